"""A/B of the Gluon forward's softcap against a fixed max (`configs.forward.GLUON_CAP_FIXED`: no row max, no rescale
of the output per tile) and against the online max, beside the same call without softcap and SDPA's cuDNN backend
on that dense call.

Cases (bf16, causal, softcap 50, issue 25's): B=4 H=16 T=4096 D=128 and B=2 H=8 T=8192 D=256. Each candidate's
output is checked against the online max's first (within 2e-2 of its scale: both are bf16 roundings of the same
softmax), then the forward (`flash_attn_func`, no autograd) is timed by `triton.testing.do_bench` (L2 flushed)
in rounds whose order rotates (`bench_core.time_in_rounds`).

    python benchmarks/softcap_ab.py --out DIR [--rounds 5]

writes DIR/softcap_ab.json (rows with the GPU, torch, triton and git sha) and prints a table.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import flashtriton
from flashtriton import configs
from flashtriton.tools import bench_core as C

CASES = {"T=4096 D=128": (4, 16, 4096, 128), "T=8192 D=256": (2, 8, 8192, 256)}


def calls_of(B: int, H: int, T: int, D: int) -> dict:
    """{label: call} of one case, each call under its switches."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3))

    def ours(softcap: float, fixed: bool):
        def call():
            with C.switched(configs.forward, GLUON_CAP_FIXED=fixed):
                return flashtriton.flash_attn_func(q, k, v, causal=True, softcap=softcap)
        return call

    from torch.nn.attention import SDPBackend, sdpa_kernel

    qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True)

    return {"softcap, online max": ours(50.0, False), "softcap, fixed max": ours(50.0, True),
            "no softcap": ours(0.0, False), "sdpa_cudnn, no softcap": cudnn}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    env = C.environment()
    rows = []
    for case, shape in CASES.items():
        calls = calls_of(*shape)
        with torch.no_grad():
            reference = calls["softcap, online max"]().float()
            got = calls["softcap, fixed max"]().float()
            err = (got - reference).abs().max().item()
            if not err <= 2e-2 * reference.abs().max().item():
                raise AssertionError(f"{case}: the fixed max's output differs from the online max's by {err:.3g}")
            times = C.time_in_rounds(calls, args.rounds)
        base = statistics.median(times["no softcap"])
        for label in calls:
            ms = statistics.median(times[label])
            rows.append(dict(env, case=case, shape=shape, candidate=label, ms=ms, rounds_ms=times[label],
                             cost_over_no_softcap=ms / base - 1))
            print(f"{case:14s} {label:24s} {ms * 1e3:9.1f} us  {100 * (ms / base - 1):+6.1f} % against no softcap",
                  flush=True)
    C.write_rows(args.out, "softcap_ab.json", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
