"""flash_attn_with_kvcache: contiguous and paged caches, appends, split-KV, GQA/MQA, causal, lse, bad input.

Each case builds its expected cache independently (the old cache with the new keys written at
cache_seqlens[b]..), checks that the call left exactly that in k_cache/v_cache, and compares the output per
batch element with the float64 reference on the valid prefix of the expected cache. The error against float64
must be within 2x torch's own same-dtype error plus a small floor.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from flashtriton.kernels import dispatch
from flashtriton import configs, kvcache, kvcache_plan, paging
from flashtriton.kernels import decode, decode_launch
from flashtriton.kernels.decode_launch import choose_num_splits, decode_attention
from flashtriton.kernels.variant import Variant
from flashtriton.kvcache import flash_attn_with_kvcache
from flashtriton.reference import attention_reference

from conftest import DEVICE

FLOOR = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}


def _logical_cache(cache, block_table, batch_idx, batch):
    """(B, capacity, Hkv, D): each sequence's cache in key order (through the page table when paged)."""
    if block_table is not None:
        return cache[block_table.long()].flatten(1, 2)
    rows = batch_idx.long() if batch_idx is not None else torch.arange(batch, device=cache.device)
    return cache[rows]


def _expected_cache(cache, new, seqlens, block_table, batch_idx):
    """The cache after writing `new` (B, S_new, Hkv, D) at positions seqlens[b].. of each sequence."""
    expected = cache.clone()
    if new is None:
        return expected
    for b in range(new.shape[0]):
        for j in range(new.shape[1]):
            pos = int(seqlens[b]) + j
            if block_table is not None:
                page_size = cache.shape[1]
                expected[int(block_table[b, pos // page_size]), pos % page_size] = new[b, j]
            else:
                row = int(batch_idx[b]) if batch_idx is not None else b
                expected[row, pos] = new[b, j]
    return expected


def run_case(batch=2, seqlen_q=1, heads_q=4, heads_kv=2, head_dim=64, capacity=80, dtype=torch.float16,
             seqlens=None, seqlen_new=0, causal=False, num_splits=0, page_size=None, batch_cache=None,
             use_batch_idx=False, seqlens_as="tensor", softmax_scale=None, check_lse=True, strided_q=False, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)

    q = randn(batch, seqlen_q, heads_q, head_dim)
    if strided_q:  # a (B, H, S, D) tensor seen as (B, S, H, D): strided, last dim contiguous
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    block_table = batch_idx = None
    if page_size is not None:
        pages_per_seq = math.ceil(capacity / page_size)
        capacity = pages_per_seq * page_size
        num_pages = batch * pages_per_seq + 3  # a few pages no sequence uses
        block_table = torch.randperm(num_pages, generator=gen)[: batch * pages_per_seq]
        block_table = block_table.reshape(batch, pages_per_seq).to(device=DEVICE, dtype=torch.int32)
        k_cache = randn(num_pages, page_size, heads_kv, head_dim)
    else:
        batch_cache = batch_cache or batch
        k_cache = randn(batch_cache, capacity, heads_kv, head_dim)
        if use_batch_idx:
            batch_idx = torch.randperm(batch_cache, generator=gen)[:batch].to(device=DEVICE, dtype=torch.int32)
    v_cache = randn(*k_cache.shape)
    if seqlens is None:
        seqlens = torch.randint(0, capacity - seqlen_new + 1, (batch,), generator=gen).tolist()
    k = randn(batch, seqlen_new, heads_kv, head_dim) if seqlen_new else None
    v = randn(batch, seqlen_new, heads_kv, head_dim) if seqlen_new else None

    exp_k = _expected_cache(k_cache, k, seqlens, block_table, batch_idx)
    exp_v = _expected_cache(v_cache, v, seqlens, block_table, batch_idx)
    if seqlens_as == "tensor":
        cache_seqlens = torch.tensor(seqlens, dtype=torch.int32, device=DEVICE)
    elif seqlens_as == "int":
        assert len(set(seqlens)) == 1
        cache_seqlens = seqlens[0]
    else:  # None: the whole cache
        assert all(s == capacity for s in seqlens) and not seqlen_new
        cache_seqlens = None

    with torch.no_grad():
        out, lse = flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, cache_batch_idx=batch_idx,
            block_table=block_table, softmax_scale=softmax_scale, causal=causal, num_splits=num_splits,
            return_softmax_lse=True,
        )
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (batch, heads_q, seqlen_q) and lse.dtype == torch.float32
    # The cache holds exactly the appended values where expected, and nothing else changed.
    assert torch.equal(k_cache, exp_k) and torch.equal(v_cache, exp_v)

    keys = _logical_cache(exp_k, block_table, batch_idx, batch)
    values = _logical_cache(exp_v, block_table, batch_idx, batch)
    for b in range(batch):
        n = seqlens[b] + seqlen_new
        args = (q[b:b + 1], keys[b:b + 1, :n], values[b:b + 1, :n], softmax_scale, causal)
        ref, ref_lse = attention_reference(*args, bottom_right=True, dtype=torch.float64, return_lse=True)
        same = attention_reference(*args, bottom_right=True, dtype=dtype)
        err = (out[b:b + 1].double() - ref).abs().max().item()
        torch_err = (same.double() - ref).abs().max().item()
        assert not out[b].isnan().any()
        assert err <= 2 * torch_err + FLOOR[dtype], f"batch {b} (keys {n}): err {err:.3g}, torch {torch_err:.3g}"
        if check_lse:
            got = lse[b:b + 1].double()
            assert torch.equal(torch.isinf(got), torch.isinf(ref_lse)), f"batch {b}: -inf rows differ"
            finite = ~torch.isinf(ref_lse)
            assert (got[finite] - ref_lse[finite]).abs().max().item() <= 1e-3 if finite.any() else True
    return out, lse


# ---------------------------------------------------------------------------------------------------------
# contiguous cache
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype,head_dim,heads_q,heads_kv,seqlen_q,causal,num_splits,seqlen_new",
    [
        (torch.float16, 64, 4, 2, 1, False, 1, 0),
        (torch.float16, 64, 4, 2, 1, True, 3, 1),
        (torch.float16, 128, 8, 1, 1, False, 0, 1),  # MQA
        (torch.float16, 40, 6, 2, 3, True, 3, 3),  # padded head dim, GQA, Sq > 1
        (torch.float16, 40, 2, 2, 4, True, 1, 2),
        (torch.float16, 64, 3, 3, 2, False, 0, 0),
        (torch.bfloat16, 64, 4, 2, 1, True, 0, 1),
        (torch.bfloat16, 128, 4, 1, 2, True, 3, 2),
        (torch.bfloat16, 40, 4, 4, 1, False, 1, 0),
        (torch.float32, 64, 4, 2, 2, True, 3, 1),
    ],
)
def test_contiguous(dtype, head_dim, heads_q, heads_kv, seqlen_q, causal, num_splits, seqlen_new):
    # Lengths 0, 1, a middle one and the full capacity (the append fills the cache to the end).
    capacity = 70
    seqlens = [0, 1, 37, capacity - seqlen_new]
    run_case(batch=4, seqlen_q=seqlen_q, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, dtype=dtype,
             capacity=capacity, seqlens=seqlens, seqlen_new=seqlen_new, causal=causal, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("seqlen_new", [0, 2])
def test_cache_batch_idx(num_splits, seqlen_new):
    run_case(batch=3, batch_cache=5, use_batch_idx=True, heads_q=4, heads_kv=1, capacity=50,
             seqlens=[5, 0, 48 - seqlen_new + 2], seqlen_new=seqlen_new, causal=True, num_splits=num_splits)


def test_larger_cache_than_batch_without_batch_idx():
    run_case(batch=2, batch_cache=4, capacity=40, seqlens=[10, 40], num_splits=1)


@pytest.mark.parametrize("seqlens_as", ["int", "none"])
def test_cache_seqlens_int_or_none(seqlens_as):
    capacity = 48
    if seqlens_as == "int":
        run_case(batch=2, capacity=capacity, seqlens=[20, 20], seqlen_new=3, seqlens_as="int", causal=True)
    else:
        run_case(batch=2, capacity=capacity, seqlens=[capacity] * 2, seqlens_as="none", num_splits=3)


@pytest.mark.parametrize("seqlen_q,heads_q,heads_kv", [(70, 1, 1), (20, 4, 2)])
def test_long_query_several_m_tiles(seqlen_q, heads_q, heads_kv):
    """Sq x group > 64 stacked rows: several M tiles, causal with rows that see no key (Sk < Sq)."""
    run_case(batch=2, seqlen_q=seqlen_q, heads_q=heads_q, heads_kv=heads_kv, head_dim=40, capacity=90,
             seqlens=[5, 90 - seqlen_q], seqlen_new=seqlen_q, causal=True, num_splits=2)


def test_softmax_scale_and_strided_q():
    run_case(batch=2, seqlen_q=2, heads_q=4, heads_kv=2, capacity=40, seqlens=[12, 33], softmax_scale=0.3,
             causal=True, strided_q=True, num_splits=3)


@pytest.mark.parametrize("softmax_scale", [-0.3, -2.0, 0.0])
@pytest.mark.parametrize("page_size", [None, 16])
def test_negative_and_zero_scales(softmax_scale, page_size):
    """torch and flash-attn accept any real scale: a negative one flips which key scores highest."""
    run_case(seqlens=[5, 40], seqlen_new=2, seqlen_q=2, causal=True, softmax_scale=softmax_scale,
             page_size=page_size, num_splits=2)


def test_more_splits_than_tiles_and_empty_sequences():
    """Splits with no keys (lse -inf) merge to the right answer; a sequence with no key at all gives 0."""
    out, lse = run_case(batch=3, capacity=40, seqlens=[0, 1, 40], num_splits=7)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isinf(lse[0]).all()


# ---------------------------------------------------------------------------------------------------------
# the stream schedule: all key tiles of the batch cut into equal ranges, one per program
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture
def stream_schedule(monkeypatch):
    """Force the stream schedule (`_decode_stream`); `use(sms, min_split_keys)` sets how many programs it gets:
    min(SMs · programs per SM, key tiles // (min_split_keys // BLOCK_N)) (the SM count only off the GPU)."""
    def use(sms=4, min_split_keys=None):
        monkeypatch.setattr(dispatch, "CHOICE", dispatch.Choice(decode="stream"))
        monkeypatch.setattr(configs, "DECODE_INTERPRETER_SMS", sms)
        if min_split_keys is not None:
            monkeypatch.setattr(configs, "DECODE_MIN_SPLIT_KEYS", min_split_keys)
        kvcache_plan.clear()  # plans are kept per signature, and these settings are not in the key

    yield use
    kvcache_plan.clear()


def _launched_kernels(monkeypatch):
    """Names and grids of the decode launches from now on."""
    seen = []
    launch, keep = decode_launch.launch, decode_launch.launch_and_keep

    def record(kernel, grid, args, meta):
        assert len(grid) == 3  # a kept launch (`Relaunch`) passes all three grid dimensions
        seen.append((kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__, tuple(grid)))

    monkeypatch.setattr(decode_launch, "launch", lambda k, g, a, m: (record(k, g, a, m), launch(k, g, a, m))[1])
    monkeypatch.setattr(decode_launch, "launch_and_keep", lambda k, g, a, m: (record(k, g, a, m), keep(k, g, a, m))[1])
    return seen


@pytest.mark.parametrize("min_split_keys", [256, 16])  # a few programs of many units; one tile per program
@pytest.mark.parametrize(
    "dtype,head_dim,heads_q,heads_kv,seqlen_q,causal,seqlen_new,page_size",
    [
        (torch.float16, 64, 4, 2, 1, False, 0, None),
        (torch.float16, 40, 6, 2, 3, True, 3, None),  # padded head dim, GQA, Sq > 1, appends
        (torch.bfloat16, 128, 4, 1, 2, True, 2, None),
        (torch.float32, 64, 4, 2, 2, True, 1, None),
        (torch.float16, 64, 4, 2, 1, True, 1, 16),  # paged
        (torch.bfloat16, 40, 6, 3, 2, True, 2, 32),
    ],
)
def test_stream_schedule(dtype, head_dim, heads_q, heads_kv, seqlen_q, causal, seqlen_new, page_size,
                         min_split_keys, stream_schedule, monkeypatch):
    """Lengths 0, 1, a middle one and the full cache: units of one tile and of many, units whole in a program
    and shared by several, against float64 and torch's own error."""
    stream_schedule(min_split_keys=min_split_keys)
    seen = _launched_kernels(monkeypatch)
    capacity = 96
    run_case(batch=4, seqlen_q=seqlen_q, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, dtype=dtype,
             capacity=capacity, seqlens=[0, 1, 45, capacity - seqlen_new], seqlen_new=seqlen_new, causal=causal,
             page_size=page_size)
    assert [name for name, _ in seen if name.startswith("_decode")] == ["_decode_stream"]


@pytest.mark.parametrize("seqlen_q,heads_q,heads_kv", [(70, 1, 1), (20, 4, 2)])
def test_stream_schedule_several_m_tiles(seqlen_q, heads_q, heads_kv, stream_schedule):
    stream_schedule(min_split_keys=16)
    run_case(batch=2, seqlen_q=seqlen_q, heads_q=heads_q, heads_kv=heads_kv, head_dim=40, capacity=90,
             seqlens=[5, 90 - seqlen_q], seqlen_new=seqlen_q, causal=True)


def test_stream_schedule_one_unit_over_many_programs(stream_schedule, monkeypatch):
    """One sequence and one kv head read by more programs than one merge round trip takes (MERGE_CHUNK), the
    cache batch index and the ticket counters left at zero for the next calls."""
    stream_schedule(sms=16, min_split_keys=16)
    seen = _launched_kernels(monkeypatch)
    keys = 300 if DEVICE == "cpu" else 1300  # 10 key tiles of 32 (the interpreter's config), 11 of 128 on a GPU
    for _ in range(2):
        run_case(batch=1, heads_q=2, heads_kv=1, capacity=keys, seqlens=[keys], batch_cache=3, use_batch_idx=True)
    programs = seen[0][1][0]
    assert programs > decode.MERGE_CHUNK.value, seen
    run_case(batch=2, heads_q=2, heads_kv=1, capacity=300, seqlens=[0, 0])  # no key anywhere: 0 and -inf
    for (kind, *_), buf in decode_launch._STREAM_BUFFERS.items():
        if kind == "tickets":
            assert int(buf.abs().sum()) == 0


def test_stream_schedule_more_programs_than_tiles(stream_schedule, monkeypatch):
    """Programs are sized from the cache's capacity; shorter caches give some programs nothing to do."""
    stream_schedule(sms=64, min_split_keys=16)
    seen = _launched_kernels(monkeypatch)
    run_case(batch=3, heads_q=4, heads_kv=2, capacity=300, seqlens=[1, 0, 40])
    assert seen[0][0] == "_decode_stream" and seen[0][1][0] > 8  # more programs than the 8 key tiles (1 + 1 + 2, 2 heads)


def test_stream_programs_model():
    """H200-like (132 SMs): the stream schedule's programs follow the units (k programs per unit or k units per
    program: a batch of full caches is cut as the split grid cuts it), for batches of several sequences with long
    caches under a one-program-per-SM config; batch 1, short caches and many programs per SM keep the grid."""
    def pick(batch, keys, per_sm=1, force=False):
        return decode_launch.stream_programs(batch * 8, keys, 132, 128, per_sm, batch, force=force)

    assert pick(8, 32768) == 128 and pick(8, 131072) == 128  # 2 programs per unit
    assert pick(8, 16384) == 0 and pick(8, 16384, force=True) == 128  # below DECODE_STREAM_MIN_KEYS
    assert pick(64, 32768) == 128  # 4 units per program
    assert pick(17, 32768) == 132  # 136 units: aligned would be 68 programs of two units, half the SMs idle
    assert pick(1, 32768) == 0 and pick(1, 32768, force=True) == 128  # batch 1: the grid (16 splits)
    assert pick(8, 1024) == 0 and pick(8, 1024, force=True) == 128  # 4 key tiles each
    assert pick(64, 4096, per_sm=3) == 0 and pick(64, 4096, per_sm=3, force=True) == 396  # aligned 256: 35 % idle


# ---------------------------------------------------------------------------------------------------------
# paged cache
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "page_size,dtype,head_dim,heads_q,heads_kv,seqlen_q,causal,num_splits,seqlen_new",
    [
        (16, torch.float16, 64, 4, 2, 1, False, 1, 0),
        (16, torch.float16, 128, 4, 1, 1, True, 3, 1),
        (16, torch.bfloat16, 40, 6, 3, 2, True, 0, 2),
        (32, torch.float16, 64, 4, 4, 1, True, 0, 1),
        (32, torch.bfloat16, 64, 8, 2, 3, True, 3, 3),
        (32, torch.float16, 40, 2, 1, 1, False, 3, 0),
        (64, torch.float16, 64, 4, 2, 2, True, 3, 2),  # page wider than the interpreter's key tile
    ],
)
def test_paged(page_size, dtype, head_dim, heads_q, heads_kv, seqlen_q, causal, num_splits, seqlen_new):
    capacity = 96
    seqlens = [0, 1, 45, capacity - seqlen_new]
    run_case(batch=4, seqlen_q=seqlen_q, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, dtype=dtype,
             capacity=capacity, page_size=page_size, seqlens=seqlens, seqlen_new=seqlen_new, causal=causal,
             num_splits=num_splits)


def test_paged_forced_wide_tile():
    """A key tile wider than a page (several page look-ups per tile) through the launcher's config."""
    torch.manual_seed(1)
    page_size, pages, heads_kv, group, head_dim = 16, 6, 2, 2, 64
    k_cache = torch.randn(pages + 2, page_size, heads_kv, head_dim, dtype=torch.float16)
    v_cache = torch.randn_like(k_cache)
    block_table = torch.randperm(pages + 2)[:pages].reshape(2, 3).to(torch.int32)
    q = torch.randn(2, 1, heads_kv * group, head_dim, dtype=torch.float16)
    seqlens = torch.tensor([48, 21], dtype=torch.int32)
    q, k_cache, v_cache, block_table, seqlens = (t.to(DEVICE) for t in (q, k_cache, v_cache, block_table, seqlens))
    out, lse = decode_attention(q, k_cache, v_cache, seqlens, 48, 0.125, False, block_table=block_table,
                                num_splits=1, config={"BLOCK_N": 64, "num_warps": 4, "num_stages": 1})
    keys = k_cache[block_table.long()].flatten(1, 2)
    values = v_cache[block_table.long()].flatten(1, 2)
    for b in range(2):
        n = int(seqlens[b])
        ref = attention_reference(q[b:b + 1], keys[b:b + 1, :n], values[b:b + 1, :n], 0.125)
        assert (out[b:b + 1].double() - ref).abs().max().item() < 2e-3


# ---------------------------------------------------------------------------------------------------------
# split heuristic, autograd, bad input
# ---------------------------------------------------------------------------------------------------------
def test_choose_num_splits():
    cpu = torch.device("cpu")
    # H200-like (132 SMs): batch 8 x 8 kv heads on a 32k cache splits to fill the SMs, one wave; batch 1
    # splits more; a full GPU's worth does not split; short caches are not worth a split's overhead.
    for per_sm in (1, 2, 3):
        s = choose_num_splits(64, 32768, cpu, num_sms=132, programs_per_sm=per_sm)
        assert 2 <= s <= 128 and 0.8 * 132 * per_sm <= 64 * s <= 132 * per_sm
        assert choose_num_splits(8, 32768, cpu, num_sms=132, programs_per_sm=per_sm) > s
    assert choose_num_splits(512, 32768, cpu, num_sms=132) == 1
    assert choose_num_splits(64, 1024, cpu, num_sms=132) == 1
    assert choose_num_splits(4, 100, cpu, num_sms=132) == 1  # too few keys to split
    assert 1 <= choose_num_splits(2, 4096, cpu) <= 8


def test_default_decode_config_by_launch_size():
    """Many short programs (batch 64 x 8 kv heads, caches <= 4k, on 132 SMs) take the 3-per-SM config; few
    programs or long caches the wide one; fp32 and D=256 the small one. The split count follows each config's
    occupancy: batch 64 x 1k is not split either way."""
    from flashtriton import configs

    many_short = configs.default_decode_config(128, 2, programs=512, num_sms=132, max_seqlen_k=1024)
    assert (many_short["BLOCK_N"], many_short["num_warps"], many_short["num_stages"]) == (128, 4, 2)
    assert configs.decode_programs_per_sm(many_short, 128, 16, 2) == 3
    for programs, keys in ((64, 1024), (512, 32768), (8, 4096)):
        wide = configs.default_decode_config(128, 2, programs=programs, num_sms=132, max_seqlen_k=keys)
        assert (wide["num_warps"], wide["num_stages"]) == (8, 3)
    assert configs.default_decode_config(128, 4, programs=512, num_sms=132, max_seqlen_k=1024)["BLOCK_N"] == 64
    assert configs.default_decode_config(256, 2)["BLOCK_N"] == 64
    cpu = torch.device("cpu")
    assert choose_num_splits(512, 1024, cpu, num_sms=132, programs_per_sm=3) == 1


def test_prune_decode_configs_keeps_one():
    from flashtriton import configs

    for dtype in (torch.float16, torch.float32):
        for block_d in (16, 64, 128, 256):
            for block_m in (16, 32, 64):
                for bucket in (16, 1024, 65536):
                    kept = configs.prune_decode_configs(
                        configs.DECODE_CONFIGS, {"Q": torch.empty(1, dtype=dtype), "TUNE_SEQLEN_K": bucket},
                        BLOCK_D=block_d, BLOCK_M=block_m)
                    assert kept, (dtype, block_d, block_m, bucket)
                    if bucket >= 1024 and dtype == torch.float16 and block_d <= 128:
                        assert any(c.kwargs["BLOCK_N"] >= 64 for c in kept)


def test_requires_grad_raises_and_no_grad_runs():
    q = torch.randn(1, 1, 2, 16, dtype=torch.float16, device=DEVICE, requires_grad=True)
    k_cache = torch.randn(1, 32, 2, 16, dtype=torch.float16, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    with pytest.raises(NotImplementedError, match="inference-only.*q requires grad"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5)
    with torch.no_grad():
        out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5)
    assert not out.requires_grad
    with torch.inference_mode():
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5)


def _inputs(**over):
    d = dict(
        q=torch.randn(2, 1, 4, 32, dtype=torch.float16),
        k_cache=torch.randn(2, 64, 2, 32, dtype=torch.float16),
        v_cache=torch.randn(2, 64, 2, 32, dtype=torch.float16),
        cache_seqlens=torch.tensor([3, 10], dtype=torch.int32),
    )
    d.update(over)
    return d


def _paged(**over):
    d = _inputs(k_cache=torch.randn(6, 16, 2, 32, dtype=torch.float16),
                v_cache=torch.randn(6, 16, 2, 32, dtype=torch.float16),
                block_table=torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32))
    d.update(over)
    return d


def _on_device(kwargs):
    """The case's tensors on the test device (strides kept), other values as they are."""
    return {n: (t.to(DEVICE) if isinstance(t, torch.Tensor) else t) for n, t in kwargs.items()}


_h = torch.float16
BAD = [
    ("window side", ValueError, "window_size sides must be >= -1", _inputs(window_size=(8, -2))),
    ("window type", TypeError, "window_size must be a tuple of two ints", _inputs(window_size=8)),
    ("window float", TypeError, "window_size must hold two ints", _inputs(window_size=(8.0, 0))),
    ("softcap negative", ValueError, "softcap must be a finite number >= 0", _inputs(softcap=-1.0)),
    ("softcap inf", ValueError, "softcap must be a finite number >= 0", _inputs(softcap=float("inf"))),
    ("softcap tensor", TypeError, "softcap must be a real number", _inputs(softcap=torch.tensor(3.0))),
    ("alibi dtype", TypeError, "alibi_slopes must be float32", _inputs(alibi_slopes=torch.ones(4, dtype=_h))),
    ("alibi shape", ValueError, r"alibi_slopes must have shape \(nheads,\)", _inputs(alibi_slopes=torch.ones(3))),
    ("alibi type", TypeError, "alibi_slopes must be a torch.Tensor", _inputs(alibi_slopes=[1.0] * 4)),
    ("sink shape", ValueError, r"learnable_sink must have shape \(nheads,\)", _inputs(learnable_sink=torch.ones(2))),
    ("sink dtype", TypeError, "learnable_sink must be float32 or the inputs' dtype",
     _inputs(learnable_sink=torch.ones(4, dtype=torch.bfloat16))),
    ("sink type", TypeError, "learnable_sink must be a torch.Tensor", _inputs(learnable_sink=0.5)),
    ("q 3d", ValueError, "q must have 4 dims", _inputs(q=torch.randn(2, 4, 32, dtype=_h))),
    ("q not tensor", TypeError, "q must be a torch.Tensor", _inputs(q=[1.0])),
    ("dtype int", TypeError, "float16, bfloat16 or float32", _inputs(q=torch.ones(2, 1, 4, 32, dtype=torch.int32))),
    ("dtype mix", TypeError, "share one dtype", _inputs(q=torch.randn(2, 1, 4, 32, dtype=torch.bfloat16))),
    ("heads", ValueError, "multiple of the number of key/value heads", _inputs(q=torch.randn(2, 1, 3, 32, dtype=_h))),
    ("head dim", ValueError, "head dim", _inputs(q=torch.randn(2, 1, 4, 16, dtype=_h))),
    ("head dim 512", ValueError, "between 1 and 256", _inputs(
        q=torch.randn(1, 1, 2, 512, dtype=_h), k_cache=torch.randn(1, 16, 2, 512, dtype=_h),
        v_cache=torch.randn(1, 16, 2, 512, dtype=_h), cache_seqlens=4)),
    ("v_cache shape", ValueError, "v_cache must have the shape", _inputs(v_cache=torch.randn(2, 32, 2, 32, dtype=_h))),
    ("cache last dim", ValueError, "k_cache must have a contiguous last dim",
     _inputs(k_cache=torch.randn(2, 64, 32, 2, dtype=_h).transpose(2, 3))),
    ("k without v", ValueError, "k and v must be given together", _inputs(k=torch.randn(2, 1, 2, 32, dtype=_h))),
    ("k shape", ValueError, "k must have shape", _inputs(k=torch.randn(2, 1, 4, 32, dtype=_h),
                                                        v=torch.randn(2, 1, 4, 32, dtype=_h))),
    ("v shape", ValueError, "v must have the shape of k", _inputs(k=torch.randn(2, 1, 2, 32, dtype=_h),
                                                                 v=torch.randn(2, 2, 2, 32, dtype=_h))),
    ("k dtype", TypeError, "share one dtype", _inputs(k=torch.randn(2, 1, 2, 32), v=torch.randn(2, 1, 2, 32))),
    ("seqlens dtype", TypeError, "cache_seqlens must have dtype torch.int32",
     _inputs(cache_seqlens=torch.tensor([3, 10]))),
    ("seqlens length", ValueError, r"cache_seqlens must have shape \(batch_size,\)",
     _inputs(cache_seqlens=torch.tensor([3, 10, 4], dtype=torch.int32))),
    ("seqlens type", TypeError, "cache_seqlens must be None, an int", _inputs(cache_seqlens=3.0)),
    ("seqlens negative", ValueError, "cache_seqlens must be >= 0",
     _inputs(cache_seqlens=torch.tensor([-1, 10], dtype=torch.int32))),
    ("seqlens int too big", ValueError, "cache_seqlens must be in 0..64", _inputs(cache_seqlens=65)),
    ("seqlens too big", ValueError, "the cache is too small",
     _inputs(cache_seqlens=torch.tensor([3, 65], dtype=torch.int32))),
    ("append overflow", ValueError, r"cache_seqlens \(max 63\) \+ seqlen_new \(2\)",
     _inputs(cache_seqlens=torch.tensor([3, 63], dtype=torch.int32), k=torch.randn(2, 2, 2, 32, dtype=_h),
             v=torch.randn(2, 2, 2, 32, dtype=_h))),
    ("append to full cache", ValueError, "the cache is too small",
     _inputs(cache_seqlens=None, k=torch.randn(2, 1, 2, 32, dtype=_h), v=torch.randn(2, 1, 2, 32, dtype=_h))),
    ("batch cache small", ValueError, "pass cache_batch_idx", _inputs(
        k_cache=torch.randn(1, 64, 2, 32, dtype=_h), v_cache=torch.randn(1, 64, 2, 32, dtype=_h))),
    ("batch idx dtype", TypeError, "cache_batch_idx must have dtype torch.int32",
     _inputs(cache_batch_idx=torch.tensor([0, 1]))),
    ("batch idx shape", ValueError, "cache_batch_idx must have shape",
     _inputs(cache_batch_idx=torch.tensor([0], dtype=torch.int32))),
    ("batch idx range", ValueError, r"cache_batch_idx must be in 0..1",
     _inputs(cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32))),
    ("num_splits", ValueError, "num_splits must be an int in 0..128", _inputs(num_splits=-1)),
    ("num_splits big", ValueError, "num_splits", _inputs(num_splits=129)),
    ("scale", TypeError, "softmax_scale", _inputs(softmax_scale="0.1")),
    ("bt dtype", TypeError, "block_table must have dtype torch.int32",
     _paged(block_table=torch.tensor([[0, 1, 2], [3, 4, 5]]))),
    ("bt dims", ValueError, "block_table must be a 2-D", _paged(block_table=torch.arange(6, dtype=torch.int32))),
    ("bt type", TypeError, "block_table must be a 2-D", _paged(block_table=[[0, 1, 2], [3, 4, 5]])),
    ("bt batch", ValueError, "block_table must have shape",
     _paged(block_table=torch.tensor([[0, 1, 2]], dtype=torch.int32))),
    ("bt range", ValueError, "block_table entries used by the sequences must be in 0..5",
     _paged(block_table=torch.tensor([[0, 1, 2], [9, 4, 5]], dtype=torch.int32))),
    ("page size", ValueError, "multiple of 16", _paged(
        k_cache=torch.randn(6, 8, 2, 32, dtype=_h), v_cache=torch.randn(6, 8, 2, 32, dtype=_h))),
    ("paged overflow", ValueError, "the cache is too small.*3 pages of 16",
     _paged(cache_seqlens=torch.tensor([3, 48], dtype=torch.int32), k=torch.randn(2, 1, 2, 32, dtype=_h),
            v=torch.randn(2, 1, 2, 32, dtype=_h))),
    ("paged batch idx", ValueError, "cache_batch_idx is for a contiguous cache",
     _paged(cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32))),
]


@pytest.mark.parametrize("name,exc,match,kwargs", BAD, ids=[b[0] for b in BAD])
def test_bad_input(name, exc, match, kwargs, monkeypatch):
    monkeypatch.setattr(kvcache, "CHECK_VALUES", True)  # values of device tensors: host checks, ValueError
    kwargs = _on_device(kwargs)
    before = {n: t.clone() for n, t in kwargs.items() if n in ("k_cache", "v_cache")}
    with pytest.raises(exc, match=match):
        flash_attn_with_kvcache(**kwargs)
    for n, t in before.items():  # a rejected call leaves the cache alone
        assert torch.equal(kwargs[n], t)


@pytest.mark.parametrize("check_values", [False, True])
def test_bad_page_entries_unused_are_ignored(check_values, monkeypatch):
    """Entries past a sequence's pages are never read, so they need not be valid (e.g. -1 padding)."""
    monkeypatch.setattr(kvcache, "CHECK_VALUES", check_values)
    kw = _paged(block_table=torch.tensor([[0, -1, -1], [3, 4, 5]], dtype=torch.int32),
                cache_seqlens=torch.tensor([3, 40], dtype=torch.int32))
    with torch.no_grad():
        out = flash_attn_with_kvcache(**_on_device(kw))
    assert not out.isnan().any()


BAD_VALUES = [  # (name, which sequence is bad, kwargs): device values the kernels must catch without a sync
    ("seqlens negative", 1, _inputs(cache_seqlens=torch.tensor([5, -3], dtype=torch.int32))),
    ("seqlens past capacity", 0, _inputs(cache_seqlens=torch.tensor([65, 5], dtype=torch.int32))),
    ("append overflow", 1, _inputs(cache_seqlens=torch.tensor([5, 63], dtype=torch.int32),
                                   k=torch.randn(2, 2, 2, 32, dtype=_h), v=torch.randn(2, 2, 2, 32, dtype=_h))),
    ("batch idx range", 0, _inputs(cache_batch_idx=torch.tensor([7, 1], dtype=torch.int32),
                                   k=torch.randn(2, 1, 2, 32, dtype=_h), v=torch.randn(2, 1, 2, 32, dtype=_h))),
    ("page range", 1, _paged(block_table=torch.tensor([[0, 1, 2], [3, 99, 5]], dtype=torch.int32),
                             cache_seqlens=torch.tensor([20, 20], dtype=torch.int32),
                             k=torch.randn(2, 1, 2, 32, dtype=_h), v=torch.randn(2, 1, 2, 32, dtype=_h))),
    ("page negative", 0, _paged(block_table=torch.tensor([[-1, 1, 2], [3, 4, 5]], dtype=torch.int32),
                                cache_seqlens=torch.tensor([20, 20], dtype=torch.int32))),
]


@pytest.mark.parametrize("name,bad,kwargs", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
@pytest.mark.parametrize("num_splits", [1, 3, "stream"])
def test_bad_values_poison_only_their_sequence(name, bad, kwargs, num_splits, monkeypatch, stream_schedule):
    """Without host checks a bad value never reads or writes out of bounds: that sequence gets NaN (out and
    lse) and no append; the other sequence is what a call with only it gives (exactly, with the split grid;
    the stream schedule cuts the two calls' keys differently, so to rounding)."""
    monkeypatch.setattr(kvcache, "CHECK_VALUES", False)
    exact = num_splits != "stream"
    if not exact:
        stream_schedule(min_split_keys=16)  # programs of one key tile each: every unit is shared
        num_splits = 0
    kw = _on_device(kwargs)
    good = 1 - bad
    before = {n: kw[n].clone() for n in ("k_cache", "v_cache")}
    with torch.no_grad():
        out, lse = flash_attn_with_kvcache(**kw, num_splits=num_splits, return_softmax_lse=True)
    assert out[bad].isnan().all() and lse[bad].isnan().all()
    assert not out[good].isnan().any() and not lse[good].isnan().any()
    # the good sequence alone (with its own cache, appends included) gives the same result
    one = {n: (t[good:good + 1] if n in ("q", "k", "v", "cache_seqlens", "cache_batch_idx", "block_table")
               and isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    one["k_cache"], one["v_cache"] = before["k_cache"].clone(), before["v_cache"].clone()
    if "block_table" not in kw and "cache_batch_idx" not in kw:  # row `good` of the cache, as in the batch
        one["cache_batch_idx"] = torch.tensor([good], dtype=torch.int32, device=DEVICE)
    with torch.no_grad():
        out1, lse1 = flash_attn_with_kvcache(**one, num_splits=num_splits, return_softmax_lse=True)
    torch.testing.assert_close(out[good:good + 1], out1, rtol=0, atol=0 if exact else 2e-3)
    torch.testing.assert_close(lse[good:good + 1], lse1, rtol=0, atol=0 if exact else 1e-4)
    # the caches: exactly the good sequence's append, nothing from the bad one
    torch.testing.assert_close(kw["k_cache"], one["k_cache"], rtol=0, atol=0)
    torch.testing.assert_close(kw["v_cache"], one["v_cache"], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------
# values near the int32 limits, bad pages anywhere in a sequence, host checks under torch.compile
# ---------------------------------------------------------------------------------------------------------
GUARD = 1024  # sentinel elements before and after each guarded cache
GUARD_VALUE = -77.0


def _guarded(shape, dtype, device, gen):
    """A random tensor of `shape` that is a view into a larger buffer, with GUARD sentinel elements before and
    after it: (tensor, buffer). A write outside the tensor changes a guard (see `_guards_intact`)."""
    numel = math.prod(shape)
    buf = torch.full((GUARD + numel + GUARD,), GUARD_VALUE, dtype=dtype, device=device)
    t = buf[GUARD:GUARD + numel].view(shape)
    t.copy_(torch.randn(shape, generator=gen).to(device=device, dtype=dtype))
    return t, buf


def _guards_intact(buf) -> bool:
    return bool((buf[:GUARD] == GUARD_VALUE).all() and (buf[-GUARD:] == GUARD_VALUE).all())


def _good_alone(kw, good, before, num_splits):
    """(out, lse, k_cache, v_cache) of the call `kw` for the sequences `good` only, on copies of the caches
    `before` (the rows of a contiguous cache through cache_batch_idx, as in the whole batch)."""
    idx = torch.tensor(good, device=kw["q"].device)
    one = {n: (t[idx] if n in ("q", "k", "v", "cache_seqlens", "cache_batch_idx", "block_table") and
               isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    one["k_cache"], one["v_cache"] = before[0].clone(), before[1].clone()
    if one.get("block_table") is None and one.get("cache_batch_idx") is None:
        one["cache_batch_idx"] = idx.to(torch.int32)
    with torch.no_grad():
        out, lse = flash_attn_with_kvcache(**one, num_splits=num_splits, return_softmax_lse=True)
    return out, lse, one["k_cache"], one["v_cache"]


def _schedule(num_splits, stream_schedule):
    """(num_splits to pass, whether results are exact against a call with fewer sequences)."""
    if num_splits == "stream":
        stream_schedule(min_split_keys=16)  # programs of one key tile each: every unit is shared
        return 0, False
    return num_splits, True


NEAR_INT32_LIMITS = [2**31 - 1, 2**31 - 2, -1, -2**31]


@pytest.mark.parametrize("num_splits", [1, 3, "stream"])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("seqlen_new", [1, 2, 3])
def test_lengths_near_the_int32_limits_never_wrap(seqlen_new, paged, num_splits, device, monkeypatch,
                                                  stream_schedule):
    """cache_seqlens near 2**31 (where cache_seqlens + seqlen_new wraps in int32) and negative ones: those
    sequences get NaN (out and lse) and append nothing, nothing outside the caches is written (sentinel guards
    around them), and the other sequences are what a call with only them gives, appends included."""
    monkeypatch.setattr(kvcache, "CHECK_VALUES", False)
    num_splits, exact = _schedule(num_splits, stream_schedule)
    gen = torch.Generator().manual_seed(0)
    lens = [3, 2**31 - 1, 2**31 - 2, 30, -1, -2**31]
    good = [0, 3]
    batch, heads_kv, head_dim, capacity = len(lens), 1, 16, 48
    block_table = None
    if paged:
        page_size = 16
        pages = capacity // page_size
        shape = (batch * pages + 1, page_size, heads_kv, head_dim)
        block_table = torch.randperm(batch * pages, generator=gen).reshape(batch, pages).to(device, torch.int32)
    else:
        shape = (batch, capacity, heads_kv, head_dim)
    k_cache, k_buf = _guarded(shape, torch.float16, device, gen)
    v_cache, v_buf = _guarded(shape, torch.float16, device, gen)
    q, k, v = (torch.randn(*s, generator=gen).to(device, torch.float16)
               for s in ((batch, 1, 2, head_dim), (batch, seqlen_new, heads_kv, head_dim),
                         (batch, seqlen_new, heads_kv, head_dim)))
    kw = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, block_table=block_table, causal=True,
              cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=device))
    before = (k_cache.clone(), v_cache.clone())
    with torch.no_grad():
        out, lse = flash_attn_with_kvcache(**kw, num_splits=num_splits, return_softmax_lse=True)
    assert _guards_intact(k_buf) and _guards_intact(v_buf)
    bad = [b for b in range(batch) if b not in good]
    assert out[bad].isnan().all() and lse[bad].isnan().all()
    assert not out[good].isnan().any() and not lse[good].isnan().any()
    out1, lse1, k_cache1, v_cache1 = _good_alone(kw, good, before, num_splits)
    torch.testing.assert_close(out[good], out1, rtol=0, atol=0 if exact else 2e-3)
    torch.testing.assert_close(lse[good], lse1, rtol=0, atol=0 if exact else 1e-4)
    assert torch.equal(k_cache, k_cache1) and torch.equal(v_cache, v_cache1)  # the good appends, nothing else


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("seqlen_new", [1, 3])
@pytest.mark.parametrize("value", NEAR_INT32_LIMITS)
def test_check_values_rejects_lengths_near_the_int32_limits(value, seqlen_new, paged, device, monkeypatch):
    monkeypatch.setattr(kvcache, "CHECK_VALUES", True)
    new = dict(k=torch.randn(2, seqlen_new, 2, 32, dtype=_h), v=torch.randn(2, seqlen_new, 2, 32, dtype=_h))
    seqlens = torch.tensor([3, value], dtype=torch.int32)
    kw = _on_device((_paged if paged else _inputs)(cache_seqlens=seqlens, **new))
    before = (kw["k_cache"].clone(), kw["v_cache"].clone())
    with torch.no_grad(), pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(**kw)
    assert torch.equal(kw["k_cache"], before[0]) and torch.equal(kw["v_cache"], before[1])


@pytest.mark.parametrize("paged", [False, True])
def test_caches_of_2_31_keys_per_sequence_are_refused(paged, device):
    """Key positions are int32 in the kernels: a cache holding 2**31 keys per sequence (here expanded views,
    no memory) is refused on the host, with the capacity in the message."""
    q = torch.randn(1, 1, 1, 16, dtype=torch.float16, device=device)
    if paged:
        k_cache = torch.randn(1, 16, 1, 16, dtype=torch.float16, device=device)
        block_table = torch.zeros(1, 1, dtype=torch.int32, device=device).expand(1, 2**27)
    else:
        k_cache = torch.randn(1, 1, 1, 16, dtype=torch.float16, device=device).expand(1, 2**31, 1, 16)
        block_table = None
    with torch.no_grad(), pytest.raises(ValueError, match="2147483648 keys per sequence"):
        flash_attn_with_kvcache(q, k_cache, k_cache, cache_seqlens=5, block_table=block_table)


PAGED_BAD_PAGES = [  # (name, block_table, cache_seqlens, seqlen_new, seqlen_q, bad sequence or None)
    ("bad page before the new key", [[999, 1], [2, 3]], [20, 20], 1, 1, 0),
    ("negative page before the new key", [[-1, 1], [2, 3]], [20, 20], 1, 1, 0),
    ("most negative page", [[2, 3], [-2**31, 1]], [20, 20], 1, 1, 1),
    ("new keys on a good and a bad page", [[0, 999], [2, 3]], [15, 20], 2, 1, 0),
    ("bad pages past the used ones", [[0, 1, 999], [2, 3, -1]], [20, 15], 1, 1, None),
    # 70 query rows: two M tiles; the first one's rows see keys up to 90 only, the bad page holds key 96
    ("bad page only the last M tile sees", [[0, 1, 2, 3, 4, 5, 999], [6, 7, 8, 9, 10, 11, 12]], [27, 10], 70,
     70, 0),
    ("bad page only the last M tile sees, no append", [[0, 1, 2, 3, 4, 5, 999], [6, 7, 8, 9, 10, 11, 12]],
     [97, 80], 0, 70, 0),
]


@pytest.mark.parametrize("num_splits", [1, 3, "stream"])
@pytest.mark.parametrize("name,table,lens,seqlen_new,seqlen_q,bad", PAGED_BAD_PAGES,
                         ids=[c[0] for c in PAGED_BAD_PAGES])
def test_bad_page_anywhere_in_a_sequence_poisons_it_whole(name, table, lens, seqlen_new, seqlen_q, bad, num_splits,
                                                           device, monkeypatch, stream_schedule):
    """A sequence one of whose used pages (those holding its keys, the new ones included) is not a page of the
    cache appends nothing at all, and all of its output rows and lse are NaN; pages past the used ones do not
    matter. The whole cache is compared: only the good sequences' new slots change."""
    monkeypatch.setattr(kvcache, "CHECK_VALUES", False)
    num_splits, exact = _schedule(num_splits, stream_schedule)
    gen = torch.Generator().manual_seed(0)
    page_size, num_pages, heads_kv, head_dim = 16, 13, 1, 16
    k_cache, v_cache = (torch.randn(num_pages, page_size, heads_kv, head_dim, generator=gen).to(device, _h)
                        for _ in range(2))
    q = torch.randn(2, seqlen_q, heads_kv, head_dim, generator=gen).to(device, _h)
    k, v = (torch.randn(2, seqlen_new, heads_kv, head_dim, generator=gen).to(device, _h) if seqlen_new else None
            for _ in range(2))
    block_table = torch.tensor(table, dtype=torch.int32, device=device)
    cache_seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    kw = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=cache_seqlens,
              block_table=block_table, causal=True)
    good = [b for b in range(2) if b != bad]
    before = (k_cache.clone(), v_cache.clone())
    expected = [_expected_cache(c, None if new is None else new[good], lens_good, block_table[good], None)
                for c, new, lens_good in zip(before, (k, v), ([lens[b] for b in good],) * 2)]
    with torch.no_grad():
        out, lse = flash_attn_with_kvcache(**kw, num_splits=num_splits, return_softmax_lse=True)
    assert torch.equal(k_cache, expected[0]) and torch.equal(v_cache, expected[1])
    if bad is not None:
        assert out[bad].isnan().all() and lse[bad].isnan().all()
    assert not out[good].isnan().any() and not lse[good].isnan().any()
    out1, lse1, _, _ = _good_alone(kw, good, before, num_splits)
    torch.testing.assert_close(out[good], out1, rtol=0, atol=0 if exact else 2e-3)
    torch.testing.assert_close(lse[good], lse1, rtol=0, atol=0 if exact else 1e-4)


def _compiled_step(backend):
    def step(q, k_cache, v_cache, k, v, cache_seqlens, block_table):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                       block_table=block_table, causal=True)

    torch._dynamo.reset()
    return step, torch.compile(step, backend=backend, fullgraph=True)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_check_values_under_torch_compile(backend, device, monkeypatch):
    """CHECK_VALUES means the same compiled as eager: the op checks the values when it runs, so a compiled
    call with a bad cache_seqlens or block_table raises the eager call's ValueError and leaves the cache alone
    (also after a good call of the same graph), and a good call gives eager's result."""
    monkeypatch.setattr(kvcache, "CHECK_VALUES", True)
    step, compiled = _compiled_step(backend)
    new = dict(k=torch.randn(2, 2, 2, 32, dtype=_h), v=torch.randn(2, 2, 2, 32, dtype=_h))
    cases = [  # (kwargs, error)
        (_inputs(**new), None),
        (_inputs(cache_seqlens=torch.tensor([3, 63], dtype=torch.int32), **new), r"cache_seqlens \(max 63\)"),
        (_inputs(cache_seqlens=torch.tensor([-2**31, 3], dtype=torch.int32), **new), "cache_seqlens must be >= 0"),
        (_inputs(cache_seqlens=torch.tensor([2**31 - 1, 3], dtype=torch.int32), **new), "cache is too small"),
        (_paged(**new), None),
        (_paged(block_table=torch.tensor([[0, 1, 2], [9, 4, 5]], dtype=torch.int32), **new), "block_table entries"),
    ]
    for kwargs, error in cases:
        kw = _on_device(kwargs)
        args = [kw[n] for n in ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens")] + [kw.get("block_table")]
        before = [a.clone() for a in args[1:3]]
        with torch.no_grad():
            if error is None:
                expected = step(*(a.clone() if a is not None else a for a in args))
                torch.testing.assert_close(compiled(*args), expected, rtol=0, atol=0)
                continue
            with pytest.raises(ValueError, match=error):
                step(*args)
            with pytest.raises(ValueError, match=error):
                compiled(*args)
        assert torch.equal(args[1], before[0]) and torch.equal(args[2], before[1])


def test_check_values_runs_at_every_call_of_a_remembered_signature(device, monkeypatch):
    """Shape checks are remembered per call signature; the values of the tensors are checked at every call."""
    monkeypatch.setattr(kvcache, "CHECK_VALUES", True)
    new = dict(k=torch.randn(2, 1, 2, 32, dtype=_h), v=torch.randn(2, 1, 2, 32, dtype=_h))
    kw = _on_device(_inputs(**new))
    with torch.no_grad():
        for _ in range(2):
            flash_attn_with_kvcache(**kw)
        kw["cache_seqlens"] = torch.tensor([3, 64], dtype=torch.int32, device=device)
        with pytest.raises(ValueError, match="cache is too small"):
            flash_attn_with_kvcache(**kw)


FLASH_ATTN_PARAMETERS = [  # flash-attn 2.8's flash_attn_with_kvcache, in order, with its defaults
    ("q", inspect.Parameter.empty), ("k_cache", inspect.Parameter.empty), ("v_cache", inspect.Parameter.empty),
    ("k", None), ("v", None), ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None),
    ("cache_batch_idx", None), ("cache_leftpad", None), ("block_table", None), ("softmax_scale", None),
    ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0), ("rotary_interleaved", True),
    ("alibi_slopes", None), ("num_splits", 0), ("return_softmax_lse", False),
]


def test_signature_is_flash_attns():
    """flash-attn 2.x's parameters in its order, then FlashAttention-4's learnable_sink, keyword-only."""
    params = inspect.signature(flash_attn_with_kvcache).parameters
    assert [(n, p.default) for n, p in params.items()] == FLASH_ATTN_PARAMETERS + [("learnable_sink", None)]
    assert params["learnable_sink"].kind is inspect.Parameter.KEYWORD_ONLY
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for n, p in params.items() if n != "learnable_sink")


def test_positional_arguments_bind_like_flash_attn(device):
    """flash-attn's positional order: (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, ...)."""
    kw = _on_device(_inputs(k=torch.randn(2, 1, 2, 32, dtype=_h), v=torch.randn(2, 1, 2, 32, dtype=_h)))
    q, k, v, lens = kw["q"], kw["k"], kw["v"], kw["cache_seqlens"]
    caches = [(kw["k_cache"].clone(), kw["v_cache"].clone()) for _ in range(3)]
    with torch.no_grad():
        expected, expected_lse = flash_attn_with_kvcache(q, *caches[0], k=k, v=v, cache_seqlens=lens,
                                                         softmax_scale=0.3, causal=True, num_splits=2,
                                                         return_softmax_lse=True)
        short = flash_attn_with_kvcache(q, *caches[1], k, v, None, None, lens, None, None, None, 0.3, True,
                                        (-1, -1), 0.0, False, None, 2, True)
        default = flash_attn_with_kvcache(q, *caches[2], k, v, None, None, lens)
    assert torch.equal(short[0], expected) and torch.equal(short[1], expected_lse)
    for kc, vc in caches[1:]:
        assert torch.equal(kc, caches[0][0]) and torch.equal(vc, caches[0][1])
    kc, vc = kw["k_cache"].clone(), kw["v_cache"].clone()
    with torch.no_grad():
        assert torch.equal(default, flash_attn_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=lens))


# ---------------------------------------------------------------------------------------------------------
# large shapes (GPU only)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_large_decode(page_size, dtype, monkeypatch):
    """8 x 32k keys, ragged lengths, appends, causal: auto (the stream schedule here), the split grid and the
    stream schedule forced, no split and 5 splits."""
    batch, heads_q, heads_kv, head_dim, capacity = 8, 32, 8, 128, 32768
    device = "cuda"
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, 1, heads_q, head_dim, device=device, dtype=dtype, generator=gen)
    if page_size:
        pages = capacity // page_size
        block_table = torch.randperm(batch * pages, device=device, generator=gen).reshape(batch, pages).int()
        k_cache = torch.randn(batch * pages, page_size, heads_kv, head_dim, device=device, dtype=dtype, generator=gen)
    else:
        block_table = None
        k_cache = torch.randn(batch, capacity, heads_kv, head_dim, device=device, dtype=dtype, generator=gen)
    v_cache = torch.randn_like(k_cache)
    k = torch.randn(batch, 1, heads_kv, head_dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn_like(k)
    seqlens = torch.tensor([0, 1, 1000, 4097, 20000, 32000, 32766, 32767], dtype=torch.int32, device=device)
    for schedule, num_splits in (("auto", 0), ("split", 0), ("stream", 0), ("auto", 1), ("auto", 5)):
        monkeypatch.setattr(dispatch, "CHOICE", dispatch.Choice(decode=schedule))
        kc, vc = k_cache.clone(), v_cache.clone()
        with torch.no_grad():
            out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=block_table,
                                               causal=True, num_splits=num_splits, return_softmax_lse=True)
        keys = kc[block_table.long()].flatten(1, 2) if page_size else kc
        values = vc[block_table.long()].flatten(1, 2) if page_size else vc
        for b in range(batch):
            n = int(seqlens[b]) + 1
            args = (q[b:b + 1], keys[b:b + 1, :n], values[b:b + 1, :n], None, True)
            ref, ref_lse = attention_reference(*args, dtype=torch.float64, return_lse=True)
            same = attention_reference(*args, dtype=dtype)
            err = (out[b:b + 1].double() - ref).abs().max().item()
            torch_err = (same.double() - ref).abs().max().item()
            assert err <= 2 * torch_err + FLOOR[dtype], (schedule, num_splits, b, err, torch_err)
            assert (lse[b:b + 1].double() - ref_lse).abs().max().item() < 1e-3


def test_appending_into_an_expanded_or_shared_cache_is_refused():
    """Writes into overlapping memory would put several sequences' keys in one place: refuse them."""
    q = torch.randn(2, 1, 4, 16, dtype=torch.float16, device=DEVICE)
    k_new = torch.randn(2, 1, 2, 16, dtype=torch.float16, device=DEVICE)
    expanded = torch.randn(1, 64, 2, 16, dtype=torch.float16, device=DEVICE).expand(2, 64, 2, 16)
    own = torch.randn(2, 64, 2, 16, dtype=torch.float16, device=DEVICE)
    with torch.no_grad():
        with pytest.raises(ValueError, match="k_cache overlaps itself"):
            flash_attn_with_kvcache(q, expanded, own.clone(), k_new, k_new.clone(), cache_seqlens=5)
        with pytest.raises(ValueError, match="same memory"):
            flash_attn_with_kvcache(q, own, own, k_new, k_new.clone(), cache_seqlens=5)
        out = flash_attn_with_kvcache(q, expanded, expanded, cache_seqlens=5)  # reading only: fine
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------------------------------------------------
# host-time shortcuts: no lse unless asked, ticket counters kept between calls, CUDA graphs
# ---------------------------------------------------------------------------------------------------------
def _decode_inputs(batch=3, heads_q=8, heads_kv=2, head_dim=64, capacity=300, dtype=torch.float16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 1, heads_q, head_dim, generator=gen).to(DEVICE, dtype)
    k_cache, v_cache = (torch.randn(batch, capacity, heads_kv, head_dim, generator=gen).to(DEVICE, dtype)
                        for _ in range(2))
    seqlens = torch.tensor([capacity, 7, capacity // 2][:batch], dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, seqlens


@pytest.mark.parametrize("num_splits", [1, 4])
def test_output_without_lse_equals_output_with_it(num_splits):
    """return_softmax_lse=False skips the lse tensor (and its stores): the output must not change."""
    q, k_cache, v_cache, seqlens = _decode_inputs()
    with torch.no_grad():
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=num_splits,
                                           return_softmax_lse=True)
        only = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=num_splits)
    assert isinstance(only, torch.Tensor) and torch.equal(only, out)
    assert torch.isfinite(lse).all()


def test_repeated_split_calls_reuse_zeroed_ticket_counters():
    """Split-KV launches count finished splits in counters that each launch leaves at zero (no memset per
    call on the GPU): many calls in a row, with different split counts and batch sizes, all stay correct."""
    from flashtriton.kernels import decode_launch

    q, k_cache, v_cache, seqlens = _decode_inputs()
    with torch.no_grad():
        expected = {s: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=s)
                    for s in (1, 2, 5)}
        for step in range(6 if DEVICE == "cuda" else 2):  # (off a GPU no counters are kept between calls)
            splits = (2, 5)[step % 2]
            got = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=splits)
            torch.testing.assert_close(got, expected[1], atol=2e-3, rtol=0)
            assert torch.equal(got, expected[splits])
            one = flash_attn_with_kvcache(q[:1], k_cache, v_cache, cache_seqlens=seqlens[:1], num_splits=splits)
            assert torch.equal(one, expected[splits][:1])
    for (kind, *_), buf in decode_launch._STREAM_BUFFERS.items():  # on the GPU: kept counters are all back at zero
        if kind == "tickets":
            assert int(buf.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("schedule,num_splits", [("split", 8), ("stream", 0)])
def test_decode_in_a_cuda_graph(schedule, num_splits, monkeypatch):
    """Capture decode steps (append + split-KV attention) in a CUDA graph and replay them: the captured
    launch gets its own counters (zeroed inside the graph), and replays match eager calls; under both
    schedules (the stream schedule reads the cache lengths on the GPU, so a replay needs no host value)."""
    monkeypatch.setattr(dispatch, "CHOICE", dispatch.Choice(decode=schedule))
    q, k_cache, v_cache, seqlens = _decode_inputs(batch=4, heads_q=32, heads_kv=8, head_dim=128, capacity=8192)
    seqlens = torch.tensor([8000, 1, 4096, 7000], dtype=torch.int32, device="cuda")
    k_new = torch.randn(4, 1, 8, 128, device="cuda", dtype=torch.float16)
    v_new = torch.randn_like(k_new)
    kc, vc = k_cache.clone(), v_cache.clone()
    stream = torch.cuda.Stream()
    with torch.no_grad(), torch.cuda.stream(stream):
        flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, num_splits=num_splits)  # compile
        torch.cuda.synchronize()
        kc.copy_(k_cache), vc.copy_(v_cache)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, num_splits=num_splits)
        kc.copy_(k_cache), vc.copy_(v_cache)
        graph.replay()
        torch.cuda.synchronize()
        replayed = captured.clone()
        kc2, vc2 = k_cache.clone(), v_cache.clone()
        eager = flash_attn_with_kvcache(q, kc2, vc2, k_new, v_new, cache_seqlens=seqlens, num_splits=num_splits)
        torch.cuda.synchronize()
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert torch.equal(replayed, eager)
    graph.replay()  # again: the graph's counters were left at zero by the first replay
    torch.cuda.synchronize()
    # The second replay writes the same new keys at the same places: the same result.
    assert torch.equal(captured, eager)


def test_checks_still_run_after_a_call_of_the_same_shape_passed():
    """Calls whose signature passed once skip the checks: anything that changes a check's outcome (an int
    cache length, grad mode, a shared k/v cache, a dtype, an option) must still raise."""
    q, k_cache, v_cache, seqlens = _decode_inputs()
    k_new = torch.randn(3, 1, 2, 64, dtype=torch.float16, device=DEVICE)
    with torch.no_grad():
        for _ in range(2):  # the second call takes the remembered signature
            flash_attn_with_kvcache(q, k_cache, v_cache, k_new, k_new.clone(), cache_seqlens=5)
        with pytest.raises(ValueError, match="cache is too small"):
            flash_attn_with_kvcache(q, k_cache, v_cache, k_new, k_new.clone(), cache_seqlens=300)
        with pytest.raises(ValueError, match="same memory"):
            flash_attn_with_kvcache(q, k_cache, k_cache, k_new, k_new.clone(), cache_seqlens=5)
        with pytest.raises(TypeError, match="share one dtype"):
            flash_attn_with_kvcache(q.float(), k_cache, v_cache, k_new, k_new.clone(), cache_seqlens=5)
        with pytest.raises(ValueError, match="window_size"):
            flash_attn_with_kvcache(q, k_cache, v_cache, k_new, k_new.clone(), cache_seqlens=5, window_size=(8, -3))
        with pytest.raises(ValueError, match="num_splits"):
            flash_attn_with_kvcache(q, k_cache, v_cache, k_new, k_new.clone(), cache_seqlens=5, num_splits=500)
    with pytest.raises(NotImplementedError, match="inference-only"):
        flash_attn_with_kvcache(q.requires_grad_(), k_cache, v_cache, k_new, k_new.clone(), cache_seqlens=5)


def test_unaligned_pointers_after_aligned_ones():
    """A launch plan's compiled kernel is relaunched directly only for 16-byte aligned pointers (as it was
    compiled): the same shapes with an unaligned q or cache must take the full launch path and stay right."""
    q, k_cache, v_cache, seqlens = _decode_inputs(batch=2, heads_q=4, heads_kv=2, head_dim=64, capacity=200)

    def shifted(t):  # same values and strides, data pointer 2 bytes past a 16-byte boundary
        flat = torch.empty(t.numel() + 8, dtype=t.dtype, device=t.device)
        view = flat[1:1 + t.numel()].view(t.shape)
        view.copy_(t)
        return view

    with torch.no_grad():
        for _ in range(2):
            expected = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=3)
        assert torch.equal(flash_attn_with_kvcache(shifted(q), k_cache, v_cache, cache_seqlens=seqlens,
                                                   num_splits=3), expected)
        assert torch.equal(flash_attn_with_kvcache(q, shifted(k_cache), shifted(v_cache), cache_seqlens=seqlens,
                                                   num_splits=3), expected)
        assert torch.equal(flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=3),
                           expected)


# ---------------------------------------------------------------------------------------------------------
# the plan of a call signature (kvcache_plan): kept, keyed on everything it depends on
# ---------------------------------------------------------------------------------------------------------
def _small_step(dtype=torch.float16, seed=0):
    """One decode step's arguments, small enough for the interpreter: batch 2, 4 / 2 heads, D=16, 48 keys."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    return dict(q=randn(2, 1, 4, 16), k_cache=randn(2, 48, 2, 16), v_cache=randn(2, 48, 2, 16),
                k=randn(2, 1, 2, 16), v=randn(2, 1, 2, 16),
                cache_seqlens=torch.tensor([30, 11], dtype=torch.int32, device=DEVICE))


def _step_reference(kw, expected_caches, causal=False, softmax_scale=None, window_size=(-1, -1)):
    """float64 attention of each sequence over its cache after the append (the expected caches)."""
    k_exp, v_exp = expected_caches
    variant = Variant.of(causal, True, window_size)
    outs = []
    for b in range(kw["q"].shape[0]):
        n = int(kw["cache_seqlens"][b]) + 1
        outs.append(attention_reference(kw["q"][b:b + 1], k_exp[b:b + 1, :n], v_exp[b:b + 1, :n], softmax_scale,
                                        causal, bottom_right=True, dtype=torch.float64, variant=variant))
    return torch.cat(outs)


def test_a_repeated_call_takes_its_plan_and_any_other_signature_gets_its_own(monkeypatch):
    """A call's checks and launch plans are worked out once per signature (`kvcache_plan.call_key`): a repeated
    call runs no check and gives the same result; a call that differs in one keyed property (a stride, a
    dtype, an option, the grad mode, the switch of the decode schedule) gets a plan of its own, right for it."""
    kvcache_plan.clear()
    checks = []
    real_check = kvcache.check_call
    monkeypatch.setattr(kvcache, "check_call", lambda *a, **kw: checks.append(1) or real_check(*a, **kw))
    base = _small_step()
    expected_caches = (_expected_cache(base["k_cache"], base["k"], base["cache_seqlens"], None, None),
                       _expected_cache(base["v_cache"], base["v"], base["cache_seqlens"], None, None))

    def step(expect_check, reference_kw=None, **changes):
        kw = {**base, "k_cache": base["k_cache"].clone(), "v_cache": base["v_cache"].clone(), **changes}
        before = len(checks)
        with torch.no_grad():
            out = flash_attn_with_kvcache(**kw)
        assert len(checks) - before == int(expect_check), ("a stale plan ran" if expect_check
                                                           else "the plan was not kept")
        ref = _step_reference(kw, expected_caches, **(reference_kw or {}))
        torch.testing.assert_close(out.double(), ref, atol=2 * FLOOR[kw["q"].dtype], rtol=0)
        assert torch.equal(kw["k_cache"].double(), expected_caches[0].double())
        return out

    first = step(True)
    assert torch.equal(step(False), first)  # the kept plan: no check, the same launches, the same result
    assert len(kvcache_plan.PLANS) == 1
    # One keyed property at a time: each gets its own plan (one check), the right answer, and is kept too.
    q_strided = torch.cat([base["q"], base["q"]], 2)[:, :, :4]  # q's strides (128, 128, 16, 1): same values
    wide = torch.zeros(2, 64, 2, 16, dtype=torch.float16, device=DEVICE)  # a cache with another batch stride
    for changes, reference_kw in [
        (dict(q=q_strided), None),
        (dict(q=base["q"].float(), k_cache=base["k_cache"].float(), v_cache=base["v_cache"].float(),
              k=base["k"].float(), v=base["v"].float()), None),  # dtypes
        (dict(causal=True), dict(causal=True)),  # options
        (dict(softmax_scale=0.5), dict(softmax_scale=0.5)),
        (dict(softmax_scale=-0.5), dict(softmax_scale=-0.5)),  # the sign of the scale (q negated)
        (dict(window_size=(4, 0)), dict(window_size=(4, 0))),
        (dict(num_splits=3), None),
        (dict(cache_seqlens=torch.tensor([30, 0, 11, 0], dtype=torch.int32, device=DEVICE)[::2]), None),  # stride 2
    ]:
        got = step(True, reference_kw, **changes)
        assert torch.equal(step(False, reference_kw, **changes), got)
    k_wide, v_wide = wide.clone(), wide.clone()
    k_wide[:, :48], v_wide[:, :48] = base["k_cache"], base["v_cache"]
    kw = {**base, "k_cache": k_wide[:, :48], "v_cache": v_wide[:, :48]}  # strides (64 · 32, ...), not (48 · 32, ...)
    before = len(checks)
    with torch.no_grad():
        torch.testing.assert_close(flash_attn_with_kvcache(**kw), first, atol=2 * FLOOR[torch.float16], rtol=0)
    assert len(checks) == before + 1 and torch.equal(k_wide[:, :48], expected_caches[0])
    with dispatch.force(decode="stream"), torch.no_grad():  # a switch: the plans are kept per switch state
        kw = {**base, "k_cache": base["k_cache"].clone(), "v_cache": base["v_cache"].clone()}
        torch.testing.assert_close(flash_attn_with_kvcache(**kw), first, atol=2 * FLOOR[torch.float16], rtol=0)
    assert len(checks) == before + 2
    with pytest.raises(NotImplementedError, match="inference-only"):  # the grad mode and requires_grad
        flash_attn_with_kvcache(**{**base, "q": base["q"].clone().requires_grad_()})


def test_a_kept_plan_still_checks_the_values_and_keeps_no_stale_lengths(monkeypatch):
    """What a plan keeps depends on the signature only: the values of a tensor cache_seqlens are read at every
    call (by the kernels, or on the host with CHECK_VALUES, which `kvcache.CHECK_VALUES` sets as
    `paging.CHECK_VALUES`: one switch), and an int cache_seqlens is part of the key."""
    kvcache_plan.clear()
    monkeypatch.setattr(kvcache, "CHECK_VALUES", True)
    assert paging.CHECK_VALUES is True
    base = _small_step()
    with torch.no_grad():
        for _ in range(2):
            flash_attn_with_kvcache(**{**base, "k_cache": base["k_cache"].clone(), "v_cache": base["v_cache"].clone()})
        with pytest.raises(ValueError, match="cache is too small"):
            too_long = torch.tensor([47, 48], dtype=torch.int32, device=DEVICE)
            flash_attn_with_kvcache(**{**base, "cache_seqlens": too_long})
        ints = {}
        for length in (11, 30, 11):  # an int length: a plan per value, each with its own kept lengths tensor
            kw = {**base, "k": None, "v": None, "cache_seqlens": length}
            ints.setdefault(length, flash_attn_with_kvcache(**kw))
            assert torch.equal(flash_attn_with_kvcache(**kw), ints[length])
            ref = attention_reference(base["q"], base["k_cache"][:, :length], base["v_cache"][:, :length], None,
                                      False, dtype=torch.float64)
            torch.testing.assert_close(ints[length].double(), ref, atol=2 * FLOOR[torch.float16], rtol=0)
    monkeypatch.setattr(kvcache, "CHECK_VALUES", False)
    assert paging.CHECK_VALUES is False


def test_decode_plans_key_the_rotary_tables_length():
    """The kept compiled kernel is specialized on ROTARY_MAX_CACHED (an int argument): the launch plans hold it, so
    tables of another length get another plan, never a relaunch of a kernel specialized on the old value."""
    q, k_cache, v_cache, _ = _decode_inputs(batch=1, heads_q=2, heads_kv=1, head_dim=32, capacity=64)
    plans = []
    for rows in (66, 67):  # one position needed per sequence: tables serving cache lengths up to 65, then 66
        cos = torch.zeros(rows, 8, dtype=torch.float16, device=DEVICE)
        rot = decode_launch.Rotary(cos, cos, True, False, rows - 1)
        plans.append((decode_launch.decode_plan(q, k_cache, v_cache, None, None, 64, False, 1, rotary=rot),
                      decode_launch.append_plan(q[:, :, :1], q[:, :, :1], k_cache, v_cache, rotary=rot)))
    (d0, a0), (d1, a1) = plans
    assert d0 is not d1 and a0 is not a1
    assert (d0.rotary_max_cached, d1.rotary_max_cached) == (65, 66) == (a0.rotary_max_cached, a1.rotary_max_cached)
