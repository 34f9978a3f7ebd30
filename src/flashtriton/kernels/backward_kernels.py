"""FlashAttention-2 backward, the portable Triton kernels (their launcher and plans: `backward`).

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
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import load_tile, sequence_bounds
from .variant import (alibi_bias, diagonal, dropout_select, dropout_state, dropout_tile, key_blocks,
                      query_blocks, softcap_scores_and_grad, visible)


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
    tiles, its rounding and the residual, so that the product is as exact as in fp32. Below 16 the rounding of dS
    alone dominates dQ's and dK's error (1 / sqrt(D) sharpens the softmax: dS as one fp16 tile puts D=1 fp16
    dQ at 4.7x torch's own error on an H100, past the tests' rule, `tests/test_every_head_dim.py`), and the second
    MMA costs little beside the 16-column tiles' other work."""
    ds_rounded = ds.to(b.dtype)
    acc = tl.dot(ds_rounded, b, acc, input_precision=DOT_PRECISION)
    if HEAD_DIM < 16 and b.dtype != tl.float32:
        acc = tl.dot((ds - ds_rounded.to(tl.float32)).to(b.dtype), b, acc, input_precision=DOT_PRECISION)
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
            fields_t = tl.trans(dropout_tile(seed, offset, bh + g, m, start_n, BLOCK_M, offs_n.shape[0]))
            dv = tl.dot(dropout_select(fields_t, dropout_threshold, p_t * dropout_scale).to(do.dtype), do, dv,
                        input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_DV)
        else:
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_DV)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        if HAS_DROPOUT:
            dp_t = dropout_select(fields_t, dropout_threshold, dp_t * dropout_scale)
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
            dp = dropout_select(dropout_tile(seed, offset, bh, m0, n, offs_m.shape[0], BLOCK_N),
                                dropout_threshold, dp * dropout_scale)
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
