"""The attention kernels as PyTorch operators: `torch.ops.flashtriton.fwd` and `torch.ops.flashtriton.bwd`.

Registering them through `torch.library` gives autograd (the backward kernels), fake implementations
(shapes only, for torch.compile / torch.export tracing) and opaque calls inside compiled graphs: a model
that calls flashtriton compiles with `fullgraph=True` and no graph break.

The ops take validated inputs (see interface.py); the host-side check of cu_seqlens' values lives inside the
op so that it runs eagerly even under torch.compile.

`attention` is what the public functions call. Outside tracing it skips the custom-op dispatcher (tens of
microseconds of host time per call, which short sequences and decoding feel) and runs the same
implementation through a plain `torch.autograd.Function`; under torch.compile / export, fake tensors or any
dispatch mode it calls the registered op.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .kernels.forward import attention_forward
from .kernels.launch import on_inputs_device
from .validation import check_cu_seqlens_values, plain_tensors


@on_inputs_device
def _forward_impl(q, k, v, softmax_scale, causal, causal_bottom_right, cu_seqlens_q, cu_seqlens_k,
                  max_seqlen_q, max_seqlen_k):
    if cu_seqlens_q is not None:
        covers_q, _ = check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q,
                                              max_seqlen_k)
        out, lse = attention_forward(
            q, k, v, softmax_scale, causal, causal_bottom_right,
            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        )
        if not covers_q:  # tokens outside every sequence: define them as 0 / -inf rather than leave garbage
            covered = _covered_rows(cu_seqlens_q, q.shape[0])
            out[~covered] = 0
            lse[:, ~covered] = float("-inf")
        return out, lse
    return attention_forward(q, k, v, softmax_scale, causal, causal_bottom_right)


@on_inputs_device
def _backward_impl(dout, q, k, v, out, lse, softmax_scale, causal, causal_bottom_right, cu_seqlens_q,
                   cu_seqlens_k, max_seqlen_q, max_seqlen_k, dlse=None):
    from .kernels.backward import attention_backward

    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    covers_all = True
    if cu_seqlens_q is not None:  # gradients of tokens outside every sequence must be 0: zero-fill only then
        covers_all = all(check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q,
                                                 max_seqlen_k))
    return attention_backward(
        dout, q, k, v, out, lse, softmax_scale, causal, causal_bottom_right,
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, zero_fill=not covers_all, dlse=dlse,
    )


@torch.library.custom_op("flashtriton::fwd", mutates_args=())
def attention_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    causal_bottom_right: bool,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out like q; lse fp32 (B, Hq, Sq) dense or (Hq, total_q) varlen."""
    return _forward_impl(q, k, v, softmax_scale, causal, causal_bottom_right, cu_seqlens_q, cu_seqlens_k,
                         max_seqlen_q, max_seqlen_k)


@attention_fwd_op.register_fake
def _(q, k, v, softmax_scale, causal, causal_bottom_right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    out = q.new_empty(q.shape)  # the kernels allocate contiguous outputs, whatever the inputs' strides
    if cu_seqlens_q is not None:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("flashtriton::bwd", mutates_args=())
def attention_bwd_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    causal_bottom_right: bool,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    dlse: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) shaped like (q, k, v); dk/dv summed over each GQA group. dlse: the gradient of lse (shaped
    like it), or None when lse is not differentiated."""
    return _backward_impl(dout, q, k, v, out, lse, softmax_scale, causal, causal_bottom_right, cu_seqlens_q,
                          cu_seqlens_k, max_seqlen_q, max_seqlen_k, dlse)


@attention_bwd_op.register_fake
def _(dout, q, k, v, out, lse, softmax_scale, causal, causal_bottom_right, cu_seqlens_q, cu_seqlens_k,
      max_seqlen_q, max_seqlen_k, dlse=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, causal_bottom_right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.args = (softmax_scale, causal, causal_bottom_right, max_seqlen_q, max_seqlen_k)
    # Outputs nothing differentiates arrive as None (no zeros allocated): lse, in most calls, costs nothing then.
    ctx.set_materialize_grads(False)


DOUBLE_BACKWARD_ERROR = (
    "flashtriton's attention backward is not differentiable (double backward): the gradients of q, k, v taken "
    "with create_graph=True hold their values but cannot be differentiated again; for second-order terms through "
    "attention use an implementation with a differentiable backward (e.g. torch's SDPA math backend)")

_DelayedError = getattr(getattr(torch._C, "_functions", None), "DelayedError", None)


def _gradients(ctx, dout, dlse, backward_fn):
    """(dq, dk, dv, None...) for the inputs saved by `_setup_context`, through `backward_fn` (the registered
    op, or its implementation when called eagerly). dout or dlse is None for an output nothing differentiates.

    The backward kernels have no derivative of their own. Under create_graph=True (grad mode on during the
    backward; torch.compile traces the backward with it off) they run without recording, and their results
    come back behind autograd's error node: differentiating them raises DOUBLE_BACKWARD_ERROR instead of
    silently adding nothing for the second-order term."""
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    softmax_scale, causal, causal_bottom_right, max_seqlen_q, max_seqlen_k = ctx.args
    if dout is None:  # only lse is differentiated
        dout = torch.zeros_like(out)
    args = (dout, q, k, v, out, lse, softmax_scale, causal, causal_bottom_right, cu_seqlens_q, cu_seqlens_k,
            max_seqlen_q, max_seqlen_k, dlse)
    if not torch.is_grad_enabled():
        dq, dk, dv = backward_fn(*args)
        return dq, dk, dv, None, None, None, None, None, None, None
    with torch.no_grad():
        dq, dk, dv = backward_fn(*args)
    dq, dk, dv = _not_differentiable((dq, dk, dv), tuple(t for t in (dout, dlse, q, k, v) if t is not None))
    return dq, dk, dv, None, None, None, None, None, None, None


def _not_differentiable(grads: tuple, inputs: tuple) -> tuple:
    """`grads` with the same values, behind a node that raises DOUBLE_BACKWARD_ERROR when autograd reaches it.
    The node's edges lead to `inputs`, so that asking for the gradient of any of them reaches it."""
    if not any(t.requires_grad for t in inputs):
        return grads
    if _DelayedError is None:  # pragma: no cover (torch without the error node: refuse at once)
        raise RuntimeError(DOUBLE_BACKWARD_ERROR)
    wrapped = _DelayedError(DOUBLE_BACKWARD_ERROR, len(grads) + len(inputs))(*grads, *inputs)
    return tuple(wrapped[:len(grads)])


def _backward(ctx, dout, dlse):
    return _gradients(ctx, dout, dlse, attention_bwd_op)


attention_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The op's forward and backward without the dispatcher (eager calls only; see `attention`)."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, causal_bottom_right, cu_seqlens_q, cu_seqlens_k,
                max_seqlen_q, max_seqlen_k):
        inputs = (q, k, v, softmax_scale, causal, causal_bottom_right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k)
        output = _forward_impl(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return _gradients(ctx, dout, dlse, _backward_impl)


_ATTENTION_TENSORS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")


def attention(q, k, v, softmax_scale: float, causal: bool, causal_bottom_right: bool, cu_seqlens_q=None,
              cu_seqlens_k=None, max_seqlen_q: int = 0, max_seqlen_k: int = 0):
    """(out, lse) with autograd, through the registered op when tracing, directly otherwise."""
    args = (q, k, v, softmax_scale, causal, causal_bottom_right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k)
    if (torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
            or not plain_tensors(q, k, v, cu_seqlens_q, cu_seqlens_k, names=_ATTENTION_TENSORS)):
        return attention_fwd_op(*args)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _EagerAttention.apply(*args)
    return _forward_impl(*args)


def _covered_rows(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Boolean (total,) mask of the tokens that belong to some sequence."""
    values = cu_seqlens.tolist()
    covered = torch.zeros(total, dtype=torch.bool, device=cu_seqlens.device)
    for start, end in zip(values[:-1], values[1:]):
        covered[start:end] = True
    return covered
