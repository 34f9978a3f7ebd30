"""Forward configs: the portable kernel's candidates and defaults, the Hopper TMA and Gluon kernels' tables."""

from __future__ import annotations

import triton

from ..kernels.host import gluon_tile_width
from .table import ANY, CAUSAL, FULL, H100_DEC6, H200, H200_DEC, H200_MERGED, H200_PAGED, SM80, SM90, Table, padded_head_dims, tiles, variant_class, width

FWD_AUTOTUNE_KEY = ["TUNE_SEQLEN_Q", "TUNE_SEQLEN_K", "HEAD_DIM", "HEAD_DIM_V", "IS_CAUSAL", "IS_VARLEN"]

# Autotuning candidates of the portable forward, (BLOCK_M, BLOCK_N, num_warps, num_stages): a curated space around
# what FlashAttention-2 and Triton's tutorial use, BLOCK_M in {32, 64, 128}. Pruned per problem
# (`prune_fwd_configs`); `flashtriton tune` sweeps it.
FWD_CANDIDATES = [
    (128, 128, 8, 2), (128, 128, 8, 3),
    (128, 64, 8, 3), (128, 64, 4, 3), (128, 64, 4, 4), (128, 32, 4, 3),
    (64, 128, 4, 3),
    (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (64, 32, 4, 3),
    (32, 64, 4, 3), (32, 32, 4, 2), (32, 32, 2, 3),
]
FWD_CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
               for bm, bn, w, s in FWD_CANDIDATES]

# The one config the interpreter uses.
FWD_INTERPRETER_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}

FP32_DOTS = "why: fp32 runs the exact (IEEE) dot, whose registers allow small tiles only"
AMPERE_FIT = "why: tiles that fit Ampere's 163 KiB of shared memory and smaller register file"
D256_FIT = "why: at D=256 only 64-row tiles keep the accumulator in registers"

# The portable forward's default per (GPU class, input width, padded head dim, variant class, lengths). On Hopper
# 128-row tiles with 8 warps where every (batch, head) has enough query tiles to fill the GPU, 64-row tiles for
# short causal calls (fewer idle rows on the diagonal, more programs).
PORTABLE_FWD = Table(("gpu", "dtype", "head_dim", "variant", "seqlen_q", "seqlen_k"), rows=[
    # gpu dtype  head dim     variant  seqlen_q      seqlen_k      config               source
    (ANY,  "32", (None, 128), ANY,     ANY,          ANY,          tiles(64, 32, 4, 2), FP32_DOTS),
    (ANY,  "32", ANY,         ANY,     ANY,          ANY,          tiles(32, 32, 4, 2), FP32_DOTS),
    (SM90, "16", (256, None), ANY,     ANY,          ANY,          tiles(64, 64, 8, 2), D256_FIT),
    (SM80, "16", (256, None), ANY,     ANY,          ANY,          tiles(64, 32, 4, 2), AMPERE_FIT),
    (SM90, "16", (128, None), CAUSAL,  (None, 1024), ANY,          tiles(64, 32, 4, 3), H200 + "explore/fwd.json"),
    (SM90, "16", (128, None), CAUSAL,  (None, 2048), ANY,          tiles(64, 64, 4, 3), H200 + "explore/fwd.json"),
    (SM90, "16", (128, None), CAUSAL,  ANY,          ANY,          tiles(128, 64, 8, 3), H200 + "explore/fwd.json"),
    (SM90, "16", (128, None), FULL,    ANY,          (2048, None), tiles(128, 64, 8, 3), H200 + "explore/fwd.json"),
    (SM90, "16", (128, None), FULL,    ANY,          ANY,          tiles(64, 64, 4, 3), H200 + "explore/fwd.json"),
    (SM80, "16", (128, None), ANY,     ANY,          ANY,          tiles(128, 64, 8, 2), AMPERE_FIT),
    (ANY,  "16", ANY,         CAUSAL,  (None, 1024), ANY,          tiles(64, 64, 4, 3), H200 + "explore/fwd.json"),
    (ANY,  ANY,  ANY,         ANY,     ANY,          ANY,          tiles(128, 64, 8, 3), H200 + "explore/fwd.json"),
])


def default_fwd_config(head_dim_padded: int, elem_bytes: int, device, seqlen_q: int = 4096,
                       seqlen_k: int | None = None, causal: bool = False) -> dict:
    """The portable forward's config: `PORTABLE_FWD`'s rule for the call (seqlen_k defaults to seqlen_q)."""
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    return PORTABLE_FWD.lookup(device, width(elem_bytes), head_dim_padded, variant_class(causal), seqlen_q, seqlen_k)


# Hopper's TMA forward (kernels.forward._attn_fwd_tma; the head dims and dtypes it takes are its row in
# kernels/dispatch.py): its tiles below are 1.05-1.24x the portable kernel at every point of the D=64/128 sweep.
# H200: benchmarks/2026-11-29-h200/explore3/tma.json

# The TMA forward's tiles per (head dim, variant class, lengths), 3 stages everywhere (2 lose 10-20 %). D=64 causal
# 64x64 keeps to 128 registers a thread (`maxnreg`) so that four programs share an SM instead of three and cover
# each other's waits; non-causal gains nothing from it and 128-row tiles spill under it.
TMA_FWD = Table(("gpu", "dtype", "head_dim", "variant", "seqlen_q", "seqlen_k"), rows=[
    # gpu dtype  head dim    variant  seqlen_q      seqlen_k      config                source
    (SM90, "16", (None, 64), CAUSAL,  (8192, None), ANY,          tiles(128, 64, 4, 3), H200 + "explore3/tma.json"),
    (SM90, "16", (None, 64), CAUSAL,  ANY,          ANY,          tiles(64, 64, 4, 3, maxnreg=128),
     H200 + "explore15/maxnreg/ab_output.txt"),
    (SM90, "16", (None, 64), FULL,    ANY,          ANY,          tiles(64, 64, 4, 3), H200 + "explore3/tma.json"),
    (SM90, "16", ANY,        FULL,    ANY,          (None, 2048), tiles(64, 32, 4, 3), H200 + "explore3/tma.json"),
    (SM90, "16", ANY,        FULL,    ANY,          ANY,          tiles(128, 128, 8, 3), H200 + "explore3/tma.json"),
    (SM90, "16", ANY,        CAUSAL,  (None, 512),  ANY,          tiles(64, 64, 4, 3), H200 + "explore3/tma.json"),
    (SM90, "16", ANY,        CAUSAL,  (None, 8192), ANY,          tiles(64, 32, 4, 3), H200 + "explore3/tma.json"),
    (ANY,  ANY,  ANY,        ANY,     ANY,          ANY,          tiles(128, 128, 8, 3), H200 + "explore3/tma.json"),
])


def default_fwd_tma_config(head_dim: int, seqlen_q: int, seqlen_k: int, causal: bool) -> dict:
    """The TMA forward's tiles for a dense call: `TMA_FWD`'s rule."""
    return TMA_FWD.lookup(SM90, "16", head_dim, variant_class(causal), seqlen_q, seqlen_k)


DENSE_RULE = "the dense rule"  # a config that says: TMA_FWD's rule at the longest sequences

# The TMA forward's tiles for packed (varlen) batches, by the longest sequence: 128x128 with 8 warps at D=128
# beyond 2048 keys (fastest or level on the varlen suite's batch), else the dense rule (D=64 is not swept packed).
VARLEN_TMA_FWD = Table(("gpu", "dtype", "head_dim", "longest"), rows=[
    # gpu dtype  head dim  longest       config                 source
    (SM90, "16", 128,      (None, 2048), DENSE_RULE,            H200 + "explore4/varlen.json"),
    (SM90, "16", 128,      ANY,          tiles(128, 128, 8, 3), H200 + "explore4/varlen.json"),
    (ANY,  ANY,  ANY,      ANY,          DENSE_RULE,            H200 + "explore4/varlen.json"),
])


def varlen_fwd_tma_config(head_dim: int, max_seqlen_q: int, max_seqlen_k: int, causal: bool) -> dict:
    """The TMA forward's tiles for packed sequences: `VARLEN_TMA_FWD`'s rule."""
    config = VARLEN_TMA_FWD.lookup(SM90, "16", head_dim, max(max_seqlen_q, max_seqlen_k))
    if config == DENSE_RULE:
        return default_fwd_tma_config(head_dim, max_seqlen_q, max_seqlen_k, causal)
    return config


# Hopper's Gluon forward (kernels/forward_gluon.py: FlashAttention-3's schedule, a TMA producer and consumer
# warpgroups, persistent), on sm_90 where its table names the shape (fp16 / bf16, softmax_scale > 0). Base: two
# consumer warpgroups of 64 rows, 128-key tiles, 2 stages, one persistent program per SM, causal items in pairs of
# equal work, one Q slot, the output staged in shared memory for a TMA store (STORE_FROM_REGS: masked stores from
# registers, which frees the staging tiles' shared memory).
GLUON_BASE = dict(BLOCK_N=128, NUM_BUFFERS=2, CONSUMER_REGS=240, N_CONSUMERS=2, Q_BUFFERS=1, CAUSAL_PAIRS=True,
                  DYNAMIC=False, OVERLAP=False, STORE_FROM_REGS=False)
# Short items (up to 4k keys causal, 1k non-causal) spend much of their time starting and ending: two Q slots and
# OVERLAP (each item's last P V issued with the next item's first S, one loop over the program's K/V tiles).
GLUON_SHORT = dict(GLUON_BASE, Q_BUFFERS=2, OVERLAP=True)
GLUON_SHORT_D64 = dict(GLUON_SHORT, NUM_BUFFERS=3)
# D=64 beyond the short items: three consumers (192-row items, FlashAttention-3's D=64 tiles) with OVERLAP.
GLUON_THREE = dict(GLUON_BASE, N_CONSUMERS=3, CONSUMER_REGS=160, OVERLAP=True)
# Packed batches: items drawn from a global counter, one Q slot.
GLUON_DYNAMIC = dict(GLUON_BASE, CAUSAL_PAIRS=False, DYNAMIC=True)
# D=256 (and 192 in its tiles) up to 1k keys: 32-key tiles, so that two stages of K and V fit beside Q and the O
# staging tiles. Beyond: 64-key tiles with the output stored from registers (STORE_FROM_REGS: no O tiles, so two
# stages fit), which halves the softmax rounds per key: H200, D=256 fp16 at 16k keys 643 TFLOP/s non-causal and
# 658 causal against 32-key tiles' 533 / 488 (cuDNN 707 / 617); at 1k keys and below the 64-key tiles lose
# (448 / 300 against 469 / 369), their fewer, longer items filling the SMs worse.
GLUON_D256 = dict(GLUON_BASE, BLOCK_N=32)
GLUON_D256_N64 = dict(GLUON_BASE, BLOCK_N=64, STORE_FROM_REGS=True)
# 64-key tiles with the output staged in the consumers' Q buffers (O_IN_Q: no staging tiles, so two stages fit
# beside Q, and the TMA store stays): on an H100, bf16 (H100_DEC6 + "o-in-q/"), 1.16-1.20x the 32-key tiles' forward
# at 1k keys and 1.07-1.15x the 64-key tiles stored from registers at 4k, causal and not, D = 192 and 256; at 16k
# keys 1.02x causal, 0.94-0.97x non-causal (which keeps STORE_FROM_REGS).
GLUON_D256_OQ = dict(GLUON_BASE, BLOCK_N=64, O_IN_Q=True)
# QK in 256-column tiles with V (and O) in 128 (DeepSeek's MLA, QK 192 / V 128): K and V of 64-key tiles take
# 2 · 64 · (256 + 128) values a stage, so two stages fit beside Q and O (192 KB of 227). H200, bf16: 0.82-0.94 of
# cuDNN at 1k-16k keys.
GLUON_D256_V128 = dict(GLUON_BASE, BLOCK_N=64)
NO_GLUON = "why: no Gluon config for the shape: the TMA kernel runs it"

# D=64 and D=128 take the Gluon forward at every dense length: it is ahead of the TMA kernel at every point of the
# standard sweep (D=64 measured in steady state).
GLUON_FWD = Table(("gpu", "dtype", "head_dim", "variant", "seqlen_k"), rows=[
    # gpu dtype  head dim  variant  seqlen_k      config             source
    (SM90, "16", 128,      CAUSAL,  (None, 4096), GLUON_SHORT,       H200 + "explore16/ab/ab_flat2.txt"),
    (SM90, "16", 128,      FULL,    (None, 1024), GLUON_SHORT,       H200 + "explore16/ab/ab_flat2.txt"),
    (SM90, "16", 128,      ANY,     ANY,          GLUON_BASE,        H200 + "explore8/gluon_72e8c4a825c2.json"),
    (SM90, "16", 64,       CAUSAL,  (None, 4096), GLUON_SHORT_D64,   H200 + "explore17/ab_steady.txt"),
    (SM90, "16", 64,       FULL,    (None, 1024), GLUON_SHORT_D64,   H200 + "explore17/ab_steady.txt"),
    (SM90, "16", 64,       ANY,     ANY,          GLUON_THREE,       H200 + "explore17/ab_steady.txt"),
    (SM90, "16", 256,      ANY,     (None, 1024), GLUON_D256,        H200_MERGED + "explore/explore/gluon.json"),
    (SM90, "16", 256,      ANY,     ANY,          GLUON_D256_N64,    H200_MERGED + "explore/explore/gluon.json"),
    (ANY,  ANY,  ANY,      ANY,     ANY,          None,              NO_GLUON),
])


# The 256-column tiles' forward with its output staged in the Q buffers (GLUON_D256_OQ), ahead of GLUON_FWD's rows
# while GLUON_O_IN_Q is on (False: GLUON_FWD's rows alone, for A/B runs). Timed against them on an H100
# (o-in-q/); its float64 GPU tests and the head-dims sweep with it on there too (o-in-q-on/: D=192 / 256 bf16 at
# 0.93-0.97x cuDNN at 1k keys, where GLUON_FWD's rows read 0.73-0.80x in headdims/).
GLUON_O_IN_Q = True
GLUON_FWD_O_IN_Q = Table(("gpu", "dtype", "head_dim", "variant", "seqlen_k"), rows=[
    # gpu dtype  head dim  variant  seqlen_k      config             source
    (SM90, "16", 256,      CAUSAL,  ANY,          GLUON_D256_OQ,     H100_DEC6 + "o-in-q/oq_wide.txt"),
    (SM90, "16", 256,      FULL,    (None, 4096), GLUON_D256_OQ,     H100_DEC6 + "o-in-q/oq_wide.txt"),
    (ANY,  ANY,  ANY,      ANY,     ANY,          None,              "why: GLUON_FWD's rule"),
])


# Sliding windows: every item spans about the same band of keys, so pairing causal items buys nothing. Bands up to
# 2k keys are short items (GLUON_SHORT: +4 % over GLUON_BASE at a 1k window); longer bands draw their items from
# the counter (GLUON_DYNAMIC: +6 % at a 4k window, where the static assignment leaves the last items' SMs idle).
# Measured at T=16k, D=128, bf16, causal; other head dims keep GLUON_FWD's rule.
WINDOWS = H200_DEC + "variants-hopper/explore_99e4f1c/variants_explore.json"
GLUON_WINDOW_FWD = Table(("gpu", "dtype", "head_dim", "band"), rows=[
    # gpu dtype  head dim  band          config          source
    (SM90, "16", 128,      (None, 2048), GLUON_SHORT,    WINDOWS),
    (SM90, "16", 128,      ANY,          GLUON_DYNAMIC,  WINDOWS),
    (ANY,  ANY,  ANY,      ANY,          None,           "why: GLUON_FWD's rule, as without a window"),
])


# The Gluon forward's head dims: every multiple of 8 up to 256 (rows of 16-byte multiples in fp16 / bf16: the
# TMA's stride rule). Its tiles span 64, 128 or 256 columns (`kernels.gluon_common.head_block`), the TMA loading a
# narrower head's missing columns as zeros; a head dim takes its tiles' rows of the tables (D=40 D=64's, 160 and
# 224 D=256's). An H100, bf16, causal, T = 1k / 4k, beside cuDNN: forward 0.98-1.00x at D=40, 0.95-0.96x at 160,
# 0.93-0.98x at 224 (H100_DEC6 + "dims8/"), the portable forward 0.26-0.37x (H100_DEC6 + "padded-dims/").
GLUON_HEAD_DIMS = tuple(range(8, 257, 8))


def gluon_head_block(head_dim: int) -> int | None:
    """The head dim the Gluon forward's tiles span for D (the tables' row), None for a D it does not take."""
    if head_dim not in GLUON_HEAD_DIMS:
        return None
    return gluon_tile_width(head_dim)


# V's head dim where it is not QK's (`head_dim_v`): a V in tiles as wide as QK's takes QK's rule; otherwise
# the rule of the pair of tile widths, here.
GLUON_SEPARATE_V_FWD = Table(("gpu", "dtype", "head_dim", "head_dim_v"), rows=[
    # gpu dtype  QK tiles  V tiles  config            source
    (SM90, "16", 256,      128,     GLUON_D256_V128,  H200_MERGED + "h200/separate_v/bench.json"),
    (ANY,  ANY,  ANY,      ANY,     None,             "why: no Gluon config for the pair: the portable kernel runs it"),
])


# Dropout in the Gluon forward (`kernels.gluon_common.dropout_keep`: the portable kernels' mask, bit for bit): dense
# calls without a window at the head dims GLUON_DROPOUT_FWD times faster than the portable forward with dropout; every
# other dropout call takes the portable forward. p = 0.1, bf16, the Gluon forward against the portable one in one run:
# an H100 at T = 4k (DROPOUT_EVIDENCE, the mask code of `variant.philox` / `dropout_select`): D=128 1.22x / 1.29x
# (non-causal / causal), D=64 1.17x / 1.28x; on the H200 with its run's mask code (ten Philox rounds; T = 1k / 4k / 16k,
# DROPOUT_EVIDENCE_H200) D=128 1.00-1.16x, D=64 0.79-0.99x. The flat loop's dropout builds spill at most 16 bytes
# (triton 3.6's ptxas; benchmarks/2026-12-03-h200/offline-builds/gluon_dropout_spills.txt). GLUON_DROPOUT off: every
# dropout call takes the portable forward; GLUON_DROPOUT_ALL on (tests, A/B runs): every dropout call the Gluon forward
# has a rule for takes it (GLUON_DROPOUT_FWD's, else its rule without dropout).
DROPOUT_EVIDENCE = "benchmarks/2026-12-07-h100/dropout-mask-code/results/dropout_after/dropout.json"
DROPOUT_EVIDENCE_H200 = "benchmarks/2026-12-03-h200/gluon-dropout-fields16/dropout.json"
GLUON_DROPOUT = True
GLUON_DROPOUT_ALL = False
GLUON_DROPOUT_FWD = Table(("gpu", "dtype", "head_dim"), rows=[
    # gpu dtype  head dim  config           source
    (SM90, "16", 128,      GLUON_SHORT,     DROPOUT_EVIDENCE),
    (SM90, "16", 64,       GLUON_SHORT_D64, DROPOUT_EVIDENCE),
    (ANY,  ANY,  ANY,      None,            "why: not timed with dropout: the portable forward"),
])


# Softcap in the Gluon forward against a fixed max (`kernels.forward_gluon_launch.cap_fixed` says where it applies:
# bf16, no ALiBi, cap <= 54): no row max and no rescale of the output per tile. Softcap 50, bf16, causal, against
# the same call without softcap (CAP_FIXED_SOURCE, beside cuDNN): T=4k D=128 +12.9 % -> +7.5 %, T=8k D=256
# +9.8 % -> -7.7 % (the dense kernel's max and rescale cost more than the tanh). Off: the online max, as without
# softcap.
GLUON_CAP_FIXED = True
CAP_FIXED_SOURCE = "benchmarks/2026-12-04-h200/softcap-fixed/softcap_ab.json"

# The tile widths whose Gluon forward runs Q Kᵀ over the head's own columns (`kernels.forward_gluon_launch.qk_width`:
# the head dim rounded up to a sum of up to three powers of two, a wgmma each) instead of the whole tile, whose last
# columns are zeros. Against the whole tiles in one H100 run (bf16, T = 1k … 16k, causal and not): D=80 1.08-1.13x,
# 96 1.07-1.10x, 112 1.02-1.05x, 192 1.02-1.09x, QK 192 / V 128 1.05-1.12x (QK_TRIM_SOURCE).
GLUON_QK_TRIM = (128, 256)
QK_TRIM_SOURCE = "benchmarks/2026-12-06-h100/trim/trim_ab.json"
# The Gluon forward's output in two accumulators at V head dims 129 … 192 (`kernels.forward_gluon_launch.pv_split`:
# P V over V's columns 0 … 127 and 128 … 191 instead of the 256-column tile's; no register spills where one
# accumulator spilled 12 bytes): at D=192, T = 1k … 16k, causal and not, 1.14-1.16x the whole tiles' forward
# against 1.05-1.09x with the trimmed Q Kᵀ alone, in one H100 run (PV_SPLIT_SOURCE).
GLUON_PV_SPLIT = True
PV_SPLIT_SOURCE = "benchmarks/2026-12-06-h100/pv-split/trim_ab.json"


def _dropout_gate(dropout: bool) -> bool:
    """Whether a call may take a Gluon forward rule by itself: always without dropout, else only under
    GLUON_DROPOUT_ALL (dense calls without a window have GLUON_DROPOUT_FWD)."""
    return not dropout or (GLUON_DROPOUT and GLUON_DROPOUT_ALL)


def gluon_fwd_config(head_dim: int, seqlen_q: int, seqlen_k: int, causal: bool, band: int = 0,
                     head_dim_v: int | None = None, dropout: bool = False) -> dict | None:
    """The Gluon forward's config for a dense call (`GLUON_FWD`), or None (the TMA kernel). `band`: the most keys
    a query row sees under a sliding window (0: no window), which picks `GLUON_WINDOW_FWD`'s rule where it is
    shorter than the keys. Head dims take the rows of their tiles' (`gluon_head_block`: D=80 those of 128).
    `head_dim_v`: V's head dim (default: D), `GLUON_SEPARATE_V_FWD` where its tiles are narrower than QK's.
    `dropout`: the call drops probabilities (GLUON_DROPOUT_FWD's rule, or None)."""
    head_dim, block_v = gluon_head_block(head_dim), gluon_head_block(head_dim if head_dim_v is None else head_dim_v)
    if head_dim is None or block_v is None or (dropout and not GLUON_DROPOUT):
        return None
    if dropout and block_v == head_dim and not 0 < band < seqlen_k:
        config = GLUON_DROPOUT_FWD.lookup(SM90, "16", head_dim)
        if config is not None:
            return config
    if not _dropout_gate(dropout):
        return None
    if block_v != head_dim:
        return GLUON_SEPARATE_V_FWD.lookup(SM90, "16", head_dim, block_v)
    if 0 < band < seqlen_k:
        config = GLUON_WINDOW_FWD.lookup(SM90, "16", head_dim, band)
        if config is not None:
            return config
    if GLUON_O_IN_Q and not dropout:  # (dropout at these tiles, under GLUON_DROPOUT_ALL: GLUON_FWD's, as tested)
        config = GLUON_FWD_O_IN_Q.lookup(SM90, "16", head_dim, variant_class(causal), seqlen_k)
        if config is not None:
            return config
    return GLUON_FWD.lookup(SM90, "16", head_dim, variant_class(causal), seqlen_k)


# Packed (varlen) batches, causal or not, with items drawn from a counter (DYNAMIC), so that programs that drew
# short sequences draw more: at D=128 GLUON_DYNAMIC (20 % off the causal forward against a static share per
# program; ahead of the TMA kernel's best tiles non-causal); in 256-column tiles (D = 192, 256) the dense rule's
# 64-key tiles stored from registers, 2.1-2.8x the portable forward that ran them and 1.5-1.7x FLASH's varlen forward
# (VARLEN_WIDE: an H100, the varlen suite's batch, bf16). D=64 keeps the TMA kernel there (the Gluon forward's
# 0.88-0.98x of it).
VARLEN_WIDE = H100_DEC6 + "varlen-wide/varlen_wide_ab.json"
GLUON_D256_VARLEN = dict(GLUON_D256_N64, CAUSAL_PAIRS=False, DYNAMIC=True)
GLUON_VARLEN_FWD = Table(("gpu", "dtype", "head_dim"), rows=[
    # gpu dtype  head dim  config             source
    (SM90, "16", 128,      GLUON_DYNAMIC,     H200 + "explore9/varlen_fwd_de6340f13ce5.json"),
    (SM90, "16", 256,      GLUON_D256_VARLEN, VARLEN_WIDE),
    (SM90, "16", 64,       None,              "why: the TMA kernel is faster on packed batches: " + VARLEN_WIDE),
    (ANY,  ANY,  ANY,      None,              NO_GLUON),
])
# Narrower heads in 64-column tiles (D = 8 ... 56), which the TMA kernel does not take (it runs D=64 itself): items
# from a counter, the config that ran the varlen suite's batch at D=64 at 0.88-0.98x the TMA kernel's rate, 1.44x
# FLASH's varlen forward (causal; VARLEN_WIDE: "gluon dynamic"); the alternative is the portable forward (0.26-0.29x
# cuDNN at D=40 dense: H100_DEC6 + "padded-dims/"). Built offline without spills; not yet run on a GPU here.
GLUON_NARROW_VARLEN = GLUON_DYNAMIC
# V in tiles narrower than QK's on packed batches: QK 256 / V 128 (DeepSeek's MLA, 192 / 128) takes the dense
# pair's 64-key tiles with items from a counter, 2.7-3.0x the portable forward that ran it (VARLEN_WIDE).
GLUON_SEPARATE_V_VARLEN_FWD = Table(("gpu", "dtype", "head_dim", "head_dim_v"), rows=[
    # gpu dtype  QK tiles  V tiles  config                                                source
    (SM90, "16", 256,      128,     dict(GLUON_D256_V128, CAUSAL_PAIRS=False, DYNAMIC=True), VARLEN_WIDE),
    (ANY,  ANY,  ANY,      ANY,     None,  "why: no Gluon config for the pair on packed batches: the portable kernel"),
])


def gluon_varlen_config(head_dim: int, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                        head_dim_v: int | None = None, dropout: bool = False) -> dict | None:
    """The Gluon forward's config for packed (varlen) batches (`GLUON_VARLEN_FWD`), or None (the TMA kernel).
    `head_dim_v`: V's head dim (default: D); a V in tiles of another width than QK's takes
    `GLUON_SEPARATE_V_VARLEN_FWD`'s rule.
    `dropout`: the call drops probabilities (None but under GLUON_DROPOUT_ALL: not timed with dropout)."""
    block, block_v = gluon_head_block(head_dim), gluon_head_block(head_dim if head_dim_v is None else head_dim_v)
    if block is None or block_v is None or not _dropout_gate(dropout):
        return None
    if block_v != block:
        return GLUON_SEPARATE_V_VARLEN_FWD.lookup(SM90, "16", block, block_v)
    if block == 64 and head_dim < 64:
        return GLUON_NARROW_VARLEN
    return GLUON_VARLEN_FWD.lookup(SM90, "16", block)


# Paged prefill over pages smaller than GLUON_VARLEN_FWD's 128-key tiles: GATHER_PAGES, the producer gathers each
# tile from one TMA box per page (pages of a multiple of 8 keys dividing 128), so the consumers run the varlen rule's
# tiles. H200, bf16 causal D=128, against the dense varlen call over the same tokens (PAGED_GATHER_EVIDENCE): pages
# of 8 / 16 / 32 / 64 / 128 / 256 keys 0.70 / 0.89 / 0.94 / 0.96 / 0.95 / 0.97. GATHER_PAGES = False (A/B runs)
# takes GLUON_PAGED_FWD's rows instead, tiles of one page each: pages of 64 0.86, 32 the portable kernel's 0.67
# (the same run's tiles-of-one-page/).
PAGED_GATHER_EVIDENCE = "benchmarks/2026-12-03-h200/paged-gather/paged_prefill.json"
GATHER_PAGES = True
GLUON_PAGED_FWD = Table(("gpu", "dtype", "head_dim", "page_size"), rows=[
    # gpu dtype  head dim  page size  config                                           source
    (SM90, "16", 128,      64,        dict(GLUON_DYNAMIC, BLOCK_N=64, NUM_BUFFERS=4),  H200_PAGED + "explore/p64_b4/paged_prefill.json"),
    (ANY,  ANY,  ANY,      ANY,       None,  "why: pages of whole 128-key tiles: GLUON_VARLEN_FWD's rule; others portable"),
])


def gluon_paged_config(head_dim: int, max_seqlen_q: int, max_seqlen_k: int, causal: bool, page_size: int,
                       head_dim_v: int | None = None, dropout: bool = False) -> dict | None:
    """The Gluon forward's config for paged varlen prefill over pages of `page_size` keys, or None (the portable
    kernel): `gluon_varlen_config`'s where its key tiles divide a page or are made of whole pages of a multiple of
    8 keys (the producer gathers them: `kernels.forward_gluon_producer.load_item`), else `GLUON_PAGED_FWD`'s.
    `dropout`: as `gluon_fwd_config`'s. Not in 64-column tiles (D <= 64): neither tested nor timed there."""
    if gluon_head_block(head_dim) == 64:
        return None
    config = gluon_varlen_config(head_dim, max_seqlen_q, max_seqlen_k, causal, head_dim_v, dropout)
    if config is None or page_size % config["BLOCK_N"] == 0 or (
            GATHER_PAGES and config["BLOCK_N"] % page_size == 0 and page_size % 8 == 0):
        return config
    return GLUON_PAGED_FWD.lookup(SM90, "16", gluon_head_block(head_dim), page_size)


def _fwd_fits(config: triton.Config, head_dim_padded: int, elem_bytes: int) -> bool:
    bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    warps, stages = config.num_warps, config.num_stages
    # Shared memory: the Q tile and `stages` buffers of K and V tiles; H100 / H200 allow 227 KiB a block, A100
    # 163 KiB: keep to the smaller, so that one list serves both.
    smem = elem_bytes * head_dim_padded * (bm + 2 * bn * max(stages - 1, 1))
    if smem > 160 * 1024:
        return False
    # Registers: the fp32 accumulator (BM x D) and scores (BM x BN) spread over the warps' threads.
    acc_regs_per_thread = (bm * head_dim_padded + bm * bn) / (warps * 32)
    if acc_regs_per_thread > 160:
        return False
    # Too many warps for a tiny tile waste the machine; too few for a big one spill.
    if bm == 32 and warps == 8:
        return False
    if bm == 128 and warps == 4 and head_dim_padded >= 128 and bn >= 128:
        return False
    if bn > bm * 2:
        return False
    return True


def prune_fwd_configs(configs, named_args, **kwargs):
    head_dim_padded = padded_head_dims(named_args, kwargs)
    elem_bytes = named_args["Q"].element_size()
    if elem_bytes == 4:  # fp32 runs the exact (IEEE) dot: small tiles only
        kept = [c for c in configs if c.kwargs["BLOCK_M"] <= 64 and c.kwargs["BLOCK_N"] <= 64]
    else:
        kept = [c for c in configs if _fwd_fits(c, head_dim_padded, elem_bytes)]
    # Short sequences: a BLOCK_N wider than the keys only multiplies masked work.
    seqlen_k_bucket = named_args["TUNE_SEQLEN_K"]
    kept = [c for c in kept if c.kwargs["BLOCK_N"] <= max(32, seqlen_k_bucket)] or kept
    return kept or configs[:1]
