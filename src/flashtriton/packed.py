"""flash-attn's packed entry points: q, k, v (or k, v) stacked into one tensor.

- `flash_attn_qkvpacked_func(qkv, ...)`: qkv (batch, seqlen, 3, nheads, headdim).
- `flash_attn_kvpacked_func(q, kv, ...)`: kv (batch, seqlen_k, 2, nheads_k, headdim).
- `flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, ...)`: qkv (total, 3, nheads, headdim).
- `flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)`:
  kv (total_k, 2, nheads_k, headdim).

Names, positional order, defaults and returns are flash-attn 2.8's. Each is `flash_attn_func` /
`flash_attn_varlen_func` on views of the packed tensor: `unbind` along the packing dim gives q, k, v as strided
views (the kernels take any strides with a contiguous last dim), so the forward reads the packed tensor in place and
copies nothing. The backward's kernels write dq, dk, dv as separate tensors; `unbind`'s backward stacks them into the
one gradient of the packed tensor (a single allocation of its size, where flash-attn writes its kernels' output into
slices of that buffer directly). A packed tensor whose last dim is not contiguous is refused (a copy of the whole
tensor is what these functions exist to avoid): pass `.contiguous()` or the unpacked `flash_attn_func`.
"""

from __future__ import annotations

import torch

from . import validation as V
from .interface import flash_attn_func, flash_attn_varlen_func


def _unpack(name: str, packed, parts: int, layout: str) -> tuple[torch.Tensor, ...]:
    """The `parts` views of `packed` along its packing dim (the one before nheads), after checking the layout."""
    ndim = layout.count(",") + 1
    V.check_tensors((name,), (packed,), ndim, layout)
    dim = ndim - 3
    if packed.shape[dim] != parts:
        raise ValueError(f"{name} must have size {parts} in dim {dim} {layout}, got shape {tuple(packed.shape)}")
    if packed.stride(-1) != 1:
        raise ValueError(
            f"{name} must have a contiguous last dim (stride 1), got strides {packed.stride()}: the packed functions "
            f"read {name} in place; pass {name}.contiguous()"
        )
    return packed.unbind(dim)


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: torch.Tensor | None = None,
):
    """`flash_attn_func` on q, k, v packed into one tensor (self-attention; q and kv share nheads: for GQA/MQA use
    `flash_attn_kvpacked_func`).

    Arguments:
        qkv: (batch, seqlen, 3, nheads, headdim), q, k, v along dim 2; any strides with a contiguous last dim.
        Other arguments as `flash_attn_func` (learnable_sink keyword-only).
    Returns:
        out: (batch, seqlen, nheads, headdim)
        and if return_attn_probs: (out, softmax_lse (batch, nheads, seqlen) fp32,
            S_dmask with dropout (flash_attn_func's) or None)
    The gradient of qkv is one (batch, seqlen, 3, nheads, headdim) tensor.
    """
    q, k, v = _unpack("qkv", qkv, 3, "(batch, seqlen, 3, nheads, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, learnable_sink=learnable_sink)


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: torch.Tensor | None = None,
):
    """`flash_attn_func` with k and v packed into one tensor.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim)
        kv: (batch, seqlen_k, 2, nheads_k, headdim), k, v along dim 2; nheads a multiple of nheads_k (GQA/MQA).
        Other arguments as `flash_attn_func` (learnable_sink keyword-only).
    Returns:
        out: (batch, seqlen_q, nheads, headdim)
        and if return_attn_probs: (out, softmax_lse (batch, nheads, seqlen_q) fp32,
            S_dmask with dropout (flash_attn_func's) or None)
    The gradient of kv is one (batch, seqlen_k, 2, nheads_k, headdim) tensor.
    """
    k, v = _unpack("kv", kv, 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, learnable_sink=learnable_sink)


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: torch.Tensor | None = None,
):
    """`flash_attn_varlen_func` on q, k, v packed into one tensor; queries and keys share cu_seqlens.

    Arguments:
        qkv: (total, 3, nheads, headdim), the batch's tokens back to back, q, k, v along dim 1.
        cu_seqlens: (batch + 1,) int32, sequence b is qkv[cu_seqlens[b] : cu_seqlens[b + 1]].
        max_seqlen: Python int, at least the longest sequence.
        Other arguments as `flash_attn_varlen_func` (learnable_sink keyword-only).
    Returns:
        out: (total, nheads, headdim)
        and if return_attn_probs: (out, softmax_lse (nheads, total) fp32,
            S_dmask with dropout (flash_attn_func's) or None)
    """
    q, k, v = _unpack("qkv", qkv, 3, "(total, 3, nheads, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                  learnable_sink=learnable_sink)


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: torch.Tensor | None = None,
):
    """`flash_attn_varlen_func` with k and v packed into one tensor.

    Arguments:
        q: (total_q, nheads, headdim)
        kv: (total_k, 2, nheads_k, headdim), k, v along dim 1; nheads a multiple of nheads_k (GQA/MQA).
        Other arguments as `flash_attn_varlen_func` (learnable_sink keyword-only).
    Returns:
        out: (total_q, nheads, headdim)
        and if return_attn_probs: (out, softmax_lse (nheads, total_q) fp32,
            S_dmask with dropout (flash_attn_func's) or None)
    """
    k, v = _unpack("kv", kv, 2, "(total_k, 2, nheads_k, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, learnable_sink=learnable_sink)
