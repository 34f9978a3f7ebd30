"""The variant description (kernels/variant.py): its mask against the definition written out pair by pair."""

import itertools

import pytest
import torch

from flashtriton.kernels.variant import Variant
from flashtriton.reference import attention_reference, causal_mask

SHAPES = [(1, 1), (1, 7), (7, 1), (5, 5), (3, 11), (11, 3), (16, 16), (9, 40)]
WINDOWS = [(-1, -1), (0, 0), (2, -1), (-1, 3), (4, 1), (0, 6)]


def _definition(variant: Variant, sq: int, sk: int, d: int) -> torch.Tensor:
    """Query i sees key j iff j <= i + d (causal) and i + d - left <= j <= i + d + right (-1 = unbounded)."""
    left, right = variant.window
    mask = torch.zeros(sq, sk, dtype=torch.bool)
    for i, j in itertools.product(range(sq), range(sk)):
        ok = not variant.causal or j <= i + d
        ok = ok and (left < 0 or j >= i + d - left) and (right < 0 or j <= i + d + right)
        mask[i, j] = ok
    return mask


@pytest.mark.parametrize("sq,sk", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("bottom_right", [True, False])
def test_dense_mask_and_counts_match_the_definition(sq, sk, causal, window, bottom_right):
    variant = Variant(causal=causal, window=window, bottom_right=bottom_right)
    d = sk - sq if bottom_right else 0
    expected = _definition(variant, sq, sk, d)
    assert torch.equal(variant.dense_mask(sq, sk), expected)
    assert variant.visible_pairs(sq, sk) == int(expected.sum())
    assert variant.visible_flops(2, 3, sq, sk, 8) == 2.0 * 2 * 3 * int(expected.sum()) * 16
    mod = variant.mask_mod(sq, sk)
    if mod is None:
        assert bool(expected.all()) or sq == 0
    else:
        got = mod(0, 0, torch.arange(sq)[:, None], torch.arange(sk)[None, :])
        assert torch.equal(got.expand(sq, sk), expected)


@pytest.mark.parametrize("q_start,k_start", [(0, 0), (64, 0), (0, 64), (100, 37)])
def test_explicit_starts(q_start, k_start):
    """Ring attention's chunks: the diagonal is q_start - k_start, whatever the lengths."""
    variant = Variant(causal=True, window=(5, 0))
    d = variant.diagonal(8, 12, q_start, k_start)
    assert d == q_start - k_start
    assert torch.equal(variant.dense_mask(8, 12, d), _definition(variant, 8, 12, d))
    with pytest.raises(ValueError, match="both"):
        variant.diagonal(8, 12, q_start, None)


def test_causal_mask_is_the_variants():
    for sq, sk in SHAPES:
        i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
        assert torch.equal(causal_mask(sq, sk, True), j <= i + sk - sq)
        assert torch.equal(causal_mask(sq, sk, False), j <= i)


def test_fields_not_run_yet_are_refused_by_name():
    assert Variant(causal=True).unsupported() == []
    assert Variant(causal=True, window=(-1, 0)).unsupported() == []
    assert Variant(window=(4, 4), softcap=30.0, alibi_slopes=torch.ones(4), sinks=torch.zeros(4)).unsupported() == []
    assert Variant(dropout_p=0.1, causal=True).unsupported() == []
    with pytest.raises(ValueError, match="dropout_mask"):  # the reference needs the kernels' mask to judge dropout
        attention_reference(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4),
                            variant=Variant(dropout_p=0.1))
    for bad in ((-2, 0), (1.5, 0), (True, 0)):
        with pytest.raises(ValueError, match="window_size"):
            Variant(window=bad)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softcap"):
            Variant(softcap=bad)


def test_causal_makes_the_right_side_zero():
    """flash-attn's rule: with causal=True the window's right side is 0 whatever it says."""
    assert torch.equal(Variant(causal=True, window=(3, 5)).dense_mask(6, 9),
                       Variant(causal=True, window=(3, 0)).dense_mask(6, 9))
    assert Variant(causal=True, window=(-1, 4)).fields() == {"causal"}


def test_reference_soft_caps_the_scaled_scores():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, n, 2, 8, generator=gen, dtype=torch.float64) for n in (4, 6, 6))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * 0.5
    capped = 3.0 * torch.tanh(scores / 3.0)
    expected = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(capped, -1), v)
    assert torch.allclose(attention_reference(q, k, v, 0.5, variant=Variant(softcap=3.0)), expected)


def test_reference_with_a_variant_is_the_reference_with_flags():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 4, 8, generator=gen) for n in (5, 9, 9))
    for causal, bottom_right in itertools.product((False, True), (False, True)):
        flags = attention_reference(q, k, v, 0.3, causal, bottom_right)
        described = attention_reference(q, k, v, 0.3, variant=Variant(causal=causal, bottom_right=bottom_right))
        assert torch.equal(flags, described)


def test_attention_flops_counts_a_windows_visible_pairs():
    from flashtriton.reference import attention_flops

    window = Variant(window=(127, 0))
    pairs = window.visible_pairs(1024, 1024)
    assert pairs == sum(min(i, 127) + 1 for i in range(1024))
    assert attention_flops(2, 3, 1024, 64, variant=window, mode="bwd") == 2.5 * 4.0 * 2 * 3 * pairs * 64
    assert attention_flops(2, 3, 1024, 64, variant=Variant(causal=True)) == attention_flops(2, 3, 1024, 64, True)


def test_alibi_and_sinks_are_part_of_a_variants_identity():
    """Launch plans are cached per variant: a call with ALiBi or sinks must never match one without them (the
    tensors' values are left out of equality, their presence is not)."""
    plain, alibi, sinks = Variant.of(True), Variant.of(True, alibi=True), Variant.of(True, sinks=True)
    assert len({plain, alibi, sinks}) == 3 and plain != alibi != sinks
    assert Variant(alibi_slopes=torch.ones(2)) == Variant(alibi_slopes=torch.zeros(2))  # values: the kernels' args
