"""All-to-all (DeepSpeed-Ulysses) attention: trade the sequence shard of every head for the whole sequence of a
share of the heads, attend locally, and trade back.

    q (B, S / world, Hq, D)  --all_to_all-->  (B, S, Hq / world, D)  --flash_attn_func-->  (B, S, Hq / world, Dv)
                             <--all_to_all--  out (B, S / world, Hq, Dv)

Rank r takes query heads [r·Hq/world, (r + 1)·Hq/world) and the kv heads they read: Hkv / world of them when
world divides Hkv, else (world a multiple of Hkv) the one kv head its query heads share, sent by each rank to the
world / Hkv ranks that need it (their gradients summed on the way back, in a fixed order). Two all_to_all calls
forward and two backward (the gradient of one is the other); every tensor moves once each way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import validation as V
from ..interface import flash_attn_func, flash_attn_varlen_func
from .checks import check_documents, check_shards, documents_field, shard_fields
from .comm import agree, group_info
from .layout import parts_per_rank, segments


def _position_order(layout: str, world: int, n: int) -> list[int]:
    """The gathered sequence comes in rank order of the shards, each its layout's segments: the index, in that
    order, of the chunk that holds each chunk of positions (chunks of n / parts_per_rank rows)."""
    chunks = []
    for rank in range(world):
        chunks += [s.pos for s in segments(layout, rank, world, n)]
    return sorted(range(len(chunks)), key=lambda i: chunks[i])


def _reorder(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    """x (B, S, h, D) with its S rows in len(order) equal chunks, chunk i of the result = chunk order[i] of x."""
    if order == sorted(order):
        return x
    b, s, h, d = x.shape
    return x.view(b, len(order), s // len(order), h, d)[:, order].reshape(b, s, h, d)


def _inverse(order: list[int]) -> list[int]:
    inv = [0] * len(order)
    for i, o in enumerate(order):
        inv[o] = i
    return inv


def _seq_to_heads(x: torch.Tensor, group, world: int, order: list[int]) -> torch.Tensor:
    """(B, n, world·h, D) -> (B, world·n, h, D): this rank's h heads over the whole sequence, in position order."""
    b, n, heads, d = x.shape
    send = x.view(b, n, world, heads // world, d).permute(2, 0, 1, 3, 4).contiguous()  # (world, B, n, h, D)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # slot s: rank s's shard of this rank's heads
    return _reorder(recv.permute(1, 0, 2, 3, 4).reshape(b, world * n, heads // world, d), order)


def _heads_to_seq(y: torch.Tensor, group, world: int, order: list[int]) -> torch.Tensor:
    """The inverse of `_seq_to_heads`: (B, world·n, h, D) in position order -> (B, n, world·h, D)."""
    b, s, h, d = y.shape
    y = _reorder(y, _inverse(order))
    send = y.view(b, world, s // world, h, d).permute(1, 0, 2, 3, 4).contiguous()  # (world, B, n, h, D)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # slot s: this rank's shard of rank s's heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // world, world * h, d)


class _SeqToHeads(torch.autograd.Function):
    """`_seq_to_heads`, after repeating each head `repeat` times (kv heads fewer than ranks); the backward is
    `_heads_to_seq` and the sum over the repeats."""

    @staticmethod
    def forward(ctx, x, group, world, order, repeat):
        ctx.args = (group, world, order, repeat)
        if repeat > 1:
            x = x.repeat_interleave(repeat, dim=2)
        return _seq_to_heads(x, group, world, order)

    @staticmethod
    def backward(ctx, grad):
        group, world, order, repeat = ctx.args
        g = _heads_to_seq(grad.contiguous(), group, world, order)
        if repeat > 1:
            b, n, heads, d = g.shape
            g = g.view(b, n, heads // repeat, repeat, d).sum(3)
        return g, None, None, None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, world, order):
        ctx.args = (group, world, order)
        return _heads_to_seq(y, group, world, order)

    @staticmethod
    def backward(ctx, grad):
        group, world, order = ctx.args
        return _seq_to_heads(grad.contiguous(), group, world, order), None, None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, group=None,
                      layout: str = "contiguous", softmax_scale: float | None = None,
                      window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                      cu_seqlens: torch.Tensor | None = None,
                      learnable_sink: torch.Tensor | None = None, return_lse: bool = False):
    """Exact attention over a sequence sharded over the ranks of `group`, by all-to-all over the heads.

    Arguments:
        q: (batch, seqlen / world, nheads, headdim), this rank's shard; nheads a multiple of the world size.
        k, v: (batch, seqlen / world, nheads_k, headdim / headdim_v); nheads_k a multiple of the world size, or the
            world size a multiple of nheads_k (GQA / MQA).
        causal, window_size, softcap, softmax_scale: as `flash_attn_func` on the whole sequence.
        group: as `ring_attention`'s.
        layout: how the shards cut the sequence, as `shard` cut it: "contiguous" (default) or "zigzag" (the
            gathered sequence is put in position order before the kernel, and back after).
        cu_seqlens: packed documents, as `ring_attention`'s: q, k, v (total / world, heads, ...) shards of the
            packed tokens, cu_seqlens the whole packed sequence's int32 document boundaries (the same on every
            rank); the local kernel is `flash_attn_varlen_func` over the gathered sequence.
        learnable_sink: (nheads,) attention sinks, as `ring_attention`'s (each rank uses its heads' and gives
            their gradient over the whole sequence).
        return_lse: also return the log-sum-exp, as `ring_attention`'s (natural log, fp32; (batch, nheads,
            seqlen / world), with cu_seqlens (nheads, total / world)): the local kernel's, sent back to its
            positions' ranks with the output; differentiable.
    Returns:
        out: (batch, seqlen / world, nheads, headdim_v) (with cu_seqlens (total / world, nheads, headdim_v)),
        this rank's shard of the output; (out, lse) with return_lse.

    Collective, checked on every rank as `ring_attention` is (one small all_gather first); differentiable through
    the all-to-alls and flashtriton's kernels; deterministic.
    """
    group, rank, world = group_info(group)
    error, bounds = None, None
    try:
        if cu_seqlens is not None:
            bounds = check_documents(cu_seqlens, q, k, v, world)
            q, k, v = q[None], k[None], v[None]
        window, softcap, scale, layout = check_shards(q, k, v, group, causal, window_size, softmax_scale, softcap,
                                                      layout)
        if q.shape[1] % parts_per_rank(layout):
            raise ValueError(f"q's shard ({q.shape[1]} positions) must be even for layout='zigzag'")
        if q.shape[2] % world:
            raise ValueError(f"q's heads ({q.shape[2]}) must be a multiple of the world size ({world}) for "
                             "ulysses_attention (ring_attention takes any)")
        if k.shape[2] % world and world % k.shape[2]:
            raise ValueError(f"k and v's heads ({k.shape[2]}) must be a multiple of the world size ({world}) or "
                             "divide it for ulysses_attention (ring_attention takes any)")
        learnable_sink = V.check_sink(learnable_sink, q.shape[2], q.dtype, q.device)
        if not isinstance(return_lse, bool):
            raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    except (TypeError, ValueError, NotImplementedError, RuntimeError) as e:
        error = e
    fields = {} if error else {**shard_fields(q, k, v, causal, window, softcap, scale, layout, learnable_sink),
                               "cu_seqlens": -1 if bounds is None else documents_field(bounds)}
    agree(group, q.device if isinstance(q, torch.Tensor) else None, "ulysses_attention", fields, error)
    order = _position_order(layout, world, q.shape[1])
    repeat = 1 if k.shape[2] % world == 0 else world // k.shape[2]
    qh = _SeqToHeads.apply(q, group, world, order, 1)
    kh, vh = (_SeqToHeads.apply(t, group, world, order, repeat) for t in (k, v))
    heads = q.shape[2] // world
    sink = None if learnable_sink is None else learnable_sink[rank * heads:(rank + 1) * heads]
    # (with return_lse the kernel's lse too: asked for only then, so that a call without it does no lse work)
    if bounds is None:
        result = flash_attn_func(qh, kh, vh, softmax_scale=scale, causal=causal, window_size=window, softcap=softcap,
                                 learnable_sink=sink, return_attn_probs=return_lse)
        out = _HeadsToSeq.apply(result[0] if return_lse else result, group, world, order)
        if not return_lse:
            return out
        # lse (B, h, S) -> (B, S, h, 1), sent as the output is -> (B, S / world, H, 1) -> (B, H, S / world)
        lse = _HeadsToSeq.apply(result[1].transpose(1, 2)[..., None].contiguous(), group, world, order)
        return out, lse[..., 0].transpose(1, 2)
    cu = cu_seqlens.to(q.device, non_blocking=True)
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    result = flash_attn_varlen_func(qh[0], kh[0], vh[0], cu, cu, longest, longest, softmax_scale=scale,
                                    causal=causal, window_size=window, softcap=softcap, learnable_sink=sink,
                                    return_attn_probs=return_lse)
    out = _HeadsToSeq.apply((result[0] if return_lse else result)[None], group, world, order)[0]
    if not return_lse:
        return out
    # lse (h, total) -> (1, total, h, 1) -> (1, total / world, H, 1) -> (H, total / world)
    lse = _HeadsToSeq.apply(result[1].transpose(0, 1)[None, :, :, None].contiguous(), group, world, order)
    return out, lse[0, :, :, 0].transpose(0, 1)
