"""The Hopper Gluon forward's work on one warpgroup's 64 query rows against its K/V tiles: S = Q Kᵀ as asynchronous
wgmmas (`qk_tile`), the online softmax with the variants' score changes (`softmax_tile`), P V into the fp32
accumulator (`pv`: one or, at V head dims of 129-192, two accumulators), and the loop that overlaps the softmax
of tile j with P V of tile j - 1 (`attend_keys`: `first_tile`, `next_tiles`, `last_pv`). The schedule, the
partitions and the kernel are `forward_gluon`'s (its docstring is the overview)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from .forward_gluon_items import (SC_ALIBI, SC_CAP_FIXED, SC_DROPOUT, SC_O_IN_Q, SC_PV_SPLIT, SC_QK_16, SC_SOFTCAP,
                                  SC_WINDOW)
from .forward_gluon_producer import ROWS
from .gluon_common import dropout_tile, mma_nt, wgmma_layout
from .variant import alibi_bias, dropout_select, key_end, softcap_scores, tanh, tile_masked, visible


@gluon.jit
def wait_v(v_ready, v_fixed, stage, phase, IS_VARLEN: gl.constexpr):
    mbarrier.wait(v_ready.index(stage), phase)
    if IS_VARLEN:
        mbarrier.wait(v_fixed.index(stage), phase)


@gluon.constexpr_function
def qk_width(scores, tile):
    """The columns of Q Kᵀ's product: QK_WIDTH from SCORES' bits (`SC_QK_16`), else the tiles' `tile`."""
    return (scores % SC_O_IN_Q.value // SC_QK_16.value) * 16 or tile


@gluon.constexpr_function
def out_layout(head_dim_v, scores):
    """Registers of a warpgroup's output accumulator (`wgmma_layout`), the parent of the P operand's layout: of
    V's tiles' width, or under PV_SPLIT (`SC_PV_SPLIT`) of its first accumulator's 128 columns."""
    return wgmma_layout(128 if scores & SC_PV_SPLIT.value else head_dim_v)


@gluon.jit
def acc_zero(HEAD_DIM_V: gl.constexpr, SCORES: gl.constexpr):
    """A warpgroup's zero output accumulator: one (ROWS, HEAD_DIM_V) tensor, or under PV_SPLIT (V's head of
    129 … 192 columns in 256-column tiles) a pair over V's columns 0 … 127 and 128 … 191, so that P V skips the
    tiles' 64 zero columns (Triton's tensors are powers of two)."""
    if (SCORES & SC_PV_SPLIT) != 0:
        return (gl.zeros([ROWS, 128], gl.float32, wgmma_layout(128)),
                gl.zeros([ROWS, 64], gl.float32, wgmma_layout(64)))
    else:
        return gl.zeros([ROWS, HEAD_DIM_V], gl.float32, wgmma_layout(HEAD_DIM_V))


@gluon.jit
def pv(p_op, v_tile, acc, SCORES: gl.constexpr):
    """acc + P V of one (BLOCK_N, HEAD_DIM_V) V tile in shared memory as asynchronous wgmmas (`pv_groups` commit
    groups): into each accumulator of `acc_zero` its columns of V."""
    if (SCORES & SC_PV_SPLIT) != 0:
        p_hi = gl.convert_layout(p_op, gl.DotOperandLayout(operand_index=0, parent=wgmma_layout(64), k_width=2))
        return (warpgroup_mma(p_op, v_tile.slice(0, 128, dim=1), acc[0], is_async=True),
                warpgroup_mma(p_hi, v_tile.slice(128, 64, dim=1), acc[1], is_async=True))
    else:
        return warpgroup_mma(p_op, v_tile, acc, is_async=True)


@gluon.constexpr_function
def pv_groups(scores):
    """The commit groups of one `pv`: what a wait for S issued before it leaves outstanding."""
    return 2 if scores & SC_PV_SPLIT.value else 1


@gluon.jit
def pv_wait(acc_tok, p_op, SCORES: gl.constexpr):
    """(acc, p_op) once every wgmma of the tokens is done."""
    if (SCORES & SC_PV_SPLIT) != 0:
        lo, hi, p_op = warpgroup_mma_wait(0, deps=(acc_tok[0], acc_tok[1], p_op))
        return (lo, hi), p_op
    else:
        return warpgroup_mma_wait(0, deps=(acc_tok, p_op))


@gluon.jit
def acc_scaled(acc, factor, SCORES: gl.constexpr):
    """acc times a per-row factor (in the scores' row layout)."""
    if (SCORES & SC_PV_SPLIT) != 0:
        return (acc[0] * gl.convert_layout(factor, gl.SliceLayout(1, wgmma_layout(128)))[:, None],
                acc[1] * gl.convert_layout(factor, gl.SliceLayout(1, wgmma_layout(64)))[:, None])
    else:
        return acc * gl.convert_layout(factor, gl.SliceLayout(1, acc.type.layout))[:, None]


@gluon.jit
def qk_tile(q, k_tile, s_zero, SCORES: gl.constexpr):
    """S = Q Kᵀ of one key tile as asynchronous wgmmas: q (ROWS, HEAD_DIM) and k_tile (BLOCK_N, HEAD_DIM) in shared
    memory, over the QK_WIDTH columns SCORES carries (`gluon_common.mma_nt`: D=192 in 256-column tiles as 128 + 64;
    one commit group per piece), all of them by default; the caller's wait on the returned token covers them."""
    return mma_nt(q, k_tile, s_zero, qk_width(SCORES, k_tile.shape[1]))


@gluon.jit
def alibi_rows(m_i, slope, IS_CAUSAL: gl.constexpr, s_layout: gl.constexpr, SCORES: gl.constexpr):
    """A finished row's m with the part of its causal ALiBi bias that `softmax_tile` leaves out, -slope · (i - row0)
    (the output does not depend on it, lse and a sink's share do)."""
    if (SCORES & SC_ALIBI) and IS_CAUSAL:
        return m_i - slope * gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout)).to(gl.float32)
    else:
        return m_i


@gluon.jit
def consumer_scores(scores, IS_CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, SCORES: gl.constexpr):
    """A consumer's `scores`: the kernel's, and with causal ALiBi the columns 0 .. BLOCK_N - 1 of a score tile in
    fp32 (this thread's), made once: `softmax_tile` scales them by the slope (the conversion is not hoisted out
    of the loops by the compiler)."""
    if (SCORES & SC_ALIBI) and IS_CAUSAL:
        cols_f = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, wgmma_layout(BLOCK_N))).to(gl.float32)
        return scores[0], scores[1], scores[2], scores[3], scores[4], cols_f
    else:
        return scores


@gluon.jit
def rescales(SCORES: gl.constexpr):
    """Whether a tile's softmax can raise a row's m, so that acc is rescaled by alpha (not under CAP_FIXED)."""
    return (SCORES & SC_CAP_FIXED) == 0


@gluon.jit
def softmax_tile(s, m_i, l_i, n, row0, rows, seqlen_k, diag, qk_scale, window, scores, slope, bh,
                  IS_CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr, COMPACT: gl.constexpr = False,
                  SCORES: gl.constexpr = 0):
    """Fold raw scores s (ROWS, BLOCK_N) of keys [n, n + BLOCK_N) into (m_i, l_i): (p, alpha, m_new, l_new).
    Only tiles that reach past the keys or past the band (the first row's diagonal, a window's edges) pay for the
    mask. COMPACT: one compare per score against the row's last visible key, for `_consume_flat` (which says why
    only there), without a window. `scores` = (softcap, ...). The score changes cost special-function and fp32
    instructions per score, which the softmax's overlap with the matmuls hides only in part, so they take their
    shortest forms: softcap alone keeps t = tanh(scale · s) (`variant.tanh`) as the scores, with the cap in the
    scale's place (the cap is > 0: it commutes with the max); ALiBi is `variant.alibi_bias` (after softcap), or,
    causal (every visible key at or left of the diagonal), the bias -slope · (row0 + d - j) of the tile's first
    row: the rest, -slope · (i - row0), is a row's constant, which the softmax ignores and `alibi_rows` adds to m
    once the row is done. DROPOUT: p keeps the scores dropout keeps (`gluon_common.dropout_tile`, of
    sequence-and-head bh), the others 0, after l_new has summed them all (the output is the dropped P V over the
    undropped softmax's denominator, scaled in `_store_item`).
    CAP_FIXED (softcap without ALiBi, bf16, cap · log2(e) <= `forward_gluon_launch.CAP_FIXED_LIMIT`): the capped
    scores t · C (C = cap · log2(e), |t| <= 1) lie in [-C, C], so every row takes the fixed m = 125 - C: p in
    [2^-125, 2^(2C - 125)], normal fp32 and bf16 numbers, no row max, and alpha = 1 (the callers skip the rescale
    of acc, `rescales`): a max and a multiply per score fewer. l sums at most 2^31 · 2^(2C - 125) <= 2^62."""
    HAS_WINDOW: gl.constexpr = (SCORES & SC_WINDOW) != 0
    FOLD_CAP: gl.constexpr = (SCORES & (SC_SOFTCAP | SC_ALIBI)) == SC_SOFTCAP
    SCALED: gl.constexpr = (SCORES & SC_ALIBI) != 0
    # Causal ALiBi in the loop of `_consume_flat` (COMPACT): -slope · (row0 + d - j) = slope · (j - n) + shift,
    # shift = slope · (n - row0 - d), the column part per score (one fused multiply-add with the scale, columns
    # made once by `consumer_scores`), the tile's constant in m: 1.5 instructions per score fewer than the whole
    # bias per score (which the item-by-item loops keep: there the shorter form spills)
    SHIFTED: gl.constexpr = SCALED and IS_CAUSAL and COMPACT
    if FOLD_CAP:
        s = tanh(s * qk_scale, True)
        qk_scale = scores[0]
    if SHIFTED:
        col_bias = (slope * scores[5])[None, :]
        if SCORES & SC_SOFTCAP:
            s = softcap_scores(s, qk_scale, scores[0], True) + col_bias
        else:
            s = gl.fma(s, gl.full(s.shape, qk_scale, gl.float32, s_layout), gl.broadcast(col_bias, s)[0])
        shift = slope * (n - row0 - diag).to(gl.float32)
    elif SCALED:  # s in base 2, scaled
        if SCORES & SC_SOFTCAP:
            s = softcap_scores(s, qk_scale, scores[0], True)
        else:
            s = s * qk_scale
        keys = n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        if IS_CAUSAL:
            s = s + (-slope * ((row0 + diag).to(gl.float32) - keys.to(gl.float32)))[None, :]
        else:
            s = s + alibi_bias(rows[:, None], keys[None, :], diag, slope)
    need_mask = (n + BLOCK_N > seqlen_k) | tile_masked(row0, n + BLOCK_N - 1, diag, IS_CAUSAL, HAS_WINDOW, window[0],
                                                       window[1], row0 + (ROWS - 1), n)
    if need_mask:
        if COMPACT and not HAS_WINDOW:
            cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))  # in the tile
            if IS_CAUSAL:
                keep = cols[None, :] < (gl.minimum(key_end(rows, diag, IS_CAUSAL), seqlen_k) - n)[:, None]
            else:
                keep = cols[None, :] < seqlen_k - n
        else:
            cols = n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            keep = visible(cols[None, :] < seqlen_k, rows[:, None], cols[None, :], diag, IS_CAUSAL, HAS_WINDOW,
                           window[0], window[1])
        s = gl.where(keep, s, float("-inf"))
    if SHIFTED:  # the scores are shift below the row's frame: its max and m_new - shift for the exponent
        m_new = gl.maximum(m_i, gl.max(s, 1) + shift)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - (m_safe - shift)[:, None])
    elif SCALED:
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_safe[:, None])
    elif (SCORES & SC_CAP_FIXED) != 0:
        gl.static_assert(FOLD_CAP, "CAP_FIXED: softcap without ALiBi")
        m_fixed = 125.0 - qk_scale  # qk_scale is C here
        p = gl.exp2(s * qk_scale - m_fixed)
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        # A row that has seen no key yet keeps m = -inf: subtract 0 instead, so exp2 gives 0, not NaN.
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s * qk_scale - m_safe[:, None])
    if (SCORES & SC_CAP_FIXED) != 0:
        l_new = l_i + gl.sum(p, 1)
        m_new = gl.zeros_like(l_i) + m_fixed
        alpha = m_new  # (unused: `rescales` is false)
    else:
        alpha = gl.exp2(m_i - m_safe)
        l_new = l_i * alpha + gl.sum(p, 1)
    if SCORES & SC_DROPOUT:
        dropout = scores[4]
        p = dropout_select(dropout_tile(dropout[0], dropout[1], bh, row0, n, BLOCK_N), dropout[2], p)
    return p, alpha, m_new, l_new


@gluon.jit
def first_softmax(s, row0, first, seqlen_k, diag, qk_scale, window, scores, slope, bh, IS_CAUSAL: gl.constexpr,
                   HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr, BLOCK_N: gl.constexpr, dtype: gl.constexpr,
                   SCORES: gl.constexpr = 0):
    """An item's first tile of scores s (ROWS, BLOCK_N), of keys from `first`, from a fresh softmax state:
    (p_op, m_i, l_i), p_op the P operand of its P V."""
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=out_layout(HEAD_DIM_V, SCORES), k_width=2)
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))  # (ROWS,) query rows
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    p, alpha, m_i, l_i = softmax_tile(s, m_i, l_i, first, row0, rows, seqlen_k, diag, qk_scale, window, scores,
                                       slope, bh, IS_CAUSAL, BLOCK_N, s_layout, False, SCORES)
    return gl.convert_layout(p.to(dtype), p_layout), m_i, l_i


@gluon.jit
def first_tile(q, k_bufs, k_ready, k_empty, c, row0, first, seqlen_k, diag, qk_scale, window, scores, slope, bh,
                IS_CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr, BLOCK_N: gl.constexpr,
                NUM_BUFFERS: gl.constexpr,
                SCORES: gl.constexpr = 0):
    """Tile c of the ring, an item's first: its scores and softmax (its P V goes out with the next tile's
    scores): (p_op, m_i, l_i)."""
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, wgmma_layout(BLOCK_N))
    stage = c % NUM_BUFFERS
    mbarrier.wait(k_ready.index(stage), (c // NUM_BUFFERS) & 1)
    s_tok = qk_tile(q, k_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM]), s_zero, SCORES)
    s = warpgroup_mma_wait(0, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(stage), count=1)
    p_op, m_i, l_i = first_softmax(s, row0, first, seqlen_k, diag, qk_scale, window, scores, slope, bh, IS_CAUSAL,
                                    HEAD_DIM, HEAD_DIM_V, BLOCK_N, q.dtype, SCORES)
    return p_op, m_i, l_i


@gluon.jit
def next_tiles(q, p_op, m_i, l_i, k_bufs, v_bufs, k_ready, v_ready, v_fixed, k_empty, v_empty, c, n_tiles, row0,
                first, seqlen_k, diag, qk_scale, window, scores, slope, bh, IS_CAUSAL: gl.constexpr,
                IS_VARLEN: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr, BLOCK_N: gl.constexpr,
                NUM_BUFFERS: gl.constexpr,
                SCORES: gl.constexpr = 0):
    """Tiles c + 1 .. c + n_tiles - 1 of an item whose first tile (c) left (p_op, m_i, l_i): per tile j, S_j and
    P_{j-1} V_{j-1} as asynchronous wgmmas, S_j's softmax while the second runs (FlashAttention-3's
    intra-warpgroup overlap). Returns (acc, p_op, m_i, l_i): acc holds P V of all but the last tile,
    whose P is p_op."""
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=out_layout(HEAD_DIM_V, SCORES), k_width=2)
    dtype: gl.constexpr = q.dtype
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))  # (ROWS,) query rows
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    acc = acc_zero(HEAD_DIM_V, SCORES)
    stage = c % NUM_BUFFERS
    for j in range(1, n_tiles):
        prev = stage
        stage = (c + j) % NUM_BUFFERS
        mbarrier.wait(k_ready.index(stage), ((c + j) // NUM_BUFFERS) & 1)
        wait_v(v_ready, v_fixed, prev, ((c + j - 1) // NUM_BUFFERS) & 1, IS_VARLEN)
        s_tok = qk_tile(q, k_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM]), s_zero, SCORES)
        acc_tok = pv(p_op, v_bufs.index(prev).reshape([BLOCK_N, HEAD_DIM_V]), acc, SCORES)
        s = warpgroup_mma_wait(pv_groups(SCORES), deps=(s_tok, ))  # S_j done; P_{j-1} V_{j-1} may still run
        mbarrier.arrive(k_empty.index(stage), count=1)
        p, alpha, m_i, l_i = softmax_tile(s, m_i, l_i, first + j * BLOCK_N, row0, rows, seqlen_k, diag, qk_scale,
                                           window, scores, slope, bh, IS_CAUSAL, BLOCK_N, s_layout, False, SCORES)
        acc, p_op = pv_wait(acc_tok, p_op, SCORES)
        mbarrier.arrive(v_empty.index(prev), count=1)
        if rescales(SCORES):
            acc = acc_scaled(acc, alpha, SCORES)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
    return acc, p_op, m_i, l_i


@gluon.jit
def last_pv(acc, p_op, v_bufs, v_ready, v_fixed, v_empty, c, IS_VARLEN: gl.constexpr, HEAD_DIM: gl.constexpr,
             HEAD_DIM_V: gl.constexpr,
             BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr, SCORES: gl.constexpr = 0):
    """acc += P V of ring tile c, an item's last, alone on the tensor cores."""
    stage = c % NUM_BUFFERS
    wait_v(v_ready, v_fixed, stage, (c // NUM_BUFFERS) & 1, IS_VARLEN)
    acc_tok = pv(p_op, v_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM_V]), acc, SCORES)
    acc, p_op = pv_wait(acc_tok, p_op, SCORES)
    mbarrier.arrive(v_empty.index(stage), count=1)
    return acc


@gluon.jit
def attend_keys(q, k_bufs, v_bufs, k_ready, v_ready, v_fixed, k_empty, v_empty, c, n_tiles, row0, first, seqlen_k, diag,
            qk_scale, window, scores, slope, bh, IS_CAUSAL: gl.constexpr, IS_VARLEN: gl.constexpr,
            HEAD_DIM: gl.constexpr,
            HEAD_DIM_V: gl.constexpr,
            BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr, SCORES: gl.constexpr = 0):
    """One warpgroup's 64 rows against K/V tiles c .. c + n_tiles - 1 of the ring (n_tiles >= 1), keys from
    `first`: (acc, m_i, l_i, next tile)."""
    p_op, m_i, l_i = first_tile(q, k_bufs, k_ready, k_empty, c, row0, first, seqlen_k, diag, qk_scale, window,
                                 scores, slope, bh, IS_CAUSAL, HEAD_DIM, HEAD_DIM_V, BLOCK_N, NUM_BUFFERS, SCORES)
    acc, p_op, m_i, l_i = next_tiles(q, p_op, m_i, l_i, k_bufs, v_bufs, k_ready, v_ready, v_fixed, k_empty, v_empty,
                                      c, n_tiles, row0, first, seqlen_k, diag, qk_scale, window, scores, slope, bh,
                                      IS_CAUSAL, IS_VARLEN, HEAD_DIM, HEAD_DIM_V, BLOCK_N, NUM_BUFFERS, SCORES)
    acc = last_pv(acc, p_op, v_bufs, v_ready, v_fixed, v_empty, c + n_tiles - 1, IS_VARLEN, HEAD_DIM, HEAD_DIM_V,
                   BLOCK_N, NUM_BUFFERS, SCORES)
    return acc, m_i, l_i, c + n_tiles
