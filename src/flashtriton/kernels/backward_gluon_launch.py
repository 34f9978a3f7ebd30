"""The host side of Hopper's Gluon backward (the kernels are `backward_gluon`'s): the padded lse / delta layout's
sizes (`padded_rows`) and its descriptor (`row_descriptor`), each kernel's grid, int arguments and constexprs
(`launch_parts`, kept per dense call shape in `_dense_plan`), the varlen work table (`work_table`, remembered per
cu_seqlens pair), the launchers `launch_dkdv_gluon` / `launch_dq_gluon` that `backward.attention_backward` calls
where `configs.gluon_bwd_config` says, and `compile_for_sm90` (the kernels compiled without a GPU).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .. import configs
from .backward_gluon import BLOCK_M, KEYS, ROWS, WIDE_HEAD_DIM
from .backward_gluon_dkdv import _attn_bwd_dkdv_gluon
from .backward_gluon_dq import _attn_bwd_dq_gluon
from .gluon_common import (FAST_DESCRIPTOR, SHARED_MEMORY_LIMIT, descriptor, head_block, trimmed_width, width_piece,
                           width_pieces)
from .host import cdiv
from .launch import hooks_installed, launch, launch_and_keep
from .memo import remembered
from .variant import Variant, alibi_batch_stride


@functools.lru_cache(maxsize=None)
def _row_layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)


def row_descriptor(t: torch.Tensor) -> TensorDescriptor:
    """Descriptor of a contiguous fp32 lse / delta buffer (a fresh allocation: aligned) as one flat row, in blocks
    of BLOCK_M values; built without TensorDescriptor's re-checks where its fields allow (`descriptor`)."""
    flat = t.view(-1)
    if not FAST_DESCRIPTOR:
        return TensorDescriptor(flat, [flat.numel()], [1], [BLOCK_M.value], _row_layout())
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides, desc.block_shape, desc.layout, desc.padding = \
        flat, [flat.numel()], [1], [BLOCK_M.value], _row_layout(), "zero"
    return desc


def padded_seqlen(seqlen_q: int) -> int:
    """lse / delta rows per (batch, head) of a dense batch: Sq rounded up to the dQ kernel's 128-row tiles."""
    return cdiv(seqlen_q, KEYS.value) * KEYS.value


def padded_rows(seqlen_q: int, varlen: bool, batch: int = 0) -> int:
    """lse / delta rows per (batch entry and) head. Dense: `padded_seqlen`. Varlen (seqlen_q = total_q, `batch`
    sequences): each sequence starts at a 16-byte aligned row (`backward_gluon.lse_rows`), the last 128 rows a
    margin so that the last sequence's last tile stays inside."""
    return 4 * (cdiv(seqlen_q, 4) + batch) + KEYS.value if varlen else padded_seqlen(seqlen_q)


def program_block(kernel: str, head_dim: int) -> int:
    """Keys (dK/dV) or query rows (dQ) of one program at tiles `head_dim` wide (`backward_gluon_dkdv.dkdv_keys`)."""
    return ROWS.value if kernel == "dkdv" and head_dim >= WIDE_HEAD_DIM.value else KEYS.value


def shared_memory_bytes(config: dict, head_dim: int, kernel: str = "dkdv", elem_bytes: int = 2,
                        head_dim_v: int | None = None) -> int:
    """Shared memory of a kernel's tiles (barriers and layout conversions aside), at tiles `head_dim` wide (Q, K)
    and `head_dim_v` (V, dO; default the same). dK/dV: K and V of the program's keys (two items' under PERSISTENT),
    and per stage a 64-row Q and dO tile with their lse and delta. dQ: Q and dO of 128 rows, and per stage a K and a V tile."""
    widths = head_dim + (head_dim if head_dim_v is None else head_dim_v)  # a row of Q and dO, or of K and V
    resident = program_block(kernel, head_dim) * widths * elem_bytes * (2 if config.get("PERSISTENT") else 1)
    if kernel == "dkdv":
        per_stage = BLOCK_M.value * (widths * elem_bytes + 8)
    else:
        per_stage = config["BLOCK_N"] * widths * elem_bytes
    return resident + config["NUM_STAGES"] * per_stage


def launch_parts(q_shape, k_shape, causal: bool, causal_bottom_right: bool, config: dict, kernel: str = "dkdv",
                 batch: int | None = None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                 variant: Variant | None = None, head_dim_v: int | None = None, programs: int = 132,
                 widths: tuple = (0, 0), dq_split: bool = False):
    """(grid, int arguments after the scales and output strides, constexprs and options) of the dK/dV or the dQ
    kernel. Dense (batch None): q (B, Sq, Hq, D), k (B, Sk, Hkv, D). Varlen: q (total_q, Hq, D),
    k (total_k, Hkv, D), `batch` sequences of at most max_seqlen_q / max_seqlen_k tokens. `variant`: the call's
    (window, softcap, ALiBi: `Variant.score_constexprs`); None: causal or not, nothing else. `head_dim_v`: V's (and
    dO's, dV's) head dim where it is not D (`separate_v_ok` pairs); the kernels read its tiles' width from the V
    descriptor, and the dK/dV kernel stores dV's own columns (DV_VALID). A dK/dV config with PERSISTENT (dense,
    tiles up to 128 wide) launches at most `programs` programs (the GPU's SM count: one resident program each), or
    at most PERSISTENT programs where it is a number (tests: many items a program). `widths`: the products over
    QK's and V's head dims (QK_WIDTH, V_WIDTH: `product_widths`), 0 for the tiles' whole width; `dq_split`: the dQ
    kernel's accumulator in two (DQ_SPLIT: `dq_split` says where)."""
    varlen = batch is not None
    heads_q, head_dim, heads_kv = q_shape[-2], q_shape[-1], k_shape[-2]
    block_d = head_block(head_dim)  # the tiles' head dim (HEAD_DIM); D_VALID the head's own
    separate_v = head_dim_v is not None and head_dim_v != head_dim
    block_dv = head_block(head_dim_v) if separate_v else None
    if separate_v and not separate_v_ok(head_dim, head_dim_v):
        raise ValueError(f"the Gluon backward does not take QK head dim {head_dim} with V head dim {head_dim_v}")
    if varlen:
        seqlen_q, seqlen_k, pad = max_seqlen_q, max_seqlen_k, padded_rows(q_shape[0], True, batch)
    else:
        batch, seqlen_q, seqlen_k = q_shape[0], q_shape[1], k_shape[1]
        pad = padded_rows(seqlen_q, False)
    smem = shared_memory_bytes(config, block_d, kernel, 2, block_dv)
    if smem > SHARED_MEMORY_LIMIT:
        raise ValueError(f"Gluon {kernel} config {config} needs {smem} bytes of shared memory at head dims "
                         f"{head_dim} / {head_dim_v or head_dim}; sm_90 has {SHARED_MEMORY_LIMIT}")
    persistent = config.get("PERSISTENT") if kernel == "dkdv" else None
    if persistent:  # True: one program per SM; a number: at most that many programs (tests)
        if varlen or block_d >= WIDE_HEAD_DIM.value:
            raise ValueError(f"Gluon dkdv config {config}: PERSISTENT takes dense calls with tiles up to 128 wide")
        programs = programs if persistent is True else int(persistent)
        grid = (max(1, min(cdiv(seqlen_k, program_block(kernel, block_d)) * heads_kv * batch, programs)), 1, 1)
    elif kernel == "dkdv":
        grid = (cdiv(seqlen_k, program_block(kernel, block_d)), heads_kv, batch)
    else:
        grid = (cdiv(seqlen_q, KEYS.value), heads_q, batch)
    ints = (heads_q, batch, heads_q // heads_kv, seqlen_q, seqlen_k, pad)
    if variant is None:
        variant = Variant.of(causal, causal_bottom_right)
    meta = dict(**variant.constexprs, **variant.score_constexprs, IS_VARLEN=varlen,
                HEAD_DIM=block_d, D_VALID=head_dim, num_warps=4, WORK_TABLE=False, **config)
    if separate_v and kernel == "dkdv":  # (absent otherwise: the kernel's default, dV's columns D_VALID)
        meta["DV_VALID"] = head_dim_v
    for name, width in zip(("QK_WIDTH", "V_WIDTH"), widths):  # (likewise: the whole tiles' launches keep their key)
        if width:
            meta[name] = width
    if kernel == "dq" and dq_split:  # (likewise)
        meta["DQ_SPLIT"] = True
    if variant.dropout_p:  # (likewise: the dropout-free launches keep their key)
        meta.update(variant.dropout_constexprs)
    return grid, ints, meta


def product_widths(head_dim: int, head_dim_v: int | None = None) -> tuple:
    """(QK_WIDTH, V_WIDTH) of a backward at these head dims: the head's own columns where they are fewer than its
    tiles' (`gluon_common.product_width`), `configs.backward.GLUON_BWD_TRIM` takes the tiles' width and they make
    at most GLUON_BWD_TRIM_PIECES wgmmas, else 0."""
    trim, pieces = configs.backward.GLUON_BWD_TRIM, configs.backward.GLUON_BWD_TRIM_PIECES
    return (trimmed_width(head_dim, trim, pieces),
            trimmed_width(head_dim if head_dim_v is None else head_dim_v, trim, pieces))


def dq_split(head_dim: int) -> bool:
    """Whether the Gluon dQ kernel keeps dQ in two accumulators over the pieces of QK's product width
    (`product_widths`), so that its product skips the tiles' zero columns: under
    `configs.backward.GLUON_BWD_DQ_SPLIT`, where that width is two pieces of at least 64 columns (D=192: 128 + 64;
    narrower pieces would slice the tiles inside a swizzle atom)."""
    width = product_widths(head_dim)[0]
    return bool(configs.backward.GLUON_BWD_DQ_SPLIT and width and width_pieces(width) == 2
                and width_piece(width, 1) >= 64)


def separate_v_ok(head_dim: int, head_dim_v: int) -> bool:
    """Whether the Gluon backward takes QK head dim `head_dim` with V head dim `head_dim_v`: a pair of tile widths
    `configs.GLUON_BWD_SEPARATE_V` has a row for (those the H200 has run against float64: QK 256 / V 128, 128 / 64,
    64 / 128 tiles); the Triton kernels run the rest."""
    return configs.gluon_bwd_pair_config(head_dim, head_dim_v) is not None


def work_table(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, heads: int, kernel: str, causal: bool,
               longest_first: bool, total: int, block: int = KEYS.value) -> torch.Tensor:
    """int32 (rows, 8) on cu_seqlens' device, one row per program of a varlen dK/dV (kernel "dkdv": key blocks,
    `heads` the kv heads) or dQ ("dq": query blocks, the query heads) launch: (sequence b, head, first key / query
    row of its `block` (`program_block`), q_start, seqlen_q, k_start, seqlen_k, 0). Only blocks that exist get a row (a grid over the
    longest sequence's blocks is half empty programs on mixed lengths); rows past the last block hold b = −1.
    Order: the sequences as given, or by seqlen_q · seqlen_k, largest first (`longest_first`), so that the last
    programs to start are short ones; within a sequence its heads, within a head its blocks in the order the dense
    grid runs them (dQ causal: the last rows, which see the most keys, first), so that a head's blocks run together
    and share its Q / dO (dK/dV) or K / V (dQ) in L2. `total`: the packed tokens along the blocked axis (total_k
    for dK/dV, total_q for dQ), a host-side bound on the rows (heads · (total // block + B)): built with GPU ops
    only, no copy to the host."""
    batch = cu_seqlens_q.numel() - 1
    keys = block
    dev = cu_seqlens_q.device
    if batch == 0:  # no sequences: no program (a launch of an empty grid does nothing)
        return torch.empty(0, 8, dtype=torch.int32, device=dev)
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    len_q, len_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]  # (B,)
    blocks = ((len_k if kernel == "dkdv" else len_q) + keys - 1) // keys  # per (sequence, head)
    if longest_first:
        order = torch.argsort(len_q * len_k, descending=True, stable=True)
    else:
        order = torch.arange(batch, device=dev)
    blocks = blocks[order]  # per ordered sequence
    per_seq = blocks * heads
    ends = torch.cumsum(per_seq, 0)  # (B,) programs up to and including each (ordered) sequence
    rows = heads * (total // keys + batch)
    pid = torch.arange(rows, device=dev)
    j = torch.searchsorted(ends, pid, right=True)  # the ordered sequence of each program; B past the last
    valid = j < batch
    j = j.clamp(max=max(batch - 1, 0))
    r = pid - (ends[j] - per_seq[j])  # the program's index within its sequence
    nb = blocks[j].clamp(min=1)
    head, block = r // nb, r % nb
    if kernel == "dq" and causal:
        block = nb - 1 - block
    b = order[j]
    table = torch.stack([b, head, block * keys, cu_q[:-1][b], len_q[b], cu_k[:-1][b], len_k[b],
                         torch.zeros_like(b)], 1)
    pad = torch.tensor([-1, 0, 0, 0, 0, 0, 0, 0], device=dev)
    return torch.where(valid[:, None], table, pad).to(torch.int32).contiguous()


_WORK_TABLES: dict = {}  # (ids, heads, kernel, causal, order, total) -> (stamp, weakrefs to the cu_seqlens, table)


def cached_work_table(cu_seqlens_q, cu_seqlens_k, heads, kernel, causal, longest_first, total,
                      block: int = KEYS.value) -> torch.Tensor:
    """`work_table`, reused while the same cu_seqlens tensors are unchanged (as `validation.check_cu_seqlens_values`
    reuses its check): a model's layers share one batch's tables. Not kept while a CUDA graph is captured."""
    key = (id(cu_seqlens_q), id(cu_seqlens_k), heads, kernel, bool(causal), bool(longest_first), total, block)
    capturing = cu_seqlens_q.is_cuda and torch.cuda.is_current_stream_capturing()
    return remembered(_WORK_TABLES, key, (cu_seqlens_q, cu_seqlens_k), lambda: work_table(
        cu_seqlens_q, cu_seqlens_k, heads, kernel, causal, longest_first, total, block), keep=not capturing)


def _varlen_work(q, k, cu_seqlens_q, cu_seqlens_k, causal, kernel, grid):
    """(grid, WORK, WORK_TABLE) of a varlen launch: where `configs.varlen_bwd_order` takes the work table, its
    grid and rows; else the given grid and a placeholder pointer."""
    order = configs.varlen_bwd_order(causal)
    if order == "grid":
        return grid, cu_seqlens_q, False
    heads = k.shape[-2] if kernel == "dkdv" else q.shape[-2]
    total = k.shape[0] if kernel == "dkdv" else q.shape[0]
    table = cached_work_table(cu_seqlens_q, cu_seqlens_k, heads, kernel, causal, order == "largest_first", total,
                              program_block(kernel, head_block(q.shape[-1])))
    return (table.shape[0],), table, True


class _DensePlan:
    """A dense launch's grid, int arguments and constexprs for one call shape, and the compiled kernel once it ran
    (`launch.Relaunch`): the pointers of a dense Gluon backward launch are all 16-byte aligned (`common.tma_ok`, fresh
    buffers) and its int arguments are not specialized on, so the kernel compiled at a shape's first call serves
    every later one, without `launch`'s key over ~25 arguments."""

    __slots__ = ("grid", "ints", "meta", "relaunch")

    def __init__(self, grid, ints, meta):
        self.grid, self.ints, self.meta, self.relaunch = grid, ints, meta, None


@functools.lru_cache(maxsize=1024)
def _dense_plan(kernel, q_shape, k_shape, dtype, device, causal, causal_bottom_right, config_items,
                variant=None, head_dim_v=None, widths=(0, 0), split_dq=False) -> _DensePlan:
    """The plan of one call shape and variant (`Variant` equality: its window, softcap and whether ALiBi slopes
    are given; the scalars and slopes themselves are arguments of each launch); `head_dim_v`: V's head dim."""
    programs = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    return _DensePlan(*launch_parts(q_shape, k_shape, causal, causal_bottom_right, dict(config_items), kernel,
                                    variant=variant, head_dim_v=head_dim_v, programs=programs, widths=widths,
                                    dq_split=split_dq))


def _launch_parts_for(kernel, q, k, v, variant, config, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """(grid, ints, meta, WORK, plan) of a launch: dense from its `_DensePlan` (WORK a placeholder), varlen from
    `launch_parts` and `_varlen_work` (plan None)."""
    causal, causal_bottom_right = variant.causal, variant.bottom_right
    if cu_seqlens_q is None:
        plan = _dense_plan(kernel, tuple(q.shape), tuple(k.shape), q.dtype, q.device, causal, causal_bottom_right,
                           tuple(sorted(config.items())), variant, v.shape[-1],
                           product_widths(q.shape[-1], v.shape[-1]), dq_split(q.shape[-1]))
        return plan.grid, plan.ints, plan.meta, q, plan
    grid, ints, meta = launch_parts(q.shape, k.shape, causal, causal_bottom_right, config, kernel,
                                    cu_seqlens_q.numel() - 1, max_seqlen_q, max_seqlen_k, variant, v.shape[-1],
                                    widths=product_widths(q.shape[-1], v.shape[-1]),
                                    dq_split=dq_split(q.shape[-1]))
    grid, work, meta["WORK_TABLE"] = _varlen_work(q, k, cu_seqlens_q, cu_seqlens_k, causal, kernel, grid)
    return grid, ints, meta, work, None


def _launch(fn, plan, grid, args, meta) -> None:
    if plan is None:
        launch(fn, grid, args, meta)
    elif plan.relaunch is not None and not hooks_installed():
        plan.relaunch(grid, args)
    else:
        plan.relaunch = launch_and_keep(fn, grid, args, meta)


def _variant_args(softmax_scale, causal, causal_bottom_right, window_size, softcap, alibi_slopes, dropout_p=0.0,
                  rng_state=None):
    """(Variant, its kernel arguments from qk_scale to dropout's scale: `Variant.scalars`, the slopes (B or 1, Hq)
    fp32 and their batch stride, `Variant.dropout_args`; None for what is off, as the portable kernels take them)."""
    variant = Variant.of(causal, causal_bottom_right, window_size, softcap, alibi_slopes is not None,
                         dropout_p=dropout_p)
    return variant, (*variant.scalars(softmax_scale), alibi_slopes, alibi_batch_stride(alibi_slopes),
                     *variant.dropout_args(rng_state))


def _dkdv_args(desc_q, desc_do, k, v, dk, dv, lse_pad, delta_pad, cu_q, cu_k, work, softmax_scale, scalars, ints,
               varlen, d, dv_block) -> tuple:
    """The dK/dV kernel's arguments, with the Q and dO descriptors given (the dQ kernel's are the same); tiles `d`
    (Q, K) and `dv_block` (V, dO) wide."""
    rows = ROWS.value
    return (desc_q, descriptor(k, rows, varlen, d), descriptor(v, rows, varlen, dv_block), desc_do,
            descriptor(dk, rows, varlen, d), descriptor(dv, rows, varlen, dv_block), row_descriptor(lse_pad),
            row_descriptor(delta_pad), dk, dv, cu_q, cu_k, work, softmax_scale, *scalars,
            dk.stride(-3), dk.stride(-2), dv.stride(-3), dv.stride(-2), *ints)


def _dq_args(desc_q, desc_do, k, v, dq, lse_pad, delta_pad, cu_q, cu_k, work, softmax_scale, scalars, ints, varlen,
             d, block_n, dv_block) -> tuple:
    """The dQ kernel's arguments, with the Q and dO descriptors given."""
    return (desc_q, descriptor(k, block_n, varlen, d), descriptor(v, block_n, varlen, dv_block), desc_do,
            descriptor(dq, ROWS.value, varlen, d), lse_pad, delta_pad, dq, cu_q, cu_k, work, softmax_scale, *scalars,
            dq.stride(-3), dq.stride(-2), *ints, *_NOT_FUSED)


_NOT_FUSED = (None,) * 13  # the dQ kernel's FUSED_DELTA arguments, off
FD_ON, FD_DLSE, FD_SINK = 1, 2, 4  # FUSED_DELTA's bits (`backward_gluon.FD_ON`, ...)


def _fused_args(out, lse, dlse, sink=None, sink_part=None) -> tuple:
    """The dQ kernel's FUSED_DELTA arguments: dense out (B, Sq, Hq, Dv), lse (B, Hq, Sq) with a contiguous last
    dim, dlse (B, Hq, Sq) any strides or None, the sinks (Hq,) with their gradient's parts (B, Hq, 2 · cdiv(Sq,
    128)) fp32 contiguous, or None."""
    d_s = (None, None, None) if dlse is None else dlse.stride()
    return (out, lse, dlse, out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), *d_s, sink,
            sink_part)


def sink_parts_shape(q_shape) -> tuple:
    """The shape of the sink's gradient's parts that a fused dQ kernel writes for dense q (B, Sq, Hq, D): one per
    batch entry, head and 64-row warpgroup block."""
    batch, seqlen_q, heads_q, _ = q_shape
    return batch, heads_q, 2 * cdiv(seqlen_q, KEYS.value)


def launch_dkdv_gluon(q, k, v, dout, dk, dv, lse_pad, delta_pad, softmax_scale, causal, causal_bottom_right,
                      config, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                      window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None) -> None:
    """Dense q (B, Sq, Hq, D), dout (B, Sq, Hq, Dv), k, dk (B, Sk, Hkv, D), v, dv (B, Sk, Hkv, Dv), lse_pad /
    delta_pad contiguous fp32 (B, Hq, `padded_rows`); or varlen q, dout (total_q, Hq, D / Dv), k, v, dk, dv
    (total_k, Hkv, D / Dv), lse_pad / delta_pad (Hq, `padded_rows`, sequences at `backward_gluon.lse_rows`),
    cu_seqlens int32 (B + 1,); as `backward.preprocess(padded=True)` writes them. Inputs that pass `common.tma_ok`,
    D of `configs.GLUON_BWD_HEAD_DIMS`, Dv = D or a `separate_v_ok` pair, Sq, Sk > 0; dk / dv with a contiguous
    last dim. window_size, softcap, alibi_slopes ((Hq,) or (B, Hq) fp32): flash-attn's; dropout_p with rng_state,
    the forward's int64 (seed, offset) tensor (its keep-mask regenerated)."""
    varlen = cu_seqlens_q is not None
    variant, scalars = _variant_args(softmax_scale, causal, causal_bottom_right, window_size, softcap, alibi_slopes,
                                     dropout_p, rng_state)
    grid, ints, meta, work, plan = _launch_parts_for("dkdv", q, k, v, variant, config, cu_seqlens_q, cu_seqlens_k,
                                                     max_seqlen_q, max_seqlen_k)
    rows, d, dv_block = ROWS.value, head_block(q.shape[-1]), head_block(v.shape[-1])
    cu_q, cu_k = (cu_seqlens_q, cu_seqlens_k) if varlen else (lse_pad, lse_pad)
    args = _dkdv_args(descriptor(q, rows, varlen, d), descriptor(dout, rows, varlen, dv_block), k, v, dk, dv,
                      lse_pad, delta_pad, cu_q, cu_k, work, softmax_scale, scalars, ints, varlen, d, dv_block)
    _launch(_attn_bwd_dkdv_gluon, plan, grid, args, meta)


def launch_dq_gluon(q, k, v, dout, dq, lse_pad, delta_pad, softmax_scale, causal, causal_bottom_right, config,
                    cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None) -> None:
    """dQ (times the softmax scale) into dq (like q); the inputs as `launch_dkdv_gluon`'s."""
    varlen = cu_seqlens_q is not None
    variant, scalars = _variant_args(softmax_scale, causal, causal_bottom_right, window_size, softcap, alibi_slopes,
                                     dropout_p, rng_state)
    grid, ints, meta, work, plan = _launch_parts_for("dq", q, k, v, variant, config, cu_seqlens_q, cu_seqlens_k,
                                                     max_seqlen_q, max_seqlen_k)
    rows, d, dv_block = ROWS.value, head_block(q.shape[-1]), head_block(v.shape[-1])
    cu_q, cu_k = (cu_seqlens_q, cu_seqlens_k) if varlen else (lse_pad, lse_pad)
    args = _dq_args(descriptor(q, rows, varlen, d), descriptor(dout, rows, varlen, dv_block), k, v, dq, lse_pad,
                    delta_pad, cu_q, cu_k, work, softmax_scale, scalars, ints, varlen, d, config["BLOCK_N"], dv_block)
    _launch(_attn_bwd_dq_gluon, plan, grid, args, meta)


class DenseBackward:
    """Both kernels of a dense Gluon backward for one call signature (`backward._BackwardPlan` keeps it): their
    plans (`_DensePlan`), the variant's scalars and the tiles' head dim. `launch_dense` runs it on a call's
    tensors, with one Q and one dO descriptor for both kernels."""

    __slots__ = ("dkdv", "dq", "scalars", "alibi_stride", "d", "dv_block", "block_n", "variant", "fused")

    def __init__(self, q, k, variant: Variant, config: dict, softmax_scale: float, alibi_slopes=None,
                 head_dim_v: int | None = None, fused: int = 0):
        variant = Variant.of(variant.causal, variant.bottom_right, variant.window, variant.softcap,
                             variant.alibi_slopes is not None,
                             dropout_p=variant.dropout_p)  # (as `_variant_args`: what these kernels compile)
        self.variant = variant
        head_dim_v = q.shape[-1] if head_dim_v is None else head_dim_v
        items = tuple(q.shape), tuple(k.shape), q.dtype, q.device, variant.causal, variant.bottom_right
        # every argument as `_launch_parts_for` passes it, so that both find the same `_dense_plan` entries
        widths, split = product_widths(q.shape[-1], head_dim_v), dq_split(q.shape[-1])
        self.dkdv = _dense_plan("dkdv", *items, tuple(sorted(config["dkdv"].items())), variant, head_dim_v, widths,
                                split)
        dq_config = dict(config["dq"], FUSED_DELTA=fused, DV_OUT=head_dim_v) if fused else config["dq"]
        self.dq = _dense_plan("dq", *items, tuple(sorted(dq_config.items())), variant, head_dim_v, widths, split)
        self.fused = fused
        self.scalars = variant.scalars(softmax_scale)
        self.alibi_stride = alibi_batch_stride(alibi_slopes)
        self.d, self.dv_block, self.block_n = head_block(q.shape[-1]), head_block(head_dim_v), config["dq"]["BLOCK_N"]


def launch_dense(plan: DenseBackward, q, k, v, dout, dq, dk, dv, lse_pad, delta_pad, softmax_scale,
                 alibi_slopes=None, rng_state=None, out=None, lse=None, dlse=None, sink=None,
                 sink_part=None) -> None:
    """dK/dV then dQ of a dense call, as `launch_dkdv_gluon` and `launch_dq_gluon` launch them (the inputs as theirs),
    through `plan` (built for these tensors' signature). With `plan.fused` the preprocess is the dQ kernel's:
    lse_pad / delta_pad are fresh buffers that it fills from `out`, `lse` and `dlse` (None without a gradient of
    lse, as when the plan was built), and with FD_SINK the sink's gradient's parts into `sink_part`
    (`sink_parts_shape`), so it goes first."""
    rows, d, dv_block = ROWS.value, plan.d, plan.dv_block
    desc_q, desc_do = descriptor(q, rows, False, d), descriptor(dout, rows, False, dv_block)
    scalars = (*plan.scalars, alibi_slopes, plan.alibi_stride, *plan.variant.dropout_args(rng_state))
    p = plan.dq
    dq_args = _dq_args(desc_q, desc_do, k, v, dq, lse_pad, delta_pad, lse_pad, lse_pad, q, softmax_scale, scalars,
                       p.ints, False, d, plan.block_n, dv_block)
    if plan.fused:
        _launch(_attn_bwd_dq_gluon, p, p.grid,
                dq_args[:-len(_NOT_FUSED)] + _fused_args(out, lse, dlse, sink, sink_part), p.meta)
    p = plan.dkdv
    _launch(_attn_bwd_dkdv_gluon, p, p.grid, _dkdv_args(desc_q, desc_do, k, v, dk, dv, lse_pad, delta_pad, lse_pad,
                                                        lse_pad, q, softmax_scale, scalars, p.ints, False, d,
                                                        dv_block), p.meta)
    if not plan.fused:
        p = plan.dq
        _launch(_attn_bwd_dq_gluon, p, p.grid, dq_args, p.meta)


def compile_for_sm90(head_dim: int, causal: bool, config: dict, dtype: torch.dtype = torch.bfloat16,
                     kernel: str = "dkdv", varlen: bool = False, with_table: bool = True,
                     window_size: tuple = (-1, -1), softcap: float = 0.0, alibi: bool = False,
                     head_dim_v: int | None = None, dropout_p: float = 0.0, fused_delta: int = 0):
    """Compile the dK/dV or the dQ kernel for sm_90 without a GPU (as `forward_gluon_launch.compile_for_sm90`): for tests
    and `ptxas -v`. window_size / softcap / alibi (whether slopes are given): the variant, as a launch passes it;
    `head_dim_v`: V's head dim (default: head_dim); `dropout_p` > 0: the dropout build; `fused_delta`: the dQ
    kernel's FUSED_DELTA bits (FD_ON, FD_DLSE, FD_SINK)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    t = torch.empty(512, 4, head_dim, dtype=dtype) if varlen else torch.empty(2, 256, 4, head_dim, dtype=dtype)
    tv = torch.empty(*t.shape[:-1], head_dim_v, dtype=dtype)
    rows_t = torch.empty(4, 1024, dtype=torch.float32)
    variant = Variant.of(causal, True, window_size, softcap, alibi, dropout_p=dropout_p)
    _, _, meta = launch_parts(t.shape, t.shape, causal, True, config, kernel, 2 if varlen else None, 256, 256,
                              variant, head_dim_v, widths=product_widths(head_dim, head_dim_v),
                              dq_split=dq_split(head_dim))
    meta["WORK_TABLE"] = varlen and with_table  # varlen: programs from the work table, or the grid
    fn = _attn_bwd_dkdv_gluon if kernel == "dkdv" else _attn_bwd_dq_gluon
    for param in fn.params:  # constexprs a launch leaves at their defaults (DV_VALID)
        if param.is_constexpr and param.has_default and param.name not in meta:
            meta[param.name] = param.default
    # the variant's arguments that are off are None (constexprs), as `_variant_args` passes them
    _, window_left, window_right, cap = variant.scalars(1.0)
    scalars = {"window_left": window_left, "window_right": window_right, "softcap": cap}
    off = [name for name, value in scalars.items() if value is None] + ([] if alibi else ["ALIBI", "stride_alibi_b"])
    off += [] if dropout_p else ["DROPOUT_RNG", "dropout_threshold", "dropout_scale"]
    if kernel == "dq":  # FUSED_DELTA's arguments: None where it is off, as `_dq_args` passes them
        dlse_names, sink_names = ["DLSE", "stride_db", "stride_dh", "stride_dm"], ["SINK", "SINK_PART"]
        off += (["O", "LSE_IN", "stride_ob", "stride_om", "stride_oh", "stride_lib", "stride_lih"] + dlse_names
                + sink_names if not fused_delta else
                dlse_names * (not fused_delta & FD_DLSE) + sink_names * (not fused_delta & FD_SINK))
        if fused_delta:
            meta.update(FUSED_DELTA=fused_delta, DV_OUT=head_dim_v)
    meta.update(dict.fromkeys(off))
    options = {"num_warps": meta.pop("num_warps")}
    rows = ROWS.value
    kv_rows = rows if kernel == "dkdv" else config["BLOCK_N"]
    descriptors = {name: descriptor(tv if name in ("desc_v", "desc_do", "desc_dv") else t,
                                    kv_rows if name in ("desc_k", "desc_v") else rows, varlen,
                                    head_block(head_dim_v if name in ("desc_v", "desc_do", "desc_dv") else head_dim))
                   for name in ("desc_q", "desc_k", "desc_v", "desc_do", "desc_dk", "desc_dv", "desc_dq")}
    descriptors.update(desc_lse=row_descriptor(rows_t), desc_delta=row_descriptor(rows_t))
    element = "*bf16" if dtype == torch.bfloat16 else "*fp16"
    pointers = {"LSE": "*fp32", "DELTA": "*fp32", "ALIBI": "*fp32", "DK": element, "DV": element, "DQ": element,
                "O": element, "LSE_IN": "*fp32", "DLSE": "*fp32", "SINK": "*fp32", "SINK_PART": "*fp32",
                "CU_SEQLENS_Q": "*i32" if varlen else "*fp32", "CU_SEQLENS_K": "*i32" if varlen else "*fp32",
                "WORK": "*i32" if varlen else "*bf16" if dtype == torch.bfloat16 else "*fp16", "DROPOUT_RNG": "*i64"}
    names = fn.arg_names
    signature = {name: "constexpr" if name in meta else mangle_type(descriptors[name]) if name in descriptors
                 else pointers[name] if name in pointers
                 else "fp32" if name in ("softmax_scale", "qk_scale", "softcap", "dropout_scale")
                 else "i32" for name in names}
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in pointers
             if name in names and name not in meta and name not in ("ALIBI", "DLSE", "SINK")}  # (not specialized on
    # alignment)
    if kernel == "dq" and fused_delta:  # O's strides, specialized as a launch with aligned ones does
        attrs.update({(names.index(name),): [["tt.divisibility", 16]] for name in ("stride_ob", "stride_om",
                                                                                  "stride_oh")})
    source = GluonASTSource(fn, signature, constexprs=meta, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
