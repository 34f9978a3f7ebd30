"""`flashtriton check`: the cookbook notebook's checks (seed/triton_flashattention_notebook) as one command.

Each check returns a `Result` (PASS / FAIL / SKIP, a one-line message, its numbers). Kernel checks run on an
Ampere+ GPU, or on the CPU through Triton's interpreter (smaller shapes where the interpreter is too slow);
timing and memory checks need a GPU. Accuracy is judged against the float64 reference
(`flashtriton.reference`), next to torch's own fp16 error: two correct fp16 results may differ by one ulp.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

import flashtriton
from .._env import INTERPRET
from ..reference import sdpa_reference
from .bench_core import environment

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
NOTEBOOK_SHAPE = (1, 8, 1024, 64)  # (B, H, T, D): the notebook's correctness shape
SPEED_SHAPE = (1, 8, 2048, 64)  # the notebook's speed shape
# forward+backward: at the notebook's small shape both sides are bound by host overhead (~1.4 ms each,
# measured on the H200), so the comparison runs where the GPU work dominates
FWD_BWD_SHAPE = (4, 16, 4096, 64)
GRAD_SHAPE_CPU = (1, 2, 512, 64)  # the interpreter runs the backward check smaller
FLOOR_FP16 = 2.0**-11  # half an fp16 ulp at 1.0: the rounding every stored fp16 value carries


@dataclass
class Result:
    name: str
    status: str
    message: str
    data: dict = field(default_factory=dict)


@dataclass
class Env:
    """Where the checks run. `device` is where tensors live; a `*_skip` is None when those checks can run."""

    device: str
    kernel_skip: str | None
    gpu_skip: str | None
    info: dict


def log(text: str = "") -> None:
    tqdm.write(text, file=sys.stdout)


def detect_env() -> Env:
    info = dict(environment(), interpreter=INTERPRET, python=sys.version.split()[0])
    if torch.cuda.is_available() and not INTERPRET:
        props = torch.cuda.get_device_properties(0)
        info.update(capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
        if (props.major, props.minor) < (8, 0):
            reason = f"compute capability {props.major}.{props.minor} < 8.0: the kernels need Ampere or newer"
            return Env("cuda", reason, reason, info)
        return Env("cuda", None, None, info)
    if INTERPRET:
        return Env("cpu", None, "needs a CUDA GPU (running on the CPU through the Triton interpreter)", info)
    reason = "no CUDA GPU and TRITON_INTERPRET is off"
    return Env("cpu", reason, reason, info)


def hardware_report(env: Env) -> str:
    i = env.info
    gpu = (f"{i['gpu']} (sm_{i['capability'].replace('.', '')}, {i['sms']} SMs, {i['memory_gib']} GiB, "
           f"CUDA {i['cuda']})" if "capability" in i else "none")
    return (f"GPU: {gpu} | torch {i['torch']} | triton {i['triton']} | flashtriton {i['flashtriton']} "
            f"({i['git_sha']}) | interpreter {'on' if i['interpreter'] else 'off'}")


# ----------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------
def make_qkv(shape, device, requires_grad=False, seed=0):
    """Fresh random (B, H, T, D) fp16 q, k, v and an upstream gradient, seeded as the notebook does."""
    torch.manual_seed(seed)
    q, k, v, dout = (torch.randn(shape, device=device, dtype=torch.float16) for _ in range(4))
    if requires_grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, dout


def ours(q, k, v):
    return flashtriton.scaled_dot_product_attention(q, k, v, is_causal=True)


def naive(q, k, v):
    """The notebook's naive attention: torch SDPA's MATH backend, which materialises the T x T scores."""
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def max_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def bench_attn(fn, q, k, v, n_iter: int = 20) -> float:
    """The notebook's timing loop: iterations per second over n_iter calls after 3 warm-ups."""
    for _ in range(3):
        fn(q, k, v)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n_iter):
        fn(q, k, v)
    torch.cuda.synchronize()
    return n_iter / (time.perf_counter() - t0)


def median_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, return_mode="median"))


def fwd_bwd(fn, q, k, v, dout):
    """Forward then backward of `fn`; returns (dq, dk, dv)."""
    return torch.autograd.grad(fn(q, k, v), (q, k, v), dout)


# ----------------------------------------------------------------------------------------------------------
# the checks
# ----------------------------------------------------------------------------------------------------------
def check_attention_ai(env: Env, opts) -> Result:
    B, H, T, D = NOTEBOOK_SHAPE
    ai = flashtriton.attention_flops(B, H, T, D) / flashtriton.attention_bytes(B, H, T, D)
    log(f"attention AI at B={B} H={H} T={T} D={D} = {ai:.1f} FLOPs/byte")
    return Result("attention_ai_above_128", PASS if ai > 128 else FAIL, f"AI = {ai:.1f} FLOPs/byte", {"ai": ai})


def check_forward_matches(env: Env, opts) -> Result:
    """Max abs error vs float64 at most max(1e-3, 2x that of torch's fp16 MATH backend): the notebook's 1e-3
    sits barely above fp16's own rounding there, so the name says both bounds; the message says which held."""
    name = "triton_fa2_error_within_2x_sdpa_math_or_1e_minus_3"
    q, k, v, _ = make_qkv(NOTEBOOK_SHAPE, env.device)
    exact = sdpa_reference(q, k, v, is_causal=True)  # float64, (B, H, T, D)
    out, math_out = ours(q, k, v), naive(q, k, v)
    d = dict(shape=NOTEBOOK_SHAPE, max_err=max_err(out, exact), math_err=max_err(math_out, exact),
             err_vs_math=max_err(out, math_out), rounding_floor=max_err(exact.half(), exact))
    # The notebook's 1e-3 sits barely above fp16's own rounding of |o| in [2, 4) (half an ulp = 9.8e-4);
    # torch's MATH output itself is ~9e-4 from exact. Allow torch's own error twice (the project's rule).
    d["allowed"] = max(1e-3, 2 * d["math_err"])
    log(f"max abs error vs float64 = {d['max_err']:.3e} (correctly rounded fp16: {d['rounding_floor']:.3e}); "
        f"torch fp16 MATH vs float64 = {d['math_err']:.3e}; ours vs MATH = {d['err_vs_math']:.3e}")
    log("  (two correct fp16 results can differ by one fp16 ulp: 1.95e-3 where |o| >= 2)")
    status = PASS if d["max_err"] <= d["allowed"] else FAIL
    excess = d["max_err"] - 1e-3
    strict = "within the notebook's 1e-3" if excess <= 0 else f"{excess:.1e} above the notebook's 1e-3"
    verdict = "within" if status == PASS else "above"
    return Result(name, status, f"max abs err vs float64 {d['max_err']:.3e}, {verdict} the allowed "
                  f"{d['allowed']:.2e} = max(1e-3, 2x MATH's own {d['math_err']:.2e}); {strict}", d)


def check_grads(env: Env, opts) -> Result:
    name = "triton_fa2_grads_match_float64"
    try:
        importlib.import_module("flashtriton.kernels.backward")
    except Exception as exc:  # noqa: BLE001  (a backward that does not import is a failed check)
        return Result(name, FAIL, f"cannot import flashtriton.kernels.backward: {type(exc).__name__}: {exc}")
    shape = NOTEBOOK_SHAPE if env.device == "cuda" else GRAD_SHAPE_CPU
    q, k, v, dout = make_qkv(shape, env.device, requires_grad=True)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    exact = torch.autograd.grad(sdpa_reference(*leaves, is_causal=True), leaves, dout.double())
    got, math = fwd_bwd(ours, q, k, v, dout), fwd_bwd(naive, q, k, v, dout)
    d, failed = {"shape": shape}, []
    for g, name_g, e, m in zip(got, ("dq", "dk", "dv"), exact, math):
        bound = 2 * max_err(m, e) + FLOOR_FP16 * max(e.abs().max().item(), 1.0)
        d[name_g] = dict(max_err=max_err(g, e), math_err=max_err(m, e), allowed=bound)
        if not d[name_g]["max_err"] <= bound:  # also catches NaN
            failed.append(name_g)
    where = "" if shape == NOTEBOOK_SHAPE else f" at B,H,T,D={shape} (interpreter; the GPU runs {NOTEBOOK_SHAPE})"
    errs = ", ".join(f"{g} {d[g]['max_err']:.2e} (MATH {d[g]['math_err']:.2e})" for g in ("dq", "dk", "dv"))
    log(f"grad errors vs float64{where}: {errs}")
    verdict = f"{', '.join(failed)} above 2x MATH's error + floor" if failed else "all <= 2x MATH's error + floor"
    return Result(name, FAIL if failed else PASS, f"{errs}: {verdict}{where}", d)


def check_speed(env: Env, opts) -> Result:
    q, k, v, _ = make_qkv(SPEED_SHAPE, "cuda")
    its_ours, its_naive = bench_attn(ours, q, k, v), bench_attn(naive, q, k, v)
    ms_ours, ms_naive = median_ms(lambda: ours(q, k, v)), median_ms(lambda: naive(q, k, v))
    d = dict(shape=SPEED_SHAPE, its_ours=its_ours, its_naive=its_naive, loop_speedup=its_ours / its_naive,
             ms_ours=ms_ours, ms_naive=ms_naive, median_speedup=ms_naive / ms_ours,
             tflops_ours=flashtriton.attention_flops(*SPEED_SHAPE, causal=True) / ms_ours / 1e9)
    log(f"naive SDPA (MATH) = {its_naive:7.1f} it/s, {ms_naive:.3f} ms median | triton FA2 = {its_ours:7.1f} "
        f"it/s, {ms_ours:.3f} ms median ({d['tflops_ours']:.0f} TFLOP/s)")
    ok = min(d["loop_speedup"], d["median_speedup"]) >= 3.0
    return Result("triton_fa2_at_least_3x_naive", PASS if ok else FAIL,
                  f"{d['loop_speedup']:.1f}x (notebook loop), {d['median_speedup']:.1f}x (do_bench median); "
                  "need >= 3x in both", d)


def check_speed_fwd_bwd(env: Env, opts) -> Result:
    q, k, v, dout = make_qkv(FWD_BWD_SHAPE, "cuda", requires_grad=True)
    ms_ours = median_ms(lambda: fwd_bwd(ours, q, k, v, dout))
    ms_naive = median_ms(lambda: fwd_bwd(naive, q, k, v, dout))
    flops = flashtriton.attention_flops(*FWD_BWD_SHAPE, causal=True, mode="fwd_bwd")
    d = dict(shape=FWD_BWD_SHAPE, ms_ours=ms_ours, ms_naive=ms_naive, speedup=ms_naive / ms_ours,
             tflops_ours=flops / ms_ours / 1e9, tflops_naive=flops / ms_naive / 1e9)
    log(f"fwd+bwd: MATH {ms_naive:.3f} ms, triton FA2 {ms_ours:.3f} ms ({d['tflops_ours']:.0f} TFLOP/s)")
    return Result("triton_fa2_fwd_bwd_faster_than_naive", PASS if d["speedup"] > 1.0 else FAIL,
                  f"fwd+bwd {d['speedup']:.1f}x MATH (do_bench median)", d)


def check_memory(env: Env, opts) -> Result:
    name = "memory_linear_in_T"
    if opts.quick:
        return Result(name, SKIP, "--quick: memory sweep skipped")
    rows = memory_sweep(opts.seqlens, opts.math_limit_gib)
    log(memory_table(rows))
    if opts.out:
        log(f"wrote {memory_plot(rows, Path(opts.out) / 'memory_latency.png')}")
    return judge_memory(name, rows)


# ----------------------------------------------------------------------------------------------------------
# the O(T^2) vs O(T) memory story
# ----------------------------------------------------------------------------------------------------------
SWEEP_BHD = (1, 8, 64)  # (B, H, D) of the sweep; T varies
MODES = ("fwd", "fwd_bwd")
# MATH's extra memory in fp16 (B, H, T, T) matrices: ~5 forward on the H200 (84 MiB at T=1k, 4928 MiB at
# 8k); forward+backward keeps the probabilities and builds their gradients: about twice that.
MATH_MATRICES = {"fwd": 5, "fwd_bwd": 10}


def peak_extra_bytes(fn) -> int:
    """Peak bytes fn() allocates beyond what was allocated before it (its outputs included)."""
    fn()  # compile and autotune outside the measurement
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def memory_sweep(seqlens, math_limit_gib: float) -> list[dict]:
    """One row per (T, provider, mode): extra MiB and median ms, or a note why there is none."""
    B, H, D = SWEEP_BHD
    rows = []
    for T in tqdm(seqlens, desc="memory sweep", unit="T", file=sys.stderr, leave=False, disable=None):
        q, k, v, dout = make_qkv((B, H, T, D), "cuda")
        grad_qkv = [t.detach().requires_grad_() for t in (q, k, v)]  # same storage, builds the graph
        for provider, fn in (("flashtriton", ours), ("math", naive)):
            for mode in MODES:
                row = dict(T=T, provider=provider, mode=mode, extra_mib=None, ms=None, note="")
                estimate = MATH_MATRICES[mode] * B * H * T * T * 2
                if provider == "math" and estimate > math_limit_gib * 2**30:
                    row["note"] = f"skipped: ~{estimate / 2**30:.0f} GiB estimated > {math_limit_gib:g} GiB"
                    rows.append(row)
                    continue
                call = (lambda: fn(q, k, v)) if mode == "fwd" else (lambda: fwd_bwd(fn, *grad_qkv, dout))
                try:
                    row["extra_mib"] = peak_extra_bytes(call) / 2**20
                    row["ms"] = median_ms(call)
                except torch.cuda.OutOfMemoryError:
                    row["note"] = "out of memory"
                torch.cuda.empty_cache()
                rows.append(row)
    return rows


def memory_table(rows: list[dict]) -> str:
    cell = {(r["T"], r["provider"], r["mode"]): r for r in rows}

    def fmt(r):
        return f"{r['extra_mib']:10.1f} {r['ms']:9.3f}" if r["extra_mib"] is not None else f"{'-':>10} {'-':>9}"

    head = f"{'T':>6} {'mode':<8} {'FA2 MiB':>10} {'FA2 ms':>9} {'MATH MiB':>10} {'MATH ms':>9}"
    lines = [f"extra memory beyond the inputs and median latency, B,H,D={SWEEP_BHD} fp16 causal", head]
    for T in sorted({r["T"] for r in rows}):
        for mode in MODES:
            ft, mt = cell[(T, "flashtriton", mode)], cell[(T, "math", mode)]
            lines.append(f"{T:>6} {mode:<8} {fmt(ft)} {fmt(mt)}  {ft['note'] or mt['note']}".rstrip())
    return "\n".join(lines)


def memory_plot(rows: list[dict], path: Path) -> Path:
    """The notebook's two panels: extra memory and latency against T, log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    styles = {"flashtriton": ("tab:blue", "flash (triton)"), "math": ("tab:gray", "naive (MATH)")}
    for provider, (color, label) in styles.items():
        for mode, line in zip(MODES, ("o-", "s--")):
            pts = [r for r in rows if r["provider"] == provider and r["mode"] == mode and r["ms"] is not None]
            Ts = [r["T"] for r in pts]
            ax1.plot(Ts, [r["extra_mib"] for r in pts], line, color=color, label=f"{label} {mode}")
            ax2.plot(Ts, [r["ms"] for r in pts], line, color=color, label=f"{label} {mode}")
    for ax, ylabel, title in ((ax1, "extra memory (MiB)", "memory: O(T^2) vs O(T)"),
                              (ax2, "latency (ms, median)", "latency vs seq length")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["T"] for r in rows}), [str(T) for T in sorted({r["T"] for r in rows})])
        ax.set_yscale("log")
        ax.set_xlabel("seq len T")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def judge_memory(name: str, rows: list[dict]) -> Result:
    """Linear: flashtriton's extra memory grows at most 1.5x as fast as T (T=1024 to the largest T)."""
    ft = {(r["mode"], r["T"]): r["extra_mib"] for r in rows if r["provider"] == "flashtriton"}
    seqlens = sorted({r["T"] for r in rows})
    if len(seqlens) < 2:
        return Result(name, SKIP, "need at least two sequence lengths", {"rows": rows})
    base = 1024 if 1024 in seqlens else seqlens[0]
    top = seqlens[-1]
    bound = 1.5 * top / base
    if any(ft[(mode, T)] is None for mode in MODES for T in (base, top)):
        return Result(name, FAIL, "flashtriton ran out of memory in the sweep", {"rows": rows})
    ratios = {mode: ft[(mode, top)] / ft[(mode, base)] for mode in MODES}
    ok = all(r <= bound for r in ratios.values())
    text = ", ".join(f"{mode} x{r:.1f}" for mode, r in ratios.items())
    return Result(name, PASS if ok else FAIL, f"extra memory T={top} vs T={base}: {text} (linear: "
                  f"x{top // base}, allowed x{bound:.0f})", dict(rows=rows, ratios=ratios, bound=bound))


# (check name, function, what it needs: None, "kernels" (GPU or interpreter) or "gpu")
STEPS = [
    ("attention_ai_above_128", check_attention_ai, None),
    ("triton_fa2_error_within_2x_sdpa_math_or_1e_minus_3", check_forward_matches, "kernels"),
    ("triton_fa2_grads_match_float64", check_grads, "kernels"),
    ("triton_fa2_at_least_3x_naive", check_speed, "gpu"),
    ("triton_fa2_fwd_bwd_faster_than_naive", check_speed_fwd_bwd, "gpu"),
    ("memory_linear_in_T", check_memory, "gpu"),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", metavar="DIR", help="write check.json and memory_latency.png here")
    parser.add_argument("--quick", action="store_true", help="skip the memory/latency sweep")
    parser.add_argument("--only", metavar="NAMES", type=lambda s: s.split(","),
                        help="comma-separated check names to run (the others SKIP)")
    parser.add_argument("--seqlens", type=lambda s: [int(x) for x in s.split(",")],
                        default=[256 << i for i in range(7)], help="memory sweep T values (default 256..16384)")
    parser.add_argument("--math-limit-gib", type=float, default=8.0,
                        help="skip MATH in the sweep where its estimated extra memory exceeds this (default 8)")


def run_step(env: Env, opts, name: str, fn, needs) -> Result:
    if opts.only and name not in opts.only:
        return Result(name, SKIP, "not selected (--only)")
    reason = {None: None, "kernels": env.kernel_skip, "gpu": env.gpu_skip}[needs]
    if reason:
        return Result(name, SKIP, reason)
    try:
        return fn(env, opts)
    except Exception as exc:  # noqa: BLE001  (one broken check must not hide the others)
        return Result(name, FAIL, f"{type(exc).__name__}: {exc}")
    finally:
        if env.device == "cuda":
            torch.cuda.empty_cache()


def summary(results: list[Result]) -> str:
    width = max(len(r.name) for r in results)
    lines = [f"{'check':<{width}}  status  details", "-" * (width + 60)]
    lines += [f"{r.name:<{width}}  {r.status:<6}  {r.message}" for r in results]
    counts = {s: sum(r.status == s for r in results) for s in (PASS, FAIL, SKIP)}
    return "\n".join(lines + [", ".join(f"{n} {s}" for s, n in counts.items())])


def main(opts) -> int:
    names = [name for name, _, _ in STEPS]
    if opts.only and set(opts.only) - set(names):
        raise SystemExit(f"flashtriton check: unknown check(s) {sorted(set(opts.only) - set(names))}; "
                         f"known: {', '.join(names)}")
    env = detect_env()
    log(hardware_report(env))
    if env.kernel_skip and env.device == "cuda":
        log(f"WARNING: {env.kernel_skip}; kernel checks will be skipped.")
    if opts.out:
        Path(opts.out).mkdir(parents=True, exist_ok=True)
    results = []
    with tqdm(STEPS, desc="check", unit="check", file=sys.stderr, disable=None) as bar:  # None: terminals only
        for name, fn, needs in bar:
            bar.set_postfix_str(name)
            log(f"\n== {name}")
            results.append(run_step(env, opts, name, fn, needs))
            log(f"{results[-1].status}: {results[-1].message}")
    log("\n" + summary(results))
    if opts.out:
        report = dict(environment=env.info, checks=[asdict(r) for r in results], argv=sys.argv[1:])
        path = Path(opts.out) / "check.json"
        path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        log(f"wrote {path}")
    return 1 if any(r.status == FAIL for r in results) else 0
