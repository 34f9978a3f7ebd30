"""Features by kernel: variant x kernel (forced through the dispatch) x dtype x awkward shape, forward and backward,
judged against float64 attention under the variant's dense mask (tests/accuracy.py: the error relative to torch's
own in the same dtype).

The switch is an upper bound: `dispatch.force(kernel)` allows that kernel level and the ones below, and the kernel's
tile rule may still pass a shape down. On a GPU the launches are recorded and no kernel above the forced level may
run; at the standard shapes the forced level's own kernel must be the one that runs. Under the interpreter only the
portable kernels exist: the other levels are skipped there. A new variant adds its `Variant` to VARIANTS.
"""

import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import flashtriton
from flashtriton.kernels import dispatch
from flashtriton.kernels.variant import Variant
from flashtriton.reference import attention_reference

from accuracy import assert_close_to_exact
from conftest import DEVICE

VARIANTS = {
    "full": Variant(),
    "causal": Variant(causal=True),
    "causal_top_left": Variant(causal=True, bottom_right=False),
    "window": Variant(window=(7, 3)),
    "window_left": Variant(window=(12, -1)),
    "causal_window": Variant(causal=True, window=(11, 0)),
    "softcap": Variant(softcap=2.0),
    "causal_window_softcap": Variant(causal=True, window=(20, 0), softcap=5.0),
    # per-head tensors: one entry for each query head of the widest shape (the test takes the first Hq)
    "alibi": Variant(alibi_slopes=2.0 ** -torch.arange(1.0, 9.0)),
    "causal_alibi_window_softcap": Variant(causal=True, window=(9, 0), softcap=4.0,
                                           alibi_slopes=0.3 / torch.arange(1.0, 9.0)),
    "sinks": Variant(sinks=torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, -2.0, 0.25, 3.0])),
    "causal_window_sinks": Variant(causal=True, window=(16, 0),
                                   sinks=torch.tensor([1.5, 0.25, -0.5, 3.0, 0.0, -1.0, 2.0, 0.75])),
}
KERNELS = ["portable", "tma", "gluon"]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim): one row, ragged tiles, more queries than keys, GQA
SHAPES = [(1, 1, 1, 1, 1, 64), (2, 37, 91, 4, 2, 64), (1, 91, 37, 2, 1, 64), (1, 64, 64, 3, 3, 40),
          (1, 17, 130, 2, 2, 128)]
BIG = [pytest.param((2, 1024, 1024, 8, 2, d), marks=pytest.mark.gpu) for d in (64, 128)] + \
      [pytest.param((1, 1500, 700, 4, 4, 128), marks=pytest.mark.gpu)]
LEVEL_KERNELS = {  # the kernel names each level owns, forward and backward
    "gluon": ("_attn_fwd_gluon", "_attn_bwd_dkdv_gluon", "_attn_bwd_dq_gluon"),
    "tma": ("_attn_fwd_tma",),
    "portable": ("_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq", "_attn_bwd_preprocess"),
}


def _capability() -> int:
    return 0 if DEVICE == "cpu" else torch.cuda.get_device_capability()[0]


@contextlib.contextmanager
def _recorded_launches():
    """The names of the Triton kernels launched in the block (on a GPU; nothing is recorded by the interpreter)."""
    names = []
    if DEVICE == "cpu":
        yield names
        return
    from triton import knobs

    def hook(metadata):
        names.append(metadata.get()["name"])

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        yield names
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)


def _torch_same_dtype(q, k, v, variant, sinks=None):
    """torch SDPA in the inputs' dtype under the variant's dense mask, (B, S, H, D); softcap as an additive bias
    softcap·tanh(s / softcap) - s of the scaled scores s (differentiable: the gradients include it), ALiBi as its
    bias; rows without a key give 0, as ours."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    sq, sk = q.shape[1], k.shape[1]
    mask = variant.dense_mask(sq, sk, device=q.device)
    bias = mask
    if variant.softcap or variant.alibi_slopes is not None:
        bias = torch.zeros(sq, sk, dtype=q.dtype, device=q.device)
    if variant.softcap:
        group = q.shape[2] // k.shape[2]
        scores = qh @ kh.repeat_interleave(group, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
        bias = bias + (variant.softcap * torch.tanh(scores / variant.softcap) - scores)
    if variant.alibi_slopes is not None:
        distance = (torch.arange(sq)[:, None] + variant.diagonal(sq, sk) - torch.arange(sk)[None, :]).abs()
        bias = bias - (variant.alibi_slopes.cpu()[:, None, None] * distance).to(q.device, q.dtype)
    if bias is not mask:
        bias = bias.masked_fill(~mask, float("-inf"))
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, enable_gqa=q.shape[2] != k.shape[2])
    if sinks is not None:  # the sink's share of each row's softmax leaves the output: out · sigmoid(lse - sink)
        group = q.shape[2] // k.shape[2]
        scores = qh @ kh.repeat_interleave(group, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
        lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")).float(), -1)
        out = out * torch.sigmoid(lse - sinks.float()[:, None]).to(q.dtype)[..., None]
    return torch.nan_to_num(out.transpose(1, 2), nan=0.0)


def _run(shape, variant, kernel, dtype):
    batch, sq, sk, hq, hkv, d = shape
    if all(dispatch.BY_NAME[n].level != kernel for n in dispatch.candidates("fwd", dtype, d, _capability(),
                                                                          fields=variant.fields())):
        pytest.skip(f"the {kernel} kernels do not take {dtype} D={d} on this device")
    gen = torch.Generator().manual_seed(sq * 1000 + sk)
    q, k, v, dout = (torch.randn(s, generator=gen).to(DEVICE, dtype) for s in
                     ((batch, sq, hq, d), (batch, sk, hkv, d), (batch, sk, hkv, d), (batch, sq, hq, d)))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    if variant.alibi_slopes is not None:  # one slope per query head of the shape
        variant = dataclasses.replace(variant, alibi_slopes=variant.alibi_slopes[:hq].to(DEVICE))
    sinks = None
    if variant.sinks is not None:  # one logit per query head, with a gradient (flash-attn keeps it fp32)
        sinks = variant.sinks[:hq].to(DEVICE).requires_grad_()
        variant = dataclasses.replace(variant, sinks=sinks.detach())
    with dispatch.force(kernel), _recorded_launches() as ran:
        slopes = variant.alibi_slopes
        out = flashtriton.flash_attn_func(q, k, v, causal=variant.causal, window_size=variant.window,
                                          softcap=variant.softcap, alibi_slopes=slopes,
                                          learnable_sink=sinks) if variant.bottom_right else \
            flashtriton.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                                     is_causal=variant.causal,
                                                     enable_gqa=hq != hkv).transpose(1, 2)
        grads = torch.autograd.grad(out, (q, k, v) + ((sinks,) if sinks is not None else ()), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    leaves64 = (q64, k64, v64)
    if sinks is not None:
        s64 = sinks.detach().double().requires_grad_()
        variant = dataclasses.replace(variant, sinks=s64)
        leaves64 += (s64,)
    exact = attention_reference(q64, k64, v64, variant=variant)
    exact_grads = torch.autograd.grad(exact, leaves64, dout.double())
    qt, kt, vt = (t.detach().clone().requires_grad_() for t in (q, k, v))
    leaves = (qt, kt, vt)
    if sinks is not None:
        st = sinks.detach().clone().requires_grad_()
        leaves += (st,)
    same = _torch_same_dtype(qt, kt, vt, variant, None if sinks is None else st)
    same_grads = [torch.nan_to_num(g, nan=0.0) for g in torch.autograd.grad(same, leaves, dout)]
    assert_close_to_exact(out, same, exact, dtype, "out")
    for name, ours, theirs, ex in zip(("q", "k", "v", "sink"), grads, same_grads, exact_grads):
        assert_close_to_exact(ours, theirs, ex, dtype, f"d{name}")
    above = [n for level in dispatch.LEVELS[dispatch.LEVELS.index(kernel) + 1:] for n in ran
             if n in LEVEL_KERNELS[level]]
    assert not above, f"forced {kernel}, but {above} ran"
    return ran


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", VARIANTS)
def test_variant_by_kernel(name, kernel, dtype, shape):
    _run(shape, VARIANTS[name], kernel, dtype)


@pytest.mark.parametrize("shape", BIG)
@pytest.mark.parametrize("dtype", DTYPES[:2], ids=str)
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", VARIANTS)
def test_variant_by_kernel_at_standard_shapes(name, kernel, dtype, shape):
    """At the standard shapes the forced level's own forward kernel runs (the Gluon rules name them)."""
    variant = VARIANTS[name]
    ran = _run(shape, variant, kernel, dtype)
    own = {"gluon": "gluon_fwd", "tma": "tma_fwd", "portable": "portable_fwd"}[kernel]
    if shape[1] == shape[2] and dispatch.supports(own, dtype, shape[-1], _capability(), fields=variant.fields()):
        assert LEVEL_KERNELS[kernel][0] in ran, f"forced {kernel}: {ran}"
