"""flash_attn_with_kvcache with rotary embedding (rotary_cos, rotary_sin, rotary_interleaved) and cache_leftpad.

flash-attn 2's semantics: the new keys are rotated at their cache rows cache_seqlens[b] + j before they are
appended; q is rotated at cache_seqlens[b] + i when causal or local (a window side shorter than the cache), else
every query at cache_seqlens[b]; only the first rotary_dim dims rotate, in pairs (2c, 2c + 1) (interleaved) or
(c, c + rotary_dim / 2). With cache_leftpad sequence b's keys are its cache rows cache_leftpad[b] ..
cache_seqlens[b] + seqlen_new - 1 (cache_seqlens counts the pad), masks align on them, and rotary positions stay
cache rows.

Each case checks the cache (old rows untouched, new rows the float64 rotation of k rounded to the cache's dtype)
and compares each sequence's output and lse with float64 attention of the float64-rotated q and new keys
(`reference.apply_rotary`) on that sequence's keys; the error must be within 2x that of the same computation in
the inputs' dtype (rotation and attention) plus a small floor (test_kvcache's rule).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo.testing

import flashtriton
from flashtriton import configs, kvcache, kvcache_plan, rotary
from flashtriton.kernels import decode_launch, dispatch
from flashtriton.kernels.host import cdiv
from flashtriton.kernels.variant import Variant
from flashtriton.kvcache import flash_attn_with_kvcache
from flashtriton.reference import apply_rotary, attention_reference

from conftest import DEVICE

FLOOR = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}
ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-22}  # relative, one ulp


@pytest.fixture
def schedule(monkeypatch):
    """`use(name)`: "split" (the split grid) or "stream" (the stream schedule, programs of one key tile each on 4
    SMs: most units are shared by several programs)."""
    def use(name):
        monkeypatch.setattr(dispatch, "CHOICE", dispatch.parse({"FLASHTRITON_KERNEL": f"portable,{name}"}))
        if name == "stream":
            monkeypatch.setattr(configs, "DECODE_INTERPRETER_SMS", 4)
            monkeypatch.setattr(configs, "DECODE_MIN_SPLIT_KEYS", 16)
        kvcache_plan.clear()

    yield use
    kvcache_plan.clear()


def _tables(rows, rotary_dim, dtype, gen):
    angle = torch.rand(rows, rotary_dim // 2, generator=gen, dtype=torch.float64, device=DEVICE) * 2 * math.pi
    return angle.cos().to(dtype), angle.sin().to(dtype)


def _inputs(seqlens, pads=None, capacity=64, seqlen_q=1, seqlen_new=1, heads_q=4, heads_kv=2, head_dim=32,
            rotary_dim=None, dtype=torch.float16, page_size=None, batch_idx_rows=0, seqlen_ro=None, seed=0, **call):
    """A call's keyword arguments: random caches (contiguous, paged, or rows through cache_batch_idx), q, k, v,
    tables of seqlen_ro rows (default: the capacity) for rotary_dim (default: the head dim; 0: none)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    batch = len(seqlens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE).to(dtype)

    block_table = batch_idx = None
    if page_size is not None:
        pages = cdiv(capacity, page_size)
        capacity = pages * page_size
        block_table = torch.randperm(batch * pages + 2, generator=gen, device=DEVICE)[:batch * pages]
        block_table = block_table.reshape(batch, pages).to(torch.int32)
        shape = (batch * pages + 2, page_size, heads_kv, head_dim)
    else:
        rows = max(batch, batch_idx_rows)
        shape = (rows, capacity, heads_kv, head_dim)
        if batch_idx_rows:
            batch_idx = torch.randperm(rows, generator=gen, device=DEVICE)[:batch].to(torch.int32)
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    cos, sin = _tables(seqlen_ro or capacity, rotary_dim, dtype, gen) if rotary_dim else (None, None)
    kw = dict(q=randn(batch, seqlen_q, heads_q, head_dim), k_cache=randn(*shape), v_cache=randn(*shape),
              k=randn(batch, seqlen_new, heads_kv, head_dim), v=randn(batch, seqlen_new, heads_kv, head_dim),
              rotary_cos=cos, rotary_sin=sin, cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=DEVICE),
              cache_batch_idx=batch_idx, block_table=block_table,
              cache_leftpad=None if pads is None else torch.tensor(pads, dtype=torch.int32, device=DEVICE))
    kw.update(call)
    return kw


def _rows(cache, kw, b):
    """(capacity, Hkv, D): sequence b's cache rows in order."""
    if kw["block_table"] is not None:
        return cache[kw["block_table"][b].long()].flatten(0, 1)
    return cache[int(kw["cache_batch_idx"][b]) if kw["cache_batch_idx"] is not None else b]


def _per_query(kw, capacity):
    """flash-attn's rule, written out: causal, or a window side >= 0 and shorter than the cache."""
    return kw.get("causal", False) or any(0 <= w < capacity for w in kw.get("window_size", (-1, -1)))


def check_call(kw):
    """Run the call `kw` on copies of its caches and judge it against float64; returns (out, lse)."""
    before = (kw["k_cache"].clone(), kw["v_cache"].clone())
    with torch.no_grad():
        out, lse = flash_attn_with_kvcache(**kw, return_softmax_lse=True)
    q, k, v, cos, sin = kw["q"], kw["k"], kw["v"], kw["rotary_cos"], kw["rotary_sin"]
    dtype, (batch, seqlen_q, heads_q, _) = q.dtype, q.shape
    seqlen_new = k.shape[1]
    capacity = _rows(before[0], kw, 0).shape[0]
    interleaved = kw.get("rotary_interleaved", True)
    assert out.shape == q.shape and lse.shape == (batch, heads_q, seqlen_q)
    slopes, sinks = kw.get("alibi_slopes"), kw.get("learnable_sink")
    for b in range(batch):
        cached = int(kw["cache_seqlens"][b])
        pad = int(kw["cache_leftpad"][b]) if kw["cache_leftpad"] is not None else 0
        new_pos = (cached + torch.arange(seqlen_new, device=DEVICE))[None]
        q_pos = cached + torch.arange(seqlen_q, device=DEVICE) * int(_per_query(kw, capacity))
        rotate = cos is not None
        k64 = apply_rotary(k[b:b + 1], cos, sin, new_pos, interleaved) if rotate else k[b:b + 1].double()
        q64 = apply_rotary(q[b:b + 1], cos, sin, q_pos[None], interleaved) if rotate else q[b:b + 1].double()
        k_low = apply_rotary(k[b:b + 1], cos, sin, new_pos, interleaved, dtype) if rotate else k[b:b + 1]
        q_low = apply_rotary(q[b:b + 1], cos, sin, q_pos[None], interleaved, dtype) if rotate else q[b:b + 1]
        # The cache: rows before the append untouched, the new rows k rotated (to one ulp: fp32 vs float64)
        for got_cache, old, new in ((kw["k_cache"], before[0], k64), (kw["v_cache"], before[1], v[b:b + 1].double())):
            got, old_rows = _rows(got_cache, kw, b), _rows(old, kw, b)
            assert torch.equal(got[:cached], old_rows[:cached]) and torch.equal(got[cached + seqlen_new:],
                                                                                old_rows[cached + seqlen_new:])
            torch.testing.assert_close(got[cached:cached + seqlen_new].double(), new[0], rtol=ULP[dtype],
                                       atol=ULP[dtype])
        old_k, old_v = _rows(before[0], kw, b)[None, pad:cached], _rows(before[1], kw, b)[None, pad:cached]
        new_v = v[b:b + 1]
        variant = Variant(causal=kw.get("causal", False), window=kw.get("window_size", (-1, -1)),
                          softcap=kw.get("softcap", 0.0), sinks=sinks,
                          alibi_slopes=slopes[b:b + 1] if slopes is not None and slopes.dim() == 2 else slopes)
        scale = kw.get("softmax_scale")
        ref, ref_lse = attention_reference(q64, torch.cat([old_k.double(), k64], 1),
                                           torch.cat([old_v.double(), new_v.double()], 1), scale, return_lse=True,
                                           variant=variant)
        same, same_lse = attention_reference(q_low, torch.cat([old_k, k_low], 1), torch.cat([old_v, new_v], 1),
                                             scale, dtype=dtype, return_lse=True, variant=variant)
        err = (out[b:b + 1].double() - ref).abs().max().item()
        torch_err = (same.double() - ref).abs().max().item()
        assert not out[b].isnan().any(), f"sequence {b}: NaN"
        assert err <= 2 * torch_err + FLOOR[dtype], f"sequence {b}: err {err:.3g}, torch {torch_err:.3g}"
        got = lse[b:b + 1].double()
        assert torch.equal(torch.isinf(got), torch.isinf(ref_lse)), f"sequence {b}: -inf rows differ"
        finite = ~torch.isinf(ref_lse)
        if finite.any():  # the rotated q and keys' rounding moves the scores: 2x its error, as for out
            lse_err = (got[finite] - ref_lse[finite]).abs().max().item()
            torch_lse_err = (same_lse.double()[finite] - ref_lse[finite]).abs().max().item()
            assert lse_err <= 2 * torch_lse_err + 1e-3, f"sequence {b}: lse err {lse_err:.3g}, torch {torch_lse_err:.3g}"
    return out, lse


# ---------------------------------------------------------------------------------------------------------
# layouts x schedules x rotary forms, against float64
# ---------------------------------------------------------------------------------------------------------
CASES = {  # name: (schedule, inputs, call options)
    "interleaved, causal, split 3, GQA, append 2": (
        "split", dict(seqlens=[0, 17, 62], seqlen_q=2, seqlen_new=2, head_dim=64), dict(causal=True, num_splits=3)),
    "neox, partial 16 of 40, not causal, Sq 3": (
        "split", dict(seqlens=[5, 61], seqlen_q=3, seqlen_new=3, head_dim=40, rotary_dim=16, heads_q=6),
        dict(rotary_interleaved=False, num_splits=1)),
    "neox, paged 16, causal, stream": (
        "stream", dict(seqlens=[1, 30, 62], page_size=16, heads_q=6, heads_kv=2, seqlen_q=2, seqlen_new=2),
        dict(causal=True, rotary_interleaved=False)),
    "interleaved, paged 32, local window, split 2, bf16": (
        "split", dict(seqlens=[9, 40], page_size=32, dtype=torch.bfloat16, seqlen_q=2, seqlen_new=1),
        dict(window_size=(6, 3), num_splits=2)),
    "leftpad, causal, batch idx, split 2": (
        "split", dict(seqlens=[10, 0, 50], pads=[3, 0, 50], batch_idx_rows=5, seqlen_q=2, seqlen_new=2),
        dict(causal=True, num_splits=2)),
    "leftpad, neox partial, not causal, stream, fp32, MQA": (
        "stream", dict(seqlens=[33, 60], pads=[20, 1], dtype=torch.float32, heads_kv=1, rotary_dim=16),
        dict(rotary_interleaved=False)),
    "leftpad without rotary, causal window, stream": (
        "stream", dict(seqlens=[40, 7], pads=[31, 2], rotary_dim=0, seqlen_q=2, seqlen_new=2),
        dict(causal=True, window_size=(4, 0))),
    "leftpad, window, softcap, alibi, sinks, split 3": (
        "split", dict(seqlens=[25, 58], pads=[4, 30], seqlen_q=3, seqlen_new=3, heads_q=4, heads_kv=2),
        dict(window_size=(9, 2), softcap=2.0, num_splits=3, causal=False)),
    "append 5, causal, several M tiles": (
        "split", dict(seqlens=[3, 50], seqlen_q=5, seqlen_new=5, heads_q=16, heads_kv=1, capacity=56),
        dict(causal=True, num_splits=2)),
}


@pytest.mark.parametrize("name", CASES)
def test_rotary_and_leftpad(name, schedule):
    sched, inputs, call = CASES[name]
    schedule(sched)
    kw = _inputs(**inputs, **call)
    if "softcap" in call:  # ALiBi slopes (B, H) and a sink per head with everything else
        gen = torch.Generator().manual_seed(1)
        kw["alibi_slopes"] = (torch.rand(len(inputs["seqlens"]), kw["q"].shape[2], generator=gen) * 0.5).to(DEVICE)
        kw["learnable_sink"] = torch.randn(kw["q"].shape[2], generator=gen).to(DEVICE)
    check_call(kw)


def test_query_positions_follow_flash_attns_rule(schedule):
    """Not causal with a window side of the cache's length or more (flash-attn: unbounded) rotates every query at
    cache_seqlens; one side shorter rotates query i at cache_seqlens + i."""
    schedule("split")
    assert rotary.per_query(False, (64, -1), 64) is False and rotary.per_query(False, (63, -1), 64) is True
    assert rotary.per_query(True, (-1, -1), 64) is True and rotary.per_query(False, (-1, 0), 64) is True
    for window in ((70, -1), (-1, 5)):
        check_call(_inputs([6, 40], seqlen_q=3, seqlen_new=3, window_size=window, num_splits=1))


def test_rotates_q_only_when_no_key_is_appended(schedule):
    """k and v with no tokens: nothing is appended, q is rotated at cache_seqlens."""
    schedule("split")
    check_call(_inputs([6, 40], seqlen_q=2, seqlen_new=0, causal=True, num_splits=2))


def test_tables_exactly_as_long_as_the_positions(schedule):
    """seqlen_ro = the last position + 1 (shorter than the cache, which flash-attn refuses)."""
    schedule("split")
    check_call(_inputs([20, 45], seqlen_q=2, seqlen_new=2, seqlen_ro=47, causal=True))


def test_positional_arguments_bind_like_flash_attn():
    """(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
    block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
    return_softmax_lse)."""
    kw = _inputs([12, 40], pads=[2, 5], seqlen_q=2, seqlen_new=2)
    results = []
    for positional in (False, True):
        caches = (kw["k_cache"].clone(), kw["v_cache"].clone())
        with torch.no_grad():
            if positional:
                out = flash_attn_with_kvcache(kw["q"], *caches, kw["k"], kw["v"], kw["rotary_cos"], kw["rotary_sin"],
                                              kw["cache_seqlens"], None, kw["cache_leftpad"], None, 0.3, True,
                                              (-1, -1), 0.0, False, None, 2, True)
            else:
                out = flash_attn_with_kvcache(
                    kw["q"], *caches, k=kw["k"], v=kw["v"], rotary_cos=kw["rotary_cos"], rotary_sin=kw["rotary_sin"],
                    cache_seqlens=kw["cache_seqlens"], cache_leftpad=kw["cache_leftpad"], softmax_scale=0.3,
                    causal=True, rotary_interleaved=False, num_splits=2, return_softmax_lse=True)
        results.append((out, caches))
    (out_kw, caches_kw), (out_pos, caches_pos) = results
    assert all(torch.equal(a, b) for a, b in zip(out_kw, out_pos))
    assert all(torch.equal(a, b) for a, b in zip(caches_kw, caches_pos))
    check_call({**kw, "softmax_scale": 0.3, "causal": True, "rotary_interleaved": False, "num_splits": 2})


# ---------------------------------------------------------------------------------------------------------
# bad input: host errors by name, and the GPU-checked path (NaN for that sequence, nothing written)
# ---------------------------------------------------------------------------------------------------------
_h = torch.float16


def _bad(**over):
    kw = _inputs([3, 10], capacity=64, seqlen_new=2)
    kw.update({n: (t.to(DEVICE) if isinstance(t, torch.Tensor) and t.device.type != "meta" else t)
               for n, t in over.items()})
    return kw


BAD = [
    ("cos without sin", ValueError, "rotary_cos and rotary_sin must be given together", dict(rotary_sin=None)),
    ("sin without cos", ValueError, "rotary_sin is a tensor, rotary_cos is None", dict(rotary_cos=None)),
    ("cos type", TypeError, "rotary_cos must be a torch.Tensor", dict(rotary_cos=[[1.0] * 16] * 64)),
    ("no k", ValueError, "pass k and v with them", dict(k=None, v=None)),
    ("cos 1-D", ValueError, r"rotary_cos must have shape \(seqlen_ro, rotary_dim / 2\)",
     dict(rotary_cos=torch.ones(64, dtype=_h), rotary_sin=torch.ones(64, dtype=_h))),
    ("sin shape", ValueError, "rotary_sin must have the shape of rotary_cos", dict(rotary_sin=torch.ones(64, 8, dtype=_h))),
    ("cos dtype", TypeError, "rotary_cos must have q's dtype", dict(rotary_cos=torch.ones(64, 16))),
    ("sin dtype", TypeError, "rotary_sin must have q's dtype", dict(rotary_sin=torch.ones(64, 16, dtype=torch.bfloat16))),
    ("cos device", ValueError, "rotary_cos must be on", dict(rotary_cos=torch.ones(64, 16, dtype=_h, device="meta"))),
    ("rotary dim 24", ValueError, "rotary_dim .* multiple of 16", dict(rotary_cos=torch.ones(64, 12, dtype=_h),
                                                                       rotary_sin=torch.ones(64, 12, dtype=_h))),
    ("rotary dim > head dim", ValueError, "at most the head dim 32, got 64",
     dict(rotary_cos=torch.ones(64, 32, dtype=_h), rotary_sin=torch.ones(64, 32, dtype=_h))),
    ("rotary dim 0", ValueError, "positive multiple of 16", dict(rotary_cos=torch.ones(64, 0, dtype=_h),
                                                                 rotary_sin=torch.ones(64, 0, dtype=_h))),
    ("tables short of int seqlens", ValueError, r"rotary_cos and rotary_sin have 40 rows .* cache_seqlens \(39\) \+ 2",
     dict(cache_seqlens=39, rotary_cos=torch.ones(40, 16, dtype=_h), rotary_sin=torch.ones(40, 16, dtype=_h))),
    ("tables short of any length", ValueError, "have 1 rows .* needs 2 rows",
     dict(rotary_cos=torch.ones(1, 16, dtype=_h), rotary_sin=torch.ones(1, 16, dtype=_h))),
    ("tables short of a tensor length", ValueError, r"have 11 rows .* cache_seqlens \(10\) \+ 2 = 12 rows",
     dict(rotary_cos=torch.ones(11, 16, dtype=_h), rotary_sin=torch.ones(11, 16, dtype=_h))),
    ("leftpad dtype", TypeError, "cache_leftpad must have dtype torch.int32", dict(cache_leftpad=torch.tensor([0, 1]))),
    ("leftpad shape", ValueError, r"cache_leftpad must have shape \(batch_size,\)",
     dict(cache_leftpad=torch.zeros(3, dtype=torch.int32))),
    ("leftpad type", TypeError, "cache_leftpad must be an int32 torch.Tensor", dict(cache_leftpad=[0, 1])),
    ("leftpad negative", ValueError, "cache_leftpad must be >= 0", dict(cache_leftpad=torch.tensor([0, -1],
                                                                                                   dtype=torch.int32))),
    ("leftpad past the length", ValueError, "cache_leftpad must be <= cache_seqlens",
     dict(cache_leftpad=torch.tensor([4, 1], dtype=torch.int32))),
    ("leftpad paged", NotImplementedError, "cache_leftpad with block_table",
     dict(cache_leftpad=torch.zeros(2, dtype=torch.int32), k_cache=torch.randn(8, 16, 2, 32, dtype=_h),
          v_cache=torch.randn(8, 16, 2, 32, dtype=_h), block_table=torch.arange(8, dtype=torch.int32).reshape(2, 4))),
    ("tables require grad", NotImplementedError, "rotary_cos, rotary_sin require grad",
     dict(rotary_cos=torch.ones(64, 16, dtype=_h).requires_grad_(), rotary_sin=torch.ones(64, 16, dtype=_h)
          .requires_grad_())),
]


@pytest.mark.parametrize("name,exc,match,over", BAD, ids=[b[0] for b in BAD])
def test_bad_input(name, exc, match, over, monkeypatch):
    monkeypatch.setattr(kvcache, "CHECK_VALUES", True)  # values of device tensors: host checks, ValueError
    good = _bad()
    with torch.no_grad():  # the same shape passes once: its checks are remembered, the bad one still raises
        flash_attn_with_kvcache(**{**good, "k_cache": good["k_cache"].clone(), "v_cache": good["v_cache"].clone()})
    kw = _bad(**over)
    before = (kw["k_cache"].clone(), kw["v_cache"].clone())
    with pytest.raises(exc, match=match):
        if "require grad" in name:
            flash_attn_with_kvcache(**kw)
        else:
            with torch.no_grad():
                flash_attn_with_kvcache(**kw)
    assert torch.equal(kw["k_cache"], before[0]) and torch.equal(kw["v_cache"], before[1])


BAD_VALUES = [  # (name, which sequence is bad, cache_seqlens, overrides): values the kernels catch without a sync
    ("leftpad negative", 1, [3, 10], dict(cache_leftpad=torch.tensor([2, -1], dtype=torch.int32))),
    ("leftpad past the length", 0, [3, 10], dict(cache_leftpad=torch.tensor([4, 1], dtype=torch.int32))),
    ("tables short of a length", 1, [9, 11], dict(rotary_cos=torch.ones(12, 16, dtype=_h),
                                                  rotary_sin=torch.ones(12, 16, dtype=_h))),
]


@pytest.mark.parametrize("name,bad,seqlens,over", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
@pytest.mark.parametrize("sched", ["split", "stream"])
def test_bad_values_poison_only_their_sequence(name, bad, seqlens, over, sched, schedule, monkeypatch):
    """Without host checks the sequence with the bad value gets NaN (out and lse) and appends nothing; the other
    is what a call with only it gives (exactly with the split grid; to rounding with the stream schedule)."""
    monkeypatch.setattr(kvcache, "CHECK_VALUES", False)
    schedule(sched)
    kw = _bad(**over, num_splits=3 if sched == "split" else 0)
    kw["cache_seqlens"] = torch.tensor(seqlens, dtype=torch.int32, device=DEVICE)
    good = 1 - bad
    before = (kw["k_cache"].clone(), kw["v_cache"].clone())
    with torch.no_grad():
        out, lse = flash_attn_with_kvcache(**kw, return_softmax_lse=True)
    assert out[bad].isnan().all() and lse[bad].isnan().all()
    assert not out[good].isnan().any() and not lse[good].isnan().any()
    one = {n: (t[good:good + 1] if n in ("q", "k", "v", "cache_seqlens", "cache_leftpad") and t is not None else t)
           for n, t in kw.items()}
    one["k_cache"], one["v_cache"] = before[0].clone(), before[1].clone()
    one["cache_batch_idx"] = torch.tensor([good], dtype=torch.int32, device=DEVICE)
    with torch.no_grad():
        out1, lse1 = flash_attn_with_kvcache(**one, return_softmax_lse=True)
    exact = sched == "split"
    torch.testing.assert_close(out[good:good + 1], out1, rtol=0, atol=0 if exact else 2e-3)
    torch.testing.assert_close(lse[good:good + 1], lse1, rtol=0, atol=0 if exact else 1e-4)
    assert torch.equal(kw["k_cache"], one["k_cache"]) and torch.equal(kw["v_cache"], one["v_cache"])


# ---------------------------------------------------------------------------------------------------------
# torch.compile, and the GPU build
# ---------------------------------------------------------------------------------------------------------
def test_compiles_fullgraph_like_eager():
    """Two decode steps with rotary tables and left pads: one graph, eager's outputs, lse and caches."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    kw = _inputs([5, 30], pads=[1, 9], seqlen_q=1, seqlen_new=1)

    def step(q, k_cache, v_cache, k, v, cos, sin, lens, pads):
        out, lse = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, lens, cache_leftpad=pads,
                                                       causal=True, rotary_interleaved=False, num_splits=2,
                                                       return_softmax_lse=True)
        return out * 2, lse

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    caches = {f: (kw["k_cache"].clone(), kw["v_cache"].clone()) for f in ("eager", "compiled")}
    with torch.no_grad():
        for i in range(2):
            lens = kw["cache_seqlens"] + i
            args = (kw["k"] + i, kw["v"] - i, kw["rotary_cos"], kw["rotary_sin"], lens, kw["cache_leftpad"])
            expected = step(kw["q"], *caches["eager"], *args)
            got = compiled(kw["q"], *caches["compiled"], *args)
            for a, b in zip(got, expected):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
            assert all(torch.equal(a, b) for a, b in zip(caches["compiled"], caches["eager"]))
    assert counter.frame_count == 1


def test_kvcache_opcheck_with_rotary_and_leftpad():
    kw = _inputs([5, 20], pads=[2, 0], capacity=32, seqlen_new=1)
    args = [kw["q"], kw["k_cache"], kw["v_cache"], kw["k"], kw["v"], kw["cache_seqlens"], None, None, 0.25, True, 2,
            32, 1, -1, 0, 0.0, None, None, kw["rotary_cos"], kw["rotary_sin"], kw["cache_leftpad"], False, True]
    torch.library.opcheck(torch.ops.flashtriton.kvcache.default, args)


def test_rotary_builds_compile_for_sm90_without_a_gpu():
    """The decode kernels with rotary (both forms) and left pads, and the rotating append, compile to sm_90 code in a
    fresh process without the interpreter."""
    script = (
        "import torch, triton\n"
        "from flashtriton.kernels.decode_launch import compile_for_sm90\n"
        "from flashtriton.kernels.variant import Variant\n"
        "plain = Variant.of(True, True, (-1, -1), 0.0, False, False)\n"
        "every = Variant.of(False, True, (100, 3), 30.0, True, True)\n"
        "for variant, paged, stream, rot, pad in [(plain, False, False, (64, False, True), True),\n"
        "                                         (every, True, True, (128, True, False), False)]:\n"
        "    compiled = compile_for_sm90(variant, paged, stream, rotary=rot, leftpad=pad, seqlen_q=2)\n"
        "    assert 'mma' in compiled.asm['ptx']\n"
        "    print('compiled', paged, stream)\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "from flashtriton.kernels.decode import _append_kv\n"
        "meta = dict(HEAD_DIM=128, BLOCK_D=128, HEAD_DIM_V=128, BLOCK_DV=128, PAGED=False, PAGE_SIZE=1,\n"
        "            HAS_BATCH_IDX=True, ROTARY_DIM=64, ROTARY_INTERLEAVED=False, HAS_LEFTPAD=True, BLOCK_T=2)\n"
        "pointers = {'K_NEW', 'V_NEW', 'K_CACHE', 'V_CACHE', 'COS', 'SIN'}\n"
        "ints = {'CACHE_SEQLENS', 'BATCH_IDX', 'BLOCK_TABLE', 'LEFTPAD'}\n"
        "sig = {n: 'constexpr' if n in meta else '*fp16' if n in pointers else '*i32' if n in ints else 'i32'\n"
        "       for n in _append_kv.arg_names}\n"
        "triton.compile(ASTSource(fn=_append_kv, signature=sig, constexprs=meta), target=GPUTarget('cuda', 90, 32))\n"
        "print('compiled append')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1] / "src")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 3


# ---------------------------------------------------------------------------------------------------------
# large shapes (GPU only)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("sched", ["auto", "split", "stream"])
@pytest.mark.parametrize("layout", ["contiguous, leftpad", "paged 256"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_large_rotary_decode(sched, layout, dtype, schedule):
    """Batch 8, 32k-key caches with ragged lengths, GQA 32/8, D=128, rotary over all 128 dims (GPT-NeoX) or half
    of them (interleaved), 1 and 4 appended keys (causal): each schedule against float64."""
    if sched != "auto":
        schedule(sched)
    capacity, batch = 32768, 8
    gen = torch.Generator().manual_seed(0)
    seqlens = torch.randint(1, capacity - 4, (batch,), generator=gen).tolist()
    paged = layout.startswith("paged")
    pads = None if paged else [int(torch.randint(0, s + 1, (1,), generator=gen)) for s in seqlens]
    for seqlen_new, rotary_dim, interleaved in ((1, 128, False), (4, 64, True)):
        kw = _inputs(seqlens, pads=pads, capacity=capacity, seqlen_q=seqlen_new, seqlen_new=seqlen_new, heads_q=32,
                     heads_kv=8, head_dim=128, rotary_dim=rotary_dim, dtype=dtype, page_size=256 if paged else None,
                     causal=True, rotary_interleaved=interleaved)
        check_call(kw)
