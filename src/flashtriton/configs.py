"""Tuning configurations for every kernel, in one place.

How a launcher picks its config, in order:
1. `config=` passed to the launcher (tests, `flashtriton tune`);
2. under Triton's interpreter (CPU): one fixed config per kernel, quick to interpret;
3. with autotuning on (`FLASHTRITON_AUTOTUNE=1` in the environment, or `configs.AUTOTUNE = True`): the best
   of the kernel's candidate list, pruned to what fits, measured once per key (head dim, causal, varlen,
   dtype and power-of-two buckets of the sequence lengths, so odd lengths do not retune) and cached;
4. otherwise a heuristic default per (padded head dim, dtype size, GPU generation) — no tuning cost on the
   first call, which every new (head dim, causal, dtype) would otherwise pay in compiles of every candidate.
"""

from __future__ import annotations

import os

import torch
import triton

from ._env import INTERPRET

AUTOTUNE: bool = os.environ.get("FLASHTRITON_AUTOTUNE", "0") == "1"


def _config(block_m: int, block_n: int, num_warps: int, num_stages: int) -> dict:
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps, "num_stages": num_stages}


def _is_hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def seqlen_bucket(seqlen: int) -> int:
    """Power-of-two bucket used in autotune keys (16 … 65536+)."""
    return min(max(16, triton.next_power_of_2(max(int(seqlen), 1))), 1 << 16)


def padded_head_dim(head_dim: int) -> int:
    """Head dims are padded inside the kernels to a power of two of at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(head_dim))


# ----------------------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------------------
FWD_AUTOTUNE_KEY = ["TUNE_SEQLEN_Q", "TUNE_SEQLEN_K", "HEAD_DIM", "IS_CAUSAL", "IS_VARLEN"]

# (BLOCK_M, BLOCK_N, num_warps, num_stages): a curated space around what FlashAttention-2 and Triton's
# tutorial use, with BLOCK_M in {32, 64, 128}. Pruned per problem below; `flashtriton tune` sweeps it.
FWD_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
    for bm, bn, w, s in [
        (128, 128, 8, 2), (128, 128, 8, 3),
        (128, 64, 8, 3), (128, 64, 4, 3), (128, 64, 4, 4), (128, 32, 4, 3),
        (64, 128, 4, 3),
        (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (64, 32, 4, 3),
        (32, 64, 4, 3), (32, 32, 4, 2), (32, 32, 2, 3),
    ]
]

# The one config the interpreter uses (and the one `tune --no-autotune` style callers can force).
FWD_INTERPRETER_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}


def default_fwd_config(head_dim_padded: int, elem_bytes: int, device: torch.device) -> dict:
    """Heuristic forward config: 128-row tiles, 64-key tiles, as FlashAttention-2 uses."""
    if elem_bytes == 4:
        return _config(32, 32, 4, 2) if head_dim_padded > 128 else _config(64, 32, 4, 2)
    if head_dim_padded >= 256:
        return _config(64, 64, 8, 2) if _is_hopper(device) else _config(64, 32, 4, 2)
    if head_dim_padded >= 128:
        return _config(128, 64, 8, 3) if _is_hopper(device) else _config(128, 64, 8, 2)
    return _config(128, 64, 4, 3)


def _fwd_fits(config: triton.Config, head_dim_padded: int, elem_bytes: int) -> bool:
    bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    warps, stages = config.num_warps, config.num_stages
    # Shared memory: Q tile plus `stages` buffers of K and V tiles; H100/H200 allow 227 KiB per block,
    # A100 163 KiB; keep to the smaller so one table serves both.
    smem = elem_bytes * head_dim_padded * (bm + 2 * bn * max(stages - 1, 1))
    if smem > 160 * 1024:
        return False
    # Registers: the fp32 accumulator (BM x D) and scores (BM x BN) spread over the warps' threads.
    acc_regs_per_thread = (bm * head_dim_padded + bm * bn) / (warps * 32)
    if acc_regs_per_thread > 160:
        return False
    # Too many warps for a tiny tile wastes the machine; too few for a big one spills.
    if bm == 32 and warps == 8:
        return False
    if bm == 128 and warps == 4 and head_dim_padded >= 128 and bn >= 128:
        return False
    if bn > bm * 2:
        return False
    return True


def prune_fwd_configs(configs, named_args, **kwargs):
    head_dim_padded = kwargs.get("BLOCK_D") or named_args.get("BLOCK_D")
    elem_bytes = named_args["Q"].element_size()
    if elem_bytes == 4:  # fp32 runs the exact (IEEE) dot: small tiles only
        kept = [c for c in configs if c.kwargs["BLOCK_M"] <= 64 and c.kwargs["BLOCK_N"] <= 64]
    else:
        kept = [c for c in configs if _fwd_fits(c, head_dim_padded, elem_bytes)]
    # Short sequences: a BLOCK_N wider than the keys only multiplies masked work.
    seqlen_k_bucket = named_args["TUNE_SEQLEN_K"]
    kept = [c for c in kept if c.kwargs["BLOCK_N"] <= max(32, seqlen_k_bucket)] or kept
    return kept or configs[:1]


# ----------------------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------------------
# Two tuned kernels: dK/dV (one program per BLOCK_N keys, streaming BLOCK_M query rows) and dQ (one program
# per BLOCK_M query rows, streaming BLOCK_N keys). The small preprocess (delta) kernel is not tuned.
BWD_AUTOTUNE_KEY = ["TUNE_SEQLEN_Q", "TUNE_SEQLEN_K", "HEAD_DIM", "IS_CAUSAL", "IS_VARLEN"]

# dK/dV keeps K, V and the fp32 dK, dV accumulators of BLOCK_N keys resident: wide BLOCK_N, narrow BLOCK_M
# (the shape FlashAttention-2 and Triton's tutorial use).
BWD_DKDV_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
    for bm, bn, w, s in [
        (32, 128, 8, 2), (32, 128, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3),
        (32, 64, 4, 3), (32, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2),
        (32, 64, 8, 2), (16, 64, 4, 3), (32, 32, 4, 2),
    ]
]

# dQ keeps Q, dO and the fp32 dQ accumulator of BLOCK_M rows resident: wide BLOCK_M, narrow BLOCK_N.
BWD_DQ_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
    for bm, bn, w, s in [
        (128, 32, 8, 2), (128, 64, 8, 2), (128, 32, 4, 3), (128, 64, 8, 3),
        (64, 64, 4, 3), (64, 32, 4, 3), (64, 64, 8, 2), (64, 32, 4, 2),
        (32, 64, 4, 2), (32, 32, 4, 2),
    ]
]

def default_bwd_configs(head_dim_padded: int, elem_bytes: int, device: torch.device) -> dict:
    """Heuristic backward configs {"dkdv": .., "dq": ..}: wide resident tiles, narrow streamed ones."""
    if elem_bytes == 4:
        small = _config(32, 32, 4, 2)
        return {"dkdv": small, "dq": small}
    if head_dim_padded >= 256:
        return {"dkdv": _config(32, 64, 8, 2), "dq": _config(64, 32, 8, 2)}
    if head_dim_padded >= 128:
        return {"dkdv": _config(32, 128, 8, 2), "dq": _config(128, 32, 8, 2)}
    return {"dkdv": _config(32, 128, 4, 3), "dq": _config(128, 32, 4, 3)}


# The one config the interpreter uses for both kernels.
BWD_INTERPRETER_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}

# Estimates (to be confirmed on the GPU): fp32 values per thread the compiler must keep live, and shared
# memory bytes; A100 allows ~163 KiB per block, H100/H200 227 KiB: keep to 160 KiB so one table serves both.
_BWD_SMEM_LIMIT = 160 * 1024
_BWD_REGS_LIMIT = 192


def _bwd_smem(resident: int, streamed: int, config: triton.Config, head_dim_padded: int, elem_bytes: int) -> int:
    """Shared memory of one program: the two resident tiles (K, V or Q, dO), the two streamed tiles
    pipelined over `num_stages`, and the P / dS tiles fed back to tl.dot."""
    stages = max(config.num_stages - 1, 1)
    return elem_bytes * (2 * resident * head_dim_padded + 2 * streamed * head_dim_padded * stages
                         + 2 * resident * streamed)


def _bwd_regs(accumulators: int, resident: int, streamed: int, config: triton.Config, head_dim_padded: int) -> float:
    """fp32 values per thread: the accumulators (resident x D each) and two score tiles (P and dS)."""
    return (accumulators * resident * head_dim_padded + 2 * resident * streamed) / (config.num_warps * 32)


def _prune_bwd(configs, named_args, kwargs, resident_key: str, streamed_key: str, accumulators: int):
    head_dim_padded = kwargs.get("BLOCK_D") or named_args.get("BLOCK_D")
    elem_bytes = named_args["Q"].element_size()
    kept = []
    for c in configs:
        resident, streamed = c.kwargs[resident_key], c.kwargs[streamed_key]
        if elem_bytes == 4 and max(resident, streamed) > 64:  # fp32 runs the exact (IEEE) dot: small tiles
            continue
        if _bwd_smem(resident, streamed, c, head_dim_padded, elem_bytes) > _BWD_SMEM_LIMIT:
            continue
        if _bwd_regs(accumulators, resident, streamed, c, head_dim_padded) > _BWD_REGS_LIMIT:
            continue
        kept.append(c)
    # Short sequences: tiles much longer than the sequence only multiply masked work.
    q_bucket, k_bucket = named_args["TUNE_SEQLEN_Q"], named_args["TUNE_SEQLEN_K"]
    short = [c for c in kept if c.kwargs["BLOCK_M"] <= max(32, q_bucket) and c.kwargs["BLOCK_N"] <= max(32, k_bucket)]
    kept = short or kept
    return kept or configs[-1:]


def prune_bwd_dkdv_configs(configs, named_args, **kwargs):
    return _prune_bwd(configs, named_args, kwargs, "BLOCK_N", "BLOCK_M", accumulators=2)


def prune_bwd_dq_configs(configs, named_args, **kwargs):
    return _prune_bwd(configs, named_args, kwargs, "BLOCK_M", "BLOCK_N", accumulators=1)


# ----------------------------------------------------------------------------------------------------------
# decode (flash_attn_with_kvcache)
# ----------------------------------------------------------------------------------------------------------
# The split kernel stacks the group's query heads x Sq rows into BLOCK_M (16..64, set by the launcher from
# the shape, not tuned) and streams BLOCK_N keys per iteration: it is memory bound, so what is tuned is the
# width of the key tile and how many tiles are in flight (num_stages). Keyed on the bucketed keys per split.
DECODE_AUTOTUNE_KEY = ["TUNE_SEQLEN_K", "HEAD_DIM", "GROUP_SIZE", "BLOCK_M", "IS_CAUSAL", "PAGED", "PAGE_SIZE"]

DECODE_CONFIGS = [
    triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
    for bn, w, s in [
        (128, 4, 2), (128, 4, 3), (128, 8, 2), (128, 8, 3),
        (64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3),
        (32, 4, 2),
    ]
]

def default_decode_config(head_dim_padded: int, elem_bytes: int) -> dict:
    """Heuristic decode config: wide key tiles, two in flight (the kernel is memory bound)."""
    if elem_bytes == 4 or head_dim_padded >= 256:
        return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    return {"BLOCK_N": 128, "num_warps": 4, "num_stages": 3}


# The one config the interpreter uses.
DECODE_INTERPRETER_CONFIG = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1}

# Split-KV heuristic (kernels.decode.choose_num_splits): the SM count it assumes off the GPU, how many
# programs it aims to keep resident per SM, the fewest keys worth a split of their own, and the most splits
# (the merge kernel loops over them).
DECODE_INTERPRETER_SMS = 4
DECODE_PROGRAMS_PER_SM = 2
DECODE_MIN_SPLIT_KEYS = 128
DECODE_MAX_SPLITS = 128


def prune_decode_configs(configs, named_args, **kwargs):
    head_dim_padded = kwargs.get("BLOCK_D") or named_args.get("BLOCK_D")
    block_m = kwargs.get("BLOCK_M") or named_args.get("BLOCK_M")
    elem_bytes = named_args["Q"].element_size()
    kept = []
    for c in configs:
        bn, warps, stages = c.kwargs["BLOCK_N"], c.num_warps, c.num_stages
        smem = elem_bytes * head_dim_padded * (block_m + 2 * bn * max(stages - 1, 1))
        # fp32 values per thread: accumulator, scores and one K tile in flight (a rough bound; configs that
        # still run out of resources are skipped by the autotuner).
        regs = (block_m * head_dim_padded + block_m * bn + bn * head_dim_padded) / (warps * 32)
        if smem <= 160 * 1024 and regs <= 192:
            kept.append(c)
    # Short splits: a key tile much wider than the split only multiplies masked work.
    kept = [c for c in kept if c.kwargs["BLOCK_N"] <= max(32, named_args["TUNE_SEQLEN_K"])] or kept
    return kept or configs[-1:]
