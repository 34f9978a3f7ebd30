"""A/B of the Gluon forward's Q Kᵀ over 192 of its 256-column tiles (`configs.forward.GLUON_QK_192`) against the
whole tiles' product, beside SDPA's cuDNN backend on the same call.

Cases (bf16, B·T = 16384 tokens, the head dims' standard shapes: H = 10 at D = 192, as the wide sweep has them):
QK / V = 192 / 192 and 192 / 128 (DeepSeek's MLA), T = 1024 / 4096 / 16384, causal and not. Each candidate's output
is checked against the whole tiles' first (within 2e-2 of its scale), then the forward (`flash_attn_func`, no
autograd) is timed by `triton.testing.do_bench` (L2 flushed) in rounds whose order rotates
(`bench_core.time_in_rounds`).

    python benchmarks/qk192_ab.py --out DIR [--rounds 3]

writes DIR/qk192_ab.json (rows with the GPU, torch, triton and git sha, ms and TFLOP/s) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

import flashtriton
from flashtriton import configs
from flashtriton.tools import bench_core as C

CASES = [(T, D, Dv, causal) for D, Dv in ((192, 192), (192, 128)) for causal in (True, False)
         for T in (1024, 4096, 16384)]
HEADS = 10


def calls_of(T: int, D: int, Dv: int, causal: bool) -> dict:
    """{label: call} of one case, each of ours under its switch."""
    B = 16384 // T
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(B, T, HEADS, D, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(B, T, HEADS, Dv, device="cuda", generator=gen, dtype=torch.bfloat16)

    def ours(split: bool):
        def call():
            with C.switched(configs.forward, GLUON_QK_192=split):
                return flashtriton.flash_attn_func(q, k, v, causal=causal)
        return call

    from torch.nn.attention import SDPBackend, sdpa_kernel

    qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)

    return {"whole tiles": ours(False), "qk 192": ours(True), "sdpa_cudnn": cudnn}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    env = C.environment()
    rows = []
    for T, D, Dv, causal in CASES:
        case = f"T={T} D={D}/{Dv}{' causal' if causal else ''}"
        calls = calls_of(T, D, Dv, causal)
        flops = 2 * 16384 * T * HEADS * (D + Dv) * (0.5 if causal else 1.0)
        with torch.no_grad():
            reference = calls["whole tiles"]().float()
            err = (calls["qk 192"]().float() - reference).abs().max().item()
            if not err <= 2e-2 * reference.abs().max().item():
                raise AssertionError(f"{case}: the split product's output differs from the whole tiles' by {err:.3g}")
            times = C.time_in_rounds(calls, args.rounds)
        base = statistics.median(times["whole tiles"])
        cudnn = statistics.median(times["sdpa_cudnn"])
        for label in calls:
            ms = statistics.median(times[label])
            rows.append(dict(env, case=case, shape=(T, D, Dv, causal), candidate=label, ms=ms, rounds_ms=times[label],
                             tflops=flops / ms * 1e-9, over_whole=base / ms, over_cudnn=cudnn / ms))
            print(f"{case:26s} {label:12s} {ms * 1e3:9.1f} us {flops / ms * 1e-9:6.0f} TFLOP/s  x{base / ms:.3f} of the "
                  f"whole tiles'  x{cudnn / ms:.3f} of cuDNN's", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "qk192_ab.json"), "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
