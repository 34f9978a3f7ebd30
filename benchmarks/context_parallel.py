"""Context parallelism's cost of chunking and merging on one GPU (issue 30): the ring's per-chunk calls against the
single full-sequence kernel call, at T = 128k, causal, D = 128 by default.

Providers, each first checked against the full call (and the full call against float32 on sampled rows), then
timed (forward alone, and forward + backward):
  full     flashtriton.flash_attn_func on the whole sequence (the baseline)
  world1   flashtriton.parallel.ring_attention on a process group of one (chunk_forward / chunk_backward of the one
           shard, the fp32 merge buffer and the fp32 gradient accumulators; no communication)
  ring8    a zigzag ring of 8 ranks simulated in this process: every rank's every step (`parallel.ring.step_calls`,
           chunk_forward, OnlineMerge; the backward's chunk_backward accumulating into fp32 dQ and per-shard dK/dV)
           run one after another: the 8 ranks' kernels and merges, no communication
Timing: `triton.testing.do_bench` (L2 flushed, median) in rounds of rotating provider order after 100 ms of warmup;
a provider's cost is the median over rounds of its time over the full call's in the same round. Without a GPU
(TRITON_INTERPRET=1, tiny shapes) the same runs with wall-clock timing, as a smoke test of the script.

    python benchmarks/context_parallel.py --out DIR              # writes DIR/context_parallel.json, prints a table
    TRITON_INTERPRET=1 python benchmarks/context_parallel.py --seqlen 256 --heads 2 --head-dim 16 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import flashtriton
from flashtriton import parallel
from flashtriton._env import INTERPRET
from flashtriton.chunked import OnlineMerge, chunk_backward, chunk_forward
from flashtriton.parallel.ring import step_calls

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
RTOL = {torch.float16: 2e-2, torch.bfloat16: 8e-2, torch.float32: 1e-4}  # the bench's rule: max |x - ref| <= rtol
# · max(1, max |ref|) (benchmarks/README.md, "Accuracy check first")


def local_shard(x: torch.Tensor, rank: int, world: int, layout: str) -> torch.Tensor:
    """Rank `rank`'s shard of a full (B, T, H, D) sequence, as `parallel.shard` cuts it (no group needed)."""
    n = x.shape[1] // world
    return torch.cat([x[:, s.pos:s.pos + s.length] for s in parallel.segments(layout, rank, world, n)], dim=1)


def gather(shards: list[torch.Tensor], layout: str) -> torch.Tensor:
    world, n = len(shards), shards[0].shape[1]
    out = shards[0].new_empty((shards[0].shape[0], world * n, *shards[0].shape[2:]))
    for rank, part in enumerate(shards):
        for s in parallel.segments(layout, rank, world, n):
            out[:, s.pos:s.pos + s.length] = part[:, s.row:s.row + s.length]
    return out


class SimulatedRing:
    """The work of a `world`-rank ring, every rank in this process: forward() -> per-rank (out, lse);
    backward(douts) -> per-rank (dq, dk, dv) (dk, dv of each rank's own shard)."""

    def __init__(self, q, k, v, causal: bool, world: int, layout: str = "zigzag"):
        self.causal, self.world, self.layout = causal, world, layout
        self.qs, self.ks, self.vs = ([local_shard(t, r, world, layout) for r in range(world)] for t in (q, k, v))
        self.scale = q.shape[-1] ** -0.5
        n = self.qs[0].shape[1]
        self.plans = [[(src, step_calls(parallel.segments(layout, r, world, n), parallel.segments(layout, src, world, n),
                                        causal, (-1, -1))) for src in ((r - s) % world for s in range(world))]
                      for r in range(world)]

    def forward(self):
        outs, lses = [], []
        for r in range(self.world):
            q = self.qs[r]
            acc = OnlineMerge(q.shape[0], q.shape[1], q.shape[2], self.vs[0].shape[-1], q.device)
            for src, calls in self.plans[r]:
                k, v = self.ks[src], self.vs[src]
                for c in calls:
                    part = chunk_forward(q[:, c.q_rows], k[:, c.k_rows], v[:, c.k_rows], c.q_pos, c.k_pos, c.causal,
                                         c.window, self.scale)
                    acc.add(*part, rows=c.q_rows)
            outs.append(acc.out.to(q.dtype))
            lses.append(acc.lse.clone())
        return outs, lses

    def backward(self, douts, outs, lses):
        f32 = dict(dtype=torch.float32, device=self.qs[0].device)
        dqs = [torch.zeros(t.shape, **f32) for t in self.qs]
        dks = [torch.zeros(t.shape, **f32) for t in self.ks]
        dvs = [torch.zeros(t.shape, **f32) for t in self.vs]
        for r in range(self.world):
            q, dout, out, lse = self.qs[r], douts[r], outs[r], lses[r]
            for src, calls in self.plans[r]:
                k, v = self.ks[src], self.vs[src]
                for c in calls:
                    chunk_backward(dout[:, c.q_rows], q[:, c.q_rows], k[:, c.k_rows], v[:, c.k_rows], out[:, c.q_rows],
                                   lse[:, :, c.q_rows], c.q_pos, c.k_pos, c.causal, c.window, self.scale,
                                   dq=dqs[r][:, c.q_rows], dk=dks[src][:, c.k_rows], dv=dvs[src][:, c.k_rows],
                                   accumulate=True)
        dtype = self.qs[0].dtype
        return [[t.to(dtype) for t in ts] for ts in (dqs, dks, dvs)]


def providers(q, k, v, dout, causal, solo):
    """name -> (forward fn, forward + backward fn returning (out, dq, dk, dv) of the whole sequence)."""
    def full_fwd():
        return flashtriton.flash_attn_func(q, k, v, causal=causal)

    def full_fwd_bwd():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = flashtriton.flash_attn_func(*leaves, causal=causal)
        out.backward(dout)
        return out, *(t.grad for t in leaves)

    def world1_fwd():
        return parallel.ring_attention(q, k, v, causal=causal, group=solo, layout="contiguous")

    def world1_fwd_bwd():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = parallel.ring_attention(*leaves, causal=causal, group=solo, layout="contiguous")
        out.backward(dout)
        return out, *(t.grad for t in leaves)

    ring = SimulatedRing(q, k, v, causal, 8)

    def ring8_fwd():
        return gather(ring.forward()[0], "zigzag")

    douts = [local_shard(dout, r, 8, "zigzag") for r in range(8)]

    def ring8_fwd_bwd():
        outs, lses = ring.forward()
        dqs, dks, dvs = ring.backward(douts, outs, lses)
        return gather(outs, "zigzag"), gather(dqs, "zigzag"), gather(dks, "zigzag"), gather(dvs, "zigzag")

    return {"full": (full_fwd, full_fwd_bwd), "world1": (world1_fwd, world1_fwd_bwd),
            "ring8": (ring8_fwd, ring8_fwd_bwd)}


def max_error(got, want) -> float:
    """max |got - want| / max(1, max |want|)."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1)).item()


def reference_error(q, k, v, out, causal, rows=128, heads=2) -> float:
    """The full call's error on its last `rows` rows of the first `heads` heads against float32 attention."""
    t = q.shape[1]
    qs = q[:1, t - rows:, :heads].float()
    kv_heads = [h // (q.shape[2] // k.shape[2]) for h in range(heads)]  # GQA: each query head's kv head
    ks, vs = (x[:1, :, kv_heads].float() for x in (k, v))
    scores = torch.einsum("bshd,bthd->bhst", qs, ks) * q.shape[-1] ** -0.5
    if causal:
        pos = torch.arange(t - rows, t, device=q.device)[:, None]
        scores = scores.masked_fill(torch.arange(t, device=q.device)[None, :] > pos, float("-inf"))
    ref = torch.einsum("bhst,bthd->bshd", scores.softmax(-1), vs)
    return max_error(out[:1, t - rows:, :heads], ref)


def timer(fn, warmup_ms=100, rep_ms=100) -> float:
    """Median ms: do_bench on a GPU; without one (the interpreter's smoke run) the best of three wall-clock runs."""
    if torch.cuda.is_available() and not INTERPRET:
        import triton

        return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def run(args) -> dict:
    device = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device=device).manual_seed(0)
    shape_q = (args.batch, args.seqlen, args.heads, args.head_dim)
    shape_k = (args.batch, args.seqlen, args.kv_heads or args.heads, args.head_dim)
    q = torch.randn(shape_q, generator=gen, device=device, dtype=dtype)
    k, v = (torch.randn(shape_k, generator=gen, device=device, dtype=dtype) for _ in range(2))
    dout = torch.randn(shape_q, generator=gen, device=device, dtype=dtype)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    solo = dist.new_group([0])
    fns = providers(q, k, v, dout, args.causal, solo)
    checks = {}
    for mode, index in (("fwd", 0), ("fwd_bwd", 1)):
        with torch.no_grad() if mode == "fwd" else torch.enable_grad():
            base = fns["full"][index]()
            base = base if isinstance(base, tuple) else (base,)
            checks[("full", mode)] = {"err_vs_float32": reference_error(q, k, v, base[0], args.causal)}
            for name in ("world1", "ring8"):
                got = fns[name][index]()
                got = got if isinstance(got, tuple) else (got,)
                errs = {f"err_{what}_vs_full": max_error(a, b) for what, a, b in zip(("out", "dq", "dk", "dv"), got, base)}
                checks[(name, mode)] = {**errs, "ok": all(e <= RTOL[dtype] for e in errs.values())}
            checks[("full", mode)]["ok"] = checks[("full", mode)]["err_vs_float32"] <= RTOL[dtype]
            del base, got
    rows = []
    for mode, index in (("fwd", 0), ("fwd_bwd", 1)):
        names = [n for n in fns if checks[(n, mode)]["ok"] or n == "full"]
        times = {n: [] for n in names}
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                fn = fns[name][index]
                with torch.no_grad() if mode == "fwd" else torch.enable_grad():
                    times[name].append(timer(fn, args.warmup, args.rep))
        for name in fns:
            row = dict(provider=name, mode=mode, **checks[(name, mode)])
            if name in times:
                ratios = sorted(t / f for t, f in zip(times[name], times["full"]))
                row.update(ms=sorted(times[name])[len(times[name]) // 2], rounds_ms=times[name],
                           ratio_to_full=ratios[len(ratios) // 2])
            rows.append(row)
    return {"rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--seqlen", type=int, default=131072)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=0, help="0: as many as --heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--causal", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=100, help="do_bench warmup, ms")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    args = parser.parse_args()
    args.causal = bool(args.causal)
    if args.seqlen % 16:
        parser.error("--seqlen must be a multiple of 16 (a zigzag ring of 8 cuts it in 16 chunks)")
    result = run(args)
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        sha = ""
    result.update(config=vars(args), sha=sha, torch=torch.__version__,
                  gpu=torch.cuda.get_device_name() if torch.cuda.is_available() and not INTERPRET else "interpreter")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "context_parallel.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'provider':8} {'mode':8} {'ms':>10} {'x full':>7}  check")
    for row in result["rows"]:
        errs = ", ".join(f"{k}={v:.1e}" for k, v in row.items() if k.startswith("err"))
        ms = f"{row['ms']:10.3f} {row['ratio_to_full']:7.3f}" if "ms" in row else f"{'-':>10} {'-':>7}"
        print(f"{row['provider']:8} {row['mode']:8} {ms}  {'ok' if row['ok'] else 'FAIL'} ({errs})")
    print(f"wrote {path}")
    dist.destroy_process_group()
    return 0 if all(row["ok"] for row in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
