"""Hopper forward in Gluon, FlashAttention-3's schedule: two consumer warpgroups and overlapped softmax.

One program computes BLOCK_M = 128 query rows of one (batch, query head) with two warpgroups of 4 warps, each
owning 64 rows (wgmma's M). They share a ring of NUM_BUFFERS K/V tiles in shared memory, filled by TMA; each
stage has a "ready" barrier (TMA bytes landed) and an "empty" barrier (both warpgroups are done with it).
Warpgroup 0 issues the loads; there is no producer warp (a third warpgroup would cap every thread at 168
registers, and the consumers need ~200).

Per K/V tile j a warpgroup issues S_j = Q K_jᵀ and O += P_{j-1} V_{j-1} as asynchronous wgmmas and computes the
softmax of S_j while the second runs (FlashAttention-3's intra-warpgroup overlap); the two warpgroups drift
freely, so one's softmax also overlaps the other's matmuls. Scores are in base 2 (log2(e) folded into
qk_scale, which must be > 0).

Dense (B, S, H, D) fp16/bf16 tensors only, head dim 64 or 128, descriptors rank 4 with block (1, rows, 1, D):
rows past the sequence arrive as zeros. Causal attention is bottom-right (or top-left) as in `forward.py`.
Kernels in this file compile for sm_90 only; `launch_forward` takes this path where `gluon_ok` says so.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .common import LOG2E

BLOCK_M = gl.constexpr(128)  # two warpgroups of 64 rows
ROWS = gl.constexpr(64)  # rows per warpgroup: wgmma's M
FIRST_HALF, SECOND_HALF = gl.constexpr(0), gl.constexpr(1)  # the 64 rows a consumer warpgroup owns


@gluon.jit
def _producer(desc_q, desc_k, desc_v, q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, k_empty, v_empty,
              off_b, off_h, off_hk, start_m, n_tiles, BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr):
    """TMA loads: the two 64-row halves of Q, then K/V tile t into stage t % NUM_BUFFERS once both warpgroups
    released the tile it held (K and V have their own barriers: S = Q Kᵀ can start before V lands)."""
    mbarrier.expect(q_ready, 2 * desc_q.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_q, [off_b, start_m * BLOCK_M, off_h, 0], q_ready, q_bufs.index(0))
    tma.async_copy_global_to_shared(desc_q, [off_b, start_m * BLOCK_M + ROWS, off_h, 0], q_ready, q_bufs.index(1))
    for t in range(n_tiles):
        stage = t % NUM_BUFFERS
        phase = ((t // NUM_BUFFERS) & 1) ^ 1  # the first round waits on a fresh barrier's "previous" phase
        mbarrier.wait(k_empty.index(stage), phase, pred=t >= NUM_BUFFERS)
        mbarrier.expect(k_ready.index(stage), desc_k.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_k, [off_b, t * BLOCK_N, off_hk, 0], k_ready.index(stage),
                                        k_bufs.index(stage))
        mbarrier.wait(v_empty.index(stage), phase, pred=t >= NUM_BUFFERS)
        mbarrier.expect(v_ready.index(stage), desc_v.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_v, [off_b, t * BLOCK_N, off_hk, 0], v_ready.index(stage),
                                        v_bufs.index(stage))


@gluon.jit
def _softmax_tile(s, m_i, l_i, n, row0, rows, seqlen_k, causal_offset, qk_scale,
                  IS_CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """Fold raw scores s (ROWS, BLOCK_N) of keys [n, n + BLOCK_N) into (m_i, l_i): (p, alpha, m_new, l_new).
    Tiles that reach past the keys or, causal, past the first row's diagonal are masked."""
    need_mask = n + BLOCK_N > seqlen_k
    if IS_CAUSAL:
        need_mask = need_mask | (n + BLOCK_N - 1 > row0 + causal_offset)
    if need_mask:
        cols = n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        visible = cols[None, :] < seqlen_k
        if IS_CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None] + causal_offset)
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    # A row that has seen no key yet keeps m = -inf: subtract 0 instead, so exp2 gives 0, not NaN.
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * qk_scale - m_safe[:, None])
    alpha = gl.exp2(m_i - m_safe)
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


@gluon.jit
def _consumer(q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, k_empty, v_empty,
              O, LSE, off_b, off_h, start_m, seqlen_q, seqlen_k, causal_offset, n_tiles, qk_scale,
              stride_ob, stride_om, stride_oh, stride_lb, stride_lh,
              WG: gl.constexpr, IS_CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_BUFFERS: gl.constexpr):
    """Rows [start_m * BLOCK_M + 64 WG, + 64) of the tile."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dtype: gl.constexpr = q_bufs.dtype

    row0 = start_m * BLOCK_M + WG * ROWS
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))  # (ROWS,) query rows
    q = q_bufs.index(WG).reshape([ROWS, HEAD_DIM])
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
    mbarrier.wait(q_ready, 0)

    # Tile 0: scores and softmax; its P V waits for the next iteration.
    mbarrier.wait(k_ready.index(0), 0)
    k_t = k_bufs.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
    s_tok = warpgroup_mma(q, k_t, s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, 0, row0, rows, seqlen_k, causal_offset, qk_scale, IS_CAUSAL,
                                       BLOCK_N, s_layout)
    p_op = gl.convert_layout(p.to(dtype), p_layout)

    for j in range(1, n_tiles):
        stage = j % NUM_BUFFERS
        prev = (j - 1) % NUM_BUFFERS
        mbarrier.wait(k_ready.index(stage), (j // NUM_BUFFERS) & 1)
        k_t = k_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
        s_tok = warpgroup_mma(q, k_t, s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // NUM_BUFFERS) & 1)
        v = v_bufs.index(prev).reshape([BLOCK_N, HEAD_DIM])
        acc_tok = warpgroup_mma(p_op, v, acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))  # S_j done, P_{j-1} V_{j-1} may still run
        mbarrier.arrive(k_empty.index(stage), count=1)
        p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, j * BLOCK_N, row0, rows, seqlen_k, causal_offset, qk_scale,
                                           IS_CAUSAL, BLOCK_N, s_layout)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
        mbarrier.arrive(v_empty.index(prev), count=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)

    last = (n_tiles - 1) % NUM_BUFFERS
    mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // NUM_BUFFERS) & 1)
    v = v_bufs.index(last).reshape([BLOCK_N, HEAD_DIM])
    acc_tok = warpgroup_mma(p_op, v, acc, is_async=True)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
    mbarrier.arrive(v_empty.index(last), count=1)

    # (out, lse); rows that saw no key (causal, Sq > Sk): out 0, lse -inf.
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
    out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
    b64 = off_b.to(gl.int64)
    gl.store(LSE + b64 * stride_lb + off_h * stride_lh + rows, lse, mask=rows < seqlen_q)
    o_rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    o_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = O + b64 * stride_ob + off_h * stride_oh + o_rows[:, None].to(gl.int64) * stride_om + o_cols[None, :]
    gl.store(o_ptrs, out.to(dtype), mask=(o_rows < seqlen_q)[:, None])


@gluon.jit(do_not_specialize=["stride_lb", "stride_lh", "GROUP_SIZE", "SEQLEN_Q", "SEQLEN_K"])
def _attn_fwd_gluon(
    desc_q, desc_k, desc_v, O, LSE, qk_scale,
    stride_ob, stride_om, stride_oh, stride_lb, stride_lh, GROUP_SIZE, SEQLEN_Q, SEQLEN_K,
    IS_CAUSAL: gl.constexpr, CAUSAL_BOTTOM_RIGHT: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_BUFFERS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
):
    """Grid (query tiles of 128, query heads, batch); num_warps=4: the default partition (the TMA producer),
    plus two consumer warpgroups of 4 warps with CONSUMER_REGS registers per thread each."""
    pid_m = gl.program_id(0)
    off_h = gl.program_id(1)
    off_b = gl.program_id(2)
    off_hk = off_h // GROUP_SIZE
    seqlen_q = SEQLEN_Q
    seqlen_k = SEQLEN_K
    # Causal tiles near the end of the queries do the most work: hand them out first.
    if IS_CAUSAL:
        start_m = gl.num_programs(0) - 1 - pid_m
        causal_offset = seqlen_k - seqlen_q if CAUSAL_BOTTOM_RIGHT else 0
        hi = gl.minimum(seqlen_k, (start_m + 1) * BLOCK_M + causal_offset)
    else:
        start_m = pid_m
        causal_offset = 0
        hi = seqlen_k
    n_tiles = gl.cdiv(gl.maximum(hi, 0), BLOCK_N)

    dtype: gl.constexpr = desc_q.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [2, 1, ROWS, 1, HEAD_DIM], desc_q.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, 1, BLOCK_N, 1, HEAD_DIM], desc_k.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, 1, BLOCK_N, 1, HEAD_DIM], desc_v.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrive per warpgroup
        mbarrier.init(v_empty.index(i), count=2)
    fence_async_shared()  # the initialised barriers, visible to TMA (async proxy)

    if n_tiles == 0:  # causal with Sq > Sk: these rows see no key
        o_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rows = start_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        b64 = off_b.to(gl.int64)
        gl.store(LSE + b64 * stride_lb + off_h * stride_lh + rows,
                 gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, o_layout)), mask=rows < seqlen_q)
        o_ptrs = O + b64 * stride_ob + off_h * stride_oh + rows[:, None].to(gl.int64) * stride_om + cols[None, :]
        gl.store(o_ptrs, gl.zeros([BLOCK_M, HEAD_DIM], dtype, o_layout), mask=(rows < seqlen_q)[:, None])
    else:
        # Worker partitions take tensors and constexprs, not Python numbers: gl.to_tensor (Triton turns integer
        # arguments equal to 1, and the non-causal offset, into constants).
        off_b = gl.to_tensor(off_b)
        off_h = gl.to_tensor(off_h)
        off_hk = gl.to_tensor(off_hk)
        start_m = gl.to_tensor(start_m)
        seqlen_q = gl.to_tensor(seqlen_q)
        seqlen_k = gl.to_tensor(seqlen_k)
        causal_offset = gl.to_tensor(causal_offset)
        qk_scale = gl.to_tensor(qk_scale)
        stride_ob = gl.to_tensor(stride_ob)
        stride_om = gl.to_tensor(stride_om)
        stride_oh = gl.to_tensor(stride_oh)
        stride_lb = gl.to_tensor(stride_lb)
        stride_lh = gl.to_tensor(stride_lh)
        gl.warp_specialize([
            (_producer, (desc_q, desc_k, desc_v, q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, k_empty,
                         v_empty, off_b, off_h, off_hk, start_m, n_tiles, BLOCK_N, NUM_BUFFERS)),
            (_consumer, (q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, k_empty, v_empty, O, LSE, off_b, off_h,
                         start_m, seqlen_q, seqlen_k, causal_offset, n_tiles, qk_scale, stride_ob, stride_om,
                         stride_oh, stride_lb, stride_lh, FIRST_HALF, IS_CAUSAL, HEAD_DIM, BLOCK_N, NUM_BUFFERS)),
            (_consumer, (q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, k_empty, v_empty, O, LSE, off_b, off_h,
                         start_m, seqlen_q, seqlen_k, causal_offset, n_tiles, qk_scale, stride_ob, stride_om,
                         stride_oh, stride_lb, stride_lh, SECOND_HALF, IS_CAUSAL, HEAD_DIM, BLOCK_N, NUM_BUFFERS)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


# ----------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------
def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """Rank-4 descriptor of a (B, S, H, D) tensor with block (1, rows, 1, D)."""
    block = [1, rows, 1, t.shape[-1]]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float16 if t.dtype == torch.float16 else gl.bfloat16)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


@functools.lru_cache(maxsize=None)
def gluon_config(head_dim: int, causal: bool) -> dict:
    """Tiles of the Gluon forward (benchmarks/explore.py gluon sweeps the alternatives)."""
    if head_dim == 64:
        return dict(BLOCK_N=128, NUM_BUFFERS=3, CONSUMER_REGS=240)
    return dict(BLOCK_N=128, NUM_BUFFERS=2, CONSUMER_REGS=240)


def launch_forward_gluon(q, k, v, out, lse, softmax_scale, causal, causal_bottom_right, config=None) -> None:
    """Dense q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D), out like q, lse (B, Hq, Sq) fp32; fp16/bf16, D 64 or 128,
    16-byte aligned bases and strides, softmax_scale > 0 (the caller checks: `gluon_ok`)."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    config = config or gluon_config(head_dim, bool(causal))
    bn = config["BLOCK_N"]
    grid = (triton.cdiv(seqlen_q, BLOCK_M.value), heads_q, batch)
    _attn_fwd_gluon[grid](
        _descriptor(q, ROWS.value), _descriptor(k, bn), _descriptor(v, bn), out, lse, softmax_scale * LOG2E,
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        heads_q // k.shape[2], seqlen_q, k.shape[1],
        IS_CAUSAL=bool(causal), CAUSAL_BOTTOM_RIGHT=bool(causal_bottom_right), HEAD_DIM=head_dim,
        num_warps=4, **config)
