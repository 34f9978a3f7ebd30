"""KV-cache decoding: flash-attn's `flash_attn_with_kvcache` (contiguous or paged cache, split-KV; sliding
windows, softcap, ALiBi and attention sinks; rotary embedding of q and the new keys, left-padded caches).

Inference only: there is no backward. See `flash_attn_with_kvcache` for the arguments and
`flashtriton.kernels.decode` / `decode_launch` for the kernels and their launcher. Eager calls run the checked arguments straight to the kernels
(`_decode_step`); under torch.compile / export the same work is the op `flashtriton::kvcache` (`kvcache_op`).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple, Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import rotary as R
from . import validation as V
from .kernels.decode_launch import MAX_CAPACITY, Rotary, append_kv, decode_attention
from .kernels.launch import on_inputs_device

# Check the values of cache_seqlens, cache_batch_idx and block_table on the host (one device-to-host copy per
# call, a ValueError naming the bad value) instead of in the kernels (no sync; the sequence gets NaN). Read when
# the call runs, eager or compiled alike (`_decode_step`); never while a CUDA graph is captured.
CHECK_VALUES: bool = os.environ.get("FLASHTRITON_CHECK_VALUES", "0") == "1"

_CACHE_LAYOUT = "(batch_cache, seqlen_cache, nheads_k, headdim) or paged (num_pages, page_size, nheads_k, headdim)"


def _check_int32_tensor(name: str, t, shape: tuple[int, ...], shape_text: str, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor of shape {shape_text}, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape_text} = {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like q, got {t.device}")


def _cache_too_small(shown: str, cached: int, seqlen_new: int, capacity: int, block_table) -> ValueError:
    where = (f"block_table: {block_table.shape[1]} pages of {capacity // block_table.shape[1]}"
             if block_table is not None else "k_cache.shape[1]")
    return ValueError(f"the cache is too small: cache_seqlens ({shown}) + seqlen_new ({seqlen_new}) = "
                      f"{cached + seqlen_new} keys, but the cache holds {capacity} per sequence ({where})")


def _check_values(cache_seqlens, cache_batch_idx, block_table, seqlen_new: int, capacity: int, cache_rows: int,
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
        raise _cache_too_small(f"max {values['seqlens_max']}", values["seqlens_max"], seqlen_new, capacity, block_table)
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


def _check_no_grad(**tensors) -> None:
    if not torch.is_grad_enabled():
        return
    needing = [n for n, t in tensors.items() if t is not None and t.requires_grad]
    if needing:
        raise NotImplementedError(
            f"flash_attn_with_kvcache is inference-only (no backward), but {', '.join(needing)} "
            f"require{'s' if len(needing) == 1 else ''} grad: call it under torch.no_grad() or "
            "torch.inference_mode(), or pass detached tensors"
        )


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    learnable_sink: torch.Tensor | None = None,
):
    """Attention of a few new queries against a KV cache, appending new keys/values first (flash-attn's API,
    with flash-attn 2.x's parameters in its order: positional calls bind as there; learnable_sink, which
    flash-attn 2.x lacks, is keyword-only, FlashAttention-4's name).

    If k and v are not None, k_cache and v_cache are updated *in place* with them, at positions
    cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 of sequence b, and attention then covers the updated
    cache: cache_seqlens[b] + seqlen_new keys. This is incremental decoding in one call: pass the cache of the
    previous steps and the new step's keys/values. The cache must have room for them (checked): pre-allocate
    it for the longest sequence and track each sequence's length with cache_seqlens.

    Rotary embedding, if rotary_cos and rotary_sin are given (with k and v): each new key is rotated at its cache
    position, cache_seqlens[b] + j, before it is written into the cache. If causal or local (window_size with a
    side >= 0 shorter than the cache), query i is rotated at position cache_seqlens[b] + i; otherwise every
    query at cache_seqlens[b] (all of q counts as one position). The rotation is computed in fp32 inside the
    kernels (the new keys as they are appended, q as the kernels load it) and rounded to the inputs' dtype, as
    in flash-attn. Keys already in the cache are not rotated again.

    Supports multi-query and grouped-query attention (MQA/GQA) with fewer KV heads than Q heads: nheads must
    be a multiple of nheads_k. With 6 Q heads and 2 KV heads, Q heads 0, 1, 2 attend to KV head 0 and Q heads
    3, 4, 5 to KV head 1. The query heads of one KV head are processed together: its cache is read once.

    If causal=True, the causal mask is aligned to the bottom-right corner of the attention matrix (query i of
    seqlen_q sees key j iff j <= i + seqlen_k - seqlen_q, seqlen_k = cache_seqlens[b] + seqlen_new).
    For seqlen_q = 2, seqlen_k = 5 (1 = keep, 0 = masked out):      For seqlen_q = 5, seqlen_k = 2:
        1 1 1 1 0                                                       0 0
        1 1 1 1 1                                                       0 0
                                                                        0 0
                                                                        1 0
                                                                        1 1
    If a row of the mask is all zero (or the sequence has no key), its output is zero and its lse -inf.

    Split-KV: the keys of each sequence are cut into `num_splits` chunks read by parallel programs, whose
    partial results are merged through their log-sum-exps ("flash-decoding"), so a small batch still fills
    the GPU. With num_splits=0, batches of several sequences with long caches (>= 32k keys) take the stream
    schedule instead: all the batch's key tiles, counted from cache_seqlens on the GPU, are cut into equal
    ranges, one per program, so that sequences of different lengths leave no program idle
    (`FLASHTRITON_KERNEL=auto,split|stream` overrides the choice).

    Under torch.compile / torch.export the call is the op torch.ops.flashtriton.kvcache, which updates the caches
    in place: a decode step compiles with fullgraph=True.

    Inference only (no backward): with grad mode on, inputs that require grad raise NotImplementedError; call
    it under torch.no_grad() / torch.inference_mode() (the result then does not require grad).

    Arguments:
        q: (batch_size, seqlen_q, nheads, headdim); any seqlen_q (decoding: 1 or a few).
        k_cache: (batch_size_cache, seqlen_cache, nheads_k, headdim) if there is no block_table,
            or (num_pages, page_size, nheads_k, headdim) if there is one (paged KV cache);
            page_size must be a multiple of 16. Last dim contiguous (it is written in place: never copied).
        v_cache: the shape of k_cache, or with a headdim_v of its own (the output's: DeepSeek's MLA).
        k [optional]: (batch_size, seqlen_new, nheads_k, headdim). If not None, written into k_cache starting
            at the positions given by cache_seqlens (through block_table when paged).
        v [optional]: (batch_size, seqlen_new, nheads_k, headdim_v). Like k; k and v come together.
        rotary_cos [optional]: (seqlen_ro, rotary_dim / 2), q's dtype: the cos of the rotary embedding's angle
            at each position; rotary_dim a multiple of 16, at most headdim (only the first rotary_dim dims of q
            and k rotate). Needs k and v. seqlen_ro must cover every position rotated: cache_seqlens[b] +
            seqlen_new new keys, and cache_seqlens[b] + seqlen_q queries when causal or local (flash-attn asks
            for seqlen_cache rows; fewer are enough here). A Python int cache_seqlens is checked against it on
            the host; a tensor's values are checked like the ones below (NaN for that sequence).
        rotary_sin [optional]: the sin, of rotary_cos's shape, dtype and device.
        cache_seqlens: int, or (batch_size,) torch.int32 tensor: the number of keys already in the cache for
            each sequence (0 .. capacity). None means the whole cache (seqlen_cache, or max_num_pages ·
            page_size when paged).
        cache_batch_idx [optional]: (batch_size,) torch.int32: the row of k_cache / v_cache each sequence
            uses (contiguous cache only). None means rows 0 .. batch_size - 1 (batch_size_cache may be
            larger). If indices repeat and k, v are given, which sequence's new values land is unspecified.
        cache_leftpad [optional]: (batch_size,) torch.int32: the cache row where sequence b's keys start
            (contiguous cache only: with block_table it raises NotImplementedError, as in flash-attn). Its keys
            are rows cache_leftpad[b] .. cache_seqlens[b] + seqlen_new - 1: cache_seqlens counts the pad's rows,
            new keys are appended at cache_seqlens[b], and the causal mask, windows and ALiBi align on the
            sequence's own seqlen_k = cache_seqlens[b] - cache_leftpad[b] + seqlen_new keys. Rotary positions
            are cache rows (not counted from the pad), as in flash-attn. Needs 0 <= cache_leftpad[b] <=
            cache_seqlens[b] (checked like the values below).
        block_table [optional]: (batch_size, max_num_pages) torch.int32: block_table[b, p] is the page that
            holds keys p · page_size .. (p + 1) · page_size - 1 of sequence b. Only the pages covering the
            sequence's keys, the new ones included, are used (and checked to be in range); later entries
            may hold anything (e.g. -1).
            Values of these tensors are checked on the GPU, without a device-to-host sync (decoding stays
            asynchronous and CUDA-graph friendly): a sequence whose cache_seqlens is negative or leaves no
            room for seqlen_new, whose cache_batch_idx is not a row of the cache, one of whose used
            block_table entries is not a page of the cache, whose cache_leftpad is out of range, or whose
            positions run past the rotary tables, is never read or written out of bounds: none of
            its new keys is appended and its output and lse are NaN (other sequences are unaffected). Set the
            environment variable FLASHTRITON_CHECK_VALUES=1 (or flashtriton.kvcache.CHECK_VALUES = True) to
            check them on the host instead, with a ValueError naming the bad value, in eager and compiled calls
            alike (one sync per call; skipped while a CUDA graph is captured).
        softmax_scale: float. The scaling of QK^T before the softmax. Default 1 / sqrt(headdim).
        causal: bool. Whether to apply the bottom-right causal mask drawn above.
        window_size: (left, right). Sliding-window attention: query i sees key j iff
            i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right (seqlen_k of each sequence,
            after the append); -1 is unbounded on that side; with causal=True the right side is 0. Only the
            window's keys are read from the cache (its tiles and pages), so a step costs the window, not the
            cache. A row whose window holds no key returns 0 (lse -inf).
        softcap: float > 0 caps the scores: softcap * tanh(scores / softcap), before the mask and ALiBi
            (0 or None: off).
        alibi_slopes: fp32 (nheads,) or (batch_size, nheads): adds -slope * |i + seqlen_k - seqlen_q - j| to the
            scores (after softcap).
        rotary_interleaved: bool. The rotary embedding's pairs: True rotates dims (0, 1), (2, 3), ... (GPT-J);
            False rotates dims (i, i + rotary_dim / 2) (GPT-NeoX). No effect without rotary_cos / rotary_sin.
        num_splits: int. If > 1, split each sequence's keys into this many chunks (at most 128). If 1, no
            split. If 0 (default), chosen from the shape and the GPU's SM count (or the stream schedule above).
        return_softmax_lse: bool. Whether to also return the log-sum-exp of the attention scores.
        learnable_sink [keyword-only]: (nheads,), fp32 or q's dtype: one extra logit per query head, unscaled,
            counted in the softmax's denominator only (gpt-oss' attention sinks); the returned lse includes it
            (a row that sees no key then has lse = the sink and out 0).

    Dtypes: q, k_cache, v_cache, k, v all fp16, all bf16 or all fp32 (fp32 accumulation); headdim and headdim_v
    1..256.

    Return:
        out: (batch_size, seqlen_q, nheads, headdim_v), q's dtype.
        softmax_lse [optional, if return_softmax_lse=True]: (batch_size, nheads, seqlen_q) fp32, the natural
            log-sum-exp of each row of the scores (QK^T · softmax_scale, capped and biased as asked; the sink
            included; -inf for a row that sees no key and has no sink).
    """
    # Under torch.compile / export (or any dispatch mode, or tensor subclasses) the call becomes the registered
    # op `flashtriton::kvcache` (it mutates the caches: an opaque node in the graph, no graph break).
    tracing = (torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
               or not V.plain_tensors(q, k_cache, v_cache, k, v, cache_batch_idx, block_table, alibi_slopes,
                                      learnable_sink, rotary_cos, rotary_sin, cache_leftpad)
               or (isinstance(cache_seqlens, torch.Tensor) and type(cache_seqlens) is not torch.Tensor))
    # Every check's outcome depends only on the call's signature (shapes, strides, dtypes, devices, options):
    # a signature that passed once skips them (decoding repeats one call shape at every step).
    # The values of the device tensors are checked where the work runs (`_decode_step`), not here.
    signature = None if tracing else _signature(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
        block_table, softmax_scale, causal, window_size, softcap, alibi_slopes, num_splits, return_softmax_lse,
        learnable_sink, rotary_interleaved)
    checked = _CHECKED.get(signature) if signature is not None else None
    if checked is None:
        checked = _check_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                              cache_leftpad, block_table, softmax_scale, window_size, softcap, alibi_slopes,
                              num_splits, tracing, learnable_sink, causal)
        if signature is not None:
            if len(_CHECKED) >= _CHECKED_LIMIT:
                _CHECKED.clear()
            _CHECKED[signature] = checked
    seqlen_new, capacity, max_cached, (window_left, window_right), softcap, rotary_per_query = checked
    if alibi_slopes is not None and alibi_slopes.stride(-1) != 1:  # the kernels read the slopes of a row in a row
        alibi_slopes = alibi_slopes.contiguous()
    if learnable_sink is not None and learnable_sink.stride(0) != 1:
        learnable_sink = learnable_sink.contiguous()
    if rotary_cos is not None:  # the kernels index the tables as contiguous (seqlen_ro, rotary_dim / 2)
        rotary_cos, rotary_sin = rotary_cos.contiguous(), rotary_sin.contiguous()
    batch, _, _, head_dim = q.shape
    device = q.device

    if cache_seqlens is None:
        cache_seqlens = torch.full((batch,), capacity, dtype=torch.int32, device=device)
    elif not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    if scale < 0:  # the kernels keep a running maximum of the scaled scores: softmax(s·qk) = softmax(|s|·(-q)k)
        q, scale = -q, -scale
    max_seqlen_k = max_cached + seqlen_new if batch else 0
    variant = (window_left, window_right, softcap, alibi_slopes, learnable_sink, rotary_cos, rotary_sin, cache_leftpad,
               bool(rotary_interleaved), rotary_per_query)
    if tracing:
        out, lse = kvcache_op(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, scale,
                              bool(causal), num_splits, max_seqlen_k, seqlen_new, *variant)
        return (out, lse) if return_softmax_lse else out
    out, lse = _decode_step(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, scale,
                            bool(causal), num_splits, max_seqlen_k, seqlen_new, bool(return_softmax_lse), *variant)
    return (out, lse) if return_softmax_lse else out


@on_inputs_device
def _decode_step(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale, causal,
                 num_splits, max_seqlen_k, seqlen_new, return_lse, window_left=-1, window_right=-1, softcap=0.0,
                 alibi_slopes=None, learnable_sink=None, rotary_cos=None, rotary_sin=None, cache_leftpad=None,
                 rotary_interleaved=True, rotary_per_query=False):
    """Append k, v (if any) into the caches in place, then attend: the checked call's work, (out, lse or None).
    With CHECK_VALUES the values of cache_seqlens, cache_batch_idx, block_table and cache_leftpad (and
    cache_seqlens against the rotary tables' length) are checked first, on the host (eager calls and the op
    alike; not while a CUDA graph is captured): a bad one raises, nothing written.
    window_left / window_right, softcap, alibi_slopes, learnable_sink: the checked variant (-1, -1, 0.0, None,
    None: off). rotary_cos / rotary_sin (contiguous), rotary_interleaved, rotary_per_query (`rotary.per_query`):
    the checked rotary embedding (None: off); cache_leftpad: the checked left pads (None: none)."""
    rotary = None
    if rotary_cos is not None:
        needed = R.positions_needed(q.shape[1], seqlen_new, rotary_per_query)
        rotary = Rotary(rotary_cos, rotary_sin, bool(rotary_interleaved), bool(rotary_per_query),
                        rotary_cos.shape[0] - needed)
    if cache_leftpad is not None and cache_leftpad.stride(0) != 1:
        cache_leftpad = cache_leftpad.contiguous()
    if CHECK_VALUES and q.shape[0] and not (q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        page_size = k_cache.shape[1]
        capacity = block_table.shape[1] * page_size if block_table is not None else page_size
        _check_values(cache_seqlens, cache_batch_idx, block_table, seqlen_new, capacity, k_cache.shape[0],
                      cache_leftpad, rotary)
    if cache_seqlens.stride(0) != 1:
        cache_seqlens = cache_seqlens.contiguous()
    q = V.last_dim_contiguous(q)
    if cache_batch_idx is not None and cache_batch_idx.stride(0) != 1:
        cache_batch_idx = cache_batch_idx.contiguous()
    if block_table is not None and block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    if seqlen_new and q.shape[0]:  # append the new keys/values in place (through the page table when paged)
        append_kv(V.last_dim_contiguous(k), V.last_dim_contiguous(v), k_cache, v_cache, cache_seqlens,
                  cache_batch_idx, block_table, rotary, cache_leftpad)
    return decode_attention(
        q, k_cache, v_cache, cache_seqlens, max_seqlen_k, softmax_scale, causal, cache_batch_idx=cache_batch_idx,
        block_table=block_table, num_splits=num_splits, seqlen_new=seqlen_new, return_lse=return_lse,
        window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
        learnable_sink=learnable_sink, rotary=rotary, cache_leftpad=cache_leftpad,
    )


@torch.library.custom_op("flashtriton::kvcache", mutates_args=("k_cache", "v_cache"))
def kvcache_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: Optional[torch.Tensor],
    v: Optional[torch.Tensor], cache_seqlens: torch.Tensor, cache_batch_idx: Optional[torch.Tensor],
    block_table: Optional[torch.Tensor], softmax_scale: float, causal: bool, num_splits: int, max_seqlen_k: int,
    seqlen_new: int, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None, learnable_sink: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None, rotary_sin: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None, rotary_interleaved: bool = True, rotary_per_query: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`flash_attn_with_kvcache` on checked arguments as an operator (what torch.compile and export see):
    cache_seqlens an int32 tensor, softmax_scale resolved, window_size as its two sides, the rotary tables
    contiguous with the positions' rule resolved (`rotary.per_query`); returns (out, lse) and updates the caches
    in place."""
    if k is not None and k_cache.data_ptr() == v_cache.data_ptr():  # the one check tracing cannot make
        raise ValueError("k_cache and v_cache are the same memory: appending k and v would overwrite each other")
    return _decode_step(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale,
                        causal, num_splits, max_seqlen_k, seqlen_new, True, window_left, window_right, softcap,
                        alibi_slopes, learnable_sink, rotary_cos, rotary_sin, cache_leftpad, rotary_interleaved,
                        rotary_per_query)


@kvcache_op.register_fake
def _(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale, causal, num_splits,
      max_seqlen_k, seqlen_new, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
      learnable_sink=None, rotary_cos=None, rotary_sin=None, cache_leftpad=None, rotary_interleaved=True,
      rotary_per_query=False):
    batch, seqlen_q, heads_q, _ = q.shape
    return (q.new_empty((batch, seqlen_q, heads_q, v_cache.shape[-1])),
            q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32))


class _Checked(NamedTuple):
    """What the checks of a call derive from its signature."""
    seqlen_new: int  # keys appended by the call
    capacity: int  # keys the cache holds per sequence
    max_cached: int  # an upper bound of cache_seqlens (sizes the split heuristic)
    window_size: tuple[int, int]  # (left, right), checked (-1: unbounded)
    softcap: float  # 0.0: off
    rotary_per_query: bool  # q rotated at cache_seqlens + i (else at cache_seqlens); False without rotary


_CHECKED: dict = {}  # signature -> _Checked, for signatures whose checks passed
_CHECKED_LIMIT = 1024


def _tensor_signature(t):
    return t.shape, t.stride(), t.dtype, t.device, t.requires_grad


def _signature(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
               block_table, softmax_scale, causal, window_size, softcap, alibi_slopes, num_splits,
               return_softmax_lse, learnable_sink=None, rotary_interleaved=True):
    """A hashable key that fixes the outcome of every check in `_check_call`, or None for calls that must take
    the checks every time (arguments of unusual types, unsupported options: they raise there). The caller has
    made sure the tensor arguments are plain tensors or None (not tracing)."""
    tensors = (q, k_cache, v_cache, k, v, cache_batch_idx, block_table, alibi_slopes, learnable_sink, rotary_cos,
               rotary_sin, cache_leftpad)
    if q is None or k_cache is None or v_cache is None:
        return None
    if type(cache_seqlens) is torch.Tensor:
        seqlens = _tensor_signature(cache_seqlens)
    elif cache_seqlens is None or type(cache_seqlens) is int:
        seqlens = cache_seqlens
    else:
        return None
    if not (type(window_size) in (tuple, list) and len(window_size) == 2 and all(type(w) is int for w in window_size)
            and (softcap is None or type(softcap) in (float, int))
            and all(t is None or type(t) is torch.Tensor
                    for t in (alibi_slopes, learnable_sink, rotary_cos, rotary_sin, cache_leftpad))
            and type(rotary_interleaved) is bool and type(num_splits) is int
            and (softmax_scale is None or type(softmax_scale) in (float, int))):
        return None
    return (
        tuple(None if t is None else _tensor_signature(t) for t in tensors), seqlens, softmax_scale, bool(causal),
        tuple(window_size), softcap, num_splits, bool(return_softmax_lse), torch.is_grad_enabled(), rotary_interleaved,
        k is not None and k_cache.data_ptr() == v_cache.data_ptr(),  # the shared-memory check
    )


def _check_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                block_table, softmax_scale, window_size, softcap, alibi_slopes, num_splits, tracing=False,
                learnable_sink=None, causal=False) -> _Checked:
    """Every check of flash_attn_with_kvcache's arguments (a clear error for each bad one) but those of the
    device tensors' values (`_decode_step` with CHECK_VALUES, else the kernels). While tracing, the addresses
    are unknown: the op checks that k_cache and v_cache are not one memory when it runs."""
    window_size = V.check_window(window_size)
    softcap = V.check_softcap(softcap)

    if (k is None) != (v is None):
        raise ValueError(f"k and v must be given together, got k={'None' if k is None else 'a tensor'}, "
                         f"v={'None' if v is None else 'a tensor'}")
    names = ("q", "k_cache", "v_cache") + (("k", "v") if k is not None else ())
    tensors = (q, k_cache, v_cache) + ((k, v) if k is not None else ())
    V.check_tensors(names, tensors, 4, "(q, k, v: (batch, seqlen, nheads, headdim); caches: " + _CACHE_LAYOUT + ")")
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
        _check_int32_tensor("block_table", block_table, (batch, block_table.shape[1]), "(batch_size, max_num_pages)", device)
        page_size = k_cache.shape[1]
        if page_size % 16 != 0 or page_size == 0:
            raise ValueError(f"the page size (k_cache.shape[1]) must be a positive multiple of 16 with block_table, got {page_size}")
        capacity = block_table.shape[1] * page_size
    else:
        batch_cache, capacity = k_cache.shape[0], k_cache.shape[1]
        if cache_batch_idx is not None:
            _check_int32_tensor("cache_batch_idx", cache_batch_idx, (batch,), "(batch_size,)", device)
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
    # bad value gets NaN and no append), or by `_decode_step` with one sync and a ValueError when CHECK_VALUES
    # is on (never while a CUDA graph is captured).
    if cache_seqlens is None:
        max_cached = capacity
    elif isinstance(cache_seqlens, torch.Tensor):
        _check_int32_tensor("cache_seqlens", cache_seqlens, (batch,), "(batch_size,)", device)
        max_cached = max(capacity - seqlen_new, 0)
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= capacity:
            raise ValueError(f"cache_seqlens must be in 0..{capacity} (the cache capacity), got {cache_seqlens}")
        max_cached = cache_seqlens
    else:
        raise TypeError(f"cache_seqlens must be None, an int or an int32 tensor (batch_size,), got {type(cache_seqlens).__name__}")
    if batch and max_cached + seqlen_new > capacity:
        raise _cache_too_small(str(max_cached), max_cached, seqlen_new, capacity, block_table)

    # Left padding and rotary embedding; the values of cache_leftpad, and of a tensor cache_seqlens against the
    # tables' length, are checked where the others are (the kernels, or CHECK_VALUES).
    if cache_leftpad is not None:
        if paged:
            raise NotImplementedError("cache_leftpad with block_table (a paged cache) is not supported (flash-attn "
                                      "does not support them together either)")
        _check_int32_tensor("cache_leftpad", cache_leftpad, (batch,), "(batch_size,)", device)
    rotary_per_query = False
    if rotary_cos is not None or rotary_sin is not None:
        R.check_rotary(rotary_cos, rotary_sin, k, q)
        rotary_per_query = R.per_query(bool(causal), window_size, capacity)
        needed = R.positions_needed(seqlen_q, seqlen_new, rotary_per_query)
        R.check_length(rotary_cos, needed, None if isinstance(cache_seqlens, torch.Tensor) else max_cached)

    _check_no_grad(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, alibi_slopes=alibi_slopes,
                   learnable_sink=learnable_sink, rotary_cos=rotary_cos, rotary_sin=rotary_sin)
    return _Checked(seqlen_new, capacity, max_cached, window_size, softcap, rotary_per_query)
