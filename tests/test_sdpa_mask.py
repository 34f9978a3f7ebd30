"""`scaled_dot_product_attention` with an attn_mask: a key-padding mask (what encoders and `nn.MultiheadAttention`'s
key_padding_mask pass: bool or 0 / -inf float, (B, 1, 1, Sk) or expanded over queries and heads) and causal and
band masks, against torch's SDPA in float64 with the same mask (forward and gradients), within 2x torch's own error
in the dtype (tests/accuracy.py); and inputs of 3 or more than 4 dims, as torch takes them. The masks it refuses:
tests/test_validation.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flashtriton
from accuracy import assert_close_to_exact


def masked_inputs(batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, device, seed, keep_share=0.7):
    """q (B, H, Sq, D), k, v (B, Hkv, Sk, D) and a (B, Sk) bool keep-mask: random keys kept, batch entry 0 with
    every key, the last (when B > 2) with none."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seqlen_q, head_dim, generator=gen).to(device, dtype)
    k, v = (torch.randn(batch, heads_kv, seqlen_k, head_dim, generator=gen).to(device, dtype) for _ in range(2))
    keep = torch.rand(batch, seqlen_k, generator=gen) < keep_share
    keep[0] = True
    if batch > 2:
        keep[-1] = False
    return q, k, v, keep.to(device)


def sdpa_grads(fn, q, k, v, mask, dout, dtype=None):
    """(out, dq, dk, dv) of `fn` (an SDPA) on copies of q, k, v (cast to `dtype`), GQA as torch takes it."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return (out, *torch.autograd.grad(out, leaves, dout.to(out.dtype)))


def as_float_mask(keep, dtype):
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, float("-inf"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("form", ["bool_b11k", "float_b11k", "bool_expanded", "bool_k"])
@pytest.mark.parametrize("shape", [(3, 4, 2, 37, 53, 32), (2, 2, 2, 65, 130, 64),
                                   pytest.param((4, 16, 8, 1024, 2048, 128), marks=pytest.mark.gpu)])
def test_key_padding_mask_against_float64(form, shape, dtype, device):
    batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim = shape
    if form == "bool_k":  # one (Sk,) mask for every batch entry: all of them see the same keys
        batch = 2
    q, k, v, keep = masked_inputs(batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, device, seed=seqlen_k)
    keep4 = keep[:, None, None, :]
    mask = {"bool_b11k": keep4, "float_b11k": as_float_mask(keep4, dtype),
            "bool_expanded": keep4.expand(batch, 1, seqlen_q, seqlen_k),
            "bool_k": keep[1]}[form]
    reference_mask = mask if form != "bool_k" else keep[1][None, None, None, :].expand(batch, 1, 1, seqlen_k)
    dout = torch.randn(batch, heads, seqlen_q, head_dim, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    ours = sdpa_grads(flashtriton.scaled_dot_product_attention, q, k, v, mask, dout)
    exact = sdpa_grads(F.scaled_dot_product_attention, q, k, v, reference_mask.to(torch.float64)
                       if reference_mask.is_floating_point() else reference_mask, dout, torch.float64)
    theirs = sdpa_grads(F.scaled_dot_product_attention, q, k, v, reference_mask, dout)
    for name, o, t, e in zip(("out", "dq", "dk", "dv"), ours, theirs, exact):
        assert o.shape == e.shape and o.dtype == dtype, name
        assert_close_to_exact(o, t, e, dtype, f"{form} {shape}: {name}")
    if batch > 2 and form != "bool_k":  # a batch entry that keeps no key: 0, as torch's math backend gives
        assert torch.equal(ours[0][-1], torch.zeros_like(ours[0][-1]))


def test_a_mask_that_keeps_every_key_is_the_call_without_it(device):
    """All True (or all 0.0): the dense call itself, bit for bit."""
    q, k, v, keep = masked_inputs(2, 2, 2, 16, 24, 16, torch.float16, device, seed=0, keep_share=2.0)
    plain = flashtriton.scaled_dot_product_attention(q, k, v)
    assert torch.equal(flashtriton.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :]), plain)
    zeros = torch.zeros(2, 1, 1, 24, dtype=torch.float16, device=device)
    assert torch.equal(flashtriton.scaled_dot_product_attention(q, k, v, attn_mask=zeros), plain)


def test_key_padding_mask_with_dropout_reproduces(device):
    """dropout_p runs with the mask (the packed call's dropout): a seed reproduces the output, two seeds differ."""
    q, k, v, keep = masked_inputs(2, 2, 2, 16, 32, 16, torch.float16, device, seed=3)
    mask = keep[:, None, None, :]
    runs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        runs.append(flashtriton.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.3))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


def test_a_mask_under_torch_compile_is_refused_by_name(device):
    """Reading the mask's values needs the host: a fullgraph compile fails with that reason (torch.compile's own
    error carries it); without fullgraph the call runs eagerly at a graph break."""
    q, k, v, keep = masked_inputs(1, 2, 2, 8, 8, 16, torch.float16, device, seed=0)
    fn = torch.compile(flashtriton.scaled_dot_product_attention, fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="reads attn_mask's values on the host"):
        fn(q, k, v, attn_mask=keep[:, None, None, :])


@pytest.mark.parametrize("scale", [-0.4, 1.7])
def test_key_padding_mask_with_a_scale_in_fp32(scale, device):
    """fp32 inputs and a negative or large scale take the same packed path (scale passed through, q negated for
    a negative one)."""
    q, k, v, keep = masked_inputs(3, 2, 1, 9, 21, 24, torch.float32, device, seed=7)
    mask = keep[:, None, None, :]
    ours = flashtriton.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=scale,
                                           enable_gqa=True)
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    assert_close_to_exact(ours, theirs, exact, torch.float32, f"scale {scale}")


@pytest.mark.parametrize("case", ["3d", "3d_gqa_causal", "5d", "5d_mask", "6d_mask_4d", "3d_mask"])
def test_inputs_of_other_ranks_as_torch_takes_them(case, device):
    """(..., H, S, D) of 3 or more than 4 dims: the dims before the heads a batch, as torch's SDPA has it (GQA on
    the head dim, a mask broadcast over the leading dims), forward and gradients against torch's in float64."""
    lead, heads, heads_kv, causal, mask_shape = {
        "3d": ((), 2, 2, False, None), "3d_gqa_causal": ((), 4, 2, True, None), "5d": ((2, 3), 2, 1, False, None),
        "5d_mask": ((2, 3), 2, 2, False, (2, 1, 1, 1, 40)), "6d_mask_4d": ((2, 1, 2), 2, 2, False, (2, 1, 1, 40)),
        "3d_mask": ((), 2, 2, False, (1, 1, 40))}[case]
    gen = torch.Generator().manual_seed(len(case))
    q = torch.randn(*lead, heads, 17, 32, generator=gen).to(device, torch.float16)
    k, v = (torch.randn(*lead, heads_kv, 40, 32, generator=gen).to(device, torch.float16) for _ in range(2))
    mask = None
    if mask_shape is not None:
        mask = torch.rand(mask_shape, generator=gen) < 0.6
        mask[..., 0] = True
        mask = mask.to(device)
    dout = torch.randn(*lead, heads, 17, 32, generator=gen).to(device, torch.float16)

    def grads(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, attn_mask=mask, is_causal=causal, enable_gqa=heads != heads_kv)
        return (out, *torch.autograd.grad(out, leaves, dout.to(dtype)))

    ours = grads(flashtriton.scaled_dot_product_attention, torch.float16)
    theirs = grads(F.scaled_dot_product_attention, torch.float16)
    exact = grads(F.scaled_dot_product_attention, torch.float64)
    for name, o, t, e in zip(("out", "dq", "dk", "dv"), ours, theirs, exact):
        assert o.shape == e.shape, (case, name, o.shape, e.shape)
        assert_close_to_exact(o, t, e, torch.float16, f"{case}: {name}")


def test_inputs_of_other_ranks_that_torch_would_broadcast_are_refused(device):
    """Leading dims that differ between query and key/value (torch's math backend broadcasts them), unequal
    ranks and fewer than 3 dims: refused by name."""
    q = torch.randn(2, 3, 2, 8, 16, dtype=torch.float16, device=device)
    kv = torch.randn(2, 1, 2, 8, 16, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="leading .batch. dims of query and key must be equal"):
        flashtriton.scaled_dot_product_attention(q, kv, kv)
    with pytest.raises(ValueError, match="same number of dims"):
        flashtriton.scaled_dot_product_attention(q, q[0], q[0])
    with pytest.raises(ValueError, match="at least 3 dims"):
        flashtriton.scaled_dot_product_attention(q[0, 0, 0], q[0, 0, 0], q[0, 0, 0])
    with pytest.raises(ValueError, match="does not broadcast to the query's batch dims"):
        flashtriton.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(3, 3, 1, 1, 8, dtype=torch.bool,
                                                                                 device=device))


def band_mask(seqlen_q, seqlen_k, left, right, diagonal, device):
    """(Sq, Sk) bool: query i sees key j iff i + diagonal - left <= j <= i + diagonal + right (None: unbounded)."""
    rows = torch.arange(seqlen_q, device=device)[:, None] + diagonal
    keys = torch.arange(seqlen_k, device=device)[None, :]
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left is not None:
        keep &= keys >= rows - left
    if right is not None:
        keep &= keys <= rows + right
    return keep


# (Sq, Sk, left, right, diagonal): causal top-left (torch's is_causal: tril) at Sq = Sk, < Sk, > Sk; causal
# bottom-right (Sk - Sq); a sliding window (w, 0); a band on both sides; bands about the bottom-right diagonal
BAND_MASKS = {
    "tril": (40, 40, None, 0, 0), "tril_short_q": (23, 70, None, 0, 0), "tril_long_q": (70, 23, None, 0, 0),
    "causal_bottom_right": (23, 70, None, 0, 47), "causal_bottom_right_long_q": (70, 23, None, 0, -47),
    "sliding_window": (65, 65, 16, 0, 0), "band": (65, 65, 5, 9, 0), "band_bottom_right": (33, 90, 20, 3, 57),
    "left_only_bottom_right": (33, 90, 20, None, 57), "upper_triangle": (40, 40, 0, None, 0),
}


@pytest.mark.parametrize("form", ["bool", "float", "bool_b1qk"])
@pytest.mark.parametrize("name", list(BAND_MASKS))
def test_causal_and_band_masks_against_float64(name, form, device):
    """A causal or band mask (the same for every batch entry and head) runs as is_causal / flash-attn's causal and
    window_size: against torch's SDPA in float64 with the mask itself, forward and gradients, GQA, fp16."""
    seqlen_q, seqlen_k, left, right, diagonal = BAND_MASKS[name]
    q, k, v, _ = masked_inputs(2, 4, 2, seqlen_q, seqlen_k, 32, torch.float16, device, seed=seqlen_q + seqlen_k)
    keep = band_mask(seqlen_q, seqlen_k, left, right, diagonal, device)
    mask = {"bool": keep, "float": as_float_mask(keep, torch.float16),
            "bool_b1qk": keep[None, None].expand(2, 1, seqlen_q, seqlen_k)}[form]
    dout = torch.randn(2, 4, seqlen_q, 32, generator=torch.Generator().manual_seed(2)).to(device, torch.float16)
    ours = sdpa_grads(flashtriton.scaled_dot_product_attention, q, k, v, mask, dout)
    exact = sdpa_grads(F.scaled_dot_product_attention, q, k, v, mask.double() if mask.is_floating_point() else mask,
                       dout, torch.float64)
    theirs = sdpa_grads(F.scaled_dot_product_attention, q, k, v, mask, dout)
    for label, o, t, e in zip(("out", "dq", "dk", "dv"), ours, theirs, exact):
        e = torch.nan_to_num(e)  # (rows that see no key: torch's math backend gives 0 or NaN by version; ours 0)
        t = torch.nan_to_num(t)
        assert_close_to_exact(o, t, e, torch.float16, f"{name} {form}: {label}")


def test_generate_square_subsequent_mask_is_is_causal(device):
    """nn.Transformer's causal mask (float, 0 / -inf) gives the is_causal call, bit for bit."""
    q, k, v, _ = masked_inputs(2, 2, 2, 48, 48, 16, torch.float16, device, seed=5)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(48, device=device, dtype=torch.float16)
    assert torch.equal(flashtriton.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                       flashtriton.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.gpu
def test_band_masks_on_large_shapes(device):
    """The kernels the dispatch picks for long sequences (Hopper: the Gluon ones) under a causal and a band mask."""
    for seqlen_q, seqlen_k, left, right, diagonal in ((2048, 2048, None, 0, 0), (1024, 4096, 512, 0, 3072),
                                                      (2048, 2048, 256, 128, 0)):
        q, k, v, _ = masked_inputs(2, 8, 4, seqlen_q, seqlen_k, 128, torch.bfloat16, device, seed=seqlen_k)
        mask = band_mask(seqlen_q, seqlen_k, left, right, diagonal, device)
        dout = torch.randn(2, 8, seqlen_q, 128, generator=torch.Generator().manual_seed(3)).to(device, torch.bfloat16)
        ours = sdpa_grads(flashtriton.scaled_dot_product_attention, q, k, v, mask, dout)
        exact = sdpa_grads(F.scaled_dot_product_attention, q, k, v, mask, dout, torch.float64)
        theirs = sdpa_grads(F.scaled_dot_product_attention, q, k, v, mask, dout)
        for label, o, t, e in zip(("out", "dq", "dk", "dv"), ours, theirs, exact):
            assert_close_to_exact(o, t, e, torch.bfloat16, f"{seqlen_q}/{seqlen_k} ({left}, {right}): {label}")
