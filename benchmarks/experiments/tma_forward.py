"""Experiment for issue 5 (not part of the library): the forward kernel with TMA tensor descriptors on Hopper.

    python benchmarks/experiments/tma_forward.py [--out DIR]        # on the GPU: check, then time
    TRITON_INTERPRET=1 python benchmarks/experiments/tma_forward.py   # on a CPU: correctness only, tiny shapes

The library's forward loads tiles through pointer tensors (`tl.load`), which Triton lowers to cp.async on
Hopper. Here Q, K, V and O are host-side `TensorDescriptor`s over the (B, S, H, D) tensors themselves (rank 4,
block (1, BLOCK, 1, D)), so tiles move by TMA: no address arithmetic in registers, out-of-range rows
zero-filled on load and clipped on store. Same online softmax (base 2, unmasked / masked stages) as
`flashtriton.kernels.forward`. Variants: tile shapes, stages, and `tl.range(..., warp_specialize=True)`
where this Triton supports it. Each variant is checked against `flashtriton.flash_attn_func` first, then
timed side by side with it and with torch's CUDNN backend (standard sweep points, D=128, fp16).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
import flashtriton  # noqa: E402
from flashtriton.reference import attention_flops  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"


@triton.jit
def _tile(acc, l_i, m_i, q, desc_k, desc_v, off_b, off_hk, offs_m, lo, hi, seqlen_k, qk_scale,
          MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
          WS: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    for n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        k = desc_k.load([off_b, n, off_hk, 0]).reshape(BLOCK_N, HEAD_DIM)
        v = desc_v.load([off_b, n, off_hk, 0]).reshape(BLOCK_N, HEAD_DIM)
        qk = tl.dot(q, tl.trans(k))
        if MASKED:
            visible = (n + offs_n)[None, :] < seqlen_k
            if IS_CAUSAL:
                visible = visible & ((n + offs_n)[None, :] <= offs_m[:, None])
            qk = tl.where(visible, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
            qk = qk - m_new[:, None]
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            qk = qk * qk_scale - m_new[:, None]
        p = tl.math.exp2(qk)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_tma(desc_q, desc_k, desc_v, desc_o, qk_scale, SEQLEN, GROUP_SIZE,
                  HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  WS: tl.constexpr):
    """Self-attention (Sq = Sk = SEQLEN), causal top-left = bottom-right. Grid (query tiles, heads, batch)."""
    pid_m = tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    off_hk = off_h // GROUP_SIZE
    start_m = tl.num_programs(0) - 1 - pid_m if IS_CAUSAL else pid_m
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = desc_q.load([off_b, start_m * BLOCK_M, off_h, 0]).reshape(BLOCK_M, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if IS_CAUSAL:
        hi = tl.minimum(SEQLEN, (start_m + 1) * BLOCK_M)
        lo = tl.minimum(start_m * BLOCK_M + 1, SEQLEN) // BLOCK_N * BLOCK_N
    else:
        hi = SEQLEN
        lo = SEQLEN // BLOCK_N * BLOCK_N
    lo = tl.minimum(lo, hi)
    acc, l_i, m_i = _tile(acc, l_i, m_i, q, desc_k, desc_v, off_b, off_hk, offs_m, 0, lo, SEQLEN, qk_scale,
                          False, IS_CAUSAL, HEAD_DIM, BLOCK_N, WS)
    acc, l_i, m_i = _tile(acc, l_i, m_i, q, desc_k, desc_v, off_b, off_hk, offs_m, lo, hi, SEQLEN, qk_scale,
                          True, IS_CAUSAL, HEAD_DIM, BLOCK_N, False)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    desc_o.store([off_b, start_m * BLOCK_M, off_h, 0], out.to(desc_o.dtype).reshape(1, BLOCK_M, 1, HEAD_DIM))


def tma_attention(q, k, v, causal, block_m=128, block_n=64, num_warps=8, num_stages=3, ws=False):
    """q (B, S, H, D), k/v (B, S, Hkv, D), last dim contiguous, 16-byte aligned rows -> out (B, S, H, D)."""
    B, S, H, D = q.shape
    out = torch.empty_like(q)
    dq = TensorDescriptor(q, list(q.shape), list(q.stride()), [1, block_m, 1, D])
    dk = TensorDescriptor(k, list(k.shape), list(k.stride()), [1, block_n, 1, D])
    dv = TensorDescriptor(v, list(v.shape), list(v.stride()), [1, block_n, 1, D])
    do = TensorDescriptor(out, list(out.shape), list(out.stride()), [1, block_m, 1, D])
    grid = (triton.cdiv(S, block_m), H, B)
    _attn_fwd_tma[grid](dq, dk, dv, do, D ** -0.5 * 1.4426950408889634, S, H // k.shape[2],
                        HEAD_DIM=D, IS_CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, WS=ws,
                        num_warps=num_warps, num_stages=num_stages)
    return out


VARIANTS = [  # (BLOCK_M, BLOCK_N, warps, stages, warp_specialize)
    (128, 64, 8, 3, False), (128, 128, 8, 2, False), (128, 128, 8, 3, False), (64, 64, 4, 3, False),
    (128, 64, 8, 3, True), (128, 128, 8, 3, True), (128, 128, 4, 3, True),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    opts = ap.parse_args()
    rows = []
    if DEV == "cpu":  # correctness of the kernel logic through the interpreter: odd lengths, GQA, causal
        for S, causal in ((100, False), (100, True), (64, True)):
            q = torch.randn(1, S, 4, 64, dtype=torch.float16)
            k = torch.randn(1, S, 2, 64, dtype=torch.float16)
            v = torch.randn(1, S, 2, 64, dtype=torch.float16)
            ref = flashtriton.flash_attn_func(q, k, v, causal=causal)
            got = tma_attention(q, k, v, causal, block_m=32, block_n=16, num_warps=4, num_stages=1)
            err = (got.float() - ref.float()).abs().max().item()
            print(f"interpreter S={S} causal={causal}: max |tma - flashtriton| = {err:.2e}")
            assert err < 2e-3, err
        return
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")

    for D in (128,):  # where the gap to cuDNN is widest (0.72 geomean)
        for causal in (False, True):
            for T in (1024, 4096, 16384):
                B, H = 16384 // T, 2048 // D
                g = torch.Generator(device="cuda").manual_seed(0)
                q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
                flops = attention_flops(B, H, T, D, causal, "fwd")
                ref = flashtriton.flash_attn_func(q, k, v, causal=causal)
                res = dict(D=D, causal=causal, T=T)
                res["flashtriton"] = flops / bench(lambda: flashtriton.flash_attn_func(q, k, v, causal=causal)) / 1e9
                qb, kb, vb = (t.transpose(1, 2).contiguous() for t in (q, k, v))
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    res["cudnn"] = flops / bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                        qb, kb, vb, is_causal=causal)) / 1e9
                for var in VARIANTS:
                    name = "tma" + "x".join(map(str, var[:4])) + ("_ws" if var[4] else "")
                    try:
                        got = tma_attention(q, k, v, causal, *var)
                        err = (got.float() - ref.float()).abs().max().item()
                        if not err < 1e-2:
                            res[name] = f"wrong: max err {err:.3g}"
                            continue
                        res[name] = flops / bench(lambda: tma_attention(q, k, v, causal, *var)) / 1e9
                    except Exception as exc:  # noqa: BLE001
                        res[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
                rows.append(res)
                print(" | ".join(f"{kk}={vv:.0f}" if isinstance(vv, float) else f"{kk}={vv}" for kk, vv in res.items()),
                      flush=True)
                del q, k, v, qb, kb, vb
    if opts.out:
        Path(opts.out).mkdir(parents=True, exist_ok=True)
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    git_sha=os.environ.get("FLASHTRITON_GIT_SHA", "unknown"),
                    date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        (Path(opts.out) / "tma_forward.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
