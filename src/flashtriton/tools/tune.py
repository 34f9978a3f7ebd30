"""`flashtriton tune`: the notebook's exercise 1 — sweep BLOCK_M (and the rest of each forward config) for one
shape and see how registers, occupancy and speed relate.

For every config in `configs.FWD_CONFIGS` that `configs.prune_fwd_configs` keeps for the shape (the pruned
ones are listed as such): compile it, check its output against the float64 reference, then read the compiled
kernel's registers, spills and shared memory, work out how many blocks fit on one SM, and time it.

On a machine without a GPU (Triton's interpreter) there are no registers or timings: the sweep only checks
every config's output, at the shape asked for cut down to at most B,H,T = `CPU_SHAPE` (with a warning that
names both shapes when it is cut; tune.json records both).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import configs
from .._env import INTERPRET
from ..kernels.forward import launch_forward
from ..reference import attention_flops, attention_reference
from .bench_core import environment

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
FLOOR = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-22}  # half an ulp at 1.0
CPU_SHAPE = (1, 2, 128)  # (B, H, T) of the interpreter's correctness-only sweep
REGS_PER_SM = 65536  # sm_80 … sm_90
MAX_BLOCKS_PER_SM = 32
SMEM_RESERVED_PER_BLOCK = 1024  # the CUDA runtime keeps 1 KiB of shared memory per block on sm_80+


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", "-B", type=int, default=4, help="batch size (default 4)")
    parser.add_argument("--heads", "-H", type=int, default=16, help="heads (default 16)")
    parser.add_argument("--seqlen", "-T", type=int, default=4096, help="sequence length (default 4096)")
    parser.add_argument("--head-dim", "-D", type=int, default=128, help="head dim, 1..256 (default 128)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16", help="input dtype (default fp16)")
    parser.add_argument("--causal", action="store_true", help="causal attention (default: not causal)")
    parser.add_argument("--out", metavar="DIR", help="write tune.json here")


def sm_limits() -> dict:
    """What one SM of GPU 0 holds: registers, shared memory, warps."""
    props = torch.cuda.get_device_properties(0)
    smem = getattr(props, "shared_memory_per_multiprocessor", 0) or (228 if props.major >= 9 else 164) * 1024
    threads = getattr(props, "max_threads_per_multi_processor", 0) or 2048
    return dict(regs=REGS_PER_SM, smem=smem, warps=threads // 32, blocks=MAX_BLOCKS_PER_SM,
                sms=props.multi_processor_count, name=props.name)


def occupancy(n_regs: int, shared: int, num_warps: int, limits: dict) -> dict:
    """Resident blocks per SM = the tightest of registers, shared memory, warps and the block limit."""
    per_limit = {
        "registers": limits["regs"] // max(n_regs * 32 * num_warps, 1),
        "shared": limits["smem"] // (shared + SMEM_RESERVED_PER_BLOCK),
        "warps": limits["warps"] // num_warps,
        "blocks": limits["blocks"],
    }
    blocks = min(per_limit.values())
    return dict(blocks_per_sm=blocks, limited_by=min(per_limit, key=per_limit.get),
                occupancy_pct=100.0 * blocks * num_warps / limits["warps"])


def config_dict(config) -> dict:
    return dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)


def max_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def sweep(shape, dtype, causal: bool, device: str, limits: dict | None = None) -> list[dict]:
    """One row per config: its parameters and status (ok / pruned / wrong / error); given the SM's `limits`
    (on a GPU), also its registers, spills, shared memory, occupancy and speed."""
    B, H, T, D = shape
    torch.manual_seed(0)
    q, k, v = (torch.randn((B, T, H, D), device=device, dtype=dtype) for _ in range(3))  # (B, T, H, D)
    scale = 1.0 / math.sqrt(D)
    heads = [0, H - 1]  # judge batch 0, first and last head, against float64 (one (T, T) matrix per head)
    qs, ks, vs = (t[:1, :, heads] for t in (q, k, v))  # (1, T, 2, D)
    exact = attention_reference(qs, ks, vs, scale, causal=causal)  # (1, T, 2, D) float64
    with sdpa_kernel([SDPBackend.MATH]):
        torch_out = torch.nn.functional.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (qs, ks, vs)), is_causal=causal, scale=scale).transpose(1, 2)
    allowed = 2 * max_err(torch_out, exact) + FLOOR[dtype] * max(exact.abs().max().item(), 1.0)

    kept = configs.prune_fwd_configs(configs.FWD_CONFIGS, {"Q": q, "TUNE_SEQLEN_K": configs.seqlen_bucket(T)},
                                     BLOCK_D=configs.padded_head_dim(D))
    flops = attention_flops(B, H, T, D, causal=causal)
    rows = []
    for config in configs.FWD_CONFIGS:
        cfg = config_dict(config)
        row = dict(cfg, status="ok", error=None)
        rows.append(row)
        if not any(config is c for c in kept):
            row["status"] = "pruned"
            continue
        try:
            out, _, kernel = launch_forward(q, k, v, scale, causal, config=cfg)
            row["max_err"], row["allowed_err"] = max_err(out[:1, :, heads], exact), allowed
            if not row["max_err"] <= allowed:
                row["status"] = "wrong"
                continue
            if limits is None:
                continue
            row.update(n_regs=kernel.n_regs, n_spills=kernel.n_spills, shared=kernel.metadata.shared)
            row.update(occupancy(kernel.n_regs, kernel.metadata.shared, cfg["num_warps"], limits))
            import triton.testing

            row["ms"] = float(triton.testing.do_bench(
                lambda: launch_forward(q, k, v, scale, causal, config=cfg), return_mode="median"))
            row["tflops"] = flops / row["ms"] / 1e9
        except Exception as exc:  # noqa: BLE001  (a config that does not compile or run is reported)
            row["status"], row["error"] = "error", f"{type(exc).__name__}: {str(exc)[:200]}"
    order = {"ok": 0, "wrong": 1, "error": 2, "pruned": 3}
    rows.sort(key=lambda r: (r["BLOCK_M"], order[r["status"]], -(r.get("tflops") or 0.0)))
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'BM':>4} {'BN':>4} {'warps':>5} {'stages':>6} {'regs':>5} {'spills':>6} {'smem KiB':>8} "
            f"{'blk/SM':>6} {'limit':<9} {'occ %':>5} {'ms':>8} {'TFLOP/s':>8}  status")
    lines = [head]
    for r in rows:
        def f(key, fmt):
            return format(r[key], fmt) if r.get(key) is not None else "-"
        smem = f"{r['shared'] / 1024:.1f}" if r.get("shared") is not None else "-"
        status = r["status"] + (f" ({r['error']})" if r["error"] else "")
        if r["status"] == "wrong":
            status += f" (err {r['max_err']:.2e} > {r['allowed_err']:.2e})"
        lines.append(f"{r['BLOCK_M']:>4} {r['BLOCK_N']:>4} {r['num_warps']:>5} {r['num_stages']:>6} "
                     f"{f('n_regs', 'd'):>5} {f('n_spills', 'd'):>6} {smem:>8} {f('blocks_per_sm', 'd'):>6} "
                     f"{r.get('limited_by') or '-':<9} {f('occupancy_pct', '.0f'):>5} {f('ms', '.3f'):>8} "
                     f"{f('tflops', '.1f'):>8}  {status}")
    return "\n".join(lines)


def conclusion(rows: list[dict]) -> list[str]:
    timed = [r for r in rows if r.get("tflops") is not None]
    if not timed:
        return []
    best = max(timed, key=lambda r: r["tflops"])
    lines = [f"best: BLOCK_M={best['BLOCK_M']} BLOCK_N={best['BLOCK_N']} num_warps={best['num_warps']} "
             f"num_stages={best['num_stages']}: {best['tflops']:.1f} TFLOP/s, {best['n_regs']} regs/thread, "
             f"{best['blocks_per_sm']} blocks/SM ({best['occupancy_pct']:.0f}% of warps)"]
    for bm in sorted({r["BLOCK_M"] for r in timed}):
        group = [r for r in timed if r["BLOCK_M"] == bm]
        regs, occ = [r["n_regs"] for r in group], [r["occupancy_pct"] for r in group]
        lines.append(f"BLOCK_M={bm:>3}: {min(regs)}-{max(regs)} regs/thread, {min(occ):.0f}-{max(occ):.0f}% "
                     f"occupancy, spills {max(r['n_spills'] for r in group)}, best "
                     f"{max(r['tflops'] for r in group):.1f} TFLOP/s")
    by_regs = sum(r["limited_by"] == "registers" for r in timed)
    top_occ = max(timed, key=lambda r: (r["occupancy_pct"], r["tflops"]))
    lines.append(f"registers limit residency in {by_regs}/{len(timed)} configs (bigger tiles hold more fp32 "
                 f"accumulator per thread, so fewer blocks fit); the highest occupancy "
                 f"({top_occ['occupancy_pct']:.0f}%) reaches {top_occ['tflops']:.1f} TFLOP/s, the best config "
                 f"runs at {best['occupancy_pct']:.0f}%")
    return lines


def interpreter_shape(requested: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """The shape the interpreter's sweep runs: the one asked for, with B, H and T cut down to `CPU_SHAPE`'s
    where they exceed it (the interpreter needs minutes for one config at a GPU-sized shape)."""
    return (*(min(n, limit) for n, limit in zip(requested[:3], CPU_SHAPE)), requested[3])


def main(opts) -> int:
    dtype = DTYPES[opts.dtype]
    if min(opts.batch, opts.heads, opts.seqlen) < 1 or not 1 <= opts.head_dim <= 256:
        print(f"flashtriton tune: -B, -H, -T must be >= 1 and -D in 1..256, got "
              f"{(opts.batch, opts.heads, opts.seqlen, opts.head_dim)}", file=sys.stderr)
        return 2
    requested = (opts.batch, opts.heads, opts.seqlen, opts.head_dim)
    shape = requested
    on_gpu = torch.cuda.is_available() and not INTERPRET
    if not on_gpu:
        if not INTERPRET:
            print("SKIP: flashtriton tune needs a CUDA GPU (or TRITON_INTERPRET=1 for the correctness sweep)")
            return 0
        shape = interpreter_shape(requested)
        print("SKIP: registers, occupancy and timings need a CUDA GPU. Interpreter: checking every config's "
              "output only.")
        if shape != requested:
            print(f"WARNING: the shape asked for, B,H,T,D={requested}, is too large for Triton's interpreter: "
                  f"the sweep runs B,H,T,D={shape} instead (at most B,H,T={CPU_SHAPE}); its results say nothing "
                  f"about B,H,T,D={requested}.")
    print(f"flashtriton tune: B,H,T,D={shape} {opts.dtype} causal={opts.causal}", flush=True)
    limits = sm_limits() if on_gpu else None
    rows = sweep(shape, dtype, opts.causal, "cuda" if on_gpu else "cpu", limits)
    print(table(rows))
    notes = conclusion(rows)
    if notes:
        print("\n".join(notes))
    bad = [r for r in rows if r["status"] in ("wrong", "error")]
    if bad:
        print(f"{len(bad)} config(s) failed: " + ", ".join(
            f"{r['BLOCK_M']}x{r['BLOCK_N']}/w{r['num_warps']}/s{r['num_stages']} {r['status']}" for r in bad))
    if opts.out:
        path = Path(opts.out) / "tune.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        report = dict(environment=environment(), mode="gpu" if on_gpu else "interpreter-correctness-only",
                      shape=dict(zip("BHTD", shape)), requested_shape=dict(zip("BHTD", requested)),
                      shape_replaced=shape != requested, dtype=opts.dtype, causal=opts.causal,
                      sm_limits=limits, rows=rows, conclusion=notes)
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {path}")
    return 1 if bad else 0
