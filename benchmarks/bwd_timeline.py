"""Where a timed backward's time goes on the GPU: the kernels, and the GPU's idle time between them, inside the
loop `triton.testing.do_bench` runs (grads set to None, L2 flushed, start event, the call, end event).

For each case (bf16, causal) and provider (flashtriton; SDPA's cuDNN backend on the dense calls), the same
`torch.autograd.grad` of one retained forward is
1. timed by do_bench (the bench's reading; the median of --rounds rounds in rotating order, `bench_core.time_in_rounds`);
2. run --iters times in do_bench's loop without a profiler: the host's time to issue the loop against the time until
   the GPU is done (a host that issues slower than the GPU runs starves it inside the timed span);
3. run --iters times in that loop under torch.profiler: per iteration, the span from the flush's end to the last
   kernel's end, the kernels' own times, and the idle time before the first kernel and between kernels.

    python benchmarks/bwd_timeline.py --out DIR [--cases dense4k,dense4k_d64,window4096] [--iters 20]

writes DIR/bwd_timeline.json (rows with the GPU, torch, triton and git sha) and prints a table. A diagnostic:
it explains a reading, the bench's suites give the numbers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import flashtriton
from flashtriton.tools import bench_core as C

CASES = {  # name: (B, H, T, D, window)
    "dense4k": (4, 16, 4096, 128, (-1, -1)),
    "dense4k_d64": (4, 32, 4096, 64, (-1, -1)),
    "dense16k": (1, 16, 16384, 128, (-1, -1)),
    "window4096": (1, 16, 16384, 128, (4095, 0)),
    "window1024": (1, 16, 16384, 128, (1023, 0)),
}


def backward_call(provider: str, case: str):
    """(call, leaves): the backward of one retained causal forward of `case` by `provider`."""
    B, H, T, D, window = CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(B, T, H, D, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(4))
    if provider == "flashtriton":
        leaves = [t.requires_grad_() for t in (q, k, v)]
        out = flashtriton.flash_attn_func(*leaves, causal=True, window_size=window)
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        leaves = [t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
        dout = dout.transpose(1, 2).contiguous()
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
    return (lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)), leaves


def do_bench_loop(call, leaves, iters: int, cache, events=None) -> None:
    """do_bench's timed loop: grads to None, the L2 flushed, the call between two events."""
    for i in range(iters):
        for t in leaves:
            t.grad = None
        cache.zero_()
        if events:
            events[i][0].record()
        call()
        if events:
            events[i][1].record()


def host_and_gpu(call, leaves, iters: int, cache) -> dict:
    """The host's time to issue `iters` iterations and the time until the GPU has run them (ms per iteration)."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    do_bench_loop(call, leaves, 3, cache)
    torch.cuda.synchronize()
    start = time.perf_counter()
    do_bench_loop(call, leaves, iters, cache, events)
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    done = time.perf_counter() - start
    spans = [a.elapsed_time(b) for a, b in events]
    return dict(host_issue_ms=issued * 1e3 / iters, gpu_done_ms=done * 1e3 / iters, event_ms=statistics.median(spans))


def timeline(call, leaves, iters: int, cache) -> dict:
    """Per iteration under torch.profiler: the span from the flush's end to the last kernel's end, the kernels'
    time, the idle time before the first kernel and between kernels (medians, µs), and the kernels' names."""
    do_bench_loop(call, leaves, 3, cache)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        do_bench_loop(call, leaves, iters, cache)
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    flush = cache.numel() * cache.element_size()
    iterations, current = [], None
    for e in kernels:  # each iteration starts at its flush (a fill of the cache: the only fill of that size)
        if "fill" in e.name.lower() or "zero" in e.name.lower():
            if current is not None:
                iterations.append(current)
            current = dict(flush_end=e.time_range.end, kernels=[])
        elif current is not None:
            current["kernels"].append((e.name, e.time_range.start, e.time_range.end))
    if current is not None:
        iterations.append(current)
    rows = []
    for it in iterations:
        ks = it["kernels"]
        if not ks:
            continue
        busy = sum(end - start for _, start, end in ks)
        span = ks[-1][2] - it["flush_end"]
        before = ks[0][1] - it["flush_end"]
        rows.append(dict(span=span, busy=busy, before_first=before, between=span - busy - before))
    med = {key: statistics.median(r[key] for r in rows) for key in ("span", "busy", "before_first", "between")}
    names = sorted({name[:60] for it in iterations for name, _, _ in it["kernels"]})
    return dict(**{f"{k}_us": v for k, v in med.items()}, iterations=len(rows), kernels=names, flush_bytes=flush)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="dense4k,dense4k_d64,window4096")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    env = C.environment()
    cache = torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda")  # do_bench's flush
    rows = []
    for case in args.cases.split(","):
        providers = ["flashtriton"] + (["sdpa_cudnn"] if CASES[case][4] == (-1, -1) else [])
        calls = {p: backward_call(p, case) for p in providers}
        bench = C.time_in_rounds({p: c for p, (c, _) in calls.items()}, args.rounds)
        for p, (call, leaves) in calls.items():
            row = dict(env, case=case, shape=CASES[case], provider=p, do_bench_ms=statistics.median(bench[p]),
                       rounds_ms=bench[p], **host_and_gpu(call, leaves, args.iters, cache),
                       **timeline(call, leaves, args.iters, cache))
            rows.append(row)
            print(f"{case:12s} {p:12s} do_bench {row['do_bench_ms'] * 1e3:7.1f} us | loop: host issues "
                  f"{row['host_issue_ms'] * 1e3:7.1f} us/it, GPU done {row['gpu_done_ms'] * 1e3:7.1f} us/it, events "
                  f"{row['event_ms'] * 1e3:7.1f} | profiled: span {row['span_us']:7.1f} kernels {row['busy_us']:7.1f} "
                  f"idle before {row['before_first_us']:6.1f} between {row['between_us']:6.1f}", flush=True)
            print("    " + ", ".join(row["kernels"]), flush=True)
    C.write_rows(args.out, "bwd_timeline.json", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
