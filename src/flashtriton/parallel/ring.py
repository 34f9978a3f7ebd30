"""Ring attention over a group: each rank keeps its shard of the queries and passes K/V round the ring.

At step t rank r holds the K/V shard of rank r - t (mod world): it posts the exchange that brings the next one
(isend to r + 1, irecv from r - 1, `RingExchange`), attends its queries to the shard it holds while the bytes move
(`chunk_forward` at the two shards' positions) and merges the result into fp32 running (out, lse)
(`OnlineMerge`). The backward runs the same ring again: with the forward's global out and lse each step gives
the local dQ (accumulated in fp32 in place) and the held shard's dK/dV, which travel with an fp32 accumulator
round the ring behind the K/V, one hop per step, and arrive complete at their owner after the last step.

A step's work is planned from the two shards' positions (`step_calls`): pairs of segments nothing of which is
visible are skipped, and where the visible pairs form one block (zigzag: every step but the first; the first is
causal over the local order, which is the positions' order) they run as one kernel call. With the zigzag layout
and a causal mask every rank does the same work at every step.

Deterministic given the world size: the kernels are, and every sum runs in a fixed order.
"""

from __future__ import annotations

from typing import NamedTuple

import bisect

import torch

from .. import validation as V
from ..chunked import OnlineMerge, chunk_backward, chunk_forward, pair_visibility
from ..kernels.backward import attention_backward, preprocess
from ..kernels.forward import attention_forward
from .checks import check_documents, check_shards, documents_field, shard_fields
from .comm import RingExchange, agree, group_info, wait
from .layout import Segment, parts_per_rank, segments


class Call(NamedTuple):
    """One kernel call of a step: query rows and key rows of the shards, their first positions, the mask."""
    q_rows: slice
    k_rows: slice
    q_pos: int
    k_pos: int
    causal: bool
    window: tuple


def _rows(segs: list[Segment]) -> slice:
    return slice(segs[0].row, segs[-1].row + segs[-1].length)


def _adjacent(segs: list[Segment]) -> bool:
    return all(a.row + a.length == b.row for a, b in zip(segs[:-1], segs[1:]))


def step_calls(q_segs: list[Segment], k_segs: list[Segment], causal: bool, window: tuple) -> list[Call]:
    """The calls that attend queries at q_segs to keys at k_segs: none for hidden pairs; one unmasked call when
    the visible pairs are all fully visible and form one block of rows x keys; one causal call when both are
    the same segments in increasing positions (the local order is then the positions' order); else one call
    per visible pair, at its positions."""
    pairs = [(a, b) for a in q_segs for b in k_segs]
    kinds = {p: pair_visibility(p[0].length, p[1].length, p[0].pos, p[1].pos, causal, window) for p in pairs}
    seen = [p for p in pairs if kinds[p] != "hidden"]
    if not seen:
        return []
    rows = sorted({a for a, _ in seen}, key=lambda s: s.row)
    keys = sorted({b for _, b in seen}, key=lambda s: s.row)
    if (all(kinds[p] == "full" for p in seen) and len(seen) == len(rows) * len(keys)
            and _adjacent(rows) and _adjacent(keys)):
        return [Call(_rows(rows), _rows(keys), 0, 0, False, (-1, -1))]
    increasing = all(a.pos + a.length <= b.pos for a, b in zip(q_segs[:-1], q_segs[1:]))
    if causal and window[0] < 0 and q_segs == k_segs and increasing and _adjacent(q_segs):
        return [Call(_rows(q_segs), _rows(q_segs), 0, 0, True, (-1, -1))]
    return [Call(slice(a.row, a.row + a.length), slice(b.row, b.row + b.length), a.pos, b.pos, causal, window)
            for a, b in seen]


class DocCall(NamedTuple):
    """One varlen kernel call of a step that attends a rank's rows to its own keys: `rows` of the shard cut into
    pieces at `cuts` (local rows, from 0): each piece one document's positions inside one segment, attending to
    itself (the same positions on both sides: the kernels' per-sequence diagonal is the positions')."""
    rows: slice
    cuts: tuple
    max_len: int


def _doc_at(bounds: list[int], pos: int) -> tuple[int, int]:
    """(start, end) of the document holding position pos (bounds: the sorted document boundaries)."""
    i = bisect.bisect_right(bounds, pos) - 1
    while bounds[i + 1] <= pos:  # (empty documents share a boundary)
        i += 1
    return bounds[i], bounds[i + 1]


def doc_step_calls(q_segs: list[Segment], k_segs: list[Segment], bounds: list[int], causal: bool,
                   window: tuple) -> list:
    """`step_calls` for packed documents (boundaries `bounds` on positions: a query sees only its own document's
    keys). The shard's own keys (q_segs == k_segs) take one varlen call over every segment's document pieces,
    each segment attending to itself; two distinct segments share at most one document (it spans the gap between
    them): its two pieces, at their positions, are a `Call` unless nothing of them is visible."""
    if q_segs == k_segs:
        cuts = {0, _rows(q_segs).stop - _rows(q_segs).start}
        for seg in q_segs:
            cuts |= {seg.row - q_segs[0].row, seg.row - q_segs[0].row + seg.length}
            cuts |= {b - seg.pos + seg.row - q_segs[0].row for b in bounds if seg.pos < b < seg.pos + seg.length}
        cuts = tuple(sorted(cuts))
        calls = [DocCall(_rows(q_segs), cuts, max(b - a for a, b in zip(cuts[:-1], cuts[1:])))]
    else:
        calls = []
    for a in q_segs:
        for b in k_segs:
            if a == b and q_segs == k_segs:
                continue  # (in the DocCall)
            first, last = (b, a) if b.pos < a.pos else (a, b)
            start, end = _doc_at(bounds, first.pos + first.length - 1)  # the document at the end of the first
            if end <= last.pos:
                continue
            q0, q1 = max(start, a.pos), min(end, a.pos + a.length)
            k0, k1 = max(start, b.pos), min(end, b.pos + b.length)
            if pair_visibility(q1 - q0, k1 - k0, q0, k0, causal, window) == "hidden":
                continue
            q_rows = slice(a.row + q0 - a.pos, a.row + q1 - a.pos)
            calls.append(Call(q_rows, slice(b.row + k0 - b.pos, b.row + k1 - b.pos), q0, k0, causal, window))
    return calls


class _Spec(NamedTuple):
    group: object
    rank: int
    world: int
    layout: str
    causal: bool
    window: tuple
    scale: float
    softcap: float
    bounds: tuple | None  # packed documents' boundaries on positions, or None (one sequence per batch row)

    def calls(self, n: int, src: int) -> list:
        q_segs, k_segs = segments(self.layout, self.rank, self.world, n), segments(self.layout, src, self.world, n)
        if self.bounds is None:
            return step_calls(q_segs, k_segs, self.causal, self.window)
        return doc_step_calls(q_segs, k_segs, list(self.bounds), self.causal, self.window)

    def kernel_mask(self) -> tuple[bool, tuple]:
        """(causal, window_size) for the kernels on a document attending to itself (bottom-right = positions)."""
        left, right = self.window
        if self.causal or right == 0:
            return True, ((-1, -1) if left < 0 else (left, 0))
        return False, self.window


def _docs_forward(c: DocCall, q, k, v, spec: _Spec):
    """(out (rows, H, Dv), lse (H, rows)) of a DocCall on q, k, v (rows, H, D)."""
    cu = torch.tensor(c.cuts, dtype=torch.int32, device=q.device)
    causal, window = spec.kernel_mask()
    scale = spec.scale
    if scale < 0:  # the forward kernels keep a running maximum: negate q instead (interface.py)
        q, scale = -q, -scale
    return attention_forward(q, k, v, scale, causal, True, cu, cu, c.max_len, c.max_len, window_size=window,
                             softcap=spec.softcap)


def _pack(k: torch.Tensor, v: torch.Tensor, dtype=None) -> torch.Tensor:
    """K and V in one flat buffer (one message a step), or an empty one of their sizes when `dtype` is given."""
    if dtype is not None:
        return torch.empty(k.numel() + v.numel(), dtype=dtype, device=k.device)
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(buf: torch.Tensor, k_shape, v_shape) -> tuple[torch.Tensor, torch.Tensor]:
    n = k_shape.numel()
    return buf[:n].view(k_shape), buf[n:].view(v_shape)


def _ring_forward(q, k, v, sink, spec: _Spec):
    batch, n, heads, _ = q.shape
    acc = OnlineMerge(batch, n, heads, v.shape[-1], q.device)
    ring = RingExchange(spec.group, spec.rank, spec.world) if spec.world > 1 else None
    kv = _pack(k, v) if ring else None
    spare = torch.empty_like(kv) if ring else None
    for step in range(spec.world):
        src = (spec.rank - step) % spec.world
        requests = ring.start(kv, spare) if step + 1 < spec.world else None  # the next shard moves meanwhile
        k_s, v_s = _unpack(kv, k.shape, v.shape) if ring else (k, v)
        for c in spec.calls(n, src):
            if isinstance(c, DocCall):
                out, lse = _docs_forward(c, q[0, c.rows], k_s[0, c.rows], v_s[0, c.rows], spec)
                acc.add(out[None], lse[None], rows=c.rows)
                continue
            part = chunk_forward(q[:, c.q_rows], k_s[:, c.k_rows], v_s[:, c.k_rows], c.q_pos, c.k_pos, c.causal,
                                 c.window, spec.scale, spec.softcap)
            acc.add(*part, rows=c.q_rows)
        if requests:
            wait(requests)
            kv, spare = spare, kv
    out, lse = acc.out, acc.lse
    if sink is not None:  # one more logit per head with a zero value: lse' = log(e^lse + e^sink), out scaled
        lse_keys, lse = lse, torch.logaddexp(lse, sink.float()[None, :, None])
        out = out * torch.exp(lse_keys - lse).transpose(1, 2)[..., None]
    return out.to(q.dtype), lse.clone()


def _ring_backward(dout, dlse, q, k, v, out, lse, sink, spec: _Spec):
    """dq, dk, dv (and dsink) of this rank's shards from the gradients of its rows' out and lse (dlse: None, or
    (batch, nheads, n) fp32: d lse_i / d s_ij = P_ij joins rowsum(dO ∘ O) in every chunk's kernels)."""
    n = q.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    ring = RingExchange(spec.group, spec.rank, spec.world) if spec.world > 1 else None
    kv = _pack(k, v)
    kv_spare = torch.empty_like(kv) if ring else None
    dkv = torch.zeros(kv.numel(), dtype=torch.float32, device=q.device)  # the held shard's dK, dV so far
    dkv_spare, scratch = (_pack(k, v, torch.float32), _pack(k, v, torch.float32)) if ring else (None, None)
    dkv_requests = None
    for step in range(spec.world):
        src = (spec.rank - step) % spec.world
        kv_requests = ring.start(kv, kv_spare, tag=0) if step + 1 < spec.world else None
        k_s, v_s = _unpack(kv, k.shape, v.shape)
        calls = spec.calls(n, src)
        target = dkv if step == 0 else scratch.zero_()  # later steps: this rank's share, added when src's arrives
        dk_t, dv_t = _unpack(target, k.shape, v.shape)
        for c in calls:
            if isinstance(c, DocCall):
                _docs_backward(c, dout, dlse, q, k_s, v_s, out, lse, spec, dq, dk_t, dv_t)
                continue
            chunk_backward(dout[:, c.q_rows], q[:, c.q_rows], k_s[:, c.k_rows], v_s[:, c.k_rows], out[:, c.q_rows],
                           lse[:, :, c.q_rows], c.q_pos, c.k_pos, c.causal, c.window, spec.scale, spec.softcap,
                           dq=dq[:, c.q_rows], dk=dk_t[:, c.k_rows], dv=dv_t[:, c.k_rows], accumulate=True,
                           dlse=None if dlse is None else dlse[:, :, c.q_rows])
        if step > 0:
            wait(dkv_requests)  # dkv_spare: src's accumulator, from the previous rank
            if calls:
                dkv_spare += scratch
            dkv, dkv_spare = dkv_spare, dkv
        if ring:
            dkv_requests = ring.start(dkv, dkv_spare, tag=1)  # on to the next rank; the previous rank's comes in
        if kv_requests:
            wait(kv_requests)
            kv, kv_spare = kv_spare, kv
    if ring:
        wait(dkv_requests)  # after the last hop: this rank's own dK, dV
        dkv = dkv_spare
    dk, dv = _unpack(dkv, k.shape, v.shape)
    dsink = None
    if sink is not None:  # this rank's rows' share: dsink_h = -sum_{b,i} exp(sink_h - lse) (rowsum(dO * O) - dlse)
        dsink = preprocess(out, dout, lse.contiguous(), dlse=dlse, sink=sink)[2]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink


def _docs_backward(c: DocCall, dout, dlse, q, k, v, out, lse, spec: _Spec, dq, dk, dv) -> None:
    """Add a DocCall's gradients into dq, dk, dv ((1, n, H, D) fp32; the rest (1, n, ...) too, lse and dlse
    (1, H, n), dlse None where lse has no gradient)."""
    cu = torch.tensor(c.cuts, dtype=torch.int32, device=q.device)
    causal, window = spec.kernel_mask()
    r = c.rows
    attention_backward(dout[0, r], q[0, r], k[0, r], v[0, r], out[0, r], lse[0, :, r], spec.scale, causal, True, cu,
                       cu, c.max_len, c.max_len, zero_fill=False, window_size=window, softcap=spec.softcap,
                       dq=dq[0, r], dk=dk[0, r], dv=dv[0, r], accumulate=True,
                       dlse=None if dlse is None else dlse[0, :, r])


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, spec):
        out, lse = _ring_forward(q, k, v, sink, spec)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.spec = spec
        ctx.set_materialize_grads(False)  # an unused out or lse has no gradient: None, no zeros to read
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dlse = None if dlse is None else dlse.float()
        dq, dk, dv, dsink = _ring_backward(dout, dlse, q, k, v, out, lse, sink, ctx.spec)
        return dq, dk, dv, dsink, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, group=None,
                   layout: str = "zigzag", softmax_scale: float | None = None,
                   window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                   cu_seqlens: torch.Tensor | None = None, return_lse: bool = False,
                   learnable_sink: torch.Tensor | None = None):
    """Exact attention over a sequence sharded over the ranks of `group` (ring attention).

    Arguments:
        q: (batch, seqlen / world, nheads, headdim), this rank's shard of the queries (`shard(x, group, layout)`).
        k, v: (batch, seqlen / world, nheads_k, headdim / headdim_v), its shards of the keys and values (GQA:
            only the nheads_k heads travel). Types, head dims and strides as `flash_attn_func`.
        causal, window_size, softcap, softmax_scale: as `flash_attn_func` on the whole sequence (causal and the
            window on positions).
        group: a torch.distributed process group (None: the default one) whose backend moves the tensors (NCCL
            for CUDA tensors, gloo for CPU ones).
        layout: "zigzag" (rank r holds chunks r and 2·world - 1 - r of 2·world: equal causal work everywhere;
            seqlen / world even) or "contiguous" (rank r holds chunk r of world).
        cu_seqlens: packed documents (flash_attn_varlen_func's layout): q (total / world, nheads, headdim), k and
            v (total / world, nheads_k, ...) are this rank's shards of the packed tokens (`shard(x, group, layout,
            dim=0)`), and cu_seqlens the int32 boundaries of the documents in the *whole* packed sequence, from 0
            to total, the same on every rank (any device; read once on the host). A query sees only its own
            document's keys (causal and the window within it, on positions). Documents may have any lengths and
            cross shard boundaries.
        learnable_sink: (nheads,) attention sinks, as `flash_attn_func`'s (one logit per query head in every
            row's softmax denominator), the same on every rank; differentiable: each rank's gradient is its rows'
            share (a replicated parameter's, which data-parallel training sums or averages over the ranks).
        return_lse: also return the log-sum-exp (natural log, fp32; (batch, nheads, seqlen / world), with
            cu_seqlens (nheads, total / world)), differentiable (its gradient joins every chunk's backward).
    Returns:
        out: (batch, seqlen / world, nheads, headdim_v) (with cu_seqlens: (total / world, nheads, headdim_v)),
        this rank's shard of the output (`unshard` rebuilds it); (out, lse) with return_lse.

    Collective: every rank of the group calls it with shards of one shape and dtype and the same options. Each
    checks its own arguments, then one all_gather of a small tensor compares all ranks' (`comm.agree`), so that
    bad input raises on every rank before anything moves, never a hang. Differentiable (the backward is another
    ring: dK, dV return to their owner); deterministic given the world size; not traced by torch.compile.
    """
    group, rank, world = group_info(group)
    error, bounds = None, None
    try:
        if not isinstance(return_lse, bool):
            raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
        if cu_seqlens is not None:
            bounds = check_documents(cu_seqlens, q, k, v, world)
            q, k, v = q[None], k[None], v[None]
        window, softcap, scale, layout = check_shards(q, k, v, group, causal, window_size, softmax_scale, softcap,
                                                      layout)
        learnable_sink = V.check_sink(learnable_sink, q.shape[2], q.dtype, q.device)
        if q.shape[1] % parts_per_rank(layout) or q.shape[1] == 0:
            raise ValueError(f"q's shard ({q.shape[1]} positions) must be a positive multiple of "
                             f"{parts_per_rank(layout)} for layout={layout!r} (the sequence a multiple of "
                             f"{parts_per_rank(layout) * world})")
    except (TypeError, ValueError, NotImplementedError, RuntimeError) as e:
        error = e
    fields = {} if error else {**shard_fields(q, k, v, causal, window, softcap, scale, layout, learnable_sink),
                               "cu_seqlens": -1 if bounds is None else documents_field(bounds)}
    agree(group, q.device if isinstance(q, torch.Tensor) else None, "ring_attention", fields, error)
    q, k, v = (V.last_dim_contiguous(t) for t in (q, k, v))
    spec = _Spec(group, rank, world, layout, causal, window, scale, softcap, None if bounds is None else tuple(bounds))
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, learnable_sink)):
        out, lse = _RingAttention.apply(q, k, v, learnable_sink, spec)
    else:
        out, lse = _ring_forward(q, k, v, learnable_sink, spec)
    if bounds is not None:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out
