"""Pieces every attention kernel shares: where a sequence lives, masked tile loads, the online-softmax step,
and the dot settings per dtype (the mask and block ranges are `variant`'s). `@triton.jit` helpers are inlined into the kernels that call them."""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from .._env import INTERPRET
from . import dispatch
from .host import capability
from .variant import alibi_bias, dropout_select, dropout_tile, softcap_scores, visible

try:  # host-side TMA descriptors (triton >= 3.4); without them the TMA paths are never taken
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

LOG2E = 1.4426950408889634


def dot_settings(dtype: torch.dtype) -> tuple[bool, str]:
    """(UPCAST_DOT, DOT_PRECISION) for an input dtype.

    fp32 inputs use the exact IEEE dot (no TF32 rounding): full fp32 accuracy, at CUDA-core speed.
    Under the interpreter bf16 tiles are upcast before tl.dot, whose bf16 path is wrong there.
    """
    upcast = INTERPRET and dtype == torch.bfloat16
    precision = "ieee" if dtype == torch.float32 else "tf32"
    return upcast, precision


@triton.jit
def sequence_bounds(CU_SEQLENS, off_b, SEQLEN, IS_VARLEN: tl.constexpr):
    """(first token, length) of sequence `off_b`. Varlen reads cu_seqlens (the launcher passes a zero batch
    stride); dense sequences start at token 0 of their batch entry (the batch stride locates them)."""
    if IS_VARLEN:
        start = tl.load(CU_SEQLENS + off_b)
        seqlen = tl.load(CU_SEQLENS + off_b + 1) - start
        start = start.to(tl.int64)
    else:
        start = 0
        seqlen = SEQLEN
    return start, seqlen


@triton.jit
def load_tile(ptrs, rows, n_rows, offs_d, MASK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Load a (rows, BLOCK_D) tile, zero outside [0, n_rows) x [0, HEAD_DIM)."""
    if MASK_ROWS:
        mask = rows[:, None] < n_rows
        if BLOCK_D != HEAD_DIM:
            mask = mask & (offs_d[None, :] < HEAD_DIM)
        return tl.load(ptrs, mask=mask, other=0.0)
    elif BLOCK_D != HEAD_DIM:
        return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def softmax_step(
    acc, l_i, m_i, qk, v, cols, offs_m, seqlen_k, diag, qk_scale,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr = False, left=0, right=0, HAS_SOFTCAP: tl.constexpr = False, softcap=0.0,
    HAS_ALIBI: tl.constexpr = False, slope=0.0,
    HAS_DROPOUT: tl.constexpr = False, seed=0, offset=0, bh=0, dropout_threshold=0, n=0, m0=0,
):
    """Fold one K/V tile into the running (acc, l_i, m_i): qk (BLOCK_M, BLOCK_N) are the raw scores Q Kᵀ of
    keys `cols` (n, n + 1, ...) for query rows `offs_m` (m0, m0 + 1, ...), v (BLOCK_N, BLOCK_D) their values. MASKED tiles hide keys past seqlen_k
    and the pairs the variant hides (`variant.visible`, diagonal `diag`); HAS_SOFTCAP caps the scores first
    (`variant.softcap_scores`), HAS_ALIBI then adds the row's bias (`variant.alibi_bias`). HAS_DROPOUT drops
    probabilities from P·V only (`variant.dropout_keep` of sequence-and-head `bh`): l_i sums them all, the
    softmax's denominator, and the caller scales the output by 1 / (1 - p)."""
    if HAS_SOFTCAP:
        qk = softcap_scores(qk, qk_scale, softcap, DOT_PRECISION != "ieee")  # fp32 inputs: the exact tanh
        qk_scale = 1.0
    if HAS_ALIBI:
        qk = qk * qk_scale + alibi_bias(offs_m[:, None], cols[None, :], diag, slope)
        qk_scale = 1.0
    if MASKED:
        keep = visible(cols[None, :] < seqlen_k, offs_m[:, None], cols[None, :], diag, IS_CAUSAL, HAS_WINDOW, left,
                       right)
        qk = tl.where(keep, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row that has seen no key yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN. (m_new
        # itself stays -inf: a finite stand-in would become the row's maximum, and the probabilities of its
        # first keys, exp2(s - 0), underflow in fp16 where its scores are all far below 0.)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        qk = qk - m_safe[:, None]
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_safe = m_new
        qk = qk * qk_scale - m_new[:, None]
    p = tl.math.exp2(qk)  # (BLOCK_M, BLOCK_N)
    alpha = tl.math.exp2(m_i - m_safe)  # rescales what was accumulated under the old max
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if HAS_DROPOUT:
        p = dropout_select(dropout_tile(seed, offset, bh, m0, n, offs_m.shape[0], cols.shape[0]),
                           dropout_threshold, p)
    if UPCAST_DOT:
        acc = tl.dot(p, v.to(tl.float32), acc, input_precision=DOT_PRECISION)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def softmax_finish(acc, l_i, m_i):
    """(out, lse) of the finished rows; rows that saw no key (causal with Sq > Sk): out 0, lse -inf, never NaN."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)  # base 2 -> e
    return out, lse


@triton.jit
def tma_tile(desc, off_b, row, off_h, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(BLOCK, HEAD_DIM) rows [row, row + BLOCK) of head off_h: dense descriptors are rank 4 over
    (B, S, H, D) (rows past S arrive as zeros), varlen ones rank 3 over (total, H, D) with `row` a token index
    (rows past the sequence belong to the next one, or are zeros past the tensor: the caller masks them)."""
    if IS_VARLEN:
        return desc.load([row, off_h, 0]).reshape(BLOCK, HEAD_DIM)
    else:
        return desc.load([off_b, row, off_h, 0]).reshape(BLOCK, HEAD_DIM)


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether the Hopper TMA kernels take these tensors: on unless the switch says `portable` (`dispatch.allows("tma")`), on
    sm_90, fp16/bf16, a head dim a TMA kernel declares (`TMA_HEAD_DIMS`), base addresses and strides 16-byte aligned (TMA's
    rules), nothing empty, no broadcast (stride-0) dimension. Off under the interpreter unless a test calls the TMA
    launchers directly."""
    t0 = tensors[0]
    if not tma_layout_ok(t0.device, t0.dtype, *((t.shape, t.stride()) for t in tensors)):
        return False
    return all(t.data_ptr() % 16 == 0 for t in tensors)


# The head dims a TMA kernel (the TMA forward, or the Gluon kernels' padded tiles) declares; each caller asks the
# dispatch for its own kernel too.
TMA_HEAD_DIMS = tuple(sorted(set(dispatch.BY_NAME["tma_fwd"].head_dims) | set(dispatch.BY_NAME["gluon_fwd"].head_dims)))


def tma_layout_ok(device: torch.device, dtype: torch.dtype, *shapes_and_strides) -> bool:
    """`tma_ok` without the base addresses: what the shapes, strides, dtype and device decide."""
    if (INTERPRET or not dispatch.allows("tma") or TensorDescriptor is None or device.type != "cuda"
            or dtype not in (torch.float16, torch.bfloat16) or capability(device)[0] != 9):
        return False
    return _tma_shapes_ok(TMA_HEAD_DIMS, dtype.itemsize, shapes_and_strides)


@functools.lru_cache(maxsize=4096)
def _tma_shapes_ok(head_dims: tuple, size: int, shapes_and_strides: tuple) -> bool:
    """What the shapes and strides decide, remembered: the backward asks on every call, about seven tensors."""
    for shape, strides in shapes_and_strides:
        if (shape[-1] not in head_dims or min(shape) == 0 or any(st * size % 16 for st in strides[:-1])
                or 0 in strides):  # a broadcast (expanded) dimension: the portable kernels read it as it is
            return False
    return True


# TensorDescriptor's __post_init__ re-checks what `tma_ok` already checked (aligned base and strides, sizes
# > 0) and the block shape (powers of two from configs): ~10 us per descriptor on a slow host CPU, four per
# forward. Where its fields are the ones known here, descriptors are built without it.
_DESCRIPTOR_FIELDS = ["base", "shape", "strides", "block_shape", "padding"]
_FAST_DESCRIPTOR = TensorDescriptor is not None and [f.name for f in dataclasses.fields(TensorDescriptor)] == \
    _DESCRIPTOR_FIELDS


def tma_descriptor(t: torch.Tensor, rows: int, varlen: bool):
    """Host descriptor of one (rows, head) slab of a (B, S, H, D) tensor — block (1, rows, 1, D) — or of a
    packed (total, H, D) one — block (rows, 1, D); `tma_tile` loads through it. `t` must pass `tma_ok`."""
    block = [rows, 1, t.shape[-1]] if varlen else [1, rows, 1, t.shape[-1]]
    if not _FAST_DESCRIPTOR or INTERPRET:
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block)
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides, desc.block_shape, desc.padding = t, list(t.shape), list(t.stride()), block, "zero"
    return desc


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """SMs of CUDA device `device_index`, queried once (a property query costs host time on every call)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count
