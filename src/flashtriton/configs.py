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
    """Heuristic forward config, from the H200 sweep of `benchmarks/explore.py fwd` (B·T = 16384, H·D = 2048;
    docs/performance.md, benchmarks/2026-11-29-h200/explore/fwd.json):

    - 128-row tiles with 8 warps win whenever there is enough work per (batch, head) to fill the GPU with
      them: non-causal D=64 at every T, non-causal D=128 from Sk = 2048, causal from Sq = 2048 (D=64) /
      4096 (D=128); e.g. D=128 non-causal T=16384: 483 TFLOP/s against 434 for 64x64.
    - Short causal sequences prefer 64-row tiles (fewer idle rows on the diagonal, more programs): D=128
      causal T=512 64x32 238, 64x64 210, 128x64 194.
    Other GPUs (Ampere) keep the tiles that fit their 163 KiB of shared memory and smaller register file.
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


# Hopper's TMA forward (kernels.forward._attn_fwd_tma; fp16/bf16, dense or varlen, head dims below): on by
# default on sm_90, off with FLASHTRITON_TMA=0 (or configs.USE_TMA = False). In one H200 run beside the
# portable kernel and cuDNN (benchmarks/2026-11-29-h200/explore3/tma.json, 9f7ad07158e3) its best config was
# 1.05-1.24x the portable kernel at every point of the standard sweep at D = 64 and 128, fp16 and bf16.
USE_TMA: bool = os.environ.get("FLASHTRITON_TMA", "1") != "0"
TMA_HEAD_DIMS = (64, 128)


def default_fwd_tma_config(head_dim: int, seqlen_q: int, seqlen_k: int, causal: bool) -> dict:
    """The TMA forward's tiles, from that sweep (B·T = 16384, H·D = 2048; TFLOP/s fp16 / bf16):

    - D = 64: 64x64 tiles with 4 warps (non-causal T=8192 484 / 492, cuDNN 486 / 491); causal from
      Sq = 8192 128x64 with 4 warps (T=16384 435 / 458 against 428 / 437 for 64x64).
    - D = 128, non-causal: 64x32 with 4 warps up to Sk = 2048 (T=1024 450 / 441), then 128x128 with 8 warps
      (T=8192 546 / 547). Causal: 64x64 at Sq <= 512 (fp16 260 against 216 for 64x32), 64x32 to Sq = 8192
      (T=4096 458 / 474), 128x128x8w beyond (T=16384 505 / 536).
    3 stages everywhere (2 stages lost 10-20 %).
    - D = 64 causal 64x64 tiles with at most 128 registers a thread (`maxnreg`; 143 without): four programs per SM
      instead of three, whose loads cover each other's waits (session 13, benchmarks/2026-11-29-h200/explore15/
      maxnreg/, GPU time fp16, without / with the cap / cuDNN: T=512 221 / 250 / 259, T=1024 307 / 336 / 337,
      T=4096 421 / 440 / 420). Not for non-causal (no gain, 2k 472 / 440) nor the 128-row tiles (spills: 443 -> 205)."""
    if head_dim <= 64:
        if causal and seqlen_q >= 8192:
            return _config(128, 64, 4, 3)
        return dict(_config(64, 64, 4, 3), maxnreg=128) if causal else _config(64, 64, 4, 3)
    if not causal:
        return _config(64, 32, 4, 3) if seqlen_k <= 2048 else _config(128, 128, 8, 3)
    if seqlen_q <= 512:
        return _config(64, 64, 4, 3)
    return _config(64, 32, 4, 3) if seqlen_q <= 8192 else _config(128, 128, 8, 3)


# Hopper's Gluon forward (kernels/forward_gluon.py: FlashAttention-3's schedule, a TMA producer and two consumer
# warpgroups, persistent): on by default on sm_90 where it beats the TMA kernel, off with FLASHTRITON_GLUON=0 (or
# configs.USE_GLUON = False). Dense fp16/bf16 at the head dims below, softmax_scale > 0.
USE_GLUON: bool = os.environ.get("FLASHTRITON_GLUON", "1") != "0"


def gluon_fwd_config(head_dim: int, seqlen_q: int, seqlen_k: int, causal: bool) -> dict | None:
    """The Gluon forward's config for a dense shape where it beats the TMA kernel, else None. From the H200 sweeps
    benchmarks/2026-11-29-h200/explore7/gluon_*.json (fp16 TFLOP/s, Gluon / TMA kernel / cuDNN):
    - D = 128 at every T (2b6137fa8c9f non-causal: T=512 452 / 388 / 517, T=8192 613 / 492 / 665): two consumer
      warpgroups, 128-key tiles, 2 stages, one program per SM (one per item lost 0-15 %, 64-key tiles 10-20 %,
      ping-pong between the warpgroups 1-7 %). Causal since its items go in L2-sized head groups
      (aed9f791d96e: T=512 252 / 230 / 326, T=1024 362 / 356 / 422, T=8192 498 / 472 / 583, T=16384 545 / 554 / 600;
      before the grouping it lost below Sk = 4096).
    - Since session 6 (explore8/gluon_72e8c4a825c2.json, GPU time in CUDA graphs, fp16 D = 128, Gluon paired /
      with two Q slots / unpaired / TMA kernel / cuDNN): causal items go in pairs of equal work (T=2048 485 / 490 /
      423 / 426 / 500, T=8192 589 / 562 / 504 / 460 / 584, T=16384 593 / 591 / 504 / 564 / 606); two Q slots from
      1k keys down, where items are short (non-causal T=512 456 / 496 / - / 391 / 512, causal T=512 249 / 294 /
      261 / 260 / 328, T=1024 381 / 392), one above (non-causal T=2048-8192 lost 4-6 % with two).
    - Since session 12 (explore14/run_549e8e775c38/, same method, causal fp16 D = 128, paired one slot / two slots /
      two slots with OVERLAP / cuDNN): causal up to 4k keys takes OVERLAP (an item's last P V issued with the next
      item's first S) with two Q slots: T=1024 377 / 390 / 407 / 420, T=2048 471 / 475 / 483 / 500, T=4096 514 / 509
      / 547 / 552; T=512 level (249 / 294 / 295 / 326); from 8k it loses (580 / 545 / 565 / 584, 16k 637 / 570 / 583
      / 609). Non-causal it never beat the configs above (T=512 q2 489 / 485, T=4096 634 / 600).
    - Since session 14 (explore16/, GPU time in CUDA graphs, rounds in alternating order, fp16 / bf16 D = 128): OVERLAP
      is one loop over all of a program's K/V tiles with one softmax and one store (`_consume_flat`; the former
      version's item boundary held copies of both, spilled and stalled on instruction fetch), and causal pairs go
      head-major. Causal T=512 298 / 301 (the config above) -> 351 / 355 (cuDNN 328 / 333), T=1024 408 / 420 -> 442 /
      460 (421 / 428), T=2048 501 / 518 -> 500 / 525, T=4096 562 / 579 -> 564 / 569 (563 / 580). Non-causal two Q slots
      with OVERLAP up to 1k keys: T=512 488 / 497 -> 507 / 521 (512 / 524), T=1024 551 / 569 -> 558 / 588 (587 / 603).
    - D = 64 (session 14, explore16/ab/ab_d64.txt: every variant and cuDNN timed in rotating rounds, fp16 / bf16;
      Gluon / TMA kernel / cuDNN): three consumer warpgroups (192-row items, FlashAttention-3's D = 64 tiles) with
      OVERLAP from 4k keys non-causal (T=4096 476 / 466 / 455, T=16384 499 / 431 / 444; one item at a time, session
      8's config, 473 at 16k) and from 8k causal (T=8192 439 / 419 / 435, 16384 471 / 428 / 435); two with OVERLAP
      and 3 stages up to 512 keys non-causal (384 / 376 / 383) and 1k causal (T=512 263 / 248 / 258, T=1024 336 / 332 /
      335). Between them the TMA kernel (causal T=2048 395 against 380, T=4096 430 against 400), until session 15
      (next).
    - D = 64 since session 15 (explore17/ab_steady*.txt, the same rounds but each timing after 100 ms of warmup, the
      README sweep's steady state, where the 700 W power cap holds the clock at 1.6-1.95 GHz): the Gluon kernel at every
      T. The TMA kernel (64-row tiles, twice the K/V traffic of 128-row items) loses 4-10 % there against the Gluon
      configs it beat in 5 ms timings. Two consumers with OVERLAP and 3 stages up to 1k keys non-causal (fp16 T=1024
      379 / TMA 355 / cuDNN 380) and 4k causal (T=2048 345 / 333 / 350, T=4096 379 / 347 / 386); three consumers with
      OVERLAP beyond (non-causal T=2048 412 / 377 / 416, T=4096 437 / 389 / 430; causal T=8192 415 / 388 / 397).
      D = 128 stays: one or two Q slots, with or without OVERLAP, are within 2 % of each other from 2k keys there.
    - Varlen: `gluon_varlen_config`."""
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
    """The Gluon forward's config for packed (varlen) batches where it beats the TMA kernel, else None.
    Session 5 (explore7/varlen_gluon_8fc4f2df6fa4/, the varlen suite: 64 sequences of 1..4096 tokens, D = 128) it
    took 8.0 / 4.2 ms (non-causal / causal) against the TMA kernel's 6.8-6.9 / 4.0-4.1: half the items of the
    grid are past their sequence's end, most have few K/V tiles, and non-causal every item ends on its
    sequence's last V tile, which the producer waits for before clearing the next sequence's rows in it.
    Session 6: two Q slots (short items) and the next item's sequence bounds loaded while the current one runs;
    causal only (its items reach a sequence's last key once per sequence and head), items one at a time (pairs
    are formed over the longest sequence's query tiles, which most sequences do not have).
    Session 7 (explore9/varlen_fwd_de6340f13ce5.json, same batch, ms causal / non-causal): items from a global
    counter (DYNAMIC) instead of a static share per program, 4.14 → 3.70 with two Q slots and 3.33 with one;
    non-causal 7.43 → 6.31 / 6.06, ahead of the TMA kernel's best tiles (6.48): both take it."""
    if head_dim == 128:
        return dict(BLOCK_N=128, NUM_BUFFERS=2, CONSUMER_REGS=240, PINGPONG=False, PERSISTENT=True, N_CONSUMERS=2,
                    Q_BUFFERS=1, CAUSAL_PAIRS=False, DYNAMIC=True, OVERLAP=False)
    return None


def varlen_fwd_tma_config(head_dim: int, max_seqlen_q: int, max_seqlen_k: int, causal: bool) -> dict:
    """The TMA forward's tiles for packed sequences. On the varlen suite's batch (64 sequences, lengths
    1..4096, D=128 fp16; explore4/varlen.json, 42cd324f8c06) 128x128 with 8 warps was fastest or level:
    non-causal 6.47 ms (64x64 6.75, 64x32 7.31), causal 3.98 ms (64x64 3.98, 64x32 4.15). Short batches
    (and D = 64, not swept) keep the dense rule at the longest sequence."""
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
# and padded head dim (64 stands for 16..64). They were chosen by compiling each kernel offline for sm_80 and
# sm_90 with triton 3.6 (triton.compile on a GPUTarget, 16-byte-aligned pointers, unit last stride) and
# reading `cuobjdump -res-usage`: every entry below compiles without register spills (stack <= 16 bytes) on
# both, except the fp32 lists, measured on sm_90 only, and the Hopper defaults of `default_bwd_configs` (added after
# the H200 sweep, timed there). dK/dV keeps two fp32 (BLOCK_N, D) accumulators and K, V
# resident, dQ one (BLOCK_M, D) accumulator and Q, dO: wide BLOCK_N for dK/dV, wide BLOCK_M for dQ, as in
# FlashAttention-2 and Triton's tutorial; at D=256 only small tiles fit. Timing picks among them on the GPU.
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

    On Hopper (fp16/bf16, D <= 128) the tiles measured fastest by `benchmarks/explore.py bwd` on the H200
    (each kernel swept with the other fixed, T = 512 / 2048 / 8192): small tiles with 4 warps and 3 stages,
    e.g. D=128 non-causal T=8192 dK/dV 32x64x4w 317 TFLOP/s of the whole backward against 254 for 32x128x8w,
    dQ 64x32x4w 289 against 253 for 128x32x8w. Elsewhere the first (spill-free, widest) entry of each
    kernel's table for this input width and head dim."""
    if elem_bytes != 4 and head_dim_padded <= 128 and _is_hopper(device):
        dkdv = (64, 64, 4, 3) if head_dim_padded <= 64 and causal else (32, 64, 4, 3)
        return {"dkdv": _config(*dkdv), "dq": _config(64, 32, 4, 3)}
    key = ("32" if elem_bytes == 4 else "16", max(64, head_dim_padded))
    return {kernel: _config(*_BWD_TABLE[kernel][key][0]) for kernel in ("dkdv", "dq")}


# Hopper's Gluon backward kernels (kernels/backward_gluon.py: a TMA producer and two consumer warpgroups; dK/dV
# holding 128 keys, dQ holding 128 query rows): fp16/bf16 at D = 64 and 128 on sm_90, dense and varlen, under
# USE_GLUON, and only where no Triton config is forced. FLASHTRITON_GLUON_BWD=0 (or configs.USE_GLUON_BWD = False)
# keeps the Triton kernels.
USE_GLUON_BWD: bool = os.environ.get("FLASHTRITON_GLUON_BWD", "1") != "0"
# Below this much work (forward FLOPs, 4·B·Hq·Sq·Sk·D, halved when causal) the backward takes the Triton kernels:
# its GPU time no longer hides the Gluon launches' host time (two launches with 13 TMA descriptors encoded per
# call: ~0.3 ms per backward called directly, 0.5-0.8 ms through autograd on the H200 machine's CPU, against
# 0.11-0.16 / 0.27-0.43 ms for the Triton kernels). Measured through autograd as `flashtriton bench` times it
# (explore11/run_5af617d97779/explore/bwd_host.json, fp16, Gluon / Triton ms): D=128 causal T=512 (4.3e10 FLOPs)
# 0.490 / 0.464, D=128 non-causal T=512 (8.6e10) 0.504 / 0.661, D=64 causal T=1024 (6.9e10) 0.733 / 0.761.
GLUON_BWD_MIN_FLOPS = 5e10
# D = 64 up to 512 keys: the Gluon kernels' GPU time is level with the Triton ones' (explore10/gluon_bwd_8c6167939b66:
# non-causal T=512 258-260 / 255 TFLOP/s), so their extra host time would only show.
GLUON_BWD_D64_MIN_KEYS = 513


def gluon_bwd_config(head_dim: int, seqlen_q: int, seqlen_k: int, causal: bool,
                     fwd_flops: float = float("inf"), varlen: bool = False) -> dict | None:
    """{"dkdv": config, "dq": config} of the Gluon backward kernels, or None (the Triton kernels).
    From the H200 sweep benchmarks/2026-11-29-h200/explore10/gluon_bwd_8c6167939b66.json (fp16, the whole backward
    in TFLOP/s of GPU time: Triton kernels / Gluon dK/dV + Triton dQ / both Gluon, dQ by 64-key tiles, 3 stages /
    by 128-key tiles / cuDNN):
    - D = 128: both Gluon, 3 stages, dQ by 64-key tiles (128-key tiles need 64 score registers more per thread):
      non-causal T=8192 344 / 401 / 478 / 468 / 531, causal T=16384 339 / 398 / 482 / 464 / 577, T=512 187 / 209 /
      227 / 224 / 212.
    - D = 64: dQ by 128-key tiles, 2 stages (non-causal T=8192 318 / 342 / 355 / 372 / 438).
    - Less work than GLUON_BWD_MIN_FLOPS, or D = 64 with fewer keys than GLUON_BWD_D64_MIN_KEYS: None.
    - Varlen: the same configs. On the varlen suite's batch (64 sequences of 1..4096 tokens, D = 128, fp16) the
      whole backward took 19.0-19.6 / 10.9-11.6 ms (non-causal / causal; `flashtriton bench --suite varlen`) against
      the Triton kernels' 26.2-26.5 / 13.9-14.4 (explore.py varlen_bwd; benchmarks/2026-11-29-h200/explore11/, every
      Gluon config there within the run-to-run spread), once lse / delta
      came by TMA from aligned rows and whole blocks left by TMA store (27.2 / 18.7 ms before that,
      explore10/varlen_3959b9332bfa/)."""
    if fwd_flops < GLUON_BWD_MIN_FLOPS or (head_dim == 64 and seqlen_k < GLUON_BWD_D64_MIN_KEYS):
        return None
    if head_dim == 128:
        return {"dkdv": dict(NUM_STAGES=3, CONSUMER_REGS=240), "dq": dict(BLOCK_N=64, NUM_STAGES=3, CONSUMER_REGS=240)}
    if head_dim == 64:
        return {"dkdv": dict(NUM_STAGES=2, CONSUMER_REGS=240), "dq": dict(BLOCK_N=128, NUM_STAGES=2, CONSUMER_REGS=240)}
    return None


# Where a varlen Gluon backward's programs come from, per causal mode: "grid" (the longest sequence's blocks ×
# heads × sequences, empty programs included), or the work table (`backward_gluon.work_table`: only the blocks that
# exist) with the sequences "as_given" or "largest_first" (by seqlen_q · seqlen_k). On the varlen suite's batch
# (explore12/run_b994eb18f8c0, fp16 D = 128, GPU µs per kernel, dK/dV + dQ, grid / as given / largest first):
# causal 6569 + 4019 / 6400 + 3853 / 6360 + 3852, non-causal 10565 + 6750 / 11877 + 7071 / 11664 + 6954. The table
# is 1.3-1.6 ms slower on the non-causal batch, for a reason not found yet (performance.md, Backward 14).
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
        # Many short programs: 4 warps and 2 stages fit 3 per SM, which overlap each other's fixed costs.
        # explore6/decode_42d6329663fb.json (GPU time), batch 64 x 8 kv heads: cache 1k 3403 GB/s against 3182
        # for the config below, 4k 4204 against 4122; from 32k on it is 0.4 % behind.
        return {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2}
    # 8 warps: 0.3-0.8 % above 4 at three of the four long-cache points of explore3/decode.json (9f7ad07158e3)
    return {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3}


# The one config the interpreter uses.
DECODE_INTERPRETER_CONFIG = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1}

# Split-KV heuristic (kernels.decode.choose_num_splits): the SM count it assumes off the GPU, the fewest
# keys worth a split of their own, the most splits, and what a program costs beyond its key tiles, in
# key-tile times (one 128 x 128 fp16 K+V tile streams in ~1.8 us per SM at full bandwidth). Fitted to the
# CUDA-graph (GPU-only) times of explore.py decode (runs/c5d869b23b17, (128, 8, 3) at D=128): a program's
# fixed cost (prologue, first loads after the L2 is cold, the stores) is ~3 tiles and a split's extra
# (partial result, ticket, the merge by the last split) ~5: batch 8 x 1k keys ran fastest unsplit
# (21.5 us against 24.4 with 2 splits), batch 1 x 32k with 16 splits (57 us; 32: 63, 8: 65).
# Programs per SM come from the config's shared memory (decode_programs_per_sm).
DECODE_INTERPRETER_SMS = 4
DECODE_MIN_SPLIT_KEYS = 256
DECODE_MAX_SPLITS = 128
DECODE_PROGRAM_OVERHEAD_TILES = 3
DECODE_SPLIT_OVERHEAD_TILES = 5
# The decode launch's schedule (kernels.decode): "grid" (`_decode_split`: B·Hkv·M tiles × splits programs, each
# sequence's keys cut into equal splits), "stream" (`_decode_stream`: all key tiles of the batch cut into one
# equal range per program, units shared between programs merged), or "auto": the stream schedule where the
# rule of `decode.stream_programs` takes it: batches of 2 .. DECODE_STREAM_MAX_BATCH sequences (every stream
# program reads all cache lengths) whose caches hold at least DECODE_STREAM_MIN_KEYS keys. Measured on the H200
# (benchmarks/2026-11-29-h200/explore13/, GB/s in CUDA graphs, grid / stream, D=128, 32/8 heads): full caches
# 8 x 32k 4257 / 4210, 8 x 128k 4566 / 4549, 64 x 32k 4637 / 4581, 64 x 128k 4673 / 4623 (the stream kernel
# ~1 % behind on the same cut); lengths uniform in 1 .. cache: 2239 / 2956, 2784 / 3966, 3987 / 4151,
# 4130 / 4511. At 4k keys the ragged gain is smaller than the full-cache loss (8 x 4k: 1650 / 1714 ragged,
# 2661 / 2528 full); many programs per SM (batch 64 at <= 4k) lose 13-22 %.
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
