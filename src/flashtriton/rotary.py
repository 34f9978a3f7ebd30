"""Rotary embedding in KV-cache decoding (`flash_attn_with_kvcache`'s rotary_cos, rotary_sin, rotary_interleaved):
the host's checks of the tables and flash-attn 2's rule for the positions q is rotated at. The kernels rotate
(`kernels/rotary.py`): the new keys in the append, q as the decode kernels load it.
"""

from __future__ import annotations

import torch


def check_rotary(rotary_cos, rotary_sin, k, q: torch.Tensor) -> int:
    """flash-attn's checks of the tables (a clear error naming the argument): both given, 2-D (seqlen_ro,
    rotary_dim / 2) of one shape, q's dtype and device, rotary_dim a multiple of 16 and at most the head dim, and
    new keys to rotate (k). Returns rotary_dim. Their length against the positions is `check_length`'s."""
    if (rotary_cos is None) != (rotary_sin is None):
        given, missing = ("rotary_cos", "rotary_sin") if rotary_sin is None else ("rotary_sin", "rotary_cos")
        raise ValueError(f"rotary_cos and rotary_sin must be given together: {given} is a tensor, {missing} is None")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape (seqlen_ro, rotary_dim / 2), got "
                            f"{type(t).__name__}")
    if k is None:
        raise ValueError("rotary_cos and rotary_sin rotate the new keys as they are appended: pass k and v with "
                         "them (as flash-attn requires)")
    if rotary_cos.dim() != 2:
        raise ValueError(f"rotary_cos must have shape (seqlen_ro, rotary_dim / 2), got {tuple(rotary_cos.shape)}")
    if rotary_sin.shape != rotary_cos.shape:
        raise ValueError(f"rotary_sin must have the shape of rotary_cos {tuple(rotary_cos.shape)}, got "
                         f"{tuple(rotary_sin.shape)}")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype} (as flash-attn requires), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on {q.device} like q, got {t.device}")
    rotary_dim, head_dim = 2 * rotary_cos.shape[1], q.shape[-1]
    if rotary_dim == 0 or rotary_dim % 16 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim (2 x rotary_cos.shape[1]) must be a positive multiple of 16 (as flash-attn "
                         f"requires) and at most the head dim {head_dim}, got {rotary_dim}")
    return rotary_dim


def per_query(causal: bool, window_size: tuple[int, int], capacity: int) -> bool:
    """flash-attn 2's rule: with causal or local attention query i is rotated at position cache_seqlens + i, else
    every query at cache_seqlens. Local: a window side >= 0 and shorter than the cache (flash-attn treats a side
    of seqlen_cache or more as unbounded)."""
    return bool(causal) or any(0 <= side < capacity for side in window_size)


def positions_needed(seqlen_q: int, seqlen_new: int, per_query: bool) -> int:
    """How many table rows from cache_seqlens on one call reads: the new keys' and the queries'."""
    return max(seqlen_new, seqlen_q if per_query else min(seqlen_q, 1))


def check_length(rotary_cos: torch.Tensor, needed: int, cached: int | None) -> None:
    """The tables hold every position read: cache_seqlens + `needed` rows (`cached`: a Python int cache_seqlens;
    None for a tensor, whose values the kernels check, or the host with CHECK_VALUES)."""
    seqlen_ro, total = rotary_cos.shape[0], needed + (cached or 0)
    if seqlen_ro < total:
        parts = f"cache_seqlens ({cached}) + {needed} = {total}" if cached else f"{total}"
        raise ValueError(f"rotary_cos and rotary_sin have {seqlen_ro} rows (seqlen_ro), but the call rotates at "
                         f"positions up to {total - 1}: it needs {parts} rows (the new keys' positions, and the "
                         "queries' when causal or local)")
