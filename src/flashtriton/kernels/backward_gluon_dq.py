"""Hopper's Gluon dQ kernel (`_attn_bwd_dq_gluon`): a program owns 128 query rows of one (batch, query head) and
streams the key tiles they see; with FUSED_DELTA it also works out the preprocess' delta (the overview, variants
and layouts: `backward_gluon`, which holds what it shares with the dK/dV kernel)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma_wait

from .backward_gluon import (KEYS, ROWS, acc_mma, acc_operands, acc_out, acc_store_rows, acc_to_shared, acc_wait,
                             acc_zero, dropout_scalars, lse_base2, lse_rows, probabilities, tile_width, work_item)
from .gluon_common import dropout_tile, mma_nt, sequence, tma_load, tma_store, wgmma_layout, width_pieces
from .variant import diagonal, dropout_select, key_blocks, key_end_before, tile_hidden, tile_masked, visible


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
    O) in fp32 over O's DV_OUT columns, minus dlse (FD_DLSE) where lse is finite, as
    `backward_kernels._attn_bwd_preprocess` works them out; both stored into the padded lse_ptr / delta_ptr for the
    dK/dV kernel, rows past Sq as -inf / 0.
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
def _dq_tile(tiles, dq, j, key_lo, row0, rows, cols, lse, delta, seqlen_k, diag, qk_scale, slope, variant,
             MASK: gl.constexpr, IS_CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
             NUM_STAGES: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
             HAS_DROPOUT: gl.constexpr, QK_W: gl.constexpr, V_W: gl.constexpr, DQ_SPLIT: gl.constexpr = False):
    """One K/V tile (ring slot j, keys [n, n + BLOCK_N) with n = key_lo + j · BLOCK_N) into a warpgroup's dQ
    (returned). `tiles`: (K, V buffers, kv_ready, kv_empty, the warpgroup's Q and dO, a zero score tile). QK_W, V_W:
    the widths of S's and dP's products (`gluon_common.mma_nt`); DQ_SPLIT: dQ in two accumulators (`acc_zero`). MASK: 0
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
            p, cap_grad = probabilities(s, lse[:, None], rows[:, None], (n + cols)[None, :], diag, qk_scale,
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
            fields = dropout_tile(dropout[0], dropout[1], dropout[4], row0, n, BLOCK_N)
        dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
        if HAS_DROPOUT:
            dp = dropout_select(fields, dropout[2], dp)  # (the scale is in P and delta: `_dq_consumer`)
        ds = p * (dp - delta[:, None])  # dS (ROWS, BLOCK_N)
        ds_op = acc_operands(ds.to(dtype), HEAD_DIM, QK_W, DQ_SPLIT)
        dq = acc_wait(acc_mma(ds_op, k, dq, QK_W, DQ_SPLIT), ds_op, DQ_SPLIT)
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
    offset, threshold, (log2(1 / (1 - p)), 1 - p), b · Hq + h). SPLIT (causal or a window): the tiles in three
    loops, the masked ones (`_dq_tile`'s MASK 2) around those every pair of which is visible (MASK 1: no mask
    code)."""
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
    lse = lse_base2(lse)
    if HAS_DROPOUT:  # P' = P / (1 - p) straight from exp2, delta' = delta · (1 - p): dS = P' ∘ (dP ∘ Z - delta'),
        lse = lse - dropout[3][0]  # with no multiply per score for the scale
        delta = delta * dropout[3][1]
    slope = gl.load(slopes) * 1.4426950408889634 if HAS_ALIBI else None  # in base 2
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    dq = acc_zero(HEAD_DIM, QK_W, DQ_SPLIT)
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

    dq = acc_out(dq, softmax_scale, dtype, DQ_SPLIT)
    if IS_VARLEN and seqlen_q - row0 < ROWS:  # the sequence ends in this block: no TMA store (the next one's rows)
        acc_store_rows(DQ + off_h * stride_dqh, stride_dqm, q_start + row0, seqlen_q - row0, dq, HEAD_DIM, d_valid,
                        QK_W, DQ_SPLIT)
    else:  # dense: rows past Sq are clipped
        acc_to_shared(q, dq, QK_W, DQ_SPLIT)  # this warpgroup's Q buffer, its last wgmma done
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
        off_b, off_h, start_m, seq = work_item(WORK)
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
        rows_base = lse_rows(off_b, off_h, HEADS_Q, SEQLEN_PAD, q_start, True)
    else:  # lse / delta (B, Hq, Sq_pad)
        rows_base = (off_b.to(gl.int64) * HEADS_Q + off_h) * SEQLEN_PAD
    place = (gl.to_tensor(off_b), gl.to_tensor(off_h), gl.to_tensor(off_hk), gl.to_tensor(start_m), n_tiles, key_lo)
    producer_args = (desc_q, desc_do, desc_k, desc_v, q_bufs, do_bufs, k_bufs, v_bufs, q_ready, kv_ready, kv_empty)
    consumer_args = (q_bufs, do_bufs, k_bufs, v_bufs, q_ready, kv_ready, kv_empty, desc_dq, DQ,
                     gl.to_tensor(stride_dqm), gl.to_tensor(stride_dqh), gl.to_tensor(D_VALID))
    QK_W: gl.constexpr = tile_width(QK_WIDTH, HEAD_DIM)  # the products' widths (`gluon_common.mma_nt`)
    V_W: gl.constexpr = tile_width(V_WIDTH, desc_v.block_type.shape[len(desc_v.block_type.shape) - 1])
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
        dropout = dropout_scalars(DROPOUT_RNG, dropout_threshold, dropout_scale, off_b * HEADS_Q + off_h)
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
