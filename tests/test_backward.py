"""Backward pass: flashtriton's gradients (through the public autograd path) against float64.

Judged as the forward is (tests/accuracy.py): error vs the float64 gradient <= 2 x the error of torch SDPA's
own gradient in the same dtype + half an ulp of the largest gradient (the rounding every stored gradient
carries: 2^-11 fp16, 2^-8 bf16, 2^-22 fp32, relative to max(|exact|, 1)). Where torch's gradient is not finite
(rows that see no key) the comparison is the reference computed in the inputs' dtype instead.
"""

import math

import pytest
import torch

import flashtriton
from flashtriton import configs
from flashtriton.kernels.backward import attention_backward
from flashtriton.kernels.forward import attention_forward
from flashtriton.reference import attention_reference, sdpa_reference

from accuracy import assert_close_to_exact, torch_attention


def randn(shape, dtype, device, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)


def make_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, device, seed=0):
    """Fresh random q, k, v (B, S, H, D) and an upstream gradient dout shaped like q."""
    gen = torch.Generator().manual_seed(seed)
    shape_q, shape_k = (batch, seqlen_q, heads_q, head_dim), (batch, seqlen_k, heads_kv, head_dim)
    return (randn(shape_q, dtype, device, gen), randn(shape_k, dtype, device, gen),
            randn(shape_k, dtype, device, gen), randn(shape_q, dtype, device, gen))


def grads(fn, q, k, v, dout):
    """(out, (dq, dk, dv)) of fn(q, k, v) for the upstream gradient dout."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(dout.to(out.dtype))
    return out, tuple(t.grad for t in leaves)


def torch_grads(q, k, v, dout, causal, bottom_right=True, softmax_scale=None):
    """torch's gradients in the inputs' dtype: SDPA, or the reference run in that dtype where SDPA's are NaN."""
    _, g = grads(lambda a, b, c: torch_attention(a, b, c, softmax_scale, causal, bottom_right), q, k, v, dout)
    if all(torch.isfinite(t).all() for t in g):
        return g
    fn = lambda a, b, c: attention_reference(a, b, c, softmax_scale, causal, bottom_right, dtype=q.dtype)  # noqa: E731
    return grads(fn, q, k, v, dout)[1]


def check_grads(ours, q, k, v, dout, causal, bottom_right=True, softmax_scale=None, what=""):
    """ours = (dq, dk, dv) for (B, S, H, D) inputs; judged against float64 and torch in the same dtype."""
    fn = lambda a, b, c: attention_reference(a, b, c, softmax_scale, causal, bottom_right)  # noqa: E731
    _, exact = grads(fn, q, k, v, dout.double())
    theirs = torch_grads(q, k, v, dout, causal, bottom_right, softmax_scale)
    for name, g, t, e, x in zip(("dq", "dk", "dv"), ours, theirs, exact, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, f"{name}: {g.shape} {g.dtype}"
        assert_close_to_exact(g, t, e, q.dtype, f"{what}{name}")


def check_backward(q, k, v, dout, causal, softmax_scale=None):
    """Gradients of flashtriton.flash_attn_func (bottom-right causal) against float64."""
    fn = lambda a, b, c: flashtriton.flash_attn_func(a, b, c, softmax_scale=softmax_scale, causal=causal)  # noqa: E731
    _, ours = grads(fn, q, k, v, dout)
    check_grads(ours, q, k, v, dout, causal, softmax_scale=softmax_scale)
    return ours


@pytest.mark.parametrize("causal", [False, True])
def test_broadcast_inputs(causal, device):
    """k / v with stride-0 (expanded) batch and head dimensions: the gradient reaches the tensor they were expanded
    from, summed over the broadcast, as torch's own autograd through expand gives it."""
    q, k, v, dout = make_qkv(2, 150, 130, 4, 1, 128, torch.float16, device, seed=3)

    def grads_through_expand(fn, dtype):
        base = [t[:1].detach().to(dtype).requires_grad_() for t in (k, v)]
        fn(q.to(dtype), *(t.expand(2, -1, 4, -1) for t in base)).backward(dout.to(dtype))
        return [t.grad for t in base]

    ours = grads_through_expand(lambda a, b, c: flashtriton.flash_attn_func(a, b, c, causal=causal), q.dtype)
    theirs = grads_through_expand(lambda a, b, c: torch_attention(a, b, c, None, causal), q.dtype)
    exact = grads_through_expand(lambda a, b, c: attention_reference(a, b, c, None, causal), torch.float64)
    for name, g, t, e in zip(("dk", "dv"), ours, theirs, exact):
        assert_close_to_exact(g, t, e, q.dtype, name)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen", [1, 17, 64])
def test_sequence_lengths(seqlen, causal, device):
    check_backward(*make_qkv(2, seqlen, seqlen, 2, 2, 64, torch.float16, device), causal)


def test_longer_sequence(device):
    check_backward(*make_qkv(1, 257, 257, 1, 1, 64, torch.float16, device, seed=1), causal=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(17, 64), (64, 17), (1, 100), (100, 1), (33, 130)])
def test_seqlen_q_differs_from_seqlen_k(seqlen_q, seqlen_k, causal, device):
    check_backward(*make_qkv(1, seqlen_q, seqlen_k, 2, 2, 40, torch.float16, device), causal)


@pytest.mark.parametrize("head_dim", [1, 16, 40, 80, 128, 256])
def test_head_dims(head_dim, device):
    check_backward(*make_qkv(1, 33, 47, 2, 1, head_dim, torch.float16, device), causal=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_dtypes(dtype, head_dim, device):
    check_backward(*make_qkv(2, 65, 80, 2, 2, head_dim, dtype, device), causal=True)


@pytest.mark.parametrize("heads_q,heads_kv", [(8, 2), (4, 1), (6, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_grouped_and_multi_query(heads_q, heads_kv, causal, device):
    dq, dk, dv = check_backward(*make_qkv(2, 40, 70, heads_q, heads_kv, 64, torch.bfloat16, device), causal)
    assert dk.shape[2] == heads_kv and dv.shape[2] == heads_kv


def test_softmax_scale(device):
    check_backward(*make_qkv(1, 30, 30, 2, 2, 32, torch.float16, device), causal=False, softmax_scale=0.3)


def test_packed_qkv_slices_and_non_contiguous_dout(device):
    gen = torch.Generator().manual_seed(2)
    qkv = randn((2, 37, 3, 4, 64), torch.float16, device, gen)
    q, k, v = qkv.unbind(dim=2)  # (B, S, H, D) views with stride 3*H*D along S
    dout = randn((2, 4, 37, 64), torch.float16, device, gen).transpose(1, 2)  # (B, S, H, D) view of (B, H, S, D)
    assert not q.is_contiguous() and not dout.is_contiguous() and dout.stride(-1) == 1
    ours = check_backward(q, k, v, dout, causal=True)
    # the launcher itself takes the strided views as they are
    out, lse = attention_forward(q, k, v, 1 / 8, True)
    direct = attention_backward(dout, q, k, v, out, lse, 1 / 8, True)
    for a, b in zip(ours, direct):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rows_that_see_no_key_get_zero_gradient(dtype, device):
    q, k, v, dout = make_qkv(1, 50, 20, 2, 1, 64, dtype, device)
    dq, dk, dv = check_backward(q, k, v, dout, causal=True)
    # bottom-right: query i sees keys j <= i - 30, so rows 0..29 see nothing
    assert torch.all(dq[:, :30] == 0)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(40, 40), (20, 60), (60, 20)])
def test_sdpa_api_is_top_left_causal_in_bhsd_layout(seqlen_q, seqlen_k, device):
    q, k, v, dout = (t.transpose(1, 2) for t in make_qkv(2, seqlen_q, seqlen_k, 4, 2, 64, torch.float16, device))
    fn = lambda a, b, c: flashtriton.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)  # noqa: E731
    _, ours = grads(fn, q, k, v, dout)
    sdpa = lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        a, b, c, is_causal=True, enable_gqa=True)
    _, theirs = grads(sdpa, q, k, v, dout)
    _, exact = grads(lambda a, b, c: sdpa_reference(a, b, c, is_causal=True), q, k, v, dout.double())
    for name, g, t, e in zip(("dq", "dk", "dv"), ours, theirs, exact):
        assert g.shape == e.shape
        assert_close_to_exact(g, t, e, torch.float16, name)


def pack(lengths, heads, head_dim, dtype, device, gen):
    """Random packed tokens (total, H, D) and int32 cu_seqlens (B + 1,)."""
    x = randn((sum(lengths), heads, head_dim), dtype, device, gen)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return x, cu


@pytest.mark.parametrize("lengths_q,lengths_k,causal", [
    ([5, 0, 1, 70, 33], [5, 0, 1, 70, 33], True),
    ([3, 40, 1, 17, 0], [10, 20, 5, 0, 1], True),
    ([9, 1, 31], [14, 0, 31], False),
])
def test_varlen_equals_dense_per_sequence(lengths_q, lengths_k, causal, device):
    gen = torch.Generator().manual_seed(3)
    q, cu_q = pack(lengths_q, 4, 40, torch.float16, device, gen)
    k, cu_k = pack(lengths_k, 2, 40, torch.float16, device, gen)
    v, _ = pack(lengths_k, 2, 40, torch.float16, device, gen)
    dout, _ = pack(lengths_q, 4, 40, torch.float16, device, gen)
    fn = lambda a, b, c: flashtriton.flash_attn_varlen_func(  # noqa: E731
        a, b, c, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal)
    _, (dq, dk, dv) = grads(fn, q, k, v, dout)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for b, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lq == 0 or lk == 0:  # nothing is seen: every gradient of this sequence is 0
            assert torch.all(dq[sq] == 0) and torch.all(dk[sk] == 0) and torch.all(dv[sk] == 0)
            continue
        qb, kb, vb, dob = q[None, sq], k[None, sk], v[None, sk], dout[None, sq]  # (1, S, H, D)
        ours = (dq[None, sq], dk[None, sk], dv[None, sk])
        check_grads(ours, qb, kb, vb, dob, causal, what=f"seq {b} ")
        dense = grads(lambda a, b_, c: flashtriton.flash_attn_func(a, b_, c, causal=causal), qb, kb, vb, dob)[1]
        for x, y in zip(ours, dense):
            torch.testing.assert_close(x, y, atol=2e-3, rtol=2e-3)


def test_deterministic(device):
    q, k, v, dout = make_qkv(2, 100, 90, 4, 2, 64, torch.float16, device, seed=4)
    fn = lambda a, b, c: flashtriton.flash_attn_func(a, b, c, causal=True)  # noqa: E731
    first, second = grads(fn, q, k, v, dout)[1], grads(fn, q, k, v, dout)[1]
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("config", [(32, 64, 4, 2), (64, 32, 4, 2), (64, 64, 4, 2), (16, 16, 1, 1)])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(100, 100), (40, 130), (130, 40)])
def test_forced_tile_configs_cover_the_masking_stages(config, seqlen_q, seqlen_k, device):
    block_m, block_n, warps, stages = config
    q, k, v, dout = make_qkv(1, seqlen_q, seqlen_k, 2, 1, 48, torch.float16, device)
    scale = 1 / math.sqrt(48)
    out, lse = attention_forward(q, k, v, scale, True)
    forced = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    ours = attention_backward(dout, q, k, v, out, lse, scale, True, config=forced)
    check_grads(ours, q, k, v, dout, causal=True)


def test_forced_configs_per_kernel_and_top_left(device):
    q, k, v, dout = make_qkv(1, 70, 50, 2, 2, 32, torch.float16, device)
    out, lse = attention_forward(q, k, v, 0.2, True, causal_bottom_right=False)
    forced = {"dkdv": dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1),
              "dq": dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)}
    ours = attention_backward(dout, q, k, v, out, lse, 0.2, True, causal_bottom_right=False, config=forced)
    check_grads(ours, q, k, v, dout, causal=True, bottom_right=False, softmax_scale=0.2)


@pytest.mark.parametrize("shape", [(0, 16, 16), (2, 0, 16), (2, 16, 0)])
def test_empty_inputs_give_zero_gradients(shape, device):
    batch, seqlen_q, seqlen_k = shape
    q, k, v, dout = make_qkv(batch, seqlen_q, seqlen_k, 2, 2, 32, torch.float16, device)
    _, (dq, dk, dv) = grads(lambda a, b, c: flashtriton.flash_attn_func(a, b, c, causal=True), q, k, v, dout)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert all(torch.all(g == 0) for g in (dq, dk, dv))


@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim_padded", [16, 32, 64, 128, 256])
def test_config_pruning_keeps_measured_configs(kernel, dtype, head_dim_padded):
    all_configs = configs.BWD_DKDV_CONFIGS if kernel == "dkdv" else configs.BWD_DQ_CONFIGS
    prune = configs.prune_bwd_dkdv_configs if kernel == "dkdv" else configs.prune_bwd_dq_configs
    for bucket in (16, 128, 4096):
        args = {"Q": torch.empty(1, dtype=dtype), "BLOCK_D": head_dim_padded,
                "TUNE_SEQLEN_Q": bucket, "TUNE_SEQLEN_K": bucket}
        kept = prune(all_configs, args)
        assert kept and all(c in all_configs for c in kept)
        if bucket == 4096 and head_dim_padded == 256:  # wide tiles cannot hold D=256 accumulators
            assert all(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 64 for c in kept)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch,seqlen,heads,head_dim", [(2, 1024, 8, 128), (1, 4096, 4, 64), (1, 2048, 4, 256),
                                                         (2, 1000, 6, 80)])
def test_large_shapes(batch, seqlen, heads, head_dim, causal, dtype, device):
    check_backward(*make_qkv(batch, seqlen, seqlen, heads, heads, head_dim, dtype, device), causal)


@pytest.mark.gpu
def test_large_gqa_uneven_lengths(device):
    check_backward(*make_qkv(1, 1500, 3001, 16, 4, 128, torch.bfloat16, device), causal=True)


@pytest.mark.gpu
def test_large_fp32_and_determinism(device):
    q, k, v, dout = make_qkv(1, 2048, 2048, 4, 2, 128, torch.float32, device)
    first = check_backward(q, k, v, dout, causal=True)
    second = grads(lambda a, b, c: flashtriton.flash_attn_func(a, b, c, causal=True), q, k, v, dout)[1]
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_deterministic_requests_are_accepted(device):
    """deterministic=True (flash-attn's flag) is accepted by both entry points and changes nothing: the backward
    is always bitwise deterministic (dQ has its own kernel, no atomics). So is torch.use_deterministic_algorithms."""
    q, k, v, dout = make_qkv(1, 20, 20, 2, 1, 32, torch.float16, device)
    cu = torch.tensor([0, 20], dtype=torch.int32, device=device)

    def dense(deterministic):
        return lambda a, b, c: flashtriton.flash_attn_func(a, b, c, causal=True, deterministic=deterministic)

    def varlen(deterministic):
        return lambda a, b, c: flashtriton.flash_attn_varlen_func(a[0], b[0], c[0], cu, cu, 20, 20, causal=True,
                                                                  deterministic=deterministic)[None]

    for fn in (dense, varlen):
        _, plain = grads(fn(False), q, k, v, dout)
        _, flagged = grads(fn(True), q, k, v, dout)
        assert all(torch.equal(a, b) for a, b in zip(plain, flagged))
        check_grads(flagged, q, k, v, dout, causal=True, what=f"{fn.__name__} ")
        previous = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            _, under_torch_flag = grads(fn(True), q, k, v, dout)
        finally:
            torch.use_deterministic_algorithms(previous)
        assert all(torch.equal(a, b) for a, b in zip(plain, under_torch_flag))


def test_plan_kept_per_signature(device):
    """A backward call keeps its plan under its signature: the same shapes, strides, scale and variant take the same
    plan (and the same gradients, bit for bit); another scale or window a plan of its own; a pointer that is not
    16-byte aligned (a view one element in) a plan built for the call alone, its gradients exact too."""
    from flashtriton.kernels import backward as bwd

    q, k, v, dout = make_qkv(1, 70, 90, 4, 2, 32, torch.float16, device, seed=11)
    scale = 0.2

    def run(q, k, v, dout, window=(-1, -1), scale=scale):
        out, lse = attention_forward(q, k, v, scale, True, window_size=window)[:2]
        return attention_backward(dout, q, k, v, out, lse, scale, True, window_size=window)

    bwd._PLANS.clear()
    first = run(q, k, v, dout)
    assert len(bwd._PLANS) == 1
    plan = next(iter(bwd._PLANS.values()))
    second = run(q, k, v, dout)
    assert len(bwd._PLANS) == 1 and next(iter(bwd._PLANS.values())) is plan
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    check_grads(second, q, k, v, dout, True, softmax_scale=scale, what="kept plan ")

    windowed = run(q, k, v, dout, window=(20, 0))
    run(q, k, v, dout, scale=0.3)
    assert len(bwd._PLANS) == 3
    assert not all(torch.equal(a, b) for a, b in zip(first, windowed))

    # the same shapes and strides, one element (2 bytes) past an aligned address: not kept
    shifted = [torch.empty(t.numel() + 1, dtype=t.dtype, device=device)[1:].view(t.shape).copy_(t)
               for t in (q, k, v, dout)]
    assert shifted[0].data_ptr() % 16 and shifted[0].stride() == q.stride()
    moved = run(*shifted)
    assert len(bwd._PLANS) == 3
    check_grads(moved, q, k, v, dout, True, softmax_scale=scale, what="unaligned ")


def test_plan_key_counts_the_sequences(device):
    """Two varlen calls with the same packed tokens and longest sequence but a different number of sequences have
    plans of their own (the grids and the preprocess' parts count the sequences); both gradients are exact."""
    from flashtriton.kernels import backward as bwd

    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (randn((96, 2, 32), torch.float16, device, gen) for _ in range(4))
    sink = torch.randn(2, generator=gen).to(device)
    bwd._PLANS.clear()
    results = []
    for cuts in ((0, 40, 96), (0, 40, 56, 96)):
        cu = torch.tensor(cuts, dtype=torch.int32, device=device)
        out, lse = attention_forward(q, k, v, 0.25, True, True, cu, cu, 56, 56, learnable_sink=sink)[:2]
        results.append((cuts, attention_backward(dout, q, k, v, out, lse, 0.25, True, True, cu, cu, 56, 56,
                                                 learnable_sink=sink)))
    assert len(bwd._PLANS) == 2
    for cuts, grads in results:
        for a, b in zip(cuts[:-1], cuts[1:]):  # each sequence against the dense call on its tokens
            d = attention_forward(*(t[None, a:b] for t in (q, k, v)), 0.25, True, learnable_sink=sink)[:2]
            want = attention_backward(dout[None, a:b], *(t[None, a:b] for t in (q, k, v)), *d, 0.25, True,
                                      learnable_sink=sink)
            for got, ref in zip(grads[:3], want[:3]):
                torch.testing.assert_close(got[a:b], ref[0], atol=2e-3, rtol=2e-3)
