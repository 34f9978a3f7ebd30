"""What `flashtriton bench` prints and writes: markdown tables, bench.json / bench.csv (long format), plots; for the
variants suite its ratios, issue 25's bars judged on them, variants.md and variants_bars.json.

Merging runs made separately (on the GPU each call writes its own directory), on any machine:

    python -m flashtriton.tools.bench_report DEST SRC [SRC ...]   # DEST/bench.json|csv + plots; later SRC wins
"""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
from collections import OrderedDict
from dataclasses import dataclass

from .bench_core import MODES, ROW_FIELDS, head_dim_label, row_key, upgrade_row
from .bench_providers import PROVIDERS

OURS = "flashtriton"
CPU_NOTE = "Triton interpreter on CPU, not GPU performance"


def on_cpu(rows) -> bool:
    """Whether any row was timed without a GPU (`bench_core.environment` names the device "cpu (...)")."""
    return any(str(r.get("gpu") or "").startswith("cpu") for r in rows)


def _cpu_banner(rows) -> str:
    """The line that heads a table of CPU timings: flashtriton's through Triton's interpreter (numpy on the host),
    torch's on the CPU; neither says anything about speed on a GPU."""
    return f"NOTE: {CPU_NOTE}: these timings are of the kernels run by Triton's interpreter on the host\n" \
        if on_cpu(rows) else ""


def _cell(row, show) -> str:
    """show(row) for a measured row, else FAIL / err / - (skipped)."""
    status = row["status"]
    if status == "ok":
        return show(row)
    return {"check_failed": "FAIL", "error": "err", "skipped": "-"}.get(status, status)


def _num(x) -> str:
    """123.4, 12.3, 1.23, 0.00123: one decimal from 10 up, three significant digits below."""
    return "" if x is None else (f"{x:.1f}" if abs(x) >= 10 else f"{x:.3g}")


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a and b else ""


def _markdown(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)] if body else [len(h) for h in header]
    line = lambda cells: "| " + " | ".join(str(c).rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"] + [line(r) for r in body])


def _notes(rows) -> str:
    """Distinct errors and skip reasons under a table, one line each, with how many measurements they hit."""
    seen: OrderedDict = OrderedDict()
    for r in rows:
        if r["status"] in ("error", "skipped", "check_failed"):
            text = r["error"] if r["status"] != "check_failed" else (
                f"accuracy check failed (max err {r['max_err']:.3g}, relative {r['rel_err']:.3g})"
                if r["max_err"] is not None and r["rel_err"] is not None else "accuracy check failed")
            key = (r["provider"], r["status"], text)
            seen[key] = seen.get(key, 0) + 1
    return "\n".join(f"- {p} {status} ×{n}: {text}" for (p, status, text), n in seen.items())


def _dims(r) -> str:
    """A row's head dim as the tables show it: D, or QK/V ('192/128') where v's is its own."""
    return head_dim_label(r["D"], r.get("Dv"))


def _order(providers) -> list[str]:
    known = [p for p in PROVIDERS if p in providers]
    return known + sorted(p for p in providers if p not in known)


def standard_table(rows) -> str:
    """TFLOP/s per shape/mode/dtype/causal, a column per provider, and flashtriton's ratios."""
    rows = [r for r in rows if r["op"] == "attention"]
    if not rows:
        return "(no attention rows)"
    providers = _order({r["provider"] for r in rows})
    groups: OrderedDict = OrderedDict()

    def order(r):
        return MODES.index(r["mode"]), r["dtype"], r["D"], r.get("Dv") or r["D"], r["causal"], r["T"], r["B"], r["H"]

    for r in sorted(rows, key=order):
        groups.setdefault((r["mode"], r["dtype"], r["causal"], _dims(r), r["B"], r["H"], r["T"]), {})[r["provider"]] = r
    body = []
    for key, by_provider in groups.items():
        cells = [by_provider.get(p) for p in providers]
        speeds = {p: r["tflops"] for p, r in by_provider.items() if r["status"] == "ok" and r["tflops"]}
        ours = speeds.get(OURS)
        others = [s for p, s in speeds.items() if p != OURS]
        body.append([*key] + [_cell(r, lambda r: _num(r["tflops"])) if r else "" for r in cells]
                    + [_ratio(ours, max(others) if others else None), _ratio(ours, speeds.get("sdpa_cudnn"))])
    header = ["mode", "dtype", "causal", "D", "B", "H", "T"] + providers + ["ours/best_other", "ours/cudnn"]
    notes = _notes(rows)
    return (_cpu_banner(rows) + "TFLOP/s (FlashAttention count: fwd 4·B·H·T²·D, 2·B·H·T²·(D + Dv) where D is QK/V; "
            "/2 causal; bwd ×2.5; fwd_bwd ×3.5), median\n"
            + _markdown(header, body) + ("\n\n" + notes if notes else ""))


def varlen_table(rows) -> str:
    rows = [r for r in rows if r["op"] == "attention_varlen"]
    if not rows:
        return "(no varlen rows)"
    providers = list(OrderedDict.fromkeys(r["provider"] for r in rows))
    groups: OrderedDict = OrderedDict()
    for r in rows:
        groups.setdefault((r["mode"], r["dtype"], r["causal"]), {})[r["provider"]] = r
    stats = rows[0]["extra"]
    body = []
    for key, by_provider in groups.items():
        ours = by_provider.get(OURS)
        extra = ours["extra"] if ours else {}
        cells = [by_provider.get(p) for p in providers]
        body.append([*key] + [_cell(r, lambda r: f"{r['ms_p50']:.3f} ({_num(r['tflops'])})") if r else "" for r in cells] + [
            _fmt(extra.get("speedup_vs_flashtriton_padded")), _fmt(extra.get("speedup_vs_best_padded")),
            _fmt(stats.get("ideal_speedup")), _fmt(stats.get("target_speedup"))])
    header = ["mode", "dtype", "causal"] + providers + [
        "speedup vs flashtriton_padded", "speedup vs best padded", "ideal 1/(1-pad)", "target: saves pad − 10 %"]
    head = (f"varlen: N={stats.get('n')} sequences, max {stats.get('max_seqlen')}, "
            f"{stats.get('real_tokens')} real of {stats.get('padded_tokens')} padded tokens: padding "
            f"{stats.get('token_padding_frac', 0):.1%} of tokens, {stats.get('flop_padding_frac', 0):.1%} of "
            f"attention FLOPs (Σ Tᵢ² vs N·Tmax²)\n"
            "cells: ms median (useful TFLOP/s, counting only real tokens); padded = dense on the padded batch, no mask\n")
    notes = _notes(rows)
    return _cpu_banner(rows) + head + _markdown(header, body) + ("\n\n" + notes if notes else "")


def _fmt(x, spec=".2f") -> str:
    return "" if x is None else format(x, spec)


def decode_table(rows) -> str:
    rows = [r for r in rows if r["op"] == "decode"]
    if not rows:
        return "(no decode rows)"
    providers = _order({r["provider"] for r in rows})
    groups: OrderedDict = OrderedDict()
    for r in rows:
        key = (r["dtype"], r["B"], r["H"], r["H_kv"], head_dim_label(r["D"], r.get("Dv")), r["T_k"])
        groups.setdefault(key, {})[r["provider"]] = r
    body = []
    for key, by_provider in groups.items():
        speeds = {p: r["gbps"] for p, r in by_provider.items() if r["status"] == "ok" and r["gbps"]}
        ours = speeds.get(OURS)
        others = [s for p, s in speeds.items() if p != OURS]
        extra = by_provider.get(OURS, {}).get("extra") or {}
        body.append([*key] + [_cell(r, lambda r: _num(r["gbps"])) if r else "" for r in
                              (by_provider.get(p) for p in providers)]
                    + [_fmt(extra.get("pct_of_copy"), ".0f"), _fmt(extra.get("pct_of_read"), ".0f"),
                       _ratio(ours, max(others) if others else None)])
    header = (["dtype", "B", "Hq", "Hkv", "D", "cache"] + providers
              + ["ours % of copy", "ours % of read", "ours/best_other"])
    notes = _notes(rows)
    return (_cpu_banner(rows) + "decode: GB/s = bytes of K and V read / median time; one query token, full caches\n"
            + _markdown(header, body) + ("\n\n" + notes if notes else ""))


def ceilings_text(rows) -> str:
    parts = []
    for r in rows:
        if r["op"] == "copy" and r["status"] == "ok":
            parts.append(f"device-to-device copy {r['gbps']:.0f} GB/s (read + write)")
        elif r["op"] == "read" and r["status"] == "ok":
            parts.append(f"read {r['gbps']:.0f} GB/s ({r['provider']})")
        elif r["op"] == "matmul" and r["status"] == "ok":
            parts.append(f"{r['dtype']} matmul 8192³ {r['tflops']:.0f} TFLOP/s")
        elif r["op"] in ("copy", "read", "matmul"):
            parts.append(f"{r['op']} {r.get('dtype') or ''}: {r['error']}")
    return "ceilings: " + "; ".join(parts) if parts else ""


# ----------------------------------------------------------------------------------------------------------
# the variants suite (`bench_variants`): ratios, issue 25's bars, tables, summary files
# ----------------------------------------------------------------------------------------------------------
VARIANT_OP = "attention_variant"
VARIANT_DENSE = "causal"  # the variant label of the dense causal rows (flashtriton_dense, sdpa_cudnn)


@dataclass(frozen=True)
class Bar:
    """One of issue 25's Done-when bars: `measure` (vs_flex: ours / Flex TFLOP/s, at least `limit`; cost: the
    variant's time over its base's, minus 1, at most `limit`) on each case and mode."""

    text: str
    cases: tuple
    modes: tuple
    measure: str
    limit: float


_WINDOWS = ("window1024 T=16384 D=128", "window4096 T=16384 D=128")
_SOFTCAP = ("softcap50 T=4096 D=128", "softcap50 T=8192 D=256")
_ALIBI = ("alibi T=4096 D=128", "alibi T=8192 D=256")
_SINKS = ("sinks T=4096 D=64", "sinks+window128 T=4096 D=64", "sinks T=4096 D=128", "sinks+window128 T=4096 D=128")
BARS = (
    Bar("window, forward: ours >= 1.3x Flex", _WINDOWS, ("fwd",), "vs_flex", 1.3),
    Bar("window, backward: ours >= 1.2x Flex", _WINDOWS, ("bwd",), "vs_flex", 1.2),
    Bar("softcap costs <= 10 %", _SOFTCAP, ("fwd", "bwd"), "cost", 0.10),
    Bar("ALiBi costs <= 10 %", _ALIBI, ("fwd", "bwd"), "cost", 0.10),
    Bar("softcap at D=128: ours >= 2x Flex", _SOFTCAP[:1], ("fwd", "bwd"), "vs_flex", 2.0),
    Bar("sinks cost <= 3 %", _SINKS, ("fwd", "bwd"), "cost", 0.03),
)


def _speed(r, field):
    return r[field] if r is not None and r["status"] == "ok" and r[field] else None


def variant_ratios(rows) -> dict:
    """{(case name, mode, dtype): vs_flex, vs_dense, vs_cudnn (TFLOP/s ratios), cost (time over base's, minus 1;
    None unless both see the same area), base} for every flashtriton variant row."""
    rows = [r for r in rows if r["op"] == VARIANT_OP]
    index = {(r["extra"].get("case"), r["provider"], r["mode"], r["dtype"]): r for r in rows}
    out = {}
    for r in rows:
        if r["provider"] != "flashtriton":
            continue
        case, size, mode, dt = r["extra"].get("case"), r["extra"].get("size"), r["mode"], r["dtype"]
        base_name = r["extra"].get("base") or VARIANT_DENSE
        dense = index.get((f"{VARIANT_DENSE} {size}", "flashtriton_dense", mode, dt))
        base = dense if base_name == VARIANT_DENSE else index.get((f"{base_name} {size}", "flashtriton", mode, dt))
        ours, base_ms = _speed(r, "tflops"), _speed(base, "ms_p50")
        same_area = base is not None and base["extra"].get("visible_pairs") == r["extra"].get("visible_pairs")

        def ratio(other):
            s = _speed(other, "tflops")
            return ours / s if ours and s else None

        out[(case, mode, dt)] = dict(
            vs_flex=ratio(index.get((case, "flex", mode, dt))), vs_dense=ratio(dense),
            vs_cudnn=ratio(index.get((f"{VARIANT_DENSE} {size}", "sdpa_cudnn", mode, dt))),
            cost=_paired_cost(r, base) if same_area and _speed(r, "ms_p50") and base_ms else None,
            base=base_name)
    return out


def _paired_cost(row, base) -> float:
    """A variant's cost, time over its base's minus 1: the median over rounds of the two readings of one round
    (timed within seconds of each other, so the GPU's clock, which drifts between rounds under its power cap,
    cancels), or the medians' ratio where the rounds do not pair up."""
    mine, theirs = row["extra"].get("round_ms"), base["extra"].get("round_ms")
    if mine and theirs and len(mine) == len(theirs) and all(theirs):
        return statistics.median(a / b for a, b in zip(mine, theirs)) - 1
    return row["ms_p50"] / base["ms_p50"] - 1


def evaluate_bars(rows, bars=BARS) -> list[dict]:
    """Each bar on each of its cases and modes, per dtype measured: {bar, case, mode, dtype, measure, value, limit,
    verdict}; verdict PASS, FAIL, or n/a (the mode not measured, or a provider skipped or failed). Cases the run did
    not include (no flashtriton row in that dtype: `--variants`) are left out."""
    values = variant_ratios(rows)
    ran = {(r["extra"].get("case"), r["dtype"]) for r in rows
           if r["op"] == VARIANT_OP and r["provider"] == "flashtriton"}
    out = []
    for dt in sorted({d for _, d in ran}):
        for bar in bars:
            for case in bar.cases:
                if (case, dt) not in ran:
                    continue
                for mode in bar.modes:
                    value = (values.get((case, mode, dt)) or {}).get(bar.measure)
                    if value is None:
                        verdict = "n/a"
                    elif bar.measure == "cost":
                        verdict = "PASS" if value <= bar.limit else "FAIL"
                    else:
                        verdict = "PASS" if value >= bar.limit else "FAIL"
                    out.append(dict(bar=bar.text, case=case, mode=mode, dtype=dt, measure=bar.measure, value=value,
                                    limit=bar.limit, verdict=verdict))
    return out


def _fmt_value(measure, value) -> str:
    if value is None:
        return ""
    return f"{100 * value:+.1f} %" if measure == "cost" else f"{value:.2f}x"


def variants_table(rows) -> str:
    """TFLOP/s (visible area) of each variant and mode: flashtriton, Flex, flashtriton's dense causal call and cuDNN's
    on the same shape; ours/Flex, ours/dense, ours/cuDNN, the variant's cost; the kernels each call launched."""
    rows = [r for r in rows if r["op"] == VARIANT_OP]
    if not rows:
        return "(no variant rows)"
    values = variant_ratios(rows)
    index = {(r["extra"].get("case"), r["provider"], r["mode"], r["dtype"]): r for r in rows}
    body = []
    for r in rows:
        if r["provider"] != "flashtriton":
            continue
        case, size, mode, dt = r["extra"].get("case"), r["extra"].get("size"), r["mode"], r["dtype"]
        dense = f"{VARIANT_DENSE} {size}"
        cells = [index.get((case, "flashtriton", mode, dt)), index.get((case, "flex", mode, dt)),
                 index.get((dense, "flashtriton_dense", mode, dt)), index.get((dense, "sdpa_cudnn", mode, dt))]
        d = values.get((case, mode, dt), {})
        cost = _fmt_value("cost", d.get("cost"))
        if cost and d.get("base") != VARIANT_DENSE:
            cost += f" (vs {d.get('base')})"
        body.append([dt, r["variant"], r["B"], r["H"], r["T"], r["D"], mode]
                    + [_cell(c, lambda c: _num(c["tflops"])) if c else "" for c in cells]
                    + [_ratio(d.get("vs_flex"), 1), _ratio(d.get("vs_dense"), 1), _ratio(d.get("vs_cudnn"), 1),
                       cost])
    header = ["dtype", "variant", "B", "H", "T", "D", "mode", "flashtriton", "flex", "flashtriton_dense", "sdpa_cudnn",
              "ours/flex", "ours/dense", "ours/cudnn", "cost"]
    kernels: OrderedDict = OrderedDict()
    for r in rows:
        if r["extra"].get("kernels"):
            kernels.setdefault(", ".join(r["extra"]["kernels"]), set()).add(f"{r['provider']} {r['variant']}")
    kernel_lines = "\n".join(f"- {', '.join(sorted(who))}: {names}" for names, who in kernels.items())
    notes = _notes(rows)
    return (_cpu_banner(rows)
            + "variants: TFLOP/s over the visible area (Variant.visible_flops; bwd 2.5x, fwd_bwd 3.5x fwd), median of "
              "the rounds' do_bench medians; flashtriton_dense and sdpa_cudnn run the dense causal call of the same "
              "shape; cost = time / the same call without the variant - 1 (the median of each round's ratio)\n"
            + _markdown(header, body) + ("\n\nkernels launched by one call:\n" + kernel_lines if kernel_lines else "")
            + ("\n\n" + notes if notes else ""))


def bars_table(rows) -> str:
    """Issue 25's Done-when bars on this run: one line per bar, case and mode."""
    verdicts = evaluate_bars(rows)
    body = [[v["bar"], v["case"], v["mode"], v["dtype"], _fmt_value(v["measure"], v["value"]),
             ("<= " if v["measure"] == "cost" else ">= ") + _fmt_value(v["measure"], v["limit"]), v["verdict"]]
            for v in verdicts]
    passed = sum(v["verdict"] == "PASS" for v in verdicts)
    failed = sum(v["verdict"] == "FAIL" for v in verdicts)
    return (_cpu_banner([r for r in rows if r["op"] == VARIANT_OP])
            + f"issue 25's bars: {passed} PASS, {failed} FAIL, {len(verdicts) - passed - failed} n/a\n"
            + _markdown(["bar", "case", "mode", "dtype", "measured", "limit", "verdict"], body))


def write_variants_summary(rows, out_dir: str) -> list[str]:
    """variants.md (both tables) and variants_bars.json (the verdicts, with the run's GPU, torch, triton, git sha)."""
    rows = [r for r in rows if r["op"] == VARIANT_OP]
    if not rows:
        return []
    os.makedirs(out_dir, exist_ok=True)
    md, js = os.path.join(out_dir, "variants.md"), os.path.join(out_dir, "variants_bars.json")
    with open(md, "w") as f:
        f.write(variants_table(rows) + "\n\n" + bars_table(rows) + "\n")
    env = {k: rows[0].get(k) for k in ("gpu", "torch", "triton", "cudnn", "flashtriton", "git_sha", "date")}
    with open(js, "w") as f:
        json.dump(dict(environment=env, bars=_clean(evaluate_bars(rows))), f, indent=1)
        f.write("\n")
    return [md, js]


# ----------------------------------------------------------------------------------------------------------
# files
# ----------------------------------------------------------------------------------------------------------
def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def read_rows(out_dir: str) -> list[dict]:
    """The rows of out_dir/bench.json, in this schema (`upgrade_row`: older files read Dv = D)."""
    path = os.path.join(out_dir, "bench.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [upgrade_row(r) for r in json.load(f)]


def write_results(rows, out_dir: str, existing=()) -> tuple[list[str], list[dict]]:
    """bench.json (a list of rows) and bench.csv (the same, `extra` as a JSON string). Rows in `existing`
    (a previous bench.json, for --append) are kept unless a new row has the same key. Returns
    (paths, all rows written)."""
    os.makedirs(out_dir, exist_ok=True)
    merged: OrderedDict = OrderedDict()
    for r in [*existing, *(_clean(r) for r in rows)]:
        merged[row_key(r)] = r
    rows = list(merged.values())
    json_path, csv_path = os.path.join(out_dir, "bench.json"), os.path.join(out_dir, "bench.csv")
    for path, write in ((json_path, _write_json), (csv_path, _write_csv)):
        with open(path + ".tmp", "w", newline="") as f:  # a run killed mid-write leaves the last good file
            write(f, rows)
        os.replace(path + ".tmp", path)
    return [json_path, csv_path], rows


def _write_json(f, rows) -> None:
    json.dump(rows, f, indent=1)
    f.write("\n")


def _write_csv(f, rows) -> None:
    writer = csv.DictWriter(f, fieldnames=ROW_FIELDS, extrasaction="ignore")
    writer.writeheader()
    for r in rows:
        writer.writerow({**r, "extra": json.dumps(r.get("extra") or {}, sort_keys=True)})


class Results:
    """Every row of a run; with an output directory, bench.json and bench.csv are rewritten after each
    batch of rows, so that a run stopped by a time limit still leaves what it measured."""

    def __init__(self, out_dir: str | None = None, append: bool = False):
        self.out_dir = out_dir
        self.existing = read_rows(out_dir) if out_dir and append else []
        self.rows: list[dict] = []

    def add(self, rows) -> None:
        self.rows += rows
        if self.out_dir and rows:
            self.write()

    def write(self) -> tuple[list[str], list[dict]]:
        return write_results(self.rows, self.out_dir, self.existing)


def write_plots(rows, out_dir: str) -> list[str]:
    """standard_<mode>_<dtype>.png (TFLOP/s vs T, a panel per D and causal, a line per provider) and
    decode_<dtype>.png (GB/s vs cache length, a panel per batch, the copy bandwidth dashed). Figures of CPU
    timings are titled `CPU_NOTE`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots")
        return []
    paths = []
    ok = [r for r in rows if r["status"] == "ok"]
    attention = [r for r in ok if r["op"] == "attention" and r["tflops"]]
    for mode, dtype in sorted({(r["mode"], r["dtype"]) for r in attention}, key=lambda x: (MODES.index(x[0]), x[1])):
        sel = [r for r in attention if r["mode"] == mode and r["dtype"] == dtype]
        dims = sorted({(r["D"], r.get("Dv") or r["D"]) for r in sel})
        causals = sorted({r["causal"] for r in sel})
        fig, axes = plt.subplots(len(dims), len(causals), figsize=(5.5 * len(causals), 3.8 * len(dims)),
                                 squeeze=False)
        for i, d in enumerate(dims):
            for j, c in enumerate(causals):
                ax = axes[i][j]
                panel = [r for r in sel if (r["D"], r.get("Dv") or r["D"]) == d and r["causal"] == c]
                for p in _order({r["provider"] for r in panel}):
                    pts = sorted((r["T"], r["tflops"]) for r in panel if r["provider"] == p)
                    ax.plot([t for t, _ in pts], [y for _, y in pts], marker="o", label=p,
                            linewidth=2.5 if p == OURS else 1.2)
                ax.set_xscale("log", base=2)
                ax.set_ylim(bottom=0)
                ax.set_title(f"{mode} {dtype} D={head_dim_label(*d)} causal={c}")
                ax.set_xlabel("T (sequence length)")
                ax.set_ylabel("TFLOP/s")
                ax.grid(alpha=0.3)
                if panel:
                    ax.legend(fontsize=7)
        _finish(fig, sel)
        path = os.path.join(out_dir, f"standard_{mode}_{dtype}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    decode = [r for r in ok if r["op"] == "decode" and r["gbps"]]
    copy = [r["gbps"] for r in ok if r["op"] == "copy" and r["gbps"]]
    for dtype in sorted({r["dtype"] for r in decode}):
        sel = [r for r in decode if r["dtype"] == dtype]
        batches = sorted({r["B"] for r in sel})
        fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 3.8), squeeze=False)
        for j, b in enumerate(batches):
            ax = axes[0][j]
            panel = [r for r in sel if r["B"] == b]
            for p in _order({r["provider"] for r in panel}):
                pts = sorted((r["T_k"], r["gbps"]) for r in panel if r["provider"] == p)
                ax.plot([t for t, _ in pts], [y for _, y in pts], marker="o", label=p,
                        linewidth=2.5 if p == OURS else 1.2)
            if copy:
                ax.axhline(copy[-1], linestyle="--", color="gray", label="d2d copy")
            ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)
            ax.set_title(f"decode {dtype} B={b}")
            ax.set_xlabel("cache length")
            ax.set_ylabel("GB/s (K, V read)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        _finish(fig, sel)
        path = os.path.join(out_dir, f"decode_{dtype}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _finish(fig, rows) -> None:
    """Lay a figure out; one that plots CPU timings says so in its title (`CPU_NOTE`)."""
    if on_cpu(rows):
        fig.suptitle(CPU_NOTE, color="tab:red", fontweight="bold")
        fig.tight_layout(rect=(0, 0, 1, 0.94))
    else:
        fig.tight_layout()


def merge(dest: str, sources, plots: bool = True) -> list[str]:
    """Merge SRC/bench.json files (and DEST's own, if any) into DEST: rows with the same key are taken from the
    later source. Rewrites bench.json, bench.csv and the plots; prints the tables."""
    existing = read_rows(dest)
    rows = []
    for src in sources:
        found = read_rows(src)
        if not found:
            raise FileNotFoundError(f"no rows in {os.path.join(src, 'bench.json')}")
        rows += found
    paths, all_rows = write_results(rows, dest, existing)
    for table in (standard_table, varlen_table, decode_table):
        if any(r["op"] == {standard_table: "attention", varlen_table: "attention_varlen",
                           decode_table: "decode"}[table] for r in all_rows):
            print(table(all_rows) + "\n")
    if any(r["op"] == VARIANT_OP for r in all_rows):
        print(variants_table(all_rows) + "\n\n" + bars_table(all_rows) + "\n")
    text = ceilings_text(all_rows)
    if text:
        print(text)
    return paths + (write_plots(all_rows, dest) if plots else [])


if __name__ == "__main__":
    import sys

    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    print("wrote " + ", ".join(merge(sys.argv[1], sys.argv[2:])))
