"""FlashAttention-2 backward: the Triton kernels and their launcher.

With P = softmax(scale · Q Kᵀ) recomputed tile by tile from the forward's saved log-sum-exp (never stored):
    dV = Pᵀ dO      dP = dO Vᵀ      dS = P ∘ (dP − delta)      dQ = scale · dS K      dK = scale · dSᵀ Q
where delta = rowsum(dO ∘ O) (FlashAttention-2 §3.2). Q and K share the head dim D (HEAD_DIM, padded to BLOCK_D);
V, O, dO and dV have V's, Dv (HEAD_DIM_V, BLOCK_DV), which may differ. Three kernels:
  1. `_attn_bwd_preprocess`: delta, fp32, laid out like lse (minus the gradient of lse, when lse is differentiated:
     d lse_i / d s_ij = P_ij, so that term is dS = P ∘ dlse and joins delta's).
  2. `_attn_bwd_dkdv`: one program per (BLOCK_N keys, batch·kv head). It keeps K, V and the fp32 dK, dV
     accumulators resident and streams Q/dO tiles of every query head of its GQA group, so the group sum
     happens in registers: no atomics, no copies of K/V.
  3. `_attn_bwd_dq`: one program per (BLOCK_M query rows, batch·query head), streaming K/V tiles. A
     separate kernel instead of atomic adds into dQ: the result is bitwise deterministic. Under
     `configs.backward.TRITON_BWD_FUSED_DELTA` it does kernel 1's work for its rows (`_fused_delta`) and runs first.
Scores are in base 2 (log2(e) folded into the scale, exp2). Causal (bottom-right, or top-left with
CAUSAL_BOTTOM_RIGHT=False): tiles that see nothing are skipped, tiles entirely visible run unmasked, and only
tiles on the diagonal or at the end of the sequence pay for masks — as in the forward.
Rows that see no key have lse = -inf: they are given lse = +inf here so that P = 0 and their gradient is 0.
On sm_90, `attention_backward` gives kernels 2 and 3 to Hopper's Gluon kernels (`backward_gluon`) where
`configs.gluon_bwd_config` says so (dense and varlen fp16/bf16, the head dims of `configs.GLUON_BWD_HEAD_DIMS` and
the V head dims `backward_gluon_launch.separate_v_ok` pairs with them, enough work to hide their host time); lse
and delta then come padded to whole tiles, from the preprocess, or in a dense call without a sink from the Gluon dQ
kernel itself, launched first (`configs.backward.GLUON_BWD_FUSED_DELTA`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import configs
from .._env import INTERPRET
from .common import dot_settings, load_tile, sequence_bounds, tma_ok
from . import dispatch
from .host import cdiv, padded_head_dim
from .launch import KeptLaunch
from .variant import (Variant, alibi_batch_stride, alibi_bias, diagonal, dropout_keep, dropout_state, key_blocks,
                      query_blocks, softcap_scores_and_grad, visible)

try:  # Hopper's Gluon dK/dV kernel (triton >= 3.6 ships Gluon's Hopper API)
    from . import backward_gluon_launch
except ImportError:  # pragma: no cover
    backward_gluon_launch = None

PREPROCESS_BLOCK_M = 64
_NOT_FUSED = (None,) * 11  # `_attn_bwd_dq`'s FUSED arguments, off


@triton.jit
def _attn_bwd_preprocess(
    O, DO, LSE, DELTA, LSE_PAD, CU_SEQLENS_Q, DLSE, SINK, SINK_PART,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_dob, stride_dom, stride_doh, stride_dod,
    stride_lb, stride_lh,  # lse (and unpadded delta)
    stride_pb, stride_ph,  # padded lse / delta
    stride_db, stride_dh, stride_dm,  # dlse (any strides: autograd may hand an expanded one)
    SEQLEN_Q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_VARLEN: tl.constexpr, BLOCK_M: tl.constexpr,
    PADDED: tl.constexpr, HAS_DLSE: tl.constexpr, HAS_SINK: tl.constexpr = False,
):
    """delta[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d] in fp32 (d over O's head dim, V's: HEAD_DIM here),
    minus dlse[b, h, i] with HAS_DLSE (the gradient of the returned lse: d lse_i / d s_ij = P_ij, so
    dS = P ∘ (dP − (delta − dlse)) and the kernels that read delta need no change; rows that see no key, lse -inf,
    keep delta: their lse is a constant and their gradient 0 whatever dlse holds). Grid (query tiles, heads, batch).
    PADDED=False (the Triton kernels): delta laid out like lse. PADDED (the Gluon kernels, `backward_gluon.
    lse_rows`): delta and a copy of lse in the padded layout. Dense (B, Hq, Sq_pad), the grid covering Sq_pad:
    rows past Sq get lse -inf and delta 0. Varlen (Hq, padded_rows): sequence b at row 4 · (ceil(start / 4) + b);
    the gaps between sequences stay unwritten (the kernels mask them).
    HAS_SINK: each program also writes its rows' share of the sink's gradient, -Σ_i exp(sink_h − lse_i) · delta_i
    (delta after dlse; rows of lse -inf and rows past the sequence add 0), to SINK_PART[b, h, pid_m], contiguous
    (batch, heads, grid's first dimension): a program past the sequence writes 0, so that the host's sum over
    the parts is dsink_h, in a fixed order (the same bits every run)."""
    pid_m = tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    q_start, seqlen_q = sequence_bounds(CU_SEQLENS_Q, off_b, SEQLEN_Q, IS_VARLEN)
    b64 = off_b.to(tl.int64)
    batch_o = b64 * stride_ob + q_start * stride_om
    batch_do = b64 * stride_dob + q_start * stride_dom
    batch_l = b64 * stride_lb + q_start
    if (not PADDED or IS_VARLEN) and pid_m * BLOCK_M >= seqlen_q:
        if HAS_SINK:
            tl.store(SINK_PART + (off_b * tl.num_programs(1) + off_h) * tl.num_programs(0) + pid_m, 0.0)
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    in_seq = offs_m < seqlen_q
    mask = in_seq[:, None] & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(O + batch_o + off_h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                mask=mask, other=0.0)  # (BLOCK_M, BLOCK_D)
    do = tl.load(DO + batch_do + off_h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                 mask=mask, other=0.0)  # (BLOCK_M, BLOCK_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)  # (BLOCK_M,) 0 past the sequence
    if PADDED or HAS_DLSE or HAS_SINK:
        lse = tl.load(LSE + batch_l + off_h * stride_lh + offs_m, mask=in_seq, other=float("-inf"))
    if HAS_DLSE:
        dlse = tl.load(DLSE + b64 * stride_db + off_h * stride_dh + (q_start + offs_m) * stride_dm, mask=in_seq,
                       other=0.0)
        delta -= tl.where(lse == float("-inf"), 0.0, dlse)
    if HAS_SINK:
        p_sink = tl.where(lse == float("-inf"), 0.0, tl.exp(tl.load(SINK + off_h).to(tl.float32) - lse))
        tl.store(SINK_PART + (off_b * tl.num_programs(1) + off_h) * tl.num_programs(0) + pid_m,
                 -tl.sum(p_sink * delta, axis=0))
    if PADDED:
        if IS_VARLEN:  # the same row as backward_gluon.lse_rows
            padded = off_h * stride_ph + ((q_start + 3) // 4 + off_b) * 4 + offs_m
            tl.store(LSE_PAD + padded, lse, mask=in_seq)
            tl.store(DELTA + padded, delta, mask=in_seq)
        else:
            padded = b64 * stride_pb + off_h * stride_ph + offs_m
            tl.store(LSE_PAD + padded, lse)
            tl.store(DELTA + padded, delta)
    else:
        tl.store(DELTA + batch_l + off_h * stride_lh + offs_m, delta, mask=in_seq)


@triton.jit
def _load_lse_delta(lse_ptrs, delta_ptrs, rows, seqlen_q, MASK_ROWS: tl.constexpr):
    """(lse · log2(e), delta) of some rows; rows that see no key (lse -inf) or lie past the end get +inf, so
    that P = exp2(s - lse) = 0 on them."""
    if MASK_ROWS:
        lse = tl.load(lse_ptrs, mask=rows < seqlen_q, other=float("-inf"))
        delta = tl.load(delta_ptrs, mask=rows < seqlen_q, other=0.0)
    else:
        lse = tl.load(lse_ptrs)
        delta = tl.load(delta_ptrs)
    lse = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    return lse, delta


# `_attn_bwd_dq`'s FUSED bits (the kernels test them as the literals 2 and 4: the interpreter cannot `&` an int
# with a constexpr)
FUSED_ON, FUSED_DLSE, FUSED_SINK = 1, 2, 4


@triton.jit
def _fused_delta(o_ptrs, do, lse_ptrs, delta_ptrs, dlse_ptrs, sink_ptr, part_ptr, rows, seqlen_q, offs_dv,
                 FUSED: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr):
    """The preprocess' work for a dQ program's rows (`_attn_bwd_preprocess`, which then does not run): delta =
    rowsum(dO ∘ O) in fp32, minus dlse where lse is finite (FUSED_DLSE), stored for the dK/dV kernel, which runs
    after; FUSED_SINK: the rows' share of the sink's gradient, −Σ exp(sink − lse) · delta, into part_ptr. Returns
    (lse · log2(e), delta) as `_load_lse_delta` does."""
    o = load_tile(o_ptrs, rows, seqlen_q, offs_dv, True, HEAD_DIM_V, BLOCK_DV)
    in_seq = rows < seqlen_q
    lse = tl.load(lse_ptrs, mask=in_seq, other=float("-inf"))
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)  # 0 past the sequence
    if FUSED & 2:
        delta -= tl.where(lse == float("-inf"), 0.0, tl.load(dlse_ptrs, mask=in_seq, other=0.0))
    if FUSED & 4:
        p_sink = tl.where(lse == float("-inf"), 0.0, tl.exp(tl.load(sink_ptr).to(tl.float32) - lse))
        tl.store(part_ptr, -tl.sum(p_sink * delta, axis=0))
    tl.store(delta_ptrs, delta, mask=in_seq)
    return tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634), delta


@triton.jit
def _dot_ds(ds, b, acc, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + dS · b, the fp32 tile dS rounded to b's dtype for the tensor cores; below 16 head dims as two such
    tiles, its rounding and the residual, so that the product is as exact as in fp32. There the rounding of dS
    alone dominates dQ's and dK's error there (1 / sqrt(D) sharpens the softmax: with one tile, D=1 fp16 dQ is off
    by 4.7x torch's own error on an H100, past the tests' rule, `tests/test_every_head_dim.py`), and the second
    MMA costs little beside the 16-column tiles' other work."""
    ds_lo = ds.to(b.dtype)
    acc = tl.dot(ds_lo, b, acc, input_precision=DOT_PRECISION)
    if HEAD_DIM < 16 and b.dtype != tl.float32:
        acc = tl.dot((ds - ds_lo.to(tl.float32)).to(b.dtype), b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _attn_bwd_dkdv_tile(
    dk, dv, k, v,
    Q, DO, LSE, DELTA,  # scalar pointers at (batch, first query head of the group, row 0)
    stride_qm, stride_qh, stride_dom, stride_doh, stride_lh,
    q_offs, do_offs,  # (BLOCK_M, BLOCK_D) and (BLOCK_M, BLOCK_DV) offsets of a tile inside one head
    offs_n, offs_m, offs_d, offs_dv,
    start_m, end_m, group_size, seqlen_q, diag, qk_scale,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr = False, left=0, right=0, HAS_SOFTCAP: tl.constexpr = False, softcap=0.0,
    HAS_ALIBI: tl.constexpr = False, slopes=None,  # the group's first query head's ALiBi slope (a pointer)
    HAS_DROPOUT: tl.constexpr = False, seed=0, offset=0, bh=0, dropout_threshold=0, dropout_scale=1.0, start_n=0,
):
    """Add the contribution of query rows [start_m, end_m) of each of the group's `group_size` query heads
    to the resident key tile's dK, dV. One flat loop over (head, row tile): a nested loop over heads costs
    the compiler far more registers. Works on transposed scores (keys x queries): no P tile is transposed.
    HAS_DROPOUT (the key tile starts at start_n): `bh` is the group's first query head's batch · Hq + head, and with keep-mask Z (`variant.
    dropout_keep`, the forward's bits) dV = (P ∘ Z / (1 - p))ᵀ dO and dS = P ∘ (dP ∘ Z / (1 - p) - delta)."""
    n_tiles = tl.cdiv(end_m - start_m, BLOCK_M)
    # max(.., 1): an empty stage must not divide by zero, even in the addresses the software pipeline
    # computes ahead of the loop (seen on the H200 as an illegal memory access).
    n_tiles_safe = tl.maximum(n_tiles, 1)
    for it in range(0, n_tiles * group_size):
        g = it // n_tiles_safe
        m = start_m + (it - g * n_tiles_safe) * BLOCK_M
        rows = m + offs_m  # (BLOCK_M,) query indices
        m64 = m.to(tl.int64)
        q = load_tile(Q + (g * stride_qh + m64 * stride_qm) + q_offs, rows, seqlen_q, offs_d,
                       MASKED, HEAD_DIM, BLOCK_D)  # (BLOCK_M, BLOCK_D)
        do = load_tile(DO + (g * stride_doh + m64 * stride_dom) + do_offs, rows, seqlen_q, offs_dv,
                        MASKED, HEAD_DIM_V, BLOCK_DV)  # (BLOCK_M, BLOCK_DV)
        lse, delta = _load_lse_delta(LSE + (g * stride_lh + m64) + offs_m, DELTA + (g * stride_lh + m64) + offs_m,
                                     rows, seqlen_q, MASKED)  # (BLOCK_M,)
        if UPCAST_DOT:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M) fp32
        if HAS_SOFTCAP:
            s_t, cap_grad = softcap_scores_and_grad(qk_t, qk_scale, softcap, DOT_PRECISION != "ieee")
        else:
            s_t = qk_t * qk_scale
        if HAS_ALIBI:  # query head g's slope, in base 2
            s_t = s_t + alibi_bias(rows[None, :], offs_n[:, None], diag, tl.load(slopes + g) * 1.4426950408889634)
        p_t = tl.math.exp2(s_t - lse[None, :])  # (BLOCK_N, BLOCK_M)
        if MASKED and (IS_CAUSAL or HAS_WINDOW):
            p_t = tl.where(visible(True, rows[None, :], offs_n[:, None], diag, IS_CAUSAL, HAS_WINDOW, left, right),
                           p_t, 0.0)
        if HAS_DROPOUT:
            keep_t = dropout_keep(seed, offset, bh + g, m, start_n, dropout_threshold, BLOCK_M, offs_n.shape[0], True)
            dv = tl.dot(tl.where(keep_t, p_t * dropout_scale, 0.0).to(do.dtype), do, dv,
                        input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_DV)
        else:
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_DV)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        if HAS_DROPOUT:
            dp_t = tl.where(keep_t, dp_t * dropout_scale, 0.0)
        ds_t = p_t * (dp_t - delta[None, :])
        if HAS_SOFTCAP:
            ds_t = ds_t * cap_grad
        dk = _dot_ds(ds_t, q, dk, HEAD_DIM, DOT_PRECISION)  # (BLOCK_N, BLOCK_D)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    CU_SEQLENS_Q, CU_SEQLENS_K,
    softmax_scale, qk_scale,  # qk_scale = softmax_scale * log2(e); with HAS_SOFTCAP softmax_scale / softcap
    window_left, window_right, softcap,  # the variant's scalars (`Variant.scalars`), None where unused
    ALIBI, stride_alibi_b,  # fp32 slopes (B or 1, Hq) and their batch stride, None without ALiBi
    DROPOUT_RNG, dropout_threshold, dropout_scale,  # `Variant.dropout_args`, None without dropout
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_dob, stride_dom, stride_doh, stride_dod,
    stride_dkb, stride_dkn, stride_dkh, stride_dkd,
    stride_dvb, stride_dvn, stride_dvh, stride_dvd,
    stride_lb, stride_lh,  # LSE and DELTA share one layout
    GROUP_SIZE,
    SEQLEN_Q, SEQLEN_K,
    TUNE_SEQLEN_Q, TUNE_SEQLEN_K,  # power-of-two buckets, autotune key only
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,  # Q and K's head dim, padded to BLOCK_D
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,  # V, dO and dV's, padded to BLOCK_DV
    IS_CAUSAL: tl.constexpr, CAUSAL_BOTTOM_RIGHT: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, IS_VARLEN: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DROPOUT: tl.constexpr = False,
    ACCUMULATE: tl.constexpr = False,  # add to DK, DV's contents instead of overwriting them
):
    pid_n = tl.program_id(0)  # grid (key tiles, kv heads, batch)
    off_hk = tl.program_id(1)
    off_b = tl.program_id(2)
    q_start, seqlen_q = sequence_bounds(CU_SEQLENS_Q, off_b, SEQLEN_Q, IS_VARLEN)
    k_start, seqlen_k = sequence_bounds(CU_SEQLENS_K, off_b, SEQLEN_K, IS_VARLEN)
    b64 = off_b.to(tl.int64)  # int64 base offsets: big batches and packed varlen tensors
    batch_q, batch_do = b64 * stride_qb + q_start * stride_qm, b64 * stride_dob + q_start * stride_dom
    batch_l = b64 * stride_lb + q_start
    batch_k, batch_v = b64 * stride_kb + k_start * stride_kn, b64 * stride_vb + k_start * stride_vn
    batch_dk, batch_dv = b64 * stride_dkb + k_start * stride_dkn, b64 * stride_dvb + k_start * stride_dvn
    start_n = pid_n * BLOCK_N  # causal: the first key tiles see the most queries and start first
    if start_n >= seqlen_k:  # varlen: this sequence is shorter than the longest
        return

    offs_n = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key indices
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = offs_d if BLOCK_DV == BLOCK_D else tl.arange(0, BLOCK_DV)
    k_ptrs = K + batch_k + off_hk * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = V + batch_v + off_hk * stride_vh + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd
    # Keys past the end load as 0; they only touch their own dK/dV rows, which are never stored.
    k = load_tile(k_ptrs, offs_n, seqlen_k, offs_d, True, HEAD_DIM, BLOCK_D)  # (BLOCK_N, BLOCK_D)
    v = load_tile(v_ptrs, offs_n, seqlen_k, offs_dv, True, HEAD_DIM_V, BLOCK_DV)  # (BLOCK_N, BLOCK_DV)
    if UPCAST_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    # Query rows this key tile sees: masked [lo, mid), unmasked [mid, full), masked [full, q_end).
    diag = diagonal(seqlen_q, seqlen_k, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, HAS_WINDOW or HAS_ALIBI)
    lo, mid, full, q_end = query_blocks(start_n, seqlen_q, diag, IS_CAUSAL, BLOCK_M, BLOCK_N, HAS_WINDOW, window_left,
                                        window_right)

    # Pointers at the group's first query head; the tile loops step over heads and rows.
    q_head = Q + batch_q + (off_hk * GROUP_SIZE) * stride_qh
    do_head = DO + batch_do + (off_hk * GROUP_SIZE) * stride_doh
    lse_head = LSE + batch_l + (off_hk * GROUP_SIZE) * stride_lh
    delta_head = DELTA + batch_l + (off_hk * GROUP_SIZE) * stride_lh
    q_offs = offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd  # (BLOCK_M, BLOCK_D)
    do_offs = offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod  # (BLOCK_M, BLOCK_DV)
    if HAS_DROPOUT:
        seed, offset = dropout_state(DROPOUT_RNG)
        bh = off_b * (tl.num_programs(1) * GROUP_SIZE) + off_hk * GROUP_SIZE  # the group's first query head
    else:
        seed, offset, bh = 0, 0, 0
    for stage in tl.static_range(3):  # masked [lo, mid), unmasked [mid, full), masked [full, q_end)
        start = lo if stage == 0 else (mid if stage == 1 else full)
        end = mid if stage == 0 else (full if stage == 1 else q_end)
        dk, dv = _attn_bwd_dkdv_tile(
            dk, dv, k, v, q_head, do_head, lse_head, delta_head,
            stride_qm, stride_qh, stride_dom, stride_doh, stride_lh, q_offs, do_offs, offs_n, offs_m, offs_d, offs_dv,
            start, end, GROUP_SIZE, seqlen_q, diag, qk_scale,
            stage != 1, IS_CAUSAL, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_M, UPCAST_DOT, DOT_PRECISION,
            HAS_WINDOW, window_left, window_right, HAS_SOFTCAP, softcap, HAS_ALIBI,
            ALIBI + off_b * stride_alibi_b + off_hk * GROUP_SIZE if HAS_ALIBI else None,
            HAS_DROPOUT, seed, offset, bh, dropout_threshold, dropout_scale, start_n,
        )

    n_ok = offs_n[:, None] < seqlen_k
    dk_mask, dv_mask = n_ok, n_ok
    if BLOCK_D != HEAD_DIM:
        dk_mask = dk_mask & (offs_d[None, :] < HEAD_DIM)
    if BLOCK_DV != HEAD_DIM_V:
        dv_mask = dv_mask & (offs_dv[None, :] < HEAD_DIM_V)
    dk_ptrs = DK + batch_dk + off_hk * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
    dv_ptrs = DV + batch_dv + off_hk * stride_dvh + offs_n[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd
    dk = dk * softmax_scale
    if ACCUMULATE:  # (one program owns these rows: deterministic)
        dk += tl.load(dk_ptrs, mask=dk_mask).to(tl.float32)
        dv += tl.load(dv_ptrs, mask=dv_mask).to(tl.float32)
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=dk_mask)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=dv_mask)


@triton.jit
def _attn_bwd_dq_tile(
    dq, q, do, lse, delta,
    k_ptrs, v_ptrs, stride_kn, stride_vn,
    offs_m, offs_n, offs_d, offs_dv,
    start_n, end_n, seqlen_k, diag, qk_scale,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr = False, left=0, right=0, HAS_SOFTCAP: tl.constexpr = False, softcap=0.0,
    HAS_ALIBI: tl.constexpr = False, slope=0.0,
    HAS_DROPOUT: tl.constexpr = False, seed=0, offset=0, bh=0, dropout_threshold=0, dropout_scale=1.0, m0=0,
):
    """Add the contribution of keys [start_n, end_n) to the resident query tile's dQ (HAS_DROPOUT: dS = P ∘
    (dP ∘ Z / (1 - p) - delta) with the forward's keep-mask Z, `variant.dropout_keep` of `bh`; the tile's rows
    start at m0)."""
    k_ptrs += start_n * stride_kn
    v_ptrs += start_n * stride_vn
    for n in range(start_n, end_n, BLOCK_N):
        cols = n + offs_n  # (BLOCK_N,) key indices
        k = load_tile(k_ptrs, cols, seqlen_k, offs_d, MASKED, HEAD_DIM, BLOCK_D)  # (BLOCK_N, BLOCK_D)
        v = load_tile(v_ptrs, cols, seqlen_k, offs_dv, MASKED, HEAD_DIM_V, BLOCK_DV)  # (BLOCK_N, BLOCK_DV)
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N) fp32
        if HAS_SOFTCAP:
            s, cap_grad = softcap_scores_and_grad(qk, qk_scale, softcap, DOT_PRECISION != "ieee")
        else:
            s = qk * qk_scale
        if HAS_ALIBI:
            s = s + alibi_bias(offs_m[:, None], cols[None, :], diag, slope)
        p = tl.math.exp2(s - lse[:, None])  # (BLOCK_M, BLOCK_N)
        if MASKED:
            p = tl.where(visible(cols[None, :] < seqlen_k, offs_m[:, None], cols[None, :], diag, IS_CAUSAL,
                                 HAS_WINDOW, left, right), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        if HAS_DROPOUT:
            dp = tl.where(dropout_keep(seed, offset, bh, m0, n, dropout_threshold, offs_m.shape[0], BLOCK_N),
                          dp * dropout_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * cap_grad
        dq = _dot_ds(ds, k, dq, HEAD_DIM, DOT_PRECISION)  # (BLOCK_M, BLOCK_D)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return dq


@triton.jit
def _attn_bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ,
    CU_SEQLENS_Q, CU_SEQLENS_K,
    softmax_scale, qk_scale,
    window_left, window_right, softcap,
    ALIBI, stride_alibi_b,
    DROPOUT_RNG, dropout_threshold, dropout_scale,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_dob, stride_dom, stride_doh, stride_dod,
    stride_dqb, stride_dqm, stride_dqh, stride_dqd,
    stride_lb, stride_lh,
    GROUP_SIZE,
    SEQLEN_Q, SEQLEN_K,
    TUNE_SEQLEN_Q, TUNE_SEQLEN_K,
    O, DLSE, SINK, SINK_PART,  # FUSED: the forward's out, dlse, the sinks and their gradient's parts; else None
    stride_ob, stride_om, stride_oh, stride_od, stride_db, stride_dh, stride_dm,  # (likewise)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,  # Q and K's head dim, padded to BLOCK_D
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,  # V, dO and dV's, padded to BLOCK_DV
    IS_CAUSAL: tl.constexpr, CAUSAL_BOTTOM_RIGHT: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, IS_VARLEN: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DROPOUT: tl.constexpr = False,
    ACCUMULATE: tl.constexpr = False,  # add to DQ's contents instead of overwriting them
    FUSED: tl.constexpr = 0,  # the preprocess' work here (bits FUSED_ON 1, FUSED_DLSE 2, FUSED_SINK 4): `_fused_delta`
):
    pid_m = tl.program_id(0)  # grid (query tiles, heads, batch)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    off_hk = off_h // GROUP_SIZE
    q_start, seqlen_q = sequence_bounds(CU_SEQLENS_Q, off_b, SEQLEN_Q, IS_VARLEN)
    k_start, seqlen_k = sequence_bounds(CU_SEQLENS_K, off_b, SEQLEN_K, IS_VARLEN)
    b64 = off_b.to(tl.int64)
    batch_q, batch_do = b64 * stride_qb + q_start * stride_qm, b64 * stride_dob + q_start * stride_dom
    batch_dq, batch_l = b64 * stride_dqb + q_start * stride_dqm, b64 * stride_lb + q_start
    batch_k, batch_v = b64 * stride_kb + k_start * stride_kn, b64 * stride_vb + k_start * stride_vn

    # Causal tiles near the end of the queries do the most work: hand them out first.
    start_m = tl.num_programs(0) - 1 - pid_m if IS_CAUSAL else pid_m
    part = None  # FUSED_SINK: this program's part of the sink's gradient, at (batch, head, query tile)
    if FUSED & 4:
        part = SINK_PART + (off_b * tl.num_programs(1) + off_h) * tl.num_programs(0) + start_m
    if start_m * BLOCK_M >= seqlen_q:
        if FUSED & 4:  # (so that the host's sum over the parts needs no zeroed buffer)
            tl.store(part, 0.0)
        return

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query rows
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = offs_d if BLOCK_DV == BLOCK_D else tl.arange(0, BLOCK_DV)
    q_ptrs = Q + batch_q + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    do_ptrs = DO + batch_do + off_h * stride_doh + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod
    k_ptrs = K + batch_k + off_hk * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = V + batch_v + off_hk * stride_vh + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd
    q = load_tile(q_ptrs, offs_m, seqlen_q, offs_d, True, HEAD_DIM, BLOCK_D)  # (BLOCK_M, BLOCK_D)
    do = load_tile(do_ptrs, offs_m, seqlen_q, offs_dv, True, HEAD_DIM_V, BLOCK_DV)  # (BLOCK_M, BLOCK_DV)
    if FUSED:
        o_ptrs = O + b64 * stride_ob + q_start * stride_om + off_h * stride_oh + (offs_m[:, None] * stride_om
                                                                                 + offs_dv[None, :] * stride_od)
        dlse_ptrs = None
        if FUSED & 2:
            dlse_ptrs = DLSE + b64 * stride_db + off_h * stride_dh + (q_start + offs_m) * stride_dm
        sink_ptr = None
        if FUSED & 4:
            sink_ptr = SINK + off_h
        lse, delta = _fused_delta(o_ptrs, do, LSE + batch_l + off_h * stride_lh + offs_m,
                                  DELTA + batch_l + off_h * stride_lh + offs_m, dlse_ptrs, sink_ptr, part,
                                  offs_m, seqlen_q, offs_dv, FUSED, HEAD_DIM_V, BLOCK_DV)
    else:
        lse, delta = _load_lse_delta(LSE + batch_l + off_h * stride_lh + offs_m,
                                     DELTA + batch_l + off_h * stride_lh + offs_m, offs_m, seqlen_q, True)
    if UPCAST_DOT:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    diag = diagonal(seqlen_q, seqlen_k, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, HAS_WINDOW or HAS_ALIBI)
    slope = tl.load(ALIBI + off_b * stride_alibi_b + off_h) * 1.4426950408889634 if HAS_ALIBI else 0.0  # base 2
    first, start, lo, hi = key_blocks(start_m, seqlen_k, diag, IS_CAUSAL, BLOCK_M, BLOCK_N, HAS_WINDOW, window_left,
                                      window_right)
    if HAS_DROPOUT:
        seed, offset = dropout_state(DROPOUT_RNG)
        bh = off_b * tl.num_programs(1) + off_h  # the grid's axis 1 is the query heads
    else:
        seed, offset, bh = 0, 0, 0

    if HAS_WINDOW:  # the window's left edge: masked
        dq = _attn_bwd_dq_tile(
            dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, offs_d, offs_dv,
            first, start, seqlen_k, diag, qk_scale,
            True, IS_CAUSAL, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, UPCAST_DOT, DOT_PRECISION,
            HAS_WINDOW, window_left, window_right, HAS_SOFTCAP, softcap, HAS_ALIBI, slope,
            HAS_DROPOUT, seed, offset, bh, dropout_threshold, dropout_scale, start_m * BLOCK_M,
        )
    dq = _attn_bwd_dq_tile(
        dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, offs_d, offs_dv,
        start, lo, seqlen_k, diag, qk_scale,
        False, IS_CAUSAL, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, UPCAST_DOT, DOT_PRECISION,
        HAS_WINDOW, window_left, window_right, HAS_SOFTCAP, softcap, HAS_ALIBI, slope,
        HAS_DROPOUT, seed, offset, bh, dropout_threshold, dropout_scale, start_m * BLOCK_M,
    )
    dq = _attn_bwd_dq_tile(
        dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, offs_d, offs_dv,
        lo, hi, seqlen_k, diag, qk_scale,
        True, IS_CAUSAL, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, UPCAST_DOT, DOT_PRECISION,
        HAS_WINDOW, window_left, window_right, HAS_SOFTCAP, softcap, HAS_ALIBI, slope,
        HAS_DROPOUT, seed, offset, bh, dropout_threshold, dropout_scale, start_m * BLOCK_M,
    )

    dq_ptrs = DQ + batch_dq + off_h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd
    dq_mask = offs_m[:, None] < seqlen_q
    if BLOCK_D != HEAD_DIM:
        dq_mask = dq_mask & (offs_d[None, :] < HEAD_DIM)
    dq = dq * softmax_scale
    if ACCUMULATE:
        dq += tl.load(dq_ptrs, mask=dq_mask).to(tl.float32)
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=dq_mask)


_attn_bwd_dkdv_tuned = triton.autotune(
    configs=configs.BWD_DKDV_CONFIGS,
    key=configs.BWD_AUTOTUNE_KEY,
    prune_configs_by={"early_config_prune": configs.prune_bwd_dkdv_configs},
    cache_results=True,
)(_attn_bwd_dkdv)

_attn_bwd_dq_tuned = triton.autotune(
    configs=configs.BWD_DQ_CONFIGS,
    key=configs.BWD_AUTOTUNE_KEY,
    prune_configs_by={"early_config_prune": configs.prune_bwd_dq_configs},
    cache_results=True,
)(_attn_bwd_dq)


class _PreprocessPlan:
    """The preprocess launch of one call signature: its grid, int arguments (strides, seqlen_q), what it writes
    (lse / delta like lse, or padded to `lse_shape`; either with `lse_strides`; the sink's per-program parts,
    `part_shape`) and the launch."""

    __slots__ = ("grid", "ints", "lse_shape", "lse_strides", "part_shape", "launch")


def _preprocess_plan(out, dout, lse, cu_seqlens_q, max_seqlen_q, padded, dlse, sink, keep=False) -> _PreprocessPlan:
    """The preprocess of these tensors (`preprocess` says what each is); `keep`: the plan is kept for later calls
    of the same signature, which relaunch its compiled kernel (`KeptLaunch`)."""
    varlen = cu_seqlens_q is not None
    heads_q, head_dim = out.shape[-2], out.shape[-1]
    if varlen:
        batch, seqlen_q = cu_seqlens_q.numel() - 1, max_seqlen_q
        o_s, do_s, l_s = (0, *out.stride()), (0, *dout.stride()), (0, lse.stride(0))
    else:
        batch, seqlen_q = out.shape[0], out.shape[1]
        o_s, do_s, l_s = out.stride(), dout.stride(), (lse.stride(0), lse.stride(1))
    plan = _PreprocessPlan()
    rows, plan.lse_shape, p_s = seqlen_q, None, l_s
    if padded:  # fresh, contiguous (*lse.shape[:-1], n_pad) buffers
        n_pad = backward_gluon_launch.padded_rows(out.shape[0] if varlen else seqlen_q, varlen, batch)
        plan.lse_shape = (*lse.shape[:-1], n_pad)
        p_s = (0, n_pad) if varlen else (heads_q * n_pad, n_pad)
        if not varlen:
            rows = n_pad  # the padding rows are written too
    d_s = (0, 0, 0) if dlse is None else (0, *dlse.stride()) if varlen else dlse.stride()
    plan.grid = (cdiv(rows, PREPROCESS_BLOCK_M), heads_q, batch)
    meta = dict(HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim), IS_VARLEN=varlen, BLOCK_M=PREPROCESS_BLOCK_M,
                PADDED=padded, HAS_DLSE=dlse is not None)
    plan.part_shape = None
    if sink is not None:
        plan.part_shape = (batch, heads_q, plan.grid[0])
        meta.update(HAS_SINK=True)  # (absent otherwise: the kernel's default, and the sink-free calls' launch key)
    plan.ints, plan.lse_strides = (*o_s, *do_s, *l_s, *p_s, *d_s, seqlen_q), p_s
    plan.launch = KeptLaunch(_attn_bwd_preprocess, meta, keep)
    return plan


def _run_preprocess(plan: _PreprocessPlan, out, dout, lse, cu_seqlens_q, dlse, sink):
    """(lse, delta, dsink) of `preprocess`, through its plan."""
    if plan.lse_shape is None:
        lse_out, delta = lse, torch.empty_like(lse)
    else:
        lse_out = torch.empty(plan.lse_shape, dtype=torch.float32, device=out.device)
        delta = torch.empty_like(lse_out)
    part = None if plan.part_shape is None else torch.empty(plan.part_shape, dtype=torch.float32, device=out.device)
    plan.launch(plan.grid, (out, dout, lse, delta, lse_out, cu_seqlens_q, dlse, sink, part, *plan.ints))
    return lse_out, delta, None if part is None else part.sum(dim=(0, 2)).to(sink.dtype)


def preprocess(out, dout, lse, cu_seqlens_q=None, max_seqlen_q=None, padded=False, dlse=None, sink=None):
    """(lse, delta, dsink) for the backward kernels; delta = rowsum(dO ∘ O) in fp32. out, dout (B, Sq, Hq, Dv) with lse
    (B, Hq, Sq), or varlen (total_q, Hq, Dv) with lse (Hq, total_q) and cu_seqlens_q. Not padded: delta like lse,
    lse itself. Padded (the Gluon kernels, which load whole 16-byte aligned tiles): both in
    `backward_gluon_launch.padded_rows`' layout, written by the one preprocess launch (no fill, no copy).
    dlse (shaped like lse, fp32, any strides): the gradient of lse, subtracted from delta in the same launch.
    sink ((Hq,), the forward's learnable_sink): dsink, its gradient in its dtype, from the same launch's per-tile
    parts and one torch sum over them (None without a sink)."""
    plan = _preprocess_plan(out, dout, lse, cu_seqlens_q, max_seqlen_q, padded, dlse, sink)
    return _run_preprocess(plan, out, dout, lse, cu_seqlens_q, dlse, sink)


class _BackwardPlan:
    """What a backward call's launches need that its signature decides (`_plan_key`): the Gluon config or None,
    the preprocess, and the Triton kernels' configs, grids, constant arguments and launches. Built once per
    signature and kept, so that a call repeats only the allocations, the pointer checks and the launches."""

    __slots__ = ("gluon_config", "gluon_dense", "pre", "head", "alibi_stride", "dropout", "ints_dkdv", "ints_dq",
                 "grid_dkdv", "grid_dq", "dkdv", "dq", "constexprs", "fused", "fused_ints")


_PLANS: dict = {}  # `_plan_key` -> _BackwardPlan
_PLAN_LIMIT = 1024  # entries; a workload with ever-new shapes starts over rather than growing without bound


def _plan_key(dout, q, k, v, out, lse, softmax_scale, variant, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
              max_seqlen_k, alibi_slopes, learnable_sink, dlse, rng_state):
    """The signature a plan is kept under: shapes, strides, dtypes and device of the tensors (a kept launch runs
    the kernel compiled for them), the scale, the variant, the varlen lengths, the dispatch switch and the configs
    the Gluon decision reads (which tests and benchmarks patch); None (the plan is built for the call alone) where
    a pointer is not 16-byte aligned, since a kept launch assumes the compiled kernel's alignment."""
    extras = tuple(t for t in (cu_seqlens_q, cu_seqlens_k, alibi_slopes, learnable_sink, dlse, rng_state)
                   if t is not None)
    pointers = q.data_ptr() | k.data_ptr() | v.data_ptr() | dout.data_ptr() | out.data_ptr() | lse.data_ptr()
    for t in extras:
        pointers |= t.data_ptr()
    if pointers & 15:
        return None
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), dout.stride(), out.stride(), lse.stride(),
            (q.dtype, k.dtype, v.dtype, dout.dtype, out.dtype, lse.dtype), q.device, softmax_scale, variant,
            cu_seqlens_q is not None, max_seqlen_q, max_seqlen_k,
            tuple((t.shape, t.stride(), t.dtype) for t in extras),  # (cu_seqlens' shapes: the sequence count)
            dispatch.CHOICE, configs.AUTOTUNE, configs.gluon_bwd_config, configs.backward.GLUON_BWD_MIN_FLOPS,
            configs.backward.GLUON_BWD_D64_MIN_KEYS, configs.backward.GLUON_BWD_DROPOUT,
            configs.backward.GLUON_BWD_FUSED_DELTA, configs.backward.GLUON_BWD_FUSED_SINK,
            configs.backward.TRITON_BWD_FUSED_DELTA, configs.backward.GLUON_BWD_TRIM,
            configs.backward.GLUON_BWD_TRIM_PIECES, configs.backward.GLUON_BWD_DQ_SPLIT,
            configs.backward.GLUON_BWD_DKDV_SPLIT)


def _backward_plan(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, variant, cu_seqlens_q, max_seqlen_q,
                   max_seqlen_k, config, given, accumulate, alibi_slopes, learnable_sink, dlse,
                   keep) -> _BackwardPlan:
    """The plan of one call (`attention_backward` says what each argument is); `keep`: kept for later calls of
    the same signature (their launches relaunch the compiled kernels)."""
    varlen = cu_seqlens_q is not None
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    separate_v = head_dim_v != head_dim
    causal = variant.causal
    if varlen:
        batch, heads_q, heads_kv = cu_seqlens_q.numel() - 1, q.shape[1], k.shape[1]
        seqlen_q, seqlen_k = max_seqlen_q, max_seqlen_k
    else:
        batch, seqlen_q, heads_q, _ = q.shape
        seqlen_k, heads_kv = k.shape[1], k.shape[2]
    plan = _BackwardPlan()
    gluon_config = None
    if (config is None and backward_gluon_launch is not None and dispatch.gluon_bwd_allowed()
            and tma_ok(q, k, v, dout)  # (no broadcast, stride-0, dimension among them)
            and dispatch.supports("gluon_bwd", q.dtype, head_dim, 9, varlen, False, variant.fields(), separate_v)):
        rows = q.shape[0] if varlen else batch * seqlen_q  # varlen: every row against the longest key range
        if "window_size" in variant.fields():  # the band's FLOPs (a varlen row: as many as a longest sequence's)
            fwd_flops = rows * _visible_fwd_flops_per_row(variant, heads_q, seqlen_q, seqlen_k, head_dim)
        else:
            fwd_flops = 4 * rows * heads_q * seqlen_k * head_dim / (2 if causal else 1)
        gluon_config = configs.gluon_bwd_config(head_dim, seqlen_q, seqlen_k, bool(causal), fwd_flops, varlen,
                                                head_dim_v, bool(variant.dropout_p),
                                                window="window_size" in variant.fields(),
                                                softcap="softcap" in variant.fields(),
                                                alibi="alibi_slopes" in variant.fields())
        if gluon_config is not None and heads_q * (1 if varlen else batch) * backward_gluon_launch.padded_rows(
                q.shape[0] if varlen else seqlen_q, varlen, batch) >= 2**31:  # the padded lse / delta's TMA
            gluon_config = None  # coordinates are int32
    if gluon_config is not None and not accumulate and (
            (given and {dq.dtype, dk.dtype, dv.dtype} != {q.dtype}) or not tma_ok(q, dq, dk, dv)):
        gluon_config = None  # buffers the Gluon kernels cannot write: the Triton kernels
    if gluon_config is not None and varlen and gluon_config["dq"] is None:
        raise ValueError("the Triton dQ kernel cannot read the Gluon kernels' varlen lse / delta layout: a varlen "
                         "Gluon config needs a 'dq' config too")
    plan.gluon_config = gluon_config
    plan.pre = _preprocess_plan(out, dout, lse, cu_seqlens_q, seqlen_q, gluon_config is not None, dlse,
                                learnable_sink, keep)
    plan.dkdv = plan.dq = plan.gluon_dense = None
    if gluon_config is not None and not varlen and not accumulate and gluon_config["dq"] is not None:
        # the preprocess in the dQ kernel (`_attn_bwd_dq_gluon`'s FUSED_DELTA bits), the sink's gradient's parts too
        # where GLUON_BWD_FUSED_SINK says so
        # (the dQ kernel reads O's rows 16 bytes at a time: not a view whose last dim is strided; tiles up to 128
        # columns wide, where it was timed: `configs.backward.GLUON_BWD_FUSED_DELTA`)
        fused = 0
        if configs.backward.GLUON_BWD_FUSED_DELTA and out.stride(-1) == 1 and (
                backward_gluon_launch.head_block(max(head_dim, head_dim_v)) <= 128) and (
                learnable_sink is None or configs.backward.GLUON_BWD_FUSED_SINK):
            fused = (backward_gluon_launch.FD_ON | backward_gluon_launch.FD_DLSE * (dlse is not None)
                     | backward_gluon_launch.FD_SINK * (learnable_sink is not None))
        plan.gluon_dense = backward_gluon_launch.DenseBackward(q, k, variant, gluon_config, softmax_scale, alibi_slopes,
                                                               head_dim_v, fused)
    if gluon_config is not None and (accumulate or gluon_config["dq"] is not None):
        return plan  # the Gluon kernels take the whole call (accumulating: `attention_backward` runs it anew)

    # The Triton kernels: dK/dV unless the Gluon kernel runs it, then dQ.
    if varlen:
        strides = [(0, *t.stride()) for t in (q, k, v, dout, dq, dk, dv)]  # zero batch stride
    else:
        strides = [t.stride() for t in (q, k, v, dout, dq, dk, dv)]
    l_s = plan.pre.lse_strides  # of the lse / delta the preprocess writes
    q_s, k_s, v_s, do_s, dq_s, dk_s, dv_s = strides
    block_d, block_dv = padded_head_dim(head_dim), padded_head_dim(head_dim_v)
    upcast, precision = dot_settings(q.dtype)
    plan.head = (softmax_scale, *variant.scalars(softmax_scale))
    plan.alibi_stride = alibi_batch_stride(alibi_slopes)
    plan.dropout = variant.dropout_args()[1:]
    tail = (heads_q // heads_kv, seqlen_q, seqlen_k, configs.seqlen_bucket(seqlen_q), configs.seqlen_bucket(seqlen_k))
    plan.ints_dkdv = (*q_s, *k_s, *v_s, *do_s, *dk_s, *dv_s, *l_s, *tail)
    plan.ints_dq = (*q_s, *k_s, *v_s, *do_s, *dq_s, *l_s, *tail)
    constexprs = dict(
        HEAD_DIM=head_dim, BLOCK_D=block_d, HEAD_DIM_V=head_dim_v, BLOCK_DV=block_dv,
        **variant.constexprs, **variant.score_constexprs, IS_VARLEN=varlen,
        UPCAST_DOT=upcast, DOT_PRECISION=precision,
    )
    if variant.dropout_p:  # (absent otherwise: the kernels' default, and the launch key of the dropout-free calls)
        constexprs.update(variant.dropout_constexprs)
    if accumulate:  # (likewise)
        constexprs.update(ACCUMULATE=True)
    if config is None and INTERPRET:
        config = configs.BWD_INTERPRETER_CONFIG
    if config is None and (not configs.AUTOTUNE or accumulate):  # (autotuning would add once per candidate run)
        config = configs.default_bwd_configs(max(block_d, block_dv), q.element_size(), q.device, bool(causal))
    if config is not None and "dkdv" not in config:
        config = {"dkdv": config, "dq": config}

    def grid_dkdv(meta):
        return (cdiv(seqlen_k, meta["BLOCK_N"]), heads_kv, batch)

    def grid_dq(meta):
        return (cdiv(seqlen_q, meta["BLOCK_M"]), heads_q, batch)

    plan.constexprs = constexprs
    plan.fused, plan.fused_ints = 0, (None,) * 7
    if config is None:  # autotuned (`_attn_bwd_dkdv_tuned` / `_attn_bwd_dq_tuned`): the grids as functions
        plan.grid_dkdv, plan.grid_dq = grid_dkdv, grid_dq
    else:
        plan.grid_dkdv, plan.grid_dq = grid_dkdv(config["dkdv"]), grid_dq(config["dq"])
        dq_meta = {**constexprs, **config["dq"]}
        if gluon_config is None and configs.backward.TRITON_BWD_FUSED_DELTA:  # the preprocess in the dQ kernel
            plan.fused = FUSED_ON | FUSED_DLSE * (dlse is not None) | FUSED_SINK * (learnable_sink is not None)
            o_s = (0, *out.stride()) if varlen else out.stride()
            d_s = (None,) * 3 if dlse is None else (0, *dlse.stride()) if varlen else dlse.stride()
            plan.fused_ints = (*o_s, *d_s)
            dq_meta.update(FUSED=plan.fused)  # (absent otherwise: the launch key of the unfused calls)
        plan.dkdv = KeptLaunch(_attn_bwd_dkdv, {**constexprs, **config["dkdv"]}, keep)
        plan.dq = KeptLaunch(_attn_bwd_dq, dq_meta, keep)
    return plan


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    causal_bottom_right: bool = True,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    config: dict | None = None,
    zero_fill: bool = True,
    dlse: torch.Tensor | None = None,
    window_size: tuple = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    learnable_sink: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    rng_state: torch.Tensor | None = None,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    accumulate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernels on validated inputs (what `attention_forward` took and returned).

    Dense:  q (B, Sq, Hq, D); dout, out (B, Sq, Hq, Dv); k (B, Sk, Hkv, D); v (B, Sk, Hkv, Dv); lse (B, Hq, Sq) fp32
    Varlen: q (total_q, Hq, D); dout, out (total_q, Hq, Dv); k (total_k, Hkv, D); v (total_k, Hkv, Dv);
            lse (Hq, total_q); cu_seqlens int32 (B + 1,)
    Dv (V's head dim) may differ from D: the Triton kernels run such calls (the Gluon ones declare Dv == D only).
    Returns dq like q and dk, dv like k, v (GQA: summed over each kv head's query heads). Deterministic (the
    Gluon kernels too: no atomics). Any strides with a contiguous last dim. `config` forces the Triton kernels'
    {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"} for both, or {"dkdv": {...}, "dq": {...}} one each, instead of
    autotuning (and of the Gluon kernels).
    Varlen with `zero_fill`: the gradients start at zero, so tokens outside every sequence get 0; pass False
    when cu_seqlens cover every token (the kernels write every other row), saving three memsets.
    dlse: the gradient of lse (shaped like it, fp32), or None when lse is not differentiated (no extra work).
    dropout_p, rng_state: the forward's (its keep-mask is regenerated, never stored); the Triton kernels run them,
    or the Gluon ones where `configs.gluon_bwd_config` takes dropout (`configs.backward.GLUON_BWD_DROPOUT`).
    dq, dk, dv: where to write the gradients (shaped like q, k, v; any float dtype, any strides, e.g. fp32 views
    into a caller's accumulators), else new tensors like q, k, v. `accumulate`: add to their contents instead
    (each element has one writer: still deterministic). Buffers of another dtype than q's run the Triton kernels
    (the Gluon ones write q's dtype, and overwrite); `accumulate` where the Gluon kernels take the call runs them
    into new tensors of q's dtype and adds those (the Triton kernels add their fp32 sums directly).
    A call without a forced config or given buffers takes the plan kept for its signature (`_plan_key`).
    """
    varlen = cu_seqlens_q is not None
    given = dq is not None or dk is not None or dv is not None
    alloc = torch.zeros if varlen and zero_fill else torch.empty
    dq, dk, dv = (alloc(t.shape, dtype=t.dtype, device=t.device) if g is None
                  else g.zero_() if varlen and zero_fill and not accumulate else g
                  for g, t in ((dq, q), (dk, k), (dv, v)))
    if varlen:
        seqlen_q, seqlen_k = max_seqlen_q, max_seqlen_k
    else:
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    if q.numel() == 0 or k.numel() == 0 or not seqlen_q or not seqlen_k:
        if not accumulate:  # no query sees a key: every gradient is 0
            dq, dk, dv = dq.zero_(), dk.zero_(), dv.zero_()
        if learnable_sink is not None:  # every row's softmax is the sink alone: dsink = sum of dlse
            dsink = torch.zeros_like(learnable_sink) if dlse is None else \
                dlse.sum(dim=1 if varlen else (0, 2)).to(learnable_sink.dtype)
            return dq, dk, dv, dsink
        return dq, dk, dv
    variant = Variant.of(causal, causal_bottom_right, window_size, softcap, alibi_slopes is not None,
                         learnable_sink is not None, dropout_p)
    if dropout_p and rng_state is None:
        raise ValueError("dropout_p > 0 needs rng_state, the forward's int64 (seed, offset) tensor")
    lse = lse.contiguous()  # already so as the forward returns it
    key = None
    if config is None and not given and not accumulate:
        key = _plan_key(dout, q, k, v, out, lse, softmax_scale, variant, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, alibi_slopes, learnable_sink, dlse, rng_state)
    plan = _PLANS.get(key) if key is not None else None
    if plan is None:
        plan = _backward_plan(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, variant, cu_seqlens_q,
                              max_seqlen_q, max_seqlen_k, config, given, accumulate, alibi_slopes, learnable_sink,
                              dlse, key is not None)
        if key is not None:
            if len(_PLANS) >= _PLAN_LIMIT:
                _PLANS.clear()
            _PLANS[key] = plan
    gluon_config = plan.gluon_config
    if gluon_config is not None and accumulate:
        # The Gluon kernels overwrite, in q's dtype: the call's gradients in new tensors, added to the accumulators
        # (each call's share rounded once, as ring-flash-attention's partials are; the sum in the buffers' dtype).
        grads = attention_backward(dout, q, k, v, out, lse, softmax_scale, causal, causal_bottom_right, cu_seqlens_q,
                                   cu_seqlens_k, max_seqlen_q, max_seqlen_k, None, zero_fill, dlse, window_size,
                                   softcap, alibi_slopes, learnable_sink, dropout_p, rng_state)
        for buffer, grad in zip((dq, dk, dv), grads):
            buffer.add_(grad)
        return (dq, dk, dv, *grads[3:])

    # The preprocess' work: in the dQ kernel (the Gluon one of a dense call, or the Triton one), which then goes
    # first, into fresh buffers (the sink's gradient from its parts); else the preprocess kernel.
    fused = plan.gluon_dense.fused if plan.gluon_dense is not None else plan.gluon_config is None and plan.fused
    part = dsink = None
    if fused:
        lse_out = lse if plan.pre.lse_shape is None else torch.empty(plan.pre.lse_shape, dtype=torch.float32,
                                                                     device=q.device)
        delta = torch.empty_like(lse_out)
        if learnable_sink is not None:  # (batch, heads, a part per query tile or warpgroup block)
            part = torch.empty(plan.grid_dq[::-1] if plan.gluon_dense is None else
                               backward_gluon_launch.sink_parts_shape(q.shape), dtype=torch.float32, device=q.device)
    else:
        lse_out, delta, dsink = _run_preprocess(plan.pre, out, dout, lse, cu_seqlens_q, dlse, learnable_sink)
    if plan.gluon_dense is not None:
        backward_gluon_launch.launch_dense(plan.gluon_dense, q, k, v, dout, dq, dk, dv, lse_out, delta,
                                           softmax_scale, alibi_slopes, rng_state if dropout_p else None,
                                           *((out, lse, dlse, learnable_sink, part) if fused else ()))
    elif gluon_config is not None:
        varlen_args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        backward_gluon_launch.launch_dkdv_gluon(q, k, v, dout, dk, dv, lse_out, delta, softmax_scale, causal,
                                                causal_bottom_right, gluon_config["dkdv"], *varlen_args, window_size,
                                                softcap, alibi_slopes, dropout_p, rng_state)
        if gluon_config["dq"] is not None:
            backward_gluon_launch.launch_dq_gluon(q, k, v, dout, dq, lse_out, delta, softmax_scale, causal,
                                                  causal_bottom_right, gluon_config["dq"], *varlen_args, window_size,
                                                  softcap, alibi_slopes, dropout_p, rng_state)
    if gluon_config is None or gluon_config["dq"] is None:
        _launch_triton(plan, q, k, v, dout, out, lse_out, delta, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                       alibi_slopes, rng_state if dropout_p else None, dlse, learnable_sink, part, fused)
    if part is not None:
        dsink = part.sum(dim=(0, 2)).to(learnable_sink.dtype)  # (in a fixed order, as the preprocess')
    return (dq, dk, dv) if learnable_sink is None else (dq, dk, dv, dsink)


def _launch_triton(plan, q, k, v, dout, out, lse, delta, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                   rng_state, dlse, learnable_sink, part, fused) -> None:
    """The Triton kernels of `plan`: dK/dV unless the Gluon kernel ran it, and dQ; with `fused` (the preprocess'
    work in the dQ kernel, which fills delta and the sink's `part`s) dQ first."""
    mid = (*plan.head, alibi_slopes, plan.alibi_stride, rng_state, *plan.dropout)
    dq_args = (q, k, v, dout, lse, delta, dq, cu_seqlens_q, cu_seqlens_k, *mid, *plan.ints_dq,
               *((out, dlse, learnable_sink, part, *plan.fused_ints) if fused else _NOT_FUSED))
    if fused:  # (a kept launch: fused plans have fixed configs)
        plan.dq(plan.grid_dq, dq_args)
    if plan.gluon_config is None:
        args = (q, k, v, dout, lse, delta, dk, dv, cu_seqlens_q, cu_seqlens_k, *mid, *plan.ints_dkdv)
        if plan.dkdv is None:
            _attn_bwd_dkdv_tuned[plan.grid_dkdv](*args, **plan.constexprs)
        else:
            plan.dkdv(plan.grid_dkdv, args)
    if fused:
        return
    if plan.dq is None:
        _attn_bwd_dq_tuned[plan.grid_dq](*dq_args, **plan.constexprs)
    else:
        plan.dq(plan.grid_dq, dq_args)


@functools.lru_cache(maxsize=1024)
def _visible_fwd_flops_per_row(variant: Variant, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int) -> float:
    """Forward FLOPs per query row of a (seqlen_q, seqlen_k) call under the variant's mask, over `heads` heads
    (`Variant.visible_flops`, whose O(Sq) count is kept per shape: it is on the Gluon backward's dispatch path)."""
    return variant.visible_flops(1, heads, seqlen_q, seqlen_k, head_dim) / seqlen_q
