"""flash-attn's packed entry points: the unpacked calls on views of the packed tensor, bitwise, with no copy of it."""

import inspect

import pytest
import torch

import flashtriton
import flashtriton.kernels.backward as backward_module
import flashtriton.ops as ops_module
from flashtriton.reference import attention_reference

FLASH_ATTN_ARGS = ["dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
                   "return_attn_probs"]  # flash-attn 2.8's order after the tensors
SIGNATURES = {
    "flash_attn_qkvpacked_func": ["qkv"],
    "flash_attn_kvpacked_func": ["q", "kv"],
    "flash_attn_varlen_qkvpacked_func": ["qkv", "cu_seqlens", "max_seqlen"],
    "flash_attn_varlen_kvpacked_func": ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"],
}


def randn(gen, *shape, dtype=torch.float16, device="cpu"):
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def cu_seqlens(lengths, device):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


def run(fn, leaves, gen, **kwargs):
    """fn(*leaves) with a loss on out (and on lse when returned): (out, lse, grads of the leaves)."""
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    result = fn(*leaves, **kwargs)
    out, lse = (result[0], result[1]) if kwargs.get("return_attn_probs") else (result, None)
    if kwargs.get("return_attn_probs"):
        assert isinstance(result, tuple) and len(result) == 3 and result[2] is None
    else:
        assert isinstance(result, torch.Tensor)
    loss = (out.float() * randn(gen, *out.shape, dtype=torch.float32, device=out.device)).sum()
    if lse is not None:
        finite = torch.isfinite(lse)
        loss = loss + (torch.where(finite, lse, 0) * randn(gen, *lse.shape, dtype=torch.float32,
                                                             device=lse.device)).sum()
    loss.backward()
    return out, lse, [t.grad for t in leaves]


def assert_same(packed, unpacked):
    """Bitwise equal results; packed grads given as the packed tensors' grads unbound."""
    (out_p, lse_p, grads_p), (out_u, lse_u, grads_u) = packed, unpacked
    assert torch.equal(out_p, out_u)
    assert (lse_p is None) == (lse_u is None) and (lse_p is None or torch.equal(lse_p, lse_u))
    assert len(grads_p) == len(grads_u)
    for gp, gu in zip(grads_p, grads_u):
        assert torch.equal(gp, gu)


def test_signatures_are_flash_attns():
    for name, tensors in SIGNATURES.items():
        params = inspect.signature(getattr(flashtriton, name)).parameters
        positional = [p for p, v in params.items() if v.kind == v.POSITIONAL_OR_KEYWORD]
        assert positional == tensors + FLASH_ATTN_ARGS, name
        assert params["learnable_sink"].kind == inspect.Parameter.KEYWORD_ONLY
        defaults = {p: v.default for p, v in params.items() if p in FLASH_ATTN_ARGS}
        assert defaults == dict(dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                alibi_slopes=None, deterministic=False, return_attn_probs=False)
        assert name in flashtriton.__all__


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_qkvpacked_equals_unpacked(causal, dtype, device):
    gen = torch.Generator().manual_seed(0)
    qkv = randn(gen, 2, 37, 3, 4, 40, dtype=dtype, device=device)
    kw = dict(causal=causal, return_attn_probs=True)
    packed = run(flashtriton.flash_attn_qkvpacked_func, [qkv], torch.Generator().manual_seed(1), **kw)
    unpacked = run(flashtriton.flash_attn_func, [t.contiguous() for t in qkv.unbind(2)],
                   torch.Generator().manual_seed(1), **kw)
    assert packed[2][0].shape == qkv.shape and packed[2][0].is_contiguous()
    assert_same((packed[0], packed[1], packed[2][0].unbind(2)), unpacked)
    exact = attention_reference(*qkv.unbind(2), causal=causal)
    torch.testing.assert_close(packed[0].double(), exact, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("causal", [False, True])
def test_kvpacked_gqa_equals_unpacked(causal, device):
    gen = torch.Generator().manual_seed(2)
    q, kv = randn(gen, 2, 20, 6, 32, device=device), randn(gen, 2, 29, 2, 2, 32, device=device)
    packed = run(flashtriton.flash_attn_kvpacked_func, [q, kv], torch.Generator().manual_seed(3), causal=causal)
    unpacked = run(flashtriton.flash_attn_func, [q, *(t.contiguous() for t in kv.unbind(2))],
                   torch.Generator().manual_seed(3), causal=causal)
    assert packed[2][1].shape == kv.shape
    assert_same((packed[0], packed[1], [packed[2][0], *packed[2][1].unbind(2)]), unpacked)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_qkvpacked_equals_unpacked(causal, device):
    gen = torch.Generator().manual_seed(4)
    lengths = [5, 0, 23, 1]
    qkv, cu = randn(gen, sum(lengths), 3, 2, 24, device=device), cu_seqlens(lengths, device)
    kw = dict(causal=causal, return_attn_probs=True)
    packed = run(lambda t, **k: flashtriton.flash_attn_varlen_qkvpacked_func(t, cu, max(lengths), **k), [qkv],
                 torch.Generator().manual_seed(5), **kw)
    unpacked = run(lambda q, k, v, **a: flashtriton.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths),
                                                                            max(lengths), **a),
                   [t.contiguous() for t in qkv.unbind(1)], torch.Generator().manual_seed(5), **kw)
    assert packed[1].shape == (2, sum(lengths))
    assert_same((packed[0], packed[1], packed[2][0].unbind(1)), unpacked)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_kvpacked_gqa_equals_unpacked(causal, device):
    gen = torch.Generator().manual_seed(6)
    lq, lk = [3, 12, 1, 4], [7, 20, 0, 9]  # Sq != Sk per sequence; a sequence without keys
    q, kv = randn(gen, sum(lq), 4, 16, device=device), randn(gen, sum(lk), 2, 1, 16, device=device)
    cq, ck = cu_seqlens(lq, device), cu_seqlens(lk, device)
    packed = run(lambda a, b, **k: flashtriton.flash_attn_varlen_kvpacked_func(a, b, cq, ck, max(lq), max(lk), **k),
                 [q, kv], torch.Generator().manual_seed(7), causal=causal)
    unpacked = run(lambda a, b, c, **k: flashtriton.flash_attn_varlen_func(a, b, c, cq, ck, max(lq), max(lk), **k),
                   [q, *(t.contiguous() for t in kv.unbind(1))], torch.Generator().manual_seed(7), causal=causal)
    assert_same((packed[0], packed[1], [packed[2][0], *packed[2][1].unbind(1)]), unpacked)


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_variants_pass_through(name, device):
    """window, softcap, ALiBi, a negative scale and learnable sinks (keyword-only), with their gradients."""
    gen = torch.Generator().manual_seed(8)
    heads, dim, batch = 4, 16, 2
    variant = dict(softmax_scale=-0.3, window_size=(5, 2), softcap=4.0, return_attn_probs=True,
                   alibi_slopes=torch.rand(heads, generator=gen).to(device))
    sink = randn(gen, heads, dtype=torch.float32, device=device)
    lengths = [9, 14]
    cu, seq = cu_seqlens(lengths, device), max(lengths)
    if name == "flash_attn_qkvpacked_func":
        packed_leaves, split = [randn(gen, batch, 14, 3, heads, dim, device=device)], lambda g: g[0].unbind(2)
        packed_fn, unpacked_fn = flashtriton.flash_attn_qkvpacked_func, flashtriton.flash_attn_func
    elif name == "flash_attn_kvpacked_func":
        packed_leaves = [randn(gen, batch, 11, heads, dim, device=device),
                         randn(gen, batch, 14, 2, 2, dim, device=device)]
        split = lambda g: [g[0], *g[1].unbind(2)]  # noqa: E731
        packed_fn, unpacked_fn = flashtriton.flash_attn_kvpacked_func, flashtriton.flash_attn_func
    elif name == "flash_attn_varlen_qkvpacked_func":
        packed_leaves, split = [randn(gen, sum(lengths), 3, heads, dim, device=device)], lambda g: g[0].unbind(1)
        packed_fn = lambda qkv, **k: flashtriton.flash_attn_varlen_qkvpacked_func(qkv, cu, seq, **k)  # noqa: E731
        unpacked_fn = lambda q, k, v, **a: flashtriton.flash_attn_varlen_func(q, k, v, cu, cu, seq, seq, **a)  # noqa
    else:
        packed_leaves = [randn(gen, sum(lengths), heads, dim, device=device),
                         randn(gen, sum(lengths), 2, 2, dim, device=device)]
        split = lambda g: [g[0], *g[1].unbind(1)]  # noqa: E731
        packed_fn = lambda q, kv, **k: flashtriton.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, seq, seq, **k)  # noqa
        unpacked_fn = lambda q, k, v, **a: flashtriton.flash_attn_varlen_func(q, k, v, cu, cu, seq, seq, **a)  # noqa
    unpacked_leaves = [t.contiguous() for t in split(packed_leaves)]
    sinks = [sink.clone().requires_grad_(), sink.clone().requires_grad_()]
    packed = run(packed_fn, packed_leaves, torch.Generator().manual_seed(9), learnable_sink=sinks[0], **variant)
    unpacked = run(unpacked_fn, unpacked_leaves, torch.Generator().manual_seed(9), learnable_sink=sinks[1], **variant)
    assert_same((packed[0], packed[1], split(packed[2])), unpacked)
    assert sinks[0].grad is not None and torch.equal(sinks[0].grad, sinks[1].grad)


def test_views_reach_the_kernels_without_a_copy(device, monkeypatch):
    """The launchers get q, k, v as views into qkv's storage (forward and backward); qkv's gradient is one tensor."""
    seen = []

    def spy(original):
        def launcher(*args, **kwargs):
            seen.append([(t.data_ptr(), t.stride()) for t in args[:4] if isinstance(t, torch.Tensor)])
            return original(*args, **kwargs)
        return launcher

    monkeypatch.setattr(ops_module, "attention_forward", spy(ops_module.attention_forward))
    monkeypatch.setattr(backward_module, "attention_backward", spy(backward_module.attention_backward))
    gen = torch.Generator().manual_seed(10)
    qkv = randn(gen, 2, 17, 3, 4, 32, device=device).requires_grad_()
    out = flashtriton.flash_attn_qkvpacked_func(qkv, causal=True)
    out.float().sum().backward()
    base, item = qkv.data_ptr(), qkv.element_size()
    views = [(base + i * 4 * 32 * item, qkv[:, :, i].stride()) for i in range(3)]
    assert seen[0][:3] == views  # forward: q, k, v
    assert seen[1][1:4] == views  # backward: dout, then q, k, v
    assert qkv.grad.shape == qkv.shape and qkv.grad.is_contiguous()


def test_dropout_passes_through(device):
    """Under one torch.manual_seed the packed calls draw the unpacked call's (seed, offset): the same mask, bitwise
    the same output; a bad dropout_p is refused with the unpacked call's message."""
    gen = torch.Generator().manual_seed(11)
    qkv = randn(gen, 1, 8, 3, 2, 16, device=device)
    torch.manual_seed(5)
    unpacked = flashtriton.flash_attn_func(*qkv.unbind(2), dropout_p=0.1)
    with pytest.raises(ValueError) as bad_unpacked:
        flashtriton.flash_attn_func(*qkv.unbind(2), dropout_p=1.5)
    cu = cu_seqlens([8], device)
    calls = [
        lambda p: flashtriton.flash_attn_qkvpacked_func(qkv, p),
        lambda p: flashtriton.flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:], dropout_p=p),
        lambda p: flashtriton.flash_attn_varlen_qkvpacked_func(qkv[0], cu, 8, p)[None],
        lambda p: flashtriton.flash_attn_varlen_kvpacked_func(qkv[0, :, 0], qkv[0, :, 1:], cu, cu, 8, 8,
                                                              dropout_p=p)[None],
    ]
    for call in calls:
        torch.manual_seed(5)
        assert torch.equal(call(0.1), unpacked)
        with pytest.raises(ValueError) as bad:
            call(1.5)
        assert str(bad.value) == str(bad_unpacked.value)


def test_bad_layouts_raise_naming_the_argument(device):
    gen = torch.Generator().manual_seed(12)
    qkv = randn(gen, 1, 8, 3, 2, 16, device=device)
    cu = cu_seqlens([8], device)
    with pytest.raises(ValueError, match=r"qkv must have size 3 in dim 2"):
        flashtriton.flash_attn_qkvpacked_func(qkv[:, :, :2])
    with pytest.raises(ValueError, match=r"qkv must have 5 dims"):
        flashtriton.flash_attn_qkvpacked_func(qkv[0])
    with pytest.raises(ValueError, match=r"kv must have size 2 in dim 2"):
        flashtriton.flash_attn_kvpacked_func(qkv[:, :, 0], qkv)
    with pytest.raises(ValueError, match=r"qkv must have size 3 in dim 1"):
        flashtriton.flash_attn_varlen_qkvpacked_func(qkv[0, :, :2], cu, 8)
    with pytest.raises(ValueError, match=r"kv must have size 2 in dim 1"):
        flashtriton.flash_attn_varlen_kvpacked_func(qkv[0, :, 0], qkv[0, :, :1], cu, cu, 8, 8)
    with pytest.raises(ValueError, match=r"kv must have 4 dims"):
        flashtriton.flash_attn_varlen_kvpacked_func(qkv[0, :, 0], qkv[:, :, 1:], cu, cu, 8, 8)
    strided = randn(gen, 1, 8, 3, 16, 2, device=device).transpose(-1, -2)  # (1, 8, 3, 2, 16), last dim stride 2
    with pytest.raises(ValueError, match=r"qkv must have a contiguous last dim"):
        flashtriton.flash_attn_qkvpacked_func(strided)
    with pytest.raises(ValueError, match=r"kv must have a contiguous last dim"):
        flashtriton.flash_attn_kvpacked_func(qkv[:, :, 0], strided[:, :, 1:])
    with pytest.raises(TypeError, match=r"qkv must be a torch.Tensor"):
        flashtriton.flash_attn_qkvpacked_func(qkv.tolist())
    with pytest.raises(TypeError, match=r"qkv must be float16, bfloat16 or float32"):
        flashtriton.flash_attn_qkvpacked_func(qkv.to(torch.float64))
    with pytest.raises(TypeError, match=r"must share one dtype"):
        flashtriton.flash_attn_kvpacked_func(qkv[:, :, 0].float(), qkv[:, :, 1:])
    with pytest.raises(ValueError, match=r"head dim"):
        flashtriton.flash_attn_kvpacked_func(qkv[:, :, 0, :, :8], qkv[:, :, 1:])


def test_torch_compile_fullgraph(device):
    """The views and the stacked gradient trace into one graph around flashtriton's op."""
    import torch._dynamo.testing

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(14)
    qkv = randn(gen, 1, 9, 3, 2, 16, device=device)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda t: flashtriton.flash_attn_qkvpacked_func(t, causal=True), backend=counter,
                             fullgraph=True)
    eager = run(lambda t: flashtriton.flash_attn_qkvpacked_func(t, causal=True), [qkv],
                torch.Generator().manual_seed(15))
    traced = run(compiled, [qkv], torch.Generator().manual_seed(15))
    assert counter.frame_count == 1
    assert_same(traced, eager)


@pytest.mark.gpu
def test_forward_allocates_no_copy_of_qkv_on_the_gpu():
    """Peak memory of the packed forward: out and lse, no copy of qkv or of one of its thirds."""
    gen = torch.Generator().manual_seed(13)
    qkv = randn(gen, 2, 4096, 3, 16, 128, device="cuda")
    flashtriton.flash_attn_qkvpacked_func(qkv, causal=True)  # compile and build the plans first
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, lse, _ = flashtriton.flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra < out.nbytes + lse.nbytes + 4 * 2**20, (extra, out.nbytes, qkv.nbytes)
    unpacked = flashtriton.flash_attn_func(*(t.contiguous() for t in qkv.unbind(2)), causal=True)
    torch.testing.assert_close(out, unpacked, atol=2e-3, rtol=0)
