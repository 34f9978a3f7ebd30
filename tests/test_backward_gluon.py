"""Hopper's Gluon backward kernels (kernels/backward_gluon.py: dK/dV and dQ). Gluon kernels compile for sm_90 only
and do not run in the interpreter: the kernel tests run on a Hopper GPU; compiling and the host-side pieces are
tested everywhere.

The backward takes the Gluon kernels on sm_90 where `configs.gluon_bwd_config` gives a config (dense and packed,
D = 64 and 128, problems large enough to hide their host time), so test_backward.py's small shapes mostly run the
Triton kernels there. These tests force the Gluon kernels (every config the sweeps tried) through `attention_backward`
on shapes that reach each of their paths, dense and packed, check which kernels ran, and check the dispatch."""


import pytest
import torch

import flashtriton
from flashtriton.kernels import dispatch
from flashtriton import configs
from flashtriton.kernels import backward as B
from flashtriton.kernels import backward_gluon_launch as BG
from flashtriton.kernels import gluon_common
from flashtriton.kernels.forward import attention_forward
from flashtriton.kernels.variant import Variant
from flashtriton.reference import attention_reference

from accuracy import assert_close_to_exact
from test_backward import check_grads, make_qkv
from test_forward_gluon import compile_in_fresh_process

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
hopper_only = pytest.mark.skipif(not HOPPER, reason="Gluon's Hopper kernel: sm_90 only (no interpreter)")

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv): one token, odd lengths, Sq != Sk both ways (bottom-right causal
# leaves rows with no key and key blocks no query sees), GQA, key counts that are not a multiple of 128, many
# programs.
SHAPES = [(2, 1, 1, 2, 2), (2, 17, 17, 2, 1), (2, 200, 333, 4, 2), (1, 333, 200, 2, 2), (2, 1024, 64, 8, 2),
          (3, 300, 1000, 8, 8), (1, 1000, 1000, 4, 1)]


def record_gluon_launches(monkeypatch) -> list:
    """The Gluon backward kernels launched from now on, in order, by the name of their launcher ("launch_dkdv_gluon",
    "launch_dq_gluon"): every Gluon backward launch goes through `backward_gluon_launch._launch`."""
    ran = []
    if BG is None:
        return ran
    real = BG._launch

    def recorded(fn, *args):
        ran.append("launch_dkdv_gluon" if fn is BG._attn_bwd_dkdv_gluon else "launch_dq_gluon")
        return real(fn, *args)

    monkeypatch.setattr(BG, "_launch", recorded)
    return ran


def expected_launches(config, dense=True, sinks=False, head_dims=(128,)) -> list:
    """The Gluon launches of a backward under `config`, in order: a dense call in tiles up to 128 columns wide
    (`head_dims`: QK's and V's) (with a sink: under GLUON_BWD_FUSED_SINK) runs the dQ kernel first, which does the
    preprocess' work (`configs.backward.GLUON_BWD_FUSED_DELTA`); the Triton dQ (config "dq" None) is not
    recorded."""
    if config["dq"] is None:
        return ["launch_dkdv_gluon"]
    if dense and configs.backward.GLUON_BWD_FUSED_DELTA and BG.head_block(max(head_dims)) <= 128 and (
            not sinks or configs.backward.GLUON_BWD_FUSED_SINK):
        return ["launch_dq_gluon", "launch_dkdv_gluon"]
    return ["launch_dkdv_gluon", "launch_dq_gluon"]


def backward(q, k, v, dout, causal, bottom_right, use_gluon, monkeypatch, softmax_scale=None, config=None):
    """(dq, dk, dv) of the forward + `attention_backward`, with the Gluon kernels on (under `config`, else the
    dispatch's config for the head dim, whatever the size of the problem) or off; asserts that the kernels asked
    for are the ones that ran."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out, lse = attention_forward(q, k, v, scale, causal, bottom_right)
    monkeypatch.setattr(dispatch, "CHOICE", dispatch.Choice(gluon_bwd=use_gluon))
    if use_gluon:
        config = config or configs.gluon_bwd_config(q.shape[-1], 4096, 4096, causal)
        monkeypatch.setattr(configs, "gluon_bwd_config", lambda *a, **kw: config)
    ran = record_gluon_launches(monkeypatch)
    grads = B.attention_backward(dout, q, k, v, out, lse, scale, causal, bottom_right)
    expected = expected_launches(config, head_dims=(q.shape[-1], v.shape[-1])) if use_gluon else []
    assert ran == expected, f"Gluon kernels that ran: {ran}, expected {expected}"
    return grads


def assert_gluon_close_to_triton(q, k, v, dout, monkeypatch, tol, finite=False):
    """For both causal modes, (dq, dk, dv) of the same inputs through the Gluon kernels and through the Triton
    ones (bottom-right) agree within tol (the same sums in another order), and are finite if asked."""
    for causal in (False, True):
        ours = backward(q, k, v, dout, causal, True, True, monkeypatch)
        theirs = backward(q, k, v, dout, causal, True, False, monkeypatch)
        for a, b in zip(ours, theirs):
            if finite:
                assert torch.isfinite(a).all()
            torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


_DEFAULT = configs.gluon_bwd_config(128, 4096, 4096, False)
CONFIGS = {
    "dispatch": None,
    "dQ by 128-key tiles": {**_DEFAULT, "dq": dict(BLOCK_N=128, NUM_STAGES=2, CONSUMER_REGS=240)},
    "dQ by 64-key tiles, 2 stages": {"dkdv": dict(NUM_STAGES=2, CONSUMER_REGS=240),
                                     "dq": dict(BLOCK_N=64, NUM_STAGES=2, CONSUMER_REGS=240)},
    "dK/dV 3 stages, Triton dQ": {"dkdv": dict(NUM_STAGES=3, CONSUMER_REGS=240), "dq": None},
    # persistent dK/dV programs: one per SM, or 3 (each then takes many items, through both K/V buffer pairs)
    "persistent dK/dV": {**_DEFAULT, "dkdv": dict(NUM_STAGES=2, CONSUMER_REGS=240, PERSISTENT=True)},
    "persistent dK/dV, 3 programs": {**_DEFAULT, "dkdv": dict(NUM_STAGES=2, CONSUMER_REGS=240, PERSISTENT=3)},
    # dK/dV tiles in three loops (masked, whole, masked), the whole tiles' dPᵀ issued early (1) or late (2)
    "split dK/dV": {**_DEFAULT, "dkdv": dict(NUM_STAGES=2, CONSUMER_REGS=240, SPLIT=1)},
    "split dK/dV, late dP, 3 stages": {**_DEFAULT, "dkdv": dict(NUM_STAGES=3, CONSUMER_REGS=240, SPLIT=2)},
    # both kernels' tiles in three loops (the dQ kernel's SPLIT: built, not yet run on the H200)
    "split dK/dV and dQ": {"dkdv": dict(NUM_STAGES=2, CONSUMER_REGS=240, SPLIT=1),
                           "dq": dict(_DEFAULT["dq"], SPLIT=1)},
}


@hopper_only
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("causal,bottom_right", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("head_dim,dtype", [(128, torch.float16), (64, torch.bfloat16), (128, torch.bfloat16),
                                           (80, torch.float16), (96, torch.bfloat16)])  # (80, 96: tiles of 128)
def test_gluon_backward_against_float64(name, causal, bottom_right, head_dim, dtype, device, monkeypatch):
    for shape in SHAPES:
        q, k, v, dout = make_qkv(*shape, head_dim, dtype, device)
        ours = backward(q, k, v, dout, causal, bottom_right, True, monkeypatch, config=CONFIGS[name])
        check_grads(ours, q, k, v, dout, causal, bottom_right, what=f"{name}, shape {shape}: ")


WIDE_CONFIGS = {
    "dispatch": None,
    "dK/dV 1 stage, Triton dQ": {"dkdv": dict(NUM_STAGES=1, CONSUMER_REGS=240), "dq": None},
}


@hopper_only
@pytest.mark.parametrize("name", list(WIDE_CONFIGS))
@pytest.mark.parametrize("causal,bottom_right", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("head_dim,dtype", [(256, torch.bfloat16), (256, torch.float16), (192, torch.bfloat16)])
def test_gluon_backward_wide_head_dims_against_float64(name, causal, bottom_right, head_dim, dtype, device,
                                                       monkeypatch):
    """D = 256 (and 192 in its tiles): dK/dV programs of 64 keys whose two warpgroups split the columns."""
    for shape in SHAPES:
        q, k, v, dout = make_qkv(*shape, head_dim, dtype, device)
        ours = backward(q, k, v, dout, causal, bottom_right, True, monkeypatch, config=WIDE_CONFIGS[name])
        check_grads(ours, q, k, v, dout, causal, bottom_right, what=f"{name}, shape {shape}: ")


@hopper_only
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim,dtype", [(40, torch.bfloat16), (72, torch.float16), (104, torch.bfloat16),
                                           (160, torch.bfloat16), (224, torch.float16), (8, torch.float16)])
def test_gluon_backward_multiples_of_8_against_float64(head_dim, dtype, causal, device, monkeypatch):
    """Head dims the Gluon backward takes in the tiles that hold them (`configs.GLUON_BWD_HEAD_DIMS`: every multiple
    of 8), through the dispatch's config: zero columns past the head in 64-, 128- and 256-column tiles."""
    assert configs.gluon_bwd_config(head_dim, 4096, 4096, causal) is not None
    for shape in SHAPES:
        q, k, v, dout = make_qkv(*shape, head_dim, dtype, device)
        ours = backward(q, k, v, dout, causal, True, True, monkeypatch)
        check_grads(ours, q, k, v, dout, causal, True, what=f"D={head_dim}, shape {shape}: ")


@hopper_only
def test_gluon_backward_equals_the_triton_kernels_closely(device, monkeypatch):
    """Same inputs, the Gluon and the Triton kernels: the same sums in another order, so close to a few ulps."""
    q, k, v, dout = make_qkv(2, 700, 900, 8, 2, 128, torch.float16, device, seed=3)
    assert_gluon_close_to_triton(q, k, v, dout, monkeypatch, 2e-2)


@hopper_only
def test_gluon_backward_other_scales_and_strided_inputs(device, monkeypatch):
    q, k, v, dout = make_qkv(2, 130, 250, 4, 2, 64, torch.float16, device, seed=5)
    for scale in (0.3, 0.0):  # 0: uniform attention over the keys each row sees
        ours = backward(q, k, v, dout, True, True, True, monkeypatch, softmax_scale=scale)
        check_grads(ours, q, k, v, dout, True, softmax_scale=scale, what=f"scale {scale}: ")
    # views into wider tensors (strides that are not the shape's), still TMA-aligned
    wide = [torch.cat([t, t], dim=-2)[:, :, : t.shape[2]] for t in (q, k, v, dout)]
    assert not wide[0].is_contiguous()
    ours = backward(*wide, False, True, True, monkeypatch)
    check_grads(ours, *wide, False, what="strided: ")


@hopper_only
def test_broadcast_upstream_gradient_takes_the_triton_kernel(device, monkeypatch):
    """An upstream gradient with stride-0 dims (out.sum().backward()) is not given to TMA."""
    q, k, v, dout = make_qkv(1, 64, 64, 2, 2, 64, torch.float16, device)
    dout = torch.ones(1, 1, 1, 64, dtype=q.dtype, device=device).expand_as(q)
    ours = backward(q, k, v, dout, False, True, False, monkeypatch)  # asserts the Triton kernel ran
    check_grads(ours, q, k, v, dout, False)


@pytest.mark.gpu
@hopper_only
def test_gluon_backward_long_sequence(device, monkeypatch):
    q, k, v, dout = make_qkv(1, 4096, 4096, 4, 2, 128, torch.bfloat16, device, seed=7)
    assert_gluon_close_to_triton(q, k, v, dout, monkeypatch, 3e-2, finite=True)


def test_launch_parts_and_padding():
    dkdv, dq = _DEFAULT["dkdv"], _DEFAULT["dq"]
    grid, ints, meta = BG.launch_parts((3, 1000, 16, 128), (3, 700, 4, 128), True, False, dkdv)
    assert grid == (6, 4, 3)  # cdiv(700, 128) key blocks, kv heads, batch
    assert ints == (16, 3, 4, 1000, 700, 1024)  # Hq, batch, group size, Sq, Sk, Sq padded to a multiple of 128
    assert meta["IS_CAUSAL"] and not meta["CAUSAL_BOTTOM_RIGHT"] and meta["HEAD_DIM"] == 128
    assert not meta["IS_VARLEN"]
    # varlen: 5 sequences packed in 3000 / 2000 tokens, the longest 900 / 700; lse rows per head: each sequence
    # moved to a 16-byte aligned row (at most 4 rows more each), plus 128
    grid, ints, meta = BG.launch_parts((3000, 16, 128), (2000, 4, 128), False, True, dkdv, "dkdv", 5, 900, 700)
    assert grid == (6, 4, 5) and ints == (16, 5, 4, 900, 700, 3000 + 4 * 5 + 128) and meta["IS_VARLEN"]
    grid, ints, meta = BG.launch_parts((3, 1000, 16, 128), (3, 700, 4, 128), False, True, dq, "dq")
    assert grid == (8, 16, 3) and meta["BLOCK_N"] == dq["BLOCK_N"]  # cdiv(1000, 128) query tiles, heads, batch
    assert [BG.padded_seqlen(n) for n in (1, 128, 129)] == [128, 128, 256]
    assert BG.padded_rows(129, False) == 256 and BG.padded_rows(129, True, 3) == 4 * (33 + 3) + 128
    rows = BG.row_descriptor(torch.empty(2, 3, 128))
    assert rows.shape == [2 * 3 * 128] and rows.block_shape == [64] and rows.strides == [1]
    assert rows.padding == "zero" and rows.layout == BG._row_layout()
    # dense launches: one plan per call shape (dtype, device, config), with launch_parts' grid, ints and constexprs
    args = ("dkdv", (3, 1000, 16, 128), (3, 700, 4, 128), torch.float16, torch.device("cpu"), True, False,
            tuple(sorted(dkdv.items())))
    plan = BG._dense_plan(*args)
    assert BG._dense_plan(*args) is plan and plan.relaunch is None
    assert (plan.grid, plan.ints, plan.meta) == BG.launch_parts((3, 1000, 16, 128), (3, 700, 4, 128), True, False, dkdv)
    assert plan.meta["WORK_TABLE"] is False
    assert BG._dense_plan(*args[:3], torch.bfloat16, *args[4:]) is not plan


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_preprocess_writes_the_padded_layout(dtype, device):
    """The preprocess launch gives the Gluon kernels lse and delta = rowsum(dO ∘ O) in their padded layout. Dense:
    (B, Hq, Sq rounded up to 128), lse -inf and delta 0 on the padding. Varlen: each sequence at a 16-byte aligned
    row, in order, none overlapping the next. Runs everywhere (the preprocess is a Triton kernel)."""
    gen = torch.Generator().manual_seed(5)

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dt)

    out, dout, lse = rand(2, 70, 3, 64), rand(2, 70, 3, 64), rand(2, 3, 70, dt=torch.float32)
    delta_ref = (out.float() * dout.float()).sum(-1).transpose(1, 2)  # (B, H, Sq)
    lse_pad, delta, _ = B.preprocess(out, dout, lse, padded=True)
    assert lse_pad.shape == delta.shape == (2, 3, 128)
    torch.testing.assert_close(lse_pad[..., :70], lse, rtol=0, atol=0)
    torch.testing.assert_close(delta[..., :70], delta_ref, rtol=1e-5, atol=1e-5)
    assert torch.all(lse_pad[..., 70:] == float("-inf")) and torch.all(delta[..., 70:] == 0)
    same_lse, plain, _ = B.preprocess(out, dout, lse)  # the Triton kernels' layout: delta like lse
    assert same_lse is lse and plain.shape == lse.shape
    torch.testing.assert_close(plain, delta_ref, rtol=1e-5, atol=1e-5)

    lengths = [5, 0, 1, 70, 3, 8]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    total = sum(lengths)
    out, dout, lse = rand(total, 3, 64), rand(total, 3, 64), rand(3, total, dt=torch.float32)
    delta_ref = (out.float() * dout.float()).sum(-1).t()  # (H, total)
    lse_pad, delta, _ = B.preprocess(out, dout, lse, cu, max(lengths), padded=True)
    assert lse_pad.shape == delta.shape == (3, BG.padded_rows(total, True, len(lengths)))
    end = 0
    for b, n in enumerate(lengths):
        start = 4 * (-(-int(cu[b]) // 4) + b)  # backward_gluon.lse_rows
        assert start % 4 == 0 and start >= end, b
        end = start + n
        torch.testing.assert_close(lse_pad[:, start:end], lse[:, cu[b]:cu[b + 1]], rtol=0, atol=0)
        torch.testing.assert_close(delta[:, start:end], delta_ref[:, cu[b]:cu[b + 1]], rtol=1e-5, atol=1e-5)
    assert end + 128 <= lse_pad.shape[1]  # the last tile of the last sequence stays inside


def test_dispatch_config():
    for head_dim in (64, 128, 256):
        for causal in (False, True):
            config = configs.gluon_bwd_config(head_dim, 4096, 4096, causal)
            assert set(config) == {"dkdv", "dq"}
            assert BG.shared_memory_bytes(config["dkdv"], head_dim) <= BG.SHARED_MEMORY_LIMIT
            assert BG.shared_memory_bytes(config["dq"], head_dim, "dq") <= BG.SHARED_MEMORY_LIMIT
    # short problems keep the Triton kernels: the Gluon launches' host time would show
    little = configs.GLUON_BWD_MIN_FLOPS / 2
    assert configs.gluon_bwd_config(128, 512, 512, True, little) is None
    assert configs.gluon_bwd_config(128, 512, 512, True, 2 * configs.GLUON_BWD_MIN_FLOPS) is not None

    def standard(head_dim, seqlen, causal):  # a point of the standard sweep: B·T = 16384, H·D = 2048
        flops = 4 * 16384 * (2048 // head_dim) * seqlen * head_dim / (2 if causal else 1)
        return configs.gluon_bwd_config(head_dim, seqlen, seqlen, causal, flops) is not None

    # measured through autograd (configs.GLUON_BWD_MIN_FLOPS): Gluon from non-causal T=512 and causal T=1024 at
    # D=128; at D=64 up to 512 keys its GPU time is level with the Triton kernels', so those keep them
    assert [standard(128, t, False) for t in (256, 512, 1024)] == [False, True, True]
    assert [standard(128, t, True) for t in (512, 1024)] == [False, True]
    assert [standard(64, t, False) for t in (512, 1024)] == [False, True]
    assert [standard(64, t, True) for t in (512, 1024)] == [False, True]
    assert configs.gluon_bwd_config(128, 4096, 4096, False, varlen=True) == configs.gluon_bwd_config(128, 4096, 4096, False)
    # 80 / 96 / 112 take D=128's rows (128-column tiles), 192 D=256's; head dims no Gluon kernel takes, none
    assert configs.gluon_bwd_config(96, 4096, 4096, False) == configs.gluon_bwd_config(128, 4096, 4096, False)
    assert configs.gluon_bwd_config(192, 4096, 4096, True) == configs.gluon_bwd_config(256, 4096, 4096, True)
    assert configs.gluon_bwd_config(72, 4096, 4096, False) == configs.gluon_bwd_config(128, 4096, 4096, False)
    assert configs.gluon_bwd_config(160, 4096, 4096, False) == configs.gluon_bwd_config(256, 4096, 4096, False)
    assert configs.gluon_bwd_config(40, 4096, 4096, False) == configs.gluon_bwd_config(64, 4096, 4096, False)
    assert configs.gluon_bwd_config(59, 4096, 4096, False) is None  # rows of 118 bytes: the Triton kernels
    # split loops (dense, without dropout or ALiBi): in 128-column tiles a window (dK/dV with 2 stages) and causal
    # softcap split both kernels, causal without a variant dQ alone; at D=64 causal both; the rest as without them
    for head_dim in (80, 128):
        unsplit = configs.gluon_bwd_config(head_dim, 16384, 16384, False)
        plain = configs.gluon_bwd_config(head_dim, 16384, 16384, True)
        assert plain == dict(unsplit, dq=dict(unsplit["dq"], SPLIT=1))
        for causal in (False, True):
            windowed = configs.gluon_bwd_config(head_dim, 16384, 16384, causal, window=True)
            assert windowed == dict(dkdv=dict(unsplit["dkdv"], NUM_STAGES=2, SPLIT=1), dq=plain["dq"])
        softcapped = configs.gluon_bwd_config(head_dim, 4096, 4096, True, softcap=True)
        assert softcapped == dict(dkdv=dict(unsplit["dkdv"], SPLIT=1), dq=plain["dq"])
        assert configs.gluon_bwd_config(head_dim, 4096, 4096, False, softcap=True) == unsplit
        assert configs.gluon_bwd_config(head_dim, 16384, 16384, True, varlen=True, window=True) == unsplit
        assert configs.gluon_bwd_config(head_dim, 16384, 16384, True, window=True, alibi=True) == unsplit
        assert configs.gluon_bwd_config(head_dim, 16384, 16384, True, alibi=True) == unsplit
        assert configs.gluon_bwd_config(head_dim, 16384, 16384, True, dropout=True, window=True) == \
            configs.gluon_bwd_config(head_dim, 16384, 16384, True, dropout=True)
    d64 = configs.gluon_bwd_config(64, 4096, 4096, False)
    assert configs.gluon_bwd_config(64, 4096, 4096, True) == {kernel: dict(d64[kernel], SPLIT=1) for kernel in d64}
    assert configs.gluon_bwd_config(64, 4096, 4096, True, window=True) == d64
    assert configs.gluon_bwd_config(64, 4096, 4096, True, varlen=True) == d64
    assert configs.gluon_bwd_config(256, 4096, 4096, True, window=True) == \
        configs.gluon_bwd_config(256, 4096, 4096, True)
    # D = 256: dK/dV programs of 64 keys (K and V 64 KB, per stage Q, dO 64 KB and lse, delta 512 B)
    assert BG.program_block("dkdv", 256) == 64 and BG.program_block("dkdv", 128) == 128
    assert BG.shared_memory_bytes(dict(NUM_STAGES=2), 256) == 65536 + 2 * 66048
    grid, _, _ = BG.launch_parts((2, 300, 8, 256), (2, 300, 2, 256), False, True, configs.GLUON_BWD_D256["dkdv"])
    assert grid == (5, 2, 2)


@hopper_only
def test_dispatch_takes_the_gluon_kernels_for_large_problems_only(device, monkeypatch):
    ran = record_gluon_launches(monkeypatch)
    for seqlen, expected in ((64, []), (4096, expected_launches({"dq": {}}))):
        q, k, v, dout = make_qkv(4, seqlen, seqlen, 16, 16, 128, torch.bfloat16, device)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        flashtriton.flash_attn_func(*leaves, causal=False).backward(dout)
        assert ran == expected, seqlen
        ran.clear()


@hopper_only
@pytest.mark.parametrize("order", ["dispatch", "as_given", "largest_first", "grid"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim,head_dim_v", [(64, 64), (112, 112), (128, 128), (256, 256), (192, 128),
                                                 (128, 64)])
def test_gluon_backward_varlen(causal, head_dim, head_dim_v, order, device, monkeypatch):
    """Packed sequences (empty ones, one token, Sq != Sk, GQA) with rows of other data before and after them:
    per-sequence gradients against float64, and the rows outside every sequence left alone. Programs from the work
    table in either order, and from the grid over the longest sequence's blocks. V with a head dim of its own too
    (a sequence's last partial block of dV stored row by row with V's columns only)."""
    from test_varlen import pack

    if order != "dispatch":
        monkeypatch.setitem(configs.VARLEN_BWD_ORDER, causal, order)

    lengths_q, lengths_k = [5, 0, 1, 200, 33, 130, 64], [9, 4, 1, 150, 20, 0, 64]
    gen = torch.Generator().manual_seed(11)
    dtype = torch.float16
    q, cu_q = pack(lengths_q, 4, head_dim, dtype, device, gen)
    k, cu_k = pack(lengths_k, 2, head_dim, dtype, device, gen)
    v, _ = pack(lengths_k, 2, head_dim_v, dtype, device, gen)
    dout, _ = pack(lengths_q, 4, head_dim_v, dtype, device, gen)
    if head_dim > 128 or head_dim_v != head_dim:  # the dispatch's config for the head dims
        config = configs.gluon_bwd_config(head_dim, 4096, 4096, causal, head_dim_v=head_dim_v)
    else:
        config = _DEFAULT if head_dim > 64 else {"dkdv": dict(NUM_STAGES=2, CONSUMER_REGS=240),
                                                  "dq": dict(BLOCK_N=128, NUM_STAGES=2, CONSUMER_REGS=240)}
    monkeypatch.setattr(configs, "gluon_bwd_config", lambda *a, **kw: config)
    ran = record_gluon_launches(monkeypatch)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = flashtriton.flash_attn_varlen_func(*leaves, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal)
    out.backward(dout)
    assert ran == ["launch_dkdv_gluon", "launch_dq_gluon"]
    dq, dk, dv = (t.grad for t in leaves)
    assert dv.shape == v.shape
    for b, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lq == 0 or lk == 0:
            assert torch.all(dq[sq] == 0) and torch.all(dk[sk] == 0) and torch.all(dv[sk] == 0), f"seq {b}"
            continue
        ours = (dq[None, sq], dk[None, sk], dv[None, sk])
        check_grads(ours, q[None, sq], k[None, sk], v[None, sk], dout[None, sq], causal, what=f"seq {b}: ")


@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("longest_first", [False, True])
def test_work_table(kernel, causal, longest_first, device):
    """The varlen backward's program table: one row per existing (sequence, head, 128-row block), each with its
    sequence's bounds, and only those; a head's blocks in a row in the dense grid's order; sequences as given or
    largest first; padding rows (b = -1) after the last block only."""
    lengths_q, lengths_k = [5, 0, 1, 300, 130, 0, 700, 129], [130, 4, 1, 0, 257, 0, 64, 129]
    heads = 3
    cu_q = torch.tensor([0] + torch.tensor(lengths_q).cumsum(0).tolist(), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + torch.tensor(lengths_k).cumsum(0).tolist(), dtype=torch.int32, device=device)
    total = int(cu_k[-1] if kernel == "dkdv" else cu_q[-1]) + 37  # packed tensors may hold more rows
    table = BG.work_table(cu_q, cu_k, heads, kernel, causal, longest_first, total).cpu()
    assert table.dtype == torch.int32 and table.shape == (heads * (total // 128 + len(lengths_q)), 8)
    valid = table[:, 0] >= 0
    n = int(valid.sum())
    assert bool(valid[:n].all()) and not bool(valid[n:].any())  # padding only at the end
    assert torch.all(table[n:, 1:] == 0)
    blocked = lengths_k if kernel == "dkdv" else lengths_q
    expected = [(b, h, s) for b, length in enumerate(blocked) for h in range(heads) for s in range(0, length, 128)]
    rows = [tuple(r) for r in table[:n].tolist()]
    assert sorted((r[0], r[1], r[2]) for r in rows) == sorted(expected)
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for b, _, _, q_start, len_q, k_start, len_k, zero in rows:
        assert (q_start, len_q, k_start, len_k, zero) == (starts_q[b], lengths_q[b], starts_k[b], lengths_k[b], 0)
    seq_order = list(dict.fromkeys(r[0] for r in rows))  # sequences in the order their rows come
    work = [lengths_q[b] * lengths_k[b] for b in seq_order]
    if longest_first:
        assert work == sorted(work, reverse=True)
    else:
        assert seq_order == sorted(seq_order)
    for b in seq_order:  # contiguous per sequence, then per head; blocks in the dense grid's order
        mine = [r for r in rows if r[0] == b]
        first = rows.index(mine[0])
        assert rows[first:first + len(mine)] == mine
        for h in range(heads):
            starts = [r[2] for r in mine if r[1] == h]
            assert starts == sorted(starts, reverse=kernel == "dq" and causal)
        assert [r[1] for r in mine] == sorted(r[1] for r in mine)


def test_work_table_without_sequences(device):
    """cu_seqlens of an empty batch over packed rows that belong to no sequence: no program at all."""
    cu = torch.zeros(1, dtype=torch.int32, device=device)
    for kernel in ("dkdv", "dq"):
        assert BG.work_table(cu, cu, 4, kernel, True, True, 1000).shape == (0, 8)
    empty = torch.zeros(3, dtype=torch.int32, device=device)  # two sequences of length 0: padding rows only
    table = BG.work_table(empty, empty, 4, "dq", False, False, 300).cpu()
    assert table.shape == (4 * (300 // 128 + 2), 8) and torch.all(table[:, 0] == -1)


def test_work_table_cache(device):
    cu = torch.tensor([0, 100, 400], dtype=torch.int32, device=device)
    args = (3, "dkdv", True, True, 400)
    first = BG.cached_work_table(cu, cu, *args)
    assert BG.cached_work_table(cu, cu, *args) is first
    cu[1] = 300  # written in place: rebuilt
    again = BG.cached_work_table(cu, cu, *args)
    assert again is not first and torch.equal(again.cpu(), BG.work_table(cu, cu, *args).cpu())
    assert not torch.equal(again.cpu(), first.cpu())


@hopper_only
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_backward_varlen_without_sequences(causal, device, monkeypatch):
    """cu_seqlens of an empty batch over 300 packed rows (a max_seqlen above 0 passed anyway): no program runs, every
    gradient row is 0 (these rows belong to no sequence)."""
    q, k, v = (torch.randn(300, 2, 128, dtype=torch.float16, device=device) for _ in range(3))
    cu = torch.zeros(1, dtype=torch.int32, device=device)
    monkeypatch.setattr(configs, "gluon_bwd_config", lambda *a, **kw: _DEFAULT)
    ran = record_gluon_launches(monkeypatch)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flashtriton.flash_attn_varlen_func(*leaves, cu, cu, 8, 8, causal=causal)
    out.backward(torch.randn_like(out))
    assert ran == ["launch_dkdv_gluon", "launch_dq_gluon"]
    assert all(torch.all(t.grad == 0) for t in leaves)


def test_shared_memory_estimate_and_limit():
    # D = 128 dQ: Q and dO of 128 rows (64 KB), per stage K and V tiles of 64 keys (32 KB); the compiled kernel holds
    # 131328 bytes with 2 stages (barriers included). 128-key tiles with 3 stages do not fit.
    dq = dict(BLOCK_N=64, NUM_STAGES=2, CONSUMER_REGS=240)
    assert BG.shared_memory_bytes(dq, 128, "dq") == 131072
    too_big = dict(dq, BLOCK_N=128, NUM_STAGES=3)
    assert BG.shared_memory_bytes(too_big, 64, "dq") <= BG.SHARED_MEMORY_LIMIT < BG.shared_memory_bytes(too_big, 128, "dq")
    with pytest.raises(ValueError, match="shared memory"):
        BG.launch_parts((1, 256, 2, 128), (1, 256, 2, 128), False, True, too_big, "dq")
    # dK/dV at D = 128, 2 stages: K and V of 128 keys (64 KB), per stage Q, dO (32 KB) and lse, delta (512 B);
    # persistent: two items' K and V
    assert BG.shared_memory_bytes(dict(NUM_STAGES=2), 128) == 65536 + 2 * 33280
    assert BG.shared_memory_bytes(dict(NUM_STAGES=2, PERSISTENT=True), 128) == 2 * 65536 + 2 * 33280


def test_persistent_dkdv_launch_parts():
    """A persistent dK/dV launch: one program per SM (`programs`) or PERSISTENT's number, never more than the grid's
    items (key blocks x kv heads x batch entries); dense calls with tiles up to 128 wide only."""
    config = dict(NUM_STAGES=2, CONSUMER_REGS=240, PERSISTENT=True)
    q, k = (2, 1000, 8, 128), (2, 1000, 2, 128)  # 8 key blocks x 2 kv heads x 2 = 32 items
    grid, _, meta = BG.launch_parts(q, k, True, True, config, "dkdv", programs=132)
    assert grid == (32, 1, 1) and meta["PERSISTENT"] is True
    assert BG.launch_parts(q, k, True, True, config, "dkdv", programs=20)[0] == (20, 1, 1)
    assert BG.launch_parts(q, k, True, True, dict(config, PERSISTENT=3), "dkdv", programs=132)[0] == (3, 1, 1)
    assert BG.launch_parts(q, k, True, True, dict(config, PERSISTENT=False), "dkdv")[0] == (8, 2, 2)
    with pytest.raises(ValueError, match="PERSISTENT"):
        BG.launch_parts((3000, 8, 128), (3000, 2, 128), True, True, config, "dkdv", 2, 1500, 1500)  # varlen
    with pytest.raises(ValueError, match="PERSISTENT"):
        BG.launch_parts((2, 1000, 8, 256), (2, 1000, 2, 256), True, True, config, "dkdv")


def test_gluon_backward_compiles_for_sm90_without_a_gpu():
    """What the dispatch launches compiles to sm_90 code on any machine (CI has no GPU). In a fresh process: this
    one runs the kernels through the interpreter, which cannot compile Gluon."""
    script = (
        "import torch\n"
        "from flashtriton import configs\n"
        "from flashtriton.kernels.backward_gluon_launch import compile_for_sm90\n"
        "for head_dim, causal, dtype in ((128, False, torch.float16), (128, True, torch.bfloat16),\n"
        "                                (64, False, torch.bfloat16), (64, True, torch.float16),\n"
        "                                (256, True, torch.bfloat16), (192, False, torch.float16)):\n"
        "    config = configs.gluon_bwd_config(head_dim, 4096, 4096, causal)\n"
        "    for kernel in ('dkdv', 'dq'):\n"
        "        compiled = compile_for_sm90(head_dim, causal, config[kernel], dtype, kernel, varlen=causal)\n"
        "        ptx = compiled.asm['ptx']\n"
        "        assert 'wgmma.mma_async' in ptx and 'setmaxnreg' in ptx and compiled.asm['cubin'], head_dim\n"
        "        print('compiled', kernel, head_dim, causal, compiled.metadata.shared)\n"
    )
    assert compile_in_fresh_process(script).count("compiled") == 12


def test_operands_in_registers_reach_the_wgmmas():
    """KV_REGS changes the products' A operands, not only a flag: with it every wgmma of the D=64 dK/dV dispatch
    build reads its A operand from registers (two register lists in the PTX instruction), and without it Sᵀ and dPᵀ
    read both from shared memory, as the dQ kernel's S and dP do; softcap, and a window even with KV_REGS' bit 4,
    build with the shared-memory operands. In a fresh process, as above."""
    script = (
        "import re, torch\n"
        "from flashtriton import configs\n"
        "from flashtriton.kernels.backward_gluon_launch import compile_for_sm90\n"
        "def counts(kernel, overrides, **variant):\n"
        "    config = dict(configs.gluon_bwd_config(64, 4096, 4096, False)[kernel], **overrides)\n"
        "    ptx = compile_for_sm90(64, False, config, torch.bfloat16, kernel, **variant).asm['ptx']\n"
        "    mmas = re.findall(r'wgmma.mma_async[^;]*;', ptx)\n"
        "    return len(mmas), sum(m.count('{') == 2 for m in mmas)\n"
        "print('dkdv', *counts('dkdv', {}))\n"
        "print('dkdv_off', *counts('dkdv', dict(KV_REGS=0)))\n"
        "print('dkdv_softcap', *counts('dkdv', {}, softcap=30.0))\n"
        "print('dkdv_window', *counts('dkdv', dict(KV_REGS=7), window_size=(100, 50)))\n"
        "print('dq_off', *counts('dq', {}))\n"
    )
    names = ("dkdv", "dkdv_off", "dkdv_softcap", "dkdv_window", "dq_off")
    lines = compile_in_fresh_process(script).splitlines()
    found = {words[0]: tuple(map(int, words[1:])) for words in map(str.split, lines) if words and words[0] in names}
    total, from_registers = found["dkdv"]  # every product from registers
    assert total > 0 and from_registers == total, found
    for name in ("dkdv_off", "dkdv_softcap", "dkdv_window", "dq_off"):  # dV / dK or dQ only (P and dS in registers)
        total, from_registers = found[name]
        assert 0 < from_registers < total, (name, found)


# ----------------------------------------------------------------------------------------------------------------
# Variants: windows, softcap, ALiBi and sinks in the Gluon backward
# ----------------------------------------------------------------------------------------------------------------
# flash-attn's arguments of each variant (bottom-right); ALiBi: one slope per query head ("alibi") or per (batch
# entry, query head) ("alibi_batch"); sinks: one logit per query head. Windows short and long against the kernels'
# 64- and 128-row tiles, on one side of the diagonal or both, with causal.
GLUON_VARIANTS = {
    "window_both": dict(window_size=(100, 50)),
    "window_tiny": dict(window_size=(7, 3)),
    "window_diagonal": dict(window_size=(0, 0)),
    "window_left_unbounded": dict(window_size=(-1, 30)),
    "window_right_unbounded": dict(window_size=(37, -1)),
    "causal_window": dict(causal=True, window_size=(200, 0)),
    "causal_window_short": dict(causal=True, window_size=(5, 0)),
    "softcap": dict(softcap=30.0),
    "softcap_small": dict(softcap=2.0),
    "alibi": dict(alibi="heads"),
    "alibi_batch": dict(alibi="batch"),
    "causal_alibi": dict(causal=True, alibi="heads"),
    "sinks": dict(sinks=True),
    "causal_window_softcap_alibi_sinks": dict(causal=True, window_size=(130, 0), softcap=5.0, alibi="batch",
                                              sinks=True),
    "window_softcap_alibi": dict(window_size=(64, 64), softcap=10.0, alibi="heads"),
}
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv): one query, Sq < Sk and Sq > Sk (rows / key blocks a window leaves
# empty), GQA, lengths that are not a multiple of a tile
VARIANT_SHAPES = [(2, 1, 130, 2, 2), (1, 333, 700, 4, 2), (1, 700, 333, 2, 1), (2, 1000, 1000, 4, 2)]


def _variant_inputs(spec: dict, batch: int, heads_q: int, device, seed: int = 0):
    """(flash-attn keyword arguments without the sinks, sinks or None) of a GLUON_VARIANTS entry."""
    gen = torch.Generator().manual_seed(seed)
    kwargs = {k: v for k, v in spec.items() if k not in ("alibi", "sinks")}
    if spec.get("alibi") == "heads":
        kwargs["alibi_slopes"] = (0.5 * torch.rand(heads_q, generator=gen) + 0.01).to(device)
    elif spec.get("alibi") == "batch":
        kwargs["alibi_slopes"] = (0.5 * torch.rand(batch, heads_q, generator=gen) + 0.01).to(device)
    sinks = (2 * torch.randn(heads_q, generator=gen)).to(device) if spec.get("sinks") else None
    return kwargs, sinks


def variant_grads(q, k, v, dout, kwargs, sinks, use_gluon, monkeypatch, config=None, varlen=None):
    """(dq, dk, dv[, dsink]) of flash_attn_func (or flash_attn_varlen_func with varlen = (cu_q, cu_k, max_q, max_k))
    under the variant's arguments, with the Gluon backward forced on (`config`, else the dispatch's for the head
    dim, whatever the size of the problem) or off; asserts that the kernels asked for are the ones that ran."""
    monkeypatch.setattr(dispatch, "CHOICE", dispatch.Choice(gluon_bwd=use_gluon))
    expected = []
    if use_gluon:
        config = config or configs.gluon_bwd_config(q.shape[-1], 4096, 4096, kwargs.get("causal", False))
        monkeypatch.setattr(configs, "gluon_bwd_config", lambda *a, **kw: config)
        expected = expected_launches(config, varlen is None, sinks is not None, (q.shape[-1], v.shape[-1]))
    ran = record_gluon_launches(monkeypatch)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if sinks is not None:
        leaves.append(sinks.detach().clone().requires_grad_())
    sink = leaves[3] if sinks is not None else None
    if varlen is None:
        out = flashtriton.flash_attn_func(*leaves[:3], learnable_sink=sink, **kwargs)
    else:
        out = flashtriton.flash_attn_varlen_func(*leaves[:3], *varlen, learnable_sink=sink, **kwargs)
    grads = torch.autograd.grad(out, leaves, dout)
    assert ran == expected, f"Gluon kernels that ran: {ran}, expected {expected}"
    return grads


def exact_variant_grads(q, k, v, dout, kwargs, sinks):
    """The float64 reference's (dq, dk, dv[, dsink]) of a dense call under flash-attn's variant arguments."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    if sinks is not None:
        leaves.append(sinks.detach().double().requires_grad_())
    variant = Variant(causal=kwargs.get("causal", False), window=kwargs.get("window_size", (-1, -1)),
                      softcap=kwargs.get("softcap", 0.0), alibi_slopes=kwargs.get("alibi_slopes"),
                      sinks=leaves[3] if sinks is not None else None)
    out = attention_reference(*leaves[:3], variant=variant)
    return torch.autograd.grad(out, leaves, dout.double())


def assert_variant_grads(ours, portable, exact, dtype, what):
    """The Gluon backward's gradients within 2x the portable backward's error against float64 (+ the dtype's
    floor, tests/accuracy.py): the portable kernels run every variant and are judged against torch in
    tests/test_features.py."""
    for name, g, p, e in zip(("dq", "dk", "dv", "dsink"), ours, portable, exact):
        assert g.shape == p.shape and g.dtype == p.dtype, f"{what}{name}: {g.shape} {g.dtype}"
        assert_close_to_exact(g, p, e, dtype, f"{what}{name}")


@hopper_only
@pytest.mark.parametrize("name", list(GLUON_VARIANTS))
@pytest.mark.parametrize("head_dim,dtype", [(128, torch.bfloat16), (64, torch.float16), (256, torch.bfloat16)])
def test_gluon_backward_variants_against_float64(name, head_dim, dtype, device, monkeypatch):
    for shape in VARIANT_SHAPES:
        q, k, v, dout = make_qkv(*shape, head_dim, dtype, device, seed=shape[1])
        kwargs, sinks = _variant_inputs(GLUON_VARIANTS[name], shape[0], shape[3], device, seed=shape[2])
        ours = variant_grads(q, k, v, dout, kwargs, sinks, True, monkeypatch)
        portable = variant_grads(q, k, v, dout, kwargs, sinks, False, monkeypatch)
        exact = exact_variant_grads(q, k, v, dout, kwargs, sinks)
        assert_variant_grads(ours, portable, exact, dtype, f"{name}, shape {shape}: ")


# The dK/dV kernel's K and V held in registers (KV_REGS) as Sᵀ's and dPᵀ's A operands, bit 4 set so that varlen
# and the variants take them too (the kernel never takes them with a window, whose dK they broke on the H200: the
# window cases check that forcing them changes nothing). What the
# dispatch honours (KV_REGS at D=64, dense without a variant) runs in the float64 tests above; this runs the rest on
# the GPU before the dispatch takes it.
REGS_CASES = ["plain", "causal", "window_both", "causal_window", "softcap", "alibi", "sinks", "varlen"]


@hopper_only
@pytest.mark.parametrize("name", REGS_CASES)
@pytest.mark.parametrize("head_dim,dtype", [(64, torch.float16), (128, torch.bfloat16)])
def test_gluon_backward_operands_in_registers_against_float64(name, head_dim, dtype, device, monkeypatch):
    """The dispatch's configs with K and V in registers wherever the dK/dV kernel builds them, dense or packed, with
    the variants: the gradients (dsink too) against float64 within 2x the portable backward's error."""
    spec = {"plain": {}, "causal": dict(causal=True), "varlen": dict(causal=True), **GLUON_VARIANTS}[name]
    base = configs.gluon_bwd_config(head_dim, 4096, 4096, spec.get("causal", False))
    config = {"dkdv": dict(base["dkdv"], KV_REGS=7), "dq": base["dq"]}
    # the build takes the operands from registers
    assert BG.launch_parts((1, 64, 4, head_dim), (1, 64, 2, head_dim), False, True, config["dkdv"], "dkdv")[2][
        "KV_REGS"] == 7
    for shape in VARIANT_SHAPES:
        q, k, v, dout = make_qkv(*shape, head_dim, dtype, device, seed=shape[1])
        kwargs, sinks = _variant_inputs(spec, shape[0], shape[3], device, seed=shape[2])
        varlen = None
        if name == "varlen":  # the batch's sequences packed: (B · S, H, D) with cu_seqlens
            batch, sq, sk = shape[:3]
            cu_q = torch.arange(0, (batch + 1) * sq, sq, dtype=torch.int32, device=device)
            cu_k = torch.arange(0, (batch + 1) * sk, sk, dtype=torch.int32, device=device)
            varlen = (cu_q, cu_k, sq, sk)
            packed = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v, dout)]
            ours = variant_grads(*packed, kwargs, sinks, True, monkeypatch, config=config, varlen=varlen)
            ours = [g.reshape(t.shape) for g, t in zip(ours, (q, k, v))]
        else:
            ours = variant_grads(q, k, v, dout, kwargs, sinks, True, monkeypatch, config=config)
        portable = variant_grads(q, k, v, dout, kwargs, sinks, False, monkeypatch)
        exact = exact_variant_grads(q, k, v, dout, kwargs, sinks)
        assert_variant_grads(ours, portable, exact, dtype, f"{name}, shape {shape}: ")


# QK_WIDTH / V_WIDTH (`gluon_common.mma_nt`): S and dP over the head's own columns, in pieces of powers of two
# (80 = 64 + 16, 96 = 64 + 32, 112 = 64 + 32 + 16 of 128; 192 = 128 + 64 of 256), with V's own (the head dims
# the dispatch gives the Gluon backward).
TRIM_HEAD_DIMS = [(80, 80, torch.bfloat16), (96, 96, torch.float16), (112, 112, torch.bfloat16),
                  (80, 80, torch.float16), (192, 192, torch.bfloat16), (192, 192, torch.float16),
                  (192, 128, torch.bfloat16), (96, 64, torch.float16)]


@hopper_only
@pytest.mark.parametrize("name", ["plain", "causal", "softcap", "window_both", "causal_window_softcap_alibi_sinks"])
@pytest.mark.parametrize("head_dim,head_dim_v,dtype", TRIM_HEAD_DIMS)
@pytest.mark.parametrize("split", [False, True])
def test_gluon_backward_trimmed_products_against_float64(name, head_dim, head_dim_v, dtype, split, device,
                                                         monkeypatch):
    """S and dP over the head's own columns (GLUON_BWD_TRIM for both tile widths) and, split, dQ in two
    accumulators (GLUON_BWD_DQ_SPLIT: QK head dim 192) through the dispatch's
    configs, dense, with GQA and Sq != Sk: the gradients (dsink too) against float64 within 2x the portable
    backward's error; the plan's constexprs say the narrower products ran."""
    monkeypatch.setattr(configs.backward, "GLUON_BWD_TRIM", (128, 256))
    monkeypatch.setattr(configs.backward, "GLUON_BWD_TRIM_PIECES", 3)  # (D=112's three wgmmas too)
    monkeypatch.setattr(configs.backward, "GLUON_BWD_DQ_SPLIT", split)
    if split and head_dim != 192:
        pytest.skip("the split accumulators take D=192 (pieces of 64 columns or more)")
    spec = {"plain": {}, "causal": dict(causal=True), **GLUON_VARIANTS}[name]
    widths = BG.product_widths(head_dim, head_dim_v)
    assert widths == tuple(w if w < BG.head_block(d) else 0 for d, w in
                           ((head_dim, gluon_common.product_width(head_dim)),
                            (head_dim_v, gluon_common.product_width(head_dim_v))))
    assert any(widths)
    config = configs.gluon_bwd_config(head_dim, 4096, 4096, spec.get("causal", False), head_dim_v=head_dim_v)
    for kernel in ("dkdv", "dq"):
        _, _, meta = BG.launch_parts((1, 64, 4, head_dim), (1, 64, 2, head_dim), False, True, config[kernel], kernel,
                                     head_dim_v=head_dim_v, widths=widths, dq_split=BG.dq_split(head_dim))
        assert (meta.get("QK_WIDTH", 0), meta.get("V_WIDTH", 0)) == widths
        assert meta.get("DQ_SPLIT", False) == (split and kernel == "dq")
    for shape in VARIANT_SHAPES[1:]:
        batch, sq, sk, hq, hkv = shape
        gen = torch.Generator().manual_seed(sq + head_dim)
        q = torch.randn(batch, sq, hq, head_dim, generator=gen).to(device, dtype)
        k = torch.randn(batch, sk, hkv, head_dim, generator=gen).to(device, dtype)
        v = torch.randn(batch, sk, hkv, head_dim_v, generator=gen).to(device, dtype)
        dout = torch.randn(batch, sq, hq, head_dim_v, generator=gen).to(device, dtype)
        kwargs, sinks = _variant_inputs(spec, batch, hq, device, seed=sk)
        ours = variant_grads(q, k, v, dout, kwargs, sinks, True, monkeypatch, config=config)
        portable = variant_grads(q, k, v, dout, kwargs, sinks, False, monkeypatch)
        exact = exact_variant_grads(q, k, v, dout, kwargs, sinks)
        assert_variant_grads(ours, portable, exact, dtype, f"{name}, {head_dim}/{head_dim_v}, shape {shape}: ")


@hopper_only
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim_v", [192, 128])
def test_gluon_backward_acc_split_varlen(causal, head_dim_v, device, monkeypatch):
    """dQ in two accumulators (GLUON_BWD_DQ_SPLIT) on packed sequences at QK head dim 192: a sequence's last partial
    block stored row by row from both accumulators (the second at column 128, its columns past the head not
    stored); per-sequence gradients against float64, rows outside every sequence left at 0."""
    monkeypatch.setattr(configs.backward, "GLUON_BWD_DQ_SPLIT", True)
    assert BG.dq_split(192) and not BG.dq_split(96)
    lengths_q, lengths_k = [5, 0, 1, 200, 33, 130], [9, 4, 1, 150, 20, 0]
    q, k, v, dout, cu_q, cu_k = packed_inputs(lengths_q, lengths_k, 4, 2, 192, torch.bfloat16, device, 17)
    if head_dim_v != 192:
        v, dout = v[..., :head_dim_v].contiguous(), dout[..., :head_dim_v].contiguous()
    config = configs.gluon_bwd_config(192, 4096, 4096, causal, head_dim_v=head_dim_v)
    varlen = (cu_q, cu_k, max(lengths_q), max(lengths_k))
    dq, dk, dv = variant_grads(q, k, v, dout, dict(causal=causal), None, True, monkeypatch, config=config,
                               varlen=varlen)
    for b, sq, sk, _ in sequences(cu_q, cu_k, {}):
        if lengths_q[b] == 0 or lengths_k[b] == 0:
            assert torch.all(dq[sq] == 0), f"seq {b}"
            continue
        one = [t[None, s] for t, s in ((q, sq), (k, sk), (v, sk), (dout, sq))]
        portable = variant_grads(*one, dict(causal=causal), None, False, monkeypatch)
        exact = exact_variant_grads(*one, dict(causal=causal), None)
        assert_variant_grads((dq[None, sq], dk[None, sk], dv[None, sk]), portable, exact, torch.bfloat16,
                             f"seq {b}: ")


def test_gluon_acc_split_builds_compile_for_sm90():
    """dQ in two accumulators (GLUON_BWD_DQ_SPLIT) compiles for sm_90 (dense and varlen, QK 192 with V 192 and
    128) with no more spill stores and no more shuffles than one accumulator: dS reaches the second product without
    moving."""
    out = compile_in_fresh_process(
        "from flashtriton import configs\n"
        "from flashtriton.configs import backward as cb\n"
        "from flashtriton.kernels.backward_gluon_launch import compile_for_sm90\n"
        "for d, dv, causal, varlen in ((192, 192, True, False), (192, 128, False, True)):\n"
        "    cfg = configs.gluon_bwd_config(d, 4096, 4096, causal, 1e12, varlen, dv)\n"
        "    found = []\n"
        "    for on in (False, True):\n"
        "        cb.GLUON_BWD_DQ_SPLIT = on\n"
        "        c = compile_for_sm90(d, causal, cfg['dq'], kernel='dq', head_dim_v=dv, varlen=varlen)\n"
        "        found.append((spill_bytes(c), c.asm['ptx'].count('shfl')))\n"
        "    assert found[1][0] <= found[0][0] and found[1][1] <= found[0][1], (d, dv, found)\n"
        "    print('compiled', d, dv, varlen, found)\n")
    assert out.count("compiled") == 2


def test_trimmed_products_take_the_tile_widths_the_switch_names(monkeypatch):
    """product_widths: the head's own columns where they are fewer than its tiles', GLUON_BWD_TRIM names the
    tiles' width and they take at most GLUON_BWD_TRIM_PIECES wgmmas; 0 (the whole tile) elsewhere."""
    monkeypatch.setattr(configs.backward, "GLUON_BWD_TRIM", (128, 256))
    monkeypatch.setattr(configs.backward, "GLUON_BWD_TRIM_PIECES", 3)
    assert [BG.product_widths(d, dv) for d, dv in ((64, 64), (96, 96), (80, 80), (112, 128), (192, 128), (256, 96))] \
        == [(0, 0), (96, 96), (80, 80), (112, 0), (192, 0), (0, 96)]
    monkeypatch.setattr(configs.backward, "GLUON_BWD_TRIM_PIECES", 2)
    assert [BG.product_widths(d) for d in (80, 112, 192)] == [(80, 80), (0, 0), (192, 192)]
    monkeypatch.setattr(configs.backward, "GLUON_BWD_TRIM", (256,))
    assert [BG.product_widths(d) for d in (96, 192)] == [(0, 0), (192, 192)]
    monkeypatch.setattr(configs.backward, "GLUON_BWD_TRIM", ())
    assert BG.product_widths(192, 128) == (0, 0)
    monkeypatch.setattr(configs.backward, "GLUON_BWD_DQ_SPLIT", True)
    assert not BG.dq_split(192)  # (no trimmed width, no pieces)
    monkeypatch.setattr(configs.backward, "GLUON_BWD_TRIM", (128, 256))
    assert [d for d in (80, 96, 112, 128, 192, 256) if BG.dq_split(d)] == [192]
    monkeypatch.setattr(configs.backward, "GLUON_BWD_DQ_SPLIT", False)
    assert not BG.dq_split(192)


def test_gluon_backward_trimmed_builds_compile_for_sm90():
    """The narrower S and dP compile for sm_90 in both kernels: fewer wgmma instructions than the whole tiles'
    build, and no more spill stores (one accumulator per gradient: the split ones add wgmmas of their own)."""
    out = compile_in_fresh_process(
        "from flashtriton import configs\n"
        "from flashtriton.configs import backward as cb\n"
        "from flashtriton.kernels.backward_gluon_launch import compile_for_sm90\n"
        "cb.GLUON_BWD_DQ_SPLIT = False\n"
        "for d, dv, causal in ((96, 96, True), (192, 128, True)):\n"
        "    cfg = configs.gluon_bwd_config(d, 4096, 4096, causal, 1e12, False, dv)\n"
        "    for kernel in ('dkdv', 'dq'):\n"
        "        found = []\n"
        "        for trim in ((), (128, 256)):\n"
        "            cb.GLUON_BWD_TRIM = trim\n"
        "            c = compile_for_sm90(d, causal, cfg[kernel], kernel=kernel, head_dim_v=dv)\n"
        "            found.append((c.asm['ptx'].count('wgmma.mma_async'), spill_bytes(c)))\n"
        "        (whole, whole_spill), (trimmed, trimmed_spill) = found\n"
        "        assert trimmed < whole and trimmed_spill <= whole_spill, (d, dv, kernel, found)\n"
        "        print('compiled', d, dv, kernel, found)\n")
    assert out.count("compiled") == 4


@hopper_only
@pytest.mark.parametrize("name", ["sinks", "causal_window_softcap_alibi_sinks"])
@pytest.mark.parametrize("head_dim,dtype", [(128, torch.bfloat16), (64, torch.float16)])
def test_gluon_backward_fused_sink_against_float64(name, head_dim, dtype, device, monkeypatch):
    """The sink's gradient from the dQ kernel's parts (GLUON_BWD_FUSED_SINK: dQ first, no preprocess launch), the
    other gradients as without it, against float64; the parts summed in a fixed order: the same bits twice."""
    monkeypatch.setattr(configs.backward, "GLUON_BWD_FUSED_SINK", True)
    for shape in VARIANT_SHAPES:
        q, k, v, dout = make_qkv(*shape, head_dim, dtype, device, seed=shape[1])
        kwargs, sinks = _variant_inputs(GLUON_VARIANTS[name], shape[0], shape[3], device, seed=shape[2])
        ours = variant_grads(q, k, v, dout, kwargs, sinks, True, monkeypatch)  # (asserts dQ ran first)
        again = variant_grads(q, k, v, dout, kwargs, sinks, True, monkeypatch)
        assert all(torch.equal(a, b) for a, b in zip(ours, again))
        portable = variant_grads(q, k, v, dout, kwargs, sinks, False, monkeypatch)
        exact = exact_variant_grads(q, k, v, dout, kwargs, sinks)
        assert_variant_grads(ours, portable, exact, dtype, f"{name}, shape {shape}: ")


@hopper_only
@pytest.mark.parametrize("name", ["causal_window", "window_both", "window_softcap_alibi",
                                  "causal_window_softcap_alibi_sinks"])
@pytest.mark.parametrize("config_name", ["dQ by 128-key tiles", "dQ by 64-key tiles, 2 stages",
                                         "dK/dV 3 stages, Triton dQ", "persistent dK/dV",
                                         "persistent dK/dV, 3 programs", "split dK/dV",
                                         "split dK/dV, late dP, 3 stages", "split dK/dV and dQ"])
def test_gluon_backward_variants_other_configs(name, config_name, device, monkeypatch):
    """The variants under every Gluon config the sweeps tried (dQ tiles of 64 and 128 keys, the Triton dQ)."""
    shape = (1, 1000, 1000, 4, 2)
    q, k, v, dout = make_qkv(*shape, 128, torch.float16, device, seed=1)
    kwargs, sinks = _variant_inputs(GLUON_VARIANTS[name], 1, 4, device)
    ours = variant_grads(q, k, v, dout, kwargs, sinks, True, monkeypatch, config=CONFIGS[config_name])
    portable = variant_grads(q, k, v, dout, kwargs, sinks, False, monkeypatch)
    exact = exact_variant_grads(q, k, v, dout, kwargs, sinks)
    assert_variant_grads(ours, portable, exact, torch.float16, f"{name}, {config_name}: ")


def packed_inputs(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, device, seed):
    """q, k, v, dout packed (total, H, D) for sequences of these lengths, and cu_seqlens_q, cu_seqlens_k."""
    from test_varlen import pack

    gen = torch.Generator().manual_seed(seed)
    q, cu_q = pack(lengths_q, heads_q, head_dim, dtype, device, gen)
    k, cu_k = pack(lengths_k, heads_kv, head_dim, dtype, device, gen)
    v, _ = pack(lengths_k, heads_kv, head_dim, dtype, device, gen)
    dout, _ = pack(lengths_q, heads_q, head_dim, dtype, device, gen)
    return q, k, v, dout, cu_q, cu_k


def sequences(cu_q, cu_k, kwargs):
    """(b, its query rows, its keys, the variant's keywords for sequence b alone: its row of (B, Hq) ALiBi slopes)
    of each sequence of a packed call."""
    for b in range(len(cu_q) - 1):
        seq_kwargs = dict(kwargs)
        if kwargs.get("alibi_slopes") is not None and kwargs["alibi_slopes"].dim() == 2:
            seq_kwargs["alibi_slopes"] = kwargs["alibi_slopes"][b]
        yield b, slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1]), seq_kwargs


@hopper_only
@pytest.mark.parametrize("name", ["causal_window", "window_both", "window_tiny", "softcap", "alibi_batch",
                                  "causal_window_softcap_alibi_sinks"])
@pytest.mark.parametrize("causal_order", ["dispatch", "grid"])
def test_gluon_backward_variants_varlen(name, causal_order, device, monkeypatch):
    """Packed sequences (empty ones, one token, Sq != Sk, GQA) under a variant: per-sequence gradients against
    float64 (the window and ALiBi measured from each sequence's own diagonal, ALiBi (B, Hq) slopes per sequence),
    dsink over all sequences against the sum of theirs, rows outside every sequence left at 0."""
    if causal_order != "dispatch":
        monkeypatch.setitem(configs.VARLEN_BWD_ORDER, True, causal_order)
        monkeypatch.setitem(configs.VARLEN_BWD_ORDER, False, causal_order)
    lengths_q, lengths_k = [5, 0, 1, 400, 33, 130, 300], [9, 4, 1, 450, 20, 0, 300]
    batch, heads_q, heads_kv, head_dim, dtype = len(lengths_q), 4, 2, 128, torch.bfloat16
    q, k, v, dout, cu_q, cu_k = packed_inputs(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, device, 13)
    kwargs, sinks = _variant_inputs(GLUON_VARIANTS[name], batch, heads_q, device, seed=3)
    varlen = (cu_q, cu_k, max(lengths_q), max(lengths_k))
    ours = variant_grads(q, k, v, dout, kwargs, sinks, True, monkeypatch, varlen=varlen)
    dq, dk, dv = ours[:3]
    dsink_exact = torch.zeros(heads_q, dtype=torch.float64, device=device)
    for b, sq, sk, seq_kwargs in sequences(cu_q, cu_k, kwargs):
        if lengths_q[b] == 0:
            assert torch.all(dk[sk] == 0) and torch.all(dv[sk] == 0), f"seq {b}"
            continue
        if lengths_k[b] == 0:  # (the sink takes each row's whole softmax; out = 0, so its gradient adds nothing)
            assert torch.all(dq[sq] == 0), f"seq {b}"
            continue
        one = [t[None, s] for t, s in ((q, sq), (k, sk), (v, sk), (dout, sq))]
        portable = variant_grads(*one, seq_kwargs, sinks, False, monkeypatch)
        exact = exact_variant_grads(*one, seq_kwargs, sinks)
        assert_variant_grads((dq[None, sq], dk[None, sk], dv[None, sk]), portable[:3], exact[:3], dtype,
                             f"{name}, seq {b}: ")
        if sinks is not None:
            dsink_exact += exact[3]
    if sinks is not None:
        portable = variant_grads(q, k, v, dout, kwargs, sinks, False, monkeypatch, varlen=varlen)
        assert_close_to_exact(ours[3], portable[3], dsink_exact, torch.float32, f"{name}: dsink")


# ----------------------------------------------------------------------------------------------------------------
# The Triton backward with the preprocess in its dQ kernel (configs.backward.TRITON_BWD_FUSED_DELTA): runs everywhere
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["plain", "causal", "window_both", "causal_window_softcap_alibi_sinks", "sinks"])
@pytest.mark.parametrize("packed", [False, True])
def test_triton_backward_fused_delta_against_float64(name, packed, device, monkeypatch):
    """The Triton dQ kernel doing the preprocess' work (delta, the sink's gradient's parts; dQ first, then dK/dV):
    the gradients against float64 and within a few ulps of the preprocess kernel's path, dense and packed (empty
    sequences, one token, Sq != Sk, GQA), and the preprocess kernel not launched."""
    spec = {"plain": {}, "causal": dict(causal=True), **GLUON_VARIANTS}[name]
    lengths_q, lengths_k = ([3, 0, 1, 70, 33], [9, 4, 1, 50, 0]) if packed else ([65], [80])
    batch, heads_q, heads_kv, head_dim, dtype = len(lengths_q), 4, 2, 48, torch.float16
    q, k, v, dout, cu_q, cu_k = packed_inputs(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, device, 5)
    kwargs, sinks = _variant_inputs(spec, batch, heads_q, device, seed=2)
    varlen = (cu_q, cu_k, max(lengths_q), max(lengths_k)) if packed else None
    if not packed:
        q, k, v, dout = (t[None] for t in (q, k, v, dout))
    launched = []
    real_plan = B._preprocess_plan

    def recording_plan(*args, **kw):
        plan = real_plan(*args, **kw)
        run = plan.launch
        plan.launch = lambda *a: (launched.append("preprocess"), run(*a))
        return plan

    monkeypatch.setattr(B, "_preprocess_plan", recording_plan)
    monkeypatch.setattr(B, "_PLANS", {})
    monkeypatch.setattr(configs.backward, "TRITON_BWD_FUSED_DELTA", False)
    unfused = variant_grads(q, k, v, dout, kwargs, sinks, False, monkeypatch, varlen=varlen)
    assert launched == ["preprocess"]
    monkeypatch.setattr(configs.backward, "TRITON_BWD_FUSED_DELTA", True)
    fused = variant_grads(q, k, v, dout, kwargs, sinks, False, monkeypatch, varlen=varlen)
    assert launched == ["preprocess"]  # not launched again
    assert any(plan.fused == 1 + 4 * (sinks is not None) for plan in B._PLANS.values())
    for a, b in zip(fused, unfused):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-3, rtol=2e-3)
    if packed:  # per sequence against float64, dsink over all of them
        dsink_exact = torch.zeros(heads_q, dtype=torch.float64, device=device)
        for b, sq, sk, seq_kwargs in sequences(cu_q, cu_k, kwargs):
            if lengths_q[b] == 0 or lengths_k[b] == 0:
                continue
            one = [t[None, s] for t, s in ((q, sq), (k, sk), (v, sk), (dout, sq))]
            exact = exact_variant_grads(*one, seq_kwargs, sinks)
            mine = (fused[0][None, sq], fused[1][None, sk], fused[2][None, sk])
            theirs = (unfused[0][None, sq], unfused[1][None, sk], unfused[2][None, sk])  # the preprocess kernel's
            assert_variant_grads(mine, theirs, exact[:3], dtype, f"{name}, seq {b}: ")
            if sinks is not None:
                dsink_exact += exact[3]
        if sinks is not None:
            assert_close_to_exact(fused[3], unfused[3], dsink_exact, torch.float32, f"{name}: dsink")
    else:
        exact = exact_variant_grads(q, k, v, dout, kwargs, sinks)
        assert_variant_grads(fused, unfused, exact, dtype, f"{name}: ")


def test_triton_fused_dq_compiles_for_sm80_and_sm90_without_a_gpu():
    """The Triton dQ kernel with the preprocess' work (FUSED bits 1, 3, 5, 7: dlse, the sink's parts), dense and
    packed, compiles for sm_80 and sm_90 (the interpreter runs it in the tests above; the GPU compiles it). In a
    fresh process, as the Gluon builds."""
    script = (
        "import sys, triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "from flashtriton.kernels import backward\n"
        "fn = backward._attn_bwd_dq\n"
        "POINTERS = {'Q', 'K', 'V', 'O', 'DO', 'DQ'}\n"
        "for cap in (80, 90):\n"
        "    for fused, varlen in ((1, False), (3, True), (5, False), (7, True)):\n"
        "        c = dict(HEAD_DIM=80, BLOCK_D=128, HEAD_DIM_V=80, BLOCK_DV=128, IS_CAUSAL=True,\n"
        "                 CAUSAL_BOTTOM_RIGHT=True, IS_VARLEN=varlen, UPCAST_DOT=False, DOT_PRECISION='tf32',\n"
        "                 BLOCK_M=64, BLOCK_N=64, HAS_WINDOW=False, HAS_SOFTCAP=False, HAS_ALIBI=False,\n"
        "                 HAS_DROPOUT=False, ACCUMULATE=False, FUSED=fused)\n"
        "        c.update(dict.fromkeys(['window_left', 'window_right', 'softcap', 'ALIBI', 'stride_alibi_b',\n"
        "                                'DROPOUT_RNG', 'dropout_threshold', 'dropout_scale']))\n"
        "        if not fused & 2:\n"
        "            c.update(dict.fromkeys(['DLSE', 'stride_db', 'stride_dh', 'stride_dm']))\n"
        "        if not fused & 4:\n"
        "            c.update(dict.fromkeys(['SINK', 'SINK_PART']))\n"
        "        sig = {n: 'constexpr' if n in c else '*fp16' if n in POINTERS else '*i32' if n.startswith('CU_')\n"
        "               else '*fp32' if n in ('LSE', 'DELTA', 'DLSE', 'SINK', 'SINK_PART')\n"
        "               else 'fp32' if n in ('softmax_scale', 'qk_scale') else 'i32' for n in fn.arg_names}\n"
        "        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=c), target=GPUTarget('cuda', cap, 32),\n"
        "                           options=dict(num_warps=4, num_stages=2))\n"
        "        assert 'st.global' in k.asm['ptx']\n"
        "        print('compiled', cap, fused, varlen)\n"
    )
    out = compile_in_fresh_process(script)
    assert out.count("compiled") == 8, out


@pytest.mark.parametrize("causal", [False, True])
def test_triton_backward_fused_delta_with_the_lse_gradient(causal, device, monkeypatch):
    """lse differentiated (dlse subtracted from delta in the dQ kernel), dense and packed, against the preprocess
    kernel's path; rows that see no key (Sq > Sk causal) keep their delta."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 23, 4, 32, generator=gen).to(device=device, dtype=torch.float16)
    k, v = (torch.randn(2, 7, 2, 32, generator=gen).to(device=device, dtype=torch.float16) for _ in range(2))
    w = torch.randn(q.shape, generator=gen).to(device=device, dtype=torch.float16)
    u = torch.randn(2, 4, 23, generator=gen).to(device)

    def grads():
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, lse, _ = flashtriton.flash_attn_func(*leaves, causal=causal, return_attn_probs=True)
        dense = torch.autograd.grad((out, lse), leaves, (w, u))
        leaves = [t.detach().clone().flatten(0, 1).requires_grad_() for t in (q, k, v)]
        cu_q = torch.tensor([0, 23, 46], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, 7, 14], dtype=torch.int32, device=device)
        out, lse, _ = flashtriton.flash_attn_varlen_func(*leaves, cu_q, cu_k, 23, 7, causal=causal,
                                                         return_attn_probs=True)
        packed = torch.autograd.grad((out, lse), leaves, (w.flatten(0, 1), u.transpose(0, 1).flatten(1)))
        return dense + packed

    monkeypatch.setattr(dispatch, "CHOICE", dispatch.Choice(gluon_bwd=False))
    monkeypatch.setattr(configs.backward, "TRITON_BWD_FUSED_DELTA", False)
    unfused = grads()
    monkeypatch.setattr(configs.backward, "TRITON_BWD_FUSED_DELTA", True)
    fused = grads()
    for a, b in zip(fused, unfused):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.float(), b.float(), atol=2e-3, rtol=2e-3)


def sink_grad_reference(lse, delta, sink, varlen: bool) -> torch.Tensor:
    """dsink_h = -Σ_{b,i} exp(sink_h - lse) · delta over lse and delta (B, Hq, Sq) or (Hq, total_q), in torch; rows of
    lse -inf add nothing."""
    logits = sink.float()[:, None] if varlen else sink.float()[None, :, None]
    p_sink = torch.where(torch.isinf(lse), 0.0, torch.exp(logits - lse))
    return (-(p_sink * delta).sum(dim=1 if varlen else (0, 2))).to(sink.dtype)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("with_dlse", [False, True])
def test_preprocess_sink_gradient(device, padded, with_dlse):
    """The preprocess' sink gradient (its per-tile parts, summed) against `sink_grad_reference` on the unpadded
    layout, varlen with tokens before, between (an empty sequence) and after the sequences, in both layouts
    (padded: the Gluon kernels'), and with dlse; and dense. Runs everywhere (the preprocess is Triton)."""
    gen = torch.Generator().manual_seed(2)
    lengths, lead, tail = [5, 0, 1, 70, 3, 8], 6, 9
    cu = torch.tensor([lead] + (lead + torch.tensor(lengths).cumsum(0)).tolist(), dtype=torch.int32, device=device)
    total = lead + sum(lengths) + tail
    out, dout = (torch.randn(total, 3, 64, generator=gen).to(device, torch.float16) for _ in range(2))
    lse = torch.randn(3, total, generator=gen).to(device)
    lse[1, lead + 7] = float("-inf")  # a row that sees nothing (and a sink of -inf): adds 0
    dlse = torch.randn(3, total, generator=gen).to(device) if with_dlse else None
    sink = torch.randn(3, generator=gen).to(device, torch.bfloat16)
    _, delta_ref, none = B.preprocess(out, dout, lse, cu, max(lengths), dlse=dlse)
    assert none is None
    _, _, dsink = B.preprocess(out, dout, lse, cu, max(lengths), padded=padded, dlse=dlse, sink=sink)
    inside = torch.zeros(total, dtype=torch.bool, device=device)
    inside[lead:lead + sum(lengths)] = True
    expected = sink_grad_reference(torch.where(inside, lse, float("-inf")), torch.where(inside, delta_ref, 0.0), sink,
                                   True)
    assert dsink.dtype == sink.dtype and dsink.shape == (3,)
    torch.testing.assert_close(dsink.float(), expected.float(), rtol=1e-2, atol=1e-3)
    # dense (B, Sq, H, D), rows past Sq in the padded layout adding nothing
    out_d, dout_d = out[:80].reshape(2, 40, 3, 64), dout[:80].reshape(2, 40, 3, 64)
    lse_d = torch.randn(2, 3, 40, generator=gen).to(device)
    _, delta_d, _ = B.preprocess(out_d, dout_d, lse_d)
    _, _, dsink_d = B.preprocess(out_d, dout_d, lse_d, padded=padded, sink=sink.float())
    torch.testing.assert_close(dsink_d, sink_grad_reference(lse_d, delta_d, sink.float(), False), rtol=1e-5,
                               atol=1e-5)


def test_variant_launch_parts_and_dispatch():
    """The variant's constexprs in the launch (`Variant.score_constexprs`), a dense plan per variant, the window's
    FLOPs in the dispatch's rule, and the `gluon_bwd` row declaring windows, softcap, ALiBi and sinks."""
    dkdv = _DEFAULT["dkdv"]
    shapes = ((3, 1000, 16, 128), (3, 700, 4, 128))
    _, _, plain = BG.launch_parts(*shapes, True, True, dkdv)
    assert not (plain["HAS_WINDOW"] or plain["HAS_SOFTCAP"] or plain["HAS_ALIBI"])
    variant = Variant.of(True, True, (100, 0), 30.0, True, True)
    _, _, meta = BG.launch_parts(*shapes, True, True, dkdv, variant=variant)
    assert meta["HAS_WINDOW"] and meta["HAS_SOFTCAP"] and meta["HAS_ALIBI"] and meta["IS_CAUSAL"]
    causal_only = Variant.of(True, True, (-1, 0))  # a window that restates causal is causal
    assert BG.launch_parts(*shapes, True, True, dkdv, variant=causal_only)[2] == plain
    args = ("dq", *shapes, torch.float16, torch.device("cpu"), True, True, tuple(sorted(_DEFAULT["dq"].items())))
    assert BG._dense_plan(*args, variant) is BG._dense_plan(*args, variant)
    assert BG._dense_plan(*args, variant) is not BG._dense_plan(*args, Variant.of(True, True, (100, 0), 30.0, True))
    assert BG._dense_plan(*args, Variant.of(True, True, (99, 0), 30.0, True, True)).meta == BG._dense_plan(*args, variant).meta

    per_row = B._visible_fwd_flops_per_row(Variant.of(False, True, (100, 50)), 8, 1000, 1000, 128)
    assert per_row * 1000 * 2 == pytest.approx(Variant.of(False, True, (100, 50)).visible_flops(2, 8, 1000, 1000, 128))
    for fields in (variant.fields(), Variant.of(False, True, (7, 3), 2.0, True).fields()):
        assert dispatch.supports("gluon_bwd", torch.bfloat16, 128, 9, True, False, fields)
    # dropout: declared (the config rule takes it where configs.backward.GLUON_BWD_DROPOUT is on)
    assert dispatch.supports("gluon_bwd", torch.bfloat16, 128, 9, False, False, frozenset({"dropout_p"}))


# Bytes of register spill stores (`ptxas -v`, triton 3.6) of variant builds of the Gluon backward, at the dispatch's
# configs: the no-variant kernels' own (8 / 20 bytes at D = 128 dK/dV) plus what each variant adds there (the dK/dV
# kernel at D = 128 holds dK and dV, 128 registers a thread, beside the score tiles). A change that spills more
# fails here before it costs device time.
VARIANT_BUILDS = {
    # (kernel, head dim, causal, varlen, window, softcap, alibi): spill budget
    ("dkdv", 128, True, True, True, True, True): 108,
    ("dkdv", 64, False, False, True, True, True): 0,
    ("dq", 64, False, False, True, True, True): 0,
    ("dq", 128, True, True, True, False, True): 0,
    ("dkdv", 256, True, True, True, True, True): 4,
    ("dq", 256, False, False, True, True, True): 0,
}
# Persistent dK/dV builds (PERSISTENT, off in the dispatch): the items' places and loop state, kept across the tile
# loop, spill (the tile loop itself reloads three values more than the one-item build's). Split dK/dV loops (SPLIT,
# as `configs.backward.GLUON_BWD_SPLIT_CASES` dispatch them): none of their tile loops spills;
# the dQ kernel's (off in the dispatch) spills nothing. The dK/dV kernel's K and V in registers (KV_REGS; bit 4
# takes varlen and the variants too, but never a window) spill nothing.
PERSISTENT_BUILDS = {
    # (kernel, head dim, causal, varlen, window, softcap, alibi, config's overrides): spill budget
    ("dkdv", 128, True, False, True, False, False, "persistent"): 200,
    ("dkdv", 64, True, False, True, False, False, "persistent"): 0,
    ("dkdv", 128, False, False, False, False, False, "persistent"): 108,
    ("dkdv", 128, True, False, True, False, False, "split"): 64,
    ("dkdv", 128, False, False, True, True, False, "split"): 64,
    ("dkdv", 128, True, False, False, True, False, "split"): 44,
    ("dkdv", 64, True, False, False, False, False, "split"): 0,
    ("dq", 128, True, False, True, False, False, "split"): 0,
    ("dq", 128, True, True, False, True, True, "split"): 0,
    ("dq", 64, True, False, False, False, False, "split"): 0,
    # the preprocess in the dQ kernel (FUSED_DELTA's bits: 1 on, 2 dlse, 4 the sink's parts), with the dispatch's
    # split rule where it has one
    ("dq", 128, True, False, False, False, False, "fused1"): 0,
    ("dq", 128, True, False, True, True, True, "fused3"): 0,
    ("dq", 64, False, False, False, False, False, "fused3"): 0,
    ("dq", 128, True, False, False, False, False, "fused5"): 0,
    ("dq", 64, True, False, True, True, True, "fused7"): 0,
    # the dK/dV kernel's K and V in registers (KV_REGS = 7: varlen and the variants too)
    ("dkdv", 64, False, False, False, False, False, "regs"): 0,
    ("dkdv", 64, True, True, False, False, False, "regs"): 0,
    ("dkdv", 64, True, False, True, False, True, "regs"): 0,  # (a window: K and V stay in shared memory)
}


def test_gluon_backward_variants_compile_for_sm90_without_a_gpu():
    """Variant builds (window, softcap, ALiBi; causal or not, dense or packed, D 64 and 128) compile to sm_90 code on
    any machine, within their spill budgets (triton 3.6's ptxas); the full grid is in the report of the change. In a
    fresh process, as above."""
    script = (
        "import torch\n"
        "from flashtriton import configs\n"
        "from flashtriton.kernels.backward_gluon_launch import compile_for_sm90\n"
        f"for kernel, d, causal, varlen, window, softcap, alibi in {list(VARIANT_BUILDS)!r}:\n"
        "    config = configs.gluon_bwd_config(d, 4096, 4096, causal)[kernel]\n"
        "    compiled = compile_for_sm90(d, causal, config, torch.bfloat16, kernel, varlen,\n"
        "                                window_size=(100, 50) if window else (-1, -1), softcap=30.0 if softcap else 0.0,\n"
        "                                alibi=alibi)\n"
        "    ptx = compiled.asm['ptx']\n"
        "    assert 'wgmma.mma_async' in ptx and 'setmaxnreg' in ptx and compiled.asm['cubin']\n"
        "    spill = spill_bytes(compiled)\n"
        "    print('compiled', kernel, d, causal, varlen, window, softcap, alibi, 'spill', spill)\n"
    )
    assert_within_spill_budgets(compile_in_fresh_process(script), VARIANT_BUILDS)


def test_persistent_and_split_builds_compile_for_sm90_without_a_gpu():
    """The persistent and the split dK/dV builds, the split dQ ones and those that do the preprocess' work compile
    to sm_90 code within their spill budgets. In a fresh process, as above."""
    script = (
        "import torch\n"
        "from flashtriton import configs\n"
        "from flashtriton.kernels.backward_gluon_launch import compile_for_sm90\n"
        "OVERRIDES = {('dkdv', 'persistent'): dict(NUM_STAGES=2, PERSISTENT=True),\n"
        "             ('dkdv', 'split'): dict(NUM_STAGES=2, SPLIT=1), ('dq', 'split'): dict(SPLIT=1),\n"
        "             ('dq', 'fused1'): {}, ('dq', 'fused3'): {}, ('dq', 'fused5'): {}, ('dq', 'fused7'): {},\n"
        "             ('dkdv', 'regs'): dict(KV_REGS=7)}\n"
        f"for kernel, d, causal, varlen, window, softcap, alibi, kind in {list(PERSISTENT_BUILDS)!r}:\n"
        "    config = dict(configs.gluon_bwd_config(d, 4096, 4096, causal)[kernel], **OVERRIDES[kernel, kind])\n"
        "    compiled = compile_for_sm90(d, causal, config, torch.bfloat16, kernel, varlen,\n"
        "                                window_size=(1023, 0) if window else (-1, -1),\n"
        "                                softcap=30.0 if softcap else 0.0, alibi=alibi,\n"
        "                                fused_delta=int(kind[5:]) if kind.startswith('fused') else 0)\n"
        "    ptx = compiled.asm['ptx']\n"
        "    assert 'wgmma.mma_async' in ptx and 'setmaxnreg' in ptx and compiled.asm['cubin']\n"
        "    print('compiled', kernel, d, causal, varlen, window, softcap, alibi, kind, 'spill', spill_bytes(compiled))\n"
    )
    assert_within_spill_budgets(compile_in_fresh_process(script), PERSISTENT_BUILDS)


def assert_within_spill_budgets(out: str, budgets: dict) -> None:
    """Each build `out` reports ("compiled KERNEL D FLAG ... spill BYTES") is one of `budgets`' keys (kernel,
    head dim, flags) and, with triton 3.6 (whose ptxas the budgets come from), spills no more than its budget."""
    import triton

    lines = [line for line in out.splitlines() if line.startswith("compiled")]
    assert len(lines) == len(budgets), out
    for line in lines:
        _, kernel, d, *flags, _, spill = line.split()
        key = (kernel, int(d), *(f == "True" if f in ("True", "False") else f for f in flags))
        assert key in budgets, line
        if triton.__version__.startswith("3.6"):
            assert int(spill) <= budgets[key], f"{line}: more spills than {budgets[key]} bytes"


@pytest.mark.parametrize("variant", [Variant.of(True, True), Variant.of(False, True, (100, 20), 30.0, True, True)])
def test_dense_launches_share_descriptors(variant, monkeypatch):
    """`launch_dense` (what a dense call's kept plan runs) launches both kernels with the arguments
    `launch_dkdv_gluon` and `launch_dq_gluon` give them, one Q and one dO descriptor serving both. On the CPU: the
    launches are recorded, not run."""
    def launches(run):
        seen = []
        monkeypatch.setattr(BG, "_launch", lambda fn, plan, grid, args, meta: seen.append((fn, plan, grid, args, meta)))
        run()
        return seen

    def same(a, b):
        if isinstance(a, BG.TensorDescriptor):
            return (a.base.data_ptr() == b.base.data_ptr() and (a.shape, a.strides, a.block_shape, a.layout, a.padding)
                    == (b.shape, b.strides, b.block_shape, b.layout, b.padding))
        return a is b if isinstance(a, torch.Tensor) else a == b

    q, dout = torch.empty(2, 300, 8, 128, dtype=torch.bfloat16), torch.empty(2, 300, 8, 128, dtype=torch.bfloat16)
    k, v = torch.empty(2, 200, 2, 128, dtype=torch.bfloat16), torch.empty(2, 200, 2, 128, dtype=torch.bfloat16)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    lse, delta = torch.empty(2, 8, BG.padded_rows(300, False)), torch.empty(2, 8, BG.padded_rows(300, False))
    alibi = torch.rand(8) if variant.alibi_slopes is not None else None
    config = configs.gluon_bwd_config(128, 4096, 4096, variant.causal)
    plan = BG.DenseBackward(q, k, variant, config, 0.1, alibi)
    ours = launches(lambda: BG.launch_dense(plan, q, k, v, dout, dq, dk, dv, lse, delta, 0.1, alibi))
    window, cap = variant.window, variant.softcap
    theirs = launches(lambda: (
        BG.launch_dkdv_gluon(q, k, v, dout, dk, dv, lse, delta, 0.1, variant.causal, True, config["dkdv"],
                             window_size=window, softcap=cap, alibi_slopes=alibi),
        BG.launch_dq_gluon(q, k, v, dout, dq, lse, delta, 0.1, variant.causal, True, config["dq"],
                           window_size=window, softcap=cap, alibi_slopes=alibi)))
    assert [x[0] for x in ours] == [BG._attn_bwd_dkdv_gluon, BG._attn_bwd_dq_gluon] == [x[0] for x in theirs]
    for (_, plan_a, grid_a, args_a, meta_a), (_, plan_b, grid_b, args_b, meta_b) in zip(ours, theirs):
        assert plan_a is plan_b and grid_a == grid_b and meta_a == meta_b and len(args_a) == len(args_b)
        assert all(same(a, b) for a, b in zip(args_a, args_b))
    assert ours[0][3][0] is ours[1][3][0] and ours[0][3][3] is ours[1][3][3]  # the Q and dO descriptors, shared
    # the preprocess in the dQ kernel (FUSED_DELTA's bits: dlse, the sink's parts): dQ first, with the forward's out,
    # lse, dlse, sinks and the parts' buffer
    out, lse_in, dlse = torch.empty_like(dout), torch.empty(2, 8, 300), torch.empty(2, 300, 8).transpose(1, 2)
    sink, part = torch.empty(8), torch.empty(BG.sink_parts_shape(q.shape))
    assert part.shape == (2, 8, 6)  # (batch, heads, a part per 64 query rows: 300 rows in 3 programs of 128)
    for fused, grad_lse, sinks in ((BG.FD_ON, None, None), (BG.FD_ON | BG.FD_DLSE, dlse, None),
                                   (BG.FD_ON | BG.FD_SINK, None, sink), (7, dlse, sink)):
        plan = BG.DenseBackward(q, k, variant, config, 0.1, alibi, fused=fused)
        parts = None if sinks is None else part
        seen = launches(lambda: BG.launch_dense(plan, q, k, v, dout, dq, dk, dv, lse, delta, 0.1, alibi, None, out,
                                                lse_in, grad_lse, sinks, parts))
        assert [x[0] for x in seen] == [BG._attn_bwd_dq_gluon, BG._attn_bwd_dkdv_gluon]
        (_, _, grid_q, args_q, meta_q), (_, _, grid_kv, args_kv, meta_kv) = seen
        assert meta_q == dict(theirs[1][4], FUSED_DELTA=fused, DV_OUT=128) and (grid_kv, meta_kv) == theirs[0][2::2]
        assert all(same(a, b) for a, b in zip(args_kv, theirs[0][3]))
        assert all(same(a, b) for a, b in zip(args_q[:-13], theirs[1][3][:-13]))
        assert theirs[1][3][-13:] == (None,) * 13  # unfused: the kernel's FUSED_DELTA arguments off
        d_s = (None,) * 3 if grad_lse is None else grad_lse.stride()
        assert args_q[-13] is out and args_q[-12] is lse_in and args_q[-11] is grad_lse
        assert args_q[-10:-2] == (*out.stride()[:3], *lse_in.stride()[:2], *d_s)
        assert args_q[-2] is sinks and args_q[-1] is parts


# ----------------------------------------------------------------------------------------------------------------
# V with a head dim of its own (DeepSeek's MLA: QK 192, V 128): V, dO and dV in tiles of V's width
# ----------------------------------------------------------------------------------------------------------------
SEPARATE_V_PAIRS = [(192, 128), (128, 64), (64, 128), (256, 128), (96, 64)]


def _separate_v_inputs(shape, head_dim, head_dim_v, dtype, device, seed):
    """q, k (B, S, H, D), v (B, Sk, Hkv, Dv) and dout (B, Sq, Hq, Dv) of a (B, Sq, Sk, Hq, Hkv) shape."""
    batch, seqlen_q, seqlen_k, heads_q, heads_kv = shape
    q, k, _, _ = make_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, device, seed=seed)
    _, _, v, dout = make_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim_v, dtype, device, seed=seed + 1)
    return q, k, v, dout


@hopper_only
@pytest.mark.parametrize("name", ["plain", "causal", "causal_window_softcap_alibi_sinks", "window_both"])
@pytest.mark.parametrize("head_dim,head_dim_v", SEPARATE_V_PAIRS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_backward_separate_v_against_float64(name, head_dim, head_dim_v, dtype, device, monkeypatch):
    """QK and V of different head dims through the Gluon kernels (the pair's config: `configs.gluon_bwd_config` with
    head_dim_v), with variants: within 2x the portable kernels' error against float64, dv shaped like v."""
    spec = {"plain": {}, "causal": dict(causal=True), **GLUON_VARIANTS}[name]
    config = configs.gluon_bwd_config(head_dim, 4096, 4096, spec.get("causal", False), head_dim_v=head_dim_v)
    assert config is not None
    for shape in VARIANT_SHAPES:
        q, k, v, dout = _separate_v_inputs(shape, head_dim, head_dim_v, dtype, device, shape[1])
        kwargs, sinks = _variant_inputs(spec, shape[0], shape[3], device, seed=shape[2])
        ours = variant_grads(q, k, v, dout, kwargs, sinks, True, monkeypatch, config=config)
        portable = variant_grads(q, k, v, dout, kwargs, sinks, False, monkeypatch)
        exact = exact_variant_grads(q, k, v, dout, kwargs, sinks)
        assert_variant_grads(ours, portable, exact, dtype, f"({head_dim}, {head_dim_v}) {name}, shape {shape}: ")


def test_separate_v_pairs_and_their_configs():
    """Which (QK, V) head dim pairs the Gluon backward takes, and the config each gets: the pairs of tile widths the
    H200 has run against float64 (`configs.GLUON_BWD_SEPARATE_V`: every pair of SEPARATE_V_PAIRS), QK 192 / V 128
    with dQ by 64-key tiles; others (V wider than 128 beside narrower QK tiles, tile pairs not run there, equal tile
    widths with other head dims, head dims no Gluon kernel takes) None: the Triton kernels."""
    for head_dim, head_dim_v in SEPARATE_V_PAIRS:
        assert BG.separate_v_ok(head_dim, head_dim_v)
        for causal in (False, True):
            config = configs.gluon_bwd_config(head_dim, 4096, 4096, causal, head_dim_v=head_dim_v)
            wider = max(BG.head_block(head_dim), BG.head_block(head_dim_v))
            if wider == 256:
                assert config == {"dkdv": configs.GLUON_BWD_D256["dkdv"],
                                  "dq": dict(BLOCK_N=64, NUM_STAGES=2, CONSUMER_REGS=240)}
            else:
                # the wider tiles' table row (the split rules take calls whose V has QK's head dim)
                assert config == configs.GLUON_BWD.lookup(configs.table.SM90, "16", wider), (head_dim, head_dim_v)
            for kernel in ("dkdv", "dq"):
                assert BG.shared_memory_bytes(config[kernel], BG.head_block(head_dim), kernel, 2,
                                              BG.head_block(head_dim_v)) <= BG.SHARED_MEMORY_LIMIT
                _, _, meta = BG.launch_parts((2, 300, 8, head_dim), (2, 300, 2, head_dim), causal, True,
                                             config[kernel], kernel, head_dim_v=head_dim_v)
                assert meta.get("DV_VALID") == (head_dim_v if kernel == "dkdv" else None)
    for head_dim, head_dim_v in ((64, 256), (128, 192), (96, 256), (256, 64), (112, 80), (192, 256), (192, 72)):
        assert not BG.separate_v_ok(head_dim, head_dim_v)
        assert configs.gluon_bwd_config(head_dim, 4096, 4096, True, head_dim_v=head_dim_v) is None
        with pytest.raises(ValueError, match="V head dim"):
            BG.launch_parts((2, 300, 8, head_dim), (2, 300, 2, head_dim), True, True,
                            configs.GLUON_BWD_D256["dkdv"], "dkdv", head_dim_v=head_dim_v)
    # QK 192 / V 128 at D=256's dK/dV config: K 64 x 256 and V 64 x 128 resident, per stage Q 64 x 256, dO 64 x 128
    assert BG.shared_memory_bytes(dict(NUM_STAGES=2), 256, "dkdv", 2, 128) == 64 * 384 * 2 + 2 * 64 * (384 * 2 + 8)
    assert dispatch.supports("gluon_bwd", torch.bfloat16, 192, 9, False, False, frozenset({"causal"}), True)


def test_gluon_backward_separate_v_compiles_for_sm90_without_a_gpu():
    """QK 192 / V 128 (both kernels, dense and varlen) and QK 128 / V 64 compile to sm_90 without spills (triton 3.6's
    ptxas): V, dO and dV take tiles of V's width."""
    script = (
        "from flashtriton import configs\n"
        "from flashtriton.kernels.backward_gluon_launch import compile_for_sm90\n"
        "for head_dim, head_dim_v, causal, varlen in ((192, 128, True, False), (192, 128, False, True),\n"
        "                                             (128, 64, True, False)):\n"
        "    config = configs.gluon_bwd_config(head_dim, 4096, 4096, causal, head_dim_v=head_dim_v)\n"
        "    for kernel in ('dkdv', 'dq'):\n"
        "        compiled = compile_for_sm90(head_dim, causal, config[kernel], kernel=kernel, varlen=varlen,\n"
        "                                    head_dim_v=head_dim_v)\n"
        "        spill = spill_bytes(compiled)\n"
        "        print('compiled', kernel, head_dim, head_dim_v, varlen, 'spill', spill)\n"
    )
    out = compile_in_fresh_process(script)
    assert out.count("compiled") == 6
    import triton

    if triton.__version__.startswith("3.6"):
        for line in out.splitlines():
            if line.startswith("compiled"):
                assert line.split()[-1] == "0", f"{line}: spills"


# Dropout builds (kernel, head dim, causal, varlen) -> the most bytes of spill stores triton 3.6's ptxas may give
# them (benchmarks/2026-12-07-cpu/dropout-builds/after.txt).
DROPOUT_BUILDS = {("dkdv", 64, False, False): 0, ("dkdv", 64, True, False): 0, ("dq", 64, True, True): 0,
                  ("dq", 128, False, False): 0, ("dkdv", 128, False, False): 88, ("dkdv", 128, True, False): 116}


def test_gluon_backward_dropout_builds_compile_for_sm90():
    """The dropout builds (the forward's keep-mask regenerated in both kernels, `gluon_common.dropout_tile` and the
    transposed `dropout_tile_t`) compile offline within their spill budgets (in a fresh process, as above), with
    as many barriers as the builds without dropout (the transposed mask crosses lanes by shuffles, not through
    shared memory behind a warpgroup barrier); tiles of 256 columns have no dropout rule."""
    script = (
        "import torch\n"
        "from flashtriton import configs\n"
        "from flashtriton.configs import backward as configs_backward\n"
        "from flashtriton.kernels.backward_gluon_launch import compile_for_sm90\n"
        "configs_backward.GLUON_BWD_DROPOUT = configs_backward.GLUON_BWD_DROPOUT_ALL = True\n"
        "assert configs.gluon_bwd_config(256, 4096, 4096, True, dropout=True) is None\n"
        f"for kernel, d, causal, varlen in {list(DROPOUT_BUILDS)!r}:\n"
        "    config = configs.gluon_bwd_config(d, 4096, 4096, causal, varlen=varlen, dropout=True)[kernel]\n"
        "    compiled = compile_for_sm90(d, causal, config, torch.bfloat16, kernel, varlen, dropout_p=0.1)\n"
        "    ptx = compiled.asm['ptx']\n"
        "    assert 'wgmma.mma_async' in ptx and 'mul.wide.u32' in ptx and compiled.asm['cubin']\n"
        "    plain = compile_for_sm90(d, causal, config, torch.bfloat16, kernel, varlen).asm['ptx']\n"
        "    assert ptx.count('bar.sync') == plain.count('bar.sync'), (kernel, d, causal, varlen)\n"
        "    print('compiled', kernel, d, causal, varlen, 'spill', spill_bytes(compiled))\n"
    )
    assert_within_spill_budgets(compile_in_fresh_process(script), DROPOUT_BUILDS)
