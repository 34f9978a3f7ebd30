"""Host time of one batch-1 decode call (`flash_attn_with_kvcache`): the Python work around the kernel launches.

Shape: batch 1, a 4096-key cache, 32 query heads over 8 kv heads, D=128, fp16, one new query token; four cases:
contiguous or paged (pages of 256) cache, with or without appending one new key/value (k, v). cache_seqlens is an
int32 tensor (4000 keys before the call).

Each call's wall time is taken with `time.perf_counter_ns` around the call alone, in blocks of `--block` calls that
the four cases take in turn (on a GPU `torch.cuda.synchronize()` before and after each block, so the launch queue
never fills and blocks the host); the result is the median over all calls after `--warmup` calls, in µs. Then
cProfile's top functions (by own time) over `--profile-calls` calls of each case.

Without a CUDA GPU (or with `--stub`) every kernel launch is a no-op (`stub_launches`): what is measured is the
host path's Python and torch work without Triton's launcher itself (`kernel.run`). Off the GPU the tensors are
plain CPU tensors and, so that the CPU takes the GPU's path, the device check lets them through, the split
heuristic sees the H200's 132 SMs, and the split-KV workspace and counters are kept between calls as on a GPU.
On a GPU without `--stub` the launches are real and the tensors CUDA tensors.

    python benchmarks/decode_host.py                       # CPU: stubbed launches
    python benchmarks/decode_host.py --out FILE.txt        # also write the report to FILE.txt
    python benchmarks/decode_host.py --stub                # on a GPU: CUDA tensors, launches stubbed

Run without TRITON_INTERPRET (the interpreter path is not the GPU's path).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time

import torch

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("decode_host.py measures the GPU's host path: run it without TRITON_INTERPRET")

import flashtriton  # noqa: E402
from flashtriton import validation  # noqa: E402
from flashtriton.kernels import decode_launch  # noqa: E402
from flashtriton.kernels import launch as launch_module  # noqa: E402

BATCH, CAPACITY, HEADS_Q, HEADS_KV, HEAD_DIM, PAGE_SIZE, CACHED = 1, 4096, 32, 8, 128, 256, 4000
H200_SMS = 132


class _NoLaunch:
    """Stands in for a kept compiled kernel (`launch.Relaunch`): called, it does nothing."""

    __slots__ = ()

    def __call__(self, *args, **kwargs):
        return None


def stub_launches() -> list[str]:
    """Replace every kernel launch on the decode path by a no-op; returns what was replaced. Every launching
    function of `kernels.launch` is replaced where `decode_launch` holds it, and in `kernels.launch` itself."""
    replaced = []
    no_launch = _NoLaunch()

    def launch(fn, grid, args, meta, *rest, **kw):
        return None

    def launch_and_keep(fn, grid, args, meta, *rest, **kw):
        return no_launch

    stubs = {"launch": launch, "launch_and_keep": launch_and_keep}
    for module in (launch_module, decode_launch):
        for name, stub in stubs.items():
            if hasattr(module, name):
                setattr(module, name, stub)
                replaced.append(f"{module.__name__}.{name}")
    launch_module.Relaunch.__call__ = lambda self, *args, **kw: None
    replaced.append("flashtriton.kernels.launch.Relaunch.__call__")
    if hasattr(decode_launch, "_decode_split_tuned"):  # the autotuned kernel (FLASHTRITON_AUTOTUNE=1 only)
        decode_launch._decode_split_tuned = type("_NoTune", (), {"__getitem__": lambda self, grid: launch})()
    if not torch.cuda.is_available():
        # CPU tensors without the interpreter: the device check lets them through (nothing runs), and the split
        # heuristic sees the H200's 132 SMs (as on the GPU: batch 1 takes split-KV with its workspace).
        validation.INTERPRET = True
        decode_launch._num_sms = lambda device: H200_SMS
        replaced.append("flashtriton.validation.INTERPRET (CPU tensors pass), decode_launch._num_sms (132)")
        # Off the GPU the split-KV workspace and ticket counters are allocated per call; on a GPU they are kept
        # per (GPU, stream): keep them here too, so that the CPU path allocates what the GPU path allocates.
        kept = {}
        original = decode_launch._stream_buffer

        def stream_buffer(kind, count, dtype, device):
            key = (kind, dtype, device)
            buf = kept.get(key)
            if buf is None or buf.numel() < count:
                buf = kept[key] = original(kind, max(count, 4096), dtype, device)
            return buf

        decode_launch._stream_buffer = stream_buffer
        replaced.append("flashtriton.kernels.decode_launch._stream_buffer (kept per (kind, dtype, device))")
    return replaced


def make_case(paged: bool, append: bool, device: str):
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=torch.float16)

    q = randn(BATCH, 1, HEADS_Q, HEAD_DIM)
    if paged:
        pages = CAPACITY // PAGE_SIZE
        shape = (BATCH * pages, PAGE_SIZE, HEADS_KV, HEAD_DIM)
        block_table = torch.arange(BATCH * pages, dtype=torch.int32).reshape(BATCH, pages).to(device)
    else:
        shape, block_table = (BATCH, CAPACITY, HEADS_KV, HEAD_DIM), None
    k_cache, v_cache = randn(*shape), randn(*shape)
    lens = torch.full((BATCH,), CACHED, dtype=torch.int32, device=device)
    k = randn(BATCH, 1, HEADS_KV, HEAD_DIM) if append else None
    v = randn(BATCH, 1, HEADS_KV, HEAD_DIM) if append else None

    def call():
        return flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lens,
                                                   block_table=block_table, causal=True)

    return call


CASES = {
    "contiguous, no append": (False, False),
    "contiguous, append k/v": (False, True),
    "paged, no append": (True, False),
    "paged, append k/v": (True, True),
}


def time_calls(calls: dict, per_case: int, warmup: int, block: int, cuda: bool) -> dict:
    """name -> (median, p10, p90) of the per-call wall time in µs. The cases take turns, a block of calls each
    (the order rotating), so that a slow spell of the machine falls on all of them alike."""
    clock = time.perf_counter_ns
    for call in calls.values():
        for _ in range(warmup):
            call()
    if cuda:
        torch.cuda.synchronize()
    times = {name: [] for name in calls}
    names = list(calls)
    rounds = -(-per_case // block)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            call, got = calls[name], times[name]
            if cuda:
                torch.cuda.synchronize()
            for _ in range(block):
                start = clock()
                call()
                got.append(clock() - start)
            if cuda:
                torch.cuda.synchronize()
    result = {}
    for name, got in times.items():
        us = sorted(t / 1000 for t in got)
        result[name] = statistics.median(us), us[len(us) // 10], us[(9 * len(us)) // 10]
    return result


def profile(call, calls: int, top: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).strip_dirs().sort_stats("tottime").print_stats(top)
    lines = text.getvalue().strip().splitlines()
    # keep the summary line and the table
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    summary = [line for line in lines[:start] if "function calls" in line]
    return "\n".join(summary + lines[start:])


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000, help="timed calls per case")
    parser.add_argument("--warmup", type=int, default=2000, help="untimed calls per case first")
    parser.add_argument("--block", type=int, default=200, help="calls between synchronizations (GPU)")
    parser.add_argument("--profile-calls", type=int, default=5000, help="calls under cProfile per case (0: none)")
    parser.add_argument("--top", type=int, default=20, help="functions in each profile")
    parser.add_argument("--stub", action="store_true", help="stub the launches on a GPU too (CPU: always)")
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    stubbed = args.stub or not cuda
    replaced = stub_launches() if stubbed else []
    device = "cuda" if cuda else "cpu"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "src"], capture_output=True,
                               text=True, check=False).stdout.strip()
    except OSError:
        commit, dirty = "?", ""
    lines = [
        "decode host time per call: flash_attn_with_kvcache, batch 1, cache 4096 (4000 cached), GQA 32/8, D=128, "
        "fp16, 1 new query token, causal",
        f"commit {commit}{' + uncommitted changes in src/' if dirty else ''}; python {platform.python_version()}, "
        f"torch {torch.__version__}; {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        f"device: {torch.cuda.get_device_name() if cuda else 'CPU (no GPU)'}; tensors on {device}; launches "
        f"{'STUBBED (no-ops): ' + ', '.join(replaced) if stubbed else 'real'}",
        f"per-call wall time (perf_counter_ns around each call), {args.calls} calls per case after {args.warmup} "
        f"warmup, in blocks of {args.block} that the cases take in turn"
        f"{', torch.cuda.synchronize() around each block' if cuda else ''}",
        "",
        f"{'case':<26} {'median us':>10} {'p10':>8} {'p90':>8}",
    ]
    with torch.no_grad():
        calls = {name: make_case(paged, append, device) for name, (paged, append) in CASES.items()}
        for name, (median, p10, p90) in time_calls(calls, args.calls, args.warmup, args.block, cuda).items():
            lines.append(f"{name:<26} {median:>10.2f} {p10:>8.2f} {p90:>8.2f}")
        if args.profile_calls:
            for name, call in calls.items():
                lines += ["", f"cProfile, {name}, {args.profile_calls} calls (sorted by own time):",
                          profile(call, args.profile_calls, args.top)]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return report


if __name__ == "__main__":
    main()
