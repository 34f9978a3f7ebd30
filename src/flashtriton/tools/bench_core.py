"""The pure parts of `flashtriton bench`: shape sweeps, FLOP and padding accounting, the long-format row
schema, the environment stamp, timing and the accuracy check.

Every measurement becomes one row (Liger-Kernel's long format): `op, mode, provider, shape, dtype,
ms p20/p50/p80, tflops, check, environment`. A provider that was skipped, raised, or failed its accuracy
check still gets a row, with `status` and `error` saying why, and no speed.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..kernels.variant import Variant
from ..reference import attention_flops, attention_reference
from ..validation import MAX_HEAD_DIM

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
MODES = ("fwd", "bwd", "fwd_bwd")
# Relative tolerance of the accuracy check: max |x - ref| <= RTOL * max(1, max |ref|), per tensor, against
# float32 attention on the same (low-precision) inputs. Loose enough for any correct kernel (a few ulps of
# the largest value), tight enough to catch a wrong mask, scale or tile (errors of order 1).
RTOL = {torch.float16: 2e-2, torch.bfloat16: 8e-2, torch.float32: 1e-4}

ROW_FIELDS = [
    "op", "suite", "mode", "provider", "B", "H", "H_kv", "T", "T_k", "D", "Dv", "causal", "dtype", "variant",
    "ms_p20", "ms_p50", "ms_p80", "tflops", "gbps", "status", "check_passed", "max_err", "rel_err", "error",
    "extra", "gpu", "torch", "triton", "cudnn", "flashtriton", "git_sha", "date",
]
# What identifies a measurement (rows with the same key replace each other when results are appended). `variant`
# names the score change of the variants suite (window1024, softcap50, ...; None elsewhere): two variants of one
# shape are two measurements. `Dv` is v's head dim (= D unless the shape gives v its own); rows written before it
# existed read as Dv = D (`upgrade_row`).
ROW_KEY = ("op", "suite", "mode", "provider", "B", "H", "H_kv", "T", "T_k", "D", "Dv", "causal", "dtype", "variant")


@dataclass(frozen=True)
class Shape:
    """One attention problem: (B, H, T, D), self-attention (Tq = Tk), H query and key heads; v (and the output) of
    head dim Dv (None: D), q and k of D."""

    B: int
    H: int
    T: int
    D: int
    Dv: int | None = None

    def __post_init__(self):
        if self.Dv is None:
            object.__setattr__(self, "Dv", self.D)

    @property
    def head_dims(self) -> str:
        """'128', or '192/128' where v's head dim is not q and k's (`head_dim_label`)."""
        return head_dim_label(self.D, self.Dv)


def head_dim_label(d, dv=None) -> str:
    """How tables show a head dim: D, or QK/V ('192/128') where v's differs."""
    return str(d) if dv is None or dv == d else f"{d}/{dv}"


def parse_head_dim(text: str, option: str = "--head-dims") -> tuple[int, int]:
    """'128' -> (128, 128); '192/128' -> (192, 128): q and k's head dim, then v's. Each 1..MAX_HEAD_DIM (the
    kernels' limit); a bad form raises ValueError naming `option`."""
    part = str(text).strip()
    pieces = part.split("/")
    want = _head_dims_wanted(option, part)
    if len(pieces) > 2 or not all(p.strip() for p in pieces):
        raise ValueError(want)
    try:
        dims = [int(p) for p in pieces]
    except ValueError:
        raise ValueError(want) from None
    if not all(1 <= d <= MAX_HEAD_DIM for d in dims):
        raise ValueError(want)
    return dims[0], dims[-1]


def parse_head_dims(text: str) -> list[tuple[int, int]]:
    """--head-dims: '64,128,192/128' -> [(64, 64), (128, 128), (192, 128)]."""
    out = [parse_head_dim(part) for part in str(text).split(",") if part.strip()]
    if not out:
        raise ValueError(_head_dims_wanted("--head-dims", str(text)))
    return out


def _head_dims_wanted(option: str, got: str) -> str:
    return (f"{option} wants head dims D or QK/V (e.g. 128 or 192/128), each an integer from 1 to {MAX_HEAD_DIM}, "
            f"got {got!r}")


def standard_shapes(seqlens, head_dims, tokens: int = 16384, hidden: int = 2048) -> list[Shape]:
    """The FlashAttention papers' sweep: B·T = tokens, H·D = hidden, for each D then each T. A head dim that does
    not divide the hidden size takes the heads that fit (H = hidden // D: D=80 25 heads, D=96 21, as the
    anchors' runs of those head dims). `head_dims`: ints, or (D, Dv) pairs whose v has a head dim of its own (H
    still counts q's, hidden // D)."""
    shapes = []
    for dims in head_dims:
        d, dv = (dims, dims) if isinstance(dims, int) else dims
        if d > hidden:
            raise ValueError(f"head dim {d} is larger than the hidden size {hidden}")
        for t in seqlens:
            shapes.append(Shape(B=max(1, tokens // t), H=hidden // d, T=t, D=d, Dv=dv))
    return shapes


def parse_shape(text: str) -> Shape:
    """'B,H,T,D' or 'B,H,T,D/Dv' (v's head dim its own) -> Shape."""
    parts = [p for p in text.replace("x", ",").split(",") if p.strip()]
    want = f"--shape wants B,H,T,D (four integers; D may be QK/V, e.g. 192/128), got {text!r}"
    if len(parts) != 4:
        raise ValueError(want)
    try:
        b, h, t = (int(p) for p in parts[:3])
        d, dv = parse_head_dim(parts[3], "--shape") if "/" in parts[3] else (int(parts[3]),) * 2
    except ValueError as exc:
        raise ValueError(str(exc) if str(exc).startswith("--shape wants head dims") else want) from None
    if min(b, h, t, d) < 1:
        raise ValueError(f"--shape values must be positive, got {text!r}")
    return Shape(b, h, t, d, dv)


def parse_int_list(text: str, option: str = "a list option") -> list[int]:
    """'512,1k,2K,64' -> [512, 1024, 2048, 64]."""
    out = []
    for part in str(text).split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            out.append(int(part[:-1]) * 1024 if part.endswith("k") else int(part))
        except ValueError:
            raise ValueError(f"{option} wants comma-separated integers (1k = 1024), got {text!r}") from None
    return out


def mode_flops(shape: Shape, causal: bool, mode: str) -> float:
    """FlashAttention's count with v's head dim (FlashAttention-3's benchmark): forward 2·B·H·T²·(D + Dv), QKᵀ at q
    and k's head dim and PV at v's, halved when causal; backward 2.5× the forward, forward+backward 3.5×. With
    Dv = D it is 4·B·H·T²·D (`reference.attention_flops`)."""
    if shape.Dv == shape.D:
        return attention_flops(shape.B, shape.H, shape.T, shape.D, causal, mode)
    flops = 2.0 * shape.B * shape.H * shape.T * shape.T * (shape.D + shape.Dv)
    if causal:
        flops /= 2
    return flops * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]


def tflops(flops: float, ms: float | None) -> float | None:
    return None if not ms else flops / (ms * 1e-3) / 1e12


def padding_stats(seqlens) -> dict:
    """What padding a batch of sequences to its longest one wastes.

    token_padding_frac = 1 - sum(T_i) / (N * Tmax)       (memory, projections)
    flop_padding_frac  = 1 - sum(T_i^2) / (N * Tmax^2)   (attention: work grows with T^2; the same with a
                                                          causal mask, which halves both sides)
    ideal_speedup = 1 / (1 - flop_padding_frac): what skipping the padding could save at equal efficiency.
    target_speedup = 1 / (1 - (flop_padding_frac - 0.10)): the serving issue's bar, time saved at least the
                     padding fraction minus 10 points (1.0 when the padding is under 10 %).
    """
    lens = [int(t) for t in seqlens]
    if not lens or max(lens) <= 0:
        raise ValueError("padding_stats needs at least one non-empty sequence")
    n, tmax = len(lens), max(lens)
    real_tokens, real_sq = sum(lens), sum(t * t for t in lens)
    token_frac = 1.0 - real_tokens / (n * tmax)
    flop_frac = 1.0 - real_sq / (n * tmax * tmax)
    return dict(
        n=n, max_seqlen=tmax, real_tokens=real_tokens, padded_tokens=n * tmax,
        sum_sq=real_sq, padded_sum_sq=n * tmax * tmax,
        token_padding_frac=token_frac, flop_padding_frac=flop_frac,
        ideal_speedup=1.0 / (1.0 - flop_frac),
        target_speedup=1.0 / (1.0 - max(flop_frac - 0.10, 0.0)),
    )


def varlen_flops(seqlens, heads: int, head_dim: int, causal: bool, mode: str) -> float:
    """Useful FLOPs of a varlen batch: the FlashAttention count summed over sequences."""
    return sum(attention_flops(1, heads, int(t), head_dim, causal, mode) for t in seqlens)


# ----------------------------------------------------------------------------------------------------------
# environment
# ----------------------------------------------------------------------------------------------------------
def git_sha() -> str:
    """The environment variable FLASHTRITON_GIT_SHA when set (a copy of a checkout on another machine, whose
    .git may be stale or absent), else HEAD of the checkout this file lives in, '+dirty' if it has changes;
    'unknown' without either."""
    if os.environ.get("FLASHTRITON_GIT_SHA"):
        return os.environ["FLASHTRITON_GIT_SHA"]
    root = Path(__file__).resolve().parents[3]
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except Exception:  # noqa: BLE001  (no git, not a checkout: the stamp says so)
        return os.environ.get("FLASHTRITON_GIT_SHA", "unknown")


def environment() -> dict:
    import triton

    from .._version import __version__

    cuda = torch.cuda.is_available()
    return dict(
        gpu=torch.cuda.get_device_name(0) if cuda else "cpu (triton interpreter)",
        torch=torch.__version__,
        triton=triton.__version__,
        cudnn=str(torch.backends.cudnn.version()) if cuda and torch.backends.cudnn.is_available() else "",
        flashtriton=__version__,
        git_sha=git_sha(),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    )


def make_row(env: dict, **fields) -> dict:
    """A row with every schema field (missing ones None), extra fields folded into `extra`."""
    row = {f: None for f in ROW_FIELDS}
    extra = dict(fields.pop("extra", None) or {})
    for name, value in fields.items():
        if name in row:
            row[name] = value
        else:
            extra[name] = value
    row["extra"] = extra
    if row["Dv"] is None:
        row["Dv"] = row["D"]  # v's head dim is q's unless the problem gives it its own
    row.update({k: env.get(k) for k in ("gpu", "torch", "triton", "cudnn", "flashtriton", "git_sha", "date")})
    return row


def upgrade_row(row: dict) -> dict:
    """A row read from a bench.json, in this schema's field order: a row without `Dv` reads Dv = D (its v has q's
    head dim), so that it merges with (and is replaced by) a row of the same measurement that has the field. Fields
    the schema does not know are kept, after the others."""
    out = {f: row.get(f) for f in ROW_FIELDS}
    if out["Dv"] is None:
        out["Dv"] = out["D"]
    out.update({k: v for k, v in row.items() if k not in out})
    return out


def row_key(row: dict) -> tuple:
    """The ROW_KEY values of a row (Dv = D where the row has none)."""
    return tuple(row.get(k) if k != "Dv" or row.get("Dv") is not None else row.get("D") for k in ROW_KEY)


def short_error(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return first[:limit]


# ----------------------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def switched(module, **values):
    """Module attributes (a configs module's switches) set to `values` for the block, restored after it. Plain
    setattr: inside a timed call its host cost is a microsecond (unittest.mock's patchers cost tens)."""
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def time_fn(fn, warmup: int = 25, rep: int = 100, grad_to_none=None) -> tuple[float, float, float]:
    """(p20, p50, p80) milliseconds of fn().

    On a GPU: `triton.testing.do_bench` (L2 flushed before each run, grads set to None between runs).
    On the CPU (interpreter): wall clock, a few runs; only there to exercise the code path.
    """
    if torch.cuda.is_available():
        import triton.testing

        p20, p50, p80 = triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none,
                                                quantiles=[0.2, 0.5, 0.8])
        return float(p20), float(p50), float(p80)
    times = []
    fn()
    for _ in range(max(3, min(20, rep))):
        if grad_to_none is not None:
            for t in grad_to_none:
                t.grad = None
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    qs = statistics.quantiles(times, n=10, method="inclusive")
    return qs[1], statistics.median(times), qs[7]


def time_in_rounds(calls: dict, rounds: int, rep: int = 100, warmup_ms: int = 100) -> dict:
    """{key: [median ms of each round]} of callables `calls` timed in `rounds` rounds, each round starting one
    entry later (the moment of extra speed a GPU has after a pause goes to a different one each time), each timing
    after `warmup_ms` of the call running (steady state)."""
    keys = list(calls)
    times = {key: [] for key in keys}
    for r in range(max(1, rounds)):
        start = r % len(keys) if keys else 0
        for key in keys[start:] + keys[:start]:
            time_fn(calls[key], warmup=warmup_ms, rep=1)
            times[key].append(time_fn(calls[key], warmup=5, rep=rep)[1])
    return times


def write_rows(out_dir: str | None, name: str, rows: list) -> None:
    """An A/B script's rows as out_dir/name (a JSON list; values JSON lacks as their str), the folder made; nothing
    when out_dir is None (the printed table only)."""
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(rows, f, indent=1, default=str)


def free_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------------
# accuracy
# ----------------------------------------------------------------------------------------------------------
def compare(got: dict, ref: dict, dtype: torch.dtype) -> tuple[bool, float, float]:
    """(passed, max abs error, max relative error) of tensors `got` against `ref` (same names, shapes).

    Relative error of a tensor = max |got - ref| / max(1, max |ref|); passes when <= RTOL[dtype]. NaN or a
    missing tensor fails.
    """
    max_err, rel_err = 0.0, 0.0
    for name, r in ref.items():
        g = got.get(name)
        if g is None or tuple(g.shape) != tuple(r.shape):
            return False, math.inf, math.inf
        diff = (g.float() - r.float()).abs().max().item() if r.numel() else 0.0
        if math.isnan(diff):
            return False, math.nan, math.nan
        scale = max(1.0, r.abs().max().item() if r.numel() else 0.0)
        max_err, rel_err = max(max_err, diff), max(rel_err, diff / scale)
    return rel_err <= RTOL[dtype], max_err, rel_err


def reference_slices(q, k, v, dout, causal: bool, heads: int, with_grad: bool, batch_index: int = 0,
                     variant: Variant | None = None) -> dict:
    """float32 attention (and gradients) on batch `batch_index`, the first `heads` query heads.

    q: (B, T, H, D), k: (B, T, Hkv, D), v: (B, T, Hkv, Dv) (Dv may differ from D), dout like the output
    (B, T, H, Dv), flash-attn's layout. With GQA the slice keeps the
    kv heads those query heads read. Heads are independent, so the slice is exact for outputs and
    gradients alike; computing it one head at a time keeps the T x T float32 scores at 1 GiB for T = 16k.
    Returns {"out": (1, T, heads', Dv)} and with_grad also "dq", "dk", "dv" for the same slices, where heads'
    is `heads` rounded up to whole GQA groups (so that dk, dv sum over all their query heads);
    `slice_like` cuts a provider's full tensors the same way. `variant` (for all H query heads; it replaces
    `causal`): the mask and score changes, its ALiBi slopes and sinks cut to the same heads.
    """
    group = q.shape[2] // k.shape[2]
    kv_heads = min(k.shape[2], -(-max(1, heads) // group))  # whole GQA groups, so dk and dv are exact
    heads = kv_heads * group
    outs, dqs, dks, dvs = [], [], [], []
    for kh in range(kv_heads):
        hs = slice(kh * group, (kh + 1) * group)
        qs = q[batch_index:batch_index + 1, :, hs].float().detach().requires_grad_(with_grad)
        ks = k[batch_index:batch_index + 1, :, kh:kh + 1].float().detach().requires_grad_(with_grad)
        vs = v[batch_index:batch_index + 1, :, kh:kh + 1].float().detach().requires_grad_(with_grad)
        with torch.set_grad_enabled(with_grad):
            out = attention_reference(qs, ks, vs, causal=causal, dtype=torch.float32,
                                      variant=None if variant is None else head_variant(variant, hs, batch_index))
            if with_grad:
                out.backward(dout[batch_index:batch_index + 1, :, hs].float())
        outs.append(out.detach())
        if with_grad:
            dqs.append(qs.grad)
            dks.append(ks.grad)
            dvs.append(vs.grad)
        del out
    ref = {"out": torch.cat(outs, dim=2)}
    if with_grad:
        ref.update(dq=torch.cat(dqs, dim=2), dk=torch.cat(dks, dim=2), dv=torch.cat(dvs, dim=2))
    return ref


def head_variant(variant: Variant, heads: slice, batch_index: int = 0) -> Variant:
    """`variant` for query heads `heads` of batch `batch_index` alone: its slopes ((H,) or (B, H)) and sinks (H,)
    cut to them."""
    slopes, sinks = variant.alibi_slopes, variant.sinks
    if slopes is not None:
        slopes = slopes[batch_index:batch_index + 1, heads] if slopes.dim() == 2 else slopes[heads]
    return Variant(causal=variant.causal, window=variant.window, bottom_right=variant.bottom_right,
                   softcap=variant.softcap, dropout_p=variant.dropout_p, alibi_slopes=slopes,
                   sinks=None if sinks is None else sinks[heads])


def slice_like(got: dict, ref: dict, batch_index: int = 0) -> dict:
    """Cut full (B, T, H, D) tensors to the slices `reference_slices` computed (batch, leading heads)."""
    return {name: got[name][batch_index:batch_index + 1, :, :r.shape[2]] for name, r in ref.items() if name in got}
