"""Which config each kernel launch takes: rule tables keyed by GPU class, input width, head dim, variant class and
length, each rule naming its source (`table.py` says how a table reads).

How a launcher picks its config, in order:
1. `config=` passed to the launcher (tests, `flashtriton tune`);
2. under Triton's interpreter (CPU): one fixed config per kernel (`*_INTERPRETER_CONFIG`), quick to interpret;
3. with autotuning on (`FLASHTRITON_AUTOTUNE=1` in the environment, or `configs.AUTOTUNE = True`): the best of the
   kernel's candidates (`*_CONFIGS`), pruned to what fits (`prune_*`), measured once per key (`*_AUTOTUNE_KEY`: head
   dim, causal, varlen, dtype and power-of-two buckets of the lengths, `seqlen_bucket`, so that odd lengths do not
   retune) and cached;
4. otherwise the kernel's rule table (`default_*`, `*_config`): no tuning cost on the first call, which every new
   (head dim, causal, dtype) would otherwise pay in compiles of every candidate (the GPU test suite's compile time;
   no results file).

  forward.py   the portable forward (PORTABLE_FWD), Hopper's TMA forward (TMA_FWD, VARLEN_TMA_FWD) and Gluon
               forward (GLUON_FWD, GLUON_VARLEN_FWD), the portable forward's candidates and pruning
  backward.py  the Triton backward (BWD_CANDIDATES, TRITON_BWD), the Gluon backward (GLUON_BWD and its gates),
               VARLEN_BWD_ORDER
  decode.py    the split decode kernel (SPLIT_DECODE), the split-KV and schedule constants
  table.py     Table, the keys a rule names (GPU classes, input widths, variant classes), seqlen_bucket
Host arithmetic and device queries (`cdiv`, `next_power_of_2`, `padded_head_dim`, `capability`) live in
`kernels/host.py`; they are re-exported here for the kernels' call sites.
"""

from __future__ import annotations

import os

from ..kernels.host import capability, cdiv, next_power_of_2, padded_head_dim
from .backward import (BWD_AUTOTUNE_KEY, BWD_CANDIDATES, BWD_DKDV_CONFIGS, BWD_DQ_CONFIGS, BWD_INTERPRETER_CONFIG,
                       GLUON_BWD, GLUON_BWD_D64_MIN_KEYS, GLUON_BWD_MIN_FLOPS, TRITON_BWD, VARLEN_BWD_ORDER,
                       default_bwd_configs, gluon_bwd_config, prune_bwd_dkdv_configs, prune_bwd_dq_configs,
                       varlen_bwd_order)
from .decode import (DECODE_AUTOTUNE_KEY, DECODE_CANDIDATES, DECODE_CONFIGS, DECODE_INTERPRETER_CONFIG,
                     DECODE_INTERPRETER_SMS, DECODE_MAX_SPLITS, DECODE_MIN_SPLIT_KEYS, DECODE_PROGRAM_OVERHEAD_TILES,
                     DECODE_SPLIT_OVERHEAD_TILES, DECODE_STREAM_MAX_BATCH, DECODE_STREAM_MIN_KEYS, SHARED_MEMORY_PER_SM,
                     SPLIT_DECODE, decode_programs_per_sm, decode_shared_memory, default_decode_config,
                     prune_decode_configs)
from .forward import (FWD_AUTOTUNE_KEY, FWD_CANDIDATES, FWD_CONFIGS, FWD_INTERPRETER_CONFIG, GLUON_FWD,
                      GLUON_VARLEN_FWD, PORTABLE_FWD, TMA_FWD, TMA_HEAD_DIMS, VARLEN_TMA_FWD, default_fwd_config,
                      default_fwd_tma_config, gluon_fwd_config, gluon_varlen_config, prune_fwd_configs,
                      varlen_fwd_tma_config)
from .table import Table, seqlen_bucket

# Every rule table, by name (tests/test_configs.py checks them).
TABLES = {"PORTABLE_FWD": PORTABLE_FWD, "TMA_FWD": TMA_FWD, "VARLEN_TMA_FWD": VARLEN_TMA_FWD, "GLUON_FWD": GLUON_FWD,
          "GLUON_VARLEN_FWD": GLUON_VARLEN_FWD, "TRITON_BWD": TRITON_BWD, "GLUON_BWD": GLUON_BWD,
          "SPLIT_DECODE": SPLIT_DECODE}

AUTOTUNE: bool = os.environ.get("FLASHTRITON_AUTOTUNE", "0") == "1"

# Which kernel families the dispatch may take, from FLASHTRITON_KERNEL (read once, at import):
#   auto (default) or gluon: the Gluon kernels where the rules name the shape, else the TMA kernels on Hopper,
#     else the portable ones;
#   tma: no Gluon kernel (the TMA forward and the Triton backward on Hopper);
#   portable: the portable Triton kernels everywhere, as Ampere runs them.
# The three booleans below are what the launchers read (tests set them directly).
KERNELS = ("auto", "gluon", "tma", "portable")
_LEGACY_SWITCHES = {"FLASHTRITON_TMA": "portable", "FLASHTRITON_GLUON": "tma", "FLASHTRITON_GLUON_BWD": None}


def kernel_choice(environ=os.environ) -> tuple[bool, bool, bool]:
    """(USE_TMA, USE_GLUON, USE_GLUON_BWD) from FLASHTRITON_KERNEL; ValueError naming it for an unknown value.
    The older FLASHTRITON_TMA=0 / FLASHTRITON_GLUON=0 / FLASHTRITON_GLUON_BWD=0 still work, with a FutureWarning
    that names the replacement (FLASHTRITON_GLUON_BWD=0, the Gluon backward alone, has none)."""
    choice = environ.get("FLASHTRITON_KERNEL", "auto").strip().lower()
    if choice not in KERNELS:
        raise ValueError(f"FLASHTRITON_KERNEL must be one of {', '.join(KERNELS)}, got {choice!r}")
    use_tma, use_gluon = choice != "portable", choice in ("auto", "gluon")
    use_gluon_bwd = use_gluon
    for name, replacement in _LEGACY_SWITCHES.items():
        if environ.get(name, "1") != "0":
            continue
        import warnings

        instead = f"use FLASHTRITON_KERNEL={replacement}" if replacement else "it stays for one release"
        warnings.warn(f"{name}=0 is deprecated: {instead}", FutureWarning, stacklevel=2)
        if name == "FLASHTRITON_TMA":
            use_tma = use_gluon = use_gluon_bwd = False
        elif name == "FLASHTRITON_GLUON":
            use_gluon = use_gluon_bwd = False
        else:
            use_gluon_bwd = False
    return use_tma, use_gluon, use_gluon_bwd


_USE_TMA, _USE_GLUON, _USE_GLUON_BWD = kernel_choice()

# Hopper's TMA forward (fp16 / bf16, dense or varlen, at TMA_HEAD_DIMS) on sm_90; off with
# FLASHTRITON_KERNEL=portable (or configs.USE_TMA = False, which turns the Gluon kernels off too).
USE_TMA: bool = _USE_TMA
# Hopper's Gluon forward on sm_90 where GLUON_FWD / GLUON_VARLEN_FWD name the shape; off with FLASHTRITON_KERNEL=tma
# (or configs.USE_GLUON = False), which keeps the backward on the Triton kernels too.
USE_GLUON: bool = _USE_GLUON
# Hopper's Gluon backward under USE_GLUON where GLUON_BWD names the shape and no Triton config is forced;
# configs.USE_GLUON_BWD = False keeps the Triton kernels.
USE_GLUON_BWD: bool = _USE_GLUON_BWD

# The decode launch's schedule (kernels.decode), from FLASHTRITON_DECODE_SCHEDULE: "grid" (`_decode_split`:
# B·Hkv·M tiles × splits programs, each sequence's keys cut into equal splits), "stream" (`_decode_stream`: all key
# tiles of the batch cut into one equal range per program, units shared between programs merged), or "auto": the
# stream schedule where `decode.stream_programs` takes it (DECODE_STREAM_MAX_BATCH, DECODE_STREAM_MIN_KEYS).
DECODE_SCHEDULE: str = os.environ.get("FLASHTRITON_DECODE_SCHEDULE", "auto")
