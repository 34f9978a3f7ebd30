"""Which scores exist and how they are changed: one description of the attention variant.

A `Variant` is a frozen host object. Query row i of a call sits at position `q_start + i` and key j at
`k_start + j`; the *diagonal* `d = q_start - k_start` is where a query meets its own position among the keys
(bottom-right alignment, flash-attn's: d = Sk - Sq; top-left, torch SDPA's: d = 0; ring attention passes
the real starts of its chunks). Query i sees key j iff

    causal:             j <= i + d
    window (left, right): i + d - left <= j <= i + d + right     (-1: unbounded on that side; causal: right 0)

That is the whole mask. Score changes (softcap, ALiBi, sinks) and dropout are fields too, so that every kernel
family, the float64 reference, the tests and the benchmarks' FLOP counts read one description. The kernels
take causal attention today; `require_supported` refuses any other field by name until a kernel declares it.

    1 1 1 1 0      causal, Sq = 2, Sk = 5, d = 3         1 1 1 0 0      window (1, 0), Sq = Sk = 5, d = 0
    1 1 1 1 1                                             0 1 1 1 0  (the diagonal and one key to its left)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass(frozen=True)
class Variant:
    causal: bool = False
    window: tuple[int, int] = (-1, -1)  # (left, right) keys around the diagonal; -1 = unbounded
    bottom_right: bool = True  # the default diagonal: Sk - Sq (flash-attn) or 0 (torch SDPA's top-left)
    softcap: float = 0.0  # scores -> softcap * tanh(scores / softcap); 0 = off
    dropout_p: float = 0.0
    alibi_slopes: Optional[torch.Tensor] = field(default=None, compare=False)  # (H,) or (B, H) fp32
    sinks: Optional[torch.Tensor] = field(default=None, compare=False)  # (H,) one extra logit per head

    def __post_init__(self):
        left, right = self.window
        if not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in (left, right)):
            raise ValueError(f"window_size must be two ints >= -1 (-1 = unbounded), got {self.window!r}")
        if self.causal and right > 0:
            raise ValueError(f"window_size={self.window!r} with causal=True: the right side must be 0 or -1")

    @property
    def right(self) -> int:
        """Keys visible to the right of the diagonal; -1 = unbounded."""
        return 0 if self.causal else self.window[1]

    @property
    def left(self) -> int:
        return self.window[0]

    @property
    def masks(self) -> bool:
        """Whether some (query, key) pair of a long enough call is hidden."""
        return self.left >= 0 or self.right >= 0

    def diagonal(self, seqlen_q: int, seqlen_k: int, q_start: Optional[int] = None,
                 k_start: Optional[int] = None) -> int:
        """d = q_start - k_start: explicit starts when given (both), else the default alignment."""
        if (q_start is None) != (k_start is None):
            raise ValueError("give both q_start and k_start, or neither")
        if q_start is not None:
            return q_start - k_start
        return seqlen_k - seqlen_q if self.bottom_right else 0

    def key_bounds(self, seqlen_q: int, seqlen_k: int, diagonal: Optional[int] = None):
        """(first, last) visible key of every query row: two int64 (Sq,) tensors; a row with none has
        first > last."""
        d = self.diagonal(seqlen_q, seqlen_k) if diagonal is None else diagonal
        rows = torch.arange(seqlen_q, dtype=torch.int64) + d
        first = (rows - self.left).clamp(min=0) if self.left >= 0 else torch.zeros_like(rows)
        last = (rows + self.right).clamp(max=seqlen_k - 1) if self.right >= 0 else torch.full_like(rows, seqlen_k - 1)
        return first, last

    def dense_mask(self, seqlen_q: int, seqlen_k: int, diagonal: Optional[int] = None, device=None) -> torch.Tensor:
        """(Sq, Sk) bool, True where query i sees key j: for the reference and the tests (small calls only)."""
        first, last = (t.to(device) for t in self.key_bounds(seqlen_q, seqlen_k, diagonal))
        keys = torch.arange(seqlen_k, device=device)[None, :]
        return (keys >= first[:, None]) & (keys <= last[:, None])

    def visible_pairs(self, seqlen_q: int, seqlen_k: int, diagonal: Optional[int] = None) -> int:
        """The number of (query, key) pairs the mask keeps, exactly (O(Sq) host work)."""
        first, last = self.key_bounds(seqlen_q, seqlen_k, diagonal)
        return int((last - first + 1).clamp(min=0).sum())

    def visible_flops(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                      mode: str = "fwd", head_dim_v: Optional[int] = None) -> float:
        """Matmul FLOPs over the visible pairs only: 2·D (QKᵀ) + 2·Dv (PV) per pair forward; the backward
        2.5× that, forward+backward 3.5× (the FlashAttention papers' ratios)."""
        dv = head_dim if head_dim_v is None else head_dim_v
        flops = 2.0 * batch * heads * self.visible_pairs(seqlen_q, seqlen_k) * (head_dim + dv)
        return flops * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]

    def mask_mod(self, seqlen_q: int, seqlen_k: int, diagonal: Optional[int] = None):
        """FlexAttention's `mask_mod(b, h, q_idx, kv_idx)` for this mask, or None when nothing is hidden."""
        if not self.masks:
            return None
        d = self.diagonal(seqlen_q, seqlen_k) if diagonal is None else diagonal
        left, right = self.left, self.right

        def mask_mod(b, h, q_idx, kv_idx):
            visible = kv_idx >= 0
            if right >= 0:
                visible = visible & (kv_idx <= q_idx + d + right)
            if left >= 0:
                visible = visible & (kv_idx >= q_idx + d - left)
            return visible

        return mask_mod

    def unsupported(self) -> list[str]:
        """The fields set to something no kernel runs yet, by their public argument names."""
        names = []
        if self.window != (-1, -1) and not (self.causal and self.window in ((-1, 0), (-1, -1))):
            names.append("window_size")
        if self.softcap:
            names.append("softcap")
        if self.dropout_p:
            names.append("dropout_p")
        if self.alibi_slopes is not None:
            names.append("alibi_slopes")
        if self.sinks is not None:
            names.append("learnable_sink")
        return names

    def require_supported(self) -> None:
        """NotImplementedError naming the first field the kernels do not run yet."""
        names = self.unsupported()
        if names:
            raise NotImplementedError(f"{names[0]} is not supported yet by flashtriton's kernels "
                                      f"(variant fields set: {', '.join(names)})")
