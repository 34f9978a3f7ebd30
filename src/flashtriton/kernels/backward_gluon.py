"""Hopper backward, dK and dV, in Gluon: a TMA producer and two consumer warpgroups (FlashAttention-3's layout,
without its in-kernel dQ).

A program owns 128 keys of one (batch, kv head): K and V stay in shared memory, each consumer warpgroup keeps the
fp32 dK, dV of its 64 keys in registers. The producer streams 64-row tiles of Q, dO and their rows' log-sum-exp
and delta (for every query head of the GQA group) through a ring of NUM_STAGES stages. Per tile a warpgroup
computes, on transposed scores (keys x queries, so no tile is ever transposed in registers):
    Sᵀ = K Qᵀ      Pᵀ = exp2(Sᵀ · qk_scale − lse · log2 e)      dV += Pᵀ dO
    dPᵀ = V dOᵀ    dSᵀ = Pᵀ ∘ (dPᵀ − delta)                      dK += dSᵀ Q
with Sᵀ and dPᵀ issued together as asynchronous wgmmas and Pᵀ / dSᵀ fed to the next wgmma from registers.
The other warpgroup's matmuls run while one computes its exponentials. dK (times the softmax scale) and dV
leave through the K/V buffers and TMA stores that clip rows past the keys.

lse and delta come padded: (B, Hq, Sq_pad) fp32 with Sq_pad a multiple of 64, lse = −inf and delta = 0 on rows
past Sq, so every tile loads whole and rows past the queries (zero-filled by TMA) give P = 0. Rows that see no
key (lse = −inf) get P = 0 too. Causal (bottom-right, or top-left): a program's query tiles start at the first
row that sees its first key; only tiles that reach its last key pay for the mask.
dQ is computed by the Triton kernel of `backward.py`. Dense (B, S, H, D) tensors, D 64 or 128, fp16/bf16; sm_90.
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
from .forward_gluon import descriptor
from .launch import launch

ROWS = gl.constexpr(64)  # keys per consumer warpgroup (wgmma's M); a program holds 2 * ROWS keys
BLOCK_M = gl.constexpr(64)  # query rows per streamed tile
KEYS = gl.constexpr(2 * 64)  # keys per program


@gluon.jit
def _producer(shared, place, group_size, heads_q, seqlen_pad, NUM_STAGES: gl.constexpr):
    """K/V of the program's keys once, then for each (query head g of the group, query tile) its Q, dO, lse and
    delta into stage it % NUM_STAGES, once both consumers released the tile it held."""
    (desc_q, desc_do, desc_k, desc_v, desc_lse, desc_delta, q_bufs, do_bufs, k_bufs, v_bufs, lse_bufs, delta_bufs,
     kv_ready, ready, empty) = shared
    off_b, off_hk, start_n, lo, n_m, n_iters = place
    mbarrier.expect(kv_ready, 4 * desc_k.block_type.nbytes)
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(desc_k, [off_b, start_n + w * ROWS, off_hk, 0], kv_ready, k_bufs.index(w))
        tma.async_copy_global_to_shared(desc_v, [off_b, start_n + w * ROWS, off_hk, 0], kv_ready, v_bufs.index(w))
    TILE_BYTES: gl.constexpr = 2 * desc_q.block_type.nbytes + 2 * desc_lse.block_type.nbytes
    for it in range(n_iters):
        g = it // n_m
        m = lo + (it - g * n_m) * BLOCK_M
        off_h = off_hk * group_size + g
        stage = it % NUM_STAGES
        mbarrier.wait(empty.index(stage), ((it // NUM_STAGES) & 1) ^ 1, pred=it >= NUM_STAGES)
        mbarrier.expect(ready.index(stage), TILE_BYTES)
        tma.async_copy_global_to_shared(desc_q, [off_b, m, off_h, 0], ready.index(stage), q_bufs.index(stage))
        tma.async_copy_global_to_shared(desc_do, [off_b, m, off_h, 0], ready.index(stage), do_bufs.index(stage))
        row = (off_b * heads_q + off_h) * seqlen_pad + m  # in the flattened (B, Hq, Sq_pad) lse / delta
        tma.async_copy_global_to_shared(desc_lse, [row], ready.index(stage), lse_bufs.index(stage))
        tma.async_copy_global_to_shared(desc_delta, [row], ready.index(stage), delta_bufs.index(stage))


@gluon.jit
def _consumer(shared, place, causal_offset, qk_scale, softmax_scale,
              WG: gl.constexpr, IS_CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr):
    """dK, dV of keys [start_n + 64 WG, start_n + 64 WG + 64) over the streamed tiles, then their TMA stores."""
    (q_bufs, do_bufs, k_bufs, v_bufs, lse_bufs, delta_bufs, kv_ready, ready, empty, desc_dk, desc_dv) = shared
    off_b, off_hk, start_n, lo, n_m, n_iters = place
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    dtype: gl.constexpr = q_bufs.dtype
    first_key = start_n + WG * ROWS
    keys = first_key + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))  # (ROWS,)
    cols = gl.arange(0, BLOCK_M, layout=col_layout)  # (BLOCK_M,)
    s_zero = gl.zeros([ROWS, BLOCK_M], gl.float32, s_layout)
    dk = gl.zeros([ROWS, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([ROWS, HEAD_DIM], gl.float32, acc_layout)
    k = k_bufs.index(WG).reshape([ROWS, HEAD_DIM])
    v = v_bufs.index(WG).reshape([ROWS, HEAD_DIM])
    mbarrier.wait(kv_ready, 0)
    for it in range(n_iters):
        g = it // n_m
        m = lo + (it - g * n_m) * BLOCK_M
        stage = it % NUM_STAGES
        mbarrier.wait(ready.index(stage), (it // NUM_STAGES) & 1)
        q = q_bufs.index(stage).reshape([BLOCK_M, HEAD_DIM])
        do = do_bufs.index(stage).reshape([BLOCK_M, HEAD_DIM])
        s_tok = warpgroup_mma(k, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)  # Sᵀ (ROWS, BLOCK_M)
        dp_tok = warpgroup_mma(v, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)  # dPᵀ
        lse = lse_bufs.index(stage).load(col_layout)  # (BLOCK_M,)
        lse = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        p = gl.exp2(s * qk_scale - lse[None, :])  # Pᵀ (ROWS, BLOCK_M)
        if IS_CAUSAL:
            if m + causal_offset < first_key + ROWS - 1:  # the tile reaches past some row's diagonal
                p = gl.where(keys[:, None] <= (m + cols)[None, :] + causal_offset, p, 0.0)
        p_op = gl.convert_layout(p.to(dtype), op_layout)
        dv_tok = warpgroup_mma(p_op, do, dv, is_async=True)
        delta = delta_bufs.index(stage).load(col_layout)
        dp = warpgroup_mma_wait(1, deps=(dp_tok, ))
        ds = p * (dp - delta[None, :])  # dSᵀ
        ds_op = gl.convert_layout(ds.to(dtype), op_layout)
        dk_tok = warpgroup_mma(ds_op, q, dk, is_async=True)
        dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, p_op, ds_op))
        mbarrier.arrive(empty.index(stage), count=1)

    k.store((dk * softmax_scale).to(dtype))  # the buffers are this warpgroup's alone, its last wgmma done
    v.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(desc_dk, [off_b, first_key, off_hk, 0], k_bufs.index(WG))
    tma.async_copy_shared_to_global(desc_dv, [off_b, first_key, off_hk, 0], v_bufs.index(WG))
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["HEADS_Q", "GROUP_SIZE", "SEQLEN_Q", "SEQLEN_K", "SEQLEN_PAD"])
def _attn_bwd_dkdv_gluon(
    desc_q, desc_k, desc_v, desc_do, desc_dk, desc_dv, desc_lse, desc_delta, softmax_scale, qk_scale,
    HEADS_Q, GROUP_SIZE, SEQLEN_Q, SEQLEN_K, SEQLEN_PAD,
    IS_CAUSAL: gl.constexpr, CAUSAL_BOTTOM_RIGHT: gl.constexpr, HEAD_DIM: gl.constexpr,
    NUM_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
):
    """Grid (cdiv(Sk, 128), Hkv, B); num_warps=4: the producer; two consumer warpgroups as workers."""
    start_n = gl.program_id(0) * KEYS  # causal: the first keys see the most queries and start first
    off_hk = gl.program_id(1)
    off_b = gl.program_id(2)
    if IS_CAUSAL and CAUSAL_BOTTOM_RIGHT:
        causal_offset = SEQLEN_K - SEQLEN_Q
    else:
        causal_offset = 0
    if IS_CAUSAL:  # the first query tile with a row that sees key start_n
        lo = gl.maximum(start_n - causal_offset, 0) // BLOCK_M * BLOCK_M
    else:
        lo = 0
    n_m = gl.cdiv(gl.maximum(SEQLEN_Q - lo, 0), BLOCK_M)  # query tiles per head; 0: dK = dV = 0

    dtype: gl.constexpr = desc_q.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + desc_q.block_type.shape, desc_q.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + desc_do.block_type.shape, desc_do.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [2] + desc_k.block_type.shape, desc_k.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [2] + desc_v.block_type.shape, desc_v.layout)
    lse_bufs = gl.allocate_shared_memory(gl.float32, [NUM_STAGES] + desc_lse.block_type.shape, desc_lse.layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [NUM_STAGES] + desc_delta.block_type.shape,
                                           desc_delta.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrive per consumer warpgroup
    fence_async_shared()

    # Worker partitions take tensors, not Python numbers: gl.to_tensor.
    off_b = gl.to_tensor(off_b)
    off_hk = gl.to_tensor(off_hk)
    start_n = gl.to_tensor(start_n)
    lo = gl.to_tensor(lo)
    n_m = gl.to_tensor(n_m)
    group_size = gl.to_tensor(GROUP_SIZE)
    n_iters = n_m * group_size
    heads_q = gl.to_tensor(HEADS_Q)
    seqlen_pad = gl.to_tensor(SEQLEN_PAD)
    causal_offset = gl.to_tensor(causal_offset)
    qk_scale = gl.to_tensor(qk_scale)
    softmax_scale = gl.to_tensor(softmax_scale)
    producer_args = (desc_q, desc_do, desc_k, desc_v, desc_lse, desc_delta, q_bufs, do_bufs, k_bufs, v_bufs,
                     lse_bufs, delta_bufs, kv_ready, ready, empty)
    consumer_args = (q_bufs, do_bufs, k_bufs, v_bufs, lse_bufs, delta_bufs, kv_ready, ready, empty, desc_dk, desc_dv)
    place = (off_b, off_hk, start_n, lo, n_m, n_iters)  # the program's keys and query tiles
    gl.warp_specialize([
        (_producer, (producer_args, place, group_size, heads_q, seqlen_pad, NUM_STAGES)),
        (_consumer, (consumer_args, place, causal_offset, qk_scale, softmax_scale, gl.constexpr(0), IS_CAUSAL,
                     HEAD_DIM, NUM_STAGES)),
        (_consumer, (consumer_args, place, causal_offset, qk_scale, softmax_scale, gl.constexpr(1), IS_CAUSAL,
                     HEAD_DIM, NUM_STAGES)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


@gluon.jit
def _dq_producer(shared, place, NUM_STAGES: gl.constexpr):
    """Q and dO of the program's rows once (one 64-row block per consumer), then its K/V tiles into the ring, tile j
    into stage j % NUM_STAGES once both consumers released the tile it held."""
    (desc_q, desc_do, desc_k, desc_v, q_bufs, do_bufs, k_bufs, v_bufs, q_ready, kv_ready, kv_empty) = shared
    off_b, off_h, off_hk, start_m, n_tiles = place
    BLOCK_N: gl.constexpr = desc_k.block_type.shape[1]
    mbarrier.expect(q_ready, 4 * desc_q.block_type.nbytes)
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(desc_q, [off_b, start_m + w * ROWS, off_h, 0], q_ready, q_bufs.index(w))
        tma.async_copy_global_to_shared(desc_do, [off_b, start_m + w * ROWS, off_h, 0], q_ready, do_bufs.index(w))
    for j in range(n_tiles):
        stage = j % NUM_STAGES
        mbarrier.wait(kv_empty.index(stage), ((j // NUM_STAGES) & 1) ^ 1, pred=j >= NUM_STAGES)
        mbarrier.expect(kv_ready.index(stage), 2 * desc_k.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_k, [off_b, j * BLOCK_N, off_hk, 0], kv_ready.index(stage),
                                        k_bufs.index(stage))
        tma.async_copy_global_to_shared(desc_v, [off_b, j * BLOCK_N, off_hk, 0], kv_ready.index(stage),
                                        v_bufs.index(stage))


@gluon.jit
def _dq_consumer(shared, place, seqlen_k, causal_offset, qk_scale, softmax_scale, lse_ptr, delta_ptr,
                 WG: gl.constexpr, IS_CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                 NUM_STAGES: gl.constexpr):
    """dQ of query rows [start_m + 64 WG, start_m + 64 WG + 64) over the K/V tiles, then its TMA store."""
    (q_bufs, do_bufs, k_bufs, v_bufs, q_ready, kv_ready, kv_empty, desc_dq) = shared
    off_b, off_h, off_hk, start_m, n_tiles = place
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    dtype: gl.constexpr = q_bufs.dtype
    row0 = start_m + WG * ROWS
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))  # (ROWS,) query rows
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))  # (BLOCK_N,)
    lse = gl.load(lse_ptr + rows)  # padded: rows past Sq hold -inf
    lse = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = gl.load(delta_ptr + rows)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    dq = gl.zeros([ROWS, HEAD_DIM], gl.float32, acc_layout)
    q = q_bufs.index(WG).reshape([ROWS, HEAD_DIM])
    do = do_bufs.index(WG).reshape([ROWS, HEAD_DIM])
    mbarrier.wait(q_ready, 0)
    for j in range(n_tiles):
        stage = j % NUM_STAGES
        mbarrier.wait(kv_ready.index(stage), (j // NUM_STAGES) & 1)
        k = k_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM])
        v = v_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM])
        s_tok = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)  # S (ROWS, BLOCK_N)
        dp_tok = warpgroup_mma(do, v.permute((1, 0)), s_zero, use_acc=False, is_async=True)  # dP
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        p = gl.exp2(s * qk_scale - lse[:, None])
        n = j * BLOCK_N
        need_mask = n + BLOCK_N > seqlen_k
        if IS_CAUSAL:
            need_mask = need_mask | (n + BLOCK_N - 1 > row0 + causal_offset)
        if need_mask:
            visible = (n + cols)[None, :] < seqlen_k
            if IS_CAUSAL:
                visible = visible & ((n + cols)[None, :] <= rows[:, None] + causal_offset)
            p = gl.where(visible, p, 0.0)
        dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
        ds = p * (dp - delta[:, None])  # dS (ROWS, BLOCK_N)
        ds_op = gl.convert_layout(ds.to(dtype), op_layout)
        dq_tok = warpgroup_mma(ds_op, k, dq, is_async=True)
        dq, ds_op = warpgroup_mma_wait(0, deps=(dq_tok, ds_op))
        mbarrier.arrive(kv_empty.index(stage), count=1)

    q.store((dq * softmax_scale).to(dtype))  # this warpgroup's Q buffer, its last wgmma done
    fence_async_shared()
    tma.async_copy_shared_to_global(desc_dq, [off_b, row0, off_h, 0], q_bufs.index(WG))
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["HEADS_Q", "GROUP_SIZE", "SEQLEN_Q", "SEQLEN_K", "SEQLEN_PAD"])
def _attn_bwd_dq_gluon(
    desc_q, desc_k, desc_v, desc_do, desc_dq, LSE, DELTA, softmax_scale, qk_scale,
    HEADS_Q, GROUP_SIZE, SEQLEN_Q, SEQLEN_K, SEQLEN_PAD,
    IS_CAUSAL: gl.constexpr, CAUSAL_BOTTOM_RIGHT: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
):
    """Grid (cdiv(Sq, 128), Hq, B); num_warps=4: the producer; two consumer warpgroups of 64 query rows each.
    Causal: the last query tiles (the most keys) start first."""
    n_m = gl.num_programs(0)
    if IS_CAUSAL:
        start_m = (n_m - 1 - gl.program_id(0)) * KEYS
    else:
        start_m = gl.program_id(0) * KEYS
    off_h = gl.program_id(1)
    off_b = gl.program_id(2)
    off_hk = off_h // GROUP_SIZE
    if IS_CAUSAL and CAUSAL_BOTTOM_RIGHT:
        causal_offset = SEQLEN_K - SEQLEN_Q
    else:
        causal_offset = 0
    if IS_CAUSAL:  # keys up to the last row's diagonal
        hi = gl.minimum(SEQLEN_K, gl.maximum(start_m + KEYS + causal_offset, 0))
    else:
        hi = SEQLEN_K
    n_tiles = gl.cdiv(hi, BLOCK_N)  # 0: rows that see no key, dQ = 0

    dtype: gl.constexpr = desc_q.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [2] + desc_q.block_type.shape, desc_q.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [2] + desc_do.block_type.shape, desc_do.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + desc_k.block_type.shape, desc_k.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + desc_v.block_type.shape, desc_v.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)
    fence_async_shared()

    rows_base = (off_b.to(gl.int64) * HEADS_Q + off_h) * SEQLEN_PAD  # this (batch, head)'s padded lse / delta
    place = (gl.to_tensor(off_b), gl.to_tensor(off_h), gl.to_tensor(off_hk), gl.to_tensor(start_m),
             gl.to_tensor(n_tiles))
    seqlen_k = gl.to_tensor(SEQLEN_K)
    causal_offset = gl.to_tensor(causal_offset)
    qk_scale = gl.to_tensor(qk_scale)
    softmax_scale = gl.to_tensor(softmax_scale)
    lse_ptr = LSE + rows_base
    delta_ptr = DELTA + rows_base
    producer_args = (desc_q, desc_do, desc_k, desc_v, q_bufs, do_bufs, k_bufs, v_bufs, q_ready, kv_ready, kv_empty)
    consumer_args = (q_bufs, do_bufs, k_bufs, v_bufs, q_ready, kv_ready, kv_empty, desc_dq)
    gl.warp_specialize([
        (_dq_producer, (producer_args, place, NUM_STAGES)),
        (_dq_consumer, (consumer_args, place, seqlen_k, causal_offset, qk_scale, softmax_scale, lse_ptr, delta_ptr,
                        gl.constexpr(0), IS_CAUSAL, HEAD_DIM, BLOCK_N, NUM_STAGES)),
        (_dq_consumer, (consumer_args, place, seqlen_k, causal_offset, qk_scale, softmax_scale, lse_ptr, delta_ptr,
                        gl.constexpr(1), IS_CAUSAL, HEAD_DIM, BLOCK_N, NUM_STAGES)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


# ----------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _row_layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)


def row_descriptor(t: torch.Tensor) -> TensorDescriptor:
    """Descriptor of a contiguous fp32 (B, Hq, Sq_pad) tensor as one flat row, in blocks of BLOCK_M values."""
    flat = t.view(-1)
    return TensorDescriptor(flat, [flat.numel()], [1], [BLOCK_M.value], _row_layout())


def padded_seqlen(seqlen_q: int) -> int:
    """lse / delta rows per (batch, head): Sq rounded up to the dQ kernel's 128-row tiles."""
    return triton.cdiv(seqlen_q, KEYS.value) * KEYS.value


SHARED_MEMORY_LIMIT = 227 * 1024  # bytes a program may hold on sm_90


def shared_memory_bytes(config: dict, head_dim: int, kernel: str = "dkdv", elem_bytes: int = 2) -> int:
    """Shared memory of a kernel's tiles (barriers aside). dK/dV: K and V of 128 keys, and per stage a 64-row Q and
    dO tile with their lse and delta. dQ: Q and dO of 128 rows, and per stage a K and a V tile."""
    resident = 2 * KEYS.value * head_dim * elem_bytes
    if kernel == "dkdv":
        per_stage = 2 * BLOCK_M.value * (head_dim * elem_bytes + 4)
    else:
        per_stage = 2 * config["BLOCK_N"] * head_dim * elem_bytes
    return resident + config["NUM_STAGES"] * per_stage


def launch_parts(q_shape, k_shape, causal: bool, causal_bottom_right: bool, config: dict, kernel: str = "dkdv"):
    """(grid, int arguments after the scales, constexprs and options) of the dK/dV or the dQ kernel for
    q (B, Sq, Hq, D), k (B, Sk, Hkv, D)."""
    batch, seqlen_q, heads_q, head_dim = q_shape
    seqlen_k, heads_kv = k_shape[1], k_shape[2]
    if shared_memory_bytes(config, head_dim, kernel) > SHARED_MEMORY_LIMIT:
        raise ValueError(f"Gluon {kernel} config {config} needs {shared_memory_bytes(config, head_dim, kernel)} bytes "
                         f"of shared memory at head dim {head_dim}; sm_90 has {SHARED_MEMORY_LIMIT}")
    if kernel == "dkdv":
        grid = (triton.cdiv(seqlen_k, KEYS.value), heads_kv, batch)
    else:
        grid = (triton.cdiv(seqlen_q, KEYS.value), heads_q, batch)
    ints = (heads_q, heads_q // heads_kv, seqlen_q, seqlen_k, padded_seqlen(seqlen_q))
    meta = dict(IS_CAUSAL=bool(causal), CAUSAL_BOTTOM_RIGHT=bool(causal_bottom_right), HEAD_DIM=head_dim,
                num_warps=4, **config)
    return grid, ints, meta


def launch_dkdv_gluon(q, k, v, dout, dk, dv, lse_pad, delta_pad, softmax_scale, causal, causal_bottom_right,
                      config) -> None:
    """q, dout (B, Sq, Hq, D); k, v, dk, dv (B, Sk, Hkv, D); lse_pad / delta_pad contiguous fp32 (B, Hq, Sq_pad)
    (`padded_seqlen`; lse -inf and delta 0 past Sq). Inputs that pass `common.tma_ok`, D 64 or 128, Sq, Sk > 0."""
    grid, ints, meta = launch_parts(q.shape, k.shape, causal, causal_bottom_right, config)
    rows = ROWS.value
    args = (descriptor(q, rows), descriptor(k, rows), descriptor(v, rows), descriptor(dout, rows),
            descriptor(dk, rows), descriptor(dv, rows), row_descriptor(lse_pad), row_descriptor(delta_pad),
            softmax_scale, softmax_scale * LOG2E, *ints)
    launch(_attn_bwd_dkdv_gluon, grid, args, meta)


def launch_dq_gluon(q, k, v, dout, dq, lse_pad, delta_pad, softmax_scale, causal, causal_bottom_right,
                    config) -> None:
    """dQ (times the softmax scale) into dq (like q); the inputs as `launch_dkdv_gluon`'s."""
    grid, ints, meta = launch_parts(q.shape, k.shape, causal, causal_bottom_right, config, "dq")
    rows, block_n = ROWS.value, config["BLOCK_N"]
    args = (descriptor(q, rows), descriptor(k, block_n), descriptor(v, block_n), descriptor(dout, rows),
            descriptor(dq, rows), lse_pad, delta_pad, softmax_scale, softmax_scale * LOG2E, *ints)
    launch(_attn_bwd_dq_gluon, grid, args, meta)


def compile_for_sm90(head_dim: int, causal: bool, config: dict, dtype: torch.dtype = torch.bfloat16,
                     kernel: str = "dkdv"):
    """Compile the dK/dV or the dQ kernel for sm_90 without a GPU (as `forward_gluon.compile_for_sm90`): for tests
    and `ptxas -v`."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    t = torch.empty(2, 256, 4, head_dim, dtype=dtype)
    rows_t = torch.empty(2, 4, 256, dtype=torch.float32)
    _, _, meta = launch_parts(t.shape, t.shape, causal, True, config, kernel)
    options = {"num_warps": meta.pop("num_warps")}
    rows = ROWS.value
    fn = _attn_bwd_dkdv_gluon if kernel == "dkdv" else _attn_bwd_dq_gluon
    kv_rows = rows if kernel == "dkdv" else config["BLOCK_N"]
    descriptors = {name: descriptor(t, kv_rows if name in ("desc_k", "desc_v") else rows)
                   for name in ("desc_q", "desc_k", "desc_v", "desc_do", "desc_dk", "desc_dv", "desc_dq")}
    descriptors.update(desc_lse=row_descriptor(rows_t), desc_delta=row_descriptor(rows_t))
    names = fn.arg_names
    signature = {name: "constexpr" if name in meta else mangle_type(descriptors[name]) if name in descriptors
                 else "*fp32" if name in ("LSE", "DELTA") else "fp32" if name in ("softmax_scale", "qk_scale")
                 else "i32" for name in names}
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in ("LSE", "DELTA") if name in names}
    source = GluonASTSource(fn, signature, constexprs=meta, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
