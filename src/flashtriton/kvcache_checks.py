"""The checks of `flash_attn_with_kvcache`'s arguments: `check_call` (everything but the device tensors' values:
a ValueError / TypeError naming the bad argument, NotImplementedError for what is not built) and `check_values`
(the values of cache_seqlens, cache_batch_idx, block_table and cache_leftpad, copied to the host once, under
FLASHTRITON_CHECK_VALUES=1: `paging.CHECK_VALUES`; otherwise the kernels check them without a sync).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import rotary as R
from . import validation as V
from .kernels.decode_launch import MAX_CAPACITY, Rotary

CACHE_LAYOUT = "(batch_cache, seqlen_cache, nheads_k, headdim) or paged (num_pages, page_size, nheads_k, headdim)"


def check_int32_tensor(name: str, t, shape: tuple[int, ...], shape_text: str, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor of shape {shape_text}, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape_text} = {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like q, got {t.device}")


def cache_too_small(shown: str, cached: int, seqlen_new: int, capacity: int, block_table) -> ValueError:
    where = (f"block_table: {block_table.shape[1]} pages of {capacity // block_table.shape[1]}"
             if block_table is not None else "k_cache.shape[1]")
    return ValueError(f"the cache is too small: cache_seqlens ({shown}) + seqlen_new ({seqlen_new}) = "
                      f"{cached + seqlen_new} keys, but the cache holds {capacity} per sequence ({where})")


def check_values(cache_seqlens, cache_batch_idx, block_table, seqlen_new: int, capacity: int, cache_rows: int,
                 cache_leftpad=None, rotary: Rotary | None = None):
    """Host-side range checks of the device tensors' values: one stacked device-to-host copy."""
    stats, labels = [cache_seqlens.min(), cache_seqlens.max()], ["seqlens_min", "seqlens_max"]
    if cache_leftpad is not None:
        stats += [cache_leftpad.min(), (cache_leftpad.long() - cache_seqlens.long()).max()]
        labels += ["pad_min", "pad_excess"]
    if cache_batch_idx is not None:
        stats += [cache_batch_idx.min(), cache_batch_idx.max()]
        labels += ["bidx_min", "bidx_max"]
    if block_table is not None and block_table.numel():
        page_size = capacity // block_table.shape[1]
        lengths = cache_seqlens.long() + seqlen_new
        pages_needed = (lengths.clamp(min=0) + page_size - 1) // page_size  # (B,)
        used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < pages_needed[:, None]
        stats += [torch.where(used, block_table, 0).min(), torch.where(used, block_table, 0).max()]
        labels += ["page_min", "page_max"]
    values = dict(zip(labels, torch.stack([s.to(torch.int64) for s in stats]).tolist()))
    if values["seqlens_min"] < 0:
        raise ValueError(f"cache_seqlens must be >= 0, got a minimum of {values['seqlens_min']}")
    if values["seqlens_max"] + seqlen_new > capacity:
        raise cache_too_small(f"max {values['seqlens_max']}", values["seqlens_max"], seqlen_new, capacity, block_table)
    if "pad_min" in values and values["pad_min"] < 0:
        raise ValueError(f"cache_leftpad must be >= 0, got a minimum of {values['pad_min']}")
    if "pad_excess" in values and values["pad_excess"] > 0:
        raise ValueError(f"cache_leftpad must be <= cache_seqlens (the pad's rows count in the cache length), got "
                         f"a pad {values['pad_excess']} rows past its sequence's cache_seqlens")
    if rotary is not None and values["seqlens_max"] > rotary.max_cached:
        R.check_length(rotary.cos, rotary.cos.shape[0] - rotary.max_cached, values["seqlens_max"])
    if "bidx_min" in values and not (0 <= values["bidx_min"] and values["bidx_max"] < cache_rows):
        raise ValueError(f"cache_batch_idx must be in 0..{cache_rows - 1} (rows of k_cache), got values in "
                         f"{values['bidx_min']}..{values['bidx_max']}")
    if "page_min" in values and not (0 <= values["page_min"] and values["page_max"] < cache_rows):
        raise ValueError(f"block_table entries used by the sequences must be in 0..{cache_rows - 1} (pages of "
                         f"k_cache), got values in {values['page_min']}..{values['page_max']}")


def check_no_grad(**tensors) -> None:
    if not torch.is_grad_enabled():
        return
    needing = [n for n, t in tensors.items() if t is not None and t.requires_grad]
    if needing:
        raise NotImplementedError(
            f"flash_attn_with_kvcache is inference-only (no backward), but {', '.join(needing)} "
            f"require{'s' if len(needing) == 1 else ''} grad: call it under torch.no_grad() or "
            "torch.inference_mode(), or pass detached tensors"
        )


class Checked(NamedTuple):
    """What the checks of a call derive from its signature."""
    seqlen_new: int  # keys appended by the call
    capacity: int  # keys the cache holds per sequence
    max_cached: int  # an upper bound of cache_seqlens (sizes the split heuristic)
    window_size: tuple[int, int]  # (left, right), checked (-1: unbounded)
    softcap: float  # 0.0: off
    rotary_per_query: bool  # q rotated at cache_seqlens + i (else at cache_seqlens); False without rotary


def check_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
               block_table, softmax_scale, window_size, softcap, alibi_slopes, num_splits, tracing=False,
               learnable_sink=None, causal=False) -> Checked:
    """Every check of flash_attn_with_kvcache's arguments (a clear error for each bad one) but those of the
    device tensors' values (`check_values` under `paging.CHECK_VALUES`, else the kernels). While tracing, the
    addresses are unknown: the op checks that k_cache and v_cache are not one memory when it runs."""
    window_size = V.check_window(window_size)
    softcap = V.check_softcap(softcap)

    if (k is None) != (v is None):
        raise ValueError(f"k and v must be given together, got k={'None' if k is None else 'a tensor'}, "
                         f"v={'None' if v is None else 'a tensor'}")
    names = ("q", "k_cache", "v_cache") + (("k", "v") if k is not None else ())
    tensors = (q, k_cache, v_cache) + ((k, v) if k is not None else ())
    V.check_tensors(names, tensors, 4, "(q, k, v: (batch, seqlen, nheads, headdim); caches: " + CACHE_LAYOUT + ")")
    device = q.device
    batch, seqlen_q, heads_q, head_dim = q.shape
    V.check_alibi(alibi_slopes, batch, heads_q, device)
    V.check_sink(learnable_sink, heads_q, q.dtype, device)
    if tuple(v_cache.shape[:-1]) != tuple(k_cache.shape[:-1]):
        raise ValueError(f"v_cache must have the shape of k_cache {tuple(k_cache.shape)} but for its head dim, got "
                         f"{tuple(v_cache.shape)}")
    heads_kv = k_cache.shape[2]
    V.check_heads_and_dims(heads_q, heads_kv, head_dim, v_cache.shape[3], v_cache.shape[2], separate_v=True)
    V.check_same("head dims of q and k_cache", q=head_dim, k_cache=k_cache.shape[3])
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim (it is updated in place), got strides {t.stride()}")
        if k is not None and any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
            raise ValueError(f"{name} overlaps itself (an expanded tensor, strides {t.stride()}): appending k/v "
                             "would write several sequences into the same memory; pass a cache with its own storage")
    if k is not None and not tracing and k_cache.data_ptr() == v_cache.data_ptr():
        raise ValueError("k_cache and v_cache are the same memory: appending k and v would overwrite each other")
    V.check_scale("softmax_scale", softmax_scale, allow_negative=True)
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or not 0 <= num_splits <= 128:
        raise ValueError(f"num_splits must be an int in 0..128 (0 = choose), got {num_splits!r}")

    seqlen_new = 0
    if k is not None:
        seqlen_new = k.shape[1]
        expected = (batch, seqlen_new, heads_kv, head_dim)
        if tuple(k.shape) != expected:
            raise ValueError(f"k must have shape (batch, seqlen_new, nheads_k, headdim) = {expected}, got {tuple(k.shape)}")
        expected_v = (*expected[:3], v_cache.shape[3])
        if tuple(v.shape) != expected_v:
            raise ValueError(f"v must have the shape of k but for its head dim, v_cache's: {expected_v}, got "
                             f"{tuple(v.shape)}")

    paged = block_table is not None
    if paged:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx is for a contiguous cache; with block_table (paged cache) it must be None")
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
            got = f"shape {tuple(block_table.shape)}" if isinstance(block_table, torch.Tensor) else type(block_table).__name__
            raise (ValueError if isinstance(block_table, torch.Tensor) else TypeError)(
                f"block_table must be a 2-D int32 tensor (batch_size, max_num_pages), got {got}")
        check_int32_tensor("block_table", block_table, (batch, block_table.shape[1]), "(batch_size, max_num_pages)", device)
        page_size = k_cache.shape[1]
        if page_size % 16 != 0 or page_size == 0:
            raise ValueError(f"the page size (k_cache.shape[1]) must be a positive multiple of 16 with block_table, got {page_size}")
        capacity = block_table.shape[1] * page_size
    else:
        batch_cache, capacity = k_cache.shape[0], k_cache.shape[1]
        if cache_batch_idx is not None:
            check_int32_tensor("cache_batch_idx", cache_batch_idx, (batch,), "(batch_size,)", device)
        elif batch_cache < batch:
            raise ValueError(
                f"k_cache has {batch_cache} rows (batch_size_cache) but q has batch {batch}: pass cache_batch_idx "
                "or a cache with at least batch_size rows")
    if capacity > MAX_CAPACITY:
        where = (f"block_table.shape[1] ({block_table.shape[1]}) pages of {k_cache.shape[1]}" if paged
                 else "k_cache.shape[1]")
        raise ValueError(f"the cache holds {capacity} keys per sequence ({where}), more than the {MAX_CAPACITY} "
                         "the kernels' int32 key positions allow")

    # cache_seqlens: Python ints are checked here; the values of device tensors (cache_seqlens, cache_batch_idx,
    # the used block_table entries) are checked by the kernels without a device-to-host sync (a sequence with a
    # bad value gets NaN and no append), or by `check_values` with one sync and a ValueError when CHECK_VALUES
    # is on (never while a CUDA graph is captured).
    if cache_seqlens is None:
        max_cached = capacity
    elif isinstance(cache_seqlens, torch.Tensor):
        check_int32_tensor("cache_seqlens", cache_seqlens, (batch,), "(batch_size,)", device)
        max_cached = max(capacity - seqlen_new, 0)
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= capacity:
            raise ValueError(f"cache_seqlens must be in 0..{capacity} (the cache capacity), got {cache_seqlens}")
        max_cached = cache_seqlens
    else:
        raise TypeError(f"cache_seqlens must be None, an int or an int32 tensor (batch_size,), got {type(cache_seqlens).__name__}")
    if batch and max_cached + seqlen_new > capacity:
        raise cache_too_small(str(max_cached), max_cached, seqlen_new, capacity, block_table)

    # Left padding and rotary embedding; the values of cache_leftpad, and of a tensor cache_seqlens against the
    # tables' length, are checked where the others are (the kernels, or CHECK_VALUES).
    if cache_leftpad is not None:
        if paged:
            raise NotImplementedError("cache_leftpad with block_table (a paged cache) is not supported (flash-attn "
                                      "does not support them together either)")
        check_int32_tensor("cache_leftpad", cache_leftpad, (batch,), "(batch_size,)", device)
    rotary_per_query = False
    if rotary_cos is not None or rotary_sin is not None:
        R.check_rotary(rotary_cos, rotary_sin, k, q)
        rotary_per_query = R.per_query(bool(causal), window_size, capacity)
        needed = R.positions_needed(seqlen_q, seqlen_new, rotary_per_query)
        R.check_length(rotary_cos, needed, None if isinstance(cache_seqlens, torch.Tensor) else max_cached)

    check_no_grad(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, alibi_slopes=alibi_slopes,
                   learnable_sink=learnable_sink, rotary_cos=rotary_cos, rotary_sin=rotary_sin)
    return Checked(seqlen_new, capacity, max_cached, window_size, softcap, rotary_per_query)
