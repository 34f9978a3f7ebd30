"""V with a head dim of its own (v.shape[-1] != q.shape[-1]; DeepSeek-V3's MLA has (192, 128)): out and dV have V's
head dim, q, k and dK theirs. Forward and every gradient against float64 attention, judged relative to torch's own
error in the same dtype (tests/accuracy.py; torch SDPA takes Dv != D too), through the dense, varlen, SDPA and KV-cache
entry points, with the variants, under torch.compile, and the bad head dims refused. The Hopper kernels declare
Dv == D only: such calls run the portable kernels (tests/test_dispatch.py holds the gates)."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo.testing

import flashtriton
from flashtriton.kernels import dispatch
from flashtriton.kernels.variant import Variant
from flashtriton.reference import attention_reference

from accuracy import assert_close_to_exact
from conftest import DEVICE
from test_features import _torch_same_dtype

H = torch.float16
DIMS = [(192, 128), (128, 64), (64, 128), (40, 24), (24, 40)]  # (q and k's head dim, v's)
DTYPE_OF = dict(zip(DIMS, (torch.bfloat16, torch.float16, torch.float32, torch.float16, torch.bfloat16)))


def _inputs(shape, dims, dtype, seed=0, requires_grad=True):
    """q, k, v and dout of (batch, seqlen_q, seqlen_k, heads_q, heads_kv), random, on the test device."""
    (batch, sq, sk, hq, hkv), (d, dv) = shape, dims
    gen = torch.Generator().manual_seed(seed + 1000 * d + dv)
    q, k, v, dout = (torch.randn(s, generator=gen).to(DEVICE, dtype)
                     for s in ((batch, sq, hq, d), (batch, sk, hkv, d), (batch, sk, hkv, dv), (batch, sq, hq, dv)))
    return (*(t.requires_grad_(requires_grad) for t in (q, k, v)), dout)


def _judge(out, grads, q, k, v, dout, variant, dtype, sinks=None):
    """out and grads (of q, k, v[, sinks]) against float64 attention, relative to torch SDPA in `dtype`."""
    assert out.shape == (*q.shape[:-1], v.shape[-1])
    leaves64 = tuple(t.detach().double().requires_grad_() for t in (q, k, v))
    exact_variant = variant
    if sinks is not None:
        s64 = sinks.detach().double().requires_grad_()
        exact_variant = dataclasses.replace(variant, sinks=s64)
        leaves64 += (s64,)
    exact = attention_reference(*leaves64[:3], variant=exact_variant)
    exact_grads = torch.autograd.grad(exact, leaves64, dout.double())
    leaves = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
    if sinks is not None:
        leaves += (sinks.detach().clone().requires_grad_(),)
    same = _torch_same_dtype(*leaves[:3], variant, leaves[3] if sinks is not None else None)
    same_grads = [torch.nan_to_num(g, nan=0.0) for g in torch.autograd.grad(same, leaves, dout)]
    assert_close_to_exact(out, same, exact, dtype, "out")
    for name, ours, theirs, ex in zip(("q", "k", "v", "sink"), grads, same_grads, exact_grads):
        assert ours.shape == ex.shape, name
        assert_close_to_exact(ours, theirs, ex, dtype, f"d{name}")


def _dense(shape, dims, dtype, variant=Variant(), sinks=None, seed=0):
    q, k, v, dout = _inputs(shape, dims, dtype, seed)
    if variant.alibi_slopes is not None:
        variant = dataclasses.replace(variant, alibi_slopes=variant.alibi_slopes[:q.shape[2]].to(DEVICE))
    out = flashtriton.flash_attn_func(q, k, v, causal=variant.causal, window_size=variant.window,
                                      softcap=variant.softcap, alibi_slopes=variant.alibi_slopes,
                                      learnable_sink=sinks)
    leaves = (q, k, v) + ((sinks,) if sinks is not None else ())
    grads = torch.autograd.grad(out, leaves, dout)
    if sinks is not None:
        variant = dataclasses.replace(variant, sinks=sinks.detach())
    _judge(out, grads, q, k, v, dout, variant, dtype, sinks)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dims", DIMS, ids=str)
def test_dense_forward_and_gradients(dims, causal):
    """GQA, Sq != Sk (ragged tiles), each pair of head dims in one dtype: every dtype is met."""
    _dense((1, 37, 45, 4, 2), dims, DTYPE_OF[dims], Variant(causal=causal))


def test_more_queries_than_keys_causal():
    """Rows that see no key: out 0 (of V's head dim), gradients 0, never NaN."""
    _dense((2, 40, 9, 2, 1), (40, 24), H, Variant(causal=True))


@pytest.mark.parametrize("dims", [(192, 128), (24, 40)], ids=str)
def test_window_and_softcap(dims):
    _dense((1, 33, 50, 2, 1), dims, H, Variant(causal=True, window=(9, 0), softcap=4.0,
                                                 alibi_slopes=0.3 / torch.arange(1.0, 3.0)))


def test_sinks_with_a_window():
    sinks = torch.tensor([1.5, -0.5, 0.25, 2.0]).to(DEVICE).requires_grad_()
    _dense((1, 29, 29, 4, 2), (128, 64), torch.bfloat16, Variant(window=(7, 3)), sinks)


@pytest.mark.parametrize("dims", [(128, 64), (40, 24)], ids=str)
def test_sdpa_layout(dims):
    """torch's (B, H, S, D) layout and top-left causal: out (B, Hq, Sq, Dv), as torch SDPA returns it."""
    d, dv = dims
    q, k, v, dout = _inputs((2, 19, 26, 4, 2), dims, H)
    qh, kh, vh = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    out = flashtriton.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    assert out.shape == (2, 4, 19, dv)
    grads = [g.transpose(1, 2) for g in torch.autograd.grad(out, (qh, kh, vh), dout.transpose(1, 2))]
    assert [g.shape[-1] for g in grads] == [d, d, dv]
    _judge(out.transpose(1, 2), grads, q, k, v, dout, Variant(causal=True, bottom_right=False), H)


def _packed_reference(fn, q, k, v, cu_q, cu_k, dv):
    """fn(q_b, k_b, v_b) (1, S, H, D) per sequence, packed back to (total_q, Hq, Dv); zeros where a sequence has no
    keys (no key: out 0) or no queries."""
    pieces = []
    for b in range(cu_q.numel() - 1):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if cu_q[b + 1] == cu_q[b] or cu_k[b + 1] == cu_k[b]:
            pieces.append(q.new_zeros(cu_q[b + 1] - cu_q[b], q.shape[1], dv))
        else:
            pieces.append(fn(q[None, sq], k[None, sk], v[None, sk])[0])
    return torch.cat(pieces)


@pytest.mark.parametrize("dims,causal", [((192, 128), True), ((24, 40), False)], ids=str)
def test_varlen(dims, causal):
    """Packed sequences of mixed lengths (an empty one, one without keys, one token), GQA, Sq != Sk per sequence."""
    d, dv = dims
    lengths_q, lengths_k = [5, 0, 1, 33, 7], [9, 3, 4, 21, 0]
    gen = torch.Generator().manual_seed(7)
    cu_q, cu_k = (torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
                  for n in (lengths_q, lengths_k))
    q, k, v, dout = (torch.randn(s, generator=gen).to(DEVICE, H) for s in
                     ((sum(lengths_q), 4, d), (sum(lengths_k), 2, d), (sum(lengths_k), 2, dv), (sum(lengths_q), 4, dv)))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal)
    assert out.shape == (q.shape[0], 4, dv)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    variant = Variant(causal=causal)
    leaves64 = tuple(t.detach().double().requires_grad_() for t in (q, k, v))
    exact = _packed_reference(lambda *t: attention_reference(*t, variant=variant), *leaves64, cu_q, cu_k, dv)
    exact_grads = torch.autograd.grad(exact, leaves64, dout.double())
    leaves = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
    same = _packed_reference(lambda *t: _torch_same_dtype(*t, variant), *leaves, cu_q, cu_k, dv)
    same_grads = torch.autograd.grad(same, leaves, dout)
    assert_close_to_exact(out, same, exact, H, "out")
    for name, ours, theirs, ex in zip("qkv", grads, same_grads, exact_grads):
        assert_close_to_exact(ours, theirs, ex, H, f"d{name}")


class _Mla(torch.nn.Module):
    """An MLA-shaped block: q and k of one head dim, v of a smaller one, dense and varlen."""

    def __init__(self, dim=16, heads=2, head_dim=24, head_dim_v=8):
        super().__init__()
        self.h, self.d, self.dv = heads, head_dim, head_dim_v
        self.qk = torch.nn.Linear(dim, 2 * heads * head_dim)
        self.v = torch.nn.Linear(dim, heads * head_dim_v)
        self.o = torch.nn.Linear(heads * head_dim_v, dim)

    def forward(self, x, cu):
        batch, seqlen, _ = x.shape
        q, k = self.qk(x).view(batch, seqlen, 2, self.h, self.d).unbind(2)
        v = self.v(x).view(batch, seqlen, self.h, self.dv)
        a = flashtriton.flash_attn_func(q, k, v, causal=True)
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        b = flashtriton.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(1, 2)
        c = flashtriton.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, seqlen,
                                               seqlen, causal=True).view(batch, seqlen, self.h, self.dv)
        return self.o((a + b + c).reshape(batch, seqlen, -1))


def test_compiles_fullgraph_forward_backward():
    """The ops' fake implementations give out and dV V's head dim: one graph, no break, equal to eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = _Mla().to(DEVICE)
    x = torch.randn(2, 6, 16, device=DEVICE, requires_grad=True)
    cu = torch.tensor([0, 6, 12], dtype=torch.int32, device=DEVICE)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    results = []
    for fn in (block, torch.compile(block, backend=counter, fullgraph=True)):
        out = fn(x, cu)
        results.append((out.detach(), *torch.autograd.grad(out.square().sum(), (x, *block.parameters()))))
    assert counter.frame_count == 1
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_fake_implementations_match_the_kernels():
    q, k, v, dout = _inputs((1, 5, 7, 2, 1), (24, 8), torch.float32, requires_grad=False)
    args = (q, k, v, 24 ** -0.5, True, True, None, None, 5, 7)
    torch.library.opcheck(torch.ops.flashtriton.fwd.default, args, test_utils=("test_schema", "test_faketensor"))
    out, lse = torch.ops.flashtriton.fwd(*args)
    bwd_args = (dout, q, k, v, out, lse, 24 ** -0.5, True, True, None, None, 5, 7)
    torch.library.opcheck(torch.ops.flashtriton.bwd.default, bwd_args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("which,head_dim_v,error,match", [
    ("v", 272, ValueError, "v's head dim .* between 1 and 256, got 272"),
    ("v", 0, ValueError, "v's head dim .* between 1 and 256, got 0"),
    ("k", 24, ValueError, "head dims of q and k must match"),
])
def test_bad_head_dims_are_refused(which, head_dim_v, error, match):
    q, k, v, _ = _inputs((1, 4, 4, 2, 2), (32, 32), H, requires_grad=False)
    tensors = dict(q=q, k=k, v=v)
    tensors[which] = torch.zeros(*tensors[which].shape[:-1], head_dim_v, dtype=H, device=DEVICE)
    with pytest.raises(error, match=match):
        flashtriton.flash_attn_func(tensors["q"], tensors["k"], tensors["v"])
    with pytest.raises(error, match=match.replace("q and k", "query and key")):
        flashtriton.scaled_dot_product_attention(*(tensors[n].transpose(1, 2) for n in "qkv"))
    cu = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(error, match=match):
        flashtriton.flash_attn_varlen_func(*(tensors[n][0] for n in "qkv"), cu, cu, 4, 4)


# flash_attn_with_kvcache: (dims, seqlen_q, causal, paged page size or None, num_splits, schedule, variant)
KVCACHE_CASES = [
    ((192, 128), 1, False, None, 3, "split", Variant()),
    ((40, 24), 3, True, 16, 0, "stream", Variant(causal=True)),
    ((24, 40), 2, True, None, 1, "split", Variant(causal=True, window=(20, 0), softcap=5.0,
                                                  sinks=torch.tensor([0.5, -1.0, 2.0, 0.25]))),
    ((64, 128), 1, False, 32, 2, "split", Variant(alibi_slopes=0.25 / torch.arange(1.0, 5.0))),
]


@pytest.mark.parametrize("dims,seqlen_q,causal,page_size,num_splits,schedule,variant", KVCACHE_CASES,
                         ids=["mla_splits", "paged_stream_causal", "window_softcap_sinks", "paged_alibi"])
def test_kvcache(dims, seqlen_q, causal, page_size, num_splits, schedule, variant):
    """A v_cache of its own head dim: new k and v appended (k_cache and v_cache hold exactly the expected values),
    then attention over each sequence's keys against float64, GQA, split, stream and paged."""
    _kvcache_case(dims, seqlen_q, causal, page_size, num_splits, schedule, variant)


@pytest.mark.gpu
@pytest.mark.parametrize("dims,capacity,page_size", [((192, 128), 32768, None), ((128, 64), 8192, 256)], ids=str)
def test_kvcache_standard_shapes(dims, capacity, page_size):
    """Long caches: the split count and schedule as the dispatch picks them (the stream schedule at 32k keys)."""
    _kvcache_case(dims, 1, True, page_size, 0, "auto", Variant(causal=True), batch=4, heads_q=16, capacity=capacity)


def _kvcache_case(dims, seqlen_q, causal, page_size, num_splits, schedule, variant, batch=3, heads_q=4, capacity=96):
    from test_kvcache import FLOOR, _expected_cache, _logical_cache

    (d, dv), heads_kv, seqlen_new = dims, 2, 2
    gen = torch.Generator().manual_seed(d * 7 + dv)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, H)

    block_table = None
    if page_size:
        pages = capacity // page_size
        block_table = torch.randperm(batch * pages + 2, generator=gen)[:batch * pages].view(batch, pages)
        block_table = block_table.to(DEVICE, torch.int32)
        cache_rows, cache_len = batch * pages + 2, page_size
    else:
        cache_rows, cache_len = batch, capacity
    q = randn(batch, seqlen_q, heads_q, d)
    k_cache, v_cache = randn(cache_rows, cache_len, heads_kv, d), randn(cache_rows, cache_len, heads_kv, dv)
    k, v = randn(batch, seqlen_new, heads_kv, d), randn(batch, seqlen_new, heads_kv, dv)
    seqlens = [0, 41, capacity - seqlen_new] + [capacity // 2] * (batch - 3)
    expected_k = _expected_cache(k_cache, k, seqlens, block_table, None)
    expected_v = _expected_cache(v_cache, v, seqlens, block_table, None)
    slopes = None if variant.alibi_slopes is None else variant.alibi_slopes.to(DEVICE)
    sinks = None if variant.sinks is None else variant.sinks.to(DEVICE)
    with torch.no_grad(), dispatch.force("auto", schedule):
        out, lse = flashtriton.flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=DEVICE),
            block_table=block_table, causal=causal, window_size=variant.window, softcap=variant.softcap,
            alibi_slopes=slopes, num_splits=num_splits, return_softmax_lse=True, learnable_sink=sinks)
    assert out.shape == (batch, seqlen_q, heads_q, dv) and lse.shape == (batch, heads_q, seqlen_q)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    keys = _logical_cache(expected_k, block_table, None, batch)
    values = _logical_cache(expected_v, block_table, None, batch)
    for b in range(batch):
        n = seqlens[b] + seqlen_new
        args = (q[b:b + 1], keys[b:b + 1, :n], values[b:b + 1, :n])
        exact, exact_lse = attention_reference(*args, variant=variant, return_lse=True)
        same = attention_reference(*args, variant=variant, dtype=H)
        err = (out[b:b + 1].double() - exact).abs().max().item()
        torch_err = (same.double() - exact).abs().max().item()
        assert err <= 2 * torch_err + FLOOR[H], f"sequence {b} ({n} keys): error {err:.3g}, torch's {torch_err:.3g}"
        torch.testing.assert_close(lse[b:b + 1].double(), exact_lse, atol=1e-3, rtol=1e-3)


def test_kvcache_compiles_fullgraph():
    """The kvcache op's fake gives out V's head dim: a decode step (append, then attend; GQA) compiles to one graph,
    with eager's output and caches."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(3)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, H)

    q, k_new, v_new = randn(2, 1, 4, 24), randn(2, 1, 2, 24), randn(2, 1, 2, 8)
    caches = (randn(2, 32, 2, 24), randn(2, 32, 2, 8))
    seqlens = torch.tensor([5, 30], dtype=torch.int32, device=DEVICE)

    def step(q, k_cache, v_cache, k, v, seqlens):
        return flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True)

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    results = []
    with torch.no_grad():
        for fn in (step, torch.compile(step, backend=counter, fullgraph=True)):
            k_cache, v_cache = (c.clone() for c in caches)
            results.append((fn(q, k_cache, v_cache, k_new, v_new, seqlens), k_cache, v_cache))
    assert counter.frame_count == 1 and results[0][0].shape == (2, 1, 4, 8)
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_kvcache_builds_compile_for_sm90_without_a_gpu():
    """The decode kernels with V's head dim of its own (both schedules, paged or not, every variant field) compile
    to sm_90 code, in a fresh process without the interpreter (which runs code Triton's compiler may refuse)."""
    script = (
        "import torch\n"
        "from flashtriton.kernels.decode_launch import compile_for_sm90\n"
        "from flashtriton.kernels.variant import Variant\n"
        "every = Variant.of(True, True, (100, 0), 30.0, True, True)\n"
        "for paged, stream in ((False, False), (True, True)):\n"
        "    compiled = compile_for_sm90(every, paged, stream, head_dim=192, head_dim_v=128, dtype=torch.bfloat16)\n"
        "    assert 'mma' in compiled.asm['ptx']\n"
        "    print('compiled', paged, stream)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(flashtriton.__file__).parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 2


def test_kvcache_shapes_are_checked():
    q = torch.randn(1, 1, 2, 32, dtype=H, device=DEVICE)
    k_cache = torch.randn(1, 8, 2, 32, dtype=H, device=DEVICE)
    seqlens = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="v_cache must have the shape of k_cache .* but for its head dim"):
        flashtriton.flash_attn_with_kvcache(q, k_cache, torch.randn(1, 9, 2, 16, dtype=H, device=DEVICE),
                                            cache_seqlens=seqlens)
    with pytest.raises(ValueError, match="v's head dim .* between 1 and 256, got 272"):
        flashtriton.flash_attn_with_kvcache(q, k_cache, torch.randn(1, 8, 2, 272, dtype=H, device=DEVICE),
                                            cache_seqlens=seqlens)
    v_cache = torch.randn(1, 8, 2, 16, dtype=H, device=DEVICE)
    k_new = torch.randn(1, 1, 2, 32, dtype=H, device=DEVICE)
    with pytest.raises(ValueError, match=r"v must have the shape of k but for its head dim, v_cache's: \(1, 1, 2, 16"):
        flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, k_new, cache_seqlens=seqlens)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dims", [(192, 128), (128, 64), (64, 128), (256, 128)], ids=str)
def test_standard_shapes(dims, dtype, causal):
    _dense((2, 1024, 1024, 16, 4), dims, dtype, Variant(causal=causal))


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(192, 128), (128, 64)], ids=str)
def test_standard_shapes_variants(dims):
    sinks = torch.linspace(-1.0, 2.0, 16).to(DEVICE).requires_grad_()
    _dense((1, 1500, 700, 16, 16), dims, torch.bfloat16,
           Variant(causal=True, window=(256, 0), softcap=30.0, alibi_slopes=0.1 / torch.arange(1.0, 17.0)), sinks)
