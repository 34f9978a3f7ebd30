"""Decode configs (flash_attn_with_kvcache): the split kernel's candidates and defaults, the split-KV and schedule
heuristics' constants."""

from __future__ import annotations

import triton

from .table import ANY, H200, Table, padded_head_dims, width

# The split kernel stacks the group's query heads x Sq rows into BLOCK_M (16..64, set by the launcher from the
# shape, not tuned) and streams BLOCK_N keys an iteration: it is memory bound, so what is tuned is the width of the
# key tile and how many tiles are in flight (num_stages). Keyed on the bucketed keys per split.
DECODE_AUTOTUNE_KEY = ["TUNE_SEQLEN_K", "HEAD_DIM", "HEAD_DIM_V", "GROUP_SIZE", "BLOCK_M", "IS_CAUSAL", "PAGED",
                       "PAGE_SIZE"]

# Autotuning candidates (BLOCK_N, num_warps, num_stages).
DECODE_CANDIDATES = [
    (128, 4, 2), (128, 4, 3), (128, 8, 2), (128, 8, 3),
    (64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3),
    (32, 4, 2),
]
DECODE_CONFIGS = [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s) for bn, w, s in DECODE_CANDIDATES]

# The one config the interpreter uses.
DECODE_INTERPRETER_CONFIG = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1}


def keys(block_n: int, num_warps: int, num_stages: int) -> dict:
    return {"BLOCK_N": block_n, "num_warps": num_warps, "num_stages": num_stages}


WIDE_TILES = "why: fp32 or D=256 doubles a key tile's bytes: half the keys a tile"

# The decode default per (input width, padded head dim, launch size, longest cache): wide key tiles, two or three
# in flight (the kernel is memory bound). `busy`: at least two programs (batch · kv heads · M tiles) per SM.
SPLIT_DECODE = Table(("dtype", "head_dim", "busy", "seqlen_k"), rows=[
    # dtype head dim     busy  seqlen_k      config           source
    ("32",  ANY,         ANY,  ANY,          keys(64, 4, 2),  WIDE_TILES),
    (ANY,   (256, None), ANY,  ANY,          keys(64, 4, 2),  WIDE_TILES),
    # Many short programs: 4 warps and 2 stages fit 3 per SM, which overlap each other's fixed costs (from 32k keys
    # on it is 0.4 % behind the rule below).
    (ANY,   ANY,         True, (None, 4096), keys(128, 4, 2), H200 + "explore6/decode_42d6329663fb.json"),
    # 8 warps: level with or 0.3-0.8 % above 4 at long caches.
    (ANY,   ANY,         ANY,  ANY,          keys(128, 8, 3), H200 + "explore3/decode.json"),
])


def default_decode_config(head_dim_padded: int, elem_bytes: int, programs: int = 0, num_sms: int = 0,
                          max_seqlen_k: int = 0) -> dict:
    """The decode config: `SPLIT_DECODE`'s rule. `programs` = batch · kv heads · M tiles of the launch, `num_sms`
    the GPU's, `max_seqlen_k` the longest sequence."""
    return SPLIT_DECODE.lookup(width(elem_bytes), head_dim_padded, programs >= 2 * num_sms > 0, max_seqlen_k)


# Split-KV heuristic (kernels.decode_launch.choose_num_splits): the SM count it assumes off the GPU, the fewest keys
# worth a split of their own, the most splits, and what a program costs beyond its key tiles, in key-tile times (one
# 128 x 128 fp16 K+V tile streams in ~1.8 us per SM at full bandwidth): a program's fixed cost (prologue, first
# loads after the L2 is cold, the stores) is ~3 tiles and a split's extra (partial result, ticket, the merge by the
# last split) ~5, fitted to CUDA-graph times of every config and split count at D=128. Programs per SM come from
# the config's shared memory (decode_programs_per_sm).
# H200: benchmarks/2026-11-29-h200/explore6/decode_c5d869b23b17.json
DECODE_INTERPRETER_SMS = 4
DECODE_MIN_SPLIT_KEYS = 256
DECODE_MAX_SPLITS = 128
DECODE_PROGRAM_OVERHEAD_TILES = 3
DECODE_SPLIT_OVERHEAD_TILES = 5

# The decode schedule's "auto" (dispatch.decode_schedule(); stream_programs): the stream schedule for
# batches of 2 .. DECODE_STREAM_MAX_BATCH sequences (every stream program reads all cache lengths) whose caches
# hold at least DECODE_STREAM_MIN_KEYS keys. There ragged batches (lengths uniform in 1 .. cache) gain 4-42 % and
# full caches lose ~1 %; at 4k keys and below the full-cache loss outweighs the ragged gain. H200, GPU time:
# benchmarks/2026-11-29-h200/explore13/run_e0b52ac01ca1/explore/decode_schedule.json
DECODE_STREAM_MAX_BATCH = 1024
DECODE_STREAM_MIN_KEYS = 32768

SHARED_MEMORY_PER_SM = 227 * 1024  # H100 / H200 (A100: 163 KiB; the heuristic only needs the order of it)


def decode_shared_memory(block_n: int, stages: int, head_dim_padded: int, block_m: int, elem_bytes: int) -> int:
    """Bytes of shared memory a decode program holds: the query tile and stages - 1 K and V tiles in flight."""
    return elem_bytes * head_dim_padded * (block_m + 2 * block_n * max(stages - 1, 1))


def decode_programs_per_sm(config: dict | None, head_dim_padded: int, block_m: int, elem_bytes: int) -> int:
    """How many programs of a decode config one SM runs at once (shared memory and warps; 2 if autotuned)."""
    if config is None:
        return 2
    smem = decode_shared_memory(config["BLOCK_N"], config["num_stages"], head_dim_padded, block_m, elem_bytes)
    return max(1, min(SHARED_MEMORY_PER_SM // smem, 64 // config["num_warps"]))


def prune_decode_configs(configs, named_args, **kwargs):
    head_dim_padded = padded_head_dims(named_args, kwargs)
    block_m = kwargs.get("BLOCK_M") or named_args.get("BLOCK_M")
    elem_bytes = named_args["Q"].element_size()
    kept = []
    for c in configs:
        bn, warps, stages = c.kwargs["BLOCK_N"], c.num_warps, c.num_stages
        smem = decode_shared_memory(bn, stages, head_dim_padded, block_m, elem_bytes)
        # fp32 values per thread: accumulator, scores and one K tile in flight (a rough bound; configs that still
        # run out of resources are skipped by the autotuner).
        regs = (block_m * head_dim_padded + block_m * bn + bn * head_dim_padded) / (warps * 32)
        if smem <= 160 * 1024 and regs <= 192:
            kept.append(c)
    # Short splits: a key tile much wider than the split only multiplies masked work.
    kept = [c for c in kept if c.kwargs["BLOCK_N"] <= max(32, named_args["TUNE_SEQLEN_K"])] or kept
    return kept or configs[-1:]
