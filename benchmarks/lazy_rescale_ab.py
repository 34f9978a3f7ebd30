"""A/B of the Gluon forward's lazy rescale (`configs.forward.GLUON_LAZY_RESCALE`: a row's m raised only when its max
grew by 2^8, the output rescaled only on the tiles where some row's m moved) against the eager one, beside SDPA's
cuDNN backend on the same call.

Cases (bf16, B·T = 16384 tokens, H·D = 2048, the standard sweep's shapes): D = 64 / 128 / 256 at T = 4096, causal
and not, and D = 128 causal at T = 1024 and 16384. Each candidate's output is checked against the eager one first
(within 2e-2 of its scale), then the forward (`flash_attn_func`, no autograd) is timed by `triton.testing.do_bench`
(L2 flushed) in rounds whose order rotates (`bench_core.time_in_rounds`).

    python benchmarks/lazy_rescale_ab.py --out DIR [--rounds 5]

writes DIR/lazy_rescale_ab.json (rows with the GPU, torch, triton and git sha) and prints a table.
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

CASES = [(T, D, causal) for D in (64, 128, 256) for causal in (True, False) for T in (4096,)]
CASES += [(1024, 128, True), (16384, 128, True)]


def calls_of(T: int, D: int, causal: bool) -> dict:
    """{label: call} of one case, each of ours under its switch."""
    B, H = 16384 // T, 2048 // D
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3))

    def ours(lazy: bool):
        def call():
            with C.switched(configs.forward, GLUON_LAZY_RESCALE=lazy):
                return flashtriton.flash_attn_func(q, k, v, causal=causal)
        return call

    from torch.nn.attention import SDPBackend, sdpa_kernel

    qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)

    return {"eager rescale": ours(False), "lazy rescale": ours(True), "sdpa_cudnn": cudnn}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    env = C.environment()
    rows = []
    for T, D, causal in CASES:
        case = f"T={T} D={D}{' causal' if causal else ''}"
        calls = calls_of(T, D, causal)
        with torch.no_grad():
            reference = calls["eager rescale"]().float()
            err = (calls["lazy rescale"]().float() - reference).abs().max().item()
            if not err <= 2e-2 * reference.abs().max().item():
                raise AssertionError(f"{case}: the lazy rescale's output differs from the eager one's by {err:.3g}")
            times = C.time_in_rounds(calls, args.rounds)
        base = statistics.median(times["eager rescale"])
        for label in calls:
            ms = statistics.median(times[label])
            rows.append(dict(env, case=case, shape=(T, D, causal), candidate=label, ms=ms, rounds_ms=times[label],
                             over_eager=base / ms))
            print(f"{case:22s} {label:14s} {ms * 1e3:9.1f} us  x{base / ms:.3f} of the eager rescale's", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "lazy_rescale_ab.json"), "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
