"""`flash_attn_combine`: FlashAttention-3's merge of split attention results through their log-sum-exps."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import validation as V
from .kernels.combine import combine_partials

OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 512  # FA3's bound; the kernel keeps a whole padded head dim per row in registers


def flash_attn_combine(out_partial: torch.Tensor, lse_partial: torch.Tensor, out: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention computed over disjoint parts of the keys (split-KV, ring or context-parallel attention),
    FlashAttention-3's `flash_attn_combine` (hopper/flash_attn_interface.py, `mha_combine`).

    Split s holds, per query row, the attention over its part of the keys: out_s, normalised over that part, and
    lse_s = log sum exp(scores) over it (natural log). The merge is the attention over all the keys:

        lse = log sum_s exp(lse_s),    out = sum_s exp(lse_s - lse) * out_s

    Arguments:
        out_partial: (num_splits, batch, seqlen, nheads, headdim) float32, num_splits >= 1, headdim <= 512.
            Or the varlen form (num_splits, total_q, nheads, headdim) (FA4's), with lse_partial
            (num_splits, total_q, nheads) and out (total_q, nheads, headdim).
        lse_partial: (num_splits, batch, seqlen, nheads) float32. A split with lse -inf (it saw no key of the row)
            contributes nothing, whatever its out_partial holds; a row whose splits are all -inf gets out 0 and
            lse -inf. flashtriton's own lse is (batch, nheads, seqlen): `torch.stack(lses).transpose(2, 3)` is this
            layout (a view; any strides are taken).
        out: optional (batch, seqlen, nheads, headdim) tensor of dtype out_dtype to write into (and return).
        out_dtype: float32 (default: out_partial's dtype), float16 or bfloat16. As in FA3, an `out` of another
            dtype than this is refused.
    Returns:
        (out, lse): out (batch, seqlen, nheads, headdim) of out_dtype; lse (batch, seqlen, nheads) float32, a
        transposed view of a (batch, nheads, seqlen) tensor (FA3's layout).

    Accumulation is fp32, in one Triton kernel; under torch.compile the ops flashtriton::combine (and
    flashtriton::combine_out for out=). Differentiable in out_partial and lse_partial (FA3's is not): the backward
    is a few fp32 torch ops, d out_s = w_s * d out and d lse_s = w_s * (d out . (out_s - out) + d lse) with
    w_s = exp(lse_s - lse) (0 for a split with lse -inf). With `out=` given nothing may require grad (an in-place
    result has no autograd history here): that raises.
    """
    names = ("out_partial", "lse_partial")
    for name, t in zip(names, (out_partial, lse_partial)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32 (FA3's partial results), got {t.dtype}")
    V.check_not_transformed(names, (out_partial, lse_partial))
    varlen = out_partial.dim() == 4
    if out_partial.dim() not in (4, 5):
        raise ValueError("out_partial must have 5 dims (num_splits, batch, seqlen, nheads, headdim) or 4 "
                         f"(num_splits, total_q, nheads, headdim), got shape {tuple(out_partial.shape)}")
    if tuple(lse_partial.shape) != tuple(out_partial.shape[:-1]):
        layout = "(num_splits, total_q, nheads)" if varlen else "(num_splits, batch, seqlen, nheads)"
        raise ValueError(f"lse_partial must have shape {layout} = {tuple(out_partial.shape[:-1])} to match "
                         f"out_partial {tuple(out_partial.shape)}, got {tuple(lse_partial.shape)}")
    if out_partial.shape[0] < 1:
        raise ValueError("out_partial must hold at least one split (num_splits >= 1), got 0")
    if out_partial.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"out_partial's headdim must be at most {MAX_HEAD_DIM} (as FA3), got {out_partial.shape[-1]}")
    out_type = out_partial.dtype if out_dtype is None else out_dtype
    if out_type not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.float32, torch.float16 or torch.bfloat16, got {out_dtype!r}")
    if varlen:  # batch 1: views, and the same kernel
        out_partial, lse_partial = out_partial.unsqueeze(1), lse_partial.unsqueeze(1)
    shape = tuple(out_partial.shape[1:])
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
        if out.dtype != out_type:
            raise TypeError(f"out must have dtype {out_type} (out_dtype, default out_partial's), got {out.dtype}: "
                            "pass out_dtype=out.dtype")
        expected = shape[1:] if varlen else shape
        if tuple(out.shape) != expected:
            raise ValueError(f"out must have shape {expected} to match out_partial, got {tuple(out.shape)}")
        if any(st == 0 and n > 1 for st, n in zip(out.stride(), out.shape)):
            raise ValueError(f"out must not have a stride-0 (broadcast) dimension, got strides {out.stride()}")
        if torch.is_grad_enabled() and (out_partial.requires_grad or lse_partial.requires_grad or out.requires_grad):
            raise RuntimeError("flash_attn_combine with out= is not differentiable: call it without out= (the "
                               "result then carries the gradient) or under torch.no_grad()")
        V.check_device(names + ("out",), (out_partial, lse_partial, out))
        out_view = out.unsqueeze(0) if varlen else out
    else:
        V.check_device(names, (out_partial, lse_partial))
        out_view = None
    V.check_grid(shape[0], shape[2])
    # Under torch.compile / export (or any dispatch mode, or tensor subclasses) the call becomes a registered op
    # (an opaque node, no graph break); eager calls skip the dispatcher.
    tracing = (torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
               or not V.plain_tensors(out_partial, lse_partial, out_view, names=names + ("out",)))
    if out_view is not None:
        lse = (combine_out_op if tracing else _combine_out)(out_partial, lse_partial, out_view)
        return out, (lse[0] if varlen else lse)
    if tracing:
        result, lse = combine_op(out_partial, lse_partial, out_type)
    elif torch.is_grad_enabled() and (out_partial.requires_grad or lse_partial.requires_grad):
        result, lse = _EagerCombine.apply(out_partial, lse_partial, out_type)
    else:
        result, lse = _combine(out_partial, lse_partial, out_type)
    return (result[0], lse[0]) if varlen else (result, lse)


def _new_lse(out_partial: torch.Tensor) -> torch.Tensor:
    """(batch, seqlen, nheads) fp32 over (batch, nheads, seqlen) storage, FA3's layout."""
    batch, seqlen, heads = out_partial.shape[1:4]
    return out_partial.new_empty((batch, heads, seqlen), dtype=torch.float32).transpose(1, 2)


def _combine(out_partial, lse_partial, out_dtype):
    out = out_partial.new_empty(out_partial.shape[1:], dtype=out_dtype)
    lse = _new_lse(out_partial)
    combine_partials(out_partial, lse_partial, out, lse)
    return out, lse


def _combine_out(out_partial, lse_partial, out):
    lse = _new_lse(out_partial)
    combine_partials(out_partial, lse_partial, out, lse)
    return lse


@torch.library.custom_op("flashtriton::combine", mutates_args=())
def combine_op(out_partial: torch.Tensor, lse_partial: torch.Tensor,
               out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of validated inputs (see flash_attn_combine)."""
    return _combine(out_partial, lse_partial, out_dtype)


@combine_op.register_fake
def _(out_partial, lse_partial, out_dtype):
    return out_partial.new_empty(out_partial.shape[1:], dtype=out_dtype), _new_lse(out_partial)


@torch.library.custom_op("flashtriton::combine_out", mutates_args=("out",))
def combine_out_op(out_partial: torch.Tensor, lse_partial: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """lse, the merge written into out (validated; not differentiable)."""
    return _combine_out(out_partial, lse_partial, out)


@combine_out_op.register_fake
def _(out_partial, lse_partial, out):
    return _new_lse(out_partial)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1], output[1])


def _backward(ctx, dout, dlse):
    """d out_s = w_s * d out, d lse_s = w_s * (d out . (out_s - out) + d lse), w_s = exp(lse_s - lse) (0 where
    lse_s = -inf: such a split's out may hold anything), in fp32 torch ops (themselves differentiable)."""
    out_partial, lse_partial, lse = ctx.saved_tensors
    finite = torch.isfinite(lse_partial)
    w = torch.where(finite, torch.exp(lse_partial - torch.where(torch.isfinite(lse), lse, 0)), 0)
    o_parts = torch.where(finite[..., None], out_partial, 0)
    out = (w[..., None] * o_parts).sum(0)  # fp32, whatever out_dtype rounded the returned out to
    d_out_partial = w[..., None] * dout.float()
    d_lse_partial = w * ((dout.float() * (o_parts - out)).sum(-1) + torch.where(torch.isfinite(lse), dlse, 0))
    return d_out_partial, d_lse_partial, None


combine_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerCombine(torch.autograd.Function):
    """The op's forward and backward without the dispatcher (eager calls only)."""

    @staticmethod
    def forward(ctx, out_partial, lse_partial, out_dtype):
        output = _combine(out_partial, lse_partial, out_dtype)
        _setup_context(ctx, (out_partial, lse_partial, out_dtype), output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return _backward(ctx, dout, dlse)
