"""An eager `flash_attn_with_kvcache` call's plan: what the call does that depends only on its signature, worked
out once and kept under `call_key`.

Decoding repeats one call shape at every step. Everything but the tensors' addresses and values — the checks'
outcome, which tensors need a contiguous copy, the launch plans of the append and the attention
(`decode_launch.append_plan` / `decode_plan`: grids, int arguments, constexprs, the kept compiled kernels) —
follows from the shapes, strides, dtypes and devices of the tensor arguments, the other arguments' values, the
grad mode and the switches (`dispatch.decode_schedule()`, `configs.AUTOTUNE`). `call_key` puts all of them in one
key; a call whose key was seen runs `CallPlan.__call__`: no check repeated, the kernels launched through their
kept compiled kernels, no host sync, and no tensor allocated but the output and the lse when asked for (and what
the inputs ask for: copies of tensors whose layout the kernels cannot take, -q for a negative softmax_scale; an
int or None cache_seqlens is a tensor kept with the plan). What reads the tensors' values stays per call: the
host value check (`paging.CHECK_VALUES`) and the kernels' own checks.
"""

from __future__ import annotations

import math

import torch

from . import configs, paging
from . import rotary as R
from . import validation as V
from ._env import INTERPRET
from .kernels import dispatch
from .kernels.decode_launch import Rotary, append_plan, decode_plan
from .kvcache_checks import Checked, check_values

_Tensor = torch.Tensor
# Whether a torch.func transform is active: then a call takes `validation.check_not_transformed` (unplanned).
_TRANSFORMS_ACTIVE = (V._TRANSFORMS_ACTIVE if V._TRANSFORMS_ACTIVE is not None and V._IS_WRAPPED is not None
                      else (lambda: False))


class Unplanned(Exception):
    """An argument `call_key` does not key (a tensor subclass, an unusual type): the call takes the checks."""


def _tensor(t):
    """A tensor argument's part of the key: what every check and launch plan reads of it."""
    if type(t) is not _Tensor:
        raise Unplanned
    return t.shape, t.stride(), t.dtype, t.device, t.requires_grad


def call_key(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
             block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
             return_softmax_lse, learnable_sink):
    """The key of a call's plan: everything the plan depends on, so that two calls with one key differ only in
    their tensors' addresses and values. Raises Unplanned for arguments it does not cover (they take the checks,
    which raise for the bad ones). The caller has made sure no tracing, dispatch mode or transform is active.

    Scalars are keyed by type and value (ints, floats, bools only; 0 == 0.0 == -0.0 alias, and every check and
    plan treats them alike); an int cache_seqlens by its value (it sizes the plan); the k_cache / v_cache
    same-memory check by its outcome."""
    if type(q) is not _Tensor or type(k_cache) is not _Tensor or type(v_cache) is not _Tensor:
        raise Unplanned
    if type(cache_seqlens) is _Tensor:
        seqlens = cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.device
    elif cache_seqlens is None or type(cache_seqlens) is int:
        seqlens = cache_seqlens
    else:
        raise Unplanned
    if window_size is None:  # (None, as a side too: unbounded, keyed as -1, the same call)
        window_size = (-1, -1)
    elif type(window_size) in (tuple, list) and len(window_size) == 2 and None in window_size:
        window_size = tuple(-1 if side is None else side for side in window_size)
    if not (type(window_size) in (tuple, list) and len(window_size) == 2 and type(window_size[0]) is int
            and type(window_size[1]) is int and type(num_splits) is int and type(rotary_interleaved) is bool
            and (softmax_scale is None or type(softmax_scale) in (float, int))
            and (softcap is None or type(softcap) in (float, int))):
        raise Unplanned
    return (
        q.shape, q.stride(), q.dtype, q.device, q.requires_grad,
        k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device, k_cache.requires_grad,
        v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device, v_cache.requires_grad,
        None if k is None else _tensor(k), None if v is None else _tensor(v), seqlens,
        None if cache_batch_idx is None else _tensor(cache_batch_idx),
        None if block_table is None else _tensor(block_table),
        None if alibi_slopes is None else _tensor(alibi_slopes),
        None if learnable_sink is None else _tensor(learnable_sink),
        None if rotary_cos is None else _tensor(rotary_cos), None if rotary_sin is None else _tensor(rotary_sin),
        None if cache_leftpad is None else _tensor(cache_leftpad),
        type(softmax_scale), softmax_scale, bool(causal), window_size[0], window_size[1], type(softcap), softcap,
        num_splits, bool(return_softmax_lse), rotary_interleaved, torch.is_grad_enabled(),
        k is not None and k_cache.data_ptr() == v_cache.data_ptr(),  # the same-memory check
        dispatch.decode_schedule(), configs.AUTOTUNE,  # the switches the launch plans read
    )


PLANS: dict = {}  # call_key -> CallPlan, for calls whose checks passed
PLANS_LIMIT = 1024  # a workload of ever-new signatures starts over rather than growing without bound


def remember(key, plan: "CallPlan") -> None:
    if len(PLANS) >= PLANS_LIMIT:
        PLANS.clear()
    PLANS[key] = plan


def contiguous_inputs(q, k, v, cache_seqlens, cache_batch_idx, block_table, alibi_slopes, learnable_sink, rotary_cos,
                rotary_sin, cache_leftpad):
    """The tensors as the kernels take them: copies only where the layout asks (the last dim contiguous; 1-D
    index tensors, the sinks and the rotary tables contiguous). A planned call and the checked one
    (`kvcache._decode_step`) alike."""
    if alibi_slopes is not None and alibi_slopes.stride(-1) != 1:  # the kernels read a row's slopes in a row
        alibi_slopes = alibi_slopes.contiguous()
    if learnable_sink is not None and learnable_sink.stride(0) != 1:
        learnable_sink = learnable_sink.contiguous()
    if rotary_cos is not None:  # the kernels index the tables as contiguous (seqlen_ro, rotary_dim / 2)
        rotary_cos, rotary_sin = rotary_cos.contiguous(), rotary_sin.contiguous()
    if cache_leftpad is not None and cache_leftpad.stride(0) != 1:
        cache_leftpad = cache_leftpad.contiguous()
    if type(cache_seqlens) is _Tensor and cache_seqlens.stride(0) != 1:
        cache_seqlens = cache_seqlens.contiguous()
    q = V.last_dim_contiguous(q)
    if cache_batch_idx is not None and cache_batch_idx.stride(0) != 1:
        cache_batch_idx = cache_batch_idx.contiguous()
    if block_table is not None and block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    if k is not None:
        k, v = V.last_dim_contiguous(k), V.last_dim_contiguous(v)
    return (q, k, v, cache_seqlens, cache_batch_idx, block_table, alibi_slopes, learnable_sink, rotary_cos,
            rotary_sin, cache_leftpad)


class CallPlan:
    """One call signature's work: `__call__` runs a call of that signature (its `call_key`)."""

    __slots__ = ("return_lse", "default_scale", "negate", "fill", "kept", "copies", "batch", "seqlen_new",
                 "capacity", "cache_rows", "rotary", "device", "cuda", "kept_launches", "append", "decode")

    def __init__(self, checked: Checked, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                 cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, alibi_slopes, learnable_sink,
                 num_splits, return_softmax_lse, rotary_interleaved):
        """From a call whose arguments `checks.check_call` passed (its result `checked`)."""
        seqlen_new, capacity, max_cached, window_size, softcap, rotary_per_query = checked
        batch, seqlen_q, _, head_dim = q.shape
        self.return_lse = bool(return_softmax_lse)
        self.default_scale = 1.0 / math.sqrt(head_dim)
        scale = self.default_scale if softmax_scale is None else float(softmax_scale)
        # the kernels keep a running maximum of the scaled scores: softmax(s·qk) = softmax(|s|·(-q)k)
        self.negate = scale < 0
        # cache_seqlens None or an int: an int32 tensor of that value, kept per stream (`_seqlens`)
        self.fill = None if isinstance(cache_seqlens, torch.Tensor) else (
            capacity if cache_seqlens is None else cache_seqlens)
        self.kept = {}
        self.batch, self.seqlen_new, self.capacity, self.cache_rows = batch, seqlen_new, capacity, k_cache.shape[0]
        self.device = q.device
        self.cuda = q.device.type == "cuda"
        self.kept_launches = self.cuda and not INTERPRET  # kept compiled kernels, workspace kept per stream
        given = (q, k, v, cache_seqlens, cache_batch_idx, block_table, alibi_slopes, learnable_sink, rotary_cos,
                 rotary_sin, cache_leftpad)
        prepared = contiguous_inputs(*given)
        self.copies = any(a is not b for a, b in zip(prepared, given))  # (a function of the strides: keyed)
        (q, k, v, _, cache_batch_idx, block_table, alibi_slopes, learnable_sink, rotary_cos, rotary_sin,
         cache_leftpad) = prepared
        if self.negate:
            q = -q  # (a new tensor: the launch plan takes its strides)
        self.rotary = None  # (interleaved, per_query, max_cached): rebuilt with the call's tables for the checks
        rotary = None
        if rotary_cos is not None:
            needed = R.positions_needed(seqlen_q, seqlen_new, rotary_per_query)
            self.rotary = (bool(rotary_interleaved), bool(rotary_per_query), rotary_cos.shape[0] - needed)
            rotary = Rotary(rotary_cos, rotary_sin, *self.rotary)
        self.append = None
        if seqlen_new and batch:
            self.append = append_plan(k, v, k_cache, v_cache, cache_batch_idx, block_table, rotary, cache_leftpad)
        self.decode = decode_plan(
            q, k_cache, v_cache, cache_batch_idx, block_table, max_cached + seqlen_new if batch else 0, bool(causal),
            num_splits, None, seqlen_new, self.return_lse, window_size, softcap, alibi_slopes, learnable_sink,
            rotary, cache_leftpad)

    def _seqlens(self, stream):
        """cache_seqlens (None or an int) as the int32 tensor the kernels read: kept per stream (they only read
        it), fresh while a CUDA graph is captured (memory a graph uses comes from its own pool)."""
        if self.cuda and torch.cuda.is_current_stream_capturing():
            return torch.full((self.batch,), self.fill, dtype=torch.int32, device=self.device)
        seqlens = self.kept.get(stream)
        if seqlens is None:
            seqlens = self.kept[stream] = torch.full((self.batch,), self.fill, dtype=torch.int32, device=self.device)
        return seqlens

    def __call__(self, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                 cache_leftpad, block_table, softmax_scale, alibi_slopes, learnable_sink):
        """The call: append k, v (if any) into the caches in place, then attend; out, or (out, lse)."""
        device = self.device
        if self.cuda and device.index != torch.cuda.current_device():  # launch on the inputs' GPU
            with torch.cuda.device(device.index):
                return self(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                            cache_leftpad, block_table, softmax_scale, alibi_slopes, learnable_sink)
        if self.copies:
            (q, k, v, cache_seqlens, cache_batch_idx, block_table, alibi_slopes, learnable_sink, rotary_cos,
             rotary_sin, cache_leftpad) = contiguous_inputs(q, k, v, cache_seqlens, cache_batch_idx, block_table,
                                                            alibi_slopes, learnable_sink, rotary_cos, rotary_sin,
                                                            cache_leftpad)
        scale = self.default_scale if softmax_scale is None else float(softmax_scale)
        if self.negate:
            q, scale = -q, -scale
        stream = torch._C._cuda_getCurrentRawStream(device.index) if self.kept_launches else None
        if self.fill is not None:
            cache_seqlens = self._seqlens(stream)
        if paging.CHECK_VALUES and self.batch and not (self.cuda and torch.cuda.is_current_stream_capturing()):
            check_values(cache_seqlens, cache_batch_idx, block_table, self.seqlen_new, self.capacity, self.cache_rows,
                         cache_leftpad, None if self.rotary is None else Rotary(rotary_cos, rotary_sin, *self.rotary))
        if self.append is not None:  # append the new keys/values in place (through the page table when paged)
            self.append.launch(k, v, k_cache, v_cache, cache_seqlens, cache_batch_idx, block_table, rotary_cos,
                               rotary_sin, cache_leftpad, stream)
        out, lse = self.decode.launch(q, k_cache, v_cache, cache_seqlens, cache_batch_idx, block_table, alibi_slopes,
                                      learnable_sink, scale, rotary_cos, rotary_sin, cache_leftpad, stream)
        return (out, lse) if self.return_lse else out


def clear() -> None:
    """Forget every plan, the launch plans they hold too (tests that change the configs' values, which no key
    holds)."""
    from .kernels import decode_launch

    PLANS.clear()
    decode_launch._decode_plan.cache_clear()
    decode_launch._append_plan.cache_clear()
