"""Head dims the Gluon kernels do not take, run padded with zero columns to one they take (`ops.PAD_HEAD_DIMS`,
`ops.padded_head_dim`): out and gradients against float64 through the dense, varlen and SDPA entry points, with
variants and dropout, the padded call having run (under "always", which the interpreter takes too); which head
dims pad to what, and where nothing pads."""

from __future__ import annotations

import pytest
import torch

import flashtriton
from flashtriton import configs, ops, testing
from flashtriton.kernels.variant import Variant

from conftest import DEVICE
from test_head_dim_v import _dense, _inputs, _judge

H = torch.float16


@pytest.fixture
def padding(monkeypatch):
    """PAD_HEAD_DIMS "always"; the list of head dims the calls were padded to."""
    monkeypatch.setattr(ops, "PAD_HEAD_DIMS", "always")
    seen = []
    decide = ops.padded_head_dim

    def recording(q, k, v):
        padded = decide(q, k, v)
        if padded is not None:
            seen.append(padded)
        return padded

    monkeypatch.setattr(ops, "padded_head_dim", recording)
    return seen


def test_which_head_dims_pad_to_what(monkeypatch):
    """The smallest head dim of the Gluon kernels above D, where it is at most 2 D; None where D is theirs, where
    padding would more than double it, above 256, or where V's head dim is another."""
    monkeypatch.setattr(ops, "PAD_HEAD_DIMS", "always")
    q = torch.empty(1, 1, 1, 1)

    def padded(d, dv=None, seqlen=1, heads=1):  # (views: no memory behind their shapes)
        qk = q.expand(1, seqlen, heads, d)
        return ops.padded_head_dim(qk, qk, q.expand(1, 1, 1, d if dv is None else dv))

    theirs = configs.GLUON_HEAD_DIMS
    for d in range(1, 258):
        above = [t for t in theirs if t > d]
        want = None if d in theirs or not above or min(above) > 2 * d else min(above)
        assert padded(d) == want, d
    assert {d: padded(d) for d in (59, 63, 75, 111, 255)} == {59: 64, 63: 64, 75: 80, 111: 112, 255: 256}
    assert [padded(d) for d in (64, 80, 96, 112, 128, 192, 256, 16, 257)] == [None] * 9
    assert padded(59, 24) is None
    big = q[0].expand(2**21, 17, 59)  # (total, heads, D) of a packed batch: 2**31 elements or more padded to 64
    assert ops.padded_head_dim(big, big, big) is None and padded(59, seqlen=2**20, heads=17) == 64
    monkeypatch.setattr(ops, "PAD_HEAD_DIMS", "off")
    assert padded(59) is None
    monkeypatch.setattr(ops, "PAD_HEAD_DIMS", "auto")  # the interpreter / CPU: the kernels take the head dim as it is
    if DEVICE == "cpu":
        assert padded(59) is None


@pytest.mark.parametrize("head_dim,dtype", [(75, H), (59, torch.bfloat16), (111, H)])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_padded_forward_and_gradients(head_dim, dtype, causal, padding):
    """GQA, Sq != Sk: out and dq, dk, dv (of the caller's head dim) against float64."""
    _dense((1, 37, 45, 4, 2), (head_dim, head_dim), dtype, Variant(causal=causal))
    assert padding == [{75: 80, 59: 64, 111: 112}[head_dim]]


def test_dense_padded_with_variants_and_a_sink(padding):
    sinks = torch.tensor([1.5, -0.5, 0.25, 2.0]).to(DEVICE).requires_grad_()
    _dense((1, 33, 50, 4, 2), (75, 75), H, Variant(causal=True, window=(9, 0), softcap=4.0,
                                                     alibi_slopes=0.3 / torch.arange(1.0, 5.0)), sinks)
    assert padding == [80]


def test_padded_dropout_is_the_unpadded_mask(padding):
    """The keep-mask depends on the score's indices only: with the call's rng_state, the padded call's output is
    float64 attention with that mask."""
    q, k, v, dout = _inputs((2, 24, 24, 2, 2), (59, 59), H, requires_grad=False)
    with testing.record_dropout() as calls:
        out = flashtriton.flash_attn_func(q, k, v, dropout_p=0.25, causal=True)
    assert padding == [64] and out.shape == q.shape
    keep = testing.dropout_mask(calls[0], 2, 2, 24, 24, 0.25, device=DEVICE)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / 59 ** 0.5
    scores = scores.masked_fill(torch.ones(24, 24, dtype=torch.bool, device=DEVICE).triu(1), float("-inf"))
    probs = scores.softmax(-1) * keep / 0.75
    want = torch.einsum("bhqk,bkhd->bqhd", probs, v.double())
    torch.testing.assert_close(out.double(), want, atol=3e-3, rtol=3e-3)


def test_varlen_padded(padding):
    """Packed sequences (an empty one, one token) at D=59: each sequence's out and gradients against float64."""
    lengths = [5, 0, 1, 33, 7]
    gen = torch.Generator().manual_seed(3)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    total = sum(lengths)
    q, k, v, dout = (torch.randn(total, h, 59, generator=gen).to(DEVICE, H) for h in (4, 2, 2, 4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = flashtriton.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    assert padding == [64] and out.shape == q.shape and out.is_contiguous()
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for b in range(len(lengths)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        if rows.start == rows.stop:
            continue
        one = [t[rows][None].detach().requires_grad_() for t in (q, k, v)]
        _judge(out[rows][None], [g[rows][None] for g in grads], *one, dout[rows][None], Variant(causal=True), H)


def test_sdpa_padded(padding):
    q, k, v, dout = _inputs((2, 19, 26, 4, 4), (111, 111), H)
    qh, kh, vh = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    out = flashtriton.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    assert padding == [112] and out.shape == (2, 4, 19, 111)
    grads = [g.transpose(1, 2) for g in torch.autograd.grad(out, (qh, kh, vh), dout.transpose(1, 2))]
    _judge(out.transpose(1, 2), grads, q, k, v, dout, Variant(causal=True, bottom_right=False), H)


def test_padded_call_compiles_fullgraph(padding):
    """torch.compile(fullgraph=True) traces the padding and the crop around the op: one graph, equal to eager."""
    import torch._dynamo.testing

    torch._dynamo.reset()
    q, k, v, dout = _inputs((1, 9, 12, 2, 2), (59, 59), torch.float32)

    def fn(q, k, v):
        return flashtriton.flash_attn_func(q, k, v, causal=True)

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    results = []
    for f in (fn, torch.compile(fn, backend=counter, fullgraph=True)):
        out = f(q, k, v)
        results.append((out.detach(), *torch.autograd.grad(out, (q, k, v), dout)))
    assert counter.frame_count == 1 and padding == [64, 64]
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
