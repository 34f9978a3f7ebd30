"""The checks that ring_attention and ulysses_attention share on each rank, and the fields every rank of a call
must agree on (comm.agree)."""

from __future__ import annotations

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


def shard_fields(q, k, v, causal, window, softcap, scale, layout) -> dict:
    """What every rank of a ring or Ulysses call must agree on (`agree`)."""
    return {
        "q's shard shape": tuple(q.shape), "k's shard shape": tuple(k.shape), "v's shard shape": tuple(v.shape),
        "dtype": q.dtype, "device type": q.device.type, "causal": causal, "window_size": window,
        "softcap": softcap, "softmax_scale": scale, "layout": layout,
        "requires_grad": torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
    }
