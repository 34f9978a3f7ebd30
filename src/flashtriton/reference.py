"""Pure-PyTorch attention in high precision: the ground truth for tests, `check` and `bench`.

Materialises the (Sq, Sk) score matrix, so use it on small problems only.
"""

from __future__ import annotations

import math

import torch

from .kernels.variant import Variant


def causal_mask(seqlen_q: int, seqlen_k: int, bottom_right: bool = True, device=None) -> torch.Tensor:
    """Boolean (Sq, Sk) mask, True where query i may see key j.

    bottom_right (flash-attn >= 2.1):  j <= i + Sk - Sq      top-left (torch SDPA):  j <= i
        Sq=2, Sk=5:  1 1 1 1 0                                1 0 0 0 0
                     1 1 1 1 1                                1 1 0 0 0
    """
    return Variant(causal=True, bottom_right=bottom_right).dense_mask(seqlen_q, seqlen_k, device=device)


def masked_scores(q: torch.Tensor, k: torch.Tensor, variant: Variant, softmax_scale: float | None = None,
                  dtype: torch.dtype = torch.float64, diagonal: int | None = None) -> torch.Tensor:
    """The scores the softmax takes, (B, Hq, Sq, Sk) in `dtype`: scale · q·k, softcapped, minus ALiBi's
    slope · |i + d - j|, -inf where `variant`'s mask hides a key (d: `diagonal`, else the variant's alignment).
    q (B, Sq, Hq, D), k (B, Sk, Hkv, D) as `attention_reference`'s."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    qh = q.to(dtype).transpose(1, 2)  # (B, Hq, Sq, D)
    kh = k.to(dtype).transpose(1, 2).repeat_interleave(heads_q // heads_kv, dim=1)  # (B, Hq, Sk, D)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if variant.softcap:
        scores = variant.softcap * torch.tanh(scores / variant.softcap)
    if variant.alibi_slopes is not None:  # -slope · |i + d - j|, slopes (Hq,) or (B, Hq)
        slopes = variant.alibi_slopes.to(device=q.device, dtype=dtype)
        slopes = slopes.expand(batch, heads_q) if slopes.dim() == 2 else slopes[None].expand(batch, heads_q)
        d = variant.diagonal(seqlen_q, seqlen_k) if diagonal is None else diagonal
        rows = torch.arange(seqlen_q, device=q.device)[:, None] + d
        distance = (rows - torch.arange(seqlen_k, device=q.device)[None, :]).abs().to(dtype)
        scores = scores - slopes[:, :, None, None] * distance
    if variant.masks:
        allowed = variant.dense_mask(seqlen_q, seqlen_k, diagonal, device=q.device)
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    bottom_right: bool = True,
    dtype: torch.dtype = torch.float64,
    return_lse: bool = False,
    variant: Variant | None = None,
    diagonal: int | None = None,
    dropout_mask: torch.Tensor | None = None,
    dropout_p: float | None = None,
):
    """Exact attention in `dtype` (float64 by default) for (B, S, H, D) inputs, flash-attn's layout.

    q: (B, Sq, Hq, D); k, v: (B, Sk, Hkv, D) with Hq a multiple of Hkv (GQA: each group of Hq/Hkv query
    heads shares one kv head). The mask is `variant`'s (`kernels/variant.py`; by default
    Variant(causal, bottom_right=bottom_right)), at `diagonal` (q_start - k_start) when given. Returns out
    (B, Sq, Hq, D) in `dtype` and, when asked, the natural-log log-sum-exp (B, Hq, Sq). A query row that sees
    no key gives out 0 and lse -inf. Differentiable.
    dropout_mask: bool, broadcastable to (B, Hq, Sq, Sk) (`flashtriton.testing.dropout_mask`), True where a
    probability is kept: out = (P ∘ mask / (1 - p)) V with p = dropout_p (default: the variant's), lse the undropped
    softmax's.
    """
    variant = Variant(causal=causal, bottom_right=bottom_right) if variant is None else variant
    variant.require_supported()  # the reference grows each score change with the kernels
    if variant.dropout_p and dropout_mask is None:
        raise ValueError("a variant with dropout_p > 0 needs the call's dropout_mask (flashtriton.testing.dropout_mask)")
    batch, seqlen_q, heads_q, _ = q.shape
    scores = masked_scores(q, k, variant, softmax_scale, dtype, diagonal)  # (B, Hq, Sq, Sk)
    vh = v.to(dtype).transpose(1, 2).repeat_interleave(heads_q // k.shape[2], dim=1)  # (B, Hq, Sk, Dv)
    if variant.sinks is not None:  # one unscaled logit per query head, in the denominator only
        sink = variant.sinks.to(device=q.device, dtype=dtype)[None, :, None, None].expand(batch, heads_q, seqlen_q, 1)
        lse = torch.logsumexp(torch.cat([scores, sink], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(scores, dim=-1)  # (B, Hq, Sq), -inf on rows that see no key
    safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - safe_lse[..., None])  # exp(-inf) = 0 on masked entries
    if dropout_mask is not None:
        p = variant.dropout_p if dropout_p is None else dropout_p
        probs = probs * dropout_mask.to(device=q.device, dtype=dtype) / (1.0 - p)
    out = torch.matmul(probs, vh).transpose(1, 2)  # (B, Sq, Hq, Dv)
    return (out, lse) if return_lse else out


def sdpa_reference(q, k, v, softmax_scale=None, is_causal=False, dtype=torch.float64):
    """The same in torch SDPA's (B, H, S, D) layout and top-left causal alignment."""
    out = attention_reference(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        softmax_scale=softmax_scale, causal=is_causal, bottom_right=False, dtype=dtype,
    )
    return out.transpose(1, 2)


def attention_flops(batch: int, heads: int, seqlen: int, head_dim: int, causal: bool = False,
                    mode: str = "fwd", seqlen_k: int | None = None, variant: Variant | None = None) -> float:
    """FLOPs by the FlashAttention papers' convention: 4·B·H·Sq·Sk·D forward (Sk = Sq unless given),
    halved when causal; backward 2.5× forward, forward+backward 3.5×. A `variant` whose mask is more than causal
    (a window) counts its visible pairs exactly (`Variant.visible_flops`)."""
    seqlen_k = seqlen if seqlen_k is None else seqlen_k
    if variant is not None and variant.window != (-1, -1) and "window_size" in variant.fields():
        return variant.visible_flops(batch, heads, seqlen, seqlen_k, head_dim, mode)
    causal = causal or (variant is not None and variant.causal)
    flops = 4.0 * batch * heads * seqlen * seqlen_k * head_dim
    if causal:
        flops /= 2
    return flops * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]


def attention_bytes(batch: int, heads: int, seqlen: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """Fewest bytes the forward moves: Q, K, V read once and O written once (the notebook's count)."""
    return dtype_bytes * batch * heads * head_dim * (seqlen + 2 * seqlen + seqlen)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 interleaved: bool = False, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """flash-attn's `apply_rotary_emb` in `dtype` (float64 by default): x (B, S, H, D) with token s of sequence b
    at table row positions[b, s] ((B, S) ints); cos, sin (seqlen_ro, rotary_dim / 2). The first rotary_dim dims
    rotate in pairs, (2c, 2c + 1) when interleaved (GPT-J) or (c, c + rotary_dim / 2) (GPT-NeoX), by the angle
    of table column c: (x_a, x_b) -> (x_a cos - x_b sin, x_b cos + x_a sin); the rest pass through. Returns
    `dtype`."""
    rotary_dim = 2 * cos.shape[1]
    x = x.to(dtype)
    rows = positions.long()
    c = cos.to(dtype)[rows][:, :, None, :]  # (B, S, 1, rotary_dim / 2)
    s = sin.to(dtype)[rows][:, :, None, :]
    ro = x[..., :rotary_dim]
    if interleaved:
        a, b = ro[..., 0::2], ro[..., 1::2]
        rotated = torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)
    else:
        a, b = ro[..., : rotary_dim // 2], ro[..., rotary_dim // 2:]
        rotated = torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)
