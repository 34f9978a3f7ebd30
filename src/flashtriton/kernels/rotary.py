"""Rotary embedding inside the decode kernels (flash-attn's `rotary_cos` / `rotary_sin`): the device helpers that
rotate a tile of rows as it is loaded, q in the decode kernels' prologue and the new keys in the append.

The tables are (seqlen_ro, ROTARY_DIM / 2), contiguous, in the inputs' dtype; a row at position p is rotated with
table row p. Only the first ROTARY_DIM columns rotate, in pairs (x_a, x_b) with table column c:
    x_a' = x_a · cos[p, c] - x_b · sin[p, c]        x_b' = x_b · cos[p, c] + x_a · sin[p, c]
INTERLEAVED (GPT-J): pairs (2c, 2c + 1); otherwise (GPT-NeoX): pairs (c, c + ROTARY_DIM / 2). The rotation is
computed in fp32 (flash-attn's rule) and rounded to the tile's dtype by the caller. A tile reads its partner
columns with a second load (`rotary_columns` gives their indices), which costs nothing next to the cache.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rotary_columns(offs_d, ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """For the columns offs_d of a tile: (partner, col, first, rotated): the column each one pairs with (itself
    past ROTARY_DIM), its table column, whether it is its pair's first (its sin term is subtracted), and whether
    it rotates at all (offs_d < ROTARY_DIM)."""
    if INTERLEAVED:
        partner = offs_d ^ 1
        col = offs_d // 2
        first = (offs_d % 2) == 0
    else:
        first = offs_d < ROTARY_DIM // 2
        partner = tl.where(first, offs_d + ROTARY_DIM // 2, offs_d - ROTARY_DIM // 2)
        col = tl.where(first, offs_d, offs_d - ROTARY_DIM // 2)
    rotated = offs_d < ROTARY_DIM
    partner = tl.where(rotated, partner, offs_d)
    col = tl.where(rotated, col, 0)
    return partner, col, first, rotated


@triton.jit
def rotate(x, x_partner, COS, SIN, pos, row_ok, col, first, rotated, ROTARY_DIM: tl.constexpr):
    """The tile x (rows, BLOCK_D) rotated at the table rows pos (rows,), in fp32; x_partner: x's values at the
    `rotary_columns` partners. Rows outside row_ok read no table entry (and are returned as they are)."""
    offs = pos.to(tl.int64)[:, None] * (ROTARY_DIM // 2) + col[None, :]
    mask = row_ok[:, None] & rotated[None, :]
    cos = tl.load(COS + offs, mask=mask, other=1.0).to(tl.float32)
    sin = tl.load(SIN + offs, mask=mask, other=0.0).to(tl.float32)
    x = x.to(tl.float32)
    signed = tl.where(first[None, :], -x_partner.to(tl.float32), x_partner.to(tl.float32))
    return tl.where(mask, x * cos + signed * sin, x)
