"""flash-attn 2's private forward and backward (`flash_attn.flash_attn_interface`), on flashtriton's kernels.

Code written on them (ring-flash-attention and other context-parallel libraries) switches by its import:

    from flashtriton.flash_attn_interface import _flash_attn_forward, _flash_attn_backward

The signatures are flash-attn >= 2.6's (window_size_left / window_size_right, softcap), dense and varlen (packed
sequences, cu_seqlens). None records autograd; the backward takes the forward's out and lse, or those of a merged
result (ring attention: the *global* out and lse), and writes dq, dk, dv into the given tensors. `flashtriton.chunked` has the same pieces with query / key
positions, fp32 accumulation into strided buffers and the merge.
"""

from __future__ import annotations

import torch

from . import validation as V
from .attn_probs import BLOCK_N, dropout_probs
from .chunked import _check_buffer, _check_inputs
from .kernels.backward import attention_backward
from .kernels.forward import attention_forward
from .kernels.launch import on_inputs_device
from .ops import _forward_impl, draw_dropout_state


def _get_block_size_n(device=None, head_dim: int = 0, is_dropout: bool = False, is_causal: bool = False) -> int:
    """flash-attn 2's: the key blocks of the running maximum in a dropout call's S_dmask (`attn_probs`), which
    flash-attn's test helpers use to normalise it; the same on every device and head dim here."""
    return BLOCK_N


@on_inputs_device
def _flash_attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
                        causal: bool, window_size_left: int = -1, window_size_right: int = -1, softcap: float = 0.0,
                        alibi_slopes: torch.Tensor | None = None, return_softmax: bool = False):
    """flash-attn's `_flash_attn_forward`: q (B, Sq, Hq, D), k, v (B, Sk, Hkv, D / Dv), arguments as
    `flash_attn_func`'s (causal bottom-right). Returns (out (B, Sq, Hq, Dv), softmax_lse (B, Hq, Sq) fp32,
    S_dmask, rng_state): S_dmask with return_softmax and dropout flash-attn 2's probabilities (`attn_probs`), else
    an empty tensor; rng_state the call's int64 (seed, offset) with dropout, else an empty int64 tensor; pass it to
    `_flash_attn_backward`."""
    window, softcap, scale = _check_inputs(q, k, v, 0, 0, bool(causal), (window_size_left, window_size_right),
                                           softmax_scale, softcap)
    dropout_p = V.check_dropout(dropout_p)
    alibi_slopes = V.check_alibi(alibi_slopes, q.shape[0], q.shape[2], q.device)
    q, k, v = (V.last_dim_contiguous(t) for t in (q, k, v))
    rng_state = draw_dropout_state(q.device) if dropout_p else torch.empty(0, dtype=torch.int64, device=q.device)
    if scale < 0:  # the forward kernels keep a running maximum: negate q instead (interface.py)
        q, scale = -q, -scale
    out, lse = attention_forward(q, k, v, scale, bool(causal), True, window_size=window, softcap=softcap,
                                 alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                                 rng_state=rng_state if dropout_p else None)
    probs = (dropout_probs(q, k, rng_state, scale, bool(causal), window, softcap, alibi_slopes, dropout_p)
             if return_softmax and dropout_p else q.new_empty(0))
    return out, lse, probs, rng_state


@on_inputs_device
def _flash_attn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         softmax_lse: torch.Tensor, dq: torch.Tensor | None, dk: torch.Tensor | None,
                         dv: torch.Tensor | None, dropout_p: float, softmax_scale: float, causal: bool,
                         window_size_left: int = -1, window_size_right: int = -1, softcap: float = 0.0,
                         alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                         rng_state: torch.Tensor | None = None) -> torch.Tensor:
    """flash-attn's `_flash_attn_backward`: writes the gradients into dq, dk, dv (shaped like q, k, v, any float
    dtype and strides; None: computed and dropped, as in flash-attn) and returns softmax_d = rowsum(dout * out)
    (B, Hq, Sq) fp32. out and softmax_lse: the forward's, or a merged result's. `deterministic` is accepted:
    flashtriton's backward always is. rng_state: the forward's (with dropout)."""
    window, softcap, scale = _check_inputs(q, k, v, 0, 0, bool(causal), (window_size_left, window_size_right),
                                           softmax_scale, softcap)
    dropout_p = V.check_dropout(dropout_p)
    alibi_slopes = V.check_alibi(alibi_slopes, q.shape[0], q.shape[2], q.device)
    _check_backward(q, k, v, dout, out, softmax_lse, dq, dk, dv, dropout_p, rng_state, (*q.shape[:3], v.shape[3]),
                    (q.shape[0], q.shape[2], q.shape[1]), "_flash_attn_forward")
    q, k, v, dout, out = (V.last_dim_contiguous(t) for t in (q, k, v, dout, out))
    attention_backward(dout, q, k, v, out, softmax_lse, scale, bool(causal), True, window_size=window,
                       softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                       rng_state=rng_state if dropout_p else None, dq=dq, dk=dk, dv=dv)
    return (dout.float() * out.float()).sum(-1).transpose(1, 2)


def _check_backward(q, k, v, dout, out, softmax_lse, dq, dk, dv, dropout_p, rng_state, out_shape: tuple,
                    lse_shape: tuple, forward: str) -> None:
    """The backward aliases' checks of what the forward returned: rng_state with dropout, dout and out of
    `out_shape`, a float32 softmax_lse of `lse_shape`, and the gradient buffers (`_check_buffer`)."""
    if dropout_p and (not isinstance(rng_state, torch.Tensor) or rng_state.numel() != 2):
        raise ValueError(f"dropout_p > 0 needs rng_state, the int64 (seed, offset) tensor {forward} returned")
    for name, t in (("dout", dout), ("out", out)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != out_shape:
            raise ValueError(f"{name} must be a tensor of shape {out_shape}, got "
                             + (str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__))
    if (not isinstance(softmax_lse, torch.Tensor) or softmax_lse.dtype != torch.float32
            or tuple(softmax_lse.shape) != lse_shape):
        raise ValueError(f"softmax_lse must be a float32 tensor of shape {lse_shape}")
    for name, buf, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        _check_buffer(name, buf, like, False)


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window, softmax_scale, softcap,
                  dropout_p, alibi_slopes):
    """The packed inputs' checks (`flash_attn_varlen_func`'s) -> (window, softcap, scale, dropout_p, alibi)."""
    V.check_tensors(("q", "k", "v"), (q, k, v), 3, "(total_tokens, nheads, headdim)")
    V.check_same("total key tokens of k and v", k=k.shape[0], v=v.shape[0])
    V.check_heads_and_dims(q.shape[1], k.shape[1], q.shape[2], v.shape[2], v.shape[1], separate_v=True)
    V.check_same("head dims of q and k", q=q.shape[2], k=k.shape[2])
    V.check_scale("softmax_scale", softmax_scale, allow_negative=True)
    batch = V.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q", None, q.device)
    V.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k", batch, q.device)
    V.check_int32_offsets(("q", "k", "v"), (q, k, v), (max_seqlen_q, max_seqlen_k, max_seqlen_k), v.shape[-1])
    V.check_grid(batch, q.shape[1])
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return (V.check_window(window), V.check_softcap(softcap), scale, V.check_dropout(dropout_p),
            V.check_alibi(alibi_slopes, batch, q.shape[1], q.device))


@on_inputs_device
def _flash_attn_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                               softmax_scale: float, causal: bool, window_size_left: int = -1,
                               window_size_right: int = -1, softcap: float = 0.0,
                               alibi_slopes: torch.Tensor | None = None, return_softmax: bool = False,
                               block_table: torch.Tensor | None = None, leftpad_k: torch.Tensor | None = None,
                               seqused_k: torch.Tensor | None = None):
    """flash-attn's `_flash_attn_varlen_forward`: q (total_q, Hq, D), k, v (total_k, Hkv, D / Dv), cu_seqlens int32
    (batch + 1,), as `flash_attn_varlen_func`. Returns (out (total_q, Hq, Dv), softmax_lse (Hq, total_q) fp32,
    S_dmask, rng_state), as `_flash_attn_forward`. block_table, leftpad_k and seqused_k: not taken here
    (NotImplementedError; `flash_attn_varlen_func` takes block_table and seqused_k)."""
    for name, value in (("block_table", block_table), ("leftpad_k", leftpad_k), ("seqused_k", seqused_k)):
        V.not_implemented(name, value, None)
    window, softcap, scale, dropout_p, alibi_slopes = _check_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        (window_size_left, window_size_right), softmax_scale, softcap, dropout_p, alibi_slopes)
    q, k, v = (V.last_dim_contiguous(t) for t in (q, k, v))
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    rng_state = draw_dropout_state(q.device) if dropout_p else torch.empty(0, dtype=torch.int64, device=q.device)
    if scale < 0:
        q, scale = -q, -scale
    out, lse = _forward_impl(q, k, v, scale, bool(causal), True, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                             max_seqlen_k, window[0], window[1], softcap, alibi_slopes, None, dropout_p,
                             rng_state if dropout_p else None)
    probs = (dropout_probs(q, k, rng_state, scale, bool(causal), window, softcap, alibi_slopes, dropout_p,
                           cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
             if return_softmax and dropout_p else q.new_empty(0))
    return out, lse, probs, rng_state


@on_inputs_device
def _flash_attn_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, softmax_lse: torch.Tensor, dq: torch.Tensor | None,
                                dk: torch.Tensor | None, dv: torch.Tensor | None, cu_seqlens_q: torch.Tensor,
                                cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                                softmax_scale: float, causal: bool, window_size_left: int = -1,
                                window_size_right: int = -1, softcap: float = 0.0,
                                alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                                rng_state: torch.Tensor | None = None) -> torch.Tensor:
    """flash-attn's `_flash_attn_varlen_backward`: as `_flash_attn_backward` on packed inputs; softmax_lse
    (Hq, total_q); returns softmax_d (Hq, total_q) fp32. Tokens outside every sequence get zero gradients."""
    window, softcap, scale, dropout_p, alibi_slopes = _check_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        (window_size_left, window_size_right), softmax_scale, softcap, dropout_p, alibi_slopes)
    _check_backward(q, k, v, dout, out, softmax_lse, dq, dk, dv, dropout_p, rng_state, (*q.shape[:2], v.shape[2]),
                    (q.shape[1], q.shape[0]), "the forward")
    q, k, v, dout, out = (V.last_dim_contiguous(t) for t in (q, k, v, dout, out))
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    covers = all(V.check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q,
                                           max_seqlen_k))
    attention_backward(dout, q, k, v, out, softmax_lse, scale, bool(causal), True, cu_seqlens_q, cu_seqlens_k,
                       max_seqlen_q, max_seqlen_k, zero_fill=not covers, window_size=window, softcap=softcap,
                       alibi_slopes=alibi_slopes, dropout_p=dropout_p, rng_state=rng_state if dropout_p else None,
                       dq=dq, dk=dk, dv=dv)
    return (dout.float() * out.float()).sum(-1).transpose(0, 1)
