"""The Gluon forward's work items: which (batch, head, query tile)s a persistent program takes, in what order,
and how the producer hands them to the consumers (`forward_gluon`).

A unit is a query tile of one (batch, head), or in causal pairs the tiles j and n_m - 1 - j of one head (equal work).
Static schedule: program p takes units p, p + programs, ... (`item`); dynamic: the producer draws units from a
global counter. Either way the producer may post each item in its Q slot (`post_item`), which the consumers read
(`read_item`) once the slot's barrier says its Q has landed."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .gluon_common import sequence
from .variant import diagonal, key_blocks

# The score changes a Gluon forward compiles in, as one constexpr bit set (SCORES) that its partitions pass on:
# the kernel's HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_SINKS, HAS_DROPOUT, CAP_FIXED (softcap's bounded scores
# against a fixed max: `forward_gluon_tiles.softmax_tile`), PV_SPLIT (the output in two accumulators over V's columns
# 0 … 127 and 128 … 191: `forward_gluon_tiles.pv`), and in the bits from SC_QK_16 up QK_WIDTH / 16 (Q Kᵀ over the
# tiles' first QK_WIDTH columns: `forward_gluon_tiles.qk_tile`; 0: all of them), and SC_O_IN_Q (the config's
# O_IN_Q: each consumer stages its output in its own Q buffer for the TMA store, no staging tiles of their own:
# `forward_gluon._consume_item`). 0: plain attention.
SC_WINDOW, SC_SOFTCAP, SC_ALIBI, SC_SINKS, SC_DROPOUT = (gl.constexpr(1), gl.constexpr(2), gl.constexpr(4),
                                                         gl.constexpr(8), gl.constexpr(16))
SC_CAP_FIXED = gl.constexpr(32)
SC_PV_SPLIT = gl.constexpr(64)
SC_QK_16 = gl.constexpr(128)
SC_O_IN_Q = gl.constexpr(1 << 16)  # (above SC_QK_16's bits: QK_WIDTH / 16 < 512)
L2_BUDGET = gl.constexpr(24 * 1024 * 1024)  # bytes of K/V the unpaired causal schedule keeps in use (L2: 50-60 MB)


@gluon.jit
def unit_item(unit, n_m, n_bh, heads, max_seqlen_k, IS_CAUSAL: gl.constexpr, CAUSAL_PAIRS: gl.constexpr,
               HEAD_DIM: gl.constexpr):
    """Work unit -> (off_b, off_h, start_m) (in pairs: the pair's first item).

    Non-causal: head-major, so the programs running together read the same head's K/V (from L2).
    Causal pairs (CAUSAL_PAIRS): unit j of a head is the pair of query tiles n_m - 1 - j and j (equal total work,
    see `item`), head-major like non-causal: the pairs of a head run at once and share its K/V in L2 (at T=512 the
    head groups below read 244 MB from DRAM where Q, K and V are 201 MB; head-major runs the flat loop at 351
    TFLOP/s against 324, level from 8k: benchmarks/2026-11-29-h200/explore16/ab/ab_flat2.txt).
    Causal items one at a time: heads go in groups whose K/V fit in L2_BUDGET; within a group, query tile j
    (counted from the last) of every head comes before tile j + 1: the longest items first."""
    if IS_CAUSAL and CAUSAL_PAIRS:
        per_head = (n_m + 1) // 2
        bh = unit // per_head
        start_m = n_m - 1 - unit % per_head
    elif IS_CAUSAL:
        heads_per_group = gl.maximum(L2_BUDGET // (max_seqlen_k.to(gl.int64) * HEAD_DIM * 4), 1).to(gl.int32)
        per_head = n_m
        group = unit // (per_head * heads_per_group)
        group_heads = gl.minimum(heads_per_group, n_bh - group * heads_per_group)  # the last group may be smaller
        r = unit - group * per_head * heads_per_group
        j = r // group_heads
        bh = group * heads_per_group + r % group_heads
        start_m = n_m - 1 - j
    else:
        bh = unit // n_m
        start_m = unit % n_m
    return bh // heads, bh % heads, start_m


@gluon.jit
def item(i, n_m, n_bh, heads, max_seqlen_k, IS_CAUSAL: gl.constexpr, CAUSAL_PAIRS: gl.constexpr,
          HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr):
    """This program's i-th work item (static schedule) -> (off_b, off_h, start_m); start_m >= n_m: an empty slot.

    Units (`unit_item`) pid, pid + programs, ...; CAUSAL_PAIRS: items 2k and 2k + 1 are the program's k-th pair
    (with an odd n_m the middle tile is a pair of its own and its second slot is empty). Handed out one at a
    time, causal items give the programs unequal totals: tile j costs j + 1 key tiles."""
    if IS_CAUSAL and CAUSAL_PAIRS:
        unit = gl.program_id(0) + (i // 2) * gl.num_programs(0)
    else:
        unit = gl.program_id(0) + i * gl.num_programs(0)
    off_b, off_h, start_m = unit_item(unit, n_m, n_bh, heads, max_seqlen_k, IS_CAUSAL, CAUSAL_PAIRS, HEAD_DIM)
    if IS_CAUSAL and CAUSAL_PAIRS:
        if i % 2 == 1:
            j = n_m - 1 - start_m
            start_m = gl.where(j == n_m - 1 - j, n_m, j)  # the middle tile's second slot: empty
    return off_b, off_h, start_m


@gluon.jit
def num_items(n_m, n_bh, PAIRS: gl.constexpr):
    """How many work items (in pairs: 2 slots per pair) this program takes."""
    if PAIRS:
        return 2 * gl.cdiv((n_m + 1) // 2 * n_bh - gl.program_id(0), gl.num_programs(0))
    else:
        return gl.cdiv(n_m * n_bh - gl.program_id(0), gl.num_programs(0))


@gluon.jit
def item_bounds(start_m, seqlen_q, seqlen_k, window, IS_CAUSAL: gl.constexpr, CAUSAL_BOTTOM_RIGHT: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SCORES: gl.constexpr = 0):
    """An item's (diag, first, n_tiles, has_rows) in its sequence: its keys are the n_tiles tiles from key `first`
    (a window's first tile; 0 without one); items past a varlen sequence's last row have no rows. `window`:
    (left, right) as `Variant.scalars` gives them, read under SCORES' WINDOW bit only."""
    HAS_WINDOW: gl.constexpr = (SCORES & SC_WINDOW) != 0
    diag = diagonal(seqlen_q, seqlen_k, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, (SCORES & (SC_WINDOW | SC_ALIBI)) != 0)
    first, _, _, hi = key_blocks(start_m, seqlen_k, diag, IS_CAUSAL, BLOCK_M, BLOCK_N, HAS_WINDOW, window[0],
                                 window[1])
    n_tiles = gl.cdiv(hi - first, BLOCK_N)
    return diag, first, n_tiles, start_m * BLOCK_M < seqlen_q


@gluon.jit
def work_ahead(i, items, IS_CAUSAL: gl.constexpr, CAUSAL_PAIRS: gl.constexpr, IS_VARLEN: gl.constexpr,
                HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr):
    """Varlen: item i and its sequence's bounds, (off_b, off_h, start_m, (q_start, seqlen_q, k_start, seqlen_k));
    `items` = (n_m, n_bh, heads, CU_SEQLENS_Q, CU_SEQLENS_K, max_seqlen_q, max_seqlen_k, window). Dense: 0
    (unused)."""
    if IS_VARLEN:
        n_m, n_bh, heads, CU_SEQLENS_Q, CU_SEQLENS_K, max_seqlen_q, max_seqlen_k, window = items
        off_b, off_h, start_m = item(i, n_m, n_bh, heads, max_seqlen_k, IS_CAUSAL, CAUSAL_PAIRS, HEAD_DIM, BLOCK_M)
        return off_b, off_h, start_m, sequence(off_b, CU_SEQLENS_Q, CU_SEQLENS_K, max_seqlen_q, max_seqlen_k, True)
    else:
        return 0


@gluon.jit
def work(i, n_items, ahead, items, IS_CAUSAL: gl.constexpr, CAUSAL_BOTTOM_RIGHT: gl.constexpr,
          CAUSAL_PAIRS: gl.constexpr, IS_VARLEN: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
          BLOCK_N: gl.constexpr, SCORES: gl.constexpr = 0):
    """This program's item i, what both partitions loop over: (off_b, off_h, start_m, (q_start, seqlen_q,
    k_start, seqlen_k), (diag, first, n_tiles, has_rows), ahead). Varlen: `ahead` holds item i, fetched while
    item i - 1 ran (`work_ahead`), and comes back holding item i + 1 (item i again after the last), so that the
    cu_seqlens loads are not on an item's critical path."""
    n_m, n_bh, heads, CU_SEQLENS_Q, CU_SEQLENS_K, max_seqlen_q, max_seqlen_k, window = items
    if IS_VARLEN:
        off_b, off_h, start_m, seq = ahead
        ahead = work_ahead(gl.minimum(i + 1, n_items - 1), items, IS_CAUSAL, CAUSAL_PAIRS, IS_VARLEN, HEAD_DIM,
                            BLOCK_M)
    else:
        off_b, off_h, start_m = item(i, n_m, n_bh, heads, max_seqlen_k, IS_CAUSAL, CAUSAL_PAIRS, HEAD_DIM, BLOCK_M)
        seq = sequence(off_b, CU_SEQLENS_Q, CU_SEQLENS_K, max_seqlen_q, max_seqlen_k, IS_VARLEN)
    q_start, seqlen_q, k_start, seqlen_k = seq
    bounds = item_bounds(start_m, seqlen_q, seqlen_k, window, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, BLOCK_M, BLOCK_N, SCORES)
    return off_b, off_h, start_m, seq, bounds, ahead


# Dynamic schedule: the producer takes units from a global counter and posts each item with rows to
# the consumers in the shared-memory slot of its Q: (off_b, off_h, start_m, q_start, seqlen_q, seqlen_k), and
# off_b = -1 once the counter has run out.
ITEM_FIELDS = gl.constexpr(8)


@gluon.jit
def post_item(slot, off_b, off_h, start_m, q_start, seqlen_q, seqlen_k):
    """Write an item into its slot; the caller's arrive on the Q slot's barrier then publishes it (release)."""
    layout: gl.constexpr = gl.BlockedLayout([ITEM_FIELDS], [32], [4], [0])  # every thread holds all fields
    f = gl.arange(0, ITEM_FIELDS, layout=layout)
    vals = gl.where(f == 0, off_b, gl.where(f == 1, off_h, gl.where(f == 2, start_m, gl.where(
        f == 3, q_start, gl.where(f == 4, seqlen_q, seqlen_k)))))
    slot.store(vals)
    gl.thread_barrier()  # every producer thread's copy is written before the one that arrives goes on


@gluon.jit
def post_end(slots, q_ready, q_empty, qi, Q_BUFFERS: gl.constexpr):
    """After this program's last item: an item with off_b = -1, and no Q, in the next slot."""
    qs = qi % Q_BUFFERS
    mbarrier.wait(q_empty.index(qs), ((qi // Q_BUFFERS) & 1) ^ 1, pred=qi >= Q_BUFFERS)
    post_item(slots.index(qs), -1, 0, 0, 0, 0, 0)
    mbarrier.arrive(q_ready.index(qs), count=1)


@gluon.jit
def read_item(slot):
    """The item posted in `slot` (after its Q barrier's wait): (off_b, off_h, start_m, q_start, seqlen_q,
    seqlen_k)."""
    layout: gl.constexpr = gl.BlockedLayout([ITEM_FIELDS], [32], [4], [0])
    f = gl.arange(0, ITEM_FIELDS, layout=layout)
    vals = slot.load(layout)
    return (gl.sum(gl.where(f == 0, vals, 0), 0), gl.sum(gl.where(f == 1, vals, 0), 0),
            gl.sum(gl.where(f == 2, vals, 0), 0), gl.sum(gl.where(f == 3, vals, 0), 0),
            gl.sum(gl.where(f == 4, vals, 0), 0), gl.sum(gl.where(f == 5, vals, 0), 0))
