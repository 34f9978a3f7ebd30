"""flashtriton.chunked: a simulated ring (every (query chunk, key chunk) pair at its positions, merged) equals the
full call and through it float64, forward and backward; the pair -> kernel-call mapping keeps every mask;
flash-attn's private aliases; refusals by name."""

import pytest
import torch

import flashtriton
from flashtriton import chunked
from flashtriton.flash_attn_interface import (_flash_attn_backward, _flash_attn_forward, _flash_attn_varlen_backward,
                                              _flash_attn_varlen_forward)
from flashtriton.kernels.variant import Variant
from flashtriton.reference import attention_reference

from accuracy import FLOOR


def _mask(seqlen_q, seqlen_k, q_start, k_start, causal, window):
    p = torch.arange(seqlen_q)[:, None] + q_start
    t = torch.arange(seqlen_k)[None, :] + k_start
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if causal:
        keep &= t <= p
    if window[0] >= 0:
        keep &= t >= p - window[0]
    if window[1] >= 0 and not causal:
        keep &= t <= p + window[1]
    return keep


def test_each_pair_maps_onto_a_kernel_call_with_its_mask():
    """Every offset, window and shape: the call `_plan` makes (rows / keys sliced off, the kernels' causal flag,
    diagonal and window) sees exactly the pair's visible (query, key) positions; pair_visibility agrees."""
    for seqlen_q, seqlen_k in [(1, 1), (3, 5), (5, 3), (4, 4), (7, 2)]:
        for d in range(-8, 9):
            for causal in (False, True):
                for window in [(-1, -1), (0, 0), (2, -1), (1, 3), (-1, 1), (5, 0)]:
                    want = _mask(seqlen_q, seqlen_k, 100 + d, 100, causal, window)
                    plan = chunked._plan(seqlen_q, seqlen_k, 100 + d, 100, causal, window)
                    got = torch.zeros_like(want)
                    if plan is not None:
                        rows, keys, kernel_causal, bottom_right, kernel_window = plan
                        variant = Variant(causal=kernel_causal, window=kernel_window, bottom_right=bottom_right)
                        got[rows:, keys:] = variant.dense_mask(seqlen_q - rows, seqlen_k - keys)
                    assert torch.equal(got, want), (seqlen_q, seqlen_k, d, causal, window, plan)
                    kind = chunked.pair_visibility(seqlen_q, seqlen_k, 100 + d, 100, causal, window)
                    assert kind == ("hidden" if not want.any() else "full" if want.all() else "partial")


CASES = {  # name: (causal, window_size, softcap, softmax_scale); plain causal rings: test_parallel.py
    "window": (False, (5, 3), 4.0, None),
    "causal_window_negative_scale": (True, (6, 0), 0.0, -0.3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_simulated_ring_equals_the_full_call(case, device):
    """Queries in two chunks, keys in three of other sizes (diagonals at every offset, rows that see nothing of a
    chunk, hidden pairs skipped), GQA 2/1: OnlineMerge of the pairs' chunk_forward is the full call's out and lse;
    chunk_backward of every pair with the full call's out / lse, accumulated in fp32 into views of one buffer, is
    its gradient; merge_chunks of one chunk's partials equals OnlineMerge's."""
    causal, window, softcap, scale = CASES[case]
    gen = torch.Generator().manual_seed(0)
    batch, seqlen, hq, hkv, dim = 1, 32, 2, 1, 16
    q = torch.randn(batch, seqlen, hq, dim, generator=gen).to(device).requires_grad_()
    k, v = (torch.randn(batch, seqlen, hkv, dim, generator=gen).to(device).requires_grad_() for _ in range(2))
    dout = torch.randn(batch, seqlen, hq, dim, generator=gen).to(device)
    out, lse, _ = flashtriton.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                              softmax_scale=scale, return_attn_probs=True)
    out.backward(dout)
    exact, exact_lse = attention_reference(q.detach(), k.detach(), v.detach(), softmax_scale=scale, return_lse=True,
                                           variant=Variant(causal=causal, window=window, softcap=softcap))
    torch.testing.assert_close(out.double(), exact, atol=20 * FLOOR[torch.float32], rtol=0)

    q_cuts, k_cuts = (0, 13, 32), (0, 9, 20, 32)
    q_chunks = [slice(a, b) for a, b in zip(q_cuts[:-1], q_cuts[1:])]
    k_chunks = [slice(a, b) for a, b in zip(k_cuts[:-1], k_cuts[1:])]
    kw = dict(causal=causal, window_size=window, softcap=softcap, softmax_scale=scale)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=device) for t in (q, k, v))
    calls = 0
    for qs in q_chunks:
        acc = chunked.OnlineMerge(batch, qs.stop - qs.start, hq, dim, device)
        partials = []
        for ks in k_chunks:
            if chunked.pair_visibility(qs.stop - qs.start, ks.stop - ks.start, qs.start, ks.start, causal,
                                       window) == "hidden":
                continue
            calls += 1
            part = chunked.chunk_forward(qd[:, qs], kd[:, ks], vd[:, ks], qs.start, ks.start, out_dtype=torch.float32,
                                         **kw)
            acc.add(*part)
            partials.append(part)
            chunked.chunk_backward(dout[:, qs], qd[:, qs], kd[:, ks], vd[:, ks], out.detach()[:, qs],
                                   lse.detach()[:, :, qs], qs.start, ks.start, dq=dq[:, qs], dk=dk[:, ks],
                                   dv=dv[:, ks], accumulate=True, **kw)
        torch.testing.assert_close(acc.out, out.detach()[:, qs], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(acc.lse, lse.detach()[:, :, qs], atol=1e-5, rtol=1e-5)
        merged, merged_lse = chunked.merge_chunks(*zip(*partials))
        torch.testing.assert_close(merged, acc.out, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(merged_lse, acc.lse, atol=1e-6, rtol=1e-6)
    assert calls < len(q_chunks) * len(k_chunks) or not causal  # hidden pairs run nothing
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_chunk_results_without_a_kernel_and_refusals(device):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 8, 2, 16, generator=gen).to(device) for _ in range(3))
    out, lse = chunked.chunk_forward(q, k, v, q_start=0, k_start=8, causal=True)  # the keys are all in the future
    assert out.shape == (1, 8, 2, 16) and not out.any() and torch.isinf(lse).all() and (lse < 0).all()
    bufs = [torch.full_like(t, 7.0) for t in (q, k, v)]
    chunked.chunk_backward(q, q, k, v, q, lse, 0, 8, causal=True, dq=bufs[0], dk=bufs[1], dv=bufs[2],
                           accumulate=True)
    assert all((b == 7).all() for b in bufs)  # nothing added
    grads = chunked.chunk_backward(q, q, k, v, q, lse, 0, 8, causal=True)
    assert all(not g.any() for g in grads)
    with pytest.raises(TypeError, match="out_dtype"):
        chunked.chunk_forward(q, k, v, out_dtype=torch.float16)
    with pytest.raises(TypeError, match="q_start"):
        chunked.chunk_forward(q, k, v, q_start=1.5)
    with pytest.raises(ValueError, match="accumulate=True .* dq is None"):
        chunked.chunk_backward(q, q, k, v, q, lse, accumulate=True)
    with pytest.raises(ValueError, match="dk must have shape"):
        chunked.chunk_backward(q, q, k, v, q, lse, dk=torch.zeros(1, 7, 2, 16, device=device))
    with pytest.raises(ValueError, match="lse must have shape"):
        chunked.chunk_backward(q, q, k, v, q, lse.transpose(1, 2))
    with pytest.raises(TypeError, match="dlse must be a float32"):
        chunked.chunk_backward(q, q, k, v, q, lse, dlse=lse.half())
    with pytest.raises(ValueError, match="outs and lses"):
        chunked.merge_chunks([out], [])


def test_flash_attn_private_aliases(device):
    """_flash_attn_forward / _flash_attn_backward (flash-attn >= 2.6's signatures) equal flash_attn_func and its
    gradient; the backward writes into given (fp32, strided) buffers and returns rowsum(dout * out)."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 24, 2, 16, generator=gen).to(device).requires_grad_()
    k, v = (torch.randn(2, 20, 1, 16, generator=gen).to(device).requires_grad_() for _ in range(2))
    dout = torch.randn(2, 24, 2, 16, generator=gen).to(device)
    ref, ref_lse, _ = flashtriton.flash_attn_func(q, k, v, causal=True, window_size=(7, 0), return_attn_probs=True)
    ref.backward(dout)
    out, lse, s_dmask, rng_state = _flash_attn_forward(q.detach(), k.detach(), v.detach(), 0.0, 0.25, True,
                                                       window_size_left=7, window_size_right=0, softcap=0.0,
                                                       alibi_slopes=None, return_softmax=False)
    assert s_dmask.numel() == 0 and rng_state.numel() == 0
    torch.testing.assert_close(out, ref.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, ref_lse.detach(), atol=1e-6, rtol=1e-6)
    wide = torch.zeros(2, 24, 2, 32, device=device)
    dq = wide[..., :16]  # a strided view
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    softmax_d = _flash_attn_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, dq, dk, dv, 0.0, 0.25, True,
                                     7, 0, 0.0, None, False, rng_state)
    torch.testing.assert_close(softmax_d, (dout * out).sum(-1).transpose(1, 2))
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not wide[..., 16:].any()
    s_dmask = _flash_attn_forward(q.detach(), k.detach(), v.detach(), 0.1, 0.25, True, return_softmax=True)[2]
    assert s_dmask.shape == (*q.shape[:1], q.shape[2], 128, 128)  # (tests/test_dropout.py checks its values)


def test_flash_attn_private_varlen_aliases(device):
    """_flash_attn_varlen_forward / _backward equal flash_attn_varlen_func and its gradient (two packed sequences,
    causal, GQA)."""
    gen = torch.Generator().manual_seed(3)
    cu_q = torch.tensor([0, 9, 24], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 12, 30], dtype=torch.int32, device=device)
    q = torch.randn(24, 2, 16, generator=gen).to(device).requires_grad_()
    k, v = (torch.randn(30, 1, 16, generator=gen).to(device).requires_grad_() for _ in range(2))
    dout = torch.randn(24, 2, 16, generator=gen).to(device)
    ref, ref_lse, _ = flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 15, 18, causal=True,
                                                         return_attn_probs=True)
    ref.backward(dout)
    out, lse, _, rng_state = _flash_attn_varlen_forward(q.detach(), k.detach(), v.detach(), cu_q, cu_k, 15, 18, 0.0,
                                                        0.25, True)
    torch.testing.assert_close(out, ref.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, ref_lse.detach(), atol=1e-6, rtol=1e-6)
    dq, dk, dv = (torch.zeros(t.shape, device=device) for t in (q, k, v))
    softmax_d = _flash_attn_varlen_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, dq, dk, dv, cu_q,
                                            cu_k, 15, 18, 0.0, 0.25, True, rng_state=rng_state)
    assert softmax_d.shape == (2, 24)
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(NotImplementedError, match="seqused_k"):
        _flash_attn_varlen_forward(q.detach(), k.detach(), v.detach(), cu_q, cu_k, 15, 18, 0.0, 0.25, True,
                                   seqused_k=torch.tensor([9, 15], dtype=torch.int32, device=device))


@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_pairs_accumulate_to_the_gradient(causal, device, monkeypatch):
    """bf16 at D=64, GQA, keys in three chunks of odd sizes: every pair's chunk_backward accumulated into fp32
    buffers is the gradient, against float64 and judged by torch's error in bf16. On Hopper the Gluon backward
    computes each pair (in bf16, then added: counted here), elsewhere the Triton kernels add in fp32."""
    from accuracy import assert_close_to_exact, torch_attention
    from flashtriton import configs
    from test_backward_gluon import record_gluon_launches

    monkeypatch.setattr(configs.backward, "GLUON_BWD_MIN_FLOPS", 0)  # the Gluon kernels at this size too
    monkeypatch.setattr(configs.backward, "GLUON_BWD_D64_MIN_KEYS", 0)
    ran = record_gluon_launches(monkeypatch)
    gen = torch.Generator().manual_seed(1)
    batch, seqlen, hq, hkv, dim, dtype = 2, 320, 4, 2, 64, torch.bfloat16
    q = torch.randn(batch, seqlen, hq, dim, generator=gen).to(device, dtype)
    k, v = (torch.randn(batch, seqlen, hkv, dim, generator=gen).to(device, dtype) for _ in range(2))
    dout = torch.randn(batch, seqlen, hq, dim, generator=gen).to(device, dtype)
    out, lse, _ = flashtriton.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)

    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=device) for t in (q, k, v))
    cuts = (0, 128, 200, 320)
    for ks in (slice(a, b) for a, b in zip(cuts[:-1], cuts[1:])):
        chunked.chunk_backward(dout, q, k[:, ks], v[:, ks], out, lse, 0, ks.start, causal=causal,
                               dq=dq, dk=dk[:, ks], dv=dv[:, ks], accumulate=True)

    def grads(x_q, x_k, x_v, attention):
        leaves = [t.detach().requires_grad_() for t in (x_q, x_k, x_v)]
        attention(*leaves).backward(dout.to(leaves[0].dtype))
        return [t.grad for t in leaves]

    exact = grads(q.double(), k.double(), v.double(),
                  lambda a, b, c: attention_reference(a, b, c, None, causal))
    same_dtype = grads(q, k, v, lambda a, b, c: torch_attention(a, b, c, None, causal))
    for name, got, want, theirs in zip("dq dk dv".split(), (dq, dk, dv), exact, same_dtype):
        assert_close_to_exact(got, theirs, want, dtype, name)
    hopper = device == "cuda" and torch.cuda.get_device_capability()[0] == 9
    assert ran.count("launch_dkdv_gluon") == (3 if hopper else 0)
