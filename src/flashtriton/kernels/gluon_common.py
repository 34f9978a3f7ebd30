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
from triton.experimental.gluon.language.nvidia.hopper import tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .host import gluon_tile_width

SHARED_MEMORY_LIMIT = 227 * 1024  # bytes a program may hold on sm_90 (H100 / H200)


@gluon.constexpr_function
def wgmma_layout(n, warps_n=1):
    """Registers of a (64, n) wgmma accumulator: held by one warpgroup (4 warps along the rows; warps_n = 1), the
    layout of the scores (n = a tile's keys or rows) and of the output / gradient accumulators (n = the head dim);
    or split by columns over `warps_n` warpgroups of one partition, each holding (64, n / warps_n) (the wide
    head dims' backward: `backward_gluon`, WIDE)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, warps_n], instr_shape=[16, n // warps_n, 16])


@gluon.jit
def _kept(seed, offset, bh, c0, c1, threshold):
    """The Philox calls on counters (c0, c1, bh, offset), each output compared with the threshold: (..., 2, 2),
    [..., i, j] output i + 2j, key 4 c0 + 2i + j, as `variant.dropout_keep` orders them (bh and offset: one value
    for every call)."""
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, bh, offset)
    k0 = (r0 >> 1).to(gl.int32, bitcast=True) >= threshold
    k1 = (r1 >> 1).to(gl.int32, bitcast=True) >= threshold
    k2 = (r2 >> 1).to(gl.int32, bitcast=True) >= threshold
    k3 = (r3 >> 1).to(gl.int32, bitcast=True) >= threshold
    return gl.join(gl.join(k0, k1), gl.join(k2, k3))


@gluon.constexpr_function
def dropout_calls_layout(n):
    """Registers of the (64, n / 4) Philox calls of a (64, n) score tile's dropout (`dropout_keep`): call (i, g)
    draws the bits of keys 4g .. 4g + 3 of row i (`variant.dropout_keep`'s counters). Lane t of warp w holds the
    calls of row 16w + t // 4 + 8 (t mod 2) and groups 2r + (t // 2 mod 2), r = 0 .. n / 8 - 1 its registers. In
    `wgmma_layout(n)` that thread holds rows 16w + t // 4 and 16w + t // 4 + 8, keys 8r + 2 (t mod 4) and the next:
    each call lands on a thread that holds half of its keys, and the conversion to the accumulator's layout swaps
    one register bit for one lane bit (warp shuffles between neighbouring lanes, no shared memory)."""
    regs = [[0, 2 << i] for i in range((n // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[8, 0], [0, 1], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, n // 4])


@gluon.jit
def dropout_keep(seed, offset, bh, row0, n, threshold, BLOCK_N: gl.constexpr):
    """The keep-mask of a (64, BLOCK_N) score tile in `wgmma_layout(BLOCK_N)`: rows row0 .. row0 + 63 against keys
    n .. n + BLOCK_N - 1 of sequence-and-head `bh`, bit for bit `variant.dropout_keep`'s (so the portable
    backward and `flashtriton.testing.dropout_mask` regenerate it): one Philox4x32-10 call per four keys of a row,
    in `dropout_calls_layout`, compared with the threshold there, then moved to the accumulator's layout."""
    calls: gl.constexpr = dropout_calls_layout(BLOCK_N)
    rows = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, calls))
    groups = n // 4 + gl.arange(0, BLOCK_N // 4, layout=gl.SliceLayout(0, calls))
    c0 = groups[None, :] + rows[:, None] * 0
    c1 = rows[:, None] + groups[None, :] * 0
    keep = gl.reshape(_kept(seed, offset, bh, c0, c1, threshold), [64, BLOCK_N])
    return gl.convert_layout(keep, wgmma_layout(BLOCK_N))


@gluon.constexpr_function
def dropout_calls_layout_t(m):
    """`dropout_calls_layout` for a transposed (64 keys, m queries) score tile, the dK/dV kernel's: its (16, m)
    Philox calls, call (g, i) for keys 4g .. 4g + 3 of query i. In `wgmma_layout(m)` lane t of warp w holds keys
    16w + 4 (t // 16) + (t // 4 mod 4) and 8 more, queries 8r + 2 (t mod 4) and the next: the four keys of a group
    lie in the four lanes that differ in t // 4 mod 4, which between them hold two groups (keys k, k + 8) of two
    queries, four calls. Here those lanes take one call each (lane bit 2: the next query, bit 3: the group 8 keys
    on), so that each call's outputs go to the lanes of its group."""
    regs = [[0, 8 << i] for i in range((m // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 2], [0, 4], [0, 1], [2, 0], [1, 0]],
                                      warp_bases=[[4, 0], [8, 0]], block_bases=[], shape=[16, m])


@gluon.jit
def dropout_keep_t(seed, offset, bh, k0, m0, threshold, QUERIES: gl.constexpr, layout: gl.constexpr):
    """The keep-mask of a transposed (64, QUERIES) score tile in `layout` (the tile's: `wgmma_layout(QUERIES)`, or
    split by columns over two warpgroups): keys k0 .. k0 + 63 against query rows m0 .. m0 + QUERIES - 1 of
    sequence-and-head `bh`, bit for bit `variant.dropout_keep`'s with KEYS_FIRST (k0 a multiple of 4)."""
    calls: gl.constexpr = dropout_calls_layout_t(QUERIES)
    groups = k0 // 4 + gl.arange(0, 16, layout=gl.SliceLayout(1, calls))
    rows = m0 + gl.arange(0, QUERIES, layout=gl.SliceLayout(0, calls))
    c0 = groups[:, None] + rows[None, :] * 0  # (16, QUERIES)
    c1 = rows[None, :] + groups[:, None] * 0
    keep = _kept(seed, offset, bh, c0, c1, threshold)  # (16, QUERIES, 2, 2)
    keep = gl.reshape(gl.permute(keep, (0, 2, 3, 1)), [64, QUERIES])
    return gl.convert_layout(keep, layout)  # (shared memory by stmatrix / ldmatrix for wgmma_layout(QUERIES))


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
