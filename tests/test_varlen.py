"""Variable-length batches: one launch over packed sequences equals the dense path run sequence by sequence."""

import pytest
import torch

import flashtriton
from flashtriton.reference import attention_reference

from accuracy import assert_close_to_exact, torch_attention


def pack(lengths, heads, head_dim, dtype, device, gen):
    """Random packed tokens (total, H, D) and int32 cu_seqlens (B + 1,) for the given lengths."""
    total = sum(lengths)
    x = torch.randn(total, heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=device)
    return x, cu


def run_varlen(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, causal, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, cu_q = pack(lengths_q, heads_q, head_dim, dtype, device, gen)
    k, cu_k = pack(lengths_k, heads_kv, head_dim, dtype, device, gen)
    v, _ = pack(lengths_k, heads_kv, head_dim, dtype, device, gen)
    out, lse, _ = flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                     causal=causal, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (heads_q, q.shape[0])
    for b, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        qb, kb, vb = q[None, sq], k[None, sk], v[None, sk]  # (1, S, H, D)
        if lq == 0:
            continue
        exact, exact_lse = attention_reference(qb, kb, vb, causal=causal, return_lse=True)
        if lk == 0:
            assert torch.all(out[sq] == 0) and torch.all(lse[:, sq] == float("-inf"))
            continue
        assert_close_to_exact(out[None, sq], torch_attention(qb, kb, vb, causal=causal), exact, dtype, f"seq {b}")
        seen = torch.isfinite(exact_lse[0])
        assert torch.equal(torch.isfinite(lse[:, sq]), seen)
        torch.testing.assert_close(lse[:, sq][seen].double(), exact_lse[0][seen], atol=1e-3, rtol=1e-3)
        # the dense path on the same sequence gives the same answer, up to rounding: its tile config follows
        # the sequence's own length, the varlen launch's follows max_seqlen (one ulp of bf16 is 2**-8 at 0.5)
        dense = flashtriton.flash_attn_func(qb, kb, vb, causal=causal)
        tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}[dtype]
        torch.testing.assert_close(out[None, sq], dense, atol=tol, rtol=tol)


@pytest.mark.parametrize("causal", [False, True])
def test_mixed_lengths_with_empty_and_single_token_sequences(causal, device):
    lengths = [5, 0, 1, 70, 33]
    run_varlen(lengths, lengths, 4, 2, 64, torch.float16, causal, device)


@pytest.mark.parametrize("causal", [False, True])
def test_seqlen_q_differs_from_seqlen_k_per_sequence(causal, device):
    run_varlen([3, 40, 1, 17], [10, 20, 5, 0], 4, 4, 40, torch.bfloat16, causal, device)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dtypes_and_odd_head_dim(dtype, device):
    run_varlen([9, 31], [14, 31], 2, 1, 80, dtype, True, device)


def test_tokens_outside_every_sequence_are_zero(device):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(20, 2, 32, generator=gen).to(device=device, dtype=torch.float16)
    cu = torch.tensor([2, 10, 15], dtype=torch.int32, device=device)  # tokens 0, 1 and 15..19 belong to none
    out, lse, _ = flashtriton.flash_attn_varlen_func(q, q, q, cu, cu, 8, 8, return_attn_probs=True)
    assert torch.all(out[:2] == 0) and torch.all(out[15:] == 0)
    assert torch.all(lse[:, :2] == float("-inf"))
    exact = attention_reference(q[None, 2:10], q[None, 2:10], q[None, 2:10])
    torch.testing.assert_close(out[None, 2:10].double(), exact, atol=2e-3, rtol=2e-3)
    # gradients: 0 outside every sequence (where the kernels write nothing), the reference's inside
    qg, kg, vg = (q.clone().requires_grad_() for _ in range(3))
    dout = torch.randn(q.shape, generator=gen).to(device=device, dtype=torch.float16)
    flashtriton.flash_attn_varlen_func(qg, kg, vg, cu, cu, 8, 8).backward(dout)
    for g in (qg.grad, kg.grad, vg.grad):
        assert torch.all(g[:2] == 0) and torch.all(g[15:] == 0)
    ref = [t.double().detach().requires_grad_() for t in (q[2:10], q[2:10], q[2:10])]
    attention_reference(*(t[None] for t in ref)).backward(dout[None, 2:10].double())
    for g, r in zip((qg.grad, kg.grad, vg.grad), ref):
        torch.testing.assert_close(g[2:10].double(), r.grad, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
def test_large_varlen_batch(device):
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 4097, (16,), generator=gen).tolist()
    run_varlen(lengths, lengths, 16, 4, 128, torch.bfloat16, True, device)


# Hopper's TMA kernel on packed sequences: called directly so that the interpreter runs it on a CPU too. Rows
# past the last sequence hold NaN: they must neither leak into the last sequence nor be written.
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tma_kernel_varlen(causal, head_dim, device):
    from flashtriton.kernels.forward import _launch_forward_tma

    if device == "cuda" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("TMA descriptors: Hopper (sm_90) only")
    lengths_q, lengths_k = [5, 0, 1, 70, 33, 18], [9, 4, 1, 70, 20, 0]
    gen = torch.Generator().manual_seed(3)
    tail = 7
    q, cu_q = pack(lengths_q, 4, head_dim, torch.float16, device, gen)
    k, cu_k = pack(lengths_k, 2, head_dim, torch.float16, device, gen)
    v, _ = pack(lengths_k, 2, head_dim, torch.float16, device, gen)
    q, k, v = (torch.cat([t, torch.full((tail, *t.shape[1:]), float("nan"), dtype=t.dtype, device=device)])
               for t in (q, k, v))
    configs = [(32, 16, 4, 1)] if device == "cpu" else [(64, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3)]
    for bm, bn, warps, stages in configs:
        out = torch.full_like(q, 7.0)
        lse = torch.full((4, q.shape[0]), 7.0, dtype=torch.float32, device=device)
        config = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
        _launch_forward_tma(q, k, v, out, lse, head_dim ** -0.5, causal, True, config, cu_q, cu_k,
                            max(lengths_q), max(lengths_k))
        assert torch.all(out[-tail:] == 7.0) and torch.all(lse[:, -tail:] == 7.0), "rows past the sequences written"
        for b, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
            sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            if lq == 0:
                continue
            if lk == 0:
                assert torch.all(out[sq] == 0) and torch.all(lse[:, sq] == float("-inf"))
                continue
            qb, kb, vb = q[None, sq], k[None, sk], v[None, sk]
            exact = attention_reference(qb, kb, vb, causal=causal)
            assert_close_to_exact(out[None, sq], torch_attention(qb, kb, vb, causal=causal), exact, torch.float16,
                                  f"seq {b} config {config}")
