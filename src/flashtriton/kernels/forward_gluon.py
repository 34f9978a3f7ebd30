"""Hopper forward in Gluon with FlashAttention-3's schedule: a TMA producer, consumer warpgroups, softmax
overlapped with the matmuls, persistent programs.

A work item is 64 · N_CONSUMERS query rows (128 with the default two consumers) of one (batch, query head).
Each program loops over items (one program per SM, or one per item) in 1 + N_CONSUMERS partitions:
  - the producer (the default partition; one thread issues): TMA loads of each item's Q (one 64-row block per
    consumer) and of its K/V tiles into a ring of NUM_BUFFERS stages. A stage's "ready" barrier counts the
    bytes landed, its "empty" barrier the consumers done with it. Loads run ahead across items, so the next
    item's Q and first K/V tiles arrive while the current one finishes.
  - N_CONSUMERS consumer warpgroups (4 warps, CONSUMER_REGS registers per thread), each owning 64 of the rows
    (wgmma's M). Per K/V tile j a warpgroup issues S_j = Q K_jᵀ and O += P_{j-1} V_{j-1} as asynchronous wgmmas
    and computes the softmax of S_j while the second runs (FlashAttention-3's intra-warpgroup overlap). With
    PINGPONG two warpgroups take turns issuing their matmuls, so that one's softmax runs while the other's
    matmuls hold the tensor cores (FlashAttention-3's inter-warpgroup schedule; measured slower, off). The
    output leaves through shared memory and a TMA store (dense: rows past the sequence are clipped) or masked
    stores (varlen); the log-sum-exp by plain stores.

Scores are in base 2 (log2(e) folded into qk_scale, which must be > 0). fp16/bf16, head dim 64 or 128. Dense
(B, S, H, D) tensors: rank-4 descriptors with block (1, rows, 1, D), rows past the sequence arrive as zeros.
Varlen (total, H, D) tensors with cu_seqlens: rank-3 descriptors with block (rows, 1, D), whose rows past a
sequence belong to the next one (masked in the scores; cleared in V by the producer). Causal attention is
bottom-right (or top-left) as in `forward.py`; causal items go in pairs of equal work. Which items a program takes
and how the producer posts them to the consumers: `forward_gluon_items`. OVERLAP: each item's last P V goes out with
the next item's first S, in one loop over all the program's K/V tiles (`_consume_flat`). Compiles for sm_90 only; `forward.launch_forward` takes this path
where `configs.gluon_fwd_config` (dense) or `configs.gluon_varlen_config` (varlen) gives a config.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .common import LOG2E, sm_count
from .forward_gluon_items import (ITEM_FIELDS, item_bounds, num_items, post_end, post_item, read_item, unit_item, work,
                                  work_ahead)
from .gluon_common import SHARED_MEMORY_LIMIT, descriptor, sequence, tma_load, wgmma_layout
from .launch import launch
from .variant import key_end, tile_masked, visible

ROWS = gl.constexpr(64)  # rows per consumer warpgroup: wgmma's M; an item has ROWS * N_CONSUMERS rows
WG0, WG1, WG2 = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2)  # which 64 rows a consumer warpgroup owns


@gluon.jit
def _zero_rows_from(tile, first, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Zero rows [first, BLOCK_N) of a (BLOCK_N, HEAD_DIM) tile in shared memory, 16 rows at a time."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    for chunk in gl.static_range(BLOCK_N // 16):
        if (chunk + 1) * 16 > first:
            part = tile.slice(chunk * 16, 16)
            rows = chunk * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, layout))
            x = part.load(layout)
            part.store(gl.where((rows < first)[:, None], x, gl.zeros_like(x)))


@gluon.jit
def _load_item(shared, qi, c, off_b, off_h, start_m, seq, n_tiles, IS_VARLEN: gl.constexpr, BLOCK_N: gl.constexpr,
               NUM_BUFFERS: gl.constexpr, N_CONSUMERS: gl.constexpr, Q_BUFFERS: gl.constexpr, POSTED: gl.constexpr):
    """One item's loads (see `_producer`): its Q into slot qi % Q_BUFFERS (POSTED: the item posted there too),
    its n_tiles K/V tiles into the ring from tile c on. Returns (qi + 1, c + n_tiles)."""
    (desc_q, desc_k, desc_v, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, v_fixed, k_empty, v_empty,
     items, n_items, group_size, slots, COUNTER) = shared
    HEAD_DIM: gl.constexpr = desc_k.block_type.shape[len(desc_k.block_type.shape) - 1]
    BLOCK_M: gl.constexpr = ROWS * N_CONSUMERS
    q_start, seqlen_q, k_start, seqlen_k = seq
    off_hk = off_h // group_size
    qs = qi % Q_BUFFERS
    mbarrier.wait(q_empty.index(qs), ((qi // Q_BUFFERS) & 1) ^ 1, pred=qi >= Q_BUFFERS)
    if POSTED:
        post_item(slots.index(qs), off_b, off_h, start_m, q_start, seqlen_q, seqlen_k)
    mbarrier.expect(q_ready.index(qs), N_CONSUMERS * desc_q.block_type.nbytes)
    for h in gl.static_range(N_CONSUMERS):
        tma_load(desc_q, IS_VARLEN, off_b, q_start + start_m * BLOCK_M + h * ROWS, off_h, q_ready.index(qs),
                  q_bufs.index(qs * N_CONSUMERS + h))
    for t in range(n_tiles):
        stage = c % NUM_BUFFERS
        phase = ((c // NUM_BUFFERS) & 1) ^ 1  # the first round passes: a fresh barrier's "previous" phase
        mbarrier.wait(k_empty.index(stage), phase, pred=c >= NUM_BUFFERS)
        mbarrier.expect(k_ready.index(stage), desc_k.block_type.nbytes)
        tma_load(desc_k, IS_VARLEN, off_b, k_start + t * BLOCK_N, off_hk, k_ready.index(stage), k_bufs.index(stage))
        mbarrier.wait(v_empty.index(stage), phase, pred=c >= NUM_BUFFERS)
        mbarrier.expect(v_ready.index(stage), desc_v.block_type.nbytes)
        tma_load(desc_v, IS_VARLEN, off_b, k_start + t * BLOCK_N, off_hk, v_ready.index(stage), v_bufs.index(stage))
        if IS_VARLEN:
            if (t + 1) * BLOCK_N > seqlen_k:
                mbarrier.wait(v_ready.index(stage), phase ^ 1)
                _zero_rows_from(v_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM]), seqlen_k - t * BLOCK_N,
                                BLOCK_N, HEAD_DIM)
                fence_async_shared()  # the generic stores, before the wgmma (async proxy) reads
            mbarrier.arrive(v_fixed.index(stage), count=1)
        c += 1
    return qi + 1, c


@gluon.jit
def _producer(shared, IS_CAUSAL: gl.constexpr, CAUSAL_BOTTOM_RIGHT: gl.constexpr, IS_VARLEN: gl.constexpr,
              BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr, N_CONSUMERS: gl.constexpr, Q_BUFFERS: gl.constexpr,
              CAUSAL_PAIRS: gl.constexpr, DYNAMIC: gl.constexpr, POSTED: gl.constexpr):
    """TMA loads of this program's items: Q into slot qi % Q_BUFFERS once the consumers are done with the item
    that held it (with two slots, an item's Q lands while the one before runs); K/V tile c
    (counted over all items) into stage c % NUM_BUFFERS once they all released the tile it held (K and V have
    their own barriers: S = Q Kᵀ can start before V lands). Varlen: a sequence's last V tile also holds rows of
    the next sequence; P is 0 there, but 0 · inf is not 0, so those rows are zeroed in shared memory once the
    tile has landed, and every V tile is announced on v_fixed as well.
    Static schedule: the items `item` gives this program. DYNAMIC: units from the global COUNTER, the
    next one taken while the current one loads, so that a program that drew short items draws more (a static
    schedule left the busiest program 5-11 % above the mean on mixed lengths); items without rows are skipped
    here, and the consumers learn each item from its Q slot."""
    (desc_q, desc_k, desc_v, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, v_fixed, k_empty, v_empty,
     items, n_items, group_size, slots, COUNTER) = shared
    HEAD_DIM: gl.constexpr = desc_k.block_type.shape[len(desc_k.block_type.shape) - 1]
    BLOCK_M: gl.constexpr = ROWS * N_CONSUMERS
    c = 0  # K/V tiles issued, over all items
    qi = 0  # items with rows, whose Q was loaded
    if DYNAMIC:
        n_m, n_bh, heads, CU_SEQLENS_Q, CU_SEQLENS_K, max_seqlen_q, max_seqlen_k = items
        unit = gl.atomic_add(COUNTER, 1, sem="relaxed")
        while unit < n_m * n_bh:
            next_unit = gl.atomic_add(COUNTER, 1, sem="relaxed")  # in flight while this unit's loads are issued
            off_b, off_h, start_m = unit_item(unit, n_m, n_bh, heads, max_seqlen_k, IS_CAUSAL, False, HEAD_DIM)
            seq = sequence(off_b, CU_SEQLENS_Q, CU_SEQLENS_K, max_seqlen_q, max_seqlen_k, IS_VARLEN)
            diag, n_tiles, has_rows = item_bounds(start_m, seq[1], seq[3], IS_CAUSAL, CAUSAL_BOTTOM_RIGHT,
                                                       BLOCK_M, BLOCK_N)
            if has_rows:
                qi, c = _load_item(shared, qi, c, off_b, off_h, start_m, seq, n_tiles, IS_VARLEN, BLOCK_N, NUM_BUFFERS,
                                   N_CONSUMERS, Q_BUFFERS, POSTED)
            unit = next_unit
        post_end(slots, q_ready, q_empty, qi, Q_BUFFERS)
    else:
        ahead = work_ahead(0, items, IS_CAUSAL, CAUSAL_PAIRS, IS_VARLEN, HEAD_DIM, BLOCK_M)
        for i in range(0, n_items):
            off_b, off_h, start_m, seq, bounds, ahead = work(i, n_items, ahead, items, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT,
                                                              CAUSAL_PAIRS, IS_VARLEN, HEAD_DIM, BLOCK_M, BLOCK_N)
            diag, n_tiles, has_rows = bounds
            if has_rows:
                qi, c = _load_item(shared, qi, c, off_b, off_h, start_m, seq, n_tiles, IS_VARLEN, BLOCK_N, NUM_BUFFERS,
                                   N_CONSUMERS, Q_BUFFERS, POSTED)
        if POSTED:
            post_end(slots, q_ready, q_empty, qi, Q_BUFFERS)


@gluon.jit
def _take_turn(turn, g, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: wait until the other warpgroup has issued its matmuls (turn g of this warpgroup)."""
    if PINGPONG:
        mbarrier.wait(turn.index(WG), g & 1)
    return g + 1


@gluon.jit
def _pass_turn(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG), count=1)


@gluon.jit
def _wait_v(v_ready, v_fixed, stage, phase, IS_VARLEN: gl.constexpr):
    mbarrier.wait(v_ready.index(stage), phase)
    if IS_VARLEN:
        mbarrier.wait(v_fixed.index(stage), phase)


@gluon.jit
def _softmax_tile(s, m_i, l_i, n, row0, rows, seqlen_k, diag, qk_scale,
                  IS_CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr, COMPACT: gl.constexpr = False):
    """Fold raw scores s (ROWS, BLOCK_N) of keys [n, n + BLOCK_N) into (m_i, l_i): (p, alpha, m_new, l_new).
    Only tiles that reach past the keys or, causal, past the first row's diagonal pay for the mask. COMPACT: one
    compare per score against the row's last visible key, for `_consume_flat` (which says why only there)."""
    need_mask = (n + BLOCK_N > seqlen_k) | tile_masked(row0, n + BLOCK_N - 1, diag, IS_CAUSAL)
    if need_mask:
        if COMPACT:
            cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))  # in the tile
            if IS_CAUSAL:
                keep = cols[None, :] < (gl.minimum(key_end(rows, diag, IS_CAUSAL), seqlen_k) - n)[:, None]
            else:
                keep = cols[None, :] < seqlen_k - n
        else:
            cols = n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            keep = visible(cols[None, :] < seqlen_k, rows[:, None], cols[None, :], diag, IS_CAUSAL)
        s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    # A row that has seen no key yet keeps m = -inf: subtract 0 instead, so exp2 gives 0, not NaN.
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * qk_scale - m_safe[:, None])
    alpha = gl.exp2(m_i - m_safe)
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


@gluon.jit
def _first_softmax(s, row0, seqlen_k, diag, qk_scale, IS_CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr,
                   BLOCK_N: gl.constexpr, dtype: gl.constexpr):
    """An item's first tile of scores s (ROWS, BLOCK_N) from a fresh softmax state: (p_op, m_i, l_i), p_op the
    P operand of its P V."""
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=wgmma_layout(HEAD_DIM), k_width=2)
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))  # (ROWS,) query rows
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, 0, row0, rows, seqlen_k, diag, qk_scale, IS_CAUSAL,
                                       BLOCK_N, s_layout)
    return gl.convert_layout(p.to(dtype), p_layout), m_i, l_i


@gluon.jit
def _first_tile(q, k_bufs, k_ready, k_empty, turn, c, g, row0, seqlen_k, diag, qk_scale, WG: gl.constexpr,
                IS_CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr,
                PINGPONG: gl.constexpr):
    """Tile c of the ring, an item's first: its scores and softmax (its P V goes out with the next tile's
    scores): (p_op, m_i, l_i, next turn)."""
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, wgmma_layout(BLOCK_N))
    stage = c % NUM_BUFFERS
    mbarrier.wait(k_ready.index(stage), (c // NUM_BUFFERS) & 1)
    g = _take_turn(turn, g, WG, PINGPONG)
    s_tok = warpgroup_mma(q, k_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
    _pass_turn(turn, WG, PINGPONG)
    s = warpgroup_mma_wait(0, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(stage), count=1)
    p_op, m_i, l_i = _first_softmax(s, row0, seqlen_k, diag, qk_scale, IS_CAUSAL, HEAD_DIM, BLOCK_N, q.dtype)
    return p_op, m_i, l_i, g


@gluon.jit
def _next_tiles(q, p_op, m_i, l_i, k_bufs, v_bufs, k_ready, v_ready, v_fixed, k_empty, v_empty, turn, c, g, n_tiles,
                row0, seqlen_k, diag, qk_scale, WG: gl.constexpr, IS_CAUSAL: gl.constexpr,
                IS_VARLEN: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr,
                PINGPONG: gl.constexpr):
    """Tiles c + 1 .. c + n_tiles - 1 of an item whose first tile (c) left (p_op, m_i, l_i): per tile j, S_j and
    P_{j-1} V_{j-1} as asynchronous wgmmas, S_j's softmax while the second runs (FlashAttention-3's
    intra-warpgroup overlap). Returns (acc, p_op, m_i, l_i, next turn): acc holds P V of all but the last tile,
    whose P is p_op."""
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dtype: gl.constexpr = q.dtype
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))  # (ROWS,) query rows
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
    stage = c % NUM_BUFFERS
    for j in range(1, n_tiles):
        prev = stage
        stage = (c + j) % NUM_BUFFERS
        mbarrier.wait(k_ready.index(stage), ((c + j) // NUM_BUFFERS) & 1)
        _wait_v(v_ready, v_fixed, prev, ((c + j - 1) // NUM_BUFFERS) & 1, IS_VARLEN)
        g = _take_turn(turn, g, WG, PINGPONG)
        s_tok = warpgroup_mma(q, k_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
        acc_tok = warpgroup_mma(p_op, v_bufs.index(prev).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
        _pass_turn(turn, WG, PINGPONG)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))  # S_j done; P_{j-1} V_{j-1} may still run
        mbarrier.arrive(k_empty.index(stage), count=1)
        p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, j * BLOCK_N, row0, rows, seqlen_k, diag, qk_scale,
                                           IS_CAUSAL, BLOCK_N, s_layout)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
        mbarrier.arrive(v_empty.index(prev), count=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)
    return acc, p_op, m_i, l_i, g


@gluon.jit
def _last_pv(acc, p_op, v_bufs, v_ready, v_fixed, v_empty, turn, c, g, WG: gl.constexpr, IS_VARLEN: gl.constexpr,
             HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr, PINGPONG: gl.constexpr):
    """acc += P V of ring tile c, an item's last, alone on the tensor cores: (acc, next turn)."""
    stage = c % NUM_BUFFERS
    _wait_v(v_ready, v_fixed, stage, (c // NUM_BUFFERS) & 1, IS_VARLEN)
    g = _take_turn(turn, g, WG, PINGPONG)
    acc_tok = warpgroup_mma(p_op, v_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
    _pass_turn(turn, WG, PINGPONG)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
    mbarrier.arrive(v_empty.index(stage), count=1)
    return acc, g


@gluon.jit
def _attend(q, k_bufs, v_bufs, k_ready, v_ready, v_fixed, k_empty, v_empty, turn, c, g, n_tiles, row0, seqlen_k,
            diag, qk_scale, WG: gl.constexpr, IS_CAUSAL: gl.constexpr, IS_VARLEN: gl.constexpr,
            HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr, PINGPONG: gl.constexpr):
    """One warpgroup's 64 rows against K/V tiles c .. c + n_tiles - 1 of the ring (n_tiles >= 1):
    (acc, m_i, l_i, next tile, next turn)."""
    p_op, m_i, l_i, g = _first_tile(q, k_bufs, k_ready, k_empty, turn, c, g, row0, seqlen_k, diag, qk_scale,
                                    WG, IS_CAUSAL, HEAD_DIM, BLOCK_N, NUM_BUFFERS, PINGPONG)
    acc, p_op, m_i, l_i, g = _next_tiles(q, p_op, m_i, l_i, k_bufs, v_bufs, k_ready, v_ready, v_fixed, k_empty,
                                         v_empty, turn, c, g, n_tiles, row0, seqlen_k, diag, qk_scale, WG,
                                         IS_CAUSAL, IS_VARLEN, HEAD_DIM, BLOCK_N, NUM_BUFFERS, PINGPONG)
    acc, g = _last_pv(acc, p_op, v_bufs, v_ready, v_fixed, v_empty, turn, c + n_tiles - 1, g, WG, IS_VARLEN, HEAD_DIM,
                      BLOCK_N, NUM_BUFFERS, PINGPONG)
    return acc, m_i, l_i, c + n_tiles, g


@gluon.jit
def _store_item(acc, m_i, l_i, o_bufs, desc_o, O, LSE, off_b, off_h, row0, q_start, seqlen_q, stride_om, stride_oh,
                stride_lb, stride_lh, WG: gl.constexpr, IS_VARLEN: gl.constexpr, HEAD_DIM: gl.constexpr,
                BLOCK_N: gl.constexpr, COMPACT: gl.constexpr = False):
    """out = acc / l, lse = m + log(l) of one warpgroup's 64 rows (rows that saw no key: out 0, lse -inf). Dense:
    through o_bufs[WG] and a TMA store (the caller has waited for the previous one to leave); varlen: masked
    stores. COMPACT: one reciprocal per row, then multiplies (acc / l is 64 full-range divisions per thread, ~4
    instructions each), for `_consume_flat`, whose loop holds the store."""
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(HEAD_DIM)
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    if COMPACT:
        out = (acc * gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, o_layout))[:, None]).to(o_bufs.dtype)
    else:
        out = (acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]).to(o_bufs.dtype)
    if IS_VARLEN:
        o_rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
        o_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        o_ptrs = (O + (q_start + o_rows)[:, None].to(gl.int64) * stride_om + off_h * stride_oh
                  + o_cols[None, :])
        gl.store(o_ptrs, out, mask=(o_rows < seqlen_q)[:, None])
    else:
        o_smem = o_bufs.index(WG)
        o_smem.reshape([ROWS, HEAD_DIM]).store(out)
        fence_async_shared()
        tma.async_copy_shared_to_global(desc_o, [off_b, row0, off_h, 0], o_smem)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    gl.store(LSE + off_b.to(gl.int64) * stride_lb + off_h * stride_lh + q_start + rows, lse,
             mask=rows < seqlen_q)


@gluon.jit
def _consume_item(shared, qs, c, g, off_b, off_h, start_m, q_start, seqlen_q, seqlen_k, diag, n_tiles,
                  WG: gl.constexpr, IS_CAUSAL: gl.constexpr, IS_VARLEN: gl.constexpr, HEAD_DIM: gl.constexpr,
                  BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr, PINGPONG: gl.constexpr, N_CONSUMERS: gl.constexpr):
    """One item's rows of this warpgroup, its Q landed in slot qs: attend, release the slot, store out and lse.
    Returns the ring's next tile and the next ping-pong turn."""
    (q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, v_ready, v_fixed, k_empty, v_empty, turn, desc_o, O,
     LSE, items, n_items, qk_scale, stride_om, stride_oh, stride_lb, stride_lh, slots) = shared
    BLOCK_M: gl.constexpr = ROWS * N_CONSUMERS
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(HEAD_DIM)
    row0 = start_m * BLOCK_M + WG * ROWS  # in the sequence
    q = q_bufs.index(qs * N_CONSUMERS + WG).reshape([ROWS, HEAD_DIM])
    if n_tiles > 0:
        acc, m_i, l_i, c, g = _attend(q, k_bufs, v_bufs, k_ready, v_ready, v_fixed, k_empty, v_empty, turn, c,
                                      g, n_tiles, row0, seqlen_k, diag, qk_scale, WG, IS_CAUSAL,
                                      IS_VARLEN, HEAD_DIM, BLOCK_N, NUM_BUFFERS, PINGPONG)
    else:  # causal with Sq > Sk: rows that see no key
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
        m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    mbarrier.arrive(q_empty.index(qs), count=1)
    _store_item(acc, m_i, l_i, o_bufs, desc_o, O, LSE, off_b, off_h, row0, q_start, seqlen_q, stride_om, stride_oh,
                stride_lb, stride_lh, WG, IS_VARLEN, HEAD_DIM, BLOCK_N)
    return c, g


@gluon.jit
def _following_item(qi, slots, q_ready, IS_CAUSAL: gl.constexpr, CAUSAL_BOTTOM_RIGHT: gl.constexpr,
                    BLOCK_N: gl.constexpr, N_CONSUMERS: gl.constexpr, Q_BUFFERS: gl.constexpr):
    """OVERLAP: the item the producer posted in Q slot qi (once its Q has landed): (valid, off_b, off_h, start_m,
    q_start, seqlen_q, seqlen_k, diag, n_tiles); not valid after the program's last item. The producer
    works out the schedule (and skips items without rows) so that the consumers' path between items is short."""
    qs = qi % Q_BUFFERS
    mbarrier.wait(q_ready.index(qs), (qi // Q_BUFFERS) & 1)
    off_b, off_h, start_m, q_start, seqlen_q, seqlen_k = read_item(slots.index(qs))
    diag, n_tiles, has_rows = item_bounds(start_m, seqlen_q, seqlen_k, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT,
                                               ROWS * N_CONSUMERS, BLOCK_N)
    return off_b >= 0, off_b, off_h, start_m, q_start, seqlen_q, seqlen_k, diag, n_tiles


@gluon.jit
def _item_with_keys(qi, shared, WG: gl.constexpr, IS_CAUSAL: gl.constexpr, CAUSAL_BOTTOM_RIGHT: gl.constexpr,
                    IS_VARLEN: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, N_CONSUMERS: gl.constexpr,
                    Q_BUFFERS: gl.constexpr):
    """The first item from Q slot qi on whose rows see a key: (qi, valid, off_b, off_h, start_m, q_start, seqlen_q,
    seqlen_k, diag, n_tiles). Items before it (causal with Sq > Sk: rows that see no key) get out 0 and
    lse -inf here, and their Q slots back."""
    (q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, v_ready, v_fixed, k_empty, v_empty, turn, desc_o, O,
     LSE, items, n_items, qk_scale, stride_om, stride_oh, stride_lb, stride_lh, slots) = shared
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    valid, off_b, off_h, start_m, q_start, seqlen_q, seqlen_k, diag, n_tiles = _following_item(
        qi, slots, q_ready, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, BLOCK_N, N_CONSUMERS, Q_BUFFERS)
    while valid & (n_tiles == 0):
        if not IS_VARLEN:
            tma.store_wait(0)  # the previous output has left o_smem
        _store_item(gl.zeros([ROWS, HEAD_DIM], gl.float32, wgmma_layout(HEAD_DIM)),
                    gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout)),
                    gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout)), o_bufs, desc_o, O, LSE, off_b, off_h,
                    start_m * ROWS * N_CONSUMERS + WG * ROWS, q_start, seqlen_q, stride_om, stride_oh, stride_lb,
                    stride_lh, WG, IS_VARLEN, HEAD_DIM, BLOCK_N, True)
        mbarrier.arrive(q_empty.index(qi % Q_BUFFERS), count=1)
        qi += 1
        valid, off_b, off_h, start_m, q_start, seqlen_q, seqlen_k, diag, n_tiles = _following_item(
            qi, slots, q_ready, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, BLOCK_N, N_CONSUMERS, Q_BUFFERS)
    return qi, valid, off_b, off_h, start_m, q_start, seqlen_q, seqlen_k, diag, n_tiles


@gluon.jit
def _item_after(qi, shared, WG: gl.constexpr, IS_CAUSAL: gl.constexpr, CAUSAL_BOTTOM_RIGHT: gl.constexpr,
                IS_VARLEN: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, N_CONSUMERS: gl.constexpr,
                Q_BUFFERS: gl.constexpr):
    """The item in Q slot qi has had its last S: give its slot back, then `_item_with_keys` from slot qi + 1."""
    (q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, v_ready, v_fixed, k_empty, v_empty, turn, desc_o, O,
     LSE, items, n_items, qk_scale, stride_om, stride_oh, stride_lb, stride_lh, slots) = shared
    mbarrier.arrive(q_empty.index(qi % Q_BUFFERS), count=1)
    return _item_with_keys(qi + 1, shared, WG, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, IS_VARLEN, HEAD_DIM, BLOCK_N,
                           N_CONSUMERS, Q_BUFFERS)


@gluon.jit
def _consume_flat(shared, WG: gl.constexpr, IS_CAUSAL: gl.constexpr, CAUSAL_BOTTOM_RIGHT: gl.constexpr,
                  IS_VARLEN: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr,
                  N_CONSUMERS: gl.constexpr, Q_BUFFERS: gl.constexpr):
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
    (q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, v_ready, v_fixed, k_empty, v_empty, turn, desc_o, O,
     LSE, items, n_items, qk_scale, stride_om, stride_oh, stride_lb, stride_lh, slots) = shared
    BLOCK_M: gl.constexpr = ROWS * N_CONSUMERS
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dtype: gl.constexpr = q_bufs.dtype
    g = gl.to_tensor(0)  # ping-pong turns (unused)
    # The S side: the item in Q slot qi, tile j of its n_tiles; the output side (o_*): the item accumulated in acc.
    qi, valid, off_b, off_h, start_m, q_start, seqlen_q, seqlen_k, diag, n_tiles = _item_with_keys(
        gl.to_tensor(0), shared, WG, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, IS_VARLEN, HEAD_DIM, BLOCK_N, N_CONSUMERS, Q_BUFFERS)
    c = gl.to_tensor(0)  # K/V tiles consumed, over all items
    j = gl.to_tensor(0)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
    p_op = gl.zeros([ROWS, BLOCK_N], dtype, p_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    o_b = off_b
    o_h = off_h
    o_row0 = start_m * BLOCK_M + WG * ROWS
    o_q_start = q_start
    o_seqlen_q = seqlen_q
    if valid:  # the program's first S, with no P V beside it
        q = q_bufs.index((qi % Q_BUFFERS) * N_CONSUMERS + WG).reshape([ROWS, HEAD_DIM])
        p_op, m_i, l_i, g = _first_tile(q, k_bufs, k_ready, k_empty, turn, c, g, o_row0, seqlen_k, diag,
                                        qk_scale, WG, IS_CAUSAL, HEAD_DIM, BLOCK_N, NUM_BUFFERS, False)
        c = 1
        j = 1
        if n_tiles == 1:
            qi, valid, off_b, off_h, start_m, q_start, seqlen_q, seqlen_k, diag, n_tiles = _item_after(
                qi, shared, WG, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, IS_VARLEN, HEAD_DIM, BLOCK_N, N_CONSUMERS, Q_BUFFERS)
            j = 0
    while valid:
        q = q_bufs.index((qi % Q_BUFFERS) * N_CONSUMERS + WG).reshape([ROWS, HEAD_DIM])
        row0 = start_m * BLOCK_M + WG * ROWS  # in the sequence
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        stage = c % NUM_BUFFERS
        prev = (c - 1) % NUM_BUFFERS
        mbarrier.wait(k_ready.index(stage), (c // NUM_BUFFERS) & 1)
        _wait_v(v_ready, v_fixed, prev, ((c - 1) // NUM_BUFFERS) & 1, IS_VARLEN)
        s_tok = warpgroup_mma(q, k_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)),
                              gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
        acc_tok = warpgroup_mma(p_op, v_bufs.index(prev).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))  # S done; the P V before it may still run
        mbarrier.arrive(k_empty.index(stage), count=1)
        first = j == 0
        m_in = gl.where(first, float("-inf"), m_i)
        l_in = gl.where(first, 0.0, l_i)
        p, alpha, m_new, l_new = _softmax_tile(s, m_in, l_in, j * BLOCK_N, row0, rows, seqlen_k, diag,
                                               qk_scale, IS_CAUSAL, BLOCK_N, s_layout, True)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
        mbarrier.arrive(v_empty.index(prev), count=1)
        if first:  # the output side's item is complete
            if not IS_VARLEN:
                tma.store_wait(0)  # the previous output has left o_smem
            _store_item(acc, m_i, l_i, o_bufs, desc_o, O, LSE, o_b, o_h, o_row0, o_q_start, o_seqlen_q, stride_om,
                        stride_oh, stride_lb, stride_lh, WG, IS_VARLEN, HEAD_DIM, BLOCK_N, True)
            acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
            o_b = off_b
            o_h = off_h
            o_row0 = row0
            o_q_start = q_start
            o_seqlen_q = seqlen_q
        else:
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        m_i = m_new
        l_i = l_new
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        c += 1
        j += 1
        if j == n_tiles:  # the item's last S is done: its Q slot may take the next Q
            qi, valid, off_b, off_h, start_m, q_start, seqlen_q, seqlen_k, diag, n_tiles = _item_after(
                qi, shared, WG, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, IS_VARLEN, HEAD_DIM, BLOCK_N, N_CONSUMERS, Q_BUFFERS)
            j = 0
    if c > 0:  # the last item's last P V, alone
        acc, g = _last_pv(acc, p_op, v_bufs, v_ready, v_fixed, v_empty, turn, c - 1, g, WG, IS_VARLEN, HEAD_DIM,
                          BLOCK_N, NUM_BUFFERS, False)
        if not IS_VARLEN:
            tma.store_wait(0)
        _store_item(acc, m_i, l_i, o_bufs, desc_o, O, LSE, o_b, o_h, o_row0, o_q_start, o_seqlen_q, stride_om,
                    stride_oh, stride_lb, stride_lh, WG, IS_VARLEN, HEAD_DIM, BLOCK_N, True)
    if not IS_VARLEN:
        tma.store_wait(0)  # the last item's output has left o_smem


@gluon.jit
def _consumer(shared, WG: gl.constexpr, IS_CAUSAL: gl.constexpr, CAUSAL_BOTTOM_RIGHT: gl.constexpr,
              IS_VARLEN: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr,
              PINGPONG: gl.constexpr, N_CONSUMERS: gl.constexpr, Q_BUFFERS: gl.constexpr, CAUSAL_PAIRS: gl.constexpr,
              DYNAMIC: gl.constexpr, OVERLAP: gl.constexpr):
    """Rows [64 WG, 64 WG + 64) of each of this program's items; `shared` holds what every consumer takes (the
    kernel's `consumer_args`): item by item (`_consume_in_turn`) or, OVERLAP, with each item's end overlapped
    with the next one's start (`_consume_flat`)."""
    if OVERLAP:
        _consume_flat(shared, WG, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, IS_VARLEN, HEAD_DIM, BLOCK_N, NUM_BUFFERS, N_CONSUMERS,
                      Q_BUFFERS)
    else:
        _consume_in_turn(shared, WG, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, IS_VARLEN, HEAD_DIM, BLOCK_N, NUM_BUFFERS,
                         PINGPONG, N_CONSUMERS, Q_BUFFERS, CAUSAL_PAIRS, DYNAMIC)


@gluon.jit
def _consume_in_turn(shared, WG: gl.constexpr, IS_CAUSAL: gl.constexpr, CAUSAL_BOTTOM_RIGHT: gl.constexpr,
                     IS_VARLEN: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr,
                     PINGPONG: gl.constexpr, N_CONSUMERS: gl.constexpr, Q_BUFFERS: gl.constexpr,
                     CAUSAL_PAIRS: gl.constexpr, DYNAMIC: gl.constexpr):
    """This warpgroup's rows of each item in turn. The output leaves through o_smem and a TMA store (dense: rows
    past the sequence are clipped) or, varlen, through masked stores (a TMA store over the packed tensor would
    write the next sequence's rows). DYNAMIC: the items the producer posts in the Q slots, until one says there
    are no more."""
    (q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, v_ready, v_fixed, k_empty, v_empty, turn, desc_o, O,
     LSE, items, n_items, qk_scale, stride_om, stride_oh, stride_lb, stride_lh, slots) = shared
    BLOCK_M: gl.constexpr = ROWS * N_CONSUMERS
    c = 0  # K/V tiles consumed, over all items
    g = 0  # ping-pong turns taken
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
                diag, n_tiles, has_rows = item_bounds(start_m, seqlen_q, seqlen_k, IS_CAUSAL,
                                                               CAUSAL_BOTTOM_RIGHT, BLOCK_M, BLOCK_N)
                c, g = _consume_item(shared, qs, c, g, off_b, off_h, start_m, q_start, seqlen_q, seqlen_k,
                                     diag, n_tiles, WG, IS_CAUSAL, IS_VARLEN, HEAD_DIM, BLOCK_N, NUM_BUFFERS,
                                     PINGPONG, N_CONSUMERS)
            qi += 1
    else:
        ahead = work_ahead(0, items, IS_CAUSAL, CAUSAL_PAIRS, IS_VARLEN, HEAD_DIM, BLOCK_M)
        for i in range(0, n_items):
            off_b, off_h, start_m, seq, bounds, ahead = work(i, n_items, ahead, items, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT,
                                                              CAUSAL_PAIRS, IS_VARLEN, HEAD_DIM, BLOCK_M, BLOCK_N)
            q_start, seqlen_q, k_start, seqlen_k = seq
            diag, n_tiles, has_rows = bounds
            if has_rows:
                if not IS_VARLEN:
                    tma.store_wait(0)  # the previous item's output has left o_smem (the barriers below order the rest)
                qs = qi % Q_BUFFERS
                mbarrier.wait(q_ready.index(qs), (qi // Q_BUFFERS) & 1)
                c, g = _consume_item(shared, qs, c, g, off_b, off_h, start_m, q_start, seqlen_q, seqlen_k,
                                     diag, n_tiles, WG, IS_CAUSAL, IS_VARLEN, HEAD_DIM, BLOCK_N, NUM_BUFFERS,
                                     PINGPONG, N_CONSUMERS)
                qi += 1
    if not IS_VARLEN:
        tma.store_wait(0)  # the last item's output has left o_smem


@gluon.jit(do_not_specialize=["stride_om", "stride_oh", "stride_lb", "stride_lh", "HEADS", "BATCH", "GROUP_SIZE",
                              "SEQLEN_Q", "SEQLEN_K"])
def _attn_fwd_gluon(
    desc_q, desc_k, desc_v, desc_o, O, LSE, CU_SEQLENS_Q, CU_SEQLENS_K, COUNTER, qk_scale, stride_om, stride_oh, stride_lb,
    stride_lh, HEADS, BATCH, GROUP_SIZE, SEQLEN_Q, SEQLEN_K,
    IS_CAUSAL: gl.constexpr, CAUSAL_BOTTOM_RIGHT: gl.constexpr, IS_VARLEN: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr, CONSUMER_REGS: gl.constexpr, PINGPONG: gl.constexpr,
    N_CONSUMERS: gl.constexpr, Q_BUFFERS: gl.constexpr, CAUSAL_PAIRS: gl.constexpr, DYNAMIC: gl.constexpr,
    OVERLAP: gl.constexpr,
):
    """Grid (programs,): the program takes items of the cdiv(Sq, 64 N_CONSUMERS) · Hq · B (varlen: Sq, Sk the
    longest sequences', B the sequences) as `forward_gluon_items.item` hands them out (causal: in pairs).
    num_warps=4: the producer; the N_CONSUMERS (2 or 3) consumer warpgroups are worker partitions."""
    gl.static_assert((N_CONSUMERS == 2) | ((N_CONSUMERS == 3) & (not PINGPONG)), "2 consumers, or 3 without ping-pong")
    gl.static_assert(not (DYNAMIC and IS_CAUSAL and CAUSAL_PAIRS), "DYNAMIC: items one at a time")
    gl.static_assert(not (OVERLAP and PINGPONG), "OVERLAP: without ping-pong")
    BLOCK_M: gl.constexpr = ROWS * N_CONSUMERS
    n_m = gl.cdiv(SEQLEN_Q, BLOCK_M)
    n_bh = HEADS * BATCH
    n_items = num_items(n_m, n_bh, IS_CAUSAL and CAUSAL_PAIRS)

    dtype: gl.constexpr = desc_q.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [Q_BUFFERS * N_CONSUMERS] + desc_q.block_type.shape, desc_q.layout)
    if IS_VARLEN:  # the output is stored from registers: no staging buffers
        o_bufs = q_bufs
    else:
        o_bufs = gl.allocate_shared_memory(dtype, [N_CONSUMERS] + desc_o.block_type.shape, desc_o.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + desc_k.block_type.shape, desc_k.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + desc_v.block_type.shape, desc_v.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
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
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_fixed.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=N_CONSUMERS)
        mbarrier.init(v_empty.index(i), count=N_CONSUMERS)
    fence_async_shared()  # the initialised barriers, visible to TMA (async proxy)
    if PINGPONG:
        mbarrier.arrive(turn.index(0), count=1)  # the first warpgroup issues first

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
    items = (n_m, n_bh, heads, CU_SEQLENS_Q, CU_SEQLENS_K, max_seqlen_q, max_seqlen_k)  # what `work` hands out
    producer_args = (desc_q, desc_k, desc_v, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, v_fixed,
                     k_empty, v_empty, items, n_items, group_size, slots, COUNTER)
    consumer_args = (q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, v_ready, v_fixed, k_empty, v_empty, turn,
                     desc_o, O, LSE, items, n_items, qk_scale, stride_om, stride_oh, stride_lb, stride_lh, slots)
    # One list per consumer count (a kernel cannot hold a function in a variable, nor grow a list in a loop).
    if N_CONSUMERS == 3:
        gl.warp_specialize([
            (_producer, (producer_args, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, IS_VARLEN, BLOCK_N, NUM_BUFFERS, N_CONSUMERS,
                         Q_BUFFERS, CAUSAL_PAIRS, DYNAMIC, DYNAMIC or OVERLAP)),
            (_consumer, (consumer_args, WG0, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, IS_VARLEN, HEAD_DIM, BLOCK_N, NUM_BUFFERS,
                         PINGPONG, N_CONSUMERS, Q_BUFFERS, CAUSAL_PAIRS, DYNAMIC, OVERLAP)),
            (_consumer, (consumer_args, WG1, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, IS_VARLEN, HEAD_DIM, BLOCK_N, NUM_BUFFERS,
                         PINGPONG, N_CONSUMERS, Q_BUFFERS, CAUSAL_PAIRS, DYNAMIC, OVERLAP)),
            (_consumer, (consumer_args, WG2, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, IS_VARLEN, HEAD_DIM, BLOCK_N, NUM_BUFFERS,
                         PINGPONG, N_CONSUMERS, Q_BUFFERS, CAUSAL_PAIRS, DYNAMIC, OVERLAP)),
        ], [4, 4, 4], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS])
    else:
        gl.warp_specialize([
            (_producer, (producer_args, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, IS_VARLEN, BLOCK_N, NUM_BUFFERS, N_CONSUMERS,
                         Q_BUFFERS, CAUSAL_PAIRS, DYNAMIC, DYNAMIC or OVERLAP)),
            (_consumer, (consumer_args, WG0, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, IS_VARLEN, HEAD_DIM, BLOCK_N, NUM_BUFFERS,
                         PINGPONG, N_CONSUMERS, Q_BUFFERS, CAUSAL_PAIRS, DYNAMIC, OVERLAP)),
            (_consumer, (consumer_args, WG1, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, IS_VARLEN, HEAD_DIM, BLOCK_N, NUM_BUFFERS,
                         PINGPONG, N_CONSUMERS, Q_BUFFERS, CAUSAL_PAIRS, DYNAMIC, OVERLAP)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


# ----------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------


# Work units are counted in int32, and a program's last draw (or static slot) runs up to one grid past the end.
UNIT_LIMIT = 2**31 - 2**20


def work_units(seqlen_q: int, heads_q: int, batch: int, config: dict, causal: bool) -> int:
    """How many work units a launch hands out: query tiles (in pairs: pairs of them) x heads x batch entries;
    varlen: over the longest sequence's tiles, for every sequence."""
    n_m = triton.cdiv(seqlen_q, ROWS.value * config["N_CONSUMERS"])
    return ((n_m + 1) // 2 if causal and config["CAUSAL_PAIRS"] else n_m) * heads_q * batch


def shared_memory_bytes(config: dict, head_dim: int, elem_bytes: int = 2, varlen: bool = False) -> int:
    """Shared memory of the kernel's tiles under `config` (barriers aside): Q slots, the K/V ring and, dense, the O
    staging tiles. Three consumers with two Q slots at D = 128 need 272 KB: more than sm_90 has."""
    rows = ROWS.value * config["N_CONSUMERS"]
    q = config["Q_BUFFERS"] * rows * head_dim
    kv = 2 * config["NUM_BUFFERS"] * config["BLOCK_N"] * head_dim
    o = 0 if varlen else rows * head_dim
    return elem_bytes * (q + kv + o)


def launch_parts(q_shape, k_shape, causal: bool, causal_bottom_right: bool, config: dict, sms: int,
                 batch: int | None = None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None):
    """(grid, int arguments after the scale, constexprs and options) of a launch. Dense (batch None):
    q (B, Sq, Hq, D), k (B, Sk, Hkv, D), contiguous out like q and lse (B, Hq, Sq). Varlen: q (total_q, Hq, D),
    k (total_k, Hkv, D), `batch` sequences of at most max_seqlen_q / max_seqlen_k tokens, contiguous out like q
    and lse (Hq, total_q)."""
    varlen = batch is not None
    heads_q, head_dim, heads_kv = q_shape[-2], q_shape[-1], k_shape[-2]
    if varlen:
        seqlen_q, seqlen_k, lse_strides = max_seqlen_q, max_seqlen_k, (0, q_shape[0])
    else:
        batch, seqlen_q, seqlen_k = q_shape[0], q_shape[1], k_shape[1]
        lse_strides = (heads_q * seqlen_q, seqlen_q)
    if shared_memory_bytes(config, head_dim, 2, varlen) > SHARED_MEMORY_LIMIT:
        raise ValueError(f"Gluon forward config {config} needs {shared_memory_bytes(config, head_dim, 2, varlen)} "
                         f"bytes of shared memory at head dim {head_dim}; sm_90 has {SHARED_MEMORY_LIMIT}")
    if config["DYNAMIC"] and causal and config["CAUSAL_PAIRS"]:
        raise ValueError(f"Gluon forward config {config}: the dynamic schedule takes items one at a time")
    if config["OVERLAP"] and config["PINGPONG"]:
        raise ValueError(f"Gluon forward config {config}: OVERLAP runs without ping-pong")
    units = work_units(seqlen_q, heads_q, batch, config, causal)  # pairs of items, or items
    if units >= UNIT_LIMIT:
        raise ValueError(f"Gluon forward: {units} work units do not fit its 32-bit counters")
    config = dict(config)
    persistent = config.pop("PERSISTENT")
    grid = (min(units, sms) if persistent else units, 1, 1)
    ints = (heads_q * head_dim, head_dim, *lse_strides, heads_q, batch, heads_q // heads_kv, seqlen_q, seqlen_k)
    meta = dict(IS_CAUSAL=bool(causal), CAUSAL_BOTTOM_RIGHT=bool(causal_bottom_right), IS_VARLEN=varlen,
                HEAD_DIM=head_dim, num_warps=4, **config)
    return grid, ints, meta


def launch_args(q, k, v, out, lse, softmax_scale: float, block_n: int, ints: tuple, cu_seqlens_q=None,
                cu_seqlens_k=None, counter=None) -> tuple:
    """The kernel's runtime arguments: the four descriptors, out, lse, cu_seqlens (varlen; else lse stands in),
    the dynamic schedule's counter (a zeroed int32; else lse stands in), the scale, then `ints`."""
    varlen = cu_seqlens_q is not None
    rows = ROWS.value
    return (descriptor(q, rows, varlen), descriptor(k, block_n, varlen), descriptor(v, block_n, varlen),
            descriptor(out, rows, varlen), out, lse, cu_seqlens_q if varlen else lse,
            cu_seqlens_k if varlen else lse, lse if counter is None else counter, softmax_scale * LOG2E, *ints)


def launch_forward_gluon(q, k, v, out, lse, softmax_scale, causal, causal_bottom_right, config, cu_seqlens_q=None,
                         cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None) -> None:
    """Dense q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D), out like q, lse (B, Hq, Sq); or varlen q (total_q, Hq, D),
    k/v (total_k, Hkv, D), out like q, lse (Hq, total_q), cu_seqlens int32 (B + 1,). out and lse contiguous,
    fp16/bf16, D 64 or 128, inputs that pass `common.tma_ok`, softmax_scale > 0, Sq > 0 (the caller checks)."""
    batch = None if cu_seqlens_q is None else cu_seqlens_q.numel() - 1
    grid, ints, meta = launch_parts(q.shape, k.shape, causal, causal_bottom_right, config, sm_count(q.device.index),
                                    batch, max_seqlen_q, max_seqlen_k)
    counter = torch.zeros(1, dtype=torch.int32, device=q.device) if config["DYNAMIC"] else None  # one per launch
    # `launch` skips Triton's argument binding for a call shape seen before: ~0.2 ms of host time per varlen call
    # on the H200 machine's CPU, which a benchmark that idles the GPU between calls sees as GPU idle time.
    launch(_attn_fwd_gluon, grid, launch_args(q, k, v, out, lse, softmax_scale, config["BLOCK_N"], ints,
                                              cu_seqlens_q, cu_seqlens_k, counter), meta)


def compile_for_sm90(head_dim: int, causal: bool, config: dict, dtype: torch.dtype = torch.bfloat16,
                     varlen: bool = False):
    """Compile the kernel for sm_90 without a GPU (Triton's frontend and Hopper passes, then its bundled ptxas):
    compiled.asm["ptx"] / ["cubin"], compiled.metadata.shared. For tests and for looking at what a change does
    to registers and spills (`ptxas -v` on the PTX) before spending device time. Not under the interpreter."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    t = torch.empty(512, 4, head_dim, dtype=dtype) if varlen else torch.empty(2, 256, 4, head_dim, dtype=dtype)
    batch = 2 if varlen else None
    _, _, meta = launch_parts(t.shape, t.shape, causal, True, config, 1, batch, 256, 256)
    options = {"num_warps": meta.pop("num_warps")}
    rows = ROWS.value
    descriptors = {"desc_q": descriptor(t, rows, varlen), "desc_o": descriptor(t, rows, varlen),
                   "desc_k": descriptor(t, config["BLOCK_N"], varlen), "desc_v": descriptor(t, config["BLOCK_N"], varlen)}
    pointers = {"O": "*bf16" if dtype == torch.bfloat16 else "*fp16", "LSE": "*fp32",
                "CU_SEQLENS_Q": "*i32" if varlen else "*fp32", "CU_SEQLENS_K": "*i32" if varlen else "*fp32",
                "COUNTER": "*i32" if config["DYNAMIC"] else "*fp32"}
    names = _attn_fwd_gluon.arg_names
    signature = {name: "constexpr" if name in meta else mangle_type(descriptors[name]) if name in descriptors
                 else pointers[name] if name in pointers else "fp32" if name == "qk_scale" else "i32"
                 for name in names}
    source = GluonASTSource(_attn_fwd_gluon, signature, constexprs=meta,
                            attrs={(names.index(name),): [["tt.divisibility", 16]] for name in pointers})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
