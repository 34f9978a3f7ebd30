"""Hopper backward in Gluon, the device side: dK/dV and dQ, each with a TMA producer and two consumer warpgroups
(FlashAttention-3's layout, with dQ in a kernel of its own instead of accumulated: no atomics, deterministic). Their
host side (launch plans, the padded lse / delta sizes, the varlen work table, the launchers) is
`backward_gluon_launch`.

dK/dV (`_attn_bwd_dkdv_gluon`): a program owns 128 keys of one (batch, kv head): K and V stay in shared memory,
each consumer warpgroup keeps the fp32 dK, dV of its 64 keys in registers. The producer streams 64-row tiles of
Q, dO and their rows' log-sum-exp and delta (for every query head of the GQA group) through a ring of NUM_STAGES
stages. Per tile a warpgroup computes, on transposed scores (keys x queries, so no tile is ever transposed in
registers):
    Sᵀ = K Qᵀ      Pᵀ = exp2(Sᵀ · qk_scale − lse · log2 e)      dV += Pᵀ dO
    dPᵀ = V dOᵀ    dSᵀ = Pᵀ ∘ (dPᵀ − delta)                      dK += dSᵀ Q
with Sᵀ and dPᵀ issued together as asynchronous wgmmas and Pᵀ / dSᵀ fed to the next wgmma from registers.
The other warpgroup's matmuls run while one computes its exponentials. dK (times the softmax scale) and dV
leave through the K/V buffers and TMA stores that clip rows past the keys.

dQ (`_attn_bwd_dq_gluon`): a program owns 128 query rows (Q, dO, lse, delta resident; 64 rows per consumer) and
streams K/V tiles of BLOCK_N keys: S = Q Kᵀ and dP = dO Vᵀ as asynchronous wgmmas, dS = P ∘ (dP − delta),
dQ += dS K with dS from registers; the result leaves through the Q buffer and a TMA store.

lse and delta come padded (`backward_gluon_launch.padded_rows`): dense (B, Hq, Sq_pad) fp32 with Sq_pad a multiple
of 128, lse = −inf and delta = 0 on rows past Sq, so every tile loads whole and rows past the queries (zero-filled
by TMA) give P = 0. Rows that see no key (lse = −inf) get P = 0 too. Causal (bottom-right, or top-left): a dK/dV
program's query tiles start at the first row that sees its first key, a dQ program's keys end at its last row's
diagonal; only tiles that cross a diagonal pay for the mask.
Varlen (packed (total, H, D) tensors, cu_seqlens): rank-3 descriptors, whose rows past a sequence belong to the
next one, so P is masked there; lse / delta (Hq, `padded_rows`) with each sequence at a 16-byte aligned row
(`_lse_rows`; a 1-d TMA copy from an unaligned row faults), written there by the preprocess and loaded by TMA, the
rows between sequences masked (never written); programs past a sequence's end return at once; whole 64-row blocks of
results leave by TMA store, a sequence's last partial block row by row (a TMA store would write the next one's rows).
Causal: the dQ kernel's first warpgroup skips the key tile it sees nothing of (the dK/dV kernel computes its wholly
masked tile: skipping it there cost spills and 12-15 %).
Variants (`Variant.score_constexprs`: HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, with their scalars; None arguments where
off, so that a kernel without them compiles as it would without the code): a window's dK/dV program streams only the
query tiles of `variant.query_blocks` for its 128 keys, a dQ program only the key tiles of `variant.key_blocks` for
its 128 rows (and skips a warpgroup's tile of no visible pair, `tile_hidden`); tiles on the band's edges are masked
(`key_tile_masked` / `tile_masked`, `visible`), or, where the config says SPLIT, the dK/dV tiles run in three loops,
the masked ones around those every pair of which is visible, which carry no mask code (`_consume_keys`; the dQ
kernel likewise under its own SPLIT, `_dq_consumer`). Softcap: the
capped scores and 1 − tanh², which multiplies dS (`softcap_scores_and_grad`; folded into P once dV has its copy);
ALiBi: `alibi_bias` before exp2, the slopes (B or 1, Hq) fp32. The dK/dV consumers issue a variant tile's dPᵀ after
its Pᵀ (fewer live registers: `_consume_keys`). Sinks need nothing here: lse includes them, and their gradient comes
from the preprocess (`backward.preprocess`).
The preprocess' work in the dQ kernel (FUSED_DELTA, dense calls without a sink: `_fused_delta`): each dQ warpgroup
works out its rows' delta from O and dO and writes them, with its lse, into the padded buffers, so that a dense
backward is two launches, dQ then dK/dV, instead of three.
Dropout (HAS_DROPOUT, the forward's keep-mask Z regenerated: `gluon_common.dropout_keep` / `dropout_keep_t`, bit
for bit `variant.dropout_keep`): dV += (Pᵀ ∘ Zᵀ / (1 − p)) dO and dSᵀ = Pᵀ ∘ (dPᵀ ∘ Zᵀ / (1 − p) − delta), dS
likewise.
Persistent dK/dV (PERSISTENT, a config constexpr off in the dispatch: `_attn_bwd_dkdv_gluon`): one program per SM
taking an item per round, two K/V buffer pairs.
Head dims: Q and K in tiles of 64, 128 or 256 columns (HEAD_DIM: `gluon_common.head_block` of D); V, dO and dV in
tiles of V's own width, read from the V descriptor (HEAD_DIM_V; a pair such as DeepSeek's MLA, QK 192 / V 128, runs
V's matmuls at 128 columns: `backward_gluon_launch.separate_v_ok` says which pairs). Products over the head dim run on
the head's own columns (QK_WIDTH, V_WIDTH: `gluon_common.mma_nt`); where such a width is two pieces of at least 64
columns (D=192 in 256-column tiles: 128 + 64), a gradient may live in two accumulators over them, so that its product
skips the zero columns too (DQ_SPLIT, DK_SPLIT, DV_SPLIT: `_acc_zero`, `backward_gluon_launch.acc_splits`).
fp16/bf16; sm_90.
`backward.attention_backward` launches these (`backward_gluon_launch.launch_dkdv_gluon` / `launch_dq_gluon`) where
`configs.gluon_bwd_config` says.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .gluon_common import (dropout_keep, dropout_keep_t, mma_nt, sequence, tma_load, tma_store, wgmma_layout,
                           width_piece, width_pieces)
from .variant import dropout_state
from .variant import (alibi_bias, diagonal, key_blocks, key_end_before, key_tile_masked, query_blocks, query_first,
                      softcap_scores_and_grad, tile_hidden, tile_masked, visible)

ROWS = gl.constexpr(64)  # keys per consumer warpgroup (wgmma's M); a program holds 2 * ROWS keys
BLOCK_M = gl.constexpr(64)  # query rows per streamed tile
KEYS = gl.constexpr(2 * 64)  # keys per program
WIDE_HEAD_DIM = gl.constexpr(256)  # dK/dV tiles this wide: 64 keys a program, split by columns (`dkdv_keys`)


@gluon.constexpr_function
def dkdv_keys(head_dim):
    """Keys per dK/dV program: 128 (two warpgroups of 64, each holding its keys' dK and dV whole), or 64 at
    WIDE_HEAD_DIM, where one key's fp32 dK and dV take 512 of a warpgroup's registers: two warpgroups then share
    64 keys, each holding half of the columns (`_consumer`, WARPS_N = 2)."""
    return 64 if head_dim >= WIDE_HEAD_DIM else 128


@gluon.constexpr_function
def _width(width, tile):
    """The width of a product over a head dim in `tile`-column tiles (`gluon_common.mma_nt`): QK_WIDTH / V_WIDTH
    (the head's own columns, `gluon_common.product_width`), or where that is 0 the tiles' whole."""
    return width or tile


@gluon.jit
def _lse_base2(lse):
    """lse in base 2 for exp2(s · qk_scale − lse); rows that see no key (−inf) get +inf, so that their P is 0."""
    return gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)


@gluon.jit
def _probabilities(s, lse, q_idx, k_idx, diag, qk_scale, softcap, slope, HAS_SOFTCAP: gl.constexpr,
                   HAS_ALIBI: gl.constexpr):
    """(P, d(capped score) / d(scaled score)) of a tile of raw scores `s` = Q Kᵀ (or its transpose), `lse` the
    rows' base-2 log-sum-exp broadcast against it and q_idx / k_idx its query / key indices: the variant's score
    changes (`variant.softcap_scores_and_grad`: the second value, by which dS is multiplied, is 1 without
    softcap; `variant.alibi_bias` with `slope` in base 2) before exp2."""
    cap_grad = 1.0
    if HAS_SOFTCAP:
        s, cap_grad = softcap_scores_and_grad(s, qk_scale, softcap, True)
    else:
        s = s * qk_scale
    if HAS_ALIBI:
        s = s + alibi_bias(q_idx, k_idx, diag, slope)
    return gl.exp2(s - lse), cap_grad


@gluon.jit
def _lse_rows(off_b, off_h, heads_q, seqlen_pad, q_start, IS_VARLEN: gl.constexpr):
    """Where the padded lse / delta of (sequence / batch entry off_b, query head off_h) start. Dense (B, Hq, Sq_pad):
    (off_b · Hq + off_h) · Sq_pad. Varlen (Hq, `padded_rows`): sequence b starts at 4 · (ceil(q_start / 4) + b),
    16-byte aligned so that its tiles can come by TMA, and at least its length past sequence b − 1's start (the
    preprocess writes this layout: `backward._attn_bwd_preprocess`). int32, as TMA coordinates are: the launcher
    keeps the buffers under 2**31 values."""
    if IS_VARLEN:
        return off_h * seqlen_pad + ((q_start + 3) // 4 + off_b) * 4
    else:
        return (off_b * heads_q + off_h) * seqlen_pad


@gluon.jit
def _work_item(WORK):
    """A varlen program's row of the work table (`work_table`): (sequence b or −1 for a padding row, head, first
    key / query row of its 128, (q_start, seqlen_q, k_start, seqlen_k)), one round trip for all of them."""
    row = WORK + gl.program_id(0) * 8
    seq = (gl.load(row + 3), gl.load(row + 4), gl.load(row + 5), gl.load(row + 6))
    return gl.load(row), gl.load(row + 1), gl.load(row + 2), seq


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
def _store_rows(base, stride_n, first, n_valid, vals, layout: gl.constexpr, HEAD_DIM: gl.constexpr, d_valid):
    """Varlen epilogue: rows first + i (i < n_valid) of a packed (total, H, D) tensor, from registers; `base`
    points at (token 0, this head). A TMA store would also write the rows past the sequence, the next one's.
    Columns from d_valid (the head's own D, below the tiles' HEAD_DIM) are not the head's: not stored."""
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    ptrs = base + (first + rows)[:, None].to(gl.int64) * stride_n + cols[None, :]
    gl.store(ptrs, vals, mask=(rows < n_valid)[:, None] & (cols < d_valid)[None, :])


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
        row = _lse_rows(off_b, off_h, heads_q, seqlen_pad, q_start, IS_VARLEN) + m  # in the flattened lse / delta
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
               V_W: gl.constexpr, DK_SPLIT: gl.constexpr = False, DV_SPLIT: gl.constexpr = False):
    """One streamed tile (query head g, rows [m, m + BLOCK_M), ring slot `it`) into a warpgroup's dK, dV (returned).
    `tiles`: (Q, dO, lse, delta buffers, ready, empty, K, V, a zero score tile). QK_W, V_W: the widths of Sᵀ's and
    dPᵀ's products (`gluon_common.mma_nt`); DK_SPLIT, DV_SPLIT: dK over QK_W's pieces and dV over V_W's, each in two
    accumulators (`_acc_zero`). MASK: 0 masks the tile where it
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
    lse = _lse_base2(lse)
    slope = gl.load(slopes + g) * 1.4426950408889634 if HAS_ALIBI else None  # query head g's, in base 2
    if LATE_DP:
        s = warpgroup_mma_wait(0, deps=(s_tok, ))
        p, cap_grad = _probabilities(s, lse[None, :], (m + cols)[None, :], keys[:, None], diag, qk_scale, softcap,
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
        keep = dropout_keep_t(dropout[0], dropout[1], dropout[4] + g, first_key, m, dropout[2], BLOCK_M, s_layout)
        p_op = _acc_operands(gl.where(keep, p * dropout[3], 0.0).to(dtype), HEAD_DIM_V, V_W, DV_SPLIT, WARPS_N)
    else:
        p_op = _acc_operands(p.to(dtype), HEAD_DIM_V, V_W, DV_SPLIT, WARPS_N)
    if HAS_SOFTCAP:  # dSᵀ's factor folded into Pᵀ once dV has its copy: one score tile fewer stays live
        p = p * cap_grad
    dv_tok = _acc_mma(p_op, do, dv, V_W, DV_SPLIT)
    if LATE_DP:
        dp_tok = mma_nt(v, do, s_zero, V_W)  # dPᵀ
    delta = delta_bufs.index(stage).load(col_layout)
    if IS_VARLEN:  # P is 0 there, but 0 · NaN is not
        delta = gl.where(in_seq, delta, 0.0)
    dp = warpgroup_mma_wait(0 if LATE_DP else (2 if DV_SPLIT else 1), deps=(dp_tok, ))  # (dV's may still run)
    if HAS_DROPOUT:
        dp = gl.where(keep, dp * dropout[3], 0.0)
    ds = p * (dp - delta[None, :])  # dSᵀ
    ds_op = _acc_operands(ds.to(dtype), HEAD_DIM, QK_W, DK_SPLIT, WARPS_N)
    dk_tok = _acc_mma(ds_op, q, dk, QK_W, DK_SPLIT)
    dv, dk = _acc_wait_both(dv_tok, p_op, dk_tok, ds_op, DV_SPLIT, DK_SPLIT)
    mbarrier.arrive(empty.index(stage), count=1)
    return dk, dv


@gluon.jit
def _consume_keys(shared, place, seq, diag, qk_scale, softmax_scale, variant, kv_bar, kv_phase, kv_base, it0,
                  release, WG: gl.constexpr, IS_CAUSAL: gl.constexpr, IS_VARLEN: gl.constexpr,
                  HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr, HAS_WINDOW: gl.constexpr,
                  HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, WARPS_N: gl.constexpr,
                  HAS_DROPOUT: gl.constexpr, PERSISTENT: gl.constexpr, SPLIT: gl.constexpr = 0,
                  QK_W: gl.constexpr = 0, V_W: gl.constexpr = 0, DK_SPLIT: gl.constexpr = False,
                  DV_SPLIT: gl.constexpr = False):
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
    between them through shared memory in `gl.convert_layout`. DK_SPLIT, DV_SPLIT: dK, dV in two accumulators each
    (`_acc_zero`: at D=192 in 256-column tiles, 128 + 64 columns), so that their products skip the zero columns."""
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
    dk = _acc_zero(HEAD_DIM, QK_W, DK_SPLIT, WARPS_N)
    dv = _acc_zero(HEAD_DIM_V, V_W, DV_SPLIT, WARPS_N)
    k = k_bufs.index(kv_base + WG).reshape([ROWS, HEAD_DIM])
    v = v_bufs.index(kv_base + WG).reshape([ROWS, HEAD_DIM_V])
    mbarrier.wait(kv_bar, kv_phase)
    tiles = (q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, k, v, s_zero)
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
                                    HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, WARPS_N, HAS_DROPOUT, QK_W, V_W,
                                    DK_SPLIT, DV_SPLIT)
                it += 1
            for i in range(n_mid):
                dk, dv = _dkdv_tile(tiles, dk, dv, it, g, mid + i * BLOCK_M, first_key, keys, cols, seqlen_q, diag,
                                    qk_scale, variant, 1, LATE_DP if SPLIT == 2 else LATE_DP_WHOLE, IS_CAUSAL,
                                    IS_VARLEN, HEAD_DIM, NUM_STAGES, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, WARPS_N,
                                    HAS_DROPOUT, QK_W, V_W, DK_SPLIT, DV_SPLIT)
                it += 1
            for i in range(n_m - n_head - n_mid):
                dk, dv = _dkdv_tile(tiles, dk, dv, it, g, full + i * BLOCK_M, first_key, keys, cols, seqlen_q, diag,
                                    qk_scale, variant, 2, LATE_DP, IS_CAUSAL, IS_VARLEN, HEAD_DIM, NUM_STAGES,
                                    HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, WARPS_N, HAS_DROPOUT, QK_W, V_W,
                                    DK_SPLIT, DV_SPLIT)
                it += 1
    else:
        for t in range(n_iters):
            g = t // n_m
            dk, dv = _dkdv_tile(tiles, dk, dv, it0 + t, g, lo + (t - g * n_m) * BLOCK_M, first_key, keys, cols,
                                seqlen_q, diag, qk_scale, variant, 0, LATE_DP, IS_CAUSAL, IS_VARLEN, HEAD_DIM,
                                NUM_STAGES, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, WARPS_N, HAS_DROPOUT, QK_W, V_W,
                                    DK_SPLIT, DV_SPLIT)
            if PERSISTENT:
                if (t == 0) & release[1]:
                    _release_keys(release[0])
        if PERSISTENT:
            if (n_iters == 0) & release[1]:
                _release_keys(release[0])

    dk = _acc_out(dk, softmax_scale, dtype, DK_SPLIT)
    dv = _acc_out(dv, None, dtype, DV_SPLIT)
    n_valid = seqlen_k - first_key
    if IS_VARLEN and n_valid < ROWS:  # the sequence ends in this block: a TMA store would write the next one's keys
        _acc_store_rows(DK + off_hk * stride_dkh, stride_dkn, k_start + first_key, n_valid, dk, HEAD_DIM, d_valid,
                        QK_W, DK_SPLIT, WARPS_N)
        _acc_store_rows(DV + off_hk * stride_dvh, stride_dvn, k_start + first_key, n_valid, dv, HEAD_DIM_V,
                        dv_valid, V_W, DV_SPLIT, WARPS_N)
    else:  # dense: rows past Sk are clipped
        _acc_to_shared(k, dk, QK_W, DK_SPLIT)  # the buffers are this warpgroup's alone, its last wgmma done
        _acc_to_shared(v, dv, V_W, DV_SPLIT)
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
              V_W: gl.constexpr = 0, DK_SPLIT: gl.constexpr = False, DV_SPLIT: gl.constexpr = False):
    """dK, dV of the program's keys (`_consume_keys`). `variant`: (window left, right, softcap, the group's first
    query head's ALiBi slope pointer, dropout), None where off; dropout = (seed, offset, threshold, 1 / (1 - p),
    b · Hq + the group's first query head). PERSISTENT: those of every item of the program (`_round_item`), item j's
    through buffer pair j % 2 (`_producer`)."""
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
                              HAS_DROPOUT, True, 0, QK_W, V_W, DK_SPLIT, DV_SPLIT)
                it += place[5]
                j += 1
        tma.store_wait(0)
    else:
        _consume_keys(shared, place, seq, diag, qk_scale, softmax_scale, variant, kv_ready, 0, 0, 0, None, WG,
                      IS_CAUSAL, IS_VARLEN, HEAD_DIM, NUM_STAGES, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, WARPS_N,
                      HAS_DROPOUT, False, SPLIT, QK_W, V_W, DK_SPLIT, DV_SPLIT)


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
    QK_WIDTH: gl.constexpr = 0, V_WIDTH: gl.constexpr = 0, DK_SPLIT: gl.constexpr = False,
    DV_SPLIT: gl.constexpr = False,
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
        off_b, off_hk, start_n, seq = _work_item(WORK)
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
    QK_W: gl.constexpr = _width(QK_WIDTH, HEAD_DIM)  # the products' widths (`gluon_common.mma_nt`)
    V_W: gl.constexpr = _width(V_WIDTH, desc_v.block_type.shape[len(desc_v.block_type.shape) - 1])
    scales = (diag, gl.to_tensor(qk_scale), gl.to_tensor(softmax_scale))
    # The variant's scalars as the consumers take them: tensors where the variant has them, else None (constexprs).
    if HAS_DROPOUT:
        seed, offset = dropout_state(DROPOUT_RNG)
        dropout = (seed, offset, gl.to_tensor(dropout_threshold), gl.to_tensor(dropout_scale),
                   off_b * HEADS_Q + off_hk * group_size)
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
                         gl.constexpr(2), HAS_DROPOUT, None, None, False, 0, QK_W, V_W, DK_SPLIT,
                         DV_SPLIT)),
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
                         gl.constexpr(1), HAS_DROPOUT, schedule, kv_empty, True, 0, QK_W, V_W, DK_SPLIT,
                         DV_SPLIT)),
            (_consumer, (consumer_args, place, seq, scales[0], scales[1], scales[2], variant, gl.constexpr(1),
                         IS_CAUSAL, IS_VARLEN, HEAD_DIM, NUM_STAGES, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI,
                         gl.constexpr(1), HAS_DROPOUT, schedule, kv_empty, True, 0, QK_W, V_W, DK_SPLIT,
                         DV_SPLIT)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
    else:
        gl.warp_specialize([
            (_producer, (producer_args, place, seq, group_size, heads_pad[0], heads_pad[1], IS_VARLEN, NUM_STAGES,
                         gl.constexpr(2))),
            (_consumer, (consumer_args, place, seq, scales[0], scales[1], scales[2], variant, gl.constexpr(0),
                         IS_CAUSAL, IS_VARLEN, HEAD_DIM, NUM_STAGES, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI,
                         gl.constexpr(1), HAS_DROPOUT, None, None, False, SPLIT, QK_W, V_W, DK_SPLIT,
                         DV_SPLIT)),
            (_consumer, (consumer_args, place, seq, scales[0], scales[1], scales[2], variant, gl.constexpr(1),
                         IS_CAUSAL, IS_VARLEN, HEAD_DIM, NUM_STAGES, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI,
                         gl.constexpr(1), HAS_DROPOUT, None, None, False, SPLIT, QK_W, V_W, DK_SPLIT,
                         DV_SPLIT)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


@gluon.jit
def _dq_producer(shared, place, seq, IS_VARLEN: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Q and dO of the program's rows once (one 64-row block per consumer), then its K/V tiles (from key key_lo) into
    the ring, tile j into stage j % NUM_STAGES once both consumers released the tile it held."""
    (desc_q, desc_do, desc_k, desc_v, q_bufs, do_bufs, k_bufs, v_bufs, q_ready, kv_ready, kv_empty) = shared
    off_b, off_h, off_hk, start_m, n_tiles, key_lo = place
    q_start, seqlen_q, k_start, seqlen_k = seq
    BLOCK_N: gl.constexpr = desc_k.block_type.shape[len(desc_k.block_type.shape) - 3]
    mbarrier.expect(q_ready, 2 * (desc_q.block_type.nbytes + desc_do.block_type.nbytes))
    for w in gl.static_range(2):
        tma_load(desc_q, IS_VARLEN, off_b, q_start + start_m + w * ROWS, off_h, q_ready, q_bufs.index(w))
        tma_load(desc_do, IS_VARLEN, off_b, q_start + start_m + w * ROWS, off_h, q_ready, do_bufs.index(w))
    for j in range(n_tiles):
        stage = j % NUM_STAGES
        mbarrier.wait(kv_empty.index(stage), ((j // NUM_STAGES) & 1) ^ 1, pred=j >= NUM_STAGES)
        mbarrier.expect(kv_ready.index(stage), desc_k.block_type.nbytes + desc_v.block_type.nbytes)
        n = key_lo + j * BLOCK_N
        tma_load(desc_k, IS_VARLEN, off_b, k_start + n, off_hk, kv_ready.index(stage), k_bufs.index(stage))
        tma_load(desc_v, IS_VARLEN, off_b, k_start + n, off_hk, kv_ready.index(stage), v_bufs.index(stage))


# FUSED_DELTA's bits (the dQ kernel's constexpr): the preprocess' work is the kernel's (FD_ON), with the gradient of
# lse subtracted from delta (FD_DLSE), with the sink's gradient's parts written (FD_SINK)
FD_ON, FD_DLSE, FD_SINK = gl.constexpr(1), gl.constexpr(2), gl.constexpr(4)


@gluon.jit
def _fused_delta(fused, do_buf, q_ready, rows, seqlen_q, lse_ptr, delta_ptr, WG: gl.constexpr,
                 s_layout: gl.constexpr, FUSED_DELTA: gl.constexpr, DV_OUT: gl.constexpr):
    """A dQ warpgroup's rows' (lse, delta) where the preprocess' work is the dQ kernel's (dense): delta = rowsum(dO ∘
    O) in fp32 over O's DV_OUT columns, minus dlse (FD_DLSE) where lse is finite, as `backward._attn_bwd_preprocess`
    works them out; both stored into the padded lse_ptr / delta_ptr for the dK/dV kernel, rows past Sq as -inf / 0.
    FD_SINK: the warpgroup's share of the sink's gradient, −Σ exp(sink − lse) · delta over its rows (0 where lse is
    -inf), into part_ptr[WG] (the host sums the parts in a fixed order, as the preprocess' ones).
    `fused`: (O at this (batch, head), O's row stride (O's strides are specialized on their alignment, and DV_OUT
    is a constexpr, so that a row's loads are 16 bytes wide: else 2), lse there, dlse there or None, dlse's row
    stride, the head's sink or None, this program's two parts or None); do_buf: this warpgroup's dO tile, landed
    once q_ready says so: O, lse, dlse and the sink are loaded before that wait, so that their latency and the
    TMA's overlap (loaded after it, each program pays their latency again, which costs as much as the preprocess
    kernel: benchmarks/2026-12-04-h200/gluon-bwd-ab/fused_delta_scalar_loads.json)."""
    o_ptr, stride_om, lse_in, dlse_ptr, stride_dm, sink_ptr, part_ptr = fused
    DV: gl.constexpr = do_buf.shape[len(do_buf.shape) - 1]
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # 16-byte loads along a row
    o_rows = rows.to(gl.int64)
    in_seq = rows < seqlen_q
    t_rows = gl.convert_layout(rows, gl.SliceLayout(1, layout))
    t_cols = gl.arange(0, DV, layout=gl.SliceLayout(0, layout))
    mask = (t_rows < seqlen_q)[:, None] & (t_cols < DV_OUT)[None, :]
    o = gl.load(o_ptr + t_rows.to(gl.int64)[:, None] * stride_om + t_cols[None, :], mask=mask, other=0.0)
    lse = gl.load(lse_in + o_rows, mask=in_seq, other=float("-inf"))
    if FUSED_DELTA & FD_DLSE:
        dlse = gl.load(dlse_ptr + o_rows * stride_dm, mask=in_seq, other=0.0)
    if FUSED_DELTA & FD_SINK:
        sink = gl.load(sink_ptr).to(gl.float32)
    mbarrier.wait(q_ready, 0)
    do = do_buf.reshape([ROWS, DV]).load(layout)  # (columns past Dv and rows past Sq: 0, as the TMA filled them)
    delta = gl.convert_layout(gl.sum(o.to(gl.float32) * do.to(gl.float32), 1), gl.SliceLayout(1, s_layout))
    if FUSED_DELTA & FD_DLSE:
        delta -= gl.where(lse == float("-inf"), 0.0, dlse)
    if FUSED_DELTA & FD_SINK:
        p_sink = gl.where(lse == float("-inf"), 0.0, gl.exp(sink - lse))
        gl.store(part_ptr + WG, -gl.sum(p_sink * delta, 0))
    gl.store(lse_ptr + rows, lse)
    gl.store(delta_ptr + rows, delta)
    return lse, delta


@gluon.jit
def _acc_zero(HEAD_DIM: gl.constexpr, W: gl.constexpr, SPLIT: gl.constexpr, WARPS_N: gl.constexpr = 1):
    """A zero gradient accumulator of ROWS rows (dQ, dK or dV): one (ROWS, HEAD_DIM) tensor, or under SPLIT a pair
    over the columns of W's two pieces (`gluon_common.width_piece`: D=192 in 256-column tiles as 128 + 64), so that
    its product skips the tiles' zero columns (Triton's tensors are powers of two). WARPS_N: the warpgroups that
    split its columns (`wgmma_layout`)."""
    if SPLIT:
        W0: gl.constexpr = width_piece(W, 0)
        W1: gl.constexpr = width_piece(W, 1)
        return (gl.zeros([ROWS, W0], gl.float32, wgmma_layout(W0, WARPS_N)),
                gl.zeros([ROWS, W1], gl.float32, wgmma_layout(W1, WARPS_N)))
    else:
        return gl.zeros([ROWS, HEAD_DIM], gl.float32, wgmma_layout(HEAD_DIM, WARPS_N))


@gluon.jit
def _acc_operands(a, HEAD_DIM: gl.constexpr, W: gl.constexpr, SPLIT: gl.constexpr, WARPS_N: gl.constexpr = 1):
    """a (a (ROWS, K) register tile in the inputs' dtype, any layout) as the A operand of the wgmmas into an
    accumulator of `_acc_zero`'s: one, or a pair under SPLIT."""
    if SPLIT:
        W0: gl.constexpr = width_piece(W, 0)
        W1: gl.constexpr = width_piece(W, 1)
        return (gl.convert_layout(a, gl.DotOperandLayout(operand_index=0, parent=wgmma_layout(W0, WARPS_N),
                                                         k_width=2)),
                gl.convert_layout(a, gl.DotOperandLayout(operand_index=0, parent=wgmma_layout(W1, WARPS_N),
                                                         k_width=2)))
    else:
        return gl.convert_layout(a, gl.DotOperandLayout(operand_index=0, parent=wgmma_layout(HEAD_DIM, WARPS_N),
                                                        k_width=2))


@gluon.jit
def _acc_mma(ops, b, acc, W: gl.constexpr, SPLIT: gl.constexpr):
    """acc + a b issued as asynchronous wgmmas (ops: `_acc_operands` of a; b: (K, tile width) in shared memory),
    into each accumulator its columns of b. Returns the accumulators' tokens: a pair under SPLIT (two commit
    groups), else one."""
    if SPLIT:
        W0: gl.constexpr = width_piece(W, 0)
        W1: gl.constexpr = width_piece(W, 1)
        return (warpgroup_mma(ops[0], b.slice(0, W0, dim=1), acc[0], is_async=True),
                warpgroup_mma(ops[1], b.slice(W0, W1, dim=1), acc[1], is_async=True))
    else:
        return warpgroup_mma(ops, b, acc, is_async=True)


@gluon.jit
def _acc_wait(tokens, ops, SPLIT: gl.constexpr):
    """The accumulators of `_acc_mma`'s tokens once every wgmma issued is done."""
    if SPLIT:
        d0, d1, op0, op1 = warpgroup_mma_wait(0, deps=(tokens[0], tokens[1], ops[0], ops[1]))
        return (d0, d1)
    else:
        acc, op = warpgroup_mma_wait(0, deps=(tokens, ops))
        return acc


@gluon.jit
def _acc_wait_both(tok_a, ops_a, tok_b, ops_b, SPLIT_A: gl.constexpr, SPLIT_B: gl.constexpr):
    """`_acc_wait` of two accumulators (each one tensor or a SPLIT pair) in one wait."""
    if SPLIT_A and SPLIT_B:
        a0, a1, b0, b1, oa0, oa1, ob0, ob1 = warpgroup_mma_wait(0, deps=(tok_a[0], tok_a[1], tok_b[0], tok_b[1],
                                                                         ops_a[0], ops_a[1], ops_b[0], ops_b[1]))
        return (a0, a1), (b0, b1)
    elif SPLIT_A:
        a0, a1, b, oa0, oa1, ob = warpgroup_mma_wait(0, deps=(tok_a[0], tok_a[1], tok_b, ops_a[0], ops_a[1], ops_b))
        return (a0, a1), b
    elif SPLIT_B:
        a, b0, b1, oa, ob0, ob1 = warpgroup_mma_wait(0, deps=(tok_a, tok_b[0], tok_b[1], ops_a, ops_b[0], ops_b[1]))
        return a, (b0, b1)
    else:
        a, b, oa, ob = warpgroup_mma_wait(0, deps=(tok_a, tok_b, ops_a, ops_b))
        return a, b


@gluon.jit
def _acc_out(acc, scale, dtype: gl.constexpr, SPLIT: gl.constexpr):
    """An accumulator (or `_acc_zero`'s pair) times `scale` (None: 1) in the outputs' dtype."""
    if SPLIT:
        if scale is None:
            return (acc[0].to(dtype), acc[1].to(dtype))
        else:
            return ((acc[0] * scale).to(dtype), (acc[1] * scale).to(dtype))
    else:
        if scale is None:
            return acc.to(dtype)
        else:
            return (acc * scale).to(dtype)


@gluon.jit
def _acc_to_shared(buf, out, W: gl.constexpr, SPLIT: gl.constexpr):
    """`_acc_out`'s result into a (ROWS, tile width) shared-memory tile for its TMA store; under SPLIT the columns
    past W keep what the tile held (the inputs' zero columns, which the TMA store clips)."""
    if SPLIT:
        W0: gl.constexpr = width_piece(W, 0)
        W1: gl.constexpr = width_piece(W, 1)
        buf.slice(0, W0, dim=1).store(out[0])
        buf.slice(W0, W1, dim=1).store(out[1])
    else:
        buf.store(out)


@gluon.jit
def _acc_store_rows(base, stride_n, first, n_valid, out, HEAD_DIM: gl.constexpr, d_valid, W: gl.constexpr,
                    SPLIT: gl.constexpr, WARPS_N: gl.constexpr = 1):
    """`_store_rows` of `_acc_out`'s result (varlen: a sequence's last, partial block of rows)."""
    if SPLIT:
        W0: gl.constexpr = width_piece(W, 0)
        W1: gl.constexpr = width_piece(W, 1)
        _store_rows(base, stride_n, first, n_valid, out[0], wgmma_layout(W0, WARPS_N), W0, d_valid)
        _store_rows(base + W0, stride_n, first, n_valid, out[1], wgmma_layout(W1, WARPS_N), W1, d_valid - W0)
    else:
        _store_rows(base, stride_n, first, n_valid, out, wgmma_layout(HEAD_DIM, WARPS_N), HEAD_DIM, d_valid)


@gluon.jit
def _dq_tile(tiles, dq, j, key_lo, row0, rows, cols, lse, delta, seqlen_k, diag, qk_scale, slope, variant,
             MASK: gl.constexpr, IS_CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
             NUM_STAGES: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
             HAS_DROPOUT: gl.constexpr, QK_W: gl.constexpr, V_W: gl.constexpr, DQ_SPLIT: gl.constexpr = False):
    """One K/V tile (ring slot j, keys [n, n + BLOCK_N) with n = key_lo + j · BLOCK_N) into a warpgroup's dQ
    (returned). `tiles`: (K, V buffers, kv_ready, kv_empty, the warpgroup's Q and dO, a zero score tile). QK_W, V_W:
    the widths of S's and dP's products (`gluon_common.mma_nt`); DQ_SPLIT: dQ in two accumulators (`_acc_zero`). MASK: 0
    skips a tile none of whose pairs is visible (`tile_hidden`) and masks one that needs it, 1 neither (a tile every
    pair of which is visible), 2 skips hidden tiles and masks the rest."""
    k_bufs, v_bufs, kv_ready, kv_empty, q, do, s_zero = tiles
    left, right, softcap, slopes, dropout = variant
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    HEAD_DIM_V: gl.constexpr = v_bufs.shape[len(v_bufs.shape) - 1]
    dtype: gl.constexpr = q.dtype
    stage = j % NUM_STAGES
    mbarrier.wait(kv_ready.index(stage), (j // NUM_STAGES) & 1)
    n = key_lo + j * BLOCK_N
    hidden = False
    if MASK != 1:
        hidden = tile_hidden(row0 + (ROWS - 1), n, diag, IS_CAUSAL, HAS_WINDOW, left, right, row0, n + (BLOCK_N - 1))
    if hidden:
        # No row of this warpgroup sees a key of the tile (causal: the first warpgroup's last tile; a window's
        # edges): nothing to add.
        mbarrier.arrive(kv_empty.index(stage), count=1)
    else:
        k = k_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM])
        v = v_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM_V])
        s_tok = mma_nt(q, k, s_zero, QK_W)  # S (ROWS, BLOCK_N)
        dp_tok = mma_nt(do, v, s_zero, V_W)  # dP
        s = warpgroup_mma_wait(width_pieces(V_W), deps=(s_tok, ))  # dP's products may still run
        if HAS_SOFTCAP or HAS_ALIBI:
            p, cap_grad = _probabilities(s, lse[:, None], rows[:, None], (n + cols)[None, :], diag, qk_scale,
                                         softcap, slope, HAS_SOFTCAP, HAS_ALIBI)
            if HAS_SOFTCAP:  # dS's factor folded into P (P feeds dS only): one score tile fewer stays live
                p = p * cap_grad
        else:
            p = gl.exp2(s * qk_scale - lse[:, None])
        if MASK == 0:
            need_mask = (n + BLOCK_N > seqlen_k) | tile_masked(row0, n + BLOCK_N - 1, diag, IS_CAUSAL, HAS_WINDOW,
                                                               left, right, row0 + (ROWS - 1), n)
            if need_mask:
                keep = visible((n + cols)[None, :] < seqlen_k, rows[:, None], (n + cols)[None, :], diag,
                               IS_CAUSAL, HAS_WINDOW, left, right)
                p = gl.where(keep, p, 0.0)
        elif MASK == 2:
            keep = visible((n + cols)[None, :] < seqlen_k, rows[:, None], (n + cols)[None, :], diag, IS_CAUSAL,
                           HAS_WINDOW, left, right)
            p = gl.where(keep, p, 0.0)
        if HAS_DROPOUT:  # the forward's mask, made while dP runs
            kept = dropout_keep(dropout[0], dropout[1], dropout[4], row0, n, dropout[2], BLOCK_N)
        dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
        if HAS_DROPOUT:
            dp = gl.where(kept, dp * dropout[3], 0.0)
        ds = p * (dp - delta[:, None])  # dS (ROWS, BLOCK_N)
        ds_op = _acc_operands(ds.to(dtype), HEAD_DIM, QK_W, DQ_SPLIT)
        dq = _acc_wait(_acc_mma(ds_op, k, dq, QK_W, DQ_SPLIT), ds_op, DQ_SPLIT)
        mbarrier.arrive(kv_empty.index(stage), count=1)
    return dq


@gluon.jit
def _dq_consumer(shared, place, seq, diag, qk_scale, softmax_scale, lse_ptr, delta_ptr, variant,
                 WG: gl.constexpr, IS_CAUSAL: gl.constexpr, IS_VARLEN: gl.constexpr, HEAD_DIM: gl.constexpr,
                 BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, HAS_WINDOW: gl.constexpr,
                 HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, HAS_DROPOUT: gl.constexpr = False,
                 SPLIT: gl.constexpr = 0, fused=0, FUSED_DELTA: gl.constexpr = 0, DV_OUT: gl.constexpr = 0,
                 QK_W: gl.constexpr = 0, V_W: gl.constexpr = 0, DQ_SPLIT: gl.constexpr = False):
    """dQ of query rows [start_m + 64 WG, start_m + 64 WG + 64) over the K/V tiles, then its store. FUSED_DELTA:
    their lse and delta from `fused` (`_fused_delta`), else from the padded lse_ptr / delta_ptr. `variant`:
    (window left, right, softcap, pointer at the head's ALiBi slope, dropout), None where off; dropout = (seed,
    offset, threshold, 1 / (1 - p), b · Hq + h). SPLIT (causal or a window): the tiles in three loops, the masked
    ones (`_dq_tile`'s MASK 2) around those every pair of which is visible (MASK 1: no mask code)."""
    (q_bufs, do_bufs, k_bufs, v_bufs, q_ready, kv_ready, kv_empty, desc_dq, DQ, stride_dqm, stride_dqh,
     d_valid) = shared
    off_b, off_h, off_hk, start_m, n_tiles, key_lo = place
    q_start, seqlen_q, k_start, seqlen_k = seq
    left, right, softcap, slopes, dropout = variant
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    HEAD_DIM_V: gl.constexpr = v_bufs.shape[len(v_bufs.shape) - 1]  # V's and dO's tiles (QK's: HEAD_DIM)
    dtype: gl.constexpr = q_bufs.dtype
    row0 = start_m + WG * ROWS  # in the sequence
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))  # (ROWS,) query rows
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))  # (BLOCK_N,)
    if FUSED_DELTA:
        lse, delta = _fused_delta(fused, do_bufs.index(WG), q_ready, rows, seqlen_q, lse_ptr, delta_ptr, WG,
                                  s_layout, FUSED_DELTA, DV_OUT)
    else:
        lse = gl.load(lse_ptr + rows)  # padded: rows past the last sequence hold -inf
        delta = gl.load(delta_ptr + rows)
    if IS_VARLEN:  # rows past the sequence: the layout's gap or the next sequence's; no P there (and 0 · NaN)
        lse = gl.where(rows < seqlen_q, lse, float("-inf"))
        delta = gl.where(rows < seqlen_q, delta, 0.0)
    lse = _lse_base2(lse)
    slope = gl.load(slopes) * 1.4426950408889634 if HAS_ALIBI else None  # in base 2
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    dq = _acc_zero(HEAD_DIM, QK_W, DQ_SPLIT)
    q = q_bufs.index(WG).reshape([ROWS, HEAD_DIM])
    do = do_bufs.index(WG).reshape([ROWS, HEAD_DIM_V])
    mbarrier.wait(q_ready, 0)
    tiles = (k_bufs, v_bufs, kv_ready, kv_empty, q, do, s_zero)
    # (SPLIT takes causal calls and windows: elsewhere only the keys' end is masked)
    if SPLIT and (IS_CAUSAL or HAS_WINDOW):  # the tiles in three runs: masked (a window's left edge), whole, masked
        first, start, lo, _ = key_blocks(start_m // KEYS, seqlen_k, diag, IS_CAUSAL, KEYS, BLOCK_N, HAS_WINDOW, left,
                                         right)
        n_head = (start - first) // BLOCK_N
        n_whole = (lo - start) // BLOCK_N
        for j in range(n_head):
            dq = _dq_tile(tiles, dq, j, key_lo, row0, rows, cols, lse, delta, seqlen_k, diag, qk_scale,
                          slope, variant, 2, IS_CAUSAL, HEAD_DIM, BLOCK_N, NUM_STAGES, HAS_WINDOW, HAS_SOFTCAP,
                          HAS_ALIBI, HAS_DROPOUT, QK_W, V_W, DQ_SPLIT)
        for j in range(n_head, n_head + n_whole):
            dq = _dq_tile(tiles, dq, j, key_lo, row0, rows, cols, lse, delta, seqlen_k, diag, qk_scale,
                          slope, variant, 1, IS_CAUSAL, HEAD_DIM, BLOCK_N, NUM_STAGES, HAS_WINDOW, HAS_SOFTCAP,
                          HAS_ALIBI, HAS_DROPOUT, QK_W, V_W, DQ_SPLIT)
        for j in range(n_head + n_whole, n_tiles):
            dq = _dq_tile(tiles, dq, j, key_lo, row0, rows, cols, lse, delta, seqlen_k, diag, qk_scale,
                          slope, variant, 2, IS_CAUSAL, HEAD_DIM, BLOCK_N, NUM_STAGES, HAS_WINDOW, HAS_SOFTCAP,
                          HAS_ALIBI, HAS_DROPOUT, QK_W, V_W, DQ_SPLIT)
    else:
        for j in range(n_tiles):
            dq = _dq_tile(tiles, dq, j, key_lo, row0, rows, cols, lse, delta, seqlen_k, diag, qk_scale,
                          slope, variant, 0, IS_CAUSAL, HEAD_DIM, BLOCK_N, NUM_STAGES, HAS_WINDOW, HAS_SOFTCAP,
                          HAS_ALIBI, HAS_DROPOUT, QK_W, V_W, DQ_SPLIT)

    dq = _acc_out(dq, softmax_scale, dtype, DQ_SPLIT)
    if IS_VARLEN and seqlen_q - row0 < ROWS:  # the sequence ends in this block: no TMA store (the next one's rows)
        _acc_store_rows(DQ + off_h * stride_dqh, stride_dqm, q_start + row0, seqlen_q - row0, dq, HEAD_DIM, d_valid,
                        QK_W, DQ_SPLIT)
    else:  # dense: rows past Sq are clipped
        _acc_to_shared(q, dq, QK_W, DQ_SPLIT)  # this warpgroup's Q buffer, its last wgmma done
        fence_async_shared()
        tma_store(desc_dq, IS_VARLEN, off_b, q_start + row0, off_h, q_bufs.index(WG))
        tma.store_wait(0)


@gluon.jit(do_not_specialize=["window_left", "window_right", "stride_alibi_b", "stride_dqm", "stride_dqh", "HEADS_Q",
                              "BATCH", "GROUP_SIZE", "SEQLEN_Q", "SEQLEN_K", "SEQLEN_PAD", "dropout_threshold",
                              "stride_lib", "stride_lih", "stride_db", "stride_dh", "stride_dm"],
           do_not_specialize_on_alignment=["ALIBI", "DLSE", "SINK"])
def _attn_bwd_dq_gluon(
    desc_q, desc_k, desc_v, desc_do, desc_dq, LSE, DELTA, DQ, CU_SEQLENS_Q, CU_SEQLENS_K, WORK, softmax_scale,
    qk_scale,
    window_left, window_right, softcap,  # the variant's scalars (`Variant.scalars`), None where off
    ALIBI, stride_alibi_b,  # fp32 slopes (B or 1, Hq) and their batch stride, None without ALiBi
    DROPOUT_RNG, dropout_threshold, dropout_scale,  # `Variant.dropout_args`, None without dropout
    stride_dqm, stride_dqh, HEADS_Q, BATCH, GROUP_SIZE, SEQLEN_Q, SEQLEN_K, SEQLEN_PAD,
    O, LSE_IN, DLSE, stride_ob, stride_om, stride_oh, stride_lib, stride_lih, stride_db, stride_dh, stride_dm,
    SINK, SINK_PART,  # FUSED_DELTA: the forward's out (B, Sq, Hq, Dv) and lse (B, Hq, Sq), dlse, their strides,
    # the sinks (Hq,) and their gradient's parts (B, Hq, 2 · cdiv(Sq, 128)) fp32; each None where off
    IS_CAUSAL: gl.constexpr, CAUSAL_BOTTOM_RIGHT: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
    HAS_ALIBI: gl.constexpr, IS_VARLEN: gl.constexpr, HEAD_DIM: gl.constexpr, D_VALID: gl.constexpr,
    BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, WORK_TABLE: gl.constexpr,
    HAS_DROPOUT: gl.constexpr = False, SPLIT: gl.constexpr = 0, FUSED_DELTA: gl.constexpr = 0,
    DV_OUT: gl.constexpr = 0, QK_WIDTH: gl.constexpr = 0, V_WIDTH: gl.constexpr = 0, DQ_SPLIT: gl.constexpr = False,
):
    """Grid (cdiv(Sq, 128), Hq, B) (varlen: Sq the longest sequence's); varlen with WORK_TABLE: one program per
    row of WORK (`work_table`). num_warps=4: the producer; two consumer warpgroups of 64 query rows each. Causal:
    the last query tiles (the most keys) start first.
    FUSED_DELTA (dense; bits FD_ON, FD_DLSE, FD_SINK): the preprocess' work is this kernel's (`_fused_delta`): each
    warpgroup works out its rows' delta from O and dO, and writes them and its lse into the padded LSE / DELTA,
    which the dK/dV kernel, launched after this one, reads (one launch and one pass over O and dO fewer)."""
    if IS_VARLEN and WORK_TABLE:
        off_b, off_h, start_m, seq = _work_item(WORK)
        if off_b < 0:  # the table's padding past its last item
            return
    else:
        n_m = gl.num_programs(0)
        if IS_CAUSAL:
            start_m = (n_m - 1 - gl.program_id(0)) * KEYS
        else:
            start_m = gl.program_id(0) * KEYS
        off_h = gl.program_id(1)
        off_b = gl.program_id(2)
        seq = sequence(off_b, CU_SEQLENS_Q, CU_SEQLENS_K, gl.to_tensor(SEQLEN_Q), gl.to_tensor(SEQLEN_K),
                       IS_VARLEN)
    off_hk = off_h // GROUP_SIZE
    q_start, seqlen_q, k_start, seqlen_k = seq
    diag = diagonal(seqlen_q, seqlen_k, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, HAS_WINDOW or HAS_ALIBI)
    key_lo = 0
    if HAS_WINDOW:  # the key tiles with a key that one of the program's rows sees: [key_lo, hi)
        key_lo, _, _, hi = key_blocks(start_m // KEYS, seqlen_k, diag, IS_CAUSAL, KEYS, BLOCK_N, HAS_WINDOW,
                                      window_left, window_right)
    elif IS_CAUSAL:  # keys up to the last row's diagonal
        hi = gl.minimum(seqlen_k, gl.maximum(key_end_before(start_m + KEYS, diag, IS_CAUSAL), 0))
    else:
        hi = seqlen_k
    n_tiles = gl.cdiv(hi - key_lo, BLOCK_N)  # 0: rows that see no key, dQ = 0
    if IS_VARLEN:
        if start_m >= seqlen_q:  # rows past a shorter sequence's end: nothing to do
            return

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

    if IS_VARLEN:  # lse / delta (Hq, `padded_rows`), sequences at aligned rows
        rows_base = _lse_rows(off_b, off_h, HEADS_Q, SEQLEN_PAD, q_start, True)
    else:  # lse / delta (B, Hq, Sq_pad)
        rows_base = (off_b.to(gl.int64) * HEADS_Q + off_h) * SEQLEN_PAD
    place = (gl.to_tensor(off_b), gl.to_tensor(off_h), gl.to_tensor(off_hk), gl.to_tensor(start_m), n_tiles, key_lo)
    producer_args = (desc_q, desc_do, desc_k, desc_v, q_bufs, do_bufs, k_bufs, v_bufs, q_ready, kv_ready, kv_empty)
    consumer_args = (q_bufs, do_bufs, k_bufs, v_bufs, q_ready, kv_ready, kv_empty, desc_dq, DQ,
                     gl.to_tensor(stride_dqm), gl.to_tensor(stride_dqh), gl.to_tensor(D_VALID))
    QK_W: gl.constexpr = _width(QK_WIDTH, HEAD_DIM)  # the products' widths (`gluon_common.mma_nt`)
    V_W: gl.constexpr = _width(V_WIDTH, desc_v.block_type.shape[len(desc_v.block_type.shape) - 1])
    scales = (diag, gl.to_tensor(qk_scale), gl.to_tensor(softmax_scale))
    lse_ptr = LSE + rows_base
    delta_ptr = DELTA + rows_base
    if FUSED_DELTA:
        fused = (O + off_b.to(gl.int64) * stride_ob + off_h * stride_oh, gl.to_tensor(stride_om),
                 LSE_IN + off_b.to(gl.int64) * stride_lib + off_h * stride_lih,
                 DLSE + off_b.to(gl.int64) * stride_db + off_h * stride_dh if FUSED_DELTA & FD_DLSE else None,
                 gl.to_tensor(stride_dm) if FUSED_DELTA & FD_DLSE else None,
                 SINK + off_h if FUSED_DELTA & FD_SINK else None,  # the parts: (b, h, query tile, warpgroup)
                 SINK_PART + ((off_b * HEADS_Q + off_h) * gl.num_programs(0) + start_m // KEYS) * 2
                 if FUSED_DELTA & FD_SINK else None)
    else:
        fused = gl.constexpr(0)
    # The variant's scalars as the consumers take them: tensors where the variant has them, else None (constexprs).
    if HAS_DROPOUT:
        seed, offset = dropout_state(DROPOUT_RNG)
        dropout = (seed, offset, gl.to_tensor(dropout_threshold), gl.to_tensor(dropout_scale), off_b * HEADS_Q + off_h)
    else:
        dropout = gl.constexpr(0)  # (off: what stands for it; a variable cannot hold None)
    variant = (gl.to_tensor(window_left) if HAS_WINDOW else None, gl.to_tensor(window_right) if HAS_WINDOW else None,
               gl.to_tensor(softcap) if HAS_SOFTCAP else None,
               ALIBI + off_b * stride_alibi_b + off_h if HAS_ALIBI else None, dropout)
    gl.warp_specialize([
        (_dq_producer, (producer_args, place, seq, IS_VARLEN, NUM_STAGES)),
        (_dq_consumer, (consumer_args, place, seq, scales[0], scales[1], scales[2], lse_ptr, delta_ptr, variant,
                        gl.constexpr(0), IS_CAUSAL, IS_VARLEN, HEAD_DIM, BLOCK_N, NUM_STAGES, HAS_WINDOW,
                        HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, SPLIT, fused, FUSED_DELTA, DV_OUT, QK_W, V_W, DQ_SPLIT)),
        (_dq_consumer, (consumer_args, place, seq, scales[0], scales[1], scales[2], lse_ptr, delta_ptr, variant,
                        gl.constexpr(1), IS_CAUSAL, IS_VARLEN, HEAD_DIM, BLOCK_N, NUM_STAGES, HAS_WINDOW,
                        HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, SPLIT, fused, FUSED_DELTA, DV_OUT, QK_W, V_W, DQ_SPLIT)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
