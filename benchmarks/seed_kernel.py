"""The cookbook notebook's Triton FA2 forward kernel, verbatim (64x64 tiles, no tuning).

Kept only as a baseline that the benchmarks measure side by side with flashtriton; (B, H, T, D) layout,
T a multiple of 64 for the notebook's masking to be right.
"""

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _fa2_fwd(
    Q, K, V, O,
    sm_scale,
    stride_qb, stride_qh, stride_qm, stride_qk,
    stride_kb, stride_kh, stride_kn, stride_kk,
    stride_vb, stride_vh, stride_vn, stride_vk,
    stride_ob, stride_oh, stride_om, stride_ok,
    Z, H, N_CTX,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    start_m = tl.program_id(0)
    off_hz = tl.program_id(1)
    off_z = off_hz // H
    off_h = off_hz % H
    q_offset = off_z * stride_qb + off_h * stride_qh
    k_offset = off_z * stride_kb + off_h * stride_kh
    v_offset = off_z * stride_vb + off_h * stride_vh
    o_offset = off_z * stride_ob + off_h * stride_oh
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + q_offset + offs_m[:, None] * stride_qm + offs_k[None, :] * stride_qk
    q = tl.load(q_ptrs, mask=offs_m[:, None] < N_CTX, other=0.0)
    m_i = tl.zeros((BLOCK_M,), dtype=tl.float32) - float("inf")
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    end_n = (start_m + 1) * BLOCK_M if CAUSAL else N_CTX
    for start_n in range(0, end_n, BLOCK_N):
        cur_n = start_n + offs_n
        k_ptrs = K + k_offset + cur_n[:, None] * stride_kn + offs_k[None, :] * stride_kk
        v_ptrs = V + v_offset + cur_n[:, None] * stride_vn + offs_k[None, :] * stride_vk
        k_blk = tl.load(k_ptrs, mask=cur_n[:, None] < N_CTX, other=0.0)
        v_blk = tl.load(v_ptrs, mask=cur_n[:, None] < N_CTX, other=0.0)
        qk = tl.dot(q, tl.trans(k_blk)) * sm_scale
        if CAUSAL:
            qk = tl.where(offs_m[:, None] >= cur_n[None, :], qk, float("-inf"))
        qk = tl.where(cur_n[None, :] < N_CTX, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v_blk.dtype), v_blk)
        m_i = m_new
    acc = acc / l_i[:, None]
    o_ptrs = O + o_offset + offs_m[:, None] * stride_om + offs_k[None, :] * stride_ok
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=offs_m[:, None] < N_CTX)


def seed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """The notebook's `flash_attn_triton`: q, k, v (B, H, T, D)."""
    B, H, T, D = q.shape
    o = torch.empty_like(q)
    grid = (triton.cdiv(T, 64), B * H)
    _fa2_fwd[grid](
        q, k, v, o, 1.0 / math.sqrt(D),
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        B, H, T,
        BLOCK_M=64, BLOCK_N=64, HEAD_DIM=D, CAUSAL=causal,
    )
    return o
