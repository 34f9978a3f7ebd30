"""Where a short variant call spends its time: host work, GPU kernels, and synchronizations (issue 25's sinks with
a 128-key window, whose cost against the window alone is larger than its kernels').

For each case (window128 with and without sinks, D = 64 and 128, B=4 H=16 T=4096 bf16 causal, as the variants
suite runs them; `--cases` to choose) and each mode (forward with the gradient's leaves, backward of that forward):
- wall: the call's time per call in a loop of `--calls` calls between two synchronizations (the launch queue
  kept full, as a training step keeps it), median over `--repeats` loops;
- host: the time until the call returns, per call, with the GPU idle before each call (a synchronization before
  the call, none inside the timed span): the host path's Python and torch work and the launches;
- gpu: the sum of the call's kernels' device times (torch.profiler), and their names;
- syncs: the CUDA synchronizations and device-to-host copies the call makes (profiler events), which serialize
  host work behind the GPU's;
- breakdown: the host path's functions (`HOST_PATH`), each wrapped in a timer, with their inclusive host time per
  call (the wrappers add ~0.3 us each); what the backward's total has beyond `ops._gradients` is the autograd
  engine's own work.
Cases: `window128`, `sinks`, `sinks+window128`, `dense` (causal, no variant), with `@T` for another sequence
length at the same B·T (e.g. `dense@512`: B=32), and `+gluon` for the Gluon backward at any size (its floors,
`configs.GLUON_BWD_MIN_FLOPS` and `GLUON_BWD_D64_MIN_KEYS`, set to 0 for the case). Gradients are set to None
between calls, as the bench does. `noop`: a Python autograd Function that launches nothing (the floor of any
Python Function's host path, the autograd engine's share of it); `sdpa`: torch's SDPA on its cuDNN backend, the
same call (its backward a C++ autograd node).

    python benchmarks/variant_host.py --out DIR        # DIR/variant_host.json and DIR/variant_host.txt
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or not torch.cuda.is_available():
    sys.exit("variant_host.py measures the GPU's host path: run it on a CUDA GPU without TRITON_INTERPRET")

import flashtriton  # noqa: E402

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync",
               "cudaEventSynchronize")


@contextlib.contextmanager
def case_configs(name: str):
    """The configs a case runs under: `+gluon` in its name, the Gluon backward's floors at 0."""
    from flashtriton.configs import backward as cb

    saved = cb.GLUON_BWD_MIN_FLOPS, cb.GLUON_BWD_D64_MIN_KEYS
    if "+gluon" in name:
        cb.GLUON_BWD_MIN_FLOPS = cb.GLUON_BWD_D64_MIN_KEYS = 0
    try:
        yield
    finally:
        cb.GLUON_BWD_MIN_FLOPS, cb.GLUON_BWD_D64_MIN_KEYS = saved


class _Noop(torch.autograd.Function):
    """A Python autograd Function that launches nothing: the floor of any such call's host path (the `noop` case)."""

    @staticmethod
    def forward(ctx, q, k, v):
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, dout):
        return dout, None, None


def make_case(name: str, head_dim: int, H: int = 16, tokens: int = 16384):
    """(("fwd", forward), ("bwd", backward)): one case's two calls on fresh inputs (bf16, causal)."""
    name, _, seqlen = name.replace("+gluon", "").partition("@")
    T = int(seqlen or 4096)
    B = max(tokens // T, 1)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, T, H, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
               .requires_grad_() for _ in range(3))
    sink = (torch.randn(H, device="cuda", dtype=torch.float32, generator=gen).requires_grad_()
            if "sinks" in name else None)
    window = (127, 0) if "window128" in name else (-1, -1)

    def forward():
        if name == "noop":
            return _Noop.apply(q, k, v)
        if name == "sdpa":
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                                                        is_causal=True).transpose(1, 2)
        return flashtriton.flash_attn_func(q, k, v, causal=True, window_size=window, learnable_sink=sink)

    leaves = [t for t in (q, k, v, sink) if t is not None]
    out = forward()
    dout = torch.randn_like(out)

    def backward():  # of one kept forward graph, its gradients set to None after each call (as the bench does)
        out.backward(dout, retain_graph=True)
        for t in leaves:
            t.grad = None

    return (("fwd", forward), ("bwd", backward))


def measure(name: str, head_dim: int, calls: int, repeats: int) -> dict:
    with case_configs(name):
        return _measure(name, head_dim, calls, repeats)


def _measure(name: str, head_dim: int, calls: int, repeats: int) -> dict:
    result = {"case": name, "head_dim": head_dim}
    for mode, fn in make_case(name, head_dim):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        walls = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) / calls * 1e6)
        hosts = []
        for _ in range(repeats * calls):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            hosts.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels, syncs, gpu_us = [], [], 0.0
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels.append(f"{e.name[:60]} {e.device_time:.1f}us")
                gpu_us += e.device_time
            elif e.name in SYNC_EVENTS:
                syncs.append(e.name)
        result[mode] = {"wall_us": statistics.median(walls), "host_us": statistics.median(hosts), "gpu_us": gpu_us,
                        "kernels": kernels, "syncs": syncs}
    return result


# (module, attribute) of the functions on a call's host path whose inclusive time the breakdown reports.
HOST_PATH = (
    ("flashtriton", "flash_attn_func"), ("flashtriton.interface", "attention"), ("flashtriton.ops", "_forward_impl"),
    ("flashtriton.ops", "attention_forward"), ("flashtriton.kernels.forward", "launch_forward"),
    ("flashtriton.validation", "check_tensors"), ("flashtriton.validation", "check_sink"),
    ("flashtriton.validation", "check_alibi"), ("flashtriton.validation", "check_heads_and_dims"),
    ("flashtriton.validation", "check_int32_offsets"), ("flashtriton.validation", "plain_tensors"),
    ("flashtriton.ops", "plain_tensors"), ("flashtriton.ops", "_setup_context"),
    ("flashtriton.ops", "_gradients"), ("flashtriton.ops", "_backward_impl"), ("flashtriton.ops", "_not_differentiable"),
    ("flashtriton.kernels.backward", "attention_backward"), ("flashtriton.kernels.backward", "_plan_key"),
    ("flashtriton.kernels.backward", "_backward_plan"), ("flashtriton.kernels.backward", "_run_preprocess"),
    ("flashtriton.kernels.launch", "KeptLaunch.__call__"), ("flashtriton.kernels.backward", "tma_ok"),
    ("flashtriton.kernels.backward", "_visible_fwd_flops_per_row"), ("flashtriton.kernels.dispatch", "supports"),
    ("flashtriton.kernels.dispatch", "gluon_bwd_allowed"), ("flashtriton.configs", "gluon_bwd_config"),
    ("flashtriton.configs", "default_bwd_configs"),
    ("flashtriton.kernels.backward_gluon_launch", "launch_dkdv_gluon"),
    ("flashtriton.kernels.backward_gluon_launch", "launch_dq_gluon"),
    ("flashtriton.kernels.backward_gluon_launch", "launch_dense"),
    ("flashtriton.kernels.backward_gluon_launch", "_launch"), ("flashtriton.kernels.forward", "launch"),
    ("flashtriton.kernels.forward", "_launch_dense_tma"), ("flashtriton.kernels.forward", "_dense_tma_plan"),
    ("flashtriton.kernels.forward_gluon_launch", "launch"),
)


def breakdown(name: str, head_dim: int, calls: int = 100) -> dict:
    """Per mode, the inclusive host time per call (us) of each `HOST_PATH` function the call reaches, and the
    call's own total, with the GPU idle before each call."""
    import importlib

    totals: dict = {}
    saved = []

    def timed(label, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[label] = totals.get(label, 0.0) + time.perf_counter() - t0
        return wrapper

    for module_name, attr in HOST_PATH:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        *owners, attr = attr.split(".")  # (a method: "Class.method")
        owner = module
        for o in owners:
            owner = getattr(owner, o, None)
        fn = getattr(owner, attr, None)
        if callable(fn):
            saved.append((owner, attr, fn))
            setattr(owner, attr, timed(f"{module_name.replace('flashtriton.', '')}.{'.'.join((*owners, attr))}", fn))
    try:
        with case_configs(name):
            return _breakdown(name, head_dim, calls, totals)
    finally:
        for module, attr, fn in saved:
            setattr(module, attr, fn)


def _breakdown(name: str, head_dim: int, calls: int, totals: dict) -> dict:
    result = {}
    for mode, fn in make_case(name, head_dim):
        for _ in range(3):
            fn()
        totals.clear()
        total = 0.0
        for _ in range(calls):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            total += time.perf_counter() - t0
        torch.cuda.synchronize()
        result[mode] = {"total": total / calls * 1e6,
                        **{k: v / calls * 1e6 for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}}
    return result


def profile_backward(name: str, head_dim: str, calls: int = 50) -> list[str]:
    """cProfile's top functions by cumulative time over `calls` backward calls of one case."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    with case_configs(name):
        backward = dict(make_case(name, int(head_dim)))["bwd"]
        for _ in range(3):
            backward()
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(calls):
            backward()
        prof.disable()
        torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(40)
    return [f"cProfile, {calls} backward calls of {name} D={head_dim} (by cumulative time):",
            *buf.getvalue().splitlines()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="window128,sinks+window128,sinks,dense,dense@512,dense@1024")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--profile", default="sinks+window128:128",
                   help="CASE:D[,CASE:D...] whose backward's host path cProfile lists (by cumulative time); empty: none")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows, lines = [], []
    for d in (int(x) for x in args.head_dims.split(",")):
        for name in args.cases.split(","):
            r = measure(name, d, args.calls, args.repeats)
            rows.append(r)
            for mode in ("fwd", "bwd"):
                m = r[mode]
                lines.append(f"{name:>16} D={d:<4} {mode}: wall {m['wall_us']:8.1f} us  host {m['host_us']:8.1f} us  "
                             f"gpu {m['gpu_us']:8.1f} us  syncs {len(m['syncs'])} {sorted(set(m['syncs']))}")
                lines.extend(f"{'':>24}{k}" for k in m["kernels"])
            r["breakdown"] = breakdown(name, d)
            for mode, times in r["breakdown"].items():
                lines.append(f"{'':>10}{mode} host breakdown (inclusive us per call, the GPU idle before each):")
                lines.extend(f"{'':>14}{t:8.1f}  {label}" for label, t in times.items())
    for case in filter(None, args.profile.split(",")):
        lines.extend(profile_backward(*case.split(":")))
    text = "\n".join([f"{torch.cuda.get_device_name()} torch {torch.__version__}", *lines])
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "variant_host.json"), "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.join(args.out, "variant_host.txt"), "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
