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
from flashtriton.kernels.forward import attention_forward

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
    """The names of the Gluon backward launchers called from now on, in order."""
    ran = []
    for name in ("launch_dkdv_gluon", "launch_dq_gluon"):
        real = getattr(BG, name)
        monkeypatch.setattr(BG, name, lambda *a, real=real, name=name, **kw: (ran.append(name), real(*a, **kw))[1])
    return ran


def backward(q, k, v, dout, causal, bottom_right, use_gluon, monkeypatch, softmax_scale=None, config=None):
    """(dq, dk, dv) of the forward + `attention_backward`, with the Gluon kernels on (under `config`, else the
    dispatch's config for the head dim, whatever the size of the problem) or off; asserts that the kernels asked
    for are the ones that ran."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out, lse = attention_forward(q, k, v, scale, causal, bottom_right)
    monkeypatch.setattr(dispatch, "CHOICE", dispatch.Choice(gluon_bwd=use_gluon))
    if use_gluon:
        config = config or configs.gluon_bwd_config(q.shape[-1], 4096, 4096, causal)
        monkeypatch.setattr(configs, "gluon_bwd_config", lambda *a: config)
    ran = record_gluon_launches(monkeypatch)
    grads = B.attention_backward(dout, q, k, v, out, lse, scale, causal, bottom_right)
    expected = []
    if use_gluon:
        expected = ["launch_dkdv_gluon"] + (["launch_dq_gluon"] if config["dq"] is not None else [])
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
}


@hopper_only
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("causal,bottom_right", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("head_dim,dtype", [(128, torch.float16), (64, torch.bfloat16), (128, torch.bfloat16)])
def test_gluon_backward_against_float64(name, causal, bottom_right, head_dim, dtype, device, monkeypatch):
    for shape in SHAPES:
        q, k, v, dout = make_qkv(*shape, head_dim, dtype, device)
        ours = backward(q, k, v, dout, causal, bottom_right, True, monkeypatch, config=CONFIGS[name])
        check_grads(ours, q, k, v, dout, causal, bottom_right, what=f"{name}, shape {shape}: ")


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
    lse_pad, delta = B.preprocess(out, dout, lse, padded=True)
    assert lse_pad.shape == delta.shape == (2, 3, 128)
    torch.testing.assert_close(lse_pad[..., :70], lse, rtol=0, atol=0)
    torch.testing.assert_close(delta[..., :70], delta_ref, rtol=1e-5, atol=1e-5)
    assert torch.all(lse_pad[..., 70:] == float("-inf")) and torch.all(delta[..., 70:] == 0)
    same_lse, plain = B.preprocess(out, dout, lse)  # the Triton kernels' layout: delta like lse
    assert same_lse is lse and plain.shape == lse.shape
    torch.testing.assert_close(plain, delta_ref, rtol=1e-5, atol=1e-5)

    lengths = [5, 0, 1, 70, 3, 8]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    total = sum(lengths)
    out, dout, lse = rand(total, 3, 64), rand(total, 3, 64), rand(3, total, dt=torch.float32)
    delta_ref = (out.float() * dout.float()).sum(-1).t()  # (H, total)
    lse_pad, delta = B.preprocess(out, dout, lse, cu, max(lengths), padded=True)
    assert lse_pad.shape == delta.shape == (3, BG.padded_rows(total, True, len(lengths)))
    end = 0
    for b, n in enumerate(lengths):
        start = 4 * (-(-int(cu[b]) // 4) + b)  # backward_gluon._lse_rows
        assert start % 4 == 0 and start >= end, b
        end = start + n
        torch.testing.assert_close(lse_pad[:, start:end], lse[:, cu[b]:cu[b + 1]], rtol=0, atol=0)
        torch.testing.assert_close(delta[:, start:end], delta_ref[:, cu[b]:cu[b + 1]], rtol=1e-5, atol=1e-5)
    assert end + 128 <= lse_pad.shape[1]  # the last tile of the last sequence stays inside


def test_dispatch_config():
    for head_dim in (64, 128):
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
    assert [standard(128, t, False) for t in (512, 1024)] == [True, True]
    assert [standard(128, t, True) for t in (512, 1024)] == [False, True]
    assert [standard(64, t, False) for t in (512, 1024)] == [False, True]
    assert [standard(64, t, True) for t in (512, 1024)] == [False, True]
    assert configs.gluon_bwd_config(128, 4096, 4096, False, varlen=True) == configs.gluon_bwd_config(128, 4096, 4096, False)
    assert configs.gluon_bwd_config(256, 4096, 4096, False) is None
    assert configs.gluon_bwd_config(96, 4096, 4096, False) is None


@hopper_only
def test_dispatch_takes_the_gluon_kernels_for_large_problems_only(device, monkeypatch):
    ran = record_gluon_launches(monkeypatch)
    for seqlen, expected in ((64, []), (4096, ["launch_dkdv_gluon", "launch_dq_gluon"])):
        q, k, v, dout = make_qkv(4, seqlen, seqlen, 16, 16, 128, torch.bfloat16, device)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        flashtriton.flash_attn_func(*leaves, causal=False).backward(dout)
        assert ran == expected, seqlen
        ran.clear()


@hopper_only
@pytest.mark.parametrize("order", ["dispatch", "as_given", "largest_first", "grid"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gluon_backward_varlen(causal, head_dim, order, device, monkeypatch):
    """Packed sequences (empty ones, one token, Sq != Sk, GQA) with rows of other data before and after them:
    per-sequence gradients against float64, and the rows outside every sequence left alone. Programs from the work
    table in either order, and from the grid over the longest sequence's blocks."""
    from test_varlen import pack

    if order != "dispatch":
        monkeypatch.setitem(configs.VARLEN_BWD_ORDER, causal, order)

    lengths_q, lengths_k = [5, 0, 1, 200, 33, 130, 64], [9, 4, 1, 150, 20, 0, 64]
    gen = torch.Generator().manual_seed(11)
    dtype = torch.float16
    q, cu_q = pack(lengths_q, 4, head_dim, dtype, device, gen)
    k, cu_k = pack(lengths_k, 2, head_dim, dtype, device, gen)
    v, _ = pack(lengths_k, 2, head_dim, dtype, device, gen)
    dout, _ = pack(lengths_q, 4, head_dim, dtype, device, gen)
    config = _DEFAULT if head_dim == 128 else {"dkdv": dict(NUM_STAGES=2, CONSUMER_REGS=240),
                                               "dq": dict(BLOCK_N=128, NUM_STAGES=2, CONSUMER_REGS=240)}
    monkeypatch.setattr(configs, "gluon_bwd_config", lambda *a: config)
    ran = record_gluon_launches(monkeypatch)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = flashtriton.flash_attn_varlen_func(*leaves, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal)
    out.backward(dout)
    assert ran == ["launch_dkdv_gluon", "launch_dq_gluon"]
    dq, dk, dv = (t.grad for t in leaves)
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
    monkeypatch.setattr(configs, "gluon_bwd_config", lambda *a: _DEFAULT)
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
    # dK/dV at D = 128, 2 stages: K and V of 128 keys (64 KB), per stage Q, dO (32 KB) and lse, delta (512 B)
    assert BG.shared_memory_bytes(dict(NUM_STAGES=2), 128) == 65536 + 2 * 33280


def test_gluon_backward_compiles_for_sm90_without_a_gpu():
    """What the dispatch launches compiles to sm_90 code on any machine (CI has no GPU). In a fresh process: this
    one runs the kernels through the interpreter, which cannot compile Gluon."""
    script = (
        "import torch\n"
        "from flashtriton import configs\n"
        "from flashtriton.kernels.backward_gluon_launch import compile_for_sm90\n"
        "for head_dim, causal, dtype in ((128, False, torch.float16), (128, True, torch.bfloat16),\n"
        "                                (64, False, torch.bfloat16), (64, True, torch.float16)):\n"
        "    config = configs.gluon_bwd_config(head_dim, 4096, 4096, causal)\n"
        "    for kernel in ('dkdv', 'dq'):\n"
        "        compiled = compile_for_sm90(head_dim, causal, config[kernel], dtype, kernel, varlen=causal)\n"
        "        ptx = compiled.asm['ptx']\n"
        "        assert 'wgmma.mma_async' in ptx and 'setmaxnreg' in ptx and compiled.asm['cubin'], head_dim\n"
        "        print('compiled', kernel, head_dim, causal, compiled.metadata.shared)\n"
    )
    assert compile_in_fresh_process(script).count("compiled") == 8
