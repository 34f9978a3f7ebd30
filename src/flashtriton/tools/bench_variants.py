"""The variants suite of `flashtriton bench` (`--suite variants`): flashtriton with a sliding window, softcap, ALiBi or
attention sinks beside FlexAttention running the same variant, flashtriton's own dense causal call on the same shape
(the cost reference) and torch SDPA's cuDNN backend on that dense call (the anchor: SDPA has no window, softcap or
sink kernel, so cuDNN runs the dense causal equivalent), in one process.

    case (causal, bf16 by default)         B  H  T      D    Flex
    window1024, window4096                 1  16 16384  128  yes
    softcap50, alibi                       4  16 4096   128  yes
    softcap50, alibi                       2  8  8192   256  yes
    sinks, window128, sinks+window128      4  16 4096   64   no (Flex has no sink logit; window128 is the reference
                                                                  that sinks+window128 is costed against)
    sinks, window128, sinks+window128      4  16 4096   128  no

Providers: `flashtriton` (`flash_attn_func` with the variant; learnable_sink fp32 (H,) with its gradient, ALiBi
slopes 2^(-8(h+1)/H)), `flex` (torch.compile'd flex_attention with `Variant.mask_mod`'s BlockMask and the
equivalent score_mod), `flashtriton_dense` and `sdpa_cudnn` (the dense causal call on the same inputs, variant
`causal`). Each is checked before anything is timed: output and gradients against float32 attention with the same
variant (batch 0, the first --check-heads heads), and flashtriton's calls must launch one of flashtriton's kernels
(`launched_kernels`: the names go in the rows). Then all providers of a shape are timed in --rounds interleaved
rounds, each starting at a different provider, do_bench after --warmup ms (steady state). TFLOP/s count the visible area
(`Variant.visible_flops`). Derived, on flashtriton's rows: ours/Flex, ours/own dense, ours/cuDNN and the cost of
the variant: its time over the same call without it, minus 1 (`base`: the dense causal call, or window128 for
sinks+window128), defined where both see the same area (softcap, ALiBi, sinks). `bench_report.BARS` are issue 25's
Done-when bars, judged on those numbers: a table of PASS / FAIL last (the exit status does not depend on them).

Without a GPU the cases shrink to sizes Triton's interpreter runs in seconds (`Case.shrunk`); their rows keep the
full-size case names, and the tables say the timings are not GPU performance.
"""

from __future__ import annotations

import argparse
import sys
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch

from .._env import INTERPRET
from ..kernels.variant import Variant
from . import bench_core as C
from . import bench_providers as P
from . import bench_report as R
from .bench_measure import check, emit, launched_kernels, report_problems, time_rounds

OP = R.VARIANT_OP
PROVIDERS = ("flashtriton", "flex", "flashtriton_dense", "sdpa_cudnn")  # table order
DENSE = R.VARIANT_DENSE  # the variant label of the dense causal rows
NO_SINKS = "FlexAttention has no sink logit (no score_mod / mask_mod adds one to the softmax's denominator)"
REFERENCE_ONLY = "the cost reference of sinks+window128: flashtriton only"


@dataclass(frozen=True)
class Case:
    """One variant on one shape (causal, self-attention). `name` ("softcap50 T=4096 D=128") and `size` stay the
    full-size ones when the case shrinks for the interpreter: the bars and the tables refer to them."""

    variant: str  # the rows' label: window1024, softcap50, alibi, sinks, sinks+window128, ...
    size: str  # "T=4096 D=128"
    B: int
    H: int
    T: int
    D: int
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    sinks: bool = False
    base: str = DENSE  # the variant this one is costed against: the same call without the field measured
    flex: str | None = None  # why FlexAttention does not run it (None: it does)

    @property
    def name(self) -> str:
        return f"{self.variant} {self.size}"

    @property
    def shape(self) -> tuple:
        return (self.B, self.H, self.T, self.D)

    def variant_of(self, slopes=None, sinks=None) -> Variant:
        return Variant(causal=True, window=tuple(self.window), softcap=self.softcap,
                       alibi_slopes=slopes if self.alibi else None, sinks=sinks if self.sinks else None)

    def shrunk(self) -> "Case":
        """The interpreter's size of this case: B=1, H=2, T 128 / 96 / 64 (16k / 8k / 4k), D / 4 (at least 16),
        the window scaled with T (at least 8 keys)."""
        T = {16384: 128, 8192: 96}.get(self.T, 64)
        left = self.window[0]
        if left >= 0:
            left = max(7, round((left + 1) * T / self.T) - 1)
        return replace(self, B=1, H=2, T=T, D=max(16, self.D // 4), window=(left, self.window[1]))


def _case(variant, B, H, T, D, **kw) -> Case:
    return Case(variant, f"T={T} D={D}", B, H, T, D, **kw)


CASES = (
    _case("window1024", 1, 16, 16384, 128, window=(1023, 0)),
    _case("window4096", 1, 16, 16384, 128, window=(4095, 0)),
    _case("softcap50", 4, 16, 4096, 128, softcap=50.0),
    _case("alibi", 4, 16, 4096, 128, alibi=True),
    _case("sinks", 4, 16, 4096, 128, sinks=True, flex=NO_SINKS),
    _case("window128", 4, 16, 4096, 128, window=(127, 0), flex=REFERENCE_ONLY),
    _case("sinks+window128", 4, 16, 4096, 128, window=(127, 0), sinks=True, base="window128", flex=NO_SINKS),
    _case("softcap50", 2, 8, 8192, 256, softcap=50.0),
    _case("alibi", 2, 8, 8192, 256, alibi=True),
    _case("sinks", 4, 16, 4096, 64, sinks=True, flex=NO_SINKS),
    _case("window128", 4, 16, 4096, 64, window=(127, 0), flex=REFERENCE_ONLY),
    _case("sinks+window128", 4, 16, 4096, 64, window=(127, 0), sinks=True, base="window128", flex=NO_SINKS),
)
VARIANTS = tuple(dict.fromkeys(c.variant for c in CASES))


# ----------------------------------------------------------------------------------------------------------
# options
# ----------------------------------------------------------------------------------------------------------
def resolve(args: argparse.Namespace, interpreter: bool = False) -> None:
    """The variants suite's options on `args`: variant_cases (selected cases, with the bases they are costed against,
    shrunk under the interpreter), variant_dtypes (default bf16), variant_modes (default fwd,bwd,fwd_bwd), rounds
    (default 2, interpreter 1)."""
    chosen = [v.strip() for v in (args.variants or ",".join(VARIANTS)).split(",") if v.strip()]
    for v in chosen:
        if v not in VARIANTS:
            raise ValueError(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    wanted = set(chosen) | {c.base for c in CASES if c.variant in chosen and c.base != DENSE}
    cases = [c for c in CASES if c.variant in wanted]
    args.variant_cases = [c.shrunk() for c in cases] if interpreter else cases
    args.variant_dtypes = []
    for d in (args.dtypes or "bf16").split(","):
        if d.strip() not in C.DTYPES:
            raise ValueError(f"unknown dtype {d!r}; choose from {', '.join(C.DTYPES)}")
        args.variant_dtypes.append(d.strip())
    args.variant_modes = [m.strip() for m in (args.modes or "fwd,bwd,fwd_bwd").split(",") if m.strip()]
    for m in args.variant_modes:
        if m not in C.MODES:
            raise ValueError(f"unknown mode {m!r}; choose from {', '.join(C.MODES)}")
    args.rounds = args.rounds if args.rounds is not None else (1 if interpreter else 2)
    if args.rounds < 1:
        raise ValueError(f"--rounds wants a positive integer, got {args.rounds}")


# ----------------------------------------------------------------------------------------------------------
# providers
# ----------------------------------------------------------------------------------------------------------
def alibi_slopes(heads: int, device) -> torch.Tensor:
    """ALiBi's geometric slopes 2^(-8(h+1)/H), fp32 (H,)."""
    return 2.0 ** (-8.0 * torch.arange(1, heads + 1, device=device, dtype=torch.float32) / heads)


def flex_score_mod(softcap: float, slopes):
    """FlexAttention's score_mod for softcap (cap · tanh(s / cap)) and ALiBi (s − slope[h] · |q − k|), applied in
    that order as the kernels and the reference do; None when neither is set."""
    if not softcap and slopes is None:
        return None

    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap:
            score = softcap * torch.tanh(score / softcap)
        if slopes is not None:
            score = score - slopes[h] * (q_idx - kv_idx).abs()
        return score

    return score_mod


def prepare(provider: str, case: Case | None, q, k, v, slopes, sinks, grad: bool) -> P.Prepared:
    """`provider` on the (B, T, H, D) inputs with `case`'s variant (None: the dense causal call). flashtriton's
    sinks are a fourth leaf (their gradient is part of its backward)."""
    if case is None:
        return P.prepare("flashtriton" if provider == "flashtriton_dense" else provider, q, k, v, True, grad)
    if provider == "flashtriton":
        import flashtriton

        ql, kl, vl = leaves = P._leaves_bshd(q, k, v, grad)
        sink = sinks.detach().requires_grad_(grad) if case.sinks else None
        if sink is not None:
            leaves = leaves + [sink]
        alibi = slopes if case.alibi else None

        def call():
            return flashtriton.flash_attn_func(ql, kl, vl, causal=True, window_size=tuple(case.window),
                                               softcap=case.softcap, alibi_slopes=alibi, learnable_sink=sink)

        return P.Prepared(call, leaves, P._bshd, P._bshd)
    if provider == "flex":
        ql, kl, vl = leaves = P._leaves_bhsd(q, k, v, grad)
        T = q.shape[1]
        flex, block_mask = P.flex_callable(T, T, True, q.device, mask_mod=case.variant_of().mask_mod(T, T))
        score_mod = flex_score_mod(case.softcap, slopes if case.alibi else None)
        return P.Prepared(lambda: flex(ql, kl, vl, score_mod=score_mod, block_mask=block_mask), leaves,
                          P._bhsd, P._bhsd)
    raise ValueError(f"provider {provider!r} does not run variants")


def _skip(provider: str, case: Case | None, device, shape, mode, args) -> str | None:
    if provider == "flex" and case.flex:
        return case.flex
    if provider in ("flex", "sdpa_cudnn"):  # every T: the suite's few shapes are its own (no --flex-seqlens)
        return P.skip_reason(provider, device, *shape, mode, argparse.Namespace(math_max_gib=args.math_max_gib))
    return None


def _kernel_problem(provider: str, names, modes) -> str | None:
    """Why flashtriton's call did not show it ran a flashtriton kernel (None: it did, or the profiler cannot tell)."""
    if names is None or not provider.startswith("flashtriton"):
        return None
    missing = [op for op in ("fwd", "bwd") if (op == "fwd" or any(m != "fwd" for m in modes))
               and not P.flashtriton_kernels(op) & set(names)]
    if missing:
        return f"no flashtriton {'/'.join(missing)} kernel launched (saw: {', '.join(names[:6]) or 'none'})"
    return None


# ----------------------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------------------
def groups(cases) -> OrderedDict:
    """Cases by shape, in CASES' order: each shape's providers are timed together, beside one dense call."""
    out: OrderedDict = OrderedDict()
    for c in cases:
        out.setdefault(c.shape, []).append(c)
    return out


def run_variants(args, env, sink=None) -> list[dict]:
    from tqdm import tqdm

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    chosen = P.parse_providers(args.providers)
    providers = [p for p in PROVIDERS if (p if p != "flashtriton_dense" else "flashtriton") in chosen]
    by_shape = groups(args.variant_cases)
    per_shape = {s: sum(1 for p in providers if p in ("flashtriton", "flex")) * len(cs)
                 + sum(1 for p in providers if p in ("flashtriton_dense", "sdpa_cudnn")) for s, cs in by_shape.items()}
    rows = []
    with tqdm(total=len(args.variant_dtypes) * sum(per_shape.values()), desc="variants",
              mininterval=1 if sys.stderr.isatty() else 30) as bar:
        for dt in args.variant_dtypes:
            for shape, cases in by_shape.items():
                new = _run_shape(args, env, dt, shape, cases, providers, device, bar)
                report_problems(new, bar)
                rows += emit(sink, new)
                C.free_memory()
    return rows


def _run_shape(args, env, dt, shape, cases, providers, device, bar=None) -> list[dict]:
    """Check every provider of one shape, then time them together in interleaved rounds; the rows, derived
    ratios in flashtriton's."""
    B, H, T, D = shape
    dtype, modes, size = C.DTYPES[dt], args.variant_modes, cases[0].size
    gen = torch.Generator(device=device).manual_seed(args.seed)
    q, k, v, dout = (torch.randn(B, T, H, D, device=device, dtype=dtype, generator=gen) for _ in range(4))
    slopes = alibi_slopes(H, device)
    sinks = torch.randn(H, device=device, dtype=torch.float32, generator=gen)
    need_grad = any(m != "fwd" for m in modes)
    entries = [(p, None) for p in providers if p in ("flashtriton_dense", "sdpa_cudnn")]
    entries += [(p, c) for c in cases for p in providers if p in ("flashtriton", "flex")]
    refs: dict = {}
    rows, timed, pending = [], {}, []
    for i, (provider, case) in enumerate(entries):
        variant = case.variant_of(slopes, sinks) if case else Variant(causal=True)
        label = case.variant if case else DENSE
        if bar is not None:
            bar.set_postfix_str(f"{dt} {label} {size} {provider}", refresh=False)
        extra = dict(case=case.name if case else f"{DENSE} {size}", size=size, base=case.base if case else None,
                     window=list(variant.window), softcap=variant.softcap, alibi=variant.has_alibi,
                     sinks=variant.has_sinks, visible_pairs=variant.visible_pairs(T, T), rounds=args.rounds)
        base = dict(op=OP, suite="variants", B=B, H=H, H_kv=H, T=T, T_k=T, D=D, causal=1, dtype=dt, variant=label)
        flops = {m: variant.visible_flops(B, H, T, T, D, m) for m in modes}
        reason = _skip(provider, case, device, shape, modes[0], args)
        if reason:
            rows += [C.make_row(env, **base, mode=m, provider=provider, status="skipped", error=reason,
                                extra=dict(extra)) for m in modes]
            if bar is not None:
                bar.update(1)
            continue
        if label not in refs:
            try:
                refs[label] = C.reference_slices(q, k, v, dout, True, args.check_heads, need_grad, variant=variant)
            except Exception as exc:  # noqa: BLE001  (timed without a check; the rows say so)
                refs[label] = None
                extra["reference_error"] = C.short_error(exc)
                C.free_memory()
        ref = refs[label]
        try:
            prepared = prepare(provider, case, q, k, v, slopes, sinks, need_grad)
        except Exception as exc:  # noqa: BLE001
            C.free_memory()
            rows += [C.make_row(env, **base, mode=m, provider=provider, status="error", error=C.short_error(exc),
                                extra=dict(extra)) for m in modes]
            if bar is not None:
                bar.update(1)
            continue

        def make_dout(out, prepared=prepared):
            return torch.empty_like(out).copy_(prepared.from_bshd(dout))

        def to_ref(got, prepared=prepared, ref=ref):
            return C.slice_like({n: prepared.to_bshd(t) for n, t in got.items()}, ref)

        with prepared.context():
            results, check_extra = check(prepared, modes, ref, to_ref, make_dout, dtype, args)
            ok = [m for m in modes if results[m]["status"] == "ok"]
            if ok:
                _record_kernels(provider, prepared, ok, make_dout, results, check_extra)
        extra.update(check_extra)
        ok = [m for m in modes if results[m]["status"] == "ok"]
        if ok:
            timed[i] = (prepared, ok, make_dout)
        pending.append((i, provider, base, extra, results, flops))
        if bar is not None:
            bar.update(1)
    readings = time_rounds(timed, args, args.rounds)
    for i, provider, base, extra, results, flops in pending:
        for m in modes:
            fields = dict(results[m])
            got = readings.get((i, m))
            row_extra = dict(extra)
            if got:
                row_extra.update(got.pop("extra", {}))
                fields.update(got)
            fields["tflops"] = C.tflops(flops[m], fields.get("ms_p50")) if fields["status"] == "ok" else None
            rows.append(C.make_row(env, **base, mode=m, provider=provider, **fields, extra=row_extra))
    del timed, q, k, v, dout, refs
    for key, values in R.variant_ratios(rows).items():
        for r in rows:
            if r["provider"] == "flashtriton" and (r["extra"].get("case"), r["mode"], r["dtype"]) == key:
                r["extra"].update({n: x for n, x in values.items() if x is not None})
    return rows


def _record_kernels(provider, prepared, modes, make_dout, results, extra) -> None:
    """Put the kernels one call launches (forward, and backward when a mode needs it) in `extra["kernels"]`; a
    flashtriton call that launched none of flashtriton's kernels turns its modes into errors."""
    grad = any(m != "fwd" for m in modes)

    def one_call():
        if grad:
            out = prepared.forward()
            out.backward(make_dout(out))
        else:
            with torch.no_grad():
                prepared.forward()

    try:
        names = launched_kernels(one_call)
    except Exception as exc:  # noqa: BLE001  (the profiler failing says nothing about the kernels)
        extra["kernel_check"] = f"unavailable: {C.short_error(exc)}"
        return
    finally:
        for t in prepared.leaves:
            t.grad = None
        C.free_memory()
    if names is None:
        extra["kernel_check"] = "unavailable: the profiler saw no device kernel"
        return
    extra["kernels"] = names
    problem = _kernel_problem(provider, names, modes)
    if problem:
        for m in modes:
            results[m].update(status="error", error=problem)


def interpreter_note() -> str:
    return ("flashtriton bench: no GPU (Triton's interpreter): the variants run at tiny shapes (B=1, H=2, T 64-128, "
            "D/4, windows scaled with T), named by their full-size cases") if INTERPRET else ""
