"""Which kernel runs a call: one table of kernels, each declaring what it supports, and one switch.

`KERNELS` lists every kernel family in the order the dispatch prefers them, per operation (fwd, bwd, decode).
A kernel takes a call when the switch allows its level, it declares the call's GPU, dtype, head dim, layout
(varlen, paged), a V head dim of its own (`separate_v`: v.shape[-1] != q.shape[-1]) where the call has one, and
every variant field the call sets, and its tile rule in `configs` names the shape (a rule
that returns no config passes the call on to the next kernel). A variant lands in the portable kernels first,
by adding its field to their `fields`; the Hopper kernels take it once they declare it too.

The switch, FLASHTRITON_KERNEL (read once, at import; `force` sets it in tests and benchmarks):
    auto (default), gluon   every kernel;  tma   no Gluon kernel;  portable   the portable Triton kernels only,
                            as Ampere runs them;
  with an optional decode schedule after a comma: `auto,stream`, `portable,split` (default: `configs`' rule).
The older FLASHTRITON_TMA=0 / _GLUON=0 / _GLUON_BWD=0 / FLASHTRITON_DECODE_SCHEDULE still work for one release,
with a FutureWarning naming the replacement.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from dataclasses import dataclass

import torch

from ..configs import GLUON_BWD_HEAD_DIMS, GLUON_HEAD_DIMS

LEVELS = ("portable", "tma", "gluon")  # each level allows the ones before it
CHOICES = ("auto", "gluon", "tma", "portable")
SCHEDULES = ("auto", "split", "stream")
HALF = (torch.float16, torch.bfloat16)
ANY_HEAD_DIM = tuple(range(1, 257))
# The portable kernels' variant fields.
SCORES = frozenset({"causal", "window_size", "softcap", "alibi_slopes", "learnable_sink"})
# The scores' and dropout: the portable and the Gluon kernels (whose config rules take the dropout calls
# `configs.GLUON_DROPOUT_FWD` / `configs.backward.GLUON_BWD_DROPOUT_CASES` name); the TMA forward and decode do not.
TRAINING = SCORES | {"dropout_p"}


@dataclass(frozen=True)
class Kernel:
    """One kernel family: what it runs and where it lives."""
    name: str
    op: str  # "fwd" | "bwd" | "decode"
    level: str  # the switch level that allows it (LEVELS)
    where: str  # module.function
    capability: int = 0  # the major compute capability it needs (0: any GPU, and the interpreter)
    dtypes: tuple = HALF + (torch.float32,)
    head_dims: tuple = ANY_HEAD_DIM
    varlen: bool = True
    paged: bool = False  # keys through a block table (paged KV); for varlen calls also keys counted by seqused_k
    fields: frozenset = frozenset({"causal"})  # the Variant fields it runs (`Variant.fields`)
    separate_v: bool = False  # whether V (and O, dO, dV) may have a head dim other than Q and K's


KERNELS = (
    Kernel("gluon_fwd", "fwd", "gluon", "forward_gluon._attn_fwd_gluon", 9, HALF, GLUON_HEAD_DIMS, paged=True,
           fields=TRAINING, separate_v=True),
    Kernel("tma_fwd", "fwd", "tma", "forward._attn_fwd_tma", 9, HALF, (64, 128), fields=SCORES),
    Kernel("portable_fwd", "fwd", "portable", "forward._attn_fwd", paged=True, fields=TRAINING, separate_v=True),
    Kernel("gluon_bwd", "bwd", "gluon",
           "backward_gluon_dkdv._attn_bwd_dkdv_gluon / backward_gluon_dq._attn_bwd_dq_gluon", 9, HALF,
           GLUON_BWD_HEAD_DIMS, fields=TRAINING, separate_v=True),
    Kernel("portable_bwd", "bwd", "portable", "backward_kernels._attn_bwd_dkdv / _attn_bwd_dq", fields=TRAINING,
           separate_v=True),
    Kernel("decode_stream", "decode", "portable", "decode._decode_stream", varlen=False, paged=True, fields=SCORES,
           separate_v=True),
    Kernel("decode_split", "decode", "portable", "decode._decode_split", varlen=False, paged=True, fields=SCORES,
           separate_v=True),
)
BY_NAME = {k.name: k for k in KERNELS}


@dataclass(frozen=True)
class Choice:
    level: str = "gluon"  # the most specialised level allowed
    decode: str = "auto"  # the decode schedule: auto (configs' rule), split or stream
    gluon_bwd: bool = True  # FLASHTRITON_GLUON_BWD=0 (deprecated): the Gluon forward without the Gluon backward


def parse(environ=os.environ) -> Choice:
    """The switch from the environment; ValueError naming FLASHTRITON_KERNEL for a value it does not know."""
    raw = environ.get("FLASHTRITON_KERNEL", "auto").strip().lower()
    parts = [p.strip() for p in raw.split(",")] if raw else ["auto"]
    if len(parts) > 2 or parts[0] not in CHOICES or (len(parts) == 2 and parts[1] not in SCHEDULES):
        raise ValueError(f"FLASHTRITON_KERNEL must be one of {', '.join(CHOICES)}, optionally followed by "
                         f"',<decode schedule>' ({', '.join(SCHEDULES)}), got {raw!r}")
    level = "gluon" if parts[0] == "auto" else parts[0]
    decode = parts[1] if len(parts) == 2 else "auto"
    gluon_bwd = True
    legacy = {"FLASHTRITON_TMA": "portable", "FLASHTRITON_GLUON": "tma", "FLASHTRITON_GLUON_BWD": None}
    for name, replacement in legacy.items():
        if environ.get(name, "1") != "0":
            continue
        instead = f"use FLASHTRITON_KERNEL={replacement}" if replacement else "it stays for one release"
        warnings.warn(f"{name}=0 is deprecated: {instead}", FutureWarning, stacklevel=2)
        if replacement is None:
            gluon_bwd = False
        elif LEVELS.index(replacement) < LEVELS.index(level):
            level = replacement
    schedule = environ.get("FLASHTRITON_DECODE_SCHEDULE")
    if schedule is not None:
        mapped = {"grid": "split", "stream": "stream", "auto": "auto"}.get(schedule.strip().lower())
        if mapped is None:
            raise ValueError(f"FLASHTRITON_DECODE_SCHEDULE must be grid, stream or auto, got {schedule!r}")
        warnings.warn(f"FLASHTRITON_DECODE_SCHEDULE is deprecated: use FLASHTRITON_KERNEL={parts[0]},{mapped}",
                      FutureWarning, stacklevel=2)
        decode = mapped
    return Choice(level, decode, gluon_bwd)


CHOICE: Choice = parse()


def allows(level: str) -> bool:
    """Whether the switch allows kernels of `level` ("portable", "tma", "gluon")."""
    return LEVELS.index(level) <= LEVELS.index(CHOICE.level)


def gluon_bwd_allowed() -> bool:
    return allows("gluon") and CHOICE.gluon_bwd


def decode_schedule() -> str:
    """"auto", "split" or "stream"."""
    return CHOICE.decode


@contextlib.contextmanager
def force(kernel: str = "auto", decode: str = "auto", gluon_bwd: bool = True):
    """Run the block under another switch (`FLASHTRITON_KERNEL=<kernel>,<decode>`; gluon_bwd=False: the Gluon
    backward off alone), for tests and benchmarks. Launch plans are cached per switch state, so it always holds."""
    global CHOICE
    previous = CHOICE
    CHOICE = parse({"FLASHTRITON_KERNEL": f"{kernel},{decode}", "FLASHTRITON_GLUON_BWD": "1"})
    if not gluon_bwd:
        CHOICE = Choice(CHOICE.level, CHOICE.decode, False)
    try:
        yield CHOICE
    finally:
        CHOICE = previous


@functools.lru_cache(maxsize=1024)
def supports(name: str, dtype: torch.dtype, head_dim: int, capability: int, varlen: bool = False,
             paged: bool = False, fields: frozenset = frozenset(), separate_v: bool = False) -> bool:
    """Whether kernel `name` declares this call (its tile rule and tensor layout are the launcher's to check);
    `capability` is the GPU's major compute capability, 0 under the interpreter or on a CPU; `head_dim` is q and
    k's, `separate_v` whether v's differs from it."""
    k = BY_NAME[name]
    return ((k.capability == 0 or k.capability == capability) and dtype in k.dtypes and head_dim in k.head_dims
            and (k.varlen or not varlen) and (k.paged or not paged) and fields <= k.fields
            and (k.separate_v or not separate_v))


def candidates(op: str, dtype: torch.dtype, head_dim: int, capability: int, varlen: bool = False,
               paged: bool = False, fields: frozenset = frozenset(), separate_v: bool = False) -> list[str]:
    """The kernels that may run this call, in the order the dispatch tries them (the switch applied)."""
    return [k.name for k in KERNELS if k.op == op and allows(k.level)
            and supports(k.name, dtype, head_dim, capability, varlen, paged, fields, separate_v)]


def unsupported_fields(fields: frozenset) -> list[str]:
    """The variant fields no kernel runs, in a stable order."""
    known = frozenset().union(*(k.fields for k in KERNELS))
    return sorted(fields - known)
