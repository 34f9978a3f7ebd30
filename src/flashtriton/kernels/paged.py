"""Keys through a block table (paged KV) and per-sequence key counts (seqused_k) for the portable forward.

Paged: k and v are pools of pages (num_pages, PAGE_SIZE, Hkv, D); key j of sequence b is row j % PAGE_SIZE of page
`block_table[b, j // PAGE_SIZE]` (flash-attn's layout). Any page size works: where PAGE_SIZE is a multiple of
BLOCK_N a key tile lies in one page (one block-table entry per tile), else each key row's page is looked up.

A sequence's key count is cu_seqlens_k[b + 1] - cu_seqlens_k[b], or seqused_k[b] where given. Its values live on
the GPU, so the kernel checks them without a sync: a sequence whose key count is negative or more than it has (its
block-table row's pages × PAGE_SIZE, or its cu_seqlens_k length without pages), or one of whose used pages
(entries 0 .. ceil(keys / PAGE_SIZE) - 1 of its row) is not in [0, num_pages), reads no key and gets NaN in every
output row and lse (`sequence_keys`, `poison`). Every program of the sequence checks the whole row, so the NaN
does not depend on which keys a program's band reads.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Most keys one sequence may hold: key positions, page offsets and the window's sides stay within int32.
KEY_LIMIT = 2**30

# Block-table entries checked per load by `_bad_pages`.
PAGE_CHECK_BLOCK = tl.constexpr(256)


@triton.jit
def sequence_keys(BLOCK_TABLE, stride_btb, SEQUSED_K, off_b, seqlen_k, capacity, num_pages,
                  PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_SEQUSED_K: tl.constexpr):
    """(key count, ok) of sequence off_b, whose cu_seqlens_k length is `seqlen_k`: the count is seqused_k's value
    where HAS_SEQUSED_K; `capacity` (the row's pages × PAGE_SIZE) and `num_pages` bound a paged sequence, whose
    block-table row is checked from BLOCK_TABLE. A sequence that is not ok has key count 0 (the caller poisons its
    rows). (A compiled Triton function cannot return None, so the block-table row is the caller's to make.)"""
    limit = capacity if PAGED else seqlen_k
    if HAS_SEQUSED_K:
        seqlen_k = tl.load(SEQUSED_K + off_b)
    ok = (seqlen_k >= 0) & (seqlen_k <= limit)
    seqlen_k = tl.where(ok, seqlen_k, 0)
    if PAGED:
        bt_row = BLOCK_TABLE + off_b.to(tl.int64) * stride_btb
        ok = ok & (_bad_pages(bt_row, tl.cdiv(seqlen_k, PAGE_SIZE), num_pages) == 0)
        seqlen_k = tl.where(ok, seqlen_k, 0)
    return seqlen_k, ok


@triton.jit
def _bad_pages(bt_row, n_pages, num_pages):
    """How many of the block-table entries bt_row[0:n_pages] are not pages of the pool [0, num_pages)."""
    offs = tl.arange(0, PAGE_CHECK_BLOCK)
    n_bad = 0
    for p0 in range(0, n_pages, PAGE_CHECK_BLOCK):
        p = p0 + offs
        pages = tl.load(bt_row + p, mask=p < n_pages, other=0)
        n_bad += tl.sum(((pages < 0) | (pages >= num_pages)).to(tl.int32))
    return n_bad


@triton.jit
def page_rows(bt_row, n, cols, seqlen_k, stride_kp, stride_kn, stride_vp, stride_vn,
              MASKED: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """(k_rows, v_rows): int64 (BLOCK_N,) element offsets of keys `cols` (the tile starting at key n) in the paged
    K and V. Entries are read only for keys inside the sequence (`sequence_keys` checked them all); rows past its
    end are left to the caller's mask."""
    if PAGE_SIZE % BLOCK_N == 0:  # the tile lies in one page
        pages = tl.load(bt_row + n // PAGE_SIZE).to(tl.int64)
    elif MASKED:
        pages = tl.load(bt_row + cols // PAGE_SIZE, mask=cols < seqlen_k, other=0).to(tl.int64)
    else:
        pages = tl.load(bt_row + cols // PAGE_SIZE).to(tl.int64)
    within = (cols % PAGE_SIZE).to(tl.int64)
    return pages * stride_kp + within * stride_kn, pages * stride_vp + within * stride_vn


@triton.jit
def poison(out, lse, ok):
    """out and lse, or NaN everywhere for a sequence whose values are out of range (not ok)."""
    return tl.where(ok, out, float("nan")), tl.where(ok, lse, float("nan"))
