"""FlashAttention-2 backward, the host side: `attention_backward` (the plan per call signature, the dispatch
between the portable Triton kernels of `backward_kernels` and Hopper's Gluon kernels) and `preprocess`. The math,
the three kernels and their masks: `backward_kernels`' docstring.

On sm_90, `attention_backward` gives the dK/dV and dQ kernels' work to Hopper's Gluon kernels (`backward_gluon`)
where `configs.gluon_bwd_config` says so (dense and varlen fp16/bf16, the head dims of `configs.GLUON_BWD_HEAD_DIMS`
and the V head dims `backward_gluon_launch.separate_v_ok` pairs with them, enough work to hide their host time); lse
and delta then come padded to whole tiles, from the preprocess, or in a dense call without a sink from the Gluon dQ
kernel itself, launched first (`configs.backward.GLUON_BWD_FUSED_DELTA`).
"""

from __future__ import annotations

import functools

import torch
import triton

from .. import configs
from .._env import INTERPRET
from .backward_kernels import FUSED_DLSE, FUSED_ON, FUSED_SINK, _attn_bwd_dkdv, _attn_bwd_dq, _attn_bwd_preprocess
from .common import dot_settings, tma_ok
from . import dispatch
from .host import cdiv, padded_head_dim
from .launch import KeptLaunch
from .variant import Variant, alibi_batch_stride

try:  # Hopper's Gluon dK/dV kernel (triton >= 3.6 ships Gluon's Hopper API)
    from . import backward_gluon_launch
except ImportError:  # pragma: no cover
    backward_gluon_launch = None

PREPROCESS_BLOCK_M = 64
_NOT_FUSED = (None,) * 11  # `_attn_bwd_dq`'s FUSED arguments, off


_attn_bwd_dkdv_tuned = triton.autotune(
    configs=configs.BWD_DKDV_CONFIGS,
    key=configs.BWD_AUTOTUNE_KEY,
    prune_configs_by={"early_config_prune": configs.prune_bwd_dkdv_configs},
    cache_results=True,
)(_attn_bwd_dkdv)

_attn_bwd_dq_tuned = triton.autotune(
    configs=configs.BWD_DQ_CONFIGS,
    key=configs.BWD_AUTOTUNE_KEY,
    prune_configs_by={"early_config_prune": configs.prune_bwd_dq_configs},
    cache_results=True,
)(_attn_bwd_dq)


class _PreprocessPlan:
    """The preprocess launch of one call signature: its grid, int arguments (strides, seqlen_q), what it writes
    (lse / delta like lse, or padded to `lse_shape`; either with `lse_strides`; the sink's per-program parts,
    `part_shape`) and the launch."""

    __slots__ = ("grid", "ints", "lse_shape", "lse_strides", "part_shape", "launch")


def _preprocess_plan(out, dout, lse, cu_seqlens_q, max_seqlen_q, padded, dlse, sink, keep=False) -> _PreprocessPlan:
    """The preprocess of these tensors (`preprocess` says what each is); `keep`: the plan is kept for later calls
    of the same signature, which relaunch its compiled kernel (`KeptLaunch`)."""
    varlen = cu_seqlens_q is not None
    heads_q, head_dim = out.shape[-2], out.shape[-1]
    if varlen:
        batch, seqlen_q = cu_seqlens_q.numel() - 1, max_seqlen_q
        o_s, do_s, l_s = (0, *out.stride()), (0, *dout.stride()), (0, lse.stride(0))
    else:
        batch, seqlen_q = out.shape[0], out.shape[1]
        o_s, do_s, l_s = out.stride(), dout.stride(), (lse.stride(0), lse.stride(1))
    plan = _PreprocessPlan()
    rows, plan.lse_shape, p_s = seqlen_q, None, l_s
    if padded:  # fresh, contiguous (*lse.shape[:-1], n_pad) buffers
        n_pad = backward_gluon_launch.padded_rows(out.shape[0] if varlen else seqlen_q, varlen, batch)
        plan.lse_shape = (*lse.shape[:-1], n_pad)
        p_s = (0, n_pad) if varlen else (heads_q * n_pad, n_pad)
        if not varlen:
            rows = n_pad  # the padding rows are written too
    d_s = (0, 0, 0) if dlse is None else (0, *dlse.stride()) if varlen else dlse.stride()
    plan.grid = (cdiv(rows, PREPROCESS_BLOCK_M), heads_q, batch)
    meta = dict(HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim), IS_VARLEN=varlen, BLOCK_M=PREPROCESS_BLOCK_M,
                PADDED=padded, HAS_DLSE=dlse is not None)
    plan.part_shape = None
    if sink is not None:
        plan.part_shape = (batch, heads_q, plan.grid[0])
        meta.update(HAS_SINK=True)  # (absent otherwise: the kernel's default, and the sink-free calls' launch key)
    plan.ints, plan.lse_strides = (*o_s, *do_s, *l_s, *p_s, *d_s, seqlen_q), p_s
    plan.launch = KeptLaunch(_attn_bwd_preprocess, meta, keep)
    return plan


def _run_preprocess(plan: _PreprocessPlan, out, dout, lse, cu_seqlens_q, dlse, sink):
    """(lse, delta, dsink) of `preprocess`, through its plan."""
    if plan.lse_shape is None:
        lse_out, delta = lse, torch.empty_like(lse)
    else:
        lse_out = torch.empty(plan.lse_shape, dtype=torch.float32, device=out.device)
        delta = torch.empty_like(lse_out)
    part = None if plan.part_shape is None else torch.empty(plan.part_shape, dtype=torch.float32, device=out.device)
    plan.launch(plan.grid, (out, dout, lse, delta, lse_out, cu_seqlens_q, dlse, sink, part, *plan.ints))
    return lse_out, delta, None if part is None else part.sum(dim=(0, 2)).to(sink.dtype)


def preprocess(out, dout, lse, cu_seqlens_q=None, max_seqlen_q=None, padded=False, dlse=None, sink=None):
    """(lse, delta, dsink) for the backward kernels; delta = rowsum(dO ∘ O) in fp32. out, dout (B, Sq, Hq, Dv) with lse
    (B, Hq, Sq), or varlen (total_q, Hq, Dv) with lse (Hq, total_q) and cu_seqlens_q. Not padded: delta like lse,
    lse itself. Padded (the Gluon kernels, which load whole 16-byte aligned tiles): both in
    `backward_gluon_launch.padded_rows`' layout, written by the one preprocess launch (no fill, no copy).
    dlse (shaped like lse, fp32, any strides): the gradient of lse, subtracted from delta in the same launch.
    sink ((Hq,), the forward's learnable_sink): dsink, its gradient in its dtype, from the same launch's per-tile
    parts and one torch sum over them (None without a sink)."""
    plan = _preprocess_plan(out, dout, lse, cu_seqlens_q, max_seqlen_q, padded, dlse, sink)
    return _run_preprocess(plan, out, dout, lse, cu_seqlens_q, dlse, sink)


class _BackwardPlan:
    """What a backward call's launches need that its signature decides (`_plan_key`): the Gluon config or None,
    the preprocess, and the Triton kernels' configs, grids, constant arguments and launches. Built once per
    signature and kept, so that a call repeats only the allocations, the pointer checks and the launches."""

    __slots__ = ("gluon_config", "gluon_dense", "pre", "head", "alibi_stride", "dropout", "ints_dkdv", "ints_dq",
                 "grid_dkdv", "grid_dq", "dkdv", "dq", "constexprs", "fused", "fused_ints")


_PLANS: dict = {}  # `_plan_key` -> _BackwardPlan
_PLAN_LIMIT = 1024  # entries; a workload with ever-new shapes starts over rather than growing without bound


def _plan_key(dout, q, k, v, out, lse, softmax_scale, variant, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
              max_seqlen_k, alibi_slopes, learnable_sink, dlse, rng_state):
    """The signature a plan is kept under: shapes, strides, dtypes and device of the tensors (a kept launch runs
    the kernel compiled for them), the scale, the variant, the varlen lengths, the dispatch switch and the configs
    the Gluon decision reads (which tests and benchmarks patch); None (the plan is built for the call alone) where
    a pointer is not 16-byte aligned, since a kept launch assumes the compiled kernel's alignment."""
    extras = tuple(t for t in (cu_seqlens_q, cu_seqlens_k, alibi_slopes, learnable_sink, dlse, rng_state)
                   if t is not None)
    pointers = q.data_ptr() | k.data_ptr() | v.data_ptr() | dout.data_ptr() | out.data_ptr() | lse.data_ptr()
    for t in extras:
        pointers |= t.data_ptr()
    if pointers & 15:
        return None
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), dout.stride(), out.stride(), lse.stride(),
            (q.dtype, k.dtype, v.dtype, dout.dtype, out.dtype, lse.dtype), q.device, softmax_scale, variant,
            cu_seqlens_q is not None, max_seqlen_q, max_seqlen_k,
            tuple((t.shape, t.stride(), t.dtype) for t in extras),  # (cu_seqlens' shapes: the sequence count)
            dispatch.CHOICE, configs.AUTOTUNE, configs.gluon_bwd_config, configs.backward.GLUON_BWD_MIN_FLOPS,
            configs.backward.GLUON_BWD_D64_MIN_KEYS, configs.backward.GLUON_BWD_DROPOUT,
            configs.backward.GLUON_BWD_FUSED_DELTA, configs.backward.GLUON_BWD_FUSED_SINK,
            configs.backward.TRITON_BWD_FUSED_DELTA, configs.backward.GLUON_BWD_TRIM,
            configs.backward.GLUON_BWD_TRIM_PIECES, configs.backward.GLUON_BWD_DQ_SPLIT)


def _backward_plan(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, variant, cu_seqlens_q, max_seqlen_q,
                   max_seqlen_k, config, given, accumulate, alibi_slopes, learnable_sink, dlse,
                   keep) -> _BackwardPlan:
    """The plan of one call (`attention_backward` says what each argument is); `keep`: kept for later calls of
    the same signature (their launches relaunch the compiled kernels)."""
    varlen = cu_seqlens_q is not None
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    separate_v = head_dim_v != head_dim
    causal = variant.causal
    if varlen:
        batch, heads_q, heads_kv = cu_seqlens_q.numel() - 1, q.shape[1], k.shape[1]
        seqlen_q, seqlen_k = max_seqlen_q, max_seqlen_k
    else:
        batch, seqlen_q, heads_q, _ = q.shape
        seqlen_k, heads_kv = k.shape[1], k.shape[2]
    plan = _BackwardPlan()
    gluon_config = None
    if (config is None and backward_gluon_launch is not None and dispatch.gluon_bwd_allowed()
            and tma_ok(q, k, v, dout)  # (no broadcast, stride-0, dimension among them)
            and dispatch.supports("gluon_bwd", q.dtype, head_dim, 9, varlen, False, variant.fields(), separate_v)):
        rows = q.shape[0] if varlen else batch * seqlen_q  # varlen: every row against the longest key range
        if "window_size" in variant.fields():  # the band's FLOPs (a varlen row: as many as a longest sequence's)
            fwd_flops = rows * _visible_fwd_flops_per_row(variant, heads_q, seqlen_q, seqlen_k, head_dim)
        else:
            fwd_flops = 4 * rows * heads_q * seqlen_k * head_dim / (2 if causal else 1)
        gluon_config = configs.gluon_bwd_config(head_dim, seqlen_q, seqlen_k, bool(causal), fwd_flops, varlen,
                                                head_dim_v, bool(variant.dropout_p),
                                                window="window_size" in variant.fields(),
                                                softcap="softcap" in variant.fields(),
                                                alibi="alibi_slopes" in variant.fields())
        if gluon_config is not None and heads_q * (1 if varlen else batch) * backward_gluon_launch.padded_rows(
                q.shape[0] if varlen else seqlen_q, varlen, batch) >= 2**31:  # the padded lse / delta's TMA
            gluon_config = None  # coordinates are int32
    if gluon_config is not None and not accumulate and (
            (given and {dq.dtype, dk.dtype, dv.dtype} != {q.dtype}) or not tma_ok(q, dq, dk, dv)):
        gluon_config = None  # buffers the Gluon kernels cannot write: the Triton kernels
    if gluon_config is not None and varlen and gluon_config["dq"] is None:
        raise ValueError("the Triton dQ kernel cannot read the Gluon kernels' varlen lse / delta layout: a varlen "
                         "Gluon config needs a 'dq' config too")
    plan.gluon_config = gluon_config
    plan.pre = _preprocess_plan(out, dout, lse, cu_seqlens_q, seqlen_q, gluon_config is not None, dlse,
                                learnable_sink, keep)
    plan.dkdv = plan.dq = plan.gluon_dense = None
    if gluon_config is not None and not varlen and not accumulate and gluon_config["dq"] is not None:
        # the preprocess in the dQ kernel (`_attn_bwd_dq_gluon`'s FUSED_DELTA bits), the sink's gradient's parts too
        # where GLUON_BWD_FUSED_SINK says so
        # (the dQ kernel reads O's rows 16 bytes at a time: not a view whose last dim is strided; tiles up to 128
        # columns wide, where it was timed: `configs.backward.GLUON_BWD_FUSED_DELTA`)
        fused = 0
        if configs.backward.GLUON_BWD_FUSED_DELTA and out.stride(-1) == 1 and (
                backward_gluon_launch.head_block(max(head_dim, head_dim_v)) <= 128) and (
                learnable_sink is None or configs.backward.GLUON_BWD_FUSED_SINK):
            fused = (backward_gluon_launch.FD_ON | backward_gluon_launch.FD_DLSE * (dlse is not None)
                     | backward_gluon_launch.FD_SINK * (learnable_sink is not None))
        plan.gluon_dense = backward_gluon_launch.DenseBackward(q, k, variant, gluon_config, softmax_scale, alibi_slopes,
                                                               head_dim_v, fused)
    if gluon_config is not None and (accumulate or gluon_config["dq"] is not None):
        return plan  # the Gluon kernels take the whole call (accumulating: `attention_backward` runs it anew)

    # The Triton kernels: dK/dV unless the Gluon kernel runs it, then dQ.
    if varlen:
        strides = [(0, *t.stride()) for t in (q, k, v, dout, dq, dk, dv)]  # zero batch stride
    else:
        strides = [t.stride() for t in (q, k, v, dout, dq, dk, dv)]
    l_s = plan.pre.lse_strides  # of the lse / delta the preprocess writes
    q_s, k_s, v_s, do_s, dq_s, dk_s, dv_s = strides
    block_d, block_dv = padded_head_dim(head_dim), padded_head_dim(head_dim_v)
    upcast, precision = dot_settings(q.dtype)
    plan.head = (softmax_scale, *variant.scalars(softmax_scale))
    plan.alibi_stride = alibi_batch_stride(alibi_slopes)
    plan.dropout = variant.dropout_args()[1:]
    tail = (heads_q // heads_kv, seqlen_q, seqlen_k, configs.seqlen_bucket(seqlen_q), configs.seqlen_bucket(seqlen_k))
    plan.ints_dkdv = (*q_s, *k_s, *v_s, *do_s, *dk_s, *dv_s, *l_s, *tail)
    plan.ints_dq = (*q_s, *k_s, *v_s, *do_s, *dq_s, *l_s, *tail)
    constexprs = dict(
        HEAD_DIM=head_dim, BLOCK_D=block_d, HEAD_DIM_V=head_dim_v, BLOCK_DV=block_dv,
        **variant.constexprs, **variant.score_constexprs, IS_VARLEN=varlen,
        UPCAST_DOT=upcast, DOT_PRECISION=precision,
    )
    if variant.dropout_p:  # (absent otherwise: the kernels' default, and the launch key of the dropout-free calls)
        constexprs.update(variant.dropout_constexprs)
    if accumulate:  # (likewise)
        constexprs.update(ACCUMULATE=True)
    if config is None and INTERPRET:
        config = configs.BWD_INTERPRETER_CONFIG
    if config is None and (not configs.AUTOTUNE or accumulate):  # (autotuning would add once per candidate run)
        config = configs.default_bwd_configs(max(block_d, block_dv), q.element_size(), q.device, bool(causal))
    if config is not None and "dkdv" not in config:
        config = {"dkdv": config, "dq": config}

    def grid_dkdv(meta):
        return (cdiv(seqlen_k, meta["BLOCK_N"]), heads_kv, batch)

    def grid_dq(meta):
        return (cdiv(seqlen_q, meta["BLOCK_M"]), heads_q, batch)

    plan.constexprs = constexprs
    plan.fused, plan.fused_ints = 0, (None,) * 7
    if config is None:  # autotuned (`_attn_bwd_dkdv_tuned` / `_attn_bwd_dq_tuned`): the grids as functions
        plan.grid_dkdv, plan.grid_dq = grid_dkdv, grid_dq
    else:
        plan.grid_dkdv, plan.grid_dq = grid_dkdv(config["dkdv"]), grid_dq(config["dq"])
        dq_meta = {**constexprs, **config["dq"]}
        if gluon_config is None and configs.backward.TRITON_BWD_FUSED_DELTA:  # the preprocess in the dQ kernel
            plan.fused = FUSED_ON | FUSED_DLSE * (dlse is not None) | FUSED_SINK * (learnable_sink is not None)
            o_s = (0, *out.stride()) if varlen else out.stride()
            d_s = (None,) * 3 if dlse is None else (0, *dlse.stride()) if varlen else dlse.stride()
            plan.fused_ints = (*o_s, *d_s)
            dq_meta.update(FUSED=plan.fused)  # (absent otherwise: the launch key of the unfused calls)
        plan.dkdv = KeptLaunch(_attn_bwd_dkdv, {**constexprs, **config["dkdv"]}, keep)
        plan.dq = KeptLaunch(_attn_bwd_dq, dq_meta, keep)
    return plan


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    causal_bottom_right: bool = True,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    config: dict | None = None,
    zero_fill: bool = True,
    dlse: torch.Tensor | None = None,
    window_size: tuple = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    learnable_sink: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    rng_state: torch.Tensor | None = None,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    accumulate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernels on validated inputs (what `attention_forward` took and returned).

    Dense:  q (B, Sq, Hq, D); dout, out (B, Sq, Hq, Dv); k (B, Sk, Hkv, D); v (B, Sk, Hkv, Dv); lse (B, Hq, Sq) fp32
    Varlen: q (total_q, Hq, D); dout, out (total_q, Hq, Dv); k (total_k, Hkv, D); v (total_k, Hkv, Dv);
            lse (Hq, total_q); cu_seqlens int32 (B + 1,)
    Dv (V's head dim) may differ from D: the Triton kernels run such calls (the Gluon ones declare Dv == D only).
    Returns dq like q and dk, dv like k, v (GQA: summed over each kv head's query heads). Deterministic (the
    Gluon kernels too: no atomics). Any strides with a contiguous last dim. `config` forces the Triton kernels'
    {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"} for both, or {"dkdv": {...}, "dq": {...}} one each, instead of
    autotuning (and of the Gluon kernels).
    Varlen with `zero_fill`: the gradients start at zero, so tokens outside every sequence get 0; pass False
    when cu_seqlens cover every token (the kernels write every other row), saving three memsets.
    dlse: the gradient of lse (shaped like it, fp32), or None when lse is not differentiated (no extra work).
    dropout_p, rng_state: the forward's (its keep-mask is regenerated, never stored); the Triton kernels run them,
    or the Gluon ones where `configs.gluon_bwd_config` takes dropout (`configs.backward.GLUON_BWD_DROPOUT`).
    dq, dk, dv: where to write the gradients (shaped like q, k, v; any float dtype, any strides, e.g. fp32 views
    into a caller's accumulators), else new tensors like q, k, v. `accumulate`: add to their contents instead
    (each element has one writer: still deterministic). Buffers of another dtype than q's run the Triton kernels
    (the Gluon ones write q's dtype, and overwrite); `accumulate` where the Gluon kernels take the call runs them
    into new tensors of q's dtype and adds those (the Triton kernels add their fp32 sums directly).
    A call without a forced config or given buffers takes the plan kept for its signature (`_plan_key`).
    """
    varlen = cu_seqlens_q is not None
    given = dq is not None or dk is not None or dv is not None
    alloc = torch.zeros if varlen and zero_fill else torch.empty
    dq, dk, dv = (alloc(t.shape, dtype=t.dtype, device=t.device) if g is None
                  else g.zero_() if varlen and zero_fill and not accumulate else g
                  for g, t in ((dq, q), (dk, k), (dv, v)))
    if varlen:
        seqlen_q, seqlen_k = max_seqlen_q, max_seqlen_k
    else:
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    if q.numel() == 0 or k.numel() == 0 or not seqlen_q or not seqlen_k:
        if not accumulate:  # no query sees a key: every gradient is 0
            dq, dk, dv = dq.zero_(), dk.zero_(), dv.zero_()
        if learnable_sink is not None:  # every row's softmax is the sink alone: dsink = sum of dlse
            dsink = torch.zeros_like(learnable_sink) if dlse is None else \
                dlse.sum(dim=1 if varlen else (0, 2)).to(learnable_sink.dtype)
            return dq, dk, dv, dsink
        return dq, dk, dv
    variant = Variant.of(causal, causal_bottom_right, window_size, softcap, alibi_slopes is not None,
                         learnable_sink is not None, dropout_p)
    if dropout_p and rng_state is None:
        raise ValueError("dropout_p > 0 needs rng_state, the forward's int64 (seed, offset) tensor")
    lse = lse.contiguous()  # already so as the forward returns it
    key = None
    if config is None and not given and not accumulate:
        key = _plan_key(dout, q, k, v, out, lse, softmax_scale, variant, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, alibi_slopes, learnable_sink, dlse, rng_state)
    plan = _PLANS.get(key) if key is not None else None
    if plan is None:
        plan = _backward_plan(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, variant, cu_seqlens_q,
                              max_seqlen_q, max_seqlen_k, config, given, accumulate, alibi_slopes, learnable_sink,
                              dlse, key is not None)
        if key is not None:
            if len(_PLANS) >= _PLAN_LIMIT:
                _PLANS.clear()
            _PLANS[key] = plan
    gluon_config = plan.gluon_config
    if gluon_config is not None and accumulate:
        # The Gluon kernels overwrite, in q's dtype: the call's gradients in new tensors, added to the accumulators
        # (each call's share rounded once, as ring-flash-attention's partials are; the sum in the buffers' dtype).
        grads = attention_backward(dout, q, k, v, out, lse, softmax_scale, causal, causal_bottom_right, cu_seqlens_q,
                                   cu_seqlens_k, max_seqlen_q, max_seqlen_k, None, zero_fill, dlse, window_size,
                                   softcap, alibi_slopes, learnable_sink, dropout_p, rng_state)
        for buffer, grad in zip((dq, dk, dv), grads):
            buffer.add_(grad)
        return (dq, dk, dv, *grads[3:])

    # The preprocess' work: in the dQ kernel (the Gluon one of a dense call, or the Triton one), which then goes
    # first, into fresh buffers (the sink's gradient from its parts); else the preprocess kernel.
    fused = plan.gluon_dense.fused if plan.gluon_dense is not None else plan.gluon_config is None and plan.fused
    part = dsink = None
    if fused:
        lse_out = lse if plan.pre.lse_shape is None else torch.empty(plan.pre.lse_shape, dtype=torch.float32,
                                                                     device=q.device)
        delta = torch.empty_like(lse_out)
        if learnable_sink is not None:  # (batch, heads, a part per query tile or warpgroup block)
            part = torch.empty(plan.grid_dq[::-1] if plan.gluon_dense is None else
                               backward_gluon_launch.sink_parts_shape(q.shape), dtype=torch.float32, device=q.device)
    else:
        lse_out, delta, dsink = _run_preprocess(plan.pre, out, dout, lse, cu_seqlens_q, dlse, learnable_sink)
    if plan.gluon_dense is not None:
        backward_gluon_launch.launch_dense(plan.gluon_dense, q, k, v, dout, dq, dk, dv, lse_out, delta,
                                           softmax_scale, alibi_slopes, rng_state if dropout_p else None,
                                           *((out, lse, dlse, learnable_sink, part) if fused else ()))
    elif gluon_config is not None:
        varlen_args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        backward_gluon_launch.launch_dkdv_gluon(q, k, v, dout, dk, dv, lse_out, delta, softmax_scale, causal,
                                                causal_bottom_right, gluon_config["dkdv"], *varlen_args, window_size,
                                                softcap, alibi_slopes, dropout_p, rng_state)
        if gluon_config["dq"] is not None:
            backward_gluon_launch.launch_dq_gluon(q, k, v, dout, dq, lse_out, delta, softmax_scale, causal,
                                                  causal_bottom_right, gluon_config["dq"], *varlen_args, window_size,
                                                  softcap, alibi_slopes, dropout_p, rng_state)
    if gluon_config is None or gluon_config["dq"] is None:
        _launch_triton(plan, q, k, v, dout, out, lse_out, delta, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                       alibi_slopes, rng_state if dropout_p else None, dlse, learnable_sink, part, fused)
    if part is not None:
        dsink = part.sum(dim=(0, 2)).to(learnable_sink.dtype)  # (in a fixed order, as the preprocess')
    return (dq, dk, dv) if learnable_sink is None else (dq, dk, dv, dsink)


def _launch_triton(plan, q, k, v, dout, out, lse, delta, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                   rng_state, dlse, learnable_sink, part, fused) -> None:
    """The Triton kernels of `plan`: dK/dV unless the Gluon kernel ran it, and dQ; with `fused` (the preprocess'
    work in the dQ kernel, which fills delta and the sink's `part`s) dQ first."""
    mid = (*plan.head, alibi_slopes, plan.alibi_stride, rng_state, *plan.dropout)
    dq_args = (q, k, v, dout, lse, delta, dq, cu_seqlens_q, cu_seqlens_k, *mid, *plan.ints_dq,
               *((out, dlse, learnable_sink, part, *plan.fused_ints) if fused else _NOT_FUSED))
    if fused:  # (a kept launch: fused plans have fixed configs)
        plan.dq(plan.grid_dq, dq_args)
    if plan.gluon_config is None:
        args = (q, k, v, dout, lse, delta, dk, dv, cu_seqlens_q, cu_seqlens_k, *mid, *plan.ints_dkdv)
        if plan.dkdv is None:
            _attn_bwd_dkdv_tuned[plan.grid_dkdv](*args, **plan.constexprs)
        else:
            plan.dkdv(plan.grid_dkdv, args)
    if fused:
        return
    if plan.dq is None:
        _attn_bwd_dq_tuned[plan.grid_dq](*dq_args, **plan.constexprs)
    else:
        plan.dq(plan.grid_dq, dq_args)


@functools.lru_cache(maxsize=1024)
def _visible_fwd_flops_per_row(variant: Variant, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int) -> float:
    """Forward FLOPs per query row of a (seqlen_q, seqlen_k) call under the variant's mask, over `heads` heads
    (`Variant.visible_flops`, whose O(Sq) count is kept per shape: it is on the Gluon backward's dispatch path)."""
    return variant.visible_flops(1, heads, seqlen_q, seqlen_k, head_dim) / seqlen_q
