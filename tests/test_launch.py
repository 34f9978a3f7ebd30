"""The cached launch path (`flashtriton.kernels.launch`): its key, and on the GPU that a launch through a
remembered compiled kernel gives the same result as Triton's own path for every argument that changes."""

import pytest
import torch

from conftest import DEVICE
from flashtriton import flash_attn_func, flash_attn_with_kvcache
from flashtriton.kernels import launch as L
from flashtriton.reference import attention_reference


def test_no_launch_hooks_by_default():
    assert not L._hooks_installed()  # otherwise the cached path would never be taken


def test_arg_key_separates_what_triton_specializes_on():
    base = torch.zeros(64, dtype=torch.float16)
    assert L._arg_key(base) == (torch.float16, True)
    assert L._arg_key(base[1:]) == (torch.float16, False)  # 2-byte offset: not 16-byte aligned
    assert L._arg_key(base[8:]) == (torch.float16, True)
    assert L._arg_key(base.float()) == (torch.float32, True)
    assert L._arg_key(1) != L._arg_key(16) != L._arg_key(17)  # exact int values
    assert L._arg_key(0.5) == L._arg_key(2.0) == float
    assert L._arg_key(None) is None
    with pytest.raises(TypeError):
        L._arg_key("text")
    if L.TensorDescriptor is not None:  # TMA descriptors: keyed on dtype, alignment, shape, strides and block
        x = torch.zeros(4, 32, 2, 64, dtype=torch.float16)
        d1 = L.TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 16, 1, 64])
        d2 = L.TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 32, 1, 64])
        y = x[:, :16]
        d3 = L.TensorDescriptor(y, list(y.shape), list(y.stride()), [1, 16, 1, 64])
        assert len({L._arg_key(d1), L._arg_key(d2), L._arg_key(d3)}) == 3
        assert L._arg_key(d1) == L._arg_key(L.TensorDescriptor(x.clone(), list(x.shape), list(x.stride()), [1, 16, 1, 64]))


def test_launch_tail_takes_defaults_that_a_call_leaves_out():
    """A call shape whose launch leaves a defaulted constexpr out (the dropout flags without dropout) is remembered
    with the default, as Triton binds it, instead of taking Triton's argument binding on every call; a parameter
    with no value and no default keeps Triton's path (which names it)."""
    import inspect

    from flashtriton.kernels.backward import _attn_bwd_dkdv

    params = list(inspect.signature(_attn_bwd_dkdv.fn).parameters.values())
    n_args = 20
    empty = inspect.Parameter.empty
    meta = {p.name: i for i, p in enumerate(params[n_args:]) if p.default is empty}
    assert any(p.name == "HAS_DROPOUT" and p.default is False for p in params[n_args:])
    tail = L.launch_tail(_attn_bwd_dkdv, n_args, meta)
    assert len(tail) == len(params) - n_args
    for p, value in zip(params[n_args:], tail):
        assert value == (p.default if p.default is not empty else meta[p.name]), p.name
    dropout_at = [p.name for p in params[n_args:]].index("HAS_DROPOUT")
    assert L.launch_tail(_attn_bwd_dkdv, n_args, dict(meta, HAS_DROPOUT=True))[dropout_at] is True
    first_required = next(p.name for p in params[n_args:] if p.default is empty)
    assert L.launch_tail(_attn_bwd_dkdv, n_args, {k: v for k, v in meta.items() if k != first_required}) is None


@pytest.mark.gpu
def test_cached_launch_matches_reference_when_arguments_change():
    torch.manual_seed(0)
    before = L.cache_size()
    for seqlen, offset, causal in [(100, 0, False), (100, 0, False), (100, 1, False), (37, 0, True), (100, 0, False),
                                   (37, 0, True), (513, 0, True)]:
        storage = torch.randn(2 * seqlen * 4 * 64 + offset, device=DEVICE, dtype=torch.float16)
        q = storage[offset:].view(2, seqlen, 4, 64)  # offset 1: a base address that is not 16-byte aligned
        k, v = torch.randn_like(q), torch.randn_like(q)
        for _ in range(2):  # the second call of each shape takes the cached path
            out = flash_attn_func(q, k, v, causal=causal)
            ref = attention_reference(q, k, v, 64 ** -0.5, causal=causal)
            assert (out.double() - ref).abs().max().item() < 4e-3, (seqlen, offset, causal)
    assert L.cache_size() > before


@pytest.mark.gpu
def test_cached_decode_launch_follows_cache_lengths():
    torch.manual_seed(1)
    k_cache = torch.randn(3, 4096, 2, 128, device=DEVICE, dtype=torch.float16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(3, 1, 8, 128, device=DEVICE, dtype=torch.float16)
    with torch.no_grad():
        for lengths in ([4096, 1, 700], [5, 4000, 0], [4096, 4096, 4096], [5, 4000, 0]):
            seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
            for splits in (0, 1, 4):
                out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=splits)
                for b, n in enumerate(lengths):
                    if n == 0:
                        assert out[b].abs().max().item() == 0.0
                        continue
                    ref = attention_reference(q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n], 128 ** -0.5)
                    assert (out[b:b + 1].double() - ref).abs().max().item() < 2e-3, (lengths, splits, b)


def test_on_inputs_device_runs_the_function_with_its_arguments(monkeypatch):
    """On the CPU (and for inputs on the current GPU) the wrapper only calls through; for inputs on another GPU
    it makes that GPU current for the call (checked with a stand-in device context)."""
    seen = []
    wrapped = L.on_inputs_device(lambda t, x, key=None: seen.append((t.device, x, key)) or x * 2)
    cpu = torch.zeros(2)
    assert wrapped(cpu, 21, key="k") == 42 and seen == [(cpu.device, 21, "k")]

    class FakeCuda:  # a tensor-like first argument on "cuda:3" while cuda:0 is current
        device = torch.device("cuda", 3)

    entered = []

    class Guard:
        def __init__(self, index):
            entered.append(index)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", Guard)
    assert wrapped(FakeCuda(), 5) == 10 and entered == [3]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert wrapped(FakeCuda(), 6) == 12 and entered == [3]  # already current: no guard


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_inputs_on_a_gpu_that_is_not_current():
    """Tensors on cuda:1 while cuda:0 is current (a model spread over GPUs): forward, backward and decode run on
    cuda:1 and match the same calls made with cuda:1 current."""
    torch.cuda.set_device(0)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 300, 4, 128, generator=gen).to("cuda:1", torch.float16).requires_grad_()
               for _ in range(3))
    out = flash_attn_func(q, k, v, causal=True)
    out.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    with torch.cuda.device(1):
        for t in (q, k, v):
            t.grad = None
        expected = flash_attn_func(q, k, v, causal=True)
        expected.sum().backward()
    assert out.device == torch.device("cuda:1") and torch.equal(out, expected)
    for got, t in zip(grads, (q, k, v)):
        assert torch.equal(got, t.grad)
    cache = torch.randn(2, 4096, 4, 128, generator=gen).to("cuda:1", torch.float16)
    lens = torch.tensor([4000, 17], dtype=torch.int32, device="cuda:1")
    with torch.no_grad():
        dec = flash_attn_with_kvcache(q[:, :1].detach(), cache, cache, cache_seqlens=lens)
        with torch.cuda.device(1):
            assert torch.equal(dec, flash_attn_with_kvcache(q[:, :1].detach(), cache, cache, cache_seqlens=lens))
