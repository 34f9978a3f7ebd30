"""Features by kernel: variant x kernel (forced through the dispatch) x dtype x awkward shape, forward and backward,
judged against float64 attention under the variant's dense mask (tests/accuracy.py: the error relative to torch's
own in the same dtype).

The switch is an upper bound: `dispatch.force(kernel)` allows that kernel level and the ones below, and the kernel's
tile rule may still pass a shape down. On a GPU the launches are recorded and no kernel above the forced level may
run; at the standard shapes the forced level's own kernel must be the one that runs. Under the interpreter only the
portable kernels exist: the other levels are skipped there. A new variant adds its `Variant` to VARIANTS.
"""

import contextlib

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


def _torch_same_dtype(q, k, v, mask):
    """torch SDPA in the inputs' dtype under the dense mask, (B, S, H, D); rows without a key give 0, as ours."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=q.shape[2] != k.shape[2])
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
    with dispatch.force(kernel), _recorded_launches() as ran:
        out = flashtriton.flash_attn_func(q, k, v, causal=variant.causal) if variant.bottom_right else \
            flashtriton.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                                     is_causal=variant.causal,
                                                     enable_gqa=hq != hkv).transpose(1, 2)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    mask = variant.dense_mask(sq, sk, device=DEVICE)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    exact = attention_reference(q64, k64, v64, variant=variant)
    exact_grads = torch.autograd.grad(exact, (q64, k64, v64), dout.double())
    qt, kt, vt = (t.detach().clone().requires_grad_() for t in (q, k, v))
    same = _torch_same_dtype(qt, kt, vt, mask)
    same_grads = [torch.nan_to_num(g, nan=0.0) for g in torch.autograd.grad(same, (qt, kt, vt), dout)]
    assert_close_to_exact(out, same, exact, dtype, "out")
    for name, ours, theirs, ex in zip("qkv", grads, same_grads, exact_grads):
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
    ran = _run(shape, VARIANTS[name], kernel, dtype)
    if shape[1] == shape[2]:
        assert LEVEL_KERNELS[kernel][0] in ran, f"forced {kernel}: {ran}"
