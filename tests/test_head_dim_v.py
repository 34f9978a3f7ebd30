"""V with a head dim of its own (v.shape[-1] != q.shape[-1]; DeepSeek-V3's MLA has (192, 128)): out and dV have V's
head dim, q, k and dK theirs. Forward and every gradient against float64 attention, judged relative to torch's own
error in the same dtype (tests/accuracy.py; torch SDPA takes Dv != D too), through the dense, varlen and SDPA entry
points, with the variants, under torch.compile, and the bad head dims refused. The Hopper kernels declare Dv == D
only: such calls run the portable kernels (tests/test_dispatch.py holds the gates)."""

import dataclasses

import pytest
import torch
import torch._dynamo.testing

import flashtriton
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


def test_kvcache_still_needs_one_head_dim():
    """flash_attn_with_kvcache reads v_cache with q's head dim: a v_cache of its own is refused, not misread."""
    q = torch.randn(1, 1, 2, 32, dtype=H, device=DEVICE)
    k_cache = torch.randn(1, 8, 2, 32, dtype=H, device=DEVICE)
    v_cache = torch.randn(1, 8, 2, 16, dtype=H, device=DEVICE)
    with pytest.raises(ValueError, match="v_cache must have the shape of k_cache"):
        flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([8], dtype=torch.int32,
                                                                                             device=DEVICE))


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
