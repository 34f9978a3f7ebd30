"""What a transformers mask function asks for, in the terms flashtriton's kernels can run — or a clear refusal.

transformers describes every layer's attention pattern as a *mask function* `f(batch, head, q_idx, kv_idx) -> bool`
on absolute positions (queries at q_offset .., keys at kv_offset ..), composed from pieces (`causal_mask_function`,
`sliding_window_overlay(w)`, `packed_sequence_mask_function(ids)`, model-specific overlays for image tokens or a
prefix-LM prefix...) and hands it to the mask interface registered under the implementation's name. flashtriton's
kernels run causal (bottom-right aligned) or full attention over each sequence's keys, with padding and packed
sequences. `analyse` decides which of those a mask function is, and raises NotImplementedError for anything else:

- the plain pieces are recognised by identity (no cost);
- packed sequences (transformers' `packed_sequence_mask_function` over a causal or bidirectional base) give the
  per-token sequence ids;
- a causal mask narrowed by `sliding_window_overlay` is decided exactly from the offsets (the window either
  hides no key of this call, or the call is refused);
- any other function is evaluated at every (query, key) pair of the call — query rows in chunks, so memory
  stays bounded — and compared with causal and full attention. It is exact for any index-based function,
  model-specific overlays included, at the cost of one pass over the (batch, q, kv) grid per mask per forward
  (what the sdpa path pays to materialise it).

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


def analyse(mask_function: Optional[Callable], batch_size: int, q_length: int, kv_length: int, q_offset: int,
            kv_offset: int, use_vmap: bool = False, device=None, model_type: str = "") -> MaskSpec:
    """The MaskSpec of `mask_function` at this call's sizes and offsets; NotImplementedError if the kernels
    cannot express it."""
    from transformers import masking_utils as mu

    if mask_function is None or mask_function is mu.causal_mask_function:
        return MaskSpec(CAUSAL)
    if mask_function is getattr(mu, "bidirectional_mask_function", None):
        return MaskSpec(FULL)
    packed = _packed(mask_function, mu)
    if packed is not None:
        return packed
    leaves = _and_leaves(mask_function)
    if leaves is not None and _is_causal_window(leaves, mu):
        window = min(_cells(f)["sliding_window"] for f in leaves if f is not mu.causal_mask_function)
        last_query = q_offset + q_length - 1
        if kv_offset > last_query - window:  # every key this call holds lies inside every query's window
            return MaskSpec(CAUSAL, derived=True)
        raise Unexpressible(f"a sliding window of {window} keys over {kv_length} keys (the window hides "
                            f"key {kv_offset} from query {last_query})", "sliding-window attention", model_type)
    kind, witness = _evaluate(mask_function, batch_size, q_length, kv_length, q_offset, kv_offset, use_vmap, device)
    if kind is None:
        b, q, kv, value = witness
        raise Unexpressible(
            f"its mask is neither causal nor full attention over the keys (batch {b}, query {q}, key {kv} is "
            f"{'visible' if value else 'hidden'}: a sliding window, chunked attention, a prefix-LM prefix or "
            "bidirectional attention over image tokens)", "this attention pattern", model_type)
    return MaskSpec(kind, derived=True)


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


def _is_causal_window(leaves: list, mu) -> bool:
    windows = [f for f in leaves if _made_by(f, "sliding_window_overlay")]
    return bool(windows) and all(f is mu.causal_mask_function or f in windows for f in leaves) and (
        mu.causal_mask_function in leaves) and all(isinstance(_cells(f).get("sliding_window"), int) for f in windows)


def _packed(fn: Callable, mu) -> Optional[MaskSpec]:
    """Packed rows as transformers builds them: and_masks(base, packed_sequence_mask_function(sequence_ids))
    with base causal or bidirectional, on positions remapped per sequence (`remap_positions_for_packed_sequence`)
    or on plain indices."""
    leaves = _and_leaves(fn)
    if leaves is None:
        return None
    ids = [f for f in leaves if _made_by(f, "packed_sequence_mask_function")]
    bases = [_cells(f).get("mask_function") if _made_by(f, "remap_positions_for_packed_sequence") else f
             for f in leaves if f not in ids]
    kinds = {mu.causal_mask_function: CAUSAL, getattr(mu, "bidirectional_mask_function", None): FULL}
    if len(ids) != 1 or len(bases) != 1 or bases[0] not in kinds:
        return None
    segments = _cells(ids[0]).get("packed_sequence_mask")
    if not isinstance(segments, torch.Tensor) or segments.dim() != 2:
        return None
    return MaskSpec(kinds[bases[0]], segments=segments, derived=True)


def _evaluate(fn, batch_size, q_length, kv_length, q_offset, kv_offset, use_vmap, device):
    """(CAUSAL or FULL, None) if fn equals one of them at every (batch, query, key) of the call, else
    (None, (batch, query, key, value)) at a position where it differs from both."""
    device = torch.device("cpu") if device is None else torch.device(device)
    batch = torch.arange(batch_size, device=device)
    head = torch.arange(1, device=device)
    kv = torch.arange(kv_length, device=device) + kv_offset
    rows = max(1, _CHUNK_ELEMENTS // max(1, batch_size * kv_length))
    causal_ok = full_ok = True
    for start in range(0, q_length, rows):
        q = torch.arange(start, min(start + rows, q_length), device=device) + q_offset
        got = _call(fn, batch, head, q, kv, use_vmap).reshape(-1, 1, q.numel(), kv_length)
        got = got.to(torch.bool).expand(batch_size, 1, q.numel(), kv_length)
        causal = kv[None, :] <= q[:, None]  # (q, kv) causal_mask_function on absolute positions
        causal_ok = causal_ok and bool(torch.equal(got, causal.expand_as(got)))
        full_ok = full_ok and bool(got.all())
        if not (causal_ok or full_ok):
            b, _, i, j = (int(x) for x in torch.nonzero(got != causal.expand_as(got))[0])
            return None, (b, int(q[i]), int(kv[j]), bool(got[b, 0, i, j]))
    return (CAUSAL if causal_ok else FULL), None


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
