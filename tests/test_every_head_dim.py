"""Every head dim 1 … 256 through the public API: out and the gradients of q, k, v against float64 attention,
judged relative to torch's own error in the same dtype (tests/accuracy.py), through the kernel the dispatch picks
for that head dim. On Hopper that is the Gluon kernels at their head dims (`configs.GLUON_HEAD_DIMS`), the call
padded with zero columns to one of them where `ops.padded_head_dim` says so, the portable kernels elsewhere; the
Gluon backward is allowed at every size here, so that these small shapes reach it. Each call's kernels are
recorded and must be the ones that rule names.

The interpreter runs a sample of head dims (each edge of a tile width and of the padding rule); the GPU runs all
256 (marked `gpu`), and the sample once more on the portable kernels alone."""

from __future__ import annotations

import pytest
import torch

import flashtriton
from flashtriton import configs, ops
from flashtriton.configs import backward as configs_backward
from flashtriton.kernels import dispatch
from flashtriton.kernels.variant import Variant

from conftest import DEVICE
from test_features import _recorded_launches
from test_head_dim_v import _inputs, _judge

HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] == 9
# Head dims at and past each tile width (16, 64, 128, 256), multiples of 8 inside a tile (8, 40, 160) and the padding
# rule's edges (the next multiple of 8, where it is at most 2 D: 3 is not padded, 4 is, 59 and 111 are).
SAMPLE = (1, 3, 4, 8, 9, 16, 17, 33, 40, 59, 64, 65, 111, 113, 128, 129, 160, 193, 255, 256)
SHAPE = (2, 37, 45, 4, 2)  # (batch, seqlen_q, seqlen_k, heads_q, heads_kv): GQA, Sq != Sk, ragged tiles


def _params():
    return [pytest.param(d, id=f"D{d}", marks=() if d in SAMPLE else pytest.mark.gpu) for d in range(1, 257)]


def _dtype(head_dim: int) -> torch.dtype:
    return torch.bfloat16 if (head_dim // 8) % 2 else torch.float16


def _expected(head_dim: int, q, k, v) -> tuple[set[str], set[str]]:
    """The forward kernels the dispatch may pick for this head dim on this GPU (names as launched; the Gluon
    forward's config rule passes some shapes on to the TMA kernel at 64 / 128), and the backward kernels it picks."""
    run_at = ops.padded_head_dim(q, k, v) or head_dim
    gluon = HOPPER and dispatch.allows("gluon")
    fwd = {"_attn_fwd_gluon", "_attn_fwd_tma"} if gluon and run_at in configs.GLUON_HEAD_DIMS else {"_attn_fwd"}
    if gluon and dispatch.gluon_bwd_allowed() and run_at in configs.GLUON_BWD_HEAD_DIMS:
        return fwd, {"_attn_bwd_dkdv_gluon", "_attn_bwd_dq_gluon"}
    return fwd, {"_attn_bwd_dkdv", "_attn_bwd_dq"}


def _run(head_dim: int, causal: bool):
    dtype = _dtype(head_dim)
    q, k, v, dout = _inputs(SHAPE, (head_dim, head_dim), dtype)
    got = {}

    def call():
        got["out"] = out = flashtriton.flash_attn_func(q, k, v, causal=causal)
        got["grads"] = torch.autograd.grad(out, (q, k, v), dout)

    with _recorded_launches() as names:
        call()
    _judge(got["out"], got["grads"], q, k, v, dout, Variant(causal=causal), dtype)
    if DEVICE == "cuda":  # the attention kernels the rule names ran, and no other (the preprocess aside)
        fwd, bwd = _expected(head_dim, q, k, v)
        ran_fwd = {n for n in names if n.startswith("_attn_fwd")}
        ran_bwd = {n for n in names if n.startswith("_attn_bwd") and n != "_attn_bwd_preprocess"}
        assert len(ran_fwd) == 1 and ran_fwd <= fwd and ran_bwd == bwd, (head_dim, names)


@pytest.fixture
def gluon_bwd_everywhere(monkeypatch):
    monkeypatch.setattr(configs_backward, "GLUON_BWD_MIN_FLOPS", 0)
    monkeypatch.setattr(configs_backward, "GLUON_BWD_D64_MIN_KEYS", 0)


@pytest.mark.parametrize("head_dim", _params())
def test_every_head_dim_against_float64(head_dim, gluon_bwd_everywhere):
    """Causal for every other multiple of 8 (so that each tile width meets both), through the dispatch's kernels."""
    _run(head_dim, causal=(head_dim // 8) % 2 == 0)


@pytest.mark.skipif(not HOPPER, reason="the dispatch picks the portable kernels already off Hopper")
@pytest.mark.parametrize("head_dim", SAMPLE, ids=[f"D{d}" for d in SAMPLE])
def test_sampled_head_dims_on_the_portable_kernels(head_dim):
    with dispatch.force("portable"):
        _run(head_dim, causal=(head_dim // 8) % 2 == 1)
