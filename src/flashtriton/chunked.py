"""Attention over one (query chunk, key chunk) pair at given positions, its backward against the whole row's out
and lse, and the merge of partial results: the pieces of ring (context-parallel) attention.

A chunk pair is q (B, Sq, Hq, D) holding the queries at positions q_start .. q_start + Sq - 1 of a sequence and
k, v (B, Sk, Hkv, D / Dv) the keys at k_start .. k_start + Sk - 1. Query p sees key t iff

    causal:                  t <= p
    window_size (left, right):  p - left <= t <= p + right      (-1: unbounded on that side; causal: right 0)

(the whole sequence's mask, flash-attn's bottom-right alignment on it: a full call is the pair q_start = k_start
= 0). Each pair maps onto one call of the existing kernels: a pair nothing of which is visible runs nothing (out 0,
lse -inf); a fully visible one runs without a mask; the rest run with the diagonal and window the kernels take
(bottom-right or top-left, the window's sides shifted by the offset between the pair's diagonal and the kernel's;
leading keys no query sees are sliced off, and leading query rows that see no key, when the shift needs it).

    chunk_forward    -> (out, lse) of the pair: out normalised over the pair's keys, lse natural log (B, Hq, Sq)
    chunk_backward   -> dq, dk, dv of the pair from dout, q, k, v and the *global* out and lse (those of the
                        merged result over all keys: dS = P * (dP - rowsum(dO * O)) with P = exp(S - lse))
    merge_chunks     -> the merge of a list of (out, lse) partials over disjoint keys (flash_attn_combine)
    OnlineMerge      -> the same merge one partial at a time into fp32 running (out, lse), in place

None of them records autograd: they are the steps of a caller's own torch.autograd.Function (as
`flashtriton.parallel.ring_attention`'s).
"""

from __future__ import annotations

import math

import torch

from . import validation as V
from .combine import flash_attn_combine
from .kernels.backward import attention_backward
from .kernels.combine import combine_partials
from .kernels.forward import attention_forward
from .kernels.launch import on_inputs_device

OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------------------------
# The pair's mask, and the kernel call that expresses it
# --------------------------------------------------------------------------------------------------------------
def _sides(causal: bool, window_size: tuple[int, int]) -> tuple[float, float]:
    """(L, R): query p sees key t iff p - L <= t <= p + R; math.inf for an unbounded side."""
    left, right = window_size
    big_left = math.inf if left < 0 else left
    big_right = 0 if causal else (math.inf if right < 0 else right)
    return big_left, big_right


def pair_visibility(seqlen_q: int, seqlen_k: int, q_start: int, k_start: int, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1)) -> str:
    """'hidden' (no query of the pair sees a key of it), 'full' (every query sees every key) or 'partial'."""
    left, right = _sides(causal, V.check_window(window_size))
    d = q_start - k_start  # query row i meets key column i + d
    if seqlen_q == 0 or seqlen_k == 0 or seqlen_q - 1 + d + right < 0 or d - left > seqlen_k - 1:
        return "hidden"  # the last row ends before the first key, or the first row starts after the last
    if left >= seqlen_q - 1 + d and right >= seqlen_k - 1 - d:
        return "full"
    return "partial"


def _kernel_call(seqlen_q: int, seqlen_k: int, d: int, left: float, right: float):
    """How the kernels run a partial pair: (rows, keys, causal, bottom_right, window_size): the call on
    q[:, rows:], k[:, keys:] (leading rows / keys sliced off), the kernels' causal flag, their diagonal (Sk - Sq
    bottom-right, else 0) and window (the sides shifted by the difference between the pair's diagonal and the
    kernel's). Slicing the keys no query sees (a view) keeps the pair's mask; after slicing the rows that see no
    key too, the top-left diagonal always expresses it (row 0 sees some key and key 0 is seen: d - L <= 0 <= d + R)."""
    keys = max(0, d - left) if left != math.inf else 0
    d -= keys
    seqlen_k -= keys
    rows = 0
    for attempt in range(2):
        for diag in (seqlen_k - (seqlen_q - rows), 0):  # the kernels' bottom-right diagonal, then top-left
            if d - left <= diag <= d + right:
                new_left, new_right = left + diag - d, right + d - diag
                n = seqlen_q - rows + seqlen_k  # a side this long is no bound
                new_left = -1 if new_left >= n else int(new_left)
                new_right = -1 if new_right >= n else int(new_right)
                bottom_right = diag == seqlen_k - (seqlen_q - rows)
                if new_right == 0 and new_left == -1:
                    return rows, keys, True, bottom_right, (-1, -1)
                return rows, keys, new_right == 0, bottom_right, (new_left, new_right)
        if attempt == 0:  # slice off the leading rows that see no key
            rows = max(0, int(-d - right)) if right != math.inf else 0
            d += rows
    raise AssertionError("unreachable: the top-left diagonal expresses every trimmed pair")  # pragma: no cover


def _plan(seqlen_q, seqlen_k, q_start, k_start, causal, window_size):
    """None (hidden), or (rows, keys, causal, bottom_right, window_size) of the kernel call (`_kernel_call`; a
    full pair runs unmasked)."""
    kind = pair_visibility(seqlen_q, seqlen_k, q_start, k_start, causal, window_size)
    if kind == "hidden":
        return None
    if kind == "full":
        return 0, 0, False, True, (-1, -1)
    left, right = _sides(causal, window_size)
    return _kernel_call(seqlen_q, seqlen_k, q_start - k_start, left, right)


# --------------------------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------------------------
def _check_inputs(q, k, v, q_start, k_start, causal, window_size, softmax_scale, softcap):
    V.check_tensors(("q", "k", "v"), (q, k, v), 4, "(batch, seqlen, nheads, headdim)")
    V.check_same("batch sizes of q, k, v", q=q.shape[0], k=k.shape[0], v=v.shape[0])
    V.check_same("sequence lengths of k and v", k=k.shape[1], v=v.shape[1])
    V.check_heads_and_dims(q.shape[2], k.shape[2], q.shape[3], v.shape[3], v.shape[2], separate_v=True)
    V.check_same("head dims of q and k", q=q.shape[3], k=k.shape[3])
    V.check_scale("softmax_scale", softmax_scale, allow_negative=True)
    for name, value in (("q_start", q_start), ("k_start", k_start)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be a Python int (the chunk's first position), got {value!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    window_size, softcap = V.check_window(window_size), V.check_softcap(softcap)
    V.check_int32_offsets(("q", "k", "v"), (q, k, v), (q.shape[1], k.shape[1], v.shape[1]), v.shape[-1])
    V.check_grid(q.shape[0], q.shape[2])
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    return window_size, softcap, scale


def _check_buffer(name: str, buf, like: torch.Tensor, accumulate: bool) -> None:
    if buf is None:
        if accumulate:
            raise ValueError(f"accumulate=True adds into caller-provided dq, dk and dv: {name} is None")
        return
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(buf).__name__}")
    if tuple(buf.shape) != tuple(like.shape):
        raise ValueError(f"{name} must have shape {tuple(like.shape)} (like the tensor it is the gradient of), "
                         f"got {tuple(buf.shape)}")
    if buf.dtype not in OUT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {buf.dtype}")
    if buf.device != like.device:
        raise ValueError(f"{name} must be on {like.device} like the inputs, got {buf.device}")
    if any(st == 0 and n > 1 for st, n in zip(buf.stride(), buf.shape)):
        raise ValueError(f"{name} must not have a stride-0 (broadcast) dimension, got strides {buf.stride()}")


# --------------------------------------------------------------------------------------------------------------
# Forward and backward of a pair
# --------------------------------------------------------------------------------------------------------------
@on_inputs_device
def chunk_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int = 0, k_start: int = 0,
                  causal: bool = False, window_size: tuple[int, int] = (-1, -1), softmax_scale: float | None = None,
                  softcap: float = 0.0, out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a query chunk over a key chunk at the given positions (module docstring).

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), queries at positions q_start, q_start + 1, ...
        k, v: (batch, seqlen_k, nheads_k, headdim / headdim_v), keys at positions k_start, k_start + 1, ...
            Types, heads (GQA), head dims and strides as `flash_attn_func`.
        causal, window_size: the whole sequence's mask, on positions (see the module docstring).
        softmax_scale, softcap: as `flash_attn_func`.
        out_dtype: None (q's dtype) or torch.float32. The kernels write q's dtype; fp32 is that result widened
            (each partial is rounded once, and `OnlineMerge` / `merge_chunks` accumulate in fp32, so the error of
            the merged result does not grow with the number of chunks).
    Returns:
        out (batch, seqlen_q, nheads, headdim_v), normalised over the chunk's keys; lse (batch, nheads, seqlen_q)
        fp32, natural log. Rows that see no key of the chunk: out 0, lse -inf (what the merge ignores).
    """
    window_size, softcap, scale = _check_inputs(q, k, v, q_start, k_start, causal, window_size, softmax_scale,
                                                softcap)
    if out_dtype not in (None, q.dtype, torch.float32):
        raise TypeError(f"out_dtype must be None (q's dtype {q.dtype}) or torch.float32, got {out_dtype!r}")
    out_dtype = q.dtype if out_dtype is None else out_dtype
    q, k, v = (V.last_dim_contiguous(t) for t in (q, k, v))
    batch, seqlen_q, heads, _ = q.shape
    plan = _plan(seqlen_q, k.shape[1], q_start, k_start, causal, window_size)
    if plan is None:
        return (q.new_zeros((batch, seqlen_q, heads, v.shape[-1]), dtype=out_dtype),
                q.new_full((batch, heads, seqlen_q), float("-inf"), dtype=torch.float32))
    rows, keys, kernel_causal, bottom_right, kernel_window = plan
    if scale < 0:  # scale · q·k = |scale| · (-q)·k: the forward kernels keep a running maximum (interface.py)
        q, scale = -q, -scale
    out, lse = attention_forward(q[:, rows:], k[:, keys:], v[:, keys:], scale, kernel_causal, bottom_right,
                                 window_size=kernel_window, softcap=softcap)
    if out.dtype != out_dtype:
        out = out.to(out_dtype)
    if rows:  # the leading rows that see no key
        out = torch.cat([out.new_zeros((batch, rows, heads, out.shape[-1])), out], dim=1)
        lse = torch.cat([lse.new_full((batch, heads, rows), float("-inf")), lse], dim=2)
    return out, lse


@on_inputs_device
def chunk_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, q_start: int = 0, k_start: int = 0, causal: bool = False,
                   window_size: tuple[int, int] = (-1, -1), softmax_scale: float | None = None, softcap: float = 0.0,
                   dq: torch.Tensor | None = None, dk: torch.Tensor | None = None, dv: torch.Tensor | None = None,
                   accumulate: bool = False, dlse: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pair's share of the gradients of the merged attention (FlashAttention-2's backward on the pair).

    Arguments:
        dout, out: (batch, seqlen_q, nheads, headdim_v): the gradient of the merged output and the merged output
            itself (over *all* keys, not this chunk's), any float dtype.
        lse: (batch, nheads, seqlen_q) fp32, the merged log-sum-exp (natural log).
        q, k, v, q_start, k_start, causal, window_size, softmax_scale, softcap: as `chunk_forward`.
        dq, dk, dv: optional buffers shaped like q, k, v (float32 / float16 / bfloat16, any strides: views into
            larger accumulators are fine) to write the gradients into, else new tensors of q's dtype.
        accumulate: add into dq, dk, dv (all three given) instead of overwriting them, deterministically (each
            element has one writer). Where Hopper's Gluon backward takes the pair, it computes the pair's gradients
            in q's dtype and they are added to the buffers (one rounding per pair); the Triton kernels add their
            fp32 sums in the kernels.
        dlse: optional (batch, nheads, seqlen_q) fp32, the gradient of the merged lse (d lse_i / d s_ij = P_ij:
            it joins rowsum(dO ∘ O) in the kernels); the same for every key chunk of the rows.
    Returns:
        (dq, dk, dv): the buffers (or new tensors). GQA: dk, dv are summed over each kv head's query heads. The sum
        of the pairs' gradients over every key chunk is the gradient of the merged attention.
    """
    window_size, softcap, scale = _check_inputs(q, k, v, q_start, k_start, causal, window_size, softmax_scale,
                                                softcap)
    batch, seqlen_q, heads, head_dim_v = q.shape[0], q.shape[1], q.shape[2], v.shape[3]
    for name, t in (("dout", dout), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != (batch, seqlen_q, heads, head_dim_v):
            raise ValueError(f"{name} must have shape (batch, seqlen_q, nheads, headdim_v) = "
                             f"{(batch, seqlen_q, heads, head_dim_v)}, got {tuple(t.shape)}")
    if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32:
        raise TypeError("lse must be a float32 torch.Tensor (the merged log-sum-exp), got "
                        + (str(lse.dtype) if isinstance(lse, torch.Tensor) else type(lse).__name__))
    if tuple(lse.shape) != (batch, heads, seqlen_q):
        raise ValueError(f"lse must have shape (batch, nheads, seqlen_q) = {(batch, heads, seqlen_q)}, "
                         f"got {tuple(lse.shape)}")
    V.check_device(("q", "dout", "out", "lse"), (q, dout, out, lse))
    if dlse is not None:
        if not isinstance(dlse, torch.Tensor) or dlse.dtype != torch.float32 or tuple(dlse.shape) != tuple(lse.shape):
            raise TypeError(f"dlse must be a float32 torch.Tensor shaped like lse {tuple(lse.shape)}, got "
                            + (f"{dlse.dtype} {tuple(dlse.shape)}" if isinstance(dlse, torch.Tensor)
                               else type(dlse).__name__))
        V.check_device(("lse", "dlse"), (lse, dlse))
    if not isinstance(accumulate, bool):
        raise TypeError(f"accumulate must be a bool, got {type(accumulate).__name__}")
    for name, buf, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        _check_buffer(name, buf, like, accumulate)
    dq, dk, dv = (torch.empty_like(t) if b is None else b for b, t in ((dq, q), (dk, k), (dv, v)))
    q, k, v, dout, out = (V.last_dim_contiguous(t) for t in (q, k, v, dout, out))
    plan = _plan(seqlen_q, k.shape[1], q_start, k_start, causal, window_size)
    if plan is None:
        if not accumulate:
            dq.zero_(), dk.zero_(), dv.zero_()
        return dq, dk, dv
    rows, keys, kernel_causal, bottom_right, kernel_window = plan
    if not accumulate:  # what the kernels do not write: the sliced-off rows and keys
        dq[:, :rows].zero_(), dk[:, :keys].zero_(), dv[:, :keys].zero_()
    # (A negative scale needs no care here: the backward recomputes P from lse, with no running maximum.)
    attention_backward(dout[:, rows:], q[:, rows:], k[:, keys:], v[:, keys:], out[:, rows:], lse[:, :, rows:],
                       scale, kernel_causal, bottom_right, window_size=kernel_window, softcap=softcap,
                       dq=dq[:, rows:], dk=dk[:, keys:], dv=dv[:, keys:], accumulate=accumulate,
                       dlse=None if dlse is None else dlse[:, :, rows:])
    return dq, dk, dv


# --------------------------------------------------------------------------------------------------------------
# Merging partials
# --------------------------------------------------------------------------------------------------------------
def merge_chunks(outs, lses, out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over the union of disjoint key chunks from each chunk's (out, lse), in fp32
    (`flash_attn_combine`'s kernel; differentiable as it is).

    outs: a sequence of (batch, seqlen, nheads, headdim) tensors, any float dtype (`chunk_forward`'s out);
    lses: the matching (batch, nheads, seqlen) fp32 lse. Returns (out of out_dtype, default float32;
    lse (batch, nheads, seqlen) fp32). A chunk with lse -inf for a row adds nothing to it."""
    outs, lses = list(outs), list(lses)
    if not outs or len(outs) != len(lses):
        raise ValueError(f"outs and lses must be non-empty sequences of one length, got {len(outs)} and {len(lses)}")
    out_partial = torch.stack([o.float() for o in outs])  # (splits, B, S, H, D)
    lse_partial = torch.stack(list(lses)).transpose(2, 3)  # (splits, B, S, H), a view
    out, lse = flash_attn_combine(out_partial, lse_partial, out_dtype=out_dtype or torch.float32)
    return out, lse.transpose(1, 2)  # lse: (B, H, S), contiguous


class OnlineMerge:
    """Running fp32 (out, lse) of one query chunk, to which partial results over further keys are merged in place,
    one at a time (ring attention's forward: no list of partials is kept).

        acc = OnlineMerge(batch, seqlen, nheads, headdim_v, device)
        acc.add(out_1, lse_1)                 # chunk_forward's results, any float dtype
        acc.add(out_2, lse_2, rows=slice(8, 16))   # a partial for some rows only
        out, lse = acc.out, acc.lse           # (B, S, H, Dv) fp32, (B, H, S) fp32

    Rows never added to have out 0 and lse -inf. Each `add` copies the partial into a second slot of one
    (2, B, S, H, Dv) buffer and merges the two slots into the first with flash_attn_combine's kernel, which reads
    every split of a tile before it writes the tile, so that the result may overwrite its input."""

    def __init__(self, batch: int, seqlen: int, heads: int, head_dim: int, device):
        self._out = torch.zeros((2, batch, seqlen, heads, head_dim), dtype=torch.float32, device=device)
        self._lse = torch.full((2, batch, heads, seqlen), float("-inf"), dtype=torch.float32, device=device)
        self._empty = True

    @property
    def out(self) -> torch.Tensor:
        return self._out[0]

    @property
    def lse(self) -> torch.Tensor:
        return self._lse[0]

    def add(self, out: torch.Tensor, lse: torch.Tensor, rows: slice = slice(None)) -> None:
        """Merge a partial (out (B, S', H, Dv), lse (B, H, S')) over other keys into rows `rows` (S' of them)."""
        rows = slice(*rows.indices(self._out.shape[2]))
        if self._empty and rows == slice(0, self._out.shape[2], 1):  # the first partial over every row: a copy
            self._out[0].copy_(out)
            self._lse[0].copy_(lse)
            self._empty = False
            return
        self._empty = False
        parts, lses = self._out[:, :, rows], self._lse[:, :, :, rows]
        parts[1].copy_(out)
        lses[1].copy_(lse)
        combine_partials(parts, lses.transpose(2, 3), parts[0], lses[0].transpose(1, 2))
