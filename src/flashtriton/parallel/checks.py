"""The checks that ring_attention and ulysses_attention share on each rank, and the fields every rank of a call
must agree on (comm.agree)."""

from __future__ import annotations

import struct
import zlib

import torch

from .. import validation as V
from ..chunked import _check_inputs
from .comm import check_backend
from .layout import check_layout



def check_shards(q, k, v, group, causal, window_size, softmax_scale, softcap, layout):
    """This rank's checks that ring_attention and ulysses_attention share: q, k, v 4-D tensors of one sequence's
    shard, a backend that moves them, the variant's arguments and the layout -> (window, softcap, scale,
    layout), checked."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        V.check_tensors(("q", "k", "v"), (q, k, v), 4, "(batch, seqlen / world, nheads, headdim)")
    check_backend(group, q.device)
    window, softcap, scale = _check_inputs(q, k, v, 0, 0, causal, window_size, softmax_scale, softcap)
    layout = check_layout(layout)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"k and v must be shards of the same sequence as q: q has {q.shape[1]} positions "
                         f"here, k and v {k.shape[1]}")
    return window, softcap, scale, layout


def shard_fields(q, k, v, causal, window, softcap, scale, layout, sink=None) -> dict:
    """What every rank of a ring or Ulysses call must agree on (`agree`)."""
    return {
        "q's shard shape": tuple(q.shape), "k's shard shape": tuple(k.shape), "v's shard shape": tuple(v.shape),
        "dtype": q.dtype, "device type": q.device.type, "causal": causal, "window_size": window,
        "softcap": softcap, "softmax_scale": scale, "layout": layout,
        "requires_grad": torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sink)),
        "learnable_sink": sink is not None,
    }


def check_documents(cu_seqlens, q, k, v, world: int) -> list[int]:
    """Packed documents: q, k, v 3-D shards (tokens / world, nheads, headdim) and cu_seqlens the whole packed
    sequence's document boundaries (int32, 1-D, from 0 to world · the shard's tokens, non-decreasing) -> the
    boundaries as a list (one copy to the host)."""
    V.check_tensors(("q", "k", "v"), (q, k, v), 3, "(total_tokens / world, nheads, headdim) with cu_seqlens")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise TypeError("cu_seqlens must be a 1-D int32 torch.Tensor (the whole packed sequence's document "
                        "boundaries, flash_attn_varlen_func's), got "
                        + (f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}"
                           if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__))
    bounds = cu_seqlens.tolist()
    total = q.shape[0] * world
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"cu_seqlens must run from 0 to the whole packed sequence's length ({total} = {world} "
                         f"ranks x {q.shape[0]} tokens), got {bounds[:3]}...{bounds[-2:]} ({len(bounds)} entries)")
    if any(b < a for a, b in zip(bounds[:-1], bounds[1:])):
        i = next(i for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])) if b < a)
        raise ValueError(f"cu_seqlens must be non-decreasing, got cu_seqlens[{i}]={bounds[i]} > "
                         f"cu_seqlens[{i + 1}]={bounds[i + 1]}")
    return bounds


def documents_field(bounds: list[int]) -> int:
    """The document boundaries as one agreement field (`comm.agree`): a checksum of their values."""
    return zlib.crc32(struct.pack(f"<{len(bounds)}q", *bounds)) + (len(bounds) << 32)
