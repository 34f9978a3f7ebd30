"""What the Hopper Gluon kernels (`forward_gluon`, `backward_gluon`) share: the wgmma accumulator layout, TMA
loads and stores of one head's rows from dense (B, S, H, D) or packed (total, H, D) tensors, a varlen sequence's
bounds, and on the host their tensor descriptors and the shared-memory limit."""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .host import gluon_tile_width
from .variant import dropout_fields

SHARED_MEMORY_LIMIT = 227 * 1024  # bytes a program may hold on sm_90 (H100 / H200)


@gluon.constexpr_function
def wgmma_layout(n, warps_n=1):
    """Registers of a (64, n) wgmma accumulator: held by one warpgroup (4 warps along the rows; warps_n = 1), the
    layout of the scores (n = a tile's keys or rows) and of the output / gradient accumulators (n = the head dim);
    or split by columns over `warps_n` warpgroups of one partition, each holding (64, n / warps_n) (the wide
    head dims' backward: `backward_gluon`, WIDE)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, warps_n], instr_shape=[16, n // warps_n, 16])


def product_width(head_dim: int) -> int:
    """The columns a Gluon kernel's products over a head dim of `head_dim` in tiles of `head_block(head_dim)` run
    on (`mma_nt`): the head dim rounded up to 16 (a wgmma's step) and on to a sum of at most three powers of two
    (one wgmma each), or the tile's width where that is no narrower (D=96: 64 + 32 of 128; 192: 128 + 64 of 256)."""
    tile = head_block(head_dim)
    width = -(-head_dim // 16) * 16
    while bin(width).count("1") > 3:
        width += 16
    return min(width, tile)


def trimmed_width(head_dim: int, tiles, max_pieces: int = 3) -> int:
    """`product_width(head_dim)` where it is narrower than the head's tiles, their width is one of `tiles` (a
    switch's tile widths) and it takes at most `max_pieces` wgmmas; 0 (the whole tile) elsewhere."""
    width = product_width(head_dim)
    return width if (width < head_block(head_dim) and head_block(head_dim) in tiles
                     and bin(width).count("1") <= max_pieces) else 0


@gluon.constexpr_function
def width_piece(width, index):
    """Piece `index` of `width` as powers of two, the largest first; 0 past the last (`mma_nt`)."""
    pieces = [1 << b for b in reversed(range(width.bit_length())) if width >> b & 1]
    return pieces[index] if index < len(pieces) else 0


@gluon.constexpr_function
def width_pieces(width):
    """The wgmmas (commit groups) `mma_nt` issues for a product over `width` columns: its powers of two."""
    return bin(width).count("1")


@gluon.jit
def a_operand(tile, acc_layout: gl.constexpr, IN_REGISTERS: gl.constexpr):
    """A shared-memory tile as the A operand of `mma_nt`'s wgmmas into accumulators of `acc_layout`: loaded into
    registers once (IN_REGISTERS: each product then reads only its B operand from shared memory, whose bandwidth
    bounds 64-row products at narrow head dims), else the tile itself. In registers only the whole width runs
    (`mma_nt` slices shared memory for its pieces): the caller turns it on where WIDTH is the tile's."""
    if IN_REGISTERS:
        return tile.load(gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2))
    else:
        return tile


@gluon.jit
def mma_nt(a, b, zero, WIDTH: gl.constexpr):
    """A · Bᵀ of shared-memory tiles a (M, K) and b (N, K) over their columns [0, WIDTH) (K or `product_width`'s
    narrower width: the TMA filled the columns past the head with zeros), as asynchronous wgmmas into `zero`'s
    layout: one over all K columns, else one per power of two of WIDTH (`width_pieces`, each its own commit group),
    so that a head of 96 columns in 128-column tiles takes 64 + 32. The caller waits on the returned token."""
    K: gl.constexpr = a.shape[1]
    if WIDTH == K:
        return warpgroup_mma(a, b.permute((1, 0)), zero, use_acc=False, is_async=True)
    else:
        W0: gl.constexpr = width_piece(WIDTH, 0)
        W1: gl.constexpr = width_piece(WIDTH, 1)
        W2: gl.constexpr = width_piece(WIDTH, 2)
        tok = warpgroup_mma(a.slice(0, W0, dim=1), b.slice(0, W0, dim=1).permute((1, 0)), zero, use_acc=False,
                            is_async=True)
        if W1 > 0:
            tok = warpgroup_mma(a.slice(W0, W1, dim=1), b.slice(W0, W1, dim=1).permute((1, 0)), tok, is_async=True)
        if W2 > 0:
            tok = warpgroup_mma(a.slice(W0 + W1, W2, dim=1), b.slice(W0 + W1, W2, dim=1).permute((1, 0)), tok,
                                is_async=True)
        return tok


@gluon.constexpr_function
def dropout_calls_layout(m, n):
    """Registers of the (m / 2, n / 4) Philox calls of an (m, n) score tile's dropout (`variant.dropout_keep`; m
    a multiple of 64, n of 16), each on the thread that holds its eight scores in `wgmma_layout(n)`: lane t of
    warp w holds rows 16w + t // 4 and 8 more (and 64 more, ...), keys 8r + 2 (t mod 4) and the next, and so
    call (8w + t // 4, 4 (r // 2) + t mod 4) (`variant.dropout_fields`). Moving the mask to the accumulator's
    layout moves no data between threads."""
    regs = ([[0, 4 << i] for i in range((n // 16).bit_length() - 1)]
            + [[32 << i, 0] for i in range((m // 64).bit_length() - 1)])
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[8, 0], [16, 0]], block_bases=[], shape=[m // 2, n // 4])


@gluon.constexpr_function
def dropout_calls_layout_t(m, warps_n):
    """Registers of the (m / 2, 16) Philox calls of an (m, 64) score tile whose scores a (64, m)
    `wgmma_layout(m, warps_n)` holds transposed (the dK/dV kernel's Sᵀ: keys as rows), placed so that each score
    reaches its thread within its warp: a call's eight scores (query rows r, r + 8; keys 2c + π + 8κ of a 16-key
    group) go to two lanes of the warp that holds that key group (lanes l and l ^ 4: one holds the keys with
    π = 0, the other π = 1), and the call is made on one of them, so that the transposition is an exchange of
    half of each call's fields between neighbouring lanes (shuffles), no shared memory. Lane bits: rows 2, 4,
    then row parity (which the exchange turns into π), then the key group's c (1, 2); warps: key groups, then
    (warps_n = 2) the half of the rows; registers: the rest of the rows."""
    split = [[m // 4, 0]] if warps_n == 2 else []
    regs = [[8 << i, 0] for i in range((m // 16).bit_length() - 1 - len(split))]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[2, 0], [4, 0], [1, 0], [0, 1], [0, 2]],
                                      warp_bases=[[0, 4], [0, 8]] + split, block_bases=[], shape=[m // 2, 16])


@gluon.jit
def _fields(seed, offset, bh, row0, n, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, calls: gl.constexpr):
    """`variant.dropout_fields` of the (ROWS, BLOCK_N) score tile at (row0, n), in the layout the calls leave
    them in (`calls`: `dropout_calls_layout` or `dropout_calls_layout_t`)."""
    c1 = row0 // 2 + gl.arange(0, ROWS // 2, layout=gl.SliceLayout(1, calls))
    c0 = n // 4 + gl.arange(0, BLOCK_N // 4, layout=gl.SliceLayout(0, calls))
    c0, c1 = c0[None, :] + c1[:, None] * 0, c1[:, None] + c0[None, :] * 0
    return dropout_fields(seed, offset, bh, c0, c1)


@gluon.jit
def dropout_tile(seed, offset, bh, row0, n, BLOCK_N: gl.constexpr):
    """The dropout fields of a (64, BLOCK_N) score tile in `wgmma_layout(BLOCK_N)`: rows row0 .. row0 + 63 against
    keys n .. n + BLOCK_N - 1 of sequence-and-head `bh`, for `variant.dropout_select`; bit for bit
    `variant.dropout_keep`'s mask (so the portable backward and `flashtriton.testing.dropout_mask` regenerate
    it), one Philox4x32-7 call per eight scores, each on the thread that holds them. The 32-bit fields change
    layout (register moves; booleans would be packed into bytes)."""
    fields = _fields(seed, offset, bh, row0, n, 64, BLOCK_N, dropout_calls_layout(64, BLOCK_N))
    return gl.convert_layout(fields, wgmma_layout(BLOCK_N))


@gluon.jit
def dropout_tile_t(seed, offset, bh, k0, m0, QUERIES: gl.constexpr, WARPS_N: gl.constexpr):
    """The dropout fields of a transposed (64, QUERIES) score tile in `wgmma_layout(QUERIES, WARPS_N)`: keys
    k0 .. k0 + 63 against query rows m0 .. m0 + QUERIES - 1 of sequence-and-head `bh`, for
    `variant.dropout_select` or `dropout_sign`; bit for bit `variant.dropout_keep`'s mask, transposed. Made as the
    (QUERIES, 64) tile of the queries' orientation, on the lanes `dropout_calls_layout_t` places the calls on, then
    transposed within each warp."""
    fields = _fields(seed, offset, bh, m0, k0, QUERIES, 64, dropout_calls_layout_t(QUERIES, WARPS_N))
    return gl.convert_layout(gl.permute(fields, (1, 0)), wgmma_layout(QUERIES, WARPS_N))


@gluon.jit
def sequence(off_b, CU_SEQLENS_Q, CU_SEQLENS_K, max_seqlen_q, max_seqlen_k, IS_VARLEN: gl.constexpr):
    """(q_start, seqlen_q, k_start, seqlen_k) of an item's sequence. Dense: the whole (Sq, Sk); varlen: sequence
    off_b of the packed batch, from cu_seqlens (the loops load the next item's while the current one runs)."""
    if IS_VARLEN:
        q_start = gl.load(CU_SEQLENS_Q + off_b)
        seqlen_q = gl.load(CU_SEQLENS_Q + off_b + 1) - q_start
        k_start = gl.load(CU_SEQLENS_K + off_b)
        seqlen_k = gl.load(CU_SEQLENS_K + off_b + 1) - k_start
    else:
        q_start = gl.to_tensor(0)
        seqlen_q = max_seqlen_q
        k_start = gl.to_tensor(0)
        seqlen_k = max_seqlen_k
    return q_start, seqlen_q, k_start, seqlen_k


@gluon.jit
def tma_load(desc, IS_VARLEN: gl.constexpr, off_b, row, head, bar, buf):
    """Rows [row, row + block) of one head: dense descriptors are rank 4 over (B, S, H, D), varlen ones rank 3
    over (total, H, D) with `row` a token index."""
    if IS_VARLEN:
        tma.async_copy_global_to_shared(desc, [row, head, 0], bar, buf)
    else:
        tma.async_copy_global_to_shared(desc, [off_b, row, head, 0], bar, buf)


@gluon.jit
def tma_store(desc, IS_VARLEN: gl.constexpr, off_b, row, head, buf):
    """Store `buf` to rows [row, row + block) of one head (descriptors as `tma_load`'s; rows past the tensor's end
    are clipped, but a varlen store also writes rows of the next sequence, so its callers store whole blocks only)."""
    if IS_VARLEN:
        tma.async_copy_shared_to_global(desc, [row, head, 0], buf)
    else:
        tma.async_copy_shared_to_global(desc, [off_b, row, head, 0], buf)


# ----------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------
GL_DTYPE = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


@functools.lru_cache(maxsize=None)
def smem_layout(block: tuple, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), GL_DTYPE[dtype])


# TensorDescriptor's __post_init__ re-checks what the caller checked (`common.tma_ok`: aligned base and strides,
# sizes > 0): ~10 us per descriptor on a slow host, four per forward. Built without it where the fields match.
FAST_DESCRIPTOR = [f.name for f in dataclasses.fields(TensorDescriptor)] == \
    ["base", "shape", "strides", "block_shape", "layout", "padding"]


def head_block(head_dim: int) -> int:
    """The head dim a Gluon kernel's tiles span (`host.gluon_tile_width`: D rounded up to 64, 128 or 256). A
    descriptor's block reaches past a narrower head: the TMA loads those columns as zeros (exact scores and a zero
    output there) and stores none of them."""
    return gluon_tile_width(head_dim)


def descriptor(t: torch.Tensor, rows: int, varlen: bool = False, block_d: int = 0) -> TensorDescriptor:
    """Descriptor of one (rows, head) slab: of a (B, S, H, D) tensor, rank 4 with block (1, rows, 1, block_d), or
    of a packed (total, H, D) one, rank 3 with block (rows, 1, block_d); block_d D by default, or `head_block(D)`.
    `t` must pass `common.tma_ok`."""
    head_dim = block_d or t.shape[-1]
    block = (rows, 1, head_dim) if varlen else (1, rows, 1, head_dim)
    layout = smem_layout(block, t.dtype)
    if not FAST_DESCRIPTOR:
        return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), layout)
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides, desc.block_shape, desc.layout, desc.padding = \
        t, list(t.shape), list(t.stride()), list(block), layout, "zero"
    return desc
