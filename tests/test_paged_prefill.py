"""Paged prefill: flash_attn_varlen_func with block_table (k, v page pools) and seqused_k, forward only.

Each sequence's pages are gathered into dense K/V and the result judged against the float64 reference (error
<= 2 x torch's own in the dtype + floor, tests/accuracy.py) and against the packed call on the gathered K/V, which
the portable kernel computes with the same tiles: equal bit for bit under the interpreter."""

import dataclasses

import pytest
import torch

import flashtriton
from flashtriton import paging
from flashtriton.kernels import dispatch
from flashtriton.kernels.variant import Variant
from flashtriton.reference import attention_reference

from accuracy import assert_close_to_exact, torch_attention

NAN_FILL = float("nan")


@dataclasses.dataclass
class Paged:
    """A packed query batch over a page pool: the call's tensors and each sequence's dense K/V."""
    q: torch.Tensor
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    block_table: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    lengths_q: list
    lengths_k: list
    dense_k: list  # (lengths_k[b], Hkv, D) per sequence
    dense_v: list


def make_paged(lengths_q, lengths_k, page_size, heads_q, heads_kv, head_dim, dtype, device, seed=0, head_dim_v=None,
               spare_columns=1):
    """Random queries and a pool whose pages are handed to the sequences in a random order; every pool row that
    holds no key, and every block-table entry past a sequence's pages, is poison (NaN rows, entries out of the
    pool), so that a read of either shows."""
    gen = torch.Generator().manual_seed(seed)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    pages = [-(-n // page_size) for n in lengths_k]
    num_pages = sum(pages) + 2  # two pages no sequence uses
    columns = max(pages, default=0) + spare_columns
    order = torch.randperm(num_pages, generator=gen).tolist()
    k_pool = torch.full((num_pages, page_size, heads_kv, head_dim), NAN_FILL, dtype=dtype)
    v_pool = torch.full((num_pages, page_size, heads_kv, head_dim_v), NAN_FILL, dtype=dtype)
    block_table = torch.full((len(lengths_k), columns), num_pages + 7, dtype=torch.int32)
    dense_k, dense_v = [], []
    for b, n in enumerate(lengths_k):
        kb = torch.randn(n, heads_kv, head_dim, generator=gen).to(dtype)
        vb = torch.randn(n, heads_kv, head_dim_v, generator=gen).to(dtype)
        for j in range(pages[b]):
            page = order.pop()
            block_table[b, j] = page
            rows = slice(j * page_size, min((j + 1) * page_size, n))
            k_pool[page, : rows.stop - rows.start] = kb[rows]
            v_pool[page, : rows.stop - rows.start] = vb[rows]
        dense_k.append(kb.to(device))
        dense_v.append(vb.to(device))
    q = torch.randn(sum(lengths_q), heads_q, head_dim, generator=gen).to(device, dtype)
    cu_q = torch.tensor([0] + torch.tensor(lengths_q).cumsum(0).tolist(), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + torch.tensor(lengths_k).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return Paged(q, k_pool.to(device), v_pool.to(device), block_table.to(device), cu_q, cu_k, list(lengths_q),
                 list(lengths_k), dense_k, dense_v)


def paged_call(p: Paged, **kwargs):
    out, lse, _ = flashtriton.flash_attn_varlen_func(p.q, p.k_pool, p.v_pool, p.cu_q, p.cu_k, max(p.lengths_q),
                                                     max(p.lengths_k), block_table=p.block_table,
                                                     return_attn_probs=True, **kwargs)
    return out, lse


def packed_call(p: Paged, lengths_k, dense_k, dense_v, **kwargs):
    """The same call on the gathered K/V, packed (the portable kernel, as the paged call runs)."""
    heads_kv, head_dim, head_dim_v = p.k_pool.shape[2], p.k_pool.shape[3], p.v_pool.shape[3]
    k = torch.cat([t for t in dense_k] or [p.q.new_empty(0, heads_kv, head_dim)])
    v = torch.cat([t for t in dense_v] or [p.q.new_empty(0, heads_kv, head_dim_v)])
    cu_k = torch.tensor([0] + torch.tensor(lengths_k).cumsum(0).tolist(), dtype=torch.int32, device=p.q.device)
    with dispatch.force("portable"):
        out, lse, _ = flashtriton.flash_attn_varlen_func(p.q, k, v, p.cu_q, cu_k, max(p.lengths_q),
                                                         max(p.lengths_k), return_attn_probs=True, **kwargs)
    return out, lse


def check_against_reference(p: Paged, out, lse, variant: Variant, lengths_k=None, sinks=None, alibi=None):
    """Each sequence against float64 attention on its gathered keys (the first lengths_k[b] of them)."""
    lengths_k = p.lengths_k if lengths_k is None else lengths_k
    dtype = p.q.dtype
    for b, (lq, lk) in enumerate(zip(p.lengths_q, lengths_k)):
        if lq == 0:
            continue
        sq = slice(int(p.cu_q[b]), int(p.cu_q[b + 1]))
        qb, kb, vb = p.q[None, sq], p.dense_k[b][None, :lk], p.dense_v[b][None, :lk]
        var = variant
        if alibi is not None:
            var = dataclasses.replace(var, alibi_slopes=alibi[b] if alibi.dim() == 2 else alibi)
        if sinks is not None:
            var = dataclasses.replace(var, sinks=sinks)
        exact, exact_lse = attention_reference(qb, kb, vb, variant=var, return_lse=True)
        if var.fields() <= {"causal"}:
            same = torch_attention(qb, kb, vb, causal=var.causal)
        else:
            same = attention_reference(qb, kb, vb, variant=var, dtype=dtype)  # torch ops in the dtype
        if lk == 0 and sinks is None:
            assert torch.all(out[sq] == 0) and torch.all(lse[:, sq] == float("-inf")), f"seq {b}: no keys"
            continue
        assert_close_to_exact(out[None, sq], same, exact, dtype, f"seq {b}")
        seen = torch.isfinite(exact_lse[0])
        assert torch.equal(torch.isfinite(lse[:, sq]), seen), f"seq {b}: lse"
        torch.testing.assert_close(lse[:, sq][seen].double(), exact_lse[0][seen], atol=2e-3, rtol=2e-3)


def assert_same(got, expected, device):
    """Bit for bit under the interpreter; on a GPU the two are compiled apart (and max_seqlen may pick other
    tiles): two ulps of the output's dtype."""
    for g, e in zip(got, expected):
        if device == "cpu":
            assert torch.equal(torch.nan_to_num(g, 7.0), torch.nan_to_num(e, 7.0))
        else:
            tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}[g.dtype]
            torch.testing.assert_close(g, e, atol=tol, rtol=tol, equal_nan=True)


# Ragged prefill: a sequence with no new queries, one with no cached keys (and queries: causal rows see nothing),
# a chunk after a long prefix, a single token. Page sizes: 64 (a multiple of the interpreter's BLOCK_N = 32: one
# block-table entry per tile), 16 and 5 (each key row's page looked up).
CASES = [  # (lengths_q, lengths_k, page_size, heads_q, heads_kv, head_dim, dtype, causal)
    ([7, 0, 4, 33, 1], [7, 9, 0, 90, 40], 16, 4, 2, 32, torch.float16, True),
    ([7, 0, 4, 33, 1], [7, 9, 0, 90, 40], 64, 4, 4, 32, torch.float16, False),
    ([5, 20, 3], [45, 20, 70], 5, 6, 2, 40, torch.bfloat16, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"page{c[2]}-{c[6]}-{'causal' if c[7] else 'full'}")
def test_paged_prefill_matches_reference(case, device):
    lengths_q, lengths_k, page_size, hq, hkv, d, dtype, causal = case
    p = make_paged(lengths_q, lengths_k, page_size, hq, hkv, d, dtype, device)
    out, lse = paged_call(p, causal=causal)
    assert out.shape == p.q.shape and lse.shape == (hq, p.q.shape[0])
    check_against_reference(p, out, lse, Variant(causal=causal))
    assert_same((out, lse), packed_call(p, lengths_k, p.dense_k, p.dense_v, causal=causal), device)


def test_variants_with_pages(device):
    """A window, softcap, ALiBi (per sequence) and sinks together, GQA, return_lse, V with a head dim of its own;
    then dropout too."""
    lengths_q, lengths_k = [6, 0, 21, 2], [30, 4, 21, 64]
    p = make_paged(lengths_q, lengths_k, 16, 4, 2, 32, torch.float16, device, seed=1, head_dim_v=16)
    gen = torch.Generator().manual_seed(5)
    alibi = (torch.rand(4, 4, generator=gen) * 0.3).to(device)
    sinks = torch.randn(4, generator=gen).to(device)
    kwargs = dict(causal=True, window_size=(9, 0), softcap=8.0, alibi_slopes=alibi, learnable_sink=sinks)
    out, lse = paged_call(p, **kwargs)
    check_against_reference(p, out, lse, Variant(causal=True, window=(9, 0), softcap=8.0), sinks=sinks, alibi=alibi)
    assert_same((out, lse), packed_call(p, lengths_k, p.dense_k, p.dense_v, **kwargs), device)
    # dropout: the same seed, the same mask as the packed call's (keyed by key position, row, sequence and head)
    torch.manual_seed(11)
    dropped = paged_call(p, dropout_p=0.3, **kwargs)
    torch.manual_seed(11)
    assert_same(dropped, packed_call(p, lengths_k, p.dense_k, p.dense_v, dropout_p=0.3, **kwargs), device)
    assert not torch.equal(dropped[0], out)


def test_seqused_k_counts_the_keys(device):
    """seqused_k replaces cu_seqlens_k's count, with pages (up to the row's capacity, past cu_seqlens_k's count)
    and without them (up to cu_seqlens_k's count); causal aligns to it."""
    lengths_q, lengths_k = [3, 9, 0, 5], [40, 17, 8, 30]
    used = [37, 0, 8, 30]
    p = make_paged(lengths_q, lengths_k, 16, 4, 2, 32, torch.float16, device, seed=2)
    seqused = torch.tensor(used, dtype=torch.int32, device=device)
    stale = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32, device=device)  # cu_seqlens_k's counts do not matter
    out, lse, _ = flashtriton.flash_attn_varlen_func(p.q, p.k_pool, p.v_pool, p.cu_q, stale, max(lengths_q), 1,
                                                     causal=True, block_table=p.block_table, seqused_k=seqused,
                                                     return_attn_probs=True)
    check_against_reference(p, out, lse, Variant(causal=True), lengths_k=used)
    trimmed = ([k[:n] for k, n in zip(p.dense_k, used)], [v[:n] for v, n in zip(p.dense_v, used)])
    assert_same((out, lse), packed_call(p, used, *trimmed, causal=True), device)
    # without pages: the first seqused_k keys of each packed sequence
    k, v = torch.cat(p.dense_k), torch.cat(p.dense_v)
    out2, lse2, _ = flashtriton.flash_attn_varlen_func(p.q, k, v, p.cu_q, p.cu_k, max(lengths_q), max(lengths_k),
                                                       causal=True, seqused_k=seqused, return_attn_probs=True)
    assert_same((out2, lse2), (out, lse), device)


def test_fp32_and_single_page_tiles(device):
    """fp32 (exact dots) with pages as large as several tiles, a row with unused columns."""
    p = make_paged([4, 12], [70, 12], 64, 2, 1, 16, torch.float32, device, seed=3, spare_columns=2)
    out, lse = paged_call(p, causal=True)
    check_against_reference(p, out, lse, Variant(causal=True))


def _bad_value_call(p, block_table=None, seqused_k=None):
    return flashtriton.flash_attn_varlen_func(p.q, p.k_pool, p.v_pool, p.cu_q, p.cu_k, max(p.lengths_q),
                                              max(p.lengths_k), causal=True, return_attn_probs=True,
                                              block_table=p.block_table if block_table is None else block_table,
                                              seqused_k=seqused_k)


def test_values_out_of_range_give_that_sequence_nan(device, monkeypatch):
    """Without a sync: a used page past the pool or negative, a key count past the row's pages or negative, a
    cu_seqlens_k count past the row: that sequence's out and lse are NaN, the others' as without it; nothing is
    read out of bounds (unused entries hold pages past the pool and are never read). FLASHTRITON_CHECK_VALUES=1:
    a ValueError naming the argument instead."""
    monkeypatch.setattr(paging, "CHECK_VALUES", False)
    p = make_paged([3, 4, 2, 5, 1], [20, 30, 6, 17, 9], 16, 2, 1, 16, torch.float16, device, seed=4)
    good_out, good_lse, _ = _bad_value_call(p)
    columns = p.block_table.shape[1]
    table = p.block_table.clone()
    table[0, 1] = p.k_pool.shape[0]  # a used page past the pool
    table[3, 0] = -1  # negative
    seqused = torch.tensor([20, columns * 16 + 1, -1, 17, 9], dtype=torch.int32, device=device)
    out, lse, _ = _bad_value_call(p, table, seqused)
    bad = torch.zeros(p.q.shape[0], dtype=torch.bool, device=device)
    for b in (0, 1, 2, 3):
        bad[int(p.cu_q[b]):int(p.cu_q[b + 1])] = True
    assert out[bad].isnan().all() and lse[:, bad].isnan().all()
    assert torch.equal(out[~bad], good_out[~bad]) and torch.equal(lse[:, ~bad], good_lse[:, ~bad])
    # a cu_seqlens_k count past the row's pages
    long_cu = p.cu_k.clone()
    long_cu[1:] += columns * 16
    out, _, _ = flashtriton.flash_attn_varlen_func(p.q, p.k_pool, p.v_pool, p.cu_q, long_cu, 5, 10**4,
                                                   block_table=p.block_table, return_attn_probs=True)
    assert out[: int(p.cu_q[1])].isnan().all()

    monkeypatch.setattr(paging, "CHECK_VALUES", True)
    with pytest.raises(ValueError, match=r"block_table entries .* 0\.\.\d+"):
        _bad_value_call(p, table)
    with pytest.raises(ValueError, match="seqused_k must give key counts >= 0"):
        _bad_value_call(p, seqused_k=torch.tensor([1, 1, -1, 1, 1], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="seqused_k gives a sequence 1 keys more than its block_table row"):
        _bad_value_call(p, seqused_k=seqused.clamp(min=0))
    with pytest.raises(ValueError, match="cu_seqlens_k gives a sequence"):
        flashtriton.flash_attn_varlen_func(p.q, p.k_pool, p.v_pool, p.cu_q, long_cu, 5, 10**4,
                                           block_table=p.block_table)
    _bad_value_call(p)  # good values pass


def test_bad_arguments_are_refused_by_name(device):
    p = make_paged([3, 2], [20, 6], 16, 2, 1, 16, torch.float16, device)
    q, k, v, bt, cu_q, cu_k = p.q, p.k_pool, p.v_pool, p.block_table, p.cu_q, p.cu_k

    def call(**over):
        args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=20,
                    block_table=bt)
        args.update(over)
        return flashtriton.flash_attn_varlen_func(**args)

    with pytest.raises(TypeError, match="block_table must have dtype torch.int32"):
        call(block_table=bt.long())
    with pytest.raises(TypeError, match="block_table must be an int32 torch.Tensor"):
        call(block_table=bt.tolist())
    with pytest.raises(ValueError, match="block_table must have shape"):
        call(block_table=bt[:1])
    with pytest.raises(ValueError, match="block_table must have shape"):
        call(block_table=bt[0])
    with pytest.raises(ValueError, match="block_table must be on"):
        call(block_table=torch.empty(bt.shape, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match="block_table's rows hold .* more than"):
        call(block_table=torch.zeros(1, 1, dtype=torch.int32, device=device).expand(2, 2**26 + 1))
    with pytest.raises(ValueError, match=r"k must have 4 dims \(num_pages, page_size"):
        call(k=k[0], v=v[0])
    with pytest.raises(ValueError, match="v must have the shape of k"):
        call(v=v[:, :8])
    with pytest.raises(TypeError, match="q, k, v must share one dtype"):
        call(k=k.float(), v=v.float())
    with pytest.raises(ValueError, match="number of query heads must be a multiple"):
        call(q=q[:, :1].expand(-1, 3, -1), k=k.expand(-1, -1, 2, -1), v=v.expand(-1, -1, 2, -1))
    with pytest.raises(TypeError, match="seqused_k must have dtype torch.int32"):
        call(seqused_k=torch.tensor([1, 2], device=device))
    with pytest.raises(ValueError, match=r"seqused_k must have shape \(batch,\) = \(2,\)"):
        call(seqused_k=torch.tensor([1, 2, 3], dtype=torch.int32, device=device))
    with pytest.raises(TypeError, match="seqused_k must be an int32 torch.Tensor"):
        call(seqused_k=[1, 2])
    with torch.no_grad():
        plain = call()
    for name, t in (("q", q), ("k", k), ("v", v)):  # the forward runs (as flash-attn's), its backward raises
        out = call(**{name: t.clone().requires_grad_()})
        assert out.requires_grad and torch.equal(torch.nan_to_num(out.detach(), 7.0), torch.nan_to_num(plain, 7.0))
        with pytest.raises(NotImplementedError, match=f"block_table is forward-only .* {name} requires grad"):
            out.sum().backward()
    cu_k8 = torch.tensor([0, 8, 16], dtype=torch.int32, device=device)
    used = torch.tensor([8, 6], dtype=torch.int32, device=device)
    out, lse, _ = flashtriton.flash_attn_varlen_func(q.clone().requires_grad_(), k[0], v[0], cu_q, cu_k8, 3, 8,
                                                     seqused_k=used, return_attn_probs=True)
    with pytest.raises(NotImplementedError, match="seqused_k is forward-only"):
        (out.sum() + lse.nan_to_num().sum()).backward()
    with torch.no_grad():  # the same tensors without grad mode: no autograd record
        assert not call(q=q.clone().requires_grad_()).requires_grad


def test_compiles_fullgraph_like_eager(device):
    """torch.compile: the op carries block_table and seqused_k; the compiled call equals the eager one."""
    import torch._dynamo

    p = make_paged([5, 0, 3], [9, 30, 3], 16, 2, 1, 16, torch.float16, device, seed=6)
    seqused = torch.tensor([9, 25, 3], dtype=torch.int32, device=device)

    def fn(q, k, v, cu_q, cu_k, block_table, seqused_k):
        return flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 30, causal=True, block_table=block_table,
                                                  seqused_k=seqused_k, return_attn_probs=True)[:2]

    torch._dynamo.reset()
    args = (p.q, p.k_pool, p.v_pool, p.cu_q, p.cu_k, p.block_table, seqused)
    expected = fn(*args)
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(*args)
    assert_same(got, expected, device)
    torch.library.opcheck(torch.ops.flashtriton.fwd.default,
                          [p.q, p.k_pool, p.v_pool, 0.25, True, True, p.cu_q, p.cu_k, 5, 30, -1, -1, 0.0, None, None,
                           0.0, None, p.block_table, seqused], test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 256])
def test_large_paged_prefill(page_size, device):
    """Chunked prefill of 24 sequences (1..1024 new tokens after 0..4096 cached ones), GQA 16/4, D=128, bf16: every
    sequence against the packed call on its gathered keys, a few against float64."""
    gen = torch.Generator().manual_seed(page_size)
    lengths_q = torch.randint(1, 1025, (24,), generator=gen).tolist()
    cached = torch.randint(0, 4097, (24,), generator=gen).tolist()
    lengths_q[0], cached[1] = 0, 0
    lengths_k = [a + b for a, b in zip(lengths_q, cached)]
    p = make_paged(lengths_q, lengths_k, page_size, 16, 4, 128, torch.bfloat16, device, seed=page_size)
    out, lse = paged_call(p, causal=True)
    assert_same((out, lse), packed_call(p, lengths_k, p.dense_k, p.dense_v, causal=True), device)
    few = dataclasses.replace(p, lengths_q=p.lengths_q[:4], lengths_k=p.lengths_k[:4])
    check_against_reference(few, out, lse, Variant(causal=True))


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the Gluon forward over pages: sm_90 only (no interpreter)")
@pytest.mark.parametrize("page_size,head_dim", [(8, 128), (16, 128), (32, 128), (64, 128), (128, 128), (256, 128),
                                                (16, 96), (256, 80)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gluon_paged_prefill(page_size, head_dim, causal, dtype, device, monkeypatch):
    """Paged prefill on Hopper takes the Gluon forward (counted; pages smaller than a 128-key tile gathered into
    it, larger ones holding whole tiles; head dims below 128 in its 128-column tiles): ragged sequences (no
    queries, no cached keys, a chunk after a long prefix, one token) over a pool whose unused rows are NaN and whose
    unused block-table entries are past the pool, GQA 8/2, D=128 (96 and 80 at one page size each): against float64
    per sequence and the packed call on the gathered keys; seqused_k shorter than cu_seqlens_k's counts; bad values
    (a used page past the pool, a negative one, seqused_k past the row or negative) give that sequence NaN rows, the
    others as without them."""
    from flashtriton.kernels import forward_gluon_launch as G

    monkeypatch.setattr(paging, "CHECK_VALUES", False)
    calls = []
    launch = G.launch_forward_gluon
    monkeypatch.setattr(G, "launch_forward_gluon", lambda *a, **kw: (calls.append(kw or a[-1]), launch(*a, **kw)))
    lengths_q = [300, 0, 17, 129, 1, 640]
    lengths_k = [300, 50, 17, 1200, 700, 640]
    p = make_paged(lengths_q, lengths_k, page_size, 8, 2, head_dim, dtype, device, seed=page_size + causal)
    out, lse = paged_call(p, causal=causal)
    assert len(calls) == 1, "the Gluon forward did not take the call"
    check_against_reference(p, out, lse, Variant(causal=causal))
    assert_same((out, lse), packed_call(p, lengths_k, p.dense_k, p.dense_v, causal=causal), device)

    used = [max(lq, min(lk, lk - 100)) for lq, lk in zip(lengths_q, lengths_k)]
    seqused = torch.tensor(used, dtype=torch.int32, device=device)
    out_used, lse_used = paged_call(p, causal=causal, seqused_k=seqused)
    check_against_reference(p, out_used, lse_used, Variant(causal=causal), lengths_k=used)

    table = p.block_table.clone()
    table[0, 1] = p.k_pool.shape[0]  # a used page past the pool
    table[3, 0] = -1  # negative
    bad_used = torch.tensor([300, 50, table.shape[1] * page_size + 1, 1200, -1, 640], dtype=torch.int32,
                            device=device)
    out_bad, lse_bad, _ = flashtriton.flash_attn_varlen_func(
        p.q, p.k_pool, p.v_pool, p.cu_q, p.cu_k, max(lengths_q), max(lengths_k), causal=causal,
        return_attn_probs=True, block_table=table, seqused_k=bad_used)
    bad = torch.zeros(p.q.shape[0], dtype=torch.bool, device=device)
    for b in (0, 2, 3, 4):
        bad[int(p.cu_q[b]):int(p.cu_q[b + 1])] = True
    assert out_bad[bad].isnan().all() and lse_bad[:, bad].isnan().all()
    assert torch.equal(out_bad[~bad], out[~bad]) and torch.equal(lse_bad[:, ~bad], lse[:, ~bad])
