"""The host side of split-KV decoding (the kernels are `decode`'s): `decode_attention` launches `_decode_split` (its
autotuned form `_decode_split_tuned` under FLASHTRITON_AUTOTUNE) or `_decode_stream` from a launch plan kept per
call shape (`decode_plan` / `_decode_plan`), `append_kv` writes new keys into the cache from one of its own
(`append_plan` / `_append_plan`); a plan keeps its compiled kernel and relaunches it with raw pointers (`_Launch`),
and `kvcache_plan` holds a call's two plans to launch them without these functions. Also the split count
(`choose_num_splits`), the stream schedule's program count (`stream_programs`), the ticket counters and split-KV
workspace kept per (GPU, stream) (`_stream_buffer`, `split_buffers`), and the largest cache the kernels' int32 key
positions allow (`MAX_CAPACITY`).
"""

from __future__ import annotations

import functools
import math
import operator
from typing import NamedTuple

import torch
import triton

from .. import configs
from .._env import INTERPRET
from .common import dot_settings, sm_count
from . import dispatch
from .decode import PART_PAD, _append_kv, _decode_split, _decode_stream
from .host import cdiv, next_power_of_2, padded_head_dim
from .launch import hooks_installed, launch, launch_and_keep
from .variant import LOG2E, Variant


class Rotary(NamedTuple):
    """A decode call's rotary embedding (`flash_attn_with_kvcache`'s rotary_cos / rotary_sin), checked."""
    cos: torch.Tensor  # (seqlen_ro, rotary_dim / 2) in q's dtype, contiguous
    sin: torch.Tensor  # the same
    interleaved: bool  # pairs (2c, 2c + 1) (GPT-J), else (c, c + rotary_dim / 2) (GPT-NeoX)
    per_query: bool  # query i at table row cache_seqlens + i (causal or local attention), else all at cache_seqlens
    max_cached: int  # the longest cache length (cache_seqlens) whose positions the tables hold

    @property
    def dim(self) -> int:
        return 2 * self.cos.shape[1]


class _Launch:
    """One kernel's launch, fixed by shapes, strides, dtypes, device and options (the plans below): `run` passes
    the call's tensors and scalars, with the rotary tables and left pads (None where off: a constexpr) last."""

    __slots__ = ("kernel", "grid", "ints", "meta", "rotary_max_cached", "relaunch")

    def __init__(self, kernel, grid, ints, meta, rotary_max_cached):
        self.kernel = kernel  # the @triton.jit function
        self.grid = grid  # (x, y, z)
        self.ints = ints  # the kernel's int arguments after the tensors (and qk_scale), from the plan's key
        self.meta = meta  # constexprs and options
        self.rotary_max_cached = rotary_max_cached  # ROTARY_MAX_CACHED (None without rotary), from the key
        self.relaunch = None  # the compiled kernel, once launched with 16-byte aligned pointers

    def run(self, tensors: tuple, pointers: list, head: tuple, cos, sin, leftpad, stream=None) -> None:
        """Launch on `tensors` (the pointer arguments, in order; `pointers` their data_ptr()), then `head`
        (scalars before the ints), the plan's ints, and COS, SIN, LEFTPAD (tensors or None), ROTARY_MAX_CACHED.
        The plan fixes every argument's type; the compiled kernel also depends on pointer alignment: when all
        pointers are 16-byte aligned (as compiled), relaunch it with raw pointers and no lookup at all.
        `stream`: the current stream's handle where the caller has it (else `Relaunch` asks)."""
        tail = (cos, sin, leftpad, self.rotary_max_cached)
        bits = functools.reduce(operator.or_, pointers)
        tail_raw = tail
        if cos is not None or leftpad is not None:  # rotary tables, left pads: raw pointers too
            tail_raw = (None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(),
                        None if leftpad is None else leftpad.data_ptr(), self.rotary_max_cached)
            bits |= functools.reduce(operator.or_, (p for p in tail_raw[:3] if p is not None))
        if bits & 15:
            launch(self.kernel, self.grid, (*tensors, *head, *self.ints, *tail), self.meta)
        elif self.relaunch is not None and not hooks_installed():
            self.relaunch(self.grid, (*pointers, *head, *self.ints, *tail_raw), stream)
        else:
            self.relaunch = launch_and_keep(self.kernel, self.grid, (*tensors, *head, *self.ints, *tail), self.meta)


class _AppendPlan(_Launch):
    """An `_append_kv` launch (`_append_plan`)."""

    __slots__ = ()

    def launch(self, k, v, k_cache, v_cache, cache_seqlens, cache_batch_idx, block_table, cos=None, sin=None,
               cache_leftpad=None, stream=None) -> None:
        dummy, at = cache_seqlens, cache_seqlens.data_ptr()  # stands in for absent pointers
        self.run((k, v, k_cache, v_cache, cache_seqlens, dummy if cache_batch_idx is None else cache_batch_idx,
                  dummy if block_table is None else block_table),
                 [k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), at,
                  at if cache_batch_idx is None else cache_batch_idx.data_ptr(),
                  at if block_table is None else block_table.data_ptr()], (), cos, sin, cache_leftpad, stream)


def _rotary_key(rotary: Rotary | None) -> tuple | None:
    """(rotary_dim, interleaved, per_query, max_cached) of the plans' keys, or None."""
    return None if rotary is None else (rotary.dim, rotary.interleaved, rotary.per_query, rotary.max_cached)


def append_plan(k, v, k_cache, v_cache, cache_batch_idx=None, block_table=None, rotary: Rotary | None = None,
                cache_leftpad=None) -> _AppendPlan:
    """The launch plan of `append_kv` on these tensors (`_append_plan`, kept per key)."""
    paged = block_table is not None
    return _append_plan(k.shape, k.stride(), v.shape[-1], v.stride(), k_cache.shape, k_cache.stride(),
                        v_cache.stride(), k.dtype, k.device, block_table.shape[1] if paged else 0,
                        block_table.stride(0) if paged else 0, cache_batch_idx is not None, _rotary_key(rotary),
                        cache_leftpad is not None)


@functools.lru_cache(maxsize=1024)
def _append_plan(k_shape, k_strides, head_dim_v, v_strides, cache_shape, kc_strides, vc_strides, dtype, device,
                 max_pages, stride_btb, has_batch_idx, rotary, has_leftpad) -> _AppendPlan:
    """Everything of an `_append_kv` launch that depends only on shapes, strides, dtype, device and options
    (`dtype` and `device` fix the compiled kernel a plan keeps). rotary: `_rotary_key`."""
    batch, seqlen_new, heads_kv, head_dim = k_shape
    paged = max_pages > 0
    capacity = max_pages * cache_shape[1] if paged else cache_shape[1]
    block_d, block_dv = padded_head_dim(head_dim), padded_head_dim(head_dim_v)
    block_t = min(next_power_of_2(seqlen_new), max(1, 4096 // max(block_d, block_dv)))
    ints = (*k_strides[:3], *v_strides[:3], *kc_strides[:3], *vc_strides[:3], stride_btb, seqlen_new, capacity,
            cache_shape[0])
    meta = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, HEAD_DIM_V=head_dim_v, BLOCK_DV=block_dv, PAGED=paged,
                PAGE_SIZE=cache_shape[1] if paged else 1, HAS_BATCH_IDX=has_batch_idx,
                ROTARY_DIM=rotary[0] if rotary else 0, ROTARY_INTERLEAVED=bool(rotary and rotary[1]),
                HAS_LEFTPAD=has_leftpad, BLOCK_T=block_t, num_warps=4)
    return _AppendPlan(_append_kv, (batch, heads_kv, cdiv(seqlen_new, block_t)), ints, meta,
                       rotary[3] if rotary else None)


def append_kv(k, v, k_cache, v_cache, cache_seqlens, cache_batch_idx=None, block_table=None,
              rotary: Rotary | None = None, cache_leftpad=None) -> None:
    """Write k (B, S_new, Hkv, D) and v (B, S_new, Hkv, Dv) into the caches at cache_seqlens[b].. (through
    block_table when paged), in place, one launch; with `rotary` each new key is rotated at its cache row first.
    Values out of range (cache_leftpad's too) write nothing (see `_append_kv`)."""
    plan = append_plan(k, v, k_cache, v_cache, cache_batch_idx, block_table, rotary, cache_leftpad)
    plan.launch(k, v, k_cache, v_cache, cache_seqlens, cache_batch_idx, block_table,
                *((rotary.cos, rotary.sin) if rotary is not None else (None, None)), cache_leftpad)


_decode_split_tuned = triton.autotune(
    configs=configs.DECODE_CONFIGS,
    key=configs.DECODE_AUTOTUNE_KEY,
    prune_configs_by={"early_config_prune": configs.prune_decode_configs},
    cache_results=True,
)(_decode_split)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda" or INTERPRET:
        return configs.DECODE_INTERPRETER_SMS
    return sm_count(device.index if device.index is not None else torch.cuda.current_device())


def choose_num_splits(programs: int, max_seqlen_k: int, device: torch.device, num_sms: int | None = None,
                      block_n: int = 128, programs_per_sm: int = 1) -> int:
    """How many chunks to cut each sequence's keys into.

    `programs` = batch · kv heads · M tiles, each reading up to `max_seqlen_k` keys in tiles of `block_n`.
    The GPU runs `programs_per_sm` programs per SM at once (`configs.decode_programs_per_sm`), so the launch
    takes about waves · (tiles per program + overhead) tile-times, with waves = ceil(programs · splits /
    slots): the split count that minimises this (the fewest splits among equals), with at least
    `DECODE_MIN_SPLIT_KEYS` keys per split and at most `DECODE_MAX_SPLITS` splits. Every program costs
    `DECODE_PROGRAM_OVERHEAD_TILES`, and a split `DECODE_SPLIT_OVERHEAD_TILES` more (its partial result, the
    merge). `num_sms` overrides the device's SM count (off the GPU a small `configs.DECODE_INTERPRETER_SMS`).
    """
    return _choose_num_splits(programs, max_seqlen_k, num_sms or _num_sms(device), block_n, programs_per_sm)


@functools.lru_cache(maxsize=4096)
def _choose_num_splits(programs: int, max_seqlen_k: int, num_sms: int, block_n: int, programs_per_sm: int) -> int:
    slots = programs_per_sm * num_sms
    tiles = max(1, cdiv(max_seqlen_k, block_n))
    max_splits = max(1, min(configs.DECODE_MAX_SPLITS, max_seqlen_k // configs.DECODE_MIN_SPLIT_KEYS))
    best, best_cost = 1, math.inf
    for splits in range(1, max_splits + 1):
        per_split = cdiv(tiles, splits)
        overhead = configs.DECODE_PROGRAM_OVERHEAD_TILES + (configs.DECODE_SPLIT_OVERHEAD_TILES if splits > 1 else 0)
        cost = cdiv(programs * splits, slots) * (per_split + overhead)
        if cost < best_cost:
            best, best_cost = splits, cost
    return best


def stream_programs(units: int, max_seqlen_k: int, num_sms: int, block_n: int, programs_per_sm: int, batch: int,
                    force: bool = False) -> int:
    """Programs of the stream schedule (`_decode_stream`) for `units` = batch · kv heads · M tiles of up to
    `max_seqlen_k` keys, or 0 where the split grid is the better launch.

    The count follows the units, so that a batch of full caches is cut as the split grid cuts it (k programs per
    unit, or k units per program, no unit shared by two programs when the numbers divide): measured with 132
    programs instead (explore13), 1-8 % of the bandwidth went to units shared between programs, each a second
    pipeline start and a merge. One program per slot (SM · programs per SM) where the aligned count would leave
    more than 5 % of the slots' time idle; at least DECODE_MIN_SPLIT_KEYS keys per program.
    The stream schedule is taken for batches of several sequences (their cache lengths may differ, which leaves
    the split grid's programs unequal) with caches of at least DECODE_STREAM_MIN_KEYS, under a config of one
    program per SM. `force`: the count whatever the rule says."""
    slots = programs_per_sm * num_sms
    tiles = max(1, cdiv(max_seqlen_k, block_n))
    total = units * tiles
    aligned = units * (slots // units) if units <= slots else cdiv(units, cdiv(units, slots))
    # Aligned unless that leaves much of the GPU idle (e.g. 136 units on 132 SMs: 68 programs of two units)
    programs = aligned if cdiv(total, aligned) * slots <= 1.05 * total else slots
    programs = max(1, min(programs, total // max(1, configs.DECODE_MIN_SPLIT_KEYS // block_n)))
    if force:
        return programs
    wanted = batch > 1 and programs_per_sm == 1 and max_seqlen_k >= configs.DECODE_STREAM_MIN_KEYS
    return programs if wanted else 0


# The most keys a cache may hold per sequence (contiguous: k_cache.shape[1]; paged: pages per sequence x page
# size), checked on the host: key positions are int32 in the kernels, and the furthest one formed (a split's or
# key tile's start: at most DECODE_MAX_SPLITS x BLOCK_N <= 128 x 256 = 2**15 past the capacity) stays below
# 2**31.
MAX_CAPACITY = 2**31 - 2**20


# Per-(GPU, stream) buffers kept between decode calls, so that a call allocates only its output:
# - the ticket counters of the split-KV merge: zeroed once; every launch leaves its counters at zero again
#   (the last split resets its tile's), and launches on one stream run in order;
# - the split-KV workspace (partial results), up to STREAM_WORKSPACE_LIMIT floats: each launch writes what
#   it reads.
# Buffers are never freed (a larger one is added when needed): a launch still queued may use an older one.
# While a CUDA graph is being captured, fresh tensors are allocated (and the counters zeroed) inside the
# graph instead: memory a graph uses must come from its own pool.
_STREAM_BUFFERS: dict = {}
_KEPT: list = []
STREAM_WORKSPACE_LIMIT = 4 * 2**20


def _stream_buffer(kind: str, count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    fresh = torch.zeros if kind == "tickets" else torch.empty
    if device.type != "cuda" or INTERPRET or (kind == "workspace" and count > STREAM_WORKSPACE_LIMIT):
        return fresh(count, dtype=dtype, device=device)
    if torch.cuda.is_current_stream_capturing():
        return fresh(count, dtype=dtype, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _kept_buffer(kind, count, dtype, device, index, torch._C._cuda_getCurrentRawStream(index))


def _kept_buffer(kind: str, count: int, dtype: torch.dtype, device: torch.device, index: int, stream: int):
    key = (kind, index, stream)
    buf = _STREAM_BUFFERS.get(key)
    if buf is None or buf.numel() < count:
        buf = (torch.zeros if kind == "tickets" else torch.empty)(max(count, 4096), dtype=dtype, device=device)
        _STREAM_BUFFERS[key] = buf
        _KEPT.append(buf)
    return buf


def split_buffers(workspace: int, tickets: int, device: torch.device, stream: int | None = None):
    """(workspace, tickets): a split-KV launch's fp32 workspace of `workspace` floats and its `tickets` zeroed
    int32 counters (`_stream_buffer`). `stream`: the current stream's handle, where the caller has it."""
    if stream is None or workspace > STREAM_WORKSPACE_LIMIT or torch.cuda.is_current_stream_capturing():
        return (_stream_buffer("workspace", workspace, torch.float32, device),
                _stream_buffer("tickets", tickets, torch.int32, device))
    return (_kept_buffer("workspace", workspace, torch.float32, device, device.index, stream),
            _kept_buffer("tickets", tickets, torch.int32, device, device.index, stream))


def ticket_counters(count: int, device: torch.device) -> torch.Tensor:
    """A zeroed int32 tensor of at least `count` counters that the decode kernel leaves zeroed."""
    return _stream_buffer("tickets", count, torch.int32, device)


def decode_block_m(rows: int) -> int:
    """M tile for `rows` = Sq · group stacked query rows: at least 16 (tl.dot), at most 64."""
    return min(max(16, next_power_of_2(max(rows, 1))), 64)


def query_rows(block_m: int, group: int, seqlen_q: int) -> int:
    """The most query rows that one M tile of `block_m` stacked rows (query i · group + head g) spans: the tile
    height `decode._unit_keys` gives `variant.key_blocks`."""
    rows = block_m // group if block_m % group == 0 else (block_m - 1) // group + 2
    return max(1, min(rows, seqlen_q))


def band_bounds(variant: Variant, seqlen_q: int, capacity: int, q_rows: int) -> tuple[int, int, int]:
    """(window_left, window_right, band_keys): the window's sides as the decode kernels take them, and the most
    keys one unit's band spans. An unbounded side, or one longer than it can reach, becomes the longest that
    changes nothing: left = capacity (no key is further back), right = Sq (the last query row's diagonal is the
    last key). Without a window both are 0 and the band is the whole cache."""
    if "window_size" not in variant.fields():
        return 0, 0, capacity
    left = capacity if variant.left < 0 else min(variant.left, capacity)
    right = seqlen_q if variant.right < 0 else min(variant.right, seqlen_q)
    return left, right, min(capacity, q_rows + left + right)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    cache_batch_idx: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    num_splits: int = 0,
    config: dict | None = None,
    seqlen_new: int = 0,
    return_lse: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    learnable_sink: torch.Tensor | None = None,
    rotary: Rotary | None = None,
    cache_leftpad: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the decode kernels on validated inputs (`flashtriton.kvcache` checks them and appends new keys).

    q (B, Sq, Hq, D); k_cache (B_cache, S_cache, Hkv, D), or paged (num_pages, page_size, Hkv, D), v_cache the same
    with V's head dim Dv (which may differ from D), with block_table int32 (B, max_pages); cache_seqlens int32 (B,): keys in the cache before the append of
    `seqlen_new` keys (already written): sequence b attends to cache_seqlens[b] + seqlen_new keys;
    max_seqlen_k: an upper bound of those (a Python int: sizes the split heuristic and the autotune key).
    Out-of-range values (cache lengths, cache rows, pages) give that sequence NaN, never an out-of-bounds read;
    cache_batch_idx int32 (B,) or None (contiguous cache only). Caches must have a contiguous last dim.
    num_splits: 0 chooses, 1 no split, n > 1 n chunks. `config` forces {"BLOCK_N", "num_warps", "num_stages"}.
    Returns out (B, Sq, Hq, Dv) in q's dtype and lse (B, Hq, Sq) fp32 (natural log), or None for lse when
    `return_lse` is False (then it is neither allocated nor written: every allocation costs host time).
    window_size, softcap, alibi_slopes (fp32 (Hq,) or (B, Hq), last dim contiguous), learnable_sink ((Hq,),
    contiguous): flash-attn's variants (`variant.Variant`), bottom-right aligned per sequence; the kernels read
    only the keys of the window (and its pages).
    rotary: q is rotated as the kernels load it (`Rotary`; the new keys were rotated by `append_kv`).
    cache_leftpad: int32 (B,), contiguous cache only: sequence b's keys start at cache row cache_leftpad[b].
    """
    plan = decode_plan(q, k_cache, v_cache, cache_batch_idx, block_table, max_seqlen_k, causal, num_splits, config,
                       seqlen_new, return_lse, window_size, softcap, alibi_slopes, learnable_sink, rotary,
                       cache_leftpad)
    tables = (rotary.cos, rotary.sin) if rotary is not None else (None, None)
    return plan.launch(q, k_cache, v_cache, cache_seqlens, cache_batch_idx, block_table, alibi_slopes,
                       learnable_sink, softmax_scale, *tables, cache_leftpad)


def decode_plan(q, k_cache, v_cache, cache_batch_idx, block_table, max_seqlen_k: int, causal: bool,
                num_splits: int = 0, config: dict | None = None, seqlen_new: int = 0, return_lse: bool = True,
                window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes=None,
                learnable_sink=None, rotary: Rotary | None = None, cache_leftpad=None) -> "_Plan | _EmptyPlan":
    """The launch plan of `decode_attention` on these tensors (its arguments but the values it does not depend
    on): `_decode_plan`'s, kept per key, or an `_EmptyPlan` for an empty output. Its `launch` takes the tensors,
    softmax_scale, the rotary tables and left pads, and returns (out, lse)."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    if batch * seqlen_q * heads_q * v_cache.shape[-1] == 0:
        return _EmptyPlan((batch, seqlen_q, heads_q, v_cache.shape[-1]),
                          (batch, heads_q, seqlen_q) if return_lse else None)
    device = q.device
    paged = block_table is not None
    if config is None and INTERPRET:
        config = configs.DECODE_INTERPRETER_CONFIG
    variant = Variant.of(causal, True, window_size, softcap, alibi_slopes is not None, learnable_sink is not None)
    return _decode_plan(
        tuple(q.shape), q.stride(), tuple(k_cache.shape), k_cache.stride(), v_cache.stride(), q.dtype,
        block_table.shape[1] if paged else 0, block_table.stride(0) if paged else 0, cache_batch_idx is not None,
        variant, max_seqlen_k, num_splits, seqlen_new, return_lse,
        None if config is None else tuple(config.items()), configs.AUTOTUNE, _num_sms(device),
        device, dispatch.decode_schedule(),
        alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0, v_cache.shape[-1],
        _rotary_key(rotary), cache_leftpad is not None,
    )


class _EmptyPlan:
    """The plan of a call whose output is empty: nothing to launch; the lse, if asked for, is -inf."""

    __slots__ = ("out_shape", "lse_shape")

    def __init__(self, out_shape, lse_shape):
        self.out_shape, self.lse_shape = out_shape, lse_shape

    def launch(self, q, *args, **kwargs):
        out = torch.empty(self.out_shape, dtype=q.dtype, device=q.device)
        if self.lse_shape is None:
            return out, None
        return out, torch.full(self.lse_shape, float("-inf"), dtype=torch.float32, device=q.device)


def _require_declared(name: str, variant: Variant) -> None:
    """NotImplementedError naming the first variant field that decode kernel `name` does not declare
    (`dispatch.KERNELS`)."""
    missing = sorted(variant.fields() - dispatch.BY_NAME[name].fields)
    if missing:
        raise NotImplementedError(f"{missing[0]} is not supported by flashtriton's decode kernel ({name}) yet")


class _Plan(_Launch):
    """A decode launch, fixed by shapes, strides, dtypes, device and options (`_decode_plan`)."""

    __slots__ = ("part_rows", "part_width", "tickets", "autotune", "stream", "out_shape", "lse_shape", "softcap",
                 "cuda")

    def __init__(self, grid, part_rows, part_width, tickets, ints, meta, autotune, stream=False, out_shape=None,
                 lse_shape=None, softcap=0.0, rotary_max_cached=None, cuda=False):
        # grid: (B·Hkv, splits, M tiles), or (programs, 1, 1) for the stream schedule (3-D: `launch`)
        super().__init__(_decode_stream if stream else _decode_split, grid, ints, meta, rotary_max_cached)
        self.stream = stream  # `_decode_stream` (else `_decode_split`)
        self.part_rows, self.part_width = part_rows, part_width  # split-KV workspace (rows 0 without splits)
        self.tickets = tickets  # ticket counters the launch uses
        self.autotune = autotune  # `_decode_split_tuned` picks the config (FLASHTRITON_AUTOTUNE=1)
        self.out_shape, self.lse_shape = out_shape, lse_shape  # (B, Sq, Hq, Dv); (B, Hq, Sq) or None (no lse)
        self.softcap = softcap  # the variant's cap (0.0: off): qk_scale as `Variant.scalars` forms it
        self.cuda = cuda  # on a GPU (not the interpreter): workspace and counters are kept per stream

    def launch(self, q, k_cache, v_cache, cache_seqlens, cache_batch_idx, block_table, alibi_slopes, learnable_sink,
               softmax_scale: float, cos=None, sin=None, cache_leftpad=None, stream=None):
        """Launch on the call's tensors (those of the plan's key; absent ones None); returns (out, lse or None).
        `stream`: the current stream's handle where the caller has it."""
        device = q.device
        out = torch.empty(self.out_shape, dtype=q.dtype, device=device)
        lse = None if self.lse_shape is None else torch.empty(self.lse_shape, dtype=torch.float32, device=device)
        dummy = cache_seqlens  # stands in for absent pointers
        if self.part_rows:
            part, tickets = split_buffers(self.part_rows * self.part_width, self.tickets, device,
                                          stream if self.cuda else None)
        else:
            part = tickets = dummy  # unused
        tensors = (q, k_cache, v_cache, out, dummy if lse is None else lse, part, tickets, cache_seqlens,
                   dummy if cache_batch_idx is None else cache_batch_idx, dummy if block_table is None else block_table,
                   dummy if alibi_slopes is None else alibi_slopes, dummy if learnable_sink is None else learnable_sink)
        # qk_scale as `Variant.scalars` forms it
        scale = softmax_scale / self.softcap if self.softcap else softmax_scale * LOG2E
        if self.autotune:
            _decode_split_tuned[self.grid](*tensors, scale, *self.ints, cos, sin, cache_leftpad,
                                           self.rotary_max_cached, **self.meta)
            return out, lse
        at = cache_seqlens.data_ptr()  # each address once: the dummies are cache_seqlens
        at_part = at_tickets = at
        if self.part_rows:
            at_part, at_tickets = part.data_ptr(), tickets.data_ptr()
        self.run(tensors, [q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                           at if lse is None else lse.data_ptr(), at_part, at_tickets, at,
                           at if cache_batch_idx is None else cache_batch_idx.data_ptr(),
                           at if block_table is None else block_table.data_ptr(),
                           at if alibi_slopes is None else alibi_slopes.data_ptr(),
                           at if learnable_sink is None else learnable_sink.data_ptr()],
                 (scale,), cos, sin, cache_leftpad, stream)
        return out, lse


@functools.lru_cache(maxsize=1024)  # decoding repeats a few shapes: their launch plans are computed once
def _decode_plan(q_shape, q_strides, cache_shape, k_strides, v_strides, dtype, max_pages, stride_btb,
                 has_batch_idx, variant, max_seqlen_k, num_splits, seqlen_new, return_lse, config, autotune,
                 num_sms, device, schedule="auto", stride_alibi_b=0, head_dim_v=0, rotary=None,
                 has_leftpad=False) -> _Plan:
    """Everything of a decode launch that depends only on shapes, strides and options. `variant`: the call's
    `variant.Variant` (causal or not, the window, softcap, whether ALiBi slopes and sinks are given). `schedule`
    (`dispatch.decode_schedule()`: FLASHTRITON_KERNEL=<kernel>,split|stream): with num_splits = 0 and a known
    config, "auto" takes the stream schedule where
    `stream_programs` says it pays, "stream" wherever it can, "split" never. The split count, the stream's program
    count and the config follow the keys a unit reads (a window's band, not the whole cache). `cache_shape` is
    k_cache's; head_dim_v: v_cache's head dim (0: k's). rotary: (rotary_dim, interleaved, per_query, max_cached)
    (`_rotary_key`: max_cached is the kernels' ROTARY_MAX_CACHED, which the kept compiled kernel is specialized on)
    or None; has_leftpad: whether cache_leftpad is given."""
    batch, seqlen_q, heads_q, head_dim = q_shape
    heads_kv = cache_shape[2]
    group = heads_q // heads_kv
    paged = max_pages > 0
    rows = seqlen_q * group
    block_m = decode_block_m(rows)
    m_tiles = cdiv(rows, block_m)
    units = batch * heads_kv * m_tiles
    head_dim_v = head_dim_v or head_dim
    block_d, block_dv = padded_head_dim(head_dim), padded_head_dim(head_dim_v)
    block_wide = max(block_d, block_dv)  # what a config's tiles must hold
    capacity = max_pages * cache_shape[1] if paged else cache_shape[1]
    q_rows = query_rows(block_m, group, seqlen_q)
    left, right, band_keys = band_bounds(variant, seqlen_q, capacity, q_rows)
    read_keys = min(max_seqlen_k, band_keys)  # the most keys one unit reads
    config = dict(config) if config is not None else None
    if config is None and not autotune:
        config = configs.default_decode_config(block_wide, dtype.itemsize, units, num_sms, read_keys)
    out_strides = (seqlen_q * heads_q * head_dim_v, heads_q * head_dim_v, head_dim_v)
    lse_strides = (heads_q * seqlen_q, 1, seqlen_q) if return_lse else (0, 0, 0)  # (B, Hq, Sq): b, row, head
    strides = (*q_strides, *k_strides[:3], *v_strides[:3], *out_strides, *lse_strides, stride_btb)
    _, _, _, cap = variant.scalars(1.0)
    scalars = (left, right, cap or 0.0, stride_alibi_b)  # after qk_scale: window sides, softcap, ALiBi's stride
    windowed = "window_size" in variant.fields()
    shapes = ((batch, seqlen_q, heads_q, head_dim_v), (batch, heads_q, seqlen_q) if return_lse else None,
              variant.softcap, rotary[3] if rotary and len(rotary) > 3 else None,
              device.type == "cuda" and not INTERPRET)
    common = dict(  # the constexprs both kernels take
        GROUP_SIZE=group, HEAD_DIM=head_dim, BLOCK_D=block_d, HEAD_DIM_V=head_dim_v, BLOCK_DV=block_dv,
        IS_CAUSAL=variant.causal,
        **variant.score_constexprs, HAS_SINKS=variant.has_sinks, PAGED=paged,
        PAGE_SIZE=cache_shape[1] if paged else 1, HAS_BATCH_IDX=has_batch_idx, STORE_LSE=return_lse,
        ROTARY_DIM=rotary[0] if rotary else 0, ROTARY_INTERLEAVED=bool(rotary and rotary[1]),
        ROTARY_PER_QUERY=bool(rotary and rotary[2]), HAS_LEFTPAD=has_leftpad,
        UNREAD_PAGES=paged and (windowed or (variant.causal and m_tiles > 1)),  # bands short of the sequence
        UPCAST_DOT=dot_settings(dtype)[0], DOT_PRECISION=dot_settings(dtype)[1], QUERY_ROWS=q_rows, BLOCK_M=block_m,
    )
    if num_splits == 0:
        per_sm = configs.decode_programs_per_sm(config, block_wide, block_m, dtype.itemsize)
        block_n = config["BLOCK_N"] if config else 128
        num_splits = _choose_num_splits(units, read_keys, num_sms, block_n, per_sm)
        programs = 0
        if config is not None and schedule != "split" and batch <= configs.DECODE_STREAM_MAX_BATCH:
            programs = stream_programs(units, read_keys, num_sms, block_n, per_sm, batch,
                                       force=schedule == "stream")
        if programs:
            _require_declared("decode_stream", variant)
            # A band's tiles: its keys, and one more where its first key is not at a tile's start.
            band_tiles = cdiv(band_keys, block_n) + 1
            ints = (*scalars, *strides, heads_kv, seqlen_q, batch, seqlen_new, capacity, cache_shape[0], band_tiles)
            meta = dict(common, BLOCK_B=next_power_of_2(batch), **config)
            return _Plan((programs, 1, 1), programs * 2 * block_m, block_dv + PART_PAD.value, units, ints, meta,
                         False, True, *shapes)
    _require_declared("decode_split", variant)
    num_splits = max(1, int(num_splits))
    split_kv = num_splits > 1
    ints = (*scalars, *strides, heads_kv, seqlen_q, num_splits, seqlen_new, capacity, cache_shape[0],
            configs.seqlen_bucket(cdiv(max(read_keys, 1), num_splits)))
    meta = dict(common, SPLIT_KV=split_kv, SPLITS_P2=next_power_of_2(num_splits) if split_kv else 1)
    if config is not None:
        meta.update(config)
    part_rows = batch * seqlen_q * heads_q * num_splits if split_kv else 0
    return _Plan((batch * heads_kv, num_splits, m_tiles), part_rows, block_dv + PART_PAD.value, units, ints, meta,
                 config is None, False, *shapes)


_POINTER_ARGS = {"LSE": "*fp32", "PART": "*fp32", "TICKETS": "*i32", "CACHE_SEQLENS": "*i32", "BATCH_IDX": "*i32",
                 "BLOCK_TABLE": "*i32", "ALIBI": "*fp32", "LEFTPAD": "*i32"}


def compile_for_sm90(variant: Variant, paged: bool = False, stream: bool = False, num_splits: int = 2,
                     seqlen_q: int = 1, heads_q: int = 32, heads_kv: int = 8, head_dim: int = 128,
                     dtype: torch.dtype = torch.float16, config: dict | None = None, head_dim_v: int = 0,
                     rotary: tuple | None = None, leftpad: bool = False):
    """Compile a decode kernel for sm_90 without a GPU (Triton's frontend and Hopper passes, then its bundled
    ptxas), with the constexprs and options a launch of this shape takes on the GPU (`_decode_plan`; a 4k-key
    cache, paged in pages of 256): compiled.asm["ptx"]. For tests (the interpreter runs what Triton's compiler may
    refuse) and for reading registers and spills (`ptxas -v`) before spending device time. Not under the
    interpreter. rotary: (rotary_dim, interleaved, per_query) of a rotary build; leftpad: a left-padded one."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    batch, capacity, page_size = 4, 4096, 256
    q_shape = (batch, seqlen_q, heads_q, head_dim)
    cache_shape = ((batch * capacity // page_size, page_size, heads_kv, head_dim) if paged
                   else (batch, capacity, heads_kv, head_dim))
    cache_strides = (cache_shape[1] * heads_kv * head_dim, heads_kv * head_dim, head_dim, 1)
    dv = head_dim_v or head_dim
    v_strides = (cache_shape[1] * heads_kv * dv, heads_kv * dv, dv, 1)
    max_pages = capacity // page_size if paged else 0
    plan = _decode_plan.__wrapped__(
        q_shape, (seqlen_q * heads_q * head_dim, heads_q * head_dim, head_dim, 1), cache_shape, cache_strides,
        v_strides, dtype, max_pages, max_pages, False, variant, capacity, 0 if stream else num_splits, 0, True,
        None if config is None else tuple(config.items()), False, 132, torch.device("cuda"),
        "stream" if stream else "split", 0, head_dim_v, rotary, leftpad)
    meta = dict(plan.meta)
    options = {"num_warps": meta.pop("num_warps"), "num_stages": meta.pop("num_stages")}
    element = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}[dtype]
    fn = _decode_stream if stream else _decode_split
    if rotary is None:  # absent features' arguments are None, constexprs (as `decode_attention` passes them)
        meta.update(COS=None, SIN=None, ROTARY_MAX_CACHED=None)
    if not leftpad:
        meta["LEFTPAD"] = None
    signature = {name: "constexpr" if name in meta else element if name in ("Q", "K", "V", "O", "SINKS", "COS", "SIN")
                 else _POINTER_ARGS.get(name, "fp32" if name in ("qk_scale", "softcap") else "i32")
                 for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if signature[name][0] == "*"}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=meta, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)
