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

import functools
import os

import torch
import triton

from ._env import INTERPRET

AUTOTUNE: bool = os.environ.get("FLASHTRITON_AUTOTUNE", "0") == "1"

# Which kernel families the dispatch may take, from FLASHTRITON_KERNEL (read once, at import):
#   auto (default) or gluon: the Gluon kernels where the rules below name the shape, else the TMA kernels on Hopper,
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


def _config(block_m: int, block_n: int, num_warps: int, num_stages: int) -> dict:
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps, "num_stages": num_stages}


def _is_hopper(device: torch.device) -> bool:
    return device.type == "cuda" and capability(device)[0] >= 9


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of a CUDA device, looked up once per device (it is on every call's path)."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def cdiv(a: int, b: int) -> int:
    """Ceiling division on the host. (`triton.cdiv` is a constexpr function: ~3 us per host call.)"""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1), on the host, like `triton.next_power_of_2` but cheap."""
    return 1 << max(int(n) - 1, 0).bit_length()


def seqlen_bucket(seqlen: int) -> int:
    """Power-of-two bucket used in autotune keys (16 … 65536+)."""
    return min(max(16, next_power_of_2(max(int(seqlen), 1))), 1 << 16)


def padded_head_dim(head_dim: int) -> int:
    """Head dims are padded inside the kernels to a power of two of at least 16 (tl.dot's minimum)."""
    return max(16, next_power_of_2(head_dim))


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


def default_fwd_config(head_dim_padded: int, elem_bytes: int, device: torch.device, seqlen_q: int = 4096,
                       seqlen_k: int | None = None, causal: bool = False) -> dict:
    """Heuristic config of the portable forward kernel, per (padded head dim, dtype size, GPU generation).

    Hopper: 128-row tiles with 8 warps wherever every (batch, head) has enough query tiles to fill the GPU with
    them (D <= 64 non-causal, D=128 non-causal from 2048 keys, causal from 2048 / 4096 rows), 64-row tiles for short
    causal sequences (fewer idle rows on the diagonal, more programs). H200: benchmarks/2026-11-29-h200/explore/fwd.json
    Other GPUs (Ampere) keep tiles that fit their 163 KiB of shared memory and smaller register file; fp32 (exact
    dots) and D=256 small tiles.
    """
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    if elem_bytes == 4:
        return _config(32, 32, 4, 2) if head_dim_padded > 128 else _config(64, 32, 4, 2)
    if head_dim_padded >= 256:
        return _config(64, 64, 8, 2) if _is_hopper(device) else _config(64, 32, 4, 2)
    if head_dim_padded >= 128:
        if not _is_hopper(device):
            return _config(128, 64, 8, 2)
        if causal:
            if seqlen_q <= 1024:
                return _config(64, 32, 4, 3)
            return _config(64, 64, 4, 3) if seqlen_q <= 2048 else _config(128, 64, 8, 3)
        return _config(128, 64, 8, 3) if seqlen_k >= 2048 else _config(64, 64, 4, 3)
    if causal and seqlen_q <= 1024:
        return _config(64, 64, 4, 3)
    return _config(128, 64, 8, 3)


# Hopper's TMA forward (kernels.forward._attn_fwd_tma; fp16/bf16, dense or varlen, the head dims below) on sm_90,
# off with FLASHTRITON_KERNEL=portable (or configs.USE_TMA = False, which turns the Gluon kernels off too): its best tiles are
# 1.05-1.24x the portable kernel at every point of the D=64/128 sweep.
# H200: benchmarks/2026-11-29-h200/explore3/tma.json
USE_TMA: bool = _USE_TMA
TMA_HEAD_DIMS = (64, 128)


def default_fwd_tma_config(head_dim: int, seqlen_q: int, seqlen_k: int, causal: bool) -> dict:
    """The TMA forward's tiles, 3 stages everywhere (2 lose 10-20 %). H200: benchmarks/2026-11-29-h200/explore3/tma.json
    - D=64: 64x64 with 4 warps; causal from 8192 query rows 128x64 with 4 warps.
    - D=64 causal 64x64: at most 128 registers a thread (`maxnreg`), so that four programs share an SM instead of
      three and cover each other's waits; non-causal gains nothing from it and the 128-row tiles spill under it.
      H200: benchmarks/2026-11-29-h200/explore15/maxnreg/ab_output.txt
    - D=128 non-causal: 64x32 with 4 warps up to 2048 keys, then 128x128 with 8 warps. Causal: 64x64 up to 512 rows,
      64x32 up to 8192, 128x128 with 8 warps beyond."""
    if head_dim <= 64:
        if causal and seqlen_q >= 8192:
            return _config(128, 64, 4, 3)
        return dict(_config(64, 64, 4, 3), maxnreg=128) if causal else _config(64, 64, 4, 3)
    if not causal:
        return _config(64, 32, 4, 3) if seqlen_k <= 2048 else _config(128, 128, 8, 3)
    if seqlen_q <= 512:
        return _config(64, 64, 4, 3)
    return _config(64, 32, 4, 3) if seqlen_q <= 8192 else _config(128, 128, 8, 3)


# Hopper's Gluon forward (kernels/forward_gluon.py: FlashAttention-3's schedule, a TMA producer and consumer
# warpgroups, persistent) on sm_90 where a config below names the shape (fp16/bf16, softmax_scale > 0); off with
# FLASHTRITON_KERNEL=tma (or configs.USE_GLUON = False), which keeps the backward on the Triton kernels too.
USE_GLUON: bool = _USE_GLUON


def gluon_fwd_config(head_dim: int, seqlen_q: int, seqlen_k: int, causal: bool) -> dict | None:
    """The Gluon forward's config for a dense shape, or None (the TMA kernel). D=64 and D=128 take it at every length:
    it is ahead of the TMA kernel at every point of the standard sweep with the configs below.
    - Base: two consumer warpgroups of 64 rows, 128-key tiles, 2 stages, one persistent program per SM, causal items in
      pairs of equal work, one Q slot. H200: benchmarks/2026-11-29-h200/explore8/gluon_72e8c4a825c2.json
    - D=128 up to 4k keys causal / 1k non-causal: two Q slots and OVERLAP (each item's last P V issued with the next
      item's first S, one loop over all the program's K/V tiles): short items spend much of their time starting and
      ending. H200: benchmarks/2026-11-29-h200/explore16/ab/ab_flat2.txt
    - D=64 up to 4k keys causal / 1k non-causal: two consumers with two Q slots, OVERLAP and 3 stages; beyond, three
      consumers (192-row items, FlashAttention-3's D=64 tiles) with OVERLAP.
      H200, steady state: benchmarks/2026-11-29-h200/explore17/ab_steady.txt
    Varlen: `gluon_varlen_config`."""
    base = dict(BLOCK_N=128, NUM_BUFFERS=2, CONSUMER_REGS=240, PINGPONG=False, PERSISTENT=True, N_CONSUMERS=2,
                Q_BUFFERS=1, CAUSAL_PAIRS=True, DYNAMIC=False, OVERLAP=False)
    if head_dim == 128:
        if seqlen_k <= (4096 if causal else 1024):
            return dict(base, Q_BUFFERS=2, OVERLAP=True)
        return base
    if head_dim == 64:
        if seqlen_k <= (4096 if causal else 1024):
            return dict(base, Q_BUFFERS=2, OVERLAP=True, NUM_BUFFERS=3)
        return dict(base, N_CONSUMERS=3, CONSUMER_REGS=160, OVERLAP=True)
    return None


def gluon_varlen_config(head_dim: int, max_seqlen_q: int, max_seqlen_k: int, causal: bool) -> dict | None:
    """The Gluon forward's config for packed (varlen) batches, or None (the TMA kernel). D=128, causal or not: items
    drawn from a global counter (DYNAMIC) with one Q slot, so that programs that drew short sequences draw more (20 %
    off the causal forward against a static share per program, ahead of the TMA kernel's best tiles non-causal).
    H200: benchmarks/2026-11-29-h200/explore9/varlen_fwd_de6340f13ce5.json"""
    if head_dim == 128:
        return dict(BLOCK_N=128, NUM_BUFFERS=2, CONSUMER_REGS=240, PINGPONG=False, PERSISTENT=True, N_CONSUMERS=2,
                    Q_BUFFERS=1, CAUSAL_PAIRS=False, DYNAMIC=True, OVERLAP=False)
    return None


def varlen_fwd_tma_config(head_dim: int, max_seqlen_q: int, max_seqlen_k: int, causal: bool) -> dict:
    """The TMA forward's tiles for packed sequences: 128x128 with 8 warps at D=128 beyond 2048 keys (fastest or level
    on the varlen suite's batch), else the dense rule at the longest sequence (D=64 is not swept on packed batches).
    H200: benchmarks/2026-11-29-h200/explore4/varlen.json"""
    if head_dim == 128 and max(max_seqlen_q, max_seqlen_k) > 2048:
        return _config(128, 128, 8, 3)
    return default_fwd_tma_config(head_dim, max_seqlen_q, max_seqlen_k, causal)


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
# Two tuned kernels: dK/dV (one program per BLOCK_N keys, streaming BLOCK_M query rows of every head of its
# GQA group) and dQ (one program per BLOCK_M query rows, streaming BLOCK_N keys). The delta kernel is not tuned.
BWD_AUTOTUNE_KEY = ["TUNE_SEQLEN_Q", "TUNE_SEQLEN_K", "HEAD_DIM", "IS_CAUSAL", "IS_VARLEN"]

# Candidates (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel, input width ("16": fp16/bf16, "32": fp32)
# and padded head dim (64 stands for 16..64). Every entry compiles without register spills (stack <= 16 bytes) for
# sm_80 and sm_90 with triton 3.6 (offline `triton.compile` on a GPUTarget, 16-byte-aligned pointers, unit last
# stride; `cuobjdump -res-usage`), except the fp32 lists (checked for sm_90 only) and the Hopper defaults of
# `default_bwd_configs` (timed on the H200). dK/dV keeps two fp32 (BLOCK_N, D) accumulators and K, V
# resident, dQ one (BLOCK_M, D) accumulator and Q, dO: wide BLOCK_N for dK/dV, wide BLOCK_M for dQ, as in
# FlashAttention-2 and Triton's tutorial; at D=256 only small tiles fit. Autotuning picks among them on the GPU.
_BWD_TABLE = {
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
    seen = dict.fromkeys(t for lists in _BWD_TABLE[kernel].values() for t in lists)  # ordered, unique
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in seen]


BWD_DKDV_CONFIGS = _bwd_configs("dkdv")
BWD_DQ_CONFIGS = _bwd_configs("dq")


def default_bwd_configs(head_dim_padded: int, elem_bytes: int, device: torch.device, causal: bool = False) -> dict:
    """Heuristic backward configs {"dkdv": .., "dq": ..}.

    Hopper (fp16/bf16, D <= 128): small tiles with 4 warps and 3 stages, the fastest when each kernel is swept with
    the other fixed: dK/dV 32x64 (64x64 at D=64 causal), dQ 64x32. H200: benchmarks/2026-11-29-h200/explore/bwd.json
    Elsewhere the first (spill-free, widest) entry of each kernel's table for this input width and head dim."""
    if elem_bytes != 4 and head_dim_padded <= 128 and _is_hopper(device):
        dkdv = (64, 64, 4, 3) if head_dim_padded <= 64 and causal else (32, 64, 4, 3)
        return {"dkdv": _config(*dkdv), "dq": _config(64, 32, 4, 3)}
    key = ("32" if elem_bytes == 4 else "16", max(64, head_dim_padded))
    return {kernel: _config(*_BWD_TABLE[kernel][key][0]) for kernel in ("dkdv", "dq")}


# Hopper's Gluon backward kernels (kernels/backward_gluon.py: a TMA producer and two consumer warpgroups; dK/dV
# holding 128 keys, dQ holding 128 query rows): fp16/bf16 at D = 64 and 128 on sm_90, dense and varlen, under
# USE_GLUON, and only where no Triton config is forced. configs.USE_GLUON_BWD = False keeps the Triton kernels.
USE_GLUON_BWD: bool = _USE_GLUON_BWD
# Below this much work (forward FLOPs, 4·B·Hq·Sq·Sk·D, halved when causal) the backward takes the Triton kernels:
# their GPU time no longer hides the Gluon launches' host time (13 TMA descriptors encoded per call).
# H200, through autograd: benchmarks/2026-11-29-h200/explore11/run_5af617d97779/explore/bwd_host.json
GLUON_BWD_MIN_FLOPS = 5e10
# D = 64 up to 512 keys: the Gluon kernels' GPU time is level with the Triton ones', so their extra host time would
# only show. H200: benchmarks/2026-11-29-h200/explore10/gluon_bwd_8c6167939b66.json
GLUON_BWD_D64_MIN_KEYS = 513


def gluon_bwd_config(head_dim: int, seqlen_q: int, seqlen_k: int, causal: bool,
                     fwd_flops: float = float("inf"), varlen: bool = False) -> dict | None:
    """{"dkdv": config, "dq": config} of the Gluon backward kernels, or None (the Triton kernels).
    - D = 128: 3 stages, dQ by 64-key tiles (128-key tiles need 64 more score registers per thread); D = 64: 2 stages,
      dQ by 128-key tiles. H200, GPU time: benchmarks/2026-11-29-h200/explore10/gluon_bwd_8c6167939b66.json
    - Less work than GLUON_BWD_MIN_FLOPS, or D = 64 with fewer keys than GLUON_BWD_D64_MIN_KEYS: None.
    - Varlen: the same configs, 1.25-1.35x faster than the Triton kernels on the varlen suite's batch.
      H200: benchmarks/2026-11-29-h200/explore11/run_9452517c10f2/explore/varlen_bwd.json"""
    if fwd_flops < GLUON_BWD_MIN_FLOPS or (head_dim == 64 and seqlen_k < GLUON_BWD_D64_MIN_KEYS):
        return None
    if head_dim == 128:
        return {"dkdv": dict(NUM_STAGES=3, CONSUMER_REGS=240), "dq": dict(BLOCK_N=64, NUM_STAGES=3, CONSUMER_REGS=240)}
    if head_dim == 64:
        return {"dkdv": dict(NUM_STAGES=2, CONSUMER_REGS=240), "dq": dict(BLOCK_N=128, NUM_STAGES=2, CONSUMER_REGS=240)}
    return None


# Where a varlen Gluon backward's programs come from, per causal mode: "grid" (the longest sequence's blocks ×
# heads × sequences, empty programs included), or the work table (`backward_gluon.work_table`: only the blocks that
# exist) with the sequences "as_given" or "largest_first" (by seqlen_q · seqlen_k). Causal: the table, largest
# first, a few % faster than the grid; non-causal: the grid, the table being 1.3-1.6 ms slower there for a reason not
# known (docs/performance.md, open questions).
# H200: benchmarks/2026-11-29-h200/explore12/run_b994eb18f8c0/explore/varlen_bwd.json
VARLEN_BWD_ORDER = {True: "largest_first", False: "grid"}


def varlen_bwd_order(causal: bool) -> str:
    return VARLEN_BWD_ORDER[bool(causal)]


# The one config the interpreter uses for both kernels.
BWD_INTERPRETER_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}


def _config_tuple(c: triton.Config) -> tuple:
    return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages


def _prune_bwd(kernel: str, configs, named_args, kwargs):
    head_dim_padded = kwargs.get("BLOCK_D") or named_args.get("BLOCK_D")
    width = "32" if named_args["Q"].element_size() == 4 else "16"
    allowed = set(_BWD_TABLE[kernel][(width, max(64, head_dim_padded))])
    kept = [c for c in configs if _config_tuple(c) in allowed]
    # Short sequences: tiles longer than the sequence only multiply masked work.
    q_bucket, k_bucket = named_args["TUNE_SEQLEN_Q"], named_args["TUNE_SEQLEN_K"]
    short = [c for c in kept if c.kwargs["BLOCK_M"] <= max(32, q_bucket) and c.kwargs["BLOCK_N"] <= max(32, k_bucket)]
    return short or kept or configs[-1:]


def prune_bwd_dkdv_configs(configs, named_args, **kwargs):
    return _prune_bwd("dkdv", configs, named_args, kwargs)


def prune_bwd_dq_configs(configs, named_args, **kwargs):
    return _prune_bwd("dq", configs, named_args, kwargs)


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

def default_decode_config(head_dim_padded: int, elem_bytes: int, programs: int = 0, num_sms: int = 0,
                          max_seqlen_k: int = 0) -> dict:
    """Heuristic decode config: wide key tiles, two in flight (the kernel is memory bound). `programs` =
    batch · kv heads · M tiles of the launch, `num_sms` the GPU's, `max_seqlen_k` the longest sequence."""
    if elem_bytes == 4 or head_dim_padded >= 256:
        return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    if programs >= 2 * num_sms > 0 and max_seqlen_k <= 4096:
        # Many short programs: 4 warps and 2 stages fit 3 per SM, which overlap each other's fixed costs (from
        # 32k keys on it is 0.4 % behind the config below). H200:
        # benchmarks/2026-11-29-h200/explore6/decode_42d6329663fb.json
        return {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2}
    # 8 warps: level with or 0.3-0.8 % above 4 at long caches. H200: benchmarks/2026-11-29-h200/explore3/decode.json
    return {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3}


# The one config the interpreter uses.
DECODE_INTERPRETER_CONFIG = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1}

# Split-KV heuristic (kernels.decode.choose_num_splits): the SM count it assumes off the GPU, the fewest
# keys worth a split of their own, the most splits, and what a program costs beyond its key tiles, in
# key-tile times (one 128 x 128 fp16 K+V tile streams in ~1.8 us per SM at full bandwidth): a program's fixed cost
# (prologue, first loads after the L2 is cold, the stores) is ~3 tiles and a split's extra (partial result, ticket,
# the merge by the last split) ~5, fitted to CUDA-graph times of every config and split count at D=128.
# Programs per SM come from the config's shared memory (decode_programs_per_sm).
# H200: benchmarks/2026-11-29-h200/explore6/decode_c5d869b23b17.json
DECODE_INTERPRETER_SMS = 4
DECODE_MIN_SPLIT_KEYS = 256
DECODE_MAX_SPLITS = 128
DECODE_PROGRAM_OVERHEAD_TILES = 3
DECODE_SPLIT_OVERHEAD_TILES = 5
# The decode launch's schedule (kernels.decode): "grid" (`_decode_split`: B·Hkv·M tiles × splits programs, each
# sequence's keys cut into equal splits), "stream" (`_decode_stream`: all key tiles of the batch cut into one
# equal range per program, units shared between programs merged), or "auto": the stream schedule where the
# rule of `decode.stream_programs` takes it: batches of 2 .. DECODE_STREAM_MAX_BATCH sequences (every stream
# program reads all cache lengths) whose caches hold at least DECODE_STREAM_MIN_KEYS keys. There ragged batches
# (lengths uniform in 1 .. cache) gain 4-42 % and full caches lose ~1 %; at 4k keys and below the full-cache loss
# outweighs the ragged gain. H200, GPU time:
# benchmarks/2026-11-29-h200/explore13/run_e0b52ac01ca1/explore/decode_schedule.json
DECODE_SCHEDULE: str = os.environ.get("FLASHTRITON_DECODE_SCHEDULE", "auto")
DECODE_STREAM_MAX_BATCH = 1024
DECODE_STREAM_MIN_KEYS = 32768
SHARED_MEMORY_PER_SM = 227 * 1024  # H100/H200 (A100: 163 KiB; the heuristic only needs the order of it)


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
    head_dim_padded = kwargs.get("BLOCK_D") or named_args.get("BLOCK_D")
    block_m = kwargs.get("BLOCK_M") or named_args.get("BLOCK_M")
    elem_bytes = named_args["Q"].element_size()
    kept = []
    for c in configs:
        bn, warps, stages = c.kwargs["BLOCK_N"], c.num_warps, c.num_stages
        smem = decode_shared_memory(bn, stages, head_dim_padded, block_m, elem_bytes)
        # fp32 values per thread: accumulator, scores and one K tile in flight (a rough bound; configs that
        # still run out of resources are skipped by the autotuner).
        regs = (block_m * head_dim_padded + block_m * bn + bn * head_dim_padded) / (warps * 32)
        if smem <= 160 * 1024 and regs <= 192:
            kept.append(c)
    # Short splits: a key tile much wider than the split only multiplies masked work.
    kept = [c for c in kept if c.kwargs["BLOCK_N"] <= max(32, named_args["TUNE_SEQLEN_K"])] or kept
    return kept or configs[-1:]
