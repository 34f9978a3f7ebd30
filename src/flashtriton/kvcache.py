"""KV-cache decoding: flash-attn's `flash_attn_with_kvcache` (contiguous or paged cache, split-KV; sliding
windows, softcap, ALiBi and attention sinks; rotary embedding of q and the new keys, left-padded caches).

Inference only: there is no backward. See `flash_attn_with_kvcache` for the arguments, `kvcache_checks` for their
checks and `flashtriton.kernels.decode` / `decode_launch` for the kernels and their launcher. An eager call runs
the plan of its signature (`kvcache_plan`: checks and launch plans worked out at its first call); under
torch.compile / export the same work is the op `flashtriton::kvcache` (`kvcache_op`, `_decode_step`).

FLASHTRITON_CHECK_VALUES=1 (the host check of the device tensors' values, one switch for decoding and paged
prefill) is `paging.CHECK_VALUES`; `flashtriton.kvcache.CHECK_VALUES` reads and sets the same switch.
"""

from __future__ import annotations

import math
import sys
import types
from typing import Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import paging
from . import rotary as R
from . import validation as V
from .kernels.decode_launch import Rotary, append_kv, decode_attention
from .kernels.launch import on_inputs_device
from .kvcache_checks import check_call, check_values
from .kvcache_plan import PLANS, CallPlan, Unplanned, call_key, contiguous_inputs, remember
from .kvcache_plan import _TRANSFORMS_ACTIVE

_is_compiling = torch.compiler.is_compiling


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
            after the append); -1 (or None) is unbounded on that side; with causal=True the right side is 0. Only the
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
    # Eager calls of a signature seen before (decoding repeats one at every step) run its plan: no check
    # repeated, the launches kept (`kvcache_plan`). The values of the device tensors are checked where the work
    # runs (`CallPlan.__call__`, `_decode_step`), at every call.
    causal, rotary_interleaved = V.check_flag("causal", causal), V.check_flag("rotary_interleaved", rotary_interleaved)
    return_softmax_lse = V.check_flag("return_softmax_lse", return_softmax_lse)
    key = None
    if not (_is_compiling() or _get_current_dispatch_mode() is not None or _TRANSFORMS_ACTIVE()):
        try:
            key = call_key(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                           cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                           rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, learnable_sink)
        except Unplanned:
            key = None
        else:
            plan = PLANS.get(key)
            if plan is not None:
                return plan(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                            cache_leftpad, block_table, softmax_scale, alibi_slopes, learnable_sink)
    return _unplanned_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                           cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                           alibi_slopes, num_splits, return_softmax_lse, learnable_sink, key)


def _unplanned_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                    block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
                    num_splits, return_softmax_lse, learnable_sink, key):
    """A call without a kept plan: the checks, then its plan, kept under `key` (None: not kept), which runs it;
    or, while tracing, the op."""
    # Under torch.compile / export (or any dispatch mode, or tensor subclasses) the call becomes the registered
    # op `flashtriton::kvcache` (it mutates the caches: an opaque node in the graph, no graph break).
    tracing = (torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
               or not V.plain_tensors(q, k_cache, v_cache, k, v, cache_batch_idx, block_table, alibi_slopes,
                                      learnable_sink, rotary_cos, rotary_sin, cache_leftpad)
               or (isinstance(cache_seqlens, torch.Tensor) and type(cache_seqlens) is not torch.Tensor))
    checked = check_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                         cache_leftpad, block_table, softmax_scale, window_size, softcap, alibi_slopes, num_splits,
                         tracing, learnable_sink, causal)
    if not tracing:
        plan = CallPlan(checked, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                        cache_leftpad, block_table, softmax_scale, causal, alibi_slopes, learnable_sink, num_splits,
                        return_softmax_lse, rotary_interleaved)
        if key is not None:
            remember(key, plan)
        return plan(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                    block_table, softmax_scale, alibi_slopes, learnable_sink)

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
    out, lse = kvcache_op(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, scale,
                          bool(causal), num_splits, max_seqlen_k, seqlen_new, window_left, window_right, softcap,
                          alibi_slopes, learnable_sink, rotary_cos, rotary_sin, cache_leftpad,
                          bool(rotary_interleaved), rotary_per_query)
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
    (q, k, v, cache_seqlens, cache_batch_idx, block_table, alibi_slopes, learnable_sink, rotary_cos, rotary_sin,
     cache_leftpad) = contiguous_inputs(q, k, v, cache_seqlens, cache_batch_idx, block_table, alibi_slopes,
                                        learnable_sink, rotary_cos, rotary_sin, cache_leftpad)
    rotary = None
    if rotary_cos is not None:
        needed = R.positions_needed(q.shape[1], seqlen_new, rotary_per_query)
        rotary = Rotary(rotary_cos, rotary_sin, bool(rotary_interleaved), bool(rotary_per_query),
                        rotary_cos.shape[0] - needed)
    capturing = q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if paging.CHECK_VALUES and q.shape[0] and not capturing:
        page_size = k_cache.shape[1]
        capacity = block_table.shape[1] * page_size if block_table is not None else page_size
        check_values(cache_seqlens, cache_batch_idx, block_table, seqlen_new, capacity, k_cache.shape[0],
                     cache_leftpad, rotary)
    if seqlen_new and q.shape[0]:  # append the new keys/values in place (through the page table when paged)
        append_kv(k, v, k_cache, v_cache, cache_seqlens, cache_batch_idx, block_table, rotary, cache_leftpad)
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


class _Module(types.ModuleType):
    """This module, with `CHECK_VALUES` standing for `paging.CHECK_VALUES`: reading or setting it reads or sets
    the one switch."""

    @property
    def CHECK_VALUES(self) -> bool:
        return paging.CHECK_VALUES

    @CHECK_VALUES.setter
    def CHECK_VALUES(self, value: bool) -> None:
        paging.CHECK_VALUES = value


sys.modules[__name__].__class__ = _Module
