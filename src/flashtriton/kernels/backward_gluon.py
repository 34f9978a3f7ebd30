"""Hopper backward in Gluon, the device side: dK/dV and dQ, each with a TMA producer and two consumer warpgroups
(FlashAttention-3's layout, with dQ in a kernel of its own instead of accumulated: no atomics, deterministic). This
module holds what both kernels share (the tile constants, the probabilities, the lse rows, the fp32 accumulators'
helpers); the kernels are `backward_gluon_dkdv._attn_bwd_dkdv_gluon` and `backward_gluon_dq._attn_bwd_dq_gluon`.
Their host side (launch plans, the padded lse / delta sizes, the varlen work table, the launchers) is
`backward_gluon_launch`.

dK/dV (`backward_gluon_dkdv`): a program owns 128 keys of one (batch, kv head): K and V stay in shared memory,
each consumer warpgroup keeps the fp32 dK, dV of its 64 keys in registers. The producer streams 64-row tiles of
Q, dO and their rows' log-sum-exp and delta (for every query head of the GQA group) through a ring of NUM_STAGES
stages. Per tile a warpgroup computes, on transposed scores (keys x queries, so no tile is ever transposed in
registers):
    Sᵀ = K Qᵀ      Pᵀ = exp2(Sᵀ · qk_scale − lse · log2 e)      dV += Pᵀ dO
    dPᵀ = V dOᵀ    dSᵀ = Pᵀ ∘ (dPᵀ − delta)                      dK += dSᵀ Q
with Sᵀ and dPᵀ issued together as asynchronous wgmmas and Pᵀ / dSᵀ fed to the next wgmma from registers.
The other warpgroup's matmuls run while one computes its exponentials. dK (times the softmax scale) and dV
leave through the K/V buffers and TMA stores that clip rows past the keys.

dQ (`backward_gluon_dq`): a program owns 128 query rows (Q, dO, lse, delta resident; 64 rows per consumer) and
streams K/V tiles of BLOCK_N keys: S = Q Kᵀ and dP = dO Vᵀ as asynchronous wgmmas, dS = P ∘ (dP − delta),
dQ += dS K with dS from registers; the result leaves through the Q buffer and a TMA store.

lse and delta come padded (`backward_gluon_launch.padded_rows`): dense (B, Hq, Sq_pad) fp32 with Sq_pad a multiple
of 128, lse = −inf and delta = 0 on rows past Sq, so every tile loads whole and rows past the queries (zero-filled
by TMA) give P = 0. Rows that see no key (lse = −inf) get P = 0 too. Causal (bottom-right, or top-left): a dK/dV
program's query tiles start at the first row that sees its first key, a dQ program's keys end at its last row's
diagonal; only tiles that cross a diagonal pay for the mask.
Varlen (packed (total, H, D) tensors, cu_seqlens): rank-3 descriptors, whose rows past a sequence belong to the
next one, so P is masked there; lse / delta (Hq, `padded_rows`) with each sequence at a 16-byte aligned row
(`lse_rows`; a 1-d TMA copy from an unaligned row faults), written there by the preprocess and loaded by TMA, the
rows between sequences masked (never written); programs past a sequence's end return at once; whole 64-row blocks of
results leave by TMA store, a sequence's last partial block row by row (a TMA store would write the next one's rows).
Causal: the dQ kernel's first warpgroup skips the key tile it sees nothing of (the dK/dV kernel computes its wholly
masked tile: skipping it there cost spills and 12-15 %).
Variants (`Variant.score_constexprs`: HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, with their scalars; None arguments where
off, so that a kernel without them compiles as it would without the code): a window's dK/dV program streams only the
query tiles of `variant.query_blocks` for its 128 keys, a dQ program only the key tiles of `variant.key_blocks` for
its 128 rows (and skips a warpgroup's tile of no visible pair, `tile_hidden`); tiles on the band's edges are masked
(`key_tile_masked` / `tile_masked`, `visible`), or, where the config says SPLIT, the dK/dV tiles run in three loops,
the masked ones around those every pair of which is visible, which carry no mask code
(`backward_gluon_dkdv._consume_keys`; the dQ kernel likewise under its own SPLIT, `backward_gluon_dq._dq_consumer`).
Softcap: the capped scores and 1 − tanh², which multiplies dS (`softcap_scores_and_grad`; folded into P once dV has
its copy); ALiBi: `alibi_bias` before exp2, the slopes (B or 1, Hq) fp32. The dK/dV consumers issue a variant tile's
dPᵀ after its Pᵀ (fewer live registers: `backward_gluon_dkdv._consume_keys`). Sinks need nothing here: lse includes
them, and their gradient comes from the preprocess (`backward.preprocess`).
The preprocess' work in the dQ kernel (FUSED_DELTA, dense calls without a sink: `backward_gluon_dq._fused_delta`):
each dQ warpgroup works out its rows' delta from O and dO and writes them, with its lse, into the padded buffers, so
that a dense backward is two launches, dQ then dK/dV, instead of three.
Dropout (HAS_DROPOUT, the forward's keep-mask Z regenerated: `gluon_common.dropout_tile` / `dropout_tile_t`, bit for
bit `variant.dropout_keep`): dV += (Pᵀ ∘ Zᵀ / (1 − p)) dO and dSᵀ = Pᵀ ∘ (dPᵀ ∘ Zᵀ / (1 − p) − delta), dS likewise,
as P' = P / (1 − p) straight from exp2 (log2(1 − p) added to lse) and dS = P' ∘ (dP ∘ Z − delta · (1 − p)): no
multiply per score for the scale.
Persistent dK/dV (PERSISTENT, a config constexpr off in the dispatch: `backward_gluon_dkdv._attn_bwd_dkdv_gluon`):
one program per SM taking an item per round, two K/V buffer pairs.
Head dims: Q and K in tiles of 64, 128 or 256 columns (HEAD_DIM: `gluon_common.head_block` of D); V, dO and dV in
tiles of V's own width, read from the V descriptor (HEAD_DIM_V; a pair such as DeepSeek's MLA, QK 192 / V 128, runs
V's matmuls at 128 columns: `backward_gluon_launch.separate_v_ok` says which pairs). Products over the head dim run on
the head's own columns (QK_WIDTH, V_WIDTH: `gluon_common.mma_nt`); where QK's width is two pieces of at least 64
columns (D=192 in 256-column tiles: 128 + 64), dQ lives in two accumulators over them, so that its product skips the
zero columns too (DQ_SPLIT: `acc_zero`, `backward_gluon_launch.dq_split`).
fp16/bf16; sm_90.
`backward.attention_backward` launches these (`backward_gluon_launch.launch_dkdv_gluon` / `launch_dq_gluon`) where
`configs.gluon_bwd_config` says.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from .gluon_common import wgmma_layout, width_piece
from .variant import alibi_bias, dropout_state, softcap_scores_and_grad

ROWS = gl.constexpr(64)  # keys per consumer warpgroup (wgmma's M); a program holds 2 * ROWS keys
BLOCK_M = gl.constexpr(64)  # query rows per streamed tile
KEYS = gl.constexpr(2 * 64)  # keys per program
# dK/dV tiles this wide: 64 keys a program, split by columns (`backward_gluon_dkdv.dkdv_keys`)
WIDE_HEAD_DIM = gl.constexpr(256)


@gluon.constexpr_function
def tile_width(width, tile):
    """The width of a product over a head dim in `tile`-column tiles (`gluon_common.mma_nt`): QK_WIDTH / V_WIDTH
    (the head's own columns, `gluon_common.product_width`), or where that is 0 the tiles' whole."""
    return width or tile


@gluon.jit
def lse_base2(lse):
    """lse in base 2 for exp2(s · qk_scale − lse); rows that see no key (−inf) get +inf, so that their P is 0."""
    return gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)


@gluon.jit
def dropout_scalars(DROPOUT_RNG, dropout_threshold, dropout_scale, bh):
    """A backward kernel's dropout, as its tiles take it: (seed, offset, threshold, (log2(1 / (1 - p)), 1 - p), bh),
    the scale as lse's shift and delta's factor (P / (1 - p) straight from exp2, no multiply per score), bh the
    mask's b · Hq + h."""
    seed, offset = dropout_state(DROPOUT_RNG)
    scale = gl.to_tensor(dropout_scale)  # 1 / (1 - p)
    return seed, offset, gl.to_tensor(dropout_threshold), (gl.log2(scale), 1.0 / scale), bh


@gluon.jit
def probabilities(s, lse, q_idx, k_idx, diag, qk_scale, softcap, slope, HAS_SOFTCAP: gl.constexpr,
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
def lse_rows(off_b, off_h, heads_q, seqlen_pad, q_start, IS_VARLEN: gl.constexpr):
    """Where the padded lse / delta of (sequence / batch entry off_b, query head off_h) start. Dense (B, Hq, Sq_pad):
    (off_b · Hq + off_h) · Sq_pad. Varlen (Hq, `padded_rows`): sequence b starts at 4 · (ceil(q_start / 4) + b),
    16-byte aligned so that its tiles can come by TMA, and at least its length past sequence b − 1's start (the
    preprocess writes this layout: `backward_kernels._attn_bwd_preprocess`). int32, as TMA coordinates are: the launcher
    keeps the buffers under 2**31 values."""
    if IS_VARLEN:
        return off_h * seqlen_pad + ((q_start + 3) // 4 + off_b) * 4
    else:
        return (off_b * heads_q + off_h) * seqlen_pad


@gluon.jit
def work_item(WORK):
    """A varlen program's row of the work table (`work_table`): (sequence b or −1 for a padding row, head, first
    key / query row of its 128, (q_start, seqlen_q, k_start, seqlen_k)), one round trip for all of them."""
    row = WORK + gl.program_id(0) * 8
    seq = (gl.load(row + 3), gl.load(row + 4), gl.load(row + 5), gl.load(row + 6))
    return gl.load(row), gl.load(row + 1), gl.load(row + 2), seq


@gluon.jit
def store_rows(base, stride_n, first, n_valid, vals, layout: gl.constexpr, HEAD_DIM: gl.constexpr, d_valid):
    """Varlen epilogue: rows first + i (i < n_valid) of a packed (total, H, D) tensor, from registers; `base`
    points at (token 0, this head). A TMA store would also write the rows past the sequence, the next one's.
    Columns from d_valid (the head's own D, below the tiles' HEAD_DIM) are not the head's: not stored."""
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    ptrs = base + (first + rows)[:, None].to(gl.int64) * stride_n + cols[None, :]
    gl.store(ptrs, vals, mask=(rows < n_valid)[:, None] & (cols < d_valid)[None, :])


@gluon.jit
def acc_zero(HEAD_DIM: gl.constexpr, W: gl.constexpr, SPLIT: gl.constexpr, WARPS_N: gl.constexpr = 1):
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
def acc_operands(a, HEAD_DIM: gl.constexpr, W: gl.constexpr, SPLIT: gl.constexpr, WARPS_N: gl.constexpr = 1):
    """a (a (ROWS, K) register tile in the inputs' dtype, any layout) as the A operand of the wgmmas into an
    accumulator of `acc_zero`'s: one, or a pair under SPLIT."""
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
def acc_mma(ops, b, acc, W: gl.constexpr, SPLIT: gl.constexpr):
    """acc + a b issued as asynchronous wgmmas (ops: `acc_operands` of a; b: (K, tile width) in shared memory),
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
def acc_wait(tokens, ops, SPLIT: gl.constexpr):
    """The accumulators of `acc_mma`'s tokens once every wgmma issued is done."""
    if SPLIT:
        d0, d1, op0, op1 = warpgroup_mma_wait(0, deps=(tokens[0], tokens[1], ops[0], ops[1]))
        return (d0, d1)
    else:
        acc, op = warpgroup_mma_wait(0, deps=(tokens, ops))
        return acc


@gluon.jit
def acc_wait_both(tok_a, ops_a, tok_b, ops_b):
    """`acc_wait` of two accumulators in one wait."""
    a, b, oa, ob = warpgroup_mma_wait(0, deps=(tok_a, tok_b, ops_a, ops_b))
    return a, b


@gluon.jit
def acc_out(acc, scale, dtype: gl.constexpr, SPLIT: gl.constexpr):
    """An accumulator (or `acc_zero`'s pair) times `scale` (None: 1) in the outputs' dtype."""
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
def acc_to_shared(buf, out, W: gl.constexpr, SPLIT: gl.constexpr):
    """`acc_out`'s result into a (ROWS, tile width) shared-memory tile for its TMA store; under SPLIT the columns
    past W keep what the tile held (the inputs' zero columns, which the TMA store clips)."""
    if SPLIT:
        W0: gl.constexpr = width_piece(W, 0)
        W1: gl.constexpr = width_piece(W, 1)
        buf.slice(0, W0, dim=1).store(out[0])
        buf.slice(W0, W1, dim=1).store(out[1])
    else:
        buf.store(out)


@gluon.jit
def acc_store_rows(base, stride_n, first, n_valid, out, HEAD_DIM: gl.constexpr, d_valid, W: gl.constexpr,
                    SPLIT: gl.constexpr, WARPS_N: gl.constexpr = 1):
    """`store_rows` of `acc_out`'s result (varlen: a sequence's last, partial block of rows)."""
    if SPLIT:
        W0: gl.constexpr = width_piece(W, 0)
        W1: gl.constexpr = width_piece(W, 1)
        store_rows(base, stride_n, first, n_valid, out[0], wgmma_layout(W0, WARPS_N), W0, d_valid)
        store_rows(base + W0, stride_n, first, n_valid, out[1], wgmma_layout(W1, WARPS_N), W1, d_valid - W0)
    else:
        store_rows(base, stride_n, first, n_valid, out, wgmma_layout(HEAD_DIM, WARPS_N), HEAD_DIM, d_valid)
