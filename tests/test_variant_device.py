"""The device helpers of kernels/variant.py (the only mask code in any kernel) against the variant's dense mask.

A small kernel evaluates every helper for each query tile and key tile of a (Sq, Sk) call; the host checks what
each promises: the element mask is the dense mask, the key blocks a query tile visits hold every key its rows see
and their unmasked part only keys that every row sees, the query blocks likewise for a key tile, and the tile
tests never call a tile unmasked or hidden that is not. The Gluon kernels call the same helpers (a `@triton.jit`
function called from a Gluon kernel compiles in Gluon mode), so this covers them too.
"""

import pytest
import torch
import triton
import triton.language as tl

from flashtriton.kernels import variant as V
from flashtriton.kernels.variant import Variant

from conftest import DEVICE


@triton.jit
def _helpers_kernel(MASK, KEY_FIRST, KEY_START, KEY_LO, KEY_HI, Q_LO, Q_MID, Q_FULL, Q_END, TILE_MASKED, TILE_HIDDEN,
                    KEY_END, seqlen_q, seqlen_k, left, right,
                    IS_CAUSAL: tl.constexpr, CAUSAL_BOTTOM_RIGHT: tl.constexpr, HAS_WINDOW: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SQ_PAD: tl.constexpr, SK_PAD: tl.constexpr):
    diag = V.diagonal(seqlen_q, seqlen_k, IS_CAUSAL, CAUSAL_BOTTOM_RIGHT, HAS_WINDOW)
    rows = tl.arange(0, SQ_PAD)
    cols = tl.arange(0, SK_PAD)
    keep = V.visible((rows[:, None] < seqlen_q) & (cols[None, :] < seqlen_k), rows[:, None], cols[None, :], diag,
                     IS_CAUSAL, HAS_WINDOW, left, right)
    tl.store(MASK + rows[:, None] * SK_PAD + cols[None, :], keep.to(tl.int8))
    tl.store(KEY_END + rows, V.key_end(rows, diag, IS_CAUSAL))
    tl.store(KEY_END + SQ_PAD + rows, V.key_end_before(rows + 1, diag, IS_CAUSAL))
    for start_m in range(0, tl.cdiv(seqlen_q, BLOCK_M)):
        first, start, lo, hi = V.key_blocks(start_m, seqlen_k, diag, IS_CAUSAL, BLOCK_M, BLOCK_N, HAS_WINDOW, left,
                                            right)
        tl.store(KEY_FIRST + start_m, first)
        tl.store(KEY_START + start_m, start)
        tl.store(KEY_LO + start_m, lo)
        tl.store(KEY_HI + start_m, hi)
        for start_n in range(0, tl.cdiv(seqlen_k, BLOCK_N)):
            row0 = start_m * BLOCK_M
            n = start_n * BLOCK_N
            masked = tl.where(V.tile_masked(row0, n + BLOCK_N - 1, diag, IS_CAUSAL, HAS_WINDOW, left, right,
                                            row0 + BLOCK_M - 1, n), 1, 0)
            key_major = tl.where(V.key_tile_masked(n + BLOCK_N - 1, row0, diag, IS_CAUSAL, HAS_WINDOW, left, right, n,
                                                   row0 + BLOCK_M - 1), 1, 0)
            tl.store(TILE_MASKED + start_m * 64 + start_n, tl.where(masked == key_major, masked, 9).to(tl.int8))
            hidden = tl.where(V.tile_hidden(row0 + BLOCK_M - 1, n, diag, IS_CAUSAL, HAS_WINDOW, left, right, row0,
                                            n + BLOCK_N - 1), 1, 0)
            tl.store(TILE_HIDDEN + start_m * 64 + start_n, hidden.to(tl.int8))
    for start_n in range(0, tl.cdiv(seqlen_k, BLOCK_N)):
        lo, mid, full, end = V.query_blocks(start_n * BLOCK_N, seqlen_q, diag, IS_CAUSAL, BLOCK_M, BLOCK_N, HAS_WINDOW,
                                            left, right)
        tl.store(Q_END + start_n, end)
        tl.store(Q_LO + start_n, lo)
        tl.store(Q_MID + start_n, mid)
        tl.store(Q_FULL + start_n, full)


CASES = [(1, 1), (1, 37), (37, 1), (64, 64), (50, 130), (130, 50), (127, 129), (200, 64), (16, 300)]
VARIANTS = [  # (causal, bottom_right, window)
    (False, True, (-1, -1)), (True, True, (-1, -1)), (True, False, (-1, -1)),
    (False, True, (5, 3)), (False, True, (0, 0)), (False, True, (-1, 20)), (False, True, (33, -1)),
    (True, True, (17, 0)), (True, False, (40, -1)), (False, False, (2, 70))]


@pytest.mark.parametrize("sq,sk", CASES)
@pytest.mark.parametrize("causal,bottom_right,window", VARIANTS)
@pytest.mark.parametrize("block_m,block_n", [(16, 32), (32, 16), (64, 64)])
def test_device_helpers_match_the_dense_mask(sq, sk, causal, bottom_right, window, block_m, block_n):
    variant = Variant(causal=causal, bottom_right=bottom_right, window=window)
    has_window = "window_size" in variant.fields()
    _, left, right, _ = variant.scalars(1.0)
    sq_pad, sk_pad = triton.next_power_of_2(sq), triton.next_power_of_2(sk)
    n_m, n_n = triton.cdiv(sq, block_m), triton.cdiv(sk, block_n)
    out = {name: torch.full((size,), -7, dtype=torch.int32, device=DEVICE) for name, size in
           dict(key_first=n_m, key_start=n_m, key_lo=n_m, key_hi=n_m, q_lo=n_n, q_mid=n_n, q_full=n_n, q_end=n_n,
                key_end=2 * sq_pad).items()}
    mask = torch.zeros(sq_pad, sk_pad, dtype=torch.int8, device=DEVICE)
    masked = torch.full((n_m * 64,), -7, dtype=torch.int8, device=DEVICE)
    hidden = torch.full((n_m * 64,), -7, dtype=torch.int8, device=DEVICE)
    _helpers_kernel[(1,)](mask, out["key_first"], out["key_start"], out["key_lo"], out["key_hi"], out["q_lo"],
                          out["q_mid"], out["q_full"], out["q_end"], masked, hidden, out["key_end"], sq, sk,
                          left or 0, right or 0, IS_CAUSAL=causal, CAUSAL_BOTTOM_RIGHT=bottom_right,
                          HAS_WINDOW=has_window, BLOCK_M=block_m, BLOCK_N=block_n, SQ_PAD=sq_pad, SK_PAD=sk_pad)
    out = {name: t.cpu().tolist() for name, t in out.items()}
    dense = variant.dense_mask(sq, sk)
    assert torch.equal(mask.cpu()[:sq, :sk].bool(), dense)
    assert not mask.cpu()[sq:].any() and not mask.cpu()[:, sk:].any()
    d = sk - sq if bottom_right else 0
    extended = variant.dense_mask(n_m * block_m + sq, n_n * block_n + sk, diagonal=d)  # rows and keys past the ends
    for m in range(n_m):
        rows = slice(m * block_m, min((m + 1) * block_m, sq))
        first, start, lo, hi = (out[f"key_{n}"][m] for n in ("first", "start", "lo", "hi"))
        assert 0 <= first <= start <= lo <= hi <= sk
        assert all(x % block_n == 0 or x == hi for x in (first, start, lo))  # aligned, or where nothing follows
        assert has_window or first == start == 0
        assert not dense[rows, hi:].any() and not dense[rows, :first].any(), "a visible key outside the visited blocks"
        assert dense[rows, start:lo].all(), "an unmasked block holds a hidden pair"
    for n in range(n_n):
        keys = slice(n * block_n, min((n + 1) * block_n, sk))
        lo, mid, full, end = (out[f"q_{name}"][n] for name in ("lo", "mid", "full", "end"))
        assert 0 <= lo <= mid <= full and all(x % block_m == 0 or x == end for x in (lo, mid, full))
        assert full <= end or lo >= end  # (rows from lo on lie past the queries: every stage is empty)
        assert full <= max(sq // block_m * block_m, lo), "an unmasked query block reaches past the queries"
        assert has_window or end == sq
        assert not dense[:lo, keys].any() and not dense[end:, keys].any(), "a row outside the visited blocks sees a key"
        assert extended[mid:full, n * block_n:(n + 1) * block_n].all(), "an unmasked query block hides a pair"
    assert (masked.cpu()[masked.cpu() != -7] != 9).all(), "key_tile_masked disagrees with tile_masked"
    masked, hidden = masked.cpu().view(n_m, 64)[:, :n_n].bool(), hidden.cpu().view(n_m, 64)[:, :n_n].bool()
    for m in range(n_m):
        rows = slice(m * block_m, min((m + 1) * block_m, sq))
        for n in range(n_n):
            keys = slice(n * block_n, min((n + 1) * block_n, sk))
            if not masked[m, n]:  # the whole tile, rows and keys past the ends included
                assert extended[m * block_m:(m + 1) * block_m, n * block_n:(n + 1) * block_n].all(), \
                    "a tile called unmasked hides a pair"
            if hidden[m, n]:
                assert not dense[rows, keys].any(), "a tile called hidden has a visible pair"
    if has_window:
        return  # key_end is for the kernels without windows
    assert out["key_end"][:sq_pad] == out["key_end"][sq_pad:]  # key_end_before(row + 1) is key_end(row)
    if causal:  # key_end: one past the last key each row sees (before clipping to the sequence)
        for i in range(sq):
            seen = dense[i].nonzero()
            assert min(out["key_end"][i], sk) == (int(seen[-1]) + 1 if len(seen) else min(out["key_end"][i], sk))
