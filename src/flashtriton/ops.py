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

from . import paging
from ._env import INTERPRET
from .configs import GLUON_HEAD_DIMS
from .kernels import dispatch
from .kernels.forward import attention_forward
from .kernels.host import capability
from .kernels.launch import on_inputs_device
from .validation import INT32_LIMIT, check_cu_seqlens_values, plain_tensors


@on_inputs_device
def _forward_impl(q, k, v, softmax_scale, causal, causal_bottom_right, cu_seqlens_q, cu_seqlens_k,
                  max_seqlen_q, max_seqlen_k, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                  learnable_sink=None, dropout_p=0.0, rng_state=None, block_table=None, seqused_k=None):
    variant = dict(window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
                   learnable_sink=learnable_sink, dropout_p=dropout_p, rng_state=rng_state)
    if cu_seqlens_q is not None:
        total_k = k.shape[0] if block_table is None else INT32_LIMIT  # paged: cu_seqlens_k gives lengths only
        covers_q, _ = check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], total_k, max_seqlen_q,
                                              max_seqlen_k)
        if paging.CHECK_VALUES and (block_table is not None or seqused_k is not None):
            paging.check_values(block_table, seqused_k, cu_seqlens_k, k.shape[1], k.shape[0])
        out, lse = attention_forward(
            q, k, v, softmax_scale, causal, causal_bottom_right,
            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **variant, block_table=block_table,
            seqused_k=seqused_k,
        )
        if not covers_q:  # tokens outside every sequence: define them as 0 / -inf rather than leave garbage
            covered = _covered_rows(cu_seqlens_q, q.shape[0])
            out[~covered] = 0
            lse[:, ~covered] = float("-inf")
        return out, lse
    return attention_forward(q, k, v, softmax_scale, causal, causal_bottom_right, **variant)


@on_inputs_device
def _backward_impl(dout, q, k, v, out, lse, softmax_scale, causal, causal_bottom_right, cu_seqlens_q,
                   cu_seqlens_k, max_seqlen_q, max_seqlen_k, dlse=None, window_left=-1, window_right=-1, softcap=0.0,
                   alibi_slopes=None, learnable_sink=None, dropout_p=0.0, rng_state=None):
    """(dq, dk, dv, dsink): dsink of learnable_sink's shape and dtype, or an empty tensor without sinks."""
    from .kernels.backward import attention_backward

    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    covers_all = True
    if cu_seqlens_q is not None:  # gradients of tokens outside every sequence must be 0: zero-fill only then
        covers_all = all(check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q,
                                                 max_seqlen_k))
    grads = attention_backward(
        dout, q, k, v, out, lse, softmax_scale, causal, causal_bottom_right,
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, zero_fill=not covers_all, dlse=dlse,
        window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
        learnable_sink=learnable_sink, dropout_p=dropout_p, rng_state=rng_state,
    )
    return grads if learnable_sink is not None else (*grads, q.new_empty(0))


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
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    learnable_sink: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    rng_state: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out like q with v's head dim; lse fp32 (B, Hq, Sq) dense or (Hq, total_q) varlen. window_left / right, softcap and
    alibi_slopes: flash-attn's window_size, softcap and alibi_slopes (-1, -1, 0.0, None: off). dropout_p > 0 with
    rng_state, the int64 (seed, offset) tensor `draw_dropout_state` drew outside the op: the op is a pure function
    of its inputs (the same rng_state, the same mask), which torch.compile may trace and the backward replays.
    block_table, seqused_k (varlen, forward only): k, v are page pools and block_table maps each sequence's keys to
    pages; seqused_k counts each sequence's keys (`paging`)."""
    return _forward_impl(q, k, v, softmax_scale, causal, causal_bottom_right, cu_seqlens_q, cu_seqlens_k,
                         max_seqlen_q, max_seqlen_k, window_left, window_right, softcap, alibi_slopes, learnable_sink,
                         dropout_p, rng_state, block_table, seqused_k)


@attention_fwd_op.register_fake
def _(q, k, v, softmax_scale, causal, causal_bottom_right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, learnable_sink=None, dropout_p=0.0,
      rng_state=None, block_table=None, seqused_k=None):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))  # contiguous, whatever the inputs' strides; v's head dim
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
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    learnable_sink: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    rng_state: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsink) shaped like (q, k, v, learnable_sink); dk/dv summed over each GQA group; dsink empty
    without sinks. dlse: the gradient of lse (shaped like it), or None when lse is not differentiated. dropout_p,
    rng_state: the forward's (the kernels regenerate its keep-mask)."""
    return _backward_impl(dout, q, k, v, out, lse, softmax_scale, causal, causal_bottom_right, cu_seqlens_q,
                          cu_seqlens_k, max_seqlen_q, max_seqlen_k, dlse, window_left, window_right, softcap,
                          alibi_slopes, learnable_sink, dropout_p, rng_state)


@attention_bwd_op.register_fake
def _(dout, q, k, v, out, lse, softmax_scale, causal, causal_bottom_right, cu_seqlens_q, cu_seqlens_k,
      max_seqlen_q, max_seqlen_k, dlse=None, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
      learnable_sink=None, dropout_p=0.0, rng_state=None):
    dsink = q.new_empty(0) if learnable_sink is None else learnable_sink.new_empty(learnable_sink.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsink


def _setup_context(ctx, inputs, output):
    (q, k, v, softmax_scale, causal, causal_bottom_right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
     *variant) = inputs
    out, lse = output
    alibi = variant[3] if len(variant) > 3 else None
    sink = variant[4] if len(variant) > 4 else None
    rng_state = variant[6] if len(variant) > 6 else None
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi, sink, rng_state)
    ctx.args = (softmax_scale, causal, causal_bottom_right, max_seqlen_q, max_seqlen_k)
    ctx.variant = tuple(variant[:3])  # (window_left, window_right, softcap), or () where the op's defaults hold
    ctx.dropout_p = variant[5] if len(variant) > 5 else 0.0
    ctx.n_variant = len(variant)  # the inputs after max_seqlen_k, which get no gradient
    ctx.paged = any(t is not None for t in variant[7:9])  # block_table or seqused_k: no backward
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
    if ctx.paged:  # (the public function refuses such calls with gradients first)
        raise NotImplementedError("flashtriton has no backward for block_table or seqused_k (nor has flash-attn)")
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi, sink, rng_state = ctx.saved_tensors
    softmax_scale, causal, causal_bottom_right, max_seqlen_q, max_seqlen_k = ctx.args
    if dout is None:  # only lse is differentiated
        dout = torch.zeros_like(out)
    args = (dout, q, k, v, out, lse, softmax_scale, causal, causal_bottom_right, cu_seqlens_q, cu_seqlens_k,
            max_seqlen_q, max_seqlen_k, dlse, *ctx.variant, *((alibi, sink) if ctx.n_variant > 3 else ()),
            *((ctx.dropout_p, rng_state) if ctx.n_variant > 5 else ()))
    # The inputs after q, k, v have no gradient, but the sink (the fifth after max_seqlen_k, where given).
    nones = (None,) * (7 + min(ctx.n_variant, 4))
    with_sink = ctx.n_variant > 4
    after_sink = (None,) * max(ctx.n_variant - 5, 0)  # dropout_p, rng_state
    if not torch.is_grad_enabled():
        grads = backward_fn(*args)
    else:
        with torch.no_grad():
            grads = backward_fn(*args)
        grads = _not_differentiable(tuple(grads), tuple(t for t in (dout, dlse, q, k, v, sink) if t is not None))
    dq, dk, dv, dsink = grads
    if not with_sink:
        return dq, dk, dv, *nones
    return dq, dk, dv, *nones, (dsink if sink is not None else None), *after_sink


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
                max_seqlen_q, max_seqlen_k, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                learnable_sink=None, dropout_p=0.0, rng_state=None, block_table=None, seqused_k=None):
        inputs = (q, k, v, softmax_scale, causal, causal_bottom_right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k, window_left, window_right, softcap, alibi_slopes, learnable_sink, dropout_p,
                  rng_state, block_table, seqused_k)
        output = _forward_impl(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return _gradients(ctx, dout, dlse, _backward_impl)


_ATTENTION_TENSORS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "learnable_sink", "block_table",
                      "seqused_k")

# While `flashtriton.testing.record_dropout` is active: the rng_state tensors of the dropout calls, in order.
DROPOUT_RECORD: Optional[list] = None


def draw_dropout_state(device) -> torch.Tensor:
    """A dropout call's (seed, offset): two int64 drawn from torch's default generator of `device` (the CPU's
    under the interpreter, else the GPU's, asynchronously), so that `torch.manual_seed` reproduces a run and two
    calls draw different masks. A torch op outside the custom op: torch.compile traces it into the graph (its
    own random numbers there, seeded by torch.manual_seed too), and a CUDA graph captures it as torch's other
    random ops (the generator advances on each replay)."""
    return torch.randint(-2**63, 2**63 - 1, (2,), dtype=torch.int64, device=device)


# Head dims the Hopper Gluon kernels do not take (`configs.GLUON_HEAD_DIMS`: those not a multiple of 8, whose rows
# break the TMA's 16-byte rule) run padded with zero columns to the next one they take (59 -> 64, 111 -> 112),
# where that is at most twice the head dim and their call would run on the Gluon kernels: the scores are the same,
# the output's extra columns zero and cropped. At D=59 (an H100, bf16, causal, T = 1k / 4k, beside FLASH: cuDNN
# refuses it) the padded call runs 1.06-1.22x FLASH forward and 1.47-1.51x backward
# (benchmarks/2026-12-06-h100/dims8/); the portable kernels read 0.58-0.88x / 0.44-0.90x there (padded-dims/).
# "auto": there; "always" (tests: the interpreter too); "off".
PAD_HEAD_DIMS = "auto"
# head dim -> the one it pads to (the smallest of GLUON_HEAD_DIMS above it, at most twice it)
_PADDED_TO = {d: min(t for t in GLUON_HEAD_DIMS if t > d) for d in range(1, max(GLUON_HEAD_DIMS))
              if d not in GLUON_HEAD_DIMS and min(t for t in GLUON_HEAD_DIMS if t > d) <= 2 * d}


def padded_head_dim(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int | None:
    """The head dim a dense or varlen call with q's head dim D runs at, padded (`PAD_HEAD_DIMS`): the smallest of
    `configs.GLUON_HEAD_DIMS` above D, where it is at most 2 D, V's head dim is D, the Gluon kernels would run
    the padded call (Hopper, fp16 / bf16, the switch allowing them) and a padded sequence stays within the
    kernels' 32-bit offsets (`validation.check_int32_offsets`); None: as it is."""
    head_dim = q.shape[-1]
    padded = _PADDED_TO.get(head_dim)
    if padded is None or PAD_HEAD_DIMS == "off" or v.shape[-1] != head_dim:
        return None
    if PAD_HEAD_DIMS != "always" and (
            INTERPRET or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16)
            or capability(q.device)[0] != 9 or not dispatch.allows("gluon")):
        return None
    if max(q.shape[-3] * q.shape[-2], k.shape[-3] * k.shape[-2]) * padded >= INT32_LIMIT:
        return None  # a sequence the kernels' 32-bit offsets address unpadded but not padded
    return padded


def attention(q, k, v, softmax_scale: float, causal: bool, causal_bottom_right: bool, cu_seqlens_q=None,
              cu_seqlens_k=None, max_seqlen_q: int = 0, max_seqlen_k: int = 0, window_size=(-1, -1),
              softcap: float = 0.0, alibi_slopes=None, learnable_sink=None, dropout_p: float = 0.0,
              block_table=None, seqused_k=None, rng_state=None):
    """(out, lse) with autograd, through the registered op when tracing, directly otherwise. window_size,
    softcap and dropout_p are flash-attn's (validated: two ints >= -1, a float >= 0, a float in [0, 1)); a call
    with dropout draws its (seed, offset) here (`draw_dropout_state`), or takes the caller's `rng_state`.
    block_table, seqused_k: varlen, validated by `paging` (forward only)."""
    paged = block_table is not None or seqused_k is not None
    padded = None if paged else padded_head_dim(q, k, v)
    if padded is not None:  # zero columns: the same scores, zero output columns; F.pad's backward crops the grads
        head_dim = q.shape[-1]
        q, k, v = (torch.nn.functional.pad(t, (0, padded - head_dim)) for t in (q, k, v))
        out, lse = attention(q, k, v, softmax_scale, causal, causal_bottom_right, cu_seqlens_q, cu_seqlens_k,
                             max_seqlen_q, max_seqlen_k, window_size, softcap, alibi_slopes, learnable_sink, dropout_p,
                             block_table, seqused_k, rng_state)
        return out[..., :head_dim].contiguous(), lse
    args = (q, k, v, softmax_scale, causal, causal_bottom_right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k)
    if (tuple(window_size) != (-1, -1) or softcap or alibi_slopes is not None or learnable_sink is not None
            or dropout_p or paged):
        args += (int(window_size[0]), int(window_size[1]), float(softcap), alibi_slopes, learnable_sink)
    if dropout_p:
        rng_state = draw_dropout_state(q.device) if rng_state is None else rng_state
        if DROPOUT_RECORD is not None:
            DROPOUT_RECORD.append(rng_state)
        args += (float(dropout_p), rng_state)
    elif paged:
        args += (0.0, None)
    if paged:
        args += (block_table, seqused_k)
    if (torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
            or not plain_tensors(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, learnable_sink, block_table,
                                 seqused_k, names=_ATTENTION_TENSORS)):
        return attention_fwd_op(*args)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (learnable_sink is not None and learnable_sink.requires_grad)):
        return _EagerAttention.apply(*args)
    return _forward_impl(*args)


def _covered_rows(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Boolean (total,) mask of the tokens that belong to some sequence."""
    values = cu_seqlens.tolist()
    covered = torch.zeros(total, dtype=torch.bool, device=cu_seqlens.device)
    for start, end in zip(values[:-1], values[1:]):
        covered[start:end] = True
    return covered
