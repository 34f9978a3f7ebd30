"""Helpers for tests: the exact dropout keep-mask of a call, for small shapes.

A call with dropout_p > 0 draws an int64 (seed, offset) tensor (`ops.draw_dropout_state`) and every kernel derives
its mask from it with `kernels.variant.dropout_keep`. `record_dropout` collects those tensors in eager calls;
`dropout_mask` rebuilds the mask from one with the same device helper, so that a test can run the float64
reference (`reference.attention_reference(..., dropout_mask=...)`) on exactly the mask the kernels used:

    with flashtriton.testing.record_dropout() as calls:
        out = flashtriton.flash_attn_func(q, k, v, dropout_p=0.1)
    keep = flashtriton.testing.dropout_mask(calls[0], batch, nheads, seqlen_q, seqlen_k, 0.1)

Calls traced by torch.compile draw their state inside the graph and are not recorded.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from . import ops
from ._env import INTERPRET
from .kernels.host import cdiv
from .kernels.variant import dropout_keep, dropout_state, dropout_threshold

MASK_BLOCK = 32


@contextlib.contextmanager
def record_dropout():
    """Within the block, the rng_state tensors ((seed, offset), int64 (2,) on the inputs' device) of every eager
    call with dropout_p > 0, in call order, appended to the yielded list. Not thread-safe (a module-level
    record); nested blocks record into the innermost."""
    previous = ops.DROPOUT_RECORD
    calls: list = []
    ops.DROPOUT_RECORD = calls
    try:
        yield calls
    finally:
        ops.DROPOUT_RECORD = previous


@triton.jit
def _dropout_mask(RNG, OUT, threshold, SEQLEN_Q, SEQLEN_K, BLOCK: tl.constexpr):
    """OUT (B, Hq, Sq, Sk) int8: 1 where `dropout_keep` keeps score (i, j) of (b, h). Grid (query tiles, Hq, B)."""
    pid_m = tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    seed, offset = dropout_state(RNG)
    bh = off_b * tl.num_programs(1) + off_h
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    base = OUT + bh.to(tl.int64) * SEQLEN_Q * SEQLEN_K
    for n in range(0, SEQLEN_K, BLOCK):
        cols = n + tl.arange(0, BLOCK)
        keep = dropout_keep(seed, offset, bh, pid_m * BLOCK, n, threshold, BLOCK, BLOCK)
        ok = (rows[:, None] < SEQLEN_Q) & (cols[None, :] < SEQLEN_K)
        tl.store(base + rows[:, None] * SEQLEN_K + cols[None, :], keep.to(tl.int8), mask=ok)


def dropout_mask(rng_state, batch: int, heads: int, seqlen_q: int, seqlen_k: int, dropout_p: float,
                 device=None) -> torch.Tensor:
    """The keep-mask of a dropout call: bool (batch, heads, seqlen_q, seqlen_k), True where the probability was
    kept (then scaled by 1 / (1 - dropout_p)). rng_state: the call's int64 (seed, offset) tensor (`record_dropout`)
    or a (seed, offset) pair of ints; heads are the query heads. Varlen: batch is the number of sequences and
    the lengths their longest; sequence b's mask is [b, :, :len_q(b), :len_k(b)] (rows and keys count from each
    sequence's start). `device`: where the mask is returned (default: rng_state's); a kernel draws it, on the GPU
    for CPU tensors unless the interpreter is on. Materialises the whole mask: small shapes only."""
    if not isinstance(rng_state, torch.Tensor):
        rng_state = torch.tensor([int(x) for x in rng_state], dtype=torch.int64)
    device = rng_state.device if device is None else torch.device(device)
    # the mask is drawn by a Triton kernel: on the CPU only under the interpreter, else on a GPU, then moved
    run_on = device if (INTERPRET or device.type != "cpu") else (
        rng_state.device if rng_state.device.type != "cpu" else torch.device("cuda"))
    if run_on.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("testing.dropout_mask draws the mask with a Triton kernel: it needs a CUDA GPU, or "
                           "TRITON_INTERPRET=1 for CPU tensors")
    rng_state = rng_state.to(device=run_on, dtype=torch.int64).contiguous()
    out = torch.empty((batch, heads, seqlen_q, seqlen_k), dtype=torch.int8, device=run_on)
    if out.numel():
        _dropout_mask[(cdiv(seqlen_q, MASK_BLOCK), heads, batch)](
            rng_state, out, dropout_threshold(float(dropout_p)), seqlen_q, seqlen_k, BLOCK=MASK_BLOCK)
    return out.bool().to(device)
