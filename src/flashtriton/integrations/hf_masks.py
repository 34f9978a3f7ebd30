"""What a transformers mask function asks for, in the terms flashtriton's kernels can run — or a clear refusal.

transformers describes every layer's attention pattern as a *mask function* `f(batch, head, q_idx, kv_idx) -> bool`
on absolute positions (queries at q_offset .., keys at kv_offset ..), composed from pieces (`causal_mask_function`,
`sliding_window_overlay(w)`, `packed_sequence_mask_function(ids)`, model-specific overlays for image tokens or a
prefix-LM prefix...) and hands it to the mask interface registered under the implementation's name. flashtriton's
kernels run causal (bottom-right aligned) or full attention over each sequence's keys, with padding and packed
sequences, narrowed to a window around each query's own position (flash-attn's `window_size`). `analyse` decides
which of those a mask function is, and raises NotImplementedError for anything else:

- the plain pieces are recognised by identity (no cost);
- packed sequences (transformers' `packed_sequence_mask_function` over a causal or bidirectional base, windowed
  or not) give the per-token sequence ids;
- a causal mask narrowed by `sliding_window_overlay(w)` (key k visible to query q iff q - w < k <= q) is the
  window (w - 1, 0); a bidirectional one narrowed by `sliding_window_bidirectional_overlay(w)` (|q - k| <= w,
  ModernBERT's local attention) is (w, w). Both are decided exactly from the offsets: a window that hides no
  key of this call is dropped (the plain kernels run);
- any other function is evaluated at every (query, key) pair of the call — query rows in chunks, so memory
  stays bounded — and compared with causal and full attention, then with the band of keys around each query
  that it shows (a window). It is exact for any index-based function, model-specific overlays included, at the
  cost of one or two passes over the (batch, q, kv) grid per mask per forward (what the sdpa path pays to
  materialise it).

A refusal is an `Unexpressible` (a NotImplementedError) saying what the mask is and which feature is missing.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

CAUSAL, FULL = "causal", "full"
_CHUNK_ELEMENTS = 1 << 24  # (batch, q rows, kv) elements evaluated at once


class MaskSpec(NamedTuple):
    kind: str  # CAUSAL or FULL
    segments: Optional[torch.Tensor] = None  # (batch, seqlen) sequence ids of packed rows, or None
    derived: bool = False  # True when the kind came from analysing a composed function (not a plain piece)
    # flash-attn's window_size around each query's own position: query q sees key k iff q - left <= k <= q + right
    # (-1: unbounded on that side; causal: right 0); None when no key of this call lies outside it
    window: Optional[tuple[int, int]] = None


def analyse(mask_function: Optional[Callable], batch_size: int, q_length: int, kv_length: int, q_offset: int,
            kv_offset: int, use_vmap: bool = False, device=None, model_type: str = "") -> MaskSpec:
    """The MaskSpec of `mask_function` at this call's sizes and offsets; NotImplementedError if the kernels
    cannot express it."""
    from transformers import masking_utils as mu

    if mask_function is None or mask_function is mu.causal_mask_function:
        return MaskSpec(CAUSAL)
    if mask_function is getattr(mu, "bidirectional_mask_function", None):
        return MaskSpec(FULL)
    packed = _packed(mask_function, mu, q_length)
    if packed is not None:
        return packed
    leaves = _and_leaves(mask_function)
    plain = _windowed(leaves, mu) if leaves is not None else None
    if plain is not None:  # causal / bidirectional narrowed by transformers' own sliding-window overlays
        kind, band = plain
        return MaskSpec(kind, derived=True, window=_hidden_sides(kind, band, q_length, kv_length, q_offset, kv_offset))
    kind, window, witness = _evaluate(mask_function, batch_size, q_length, kv_length, q_offset, kv_offset, use_vmap,
                                      device)
    if kind is None:
        b, q, kv, value = witness
        raise Unexpressible(
            f"its mask is neither causal nor full attention over the keys, nor a window around each query (batch "
            f"{b}, query {q}, key {kv} is {'visible' if value else 'hidden'}: chunked attention, a prefix-LM prefix "
            "or bidirectional attention over image tokens)", "this attention pattern", model_type)
    return MaskSpec(kind, derived=True, window=window)


class Unexpressible(NotImplementedError):
    """A mask flashtriton's kernels cannot run: `what` it is, and the `feature` flashtriton lacks for it."""

    def __init__(self, what: str, feature: str, model_type: str = ""):
        self.what, self.feature = what, feature
        where = f" of this {model_type} model" if model_type else ""
        super().__init__(f"flashtriton cannot run the attention{where}: {what}. flashtriton does not support "
                         f"{feature} yet; load the model with attn_implementation='eager'.")


def _cells(fn: Callable) -> dict:
    """The variables a closure captured, by name ({} for a plain function)."""
    closure = getattr(fn, "__closure__", None) or ()
    return {name: cell.cell_contents for name, cell in zip(fn.__code__.co_freevars, closure)}


def _made_by(fn: Callable, factory: str) -> bool:
    return getattr(fn, "__qualname__", "").startswith(factory + ".<locals>.")


def _and_leaves(fn: Callable) -> Optional[list]:
    """The functions an `and_masks(...)` tree intersects (nested trees flattened), or None if fn is not one."""
    if not _made_by(fn, "and_masks"):
        return None
    leaves = []
    for part in _cells(fn).get("mask_functions", ()):
        sub = _and_leaves(part)
        leaves.extend(sub if sub is not None else [part])
    return leaves


def _windowed(leaves: list, mu) -> Optional[tuple[str, tuple[int, int]]]:
    """(CAUSAL, (w - 1, 0)) for leaves that are causal_mask_function and sliding_window_overlay(w)s (q - w < k
    <= q), (FULL, (w, w)) for bidirectional_mask_function and sliding_window_bidirectional_overlay(w)s (|q - k|
    <= w), (kind, (-1, -1)) for the plain piece alone; the narrowest window wins. None for anything else."""
    causal_windows = [f for f in leaves if _made_by(f, "sliding_window_overlay")]
    full_windows = [f for f in leaves if _made_by(f, "sliding_window_bidirectional_overlay")]
    for base, kind, windows, band in (
            (mu.causal_mask_function, CAUSAL, causal_windows, lambda w: (w - 1, 0)),
            (getattr(mu, "bidirectional_mask_function", None), FULL, full_windows, lambda w: (w, w))):
        if base is None or not all(f is base or f in windows for f in leaves):
            continue
        sizes = [_cells(f).get("sliding_window") for f in windows]
        if not all(isinstance(w, int) and not isinstance(w, bool) for w in sizes):
            return None
        if base not in leaves and not (kind == FULL and windows):  # a bare bidirectional overlay is one too
            return None
        if kind == CAUSAL and sizes and min(sizes) < 1:  # a window of 0 keys hides every key: not a band
            return None
        return kind, (band(min(sizes)) if sizes else (-1, -1))
    return None


def _hidden_sides(kind: str, band: tuple[int, int], q_length: int, kv_length: int, q_offset: int,
                  kv_offset: int) -> Optional[tuple[int, int]]:
    """The window `band` (around each query's own position; causal: right 0) with each side that hides no key
    of this call set to -1; None when no side hides one (causal: the left one)."""
    left, right = band
    last_query, last_key = q_offset + q_length - 1, kv_offset + kv_length - 1
    if left >= 0 and kv_offset >= last_query - left:  # the last query sees back to the first key
        left = -1
    if kind == CAUSAL:
        return None if left == -1 else (left, 0)
    if right >= 0 and last_key <= q_offset + right:  # the first query sees up to the last key
        right = -1
    return None if (left, right) == (-1, -1) else (left, right)


def _packed(fn: Callable, mu, seqlen: int) -> Optional[MaskSpec]:
    """Packed rows as transformers builds them: and_masks(base, packed_sequence_mask_function(sequence_ids))
    with base causal or bidirectional (narrowed by a sliding window or not), on positions remapped per sequence
    (`remap_positions_for_packed_sequence`) or on plain indices. Within a sequence the positions grow by one, so
    a window on positions is the same window on each sequence's tokens."""
    leaves = _and_leaves(fn)
    if leaves is None:
        return None
    ids = [f for f in leaves if _made_by(f, "packed_sequence_mask_function")]
    if len(ids) != 1:
        return None
    bases = []
    for f in leaves:
        if f in ids:
            continue
        if _made_by(f, "remap_positions_for_packed_sequence"):
            f = _cells(f).get("mask_function")
        sub = _and_leaves(f) if callable(f) else None
        bases.extend(sub if sub is not None else [f])
    plain = _windowed(bases, mu) if bases else None
    if plain is None:
        return None
    segments = _cells(ids[0]).get("packed_sequence_mask")
    if not isinstance(segments, torch.Tensor) or segments.dim() != 2:
        return None
    kind, band = plain  # a side that reaches past the row's length hides nothing within any of its sequences
    window = _hidden_sides(kind, band, seqlen, seqlen, 0, 0)
    return MaskSpec(kind, segments=segments, derived=True, window=window)


def _evaluate(fn, batch_size, q_length, kv_length, q_offset, kv_offset, use_vmap, device):
    """(kind, window, None): fn equals causal or full attention (window None), or one of them narrowed to the
    window of keys around each query it shows (flash-attn's (left, right) on positions, -1: unbounded), at every
    (batch, query, key) of the call. Else (None, None, (batch, query, key, value)) at a position where it
    differs from causal attention. One pass over the grid; a second one checks a window."""
    device = torch.device("cpu") if device is None else torch.device(device)
    batch = torch.arange(batch_size, device=device)
    head = torch.arange(1, device=device)
    kv = torch.arange(kv_length, device=device) + kv_offset
    rows = max(1, _CHUNK_ELEMENTS // max(1, batch_size * kv_length))

    def chunks():
        for start in range(0, q_length, rows):
            q = torch.arange(start, min(start + rows, q_length), device=device) + q_offset
            got = _call(fn, batch, head, q, kv, use_vmap).reshape(-1, 1, q.numel(), kv_length)
            yield q, got.to(torch.bool).expand(batch_size, 1, q.numel(), kv_length), kv[None, :] - q[:, None]

    causal_ok = full_ok = True
    witness, lowest, highest = None, None, None  # the visible keys' offsets from their query: kv - q
    for q, got, offset in chunks():
        causal = offset <= 0  # (q, kv) causal_mask_function on absolute positions
        causal_ok = causal_ok and bool(torch.equal(got, causal.expand_as(got)))
        full_ok = full_ok and bool(got.all())
        if witness is None and not causal_ok:
            b, _, i, j = (int(x) for x in torch.nonzero(got != causal.expand_as(got))[0])
            witness = (b, int(q[i]), int(kv[j]), bool(got[b, 0, i, j]))
        seen = got.any(0)[0]  # (q, kv): visible in some batch row
        if bool(seen.any()):
            lo, hi = int(offset[seen].min()), int(offset[seen].max())
            lowest, highest = lo if lowest is None else min(lowest, lo), hi if highest is None else max(highest, hi)
    if causal_ok or full_ok:
        return (CAUSAL if causal_ok else FULL), None, None
    if lowest is None or lowest > 0 or highest < 0:  # no band of keys around each query's own position
        return None, None, witness
    for _, got, offset in chunks():  # is it exactly the band [lowest, highest] around every query?
        band = (offset >= lowest) & (offset <= highest)
        if not bool(torch.equal(got, band.expand_as(got))):
            return None, None, witness
    kind = CAUSAL if highest == 0 else FULL
    window = _hidden_sides(kind, (-lowest, highest), q_length, kv_length, q_offset, kv_offset)
    return kind, window, None


def _call(fn, batch, head, q, kv, use_vmap: bool) -> torch.Tensor:
    """fn on the (batch, head, q, kv) grid: broadcast index tensors, or vmap for functions that index tensors
    with their arguments (as transformers' own sdpa mask does for custom overlays)."""
    if not use_vmap:
        try:
            return torch.as_tensor(fn(batch[:, None, None, None], head[None, :, None, None], q[None, None, :, None],
                                      kv[None, None, None, :]))
        except Exception:  # an overlay that is not broadcastable: fall back to vmap below
            pass
    from transformers import masking_utils as mu

    expand = getattr(mu, "_vmap_expansion_sdpa", None)
    if expand is None:  # pragma: no cover - very old or very new transformers
        raise NotImplementedError("flashtriton cannot evaluate this transformers mask function (no vmap expansion)")
    context = getattr(mu, "TransformGetItemToIndex", None)
    if context is None:
        return expand(fn)(batch, head, q, kv)
    with context():
        return expand(fn)(batch, head, q, kv)
