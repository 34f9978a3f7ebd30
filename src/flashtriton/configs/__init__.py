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
               forward (GLUON_FWD, GLUON_DROPOUT_FWD, GLUON_WINDOW_FWD, GLUON_VARLEN_FWD,
               GLUON_SEPARATE_V_VARLEN_FWD), the portable forward's candidates and pruning
  backward.py  the Triton backward (BWD_CANDIDATES, TRITON_BWD), the Gluon backward (GLUON_BWD and its gates),
               VARLEN_BWD_ORDER
  decode.py    the split decode kernel (SPLIT_DECODE), the split-KV and schedule constants
  table.py     Table, the keys a rule names (GPU classes, input widths, variant classes), seqlen_bucket
Which kernel families a call may take (the switch FLASHTRITON_KERNEL) and what each declares are
`kernels/dispatch.py`'s. Host arithmetic and device queries (`cdiv`, `next_power_of_2`, `padded_head_dim`, `capability`) live in
`kernels/host.py`; they are re-exported here for the kernels' call sites.
"""

from __future__ import annotations

import os

from ..kernels.host import capability, cdiv, next_power_of_2, padded_head_dim
from .backward import (BWD_AUTOTUNE_KEY, BWD_CANDIDATES, BWD_DKDV_CONFIGS, BWD_DQ_CONFIGS, BWD_INTERPRETER_CONFIG,
                       GLUON_BWD, GLUON_BWD_D256, GLUON_BWD_D64_MIN_KEYS, GLUON_BWD_HEAD_DIMS, GLUON_BWD_MIN_FLOPS,
                       GLUON_BWD_SEPARATE_V, TRITON_BWD, VARLEN_BWD_ORDER,
                       default_bwd_configs, gluon_bwd_config, gluon_bwd_pair_config, prune_bwd_dkdv_configs,
                       prune_bwd_dq_configs,
                       varlen_bwd_order)
from .decode import (DECODE_AUTOTUNE_KEY, DECODE_CANDIDATES, DECODE_CONFIGS, DECODE_INTERPRETER_CONFIG,
                     DECODE_INTERPRETER_SMS, DECODE_MAX_SPLITS, DECODE_MIN_SPLIT_KEYS, DECODE_PROGRAM_OVERHEAD_TILES,
                     DECODE_SPLIT_OVERHEAD_TILES, DECODE_STREAM_MAX_BATCH, DECODE_STREAM_MIN_KEYS, SHARED_MEMORY_PER_SM,
                     SPLIT_DECODE, decode_programs_per_sm, decode_shared_memory, default_decode_config,
                     prune_decode_configs)
from .forward import (FWD_AUTOTUNE_KEY, FWD_CANDIDATES, FWD_CONFIGS, FWD_INTERPRETER_CONFIG, GLUON_DROPOUT_FWD,
                      GLUON_FWD, GLUON_FWD_O_IN_Q, GLUON_HEAD_DIMS, GLUON_PAGED_FWD, GLUON_SEPARATE_V_FWD,
                      GLUON_SEPARATE_V_VARLEN_FWD, GLUON_VARLEN_FWD, GLUON_WINDOW_FWD, PORTABLE_FWD, TMA_FWD,
                      VARLEN_TMA_FWD, default_fwd_config, default_fwd_tma_config, gluon_fwd_config, gluon_head_block,
                      gluon_paged_config, gluon_varlen_config, prune_fwd_configs, varlen_fwd_tma_config)
from .table import Table, seqlen_bucket

# Every rule table, by name (tests/test_configs.py checks them).
TABLES = {"PORTABLE_FWD": PORTABLE_FWD, "TMA_FWD": TMA_FWD, "VARLEN_TMA_FWD": VARLEN_TMA_FWD, "GLUON_FWD": GLUON_FWD,
          "GLUON_FWD_O_IN_Q": GLUON_FWD_O_IN_Q,
          "GLUON_DROPOUT_FWD": GLUON_DROPOUT_FWD, "GLUON_WINDOW_FWD": GLUON_WINDOW_FWD, "GLUON_SEPARATE_V_FWD": GLUON_SEPARATE_V_FWD,
          "GLUON_VARLEN_FWD": GLUON_VARLEN_FWD, "GLUON_SEPARATE_V_VARLEN_FWD": GLUON_SEPARATE_V_VARLEN_FWD,
          "GLUON_PAGED_FWD": GLUON_PAGED_FWD, "TRITON_BWD": TRITON_BWD, "GLUON_BWD": GLUON_BWD,
          "GLUON_BWD_SEPARATE_V": GLUON_BWD_SEPARATE_V, "SPLIT_DECODE": SPLIT_DECODE}

AUTOTUNE: bool = os.environ.get("FLASHTRITON_AUTOTUNE", "0") == "1"
