"""Hopper's Gluon dK/dV kernel (`_attn_bwd_dkdv_gluon`): a program owns 128 keys of one (batch, kv head), or 64
at 256-column tiles, and streams the query tiles that see them (the overview, variants and layouts:
`backward_gluon`, which holds what it shares with the dQ kernel)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma_wait

from .backward_gluon import (BLOCK_M, ROWS, WIDE_HEAD_DIM, acc_mma, acc_operands, acc_out, acc_store_rows,
                             acc_to_shared, acc_wait_both, acc_zero, dropout_scalars, lse_base2, lse_rows,
                             probabilities, tile_width, work_item)
from .gluon_common import (a_operand, dropout_tile_t, mma_nt, sequence, tma_load, tma_store, wgmma_layout,
                           width_pieces)
from .variant import diagonal, dropout_sign, key_tile_masked, query_blocks, query_first, visible


@gluon.constexpr_function
def dkdv_keys(head_dim):
    """Keys per dK/dV program: 128 (two warpgroups of 64, each holding its keys' dK and dV whole), or 64 at
    WIDE_HEAD_DIM, where one key's fp32 dK and dV take 512 of a warpgroup's registers: two warpgroups then share
    64 keys, each holding half of the columns (`_consumer`, WARPS_N = 2)."""
    return 64 if head_dim >= WIDE_HEAD_DIM else 128


@gluon.jit
def _query_tiles(start_n, seqlen_q, diag, window_left, window_right, IS_CAUSAL: gl.constexpr,
                 HAS_WINDOW: gl.constexpr, PROGRAM_KEYS: gl.constexpr):
    """(lo, n_m) of the keys [start_n, start_n + PROGRAM_KEYS): the first query tile with a row that sees one of them
    and the number of query tiles per head from there (0: dK = dV = 0)."""
    if HAS_WINDOW:  # the query tiles with a row that sees one of the keys: [lo, q_end)
        lo, _, _, q_end = query_blocks(start_n, seqlen_q, diag, IS_CAUSAL, BLOCK_M, PROGRAM_KEYS, HAS_WINDOW,
                                       window_left, window_right)
        n_m = gl.cdiv(q_end - lo, BLOCK_M)
    else:
        lo = query_first(start_n, diag, IS_CAUSAL, BLOCK_M)  # the first query tile with a row that sees key start_n
        n_m = gl.cdiv(gl.maximum(seqlen_q - lo, 0), BLOCK_M)
    return lo, n_m


@gluon.jit
def _round_item(r, schedule):
    """The item a persistent dK/dV program takes in round r: items r · programs ... (r + 1) · programs − 1 go one to a
    program, in program order in even rounds and in reverse in odd ones, so that with items of decreasing length
    (`_item_place`) each program's sum stays near the mean (a plain stride gives the first programs the longest
    item of every round: 1.6x the mean at causal T=16k). Past the last item: nothing to do."""
    pid = schedule[0]
    programs = schedule[2]
    return r * programs + pid + (r % 2) * (programs - 1 - 2 * pid)


@gluon.jit
def _item_place(item, schedule, seqlen_q):
    """A persistent dK/dV program's item `item`, key block by key block (causal: the first keys, which see the most
    queries, first), within one the batch entries' kv heads: its place (off_b, off_hk, start_n, lo, n_m,
    n_iters), as `_attn_bwd_dkdv_gluon` makes it.
    `schedule`: (first item, items, programs, key blocks, kv heads, group size, diag, window left, right,
    IS_CAUSAL, HAS_WINDOW, PROGRAM_KEYS, ALiBi slopes' batch stride, Hq)."""
    heads_kv = schedule[4]
    per_block = schedule[1] // schedule[3]  # kv heads x batch entries
    start_n = (item // per_block) * schedule[11]
    rest = item % per_block
    off_hk = rest % heads_kv
    off_b = rest // heads_kv
    lo, n_m = _query_tiles(start_n, seqlen_q, schedule[6], schedule[7], schedule[8], schedule[9], schedule[10],
                           schedule[11])
    return off_b, off_hk, start_n, lo, n_m, n_m * schedule[5]


@gluon.jit
def _produce_keys(shared, place, seq, group_size, heads_q, seqlen_pad, kv_bar, kv_base, it0, IS_VARLEN: gl.constexpr,
                  NUM_STAGES: gl.constexpr, KV_BLOCKS: gl.constexpr):
    """One program's keys (`place`): their K/V (KV_BLOCKS blocks of 64) into K/V buffers kv_base + w once, signalled
    on `kv_bar`, then for each (query head g of the group, query tile) its Q, dO, lse and delta into stage
    it % NUM_STAGES of the ring (`it` counting from it0 the tiles the program streamed before), once the consumers
    released the tile it held."""
    (desc_q, desc_do, desc_k, desc_v, desc_lse, desc_delta, q_bufs, do_bufs, k_bufs, v_bufs, lse_bufs, delta_bufs,
     kv_ready, ready, empty) = shared
    off_b, off_hk, start_n, lo, n_m, n_iters = place
    q_start, seqlen_q, k_start, seqlen_k = seq
    mbarrier.expect(kv_bar, KV_BLOCKS * (desc_k.block_type.nbytes + desc_v.block_type.nbytes))
    for w in gl.static_range(KV_BLOCKS):
        tma_load(desc_k, IS_VARLEN, off_b, k_start + start_n + w * ROWS, off_hk, kv_bar, k_bufs.index(kv_base + w))
        tma_load(desc_v, IS_VARLEN, off_b, k_start + start_n + w * ROWS, off_hk, kv_bar, v_bufs.index(kv_base + w))
    TILE_BYTES: gl.constexpr = (desc_q.block_type.nbytes + desc_do.block_type.nbytes
                                + 2 * desc_lse.block_type.nbytes)  # Q, dO, lse, delta
    for t in range(n_iters):
        it = it0 + t
        g = t // n_m
        m = lo + (t - g * n_m) * BLOCK_M
        off_h = off_hk * group_size + g
        stage = it % NUM_STAGES
        mbarrier.wait(empty.index(stage), ((it // NUM_STAGES) & 1) ^ 1, pred=it >= NUM_STAGES)
        mbarrier.expect(ready.index(stage), TILE_BYTES)
        tma_load(desc_q, IS_VARLEN, off_b, q_start + m, off_h, ready.index(stage), q_bufs.index(stage))
        tma_load(desc_do, IS_VARLEN, off_b, q_start + m, off_h, ready.index(stage), do_bufs.index(stage))
        row = lse_rows(off_b, off_h, heads_q, seqlen_pad, q_start, IS_VARLEN) + m  # in the flattened lse / delta
        tma.async_copy_global_to_shared(desc_lse, [row], ready.index(stage), lse_bufs.index(stage))
        tma.async_copy_global_to_shared(desc_delta, [row], ready.index(stage), delta_bufs.index(stage))


@gluon.jit
def _producer(shared, place, seq, group_size, heads_q, seqlen_pad, IS_VARLEN: gl.constexpr,
              NUM_STAGES: gl.constexpr, KV_BLOCKS: gl.constexpr, schedule=None, kv_empty=None,
              PERSISTENT: gl.constexpr = False):
    """The program's keys (`_produce_keys`). PERSISTENT: the keys of every item of the program (`_round_item`), the
    K/V of item j into buffer pair j % 2 once the consumers released that pair's item j - 2 (`kv_empty`), while
    item j - 1's tiles still run, and the ring's tiles counted across items."""
    if PERSISTENT:
        kv_ready = shared[12]
        it = 0
        j = 0
        for r in range(gl.cdiv(schedule[1], schedule[2])):
            item = _round_item(r, schedule)
            if item < schedule[1]:
                place = _item_place(item, schedule, seq[1])
                buf = j % 2
                mbarrier.wait(kv_empty.index(buf), ((j // 2) & 1) ^ 1, pred=j >= 2)
                _produce_keys(shared, place, seq, group_size, heads_q, seqlen_pad, kv_ready.index(buf),
                              buf * KV_BLOCKS, it, IS_VARLEN, NUM_STAGES, KV_BLOCKS)
                it += place[5]
                j += 1
    else:
        _produce_keys(shared, place, seq, group_size, heads_q, seqlen_pad, shared[12], 0, 0, IS_VARLEN, NUM_STAGES,
                      KV_BLOCKS)


@gluon.jit
def _dkdv_tile(tiles, dk, dv, it, g, m, first_key, keys, cols, seqlen_q, diag, qk_scale, variant,
               MASK: gl.constexpr, LATE_DP: gl.constexpr, IS_CAUSAL: gl.constexpr, IS_VARLEN: gl.constexpr,
               HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
               HAS_ALIBI: gl.constexpr, WARPS_N: gl.constexpr, HAS_DROPOUT: gl.constexpr, QK_W: gl.constexpr,
               V_W: gl.constexpr):
    """One streamed tile (query head g, rows [m, m + BLOCK_M), ring slot `it`) into a warpgroup's dK, dV (returned).
    `tiles`: (Q, dO, lse, delta buffers, ready, empty, K, V, a zero score tile). QK_W, V_W: the widths of Sᵀ's and
    dPᵀ's products (`gluon_common.mma_nt`). MASK: 0 masks the tile where it
    crosses the diagonal or a window's edge (`key_tile_masked`), 1 never (a tile every pair of which is visible),
    2 always. LATE_DP: dPᵀ issued once Pᵀ is on its way to dV (fewer live registers), else beside Sᵀ."""
    q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, k, v, s_zero = tiles
    left, right, softcap, slopes, dropout = variant
    HEAD_DIM_V: gl.constexpr = v.shape[1]
    s_layout: gl.constexpr = wgmma_layout(BLOCK_M, WARPS_N)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    dtype: gl.constexpr = q_bufs.dtype
    stage = it % NUM_STAGES
    mbarrier.wait(ready.index(stage), (it // NUM_STAGES) & 1)
    q = q_bufs.index(stage).reshape([BLOCK_M, HEAD_DIM])
    do = do_bufs.index(stage).reshape([BLOCK_M, HEAD_DIM_V])
    s_tok = mma_nt(k, q, s_zero, QK_W)  # Sᵀ (ROWS, BLOCK_M)
    if not LATE_DP:
        dp_tok = mma_nt(v, do, s_zero, V_W)  # dPᵀ
    lse = lse_bufs.index(stage).load(col_layout)  # (BLOCK_M,)
    if IS_VARLEN:  # rows past the sequence: the layout's gap (never written) or the next sequence's; no P there
        in_seq = m + cols < seqlen_q
        lse = gl.where(in_seq, lse, float("-inf"))
    lse = lse_base2(lse)
    if HAS_DROPOUT:  # Pᵀ / (1 - p) straight from exp2 (and delta · (1 - p) below): no multiply per score
        lse = lse - dropout[3][0]
    slope = gl.load(slopes + g) * 1.4426950408889634 if HAS_ALIBI else None  # query head g's, in base 2
    if LATE_DP:
        s = warpgroup_mma_wait(0, deps=(s_tok, ))
        p, cap_grad = probabilities(s, lse[None, :], (m + cols)[None, :], keys[:, None], diag, qk_scale, softcap,
                                     slope, HAS_SOFTCAP, HAS_ALIBI)  # Pᵀ (ROWS, BLOCK_M)
    else:
        s = warpgroup_mma_wait(width_pieces(V_W), deps=(s_tok, ))  # dPᵀ's products may still run
        p = gl.exp2(s * qk_scale - lse[None, :])  # Pᵀ (ROWS, BLOCK_M)
    # the tile reaches past some row's diagonal (or a window's edge); with a window, tiles none of whose rows
    # see this warpgroup's keys are computed too (P = 0): skipping them cost spills, as causal's
    if MASK == 0:
        if key_tile_masked(first_key + ROWS - 1, m, diag, IS_CAUSAL, HAS_WINDOW, left, right, first_key,
                           m + (BLOCK_M - 1)):
            p = gl.where(visible(True, (m + cols)[None, :], keys[:, None], diag, IS_CAUSAL, HAS_WINDOW, left,
                                 right), p, 0.0)
    elif MASK == 2:
        p = gl.where(visible(True, (m + cols)[None, :], keys[:, None], diag, IS_CAUSAL, HAS_WINDOW, left, right), p,
                     0.0)
    if HAS_DROPOUT:  # the forward's mask (query head g's); dV takes the kept probabilities, scaled
        # Pᵀ' of dropped scores negated: max(Pᵀ', 0) is dV's, |Pᵀ'| dSᵀ's (`variant.dropout_sign`)
        p = dropout_sign(dropout_tile_t(dropout[0], dropout[1], dropout[4] + g, first_key, m, BLOCK_M, WARPS_N),
                         dropout[2], p)
        p_op = acc_operands(gl.maximum(p, 0.0).to(dtype), HEAD_DIM_V, V_W, False, WARPS_N)
    else:
        p_op = acc_operands(p.to(dtype), HEAD_DIM_V, V_W, False, WARPS_N)
    if HAS_SOFTCAP:  # dSᵀ's factor folded into Pᵀ once dV has its copy: one score tile fewer stays live
        p = p * cap_grad
    dv_tok = acc_mma(p_op, do, dv, V_W, False)
    if LATE_DP:
        dp_tok = mma_nt(v, do, s_zero, V_W)  # dPᵀ
    delta = delta_bufs.index(stage).load(col_layout)
    if IS_VARLEN:  # P is 0 there, but 0 · NaN is not
        delta = gl.where(in_seq, delta, 0.0)
    dp = warpgroup_mma_wait(0 if LATE_DP else 1, deps=(dp_tok, ))  # (dV's may still run)
    if HAS_DROPOUT:  # dSᵀ = Pᵀ' ∘ (dPᵀ ∘ Zᵀ - delta · (1 - p)), Pᵀ' = Pᵀ / (1 - p)
        ds = gl.abs(p) * (gl.where(p >= 0.0, dp, 0.0) - (delta * dropout[3][1])[None, :])
    else:
        ds = p * (dp - delta[None, :])  # dSᵀ
    ds_op = acc_operands(ds.to(dtype), HEAD_DIM, QK_W, False, WARPS_N)
    dk_tok = acc_mma(ds_op, q, dk, QK_W, False)
    dv, dk = acc_wait_both(dv_tok, p_op, dk_tok, ds_op)
    mbarrier.arrive(empty.index(stage), count=1)
    return dk, dv


@gluon.jit
def _consume_keys(shared, place, seq, diag, qk_scale, softmax_scale, variant, kv_bar, kv_phase, kv_base, it0,
                  release, WG: gl.constexpr, IS_CAUSAL: gl.constexpr, IS_VARLEN: gl.constexpr,
                  HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr, HAS_WINDOW: gl.constexpr,
                  HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, WARPS_N: gl.constexpr,
                  HAS_DROPOUT: gl.constexpr, PERSISTENT: gl.constexpr, SPLIT: gl.constexpr = 0,
                  QK_W: gl.constexpr = 0, V_W: gl.constexpr = 0, KV_REGS: gl.constexpr = 0):
    """dK, dV of keys [start_n + 64 WG, start_n + 64 WG + 64) of one program's keys (`place`) over the streamed
    tiles, then their stores (dK in QK's tiles, dV in V's: HEAD_DIM_V), through K/V buffers kv_base + WG, whose
    load completes phase `kv_phase` of `kv_bar`; `it0`: the tiles the program streamed before.
    PERSISTENT: the stores are not waited for here; once this item's first tile is done (or at its end, without
    tiles), the previous item's stores are, and its K/V buffers go back to the producer: `release` = (the barrier,
    whether there was a previous item).
    SPLIT (dense, causal or a window, 128 keys a program, not PERSISTENT): the tiles of each query head in three
    loops, the masked ones (`_dkdv_tile`'s MASK 2: across the diagonal or a window's edges) around those every pair
    of which is visible (MASK 1: no mask code, ~40 % fewer instructions a tile than the loop that decides per tile);
    SPLIT = 1 issues those tiles' dPᵀ beside Sᵀ, as without a variant, 2 after Pᵀ, as the masked ones.
    WARPS_N = 2 (WIDE): the partition is two warpgroups that split every tile by columns (`wgmma_layout`): Sᵀ
    and dPᵀ by query rows, dK and dV by head dim; Pᵀ and dSᵀ, which each needs whole as the A operand, cross
    between them through shared memory in `gl.convert_layout`.
    KV_REGS (bits: 1 K, 2 V, 4 with varlen and ALiBi; never with a window): Sᵀ's and dPᵀ's A operands, the
    warpgroup's K and V, held in registers (16 a thread each at D=64), so that of their products only Q's and dO's
    tiles are read from shared memory, whose bandwidth bounds the D=64 tiles (64 x 64 x 64 products, both operands
    read per wgmma); honoured where they build without spills (below), else off."""
    (q_bufs, do_bufs, k_bufs, v_bufs, lse_bufs, delta_bufs, kv_ready, ready, empty, desc_dk, desc_dv, DK, DV,
     stride_dkn, stride_dkh, stride_dvn, stride_dvh, d_valid, dv_valid) = shared
    off_b, off_hk, start_n, lo, n_m, n_iters = place
    q_start, seqlen_q, k_start, seqlen_k = seq
    left, right = variant[0], variant[1]  # (the tiles take the rest: `_dkdv_tile`)
    # A variant's score tile takes more registers (the softcap's gradient, ALiBi's and the window's indices): its
    # dPᵀ is issued once Pᵀ is on its way to dV, so that the dPᵀ accumulator is not live while Pᵀ is computed.
    LATE_DP: gl.constexpr = HAS_WINDOW or HAS_SOFTCAP or HAS_ALIBI or HAS_DROPOUT
    LATE_DP_WHOLE: gl.constexpr = HAS_SOFTCAP or HAS_ALIBI or HAS_DROPOUT  # a tile without a mask (SPLIT == 1)
    HEAD_DIM_V: gl.constexpr = v_bufs.shape[len(v_bufs.shape) - 1]  # V's, dO's and dV's tiles (QK's: HEAD_DIM)
    s_layout: gl.constexpr = wgmma_layout(BLOCK_M, WARPS_N)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    dtype: gl.constexpr = q_bufs.dtype
    first_key = start_n + WG * ROWS  # in the sequence
    keys = first_key + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))  # (ROWS,)
    cols = gl.arange(0, BLOCK_M, layout=col_layout)  # (BLOCK_M,)
    s_zero = gl.zeros([ROWS, BLOCK_M], gl.float32, s_layout)
    dk = acc_zero(HEAD_DIM, QK_W, False, WARPS_N)
    dv = acc_zero(HEAD_DIM_V, V_W, False, WARPS_N)
    k = k_bufs.index(kv_base + WG).reshape([ROWS, HEAD_DIM])
    v = v_bufs.index(kv_base + WG).reshape([ROWS, HEAD_DIM_V])
    mbarrier.wait(kv_bar, kv_phase)
    # K (KV_REGS bit 1) and V (bit 2) in registers for dense calls without a variant (bit 4: varlen and ALiBi too,
    # whose GPU tests pass with them but which are not timed with them), in whole tiles (no column pieces), one
    # warpgroup a worker. Never with a window: a non-causal window's dK came out wrong with them on the H200 (D=64,
    # benchmarks/2026-12-07-h200/regs/pytest_regs.txt; not diagnosed). Softcap's tiles spill with them, dropout's
    # have not been timed with them.
    REGS_ON: gl.constexpr = QK_W == HEAD_DIM and V_W == HEAD_DIM_V and WARPS_N == 1 and not (
        PERSISTENT or HAS_SOFTCAP or HAS_DROPOUT or HAS_WINDOW or (not (KV_REGS & 4) and (IS_VARLEN or HAS_ALIBI)))
    tiles = (q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, a_operand(k, s_layout, REGS_ON and (KV_REGS & 1)),
             a_operand(v, s_layout, REGS_ON and (KV_REGS & 2)), s_zero)
    # (SPLIT takes dense causal calls and windows in one-item programs of 128 keys: elsewhere there is nothing to
    # split, and a varlen split is neither tested nor timed)
    SPLIT_ON: gl.constexpr = SPLIT and (IS_CAUSAL or HAS_WINDOW) and WARPS_N == 1 and not (PERSISTENT or IS_VARLEN)
    if SPLIT_ON:  # the tiles in three runs: masked (the diagonal or right edge), whole, masked (the left edge)
        _, mid, full, _ = query_blocks(start_n, seqlen_q, diag, IS_CAUSAL, BLOCK_M, 2 * ROWS, HAS_WINDOW, left, right)
        n_head = (mid - lo) // BLOCK_M
        n_mid = (full - mid) // BLOCK_M
        it = it0
        for g in range(n_iters // gl.maximum(n_m, 1)):
            for i in range(n_head):
                dk, dv = _dkdv_tile(tiles, dk, dv, it, g, lo + i * BLOCK_M, first_key, keys, cols, seqlen_q, diag,
                                    qk_scale, variant, 2, LATE_DP, IS_CAUSAL, IS_VARLEN, HEAD_DIM, NUM_STAGES,
                                    HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, WARPS_N, HAS_DROPOUT, QK_W, V_W)
                it += 1
            for i in range(n_mid):
                dk, dv = _dkdv_tile(tiles, dk, dv, it, g, mid + i * BLOCK_M, first_key, keys, cols, seqlen_q, diag,
                                    qk_scale, variant, 1, LATE_DP if SPLIT == 2 else LATE_DP_WHOLE, IS_CAUSAL,
                                    IS_VARLEN, HEAD_DIM, NUM_STAGES, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, WARPS_N,
                                    HAS_DROPOUT, QK_W, V_W)
                it += 1
            for i in range(n_m - n_head - n_mid):
                dk, dv = _dkdv_tile(tiles, dk, dv, it, g, full + i * BLOCK_M, first_key, keys, cols, seqlen_q, diag,
                                    qk_scale, variant, 2, LATE_DP, IS_CAUSAL, IS_VARLEN, HEAD_DIM, NUM_STAGES,
                                    HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, WARPS_N, HAS_DROPOUT, QK_W, V_W)
                it += 1
    else:
        for t in range(n_iters):
            g = t // n_m
            dk, dv = _dkdv_tile(tiles, dk, dv, it0 + t, g, lo + (t - g * n_m) * BLOCK_M, first_key, keys, cols,
                                seqlen_q, diag, qk_scale, variant, 0, LATE_DP, IS_CAUSAL, IS_VARLEN, HEAD_DIM,
                                NUM_STAGES, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, WARPS_N, HAS_DROPOUT, QK_W, V_W)
            if PERSISTENT:
                if (t == 0) & release[1]:
                    _release_keys(release[0])
        if PERSISTENT:
            if (n_iters == 0) & release[1]:
                _release_keys(release[0])

    dk = acc_out(dk, softmax_scale, dtype, False)
    dv = acc_out(dv, None, dtype, False)
    n_valid = seqlen_k - first_key
    if IS_VARLEN and n_valid < ROWS:  # the sequence ends in this block: a TMA store would write the next one's keys
        acc_store_rows(DK + off_hk * stride_dkh, stride_dkn, k_start + first_key, n_valid, dk, HEAD_DIM, d_valid,
                        QK_W, False, WARPS_N)
        acc_store_rows(DV + off_hk * stride_dvh, stride_dvn, k_start + first_key, n_valid, dv, HEAD_DIM_V,
                        dv_valid, V_W, False, WARPS_N)
    else:  # dense: rows past Sk are clipped
        acc_to_shared(k, dk, QK_W, False)  # the buffers are this warpgroup's alone, its last wgmma done
        acc_to_shared(v, dv, V_W, False)
        fence_async_shared()
        tma_store(desc_dk, IS_VARLEN, off_b, k_start + first_key, off_hk, k_bufs.index(kv_base + WG))
        tma_store(desc_dv, IS_VARLEN, off_b, k_start + first_key, off_hk, v_bufs.index(kv_base + WG))
        if not PERSISTENT:
            tma.store_wait(0)


@gluon.jit
def _release_keys(kv_empty):
    """The previous item's dK / dV stores have read their buffers: its K/V buffers go back to the producer."""
    tma.store_wait(0)
    mbarrier.arrive(kv_empty, count=1)


@gluon.jit
def _consumer(shared, place, seq, diag, qk_scale, softmax_scale, variant,
              WG: gl.constexpr, IS_CAUSAL: gl.constexpr, IS_VARLEN: gl.constexpr, HEAD_DIM: gl.constexpr,
              NUM_STAGES: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
              HAS_ALIBI: gl.constexpr, WARPS_N: gl.constexpr, HAS_DROPOUT: gl.constexpr = False, schedule=None,
              kv_empty=None, PERSISTENT: gl.constexpr = False, SPLIT: gl.constexpr = 0, QK_W: gl.constexpr = 0,
              V_W: gl.constexpr = 0, KV_REGS: gl.constexpr = 0):
    """dK, dV of the program's keys (`_consume_keys`). `variant`: (window left, right, softcap, the group's first
    query head's ALiBi slope pointer, dropout), None where off; dropout = (seed, offset, threshold,
    (log2(1 / (1 - p)), 1 - p), b · Hq + the group's first query head). PERSISTENT: those of every item of the
    program (`_round_item`), item j's through buffer pair j % 2 (`_producer`)."""
    kv_ready = shared[6]
    if PERSISTENT:
        KV_BLOCKS: gl.constexpr = 2 // WARPS_N
        it = 0
        j = 0
        for r in range(gl.cdiv(schedule[1], schedule[2])):
            item = _round_item(r, schedule)
            if item < schedule[1]:
                place = _item_place(item, schedule, seq[1])
                buf = j % 2
                # the variant's per-head parts for the item's (batch entry, group): the kernel made them for (0, 0)
                heads_base = place[0] * schedule[13] + place[1] * schedule[5]  # b · Hq + the group's first head
                item_variant = (variant[0], variant[1], variant[2],
                                variant[3] + place[0] * schedule[12] + place[1] * schedule[5] if HAS_ALIBI else None,
                                (variant[4][0], variant[4][1], variant[4][2], variant[4][3], heads_base)
                                if HAS_DROPOUT else variant[4])
                _consume_keys(shared, place, seq, diag, qk_scale, softmax_scale, item_variant, kv_ready.index(buf),
                              (j // 2) & 1, buf * KV_BLOCKS, it, (kv_empty.index(1 - buf), j > 0), WG, IS_CAUSAL,
                              IS_VARLEN, HEAD_DIM, NUM_STAGES, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, WARPS_N,
                              HAS_DROPOUT, True, 0, QK_W, V_W)
                it += place[5]
                j += 1
        tma.store_wait(0)
    else:
        _consume_keys(shared, place, seq, diag, qk_scale, softmax_scale, variant, kv_ready, 0, 0, 0, None, WG,
                      IS_CAUSAL, IS_VARLEN, HEAD_DIM, NUM_STAGES, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, WARPS_N,
                      HAS_DROPOUT, False, SPLIT, QK_W, V_W, KV_REGS)


@gluon.jit(do_not_specialize=["window_left", "window_right", "stride_alibi_b", "stride_dkn", "stride_dkh",
                              "stride_dvn", "stride_dvh", "HEADS_Q", "BATCH", "GROUP_SIZE", "SEQLEN_Q", "SEQLEN_K",
                              "SEQLEN_PAD", "dropout_threshold"], do_not_specialize_on_alignment=["ALIBI"])
def _attn_bwd_dkdv_gluon(
    desc_q, desc_k, desc_v, desc_do, desc_dk, desc_dv, desc_lse, desc_delta, DK, DV, CU_SEQLENS_Q,
    CU_SEQLENS_K, WORK, softmax_scale, qk_scale,
    window_left, window_right, softcap,  # the variant's scalars (`Variant.scalars`), None where off
    ALIBI, stride_alibi_b,  # fp32 slopes (B or 1, Hq) and their batch stride, None without ALiBi
    DROPOUT_RNG, dropout_threshold, dropout_scale,  # `Variant.dropout_args`, None without dropout
    stride_dkn, stride_dkh, stride_dvn, stride_dvh,
    HEADS_Q, BATCH, GROUP_SIZE, SEQLEN_Q, SEQLEN_K, SEQLEN_PAD,
    IS_CAUSAL: gl.constexpr, CAUSAL_BOTTOM_RIGHT: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
    HAS_ALIBI: gl.constexpr, IS_VARLEN: gl.constexpr, HEAD_DIM: gl.constexpr, D_VALID: gl.constexpr,
    NUM_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, WORK_TABLE: gl.constexpr, DV_VALID: gl.constexpr = 0,
    HAS_DROPOUT: gl.constexpr = False, PERSISTENT: gl.constexpr = False, SPLIT: gl.constexpr = 0,
    QK_WIDTH: gl.constexpr = 0, V_WIDTH: gl.constexpr = 0, KV_REGS: gl.constexpr = 0,
):
    """Grid (cdiv(Sk, PROGRAM_KEYS), Hkv, B) (varlen: Sk the longest sequence's; PROGRAM_KEYS = `dkdv_keys`);
    varlen with WORK_TABLE: one program per row of WORK (`work_table`: only the (sequence, head, key block)s that
    exist, in the table's order). PERSISTENT (dense, 128 keys a program): a grid of (programs,), each program taking
    one item (key block, kv head, batch entry) per round (`_round_item`, `_item_place`), with two K/V buffer pairs,
    so that an item's K/V loads and first Q / dO tiles and the previous item's dK / dV stores overlap the tiles of
    the item before (`_producer`, `_consumer`). num_warps=4: the producer; two consumer warpgroups as workers, each
    with its 64 keys, or at WIDE_HEAD_DIM one worker of two warpgroups sharing 64 keys. Causal: the second
    warpgroup's first query tile lies wholly before its keys (P = 0); it is computed anyway: skipping it cost
    registers (spills) and 12-15 % (explore11/run_04538af9a0df)."""
    PROGRAM_KEYS: gl.constexpr = dkdv_keys(HEAD_DIM)
    WIDE: gl.constexpr = PROGRAM_KEYS == ROWS
    gl.static_assert(not PERSISTENT or not (IS_VARLEN or WIDE), "PERSISTENT: dense, 128 keys a program")
    if PERSISTENT:  # the first item's place (the partitions work out each item's: `_item_place`)
        start_n = gl.program_id(0) * 0
        off_hk = start_n
        off_b = start_n
        seq = sequence(off_b, CU_SEQLENS_Q, CU_SEQLENS_K, gl.to_tensor(SEQLEN_Q), gl.to_tensor(SEQLEN_K), False)
    elif IS_VARLEN and WORK_TABLE:
        off_b, off_hk, start_n, seq = work_item(WORK)
        if off_b < 0:  # the table's padding past its last item
            return
    else:
        start_n = gl.program_id(0) * PROGRAM_KEYS  # causal: the first keys see the most queries and start first
        off_hk = gl.program_id(1)
        off_b = gl.program_id(2)
        seq = sequence(off_b, CU_SEQLENS_Q, CU_SEQLENS_K, gl.to_tensor(SEQLEN_Q), gl.to_tensor(SEQLEN_K),
                       IS_VARLEN)
    q_start, seqlen_q, k_start, seqlen_k = seq
    diag = diagonal(seqlen_q, seqlen_k, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, HAS_WINDOW or HAS_ALIBI)
    lo, n_m = _query_tiles(start_n, seqlen_q, diag, window_left, window_right, IS_CAUSAL, HAS_WINDOW, PROGRAM_KEYS)
    if IS_VARLEN:
        if start_n >= seqlen_k:  # keys past a shorter sequence's end: nothing to do (no K/V load, no barrier)
            return

    dtype: gl.constexpr = desc_q.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + desc_q.block_type.shape, desc_q.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + desc_do.block_type.shape, desc_do.layout)
    KV_BUFS: gl.constexpr = (2 if PERSISTENT else 1) * (PROGRAM_KEYS // ROWS)  # PERSISTENT: two pairs, item j's j % 2
    k_bufs = gl.allocate_shared_memory(dtype, [KV_BUFS] + desc_k.block_type.shape, desc_k.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [KV_BUFS] + desc_v.block_type.shape, desc_v.layout)
    lse_bufs = gl.allocate_shared_memory(gl.float32, [NUM_STAGES] + desc_lse.block_type.shape, desc_lse.layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [NUM_STAGES] + desc_delta.block_type.shape,
                                           desc_delta.layout)
    if PERSISTENT:  # per K/V buffer pair: loaded (kv_ready), and released by both consumers (kv_empty)
        kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(kv_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)
    else:
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        kv_empty = None
        mbarrier.init(kv_ready, count=1)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1 if WIDE else 2)  # one arrive per consumer partition
    fence_async_shared()

    # Worker partitions take tensors, not Python numbers: gl.to_tensor.
    group_size = gl.to_tensor(GROUP_SIZE)
    place = (gl.to_tensor(off_b), gl.to_tensor(off_hk), gl.to_tensor(start_n), lo, n_m, n_m * group_size)
    producer_args = (desc_q, desc_do, desc_k, desc_v, desc_lse, desc_delta, q_bufs, do_bufs, k_bufs, v_bufs,
                     lse_bufs, delta_bufs, kv_ready, ready, empty)
    consumer_args = (q_bufs, do_bufs, k_bufs, v_bufs, lse_bufs, delta_bufs, kv_ready, ready, empty, desc_dk, desc_dv,
                     DK, DV, gl.to_tensor(stride_dkn), gl.to_tensor(stride_dkh), gl.to_tensor(stride_dvn),
                     gl.to_tensor(stride_dvh), gl.to_tensor(D_VALID), gl.to_tensor(DV_VALID if DV_VALID else D_VALID))
    QK_W: gl.constexpr = tile_width(QK_WIDTH, HEAD_DIM)  # the products' widths (`gluon_common.mma_nt`)
    V_W: gl.constexpr = tile_width(V_WIDTH, desc_v.block_type.shape[len(desc_v.block_type.shape) - 1])
    scales = (diag, gl.to_tensor(qk_scale), gl.to_tensor(softmax_scale))
    # The variant's scalars as the consumers take them: tensors where the variant has them, else None (constexprs).
    if HAS_DROPOUT:
        dropout = dropout_scalars(DROPOUT_RNG, dropout_threshold, dropout_scale, off_b * HEADS_Q + off_hk * group_size)
    else:
        dropout = gl.constexpr(0)  # (off: what stands for it; a variable cannot hold None)
    variant = (gl.to_tensor(window_left) if HAS_WINDOW else None, gl.to_tensor(window_right) if HAS_WINDOW else None,
               gl.to_tensor(softcap) if HAS_SOFTCAP else None,
               ALIBI + off_b * stride_alibi_b + off_hk * group_size if HAS_ALIBI else None,  # the group's first head
               dropout)
    heads_pad = (gl.to_tensor(HEADS_Q), gl.to_tensor(SEQLEN_PAD))
    if WIDE:
        gl.warp_specialize([
            (_producer, (producer_args, place, seq, group_size, heads_pad[0], heads_pad[1], IS_VARLEN, NUM_STAGES,
                         gl.constexpr(1))),
            (_consumer, (consumer_args, place, seq, scales[0], scales[1], scales[2], variant, gl.constexpr(0),
                         IS_CAUSAL, IS_VARLEN, HEAD_DIM, NUM_STAGES, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI,
                         gl.constexpr(2), HAS_DROPOUT, None, None, False, 0, QK_W, V_W)),
        ], [8], [CONSUMER_REGS])
    elif PERSISTENT:
        schedule = (gl.program_id(0), gl.cdiv(SEQLEN_K, PROGRAM_KEYS) * (HEADS_Q // GROUP_SIZE) * BATCH,
                    gl.num_programs(0), gl.to_tensor(gl.cdiv(SEQLEN_K, PROGRAM_KEYS)),
                    gl.to_tensor(HEADS_Q // GROUP_SIZE), group_size, diag,
                    variant[0] if HAS_WINDOW else gl.constexpr(0), variant[1] if HAS_WINDOW else gl.constexpr(0),
                    IS_CAUSAL, HAS_WINDOW, PROGRAM_KEYS,  # (0 for what the variant lacks: no None in it)
                    gl.to_tensor(stride_alibi_b) if HAS_ALIBI else gl.constexpr(0), gl.to_tensor(HEADS_Q))
        gl.warp_specialize([
            (_producer, (producer_args, place, seq, group_size, heads_pad[0], heads_pad[1], IS_VARLEN, NUM_STAGES,
                         gl.constexpr(2), schedule, kv_empty, True)),
            (_consumer, (consumer_args, place, seq, scales[0], scales[1], scales[2], variant, gl.constexpr(0),
                         IS_CAUSAL, IS_VARLEN, HEAD_DIM, NUM_STAGES, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI,
                         gl.constexpr(1), HAS_DROPOUT, schedule, kv_empty, True, 0, QK_W, V_W)),
            (_consumer, (consumer_args, place, seq, scales[0], scales[1], scales[2], variant, gl.constexpr(1),
                         IS_CAUSAL, IS_VARLEN, HEAD_DIM, NUM_STAGES, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI,
                         gl.constexpr(1), HAS_DROPOUT, schedule, kv_empty, True, 0, QK_W, V_W)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
    else:
        gl.warp_specialize([
            (_producer, (producer_args, place, seq, group_size, heads_pad[0], heads_pad[1], IS_VARLEN, NUM_STAGES,
                         gl.constexpr(2))),
            (_consumer, (consumer_args, place, seq, scales[0], scales[1], scales[2], variant, gl.constexpr(0),
                         IS_CAUSAL, IS_VARLEN, HEAD_DIM, NUM_STAGES, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI,
                         gl.constexpr(1), HAS_DROPOUT, None, None, False, SPLIT, QK_W, V_W, KV_REGS)),
            (_consumer, (consumer_args, place, seq, scales[0], scales[1], scales[2], variant, gl.constexpr(1),
                         IS_CAUSAL, IS_VARLEN, HEAD_DIM, NUM_STAGES, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI,
                         gl.constexpr(1), HAS_DROPOUT, None, None, False, SPLIT, QK_W, V_W, KV_REGS)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
