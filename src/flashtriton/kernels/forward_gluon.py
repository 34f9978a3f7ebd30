"""Hopper forward in Gluon with FlashAttention-3's schedule, the device code: a TMA producer, consumer
warpgroups, softmax overlapped with the matmuls, persistent programs. Here: the kernel and its consumer
warpgroups' loops over work items; a warpgroup's work on one item's K/V tiles (S, the softmax, P V) is
`forward_gluon_tiles`, the producer partition `forward_gluon_producer`, the work items `forward_gluon_items`, the
host side (configs checked, grid, arguments, launch, offline compile) `forward_gluon_launch`.

A work item is 64 · N_CONSUMERS query rows (128 with the default two consumers) of one (batch, query head).
Each program (one per SM) loops over items in 1 + N_CONSUMERS partitions:
  - the producer (the default partition, `forward_gluon_producer`; one thread issues): TMA loads of each item's Q
    (one 64-row block per consumer) and of its K/V tiles into a ring of NUM_BUFFERS stages. A stage's "ready"
    barrier counts the bytes landed, its "empty" barrier the consumers done with it. Loads run ahead across items,
    so the next item's Q and first K/V tiles arrive while the current one finishes.
  - N_CONSUMERS consumer warpgroups (4 warps, CONSUMER_REGS registers per thread), each owning 64 of the rows
    (wgmma's M). Per K/V tile j a warpgroup issues S_j = Q K_jᵀ and O += P_{j-1} V_{j-1} as asynchronous wgmmas
    and computes the softmax of S_j while the second runs (FlashAttention-3's intra-warpgroup overlap). The
    output leaves through shared memory and a TMA store (dense: rows past the sequence are clipped; staging tiles
    of its own, or under O_IN_Q the warpgroup's Q buffer, handed back to the producer once the store has read it)
    or masked stores (varlen, STORE_FROM_REGS); the log-sum-exp by plain stores.

Scores are in base 2 (log2(e) folded into qk_scale, which must be > 0). fp16/bf16, head dims that are multiples of
8 up to 256, in tiles of 64, 128 or 256 columns (`gluon_common.head_block`). Dense (B, S, H, D) tensors: rank-4
descriptors with block (1, rows, 1, D), rows past the sequence arrive as zeros.
Varlen (total, H, D) tensors with cu_seqlens: rank-3 descriptors with block (rows, 1, D), whose rows past a
sequence belong to the next one (masked in the scores; cleared in V by the producer). Causal attention is
bottom-right (or top-left) as in `forward.py`; causal items go in pairs of equal work. Which items a program takes
and how the producer posts them to the consumers: `forward_gluon_items`. OVERLAP: each item's last P V goes out with
the next item's first S, in one loop over all the program's K/V tiles (`_consume_flat`). The variants (window,
softcap, ALiBi, sinks, dropout) are constexpr flags, which the partitions pass on as one bit set, SCORES; dropout's
keep-mask is the portable kernels' (`gluon_common.dropout_tile`), so their backward regenerates it. Compiles for
sm_90 only; `forward.launch_forward` takes this path where `configs.gluon_fwd_config` (dense) or
`configs.gluon_varlen_config` (varlen) gives a config.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma_wait

from .forward_gluon_items import (ITEM_FIELDS, SC_ALIBI, SC_CAP_FIXED, SC_DROPOUT, SC_O_IN_Q, SC_PV_SPLIT,
                                  SC_QK_16, SC_SINKS, SC_SOFTCAP, SC_WINDOW, item_bounds, num_items, read_item, work,
                                  work_ahead)
from .forward_gluon_producer import ROWS, producer
from .forward_gluon_tiles import (acc_scaled, acc_zero, alibi_rows, attend_keys, consumer_scores, first_tile, last_pv,
                                  out_layout, pv, pv_groups, pv_wait, qk_tile, rescales, softmax_tile, wait_v)
from .gluon_common import wgmma_layout
from .variant import dropout_state

WG0, WG1, WG2 = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2)  # which 64 rows a consumer warpgroup owns
NONE = gl.constexpr(0)  # what stands for a variant argument that is off


@gluon.jit
def _slope(scores, off_b, off_h, SCORES: gl.constexpr):
    """An item's ALiBi slope in base 2 (0 without ALiBi); `scores` = (softcap, ALIBI, stride_alibi_b, SINKS,
    dropout), dropout = (seed, offset, threshold, scale) (`Variant.dropout_args`, `variant.dropout_state`).
    The consumers ask for it at every item they read, the end marker's too (off_b = -1, `post_end`), whose slope
    goes unused: its row is clamped to 0 so that the load stays inside the slopes (row -1 of (B, Hq) slopes lies
    before the tensor, and faults where no memory is mapped there)."""
    if SCORES & SC_ALIBI:
        return gl.load(scores[1] + gl.maximum(off_b, 0) * scores[2] + off_h) * 1.4426950408889634
    else:
        return 0.0


@gluon.jit
def _sink(scores, off_h, SCORES: gl.constexpr):
    """A head's sink logit in base 2 (unused without sinks), loaded when its item starts so that the epilogue does
    not wait for it."""
    if SCORES & SC_SINKS:
        return gl.load(scores[3] + off_h).to(gl.float32) * 1.4426950408889634
    else:
        return 0.0


@gluon.jit
def _dropout_bh(items, off_b, off_h, SCORES: gl.constexpr):
    """An item's sequence-and-head index for its dropout mask, b · Hq + h as the portable kernels count it (0
    without dropout)."""
    if SCORES & SC_DROPOUT:
        return off_b * items[2] + off_h
    else:
        return 0


@gluon.jit
def _dropout_scale(scores, SCORES: gl.constexpr):
    """1 / (1 - p) with dropout (the kept probabilities' scale), else 1 (unused)."""
    if SCORES & SC_DROPOUT:
        return scores[4][3]
    else:
        return 1.0


@gluon.jit
def _store_out(out, col0: gl.constexpr, o_bufs, O, off_b, off_h, row0, q_start, seqlen_q, stride_om, stride_oh,
               WG: gl.constexpr, IS_VARLEN: gl.constexpr, HEAD_DIM_V: gl.constexpr):
    """Columns [col0, col0 + width) of one warpgroup's finished output tile `out` (ROWS, width): into its staging
    tile o_bufs[WG] for the caller's TMA store, or with no staging tiles (varlen, STORE_FROM_REGS: o_bufs NONE)
    by masked stores from registers."""
    layout: gl.constexpr = out.type.layout
    WIDTH: gl.constexpr = out.shape[1]
    if not isinstance(o_bufs, gl.shared_memory_descriptor):
        o_rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        o_cols = col0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
        o_base = q_start if IS_VARLEN else off_b * seqlen_q  # the dense out is contiguous (B, Sq, Hq, Dv)
        o_ptrs = (O + (o_base + o_rows)[:, None].to(gl.int64) * stride_om + off_h * stride_oh
                  + o_cols[None, :])
        # (stride_oh is the head dim of the contiguous out: the tiles' columns past it belong to the next head)
        gl.store(o_ptrs, out, mask=(o_rows < seqlen_q)[:, None] & (o_cols < stride_oh)[None, :])
    elif WIDTH == HEAD_DIM_V:
        o_bufs.index(WG).reshape([ROWS, HEAD_DIM_V]).store(out)
    else:
        o_bufs.index(WG).reshape([ROWS, HEAD_DIM_V]).slice(col0, WIDTH, dim=1).store(out)


@gluon.jit
def _store_item(acc, m_i, l_i, o_bufs, desc_o, O, LSE, off_b, off_h, row0, q_start, seqlen_q, stride_om, stride_oh,
                stride_lb, stride_lh, sink, scale, WG: gl.constexpr, IS_VARLEN: gl.constexpr, HEAD_DIM: gl.constexpr,
                HEAD_DIM_V: gl.constexpr,
                BLOCK_N: gl.constexpr, COMPACT: gl.constexpr = False, SCORES: gl.constexpr = 0):
    """out = acc / l, lse = m + log(l) of one warpgroup's 64 rows (rows that saw no key: out 0, lse -inf). Dense:
    through o_bufs[WG] and a TMA store (the caller has waited for the previous one to leave); varlen, or o_bufs
    NONE (STORE_FROM_REGS): masked stores from registers. COMPACT: one reciprocal per row, then multiplies (acc / l
    is 64 full-range divisions per thread, ~4 instructions each), for `_consume_flat`, whose loop holds the store.
    SINKS: the head's `sink` (`_sink`) joins the denominator first, as `variant.add_sink` does (rows that saw no
    key: out 0, lse = the sink). DROPOUT: out is scaled by `scale` = 1 / (1 - p) (`_dropout_scale`)."""
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    if SCORES & SC_SINKS:
        m_new = gl.maximum(m_i, sink)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)  # 0 for a row that saw no key
        l_i = l_i * alpha + gl.exp2(sink - m_safe)
        m_i = m_new
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    dtype: gl.constexpr = O.dtype.element_ty
    if (SCORES & SC_PV_SPLIT) != 0:  # two accumulators: one reciprocal per row, then multiplies (as COMPACT)
        factor = 1.0 / l_safe
        if SCORES & SC_DROPOUT:
            factor = factor * scale
        if SCORES & SC_SINKS:
            factor = factor * alpha
        out = acc_scaled(acc, factor, SCORES)
        _store_out(out[0].to(dtype), 0, o_bufs, O, off_b, off_h, row0, q_start, seqlen_q, stride_om, stride_oh, WG,
                   IS_VARLEN, HEAD_DIM_V)
        _store_out(out[1].to(dtype), 128, o_bufs, O, off_b, off_h, row0, q_start, seqlen_q, stride_om, stride_oh,
                   WG, IS_VARLEN, HEAD_DIM_V)
    else:
        o_layout: gl.constexpr = wgmma_layout(HEAD_DIM_V)
        if SCORES & SC_DROPOUT:
            factor = scale / l_safe
            if SCORES & SC_SINKS:
                factor = factor * alpha
            out = (acc * gl.convert_layout(factor, gl.SliceLayout(1, o_layout))[:, None]).to(dtype)
        elif SCORES & SC_SINKS:
            out = (acc * gl.convert_layout(alpha / l_safe, gl.SliceLayout(1, o_layout))[:, None]).to(dtype)
        elif COMPACT:
            out = (acc * gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, o_layout))[:, None]).to(dtype)
        else:
            out = (acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]).to(dtype)
        _store_out(out, 0, o_bufs, O, off_b, off_h, row0, q_start, seqlen_q, stride_om, stride_oh, WG, IS_VARLEN,
                   HEAD_DIM_V)
    if isinstance(o_bufs, gl.shared_memory_descriptor):  # the staged tile to its TMA store
        fence_async_shared()
        tma.async_copy_shared_to_global(desc_o, [off_b, row0, off_h, 0], o_bufs.index(WG))
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    gl.store(LSE + off_b.to(gl.int64) * stride_lb + off_h * stride_lh + q_start + rows, lse,
             mask=rows < seqlen_q)


@gluon.jit
def _consume_item(shared, qs, c, off_b, off_h, start_m, q_start, seqlen_q, seqlen_k, diag, first, n_tiles,
                  WG: gl.constexpr, IS_CAUSAL: gl.constexpr, IS_VARLEN: gl.constexpr, HEAD_DIM: gl.constexpr,
                  HEAD_DIM_V: gl.constexpr,
                  BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr, N_CONSUMERS: gl.constexpr,
                  SCORES: gl.constexpr = 0):
    """One item's rows of this warpgroup, its Q landed in slot qs: attend, release the slot, store out and lse.
    Returns the ring's next tile."""
    (q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, v_ready, v_fixed, k_empty, v_empty, desc_o, O, LSE,
     items, n_items, qk_scale, stride_om, stride_oh, stride_lb, stride_lh, slots, scores) = shared
    BLOCK_M: gl.constexpr = ROWS * N_CONSUMERS
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    row0 = start_m * BLOCK_M + WG * ROWS  # in the sequence
    q = q_bufs.index(qs * N_CONSUMERS + WG).reshape([ROWS, HEAD_DIM])
    sink = _sink(scores, off_h, SCORES)
    slope = _slope(scores, off_b, off_h, SCORES)
    bh = _dropout_bh(items, off_b, off_h, SCORES)
    if n_tiles > 0:
        acc, m_i, l_i, c = attend_keys(q, k_bufs, v_bufs, k_ready, v_ready, v_fixed, k_empty, v_empty, c, n_tiles, row0,
                                   first, seqlen_k, diag, qk_scale, items[7], scores, slope, bh, IS_CAUSAL, IS_VARLEN,
                                   HEAD_DIM, HEAD_DIM_V, BLOCK_N, NUM_BUFFERS, SCORES)
        m_i = alibi_rows(m_i, slope, IS_CAUSAL, s_layout, SCORES)
    else:  # rows that see no key (causal with Sq > Sk, a window past the keys)
        acc = acc_zero(HEAD_DIM_V, SCORES)
        m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    # O_IN_Q: the output staged in this warpgroup's Q buffer (its S products are done), which goes back to the
    # producer once the TMA store has read it; else the Q slot goes back before the output is stored
    O_IN_Q: gl.constexpr = (SCORES & SC_O_IN_Q) != 0 and not IS_VARLEN
    if not O_IN_Q:
        mbarrier.arrive(q_empty.index(qs), count=1)
    _store_item(acc, m_i, l_i, q_bufs if O_IN_Q else o_bufs, desc_o, O, LSE, off_b, off_h, row0, q_start, seqlen_q,
                stride_om, stride_oh, stride_lb, stride_lh, sink, _dropout_scale(scores, SCORES), WG, IS_VARLEN,
                HEAD_DIM, HEAD_DIM_V, BLOCK_N, False, SCORES)
    if O_IN_Q:
        tma.store_wait(0)
        mbarrier.arrive(q_empty.index(qs), count=1)
    return c


@gluon.jit
def _following_item(qi, slots, q_ready, window, IS_CAUSAL: gl.constexpr, CAUSAL_BOTTOM_RIGHT: gl.constexpr,
                    BLOCK_N: gl.constexpr, N_CONSUMERS: gl.constexpr, Q_BUFFERS: gl.constexpr,
                    SCORES: gl.constexpr = 0):
    """OVERLAP: the item the producer posted in Q slot qi (once its Q has landed): (valid, off_b, off_h, start_m,
    q_start, seqlen_q, seqlen_k, diag, first, n_tiles); not valid after the program's last item. The producer
    works out the schedule (and skips items without rows) so that the consumers' path between items is short."""
    qs = qi % Q_BUFFERS
    mbarrier.wait(q_ready.index(qs), (qi // Q_BUFFERS) & 1)
    off_b, off_h, start_m, q_start, seqlen_q, seqlen_k = read_item(slots.index(qs))
    diag, first, n_tiles, has_rows = item_bounds(start_m, seqlen_q, seqlen_k, window, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT,
                                                 ROWS * N_CONSUMERS, BLOCK_N, SCORES)
    return off_b >= 0, off_b, off_h, start_m, q_start, seqlen_q, seqlen_k, diag, first, n_tiles


@gluon.jit
def _item_with_keys(qi, shared, WG: gl.constexpr, IS_CAUSAL: gl.constexpr, CAUSAL_BOTTOM_RIGHT: gl.constexpr,
                    IS_VARLEN: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr, BLOCK_N: gl.constexpr,
                    N_CONSUMERS: gl.constexpr,
                    Q_BUFFERS: gl.constexpr, SCORES: gl.constexpr = 0):
    """The first item from Q slot qi on whose rows see a key: (qi, valid, off_b, off_h, start_m, q_start, seqlen_q,
    seqlen_k, diag, first, n_tiles). Items before it (rows that see no key: causal with Sq > Sk, a window past
    the keys) get out 0 and lse -inf (or the sink) here, and their Q slots back."""
    (q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, v_ready, v_fixed, k_empty, v_empty, desc_o, O, LSE,
     items, n_items, qk_scale, stride_om, stride_oh, stride_lb, stride_lh, slots, scores) = shared
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    valid, off_b, off_h, start_m, q_start, seqlen_q, seqlen_k, diag, first, n_tiles = _following_item(
        qi, slots, q_ready, items[7], IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, BLOCK_N, N_CONSUMERS, Q_BUFFERS, SCORES)
    while valid & (n_tiles == 0):
        if not IS_VARLEN:
            tma.store_wait(0)  # the previous output has left o_smem
        _store_item(gl.zeros([ROWS, HEAD_DIM_V], gl.float32, wgmma_layout(HEAD_DIM_V)),
                    gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout)),
                    gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout)), o_bufs, desc_o, O, LSE, off_b, off_h,
                    start_m * ROWS * N_CONSUMERS + WG * ROWS, q_start, seqlen_q, stride_om, stride_oh, stride_lb,
                    stride_lh, _sink(scores, off_h, SCORES), _dropout_scale(scores, SCORES), WG,
                    IS_VARLEN, HEAD_DIM, HEAD_DIM_V, BLOCK_N, True, SCORES)
        mbarrier.arrive(q_empty.index(qi % Q_BUFFERS), count=1)
        qi += 1
        valid, off_b, off_h, start_m, q_start, seqlen_q, seqlen_k, diag, first, n_tiles = _following_item(
            qi, slots, q_ready, items[7], IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, BLOCK_N, N_CONSUMERS, Q_BUFFERS, SCORES)
    return qi, valid, off_b, off_h, start_m, q_start, seqlen_q, seqlen_k, diag, first, n_tiles


@gluon.jit
def _item_after(qi, shared, WG: gl.constexpr, IS_CAUSAL: gl.constexpr, CAUSAL_BOTTOM_RIGHT: gl.constexpr,
                IS_VARLEN: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr, BLOCK_N: gl.constexpr,
                N_CONSUMERS: gl.constexpr,
                Q_BUFFERS: gl.constexpr, SCORES: gl.constexpr = 0):
    """The item in Q slot qi has had its last S: give its slot back, then `_item_with_keys` from slot qi + 1."""
    (q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, v_ready, v_fixed, k_empty, v_empty, desc_o, O, LSE,
     items, n_items, qk_scale, stride_om, stride_oh, stride_lb, stride_lh, slots, scores) = shared
    mbarrier.arrive(q_empty.index(qi % Q_BUFFERS), count=1)
    return _item_with_keys(qi + 1, shared, WG, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, IS_VARLEN, HEAD_DIM, HEAD_DIM_V, BLOCK_N,
                           N_CONSUMERS, Q_BUFFERS, SCORES)


@gluon.jit
def _consume_flat(shared, WG: gl.constexpr, IS_CAUSAL: gl.constexpr, CAUSAL_BOTTOM_RIGHT: gl.constexpr,
                  IS_VARLEN: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr, BLOCK_N: gl.constexpr,
                  NUM_BUFFERS: gl.constexpr,
                  N_CONSUMERS: gl.constexpr, Q_BUFFERS: gl.constexpr, SCORES: gl.constexpr = 0):
    """OVERLAP: one loop over the K/V tiles of all this program's items. Each step issues S of the next tile (the
    current item's, or the next item's first) with P V of the tile before (whichever item that belongs to), then
    runs the softmax of S while P V runs. When S was an item's first tile, the item before is complete once its P V
    is: it is stored (the store's only place in the loop) instead of rescaled. So the tensor cores do not idle
    between items for the last P V, the epilogue and the first S (each costs about a tile's matmuls; an item at
    T = 512 has 1-4 tiles), and the loop holds one softmax and one store: a body of ~1000 SASS instructions per
    warpgroup, which items of 1-4 tiles run through in full. Written with the item's end and the next one's start
    as a block of their own (a second softmax and store), the loop spills and its consumer warps spend 24 % of their
    stall samples waiting for instructions (benchmarks/2026-11-29-h200/explore15/ncu/).
    The mask and the epilogue take their COMPACT forms here (shorter code; explore16/ab/ab_flat2.txt: 351 against 301
    TFLOP/s at causal T=512), and the longer ones in `_consume_in_turn`, whose schedule the compact ones slow by 2-5 %
    (explore16/ab/ab_flat3.txt)."""
    (q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, v_ready, v_fixed, k_empty, v_empty, desc_o, O, LSE,
     items, n_items, qk_scale, stride_om, stride_oh, stride_lb, stride_lh, slots, scores) = shared
    scores = consumer_scores(scores, IS_CAUSAL, BLOCK_N, SCORES)
    BLOCK_M: gl.constexpr = ROWS * N_CONSUMERS
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=out_layout(HEAD_DIM_V, SCORES), k_width=2)
    dtype: gl.constexpr = q_bufs.dtype
    # The S side: the item in Q slot qi, tile j of its n_tiles; the output side (o_*): the item accumulated in acc.
    qi, valid, off_b, off_h, start_m, q_start, seqlen_q, seqlen_k, diag, first, n_tiles = _item_with_keys(
        gl.to_tensor(0), shared, WG, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, IS_VARLEN, HEAD_DIM, HEAD_DIM_V, BLOCK_N,
        N_CONSUMERS, Q_BUFFERS,
        SCORES)
    slope = _slope(scores, off_b, off_h, SCORES)
    sink = _sink(scores, off_h, SCORES)
    bh = _dropout_bh(items, off_b, off_h, SCORES)
    c = gl.to_tensor(0)  # K/V tiles consumed, over all items
    j = gl.to_tensor(0)
    acc = acc_zero(HEAD_DIM_V, SCORES)
    p_op = gl.zeros([ROWS, BLOCK_N], dtype, p_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    o_b = off_b
    o_h = off_h
    o_row0 = start_m * BLOCK_M + WG * ROWS
    o_q_start = q_start
    o_seqlen_q = seqlen_q
    o_sink = sink
    o_slope = slope
    if valid:  # the program's first S, with no P V beside it
        q = q_bufs.index((qi % Q_BUFFERS) * N_CONSUMERS + WG).reshape([ROWS, HEAD_DIM])
        p_op, m_i, l_i = first_tile(q, k_bufs, k_ready, k_empty, c, o_row0, first, seqlen_k, diag, qk_scale,
                                     items[7], scores, slope, bh, IS_CAUSAL, HEAD_DIM, HEAD_DIM_V, BLOCK_N, NUM_BUFFERS,
                                     SCORES)
        c = 1
        j = 1
        if n_tiles == 1:
            qi, valid, off_b, off_h, start_m, q_start, seqlen_q, seqlen_k, diag, first, n_tiles = _item_after(
                qi, shared, WG, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, IS_VARLEN, HEAD_DIM, HEAD_DIM_V, BLOCK_N, N_CONSUMERS,
                Q_BUFFERS,
                SCORES)
            slope = _slope(scores, off_b, off_h, SCORES)
            sink = _sink(scores, off_h, SCORES)
            bh = _dropout_bh(items, off_b, off_h, SCORES)
            j = 0
    while valid:
        q = q_bufs.index((qi % Q_BUFFERS) * N_CONSUMERS + WG).reshape([ROWS, HEAD_DIM])
        row0 = start_m * BLOCK_M + WG * ROWS  # in the sequence
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        stage = c % NUM_BUFFERS
        prev = (c - 1) % NUM_BUFFERS
        mbarrier.wait(k_ready.index(stage), (c // NUM_BUFFERS) & 1)
        wait_v(v_ready, v_fixed, prev, ((c - 1) // NUM_BUFFERS) & 1, IS_VARLEN)
        s_tok = qk_tile(q, k_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM]),
                        gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout), SCORES)
        acc_tok = pv(p_op, v_bufs.index(prev).reshape([BLOCK_N, HEAD_DIM_V]), acc, SCORES)
        s = warpgroup_mma_wait(pv_groups(SCORES), deps=(s_tok, ))  # S done; the P V before it may still run
        mbarrier.arrive(k_empty.index(stage), count=1)
        starts = j == 0  # S is an item's first tile
        m_in = gl.where(starts, float("-inf"), m_i)
        l_in = gl.where(starts, 0.0, l_i)
        p, alpha, m_new, l_new = softmax_tile(s, m_in, l_in, first + j * BLOCK_N, row0, rows, seqlen_k, diag,
                                               qk_scale, items[7], scores, slope, bh, IS_CAUSAL, BLOCK_N, s_layout,
                                               True, SCORES)
        acc, p_op = pv_wait(acc_tok, p_op, SCORES)
        mbarrier.arrive(v_empty.index(prev), count=1)
        if starts:  # the output side's item is complete
            if not IS_VARLEN:
                tma.store_wait(0)  # the previous output has left o_smem
            _store_item(acc, alibi_rows(m_i, o_slope, IS_CAUSAL, s_layout, SCORES), l_i, o_bufs, desc_o, O, LSE, o_b,
                        o_h, o_row0, o_q_start, o_seqlen_q, stride_om,
                        stride_oh, stride_lb, stride_lh, o_sink, _dropout_scale(scores, SCORES), WG, IS_VARLEN,
                        HEAD_DIM, HEAD_DIM_V, BLOCK_N, True,
                        SCORES)
            acc = acc_zero(HEAD_DIM_V, SCORES)
            o_b = off_b
            o_h = off_h
            o_row0 = row0
            o_q_start = q_start
            o_seqlen_q = seqlen_q
            o_sink = sink
            o_slope = slope
        elif rescales(SCORES):
            acc = acc_scaled(acc, alpha, SCORES)
        m_i = m_new
        l_i = l_new
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        c += 1
        j += 1
        if j == n_tiles:  # the item's last S is done: its Q slot may take the next Q
            qi, valid, off_b, off_h, start_m, q_start, seqlen_q, seqlen_k, diag, first, n_tiles = _item_after(
                qi, shared, WG, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, IS_VARLEN, HEAD_DIM, HEAD_DIM_V, BLOCK_N, N_CONSUMERS,
                Q_BUFFERS,
                SCORES)
            slope = _slope(scores, off_b, off_h, SCORES)
            sink = _sink(scores, off_h, SCORES)
            bh = _dropout_bh(items, off_b, off_h, SCORES)
            j = 0
    if c > 0:  # the last item's last P V, alone
        acc = last_pv(acc, p_op, v_bufs, v_ready, v_fixed, v_empty, c - 1, IS_VARLEN, HEAD_DIM, HEAD_DIM_V, BLOCK_N,
                       NUM_BUFFERS, SCORES)
        if not IS_VARLEN:
            tma.store_wait(0)
        _store_item(acc, alibi_rows(m_i, o_slope, IS_CAUSAL, s_layout, SCORES), l_i, o_bufs, desc_o, O, LSE, o_b,
                    o_h, o_row0, o_q_start, o_seqlen_q, stride_om,
                    stride_oh, stride_lb, stride_lh, o_sink, _dropout_scale(scores, SCORES), WG, IS_VARLEN, HEAD_DIM,
                    HEAD_DIM_V, BLOCK_N, True, SCORES)
    if not IS_VARLEN:
        tma.store_wait(0)  # the last item's output has left o_smem


@gluon.jit
def _consumer(shared, WG: gl.constexpr, IS_CAUSAL: gl.constexpr, CAUSAL_BOTTOM_RIGHT: gl.constexpr,
              IS_VARLEN: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_BUFFERS: gl.constexpr,
              N_CONSUMERS: gl.constexpr, Q_BUFFERS: gl.constexpr, CAUSAL_PAIRS: gl.constexpr, DYNAMIC: gl.constexpr,
              OVERLAP: gl.constexpr, SCORES: gl.constexpr):
    """Rows [64 WG, 64 WG + 64) of each of this program's items; `shared` holds what every consumer takes (the
    kernel's `consumer_args`): item by item (`_consume_in_turn`) or, OVERLAP, with each item's end overlapped
    with the next one's start (`_consume_flat`)."""
    if OVERLAP:
        _consume_flat(shared, WG, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, IS_VARLEN, HEAD_DIM, HEAD_DIM_V, BLOCK_N,
                      NUM_BUFFERS, N_CONSUMERS,
                      Q_BUFFERS, SCORES)
    else:
        _consume_in_turn(shared, WG, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, IS_VARLEN, HEAD_DIM, HEAD_DIM_V, BLOCK_N,
                         NUM_BUFFERS,
                         N_CONSUMERS, Q_BUFFERS, CAUSAL_PAIRS, DYNAMIC, SCORES)


@gluon.jit
def _consume_in_turn(shared, WG: gl.constexpr, IS_CAUSAL: gl.constexpr, CAUSAL_BOTTOM_RIGHT: gl.constexpr,
                     IS_VARLEN: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr, BLOCK_N: gl.constexpr,
                     NUM_BUFFERS: gl.constexpr,
                     N_CONSUMERS: gl.constexpr, Q_BUFFERS: gl.constexpr, CAUSAL_PAIRS: gl.constexpr,
                     DYNAMIC: gl.constexpr, SCORES: gl.constexpr = 0):
    """This warpgroup's rows of each item in turn. The output leaves through o_smem and a TMA store (dense: rows
    past the sequence are clipped) or, varlen, through masked stores (a TMA store over the packed tensor would
    write the next sequence's rows). DYNAMIC: the items the producer posts in the Q slots, until one says there
    are no more."""
    (q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, v_ready, v_fixed, k_empty, v_empty, desc_o, O, LSE,
     items, n_items, qk_scale, stride_om, stride_oh, stride_lb, stride_lh, slots, scores) = shared
    BLOCK_M: gl.constexpr = ROWS * N_CONSUMERS
    c = 0  # K/V tiles consumed, over all items
    qi = 0  # items with rows
    if DYNAMIC:
        more = gl.to_tensor(True)
        while more:
            qs = qi % Q_BUFFERS
            mbarrier.wait(q_ready.index(qs), (qi // Q_BUFFERS) & 1)
            off_b, off_h, start_m, q_start, seqlen_q, seqlen_k = read_item(slots.index(qs))
            more = off_b >= 0
            if more:
                if not IS_VARLEN:
                    tma.store_wait(0)  # the previous item's output has left o_smem
                diag, first, n_tiles, has_rows = item_bounds(start_m, seqlen_q, seqlen_k, items[7], IS_CAUSAL,
                                                             CAUSAL_BOTTOM_RIGHT, BLOCK_M, BLOCK_N, SCORES)
                c = _consume_item(shared, qs, c, off_b, off_h, start_m, q_start, seqlen_q, seqlen_k, diag, first,
                                  n_tiles, WG, IS_CAUSAL, IS_VARLEN, HEAD_DIM, HEAD_DIM_V, BLOCK_N, NUM_BUFFERS,
                                  N_CONSUMERS,
                                  SCORES)
            qi += 1
    else:
        ahead = work_ahead(0, items, IS_CAUSAL, CAUSAL_PAIRS, IS_VARLEN, HEAD_DIM, BLOCK_M)
        for i in range(0, n_items):
            off_b, off_h, start_m, seq, bounds, ahead = work(i, n_items, ahead, items, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT,
                                                              CAUSAL_PAIRS, IS_VARLEN, HEAD_DIM, BLOCK_M, BLOCK_N,
                                                              SCORES)
            q_start, seqlen_q, k_start, seqlen_k = seq
            diag, first, n_tiles, has_rows = bounds
            if has_rows:
                if not IS_VARLEN:
                    tma.store_wait(0)  # the previous item's output has left o_smem (the barriers below order the rest)
                qs = qi % Q_BUFFERS
                mbarrier.wait(q_ready.index(qs), (qi // Q_BUFFERS) & 1)
                c = _consume_item(shared, qs, c, off_b, off_h, start_m, q_start, seqlen_q, seqlen_k, diag, first,
                                  n_tiles, WG, IS_CAUSAL, IS_VARLEN, HEAD_DIM, HEAD_DIM_V, BLOCK_N, NUM_BUFFERS,
                                  N_CONSUMERS,
                                  SCORES)
                qi += 1
    if not IS_VARLEN:
        tma.store_wait(0)  # the last item's output has left o_smem


@gluon.jit(do_not_specialize=["stride_om", "stride_oh", "stride_lb", "stride_lh", "HEADS", "BATCH", "GROUP_SIZE",
                              "SEQLEN_Q", "SEQLEN_K", "window_left", "window_right", "stride_alibi_b", "stride_btb",
                              "dropout_threshold"])
def _attn_fwd_gluon(
    desc_q, desc_k, desc_v, desc_o, O, LSE, CU_SEQLENS_Q, CU_SEQLENS_K, COUNTER,
    qk_scale, window_left, window_right, softcap, ALIBI, stride_alibi_b, SINKS,  # as `forward._attn_fwd` takes them
    DROPOUT_RNG, dropout_threshold, dropout_scale,  # `Variant.dropout_args`, None without dropout
    stride_om, stride_oh, stride_lb, stride_lh, HEADS, BATCH, GROUP_SIZE, SEQLEN_Q, SEQLEN_K,
    BLOCK_TABLE, stride_btb,  # PAGE_SIZE > 0: int32 (B, pages per sequence) and its row stride; else unused
    IS_CAUSAL: gl.constexpr, CAUSAL_BOTTOM_RIGHT: gl.constexpr, IS_VARLEN: gl.constexpr, HEAD_DIM: gl.constexpr,
    HEAD_DIM_V: gl.constexpr,
    BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr, CONSUMER_REGS: gl.constexpr, N_CONSUMERS: gl.constexpr,
    Q_BUFFERS: gl.constexpr, CAUSAL_PAIRS: gl.constexpr, DYNAMIC: gl.constexpr, OVERLAP: gl.constexpr,
    STORE_FROM_REGS: gl.constexpr, HAS_WINDOW: gl.constexpr = False, HAS_SOFTCAP: gl.constexpr = False,
    HAS_ALIBI: gl.constexpr = False, HAS_SINKS: gl.constexpr = False, PAGE_SIZE: gl.constexpr = 0,
    HAS_DROPOUT: gl.constexpr = False, CAP_FIXED: gl.constexpr = False, QK_WIDTH: gl.constexpr = 0,
    PV_SPLIT: gl.constexpr = False, O_IN_Q: gl.constexpr = False,
):
    """Grid (programs,): the program takes items of the cdiv(Sq, 64 N_CONSUMERS) · Hq · B (varlen: Sq, Sk the
    longest sequences', B the sequences) as `forward_gluon_items.item` hands them out (causal: in pairs).
    num_warps=4: the producer; the N_CONSUMERS (2 or 3) consumer warpgroups are worker partitions. The variant's
    arguments and flags are `forward._attn_fwd`'s (None where off); the partitions take the flags as one bit set,
    SCORES (`forward_gluon_items.SC_WINDOW` ...)."""
    gl.static_assert((N_CONSUMERS == 2) | (N_CONSUMERS == 3), "2 or 3 consumers")
    gl.static_assert(not (DYNAMIC and IS_CAUSAL and CAUSAL_PAIRS), "DYNAMIC: items one at a time")
    BLOCK_M: gl.constexpr = ROWS * N_CONSUMERS
    n_m = gl.cdiv(SEQLEN_Q, BLOCK_M)
    n_bh = HEADS * BATCH
    n_items = num_items(n_m, n_bh, IS_CAUSAL and CAUSAL_PAIRS)
    SCORES: gl.constexpr = (SC_WINDOW * HAS_WINDOW + SC_SOFTCAP * HAS_SOFTCAP + SC_ALIBI * HAS_ALIBI
                            + SC_SINKS * HAS_SINKS + SC_DROPOUT * HAS_DROPOUT + SC_CAP_FIXED * CAP_FIXED
                            + SC_PV_SPLIT * PV_SPLIT + SC_QK_16 * (QK_WIDTH // 16) + SC_O_IN_Q * O_IN_Q)

    dtype: gl.constexpr = desc_q.dtype
    gl.static_assert(not O_IN_Q or (Q_BUFFERS == 1 and not OVERLAP and HEAD_DIM_V == HEAD_DIM),
                     "O_IN_Q: one Q slot, no OVERLAP, Q and V in tiles of one width")
    q_bufs = gl.allocate_shared_memory(dtype, [Q_BUFFERS * N_CONSUMERS] + desc_q.block_type.shape, desc_q.layout)
    if IS_VARLEN or STORE_FROM_REGS or O_IN_Q:  # stored from registers, or staged in the Q buffers: no O tiles
        o_bufs = NONE
    else:
        o_bufs = gl.allocate_shared_memory(dtype, [N_CONSUMERS] + desc_o.block_type.shape, desc_o.layout)
    if IS_VARLEN:  # (BLOCK_N, 1, D) stages; paged prefill over smaller pages gathers them from boxes of a page's rows
        k_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, BLOCK_N] + desc_k.block_type.shape[1:], desc_k.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, BLOCK_N] + desc_v.block_type.shape[1:], desc_v.layout)
    else:
        k_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + desc_k.block_type.shape, desc_k.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + desc_v.block_type.shape, desc_v.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    # Two barriers no partition uses: they keep every other barrier at the shared-memory offset of the measured
    # kernel, whose PTX this one matches (without them the PTX changes, and a GPU sweep has to judge it).
    spare = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    v_fixed = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    if DYNAMIC or OVERLAP:  # the items the producer posts to the consumers, one slot per Q slot
        slots = gl.allocate_shared_memory(gl.int32, [Q_BUFFERS, ITEM_FIELDS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    else:
        slots = q_ready  # unused
    for i in gl.static_range(Q_BUFFERS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=N_CONSUMERS)  # one arrive per consumer warpgroup
    mbarrier.init(spare.index(0), count=1)
    mbarrier.init(spare.index(1), count=1)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_fixed.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=N_CONSUMERS)
        mbarrier.init(v_empty.index(i), count=N_CONSUMERS)
    fence_async_shared()  # the initialised barriers, visible to TMA (async proxy)

    # Worker partitions take tensors and constexprs, not Python numbers (Triton turns integer arguments equal
    # to 1 into constants): gl.to_tensor.
    n_m = gl.to_tensor(n_m)
    n_bh = gl.to_tensor(n_bh)
    heads = gl.to_tensor(HEADS)
    group_size = gl.to_tensor(GROUP_SIZE)
    max_seqlen_q = gl.to_tensor(SEQLEN_Q)
    max_seqlen_k = gl.to_tensor(SEQLEN_K)
    qk_scale = gl.to_tensor(qk_scale)
    stride_om = gl.to_tensor(stride_om)
    stride_oh = gl.to_tensor(stride_oh)
    stride_lb = gl.to_tensor(stride_lb)
    stride_lh = gl.to_tensor(stride_lh)
    # The variant's arguments, constants where off (the kernel then compiles without them).
    window = (gl.to_tensor(window_left), gl.to_tensor(window_right)) if HAS_WINDOW else (NONE, NONE)
    if HAS_DROPOUT:  # (seed, offset, threshold, scale): the call's Philox key and counter offset, loaded once
        seed, offset = dropout_state(DROPOUT_RNG)
        dropout = (seed, offset, gl.to_tensor(dropout_threshold), gl.to_tensor(dropout_scale))
    else:
        dropout = NONE
    scores = (gl.to_tensor(softcap) if HAS_SOFTCAP else NONE, ALIBI if HAS_ALIBI else NONE,
              gl.to_tensor(stride_alibi_b) if HAS_ALIBI else NONE, SINKS if HAS_SINKS else NONE, dropout)
    items = (n_m, n_bh, heads, CU_SEQLENS_Q, CU_SEQLENS_K, max_seqlen_q, max_seqlen_k, window)  # what `work` hands out
    paging = (BLOCK_TABLE, gl.to_tensor(stride_btb))  # PAGE_SIZE > 0: the producer reads each tile's page there
    producer_args = (desc_q, desc_k, desc_v, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, v_fixed,
                     k_empty, v_empty, items, n_items, group_size, slots, COUNTER, paging)
    consumer_args = (q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, v_ready, v_fixed, k_empty, v_empty,
                     desc_o, O, LSE, items, n_items, qk_scale, stride_om, stride_oh, stride_lb, stride_lh, slots,
                     scores)
    # One list per consumer count (a kernel cannot hold a function in a variable, nor grow a list in a loop).
    if N_CONSUMERS == 3:
        gl.warp_specialize([
            (producer, (producer_args, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, IS_VARLEN, BLOCK_N, NUM_BUFFERS, N_CONSUMERS,
                         Q_BUFFERS, CAUSAL_PAIRS, DYNAMIC, DYNAMIC or OVERLAP, SCORES, PAGE_SIZE)),
            (_consumer, (consumer_args, WG0, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, IS_VARLEN, HEAD_DIM, HEAD_DIM_V, BLOCK_N,
                         NUM_BUFFERS,
                         N_CONSUMERS, Q_BUFFERS, CAUSAL_PAIRS, DYNAMIC, OVERLAP, SCORES)),
            (_consumer, (consumer_args, WG1, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, IS_VARLEN, HEAD_DIM, HEAD_DIM_V, BLOCK_N,
                         NUM_BUFFERS,
                         N_CONSUMERS, Q_BUFFERS, CAUSAL_PAIRS, DYNAMIC, OVERLAP, SCORES)),
            (_consumer, (consumer_args, WG2, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, IS_VARLEN, HEAD_DIM, HEAD_DIM_V, BLOCK_N,
                         NUM_BUFFERS,
                         N_CONSUMERS, Q_BUFFERS, CAUSAL_PAIRS, DYNAMIC, OVERLAP, SCORES)),
        ], [4, 4, 4], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS])
    else:
        gl.warp_specialize([
            (producer, (producer_args, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, IS_VARLEN, BLOCK_N, NUM_BUFFERS, N_CONSUMERS,
                         Q_BUFFERS, CAUSAL_PAIRS, DYNAMIC, DYNAMIC or OVERLAP, SCORES, PAGE_SIZE)),
            (_consumer, (consumer_args, WG0, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, IS_VARLEN, HEAD_DIM, HEAD_DIM_V, BLOCK_N,
                         NUM_BUFFERS,
                         N_CONSUMERS, Q_BUFFERS, CAUSAL_PAIRS, DYNAMIC, OVERLAP, SCORES)),
            (_consumer, (consumer_args, WG1, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, IS_VARLEN, HEAD_DIM, HEAD_DIM_V, BLOCK_N,
                         NUM_BUFFERS,
                         N_CONSUMERS, Q_BUFFERS, CAUSAL_PAIRS, DYNAMIC, OVERLAP, SCORES)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
