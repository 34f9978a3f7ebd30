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
