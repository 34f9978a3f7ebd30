"""flash_attn_with_kvcache with sliding windows, softcap, ALiBi and attention sinks, alone and together.

Every case appends (or not) into a contiguous or paged cache, checks the cache holds exactly the expected keys,
and compares each sequence's output and lse with the float64 reference (`reference.attention_reference` with the
call's `Variant`) on that sequence's keys after the append, bottom-right aligned. The error must be within 2x the
reference's own error in the inputs' dtype plus a small floor (test_kvcache's rule). Both decode schedules run
every variant: the split grid (1 or several splits) and the stream schedule (units shared by several programs).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo.testing

import flashtriton
from flashtriton import configs, kvcache, kvcache_plan
from flashtriton._env import INTERPRET
from flashtriton.kernels import decode_launch, dispatch
from flashtriton.kernels.host import cdiv
from flashtriton.kernels.variant import Variant
from flashtriton.kvcache import flash_attn_with_kvcache
from flashtriton.reference import attention_reference

from conftest import DEVICE

FLOOR = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}
# The widest key tile the decode kernels may take here (the interpreter's fixed config; on a GPU the largest
# candidate): keys further than this before a window's first key lie in tiles the kernels must not read.
WIDEST_TILE = configs.DECODE_INTERPRETER_CONFIG["BLOCK_N"] if INTERPRET else 256


@pytest.fixture
def schedule(monkeypatch):
    """`use(name)`: "split" (the split grid, num_splits as the case says) or "stream" (the stream schedule with
    programs of one key tile each on 4 SMs: most units are shared by several programs)."""
    def use(name):
        monkeypatch.setattr(dispatch, "CHOICE", dispatch.parse({"FLASHTRITON_KERNEL": f"portable,{name}"}))
        if name == "stream":
            monkeypatch.setattr(configs, "DECODE_INTERPRETER_SMS", 4)
            monkeypatch.setattr(configs, "DECODE_MIN_SPLIT_KEYS", 16)
        kvcache_plan.clear()  # the configs' values are not in the plans' key

    yield use
    kvcache_plan.clear()


def _expected_cache(cache, new, seqlens, block_table, batch_idx):
    """The cache after writing `new` (B, S_new, Hkv, D) at positions seqlens[b].. of each sequence."""
    expected = cache.clone()
    for b in range(0 if new is None else new.shape[0]):
        for j in range(new.shape[1]):
            pos = seqlens[b] + j
            if block_table is not None:
                expected[int(block_table[b, pos // cache.shape[1]]), pos % cache.shape[1]] = new[b, j]
            else:
                expected[int(batch_idx[b]) if batch_idx is not None else b, pos] = new[b, j]
    return expected


def _sequence_keys(cache, block_table, batch_idx, b):
    """(capacity, Hkv, D): sequence b's cache in key order."""
    if block_table is not None:
        return cache[block_table[b].long()].flatten(0, 1)
    return cache[int(batch_idx[b]) if batch_idx is not None else b]


def _variant_tensors(kind, batch, heads, dtype, gen):
    """ALiBi slopes or sinks for a case: kind None, "alibi" (H,), "alibi_b" (B, H), "sink" fp32, "sink_dtype"."""
    if kind == "alibi":
        return {"alibi_slopes": (torch.rand(heads, generator=gen) * 0.5).to(DEVICE)}
    if kind == "alibi_b":
        return {"alibi_slopes": (torch.rand(batch, heads, generator=gen) * 0.5).to(DEVICE)}
    if kind == "sink":
        return {"learnable_sink": (torch.randn(heads, generator=gen) * 2).to(DEVICE)}
    if kind == "sink_dtype":
        return {"learnable_sink": (torch.randn(heads, generator=gen) * 2).to(DEVICE, dtype)}
    return {}


def run_case(seqlens, capacity=96, seqlen_q=1, seqlen_new=0, heads_q=4, heads_kv=2, head_dim=32,
             dtype=torch.float16, causal=False, window=(-1, -1), softcap=0.0, extra=(), page_size=None,
             num_splits=0, batch_idx_rows=0, softmax_scale=None, k_cache=None, v_cache=None, block_table=None,
             seed=0):
    """One call against float64; returns (out, lse, the call's kwargs). `extra`: ALiBi / sink kinds
    (`_variant_tensors`). k_cache / v_cache / block_table: given caches (then `capacity` and `page_size` follow
    them)."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(seqlens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    batch_idx = None
    if k_cache is None:
        if page_size is not None:
            pages = cdiv(capacity, page_size)
            capacity = pages * page_size
            num_pages = batch * pages + 2
            block_table = torch.randperm(num_pages, generator=gen)[:batch * pages].reshape(batch, pages)
            block_table = block_table.to(DEVICE, torch.int32)
            k_cache, v_cache = randn(num_pages, page_size, heads_kv, head_dim), randn(num_pages, page_size, heads_kv,
                                                                                      head_dim)
        else:
            rows = max(batch, batch_idx_rows)
            k_cache, v_cache = randn(rows, capacity, heads_kv, head_dim), randn(rows, capacity, heads_kv, head_dim)
            if batch_idx_rows:
                batch_idx = torch.randperm(rows, generator=gen)[:batch].to(DEVICE, torch.int32)
    q = randn(batch, seqlen_q, heads_q, head_dim)
    k, v = (randn(batch, seqlen_new, heads_kv, head_dim) if seqlen_new else None for _ in range(2))
    tensors = {}
    for kind in extra:
        tensors.update(_variant_tensors(kind, batch, heads_q, dtype, gen))
    exp_k = _expected_cache(k_cache, k, seqlens, block_table, batch_idx)
    exp_v = _expected_cache(v_cache, v, seqlens, block_table, batch_idx)
    unread = {"nan": 0.0}  # NaN that a test left in the cache stands for keys no window reaches
    kw = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v,
              cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=DEVICE), cache_batch_idx=batch_idx,
              block_table=block_table, softmax_scale=softmax_scale, causal=causal, window_size=window,
              softcap=softcap, num_splits=num_splits, **tensors)
    with torch.no_grad():
        out, lse = flash_attn_with_kvcache(**kw, return_softmax_lse=True)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (batch, heads_q, seqlen_q)
    assert torch.equal(k_cache.nan_to_num(**unread), exp_k.nan_to_num(**unread))
    assert torch.equal(v_cache.nan_to_num(**unread), exp_v.nan_to_num(**unread))

    slopes, sinks = tensors.get("alibi_slopes"), tensors.get("learnable_sink")
    for b in range(batch):
        n = seqlens[b] + seqlen_new
        keys = _sequence_keys(exp_k, block_table, batch_idx, b)[None, :n].nan_to_num(**unread)
        values = _sequence_keys(exp_v, block_table, batch_idx, b)[None, :n].nan_to_num(**unread)
        variant = Variant(causal=causal, window=window, softcap=softcap, sinks=sinks,
                          alibi_slopes=slopes[b:b + 1] if slopes is not None and slopes.dim() == 2 else slopes)
        args = (q[b:b + 1], keys, values, softmax_scale)
        ref, ref_lse = attention_reference(*args, return_lse=True, variant=variant)
        same = attention_reference(*args, dtype=dtype, variant=variant)
        err = (out[b:b + 1].double() - ref).abs().max().item()
        torch_err = (same.double() - ref).abs().max().item()
        assert not out[b].isnan().any(), f"sequence {b}: NaN"
        assert err <= 2 * torch_err + FLOOR[dtype], f"sequence {b} ({n} keys): err {err:.3g}, torch {torch_err:.3g}"
        got = lse[b:b + 1].double()
        assert torch.equal(torch.isinf(got), torch.isinf(ref_lse)), f"sequence {b}: -inf rows differ"
        finite = ~torch.isinf(ref_lse)
        if finite.any():
            assert (got[finite] - ref_lse[finite]).abs().max().item() <= 1e-3, f"sequence {b}: lse"
    return out, lse, kw


# ---------------------------------------------------------------------------------------------------------
# every variant alone and together, through both schedules, contiguous and paged
# ---------------------------------------------------------------------------------------------------------
VARIANTS = {  # name: (causal, window, softcap, extra)
    "window causal": (True, (20, 0), 0.0, ()),
    "window both sides": (False, (14, 9), 0.0, ()),
    "window left unbounded": (False, (-1, 2), 0.0, ()),
    "window right unbounded": (False, (25, -1), 0.0, ()),
    "window zero": (False, (0, 0), 0.0, ()),
    "softcap": (False, (-1, -1), 1.5, ()),
    "softcap causal": (True, (-1, -1), 0.7, ()),
    "alibi": (True, (-1, -1), 0.0, ("alibi",)),
    "alibi per batch": (False, (-1, -1), 0.0, ("alibi_b",)),
    "sink": (False, (-1, -1), 0.0, ("sink",)),
    "sink in dtype": (True, (-1, -1), 0.0, ("sink_dtype",)),
    "all, causal": (True, (17, 0), 2.0, ("alibi", "sink")),
    "all, both sides": (False, (11, 6), 3.0, ("alibi_b", "sink")),
}
LAYOUTS = {  # name: (schedule, num_splits, page_size, seqlen_q, seqlen_new, heads_q, heads_kv, batch_idx rows)
    "split 3, contiguous, append 2": ("split", 3, None, 1, 2, 4, 2, 0),
    "split 1, paged 16, Sq 3": ("split", 1, 16, 3, 3, 6, 2, 0),
    "stream, paged 32, Sq 2": ("stream", 0, 32, 2, 1, 4, 1, 0),
    "stream, batch idx, append 1": ("stream", 0, None, 1, 1, 2, 2, 5),
}
GRID = [(v, layout) for i, v in enumerate(VARIANTS) for j, layout in enumerate(LAYOUTS) if (i + j) % 2 == 0]


@pytest.mark.parametrize("variant,layout", GRID, ids=[f"{v}-{layout}" for v, layout in GRID])
def test_variant(variant, layout, schedule):
    """Lengths 0, 1, a middle one and the full cache (the window then ends at the end of the cache)."""
    causal, window, softcap, extra = VARIANTS[variant]
    name, num_splits, page_size, seqlen_q, seqlen_new, heads_q, heads_kv, rows = LAYOUTS[layout]
    schedule(name)
    capacity = 96
    run_case([0, 1, 45, capacity - seqlen_new], capacity=capacity, seqlen_q=seqlen_q, seqlen_new=seqlen_new,
             heads_q=heads_q, heads_kv=heads_kv, causal=causal, window=window, softcap=softcap, extra=extra,
             page_size=page_size, num_splits=num_splits, batch_idx_rows=rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_other_dtypes_and_scales(dtype, schedule):
    """bf16 and fp32 with everything on, a negative scale (q is negated: the same capped scores) and head dim 40."""
    schedule("split")
    run_case([3, 50, 70], capacity=72, seqlen_new=2, seqlen_q=2, head_dim=40, dtype=dtype, causal=True,
             window=(9, 0), softcap=1.2, extra=("alibi", "sink"), softmax_scale=-0.4, num_splits=2)


@pytest.mark.parametrize("sched", ["split", "stream"])
def test_several_m_tiles(sched, schedule):
    """Sq x group > 64 stacked rows: M tiles whose rows see different bands, causal windows where early rows see
    no key (Sk < Sq for the first sequence)."""
    schedule(sched)
    run_case([3, 60], capacity=100, seqlen_q=24, seqlen_new=24, heads_q=4, heads_kv=1, causal=True, window=(6, 0),
             extra=("sink",), page_size=16, num_splits=2)
    run_case([10, 70], capacity=100, seqlen_q=23, seqlen_new=5, heads_q=6, heads_kv=2, window=(4, 3),
             softcap=2.0, extra=("alibi",), num_splits=3)


# ---------------------------------------------------------------------------------------------------------
# the window: only its keys are read; rows it leaves empty; lengths that differ per sequence
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sched,num_splits,paged", [("split", 1, False), ("split", 3, True), ("stream", 0, False),
                                                    ("stream", 0, True)])
def test_keys_before_the_window_are_never_read(sched, num_splits, paged, schedule):
    """Keys more than one key tile before each sequence's window are NaN (contiguous cache), or sit on a page
    full of NaN (paged: the block table points there, a valid page): the result is still exact, so the kernels
    start at the window's first tile. Lengths differ per sequence, and so do their windows' positions."""
    schedule(sched)
    left, page_size, capacity, heads_kv, head_dim = 12, 16, 320, 2, 32
    seqlens = [5, 100, 250, 319]
    batch = len(seqlens)
    gen = torch.Generator().manual_seed(1)
    if paged:
        pages = capacity // page_size
        k_cache = torch.randn(batch * pages + 1, page_size, heads_kv, head_dim, generator=gen).to(DEVICE, torch.float16)
        v_cache = torch.randn_like(k_cache)
        poison_page = batch * pages
        k_cache[poison_page] = float("nan")
        v_cache[poison_page] = float("nan")
        table = torch.arange(batch * pages).reshape(batch, pages)
        for b, n in enumerate(seqlens):  # pages wholly before the window's first tile point at the NaN page
            unread = max(0, n + 1 - left - WIDEST_TILE) // page_size
            table[b, :unread] = poison_page
        block_table = table.to(DEVICE, torch.int32)
    else:
        k_cache = torch.randn(batch, capacity, heads_kv, head_dim, generator=gen).to(DEVICE, torch.float16)
        v_cache = torch.randn_like(k_cache)
        for b, n in enumerate(seqlens):
            unread = max(0, n + 1 - left - WIDEST_TILE)
            k_cache[b, :unread] = float("nan")
            v_cache[b, :unread] = float("nan")
        block_table = None
    run_case(seqlens, seqlen_new=1, causal=True, window=(left, 0), extra=("alibi",), num_splits=num_splits,
             k_cache=k_cache, v_cache=v_cache, block_table=block_table)  # the reference reads NaN keys as 0
    assert torch.isnan(k_cache).any()


@pytest.mark.parametrize("sched", ["split", "stream"])
def test_rows_the_window_leaves_without_keys(sched, schedule):
    """Sequences with no key at all, and causal windows whose first rows precede every key (Sq > Sk): out 0 and
    lse -inf, or with a sink out 0 and lse = the sink; never NaN."""
    schedule(sched)
    for extra in ((), ("sink",)):
        out, lse, kw = run_case([0, 0, 40], seqlen_q=5, seqlen_new=2, causal=True, window=(1, 0), extra=extra,
                                num_splits=2)
        empty = torch.zeros_like(out[0, :3])
        assert torch.equal(out[0, :3], empty) and torch.equal(out[1, :3], empty)  # rows 0..2 precede both keys
        want = float("-inf") if not extra else None
        for b in (0, 1):
            if want is not None:
                assert torch.isinf(lse[b, :, :3]).all()
            else:
                torch.testing.assert_close(lse[b, :, :3], kw["learnable_sink"][:, None].expand(-1, 3).float())
    out, lse, kw = run_case([0, 7], capacity=16, window=(3, 3), extra=("sink",), num_splits=3)  # no key, no append
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(lse[0, :, 0], kw["learnable_sink"])


@pytest.mark.parametrize("sched", ["split", "stream"])
def test_ragged_lengths_and_long_windows(sched, schedule):
    """Lengths spread over the cache, a window shorter than some sequences and longer than others (the whole
    sequence), and a window longer than the cache."""
    schedule(sched)
    seqlens = [0, 1, 31, 32, 33, 64, 100, 127]
    run_case(seqlens, capacity=128, heads_q=2, heads_kv=1, causal=True, window=(40, 0), page_size=16)
    run_case(seqlens, capacity=128, heads_q=2, heads_kv=1, window=(500, 500), extra=("sink",))


def test_output_without_lse_equals_output_with_it(schedule):
    schedule("split")
    out, _, kw = run_case([30, 64], capacity=64, causal=True, window=(7, 0), softcap=1.0, extra=("alibi", "sink"),
                          num_splits=2)
    kw = {**kw, "k_cache": kw["k_cache"].clone(), "v_cache": kw["v_cache"].clone()}  # no append: same result
    with torch.no_grad():
        assert torch.equal(flash_attn_with_kvcache(**kw), out)


@pytest.mark.parametrize("sched", ["split", "stream"])
@pytest.mark.parametrize("causal,window", [(True, (8, 0)), (False, (8, 2**30)), (False, (6, 2))])
def test_windows_near_the_int32_limit(causal, window, sched, schedule):
    """A window at the end of a cache of decode_launch.MAX_CAPACITY keys (an expanded view: every key the same),
    with sides as long as int32 allows: no key position wraps. Every visible key scores alike, so out is the one
    value row and lse = the score + log(visible keys); ALiBi then weighs the keys by their distance."""
    schedule(sched)
    capacity = decode_launch.MAX_CAPACITY
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 2, 16, generator=gen).to(DEVICE)
    k_cache = torch.randn(1, 1, 1, 16, generator=gen).to(DEVICE).expand(2, capacity, 1, 16)
    v_cache = torch.randn(1, 1, 1, 16, generator=gen).to(DEVICE).expand(2, capacity, 1, 16)
    seqlens = torch.tensor([capacity - 3, capacity], dtype=torch.int32, device=DEVICE)
    slopes = torch.tensor([0.5, 0.0], device=DEVICE)
    with torch.no_grad():
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=causal,
                                           window_size=window, alibi_slopes=slopes, return_softmax_lse=True)
    left, right = window[0], 0 if causal else min(window[1], 1)  # row i (of 2) sees right keys: 1 - i at most
    for i in range(2):
        offsets = torch.arange(-left, min(right, 1 - i) + 1, device=DEVICE)  # keys j - (i + Sk - Sq)
        score = (q[:, i].float() @ k_cache[0, 0, 0].float()) / 4.0  # (B, Hq)
        for h, slope in enumerate(slopes.tolist()):
            torch.testing.assert_close(out[:, i, h].float(), v_cache[0, 0, 0].float().expand(2, -1), atol=2e-6,
                                       rtol=1e-5)
            want = score[:, h] + torch.logsumexp(-slope * offsets.abs().float(), 0)
            torch.testing.assert_close(lse[:, h, i], want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# bad pages: every used page is checked, also those the window skips
# ---------------------------------------------------------------------------------------------------------
POISONED = [  # (name, table row of sequence 0, cache_seqlens, seqlen_new, seqlen_q, heads_q, window, causal)
    ("bad page before the window", [999, 1, 2, 3, 4, 5], [90, 40], 1, 1, 2, (10, 0), True),
    ("negative page before the window, no append", [0, -5, 2, 3, 4, 5], [90, 40], 0, 1, 2, (10, 0), True),
    ("bad page before a two-sided window", [0, 1, 2**31 - 1, 3, 4, 5], [90, 40], 2, 2, 2, (8, 5), False),
    ("bad new page", [0, 1, 2, 3, 4, 999], [80, 40], 3, 1, 2, (10, 0), True),
    # 40 query rows x 2 heads: two M tiles; the first one's rows (0..31) see keys 25..61, the bad page holds 64..69
    ("bad page after the first M tile's band", [0, 1, 2, 3, 999, 5], [70, 40], 0, 40, 2, (5, 0), True),
]


@pytest.mark.parametrize("sched,num_splits", [("split", 1), ("split", 3), ("stream", 0)])
@pytest.mark.parametrize("name,row,lens,seqlen_new,seqlen_q,heads_q,window,causal", POISONED,
                         ids=[c[0] for c in POISONED])
def test_bad_page_outside_the_window_poisons_the_sequence(name, row, lens, seqlen_new, seqlen_q, heads_q, window,
                                                          causal, sched, num_splits, schedule, monkeypatch):
    """A sequence one of whose used pages is not a page of the cache appends nothing and gets NaN in every
    output row and lse, though the window never reads that page's keys; the other sequence is what a call with
    it alone gives."""
    monkeypatch.setattr(kvcache, "CHECK_VALUES", False)
    schedule(sched)
    gen = torch.Generator().manual_seed(2)
    page_size, num_pages, heads_kv, head_dim = 16, 13, 1, 16
    k_cache, v_cache = (torch.randn(num_pages, page_size, heads_kv, head_dim, generator=gen).to(DEVICE, torch.float16)
                        for _ in range(2))
    table = torch.tensor([row, [6, 7, 8, 9, 10, 11]], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, seqlen_q, heads_q, head_dim, generator=gen).to(DEVICE, torch.float16)
    k, v = (torch.randn(2, seqlen_new, heads_kv, head_dim, generator=gen).to(DEVICE, torch.float16) if seqlen_new
            else None for _ in range(2))
    sink = torch.randn(heads_q, generator=gen).to(DEVICE)
    kw = dict(q=q, k=k, v=v, block_table=table, causal=causal, window_size=window, softcap=2.0, learnable_sink=sink,
              num_splits=num_splits, return_softmax_lse=True)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    before = (k_cache.clone(), v_cache.clone())
    with torch.no_grad():
        out, lse = flash_attn_with_kvcache(k_cache=k_cache, v_cache=v_cache, cache_seqlens=lens_t, **kw)
    assert out[0].isnan().all() and lse[0].isnan().all()
    assert not out[1].isnan().any() and not lse[1].isnan().any()
    alone = {n: (t[1:] if n in ("q", "k", "v", "block_table") and t is not None else t) for n, t in kw.items()}
    k_alone, v_alone = before[0].clone(), before[1].clone()
    with torch.no_grad():
        out1, lse1 = flash_attn_with_kvcache(k_cache=k_alone, v_cache=v_alone, cache_seqlens=lens_t[1:], **alone)
    exact = sched == "split"
    torch.testing.assert_close(out[1:], out1, rtol=0, atol=0 if exact else 2e-3)
    torch.testing.assert_close(lse[1:], lse1, rtol=0, atol=0 if exact else 1e-4)
    assert torch.equal(k_cache, k_alone) and torch.equal(v_cache, v_alone)  # only sequence 1's append landed


# ---------------------------------------------------------------------------------------------------------
# the launch: bands, tiles and splits follow the window
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("group,seqlen_q", [(1, 1), (8, 1), (3, 5), (6, 11), (5, 30), (128, 1), (2, 40)])
def test_query_rows_bound_every_m_tile(group, seqlen_q):
    block_m = decode_launch.decode_block_m(group * seqlen_q)
    bound = decode_launch.query_rows(block_m, group, seqlen_q)
    for m in range(cdiv(group * seqlen_q, block_m)):
        stacked = range(m * block_m, min((m + 1) * block_m, group * seqlen_q))
        rows = {r // group for r in stacked}
        assert max(rows) - min(rows) + 1 <= bound


@pytest.mark.parametrize("causal,window", [(True, (50, 0)), (False, (30, 20)), (False, (-1, 4)), (False, (9, -1)),
                                           (True, (0, 0))])
@pytest.mark.parametrize("group,seqlen_q", [(4, 1), (3, 7), (2, 40)])
def test_band_tiles_bound_every_unit(causal, window, group, seqlen_q):
    """The stream schedule gives every unit of a sequence min(its tiles, band tiles): no unit's band (its rows'
    visible keys, from the tile holding the first) may have more tiles, for any length and key tile."""
    variant = Variant(causal=causal, window=window)
    capacity = 300
    block_m = decode_launch.decode_block_m(group * seqlen_q)
    q_rows = decode_launch.query_rows(block_m, group, seqlen_q)
    _, _, band_keys = decode_launch.band_bounds(variant, seqlen_q, capacity, q_rows)
    for block_n in (16, 32, 128):
        band_tiles = cdiv(band_keys, block_n) + 1
        for seqlen_k in (0, 1, 5, 64, 299, 300):
            first, last = variant.key_bounds(seqlen_q, seqlen_k)
            for m in range(cdiv(group * seqlen_q, block_m)):
                rows = sorted({r // group for r in range(m * block_m, min((m + 1) * block_m, group * seqlen_q))})
                lo = int(first[rows].min()) // block_n * block_n
                hi = int(last[rows].max()) + 1
                assert max(0, cdiv(hi - lo, block_n)) <= max(min(cdiv(seqlen_k, block_n), band_tiles), 1)


def test_window_sizes_the_split_count_and_programs():
    """A 4k window of a 32k cache (batch 8, 8 kv heads, 132 SMs): splits and stream programs as for a 4k cache."""
    shape = dict(q_shape=(8, 1, 32, 128), q_strides=(4096, 4096, 128, 1), cache_shape=(8, 32768, 8, 128),
                 k_strides=(32768 * 1024, 1024, 128, 1), v_strides=(32768 * 1024, 1024, 128, 1), dtype=torch.float16,
                 max_pages=0, stride_btb=0, has_batch_idx=False, max_seqlen_k=32768, num_splits=0, seqlen_new=1,
                 return_lse=False, config=None, autotune=False, num_sms=132, device=torch.device("cuda"))
    windowed = decode_launch._decode_plan(**shape, variant=Variant.of(True, True, (4095, 0)))
    short = decode_launch._decode_plan(**{**shape, "cache_shape": (8, 4096, 8, 128), "max_seqlen_k": 4096},
                                       variant=Variant.of(True, True))
    full = decode_launch._decode_plan(**shape, variant=Variant.of(True, True))
    assert windowed.grid == short.grid and not windowed.stream
    assert full.stream  # the whole cache: the stream schedule
    decode_launch._decode_plan.cache_clear()


def test_variant_builds_compile_for_sm90_without_a_gpu():
    """Both decode kernels with every variant field, paged or not, and a two-sided window, compile to sm_90 code
    (the interpreter runs code Triton's compiler refuses, such as bounds of mixed int widths): in a fresh process
    without the interpreter, through `decode_launch.compile_for_sm90`."""
    script = (
        "import torch\n"
        "from flashtriton.kernels.decode_launch import compile_for_sm90\n"
        "from flashtriton.kernels.variant import Variant\n"
        "every = Variant.of(True, True, (100, 0), 30.0, True, True)\n"
        "builds = [(every, False, False), (every, True, False), (every, False, True), (every, True, True),\n"
        "          (Variant.of(False, True, (6, 3), 30.0), True, False)]\n"
        "for variant, paged, stream in builds:\n"
        "    compiled = compile_for_sm90(variant, paged, stream, seqlen_q=3, heads_q=12, heads_kv=4,\n"
        "                                dtype=torch.bfloat16)\n"
        "    assert 'mma' in compiled.asm['ptx']\n"
        "    print('compiled', sorted(variant.fields()), paged, stream)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(flashtriton.__file__).parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 5


# ---------------------------------------------------------------------------------------------------------
# torch.compile: the op carries the variant
# ---------------------------------------------------------------------------------------------------------
def _decode_inputs(seed=0, batch=2, capacity=48, heads_q=4, heads_kv=2, head_dim=16):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 1, heads_q, head_dim, generator=gen).to(DEVICE)
    k_cache, v_cache = (torch.randn(batch, capacity, heads_kv, head_dim, generator=gen).to(DEVICE) for _ in range(2))
    k, v = (torch.randn(batch, 1, heads_kv, head_dim, generator=gen).to(DEVICE) for _ in range(2))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=DEVICE)
    sink = torch.tensor([0.3, -1.0, 1.5, 0.0], device=DEVICE)
    return q, k_cache, v_cache, k, v, slopes, sink


def _step(q, k_cache, v_cache, k, v, cache_seqlens, slopes, sink):
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, causal=True,
                                       window_size=(9, 0), softcap=2.5, alibi_slopes=slopes, num_splits=2,
                                       return_softmax_lse=True, learnable_sink=sink)
    return out * 2, lse


def test_variants_compile_fullgraph_like_eager():
    """Two decode steps with every variant field: one graph, eager's outputs, lse and caches."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_step, backend=counter, fullgraph=True)
    q, k_cache, v_cache, k, v, slopes, sink = _decode_inputs()
    caches = {"eager": (k_cache.clone(), v_cache.clone()), "compiled": (k_cache.clone(), v_cache.clone())}
    with torch.no_grad():
        for step, lengths in enumerate(([3, 30], [4, 31])):
            seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
            out_e, lse_e = _step(q, *caches["eager"], k + step, v - step, seqlens, slopes, sink)
            out_c, lse_c = compiled(q, *caches["compiled"], k + step, v - step, seqlens, slopes, sink)
            torch.testing.assert_close(out_c, out_e, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse_c, lse_e, atol=1e-5, rtol=1e-5)
            for got, expected in zip(caches["compiled"], caches["eager"]):
                assert torch.equal(got, expected)
    assert counter.frame_count == 1


def test_kvcache_opcheck_with_variants():
    q, k_cache, v_cache, k, v, slopes, sink = _decode_inputs(capacity=32)
    seqlens = torch.tensor([5, 20], dtype=torch.int32, device=DEVICE)
    args = [q, k_cache, v_cache, k, v, seqlens, None, None, 0.25, True, 2, 32, 1, 6, 0, 1.5, slopes, sink]
    torch.library.opcheck(torch.ops.flashtriton.kvcache.default, args)


def test_variant_checks_run_before_anything_is_written():
    """A bad variant argument raises by name and appends nothing, also after a good call of the same shape
    (whose checks are remembered)."""
    q, k_cache, v_cache, k, v, slopes, sink = _decode_inputs()
    seqlens = torch.tensor([3, 30], dtype=torch.int32, device=DEVICE)
    with torch.no_grad():
        flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=seqlens, window_size=(4, 0),
                                alibi_slopes=slopes, learnable_sink=sink)
        before = k_cache.clone()
        for bad, error, match in ((dict(window_size=(4, -2)), ValueError, "window_size"),
                                  (dict(softcap=-1.0), ValueError, "softcap"),
                                  (dict(alibi_slopes=slopes[:2]), ValueError, "alibi_slopes"),
                                  (dict(alibi_slopes=slopes.double()), TypeError, "alibi_slopes"),
                                  (dict(learnable_sink=sink[:3]), ValueError, "learnable_sink")):
            args = {**dict(window_size=(4, 0), alibi_slopes=slopes, learnable_sink=sink), **bad}
            with pytest.raises(error, match=match):
                flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, **args)
            assert torch.equal(k_cache, before)
    with pytest.raises(NotImplementedError, match="inference-only.*learnable_sink requires grad"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, learnable_sink=sink.requires_grad_())


# ---------------------------------------------------------------------------------------------------------
# large shapes (GPU only)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("variant", ["window", "all"])
def test_large_window_decode(variant, dtype, page_size, schedule):
    """Batch 8, a 32k cache, a 4k causal window (and softcap, ALiBi, sinks), ragged lengths, one appended key:
    auto, the split grid and the stream schedule, against float64 on each sequence's keys."""
    batch, heads_q, heads_kv, head_dim, capacity = 8, 32, 8, 128, 32768
    seqlens = [0, 1, 1000, 4095, 4097, 20000, 32000, 32767]
    extra = ("alibi", "sink") if variant == "all" else ()
    softcap = 30.0 if variant == "all" else 0.0
    for sched in ("auto", "split", "stream"):
        schedule(sched)
        run_case(seqlens, capacity=capacity, seqlen_new=1, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim,
                 dtype=dtype, causal=True, window=(4095, 0), softcap=softcap, extra=extra, page_size=page_size)


@pytest.mark.gpu
def test_large_window_several_queries_and_m_tiles(schedule):
    """Speculative decoding-like calls: 40 new queries x GQA 4 (three M tiles) against a 16k cache, window 1k."""
    for sched in ("split", "stream"):
        schedule(sched)
        run_case([100, 5000, 16000], capacity=16384, seqlen_q=40, seqlen_new=40, heads_q=16, heads_kv=4,
                 head_dim=128, causal=True, window=(1023, 0), extra=("sink",), page_size=64)
