"""A/B of the backward's preprocess as a kernel of its own against the same work inside the dQ kernel, on the calls
the Triton backward runs (`configs.backward.TRITON_BWD_FUSED_DELTA`) and on the dense Gluon ones
(`GLUON_BWD_FUSED_DELTA`, `GLUON_BWD_FUSED_SINK`), beside SDPA's cuDNN backend on the same dense call.

Cases (bf16, B·T = 16384 tokens, H·D = 2048): T = 256, 512, 1024 at D = 64 and 128, causal and not (the Triton
kernels below `configs.backward.GLUON_BWD_MIN_FLOPS`, host-bound on the H200), with a sink and a 128-key window
(gpt-oss' sliding layers, T = 4096: the Triton kernels too), and with a sink at T = 4096 D = 128 causal (the Gluon
kernels). Each case's gradients are checked against each other first (the same sums but for delta's order: within
1e-2 of their scale), then the backward (`torch.autograd.grad` of one forward, retained; the host work included) is
timed by `triton.testing.do_bench` (L2 flushed) in rounds whose order rotates (`bench_core.time_in_rounds`), and
each candidate's kernels are listed (torch.profiler).

    python benchmarks/fused_delta_ab.py --out DIR [--rounds 5] [--cases short,sinks]

writes DIR/fused_delta_ab.json (rows with the GPU, torch, triton and git sha) and prints a table.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import flashtriton
from flashtriton import configs
from flashtriton.tools import bench_core as C

SWITCHES = {  # candidate: configs.backward's switches during its calls
    "preprocess kernel": dict(TRITON_BWD_FUSED_DELTA=False, GLUON_BWD_FUSED_DELTA=False, GLUON_BWD_FUSED_SINK=False),
    "in the dQ kernel": dict(TRITON_BWD_FUSED_DELTA=True, GLUON_BWD_FUSED_DELTA=True, GLUON_BWD_FUSED_SINK=True),
}


def cases(which: set) -> list:
    """(label, B, H, T, D, causal, window, sinks)."""
    out = []
    if "short" in which:
        for d in (64, 128):
            for t in (256, 512, 1024):
                for causal in (False, True):
                    out.append((f"T={t} D={d}{' causal' if causal else ''}", 16384 // t, 2048 // d, t, d, causal,
                                (-1, -1), False))
    if "sinks" in which:
        for d in (64, 128):
            out.append((f"sinks + window 128, T=4096 D={d}", 4, 2048 // d, 4096, d, True, (127, 0), True))
        out.append(("sinks, T=4096 D=128 causal (Gluon)", 4, 16, 4096, 128, True, (-1, -1), True))
    return out


def backward_call(case, switches: dict):
    """(call, grads) of one forward of `case` under `switches`; the call is the timed backward."""
    _, B, H, T, D, causal, window, with_sinks = case
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    sink = torch.randn(H, device="cuda", generator=gen).requires_grad_() if with_sinks else None
    dout = torch.randn(B, T, H, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    out = flashtriton.flash_attn_func(q, k, v, causal=causal, window_size=window, learnable_sink=sink)
    leaves = (q, k, v) + ((sink,) if sink is not None else ())

    def call():
        with C.switched(configs.backward, **switches):
            return torch.autograd.grad(out, leaves, dout, retain_graph=True)

    return call, call()


def cudnn_call(case):
    """SDPA's cuDNN backward of the same dense call (no window, no sink), or None where the case has either."""
    _, B, H, T, D, causal, window, with_sinks = case
    if with_sinks or window != (-1, -1):
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    dout = torch.randn(B, H, T, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def kernels_of(call) -> list:
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return sorted({e.key[:40] for e in prof.key_averages()
                   if e.device_type == torch.autograd.DeviceType.CUDA and "flush" not in e.key})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="short,sinks")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    env = C.environment()
    rows = []
    for case in cases(set(args.cases.split(","))):
        calls, reference = {}, None
        for label, switches in SWITCHES.items():
            calls[label], grads = backward_call(case, switches)
            if reference is None:
                reference = grads
            for name, g, r in zip(("dq", "dk", "dv", "dsink"), grads, reference):
                scale = r.float().abs().max().item()
                err = (g.float() - r.float()).abs().max().item()
                if not err <= 1e-2 * max(scale, 1e-6):
                    raise AssertionError(f"{case[0]} {label}: {name} differs from the preprocess kernel's by {err:.3g}")
        cudnn = cudnn_call(case)
        if cudnn is not None:
            calls["sdpa_cudnn"] = cudnn
        times = C.time_in_rounds(calls, args.rounds)
        base = statistics.median(times["preprocess kernel"])
        for label, call in calls.items():
            ms = statistics.median(times[label])
            rows.append(dict(env, case=case[0], shape=case[1:], candidate=label, ms=ms, rounds_ms=times[label],
                             over_preprocess_kernel=base / ms, kernels=kernels_of(call)))
            print(f"{case[0]:36s} {label:18s} {ms * 1e3:9.1f} us  x{base / ms:.3f} of the preprocess kernel's",
                  flush=True)
    C.write_rows(args.out, "fused_delta_ab.json", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
