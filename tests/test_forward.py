"""Forward pass: flashtriton against float64, judged relative to torch's own error in the same dtype."""

import dataclasses
import math

import pytest
import torch

import flashtriton
from flashtriton.kernels.forward import _launch_forward_tma, attention_forward
from flashtriton.kernels.variant import Variant
from flashtriton.reference import attention_reference, sdpa_reference

from accuracy import assert_close_to_exact, torch_attention


def make_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape_q, shape_k = (batch, seqlen_q, heads_q, head_dim), (batch, seqlen_k, heads_kv, head_dim)
    q, k, v = (torch.randn(s, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
               for s in (shape_q, shape_k, shape_k))
    return q, k, v


def check_forward(q, k, v, causal, softmax_scale=None):
    out, lse, _ = flashtriton.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                              return_attn_probs=True)
    exact, exact_lse = attention_reference(q, k, v, softmax_scale, causal, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close_to_exact(out, torch_attention(q, k, v, softmax_scale, causal), exact, q.dtype)
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    seen = torch.isfinite(exact_lse)
    assert torch.equal(torch.isfinite(lse), seen), "lse must be -inf exactly on rows that see no key"
    torch.testing.assert_close(lse[seen].double(), exact_lse[seen], atol=1e-3, rtol=1e-3)
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen", [1, 17, 64, 257])
def test_sequence_lengths(seqlen, causal, device):
    check_forward(*make_qkv(2, seqlen, seqlen, 2, 2, 64, torch.float16, device), causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(17, 64), (64, 17), (1, 100), (100, 1), (33, 250)])
def test_seqlen_q_differs_from_seqlen_k(seqlen_q, seqlen_k, causal, device):
    check_forward(*make_qkv(2, seqlen_q, seqlen_k, 2, 2, 40, torch.float16, device), causal)


@pytest.mark.parametrize("head_dim", [1, 16, 40, 64, 80, 96, 111, 128, 200, 256])
def test_head_dims(head_dim, device):
    check_forward(*make_qkv(1, 33, 47, 2, 2, head_dim, torch.float16, device), causal=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_dtypes(dtype, head_dim, device):
    check_forward(*make_qkv(2, 65, 80, 2, 2, head_dim, dtype, device), causal=True)


@pytest.mark.parametrize("heads_q,heads_kv", [(8, 2), (4, 1), (6, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_grouped_and_multi_query(heads_q, heads_kv, causal, device):
    check_forward(*make_qkv(2, 40, 70, heads_q, heads_kv, 64, torch.bfloat16, device), causal)


def test_softmax_scale(device):
    check_forward(*make_qkv(1, 30, 30, 2, 2, 32, torch.float16, device), causal=False, softmax_scale=0.3)


def test_rows_that_see_no_key_give_zero_and_minus_inf(device):
    q, k, v = make_qkv(1, 50, 20, 2, 2, 64, torch.float16, device)
    out, lse = check_forward(q, k, v, causal=True)
    # bottom-right: query i sees keys j <= i - 30, so rows 0..29 see nothing
    assert torch.all(out[:, :30] == 0) and torch.all(lse[:, :, :30] == float("-inf"))
    assert torch.isfinite(lse[:, :, 30:]).all()


def test_packed_qkv_slices_need_no_copy(device):
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(2, 37, 3, 4, 64, generator=gen).to(device=device, dtype=torch.float16)
    q, k, v = qkv.unbind(dim=2)  # (B, S, H, D) views with stride 3*H*D along S
    assert not q.is_contiguous()
    check_forward(q, k, v, causal=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_broadcast_inputs(head_dim, causal, device):
    """Stride-0 (expanded) dimensions, as a batch-shared prompt or heads shared by expand give: read as they are
    (not copied), by the portable kernels (TMA descriptors are not given broadcast dimensions)."""
    from flashtriton.kernels.common import tma_layout_ok

    q, k, v = make_qkv(3, 200, 150, 4, 1, head_dim, torch.float16, device, seed=2)
    k, v = (t[:1].expand(3, -1, 4, -1) for t in (k, v))  # one sequence and one head, broadcast
    assert k.stride(0) == 0 and k.stride(2) == 0
    assert not tma_layout_ok(q.device, q.dtype, (k.shape, k.stride()))
    check_forward(q, k, v, causal)


def test_tma_shape_rules():
    """What the shapes and strides decide about the TMA kernels (remembered per shape: the backward asks each call;
    on a CPU `tma_layout_ok` says no before it asks): head dims in the list, no empty or broadcast dimension, every
    stride but the last a multiple of 16 bytes."""
    from flashtriton.kernels.common import _tma_shapes_ok

    dims = (64, 128)
    dense = torch.empty(2, 100, 4, 128, dtype=torch.float16)
    assert _tma_shapes_ok(dims, 2, ((dense.shape, dense.stride()),))
    assert _tma_shapes_ok(dims, 2, ((dense.shape, dense.stride()), (dense[:, :, :, :64].shape, dense.stride())))
    assert not _tma_shapes_ok((64,), 2, ((dense.shape, dense.stride()),))  # head dim 128 not in the list
    assert not _tma_shapes_ok(dims, 2, ((torch.Size([2, 0, 4, 128]), dense.stride()),))  # empty
    shared = dense[:1].expand(2, -1, -1, -1)  # a broadcast batch
    assert not _tma_shapes_ok(dims, 2, ((shared.shape, shared.stride()),))
    odd = torch.empty(2, 100, 3, 132, dtype=torch.float16)[..., :128]  # token stride 3 * 132 * 2 bytes: not 16-aligned
    assert not _tma_shapes_ok(dims, 2, ((odd.shape, odd.stride()),))
    assert _tma_shapes_ok(dims, 4, ((odd.shape, odd.stride()),))  # the same strides in 4-byte elements: aligned


def test_non_contiguous_last_dim_is_accepted(device):
    q, k, v = make_qkv(1, 20, 20, 2, 2, 32, torch.float16, device)
    q_strided = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, last-dim stride != 1
    assert q_strided.stride(-1) != 1
    torch.testing.assert_close(flashtriton.flash_attn_func(q_strided, k, v), flashtriton.flash_attn_func(q, k, v))


@pytest.mark.parametrize("config", [(32, 32, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), (128, 64, 4, 2), (16, 16, 1, 1)])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(100, 100), (40, 130), (130, 40)])
def test_forced_tile_configs_cover_the_masking_stages(config, seqlen_q, seqlen_k, device):
    block_m, block_n, warps, stages = config
    q, k, v = make_qkv(1, seqlen_q, seqlen_k, 2, 1, 48, torch.float16, device)
    out, lse = attention_forward(q, k, v, 1 / math.sqrt(48), True,
                                 config=dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages))
    exact = attention_reference(q, k, v, causal=True)
    assert_close_to_exact(out, torch_attention(q, k, v, causal=True), exact, torch.float16)


# Hopper's TMA kernel: flash_attn_func takes it on sm_90 for fp16/bf16 with head dim 64 or 128 (the rest of this
# file covers it there); here it is called directly, so that the interpreter runs it on a CPU too.
@pytest.mark.parametrize("causal,bottom_right", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("seqlen_q,seqlen_k,heads_q,heads_kv", [(17, 17, 2, 2), (100, 37, 4, 2), (37, 100, 2, 1),
                                                                 (1, 65, 2, 2)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tma_kernel(seqlen_q, seqlen_k, heads_q, heads_kv, causal, bottom_right, dtype, head_dim, device):
    if device == "cuda" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("TMA descriptors: Hopper (sm_90) only")
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, device)
    exact, exact_lse = attention_reference(q, k, v, None, causal, bottom_right, return_lse=True)
    same_dtype = torch_attention(q, k, v, None, causal, bottom_right)
    configs = [(32, 16, 4, 1, 0)] if device == "cpu" else [(64, 64, 4, 3, 0), (128, 128, 8, 3, 0), (64, 64, 4, 3, 128)]
    for bm, bn, warps, stages, maxnreg in configs:  # maxnreg: a register cap (the D=64 causal dispatch's)
        out = torch.empty_like(q)
        lse = torch.full((2, heads_q, seqlen_q), float("nan"), dtype=torch.float32, device=device)
        config = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages, "maxnreg": maxnreg}
        _launch_forward_tma(q, k, v, out, lse, head_dim ** -0.5, causal, bottom_right, config)
        assert_close_to_exact(out, same_dtype, exact, dtype, f"config {config}")
        seen = torch.isfinite(exact_lse)
        assert torch.equal(torch.isfinite(lse), seen), "lse must be -inf exactly on rows that see no key"
        torch.testing.assert_close(lse[seen].double(), exact_lse[seen], atol=1e-3, rtol=1e-3)
        assert torch.all(out[~seen.transpose(1, 2)] == 0)


TMA_VARIANTS = [Variant(window=(7, 3)), Variant(causal=True, window=(20, 0), softcap=5.0),
                Variant(alibi_slopes=0.3 / torch.arange(1.0, 3.0)),
                Variant(causal=True, window=(16, 0), sinks=torch.tensor([1.5, -0.5]))]


@pytest.mark.parametrize("variant", TMA_VARIANTS, ids=lambda v: "-".join(sorted(v.fields())))
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(37, 91), (91, 37)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tma_kernel_variants(variant, seqlen_q, seqlen_k, dtype, device):
    """The TMA kernel with windows (masked left edge, unmasked interior, masked right edge), softcap, ALiBi and
    sinks against float64, judged against torch's error in the same dtype."""
    if device == "cuda" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("TMA descriptors: Hopper (sm_90) only")
    from test_features import _torch_same_dtype

    q, k, v = make_qkv(1, seqlen_q, seqlen_k, 2, 1, 64, dtype, device)
    slopes = None if variant.alibi_slopes is None else variant.alibi_slopes.to(device)
    sinks = None if variant.sinks is None else variant.sinks.to(device)
    variant = dataclasses.replace(variant, alibi_slopes=slopes, sinks=sinks)
    exact, exact_lse = attention_reference(q, k, v, variant=variant, return_lse=True)
    same_dtype = _torch_same_dtype(q, k, v, variant, sinks)
    out = torch.empty_like(q)
    lse = torch.full((1, 2, seqlen_q), float("nan"), dtype=torch.float32, device=device)
    config = {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    _launch_forward_tma(q, k, v, out, lse, 64 ** -0.5, variant.causal, True, config, variant=variant,
                        alibi_slopes=slopes, learnable_sink=sinks)
    assert_close_to_exact(out, same_dtype, exact, dtype)
    seen = torch.isfinite(exact_lse)
    assert torch.equal(torch.isfinite(lse), seen), "lse must be -inf exactly on rows that see no key"
    torch.testing.assert_close(lse[seen].double(), exact_lse[seen], atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(40, 40), (20, 60), (60, 20)])
def test_sdpa_api_is_top_left_causal_in_bhsd_layout(seqlen_q, seqlen_k, device):
    q, k, v = (t.transpose(1, 2) for t in make_qkv(2, seqlen_q, seqlen_k, 4, 2, 64, torch.float16, device))
    out = flashtriton.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out.shape == q.shape
    assert_close_to_exact(out, torch_out, sdpa_reference(q, k, v, is_causal=True), torch.float16)


@pytest.mark.parametrize("shape", [(0, 16, 16), (2, 0, 16), (2, 16, 0)])
def test_empty_inputs_return_shaped_results(shape, device):
    batch, seqlen_q, seqlen_k = shape
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, 2, 2, 32, torch.float16, device)
    out, lse, _ = flashtriton.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (batch, 2, seqlen_q)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


def check_large(q, k, v, causal, heads_q=2):
    """Run the whole problem, judge batch 0 and the first `heads_q` query heads (the float64 reference of
    the whole problem would need tens of GiB)."""
    out, lse, _ = flashtriton.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    heads_kv = heads_q * k.shape[2] // q.shape[2]
    qs, ks, vs = q[:1, :, :heads_q], k[:1, :, :heads_kv], v[:1, :, :heads_kv]
    exact, exact_lse = attention_reference(qs, ks, vs, None, causal, return_lse=True)
    assert_close_to_exact(out[:1, :, :heads_q], torch_attention(qs, ks, vs, None, causal), exact, q.dtype)
    torch.testing.assert_close(lse[:1, :heads_q].double(), exact_lse, atol=1e-3, rtol=1e-3)
    assert torch.isfinite(out).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch,seqlen,heads,head_dim", [(2, 4096, 16, 128), (1, 16384, 8, 64), (2, 2048, 8, 256),
                                                         (4, 1000, 12, 80)])
def test_large_shapes(batch, seqlen, heads, head_dim, causal, dtype, device):
    check_large(*make_qkv(batch, seqlen, seqlen, heads, heads, head_dim, dtype, device), causal)


@pytest.mark.gpu
def test_large_gqa_uneven_lengths(device):
    check_large(*make_qkv(2, 3000, 5001, 32, 8, 128, torch.bfloat16, device), causal=True, heads_q=8)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen", [1, 77, 300])
def test_portable_path_forced_on_every_gpu(causal, seqlen, device, monkeypatch):
    """The portable (Ampere) kernel stays correct where the TMA kernel would be taken (sm_90, D=128)."""
    from flashtriton.kernels import dispatch

    q, k, v = make_qkv(2, seqlen, seqlen, 4, 2, 128, torch.bfloat16, device)
    exact = attention_reference(q, k, v, causal=causal)
    same_dtype = torch_attention(q, k, v, causal=causal)
    # (off a GPU both levels run the portable kernel: once is enough there)
    for use_tma in (False, True) if device == "cuda" else (False,):
        monkeypatch.setattr(dispatch, "CHOICE", dispatch.Choice(level="tma" if use_tma else "portable"))
        out = flashtriton.flash_attn_func(q, k, v, causal=causal)
        assert_close_to_exact(out, same_dtype, exact, torch.bfloat16, f"USE_TMA={use_tma}")


@pytest.mark.parametrize("causal", [False, True])
def test_unaligned_inputs_after_aligned_ones_of_the_same_shape(causal, device):
    """A call shape's launch plan (on Hopper: the TMA kernel, compiled once, relaunched directly) is only taken
    for 16-byte aligned addresses; the same shapes and strides at an unaligned address must take the portable
    kernel and stay right, and the aligned tensors must still be right after that. (Off a GPU no plan is kept:
    a short sequence checks the unaligned inputs alone.)"""
    seqlen = 200 if device == "cuda" else 40
    q, k, v = make_qkv(2, seqlen, seqlen, 4, 2, 128, torch.float16, device)

    def shifted(t):  # same values, shape and strides; the data 2 bytes past a 16-byte boundary
        flat = torch.empty(t.numel() + 8, dtype=t.dtype, device=t.device)
        view = flat[1:1 + t.numel()].view(t.shape)
        view.copy_(t)
        return view

    for _ in range(2):
        expected, _ = check_forward(q, k, v, causal)
    for args in ((shifted(q), k, v), (q, shifted(k), v), (q, k, shifted(v))):
        out, _ = check_forward(*args, causal)
        torch.testing.assert_close(out, expected, atol=2e-3, rtol=0)
    assert torch.equal(check_forward(q, k, v, causal)[0], expected)


@pytest.mark.parametrize("window", [(0, 0), (2, 0), (5, 3)])
def test_rows_whose_scores_are_all_far_below_zero(window, device):
    """fp16 rows whose every score is far below 0 (here -32 each, natural log) and whose first key tile holds none
    of their keys (a window's left edge): their probabilities exp(s - m) are exact only with m the row's own
    maximum (a stand-in maximum of 0 underflows them all to 0 in fp16). Dense, varlen and KV-cache decoding."""
    gen = torch.Generator().manual_seed(3)
    sq, sk, d = 40, 70, 16
    q = torch.ones(1, sq, 2, d, dtype=torch.float16, device=device)
    k = torch.full((1, sk, 1, d), -2.0, dtype=torch.float16, device=device)
    v = torch.randn(1, sk, 1, d, generator=gen).to(device=device, dtype=torch.float16)
    causal = window[1] == 0
    exact = attention_reference(q, k, v, 1.0, variant=Variant(causal=causal, window=window))
    low = attention_reference(q, k, v, 1.0, dtype=torch.float16, variant=Variant(causal=causal, window=window))
    out = flashtriton.flash_attn_func(q, k, v, softmax_scale=1.0, causal=causal, window_size=window)
    assert_close_to_exact(out, low, exact, torch.float16, "dense ")
    cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32, device=device) for n in (sq, sk))
    out = flashtriton.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, sq, sk, softmax_scale=1.0, causal=causal,
                                             window_size=window)
    assert_close_to_exact(out[None], low, exact, torch.float16, "varlen ")
    out = flashtriton.flash_attn_with_kvcache(q[:, -3:], k, v, softmax_scale=1.0, causal=causal, window_size=window,
                                              cache_seqlens=torch.tensor([sk], dtype=torch.int32, device=device))
    assert_close_to_exact(out, low[:, -3:], exact[:, -3:], torch.float16, "decode ")
