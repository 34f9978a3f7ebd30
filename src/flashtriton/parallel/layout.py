"""How a sequence is cut over the ranks of a group, and `shard` / `unshard` to cut and rebuild it.

    contiguous: rank r holds positions [r·n, (r + 1)·n), n = S / world
    zigzag:     the sequence in 2·world chunks of c = S / (2·world); rank r holds chunks r and 2·world - 1 - r
                (its shard is the two back to back), so that under a causal mask every rank has the same work

A rank's shard is a list of segments (row in the shard, first position, length): the ring's step plans and
Ulysses' reordering read positions from it, never from the layout's name.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from .comm import agree, group_info

LAYOUTS = ("zigzag", "contiguous")


class Segment(NamedTuple):
    row: int  # first row of the segment in the rank's shard
    pos: int  # its first position in the sequence
    length: int


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def parts_per_rank(layout: str) -> int:
    """Equal pieces of a shard (zigzag: 2, contiguous: 1): a rank's sequence length must be a multiple of it."""
    return 2 if layout == "zigzag" else 1


def segments(layout: str, rank: int, world: int, seqlen_local: int) -> list[Segment]:
    """The positions of rank `rank`'s shard of `seqlen_local` rows, in shard order."""
    if layout == "contiguous":
        return [Segment(0, rank * seqlen_local, seqlen_local)]
    c = seqlen_local // 2
    return [Segment(0, rank * c, c), Segment(c, (2 * world - 1 - rank) * c, c)]


def _check_dim(name: str, x, dim: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int naming one of {name}'s {x.dim()} dims, got {dim!r}")
    return dim % x.dim()


def shard(x: torch.Tensor, group=None, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """This rank's part of a full sequence x along `dim` (default 1: flash-attn's (B, S, H, D); position ids
    (B, S) shard the same way). contiguous: a view; zigzag: a new tensor (two chunks back to back).
    Differentiable. Raises ValueError when the length does not divide as the layout needs (S a multiple of
    world, zigzag 2·world)."""
    group, rank, world = group_info(group)
    layout = check_layout(layout)
    dim = _check_dim("x", x, dim)
    pieces = parts_per_rank(layout) * world
    length = x.shape[dim]
    if length % pieces:
        raise ValueError(f"x's length along dim {dim} ({length}) must be a multiple of {pieces} for layout="
                         f"{layout!r} over {world} ranks ({'2 x ' if layout == 'zigzag' else ''}the world size)")
    n = length // world
    parts = [x.narrow(dim, s.pos, s.length) for s in segments(layout, rank, world, n)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def unshard(x: torch.Tensor, group=None, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard x (the inverse of `shard`), on every rank: one all_gather.
    Not differentiable. Every rank's shard must have the same shape and dtype (checked: ValueError on every
    rank otherwise)."""
    group, rank, world = group_info(group)
    error = None
    try:
        layout = check_layout(layout)
        dim = _check_dim("x", x, dim)
        if x.shape[dim] % parts_per_rank(layout):
            raise ValueError(f"x's length along dim {dim} ({x.shape[dim]}) must be even for layout='zigzag' "
                             "(a shard holds two equal chunks)")
    except (TypeError, ValueError) as e:
        error = e
    signature = {} if error else {"x's shape": list(x.shape), "x's dtype": x.dtype, "dim": dim, "layout": layout}
    agree(group, x.device if isinstance(x, torch.Tensor) else None, "unshard", signature, error)
    x = x.contiguous()
    gathered = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(gathered, x, group=group)
    n = x.shape[dim]
    full_shape = list(x.shape)
    full_shape[dim] = n * world
    out = x.new_empty(full_shape)
    for r, part in enumerate(gathered):
        for s in segments(layout, r, world, n):
            out.narrow(dim, s.pos, s.length).copy_(part.narrow(dim, s.row, s.length))
    return out
