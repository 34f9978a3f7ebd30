"""Backward configs: the Triton kernels' candidates and defaults, the Hopper Gluon kernels' table and gates."""

from __future__ import annotations

import triton

from ..kernels.host import gluon_tile_width
from .table import (ANY, CAUSAL, H200, H200_DEC4, H200_LATE, H200_WIDE, SM90, Table, padded_head_dims, tiles,
                    variant_class, width)

# Two tuned kernels: dK/dV (one program per BLOCK_N keys, streaming BLOCK_M query rows of every head of its GQA
# group) and dQ (one program per BLOCK_M query rows, streaming BLOCK_N keys). The delta kernel is not tuned.
BWD_AUTOTUNE_KEY = ["TUNE_SEQLEN_Q", "TUNE_SEQLEN_K", "HEAD_DIM", "HEAD_DIM_V", "IS_CAUSAL", "IS_VARLEN"]

# Candidates (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel, input width ("16": fp16 / bf16, "32": fp32) and
# padded head dim (64 stands for 16..64). dK/dV keeps two fp32 (BLOCK_N, D) accumulators and K, V resident, dQ one
# (BLOCK_M, D) accumulator and Q, dO: wide BLOCK_N for dK/dV, wide BLOCK_M for dQ, as in FlashAttention-2 and
# Triton's tutorial; at D=256 only small tiles fit. Every entry compiles without register spills (stack <= 16
# bytes) for sm_80 and sm_90 with triton 3.6 (offline `triton.compile` on a GPUTarget, 16-byte-aligned pointers,
# unit last stride; `cuobjdump -res-usage`; no results file), the fp32 lists for sm_90 only. The first entry of a
# list is the default off Hopper; autotuning picks among them on the GPU.
BWD_CANDIDATES = {
    "dkdv": {
        ("16", 64): [(32, 128, 8, 2), (64, 128, 8, 2), (64, 128, 8, 3), (32, 64, 4, 2), (32, 64, 4, 3),
                     (64, 64, 4, 3), (64, 64, 8, 2), (32, 32, 4, 2)],
        ("16", 128): [(32, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 2), (32, 64, 4, 2), (64, 64, 8, 2),
                      (32, 64, 8, 2), (16, 64, 4, 3), (32, 32, 4, 2)],
        ("16", 256): [(32, 32, 8, 2), (64, 32, 8, 2), (32, 16, 4, 2), (16, 32, 4, 2), (32, 32, 4, 2)],
        ("32", 64): [(32, 32, 8, 2), (16, 32, 4, 2), (32, 16, 4, 2)],
        ("32", 128): [(16, 32, 4, 2), (16, 16, 4, 2)],
        ("32", 256): [(16, 32, 8, 2), (16, 16, 4, 2)],
    },
    "dq": {
        ("16", 64): [(128, 32, 8, 2), (128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3),
                     (64, 64, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2)],
        ("16", 128): [(128, 32, 8, 2), (64, 64, 8, 2), (64, 32, 4, 3), (64, 32, 4, 2), (32, 64, 4, 2),
                      (32, 32, 4, 2)],
        ("16", 256): [(64, 32, 8, 2), (32, 32, 8, 2), (16, 64, 8, 2), (32, 32, 4, 2), (32, 16, 4, 2)],
        ("32", 64): [(32, 32, 4, 2), (32, 32, 8, 2), (16, 64, 4, 2), (16, 32, 4, 2), (32, 16, 4, 2)],
        ("32", 128): [(32, 32, 8, 2), (32, 16, 4, 2), (16, 32, 4, 2), (16, 16, 4, 2)],
        ("32", 256): [(32, 32, 8, 2), (16, 32, 8, 2), (16, 16, 4, 2)],
    },
}


def _bwd_configs(kernel: str) -> list:
    seen = dict.fromkeys(t for lists in BWD_CANDIDATES[kernel].values() for t in lists)  # ordered, unique
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in seen]


BWD_DKDV_CONFIGS = _bwd_configs("dkdv")
BWD_DQ_CONFIGS = _bwd_configs("dq")

# The one config the interpreter uses for both kernels.
BWD_INTERPRETER_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}

FIRST_CANDIDATE = "the first candidate"  # a config that says: each kernel's first entry of BWD_CANDIDATES


def pair(dkdv: tuple, dq: tuple) -> dict:
    return {"dkdv": tiles(*dkdv), "dq": tiles(*dq)}


# The Triton backward's defaults {"dkdv": .., "dq": ..}. Hopper, fp16 / bf16, D <= 128: small tiles with 4 warps
# and 3 stages, the fastest when each kernel is swept with the other fixed.
TRITON_BWD = Table(("gpu", "dtype", "head_dim", "variant"), rows=[
    # gpu dtype  head dim     variant  config                                       source
    (SM90, "16", (None, 64),  CAUSAL,  pair(dkdv=(64, 64, 4, 3), dq=(64, 32, 4, 3)), H200 + "explore/bwd.json"),
    (SM90, "16", (None, 128), ANY,     pair(dkdv=(32, 64, 4, 3), dq=(64, 32, 4, 3)), H200 + "explore/bwd.json"),
    (ANY,  ANY,  ANY,         ANY,     FIRST_CANDIDATE, "why: the widest spill-free candidate (BWD_CANDIDATES)"),
])


def default_bwd_configs(head_dim_padded: int, elem_bytes: int, device, causal: bool = False) -> dict:
    """The Triton backward's configs {"dkdv": .., "dq": ..}: `TRITON_BWD`'s rule for the call."""
    configs = TRITON_BWD.lookup(device, width(elem_bytes), head_dim_padded, variant_class(causal))
    if configs == FIRST_CANDIDATE:
        key = (width(elem_bytes), max(64, head_dim_padded))
        return {kernel: tiles(*BWD_CANDIDATES[kernel][key][0]) for kernel in ("dkdv", "dq")}
    return configs


# Hopper's Gluon backward kernels (kernels/backward_gluon.py: a TMA producer and two consumer warpgroups; dK/dV
# holding 128 keys, dQ holding 128 query rows): fp16 / bf16 at D = 64 and 128 on sm_90, dense and varlen, where no
# Triton config is forced. Below GLUON_BWD_MIN_FLOPS of work (forward FLOPs, 4·B·Hq·Sq·Sk·D, halved when causal)
# the Triton kernels' GPU time does not hide the Gluon launches' host time (13 TMA descriptors encoded a call).
# H200, through autograd: benchmarks/2026-11-29-h200/explore11/run_5af617d97779/explore/bwd_host.json. With the
# backward's plan kept, causal T=512 at D=128 (B·T=16k, H=16: 3.4e10) still stays below: there the Gluon kernels
# take 0.79x the Triton ones' GPU time (359 against 457 us), but their call spends 410 us on the host, more than
# its GPU time, so in do_bench (the GPU idle when a call starts) the host work before the first launch adds to it:
# 0.54x cuDNN against the Triton kernels' 0.88x (benchmarks/2026-12-03-h200/bwd-short/bwd_short.txt with the
# floor at 3e10, benchmarks/2026-12-03-h200/bwd-short-5e10/bwd_short.txt at 5e10; the host and GPU times:
# benchmarks/2026-12-03-h200/variant-host-noop/variant_host.txt).
GLUON_BWD_MIN_FLOPS = 5e10
# D = 64 up to 512 keys: the Gluon kernels' GPU time is level with the Triton ones', so their extra host time would
# only show. H200: benchmarks/2026-11-29-h200/explore10/gluon_bwd_8c6167939b66.json
GLUON_BWD_D64_MIN_KEYS = 513

# The Gluon backward's configs by head dim: D = 128 3 stages, dQ by 64-key tiles (128-key tiles need 64 more
# score registers a thread); D = 64 2 stages, dQ by 128-key tiles, dK/dV with K and V in registers (KV_REGS: the
# dK/dV kernel 0.89x / 0.96x the time with them read from shared memory, non-causal / causal T=4k, our kernels
# alone on an H100, benchmarks/2026-12-07-h100/kv-regs/gluon_bwd_ab.json; at D = 128 they spill). Packed (varlen)
# batches take the same configs, 1.25-1.35x faster than the Triton kernels on the varlen suite's batch.
# H200: benchmarks/2026-11-29-h200/explore11/run_9452517c10f2/explore/varlen_bwd.json
GLUON_BWD_D128 = {"dkdv": dict(NUM_STAGES=3, CONSUMER_REGS=240),
                  "dq": dict(BLOCK_N=64, NUM_STAGES=3, CONSUMER_REGS=240)}
GLUON_BWD_D64 = {"dkdv": dict(NUM_STAGES=2, CONSUMER_REGS=240, KV_REGS=3),
                 "dq": dict(BLOCK_N=128, NUM_STAGES=2, CONSUMER_REGS=240)}
# D = 256 (and 192 in its tiles): dK/dV programs of 64 keys whose two warpgroups split the columns
# (`backward_gluon_dkdv.dkdv_keys`), 2 stages of Q / dO (197 KB of shared memory with K / V); dQ by 32-key tiles, 2
# stages (Q / dO of 128 rows take 128 KB). Both compile without spills (tests/test_backward_gluon.py). H200, bf16:
# 0.79-1.23x cuDNN at D = 256, 0.94-1.10x at 192, above FLASH everywhere (the source below).
GLUON_BWD_D256 = {"dkdv": dict(NUM_STAGES=2, CONSUMER_REGS=240),
                  "dq": dict(BLOCK_N=32, NUM_STAGES=2, CONSUMER_REGS=240)}
# Head dims the Gluon backward runs: every multiple of 8 up to 256 (the forward's, `configs.GLUON_HEAD_DIMS`), in
# the tiles of 64, 128 or 256 columns that hold them (`kernels.gluon_common.head_block`: the TMA loads the missing
# columns as zeros and stores none of them): 80, 96, 112 in D=128's (H200, bf16: 0.88-0.98x cuDNN, above FLASH at
# every point, benchmarks/2026-12-02-h200/gluon-head-dims/h200/headdims_gluon/bench.json), 192 in D=256's. An
# H100, bf16, causal, T = 1k / 4k: 0.95-0.97x cuDNN at D=40, 1.09-1.15x at 160, 1.00-1.13x at 224 (H100_DEC6 +
# "dims8/"); the portable kernels read 0.24-0.42x there.
GLUON_BWD_HEAD_DIMS = tuple(range(8, 257, 8))
GLUON_BWD = Table(("gpu", "dtype", "head_dim"), rows=[
    # gpu dtype  head dim  config          source
    (SM90, "16", 128,      GLUON_BWD_D128, H200 + "explore10/gluon_bwd_8c6167939b66.json"),
    (SM90, "16", 64,       GLUON_BWD_D64,  H200 + "explore10/gluon_bwd_8c6167939b66.json"),
    (SM90, "16", 256,      GLUON_BWD_D256, H200_WIDE + "wide_bwd/bench.json"),
    (ANY,  ANY,  ANY,      None,           "why: no Gluon config for the head dim: the Triton kernels run it"),
])


# V with a head dim of its own: the Gluon backward's config per pair of tile widths (QK's, V's), for the pairs whose
# kernels the H200 has run against float64 (tests/test_backward_gluon.py's SEPARATE_V_PAIRS, SEPARATE_V_TESTS);
# other pairs, equal tile widths with other head dims among them, take the Triton kernels. QK 192 / V 128
# (DeepSeek's MLA; QK in 256-column tiles): D=256's dK/dV config, dQ by 64-key tiles (1.079x D=256's 32-key tiles
# on the causal pair at T=4k); with them the pair's backward runs at 1.19-1.22x cuDNN non-causal and 0.70-0.85x causal
# (bf16, T=1k-16k, benchmarks/2026-12-03-h200/separate-v-dq64/bench.json). QK 128 / V 64 and QK 64 / V 128: D=128's
# rows (the wider tiles': their stages fit), tested, not timed.
SEPARATE_V_TESTS = "benchmarks/2026-12-03-h200/tests/pytest_sepv_dad5f92.txt"
GLUON_BWD_SEPARATE_V = Table(("gpu", "dtype", "head_dim", "head_dim_v"), rows=[
    # gpu dtype  QK tiles  V tiles  config                                                   source
    (SM90, "16", 256,      128,     {"dkdv": GLUON_BWD_D256["dkdv"],
                                     "dq": dict(BLOCK_N=64, NUM_STAGES=2, CONSUMER_REGS=240)},
     H200_LATE + "gluon-bwd-ab/gluon_bwd_ab.json"),
    (SM90, "16", 128,      64,      GLUON_BWD_D128,  "why: D=128's rows; tested (SEPARATE_V_TESTS), not timed"),
    (SM90, "16", 64,       128,     GLUON_BWD_D128,  "why: D=128's rows; tested (SEPARATE_V_TESTS), not timed"),
    (ANY,  ANY,  ANY,      ANY,     None,  "why: a pair not run on the H200 against float64: the Triton kernels"),
])


# The head dims whose pairs (QK, V) the H200 has run through the Gluon backward against float64 (SEPARATE_V_TESTS).
GLUON_BWD_PAIR_HEAD_DIMS = (64, 80, 96, 112, 128, 192, 256)


def gluon_bwd_pair_config(head_dim: int, head_dim_v: int) -> dict | None:
    """The Gluon backward's config for QK head dim `head_dim` with V head dim `head_dim_v` (!= head_dim): both of
    GLUON_BWD_PAIR_HEAD_DIMS and their tile widths a row of GLUON_BWD_SEPARATE_V; else None (the Triton kernels)."""
    if head_dim not in GLUON_BWD_PAIR_HEAD_DIMS or head_dim_v not in GLUON_BWD_PAIR_HEAD_DIMS:
        return None
    return GLUON_BWD_SEPARATE_V.lookup(SM90, "16", gluon_tile_width(head_dim), gluon_tile_width(head_dim_v))


# Dropout in the Gluon backward (the forward's keep-mask regenerated: `kernels.gluon_common.dropout_tile` and
# `dropout_tile_t`): dense calls of GLUON_BWD_DROPOUT_CASES (tile width, causal), where it is faster than the Triton
# backward with dropout. p = 0.1, bf16, in one run (configs.forward.DROPOUT_EVIDENCE: an H100, T = 4k): D=128 1.25x /
# 1.27x the Triton backward (non-causal / causal), D=64 1.18x / 1.09x; on the H200 with its run's mask code (ten Philox
# rounds; T = 1k / 4k / 16k, configs.forward.DROPOUT_EVIDENCE_H200): D=128 0.99-1.12x, D=64 non-causal 1.07-1.09x,
# causal 0.91-0.99x. Varlen dropout calls are not timed: the Triton backward. Tiles of 256 columns (two warpgroups
# sharing 64 keys) have no dropout build. GLUON_BWD_DROPOUT off: every dropout call takes the Triton backward;
# GLUON_BWD_DROPOUT_ALL on (tests, A/B runs): every dropout call the Gluon backward has a rule for takes it.
GLUON_BWD_DROPOUT = True
GLUON_BWD_DROPOUT_ALL = False
GLUON_BWD_DROPOUT_CASES = {(128, False), (128, True), (64, False), (64, True)}


# The dense Gluon backward's preprocess (delta = rowsum(dO ∘ O), lse into the padded layout) done by its dQ kernel,
# which then runs first (`kernels.backward_gluon_dq._fused_delta`): one launch and one pass over O and dO fewer. Dense
# calls whose tiles are up to 128 columns wide (D and Dv up to 128: what was timed, GLUON_BWD_FUSED_DELTA_SOURCE;
# the 256-column builds compile without spills and pass their float64 tests on the H200, not timed), not with a
# sink unless GLUON_BWD_FUSED_SINK, nor varlen. Off: the preprocess kernel, then dK/dV, then dQ.
GLUON_BWD_FUSED_DELTA = True
GLUON_BWD_FUSED_DELTA_SOURCE = H200_DEC4 + "gluon-bwd-ab/fused_delta.json"
# With a sink, its gradient's parts from the dQ kernel too (`_fused_delta`'s FD_SINK; the host sums the parts in a
# fixed order): the sinks' backward at T=4096 D=128 causal 1657 -> 1637 us with the host work (GLUON_FUSED_AB_SOURCE).
GLUON_BWD_FUSED_SINK = True

# The tile widths whose Gluon backward runs S (Sᵀ) and dP (dPᵀ), the products over the head dim, on the head's own
# columns (`kernels.backward_gluon_launch.product_widths`: QK_WIDTH / V_WIDTH, `gluon_common.mma_nt`) instead of
# the whole tile, whose last columns are zeros, where that takes at most GLUON_BWD_TRIM_PIECES wgmmas. Against the
# whole tiles in one H100 run (bf16, T = 1k … 16k, causal and not): D=80 (64 + 16) 1.02-1.14x, 96 (64 + 32)
# 1.02-1.09x, 192 (128 + 64) 1.09-1.14x, QK 192 / V 128 1.04-1.06x; 112 (64 + 32 + 16) 0.96-1.02x, so it keeps
# the whole tiles (GLUON_BWD_TRIM_SOURCE).
GLUON_BWD_TRIM = (128, 256)
GLUON_BWD_TRIM_PIECES = 2
GLUON_BWD_TRIM_SOURCE = "benchmarks/2026-12-06-h100/trim/trim_ab.json"
# The Gluon dQ kernel's accumulator in two over the trimmed head's pieces (`kernels.backward_gluon_launch.dq_split`:
# D=192 as 128 + 64 columns), so that dS K skips the 256-column tiles' zero columns. On an H100, bf16, T = 1k / 4k /
# 16k, causal and not: the backward 0.99-1.06x of the trimmed products' alone at QK 192 / V 192 and 192 / 128
# (GLUON_BWD_DQ_SPLIT_SOURCE).
GLUON_BWD_DQ_SPLIT = True
GLUON_BWD_DQ_SPLIT_SOURCE = "benchmarks/2026-12-06-h100/dq-split-decode/trim_ab.txt"
# The Triton backward's preprocess in its dQ kernel (`kernels.backward_kernels._fused_delta`: dQ first, then dK/dV; with
# dlse and the sink's gradient's parts too; not under autotuning, whose dQ tiles are picked at the first launch):
# one launch, two allocations and one pass over O and dO fewer. The short, host-bound backward (bf16, B*T = 16k,
# T = 256-1024, D = 64 / 128, causal and not) 1.02-1.06x faster with the host work, sinks with a 128-key window
# 0.99x (D=64) / 1.28x (D=128) (GLUON_FUSED_AB_SOURCE, beside cuDNN).
TRITON_BWD_FUSED_DELTA = True
GLUON_FUSED_AB_SOURCE = H200_DEC4 + "fused-ab/fused_delta_ab.json"


# Tiles in three loops, the masked ones around those every pair of which is visible (SPLIT = 1: those run without
# mask code; in dK/dV their dPᵀ issued beside Sᵀ), per kernel. Kernel times (torch.profiler, candidates read in
# rotating order; bf16, T=16k H=16 windows and dense causal, T=4k B=4 softcap 50 and D=64 causal) against the same
# config unsplit in one run:
# - dK/dV (GLUON_BWD_SPLIT_SOURCE): window 1024 0.96x, window 4096 0.95x (with 2 stages of Q / dO; against the 3
#   stages of D=128's row 0.94x / 0.94x), D=64 causal 0.95x, softcap 0.97x
#   (benchmarks/2026-12-04-h200/gluon-bwd-ab/split_rotated.json); D=128 causal without a variant level at T=4k and
#   16k (1.00-1.01x, benchmarks/2026-12-04-h200/gluon-bwd-ab/split.json), so its dK/dV stays unsplit.
# - dQ (GLUON_BWD_SPLIT_DQ_SOURCE): window 1024 0.99x, window 4096 0.98x, D=128 causal 0.96x, softcap 0.97x, D=64
#   causal 0.97x.
# Dense calls without dropout or ALiBi (what was timed; varlen calls are not split, and with ALiBi the whole
# dK/dV tiles' loop spills 14 values a tile: benchmarks/2026-12-04-h200/offline-builds/split_sass_counts.txt).
GLUON_BWD_SPLIT_CASES = {  # (the tiles' width, what the call has): {kernel: its config's overrides}
    (128, "window"): {"dkdv": dict(NUM_STAGES=2, SPLIT=1), "dq": dict(SPLIT=1)},
    (128, "causal softcap"): {"dkdv": dict(SPLIT=1), "dq": dict(SPLIT=1)},
    (128, "causal"): {"dq": dict(SPLIT=1)},
    (64, "causal"): {"dkdv": dict(SPLIT=1), "dq": dict(SPLIT=1)},
}
GLUON_BWD_SPLIT_SOURCE = H200_DEC4 + "gluon-bwd-ab/split_unsplit.json"
GLUON_BWD_SPLIT_DQ_SOURCE = H200_DEC4 + "gluon-bwd-ab/split_dq.json"


def gluon_bwd_config(head_dim: int, seqlen_q: int, seqlen_k: int, causal: bool,
                     fwd_flops: float = float("inf"), varlen: bool = False,
                     head_dim_v: int | None = None, dropout: bool = False, window: bool = False,
                     softcap: bool = False, alibi: bool = False) -> dict | None:
    """{"dkdv": config, "dq": config} of the Gluon backward kernels (`GLUON_BWD`), or None (the Triton kernels):
    None with less work than GLUON_BWD_MIN_FLOPS, or at D = 64 with fewer keys than GLUON_BWD_D64_MIN_KEYS.
    `head_dim_v`: V's head dim where it is not D: `gluon_bwd_pair_config`. `dropout`: the call drops
    probabilities (GLUON_BWD_DROPOUT_CASES, dense, or every case under GLUON_BWD_DROPOUT_ALL). `window`,
    `softcap`, `alibi`: the call has a sliding window, a softcap, ALiBi slopes (dense calls without dropout or
    ALiBi: the first of GLUON_BWD_SPLIT_CASES' rules that the call's tiles and variant have)."""
    if fwd_flops < GLUON_BWD_MIN_FLOPS or (head_dim == 64 and seqlen_k < GLUON_BWD_D64_MIN_KEYS):
        return None
    if dropout and (not GLUON_BWD_DROPOUT or gluon_tile_width(head_dim) >= 256 or not GLUON_BWD_DROPOUT_ALL and (
            varlen or head_dim_v not in (None, head_dim)
            or (gluon_tile_width(head_dim), bool(causal)) not in GLUON_BWD_DROPOUT_CASES)):
        return None
    if head_dim_v is not None and head_dim_v != head_dim:
        return gluon_bwd_pair_config(head_dim, head_dim_v)
    if head_dim not in GLUON_BWD_HEAD_DIMS:
        return None
    config = GLUON_BWD.lookup(SM90, "16", gluon_tile_width(head_dim))  # the tiles' columns: their table row
    if varlen or dropout or alibi:
        return config
    # a window takes only a window's rule (a window at D=64 split is neither tested on the GPU nor timed)
    kinds = ["window"] if window else ["causal softcap"] * bool(causal and softcap) + ["causal"] * bool(causal)
    split = next((GLUON_BWD_SPLIT_CASES[gluon_tile_width(head_dim), kind] for kind in kinds
                  if (gluon_tile_width(head_dim), kind) in GLUON_BWD_SPLIT_CASES), None)
    return config if split is None else {kernel: {**config[kernel], **split.get(kernel, {})} for kernel in config}


# Where a varlen Gluon backward's programs come from, per causal mode: "grid" (the longest sequence's blocks ×
# heads × sequences, empty programs included), or the work table (`backward_gluon_launch.work_table`: only the
# blocks that exist) with the sequences "as_given" or "largest_first" (by seqlen_q · seqlen_k). Causal: the table, largest
# first, a few % faster than the grid; non-causal: the grid, the table being 1.3-1.6 ms slower there for a reason
# not known (docs/performance.md, open questions).
# H200: benchmarks/2026-11-29-h200/explore12/run_b994eb18f8c0/explore/varlen_bwd.json
VARLEN_BWD_ORDER = {True: "largest_first", False: "grid"}


def varlen_bwd_order(causal: bool) -> str:
    return VARLEN_BWD_ORDER[bool(causal)]


def _config_tuple(c: triton.Config) -> tuple:
    return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages


def _prune_bwd(kernel: str, configs, named_args, kwargs):
    head_dim_padded = padded_head_dims(named_args, kwargs)
    allowed = set(BWD_CANDIDATES[kernel][(width(named_args["Q"].element_size()), max(64, head_dim_padded))])
    kept = [c for c in configs if _config_tuple(c) in allowed]
    # Short sequences: tiles longer than the sequence only multiply masked work.
    q_bucket, k_bucket = named_args["TUNE_SEQLEN_Q"], named_args["TUNE_SEQLEN_K"]
    short = [c for c in kept if c.kwargs["BLOCK_M"] <= max(32, q_bucket) and c.kwargs["BLOCK_N"] <= max(32, k_bucket)]
    return short or kept or configs[-1:]


def prune_bwd_dkdv_configs(configs, named_args, **kwargs):
    return _prune_bwd("dkdv", configs, named_args, kwargs)


def prune_bwd_dq_configs(configs, named_args, **kwargs):
    return _prune_bwd("dq", configs, named_args, kwargs)
