"""Sweep kernel variants on the GPU to choose heuristic configs (the experiments behind docs/performance.md).

    python benchmarks/explore.py fwd|bwd|decode|host|tma|varlen|gluon --out DIR [--jobs N]

Each sweep compiles its variants first in N parallel processes (Triton's on-disk cache then serves the timing
process), and times them one at a time in one process with `triton.testing.do_bench` (median, L2 flushed).
Every variant's output is compared with the default config's before it is timed. Writes DIR/<sweep>.json:
one row per (shape, variant) with ms and TFLOP/s (or GB/s for decode).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from flashtriton import configs  # noqa: E402
from flashtriton.kernels import dispatch  # noqa: E402
from flashtriton.kernels import backward as B  # noqa: E402
from flashtriton.kernels import decode_launch as Dk  # noqa: E402
from flashtriton.kernels import forward as F  # noqa: E402
from flashtriton.reference import attention_flops  # noqa: E402

DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}

# ---------------------------------------------------------------------------------------------------------
# variant spaces
# ---------------------------------------------------------------------------------------------------------
FWD_CONFIGS = [(64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (128, 64, 8, 3), (128, 64, 8, 2),
               (128, 128, 8, 2), (128, 128, 8, 3), (64, 128, 4, 3), (64, 32, 4, 3), (128, 64, 4, 3)]
FWD_SEQLENS = [512, 1024, 2048, 4096, 8192, 16384]

BWD_DKDV = {64: [(32, 128, 8, 2), (32, 128, 4, 3), (32, 128, 4, 4), (64, 128, 8, 2), (64, 128, 8, 3),
                 (32, 64, 4, 3), (64, 64, 4, 3), (16, 128, 4, 3), (32, 128, 8, 3), (64, 128, 4, 2)],
            128: [(32, 128, 8, 2), (32, 128, 8, 3), (64, 128, 8, 2), (32, 128, 4, 2), (64, 64, 4, 2),
                  (16, 128, 8, 3), (32, 64, 4, 3), (16, 128, 4, 3), (64, 128, 8, 1), (32, 64, 4, 2)]}
BWD_DQ = {64: [(128, 32, 8, 2), (128, 32, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3),
               (128, 32, 8, 3), (64, 32, 4, 3), (128, 16, 4, 3), (64, 64, 4, 2), (128, 64, 4, 2)],
         128: [(128, 32, 8, 2), (128, 32, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3), (64, 32, 4, 3),
               (128, 16, 4, 3), (64, 64, 8, 2), (128, 32, 4, 2), (64, 64, 4, 2), (32, 64, 4, 3)]}
BWD_SEQLENS = [512, 2048, 8192]

DECODE_CONFIGS = [(128, 8, 3), (128, 4, 2), (64, 4, 3), (64, 4, 4), (32, 4, 4)]
DECODE_POINTS = [(B, S) for B in (1, 8, 64) for S in (1024, 4096, 32768, 131072)]
DECODE_SPLITS = [0, 1, 2, 4, 8, 16, 32, 64]


# The TMA forward's tiles on the varlen suite's batch (D=128), forced through configs.varlen_fwd_tma_config; the last
# four are the tutorial's Hopper space.
VARLEN_TMA = [(64, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3), (128, 128, 8, 2),
              (128, 64, 4, 3), (128, 64, 4, 4), (128, 128, 8, 4), (64, 64, 4, 4)]

_GV = dict(BLOCK_N=128, NUM_BUFFERS=2, CONSUMER_REGS=240, N_CONSUMERS=2, DYNAMIC=False, OVERLAP=False)
GLUON_VARLEN = {"q2_static": dict(_GV, Q_BUFFERS=2, CAUSAL_PAIRS=False),
                "q2_dynamic": dict(_GV, Q_BUFFERS=2, CAUSAL_PAIRS=False, DYNAMIC=True),
                "q1_dynamic": dict(_GV, Q_BUFFERS=1, CAUSAL_PAIRS=False, DYNAMIC=True)}
VARLEN_FWD = [(64, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 3)]
VARLEN_BWD_DKDV = [(32, 64, 4, 3), (64, 64, 4, 3), (32, 128, 8, 3), (64, 128, 8, 3)]
VARLEN_BWD_DQ = [(64, 32, 4, 3), (128, 32, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3)]

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMOKE = bool(os.environ.get("EXPLORE_SMOKE"))
if SMOKE:  # logic check on a CPU (TRITON_INTERPRET=1): tiny lists
    FWD_CONFIGS, FWD_SEQLENS, BWD_SEQLENS = FWD_CONFIGS[:2], [64], [64]
    BWD_DKDV = {d: v[:1] for d, v in BWD_DKDV.items()}
    BWD_DQ = {d: v[:1] for d, v in BWD_DQ.items()}
    DECODE_CONFIGS, DECODE_POINTS, DECODE_SPLITS = DECODE_CONFIGS[:1], [(2, 64)], [0, 2]
    VARLEN_FWD, VARLEN_BWD_DKDV, VARLEN_BWD_DQ = VARLEN_FWD[:1], VARLEN_BWD_DKDV[:1], VARLEN_BWD_DQ[:1]
    VARLEN_TMA = VARLEN_TMA[:1]


def cfg(t):
    return {"BLOCK_M": t[0], "BLOCK_N": t[1], "num_warps": t[2], "num_stages": t[3]}


def dcfg(t):
    return {"BLOCK_N": t[0], "num_warps": t[1], "num_stages": t[2]}


@contextlib.contextmanager
def kernel_families(kind, varlen_tma_tile=None):
    """Launches inside take the kernel families FLASHTRITON_KERNEL=`kind` ("auto", "tma", "portable") allows
    (`dispatch.force`, which the launchers read on every call). `varlen_tma_tile` (a VARLEN_TMA entry), when
    given, is the TMA forward's tile on packed batches: what configs.varlen_fwd_tma_config, asked on every packed
    call, answers inside."""
    saved = configs.varlen_fwd_tma_config
    if varlen_tma_tile is not None:
        configs.varlen_fwd_tma_config = lambda *a, c=cfg(varlen_tma_tile): c
    try:
        with dispatch.force(kind):
            yield
    finally:
        configs.varlen_fwd_tma_config = saved


def tma_forward(q, k, v, causal, tile=None, cu=None, mx=None):
    """(out, lse) of the Hopper TMA forward through the public launcher, the Gluon kernels off. Dense: at the
    dispatch's tile (configs.default_fwd_tma_config); the public launcher takes no forced tile there. Packed (cu, mx
    given): at `tile` where given, else the dispatch's (configs.varlen_fwd_tma_config)."""
    if tile is not None and cu is None:
        raise ValueError("the public launcher takes a forced TMA tile on packed batches only")
    with kernel_families("tma", tile):
        if cu is None:
            return F.attention_forward(q, k, v, q.shape[-1] ** -0.5, causal)
        return F.attention_forward(q, k, v, q.shape[-1] ** -0.5, causal, True, cu, cu, mx, mx)


def hopper() -> bool:
    """Whether the TMA kernels can run here (without them `tma_forward` runs the portable kernel)."""
    return DEV == "cuda" and torch.cuda.get_device_capability()[0] == 9


# ---------------------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------------------
def fwd_inputs(T, D, dtype, layout="bshd", seed=0):
    B, H = max(1, 16384 // T), 2048 // D
    if DEV == "cpu":
        B, H = 1, 2
    g = torch.Generator(device=DEV).manual_seed(seed)
    if layout == "bshd":
        return [torch.randn(B, T, H, D, device=DEV, dtype=dtype, generator=g) for _ in range(3)]
    return [torch.randn(B, H, T, D, device=DEV, dtype=dtype, generator=g).transpose(1, 2) for _ in range(3)]


def bwd_inputs(T, D, causal):
    """A standard-sweep point's backward inputs (fp16): q, k, v, the forward's out and lse, a random upstream
    gradient, and the backward's FLOP count."""
    q, k, v = fwd_inputs(T, D, torch.float16)
    out, lse = F.attention_forward(q, k, v, D ** -0.5, causal)
    flops = attention_flops(max(1, 16384 // T), 2048 // D, T, D, causal, "bwd")
    return q, k, v, out, lse, torch.randn_like(out), flops


def bench(fn, warmup=5, rep=30):
    import triton.testing

    if DEV == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def bench_graph(fn, rep=20, warmup=5):
    """GPU time of fn alone: captured in a CUDA graph, the replay's host time hides behind the L2 flush. warmup (ms):
    100 for steady-state numbers like the sweep's (`flashtriton bench --warmup 100`)."""
    if DEV == "cpu":
        return bench(fn)
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        fn()
    ms = bench(graph.replay, warmup=warmup, rep=rep)
    del graph
    return ms


def time_rounds(fns: dict, flops: float, warmup: float = 5) -> dict:
    """TFLOP/s of each fn (name -> callable) by `bench_graph`, in as many rounds as there are fns, each round starting
    one later, so that each is timed first once: a GPU that has paused runs up to 10 % faster for a moment, which
    would go to whichever is timed first (benchmarks/2026-11-29-h200/explore16/ab/ab_flat2.txt). warmup: ms before each
    timing (`bench_graph`). Returns name -> [one reading per round]."""
    names, res = list(fns), {n: [] for n in fns}
    for r in range(len(names)):
        for n in names[r:] + names[:r]:
            res[n].append(flops / bench_graph(fns[n], warmup=warmup) / 1e9)
    return res


# ---------------------------------------------------------------------------------------------------------
# parallel precompile: run each variant once on a small problem with the same specialisations
# ---------------------------------------------------------------------------------------------------------
def _compile_job(job):
    kind, args = job
    if DEV == "cuda":
        torch.cuda.set_device(0)
    try:
        if kind == "fwd":
            D, dtype, causal, c = args
            q, k, v = fwd_inputs(256, D, DTYPE[dtype])
            F.launch_forward(q, k, v, D ** -0.5, causal, config=cfg(c))
        elif kind == "bwd":
            D, dtype, causal, which, c = args
            q, k, v = fwd_inputs(256, D, DTYPE[dtype])
            out, lse = F.attention_forward(q, k, v, D ** -0.5, causal)
            both = configs.default_bwd_configs(D, 2, q.device)
            both[which] = cfg(c)
            B.attention_backward(torch.randn_like(out), q, k, v, out, lse, D ** -0.5, causal, config=both)
        elif kind == "varlen":
            which, causal, c = args
            q, k, v, cu, mx = _varlen_inputs(small=True)
            _varlen_run(which, q, k, v, cu, mx, causal, c)
        elif kind == "varlen_tma":
            causal, c = args
            q, k, v, cu, mx = _varlen_inputs(small=True)
            tma_forward(q, k, v, causal, c, cu, mx)
        elif kind == "decode":
            c, splits = args
            _decode_run(1, 4096, splits, dcfg(c))
        if DEV == "cuda":
            torch.cuda.synchronize()
        return None
    except Exception as exc:  # noqa: BLE001
        return f"{kind} {args}: {type(exc).__name__}: {str(exc)[:200]}"


def precompile(jobs, n):
    t0 = time.time()
    ctx = mp.get_context("spawn")
    with ctx.Pool(n) as pool:
        errors = [e for e in pool.map(_compile_job, jobs, chunksize=1) if e]
    print(f"precompiled {len(jobs)} variants in {time.time() - t0:.0f} s; {len(errors)} errors", flush=True)
    for e in errors[:10]:
        print("  ", e, flush=True)


# ---------------------------------------------------------------------------------------------------------
# sweeps
# ---------------------------------------------------------------------------------------------------------
def sweep_fwd(opts):
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("seed", Path(__file__).with_name("seed_kernel.py"))
    seed = module_from_spec(spec)
    spec.loader.exec_module(seed)
    jobs = [("fwd", (128, dt, c, x)) for dt, c in (("fp16", False), ("fp16", True), ("bf16", True), ("bf16", False))
            for x in FWD_CONFIGS]
    jobs += [("fwd", (64, "fp16", c, x)) for c in (False, True) for x in FWD_CONFIGS[:5]]
    precompile(jobs, opts.jobs)
    rows = []
    plan = [(128, "fp16", c, T) for c in (False, True) for T in FWD_SEQLENS]
    plan += [(128, "bf16", c, 512) for c in (False, True)] + [(64, "fp16", c, T) for c in (False, True) for T in (512, 1024)]
    for D, dt, causal, T in plan:
        cands = FWD_CONFIGS if D == 128 else FWD_CONFIGS[:5]
        flops = attention_flops(max(1, 16384 // T), 2048 // D, T, D, causal, "fwd")
        for layout in ("bshd", "bhsd"):
            q, k, v = fwd_inputs(T, D, DTYPE[dt], layout)
            ref, _ = F.attention_forward(q, k, v, D ** -0.5, causal, config=cfg((64, 64, 4, 3)))
            for c in cands:
                try:
                    o, _ = F.attention_forward(q, k, v, D ** -0.5, causal, config=cfg(c))
                    err = (o.float() - ref.float()).abs().max().item()
                    ms = bench(lambda: F.attention_forward(q, k, v, D ** -0.5, causal, config=cfg(c)))
                    rows.append(dict(D=D, dtype=dt, causal=causal, T=T, layout=layout, variant=str(c), ms=ms,
                                     tflops=flops / ms / 1e9, err=err))
                except Exception as exc:  # noqa: BLE001
                    rows.append(dict(D=D, dtype=dt, causal=causal, T=T, layout=layout, variant=str(c), error=str(exc)[:200]))
            qb, kb, vb = (t.transpose(1, 2) for t in (q, k, v))
            if layout == "bhsd":
                ms = bench(lambda: seed.seed_attention(qb, kb, vb, causal))
                rows.append(dict(D=D, dtype=dt, causal=causal, T=T, layout="bhsd", variant="seed", ms=ms,
                                 tflops=flops / ms / 1e9))
                import flashtriton

                ms = bench(lambda: flashtriton.scaled_dot_product_attention(qb, kb, vb, is_causal=causal))
                rows.append(dict(D=D, dtype=dt, causal=causal, T=T, layout="bhsd", variant="api_sdpa", ms=ms,
                                 tflops=flops / ms / 1e9))
            else:
                import flashtriton

                ms = bench(lambda: flashtriton.flash_attn_func(q, k, v, causal=causal))
                rows.append(dict(D=D, dtype=dt, causal=causal, T=T, layout="bshd", variant="api_default", ms=ms,
                                 tflops=flops / ms / 1e9))
            here = [r for r in rows if r.get("T") == T and r.get("D") == D and r.get("causal") == causal
                    and r.get("dtype") == dt and r.get("layout") == layout and "tflops" in r]
            print(f"fwd D={D} {dt} causal={int(causal)} T={T} {layout}:"
                  + "".join(f" | {r['variant']} {r['tflops']:.0f}" for r in here), flush=True)
            del q, k, v
    return rows


def sweep_bwd(opts):
    jobs = [("bwd", (D, "fp16", c, which, x)) for D in (64, 128) for c in (False, True)
            for which, table in (("dkdv", BWD_DKDV), ("dq", BWD_DQ)) for x in table[D]]
    precompile(jobs, opts.jobs)
    rows = []
    for D in (64, 128):
        for causal in (False, True):
            for T in BWD_SEQLENS:
                q, k, v, out, lse, do, flops = bwd_inputs(T, D, causal)
                base = configs.default_bwd_configs(D, 2, q.device)
                ref = B.attention_backward(do, q, k, v, out, lse, D ** -0.5, causal, config=base)
                for which, table in (("dkdv", BWD_DKDV), ("dq", BWD_DQ)):
                    for c in table[D]:
                        both = dict(base)
                        both[which] = cfg(c)
                        try:
                            got = B.attention_backward(do, q, k, v, out, lse, D ** -0.5, causal, config=both)
                            err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, ref))
                            ms = bench(lambda: B.attention_backward(do, q, k, v, out, lse, D ** -0.5, causal, config=both))
                            rows.append(dict(D=D, causal=causal, T=T, kernel=which, variant=str(c), ms=ms,
                                             tflops=flops / ms / 1e9, err=err))
                        except Exception as exc:  # noqa: BLE001
                            rows.append(dict(D=D, causal=causal, T=T, kernel=which, variant=str(c), error=str(exc)[:200]))
                    sel = [r for r in rows[-len(table[D]):] if "tflops" in r]
                    print(f"bwd D={D} causal={int(causal)} T={T} {which}:"
                          + "".join(f" | {r['variant']} {r['tflops']:.0f}" for r in sel), flush=True)
                # the time of each kernel alone, for the default config (torch profiler-free: events)
                del q, k, v, out, lse, do
    return rows


_DKDV2, _DKDV3 = dict(NUM_STAGES=2, CONSUMER_REGS=240), dict(NUM_STAGES=3, CONSUMER_REGS=240)
GLUON_BWD = {"dkdv_only": {"dkdv": _DKDV2, "dq": None},
             "dq64": {"dkdv": _DKDV2, "dq": dict(BLOCK_N=64, NUM_STAGES=2, CONSUMER_REGS=240)},
             "dq64_s3": {"dkdv": _DKDV3, "dq": dict(BLOCK_N=64, NUM_STAGES=3, CONSUMER_REGS=240)},
             "dq128": {"dkdv": _DKDV2, "dq": dict(BLOCK_N=128, NUM_STAGES=2, CONSUMER_REGS=240)}}
GLUON_BWD_SEQLENS = [512, 1024, 2048, 4096, 8192, 16384]


def sweep_gluon_bwd(opts):
    """The whole backward (preprocess, dK/dV, dQ) with the Gluon dK/dV kernel under each GLUON_BWD config, with
    the Triton one (the default configs), and cuDNN's backward (torch autograd through SDPA), fp16, the standard
    sweep's shapes. Gluon variants are checked against the Triton kernel's gradients (max abs difference); all
    timed eagerly with do_bench (a backward runs >= 0.1 ms, its host time hides)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for D in opts.head_dims:
        for causal in (False, True):
            for T in GLUON_BWD_SEQLENS:
                q, k, v, out, lse, do, flops = bwd_inputs(T, D, causal)
                base = dict(D=D, causal=causal, T=T)

                def run(gluon_cfg):
                    dispatch.CHOICE = dispatch.Choice(gluon_bwd=gluon_cfg is not None)
                    if gluon_cfg is not None:
                        configs.gluon_bwd_config = lambda *a, c=gluon_cfg, **kw: c
                    return B.attention_backward(do, q, k, v, out, lse, D ** -0.5, causal)

                real_config = configs.gluon_bwd_config
                ref = run(None)
                for name, c in [("triton", None)] + list(GLUON_BWD.items()):
                    try:
                        got = run(c)
                        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, ref))
                        ms = bench(lambda: run(c))
                        rows.append(dict(base, variant=name, ms=ms, tflops=flops / ms / 1e9, err=err))
                    except Exception as exc:  # noqa: BLE001
                        rows.append(dict(base, variant=name, error=str(exc)[:300]))
                    finally:
                        configs.gluon_bwd_config = real_config
                        dispatch.CHOICE = dispatch.Choice(gluon_bwd=True)
                try:
                    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                        dot = do.transpose(1, 2)
                        ms = bench(lambda: torch.autograd.grad(o, (qt, kt, vt), dot, retain_graph=True))
                    rows.append(dict(base, variant="cudnn", ms=ms, tflops=flops / ms / 1e9))
                except Exception as exc:  # noqa: BLE001
                    rows.append(dict(base, variant="cudnn", error=str(exc)[:300]))
                sel = rows[-len(GLUON_BWD) - 2:]
                print(f"gluon_bwd D={D} causal={int(causal)} T={T}:" + "".join(
                    f" | {r['variant']} {r['tflops']:.0f}" + (f" (err {r['err']:.1e})" if "err" in r else "")
                    if "tflops" in r else f" | {r['variant']} ERROR {r['error'][:120]}" for r in sel), flush=True)
                del q, k, v, out, lse, do
    return rows


VARLEN_BWD_GLUON = {
    "gluon_d3_q64s3": {"dkdv": dict(NUM_STAGES=3, CONSUMER_REGS=240), "dq": dict(BLOCK_N=64, NUM_STAGES=3, CONSUMER_REGS=240)},
    "gluon_d2_q64s2": {"dkdv": dict(NUM_STAGES=2, CONSUMER_REGS=240), "dq": dict(BLOCK_N=64, NUM_STAGES=2, CONSUMER_REGS=240)},
    "gluon_d3_q128s2": {"dkdv": dict(NUM_STAGES=3, CONSUMER_REGS=240), "dq": dict(BLOCK_N=128, NUM_STAGES=2, CONSUMER_REGS=240)},
}


# Where a varlen Gluon backward's programs come from (configs.VARLEN_BWD_ORDER): the grid over the longest
# sequence's blocks (empty programs included), or the work table, sequences as given or largest first; and, to tell
# the table's code from its lack of empty programs, a table that lists the grid's programs, empty ones included.
VARLEN_BWD_ORDERS = ["grid", "as_given", "largest_first", "grid_table"]


_GRID_TABLES: dict = {}


def _grid_work_table(cu_q, cu_k, heads, kernel, causal, longest_first, total):
    """A `backward_gluon_launch.work_table` with a row for every program of the grid (blocks of the longest sequence ×
    heads × sequences, blocks fastest), empty ones included (their kernels return on start >= the sequence's
    length), in the grid's order (dQ causal: the last blocks first). Built at the first (eager) call, reused in
    CUDA graph captures (it reads the longest length on the host)."""
    key = (id(cu_q), id(cu_k), heads, kernel, causal)
    if key not in _GRID_TABLES:
        _GRID_TABLES[key] = _build_grid_work_table(cu_q, cu_k, heads, kernel, causal)
    return _GRID_TABLES[key]


def _build_grid_work_table(cu_q, cu_k, heads, kernel, causal):
    cu_q, cu_k = cu_q.long(), cu_k.long()
    len_q, len_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    n_blocks = triton.cdiv(int((len_k if kernel == "dkdv" else len_q).max()), 128)
    pid = torch.arange(len(len_q) * heads * n_blocks, device=cu_q.device)
    block, head, b = pid % n_blocks, (pid // n_blocks) % heads, pid // (n_blocks * heads)
    if kernel == "dq" and causal:
        block = n_blocks - 1 - block
    return torch.stack([b, head, block * 128, cu_q[:-1][b], len_q[b], cu_k[:-1][b], len_k[b], torch.zeros_like(b)],
                       1).to(torch.int32).contiguous()


def sweep_varlen_bwd(opts):
    """The whole varlen backward on the varlen suite's batch (64 sequences, 1..4096, H=16, D=128, fp16): the Triton
    kernels against the Gluon ones under each VARLEN_BWD_GLUON config (lse / delta in the aligned padded layout).
    Each variant's gradients against the Triton kernels' (max abs difference), then eager (do_bench) and CUDA-graph
    (GPU time) medians; the dense backward on the batch padded to its longest sequence for the ratio of the issue."""
    from flashtriton.tools.bench_core import varlen_flops
    from flashtriton.kernels import backward_gluon_launch as BG

    q, k, v, cu, mx = _varlen_inputs(small=SMOKE)
    lens = (cu[1:] - cu[:-1]).tolist()
    rows = []
    real_config = configs.gluon_bwd_config
    for causal in (False, True):
        fl_b = varlen_flops(lens, 16, 128, causal, "bwd")
        out, lse = F.attention_forward(q, k, v, 128 ** -0.5, causal, True, cu, cu, mx, mx)
        do = torch.randn_like(q)

        def run(gc, use=True, order="dispatch"):
            dispatch.CHOICE = dispatch.Choice(gluon_bwd=use)
            configs.gluon_bwd_config = (lambda *a, c=gc, **kw: c) if gc is not None else real_config
            real_order, real_table = configs.VARLEN_BWD_ORDER[causal], BG.cached_work_table
            if order == "grid_table":  # the grid's programs, empty ones included, in its order, from a work table
                configs.VARLEN_BWD_ORDER[causal] = "as_given"
                BG.cached_work_table = _grid_work_table
            elif order != "dispatch":  # the programs from the grid, or from the work table in either order
                configs.VARLEN_BWD_ORDER[causal] = order
            try:
                return B.attention_backward(do, q, k, v, out, lse, 128 ** -0.5, causal, True, cu, cu, mx, mx,
                                            zero_fill=False)
            finally:
                configs.gluon_bwd_config = real_config
                dispatch.CHOICE = dispatch.Choice(gluon_bwd=True)
                configs.VARLEN_BWD_ORDER[causal] = real_order
                BG.cached_work_table = real_table

        ref = run(None, use=False)
        variants = [("triton", None, False, "dispatch"), ("dispatch", None, True, "dispatch")]
        variants += [(f"order_{o}", None, True, o) for o in VARLEN_BWD_ORDERS]
        variants += [(n, c, True, "dispatch") for n, c in VARLEN_BWD_GLUON.items()]
        for name, gc, use, order in variants:
            try:
                got = run(gc, use, order)
                err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, ref))
                ms = bench(lambda: run(gc, use, order))
                ms_graph = bench_graph(lambda: run(gc, use, order))
                rows.append(dict(causal=causal, variant=name, ms=ms, ms_graph=ms_graph, tflops=fl_b / ms / 1e9, err=err))
            except Exception as exc:  # noqa: BLE001
                rows.append(dict(causal=causal, variant=name, error=str(exc)[:300]))
        # the dense path on the padded batch (B = 64, S = longest), what the ratio is taken against
        nb = len(lens)
        qp, kp, vp = (torch.randn(nb, mx, 16, 128, device=DEV, dtype=torch.float16) for _ in range(3))
        outp, lsep = F.attention_forward(qp, kp, vp, 128 ** -0.5, causal)
        dop = torch.randn_like(qp)
        ms = bench(lambda: B.attention_backward(dop, qp, kp, vp, outp, lsep, 128 ** -0.5, causal))
        rows.append(dict(causal=causal, variant="dense_padded", ms=ms))
        del qp, kp, vp, outp, lsep, dop
        if DEV == "cuda":  # where the Gluon kernels' time goes: per kernel, per program order
            for order in VARLEN_BWD_ORDERS:
                times = kernel_times(lambda: run(None, True, order))
                rows.append(dict(causal=causal, variant=f"kernels_{order}", kernels_us=times))
            for nb, T in ((8, 2048), (4, 4096)):  # dense shapes of the batch's FLOP-weighted length (~3k)
                qd, kd, vd = (torch.randn(nb, T, 16, 128, device=DEV, dtype=torch.float16) for _ in range(3))
                od, ld = F.attention_forward(qd, kd, vd, 128 ** -0.5, causal)
                dod = torch.randn_like(qd)
                times = kernel_times(lambda: B.attention_backward(dod, qd, kd, vd, od, ld, 128 ** -0.5, causal))
                rows.append(dict(causal=causal, variant=f"kernels_dense_{nb}x{T}", kernels_us=times,
                                 flops=attention_flops(nb, 16, T, 128, causal, "bwd")))
            rows.append(dict(causal=causal, variant="flops_varlen", flops=fl_b))
        print(f"varlen_bwd causal={int(causal)}:" + "".join(
            f" | {r['variant']} {r['ms']:.2f} ms" + (f" graph {r['ms_graph']:.2f} err {r['err']:.1e}" if "err" in r else "")
            if "ms" in r else f" | {r['variant']} ERROR {r['error'][:200]}" for r in rows
            if r["causal"] == causal and "kernels_us" not in r and "flops" not in r), flush=True)
        for r in rows:
            if r["causal"] == causal and "kernels_us" in r:
                print(f"  {r['variant']}: total {sum(r['kernels_us'].values()):.0f} us |" + " |".join(
                    f" {n} {t:.0f}" for n, t in sorted(r["kernels_us"].items(), key=lambda x: -x[1])), flush=True)
    return rows


BWD_KERNEL_POINTS = [(D, c, T) for D in (128, 64) for c in (False, True) for T in (1024, 8192)]


def host_profile(fn, calls: int, top: int) -> str:
    """cProfile of `calls` calls of fn (no sync between them): the `top` functions by own time, as text."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    if DEV == "cuda":
        torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def kernel_times(fn, calls=5):
    """{kernel name: GPU µs per call} of fn's launches (torch.profiler, mean over `calls` calls)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            times[e.name[:60]] = times.get(e.name[:60], 0.0) + e.device_time / calls
    return times


def sweep_bwd_kernels(opts):
    """GPU time of each backward kernel (torch.profiler, mean over 5 calls) with the Gluon dK/dV kernel and with
    the Triton one, and of cuDNN's backward kernels, at BWD_KERNEL_POINTS (fp16, the standard sweep's shapes)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for D, causal, T in BWD_KERNEL_POINTS:
        q, k, v, out, lse, do, flops = bwd_inputs(T, D, causal)
        for name, on in (("gluon", True), ("triton", False)):
            dispatch.CHOICE = dispatch.Choice(gluon_bwd=on)
            times = kernel_times(lambda: B.attention_backward(do, q, k, v, out, lse, D ** -0.5, causal))
            rows.append(dict(D=D, causal=causal, T=T, variant=name, kernels_us=times, flops=flops))
        dispatch.CHOICE = dispatch.Choice(gluon_bwd=True)
        qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            times = kernel_times(lambda: torch.autograd.grad(o, (qt, kt, vt), do.transpose(1, 2), retain_graph=True))
        rows.append(dict(D=D, causal=causal, T=T, variant="cudnn", kernels_us=times, flops=flops))
        for r in rows[-3:]:
            print(f"bwd_kernels D={D} causal={int(causal)} T={T} {r['variant']}: total "
                  f"{sum(r['kernels_us'].values()):.0f} us |" + " |".join(
                      f" {n} {t:.0f}" for n, t in sorted(r["kernels_us"].items(), key=lambda x: -x[1])), flush=True)
    return rows


BWD_HOST_POINTS = [(128, True, 512), (128, False, 512), (64, True, 1024), (128, False, 4096)]


def sweep_bwd_host(opts):
    """Where a short backward's time goes: at BWD_HOST_POINTS (fp16), the Gluon and the Triton kernels, called
    directly (`attention_backward`) and through autograd (flash_attn_func, out.backward(retain_graph=True), grads
    set to None, as `flashtriton bench` times it): eager do_bench medians, CUDA-graph GPU time (direct call),
    host time per call (20 calls without a sync), and the kernels the autograd call launches (profiler)."""
    import flashtriton
    from torch.profiler import ProfilerActivity, profile

    rows = []
    real_config = configs.gluon_bwd_config
    for D, causal, T in BWD_HOST_POINTS:
        q, k, v, out, lse, do, flops = bwd_inputs(T, D, causal)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        for name, on in (("gluon", True), ("triton", False)):
            dispatch.CHOICE = dispatch.Choice(gluon_bwd=on)
            forced = real_config(D, T, T, causal)  # the Gluon kernels whatever the size (no host-time threshold)
            configs.gluon_bwd_config = lambda *a, c=forced, **kw: c
            direct = lambda: B.attention_backward(do, q, k, v, out, lse, D ** -0.5, causal)  # noqa: E731
            o = flashtriton.flash_attn_func(*leaves, causal=causal)

            def auto():
                o.backward(do, retain_graph=True)
                for t in leaves:
                    t.grad = None

            row = dict(D=D, causal=causal, T=T, variant=name)
            row["direct_ms"] = bench(direct)
            row["graph_ms"] = bench_graph(direct)
            row["autograd_ms"] = bench(auto)
            for what, fn in (("direct", direct), ("autograd", auto)):
                fn()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(20):
                    fn()
                row[f"{what}_host_ms"] = (time.perf_counter() - t0) / 20 * 1e3
                torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                auto()
                torch.cuda.synchronize()
            row["autograd_kernels"] = sorted({e.name[:50] for e in prof.events() if e.device_type.name == "CUDA"})
            row["tflops_graph"] = flops / row["graph_ms"] / 1e9
            if T == BWD_HOST_POINTS[0][2]:  # where the host time goes, called directly and through autograd
                row["cprofile_direct"] = host_profile(direct, 50, 25)[-6000:]
                # the autograd engine runs a CUDA backward on its own thread, which cProfile does not follow: profile
                # it on this thread (and time it so: the thread hop itself may be part of the cost)
                with torch.autograd.set_multithreading_enabled(False):
                    row["cprofile_autograd"] = host_profile(auto, 50, 25)[-6000:]
                    auto()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(20):
                        auto()
                    row["autograd_one_thread_host_ms"] = (time.perf_counter() - t0) / 20 * 1e3
                    torch.cuda.synchronize()
                print(row["cprofile_direct"], row["cprofile_autograd"], sep="\n", flush=True)
            rows.append(row)
            print(f"bwd_host D={D} causal={int(causal)} T={T} {name}: " + " ".join(
                f"{k2}={v2:.3f}" for k2, v2 in row.items() if isinstance(v2, float)) + f" | {row['autograd_kernels']}",
                flush=True)
        dispatch.CHOICE = dispatch.Choice(gluon_bwd=True)
        configs.gluon_bwd_config = real_config
    return rows


def _time_forward(cands, ref, flops, base, cudnn_context=None):
    """Check each (name, fn) forward candidate against ref (the "cudnn" one returns SDPA's (B, H, S, D) layout),
    then time it in a CUDA graph (GPU time only): one row per candidate, base + variant, ms, TFLOP/s, max error
    (or the error it raised).
    `cudnn_context`, if given, is entered once around the cudnn candidate's check and timing."""
    rows = []
    for name, fn in cands:
        context = cudnn_context if name == "cudnn" and cudnn_context is not None else contextlib.nullcontext()
        try:
            with context:
                o = fn()
                o = o[0] if isinstance(o, tuple) else o
                if name == "cudnn":
                    o = o.transpose(1, 2)
                err = (o.float() - ref.float()).abs().max().item()
                ms = bench_graph(fn)  # GPU time: a Gluon launch's host time (descriptors) is not the kernel's
            row = dict(base, variant=name, ms=ms, tflops=flops / ms / 1e9, err=err)
        except Exception as exc:  # noqa: BLE001
            row = dict(base, variant=name, error=str(exc)[:300])
        rows.append(row)
    return rows


def sweep_tma(opts):
    """The Hopper TMA forward at the dispatch's tile (`tma_forward`) against the portable kernel's default and cuDNN,
    same run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not hopper() and not SMOKE:
        raise SystemExit("tma: the TMA kernels need an sm_90 GPU")
    head_dims, dtypes = opts.head_dims, opts.dtypes.split(",")
    causals = [bool(int(c)) for c in opts.causal.split(",")]
    seqlens = opts.seqlens or FWD_SEQLENS
    rows = []
    for D in head_dims:
        for dt in dtypes:
            for causal in causals:
                for T in seqlens:
                    q, k, v = fwd_inputs(T, D, DTYPE[dt])
                    flops = attention_flops(max(1, 16384 // T), 2048 // D, T, D, causal, "fwd")
                    ref, _ = F.attention_forward(q, k, v, D ** -0.5, causal)
                    tile = configs.default_fwd_tma_config(D, T, T, causal)

                    def portable():
                        with kernel_families("portable"):
                            return F.attention_forward(q, k, v, D ** -0.5, causal)

                    cands = [("portable", portable),
                             (f"tma {tile['BLOCK_M']}x{tile['BLOCK_N']}", lambda: tma_forward(q, k, v, causal))]
                    qb, kb, vb = (t.transpose(1, 2).contiguous() for t in (q, k, v))

                    def cudnn():
                        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                            return torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=causal)

                    cands.append(("cudnn", cudnn))
                    here = _time_forward(cands, ref, flops, dict(D=D, dtype=dt, causal=causal, T=T))
                    rows += here
                    print(f"tma D={D} {dt} causal={int(causal)} T={T}:"
                          + "".join(f" | {r['variant']} {r.get('tflops', 0):.0f}" for r in here), flush=True)
                    del q, k, v, qb, kb, vb
    return rows


_G = dict(BLOCK_N=128, NUM_BUFFERS=2, CONSUMER_REGS=240, N_CONSUMERS=2, Q_BUFFERS=1, CAUSAL_PAIRS=True,
          DYNAMIC=False, OVERLAP=False, STORE_FROM_REGS=False)
_G3 = dict(_G, N_CONSUMERS=3, CONSUMER_REGS=160)  # 192-row items, as FlashAttention-3 at D = 64
GLUON_CONFIGS = {  # name -> the Gluon forward's config (kernels/forward_gluon.py)
    # explore7/gluon_2b6137fa8c9f.json also tried one program per item, 64-key tiles, ping-pong
    # explore8/gluon_72e8c4a825c2.json also tried items one at a time from a static schedule (unpaired)
    # explore9/gluon_a99806d25f61.json also tried the dynamic schedule (one or two Q slots)
    128: {"persist": _G, "q2": dict(_G, Q_BUFFERS=2), "overlap": dict(_G, OVERLAP=True),
          "q2_overlap": dict(_G, Q_BUFFERS=2, OVERLAP=True)},
    # gluon_ccaefbc239e1.json also tried 3 consumers with 64-key tiles
    # explore14/run_549e8e775c38 also tried one Q slot, with and without OVERLAP (behind two slots everywhere)
    64: {"q2": dict(_G, Q_BUFFERS=2), "c3": _G3, "q2_overlap": dict(_G, Q_BUFFERS=2, OVERLAP=True),
         "q2_overlap_s3": dict(_G, Q_BUFFERS=2, OVERLAP=True, NUM_BUFFERS=3),
         "q2_overlap_n64": dict(_G, Q_BUFFERS=2, OVERLAP=True, BLOCK_N=64, NUM_BUFFERS=4)},
    # tiles of 256 columns (192 in them): 32-key tiles beside the O staging tiles, or 64-key tiles with the output
    # stored from registers (two stages fit without the staging tiles)
    256: {"n32": dict(_G, BLOCK_N=32), "n64_regs": dict(_G, BLOCK_N=64, STORE_FROM_REGS=True)}}
GLUON_CONFIGS[192] = GLUON_CONFIGS[256]
GLUON_CONFIGS[128]["regs_s3"] = dict(_G, STORE_FROM_REGS=True, NUM_BUFFERS=3)  # a third stage where O was staged
GLUON_CHECKS = [  # (B, Sq, Sk, Hq, Hkv): odd lengths, one token, Sq != Sk (bottom-right causal, rows with no key),
    # GQA, and more items than SMs (persistent programs take several)
    (2, 1, 1, 2, 2), (2, 17, 17, 2, 1), (1, 128, 128, 4, 2), (2, 200, 333, 2, 2), (1, 333, 200, 2, 2),
    (1, 1000, 1000, 3, 3), (1, 64, 1024, 2, 2), (2, 1024, 64, 2, 1), (3, 1000, 1000, 16, 8), (4, 1024, 64, 16, 4),
    (2, 777, 1500, 12, 3)]


def gluon_forward(q, k, v, causal, c, bottom_right=True):
    """(out, lse) of the Gluon forward with config c."""
    from flashtriton.kernels import forward_gluon_launch as G

    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device, dtype=torch.float32)
    G.launch_forward_gluon(q, k, v, out, lse, q.shape[-1] ** -0.5, causal, bottom_right, c)
    return out, lse


def sweep_gluon(opts):
    """The Gluon (FlashAttention-3 schedule) forward: checked against float64 on odd shapes, then timed per
    config beside the TMA kernel (the default dense path) and cuDNN."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashtriton.reference import attention_reference

    rows = []
    for D in opts.head_dims:
        for dt in ("fp16", "bf16"):
            for causal in (False, True):
                for bottom_right in ((True, False) if causal else (True,)):
                    for (B, Sq, Sk, Hq, Hkv) in GLUON_CHECKS:
                        g = torch.Generator(device=DEV).manual_seed(Sq * 7 + Sk)
                        q = torch.randn(B, Sq, Hq, D, device=DEV, dtype=DTYPE[dt], generator=g)
                        k, v = (torch.randn(B, Sk, Hkv, D, device=DEV, dtype=DTYPE[dt], generator=g) for _ in range(2))
                        ref, ref_lse = attention_reference(q, k, v, D ** -0.5, causal, bottom_right=bottom_right, return_lse=True)
                        row = dict(check=True, D=D, dtype=dt, causal=causal, bottom_right=bottom_right, shape=[B, Sq, Sk, Hq, Hkv])
                        for name, c in GLUON_CONFIGS[D].items():
                            try:
                                o, lse = gluon_forward(q, k, v, causal, c, bottom_right)
                                torch.cuda.synchronize()
                                row[f"err_{name}"] = (o.double() - ref).abs().max().item()
                                fin = torch.isfinite(ref_lse)
                                row[f"lse_{name}"] = ((lse.double() - ref_lse)[fin].abs().max().item()
                                                      if fin.any() else 0.0)
                                row[f"lse_inf_ok_{name}"] = bool((torch.isinf(lse) == ~fin).all().item())
                            except Exception as exc:  # noqa: BLE001
                                row[f"error_{name}"] = str(exc)[:300]
                        o, _ = F.attention_forward(q, k, v, D ** -0.5, causal, bottom_right)
                        row["err_tma"] = (o.double() - ref).abs().max().item()
                        rows.append(row)
                    bad = [r for r in rows[-len(GLUON_CHECKS):] if any(
                        k.startswith("error") or (k.startswith("err_") and k != "err_tma" and v > 2 * r["err_tma"] + 2e-3)
                        or (k.startswith("lse_inf") and not v) for k, v in r.items())]
                    print(f"gluon check D={D} {dt} causal={int(causal)} br={int(bottom_right)}: "
                          f"{len(GLUON_CHECKS) - len(bad)}/{len(GLUON_CHECKS)} ok"
                          + "".join(f"\n  BAD {r}" for r in bad), flush=True)
    for D in opts.head_dims:
        for dt in ("fp16", "bf16"):
            for causal in (False, True):
                for T in FWD_SEQLENS:
                    if dt == "bf16" and T not in (1024, 8192):
                        continue
                    q, k, v = fwd_inputs(T, D, DTYPE[dt])
                    flops = attention_flops(max(1, 16384 // T), 2048 // D, T, D, causal, "fwd")
                    ref, _ = F.attention_forward(q, k, v, D ** -0.5, causal)
                    cands = [("tma", lambda: tma_forward(q, k, v, causal))]
                    cands += [(name, lambda c=c: gluon_forward(q, k, v, causal, c)) for name, c in GLUON_CONFIGS[D].items()]
                    qb, kb, vb = (t.transpose(1, 2).contiguous() for t in (q, k, v))
                    ctx = sdpa_kernel([SDPBackend.CUDNN_ATTENTION])

                    def cudnn():
                        return torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=causal)

                    here = _time_forward(cands + [("cudnn", cudnn)], ref, flops, dict(D=D, dtype=dt, causal=causal, T=T),
                                         cudnn_context=ctx)
                    rows += here
                    print(f"gluon D={D} {dt} causal={int(causal)} T={T}:"
                          + "".join(f" | {r['variant']} {r.get('tflops', 0):.0f}" + (" ERR" if "error" in r else "")
                                    for r in here), flush=True)
                    del q, k, v, qb, kb, vb
    return rows


def _varlen_inputs(small=False, seed=0):
    """The varlen suite's batch: 64 sequences, lengths uniform in 1..4096 (seed 0), H=16, D=128, fp16."""
    from flashtriton.tools.bench_suites import varlen_seqlens

    lens = varlen_seqlens(4 if small else 64, 256 if small else 4096, seed)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(seed)
    total = int(cu[-1])
    q, k, v = (torch.randn(total, 16, 128, device=DEV, dtype=torch.float16, generator=g) for _ in range(3))
    return q, k, v, cu, max(lens)


def _varlen_run(which, q, k, v, cu, mx, causal, c, state=None):
    if which == "fwd":
        return F.attention_forward(q, k, v, 128 ** -0.5, causal, True, cu, cu, mx, mx, config=cfg(c))
    out, lse, do = state or (*F.attention_forward(q, k, v, 128 ** -0.5, causal, True, cu, cu, mx, mx), torch.randn_like(q))
    both = configs.default_bwd_configs(128, 2, q.device, causal)
    both[which] = cfg(c)
    return B.attention_backward(do, q, k, v, out, lse, 128 ** -0.5, causal, True, cu, cu, mx, mx, config=both)


def sweep_varlen(opts):
    """Configs of the varlen forward and of each backward kernel on the varlen suite's batch (64 sequences,
    1..4096): what the launcher should pick from the lengths it knows on the host (max, mean)."""
    from flashtriton.tools.bench_core import varlen_flops

    jobs = [("varlen", ("fwd", c, x)) for c in (False, True) for x in VARLEN_FWD]
    jobs += [("varlen_tma", (c, x)) for c in (False, True) for x in VARLEN_TMA] if hopper() else []
    if not opts.fwd_only:
        jobs += [("varlen", (w, c, x)) for c in (False, True)
                 for w, tab in (("dkdv", VARLEN_BWD_DKDV), ("dq", VARLEN_BWD_DQ)) for x in tab]
    precompile(jobs, opts.jobs)
    from flashtriton.kernels import backward_gluon_launch as BG

    q, k, v, cu, mx = _varlen_inputs(small=SMOKE)
    lens = (cu[1:] - cu[:-1]).tolist()
    rows = []
    for causal in (False, True):
        fl_f = varlen_flops(lens, 16, 128, causal, "fwd")
        fl_b = varlen_flops(lens, 16, 128, causal, "bwd")
        for c in VARLEN_FWD:
            ms = bench(lambda: _varlen_run("fwd", q, k, v, cu, mx, causal, c))
            rows.append(dict(mode="fwd", causal=causal, variant=str(c), ms=ms, tflops=fl_f / ms / 1e9))
        if hopper():
            for c in VARLEN_TMA:
                def tma(c=c):
                    return tma_forward(q, k, v, causal, c, cu, mx)
                try:
                    ms = bench(tma)
                except Exception as exc:  # noqa: BLE001  (a config past the shared memory)
                    rows.append(dict(mode="fwd_tma", causal=causal, variant=str(c), ms=float("nan"),
                                     error=str(exc)[:200]))
                    continue
                rows.append(dict(mode="fwd_tma", causal=causal, variant=str(c), ms=ms, tflops=fl_f / ms / 1e9))
            from flashtriton.kernels import forward_gluon_launch as G

            ref_out, _ = tma_forward(q, k, v, causal, cu=cu, mx=mx)  # what each Gluon variant must match
            for name, gc in GLUON_VARLEN.items():
                def gluon(gc=gc):
                    out = torch.empty_like(q)
                    lse = torch.empty(q.shape[1], q.shape[0], device=q.device, dtype=torch.float32)
                    G.launch_forward_gluon(q, k, v, out, lse, 128 ** -0.5, causal, True, gc, cu, cu, mx, mx)
                    return out
                err = (gluon().float() - ref_out.float()).abs().max().item()
                ms = bench(gluon)
                rows.append(dict(mode="fwd_gluon", causal=causal, variant=name, ms=ms, tflops=fl_f / ms / 1e9,
                                 err_vs_tma=err))
        import flashtriton

        ms = bench(lambda: flashtriton.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=causal))
        rows.append(dict(mode="fwd_api", causal=causal, variant="api", ms=ms, tflops=fl_f / ms / 1e9))
        if opts.fwd_only:
            continue
        out, lse = F.attention_forward(q, k, v, 128 ** -0.5, causal, True, cu, cu, mx, mx)
        state = (out, lse, torch.randn_like(q))
        for which, tab in (("dkdv", VARLEN_BWD_DKDV), ("dq", VARLEN_BWD_DQ)):
            for c in tab:
                ms = bench(lambda: _varlen_run(which, q, k, v, cu, mx, causal, c, state))
                rows.append(dict(mode="bwd", kernel=which, causal=causal, variant=str(c), ms=ms, tflops=fl_b / ms / 1e9))
    for causal in (False, True):
        print(f"varlen causal={int(causal)}:" + "".join(
            f" | {r['mode']}{'/' + r['kernel'] if 'kernel' in r else ''} {r['variant']} {r['ms']:.3f} ms"
            + (f" (err {r['err_vs_tma']:.1e})" if "err_vs_tma" in r else "")
            for r in rows if r["causal"] == causal), flush=True)
    return rows


def _decode_inputs(Bsz, S, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(Bsz, 1, 32, 128, device=DEV, dtype=torch.float16, generator=g)
    kc = torch.randn(Bsz, S, 8, 128, device=DEV, dtype=torch.float16, generator=g)
    vc = torch.randn(Bsz, S, 8, 128, device=DEV, dtype=torch.float16, generator=g)
    seqlens = torch.full((Bsz,), S, dtype=torch.int32, device=DEV)
    return q, kc, vc, seqlens


def _decode_run(Bsz, S, splits, config, inputs=None):
    q, kc, vc, seqlens = inputs or _decode_inputs(Bsz, S)
    return Dk.decode_attention(q, kc, vc, seqlens, S, 128 ** -0.5, False, num_splits=splits, config=config)


def _decode_row(Bsz, S, variant, splits, fn, kv_bytes, ref=None) -> dict:
    """One decode variant: its error against `ref` (when given), eager and CUDA-graph times, GB/s of K/V."""
    row = dict(B=Bsz, S=S, variant=variant, splits=splits)
    try:
        with torch.no_grad():
            if ref is not None:
                row["err"] = (fn()[0].float() - ref.float()).abs().max().item()
            ms, ms_graph = bench(fn, rep=20), bench_graph(fn, rep=20)
    except Exception as exc:  # noqa: BLE001
        return dict(row, error=str(exc)[:200])
    return dict(row, ms=ms, gbps=kv_bytes / ms / 1e6, ms_graph=ms_graph, gbps_graph=kv_bytes / ms_graph / 1e6)


@triton.jit
def _touch(X):
    tl.store(X, tl.load(X))


def sweep_decode(opts):
    jobs = [("decode", (c, s)) for c in DECODE_CONFIGS for s in (1, 2)]
    precompile(jobs, opts.jobs)
    rows = []
    import flashtriton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for Bsz, S in DECODE_POINTS:
        inputs = _decode_inputs(Bsz, S)
        kv_bytes = 2 * Bsz * S * 8 * 128 * 2
        ref, _ = _decode_run(Bsz, S, 1, dcfg(DECODE_CONFIGS[0]), inputs)
        for c in DECODE_CONFIGS:
            for s in DECODE_SPLITS:
                rows.append(_decode_row(Bsz, S, str(c), s, lambda: _decode_run(Bsz, S, s, dcfg(c), inputs), kv_bytes,
                                        ref))
        q, kc, vc, seqlens = inputs
        rows.append(_decode_row(Bsz, S, "api", 0, lambda: flashtriton.flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=seqlens), kv_bytes))
        qb, kb, vb = q.transpose(1, 2).contiguous(), kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
        del kc, vc
        # The same kernels on the cache memory SDPA reads: (B, Hkv, S, D) contiguous, seen as (B, S, Hkv, D).
        kh, vh = kb.transpose(1, 2), vb.transpose(1, 2)
        for c in DECODE_CONFIGS[:1] + DECODE_CONFIGS[2:3]:
            for sp in (0, 2, 4, 8, 16, 32):
                rows.append(_decode_row(Bsz, S, f"bhsd {c}", sp, lambda: Dk.decode_attention(
                    q, kh, vh, seqlens, S, 128 ** -0.5, False, num_splits=sp, config=dcfg(c)), kv_bytes, ref))
        rows.append(_decode_row(Bsz, S, "api_bhsd", 0, lambda: flashtriton.flash_attn_with_kvcache(
            q, kh, vh, cache_seqlens=seqlens), kv_bytes))
        # The floor of this timing: a launch of a kernel that does next to nothing, timed the same way.
        rows.append(_decode_row(Bsz, S, "empty kernel", 0, lambda: _touch[(1,)](seqlens), kv_bytes))
        backend = SDPBackend.CUDNN_ATTENTION if DEV == "cuda" else SDPBackend.MATH
        with sdpa_kernel([backend]):
            rows.append(_decode_row(Bsz, S, "sdpa_cudnn", 0, lambda: torch.nn.functional.scaled_dot_product_attention(
                qb, kb, vb, enable_gqa=True), kv_bytes))
        del qb, kb, vb, inputs
        here = [r for r in rows if r.get("B") == Bsz and r.get("S") == S and "gbps" in r and r["variant"] != "empty kernel"]
        floor = [r for r in rows if r.get("B") == Bsz and r.get("S") == S and r["variant"] == "empty kernel" and "ms" in r]
        best = max(here, key=lambda r: r["gbps"])
        best_graph = max(here, key=lambda r: r.get("gbps_graph") or 0)
        named = {r["variant"]: r for r in here}
        auto = [r for r in here if r["splits"] == 0 and r["variant"] == str(DECODE_CONFIGS[0])]
        print(f"decode B={Bsz} S={S}: best {best['variant']} splits={best['splits']} {best['gbps']:.0f} GB/s; "
              f"auto {auto[0]['gbps'] if auto else 0:.0f}; api {named['api']['gbps']:.0f}; api_bhsd {named['api_bhsd']['gbps']:.0f}; "
              f"cudnn {named['sdpa_cudnn']['gbps']:.0f} | "
              f"graphs (GPU time only): best {best_graph['variant']} splits={best_graph['splits']} "
              f"{best_graph['gbps_graph']:.0f}; auto {auto[0]['gbps_graph'] if auto else 0:.0f}; "
              f"api {named['api']['gbps_graph']:.0f}; api_bhsd {named['api_bhsd']['gbps_graph']:.0f}; "
              f"cudnn {named['sdpa_cudnn']['gbps_graph']:.0f} | empty kernel "
              f"{floor[0]['ms'] * 1e3 if floor else 0:.1f} us ({floor[0]['ms_graph'] * 1e3 if floor else 0:.1f} in a graph)",
              flush=True)
        torch.cuda.empty_cache()
    return rows


def sweep_decode_schedule(opts):
    """The decode API under each schedule (`dispatch.decode_schedule()`: the split grid, the stream schedule forced,
    and auto) beside cuDNN, eager and in CUDA graphs, every point measured in ROUNDS interleaved rounds (the
    machine's run-to-run spread is the size of the effect); plus a ragged batch (lengths uniform in 1 .. S) where
    the cache's capacity, not the lengths, sizes the launch."""
    import flashtriton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    rounds = 2
    for Bsz, S in DECODE_POINTS:
        q, kc, vc, seqlens = _decode_inputs(Bsz, S)
        kv_bytes = 2 * Bsz * S * 8 * 128 * 2
        ragged = torch.randint(1, S + 1, (Bsz,), device=DEV, dtype=torch.int32, generator=torch.Generator(
            device=DEV).manual_seed(1)) if Bsz > 1 else seqlens
        ragged_bytes = 2 * int(ragged.sum()) * 8 * 128 * 2
        qb, kb, vb = q.transpose(1, 2).contiguous(), kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
        with torch.no_grad():
            ref = flashtriton.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens).float()
        for r in range(rounds):
            for schedule in ("split", "stream", "auto"):
                dispatch.CHOICE = dispatch.Choice(decode=schedule)

                def api():
                    return flashtriton.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)

                def api_ragged():
                    return flashtriton.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=ragged)

                row = _decode_row(Bsz, S, f"api_{schedule}", 0, lambda: (api(),), kv_bytes, ref)
                rows.append(dict(row, round=r))
                if Bsz > 1:
                    rows.append(dict(_decode_row(Bsz, S, f"ragged_{schedule}", 0, lambda: (api_ragged(),),
                                                 ragged_bytes), round=r))
            dispatch.CHOICE = dispatch.Choice()
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION if DEV == "cuda" else SDPBackend.MATH]):
                rows.append(dict(_decode_row(Bsz, S, "sdpa_cudnn", 0, lambda: (torch.nn.functional.scaled_dot_product_attention(
                    qb, kb, vb, enable_gqa=True).transpose(1, 2),), kv_bytes, ref), round=r))
            here = [x for x in rows if x.get("B") == Bsz and x.get("S") == S and x.get("round") == r and "gbps" in x]
            print(f"decode_schedule B={Bsz} S={S} round {r}: " + " | ".join(
                f"{x['variant']} {x['gbps']:.0f}/{x['gbps_graph']:.0f}" + (f" err {x['err']:.1e}" if "err" in x else "")
                for x in here) + "  (GB/s eager/graph)", flush=True)
        del q, kc, vc, qb, kb, vb
        torch.cuda.empty_cache()
    return rows


def sweep_host(opts):
    """Host time per call of the public forward (no sync), against the kernel's GPU time."""
    import flashtriton

    rows = []
    for T, D, causal in ((512, 128, False), (512, 128, True), (512, 64, True)):
        q, k, v = fwd_inputs(T, D, torch.float16)
        for name, fn in (("flash_attn_func", lambda: flashtriton.flash_attn_func(q, k, v, causal=causal)),
                         ("launch_forward", lambda: F.attention_forward(q, k, v, D ** -0.5, causal))):
            fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                fn()
            host = (time.perf_counter() - t0) / 200 * 1e3
            torch.cuda.synchronize()
            ms = bench(fn)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            graph_ms = bench(lambda: g.replay())
            rows.append(dict(T=T, D=D, causal=causal, path=name, host_ms=host, ms=ms, graph_ms=graph_ms))
            print(rows[-1], flush=True)
    # The varlen suite's batch: the API's forward (causal: the Gluon kernel) against the kernel launched directly.
    vq, vk, vv, cu, mx = _varlen_inputs(small=SMOKE)
    from flashtriton.kernels import forward_gluon_launch as G

    def gluon_direct():
        out = torch.empty_like(vq)
        lse = torch.empty(vq.shape[1], vq.shape[0], device=vq.device, dtype=torch.float32)
        G.launch_forward_gluon(vq, vk, vv, out, lse, 128 ** -0.5, True, True,
                               configs.gluon_varlen_config(128, mx, mx, True), cu, cu, mx, mx)
        return out

    varlen_calls = [("flash_attn_varlen_func", lambda: flashtriton.flash_attn_varlen_func(vq, vk, vv, cu, cu, mx, mx,
                                                                                         causal=True)),
                    ("launch_forward varlen", lambda: F.attention_forward(vq, vk, vv, 128 ** -0.5, True, True, cu, cu,
                                                                          mx, mx))]
    if DEV == "cuda" and configs.gluon_varlen_config(128, mx, mx, True) is not None:
        varlen_calls.append(("gluon kernel varlen", gluon_direct))
    for name, fn in varlen_calls:
        fn()
        torch.cuda.synchronize() if DEV == "cuda" else None
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        host = (time.perf_counter() - t0) / 20 * 1e3  # enqueue time, while the GPU runs the previous calls
        torch.cuda.synchronize() if DEV == "cuda" else None
        rows.append(dict(path=name, varlen=True, host_ms=host, ms=bench(fn), graph_ms=bench_graph(fn)))
        print(rows[-1], flush=True)
    # where the host time goes: cProfile of a forward call and of a decode call (B=1, 4k cache)
    q, k, v = fwd_inputs(512, 128, torch.float16)
    dq, kc, vc, seqlens = _decode_inputs(1, 4096)
    qb, kb, vb = dq.transpose(1, 2).contiguous(), kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa_cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True)

    flush = torch.empty(int(256e6 // 4), dtype=torch.int, device=DEV)  # what do_bench clears before each run
    calls = {
        "flash_attn_func": lambda: flashtriton.flash_attn_func(q, k, v, causal=True),
        "flash_attn_with_kvcache": lambda: flashtriton.flash_attn_with_kvcache(dq, kc, vc, cache_seqlens=seqlens),
        "decode_attention": lambda: Dk.decode_attention(dq, kc, vc, seqlens, 4096, 128 ** -0.5, False),
        "sdpa_cudnn_decode": sdpa_cudnn,
        "l2_flush_zero_": lambda: flush.zero_(),
    }
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        start.record()
        flush.zero_()
        end.record()
        torch.cuda.synchronize()
    print(f"--- do_bench's L2 flush (zero_ of 256 MB): {start.elapsed_time(end) * 1e3:.1f} us of GPU time", flush=True)
    rows.append(dict(path="l2_flush_gpu", us=start.elapsed_time(end) * 1e3))
    with torch.no_grad():
        for name, fn in calls.items():
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(500):
                fn()
            host = (time.perf_counter() - t0) / 500 * 1e3
            torch.cuda.synchronize()
            profile_text = host_profile(fn, 500, 14)
            print(f"--- {name}: {host * 1e3:.1f} us per call (no sync)", flush=True)
            print(profile_text, flush=True)
            rows.append(dict(path=name, host_us=host * 1e3))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("sweep", choices=["fwd", "bwd", "decode", "decode_schedule", "host", "tma", "varlen", "gluon", "gluon_bwd", "bwd_kernels", "bwd_host", "varlen_bwd"])
    ap.add_argument("--out", default=".")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--head-dims", type=lambda x: [int(d) for d in x.split(",")], default=[128, 64],
                    help="gluon, tma: head dims to sweep")
    ap.add_argument("--dtypes", default="fp16,bf16", help="tma: dtypes to sweep")
    ap.add_argument("--causal", default="0,1", help="tma: causal modes to sweep (0,1)")
    ap.add_argument("--seqlens", type=lambda x: [int(t) for t in x.split(",")], default=None,
                    help="tma: sequence lengths (default FWD_SEQLENS)")
    ap.add_argument("--fwd-only", action="store_true", help="varlen: the forward kernels only")
    ap.add_argument("--decode-points", default="", help="decode: BxS points instead of the default, e.g. 1x1024,64x1024")
    opts = ap.parse_args()
    if opts.decode_points:
        global DECODE_POINTS
        DECODE_POINTS = [tuple(int(x) for x in p.split("x")) for p in opts.decode_points.split(",")]
    t0 = time.time()
    sweeps = {"fwd": sweep_fwd, "bwd": sweep_bwd, "decode": sweep_decode, "decode_schedule": sweep_decode_schedule, "host": sweep_host, "tma": sweep_tma,
              "varlen": sweep_varlen, "gluon": sweep_gluon, "gluon_bwd": sweep_gluon_bwd, "bwd_kernels": sweep_bwd_kernels, "bwd_host": sweep_bwd_host,
              "varlen_bwd": sweep_varlen_bwd}
    rows = sweeps[opts.sweep](opts)
    Path(opts.out).mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name() if DEV == "cuda" else "cpu", torch=torch.__version__, triton=__import__("triton").__version__,
                git_sha=os.environ.get("FLASHTRITON_GIT_SHA", "unknown"), date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                seconds=round(time.time() - t0, 1))
    (Path(opts.out) / f"{opts.sweep}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"{opts.sweep}: {len(rows)} rows in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
