"""kernels/dispatch.py: the kernel table and the one switch (FLASHTRITON_KERNEL)."""

import warnings

import pytest
import torch

from flashtriton.kernels import dispatch
from flashtriton.kernels.dispatch import Choice, parse
from flashtriton.kernels.variant import Variant

from conftest import DEVICE


def test_the_switch_names_levels_and_a_decode_schedule():
    assert parse({}) == Choice("gluon", "auto", True)
    assert parse({"FLASHTRITON_KERNEL": "auto"}) == parse({"FLASHTRITON_KERNEL": "gluon"}) == Choice()
    assert parse({"FLASHTRITON_KERNEL": "tma"}).level == "tma"
    assert parse({"FLASHTRITON_KERNEL": " Portable "}).level == "portable"
    assert parse({"FLASHTRITON_KERNEL": "portable,stream"}) == Choice("portable", "stream", True)
    assert parse({"FLASHTRITON_KERNEL": "auto,split"}).decode == "split"
    for bad in ("cudnn", "tma,grid", "auto,split,stream", "stream"):
        with pytest.raises(ValueError, match="FLASHTRITON_KERNEL"):
            parse({"FLASHTRITON_KERNEL": bad})


@pytest.mark.parametrize("legacy,value,expected", [
    ("FLASHTRITON_TMA", "0", Choice("portable")), ("FLASHTRITON_GLUON", "0", Choice("tma")),
    ("FLASHTRITON_GLUON_BWD", "0", Choice(gluon_bwd=False)), ("FLASHTRITON_DECODE_SCHEDULE", "grid", Choice(decode="split")),
    ("FLASHTRITON_DECODE_SCHEDULE", "stream", Choice(decode="stream"))])
def test_the_older_switches_map_and_warn(legacy, value, expected):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert parse({legacy: value}) == expected
    assert any(legacy in str(w.message) and w.category is FutureWarning for w in caught)
    with pytest.raises(ValueError, match="FLASHTRITON_DECODE_SCHEDULE"):
        parse({"FLASHTRITON_DECODE_SCHEDULE": "fastest"})


def test_an_older_switch_never_raises_the_level():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert parse({"FLASHTRITON_KERNEL": "portable", "FLASHTRITON_GLUON": "0"}).level == "portable"


def test_force_sets_the_switch_for_a_block_and_restores_it():
    before = dispatch.CHOICE
    with dispatch.force("portable", "stream"):
        assert not dispatch.allows("tma") and dispatch.allows("portable") and dispatch.decode_schedule() == "stream"
    with dispatch.force(gluon_bwd=False):
        assert dispatch.allows("gluon") and not dispatch.gluon_bwd_allowed()
    with pytest.raises(RuntimeError), dispatch.force("tma"):
        raise RuntimeError
    assert dispatch.CHOICE == before


@pytest.mark.parametrize("op", ["fwd", "bwd", "decode"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_every_call_has_a_portable_kernel(op, dtype):
    """Whatever the GPU, head dim and switch, some kernel declares plain and causal attention."""
    with dispatch.force("portable"):
        for capability in (0, 8, 9, 10):
            for head_dim in range(1, 257):
                for fields in (frozenset(), frozenset({"causal"})):
                    assert dispatch.candidates(op, dtype, head_dim, capability, False, False, fields), \
                        (op, dtype, capability, head_dim)


def test_candidates_follow_the_table_and_the_switch():
    half = torch.bfloat16
    assert dispatch.candidates("fwd", half, 128, 9) == ["gluon_fwd", "tma_fwd", "portable_fwd"]
    assert dispatch.candidates("fwd", half, 96, 9) == ["gluon_fwd", "portable_fwd"]  # tiles of 128
    assert dispatch.candidates("fwd", half, 72, 9) == ["gluon_fwd", "portable_fwd"]  # tiles of 128 too
    assert dispatch.candidates("fwd", half, 59, 9) == ["portable_fwd"]  # rows of 118 bytes: no TMA
    assert dispatch.candidates("bwd", half, 224, 9) == ["gluon_bwd", "portable_bwd"]
    assert dispatch.candidates("fwd", torch.float32, 128, 9) == ["portable_fwd"]
    assert dispatch.candidates("fwd", half, 128, 8) == ["portable_fwd"]
    assert dispatch.candidates("bwd", half, 64, 9, varlen=True) == ["gluon_bwd", "portable_bwd"]
    assert dispatch.candidates("decode", half, 128, 9, paged=True) == ["decode_stream", "decode_split"]
    assert dispatch.candidates("fwd", half, 128, 9, paged=True) == ["gluon_fwd", "portable_fwd"]  # paged prefill
    assert dispatch.candidates("bwd", half, 128, 9, varlen=True, paged=True) == []
    with dispatch.force("tma"):
        assert dispatch.candidates("fwd", half, 128, 9) == ["tma_fwd", "portable_fwd"]
        assert dispatch.candidates("bwd", half, 128, 9) == ["portable_bwd"]
    # a field some kernels do not declare: the call falls to those that do
    assert dispatch.candidates("fwd", half, 59, 9, fields=frozenset({"softcap"})) == ["portable_fwd"]
    assert dispatch.candidates("fwd", half, 72, 9, fields=frozenset({"softcap"})) == ["gluon_fwd", "portable_fwd"]
    assert dispatch.candidates("fwd", half, 128, 9, fields=frozenset({"softcap"})) == ["gluon_fwd", "tma_fwd",
                                                                                       "portable_fwd"]
    assert dispatch.candidates("bwd", half, 128, 9, fields=frozenset({"causal", "window_size"})) == ["gluon_bwd",
                                                                                                 "portable_bwd"]
    assert dispatch.candidates("fwd", half, 128, 9, fields=frozenset({"learnable_sink"})) == ["gluon_fwd", "tma_fwd",
                                                                                              "portable_fwd"]
    # dropout: the Gluon kernels (where configs.GLUON_DROPOUT_FWD / GLUON_BWD_DROPOUT_CASES name the case) and the
    # portable ones
    assert dispatch.candidates("fwd", half, 128, 9, fields=frozenset({"dropout_p"})) == ["gluon_fwd", "portable_fwd"]
    assert dispatch.candidates("bwd", half, 128, 9, fields=frozenset({"causal", "dropout_p"})) == ["gluon_bwd",
                                                                                                  "portable_bwd"]
    assert dispatch.candidates("decode", half, 128, 9, fields=frozenset({"dropout_p"})) == []


def test_a_field_no_kernel_declares_is_refused_by_name():
    assert dispatch.unsupported_fields(Variant(causal=True).fields()) == []
    assert dispatch.unsupported_fields(Variant(softcap=5.0, window=(3, 3)).fields()) == []
    assert dispatch.unsupported_fields(Variant(dropout_p=0.1, alibi_slopes=torch.ones(2)).fields()) == []
    assert dispatch.unsupported_fields(frozenset({"causal", "attn_mask"})) == ["attn_mask"]


def test_the_tma_gate_reads_the_table():
    """The Hopper TMA paths take the head dims the TMA forward declares, and the switch turns them off."""
    from flashtriton.kernels.common import _tma_shapes_ok

    assert dispatch.BY_NAME["tma_fwd"].head_dims == (64, 128)
    assert dispatch.BY_NAME["gluon_fwd"].head_dims == tuple(range(8, 257, 8))  # in tiles of 64, 128, 256 columns
    shape = ((2, 64, 4, 128), (64 * 4 * 128, 4 * 128, 128, 1))
    assert _tma_shapes_ok(dispatch.BY_NAME["tma_fwd"].head_dims, 2, (shape,))
    assert not _tma_shapes_ok(dispatch.BY_NAME["tma_fwd"].head_dims, 2, (((2, 64, 4, 96), (1, 1, 1, 1)),))


def test_a_separate_v_head_dim_takes_the_kernels_that_declare_it():
    """v.shape[-1] != q.shape[-1]: only the kernels that declare `separate_v` (the Gluon forward and backward on
    sm_90, the portable ones, decode's) take the call; the Gluon kernels' configs then decide per pair of head
    dims."""
    half = torch.float16
    for capability in (0, 8, 9):
        for varlen in (False, True):
            gluon = ["gluon_fwd"] if capability == 9 else []
            fwd = dispatch.candidates("fwd", half, 128, capability, varlen, separate_v=True)
            assert fwd == gluon + ["portable_fwd"]
            gluon = ["gluon_bwd"] if capability == 9 else []
            assert dispatch.candidates("bwd", half, 64, capability, varlen, separate_v=True) == gluon + ["portable_bwd"]
    assert dispatch.candidates("fwd", half, 192, 9, fields=frozenset({"causal", "softcap"}), separate_v=True) == \
        ["gluon_fwd", "portable_fwd"]
    assert dispatch.candidates("decode", half, 128, 9, separate_v=True) == ["decode_stream", "decode_split"]
    assert dispatch.supports("gluon_fwd", half, 128, 9, separate_v=True)
    assert not dispatch.supports("tma_fwd", half, 128, 9, True, False, frozenset(), True)
    assert dispatch.supports("gluon_bwd", half, 128, 9, separate_v=True)
    with dispatch.force("portable"):
        for op in ("fwd", "bwd", "decode"):
            for head_dim in range(1, 257):
                assert dispatch.candidates(op, torch.float32, head_dim, 9, separate_v=True), (op, head_dim)


def test_the_dense_hopper_plan_refuses_a_separate_v_head_dim(monkeypatch):
    """`_dense_tma_plan` where the layout passes (faked: no Hopper GPU here): a plan for Dv == D, None for Dv != D."""
    from flashtriton.kernels import forward

    monkeypatch.setattr(forward, "tma_layout_ok", lambda *a: True)
    monkeypatch.setattr(forward, "capability", lambda device: (9, 0))
    plan = forward._dense_tma_plan.__wrapped__  # (not the cache: the fakes must not outlive the test)
    device, variant = torch.device("cuda", 0), Variant(causal=True)
    q_shape, k_shape = (2, 256, 8, 128), (2, 256, 2, 128)
    strides = (256 * 8 * 128, 8 * 128, 128, 1)
    kv_strides = (256 * 2 * 128, 2 * 128, 128, 1)
    with dispatch.force("auto"):
        same = plan(q_shape, strides, k_shape, kv_strides, kv_strides, torch.float16, device, variant, True, False)
        assert same is not None and same.fn is forward._attn_fwd_tma
        v_shape, v_strides = (2, 256, 2, 64), (256 * 2 * 64, 2 * 64, 64, 1)
        assert plan(q_shape, strides, k_shape, kv_strides, v_strides, torch.float16, device, variant, True, True,
                    v_shape) is None  # V's tiles (64) narrower than QK's (128): no Gluon rule, no TMA kernel


def test_the_dense_hopper_plan_takes_the_gluon_kernel_for_mla_head_dims(monkeypatch):
    """QK 192 / V 128 (DeepSeek's MLA) with the layout faked to pass: the Gluon kernel's plan, QK in 256-column
    tiles and V and O in 128 (`configs.GLUON_SEPARATE_V_FWD`), out strides of V's head dim."""
    from flashtriton.kernels import forward

    monkeypatch.setattr(forward, "tma_layout_ok", lambda *a: True)
    monkeypatch.setattr(forward, "capability", lambda device: (9, 0))
    monkeypatch.setattr(forward, "sm_count", lambda index: 132)
    if forward.forward_gluon_launch is None:
        pytest.skip("no Gluon in this Triton")
    plan = forward._dense_tma_plan.__wrapped__
    device, variant = torch.device("cuda", 0), Variant(causal=True)
    q_shape, k_shape, v_shape = (2, 256, 8, 192), (2, 256, 2, 192), (2, 256, 2, 128)
    strides, kv_strides = (256 * 8 * 192, 8 * 192, 192, 1), (256 * 2 * 192, 2 * 192, 192, 1)
    v_strides = (256 * 2 * 128, 2 * 128, 128, 1)
    with dispatch.force("auto"):
        mla = plan(q_shape, strides, k_shape, kv_strides, v_strides, torch.bfloat16, device, variant, True, True,
                   v_shape)
    assert mla is not None and mla.gluon
    assert (mla.meta["HEAD_DIM"], mla.meta["HEAD_DIM_V"]) == (256, 128)
    assert mla.ints[:2] == (8 * 128, 128)  # out's row and head strides: V's head dim


class _HopperPathTaken(Exception):
    pass


def _hopper_path(*args, **kwargs):
    raise _HopperPathTaken


@pytest.mark.parametrize("head_dim_v", [64, 128])
def test_the_varlen_hopper_gate_refuses_a_separate_v_head_dim(monkeypatch, head_dim_v):
    """The varlen forward with `tma_ok` faked true: Dv == D reaches a Hopper launcher, Dv != D runs the portable
    kernel (the interpreter here)."""
    from flashtriton.kernels import forward

    monkeypatch.setattr(forward, "tma_ok", lambda *t: True)
    monkeypatch.setattr(forward, "_launch_forward_tma", _hopper_path)
    if forward.forward_gluon_launch is not None:
        monkeypatch.setattr(forward.forward_gluon_launch, "launch_forward_gluon", _hopper_path)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE)
    q, k = (torch.randn(7, 2, 64, dtype=torch.float16, device=DEVICE) for _ in range(2))
    v = torch.randn(7, 2, head_dim_v, dtype=torch.float16, device=DEVICE)
    with dispatch.force("auto"):
        if head_dim_v == 64:
            with pytest.raises(_HopperPathTaken):
                forward.attention_forward(q, k, v, 0.125, True, True, cu, cu, 4, 4)
        else:
            out, _ = forward.attention_forward(q, k, v, 0.125, True, True, cu, cu, 4, 4)
            assert out.shape == (7, 2, 128)


@pytest.mark.parametrize("head_dim_v", [64, 128, 256])
def test_the_gluon_backward_gate_follows_the_pair_config(monkeypatch, head_dim_v):
    """The backward with `tma_ok` faked true and the Gluon configs' floors at 0: D = 64 with Dv = 64 or 128 (pairs
    `configs.gluon_bwd_config` has a config for) reaches the Gluon launcher; Dv = 256 beside D = 64 (a pair it refuses:
    the dV tiles would not fit a warpgroup) runs the Triton kernels."""
    from types import SimpleNamespace

    from flashtriton import configs
    from flashtriton.kernels import backward, forward

    q, k = (torch.randn(1, 9, 2, 64, dtype=torch.float16, device=DEVICE) for _ in range(2))
    v = torch.randn(1, 9, 2, head_dim_v, dtype=torch.float16, device=DEVICE)
    out, lse = forward.attention_forward(q, k, v, 0.125, True)
    monkeypatch.setattr(backward, "tma_ok", lambda *t: True)
    monkeypatch.setattr(configs.backward, "GLUON_BWD_MIN_FLOPS", 0)
    monkeypatch.setattr(configs.backward, "GLUON_BWD_D64_MIN_KEYS", 0)
    monkeypatch.setattr(backward, "backward_gluon_launch", SimpleNamespace(padded_rows=_hopper_path))
    with dispatch.force("auto"):
        if head_dim_v <= 128:
            with pytest.raises(_HopperPathTaken):
                backward.attention_backward(torch.ones_like(out), q, k, v, out, lse, 0.125, True)
        else:
            dq, dk, dv = backward.attention_backward(torch.ones_like(out), q, k, v, out, lse, 0.125, True)
            assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
