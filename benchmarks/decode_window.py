"""Sliding-window decoding against the whole cache (issue 25): batch 8, a 32k-key cache, a 4k causal window.

`flash_attn_with_kvcache` with window_size=(4095, 0) must read only the window's keys: at least 6x faster than
the same call over the whole cache, and at least 80 % of the GPU's copy bandwidth over the bytes it reads
(K and V of 4096 keys per sequence and kv head, q and out). Every provider is first checked against float64 on
fresh random inputs, then timed by `triton.testing.do_bench` (L2 flushed, median) as a CUDA-graph replay (the GPU
time; a decode step's host time is not what is measured) and as a plain eager call, in rounds of rotating order
after 100 ms of warmup, each timing twice: after do_bench's L2 flush (which zeroes a buffer) and after a flush that
reads one (`time_read_flush` says why). Copy bandwidth: a 1 GiB device-to-device copy (read + write counted), in
the same run, under both flushes.

    python benchmarks/decode_window.py --out DIR      # writes DIR/decode_window.json, prints a table last
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

import torch
import triton

import flashtriton
from flashtriton.kernels import dispatch
from flashtriton.kernels.variant import Variant
from flashtriton.reference import attention_reference

BATCH, HEADS_Q, HEADS_KV, HEAD_DIM, CAPACITY, WINDOW = 8, 32, 8, 128, 32768, 4096


def make_inputs(dtype, page_size, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(BATCH, 1, HEADS_Q, HEAD_DIM, device="cuda", dtype=dtype, generator=gen)
    if page_size:
        pages = CAPACITY // page_size
        block_table = torch.randperm(BATCH * pages, device="cuda", generator=gen).reshape(BATCH, pages).int()
        shape = (BATCH * pages, page_size, HEADS_KV, HEAD_DIM)
    else:
        block_table, shape = None, (BATCH, CAPACITY, HEADS_KV, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    v_cache = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    seqlens = torch.full((BATCH,), CAPACITY, dtype=torch.int32, device="cuda")
    slopes = (2.0 ** (-8.0 * torch.arange(1, HEADS_Q + 1, device="cuda") / HEADS_Q)).float()
    sinks = torch.randn(HEADS_Q, device="cuda", generator=gen)
    return q, k_cache, v_cache, block_table, seqlens, slopes, sinks


PROVIDERS = {  # name: (window_size, softcap, ALiBi and sinks)
    "full": ((-1, -1), 0.0, False),
    "window": ((WINDOW - 1, 0), 0.0, False),
    "window_all": ((WINDOW - 1, 0), 30.0, True),  # + softcap, ALiBi, sinks
}


def call(name, inputs):
    q, k_cache, v_cache, block_table, seqlens, slopes, sinks = inputs
    window, softcap, extra = PROVIDERS[name]
    return lambda: flashtriton.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, block_table=block_table, causal=True, window_size=window,
        softcap=softcap, alibi_slopes=slopes if extra else None, learnable_sink=sinks if extra else None)


def check(name, inputs, dtype):
    """Max error against float64 over every sequence and head, and the same for the reference in `dtype`."""
    q, k_cache, v_cache, block_table, seqlens, slopes, sinks = inputs
    window, softcap, extra = PROVIDERS[name]
    out = call(name, inputs)()
    variant = Variant(causal=True, window=window, softcap=softcap, alibi_slopes=slopes if extra else None,
                      sinks=sinks if extra else None)
    keys = k_cache[block_table.long()].flatten(1, 2) if block_table is not None else k_cache
    values = v_cache[block_table.long()].flatten(1, 2) if block_table is not None else v_cache
    err = torch_err = 0.0
    for b in range(BATCH):
        ref = attention_reference(q[b:b + 1], keys[b:b + 1], values[b:b + 1], variant=variant)
        same = attention_reference(q[b:b + 1], keys[b:b + 1], values[b:b + 1], variant=variant, dtype=dtype)
        err = max(err, (out[b:b + 1].double() - ref).abs().max().item())
        torch_err = max(torch_err, (same.double() - ref).abs().max().item())
    floor = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    return {"err": err, "torch_err": torch_err, "ok": bool(err <= 2 * torch_err + floor)}


def graphed(fn):
    """fn captured in a CUDA graph (after a warm call that compiles and keeps its launch plan): its replay."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay


_FLUSH = {}


def time_read_flush(fn, reps=100):
    """Median GPU time (ms) of fn after the L2 is flushed by *reading* 512 MiB (a sum), which leaves no dirty
    lines: do_bench's flush zeroes a buffer, and the L2's dirty lines of it are written back during the timed call
    (tens of MB: a fixed ~10 us on top of a 50 us call, the same on a 1 GiB one). A decode step follows reads of
    weights, not writes of a buffer larger than the L2."""
    buf = _FLUSH.get("buf")
    if buf is None:
        buf = _FLUSH["buf"] = torch.empty(2**27, dtype=torch.float32, device="cuda").normal_()
    end = time.perf_counter() + 0.1  # ~100 ms of warmup
    while time.perf_counter() < end:
        fn()
        torch.cuda.synchronize()
    events = []
    for _ in range(reps):
        buf.sum()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        events.append((start, stop))
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in events)
    return times[len(times) // 2]


def time_call(fn, flush):
    if flush == "read":
        return time_read_flush(fn)
    return triton.testing.do_bench(fn, warmup=100, rep=200, return_mode="median")


def bytes_read(name, dtype):
    keys = CAPACITY if PROVIDERS[name][0] == (-1, -1) else WINDOW
    kv = 2 * BATCH * HEADS_KV * keys * HEAD_DIM * dtype.itemsize
    return kv + 2 * BATCH * HEADS_Q * HEAD_DIM * dtype.itemsize  # K, V; q and out


def copy_bandwidth(rounds=3, flush="zero"):
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = min(time_call(lambda: dst.copy_(src), flush) for _ in range(rounds))
    del src, dst
    return 2 * 2**30 / (ms * 1e-3) / 1e9  # GB/s, read + write


FLUSHES = ("zero", "read")  # do_bench's L2 flush (zeroing a buffer), or a read of one (`time_read_flush`)


def run(dtype, page_size, schedule, rounds):
    inputs = make_inputs(dtype, page_size)
    rows = []
    with torch.no_grad(), dispatch.force("auto", schedule):
        checks = {name: check(name, inputs, dtype) for name in PROVIDERS}
        fns = {name: call(name, inputs) for name in PROVIDERS}
        replays = {name: graphed(fn) for name, fn in fns.items()}
        keys = [(name, mode, flush) for name in PROVIDERS for mode in ("graph", "eager") for flush in FLUSHES]
        times = {key: [] for key in keys}
        names = list(PROVIDERS)
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]  # rotate the providers between rounds
            for name in order:
                for mode, fn in (("graph", replays[name]), ("eager", fns[name])):
                    for flush in FLUSHES:
                        times[(name, mode, flush)].append(time_call(fn, flush))
    for name, mode, flush in keys:
        ms = sorted(times[(name, mode, flush)])[len(times[(name, mode, flush)]) // 2]
        rows.append(dict(dtype=str(dtype).split(".")[-1], page_size=page_size or 0, schedule=schedule,
                         provider=name, mode=mode, flush=flush, ms=ms, rounds=times[(name, mode, flush)],
                         bytes=bytes_read(name, dtype), gbps=bytes_read(name, dtype) / (ms * 1e-3) / 1e9,
                         **checks[name]))
    del inputs
    torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--dtypes", default="fp16,bf16")
    parser.add_argument("--page-sizes", default="0,256", help="0: a contiguous cache")
    parser.add_argument("--schedules", default="auto,split", help="decode schedules (auto, split, stream)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    copy_gbps = {flush: copy_bandwidth(flush=flush) for flush in FLUSHES}
    rows = []
    for dt in args.dtypes.split(","):
        for page_size in (int(p) for p in args.page_sizes.split(",")):
            for schedule in args.schedules.split(","):
                rows += run(dtypes[dt], page_size, schedule, args.rounds)
    full = {(r["dtype"], r["page_size"], r["schedule"], r["mode"], r["flush"]): r["ms"] for r in rows
            if r["provider"] == "full"}
    for r in rows:
        r["speedup_vs_full"] = full[(r["dtype"], r["page_size"], r["schedule"], r["mode"], r["flush"])] / r["ms"]
        r["of_copy_bandwidth"] = r["gbps"] / copy_gbps[r["flush"]]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        sha = ""
    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, git=sha,
                  shape=dict(batch=BATCH, heads_q=HEADS_Q, heads_kv=HEADS_KV, head_dim=HEAD_DIM, cache=CAPACITY,
                             window=WINDOW),
                  copy_gbps=copy_gbps, rows=rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "decode_window.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("copy bandwidth (read + write), GB/s: " + ", ".join(f"{f} flush {g:.0f}" for f, g in copy_gbps.items()))
    print(f"{'dtype':5} {'page':>4} {'sched':6} {'provider':11} {'mode':5} {'flush':5} {'us':>8} {'GB/s':>6} "
          f"{'copy%':>6} {'vs full':>7} {'ok':>3}")
    for r in rows:
        print(f"{r['dtype']:5} {r['page_size']:>4} {r['schedule']:6} {r['provider']:11} {r['mode']:5} {r['flush']:5} "
              f"{r['ms'] * 1e3:8.1f} {r['gbps']:6.0f} {100 * r['of_copy_bandwidth']:5.0f}% "
              f"{r['speedup_vs_full']:6.2f}x {'yes' if r['ok'] else 'NO':>3}")


if __name__ == "__main__":
    main()
