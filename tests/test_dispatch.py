"""kernels/dispatch.py: the kernel table and the one switch (FLASHTRITON_KERNEL)."""

import warnings

import pytest
import torch

from flashtriton.kernels import dispatch
from flashtriton.kernels.dispatch import Choice, parse
from flashtriton.kernels.variant import Variant


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
    assert dispatch.candidates("fwd", half, 96, 9) == ["portable_fwd"]
    assert dispatch.candidates("fwd", torch.float32, 128, 9) == ["portable_fwd"]
    assert dispatch.candidates("fwd", half, 128, 8) == ["portable_fwd"]
    assert dispatch.candidates("bwd", half, 64, 9, varlen=True) == ["gluon_bwd", "portable_bwd"]
    assert dispatch.candidates("decode", half, 128, 9, paged=True) == ["decode_stream", "decode_split"]
    assert dispatch.candidates("fwd", half, 128, 9, paged=True) == []
    with dispatch.force("tma"):
        assert dispatch.candidates("fwd", half, 128, 9) == ["tma_fwd", "portable_fwd"]
        assert dispatch.candidates("bwd", half, 128, 9) == ["portable_bwd"]
    # a field some kernels do not declare: the call falls to those that do
    assert dispatch.candidates("fwd", half, 96, 9, fields=frozenset({"softcap"})) == ["portable_fwd"]
    assert dispatch.candidates("fwd", half, 128, 9, fields=frozenset({"softcap"})) == ["gluon_fwd", "tma_fwd",
                                                                                       "portable_fwd"]
    assert dispatch.candidates("bwd", half, 128, 9, fields=frozenset({"causal", "window_size"})) == ["gluon_bwd",
                                                                                                 "portable_bwd"]
    assert dispatch.candidates("fwd", half, 128, 9, fields=frozenset({"learnable_sink"})) == ["gluon_fwd", "tma_fwd",
                                                                                              "portable_fwd"]
    assert dispatch.candidates("fwd", half, 128, 9, fields=frozenset({"dropout_p"})) == []


def test_a_field_no_kernel_declares_is_refused_by_name():
    assert dispatch.unsupported_fields(Variant(causal=True).fields()) == []
    assert dispatch.unsupported_fields(Variant(softcap=5.0, window=(3, 3)).fields()) == []
    assert dispatch.unsupported_fields(Variant(dropout_p=0.1, alibi_slopes=torch.ones(2)).fields()) == ["dropout_p"]
    with pytest.raises(NotImplementedError, match="dropout_p"):
        Variant(dropout_p=0.5).require_supported()


def test_the_tma_gate_reads_the_table():
    """The Hopper TMA paths take the head dims the TMA forward declares, and the switch turns them off."""
    from flashtriton.kernels.common import _tma_shapes_ok

    assert dispatch.BY_NAME["tma_fwd"].head_dims == dispatch.BY_NAME["gluon_fwd"].head_dims == (64, 128)
    shape = ((2, 64, 4, 128), (64 * 4 * 128, 4 * 128, 128, 1))
    assert _tma_shapes_ok(dispatch.BY_NAME["tma_fwd"].head_dims, 2, (shape,))
    assert not _tma_shapes_ok(dispatch.BY_NAME["tma_fwd"].head_dims, 2, (((2, 64, 4, 96), (1, 1, 1, 1)),))
