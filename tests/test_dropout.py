"""Attention dropout (dropout_p > 0): exact against float64 with the call's own keep-mask, its statistics, its
reproducibility, the backward's regeneration of the forward's mask, torch.compile, and every entry point.

The mask of a call comes back through `flashtriton.testing` (record_dropout, then dropout_mask from the call's
(seed, offset)); the reference is `reference.attention_reference(..., dropout_mask=...)`, judged as every other
result (tests/accuracy.py), against the same reference run in the inputs' dtype.
"""

import math

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

import flashtriton
from flashtriton import testing
from flashtriton.kernels import dispatch
from flashtriton.kernels.variant import Variant, dropout_threshold
from flashtriton.reference import attention_reference

from accuracy import assert_close_to_exact
from conftest import DEVICE


def randn(shape, dtype, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(device=DEVICE, dtype=dtype)


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def run(fn, inputs, dout):
    """(out, lse, grads of inputs, the recorded rng_state) of fn(*inputs) -> (out, lse)."""
    ins = leaves(*inputs)
    with testing.record_dropout() as calls:
        out, lse = fn(*ins)
    assert len(calls) == 1
    out.backward(dout.to(out.dtype))
    return out, lse, [t.grad for t in ins], calls[0]


def reference(inputs, dout, variant, mask, p, dtype, softmax_scale=None):
    """(out, lse, grads) of the reference with `mask`, in `dtype`."""
    ins = [t.detach().to(dtype).requires_grad_() for t in inputs[:3]]
    out, lse = attention_reference(*ins, softmax_scale, dtype=dtype, return_lse=True, variant=variant,
                                   dropout_mask=mask, dropout_p=p)
    out.backward(dout.to(dtype))
    return out, lse, [t.grad for t in ins]


def check(inputs, dout, variant, mask, p, ours, dtype, what=""):
    """ours = (out, lse, [dq, dk, dv]) against float64 and the reference in `dtype` with the same mask."""
    ex_out, ex_lse, ex_grads = reference(inputs, dout, variant, mask, p, torch.float64)
    lo_out, _, lo_grads = reference(inputs, dout, variant, mask, p, dtype)
    out, lse, grads = ours
    assert_close_to_exact(out, lo_out, ex_out, dtype, f"{what}out")
    fin = torch.isfinite(ex_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    torch.testing.assert_close(lse[fin].double(), ex_lse[fin], atol=1e-4, rtol=1e-4)
    for name, g, lo, ex in zip(("dq", "dk", "dv"), grads, lo_grads, ex_grads):
        assert_close_to_exact(g, lo, ex, dtype, f"{what}{name}")


def qkv(batch, sq, sk, hq, hkv, d, dtype, seed=0, dv=None):
    gen = torch.Generator().manual_seed(seed)
    return (randn((batch, sq, hq, d), dtype, gen), randn((batch, sk, hkv, d), dtype, gen),
            randn((batch, sk, hkv, dv or d), dtype, gen), randn((batch, sq, hq, dv or d), dtype, gen))


@pytest.mark.parametrize("dtype,causal,shape,p", [
    (torch.float16, False, (2, 37, 37, 2, 2, 32), 0.2),
    (torch.float16, True, (1, 50, 70, 4, 2, 40), 0.5),  # GQA, Sq != Sk, bottom-right causal
    (torch.bfloat16, True, (2, 33, 20, 2, 1, 16), 0.1),  # MQA, rows that see no key
    (torch.float32, False, (1, 24, 65, 3, 3, 24), 0.3),
])
def test_dense_exact_with_the_recovered_mask(dtype, causal, shape, p, device):
    batch, sq, sk, hq, hkv, d = shape
    q, k, v, dout = qkv(*shape, dtype)
    fn = lambda a, b, c: flashtriton.flash_attn_func(a, b, c, dropout_p=p, causal=causal,  # noqa: E731
                                                     return_attn_probs=True)[:2]
    out, lse, grads, rng = run(fn, (q, k, v), dout)
    mask = testing.dropout_mask(rng, batch, hq, sq, sk, p)
    assert 0 < mask.float().mean() < 1
    check((q, k, v), dout, Variant(causal=causal), mask, p, (out, lse, grads), dtype)


def test_variant_combination_window_softcap_alibi_sinks(device):
    batch, sq, sk, hq, hkv, d, p = 2, 45, 45, 4, 2, 32, 0.25
    q, k, v, dout = qkv(batch, sq, sk, hq, hkv, d, torch.float16, seed=2)
    slopes = torch.tensor([0.3, 0.1, 0.05, 0.02], device=DEVICE)
    sinks = torch.tensor([0.5, -1.0, 0.0, 2.0], device=DEVICE)
    fn = lambda a, b, c: flashtriton.flash_attn_func(  # noqa: E731
        a, b, c, dropout_p=p, causal=True, window_size=(11, 0), softcap=5.0, alibi_slopes=slopes,
        learnable_sink=sinks, return_attn_probs=True)[:2]
    out, lse, grads, rng = run(fn, (q, k, v), dout)
    mask = testing.dropout_mask(rng, batch, hq, sq, sk, p)
    variant = Variant(causal=True, window=(11, 0), softcap=5.0, alibi_slopes=slopes, sinks=sinks)
    check((q, k, v), dout, variant, mask, p, (out, lse, grads), torch.float16)


def test_sinks_gradient_with_dropout(device):
    batch, s, h, d, p = 1, 30, 2, 16, 0.3
    q, k, v, dout = qkv(batch, s, s, h, h, d, torch.float32, seed=5)
    sink = torch.tensor([0.7, -0.4], device=DEVICE, requires_grad=True)
    with testing.record_dropout() as calls:
        out = flashtriton.flash_attn_func(q, k, v, dropout_p=p, learnable_sink=sink)
    out.backward(dout)
    mask = testing.dropout_mask(calls[0], batch, h, s, s, p)
    sink64 = sink.detach().double().requires_grad_()
    ref = attention_reference(q.double(), k.double(), v.double(), variant=Variant(sinks=sink64),
                              dropout_mask=mask, dropout_p=p)
    ref.backward(dout.double())
    torch.testing.assert_close(sink.grad.double(), sink64.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_exact_per_sequence(causal, device):
    check_varlen([5, 0, 33, 17], [9, 4, 33, 20], 4, 2, 24, torch.float16, 0.3, causal, seed=7)


def check_varlen(lengths_q, lengths_k, hq, hkv, d, dtype, p, causal, seed, after_run=None):
    """A varlen dropout call forward and backward, each sequence against float64 with its part of the recovered
    mask; `after_run()` is called between the call and the checks."""
    gen = torch.Generator().manual_seed(seed)
    q = randn((sum(lengths_q), hq, d), dtype, gen)
    k = randn((sum(lengths_k), hkv, d), dtype, gen)
    v = randn((sum(lengths_k), hkv, d), dtype, gen)
    dout = randn((sum(lengths_q), hq, d), dtype, gen)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
                  for n in (lengths_q, lengths_k))
    fn = lambda a, b, c: flashtriton.flash_attn_varlen_func(  # noqa: E731
        a, b, c, cu_q, cu_k, max(lengths_q), max(lengths_k), dropout_p=p, causal=causal, return_attn_probs=True)[:2]
    out, lse, (dq, dk, dv), rng = run(fn, (q, k, v), dout)
    if after_run is not None:
        after_run()
    mask = testing.dropout_mask(rng, len(lengths_q), hq, max(lengths_q), max(lengths_k), p)
    for b, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lq == 0:
            continue
        ours = (out[None, sq], lse[None, :, sq], [dq[None, sq], dk[None, sk], dv[None, sk]])
        check((q[None, sq], k[None, sk], v[None, sk]), dout[None, sq], Variant(causal=causal),
              mask[b:b + 1, :, :lq, :lk], p, ours, dtype, f"seq {b} ")


def test_sdpa_and_packed_take_dropout(device):
    q, k, v, dout = qkv(1, 20, 20, 2, 2, 16, torch.float16, seed=3)
    with testing.record_dropout() as calls:
        out = flashtriton.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), dropout_p=0.4,
                                                       is_causal=True)
    mask = testing.dropout_mask(calls[0], 1, 2, 20, 20, 0.4)
    ref = attention_reference(q, k, v, variant=Variant(causal=True, bottom_right=False), dropout_mask=mask,
                              dropout_p=0.4)
    torch.testing.assert_close(out.transpose(1, 2).double(), ref, atol=2e-3, rtol=2e-3)
    qkv_packed = torch.stack([q, k, v], dim=2)
    with testing.record_dropout() as calls:
        packed = flashtriton.flash_attn_qkvpacked_func(qkv_packed, 0.4, causal=True)
    mask = testing.dropout_mask(calls[0], 1, 2, 20, 20, 0.4)
    ref = attention_reference(q, k, v, causal=True, dropout_mask=mask, dropout_p=0.4)
    torch.testing.assert_close(packed.double(), ref, atol=2e-3, rtol=2e-3)


def test_rows_that_see_no_key_stay_zero(device):
    q, k, v, dout = qkv(1, 12, 4, 2, 2, 16, torch.float16, seed=4)
    ins = leaves(q, k, v)
    out, lse, _ = flashtriton.flash_attn_func(*ins, dropout_p=0.5, causal=True, return_attn_probs=True)
    out.backward(dout)
    assert torch.all(out[:, :8] == 0) and torch.isinf(lse[:, :, :8]).all() and torch.isfinite(out).all()
    assert torch.all(ins[0].grad[:, :8] == 0) and all(torch.isfinite(t.grad).all() for t in ins)


# ---------------------------------------------------------------------------------------------------------
# the mask: statistics, reproducibility, regeneration
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_kept_fraction_per_row_and_overall(p, device):
    """A 256 x 256 mask per (batch, head) keeps 1 - p of its entries, within 5 sigma overall and per row; rows,
    columns and heads are independent draws (no two rows or heads equal)."""
    batch, heads, n = 2, 2, 256
    mask = testing.dropout_mask((123456789, 42), batch, heads, n, n, p, device=DEVICE).double()
    keep = 1 - p
    overall = mask.mean().item()
    sigma = math.sqrt(keep * (1 - keep) / mask.numel())
    assert abs(overall - keep) < 5 * sigma, (overall, keep, sigma)
    rows = mask.mean(-1)
    sigma_row = math.sqrt(keep * (1 - keep) / n)
    assert (rows - keep).abs().max().item() < 5 * sigma_row
    cols = mask.mean(-2)
    assert (cols - keep).abs().max().item() < 5 * sigma_row
    flat = mask.reshape(batch * heads, n, n)
    assert not any(torch.equal(flat[i], flat[j]) for i in range(4) for j in range(i))
    assert not torch.equal(flat[0, 0], flat[0, 1]) and not torch.equal(flat[0, :, 0], flat[0, :, 1])
    # neighbouring entries are uncorrelated (the counter differs in one word)
    a, b = flat[..., :-1] - keep, flat[..., 1:] - keep
    corr = (a * b).mean() / (keep * (1 - keep))
    assert abs(corr.item()) < 5 / math.sqrt(a.numel())



def test_scores_of_one_call_and_their_neighbours_are_independent():
    """At p = 0.5 (every bit of a field counts), the keep indicators are uncorrelated at the lags where scores
    share a Philox call, a word of it, a row or key of its counter, or sit in the next tile (each within 5
    sigma), and the eight scores of one call are kept as eight independent draws: their count of kept scores
    follows Binomial(8, 1/2) (chi-square, 8 degrees of freedom, below its 1e-6 tail), and a row's count of kept
    scores has a binomial's variance."""
    batch, heads, n, keep = 2, 2, 256, 0.5
    mask = testing.dropout_mask((987654321, 7), batch, heads, n, n, 0.5, device=DEVICE).double().cpu()
    centred = mask - keep
    for di, dj in ((0, 1), (0, 2), (0, 8), (0, 9), (0, 16), (1, 0), (8, 0), (16, 0), (8, 8), (1, 1), (8, 1)):
        a, b = centred[..., : n - di, : n - dj], centred[..., di:, dj:]
        corr = (a * b).mean() / (keep * (1 - keep))
        assert abs(corr.item()) < 5 / math.sqrt(a.numel()), (di, dj, corr.item())
    # call (i mod 8, (j mod 8) // 2) of each 16 x 16 block serves rows i, i + 8 and keys j, j + 1, j + 8, j + 9
    blocks = mask.reshape(batch, heads, n // 16, 2, 8, n // 16, 2, 4, 2)  # (.., a, ρ, i mod 8, m, κ, c, π)
    kept = blocks.sum(dim=(3, 6, 8)).flatten()  # per call: its eight scores
    counts = torch.bincount(kept.long(), minlength=9).double()
    expected = torch.tensor([math.comb(8, k) / 256 for k in range(9)], dtype=torch.float64) * kept.numel()
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 45.0, (chi2, counts.tolist())
    # a row's kept count (the keys a softmax row keeps) varies as a binomial's: no correlation along the row
    rows = mask.sum(-1).flatten()
    ratio = rows.var().item() / (n * keep * (1 - keep))
    assert abs(ratio - 1) < 5 * math.sqrt(2 / rows.numel()), ratio

def _philox4x32(c0, c1, c2, c3, seed: int, rounds: int):
    """Philox4x32-`rounds` (Salmon et al., as `tl.philox` computes it) on numpy uint64 arrays holding 32-bit words,
    keyed by the 64-bit seed: the four output words."""
    import numpy as np

    low = np.uint64(0xFFFFFFFF)
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64((seed >> 32) & 0xFFFFFFFF)
    for _ in range(rounds):
        p0, p2 = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = (p2 >> np.uint64(32)) ^ c1 ^ k0, p2 & low, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & low
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & low, (k1 + np.uint64(0xBB67AE85)) & low
    return c0, c1, c2, c3


def test_mask_is_its_definition():
    """`testing.dropout_mask` (the kernels' `variant.dropout_keep`) is, bit for bit, the definition written out
    per score in numpy: score (i, j) of sequence-and-head bh takes field j mod 2 (16 bits) of output
    2 ((i // 8) mod 2) + (j // 8) mod 2 of Philox4x32-7 (`variant.DROPOUT_ROUNDS`) on
    (bh, 8 (i // 16) + i mod 8, offset, 4 (j // 16) + (j mod 8) // 2), kept iff the field is >= round(p · 2^16).
    A negative seed and an offset past 2^32 (its low 32 bits count) too."""
    import numpy as np

    batch, heads, sq, sk, p = 2, 3, 40, 72, 0.3
    for seed, offset in ((123456789, 42), (-5, 2**40 + 3)):
        mask = testing.dropout_mask((seed, offset), batch, heads, sq, sk, p, device=DEVICE).cpu().numpy()
        i = np.arange(sq, dtype=np.uint64)[None, None, :, None]
        j = np.arange(sk, dtype=np.uint64)[None, None, None, :]
        bh = np.arange(batch * heads, dtype=np.uint64).reshape(batch, heads, 1, 1)
        keys = 4 * (j // 16) + (j % 8) // 2 + 0 * (i + bh)
        rows = 8 * (i // 16) + i % 8 + 0 * (j + bh)
        words = _philox4x32(bh + 0 * (i + j), rows, np.full_like(rows, offset % 2**32), keys, seed % 2**64, 7)
        word = 2 * ((i // 8) % 2) + (j // 8) % 2 + 0 * bh
        bits = np.choose(word.astype(np.int64), words)
        field = (bits >> (16 * (j % 2))) & np.uint64(0xFFFF)
        want = field >= np.uint64(dropout_threshold(p))
        assert mask.shape == want.shape and (mask == want).all(), (seed, offset, (mask != want).sum())


def test_threshold_is_the_probability():
    assert dropout_threshold(0.0) == 0 and dropout_threshold(0.5) == 2**15 and dropout_threshold(0.1) == 6554
    assert dropout_threshold(1 - 2**-40) == 2**16 - 1  # kept with probability 2^-16, not never


def test_manual_seed_reproduces_and_two_calls_differ(device):
    q, k, v, dout = qkv(1, 24, 24, 2, 2, 16, torch.float16, seed=6)

    def call():
        with testing.record_dropout() as calls:
            out = flashtriton.flash_attn_func(q, k, v, dropout_p=0.3)
        return out, calls[0]

    torch.manual_seed(11)
    out1, rng1 = call()
    out2, rng2 = call()
    torch.manual_seed(11)
    out3, rng3 = call()
    assert torch.equal(rng1, rng3) and torch.equal(out1, out3)
    assert not torch.equal(rng1, rng2) and not torch.equal(out1, out2)
    m1, m2 = (testing.dropout_mask(r, 1, 2, 24, 24, 0.3) for r in (rng1, rng2))
    assert not torch.equal(m1, m2)


def test_backward_regenerates_the_forwards_mask(device):
    """Calls with the same rng_state give bitwise the same results (the mask is a function of it alone), and the
    backward's gradients are the derivatives of the forward at that state: central finite differences of
    <dout, out> along random directions, in fp32 (nothing is stored between forward and backward but the state)."""
    q, k, v, dout = qkv(1, 9, 11, 2, 1, 8, torch.float32, seed=8)
    rng = torch.tensor([987654321, 7], dtype=torch.int64, device=DEVICE)

    def fn(a, b, c):
        return torch.ops.flashtriton.fwd(a, b, c, 0.35, True, True, None, None, 9, 11, -1, -1, 0.0, None, None,
                                         0.4, rng)[0]

    assert torch.equal(fn(q, k, v), fn(q, k, v))
    ins = leaves(q, k, v)
    fn(*ins).backward(dout)
    gen = torch.Generator().manual_seed(1)
    for i in range(3):
        direction = [torch.randn(t.shape, generator=gen).to(DEVICE) if j == i else torch.zeros_like(t)
                     for j, t in enumerate((q, k, v))]
        eps = 1e-2
        plus = fn(*(t + eps * d for t, d in zip((q, k, v), direction)))
        minus = fn(*(t - eps * d for t, d in zip((q, k, v), direction)))
        numeric = ((plus - minus) * dout).sum().double() / (2 * eps)
        analytic = (ins[i].grad * direction[i]).sum().double()
        assert abs(numeric - analytic) <= 2e-3 * max(1.0, abs(analytic)), ("qkv"[i], numeric, analytic)


def test_op_matches_the_recovered_mask_at_a_fixed_state(device):
    q, k, v, dout = qkv(2, 16, 16, 2, 2, 16, torch.float32, seed=9)
    rng = torch.tensor([-5, 2**40 + 3], dtype=torch.int64, device=DEVICE)
    out, lse = torch.ops.flashtriton.fwd(q, k, v, 0.25, False, True, None, None, 16, 16, -1, -1, 0.0, None, None,
                                         0.2, rng)
    mask = testing.dropout_mask(rng, 2, 2, 16, 16, 0.2)
    assert torch.equal(mask, testing.dropout_mask((-5, 2**40 + 3), 2, 2, 16, 16, 0.2, device=DEVICE))
    ref = attention_reference(q, k, v, 0.25, dropout_mask=mask, dropout_p=0.2)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_p_zero_takes_the_dropout_free_path(device, monkeypatch):
    """dropout_p=0 draws nothing and launches without HAS_DROPOUT (the dropout-free kernels, bit for bit)."""
    q, k, v, _ = qkv(1, 20, 20, 2, 2, 16, torch.float16, seed=10)
    state = torch.get_rng_state()
    with testing.record_dropout() as calls:
        a = flashtriton.flash_attn_func(q, k, v, dropout_p=0.0, causal=True)
    assert calls == [] and torch.equal(state, torch.get_rng_state())
    assert torch.equal(a, flashtriton.flash_attn_func(q, k, v, causal=True))
    assert Variant.of(True, dropout_p=0.0) == Variant.of(True)
    assert "HAS_DROPOUT" not in Variant.of(True).forward_constexprs


def test_dispatch_of_dropout_and_the_gluon_forwards_gate(monkeypatch):
    """The Gluon and the portable kernels declare dropout. The Gluon forward's rules take dense dropout calls
    without a window at tiles of 64 and 128 columns only (`configs.GLUON_DROPOUT_FWD`: the measured faster cases), the
    Gluon backward's dense calls of `GLUON_BWD_DROPOUT_CASES`; the portable kernels run the rest, and all of them
    with the switches off. Under GLUON_DROPOUT_ALL / GLUON_BWD_DROPOUT_ALL every call the Gluon kernels have a rule
    for takes them (not the backward's tiles of 256 columns)."""
    from flashtriton import configs
    from flashtriton.configs import forward as configs_forward

    fields = Variant.of(True, dropout_p=0.1).fields()
    assert "dropout_p" in fields
    half = torch.float16
    assert dispatch.candidates("fwd", half, 128, 9, fields=fields) == ["gluon_fwd", "portable_fwd"]
    assert dispatch.candidates("bwd", half, 64, 9, fields=fields) == ["gluon_bwd", "portable_bwd"]
    for name in ("tma_fwd", "decode_split", "decode_stream"):
        assert "dropout_p" not in dispatch.BY_NAME[name].fields
    fwd = configs_forward.gluon_fwd_config
    varlen = lambda dropout: configs_forward.gluon_varlen_config(128, 4096, 4096, True, dropout=dropout)  # noqa: E731
    paged = lambda dropout: configs_forward.gluon_paged_config(128, 4096, 4096, True, 256, dropout=dropout)  # noqa: E731
    assert configs_forward.GLUON_DROPOUT and not configs_forward.GLUON_DROPOUT_ALL
    for head_dim, keys, causal in ((128, 16384, False), (128, 512, True), (96, 4096, False)):
        assert fwd(head_dim, keys, keys, causal, dropout=True) == configs_forward.GLUON_SHORT
    assert fwd(64, 4096, 4096, False, dropout=True) == configs_forward.GLUON_SHORT_D64
    assert fwd(256, 4096, 4096, False, dropout=True) is None and fwd(256, 4096, 4096, False) is not None
    assert fwd(128, 4096, 4096, True, 1024, dropout=True) is None  # a window
    assert varlen(True) is None and paged(True) is None and varlen(False) is not None and paged(False) is not None
    bwd = configs.gluon_bwd_config
    # (the table's row: the split loops are not built with dropout)
    assert bwd(128, 4096, 4096, True, dropout=True) == configs.GLUON_BWD.lookup(configs.table.SM90, "16", 128)
    assert bwd(64, 4096, 4096, False, dropout=True) == bwd(64, 4096, 4096, False)
    assert bwd(64, 4096, 4096, True, dropout=True) == bwd(64, 4096, 4096, True, varlen=True)  # (not split)
    assert bwd(256, 4096, 4096, True, dropout=True) is None and bwd(256, 4096, 4096, True) is not None
    assert bwd(128, 4096, 4096, True, varlen=True, dropout=True) is None
    monkeypatch.setattr(configs_forward, "GLUON_DROPOUT", False)
    monkeypatch.setattr(configs.backward, "GLUON_BWD_DROPOUT", False)
    assert fwd(128, 4096, 4096, False, dropout=True) is None and bwd(128, 4096, 4096, True, dropout=True) is None
    monkeypatch.setattr(configs_forward, "GLUON_DROPOUT", True)
    monkeypatch.setattr(configs_forward, "GLUON_DROPOUT_ALL", True)
    monkeypatch.setattr(configs.backward, "GLUON_BWD_DROPOUT", True)
    monkeypatch.setattr(configs.backward, "GLUON_BWD_DROPOUT_ALL", True)
    assert all(rule(True) is not None for rule in (varlen, paged))
    assert fwd(64, 16384, 16384, False, dropout=True) == configs_forward.GLUON_SHORT_D64
    with monkeypatch.context() as m:  # at 256-column tiles GLUON_FWD's rows (the output not in the Q buffers)
        m.setattr(configs_forward, "GLUON_O_IN_Q", False)
        table_rows = fwd(256, 4096, 4096, False)
    assert fwd(256, 4096, 4096, False, dropout=True) == table_rows != fwd(256, 4096, 4096, False)
    assert bwd(64, 4096, 4096, True, dropout=True) == bwd(64, 4096, 4096, True, varlen=True)  # (not split)
    assert bwd(128, 4096, 4096, True, varlen=True, dropout=True) == bwd(128, 4096, 4096, True, varlen=True)
    assert bwd(256, 4096, 4096, True, dropout=True) is None


# ---------------------------------------------------------------------------------------------------------
# torch.compile and bad input
# ---------------------------------------------------------------------------------------------------------
class DropoutAttention(torch.nn.Module):
    def forward(self, q, k, v):
        return flashtriton.flash_attn_func(q, k, v, dropout_p=0.25, causal=True) * 2


def test_compile_fullgraph_through_dropout(device):
    """The (seed, offset) draw is a torch.randint outside the custom op: dynamo traces it into the graph (no
    graph break), the op takes it as a tensor and saves it for the backward. A compiled function that returns
    the state it drew is judged against the reference with that state's mask, forward and backward; the public
    function compiles in one frame, and two compiled calls draw two masks."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    q, k, v, dout = qkv(1, 16, 16, 2, 2, 16, torch.float32, seed=12)

    def f(a, b, c):
        from flashtriton.ops import draw_dropout_state
        rng = draw_dropout_state(a.device)
        out = torch.ops.flashtriton.fwd(a, b, c, 0.25, True, True, None, None, 16, 16, -1, -1, 0.0, None, None,
                                        0.3, rng)[0]
        return out, rng

    ins = leaves(q, k, v)
    out, rng = torch.compile(f, backend=counter, fullgraph=True)(*ins)
    out.backward(dout)
    assert counter.frame_count == 1
    mask = testing.dropout_mask(rng, 1, 2, 16, 16, 0.3)
    ex_ins = leaves(*(t.double() for t in (q, k, v)))
    ref = attention_reference(*ex_ins, 0.25, causal=True, dropout_mask=mask, dropout_p=0.3)
    ref.backward(dout.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    for g, e in zip((t.grad for t in ins), (t.grad for t in ex_ins)):
        torch.testing.assert_close(g.double(), e, atol=1e-4, rtol=1e-4)

    # the public function under fullgraph: one frame, and two compiled calls draw two masks
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(DropoutAttention(), backend=counter, fullgraph=True)
    ins = leaves(q, k, v)
    a = compiled(*ins)
    a.sum().backward()
    b = compiled(*ins)
    assert counter.frame_count == 1 and not torch.equal(a.detach(), b.detach())
    assert all(torch.isfinite(t.grad).all() for t in ins)


def test_opcheck_with_dropout():
    q, k, v, dout = qkv(1, 6, 7, 2, 1, 16, torch.float32, seed=13)
    rng = torch.tensor([1, 2], dtype=torch.int64, device=DEVICE)
    args = [q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), 0.25, True, True, None, None, 6, 7,
            -1, -1, 0.0, None, None, 0.2, rng]
    torch.library.opcheck(torch.ops.flashtriton.fwd.default, args)
    out, lse = torch.ops.flashtriton.fwd(*(t.detach() for t in args[:3]), *args[3:])
    torch.library.opcheck(torch.ops.flashtriton.bwd.default,
                          [dout, *(t.detach() for t in args[:3]), out, lse, *args[3:10], None, *args[10:]])


def test_deterministic_is_accepted_with_dropout(device):
    """The mask is a function of the call's (seed, offset) and the backward has no atomics: deterministic=True
    holds with dropout (the same seed, the same bits)."""
    q, k, v, _ = qkv(1, 10, 10, 2, 2, 16, torch.float16, seed=14)
    torch.manual_seed(3)
    a = flashtriton.flash_attn_func(q, k, v, dropout_p=0.2, deterministic=True)
    torch.manual_seed(3)
    assert torch.equal(a, flashtriton.flash_attn_func(q, k, v, dropout_p=0.2, deterministic=True))


def keep_all(s_dmask, allowed, sq, sk):
    return bool((s_dmask[:, :, :sq, :sk][:, :, allowed] >= 0).all())


def _softmax_from_s_dmask(s_dmask, q, k, seqlen_q, seqlen_k, allowed, block_n):
    """What flash-attn's test helpers do with a dropout call's S_dmask, restated: crop it to the call, keep the
    mask `S >= 0` and normalise |S| back to the softmax, each key block by exp(m - lse) with m the running maximum
    from that block to the last. q (Sq, H, D), k (Sk, H, D) of one sequence (heads already repeated)."""
    s = s_dmask[:, :seqlen_q, :seqlen_k].float().masked_fill(~allowed, 0.0)
    scores = torch.einsum("qhd,khd->hqk", q.float() / math.sqrt(q.shape[-1]), k.float())
    scores = scores.masked_fill(~allowed, float("-inf"))
    blocks = scores.split(block_n, dim=-1)
    lse = torch.logsumexp(torch.stack([torch.logsumexp(b, -1) for b in blocks], -1), -1)
    lse[lse == float("-inf")] = float("inf")
    maxes = torch.cummax(torch.stack([b.amax(-1) for b in blocks], -1).flip(-1), -1).values.flip(-1)
    parts = [a * torch.exp(maxes[..., j] - lse)[..., None] for j, a in enumerate(s.abs().split(block_n, dim=-1))]
    return s >= 0, torch.cat(parts, -1)


def test_attn_probs_as_flash_attn_returns_them():
    """return_attn_probs=True with dropout gives flash-attn 2's S_dmask (flash_attn_func, the varlen form and the
    private forward): its sign is the call's keep-mask, and normalised as flash-attn's tests normalise it (block
    size from _get_block_size_n) it is the softmax — over two key blocks, Sq != Sk, MQA, causal with a window."""
    from flashtriton.flash_attn_interface import _flash_attn_forward, _get_block_size_n

    p, (sq, sk, hq, hkv, d), causal, window = 0.3, (24, 140, 2, 1, 16), True, (100, 0)
    q, k, v, _ = qkv(2, sq, sk, hq, hkv, d, torch.float16, seed=7)
    block_n = _get_block_size_n(q.device, d, True, causal)
    variant = Variant(causal=causal, window=window)
    allowed = variant.dense_mask(sq, sk, device=q.device)
    kr = k.repeat_interleave(hq // hkv, dim=2)
    with testing.record_dropout() as calls:
        out, lse, s_dmask = flashtriton.flash_attn_func(q, k, v, dropout_p=p, causal=causal, window_size=window,
                                                        return_attn_probs=True)
    assert s_dmask.shape == (2, hq, 128, 256) and s_dmask.dtype == q.dtype
    assert not keep_all(s_dmask, allowed, sq, sk)  # something is dropped
    keep_call = testing.dropout_mask(calls[0], 2, hq, sq, sk, p)
    for b in range(2):
        keep, attn = _softmax_from_s_dmask(s_dmask[b], q[b], kr[b], sq, sk, allowed, block_n)
        assert torch.equal(keep[:, allowed], keep_call[b][:, allowed])
        scores = torch.einsum("qhd,khd->hqk", q[b].double(), kr[b].double()) / math.sqrt(d)
        want = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
        torch.testing.assert_close(attn.double(), want, atol=2e-3, rtol=0)
    # the out the mask gives (the same mask as the kernels')
    want_out = attention_reference(q, k, v, variant=Variant(causal=causal, window=window, dropout_p=p),
                                   dropout_mask=keep_call)
    assert_close_to_exact(out, attention_reference(q, k, v, dtype=q.dtype, variant=Variant(
        causal=causal, window=window, dropout_p=p), dropout_mask=keep_call), want_out, q.dtype, "out ")
    # the private forward and the varlen form: the same probabilities from their own states
    _, _, s_private, rng = _flash_attn_forward(q, k, v, p, d ** -0.5, causal, *window, return_softmax=True)
    keep, _ = _softmax_from_s_dmask(s_private[0], q[0], kr[0], sq, sk, allowed, block_n)
    assert torch.equal(keep[:, allowed], testing.dropout_mask(rng, 2, hq, sq, sk, p)[0][:, allowed])
    cu = torch.tensor([0, sq, 2 * sq], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, sk, 2 * sk], dtype=torch.int32, device=q.device)
    with testing.record_dropout() as calls:
        _, _, s_var = flashtriton.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu_k,
                                                         sq, sk, dropout_p=p, causal=causal, window_size=window,
                                                         return_attn_probs=True)
    keep_var = testing.dropout_mask(calls[0], 2, hq, sq, sk, p)
    for b in range(2):
        keep, attn = _softmax_from_s_dmask(s_var[b], q[b], kr[b], sq, sk, allowed, block_n)
        assert torch.equal(keep[:, allowed], keep_var[b][:, allowed])
    # an empty sequence and one without keys: their rows of S_dmask stay 0
    cu_gap, cu_k_gap = (torch.tensor(c, dtype=torch.int32, device=q.device) for c in ([0, 0, sq, 2 * sq],
                                                                                     [0, sk, sk, 2 * sk]))
    s_gap = flashtriton.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_gap, cu_k_gap,
                                               sq, sk, dropout_p=p, causal=causal, window_size=window,
                                               return_attn_probs=True)[2]
    assert s_gap.shape[0] == 3 and not s_gap[:2].any() and s_gap[2].any()
    assert flashtriton.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)[2] is None  # no dropout


# ---------------------------------------------------------------------------------------------------------
# The Gluon kernels' dropout (Hopper; on for every call they have a rule for: `configs.GLUON_DROPOUT_ALL`)
# ---------------------------------------------------------------------------------------------------------
def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


class GluonLaunches:
    """The Gluon kernels' launches in a test: the forward's dropout arguments, the backward kernels' names with
    their HAS_DROPOUT."""

    def __init__(self):
        self.fwd, self.bwd = [], []

    def clear(self):
        self.fwd.clear()
        self.bwd.clear()


@pytest.fixture
def gluon_dropout(monkeypatch):
    """Dropout in the Gluon forward and backward on for every call they have a rule for (`configs.GLUON_DROPOUT_ALL`,
    `GLUON_BWD_DROPOUT_ALL`;
    the backward's floors off, so that small shapes take its kernels too; the dense plans made before dropped),
    and the Gluon kernels' launches counted (`GluonLaunches`)."""
    from flashtriton import configs
    from flashtriton.configs import forward as configs_forward
    from flashtriton.kernels import backward_gluon_launch, forward_gluon_launch
    from flashtriton.kernels import forward as kernels_forward

    monkeypatch.setattr(configs_forward, "GLUON_DROPOUT", True)
    monkeypatch.setattr(configs_forward, "GLUON_DROPOUT_ALL", True)
    monkeypatch.setattr(configs.backward, "GLUON_BWD_DROPOUT", True)
    monkeypatch.setattr(configs.backward, "GLUON_BWD_DROPOUT_ALL", True)
    monkeypatch.setattr(configs.backward, "GLUON_BWD_MIN_FLOPS", 0)
    monkeypatch.setattr(configs.backward, "GLUON_BWD_D64_MIN_KEYS", 0)
    kernels_forward._dense_tma_plan.cache_clear()
    launches = GluonLaunches()
    launch_args, launch = forward_gluon_launch.launch_args, backward_gluon_launch._launch

    def counted(q, k, v, out, lse, scalars, *args, **kwargs):
        launches.fwd.append(scalars[-3:])  # (DROPOUT_RNG, dropout_threshold, dropout_scale)
        return launch_args(q, k, v, out, lse, scalars, *args, **kwargs)

    def counted_bwd(fn, plan, grid, args, meta):
        launches.bwd.append((fn.__name__, meta.get("HAS_DROPOUT", False)))
        return launch(fn, plan, grid, args, meta)

    monkeypatch.setattr(forward_gluon_launch, "launch_args", counted)
    monkeypatch.setattr(backward_gluon_launch, "_launch", counted_bwd)
    yield launches
    kernels_forward._dense_tma_plan.cache_clear()


def _took_gluon_with_dropout(launches, p, head_dim=128, backward=True):
    """The last forward ran on the Gluon kernel with this p, and (`backward`) the backward on both Gluon kernels
    with dropout (but at tiles of 256 columns, which the Triton backward runs)."""
    assert launches.fwd, "the Gluon forward did not run"
    rng, threshold, scale = launches.fwd[-1]
    assert isinstance(rng, torch.Tensor) and threshold == dropout_threshold(p) and scale == 1 / (1 - p)
    if not backward:
        return
    if head_dim > 128:
        assert launches.bwd == []
    else:
        assert sorted(launches.bwd[-2:]) == [("_attn_bwd_dkdv_gluon", True), ("_attn_bwd_dq_gluon", True)]


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the Gluon forward: sm_90 only (no interpreter)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape,p", [
    ((2, 300, 300, 4, 2, 128), 0.1),    # GQA; a partial last tile
    ((1, 700, 1100, 4, 4, 64), 0.5),    # Sq != Sk (bottom-right causal)
    ((2, 4100, 4100, 2, 1, 128), 0.1),  # MQA, many tiles per row
    ((1, 200, 330, 2, 2, 96), 0.3),     # a head dim in 128-column tiles
    ((1, 256, 600, 2, 2, 256), 0.2),    # D=256's rule (item by item)
])
def test_gluon_forward_dropout_exact_with_the_recovered_mask(shape, p, causal, dtype, device, gluon_dropout):
    """The Gluon forward drops by the call's mask (`testing.dropout_mask`, the portable kernels' bits) and the Gluon
    backward regenerates it (at D=256 the Triton backward): out, lse, dQ, dK and dV against float64 with that
    mask."""
    batch, sq, sk, hq, hkv, d = shape
    q, k, v, dout = qkv(*shape, dtype, seed=sq + d)
    fn = lambda a, b, c: flashtriton.flash_attn_func(a, b, c, dropout_p=p, causal=causal,  # noqa: E731
                                                     return_attn_probs=True)[:2]
    out, lse, grads, rng = run(fn, (q, k, v), dout)
    _took_gluon_with_dropout(gluon_dropout, p, d)
    mask = testing.dropout_mask(rng, batch, hq, sq, sk, p)
    check((q, k, v), dout, Variant(causal=causal), mask, p, (out, lse, grads), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the Gluon forward: sm_90 only (no interpreter)")
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_forward_dropout_varlen_and_variants(causal, device, gluon_dropout):
    """Varlen (ragged sequences, one empty, lengths past a tile, a single query) and dropout with a window, softcap,
    ALiBi and sinks together, through the Gluon forward and backward: each against float64 with the recovered
    mask. (No sequence of one key: its exact dQ is 0, which torch's autograd reproduces exactly, while a flash
    backward's dS = P (dP - rowsum(dO ∘ O)) carries the rounding of O, scaled by 1 / (1 - p).)"""
    p, hq, hkv, d = 0.2, 4, 2, 128
    check_varlen([130, 0, 333, 17, 1], [200, 64, 333, 300, 9], hq, hkv, d, torch.bfloat16, p, causal, seed=21,
                 after_run=lambda: _took_gluon_with_dropout(gluon_dropout, p))

    gluon_dropout.clear()
    batch, s = 2, 700
    q, k, v, dout = qkv(batch, s, s, hq, hkv, d, torch.float16, seed=22)
    slopes = torch.tensor([0.3, 0.1, 0.05, 0.02], device=DEVICE)
    sinks = torch.tensor([0.5, -1.0, 0.0, 2.0], device=DEVICE)
    window = (200, 0) if causal else (150, 90)
    fn = lambda a, b, c: flashtriton.flash_attn_func(  # noqa: E731
        a, b, c, dropout_p=p, causal=causal, window_size=window, softcap=20.0, alibi_slopes=slopes,
        learnable_sink=sinks, return_attn_probs=True)[:2]
    out, lse, grads, rng = run(fn, (q, k, v), dout)
    _took_gluon_with_dropout(gluon_dropout, p)
    mask = testing.dropout_mask(rng, batch, hq, s, s, p)
    variant = Variant(causal=causal, window=window, softcap=20.0, alibi_slopes=slopes, sinks=sinks)
    check((q, k, v), dout, variant, mask, p, (out, lse, grads), torch.float16)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the Gluon forward: sm_90 only (no interpreter)")
def test_gluon_forward_dropout_kept_fraction(device, gluon_dropout):
    """Through the Gluon forward (two consumers, many tiles per row) the call's mask keeps 1 - p overall and per
    row, and out is the float64 attention with that mask (no backward here)."""
    p, (batch, s, h, d) = 0.1, (2, 2048, 4, 128)
    q, k, v, _ = qkv(batch, s, s, h, h, d, torch.bfloat16, seed=23)
    with testing.record_dropout() as calls:
        out = flashtriton.flash_attn_func(q, k, v, dropout_p=p)
    _took_gluon_with_dropout(gluon_dropout, p, backward=False)
    mask = testing.dropout_mask(calls[0], batch, h, s, s, p)
    kept = mask.float()
    assert abs(kept.mean().item() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / kept.numel())
    per_row = kept.mean(-1)
    assert (per_row - (1 - p)).abs().max().item() < 6 * math.sqrt(p * (1 - p) / s)
    ref = attention_reference(q.double(), k.double(), v.double(), dropout_mask=mask, dropout_p=p)
    lo = attention_reference(q, k, v, dropout_mask=mask, dropout_p=p, dtype=torch.bfloat16)
    assert_close_to_exact(out, lo, ref, torch.bfloat16, "out")
