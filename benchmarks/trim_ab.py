"""A/B of the Gluon kernels' products over the head's own columns (`configs.forward.GLUON_QK_TRIM`: the forward's
Q Kᵀ; `configs.backward.GLUON_BWD_TRIM`: the backward's S and dP) against the whole tiles' products, beside SDPA's
cuDNN backend on the same call, forward and backward; at V head dims of 129 … 192 also the forward with its output in
two accumulators (`configs.forward.GLUON_PV_SPLIT`, "two accumulators", beside the trimmed Q Kᵀ), and at QK head
dims of 129 … 192 the backward with dQ in two accumulators (`configs.backward.GLUON_BWD_DQ_SPLIT`, "dq split").

Cases (bf16, B·T = 16384 tokens, H·D ≈ 2048 as the head-dim sweeps have them: H = 25 / 21 / 18 / 10 at D = 80 /
96 / 112 / 192): D = 80, 96, 112, 192 and QK 192 / V 128 (DeepSeek's MLA), T = 1024 / 4096 / 16384, causal and not.
Each trimmed output and gradient is checked against the whole tiles' first (within 2e-2 of its scale), then the
forward (`flash_attn_func` without autograd) and the backward (`torch.autograd.grad` of a kept forward) are timed
by `triton.testing.do_bench` (L2 flushed) in rounds whose order rotates (`bench_core.time_in_rounds`).

    python benchmarks/trim_ab.py --out DIR [--rounds 3] [--head-dims 80,96,192/128] [--seqlens 1024,4096]

writes DIR/trim_ab.json (rows with the GPU, torch, triton and git sha, ms and TFLOP/s) and prints a table.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import flashtriton
from flashtriton import configs
from flashtriton.tools import bench_core as C

HEADS = {80: 25, 96: 21, 112: 18, 192: 10}
SWITCHES = {"fwd": (configs.forward, "GLUON_QK_TRIM"), "bwd": (configs.backward, "GLUON_BWD_TRIM")}


def calls_of(T: int, D: int, Dv: int, causal: bool) -> dict:
    """{(direction, label): call} of one case, each of ours under its switch."""
    B, H = 16384 // T, HEADS[D]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(B, T, H, D, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(B, T, H, Dv, device="cuda", generator=gen, dtype=torch.bfloat16)
    dout = torch.randn(B, T, H, Dv, device="cuda", generator=gen, dtype=torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flashtriton.flash_attn_func(*leaves, causal=causal)

    def switched(direction, trimmed, fn, split_pv=False, split_dq=False):
        module, name = SWITCHES[direction]
        setting = (128, 256) if trimmed else ()

        def call():
            with C.switched(module, **{name: setting}), C.switched(configs.forward, GLUON_PV_SPLIT=split_pv), \
                    C.switched(configs.backward, GLUON_BWD_DQ_SPLIT=split_dq):
                return fn()
        return call

    def forward():
        with torch.no_grad():
            return flashtriton.flash_attn_func(q, k, v, causal=causal)

    def backward():
        return torch.autograd.grad(out, leaves, dout, retain_graph=True)

    from torch.nn.attention import SDPBackend, sdpa_kernel

    qh, kh, vh = (t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    doh = dout.transpose(1, 2).contiguous()

    def cudnn_fwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out_h = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)

    def cudnn_bwd():
        return torch.autograd.grad(out_h, (qh, kh, vh), doh, retain_graph=True)

    split = {("fwd", "two accumulators"): switched("fwd", True, forward, True)} if 128 < Dv <= 192 else {}
    if 128 < D <= 192:
        split[("bwd", "dq split")] = switched("bwd", True, backward, split_dq=True)
    return {("fwd", "whole tiles"): switched("fwd", False, forward), ("fwd", "trimmed"): switched("fwd", True, forward),
            **split, ("fwd", "sdpa_cudnn"): cudnn_fwd,
            ("bwd", "whole tiles"): switched("bwd", False, backward),
            ("bwd", "trimmed"): switched("bwd", True, backward), ("bwd", "sdpa_cudnn"): cudnn_bwd}


def check(calls: dict, case: str) -> None:
    """The trimmed products' output and gradients against the whole tiles' (within 2e-2 of their scale)."""
    for direction, label in (("fwd", "trimmed"), ("fwd", "two accumulators"), ("bwd", "trimmed"),
                             ("bwd", "dq split")):
        if (direction, label) not in calls:
            continue
        whole, trimmed = calls[(direction, "whole tiles")](), calls[(direction, label)]()
        if direction == "fwd":
            whole, trimmed = (whole,), (trimmed,)
        for a, b in zip(whole, trimmed):
            err = (a.float() - b.float()).abs().max().item()
            if not err <= 2e-2 * a.float().abs().max().item():
                raise AssertionError(f"{case} {direction}: {label} differs from the whole tiles' by {err:.3g}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--head-dims", default="80,96,112,192,192/128")
    parser.add_argument("--seqlens", default="1024,4096,16384")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cases = [(T, D, Dv, causal) for D, Dv in C.parse_head_dims(args.head_dims) for causal in (True, False)
             for T in C.parse_int_list(args.seqlens, "--seqlens")]
    env = C.environment()
    rows = []
    for T, D, Dv, causal in cases:
        case = f"T={T} D={D}/{Dv}{' causal' if causal else ''}"
        calls = calls_of(T, D, Dv, causal)
        check(calls, case)
        fwd_flops = 2 * 16384 * T * HEADS[D] * (D + Dv) * (0.5 if causal else 1.0)
        times = C.time_in_rounds(calls, args.rounds)
        for direction, flops in (("fwd", fwd_flops), ("bwd", 2.5 * fwd_flops)):
            base = statistics.median(times[(direction, "whole tiles")])
            cudnn = statistics.median(times[(direction, "sdpa_cudnn")])
            for label in ("whole tiles", "trimmed", "two accumulators", "dq split", "sdpa_cudnn"):
                if (direction, label) not in times:
                    continue
                ms = statistics.median(times[(direction, label)])
                rows.append(dict(env, case=case, shape=(T, D, Dv, causal), direction=direction, candidate=label,
                                 ms=ms, rounds_ms=times[(direction, label)], tflops=flops / ms * 1e-9,
                                 over_whole=base / ms, over_cudnn=cudnn / ms))
                print(f"{case:26s} {direction} {label:12s} {ms * 1e3:9.1f} us {flops / ms * 1e-9:6.0f} TFLOP/s  "
                      f"x{base / ms:.3f} of the whole tiles'  x{cudnn / ms:.3f} of cuDNN's", flush=True)
        del calls
        C.free_memory()
    C.write_rows(args.out, "trim_ab.json", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
