"""Which scores exist and how they are changed: one description of the attention variant.

A `Variant` is a frozen host object. Query row i of a call sits at position `q_start + i` and key j at
`k_start + j`; the *diagonal* `d = q_start - k_start` is where a query meets its own position among the keys
(bottom-right alignment, flash-attn's: d = Sk - Sq; top-left, torch SDPA's: d = 0; ring attention passes
the real starts of its chunks). Query i sees key j iff

    causal:             j <= i + d
    window (left, right): i + d - left <= j <= i + d + right     (-1: unbounded on that side; causal: right 0)

That is the whole mask. Score changes (softcap, ALiBi, sinks) and dropout are fields too, so that every kernel
family, the float64 reference, the tests and the benchmarks' FLOP counts read one description. The kernels
declare the fields they run (`dispatch.KERNELS`); `require_supported` refuses by name a field that none declares.

    1 1 1 1 0      causal, Sq = 2, Sk = 5, d = 3         1 1 1 0 0      window (1, 0), Sq = Sk = 5, d = 0
    1 1 1 1 1                                             0 1 1 1 0  (the diagonal and one key to its left)
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import triton
import triton.language as tl


LOG2E = 1.4426950408889634
# Whether the kernels compile to PTX (a GPU), so that inline PTX may stand for a longer form the interpreter runs
PTX = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")
# Rounds of the dropout generator's Philox4x32 (`dropout_fields`): seven, as FlashAttention-2's and PyTorch's flash
# kernels draw their masks (Philox4x32-7 passes TestU01's BigCrush, Salmon et al., SC 2011). The rounds' integer
# multiplies and logic share the softmax's issue slots: against Philox4x32-10's ten, the Gluon kernels' dropout
# forward runs 1.13-1.22x faster and its backward 1.05-1.14x (benchmarks/2026-12-06-h100/dropout-rounds/).
DROPOUT_ROUNDS = tl.constexpr(7)
WINDOW_UNBOUNDED = 1 << 30  # a window side without bound, as the kernels take it (indices stay within int32)
ALIBI_GIVEN = torch.empty(0)  # `Variant.of`'s stand-in for slopes or sinks that the launcher passes to the kernels


def alibi_batch_stride(alibi_slopes) -> int | None:
    """The kernels' `stride_alibi_b` of flash-attn's slopes: their batch stride ((batch, nheads)), 0 for (nheads,)
    (one row for every batch entry), None without slopes (a constexpr)."""
    if alibi_slopes is None:
        return None
    return alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0


@dataclass(frozen=True)
class Variant:
    causal: bool = False
    window: tuple[int, int] = (-1, -1)  # (left, right) keys around the diagonal; -1 = unbounded
    bottom_right: bool = True  # the default diagonal: Sk - Sq (flash-attn) or 0 (torch SDPA's top-left)
    softcap: float = 0.0  # scores -> softcap * tanh(scores / softcap); 0 = off
    dropout_p: float = 0.0
    alibi_slopes: Optional[torch.Tensor] = field(default=None, compare=False)  # (H,) or (B, H) fp32
    sinks: Optional[torch.Tensor] = field(default=None, compare=False)  # (H,) one extra logit per head
    # Whether the two tensors are given: part of equality and the hash (the tensors' values are not), so that
    # launch plans cached per variant never serve a call with ALiBi or sinks a plan made without them.
    has_alibi: bool = field(default=False, init=False)
    has_sinks: bool = field(default=False, init=False)

    def __post_init__(self):
        object.__setattr__(self, "has_alibi", self.alibi_slopes is not None)
        object.__setattr__(self, "has_sinks", self.sinks is not None)
        left, right = self.window
        if not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in (left, right)):
            raise ValueError(f"window_size must be two ints >= -1 (-1 = unbounded), got {self.window!r}")
        if not (isinstance(self.softcap, (int, float)) and math.isfinite(self.softcap) and self.softcap >= 0):
            raise ValueError(f"softcap must be a finite number >= 0 (0: off), got {self.softcap!r}")
        if not (isinstance(self.dropout_p, (int, float)) and 0 <= self.dropout_p < 1):
            raise ValueError(f"dropout_p must be a number in [0, 1) (0: off), got {self.dropout_p!r}")

    @staticmethod
    @functools.lru_cache(maxsize=4096)
    def of(causal: bool, bottom_right: bool = True, window: tuple = (-1, -1), softcap: float = 0.0,
           alibi: bool = False, sinks: bool = False, dropout_p: float = 0.0) -> "Variant":
        """The variant of the launchers' arguments (flash-attn's `causal`, `causal_bottom_right`, `window_size`,
        `softcap`, `dropout_p`; `alibi` / `sinks`: whether slopes / sinks are given, the launchers pass the tensors
        to the kernels themselves):
        one shared instance each, so that a launch pays a dictionary lookup for it."""
        return Variant(causal=bool(causal), bottom_right=bool(bottom_right), window=tuple(window),
                       softcap=float(softcap), dropout_p=float(dropout_p), alibi_slopes=ALIBI_GIVEN if alibi else None,
                       sinks=ALIBI_GIVEN if sinks else None)

    @functools.cached_property
    def constexprs(self) -> dict:
        """The constexprs every attention kernel (Triton and Gluon) takes for this variant; do not modify."""
        return {"IS_CAUSAL": self.causal, "CAUSAL_BOTTOM_RIGHT": self.bottom_right}

    @functools.cached_property
    def score_constexprs(self) -> dict:
        """The constexprs of the kernels that declare windows and softcap (the portable ones); do not modify."""
        return {"HAS_WINDOW": "window_size" in self.fields(), "HAS_SOFTCAP": bool(self.softcap),
                "HAS_ALIBI": self.alibi_slopes is not None}

    @functools.cached_property
    def forward_constexprs(self) -> dict:
        """The variant's constexprs as the forward kernels (portable, TMA, Gluon) take them; do not modify."""
        return {**self.constexprs, **self.score_constexprs, "HAS_SINKS": self.has_sinks}

    @functools.cached_property
    def dropout_constexprs(self) -> dict:
        """The portable kernels' dropout constexpr (HAS_DROPOUT); do not modify."""
        return {"HAS_DROPOUT": bool(self.dropout_p)}

    def dropout_args(self, rng_state=None) -> tuple:
        """(DROPOUT_RNG, dropout_threshold, dropout_scale) as the portable kernels take them: the call's int64
        (seed, offset) tensor, the 16-bit threshold below which a score is dropped (`dropout_threshold`) and
        1 / (1 - p); None for each without dropout (constexprs: the kernels compile without them)."""
        if not self.dropout_p:
            return None, None, None
        return rng_state, dropout_threshold(self.dropout_p), 1.0 / (1.0 - self.dropout_p)

    def forward_args(self, softmax_scale: float, alibi_slopes=None, learnable_sink=None) -> tuple:
        """The variant's runtime arguments as the forward kernels take them after their cu_seqlens: (qk_scale,
        window_left, window_right, softcap, ALIBI, stride_alibi_b, SINKS), None for what is off (a constexpr: the
        kernel compiles without it)."""
        return (*self.scalars(softmax_scale), alibi_slopes, alibi_batch_stride(alibi_slopes), learnable_sink)

    def scalars(self, softmax_scale: float) -> tuple:
        """(qk_scale, window_left, window_right, softcap) as those kernels take them: qk_scale = softmax_scale ·
        log2(e), or softmax_scale / softcap with the cap (then softcap · log2(e), `softcap_scores`); the window's
        sides with an unbounded one as WINDOW_UNBOUNDED (causal: right 0); None for what is off."""
        left = right = cap = None
        if "window_size" in self.fields():
            left = WINDOW_UNBOUNDED if self.left < 0 else self.left
            right = WINDOW_UNBOUNDED if self.right < 0 else self.right
        if self.softcap:
            return softmax_scale / self.softcap, left, right, self.softcap * LOG2E
        return softmax_scale * LOG2E, left, right, cap

    @property
    def right(self) -> int:
        """Keys visible to the right of the diagonal; -1 = unbounded. Causal makes it 0, whatever the window says
        (flash-attn's rule)."""
        return 0 if self.causal else self.window[1]

    @property
    def left(self) -> int:
        return self.window[0]

    def band(self, seqlen_k: int) -> int:
        """The most keys a query row sees under the window, at most `seqlen_k`; 0 without a window or with an
        unbounded side (the keys then bound it)."""
        if "window_size" not in self.fields() or self.left < 0 or self.right < 0:
            return 0
        return min(seqlen_k, self.left + self.right + 1)

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

    def fields(self) -> frozenset:
        """The fields set, by their public argument names: what a kernel must declare to run this variant
        (`dispatch.Kernel.fields`). A window that only restates causal (left -1) is causal."""
        return self._fields

    @functools.cached_property
    def _fields(self) -> frozenset:
        names = {"causal"} if self.causal else set()
        if self.window != (-1, -1) and not (self.causal and self.window[0] == -1):
            names.add("window_size")
        if self.softcap:
            names.add("softcap")
        if self.dropout_p:
            names.add("dropout_p")
        if self.alibi_slopes is not None:
            names.add("alibi_slopes")
        if self.sinks is not None:
            names.add("learnable_sink")
        return frozenset(names)

    def unsupported(self) -> list[str]:
        """The fields set to something no kernel in `dispatch.KERNELS` runs, by their public argument names."""
        from .dispatch import unsupported_fields

        return unsupported_fields(self.fields())

    def require_supported(self) -> None:
        """NotImplementedError naming the first field the kernels do not run yet."""
        names = self.unsupported()
        if names:
            raise NotImplementedError(f"{names[0]} is not supported yet by flashtriton's kernels "
                                      f"(variant fields set: {', '.join(names)})")


def dropout_threshold(dropout_p: float) -> int:
    """round(p · 2^16), at most 2^16 - 1: `dropout_keep` drops a score whose 16 random bits fall below it, so a
    score is kept with probability 1 - threshold / 2^16 (1 - p to within 2^-17)."""
    return min(int(round(dropout_p * 2**16)), 2**16 - 1)


# --------------------------------------------------------------------------------------------------------------
# Device side: the only mask code in any kernel. Plain `@triton.jit` helpers, which the Gluon kernels call too
# (a jit function called from a Gluon kernel compiles in Gluon mode): they take index tensors and scalars and
# make none, so they need no layout. The variant's constexprs are IS_CAUSAL, CAUSAL_BOTTOM_RIGHT and HAS_WINDOW;
# `diag` is the diagonal d above (query row i meets key i + d); with HAS_WINDOW, `left` / `right` are the window's
# sides (`Variant.window_scalars`: an unbounded side is WINDOW_UNBOUNDED; causal is right = 0). The window
# arguments default to off, so that a kernel without windows calls the helpers as before.
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def diagonal(seqlen_q, seqlen_k, IS_CAUSAL: tl.constexpr, CAUSAL_BOTTOM_RIGHT: tl.constexpr,
             HAS_WINDOW: tl.constexpr = False):
    """d of a (seqlen_q, seqlen_k) sequence pair: Sk - Sq bottom-right, 0 top-left (and unused without a mask);
    always a tensor, so that it can be carried through loops and warp-specialized partitions."""
    if (IS_CAUSAL or HAS_WINDOW) and CAUSAL_BOTTOM_RIGHT:  # (HAS_WINDOW: or any bias measured from the diagonal)
        return seqlen_k - seqlen_q
    else:
        return seqlen_k * 0  # a zero of seqlen_k's kind (a tensor where it is one); folds to a constant


@triton.jit
def visible(keep, q_idx, k_idx, diag, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr = False, left=0, right=0):
    """`keep` (a bool tile, or True) and the element mask: query q_idx sees key k_idx. q_idx and k_idx broadcast
    against each other ((M, 1) and (1, N), or transposed for key-major tiles)."""
    if HAS_WINDOW:
        keep = keep & (k_idx >= q_idx + diag - left) & (k_idx <= q_idx + diag + right)
    elif IS_CAUSAL:
        keep = keep & (k_idx <= q_idx + diag)
    return keep


@triton.jit
def tile_masked(row_first, key_last, diag, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr = False, left=0,
                right=0, row_last=0, key_first=0):
    """Whether the mask hides some pair of a tile of rows [row_first, row_last] and keys [key_first, key_last] (the
    end of the keys is the caller's test). Without a window only the corner (row_first, key_last) matters."""
    if HAS_WINDOW:
        return (key_last > row_first + diag + right) | (key_first < row_last + diag - left)
    elif IS_CAUSAL:
        return key_last > row_first + diag
    else:
        return False


@triton.jit
def key_tile_masked(key_last, row_first, diag, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr = False, left=0,
                    right=0, key_first=0, row_last=0):
    """`tile_masked` seen from a key-major tile (the dK/dV kernels, whose tile rows are keys [key_first, key_last],
    against query rows [row_first, row_last]): whether the mask hides some pair of it."""
    if HAS_WINDOW:
        return (row_first + diag + right < key_last) | (row_last + diag - left > key_first)
    elif IS_CAUSAL:
        return row_first + diag < key_last
    else:
        return False


@triton.jit
def tile_hidden(row_last, key_first, diag, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr = False, left=0,
                right=0, row_first=0, key_last=0):
    """Whether the mask hides every pair of a tile of rows [row_first, row_last] and keys [key_first, key_last].
    Without a window only the corner (row_last, key_first) matters."""
    if HAS_WINDOW:
        return (key_first > row_last + diag + right) | (key_last < row_first + diag - left)
    elif IS_CAUSAL:
        return key_first > row_last + diag
    else:
        return False


@triton.jit
def key_end(row, diag, IS_CAUSAL: tl.constexpr):
    """One past the last key query `row` sees (a tensor of rows, or one); unbounded (a large int) without a causal
    mask. The caller clips it to the sequence."""
    if IS_CAUSAL:
        return row + diag + 1
    else:
        return 2147483647


@triton.jit
def key_end_before(row_end, diag, IS_CAUSAL: tl.constexpr):
    """`key_end(row_end - 1)`: one past the last key that any query row before `row_end` sees, in the form the
    tile bounds compute it."""
    if IS_CAUSAL:
        return row_end + diag
    else:
        return 2147483647


@triton.jit
def key_blocks(start_m, seqlen_k, diag, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               HAS_WINDOW: tl.constexpr = False, left=0, right=0):
    """Keys the query tile `start_m` (rows [start_m * BLOCK_M, + BLOCK_M)) visits: (first, start, lo, hi), the
    first three multiples of BLOCK_N. Keys [start, lo) are visible to every row of the tile and inside the
    sequence, so they need no mask; keys [first, start) (a window's left edge) and [lo, hi) (the diagonal or the
    right edge, the end of the keys) are masked; keys before first and from hi on are never visited. Without a
    window first = start = 0."""
    if HAS_WINDOW:
        row0 = start_m * BLOCK_M
        hi = tl.maximum(tl.minimum(seqlen_k, row0 + BLOCK_M + diag + right), 0)
        first = tl.minimum(tl.maximum(row0 + diag - left, 0) // BLOCK_N * BLOCK_N, hi)
        start = tl.minimum(tl.cdiv(tl.maximum(row0 + BLOCK_M - 1 + diag - left, 0), BLOCK_N) * BLOCK_N, hi)
        start = tl.maximum(start, first)
        lo = tl.minimum(tl.maximum(row0 + diag + right + 1, 0), seqlen_k) // BLOCK_N * BLOCK_N
        lo = tl.maximum(tl.minimum(lo, hi), start)
        return first, start, lo, hi
    if IS_CAUSAL:
        hi = tl.minimum(seqlen_k, key_end_before((start_m + 1) * BLOCK_M, diag, IS_CAUSAL))
        lo = tl.minimum(key_end(start_m * BLOCK_M, diag, IS_CAUSAL), seqlen_k)
    else:
        hi = seqlen_k
        lo = seqlen_k
    hi = tl.maximum(hi, 0)
    lo = tl.minimum(tl.maximum(lo, 0) // BLOCK_N * BLOCK_N, hi)
    return 0, 0, lo, hi


@triton.jit
def query_first(start_n, diag, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """The first query tile start (a multiple of BLOCK_M) with a row that sees key `start_n`."""
    if IS_CAUSAL:
        return tl.maximum(start_n - diag, 0) // BLOCK_M * BLOCK_M
    else:
        return start_n * 0


@triton.jit
def query_blocks(start_n, seqlen_q, diag, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_WINDOW: tl.constexpr = False, left=0, right=0):
    """Query rows the key tile [start_n, start_n + BLOCK_N) visits: (lo, mid, full, end), the first three
    multiples of BLOCK_M. Rows [lo, mid) are masked (they straddle the diagonal, or a window's right edge),
    [mid, full) see every key of the tile and lie inside the sequence (no mask), [full, end) are masked (a window's
    left edge, the end of the queries); rows before lo and from end on see none of the tile's keys. Without a window
    end = seqlen_q."""
    if HAS_WINDOW:
        lo = tl.maximum(start_n - diag - right, 0) // BLOCK_M * BLOCK_M
        end = tl.maximum(tl.minimum(seqlen_q, start_n + BLOCK_N - diag + left), 0)
        lo = tl.minimum(lo, end)
        mid = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - diag - right, 0), BLOCK_M) * BLOCK_M
        full = tl.minimum(seqlen_q // BLOCK_M * BLOCK_M, tl.maximum(start_n - diag + left + 1, 0) // BLOCK_M * BLOCK_M)
        mid = tl.maximum(tl.minimum(mid, full), lo)
        full = tl.maximum(full, mid)
        end = tl.maximum(end, full)
        return lo, mid, full, end
    if IS_CAUSAL:
        lo = query_first(start_n, diag, IS_CAUSAL, BLOCK_M)
        mid = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - diag, 0), BLOCK_M) * BLOCK_M
    else:
        lo = 0
        mid = 0
    full = seqlen_q // BLOCK_M * BLOCK_M
    mid = tl.maximum(tl.minimum(mid, full), lo)
    full = tl.maximum(full, mid)
    return lo, mid, full, seqlen_q


@triton.jit
def tanh(x, APPROX: tl.constexpr = False):
    """tanh in fp32. APPROX (kernels on fp16/bf16 inputs), on a GPU: the hardware's approximation (PTX
    tanh.approx.f32, one special-function instruction, relative error below 2^-10.9, what FlashAttention's softcap
    uses; the rational form costs the forward about three times its softmax time). Otherwise, and always in the
    interpreter (which has no PTX), Eigen's rational approximation, to a few ulp: for fp32 inputs."""
    if APPROX and PTX:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return _tanh_rational(x)


@triton.jit
def _tanh_rational(x):
    """Eigen's rational approximation of tanh, x P(x²) / Q(x²) on |x| <= 7.9 (tanh is ±1 in fp32 beyond)."""
    x = tl.minimum(tl.maximum(x, -7.90531110763549805), 7.90531110763549805)
    x2 = x * x
    p = x2 * -2.76076847742355e-16 + 2.00018790482477e-13
    p = p * x2 + -8.60467152213735e-11
    p = p * x2 + 5.12229709037114e-08
    p = p * x2 + 1.48572235717979e-05
    p = p * x2 + 6.37261928875436e-04
    p = p * x2 + 4.89352455891786e-03
    q = x2 * 1.19825839466702e-06 + 1.18534705686654e-04
    q = q * x2 + 2.26843463243900e-03
    q = q * x2 + 4.89352518554385e-03
    return x * p / q


@triton.jit
def softcap_scores(qk, qk_scale, softcap, APPROX: tl.constexpr = False):
    """Soft-capped scores in base 2, from raw Q Kᵀ: softcap · tanh(qk · qk_scale), with the launcher passing
    qk_scale = softmax_scale / cap and softcap = cap · log2(e) (`Variant.scalars`); APPROX as `tanh`'s."""
    return softcap * tanh(qk * qk_scale, APPROX)


@triton.jit
def softcap_scores_and_grad(qk, qk_scale, softcap, APPROX: tl.constexpr = False):
    """(`softcap_scores`, d(capped score) / d(scaled score) = 1 - tanh²) for the backward, which multiplies dS by
    the latter (the softmax scale is applied to dQ and dK at the end, as without softcap)."""
    t = tanh(qk * qk_scale, APPROX)
    return softcap * t, 1.0 - t * t


@triton.jit
def alibi_bias(q_idx, k_idx, diag, slope):
    """ALiBi's bias in base 2, -slope · |i + d - j| (the launcher passes slope · log2(e)); q_idx, k_idx broadcast
    ((M, 1) and (1, N)). Positions are converted before they broadcast (one conversion per row and per key, then a
    subtraction per score: integer-to-float conversion runs at a quarter of the fp32 rate), exact below 2^24."""
    return -slope * tl.abs((q_idx + diag).to(tl.float32) - k_idx.to(tl.float32))


@triton.jit
def add_sink(acc, l_i, m_i, sink):
    """Fold an attention sink (one logit per head, in base 2, counted in the denominator only) into a finished
    row's (acc, l_i, m_i): a row that saw no key keeps out 0 and gets lse = the sink."""
    m_new = tl.maximum(m_i, sink)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a sink of -inf and no key: out 0, lse -inf
    alpha = tl.math.exp2(m_i - m_safe)  # 0 for a row that saw no key (m_i = -inf)
    return acc * alpha[:, None], l_i * alpha + tl.math.exp2(sink - m_safe), m_new


@triton.jit
def dropout_state(rng):
    """(seed, offset) of a dropout call from its int64 (seed, offset) tensor: the 64-bit Philox key and the low 32
    bits of the offset, loaded once per program."""
    return tl.load(rng), tl.load(rng + 1).to(tl.int32)


@triton.jit
def _mulhilo(x, M: tl.constexpr):
    """(hi, lo) 32-bit halves of x · M (x uint32, M one of Philox4x32's round multipliers). On a GPU one
    `mul.wide.u32` (IMAD.WIDE.U32, one instruction: `umulhi` and `*` compile to an IMAD.HI and an IMAD), in the
    interpreter (which has no PTX) `umulhi` and `*`: the same bits."""
    if PTX:
        return tl.inline_asm_elementwise("{ .reg .b64 t; mul.wide.u32 t, $2, $3; mov.b64 {$1, $0}, t; }",
                                         "=r,=r,r,r", [x, tl.cast(M, tl.uint32)], dtype=(tl.uint32, tl.uint32),
                                         is_pure=True, pack=1)
    else:
        return tl.math.umulhi(x, M), x * M


@triton.jit
def philox(seed, c0, c1, c2, c3):
    """Philox4x32-`DROPOUT_ROUNDS` (Salmon et al., SC 2011; bit for bit `tl.philox`) of the counter
    (c0, c1, c2, c3) keyed by the 64-bit `seed`: c0, c2 scalars, c1, c3 uint32 tensors that broadcast. A round
    multiplies c0 and c2 and xors c1 and c3 in, so with the scalars there the first round's products are
    scalars, and a tile's rows (c1) and keys (c3) meet only in the third round's results: of the second and
    third rounds' products one depends on the row alone and one on the key alone, so that a loop over key tiles
    (the forward, dQ) or over query tiles (dK/dV) makes 10 of the 14 products per call. Each product is one wide
    multiply (`_mulhilo`)."""
    seed = seed.to(tl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = c0.to(tl.uint32, bitcast=True)
    c2 = c2.to(tl.uint32, bitcast=True)
    c0, c1, c2, c3 = (tl.math.umulhi(c2, 0xCD9E8D57) ^ c1 ^ k0, c2 * 0xCD9E8D57,
                      tl.math.umulhi(c0, 0xD2511F53) ^ c3 ^ k1, c0 * 0xD2511F53)
    for _ in tl.static_range(DROPOUT_ROUNDS - 1):
        k0 += 0x9E3779B9
        k1 += 0xBB67AE85
        hi0, lo0 = _mulhilo(c0, 0xD2511F53)
        hi2, lo2 = _mulhilo(c2, 0xCD9E8D57)
        c0, c1, c2, c3 = hi2 ^ c1 ^ k0, lo2, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


@triton.jit
def dropout_select(fields, threshold, x):
    """x where the score's field (`dropout_fields`) is kept (>= `dropout_threshold`'s `threshold`), else 0, in
    fp32. On a GPU one compare and one fp32 select (PTX `setp` / `selp`): a `tl.where` of fp32 scores that are
    then rounded to 16 bits becomes, in LLVM, a select of the rounded halves, which unpacks and repacks each pair
    (two permutes and an integer select per score)."""
    threshold = threshold.to(tl.uint32) << 16  # (the fields' low 16 bits cannot change the comparison)
    if PTX:
        return tl.inline_asm_elementwise(
            "{ .reg .pred k; setp.ge.u32 k, $1, $2; selp.f32 $0, $3, 0f00000000, k; }", "=r,r,r,r",
            [fields, threshold, x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.where(fields >= threshold, x, 0.0)


@triton.jit
def dropout_sign(fields, threshold, x):
    """x (>= 0: probabilities) where the score is kept (`dropout_select`), else -x: the keep-mask carried in the
    sign bit, for a kernel that needs it again after a matmul (`backward_gluon_dkdv`: max(x, 0) is the kept
    probability, |x| the probability; an underflowed 0 is 0 either way). On a GPU a compare and a predicated xor
    (a mask held across the matmul otherwise sits in predicate bits of a register: three instructions per score
    to set, clear and test them)."""
    threshold = threshold.to(tl.uint32) << 16
    if PTX:
        return tl.inline_asm_elementwise(
            "{ .reg .pred d; setp.lt.u32 d, $1, $2; mov.b32 $0, $3; @d xor.b32 $0, $3, 0x80000000; }", "=r,r,r,r",
            [fields, threshold, x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.where(fields >= threshold, x, -x)


@triton.jit
def dropout_fields(seed, offset, bh, c0, c1):
    """The random fields of the Philox calls (c0, c1), shape (M / 2, N / 4), laid out as the (M, N) scores they
    serve (`dropout_keep`): uint32 values whose top 16 bits are the score's field (the bits below it are 0 or
    another field, which cannot change a comparison with a threshold whose low 16 bits are 0). Call
    (R, C) = (8a + b, 4m + c) serves rows 16a + b + 8ρ and keys 16m + 2c + 8κ + π: field π (0: bits 0..15,
    1: bits 16..31) of its output 2ρ + κ. Only register moves lie between the calls' shape and the scores' where
    a thread holds all eight scores of each of its calls (`gluon_common.dropout_calls_layout`)."""
    r0, r1, r2, r3 = philox(seed, bh, c1.to(tl.uint32, bitcast=True), offset, c0.to(tl.uint32, bitcast=True))
    x0 = tl.join(r0 << 16, r0)  # (M / 2, N / 4, π)
    x1 = tl.join(r1 << 16, r1)
    x2 = tl.join(r2 << 16, r2)
    x3 = tl.join(r3 << 16, r3)
    z = tl.join(tl.join(x0, x1), tl.join(x2, x3))  # (M / 2, N / 4, π, κ, ρ)
    M2: tl.constexpr = c0.shape[0]
    N4: tl.constexpr = c0.shape[1]
    z = tl.reshape(z, (M2 // 8, 8, N4 // 4, 4, 2, 2, 2))  # (a, b, m, c, π, κ, ρ)
    z = tl.permute(z, (0, 6, 1, 2, 5, 3, 4))  # (a, ρ, b, m, κ, c, π)
    return tl.reshape(z, (2 * M2, 4 * N4))


@triton.jit
def dropout_keep(seed, offset, bh, m0, k0, threshold, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The dropout keep-mask of a tile of scores of sequence-and-head `bh` (batch b · Hq + query head h): query
    rows m0 .. m0 + BLOCK_M - 1 against keys k0 .. k0 + BLOCK_K - 1, both counted within the sequence (varlen: its
    own rows and keys); m0, k0 and the tile sizes are multiples of 16 (every kernel's tiles are). (BLOCK_M,
    BLOCK_K), True where the score is kept (the kernels select with the fields themselves: `dropout_tile`,
    `dropout_select`).
    Counter-based, so that the forward, both backward kernels and `flashtriton.testing.dropout_mask` regenerate
    the same bits from the same indices, whatever their tiles: score (i, j) takes 16 bits of the Philox4x32-7
    call (`philox`, keyed by the call's 64-bit seed) on the counter (bh, 8 (i // 16) + i mod 8, offset,
    4 (j // 16) + (j mod 8) // 2) (`dropout_state`), field j mod 2 of its output 2 ((i // 8) mod 2) +
    (j // 8) mod 2 (`dropout_fields`). One call (about 40 integer instructions in a loop over tiles) serves eight
    scores. A score is kept iff its field is >= threshold (`dropout_threshold`)."""
    return dropout_tile(seed, offset, bh, m0, k0, BLOCK_M, BLOCK_K) >= (threshold.to(tl.uint32) << 16)


@triton.jit
def dropout_tile(seed, offset, bh, m0, k0, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The (BLOCK_M, BLOCK_K) fields (`dropout_fields`) of `dropout_keep`'s tile, for `dropout_select`."""
    calls_m = m0 // 2 + tl.arange(0, BLOCK_M // 2)
    calls_k = k0 // 4 + tl.arange(0, BLOCK_K // 4)
    c0 = calls_k[None, :] + calls_m[:, None] * 0  # (BLOCK_M / 2, BLOCK_K / 4)
    c1 = calls_m[:, None] + calls_k[None, :] * 0
    return dropout_fields(seed, offset, bh, c0, c1)
