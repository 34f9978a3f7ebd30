"""The producer partition of Hopper's Gluon forward (`forward_gluon`): TMA loads of each of a program's items, its Q
into a Q slot and its K/V tiles into the ring of stages, each announced on the barriers the consumer warpgroups wait
on; varlen V rows past a sequence cleared in shared memory. Which items a program takes and how they are posted to
the consumers: `forward_gluon_items`."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from .forward_gluon_items import item_bounds, post_end, post_item, unit_item, work, work_ahead
from .gluon_common import sequence, tma_load

ROWS = gl.constexpr(64)  # rows per consumer warpgroup: wgmma's M; an item has ROWS * N_CONSUMERS rows


@gluon.jit
def zero_rows_from(tile, first, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Zero rows [first, BLOCK_N) of a (BLOCK_N, HEAD_DIM) tile in shared memory, 16 rows at a time."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    for chunk in gl.static_range(BLOCK_N // 16):
        if (chunk + 1) * 16 > first:
            part = tile.slice(chunk * 16, 16)
            rows = chunk * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, layout))
            x = part.load(layout)
            part.store(gl.where((rows < first)[:, None], x, gl.zeros_like(x)))


@gluon.jit
def _page_rows(entries, key, seqlen_k, PAGE_SIZE: gl.constexpr, GATHER: gl.constexpr):
    """The pool rows where the key tile from `key` on starts in each of its GATHER pages of PAGE_SIZE rows (a tuple),
    page g's index at entries[key // PAGE_SIZE + g] (the block-table row); a page past the sequence's keys is not
    read from the table (page 0 stands in). The loads go out together, ahead of the wait for the stage, so that no
    box waits for a round trip of its own (boxes each behind its own load run 4 % slower at pages of 8 keys on an
    H100: benchmarks/2026-12-07-h100/paged-prefetch/). Scalars, not one vector load: its elements' extraction
    cost more than the loads (docs/performance.md)."""
    rows = ()
    for g in gl.static_range(GATHER):
        used = key + g * PAGE_SIZE < seqlen_k
        rows = rows + (gl.load(entries + key // PAGE_SIZE + g, mask=used, other=0) * PAGE_SIZE, )
    return rows


@gluon.jit
def _gather_pages(desc, rows, off_hk, bar, tile, PAGE_SIZE: gl.constexpr, GATHER: gl.constexpr):
    """TMA loads of a key tile from its GATHER pages (`_page_rows`): page g into rows [g · PAGE_SIZE, + PAGE_SIZE)
    of `tile` (BLOCK_N, 1, D), all on `bar`."""
    for g in gl.static_range(GATHER):
        tma_load(desc, True, 0, rows[g], off_hk, bar, tile.slice(g * PAGE_SIZE, PAGE_SIZE))


@gluon.jit
def load_item(shared, qi, c, off_b, off_h, start_m, seq, first, n_tiles, IS_VARLEN: gl.constexpr,
              BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr, N_CONSUMERS: gl.constexpr, Q_BUFFERS: gl.constexpr,
              POSTED: gl.constexpr, PAGE_SIZE: gl.constexpr = 0):
    """One item's loads (see `producer`): its Q into slot qi % Q_BUFFERS (POSTED: the item posted there too),
    its n_tiles K/V tiles from key `first` on into the ring from tile c on. Returns (qi + 1, c + n_tiles).
    PAGE_SIZE > 0 (varlen): K and V are pools of pages flattened to (pages · PAGE_SIZE, Hkv, D), page p of sequence b
    block_table[b, p] (the host has checked the entries a sequence uses and cut the bad sequences' keys to 0). Pages
    of whole tiles (PAGE_SIZE a multiple of BLOCK_N): tile t is rows [first + t · BLOCK_N, + BLOCK_N) of one page.
    Smaller pages (BLOCK_N a multiple of PAGE_SIZE, which is a multiple of 8: whole swizzle atoms of the stage's
    layout): the tile gathers BLOCK_N / PAGE_SIZE pages, one TMA box of PAGE_SIZE rows each into its rows of the
    stage (the K/V descriptors' boxes are a page's rows), so that the consumers see the dense call's tiles; a page
    past the sequence's keys (the last tile's) is not read from the block table, page 0 stands in (its keys are
    masked and its V rows zeroed, as any rows past a sequence)."""
    (desc_q, desc_k, desc_v, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, v_fixed, k_empty, v_empty,
     items, n_items, group_size, slots, COUNTER, paging) = shared
    HEAD_DIM_V: gl.constexpr = desc_v.block_type.shape[len(desc_v.block_type.shape) - 1]  # V's tiles' head dim
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
    GATHER: gl.constexpr = BLOCK_N // PAGE_SIZE if (PAGE_SIZE > 0 and PAGE_SIZE < BLOCK_N) else 1  # pages a tile
    if PAGE_SIZE > 0:
        gl.static_assert(IS_VARLEN and (PAGE_SIZE % BLOCK_N == 0 or (BLOCK_N % PAGE_SIZE == 0 and PAGE_SIZE % 8 == 0)),
                         "pages: varlen, whole key tiles or whole 8-row parts of one")
        bt_row = paging[0] + off_b.to(gl.int64) * paging[1]
    for t in range(n_tiles):
        stage = c % NUM_BUFFERS
        phase = ((c // NUM_BUFFERS) & 1) ^ 1  # the first round passes: a fresh barrier's "previous" phase
        key = first + t * BLOCK_N
        if GATHER > 1:
            pages = _page_rows(bt_row, key, seqlen_k, PAGE_SIZE, GATHER)
        elif PAGE_SIZE > 0:
            row = gl.load(bt_row + key // PAGE_SIZE) * PAGE_SIZE + key % PAGE_SIZE
        else:
            row = k_start + key
        mbarrier.wait(k_empty.index(stage), phase, pred=c >= NUM_BUFFERS)
        mbarrier.expect(k_ready.index(stage), GATHER * desc_k.block_type.nbytes)
        if GATHER > 1:
            _gather_pages(desc_k, pages, off_hk, k_ready.index(stage), k_bufs.index(stage), PAGE_SIZE, GATHER)
        else:
            tma_load(desc_k, IS_VARLEN, off_b, row, off_hk, k_ready.index(stage), k_bufs.index(stage))
        if GATHER > 1:
            pages = _page_rows(bt_row, key, seqlen_k, PAGE_SIZE, GATHER)  # again (L1 hits): fewer live registers
        mbarrier.wait(v_empty.index(stage), phase, pred=c >= NUM_BUFFERS)
        mbarrier.expect(v_ready.index(stage), GATHER * desc_v.block_type.nbytes)
        if GATHER > 1:
            _gather_pages(desc_v, pages, off_hk, v_ready.index(stage), v_bufs.index(stage), PAGE_SIZE, GATHER)
        else:
            tma_load(desc_v, IS_VARLEN, off_b, row, off_hk, v_ready.index(stage), v_bufs.index(stage))
        if IS_VARLEN:
            if first + (t + 1) * BLOCK_N > seqlen_k:
                mbarrier.wait(v_ready.index(stage), phase ^ 1)
                zero_rows_from(v_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM_V]), seqlen_k - first - t * BLOCK_N,
                                BLOCK_N, HEAD_DIM_V)
                fence_async_shared()  # the generic stores, before the wgmma (async proxy) reads
            mbarrier.arrive(v_fixed.index(stage), count=1)
        c += 1
    return qi + 1, c


@gluon.jit
def producer(shared, IS_CAUSAL: gl.constexpr, CAUSAL_BOTTOM_RIGHT: gl.constexpr, IS_VARLEN: gl.constexpr,
              BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr, N_CONSUMERS: gl.constexpr, Q_BUFFERS: gl.constexpr,
              CAUSAL_PAIRS: gl.constexpr, DYNAMIC: gl.constexpr, POSTED: gl.constexpr, SCORES: gl.constexpr = 0,
              PAGE_SIZE: gl.constexpr = 0):
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
     items, n_items, group_size, slots, COUNTER, paging) = shared
    HEAD_DIM: gl.constexpr = desc_k.block_type.shape[len(desc_k.block_type.shape) - 1]
    BLOCK_M: gl.constexpr = ROWS * N_CONSUMERS
    c = 0  # K/V tiles issued, over all items
    qi = 0  # items with rows, whose Q was loaded
    if DYNAMIC:
        n_m, n_bh, heads, CU_SEQLENS_Q, CU_SEQLENS_K, max_seqlen_q, max_seqlen_k, window = items
        unit = gl.atomic_add(COUNTER, 1, sem="relaxed")
        while unit < n_m * n_bh:
            next_unit = gl.atomic_add(COUNTER, 1, sem="relaxed")  # in flight while this unit's loads are issued
            off_b, off_h, start_m = unit_item(unit, n_m, n_bh, heads, max_seqlen_k, IS_CAUSAL, False, HEAD_DIM)
            seq = sequence(off_b, CU_SEQLENS_Q, CU_SEQLENS_K, max_seqlen_q, max_seqlen_k, IS_VARLEN)
            diag, first, n_tiles, has_rows = item_bounds(start_m, seq[1], seq[3], window, IS_CAUSAL,
                                                         CAUSAL_BOTTOM_RIGHT, BLOCK_M, BLOCK_N, SCORES)
            if has_rows:
                qi, c = load_item(shared, qi, c, off_b, off_h, start_m, seq, first, n_tiles, IS_VARLEN, BLOCK_N,
                                  NUM_BUFFERS, N_CONSUMERS, Q_BUFFERS, POSTED, PAGE_SIZE)
            unit = next_unit
        post_end(slots, q_ready, q_empty, qi, Q_BUFFERS)
    else:
        ahead = work_ahead(0, items, IS_CAUSAL, CAUSAL_PAIRS, IS_VARLEN, HEAD_DIM, BLOCK_M)
        for i in range(0, n_items):
            off_b, off_h, start_m, seq, bounds, ahead = work(i, n_items, ahead, items, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT,
                                                              CAUSAL_PAIRS, IS_VARLEN, HEAD_DIM, BLOCK_M, BLOCK_N,
                                                              SCORES)
            diag, first, n_tiles, has_rows = bounds
            if has_rows:
                qi, c = load_item(shared, qi, c, off_b, off_h, start_m, seq, first, n_tiles, IS_VARLEN, BLOCK_N,
                                  NUM_BUFFERS, N_CONSUMERS, Q_BUFFERS, POSTED, PAGE_SIZE)
        if POSTED:
            post_end(slots, q_ready, q_empty, qi, Q_BUFFERS)
