"""Hopper's Gluon forward (kernels/forward_gluon*.py). Gluon kernels compile for sm_90 only and do not run in the
interpreter: the kernel tests run on a Hopper GPU; the host-side pieces are tested everywhere.

flash_attn_func takes the Gluon kernel on sm_90 where `configs.gluon_fwd_config` says so (D = 64 and 128), so the
forward tests of test_forward.py cover it there as well; these call it directly with every config the sweep
tried, on shapes that reach each of its paths, and on packed (varlen) batches, which the dispatch gives it where
`configs.gluon_varlen_config` says so (D = 128)."""

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashtriton
from flashtriton.kernels.variant import Variant
from flashtriton.kernels import dispatch
from flashtriton import configs
from flashtriton.kernels import forward_gluon_launch as G
from flashtriton.kernels import gluon_common
from flashtriton.kernels import launch
from flashtriton.kernels.forward import _dense_tma_plan
from flashtriton.reference import attention_reference

from accuracy import assert_close_to_exact, torch_attention
from test_forward import make_qkv

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
hopper_only = pytest.mark.skipif(not HOPPER, reason="Gluon's Hopper kernel: sm_90 only (no interpreter)")

_BASE = dict(BLOCK_N=128, NUM_BUFFERS=2, CONSUMER_REGS=240, N_CONSUMERS=2, Q_BUFFERS=1, CAUSAL_PAIRS=True,
             DYNAMIC=False, OVERLAP=False, STORE_FROM_REGS=False)
CONFIGS = {
    "default": _BASE,
    "64-key tiles, 4 stages": {**_BASE, "BLOCK_N": 64, "NUM_BUFFERS": 4},
    "two Q buffers": {**_BASE, "Q_BUFFERS": 2},
    "causal items one at a time": {**_BASE, "CAUSAL_PAIRS": False},
    "three consumers, two Q buffers": {**_BASE, "N_CONSUMERS": 3, "CONSUMER_REGS": 160, "Q_BUFFERS": 2},
    "varlen dispatch": configs.gluon_varlen_config(128, 4096, 4096, True),
    "varlen, static schedule": {**configs.gluon_varlen_config(128, 4096, 4096, True), "DYNAMIC": False},
    "varlen, dynamic schedule, two Q slots": {**configs.gluon_varlen_config(128, 4096, 4096, True), "Q_BUFFERS": 2},
    "three consumers": {**_BASE, "N_CONSUMERS": 3, "CONSUMER_REGS": 160},
    "three consumers, 64-key tiles": {**_BASE, "N_CONSUMERS": 3, "CONSUMER_REGS": 160, "BLOCK_N": 64, "NUM_BUFFERS": 4},
    # an item's last P V with the next item's first S, one loop over all the K/V tiles (`_consume_flat`)
    "overlap": {**_BASE, "OVERLAP": True},
    "overlap, two Q buffers": {**_BASE, "OVERLAP": True, "Q_BUFFERS": 2},
    "overlap, two Q buffers, 3 stages": {**_BASE, "OVERLAP": True, "Q_BUFFERS": 2, "NUM_BUFFERS": 3},  # D = 64 only
    "overlap, three consumers": {**_BASE, "OVERLAP": True, "N_CONSUMERS": 3, "CONSUMER_REGS": 160},
    "overlap, causal items one at a time": {**_BASE, "OVERLAP": True, "CAUSAL_PAIRS": False},
    "overlap, 64-key tiles, 4 stages": {**_BASE, "OVERLAP": True, "BLOCK_N": 64, "NUM_BUFFERS": 4},
    "overlap, dynamic schedule": {**_BASE, "OVERLAP": True, "CAUSAL_PAIRS": False, "DYNAMIC": True},
    "varlen dispatch, overlap": {**configs.gluon_varlen_config(128, 4096, 4096, True), "OVERLAP": True},
    "varlen, overlap, two Q slots": {**configs.gluon_varlen_config(128, 4096, 4096, True), "OVERLAP": True,
                                     "Q_BUFFERS": 2},
    "varlen, static schedule, overlap": {**configs.gluon_varlen_config(128, 4096, 4096, True), "DYNAMIC": False,
                                         "OVERLAP": True},
    # the output stored from registers (no staging tiles), with the shared memory that frees taken by a stage more
    "store from registers": {**_BASE, "STORE_FROM_REGS": True},
    "store from registers, 3 stages": {**_BASE, "STORE_FROM_REGS": True, "NUM_BUFFERS": 3},
    # the output staged in the consumers' Q buffers (O_IN_Q), with the shared memory that frees taken by a stage more
    "output in the Q buffers": {**_BASE, "O_IN_Q": True},
    "output in the Q buffers, 3 stages": {**_BASE, "O_IN_Q": True, "NUM_BUFFERS": 3},
    "output in the Q buffers, dynamic schedule": {**_BASE, "CAUSAL_PAIRS": False, "DYNAMIC": True, "O_IN_Q": True},
}
# The wide head dims' (tiles of 256 columns): 32-key tiles beside the O staging tiles, or 64-key tiles with the
# output stored from registers.
WIDE_CONFIGS = {"32-key tiles": {**_BASE, "BLOCK_N": 32},
                "64-key tiles, output in the Q buffers": {**_BASE, "BLOCK_N": 64, "O_IN_Q": True},
                "32-key tiles, output in the Q buffers, 3 stages": {**_BASE, "BLOCK_N": 32, "O_IN_Q": True,
                                                                    "NUM_BUFFERS": 3},
                "64-key tiles, store from registers": {**_BASE, "BLOCK_N": 64, "STORE_FROM_REGS": True}}
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv): one token, odd lengths, Sq != Sk both ways (bottom-right causal
# leaves rows with no key), GQA, more items than SMs (a persistent program takes several, some with no key), and
# keys long enough that the causal schedule splits the heads into groups (the last one smaller).
SHAPES = [(2, 1, 1, 2, 2), (2, 17, 17, 2, 1), (2, 200, 333, 4, 2), (1, 333, 200, 2, 2), (4, 1024, 64, 16, 4),
          (3, 1000, 1000, 16, 8), (1, 200, 16384, 4, 2)]


def run_gluon(q, k, v, causal, bottom_right, config, softmax_scale=None):
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), dtype=torch.float32, device=q.device)
    G.launch_forward_gluon(q, k, v, out, lse, scale, causal, bottom_right, config)
    return out, lse


@hopper_only
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("causal,bottom_right", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("head_dim,dtype", [(128, torch.float16), (64, torch.bfloat16)])
def test_gluon_kernel_against_float64(name, causal, bottom_right, head_dim, dtype, device):
    if G.shared_memory_bytes(CONFIGS[name], head_dim) > gluon_common.SHARED_MEMORY_LIMIT:
        with pytest.raises(ValueError, match="shared memory"):
            run_gluon(*make_qkv(1, 64, 64, 2, 2, head_dim, dtype, device), causal, bottom_right, CONFIGS[name])
        return
    for batch, seqlen_q, seqlen_k, heads_q, heads_kv in SHAPES:
        q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, device)
        out, lse = run_gluon(q, k, v, causal, bottom_right, CONFIGS[name])
        exact, exact_lse = attention_reference(q, k, v, None, causal, bottom_right, return_lse=True)
        where = f"{name}, shape {(batch, seqlen_q, seqlen_k, heads_q, heads_kv)}"
        assert_close_to_exact(out, torch_attention(q, k, v, None, causal, bottom_right), exact, dtype, where)
        seen = torch.isfinite(exact_lse)
        assert torch.equal(torch.isfinite(lse), seen), f"{where}: lse -inf exactly on rows that see no key"
        torch.testing.assert_close(lse[seen].double(), exact_lse[seen], atol=1e-3, rtol=1e-3)
        assert torch.all(out[~seen.transpose(1, 2)] == 0), where


@hopper_only
@pytest.mark.parametrize("name", list(WIDE_CONFIGS))
@pytest.mark.parametrize("causal,bottom_right", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("head_dim,dtype", [(256, torch.bfloat16), (192, torch.float16)])
def test_gluon_wide_configs_against_float64(name, causal, bottom_right, head_dim, dtype, device):
    """Every wide-tile schedule on odd shapes, one token, Sq != Sk and GQA: out against float64, lse finite
    exactly where a row sees a key, and zero rows (dense out stored from registers: the masked stores write only
    the head's own columns and rows)."""
    for batch, seqlen_q, seqlen_k, heads_q, heads_kv in SHAPES[:6]:
        q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, device)
        out, lse = run_gluon(q, k, v, causal, bottom_right, WIDE_CONFIGS[name])
        exact, exact_lse = attention_reference(q, k, v, None, causal, bottom_right, return_lse=True)
        where = f"{name}, shape {(batch, seqlen_q, seqlen_k, heads_q, heads_kv)}"
        assert_close_to_exact(out, torch_attention(q, k, v, None, causal, bottom_right), exact, dtype, where)
        seen = torch.isfinite(exact_lse)
        assert torch.equal(torch.isfinite(lse), seen), f"{where}: lse -inf exactly on rows that see no key"
        torch.testing.assert_close(lse[seen].double(), exact_lse[seen], atol=1e-3, rtol=1e-3)
        assert torch.all(out[~seen.transpose(1, 2)] == 0), where


# QK_WIDTH (`forward_gluon_tiles.qk_tile`, `gluon_common.mma_nt`): Q Kᵀ over the head's own columns in pieces of powers of
# two (192 = 128 + 64 of 256, 160 = 128 + 32, 96 = 64 + 32 of 128, 80 = 64 + 16, 112 = 64 + 32 + 16); with V in tiles
# of its own (MLA's 192 / 128) and every variant.
QK_WIDTH_CASES = {  # (head_dim, head_dim_v, causal, window, softcap, alibi, sinks)
    "192": (192, 192, False, (-1, -1), 0.0, False, False),
    "192 causal": (192, 192, True, (-1, -1), 0.0, False, False),
    "160 (zeros past the head)": (160, 160, True, (-1, -1), 0.0, False, False),
    "192 / 128 (MLA)": (192, 128, True, (-1, -1), 0.0, False, False),
    "192 / 128 non-causal": (192, 128, False, (-1, -1), 0.0, False, False),
    "192, every variant": (192, 192, True, (150, 0), 15.0, True, True),
    "192 / 128, window both sides, softcap": (192, 128, False, (130, 70), 30.0, False, False),
    "96": (96, 96, False, (-1, -1), 0.0, False, False),
    "80 causal": (80, 80, True, (-1, -1), 0.0, False, False),
    "112 (three pieces), causal": (112, 112, True, (-1, -1), 0.0, False, False),
    "72 (zeros past the head), every variant": (72, 72, True, (150, 0), 15.0, True, True),
    "160 / 160 (zeros past V's head too), window both sides": (160, 160, False, (130, 70), 0.0, False, False),
    "256 / 192": (256, 192, True, (-1, -1), 0.0, False, True),
}


@hopper_only
@pytest.mark.parametrize("case", list(QK_WIDTH_CASES))
@pytest.mark.parametrize("name", ["default", "overlap, dynamic schedule", "wide: 32-key tiles",
                                  "wide: 64-key tiles, store from registers",
                                  "wide: 64-key tiles, output in the Q buffers"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split_pv", [False, True])
def test_gluon_qk_width_against_float64(case, name, dtype, split_pv, device, monkeypatch):
    """Q Kᵀ over the head's own columns (QK_WIDTH, under GLUON_QK_TRIM for every tile width) and, split_pv, the
    output in two accumulators over V's columns 0 … 127 and 128 … 191 (PV_SPLIT: V heads of 129 … 192 columns) on
    odd shapes, GQA, Sq != Sk: out against float64 judged against torch's error in the dtype, lse where a row sees
    a key; the launch's constexprs say the narrower products ran."""
    from test_features import _torch_same_dtype

    monkeypatch.setattr(configs.forward, "GLUON_QK_TRIM", (128, 256))
    monkeypatch.setattr(configs.forward, "GLUON_PV_SPLIT", split_pv)
    head_dim, head_dim_v, causal, window, softcap, alibi, sinks = QK_WIDTH_CASES[case]
    wide = gluon_common.head_block(head_dim) == 256
    if name.startswith("wide") != wide:
        pytest.skip("the schedules of the other tile width")
    if split_pv and not 128 < head_dim_v <= 192:
        pytest.skip("PV_SPLIT takes V heads of 129 ... 192 columns")
    config = WIDE_CONFIGS[name[6:]] if wide else CONFIGS[name]
    width = G.qk_width(head_dim)
    if config.get("O_IN_Q") and gluon_common.head_block(head_dim_v) != gluon_common.head_block(head_dim):
        # the output's tile would not fill Q's buffer: refused (256 / 192: both in 256-column tiles, taken)
        with pytest.raises(ValueError, match="O_IN_Q takes"):
            G.launch_parts((2, 64, 4, head_dim), (2, 64, 2, head_dim), causal, True, config, 1,
                           head_dim_v=head_dim_v, qk_columns=width, split_pv=G.pv_split(head_dim_v))
        return
    _, _, meta = G.launch_parts((2, 64, 4, head_dim), (2, 64, 2, head_dim), causal, True, config, 1,
                                head_dim_v=head_dim_v, qk_columns=width, split_pv=G.pv_split(head_dim_v))
    assert meta.get("QK_WIDTH", head_dim) == gluon_common.product_width(head_dim) <= meta["HEAD_DIM"]
    assert meta.get("PV_SPLIT", False) == split_pv
    for batch, sq, sk, hq, hkv in [(2, 200, 333, 4, 2), (1, 333, 200, 2, 2), (3, 1000, 1000, 8, 2)]:
        gen = torch.Generator().manual_seed(sq + sk + head_dim)
        q = torch.randn(batch, sq, hq, head_dim, generator=gen).to(device, dtype)
        k = torch.randn(batch, sk, hkv, head_dim, generator=gen).to(device, dtype)
        v = torch.randn(batch, sk, hkv, head_dim_v, generator=gen).to(device, dtype)
        slopes = (0.5 ** torch.arange(1.0, hq + 1)).to(device) if alibi else None
        sink = torch.linspace(-2.0, 3.0, hq).to(device) if sinks else None
        variant = Variant(causal=causal, window=window, softcap=softcap, alibi_slopes=slopes, sinks=sink)
        out = torch.full((batch, sq, hq, head_dim_v), float("nan"), dtype=dtype, device=device)
        lse = torch.full((batch, hq, sq), float("nan"), dtype=torch.float32, device=device)
        G.launch_forward_gluon(q, k, v, out, lse, head_dim ** -0.5, causal, True, config,
                               variant=variant.of(causal, True, window, softcap, alibi, sinks), alibi_slopes=slopes,
                               learnable_sink=sink)
        exact, exact_lse = attention_reference(q, k, v, variant=variant, return_lse=True)
        where = f"{case}, {name}, shape {(batch, sq, sk, hq, hkv)}"
        assert_close_to_exact(out, _torch_same_dtype(q, k, v, variant, sink), exact, dtype, where)
        seen = torch.isfinite(exact_lse)
        assert torch.equal(torch.isfinite(lse), seen), f"{where}: lse -inf exactly where no key is seen"
        torch.testing.assert_close(lse[seen].double(), exact_lse[seen], atol=2e-3, rtol=2e-3)


def test_gluon_pv_split_builds_compile_for_sm90():
    """The output in two accumulators (PV_SPLIT) compiles for sm_90 at D=192 with no more spill stores than one
    accumulator, and P's operand reaches the second product without moving between threads (no more shuffles)."""
    out = compile_in_fresh_process(
        "from flashtriton import configs\n"
        "from flashtriton.configs import forward as cf\n"
        "from flashtriton.kernels.forward_gluon_launch import compile_for_sm90\n"
        "for causal, T in ((True, 4096), (False, 1024)):\n"
        "    cfg = configs.gluon_fwd_config(192, T, T, causal)\n"
        "    found = []\n"
        "    for on in (False, True):\n"
        "        cf.GLUON_PV_SPLIT = on\n"
        "        c = compile_for_sm90(192, causal, cfg)\n"
        "        found.append((spill_bytes(c), c.asm['ptx'].count('shfl')))\n"
        "    (one_spill, one_shfl), (two_spill, two_shfl) = found\n"
        "    assert two_spill <= one_spill and two_shfl <= one_shfl, (causal, T, found)\n"
        "    print('compiled', causal, T, found)\n")
    assert out.count("compiled") == 2


def test_qk_width_takes_the_head_dims_its_tiles_pad(monkeypatch):
    """QK_WIDTH applies to the tile widths GLUON_QK_TRIM names, at head dims whose own columns (rounded up to 16 and
    to at most three powers of two) are fewer than the tiles'."""
    monkeypatch.setattr(configs.forward, "GLUON_QK_TRIM", (128, 256))
    dims = (64, 72, 80, 96, 112, 120, 128, 129, 160, 192, 224, 240, 256)
    assert {d: G.qk_width(d) for d in dims if G.qk_width(d)} == {72: 80, 80: 80, 96: 96, 112: 112, 129: 144,
                                                                 160: 160, 192: 192, 224: 224}
    monkeypatch.setattr(configs.forward, "GLUON_QK_TRIM", (256,))
    assert (G.qk_width(96), G.qk_width(192)) == (0, 192)
    monkeypatch.setattr(configs.forward, "GLUON_QK_TRIM", ())
    assert G.qk_width(192) == 0


def test_gluon_qk_width_builds_compile_for_sm90():
    """The narrower product compiles for sm_90: fewer wgmma instructions on the scores (192 of 256 columns: 12 for
    every 16 per 64 keys; 96 of 128: 6 for every 8), and no more spill stores than the whole tiles' build."""
    out = compile_in_fresh_process(
        "from flashtriton import configs\n"
        "from flashtriton.configs import forward as cf\n"
        "from flashtriton.kernels.forward_gluon_launch import compile_for_sm90\n"
        "for d, dv, causal, fewer in ((192, 192, True, 16), (192, 128, False, 16), (96, 96, True, 8)):\n"
        "    cfg = configs.gluon_fwd_config(d, 4096, 4096, causal, 0, dv)\n"
        "    found = []\n"
        "    for trim in ((), (128, 256)):\n"
        "        cf.GLUON_QK_TRIM = trim\n"
        "        c = compile_for_sm90(d, causal, cfg, head_dim_v=dv)\n"
        "        found.append((c.asm['ptx'].count('wgmma.mma_async'), spill_bytes(c)))\n"
        "    (whole, whole_spill), (split, split_spill) = found\n"
        "    assert whole - split == fewer and split_spill <= max(whole_spill, 16), (d, dv, found)\n"
        "    print('compiled', d, dv, found)\n")
    assert out.count("compiled") == 3


@hopper_only
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_takes_the_gluon_kernel_where_configured(causal, head_dim, device, monkeypatch):
    """Short sequences at D = 64 and 128: the dispatch plans the Gluon kernel, and its output
    matches the TMA kernel's (FLASHTRITON_GLUON=0) to rounding; softmax_scale = 0 (masked scores would be
    -inf * 0) is never given to it."""
    seqlen = 1000 if causal else 512
    q, k, v = make_qkv(2, seqlen, seqlen, 8, 2, head_dim, torch.float16, device)
    plan = _dense_tma_plan(q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, q.device,
                           Variant.of(causal), True, True)
    assert plan is not None and plan.gluon
    out = flashtriton.flash_attn_func(q, k, v, causal=causal)
    monkeypatch.setattr(dispatch, "CHOICE", dispatch.Choice(level="tma"))
    reference = flashtriton.flash_attn_func(q, k, v, causal=causal)
    torch.testing.assert_close(out, reference, atol=2e-3, rtol=0)
    monkeypatch.setattr(dispatch, "CHOICE", dispatch.Choice())
    zero_scale = flashtriton.flash_attn_func(q, k, v, causal=causal, softmax_scale=0.0)  # the TMA kernel's
    exact = attention_reference(q, k, v, 0.0, causal)
    assert_close_to_exact(zero_scale, torch_attention(q, k, v, 0.0, causal), exact, torch.float16)


@hopper_only
@pytest.mark.parametrize("head_dim", [8, 40, 72, 80, 96, 104, 112, 160, 192, 224, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("o_in_q", [False, True])
def test_gluon_kernel_pads_other_head_dims(head_dim, causal, varlen, o_in_q, device, monkeypatch):
    """Head dims between the tiles' 64 / 128 / 256 columns: the descriptors' blocks reach past the head, the TMA
    loads the missing columns as zeros and stores none of them (dense), the masked stores skip them (varlen), so the
    next head's output is untouched. Against float64 through flash_attn_func, whose dispatch takes the Gluon kernel
    (dense: its plan says so; varlen: where `configs.gluon_varlen_config` has the tiles' row). o_in_q: with
    `configs.forward.GLUON_O_IN_Q` on, whose rules stage the 256-column tiles' output in the Q buffers."""
    from test_varlen import pack

    if o_in_q and (varlen or head_dim <= 128):
        pytest.skip("GLUON_O_IN_Q's rules take dense 256-column tiles")
    monkeypatch.setattr(configs.forward, "GLUON_O_IN_Q", o_in_q)
    dtype = torch.bfloat16
    if varlen:
        if configs.gluon_varlen_config(head_dim, 1000, 1000, causal) is None:
            pytest.skip("no Gluon varlen config for these tiles")
        gen = torch.Generator().manual_seed(head_dim)
        lengths = [300, 1, 517, 64]
        q, cu = pack(lengths, 8, head_dim, dtype, device, gen)
        k, _ = pack(lengths, 2, head_dim, dtype, device, gen)
        v, _ = pack(lengths, 2, head_dim, dtype, device, gen)
        out = flashtriton.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal)
        for b in range(len(lengths)):
            rows = slice(cu[b], cu[b + 1])
            qb, kb, vb = q[None, rows], k[None, rows], v[None, rows]
            assert_close_to_exact(out[None, rows], torch_attention(qb, kb, vb, None, causal),
                                  attention_reference(qb, kb, vb, None, causal), dtype, f"sequence {b}")
        return
    # 256-column tiles: up to 1k keys and beyond take different configs (32- and 64-key tiles)
    for seqlen_k in (900, 2100) if head_dim > 128 else (900,):
        q, k, v = make_qkv(2, 700, seqlen_k, 8, 2, head_dim, dtype, device)
        plan = _dense_tma_plan(q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, q.device,
                               Variant.of(causal), True, True, o_in_q=o_in_q)
        assert plan is not None and plan.gluon and plan.meta["HEAD_DIM"] == gluon_common.head_block(head_dim)
        assert plan.meta.get("O_IN_Q", False) == (o_in_q and (causal or seqlen_k <= 4096))
        out = flashtriton.flash_attn_func(q, k, v, causal=causal)
        assert_close_to_exact(out, torch_attention(q, k, v, None, causal),
                              attention_reference(q, k, v, None, causal), dtype, f"{seqlen_k} keys")


@hopper_only
@pytest.mark.parametrize("head_dim,head_dim_v", [(192, 128), (256, 128), (192, 96), (128, 96), (96, 64)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_kernel_separate_v_head_dim(head_dim, head_dim_v, causal, dtype, device):
    """V (and out) with a head dim of its own (DeepSeek's MLA: QK 192, V 128): the V and O tiles span V's tile
    width, Q and K's theirs. Against float64 through flash_attn_func, whose plan takes the Gluon kernel where
    `configs.gluon_fwd_config` has a rule for the pair of tile widths (192 / 128, 256 / 128; V in QK's width:
    128 / 96), and the portable kernel elsewhere (96 / 64: no rule); with GQA, Sq != Sk and lengths off the tiles."""
    gen = torch.Generator().manual_seed(head_dim + head_dim_v)
    q = torch.randn(2, 700, 8, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(2, 900, 2, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(2, 900, 2, head_dim_v, generator=gen).to(device, dtype)
    plan = _dense_tma_plan(q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, q.device,
                           Variant.of(causal), True, True, v.shape)
    block, block_v = gluon_common.head_block(head_dim), gluon_common.head_block(head_dim_v)
    expected = configs.gluon_fwd_config(head_dim, 700, 900, causal, 0, head_dim_v) is not None
    assert (plan is not None and plan.gluon) == expected, plan
    if expected:
        assert (plan.meta["HEAD_DIM"], plan.meta["HEAD_DIM_V"]) == (block, block_v)
    out, lse, _ = flashtriton.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert out.shape == (2, 700, 8, head_dim_v)
    exact, exact_lse = attention_reference(q, k, v, None, causal, return_lse=True)
    assert_close_to_exact(out, torch_attention(q, k, v, None, causal), exact, dtype)
    torch.testing.assert_close(lse.double(), exact_lse, atol=1e-3, rtol=1e-3)


@hopper_only
@pytest.mark.parametrize("name", ["default", "three consumers", "two Q buffers",
                                  "causal items one at a time", "varlen dispatch", "varlen, static schedule",
                                  "varlen, dynamic schedule, two Q slots", "varlen dispatch, overlap",
                                  "varlen, overlap, two Q slots", "varlen, static schedule, overlap"])
@pytest.mark.parametrize("causal,bottom_right", [(False, True), (True, True), (True, False)])
def test_gluon_kernel_varlen(name, causal, bottom_right, device):
    """Packed sequences (empty, one token, Sq != Sk, longer than a tile, GQA) against float64 per sequence. The
    keys' tensor runs 40 rows past the last sequence, and sequence 1's values start with inf: a sequence's last
    K/V tile reaches into the next one's rows (or those), where P is 0 but 0 * inf is NaN unless the kernel
    clears them."""
    from test_varlen import pack

    gen = torch.Generator().manual_seed(1)
    lengths_q, lengths_k = [130, 1, 0, 257, 64, 5], [100, 300, 7, 257, 1, 0]
    q, cu_q = pack(lengths_q, 8, 128, torch.bfloat16, device, gen)
    k, cu_k = pack(lengths_k + [40], 2, 128, torch.bfloat16, device, gen)
    v, _ = pack(lengths_k + [40], 2, 128, torch.bfloat16, device, gen)
    cu_k = cu_k[:-1]
    v[cu_k[1]:cu_k[1] + 3] = float("inf")  # sequence 1's own values: its output is not checked
    v[cu_k[-1]:] = float("inf")  # rows past the last sequence
    out = torch.full_like(q, float("nan"))
    lse = torch.full((8, q.shape[0]), float("nan"), dtype=torch.float32, device=device)
    G.launch_forward_gluon(q, k, v, out, lse, 128 ** -0.5, causal, bottom_right, CONFIGS[name], cu_q, cu_k,
                           max(lengths_q), max(lengths_k))
    for b, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
        if lq == 0 or b == 1:
            continue
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        qb, kb, vb = q[None, sq], k[None, sk], v[None, sk]
        exact, exact_lse = attention_reference(qb, kb, vb, None, causal, bottom_right, return_lse=True)
        seen = torch.isfinite(exact_lse[0])
        assert torch.equal(torch.isfinite(lse[:, sq]), seen), f"{name}: sequence {b}"
        if lk == 0:
            assert torch.all(out[sq] == 0), f"{name}: sequence {b}"
            continue
        assert_close_to_exact(out[None, sq], torch_attention(qb, kb, vb, None, causal, bottom_right), exact,
                              torch.bfloat16, f"{name}: sequence {b}")
        torch.testing.assert_close(lse[:, sq][seen].double(), exact_lse[0][seen], atol=1e-3, rtol=1e-3)


@hopper_only
@pytest.mark.parametrize("head_dim,head_dim_v", [(192, 192), (256, 256), (192, 128)])
@pytest.mark.parametrize("every_variant", [False, True])
def test_gluon_varlen_wide_tiles_against_float64(head_dim, head_dim_v, every_variant, device):
    """Packed batches in 256-column tiles (`configs.GLUON_VARLEN_FWD`, `GLUON_SEPARATE_V_VARLEN_FWD`), causal, and
    with every variant (a window, softcap, ALiBi, sinks) on GQA: out and lse per sequence against float64."""
    from test_varlen import pack

    config = configs.gluon_varlen_config(head_dim, 4096, 4096, True, head_dim_v)
    assert config is not None and config["DYNAMIC"]
    gen = torch.Generator().manual_seed(head_dim + head_dim_v)
    lengths_q, lengths_k = [130, 1, 0, 257, 64], [100, 300, 7, 257, 1]
    q, cu_q = pack(lengths_q, 8, head_dim, torch.bfloat16, device, gen)
    k, cu_k = pack(lengths_k, 2, head_dim, torch.bfloat16, device, gen)
    v, _ = pack(lengths_k, 2, head_dim_v, torch.bfloat16, device, gen)
    window, softcap = ((150, 0), 15.0) if every_variant else ((-1, -1), 0.0)
    slopes = (0.5 ** torch.arange(1.0, 9.0)).to(device) if every_variant else None
    sink = torch.linspace(-2.0, 3.0, 8).to(device) if every_variant else None
    _varlen_against_float64(q, k, v, cu_q, cu_k, lengths_q, lengths_k, config, True, window, softcap, slopes, sink,
                            f"{head_dim}/{head_dim_v}")


@hopper_only
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["varlen dispatch", "varlen, static schedule", "varlen dispatch, overlap",
                                  "varlen, static schedule, overlap"])
def test_gluon_kernel_varlen_many_items_per_program(name, causal, device):
    """More items than programs (each program takes several, from the counter in the dynamic schedule), lengths
    mixed from 1 to 700 with some empty, GQA: every sequence against float64 on two query heads of different kv
    heads, and every lse finite. Launched twice: the second launch must not see the first one's counter."""
    from test_varlen import pack

    gen = torch.Generator().manual_seed(7)
    lengths = torch.randint(0, 701, (48,), generator=gen).tolist()
    lengths[3] = lengths[17] = 0
    q, cu = pack(lengths, 16, 128, torch.float16, device, gen)
    k, _ = pack(lengths, 4, 128, torch.float16, device, gen)
    v, _ = pack(lengths, 4, 128, torch.float16, device, gen)
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((16, q.shape[0]), float("nan"), dtype=torch.float32, device=device)
        G.launch_forward_gluon(q, k, v, out, lse, 128 ** -0.5, causal, True, CONFIGS[name], cu, cu, max(lengths),
                               max(lengths))
        assert torch.isfinite(out).all() and torch.isfinite(lse).all(), name
    heads = [0, 13]  # kv heads 0 and 3
    for b, length in enumerate(lengths):
        if length == 0:
            continue
        rows = slice(cu[b], cu[b + 1])
        qb, kb, vb = q[None, rows][:, :, heads], k[None, rows][:, :, [0, 3]], v[None, rows][:, :, [0, 3]]
        exact = attention_reference(qb, kb, vb, 128 ** -0.5, causal)
        assert_close_to_exact(out[None, rows][:, :, heads], torch_attention(qb, kb, vb, 128 ** -0.5, causal), exact,
                              torch.float16, f"{name}: sequence {b} of length {length}")


@pytest.mark.gpu
@hopper_only
def test_gluon_kernel_long_sequences(device):
    for causal in (False, True):
        q, k, v = make_qkv(1, 8192, 8192, 16, 16, 128, torch.bfloat16, device)
        out, _ = run_gluon(q, k, v, causal, True, _BASE)
        reference = attention_reference(q[:, :, :2], k[:, :, :2], v[:, :, :2], None, causal, dtype=torch.float32)
        torch.testing.assert_close(out[:, :, :2].float(), reference, atol=1e-2, rtol=0)
        assert torch.isfinite(out).all()


def test_fast_descriptor_equals_the_checked_one():
    """`descriptor` skips TensorDescriptor's checks; its fields must be what the checked constructor gives."""
    t = torch.empty(2, 100, 4, 128, dtype=torch.bfloat16)
    fast = gluon_common.descriptor(t, 64)
    checked = gluon_common.TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 64, 1, 128],
                                            gluon_common.smem_layout((1, 64, 1, 128), t.dtype))
    for field in ("shape", "strides", "block_shape", "layout", "padding"):
        assert getattr(fast, field) == getattr(checked, field), field
    assert fast.base is t
    packed = t.view(200, 4, 128)
    assert gluon_common.descriptor(packed, 64, varlen=True).block_shape == [64, 1, 128]
    assert gluon_common.descriptor(packed, 64, varlen=True).layout.rank == 3


def test_launch_parts_count_items_and_cap_programs_at_the_sms():
    q_shape, k_shape = (3, 1000, 16, 128), (3, 700, 4, 128)
    items = 8 * 16 * 3  # cdiv(1000, 128) query tiles of 128 rows, per head and batch
    grid, ints, meta = G.launch_parts(q_shape, k_shape, True, True, _BASE, sms=132)
    assert grid == (132, 1, 1)
    # out strides (token, head), lse strides (batch, head), heads, batch, group, Sq, Sk
    assert ints == (16 * 128, 128, 16 * 1000, 1000, 16, 3, 4, 1000, 700)
    assert meta["IS_CAUSAL"] and not meta["IS_VARLEN"] and meta["HEAD_DIM"] == 128
    # varlen: 5 sequences packed in 3000 / 2000 tokens, the longest 900 / 700; lse (Hq, total_q)
    many_sms = 10**6  # more SMs than work units: one program per unit
    grid, ints, meta = G.launch_parts((3000, 16, 128), (2000, 4, 128), False, True, _BASE, many_sms, batch=5,
                                      max_seqlen_q=900, max_seqlen_k=700)
    assert grid == (8 * 16 * 5, 1, 1) and meta["IS_VARLEN"]
    assert ints == (16 * 128, 128, 0, 3000, 16, 5, 4, 900, 700)
    assert G.launch_parts(q_shape, k_shape, False, True, _BASE, sms=many_sms)[0] == (items, 1, 1)
    # causal items go in pairs (query tiles j and n_m - 1 - j): at most one program per pair
    pairs = 4 * 16 * 3
    assert G.launch_parts(q_shape, k_shape, True, True, _BASE, sms=many_sms)[0] == (pairs, 1, 1)
    assert G.launch_parts((1, 300, 2, 128), (1, 300, 2, 128), True, True, _BASE, sms=132)[0] == (2 * 2, 1, 1)
    three = {**_BASE, "N_CONSUMERS": 3}
    assert G.launch_parts(q_shape, k_shape, False, True, three, many_sms)[0][0] == 6 * 16 * 3


def test_launch_parts_refuse_unknown_and_missing_config_keys():
    """A config names exactly the kernel's schedule keys (the optional ones, O_IN_Q, where it sets them): an
    unknown one (PINGPONG, PERSISTENT: schedules it does not have) or a missing one is a ValueError that names it;
    O_IN_Q with two Q slots, OVERLAP or V in narrower tiles than Q's is refused, and OVERLAP with PV_SPLIT (which its
    flat loop does not take)."""
    shapes = ((2, 256, 4, 128), (2, 256, 4, 128), True, True)
    for extra in ("PINGPONG", "PERSISTENT"):
        with pytest.raises(ValueError, match=f"unknown keys \\['{extra}'\\]"):
            G.launch_parts(*shapes, {**_BASE, extra: False}, 132)
    with pytest.raises(ValueError, match="missing \\['OVERLAP'\\]"):
        G.launch_parts(*shapes, {k: v for k, v in _BASE.items() if k != "OVERLAP"}, 132)
    assert G.launch_parts(*shapes, {**_BASE, "O_IN_Q": True}, 132)[2]["O_IN_Q"]  # an optional key
    for bad in ({"Q_BUFFERS": 2}, {"OVERLAP": True}):
        with pytest.raises(ValueError, match="O_IN_Q takes one Q slot"):
            G.launch_parts(*shapes, {**_BASE, "O_IN_Q": True, **bad}, 132)
    with pytest.raises(ValueError, match="O_IN_Q takes one Q slot"):
        G.launch_parts((2, 256, 4, 192), (2, 256, 4, 192), True, True, {**_BASE, "BLOCK_N": 64, "O_IN_Q": True}, 132,
                       head_dim_v=128)
    with pytest.raises(ValueError, match="OVERLAP does not take the output in two accumulators"):
        G.launch_parts((2, 256, 4, 192), (2, 256, 4, 192), True, True, {**_BASE, "BLOCK_N": 32, "OVERLAP": True},
                       132, split_pv=True)


def test_dynamic_schedule_takes_causal_items_one_at_a_time():
    with pytest.raises(ValueError, match="dynamic schedule"):
        G.launch_parts((2, 256, 4, 128), (2, 256, 4, 128), True, True, {**_BASE, "DYNAMIC": True}, 132)
    grid, _, meta = G.launch_parts((2, 256, 4, 128), (2, 256, 4, 128), True, True,
                                   {**_BASE, "DYNAMIC": True, "CAUSAL_PAIRS": False}, 132)
    assert meta["DYNAMIC"] and grid == (2 * 4 * 2, 1, 1)  # one program per item up to the SM count


def test_overlap_takes_every_schedule():
    """OVERLAP's consumer runs under the static and the dynamic schedule, dense and varlen."""
    varlen = {**configs.gluon_varlen_config(128, 4096, 4096, True), "OVERLAP": True}
    for dynamic in (False, True):
        _, _, meta = G.launch_parts((512, 4, 128), (512, 4, 128), True, True, {**varlen, "DYNAMIC": dynamic}, 132, 2,
                                    256, 256)
        assert meta["OVERLAP"] and meta["DYNAMIC"] == dynamic
    _, _, meta = G.launch_parts((2, 256, 4, 128), (2, 256, 4, 128), True, True, {**_BASE, "OVERLAP": True}, 132)
    assert meta["OVERLAP"] and meta["CAUSAL_PAIRS"]


def test_shared_memory_estimate_and_limit():
    # D = 128, two consumers: Q 2 x 16 KB, K/V ring 2 x 2 x 32 KB, O staging 2 x 16 KB (the compiled kernel holds
    # 196976 bytes, barriers included); a second Q slot adds 32 KB; three consumers with two slots do not fit.
    assert G.shared_memory_bytes(_BASE, 128) == 196608
    assert G.shared_memory_bytes({**_BASE, "Q_BUFFERS": 2}, 128) == 196608 + 32768 <= gluon_common.SHARED_MEMORY_LIMIT
    too_big = {**_BASE, "N_CONSUMERS": 3, "Q_BUFFERS": 2}
    assert G.shared_memory_bytes(too_big, 64) <= gluon_common.SHARED_MEMORY_LIMIT < G.shared_memory_bytes(too_big, 128)
    with pytest.raises(ValueError, match="shared memory"):
        G.launch_parts((1, 256, 2, 128), (1, 256, 2, 128), False, True, too_big, 132)
    # O_IN_Q stages the output in the Q buffers: at 256 columns, 64-key tiles in two stages fit beside Q (192 KB)
    wide = {**_BASE, "BLOCK_N": 64}
    assert G.shared_memory_bytes(wide, 256) == 262144 > gluon_common.SHARED_MEMORY_LIMIT
    assert G.shared_memory_bytes({**wide, "O_IN_Q": True}, 256) == 196608


def test_o_in_q_rules_take_the_wide_tiles_where_switched_on(monkeypatch):
    """configs.forward.GLUON_O_IN_Q: the 256-column tiles' forward takes 64-key tiles with the output staged in the
    Q buffers, causal at every length and non-causal up to 4k keys (GLUON_FWD_O_IN_Q), and those launch within
    sm_90's shared memory; off, and at other head dims or V tiles narrower than Q's, the rules are GLUON_FWD's."""
    cases = [(d, causal, t) for d in (64, 128, 192, 256) for causal in (False, True) for t in (512, 4096, 16384)]
    monkeypatch.setattr(configs.forward, "GLUON_O_IN_Q", False)
    off = {case: configs.gluon_fwd_config(case[0], case[2], case[2], case[1]) for case in cases}
    assert not any(c.get("O_IN_Q") for c in off.values())
    monkeypatch.setattr(configs.forward, "GLUON_O_IN_Q", True)
    for (d, causal, t), before in off.items():
        config = configs.gluon_fwd_config(d, t, t, causal)
        wanted = d > 128 and (causal or t <= 4096)
        assert bool(config.get("O_IN_Q")) == wanted and (wanted or config == before), (d, causal, t, config)
        if wanted:
            assert config["BLOCK_N"] == 64 and not config["STORE_FROM_REGS"]
            G.launch_parts((1, t, 2, d), (1, t, 2, d), causal, True, config, 132)
    assert not configs.gluon_fwd_config(192, 4096, 4096, True, head_dim_v=128).get("O_IN_Q")


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_every_dispatched_dense_config_launches(head_dim, causal):
    """Whatever `configs.gluon_fwd_config` returns for a dense shape passes `launch_parts` (shared memory within sm_90's,
    no schedule it refuses), for query and key lengths from one token to 64k, equal or not: the dispatch takes the
    Gluon kernel at D = 64, 128, 192 and 256 for every length (benchmarks/2026-11-29-h200/explore17/ab_steady.txt), so a config
    it returns for some length that the kernel refuses would fail users' calls, not fall back."""
    lengths = [1, 17, 128, 512, 1000, 1024, 2048, 3000, 4096, 8192, 16384, 65536]
    windows = [(-1, -1), (127, 0), (1023, 0), (4095, 0), (64, 64), (3000, 3000)]
    for seqlen_q, seqlen_k, window in itertools.product(lengths, lengths, windows):
        variant = Variant.of(causal, True, window)
        config = configs.gluon_fwd_config(head_dim, seqlen_q, seqlen_k, causal, variant.band(seqlen_k))
        assert config is not None, (head_dim, seqlen_q, seqlen_k, causal, window)
        grid, _, meta = G.launch_parts((2, seqlen_q, 8, head_dim), (2, seqlen_k, 2, head_dim), causal, True, config,
                                       sms=132, variant=variant)
        block = gluon_common.head_block(head_dim)
        assert 1 <= grid[0] <= 132 and meta["HEAD_DIM"] == block
        assert G.shared_memory_bytes(config, block) <= gluon_common.SHARED_MEMORY_LIMIT


def test_launch_keys_tell_gluon_descriptor_layouts_apart():
    t = torch.empty(1, 64, 2, 64, dtype=torch.float16)
    a = launch._arg_key(gluon_common.descriptor(t, 64))
    assert a == launch._arg_key(gluon_common.descriptor(t, 64))
    assert a != launch._arg_key(gluon_common.descriptor(t, 32))
    assert a != launch._arg_key(gluon_common.descriptor(t.to(torch.bfloat16), 64))


# What every script of `compile_in_fresh_process` can call: `spill_bytes(compiled)`, the bytes of register spill
# stores that ptxas (Triton's bundled one, `-v`) reports for a compiled kernel.
SPILL_PRELUDE = (
    "import re, subprocess, tempfile\n"
    "from triton.backends.nvidia.compiler import get_ptxas\n"
    "def spill_bytes(compiled):\n"
    "    with tempfile.NamedTemporaryFile('w', suffix='.ptx') as f:\n"
    "        f.write(compiled.asm['ptx']); f.flush()\n"
    "        report = subprocess.run([get_ptxas(90).path, '-arch=sm_90a', '-v', f.name, '-o', '/dev/null'],\n"
    "                                capture_output=True, text=True, check=True).stderr\n"
    "    return max(int(n) for n in re.findall(r'(\\d+) bytes spill stores', report))\n"
)


def compile_in_fresh_process(script: str) -> str:
    """Run a Python script that compiles Gluon kernels for sm_90, in a process without the interpreter (which this
    one may run, and which cannot compile Gluon), after SPILL_PRELUDE; asserts that it succeeded and returns what
    it printed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(flashtriton.__file__).parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", SPILL_PRELUDE + script], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# Register spills (bytes of spill stores, `ptxas -v`) of the dispatched Gluon forward configs as triton 3.6's ptxas
# compiles them; those that spill were measured fast regardless: D=64 causal 16k
# (benchmarks/2026-11-29-h200/explore17/ab_steady_long.txt, `c3o`), the 256-column tiles on packed batches
# (configs.forward.VARLEN_WIDE). A change that makes one spill more fails here
# before it costs device time (the former OVERLAP loop's 36 bytes cost it 5-15 %).
SPILL_BUDGET = {(64, True, False, 16384): 28, (256, True, True, 16384): 8}


def test_gluon_kernel_compiles_for_sm90_without_a_gpu():
    """What the dispatch launches compiles to sm_90 code on any machine (CI has no GPU): Gluon's frontend,
    Triton's Hopper passes and ptxas, for each config `configs.gluon_fwd_config` returns, within its spill budget
    (with triton 3.6, whose ptxas the budgets come from). In a fresh process: this one runs the kernels through the
    interpreter, which cannot compile them."""
    script = (
        "from flashtriton import configs\n"
        "from flashtriton.kernels.forward_gluon_launch import compile_for_sm90\n"
        "for head_dim, causal, varlen, keys in ((128, False, False, 16384), (128, True, False, 16384),\n"
        "                                       (128, True, False, 1024), (64, False, False, 16384),\n"
        "                                       (64, True, False, 16384), (64, True, False, 1024),\n"
        "                                       (128, True, True, 16384), (128, False, True, 16384),\n"
        "                                       (256, True, True, 16384)):\n"
        "    config = (configs.gluon_varlen_config if varlen else configs.gluon_fwd_config)(head_dim, keys, keys, causal)\n"
        "    compiled = compile_for_sm90(head_dim, causal, config, varlen=varlen)\n"
        "    ptx = compiled.asm['ptx']\n"
        "    assert 'wgmma.mma_async' in ptx and 'setmaxnreg' in ptx and compiled.asm['cubin'], head_dim\n"
        "    spill = spill_bytes(compiled)\n"
        "    print('compiled', head_dim, causal, varlen, keys, 'spill', spill, compiled.metadata.shared)\n"
    )
    out = compile_in_fresh_process(script)
    assert out.count("compiled") == 9
    import triton

    if triton.__version__.startswith("3.6"):
        for line in out.splitlines():
            if line.startswith("compiled"):
                _, d, causal, varlen, keys, _, spill, _ = line.split()
                key = (int(d), causal == "True", varlen == "True", int(keys))
                assert int(spill) <= SPILL_BUDGET.get(key, 0), f"{line}: more spills than {SPILL_BUDGET.get(key, 0)} bytes"


@hopper_only
@pytest.mark.parametrize("head_dim_v", [96, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_kernel_varlen_separate_v_head_dim(head_dim_v, causal, device):
    """Packed sequences with V's head dim of its own, QK at 128: V in QK's tile width (96) takes the Gluon varlen
    kernel, whose masked stores write V's columns only; 64 (narrower tiles) the portable kernel. Against float64
    per sequence; an empty sequence and one of one token among them."""
    from test_varlen import pack

    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(head_dim_v)
    lengths = [300, 0, 1, 517, 64]
    q, cu = pack(lengths, 8, 128, dtype, device, gen)
    k, _ = pack(lengths, 2, 128, dtype, device, gen)
    v, _ = pack(lengths, 2, head_dim_v, dtype, device, gen)
    assert (configs.gluon_varlen_config(128, 517, 517, causal, head_dim_v) is not None) == (head_dim_v == 96)
    out = flashtriton.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal)
    assert out.shape == (q.shape[0], 8, head_dim_v)
    for b in range(len(lengths)):
        if lengths[b] == 0:
            continue
        rows = slice(cu[b], cu[b + 1])
        qb, kb, vb = q[None, rows], k[None, rows], v[None, rows]
        assert_close_to_exact(out[None, rows], torch_attention(qb, kb, vb, None, causal),
                              attention_reference(qb, kb, vb, None, causal), dtype, f"sequence {b}")


def test_gluon_separate_v_builds_compile_for_sm90_without_spills():
    """QK 192 / V 128 (and V in QK's tile width, 128 / 96, dense and varlen) compile offline with V and O in their
    own tiles:
    wgmma chains on both widths, shared memory under sm_90's, no spill (in a fresh process, as above)."""
    script = (
        "from flashtriton import configs\n"
        "from flashtriton.kernels.forward_gluon_launch import compile_for_sm90\n"
        "from flashtriton.kernels.gluon_common import SHARED_MEMORY_LIMIT\n"
        "for head_dim, head_dim_v, causal, keys, varlen in ((192, 128, True, 16384, False),\n"
        "                                                   (192, 128, False, 1024, False),\n"
        "                                                   (128, 96, True, 4096, False),\n"
        "                                                   (128, 96, True, 4096, True)):\n"
        "    config = (configs.gluon_varlen_config(head_dim, keys, keys, causal, head_dim_v) if varlen else\n"
        "              configs.gluon_fwd_config(head_dim, keys, keys, causal, 0, head_dim_v))\n"
        "    compiled = compile_for_sm90(head_dim, causal, config, varlen=varlen, head_dim_v=head_dim_v)\n"
        "    assert 'wgmma.mma_async' in compiled.asm['ptx'] and compiled.metadata.shared <= SHARED_MEMORY_LIMIT\n"
        "    spill = spill_bytes(compiled)\n"
        "    print('compiled', head_dim, head_dim_v, causal, 'spill', spill)\n"
    )
    out = compile_in_fresh_process(script)
    lines = [line for line in out.splitlines() if line.startswith("compiled")]
    assert len(lines) == 4, out
    assert all(line.endswith("spill 0") for line in lines), lines


def test_gluon_paged_builds_compile_for_sm90_without_spills():
    """The varlen forward over pages of 128 and 256 keys (each K/V tile one page's rows, its page read from the
    block table by the producer) and of 16 and 64 keys (a tile gathered from 8 / 2 pages) compiles offline within
    its spill budget (in a fresh process, as above; triton 3.6's ptxas): up to 36 bytes, all in the producer's
    24-register tile loop (its block-table row pointer, a tile's page entries held across the wait for its stage),
    which waits on the consumers most of its time. The 36-byte build at pages of 16 runs level with a 24-byte one
    that loaded each entry as its box was issued, and 4 % faster at pages of 8 (an H100,
    benchmarks/2026-12-07-h100/paged-prefetch/)."""
    script = (
        "from flashtriton import configs\n"
        "from flashtriton.kernels.forward_gluon_launch import compile_for_sm90\n"
        "for page_size, causal in ((128, True), (256, False), (16, True), (64, False)):\n"
        "    config = configs.gluon_varlen_config(128, 4096, 4096, causal)\n"
        "    compiled = compile_for_sm90(128, causal, config, varlen=True, page_size=page_size)\n"
        "    assert 'wgmma.mma_async' in compiled.asm['ptx']\n"
        "    spill = spill_bytes(compiled)\n"
        "    print('compiled', page_size, causal, 'spill', spill)\n"
    )
    lines = [line.split() for line in compile_in_fresh_process(script).splitlines() if line.startswith("compiled")]
    assert len(lines) == 4, lines
    budget = {"128": 8, "256": 0, "16": 36, "64": 0}  # bytes of spill stores by page size
    assert all(int(spill) <= budget[page] for _, page, _, _, spill in lines), lines


VARIANT_CONFIGS = ["default", "64-key tiles, 4 stages", "causal items one at a time", "three consumers", "overlap",
                   "overlap, three consumers", "overlap, dynamic schedule"]
GLUON_VARIANTS = {  # (causal, window, softcap, ALiBi, sinks)
    "causal window": (True, (200, 0), 0.0, False, False),
    "window both sides": (False, (130, 70), 0.0, False, False),
    "window left only": (False, (300, -1), 0.0, False, False),
    "softcap": (True, (-1, -1), 20.0, False, False),
    "alibi": (False, (-1, -1), 0.0, True, False),
    "causal alibi": (True, (-1, -1), 0.0, True, False),  # the flat loop's column bias and shifted max
    "sinks": (True, (-1, -1), 0.0, False, True),
    "all": (True, (150, 0), 15.0, True, True),
}


@hopper_only
@pytest.mark.parametrize("variant_name", list(GLUON_VARIANTS))
@pytest.mark.parametrize("name", VARIANT_CONFIGS)
@pytest.mark.parametrize("shape", [(2, 1000, 1000, 8, 2), (1, 333, 700, 4, 4), (1, 700, 333, 4, 2)])
def test_gluon_kernel_variants(variant_name, name, shape, device):
    """Windows (the producer loads only the band's tiles, from its first), softcap, ALiBi and sinks through every
    consumer schedule, against float64 and judged against torch's error in the same dtype; lse -inf (or the sink)
    exactly on rows that see no key."""
    from test_features import _torch_same_dtype

    causal, window, softcap, alibi, sinks = GLUON_VARIANTS[variant_name]
    batch, sq, sk, hq, hkv = shape
    q, k, v = make_qkv(batch, sq, sk, hq, hkv, 128, torch.bfloat16, device, seed=sq + sk)
    slopes = (0.5 ** torch.arange(1.0, hq + 1)).to(device) if alibi else None
    sink = torch.linspace(-2.0, 3.0, hq).to(device) if sinks else None
    variant = Variant(causal=causal, window=window, softcap=softcap, alibi_slopes=slopes, sinks=sink)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((batch, hq, sq), float("nan"), dtype=torch.float32, device=device)
    G.launch_forward_gluon(q, k, v, out, lse, 128 ** -0.5, causal, True, CONFIGS[name], variant=variant.of(
        causal, True, window, softcap, alibi, sinks), alibi_slopes=slopes, learnable_sink=sink)
    exact, exact_lse = attention_reference(q, k, v, variant=variant, return_lse=True)
    assert_close_to_exact(out, _torch_same_dtype(q, k, v, variant, sink), exact, torch.bfloat16,
                          f"{name}, {variant_name}")
    seen = torch.isfinite(exact_lse)
    assert torch.equal(torch.isfinite(lse), seen), f"{name}, {variant_name}: lse -inf exactly where no key is seen"
    torch.testing.assert_close(lse[seen].double(), exact_lse[seen], atol=2e-3, rtol=2e-3)


@hopper_only
@pytest.mark.parametrize("variant_name", ["causal window", "window both sides", "all"])
@pytest.mark.parametrize("name", ["varlen dispatch", "varlen, static schedule", "varlen dispatch, overlap"])
def test_gluon_kernel_varlen_variants(variant_name, name, device):
    """Packed sequences with a window (per sequence, bottom-right), softcap, ALiBi and sinks: each sequence against
    float64; the tile past a sequence's last key holds the next sequence's rows, which the mask must hide."""
    from test_varlen import pack

    causal, window, softcap, alibi, sinks = GLUON_VARIANTS[variant_name]
    gen = torch.Generator().manual_seed(3)
    lengths_q, lengths_k = [130, 1, 0, 457, 64, 5], [100, 300, 7, 657, 1, 0]
    q, cu_q = pack(lengths_q, 4, 128, torch.bfloat16, device, gen)
    k, cu_k = pack(lengths_k, 2, 128, torch.bfloat16, device, gen)
    v, _ = pack(lengths_k, 2, 128, torch.bfloat16, device, gen)
    slopes = (0.5 ** torch.arange(1.0, 5.0)).to(device) if alibi else None
    sink = torch.linspace(-2.0, 3.0, 4).to(device) if sinks else None
    _varlen_against_float64(q, k, v, cu_q, cu_k, lengths_q, lengths_k, CONFIGS[name], causal, window, softcap,
                            slopes, sink, name)


def _varlen_against_float64(q, k, v, cu_q, cu_k, lengths_q, lengths_k, config, causal, window, softcap, slopes, sink,
                            what):
    """The Gluon forward on packed q, k, v (bf16) under `config` and the variant (bottom-right); each sequence's
    out and lse against float64, out 0 where a sequence has no key."""
    from test_features import _torch_same_dtype

    out = torch.full((*q.shape[:-1], v.shape[-1]), float("nan"), dtype=torch.bfloat16, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), dtype=torch.float32, device=q.device)
    G.launch_forward_gluon(q, k, v, out, lse, q.shape[-1] ** -0.5, causal, True, config, cu_q, cu_k, max(lengths_q),
                           max(lengths_k), Variant.of(causal, True, window, softcap, slopes is not None,
                                                      sink is not None), slopes, sink)
    variant = Variant(causal=causal, window=window, softcap=softcap, alibi_slopes=slopes, sinks=sink)
    for b, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
        if lq == 0:
            continue
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        qb, kb, vb = q[None, sq], k[None, sk], v[None, sk]
        exact, exact_lse = attention_reference(qb, kb, vb, variant=variant, return_lse=True)
        seen = torch.isfinite(exact_lse[0])
        assert torch.equal(torch.isfinite(lse[:, sq]), seen), f"{what}: sequence {b}"
        if lk == 0:
            assert torch.all(out[sq] == 0), f"{what}: sequence {b}"
            continue
        assert_close_to_exact(out[None, sq], _torch_same_dtype(qb, kb, vb, variant, sink), exact, torch.bfloat16,
                              f"{what}: sequence {b}")
        torch.testing.assert_close(lse[:, sq][seen].double(), exact_lse[0][seen], atol=2e-3, rtol=2e-3)

CAP_FIXED_CASES = {  # (causal, window, softcap, sinks, dropout-free hostile scores: "low" every score near -cap)
    "softcap 50": (True, (-1, -1), 50.0, False, ""),
    "softcap 54, sinks": (False, (-1, -1), 54.0, True, ""),
    "softcap 30, window, sinks": (True, (150, 0), 30.0, True, ""),
    "softcap 50, every score near -cap": (False, (-1, -1), 50.0, False, "low"),
    "softcap 20, every score near +cap, window both sides": (False, (90, 40), 20.0, True, "high"),
}


@hopper_only
@pytest.mark.parametrize("case", list(CAP_FIXED_CASES))
@pytest.mark.parametrize("name", ["default", "causal items one at a time", "overlap", "overlap, dynamic schedule",
                                  "varlen dispatch"])
def test_gluon_softcap_fixed_max_against_float64(case, name, device, monkeypatch):
    """Softcap against its fixed max (CAP_FIXED: p = exp2(t · C - (125 - C)), no row max, no rescale; bf16) through
    the flat, item-by-item and packed schedules, against float64 and judged against torch's bf16 error, with the
    sink in the denominator and rows that see no key; and on hostile scores, every one near -cap (p near 2^-125:
    nothing may flush to 0) or near +cap (p near 2^(2C - 125))."""
    from test_features import _torch_same_dtype

    monkeypatch.setattr(configs.forward, "GLUON_CAP_FIXED", True)
    causal, window, softcap, sinks, hostile = CAP_FIXED_CASES[case]
    assert G.cap_fixed(Variant.of(causal, True, window, softcap, False, sinks), torch.bfloat16)
    batch, sq, sk, hq, hkv = (2, 700, 900, 4, 2) if not name.startswith("varlen") else (1, 700, 900, 4, 2)
    q, k, v = make_qkv(batch, sq, sk, hq, hkv, 128, torch.bfloat16, device, seed=sq + int(softcap))
    if hostile:  # scaled scores of about ±8 · cap: tanh at ±1 to fp32's precision
        direction = torch.randn(1, 1, 1, 128, device=device)
        direction = direction / direction.norm()
        sign = -1.0 if hostile == "low" else 1.0
        scale = (8 * softcap * 128 ** 0.5) ** 0.5
        q = (scale * direction + 0.01 * q.float()).expand_as(q).to(torch.bfloat16).contiguous()
        k = (sign * scale * direction + 0.01 * k.float()).expand_as(k).to(torch.bfloat16).contiguous()
    sink = torch.linspace(-2.0, 3.0, hq).to(device) if sinks else None
    variant = Variant(causal=causal, window=window, softcap=softcap, sinks=sink)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((batch, hq, sq), float("nan"), dtype=torch.float32, device=device)
    kernel_variant = variant.of(causal, True, window, softcap, False, sinks)
    if name.startswith("varlen"):
        cu_q = torch.tensor([0, 300, sq], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, 500, sk], dtype=torch.int32, device=device)
        flat_out, flat_lse = out[0], torch.full((hq, sq), float("nan"), dtype=torch.float32, device=device)
        G.launch_forward_gluon(q[0], k[0], v[0], flat_out, flat_lse, 128 ** -0.5, causal, True, CONFIGS[name],
                               cu_q, cu_k, 400, 500, kernel_variant, None, sink)
        pieces = [(slice(0, 300), slice(0, 500)), (slice(300, sq), slice(500, sk))]
        for qs, ks in pieces:
            exact, exact_lse = attention_reference(q[:, qs], k[:, ks], v[:, ks], variant=variant, return_lse=True)
            assert_close_to_exact(out[:, qs], _torch_same_dtype(q[:, qs], k[:, ks], v[:, ks], variant, sink), exact,
                                  torch.bfloat16, f"{name}, {case}")
            seen = torch.isfinite(exact_lse[0])
            assert torch.equal(torch.isfinite(flat_lse[:, qs]), seen), f"{name}, {case}"
            torch.testing.assert_close(flat_lse[:, qs][seen].double(), exact_lse[0][seen], atol=2e-3, rtol=2e-3)
        return
    G.launch_forward_gluon(q, k, v, out, lse, 128 ** -0.5, causal, True, CONFIGS[name], variant=kernel_variant,
                           learnable_sink=sink)
    exact, exact_lse = attention_reference(q, k, v, variant=variant, return_lse=True)
    assert_close_to_exact(out, _torch_same_dtype(q, k, v, variant, sink), exact, torch.bfloat16, f"{name}, {case}")
    seen = torch.isfinite(exact_lse)
    assert torch.equal(torch.isfinite(lse), seen), f"{name}, {case}: lse -inf exactly where no key is seen"
    torch.testing.assert_close(lse[seen].double(), exact_lse[seen], atol=2e-3, rtol=2e-3)


def test_softcap_fixed_max_applies_only_where_its_range_holds(monkeypatch):
    """CAP_FIXED takes bf16 softcap without ALiBi up to cap · log2(e) = CAP_FIXED_LIMIT (cap 54.06) and nothing
    else: fp16's P cannot hold p's range, ALiBi's bias is not bounded; off, it takes nothing."""
    monkeypatch.setattr(configs.forward, "GLUON_CAP_FIXED", True)
    bf16, fp16 = torch.bfloat16, torch.float16
    assert G.cap_fixed(Variant.of(True, True, softcap=50.0), bf16)
    assert G.cap_fixed(Variant.of(False, True, (10, 10), 54.0, sinks=True, dropout_p=0.1), bf16)
    assert not G.cap_fixed(Variant.of(True, True, softcap=54.1), bf16)
    assert not G.cap_fixed(Variant.of(True, True, softcap=50.0), fp16)
    assert not G.cap_fixed(Variant.of(True, True, softcap=50.0, alibi=True), bf16)
    assert not G.cap_fixed(Variant.of(True, True), bf16)
    _, _, meta = G.launch_parts((1, 256, 4, 128), (1, 256, 4, 128), True, True, CONFIGS["default"], 132,
                                variant=Variant.of(True, True, softcap=50.0), fixed_cap=True)
    assert meta["CAP_FIXED"] is True
    monkeypatch.setattr(configs.forward, "GLUON_CAP_FIXED", False)
    assert not G.cap_fixed(Variant.of(True, True, softcap=50.0), bf16)


def test_gluon_variant_builds_compile_for_sm90():
    """The variant builds (window, softcap, ALiBi, sinks) compile offline through the flat (OVERLAP, short keys) and
    item-by-item (long keys) schedules and the varlen one (in a fresh process, as above)."""
    script = (
        "from flashtriton import configs\n"
        "from flashtriton.kernels.forward_gluon_launch import compile_for_sm90\n"
        "from flashtriton.kernels.variant import Variant\n"
        "for causal, window, varlen, keys in ((True, (100, 0), False, 1024), (False, (64, 64), False, 16384),\n"
        "                                     (True, (100, 0), True, 4096)):\n"
        "    variant = Variant.of(causal, True, window, 15.0, True, True)\n"
        "    config = (configs.gluon_varlen_config if varlen else configs.gluon_fwd_config)(128, keys, keys, causal)\n"
        "    compiled = compile_for_sm90(128, causal, config, varlen=varlen, variant=variant)\n"
        "    assert 'wgmma.mma_async' in compiled.asm['ptx']\n"
        "    print('compiled', causal, window, varlen, keys)\n"
    )
    assert compile_in_fresh_process(script).count("compiled") == 3


def test_gluon_dropout_builds_compile_for_sm90():
    """The dropout builds (`gluon_common.dropout_tile` in the softmax, the output scaled by 1 / (1 - p)) compile
    offline: the rules `configs.GLUON_DROPOUT_FWD` names (the flat loop at D=64 and
    128, causal or not) within 16 bytes of spills (triton 3.6's ptxas; 24 at D=128 non-causal, whose build with
    Philox4x32-7 runs 1.13-1.22x faster than Philox4x32-10's 16: benchmarks/2026-12-06-h100/dropout-rounds/), their keep-mask made on the threads that hold its scores (no more
    warp shuffles than the dropout-free build); a combination with a window, softcap, ALiBi and sinks, and the
    varlen build (in a fresh process, as above)."""
    script = (
        "from flashtriton.configs import forward as configs_forward\n"
        "from flashtriton.kernels.forward_gluon_launch import compile_for_sm90\n"
        "from flashtriton.kernels.variant import Variant\n"
        "configs_forward.GLUON_DROPOUT = configs_forward.GLUON_DROPOUT_ALL = True\n"
        "for head_dim, causal, keys in ((128, False, 16384), (128, True, 1024), (64, False, 16384), (64, True, 4096)):\n"
        "    config = configs_forward.gluon_fwd_config(head_dim, keys, keys, causal, dropout=True)\n"
        "    rule = configs_forward.GLUON_DROPOUT_FWD.lookup(configs_forward.SM90, '16', head_dim)\n"
        "    assert config == rule, config\n"
        "    compiled = compile_for_sm90(head_dim, causal, config, variant=Variant.of(causal, dropout_p=0.1))\n"
        "    ptx = compiled.asm['ptx']\n"
        "    plain = compile_for_sm90(head_dim, causal, config, variant=Variant.of(causal)).asm['ptx']\n"
        "    assert 'wgmma.mma_async' in ptx and 'mul.wide.u32' in ptx\n"
        "    assert ptx.count('shfl.sync') == plain.count('shfl.sync'), (head_dim, causal)\n"
        "    assert spill_bytes(compiled) <= (24 if (head_dim, causal) == (128, False) else 16), (head_dim, causal)\n"
        "    print('compiled', head_dim, causal, keys)\n"
        "variant = Variant.of(True, True, (100, 0), 15.0, True, True, 0.1)\n"
        "config = configs_forward.gluon_fwd_config(128, 1024, 1024, True, 100, dropout=True)\n"
        "assert 'mul.wide.u32' in compile_for_sm90(128, True, config, variant=variant).asm['ptx']\n"
        "print('compiled variants')\n"
        "config = configs_forward.gluon_varlen_config(128, 4096, 4096, True, dropout=True)\n"
        "ptx = compile_for_sm90(128, True, config, varlen=True, variant=Variant.of(True, dropout_p=0.1)).asm['ptx']\n"
        "assert 'mul.wide.u32' in ptx\n"
        "print('compiled varlen')\n"
    )
    assert compile_in_fresh_process(script).count("compiled") == 6


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_gluon_launch_arguments_bind_to_the_kernels_parameters(dropout_p):
    """The host's positional arguments of the Gluon forward and of both backward kernels land on the parameters
    they are meant for (the variant's, dropout's three included: None where off), with the launch's constexprs
    by keyword: bound as Triton binds them, on CPU tensors (no launch)."""
    import inspect

    from flashtriton.kernels import backward_gluon_launch as BG
    from flashtriton.kernels import forward_gluon_launch as FG
    from flashtriton.kernels.variant import Variant, dropout_threshold

    q = torch.zeros(2, 256, 4, 128, dtype=torch.bfloat16)
    k = torch.zeros(2, 256, 2, 128, dtype=torch.bfloat16)
    lse = torch.zeros(2, 4, 256)
    rng = torch.tensor([5, 7], dtype=torch.int64)
    variant = Variant.of(True, True, (100, 0), 20.0, True, True, dropout_p)
    slopes, sinks = torch.ones(4), torch.ones(4)
    config = configs.gluon_fwd_config(128, 256, 256, True, 100)
    _, ints, meta = FG.launch_parts(q.shape, k.shape, True, True, config, 132, variant=variant)
    scalars = variant.forward_args(0.125, slopes, sinks) + variant.dropout_args(rng if dropout_p else None)
    args = FG.launch_args(q, k, k, q, lse, scalars, config["BLOCK_N"], ints)
    meta = {name: value for name, value in meta.items() if name != "num_warps"}
    bound = inspect.signature(FG.KERNEL.fn).bind(*args, **meta).arguments
    assert bound["SINKS"] is sinks and bound["ALIBI"] is slopes and bound["stride_om"] == ints[0]
    assert bound["window_left"] == 100 and bound["softcap"] == scalars[3] is not None
    assert bound.get("HAS_DROPOUT", False) == bool(dropout_p)
    if dropout_p:
        assert bound["DROPOUT_RNG"] is rng and bound["dropout_threshold"] == dropout_threshold(dropout_p)
        assert bound["dropout_scale"] == 1 / (1 - dropout_p)
    else:
        assert bound["DROPOUT_RNG"] is None and bound["dropout_threshold"] is None and bound["dropout_scale"] is None

    bwd_config = configs.gluon_bwd_config(128, 256, 256, True)
    variant, scalars = BG._variant_args(0.125, True, True, (100, 0), 20.0, slopes, dropout_p,
                                        rng if dropout_p else None)
    lse_pad = torch.zeros(2, 4, BG.padded_rows(256, False))
    for name, fn in (("dkdv", BG._attn_bwd_dkdv_gluon), ("dq", BG._attn_bwd_dq_gluon)):
        _, ints, meta = BG.launch_parts(q.shape, k.shape, True, True, bwd_config[name], name, variant=variant)
        desc = FG.descriptor(q, 64, False, 128)
        if name == "dkdv":
            args = BG._dkdv_args(desc, desc, k, k, k, k, lse_pad, lse_pad, lse, lse, q, 0.125, scalars, ints, False,
                                 128, 128)
            stride = "stride_dkn"
        else:
            args = BG._dq_args(desc, desc, k, k, q, lse_pad, lse_pad, lse, lse, q, 0.125, scalars, ints, False, 128,
                               bwd_config[name]["BLOCK_N"], 128)
            stride = "stride_dqm"
        meta = {n: v for n, v in meta.items() if n != "num_warps"}
        bound = inspect.signature(fn.fn).bind(*args, **meta).arguments
        assert bound["ALIBI"] is slopes and bound["softcap"] == scalars[3] is not None and bound["window_left"] == 100
        assert bound[stride] == (k if name == "dkdv" else q).stride(-3) and bound["SEQLEN_PAD"] == ints[-1]
        assert (bound["DROPOUT_RNG"] is rng) == bool(dropout_p) and bound.get("HAS_DROPOUT", False) == bool(dropout_p)
        if dropout_p:
            assert bound["dropout_threshold"] == dropout_threshold(dropout_p)
