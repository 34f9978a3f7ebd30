"""Paged KV (`block_table`) and per-sequence key counts (`seqused_k`) in `flash_attn_varlen_func`: their checks.

Prefill over a prefix cache: the queries of many sequences, packed by cu_seqlens_q, attend to keys in a pool of
pages, k (num_pages, page_size, nheads_k, headdim) and v (num_pages, page_size, nheads_k, headdim_v); key j of
sequence b is row j % page_size of page block_table[b, j // page_size] (int32 (batch, pages per sequence)). The
sequence's key count is cu_seqlens_k[b + 1] - cu_seqlens_k[b] (flash-attn's rule with a block table: only the
differences matter), or seqused_k[b] (int32 (batch,)) where given, with or without pages. Forward only: neither
flash-attn nor flashtriton has a backward for these calls.

Shapes, dtypes and devices are checked here (a ValueError / TypeError naming the argument). The values of
block_table and seqused_k live on the GPU: the kernel checks them without a sync (`kernels.paged`: a sequence
with a value out of range reads nothing out of bounds and gets NaN in its out and lse rows), or, with
FLASHTRITON_CHECK_VALUES=1, `check_values` copies what it needs to the host once per call and raises a
ValueError instead (never while a CUDA graph is captured).
"""

from __future__ import annotations

import os

import torch

from . import validation as V
from .kernels.paged import KEY_LIMIT

# FLASHTRITON_CHECK_VALUES=1: the host checks of the device tensors' values instead of the kernels' NaN, here
# (`check_values`) and in flash_attn_with_kvcache (`kvcache_checks.check_values`; `flashtriton.kvcache.CHECK_VALUES`
# is this switch too). Read when a call runs, eager or compiled alike; never while a CUDA graph is captured.
CHECK_VALUES: bool = os.environ.get("FLASHTRITON_CHECK_VALUES", "0") == "1"

POOL_LAYOUT = "(num_pages, page_size, nheads_k, headdim) with block_table"


def check_pools(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q (total_q, nheads, headdim) and the page pools k, v: types, ranks, one dtype and device, the same pages."""
    V.check_tensors(("q",), (q,), 3, "(total_q, nheads, headdim)")
    V.check_tensors(("k", "v"), (k, v), 4, POOL_LAYOUT)
    if k.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    V.check_device(("q", "k", "v"), (q, k, v))
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"v must have the shape of k {tuple(k.shape)} but for its head dim (num_pages, page_size and "
                         f"nheads_k the same), got {tuple(v.shape)}")


def check_block_table(block_table, batch: int, k: torch.Tensor) -> torch.Tensor:
    """block_table: an int32 (batch, pages per sequence) tensor on k's device, its rows holding at most KEY_LIMIT
    keys -> the tensor with a contiguous last dim."""
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be an int32 torch.Tensor of shape (batch, max_num_pages), got "
                        f"{type(block_table).__name__}")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must have dtype torch.int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must have shape (batch, max_num_pages) with batch = {batch} (cu_seqlens_q's "
                         f"length - 1), got {tuple(block_table.shape)}")
    if block_table.device != k.device:
        raise ValueError(f"block_table must be on {k.device} like q, k and v, got {block_table.device}")
    V.check_not_transformed(("block_table",), (block_table,))
    capacity = block_table.shape[1] * k.shape[1]
    if capacity > KEY_LIMIT:
        raise ValueError(f"block_table's rows hold {block_table.shape[1]} pages of {k.shape[1]} keys = {capacity}, "
                         f"more than the {KEY_LIMIT} keys per sequence the kernel's int32 key positions allow")
    return V.last_dim_contiguous(block_table)


def check_seqused_k(seqused_k, batch: int, device: torch.device) -> torch.Tensor | None:
    """seqused_k: None, or an int32 (batch,) tensor on the inputs' device -> the tensor, contiguous."""
    if seqused_k is None:
        return None
    if not isinstance(seqused_k, torch.Tensor):
        raise TypeError(f"seqused_k must be an int32 torch.Tensor of shape (batch,) or None, got "
                        f"{type(seqused_k).__name__}")
    if seqused_k.dtype != torch.int32:
        raise TypeError(f"seqused_k must have dtype torch.int32, got {seqused_k.dtype}")
    if tuple(seqused_k.shape) != (batch,):
        raise ValueError(f"seqused_k must have shape (batch,) = ({batch},), got {tuple(seqused_k.shape)}")
    if seqused_k.device != device:
        raise ValueError(f"seqused_k must be on {device} like q, k and v, got {seqused_k.device}")
    V.check_not_transformed(("seqused_k",), (seqused_k,))
    return seqused_k.contiguous()


def grad_message(block_table, seqused_k, **tensors) -> str | None:
    """None where autograd needs no gradient of a paged or seqused_k call; else what its backward raises (there is
    none: flash-attn has none either), naming the tensors that require grad."""
    if not torch.is_grad_enabled():
        return None
    needing = [n for n, t in tensors.items() if t is not None and t.requires_grad]
    if not needing:
        return None
    given = " and ".join(n for n, t in (("block_table", block_table), ("seqused_k", seqused_k)) if t is not None)
    return (f"flash_attn_varlen_func with {given} is forward-only (no backward, as in flash-attn), but "
            f"{', '.join(needing)} require{'s' if len(needing) == 1 else ''} grad: its forward ran, a gradient "
            "through it cannot be computed; call it under torch.no_grad() or torch.inference_mode(), or pass "
            "detached tensors")


class ForwardOnly(torch.autograd.Function):
    """(out, lse) of a forward-only call whose inputs require grad, as flash-attn returns them: the forward's
    results (views, no copy), and a backward that raises `message` (never a silently wrong or missing
    gradient)."""

    @staticmethod
    def forward(ctx, message: str, out: torch.Tensor, lse: torch.Tensor, *inputs):
        ctx.message = message
        return out.view_as(out), lse.view_as(lse)

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(ctx.message)


def check_values(block_table, seqused_k, cu_seqlens_k: torch.Tensor, page_size: int, num_pages: int) -> None:
    """Host-side check of what the kernel checks on the GPU: one stacked device-to-host copy, a ValueError naming the
    argument whose value is out of range. page_size, num_pages: the pools' (unused without block_table)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return
    given = cu_seqlens_k[1:].long() - cu_seqlens_k[:-1].long()  # (B,) cu_seqlens_k's lengths
    lengths = given if seqused_k is None else seqused_k.long()
    if block_table is not None:
        limit = torch.full_like(lengths, block_table.shape[1] * page_size)
    else:
        limit = given
    stats = [lengths.min(), (lengths - limit).max()] if lengths.numel() else []
    if block_table is not None and block_table.numel():
        pages_needed = (lengths.clamp(min=0).minimum(limit) + page_size - 1) // page_size  # (B,)
        used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < pages_needed[:, None]
        entries = torch.where(used, block_table, 0)
        stats += [entries.min(), entries.max()]
    if not stats:
        return
    values = torch.stack([s.to(torch.int64) for s in stats]).tolist()
    name = "seqused_k" if seqused_k is not None else "cu_seqlens_k"
    if values[0] < 0:
        raise ValueError(f"{name} must give key counts >= 0, got a minimum of {values[0]}")
    if values[1] > 0:
        holds = (f"its block_table row ({block_table.shape[1]} pages of {page_size} keys)" if block_table is not None
                 else "its cu_seqlens_k length")
        raise ValueError(f"{name} gives a sequence {values[1]} keys more than {holds} holds")
    if len(values) > 2 and not (0 <= values[2] and values[3] < num_pages):
        raise ValueError(f"block_table entries used by the sequences must be in 0..{num_pages - 1} (pages of k), "
                         f"got values in {values[2]}..{values[3]}")
