"""The merge of partial attention results through their log-sum-exps (FlashAttention-3's `fwd_combine`).

Split s of a row attended to its share of the keys: out_s (normalised over that share) and lse_s. The row's
attention over all keys is

    lse = log sum_s exp(lse_s),    out = sum_s exp(lse_s - lse) * out_s.

One program per (block of BLOCK_M rows, head, batch): a first loop over the splits reads only the lse (running max
and sum, so no split's exp overflows), a second reads each split's out tile once and accumulates it with its weight,
in fp32. A split with lse = -inf has weight 0 and contributes nothing, whatever its out holds (not even a NaN); a row
whose splits are all -inf gets out 0 and lse -inf (as FA3).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host import cdiv, next_power_of_2
from .launch import launch, on_inputs_device

LOG2E = tl.constexpr(1.4426950408889634)
TILE_ELEMENTS = 8192  # rows x padded head dim per program: 64 fp32 accumulators per thread at 4 warps


@triton.jit
def _combine(
    O_part, L_part, Out, Lse,
    stride_os, stride_ob, stride_om, stride_oh, stride_od,
    stride_ls, stride_lb, stride_lm, stride_lh,
    stride_out_b, stride_out_m, stride_out_h, stride_out_d,
    stride_lse_b, stride_lse_m, stride_lse_h,
    seqlen, head_dim, num_splits,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < seqlen
    rows = rows.to(tl.int64)

    # the splits' lse: running max and sum of exp(lse_s - max); each difference is taken before its scaling to
    # base 2 (the split at the max weighs exactly 1: a product folded into the subtraction would not cancel)
    l_ptrs = L_part + batch * stride_lb + head * stride_lh + rows * stride_lm
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for _ in range(num_splits):
        lse_s = tl.load(l_ptrs, mask=row_ok, other=float("-inf"))
        m_new = tl.maximum(m_i, lse_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: every term is 0
        l_i = l_i * tl.exp2((m_i - m_safe) * LOG2E) + tl.exp2((lse_s - m_safe) * LOG2E)
        m_i = m_new
        l_ptrs += stride_ls
    seen = l_i > 0
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)) / LOG2E, float("-inf"))

    # the splits' out, each weighted by exp(lse_s - lse)
    l_ptrs = L_part + batch * stride_lb + head * stride_lh + rows * stride_lm
    o_ptrs = (O_part + batch * stride_ob + head * stride_oh + rows[:, None] * stride_om
              + cols[None, :] * stride_od)
    tile_ok = row_ok[:, None] & (cols[None, :] < head_dim)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for _ in range(num_splits):
        lse_s = tl.load(l_ptrs, mask=row_ok, other=float("-inf"))
        w = tl.where(seen & (lse_s > float("-inf")), tl.exp2((lse_s - tl.where(seen, lse, 0.0)) * LOG2E), 0.0)
        o_s = tl.load(o_ptrs, mask=tile_ok & (w[:, None] > 0), other=0.0)
        acc += w[:, None] * o_s
        l_ptrs += stride_ls
        o_ptrs += stride_os

    out_ptrs = (Out + batch * stride_out_b + head * stride_out_h + rows[:, None] * stride_out_m
                + cols[None, :] * stride_out_d)
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=tile_ok)
    lse_ptrs = Lse + batch * stride_lse_b + head * stride_lse_h + rows * stride_lse_m
    tl.store(lse_ptrs, lse, mask=row_ok)


def _blocks(seqlen: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_D): the padded head dim, and rows up to TILE_ELEMENTS per program (at most 64, or the rows)."""
    block_d = next_power_of_2(head_dim)
    return max(1, min(64, TILE_ELEMENTS // block_d, next_power_of_2(seqlen))), block_d


@on_inputs_device
def combine_partials(out_partial: torch.Tensor, lse_partial: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor) -> None:
    """Write the merge of out_partial (splits, B, S, H, D) fp32 and lse_partial (splits, B, S, H) fp32 into out
    (B, S, H, D) and lse (B, S, H) fp32; any strides, splits >= 1 (checked by the caller)."""
    splits, batch, seqlen, heads, head_dim = out_partial.shape
    if batch * seqlen * heads == 0:
        return
    block_m, block_d = _blocks(seqlen, head_dim)
    launch(_combine, (cdiv(seqlen, block_m), heads, batch), (
        out_partial, lse_partial, out, lse,
        *out_partial.stride(), *lse_partial.stride(), *out.stride(), *lse.stride(),
        seqlen, head_dim, splits,
    ), dict(BLOCK_M=block_m, BLOCK_D=block_d, num_warps=4))


def compile_for_sm90(head_dim: int = 128, out_dtype: torch.dtype = torch.float16, seqlen: int = 4096):
    """The kernel compiled for sm_90 without a GPU, with a launch's constexprs (compiled.asm["ptx"]): for tests (the
    interpreter runs what Triton's compiler may refuse) and for reading registers (`ptxas -v`). Not under the
    interpreter."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    block_m, block_d = _blocks(seqlen, head_dim)
    meta = dict(BLOCK_M=block_m, BLOCK_D=block_d)
    out = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}[out_dtype]
    signature = {name: "constexpr" if name in meta else out if name == "Out" else "*fp32" if name in
                 ("O_part", "L_part", "Lse") else "i32" for name in _combine.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(_combine.arg_names) if signature[name][0] == "*"}
    return triton.compile(ASTSource(fn=_combine, signature=signature, constexprs=meta, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
