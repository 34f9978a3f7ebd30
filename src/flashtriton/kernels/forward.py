"""FlashAttention-2 forward: the Triton kernel and its launcher.

One program computes one BLOCK_M tile of query rows for one (batch, query head): it keeps the tile of Q in
registers, streams K/V in BLOCK_N tiles and keeps the online-softmax state per row (running max `m_i`,
denominator `l_i`, fp32 accumulator `acc`) so the (Sq, Sk) score matrix never exists. Scores are kept in
base 2: log2(e) is folded into the scale, so the softmax uses exp2.

Causal attention is bottom-right aligned (flash-attn >= 2.1): query i sees key j iff j <= i + Sk - Sq
(or top-left, j <= i, torch SDPA's convention, with CAUSAL_BOTTOM_RIGHT=False). K tiles entirely past the
diagonal are never visited; tiles entirely before it run without masks; only the tiles that straddle the
diagonal or the end of the keys pay for masking.

Q and K share the head dim D (HEAD_DIM, padded to BLOCK_D); V and O have V's, Dv (HEAD_DIM_V, BLOCK_DV), which may
differ (DeepSeek's MLA: D = 192, Dv = 128).

Varlen: with IS_VARLEN, sequences are packed along one token axis and `cu_seqlens_q/k` (int32, B + 1) give
each sequence's start; program (m, b·h) handles sequence b.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import configs
from .._env import INTERPRET
from .common import (dot_settings, load_tile, sequence_bounds, sm_count, softmax_finish, softmax_step,
                     tma_descriptor, tma_layout_ok, tma_ok, tma_tile)
from . import dispatch
from .host import capability, cdiv, padded_head_dim
from .launch import hooks_installed, launch, launch_and_keep
from .paged import page_rows, poison, sequence_keys
from .variant import Variant, add_sink, diagonal, dropout_state, key_blocks

try:  # Hopper's Gluon forward (triton >= 3.6 ships Gluon's Hopper API)
    from . import forward_gluon_launch
except ImportError:  # pragma: no cover
    forward_gluon_launch = None


@triton.jit
def _attn_fwd_tile(
    acc, l_i, m_i, q,
    k_ptrs, v_ptrs, stride_kn, stride_vn,
    offs_m, offs_n, offs_d, offs_dv,
    start_n, end_n, seqlen_k, diag, qk_scale,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr = False, left=0, right=0, HAS_SOFTCAP: tl.constexpr = False, softcap=0.0,
    HAS_ALIBI: tl.constexpr = False, slope=0.0,
    HAS_DROPOUT: tl.constexpr = False, seed=0, offset=0, bh=0, dropout_threshold=0, m0=0,
    PAGED: tl.constexpr = False, PAGE_SIZE: tl.constexpr = 1, bt_row=None, stride_kp=0, stride_vp=0,
):
    """Fold K/V tiles [start_n, end_n) into the running (acc, l_i, m_i) of one Q tile; K tiles span the head dim
    (offs_d), V tiles V's (offs_dv). PAGED: k_ptrs / v_ptrs are (1, BLOCK_D) / (1, BLOCK_DV) pointers of the kv head
    in the page pools, each tile's rows found through the block-table row `bt_row` (`paged.page_rows`)."""
    if not PAGED:
        k_ptrs += start_n * stride_kn
        v_ptrs += start_n * stride_vn
    for n in range(start_n, end_n, BLOCK_N):
        cols = n + offs_n  # (BLOCK_N,) key indices
        if PAGED:
            k_rows, v_rows = page_rows(bt_row, n, cols, seqlen_k, stride_kp, stride_kn, stride_vp, stride_vn, MASKED,
                                       PAGE_SIZE, BLOCK_N)
            k = load_tile(k_ptrs + k_rows[:, None], cols, seqlen_k, offs_d, MASKED, HEAD_DIM, BLOCK_D)
            v = load_tile(v_ptrs + v_rows[:, None], cols, seqlen_k, offs_dv, MASKED, HEAD_DIM_V, BLOCK_DV)
        else:
            k = load_tile(k_ptrs, cols, seqlen_k, offs_d, MASKED, HEAD_DIM, BLOCK_D)  # (BLOCK_N, BLOCK_D)
            v = load_tile(v_ptrs, cols, seqlen_k, offs_dv, MASKED, HEAD_DIM_V, BLOCK_DV)  # (BLOCK_N, BLOCK_DV)
        if UPCAST_DOT:  # the interpreter's bf16 dot is wrong: compute it in fp32 (exact products)
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N) fp32
        acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v, cols, offs_m, seqlen_k, diag, qk_scale,
                                      MASKED, IS_CAUSAL, UPCAST_DOT, DOT_PRECISION, HAS_WINDOW, left, right,
                                      HAS_SOFTCAP, softcap, HAS_ALIBI, slope, HAS_DROPOUT, seed, offset, bh,
                                      dropout_threshold, n, m0)
        if not PAGED:
            k_ptrs += BLOCK_N * stride_kn
            v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(
    Q, K, V, O, LSE,
    CU_SEQLENS_Q, CU_SEQLENS_K,
    qk_scale,  # softmax_scale * log2(e); with HAS_SOFTCAP softmax_scale / softcap
    window_left, window_right, softcap,  # the variant's scalars (`Variant.scalars`), None where unused
    ALIBI, stride_alibi_b,  # fp32 slopes (B or 1, Hq) and their batch stride (0 for (Hq,)), None without ALiBi
    SINKS,  # (Hq,) one logit per query head (learnable_sink), None without sinks
    DROPOUT_RNG, dropout_threshold, dropout_scale,  # `Variant.dropout_args`, None without dropout
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_lb, stride_lh,
    GROUP_SIZE,  # query heads per kv head
    SEQLEN_Q, SEQLEN_K,  # dense: the lengths; varlen: unused (read from cu_seqlens)
    TUNE_SEQLEN_Q, TUNE_SEQLEN_K,  # power-of-two buckets, autotune key only
    # PAGED: int32 (B, pages per sequence) and its row stride, the row's pages x PAGE_SIZE, the pool's pages;
    # HAS_SEQUSED_K: int32 (B,) key counts (`paged.sequence_keys`). None where off.
    BLOCK_TABLE, stride_btb, capacity, num_pages, SEQUSED_K,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,  # Q and K's head dim, padded to BLOCK_D
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,  # V and O's, padded to BLOCK_DV
    IS_CAUSAL: tl.constexpr, CAUSAL_BOTTOM_RIGHT: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr, IS_VARLEN: tl.constexpr, UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DROPOUT: tl.constexpr = False,
    PAGED: tl.constexpr = False, PAGE_SIZE: tl.constexpr = 1, HAS_SEQUSED_K: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    off_h = tl.program_id(1)  # grid (query tiles, heads, batch): each axis within CUDA's limits
    off_b = tl.program_id(2)
    off_hk = off_h // GROUP_SIZE  # GQA: the kv head this query head reads

    q_start, seqlen_q = sequence_bounds(CU_SEQLENS_Q, off_b, SEQLEN_Q, IS_VARLEN)
    k_start, seqlen_k = sequence_bounds(CU_SEQLENS_K, off_b, SEQLEN_K, IS_VARLEN)
    b64 = off_b.to(tl.int64)
    batch_q, batch_o = b64 * stride_qb + q_start * stride_qm, b64 * stride_ob + q_start * stride_om
    batch_k, batch_v = b64 * stride_kb + k_start * stride_kn, b64 * stride_vb + k_start * stride_vn
    batch_l = b64 * stride_lb + q_start

    # Causal tiles near the end of the queries do the most work: hand them out first.
    start_m = tl.num_programs(0) - 1 - pid_m if IS_CAUSAL else pid_m
    if start_m * BLOCK_M >= seqlen_q:  # varlen: this sequence is shorter than the longest
        return

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query rows
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = offs_d if BLOCK_DV == BLOCK_D else tl.arange(0, BLOCK_DV)

    q_ptrs = Q + batch_q + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    if PAGED or HAS_SEQUSED_K:  # (paged: K, V (num_pages, PAGE_SIZE, Hkv, D), stride_kb the page stride)
        seqlen_k, keys_ok = sequence_keys(BLOCK_TABLE, stride_btb, SEQUSED_K, off_b, seqlen_k, capacity, num_pages,
                                          PAGED, PAGE_SIZE, HAS_SEQUSED_K)
    bt_row = BLOCK_TABLE
    if PAGED:  # each tile's rows come from the block table
        bt_row = BLOCK_TABLE + off_b.to(tl.int64) * stride_btb
        k_ptrs = K + off_hk * stride_kh + offs_d[None, :] * stride_kd  # (1, BLOCK_D)
        v_ptrs = V + off_hk * stride_vh + offs_dv[None, :] * stride_vd
    else:
        k_ptrs = K + batch_k + off_hk * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
        v_ptrs = V + batch_v + off_hk * stride_vh + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd

    q = load_tile(q_ptrs, offs_m, seqlen_q, offs_d, True, HEAD_DIM, BLOCK_D)  # (BLOCK_M, BLOCK_D)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    diag = diagonal(seqlen_q, seqlen_k, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, HAS_WINDOW or HAS_ALIBI)
    first, start, lo, hi = key_blocks(start_m, seqlen_k, diag, IS_CAUSAL, BLOCK_M, BLOCK_N, HAS_WINDOW, window_left,
                                      window_right)
    slope = tl.load(ALIBI + off_b * stride_alibi_b + off_h) * 1.4426950408889634 if HAS_ALIBI else 0.0  # base 2
    if HAS_DROPOUT:
        seed, offset = dropout_state(DROPOUT_RNG)
        bh = off_b * tl.num_programs(1) + off_h  # the grid's axis 1 is the query heads
    else:
        seed, offset, bh = 0, 0, 0

    if HAS_WINDOW:  # the window's left edge: masked
        acc, l_i, m_i = _attn_fwd_tile(
            acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, offs_d, offs_dv,
            first, start, seqlen_k, diag, qk_scale,
            True, IS_CAUSAL, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, UPCAST_DOT, DOT_PRECISION,
            HAS_WINDOW, window_left, window_right, HAS_SOFTCAP, softcap, HAS_ALIBI, slope,
            HAS_DROPOUT, seed, offset, bh, dropout_threshold, start_m * BLOCK_M, PAGED, PAGE_SIZE, bt_row, stride_kb, stride_vb,
        )
    acc, l_i, m_i = _attn_fwd_tile(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, offs_d, offs_dv,
        start, lo, seqlen_k, diag, qk_scale,
        False, IS_CAUSAL, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, UPCAST_DOT, DOT_PRECISION,
        HAS_WINDOW, window_left, window_right, HAS_SOFTCAP, softcap, HAS_ALIBI, slope,
        HAS_DROPOUT, seed, offset, bh, dropout_threshold, start_m * BLOCK_M, PAGED, PAGE_SIZE, bt_row, stride_kb, stride_vb,
    )
    acc, l_i, m_i = _attn_fwd_tile(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, offs_d, offs_dv,
        lo, hi, seqlen_k, diag, qk_scale,
        True, IS_CAUSAL, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, UPCAST_DOT, DOT_PRECISION,
        HAS_WINDOW, window_left, window_right, HAS_SOFTCAP, softcap, HAS_ALIBI, slope,
        HAS_DROPOUT, seed, offset, bh, dropout_threshold, start_m * BLOCK_M, PAGED, PAGE_SIZE, bt_row, stride_kb, stride_vb,
    )

    if HAS_SINKS:
        acc, l_i, m_i = add_sink(acc, l_i, m_i, tl.load(SINKS + off_h).to(tl.float32) * 1.4426950408889634)
    out, lse = softmax_finish(acc, l_i, m_i)
    if HAS_DROPOUT:  # the kept probabilities scaled by 1 / (1 - p); lse is the undropped softmax's
        out = out * dropout_scale
    if PAGED or HAS_SEQUSED_K:
        out, lse = poison(out, lse, keys_ok)

    row_ok = offs_m < seqlen_q
    tl.store(LSE + batch_l + off_h * stride_lh + offs_m, lse, mask=row_ok)
    o_ptrs = O + batch_o + off_h * stride_oh + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od
    o_mask = row_ok[:, None]
    if BLOCK_DV != HEAD_DIM_V:
        o_mask = o_mask & (offs_dv[None, :] < HEAD_DIM_V)
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=o_mask)


_attn_fwd_tuned = triton.autotune(
    configs=configs.FWD_CONFIGS,
    key=configs.FWD_AUTOTUNE_KEY,
    prune_configs_by={"early_config_prune": configs.prune_fwd_configs},
    cache_results=True,
)(_attn_fwd)


# ----------------------------------------------------------------------------------------------------------
# Hopper: the same kernel with Q, K, V, O moved by TMA (host tensor descriptors over the (B, S, H, D) tensors)
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _attn_fwd_tile_tma(
    acc, l_i, m_i, q, desc_k, desc_v, off_b, off_hk, k_start,
    offs_m, offs_n, start_n, end_n, seqlen_k, diag, qk_scale,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, UPCAST_DOT: tl.constexpr,
    HAS_WINDOW: tl.constexpr = False, left=0, right=0, HAS_SOFTCAP: tl.constexpr = False, softcap=0.0,
    HAS_ALIBI: tl.constexpr = False, slope=0.0,
):
    """`_attn_fwd_tile` with K/V tiles loaded by TMA."""
    for n in range(start_n, end_n, BLOCK_N):
        cols = n + offs_n  # (BLOCK_N,) key indices in the sequence
        k = tma_tile(desc_k, off_b, k_start + n, off_hk, BLOCK_N, HEAD_DIM, IS_VARLEN)  # (BLOCK_N, D)
        v = tma_tile(desc_v, off_b, k_start + n, off_hk, BLOCK_N, HEAD_DIM, IS_VARLEN)  # (BLOCK_N, D)
        if MASKED and IS_VARLEN:  # rows of the next sequence: p is 0 there, but 0 * inf or NaN is not 0
            v = tl.where(cols[:, None] < seqlen_k, v, 0.0)
        if UPCAST_DOT:  # the interpreter's bf16 dot is wrong: compute it in fp32 (exact products)
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k))  # (BLOCK_M, BLOCK_N) fp32
        acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v, cols, offs_m, seqlen_k, diag, qk_scale,
                                      MASKED, IS_CAUSAL, UPCAST_DOT, "tf32", HAS_WINDOW, left, right,
                                      HAS_SOFTCAP, softcap, HAS_ALIBI, slope)
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_tma(
    desc_q, desc_k, desc_v, desc_o, O, LSE, CU_SEQLENS_Q, CU_SEQLENS_K,
    qk_scale, window_left, window_right, softcap, ALIBI, stride_alibi_b, SINKS,  # as `_attn_fwd` takes them
    stride_om, stride_oh, stride_lb, stride_lh, GROUP_SIZE, SEQLEN_Q, SEQLEN_K,
    HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, CAUSAL_BOTTOM_RIGHT: tl.constexpr, IS_VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST_DOT: tl.constexpr,
    HAS_WINDOW: tl.constexpr = False, HAS_SOFTCAP: tl.constexpr = False, HAS_ALIBI: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False,
):
    """`_attn_fwd` for fp16/bf16 inputs on Hopper, with Q, K, V (and dense O) moved by TMA. Grid (query tiles,
    heads, batch). Dense: query rows past the end load as zeros and are not stored (TMA clips the store).
    Varlen (O, lse of (total_q, Hq, D), (Hq, total_q)): O is stored with a row mask, not by TMA, so that
    rows of the next sequence are never written."""
    pid_m = tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    off_hk = off_h // GROUP_SIZE
    if IS_VARLEN:
        q_start = tl.load(CU_SEQLENS_Q + off_b)
        seqlen_q = tl.load(CU_SEQLENS_Q + off_b + 1) - q_start
        k_start = tl.load(CU_SEQLENS_K + off_b)
        seqlen_k = tl.load(CU_SEQLENS_K + off_b + 1) - k_start
    else:
        q_start = 0
        seqlen_q = SEQLEN_Q
        k_start = 0
        seqlen_k = SEQLEN_K
    start_m = tl.num_programs(0) - 1 - pid_m if IS_CAUSAL else pid_m
    if start_m * BLOCK_M >= seqlen_q:  # varlen: this sequence is shorter than the longest
        return
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = tma_tile(desc_q, off_b, q_start + start_m * BLOCK_M, off_h, BLOCK_M, HEAD_DIM, IS_VARLEN)  # (BLOCK_M, D)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    diag = diagonal(seqlen_q, seqlen_k, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, HAS_WINDOW or HAS_ALIBI)
    first, start, lo, hi = key_blocks(start_m, seqlen_k, diag, IS_CAUSAL, BLOCK_M, BLOCK_N, HAS_WINDOW, window_left,
                                      window_right)
    slope = tl.load(ALIBI + off_b * stride_alibi_b + off_h) * 1.4426950408889634 if HAS_ALIBI else 0.0  # base 2
    if HAS_WINDOW:  # the window's left edge: masked
        acc, l_i, m_i = _attn_fwd_tile_tma(acc, l_i, m_i, q, desc_k, desc_v, off_b, off_hk, k_start, offs_m, offs_n,
                                           first, start, seqlen_k, diag, qk_scale, True, IS_CAUSAL, IS_VARLEN,
                                           HEAD_DIM, BLOCK_N, UPCAST_DOT, HAS_WINDOW, window_left, window_right,
                                           HAS_SOFTCAP, softcap, HAS_ALIBI, slope)
    acc, l_i, m_i = _attn_fwd_tile_tma(acc, l_i, m_i, q, desc_k, desc_v, off_b, off_hk, k_start, offs_m, offs_n,
                                       start, lo, seqlen_k, diag, qk_scale, False, IS_CAUSAL, IS_VARLEN,
                                       HEAD_DIM, BLOCK_N, UPCAST_DOT, HAS_WINDOW, window_left, window_right,
                                       HAS_SOFTCAP, softcap, HAS_ALIBI, slope)
    acc, l_i, m_i = _attn_fwd_tile_tma(acc, l_i, m_i, q, desc_k, desc_v, off_b, off_hk, k_start, offs_m, offs_n,
                                       lo, hi, seqlen_k, diag, qk_scale, True, IS_CAUSAL, IS_VARLEN,
                                       HEAD_DIM, BLOCK_N, UPCAST_DOT, HAS_WINDOW, window_left, window_right,
                                       HAS_SOFTCAP, softcap, HAS_ALIBI, slope)
    if HAS_SINKS:
        acc, l_i, m_i = add_sink(acc, l_i, m_i, tl.load(SINKS + off_h).to(tl.float32) * 1.4426950408889634)

    out, lse = softmax_finish(acc, l_i, m_i)
    row_ok = offs_m < seqlen_q
    tl.store(LSE + off_b.to(tl.int64) * stride_lb + q_start + off_h * stride_lh + offs_m, lse, mask=row_ok)
    if IS_VARLEN:
        rows = (q_start + offs_m).to(tl.int64)
        o_ptrs = O + rows[:, None] * stride_om + off_h * stride_oh + tl.arange(0, HEAD_DIM)[None, :]
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
    else:
        desc_o.store([off_b, start_m * BLOCK_M, off_h, 0], out.to(desc_o.dtype).reshape(1, BLOCK_M, 1, HEAD_DIM))


def _tma_launch_parts(q_shape, k_shape, dtype, out_strides, lse_strides, causal, causal_bottom_right, config,
                      batch=None, max_seqlen_q=None, max_seqlen_k=None, variant: Variant | None = None):
    """(grid, scalar arguments after the variant's, constexprs and options) of a TMA forward launch. Dense:
    q (B, Sq, Hq, D), k (B, Sk, Hkv, D), lse (B, Hq, Sq); varlen (batch given): (total, H, D), lse (Hq, total).
    `variant` (default: causal or not) overrides causal and causal_bottom_right."""
    variant = Variant.of(causal, causal_bottom_right) if variant is None else variant
    varlen = batch is not None
    heads_q, heads_kv = q_shape[-2], k_shape[-2]
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    if varlen:
        seqlen_q, seqlen_k = max_seqlen_q, max_seqlen_k
        stride_lb, stride_lh = 0, lse_strides[0]
    else:
        batch, seqlen_q, seqlen_k = q_shape[0], q_shape[1], k_shape[1]
        stride_lb, stride_lh = lse_strides[0], lse_strides[1]
    ints = (out_strides[-3], out_strides[-2], stride_lb, stride_lh, heads_q // heads_kv, seqlen_q, seqlen_k)
    meta = dict(HEAD_DIM=q_shape[-1], **variant.forward_constexprs, IS_VARLEN=varlen, BLOCK_M=bm, BLOCK_N=bn,
                UPCAST_DOT=dot_settings(dtype)[0],
                num_warps=config["num_warps"], num_stages=config["num_stages"])
    if config.get("maxnreg"):  # a register cap, so that more programs fit on an SM
        meta["maxnreg"] = config["maxnreg"]
    return (cdiv(seqlen_q, bm), heads_q, batch), ints, meta


def _launch_forward_tma(q, k, v, out, lse, softmax_scale, causal, causal_bottom_right, config,
                        cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                        variant: Variant | None = None, alibi_slopes=None, learnable_sink=None):
    """The TMA forward on tensors that passed `tma_ok`."""
    varlen = cu_seqlens_q is not None
    variant = Variant.of(causal, causal_bottom_right) if variant is None else variant
    grid, ints, meta = _tma_launch_parts(q.shape, k.shape, q.dtype, out.stride(), lse.stride(), causal,
                                         causal_bottom_right, config, cu_seqlens_q.numel() - 1 if varlen else None,
                                         max_seqlen_q, max_seqlen_k, variant)
    launch(_attn_fwd_tma, grid, _tma_args(q, k, v, out, lse, config["BLOCK_M"], config["BLOCK_N"], varlen,
                                          cu_seqlens_q, cu_seqlens_k,
                                          variant.forward_args(softmax_scale, alibi_slopes, learnable_sink), ints),
           meta)


def _tma_args(q, k, v, out, lse, block_m, block_n, varlen, cu_seqlens_q, cu_seqlens_k, scalars, ints) -> tuple:
    """The TMA forward's runtime arguments: descriptors of q, k, v, out, then the pointers, the variant's arguments
    (`Variant.forward_args`) and `ints`."""
    return (tma_descriptor(q, block_m, varlen), tma_descriptor(k, block_n, varlen), tma_descriptor(v, block_n, varlen),
            tma_descriptor(out, block_m, varlen), out, lse, cu_seqlens_q, cu_seqlens_k, *scalars, *ints)


class _DenseTmaPlan:
    """A dense Hopper forward launch (the TMA kernel, or the Gluon one where `gluon`), fixed by shapes, strides,
    dtype, device and options. Host time matters: the forward of a short sequence takes ~0.1 ms of GPU time,
    about what a launch costs in Python on a slow CPU."""

    __slots__ = ("fn", "grid", "ints", "meta", "block_m", "block_n", "gluon", "relaunch")

    def __init__(self, fn, grid, ints, meta, block_m, block_n, gluon=False):
        self.fn, self.grid, self.ints, self.meta, self.block_m, self.block_n = fn, grid, ints, meta, block_m, block_n
        self.gluon = gluon
        self.relaunch = None  # the compiled kernel, after the first launch


@functools.lru_cache(maxsize=1024)
def _dense_tma_plan(q_shape, q_strides, k_shape, k_strides, v_strides, dtype, device, variant: Variant,
                    use_tma, use_gluon, v_shape=None, fixed_cap: bool = False,
                    qk_columns: int = 0, split_pv: bool = False, o_in_q: bool = False) -> _DenseTmaPlan | None:
    """The plan of a dense Hopper forward, or None where the TMA kernels do not take such tensors whatever their
    addresses (`tma_layout_ok`; the output is contiguous) or do not declare the call (`dispatch.KERNELS`: the
    variant, a V head dim of its own). The Gluon kernel where it declares the call and `configs.gluon_fwd_config`
    has a config for the shape (and `use_gluon`: it is on, and softmax_scale > 0), else the TMA kernel.
    v_shape: v's shape (default: k's). fixed_cap: the Gluon kernel's softcap against a fixed max
    (`forward_gluon_launch.cap_fixed`; an argument, so that the plans of both are kept apart); qk_columns likewise
    its Q Kᵀ's product width (`forward_gluon_launch.qk_width`), split_pv its two output accumulators
    (`forward_gluon_launch.pv_split`) and o_in_q `configs.forward.GLUON_O_IN_Q` (which rules the config follows)."""
    batch, seqlen_q, heads_q, head_dim = q_shape
    v_shape = k_shape if v_shape is None else v_shape
    separate_v = v_shape[-1] != head_dim
    causal, causal_bottom_right = variant.causal, variant.bottom_right
    head_dim_v = v_shape[-1]
    out_shape = (batch, seqlen_q, heads_q, head_dim_v)
    out_strides = (seqlen_q * heads_q * head_dim_v, heads_q * head_dim_v, head_dim_v, 1)
    if not use_tma or not tma_layout_ok(device, dtype, (q_shape, q_strides), (k_shape, k_strides),
                                        (v_shape, v_strides), (out_shape, out_strides)):
        return None
    major = capability(device)[0]
    tma = dispatch.supports("tma_fwd", dtype, head_dim, major, False, False, variant.fields(), separate_v)
    use_gluon = use_gluon and dispatch.supports("gluon_fwd", dtype, head_dim, major, False, False, variant.fields(),
                                                separate_v)
    if not (tma or use_gluon):
        return None
    gluon_config = (configs.gluon_fwd_config(head_dim, seqlen_q, k_shape[1], causal, variant.band(k_shape[1]),
                                             head_dim_v, bool(variant.dropout_p)) if use_gluon else None)
    if gluon_config is not None:
        grid, ints, meta = forward_gluon_launch.launch_parts(q_shape, k_shape, causal, causal_bottom_right,
                                                             gluon_config, sm_count(device.index), variant=variant,
                                                             head_dim_v=head_dim_v, fixed_cap=fixed_cap,
                                                             qk_columns=qk_columns, split_pv=split_pv)
        return _DenseTmaPlan(forward_gluon_launch.KERNEL, grid, ints, meta, None, gluon_config["BLOCK_N"], True)
    if not tma:  # a head dim only the Gluon kernel's padded tiles take, without a config: the portable kernel
        return None
    config = configs.default_fwd_tma_config(head_dim, seqlen_q, k_shape[1], causal)
    grid, ints, meta = _tma_launch_parts(q_shape, k_shape, dtype, out_strides, (heads_q * seqlen_q, seqlen_q), causal,
                                         causal_bottom_right, config, variant=variant)
    return _DenseTmaPlan(_attn_fwd_tma, grid, ints, meta, config["BLOCK_M"], config["BLOCK_N"])


def _launch_dense_tma(plan, q, k, v, out, lse, scalars, dropout=(None, None, None)) -> None:
    """`plan` on this call's tensors; `scalars`: the variant's arguments (`Variant.forward_args`), `dropout` its
    `Variant.dropout_args` (the Gluon kernel's; the TMA kernel does not declare dropout)."""
    if plan.gluon:
        counter = torch.zeros(1, dtype=torch.int32, device=q.device) if plan.meta["DYNAMIC"] else None
        args = forward_gluon_launch.launch_args(q, k, v, out, lse, scalars + dropout, plan.block_n, plan.ints, None,
                                                None, counter)
    else:
        args = _tma_args(q, k, v, out, lse, plan.block_m, plan.block_n, False, None, None, scalars, plan.ints)
    if plan.relaunch is not None and not hooks_installed():
        plan.relaunch(plan.grid, args)
    else:
        plan.relaunch = launch_and_keep(plan.fn, plan.grid, args, plan.meta)


def _paged_args(block_table, k, seqused_k) -> tuple:
    """(BLOCK_TABLE, stride_btb, capacity, num_pages, SEQUSED_K) as `_attn_fwd` takes them, None where off."""
    if block_table is None:
        return None, None, None, None, seqused_k
    return block_table, block_table.stride(0), block_table.shape[1] * k.shape[1], k.shape[0], seqused_k


def _paged_gluon_keys(cu_seqlens_k, seqused_k, block_table, page_size: int, num_pages: int):
    """(cu_seqlens int32 (B + 1,) whose differences are the sequences' key counts, bad bool (B,)) for the Gluon
    forward over pages, from the device tensors without a sync: a sequence is bad where its key count (seqused_k's,
    else cu_seqlens_k's difference) is negative or more than its block-table row holds, or one of the entries its
    keys use is not a page (`kernels.paged`'s rules); a bad sequence gets 0 keys here and NaN rows after."""
    lens = seqused_k if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    ok = (lens >= 0) & (lens <= block_table.shape[1] * page_size)
    pages = torch.where(ok, (lens + page_size - 1) // page_size, 0)
    used = torch.arange(block_table.shape[1], device=lens.device)[None, :] < pages[:, None]
    ok &= ~(((block_table < 0) | (block_table >= num_pages)) & used).any(1)
    cu = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=lens.device)
    cu[1:] = torch.where(ok, lens, 0).cumsum(0)  # (int32 wraps past 2^31: the kernel takes differences only)
    return cu, ~ok


def _launch_paged_gluon(q, k, v, out, lse, softmax_scale, variant, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, alibi_slopes, learnable_sink, block_table, seqused_k, rng_state=None) -> bool:
    """Paged varlen prefill on the Gluon forward where it takes the call (Hopper, fp16/bf16, a head dim with a
    varlen config, pages of whole key tiles or tiles of whole pages (`configs.gluon_paged_config`,
    `forward_gluon_launch.pages_fit`), pools whose pages are evenly spaced rows, TMA-aligned):
    launched, with bad sequences' rows set to NaN as the portable kernel does (`_paged_gluon_keys`); True. Else
    False (the portable kernel runs it)."""
    if (INTERPRET or not q.is_cuda or softmax_scale <= 0 or forward_gluon_launch is None
            or not dispatch.allows("gluon")
            or not dispatch.supports("gluon_fwd", q.dtype, q.shape[-1], capability(q.device)[0], True, True,
                                     variant.fields(), v.shape[-1] != q.shape[-1])):
        return False
    page_size = k.shape[1]
    config = configs.gluon_paged_config(q.shape[-1], max_seqlen_q, max_seqlen_k, variant.causal, page_size,
                                        v.shape[-1], bool(variant.dropout_p))
    k_rows, v_rows = forward_gluon_launch.flat_pages(k), forward_gluon_launch.flat_pages(v)
    batch = cu_seqlens_q.numel() - 1
    if (config is None or not forward_gluon_launch.pages_fit(page_size, config["BLOCK_N"]) or k_rows is None
            or v_rows is None
            or not tma_ok(q, k_rows, v_rows, out)
            or forward_gluon_launch.work_units(max_seqlen_q, q.shape[1], batch, config, variant.causal)
            >= forward_gluon_launch.UNIT_LIMIT):
        return False
    cu_k, bad = _paged_gluon_keys(cu_seqlens_k, seqused_k, block_table, page_size, k.shape[0])
    forward_gluon_launch.launch_forward_gluon(q, k_rows, v_rows, out, lse, softmax_scale, variant.causal,
                                              variant.bottom_right, config, cu_seqlens_q, cu_k, max_seqlen_q,
                                              max_seqlen_k, variant, alibi_slopes, learnable_sink, block_table,
                                              page_size, rng_state)
    tokens = torch.arange(q.shape[0], dtype=cu_seqlens_q.dtype, device=q.device)
    seq = torch.searchsorted(cu_seqlens_q[1:].contiguous(), tokens, right=True)  # B past the last sequence
    bad_token = torch.cat([bad, bad.new_zeros(1)])[seq]
    out.masked_fill_(bad_token[:, None, None], float("nan"))
    lse.masked_fill_(bad_token[None, :], float("nan"))
    return True


def attention_forward(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel: (out, lse). Arguments as `launch_forward`."""
    out, lse, _ = launch_forward(*args, **kwargs)
    return out, lse


def launch_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    causal_bottom_right: bool = True,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    config: dict | None = None,
    window_size: tuple = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    learnable_sink: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    rng_state: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
):
    """Launch the forward kernel on validated inputs (the public API checks them).

    Dense:  q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv)  ->  out (B, Sq, Hq, Dv), lse (B, Hq, Sq) fp32
    Varlen: q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv), cu_seqlens int32 (B + 1,)
                                                      ->  out (total_q, Hq, Dv), lse (Hq, total_q) fp32
    Paged (varlen with block_table int32 (B, pages per sequence), last dim contiguous): k (num_pages, page_size,
    Hkv, D), v (num_pages, page_size, Hkv, Dv), sequence b's keys from its row's pages; seqused_k int32 (B,),
    contiguous, with or without pages: sequence b's key count (else cu_seqlens_k's). Values out of range give the
    sequence NaN (`paged`). The portable kernel runs these calls (the dispatch's `paged` layout).
    Any strides with a contiguous last dim. Dv (V's head dim) may differ from D: the Gluon kernel runs such calls
    where `configs.gluon_fwd_config` / `gluon_varlen_config` have a rule for the pair, the portable kernel the
    rest (the TMA kernel declares Dv == D only). `config` forces {"BLOCK_M", "BLOCK_N", "num_warps",
    "num_stages"} of the portable kernel instead of autotuning (always so under the interpreter). Without
    one, on Hopper, fp16/bf16 inputs (dense or varlen) with head dim 64 or 128 take the TMA kernel
    (`_attn_fwd_tma`; FLASHTRITON_KERNEL=portable turns it off), or where `configs.gluon_fwd_config` (dense) or
    `configs.gluon_varlen_config` (varlen) say so the Gluon kernel (`forward_gluon`; FLASHTRITON_KERNEL=tma turns
    it off). dropout_p > 0 (with rng_state, the call's int64 (seed, offset) tensor on q's device): probabilities
    dropped by `variant.dropout_keep`'s mask, in the portable kernel, or the Gluon kernel where its config rule
    takes dropout (`configs.GLUON_DROPOUT_FWD`); the TMA kernel does not declare dropout.
    Returns (out, lse, compiled kernel or None); the compiled kernel (n_regs, n_spills, metadata.shared) is
    returned when a config is forced on a GPU, for `flashtriton tune`.
    """
    varlen = cu_seqlens_q is not None
    paged = block_table is not None or seqused_k is not None  # the dispatch's `paged` layout
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    separate_v = head_dim_v != head_dim
    variant = Variant.of(causal, causal_bottom_right, window_size, softcap, alibi_slopes is not None,
                         learnable_sink is not None, dropout_p)
    if dropout_p and rng_state is None:
        raise ValueError("dropout_p > 0 needs rng_state, the call's int64 (seed, offset) tensor")
    out = torch.empty((*q.shape[:-1], head_dim_v), dtype=q.dtype, device=q.device)
    if varlen:
        batch = cu_seqlens_q.numel() - 1
        total_q, heads_q = q.shape[0], q.shape[1]
        heads_kv = k.shape[-2]
        seqlen_q, seqlen_k = max_seqlen_q, max_seqlen_k
        lse = torch.empty((heads_q, total_q), dtype=torch.float32, device=q.device)
    else:
        batch, seqlen_q, heads_q, _ = q.shape
        seqlen_k, heads_kv = k.shape[1], k.shape[2]
        lse = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or seqlen_q == 0:
        return out, lse.fill_(float("-inf")), None

    if config is None and not varlen and q.is_cuda and not INTERPRET:
        # Dense on Hopper: a plan per call shape (TMA applicability, tiles, launch arguments, the compiled
        # kernel); per call only the addresses are checked (TMA needs 16-byte aligned bases).
        plan = _dense_tma_plan(q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, q.device, variant,
                               dispatch.allows("tma"),
                               dispatch.allows("gluon") and forward_gluon_launch is not None and softmax_scale > 0,
                               v.shape, forward_gluon_launch is not None and forward_gluon_launch.cap_fixed(variant, q.dtype),
                               forward_gluon_launch is not None and forward_gluon_launch.qk_width(head_dim),
                               forward_gluon_launch is not None and forward_gluon_launch.pv_split(v.shape[-1]),
                               configs.forward.GLUON_O_IN_Q)
        if plan is not None and not (q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr()) & 15:
            _launch_dense_tma(plan, q, k, v, out, lse,
                              variant.forward_args(softmax_scale, alibi_slopes, learnable_sink),
                              variant.dropout_args(rng_state))
            return out, lse, None
    if config is None and block_table is not None and _launch_paged_gluon(
            q, k, v, out, lse, softmax_scale, variant, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            alibi_slopes, learnable_sink, block_table, seqused_k, rng_state):
        return out, lse, None
    varlen_tma = dispatch.supports("tma_fwd", q.dtype, head_dim, 9, True, paged, variant.fields(), separate_v)
    if (config is None and varlen and not paged and tma_ok(q, k, v, out)
            and (varlen_tma or dispatch.supports("gluon_fwd", q.dtype, head_dim, 9, True, paged, variant.fields(),
                                                 separate_v))):
        gluon_config = (configs.gluon_varlen_config(head_dim, seqlen_q, seqlen_k, bool(causal), head_dim_v,
                                                    bool(dropout_p))
                        if dispatch.allows("gluon") and forward_gluon_launch is not None and softmax_scale > 0
                        and dispatch.supports("gluon_fwd", q.dtype, head_dim, 9, True, paged, variant.fields(),
                                              separate_v)
                        else None)
        if gluon_config is not None and (forward_gluon_launch.work_units(seqlen_q, heads_q, batch, gluon_config,
                                                                         bool(causal))
                                         >= forward_gluon_launch.UNIT_LIMIT):  # many (empty) sequences: the TMA kernel
            gluon_config = None
        if gluon_config is not None:
            forward_gluon_launch.launch_forward_gluon(q, k, v, out, lse, softmax_scale, causal, causal_bottom_right,
                                                      gluon_config, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                      max_seqlen_k, variant, alibi_slopes, learnable_sink,
                                                      rng_state=rng_state)
            return out, lse, None
        if varlen_tma:
            tma_config = configs.varlen_fwd_tma_config(head_dim, seqlen_q, seqlen_k, bool(causal))
            _launch_forward_tma(q, k, v, out, lse, softmax_scale, causal, causal_bottom_right, tma_config,
                                cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, variant, alibi_slopes,
                                learnable_sink)
            return out, lse, None

    if varlen:  # a zero batch stride, so that one kernel signature serves both layouts
        q_strides, k_strides, v_strides, o_strides = ((0, *t.stride()) for t in (q, k, v, out))
        l_strides = (0, lse.stride(0))
        if block_table is not None:  # page pools (num_pages, page_size, Hkv, D): the page stride in the batch's place
            k_strides, v_strides = k.stride(), v.stride()
    else:
        q_strides, k_strides, v_strides, o_strides = q.stride(), k.stride(), v.stride(), out.stride()
        l_strides = (lse.stride(0), lse.stride(1))
    upcast, precision = dot_settings(q.dtype)
    args = (
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
        *variant.forward_args(softmax_scale, alibi_slopes, learnable_sink), *variant.dropout_args(rng_state),
        *q_strides, *k_strides, *v_strides, *o_strides, *l_strides,
        heads_q // heads_kv, seqlen_q, seqlen_k,
        configs.seqlen_bucket(seqlen_q), configs.seqlen_bucket(seqlen_k),
        *_paged_args(block_table, k, seqused_k),
    )
    constexprs = dict(
        HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim),
        HEAD_DIM_V=head_dim_v, BLOCK_DV=padded_head_dim(head_dim_v),
        **variant.forward_constexprs, IS_VARLEN=varlen,
        UPCAST_DOT=upcast, DOT_PRECISION=precision,
    )
    if dropout_p:  # (absent otherwise: the kernel's default, and the launch key of the dropout-free calls)
        constexprs.update(variant.dropout_constexprs)
    if paged:  # (likewise)
        constexprs.update(PAGED=block_table is not None, PAGE_SIZE=k.shape[1] if block_table is not None else 1,
                          HAS_SEQUSED_K=seqused_k is not None)

    def grid(meta):
        return (cdiv(seqlen_q, meta["BLOCK_M"]), heads_q, batch)

    if config is None and INTERPRET:
        config = configs.FWD_INTERPRETER_CONFIG
    if config is None and not configs.AUTOTUNE:
        config = configs.default_fwd_config(max(constexprs["BLOCK_D"], constexprs["BLOCK_DV"]), q.element_size(),
                                            q.device, seqlen_q, seqlen_k, bool(causal))
    if config is None:
        _attn_fwd_tuned[grid](*args, **constexprs)
        return out, lse, None
    compiled = launch(_attn_fwd, grid(config), args, {**constexprs, **config})
    return out, lse, compiled
