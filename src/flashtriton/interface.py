"""Public attention functions, with the signatures users already know.

- `flash_attn_func`, `flash_attn_varlen_func`: flash-attn's names, arguments and (B, S, H, D) layout.
- `scaled_dot_product_attention`: torch's SDPA signature and (B, H, S, D) layout.

All are exact attention, differentiable, and never build an (Sq, Sk) matrix.
"""

from __future__ import annotations

import math

import torch

from . import validation as V
from .ops import attention


def _default_scale(softmax_scale, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def _positive_scale(q: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    """(q, scale) with scale >= 0: scale · q·k = |scale| · (-q)·k. The kernels keep the running row maximum of
    the unscaled scores times the scale, which only a scale >= 0 keeps a maximum; negating q (exact, one copy,
    only for a negative scale) gives the same scores, lse and, through autograd, gradients."""
    return (-q, -scale) if scale < 0 else (q, scale)


def _variant_args(dropout_p, window_size, softcap) -> tuple[tuple[int, int], float]:
    """(window_size, softcap), checked; NotImplementedError for the features not built."""
    V.not_implemented("dropout_p", dropout_p, 0.0)
    return V.check_window(window_size), V.check_softcap(softcap)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    learnable_sink: torch.Tensor | None = None,
):
    """Exact attention, flash-attn's `flash_attn_func`.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim)
        k: (batch, seqlen_k, nheads_k, headdim)
        v: (batch, seqlen_k, nheads_k, headdim_v)
            nheads must be a multiple of nheads_k (GQA/MQA: query head h uses kv head h // (nheads // nheads_k)).
            headdim and headdim_v 1..256 (v's, the output's, may differ from q and k's: DeepSeek's MLA has 192 and
            128); fp16, bf16 (fp32 accumulation) or fp32 (exact fp32 dots, much slower).
            Any strides with a contiguous last dim (slices of a packed qkv tensor cost no copy).
        softmax_scale: scaling of QK^T before the softmax, any finite real number (Python or NumPy; negative
            and 0, a uniform average, too); default 1 / sqrt(headdim).
        causal: causal mask aligned to the bottom-right corner of the attention matrix.
            For seqlen_q = 2, seqlen_k = 5:          For seqlen_q = 5, seqlen_k = 2:
                1 1 1 1 0                                0 0
                1 1 1 1 1                                0 0
                                                         0 0
                                                         1 0
                                                         1 1
            A row that sees no key returns 0 (and lse -inf).
        deterministic: accepted; flashtriton's backward is always deterministic (no atomics).
        return_attn_probs: also return the log-sum-exp (the probabilities are never formed: None). The lse is
            differentiable (d lse_i / d s_ij = softmax_ij, what ring attention's merge of partial results needs);
            a row that sees no key has lse -inf, a constant: q, k, v get no gradient from it.
        window_size: (left, right): query i sees key j iff i + Sk - Sq - left <= j <= i + Sk - Sq + right (-1:
            unbounded on that side; with causal the right side is 0). A row that sees no key returns 0.
        softcap: > 0 caps the scaled scores: softcap * tanh(scores / softcap) (0 or None: off).
        alibi_slopes: fp32 (nheads,) or (batch, nheads): adds -slope * |i + Sk - Sq - j| to the scores (after
            softcap). window_size, softcap and alibi_slopes run on the portable kernels (the Hopper kernels do not
            take them yet).
        learnable_sink: (nheads,), fp32 or the inputs' dtype: one extra logit per query head, unscaled, in the
            softmax's denominator only (gpt-oss' attention sinks; FlashAttention-4's name); the returned lse
            includes it, and it gets a gradient.
        dropout_p: not supported yet; any non-zero value raises NotImplementedError.
    Returns:
        out: (batch, seqlen_q, nheads, headdim_v)
        and if return_attn_probs: (out, softmax_lse (batch, nheads, seqlen_q) fp32 natural log, None)
    """
    window_size, softcap = _variant_args(dropout_p, window_size, softcap)
    V.check_tensors(("q", "k", "v"), (q, k, v), 4, "(batch, seqlen, nheads, headdim)")
    alibi_slopes = V.check_alibi(alibi_slopes, q.shape[0], q.shape[2], q.device)
    learnable_sink = V.check_sink(learnable_sink, q.shape[2], q.dtype, q.device)
    V.check_same("batch sizes of q, k, v", q=q.shape[0], k=k.shape[0], v=v.shape[0])
    V.check_same("sequence lengths of k and v", k=k.shape[1], v=v.shape[1])
    V.check_heads_and_dims(q.shape[2], k.shape[2], q.shape[3], v.shape[3], v.shape[2], separate_v=True)
    V.check_same("head dims of q and k", q=q.shape[3], k=k.shape[3])
    V.check_scale("softmax_scale", softmax_scale, allow_negative=True)
    q, k, v = (V.last_dim_contiguous(t) for t in (q, k, v))
    V.check_int32_offsets(("q", "k", "v"), (q, k, v), (q.shape[1], k.shape[1], v.shape[1]), v.shape[-1])
    V.check_grid(q.shape[0], q.shape[2])
    q, scale = _positive_scale(q, _default_scale(softmax_scale, q.shape[-1]))
    out, lse = attention(q, k, v, scale, bool(causal), True, None, None, q.shape[1], k.shape[1], window_size, softcap,
                         alibi_slopes, learnable_sink)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
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
    block_table: torch.Tensor | None = None,
    learnable_sink: torch.Tensor | None = None,
):
    """Exact attention over a batch of sequences of different lengths packed without padding.

    Arguments:
        q: (total_q, nheads, headdim), the batch's query tokens back to back.
        k, v: (total_k, nheads_k, headdim), (total_k, nheads_k, headdim_v).
        cu_seqlens_q: (batch + 1,) int32, sequence b's queries are q[cu_seqlens_q[b] : cu_seqlens_q[b + 1]].
        cu_seqlens_k: (batch + 1,) int32, likewise for k and v. Sequences of length 0 are allowed.
        max_seqlen_q, max_seqlen_k: Python ints, at least the longest sequence.
        causal: per sequence, aligned bottom-right as in `flash_attn_func`.
        Other arguments as `flash_attn_func`. cu_seqlens are checked on the host (non-decreasing, inside the
        tensor, max_seqlen large enough): one small device-to-host copy, which waits for the GPU, per cu_seqlens
        tensor; calls with tensors that passed and were not written since (torch's version counter) skip it.
        A kernel that writes a cu_seqlens tensor behind torch's back (no version bump) must pass a new tensor.
    Returns:
        out: (total_q, nheads, headdim_v)
        and if return_attn_probs: (out, softmax_lse (nheads, total_q) fp32, differentiable, None)
    """
    window_size, softcap = _variant_args(dropout_p, window_size, softcap)
    V.not_implemented("block_table", block_table, None)
    V.check_tensors(("q", "k", "v"), (q, k, v), 3, "(total_tokens, nheads, headdim)")
    V.check_same("total key tokens of k and v", k=k.shape[0], v=v.shape[0])
    V.check_heads_and_dims(q.shape[1], k.shape[1], q.shape[2], v.shape[2], v.shape[1], separate_v=True)
    V.check_same("head dims of q and k", q=q.shape[2], k=k.shape[2])
    V.check_scale("softmax_scale", softmax_scale, allow_negative=True)
    batch = V.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q", None, q.device)
    alibi_slopes = V.check_alibi(alibi_slopes, batch, q.shape[1], q.device)
    learnable_sink = V.check_sink(learnable_sink, q.shape[1], q.dtype, q.device)
    V.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k", batch, q.device)
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()  # kernels index them densely
    q, k, v = (V.last_dim_contiguous(t) for t in (q, k, v))
    V.check_int32_offsets(("q", "k", "v"), (q, k, v), (max_seqlen_q, max_seqlen_k, max_seqlen_k), v.shape[-1])
    V.check_grid(batch, q.shape[1])
    if q.shape[1] * q.shape[0] >= V.INT32_LIMIT:
        raise NotImplementedError(f"nheads x total_q = {q.shape[1] * q.shape[0]} must be below 2**31 (32-bit offsets)")
    q, scale = _positive_scale(q, _default_scale(softmax_scale, q.shape[-1]))
    out, lse = attention(q, k, v, scale, bool(causal), True, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         window_size, softcap, alibi_slopes, learnable_sink)
    return (out, lse, None) if return_attn_probs else out


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Drop-in for `torch.nn.functional.scaled_dot_product_attention` on 4-D inputs.

    query (B, Hq, Sq, D), key (B, Hkv, Sk, D), value (B, Hkv, Sk, Dv) -> (B, Hq, Sq, Dv). As in torch, `is_causal`
    is aligned top-left (query i sees keys j <= i), Hq != Hkv needs `enable_gqa=True`, `scale` may be any finite
    real and value may have a head dim of its own. attn_mask and dropout_p are not supported yet
    (NotImplementedError). The result is a (B, Hq, Sq, Dv) view of a (B, Sq, Hq, Dv) tensor, as torch's flash
    backend returns it.
    """
    V.not_implemented("attn_mask", attn_mask, None)
    V.not_implemented("dropout_p", dropout_p, 0.0)
    V.check_tensors(("query", "key", "value"), (query, key, value), 4, "(batch, nheads, seqlen, headdim)")
    V.check_same("batch sizes of query, key, value", query=query.shape[0], key=key.shape[0], value=value.shape[0])
    V.check_same("sequence lengths of key and value", key=key.shape[2], value=value.shape[2])
    V.check_heads_and_dims(query.shape[1], key.shape[1], query.shape[3], value.shape[3], value.shape[1],
                           separate_v=True)
    V.check_same("head dims of query and key", query=query.shape[3], key=key.shape[3])
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(
            f"query has {query.shape[1]} heads and key/value {key.shape[1]}: pass enable_gqa=True for "
            "grouped-query attention (as torch requires)"
        )
    V.check_scale("scale", scale, allow_negative=True)
    q, k, v = (V.last_dim_contiguous(t.transpose(1, 2)) for t in (query, key, value))  # (B, S, H, D) views
    V.check_int32_offsets(("query", "key", "value"), (q, k, v), (q.shape[1], k.shape[1], v.shape[1]), v.shape[-1])
    V.check_grid(q.shape[0], q.shape[2])
    q, softmax_scale = _positive_scale(q, _default_scale(scale, q.shape[-1]))
    out, _ = attention(q, k, v, softmax_scale, bool(is_causal), False, None, None, q.shape[1], k.shape[1])
    return out.transpose(1, 2)  # (B, Hq, Sq, Dv)
