"""Split-KV decoding ("flash-decoding") over a contiguous or paged KV cache: the Triton kernels and launcher.

Decoding has few query rows (Sq = 1 .. a few) against a long cache, so the work is reading K and V once, at
memory bandwidth. Two kernels:

1. `_decode_split`: program (b·hk, split, m) takes batch b, kv head hk and one chunk (`split`) of that
   sequence's keys. GQA: the Hq / Hkv query heads of kv head hk and the Sq query rows are stacked into the M
   dimension of one tile (row r = query i · group + head g, padded to BLOCK_M >= 16 for tl.dot), so the
   group reads its K/V once. K/V stream in BLOCK_N tiles with the online softmax of FlashAttention-2
   (base 2: log2(e) folded into the scale). With one split it writes the final (out, lse); with several,
   each writes a partial (out_s, lse_s) in fp32 (a split with no keys writes 0 and -inf).
2. `_decode_merge`: per (b, i, h) row, out = sum_s exp(lse_s - lse) · out_s with lse = logsumexp_s(lse_s);
   a row with no key in any split gives out 0, lse -inf (never NaN).

Paged cache: `block_table[b, j // PAGE_SIZE]` is the page that holds key j of sequence b, at row
`j % PAGE_SIZE` of the page. Pages may be smaller or larger than BLOCK_N: each key row's page is looked up.

Causal is bottom-right: query i of Sq sees key j iff j <= i + Sk_b - Sq (Sk_b = the sequence's key count).
Offsets into the cache are int64.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .. import configs
from .._env import INTERPRET
from .common import LOG2E, dot_settings


@triton.jit
def _decode_tile(
    acc, l_i, m_i, n_bad, q, K_base, V_base, BT_row, num_pages,
    stride_kp, stride_kn, stride_vp, stride_vn,
    offs_d, last_key, start_n, end_n, seqlen_k, qk_scale,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold key tiles [start_n, end_n) into the running (acc, l_i, m_i) of the stacked query tile.
    Paged: a page index outside [0, num_pages) is read as page 0 and counted in n_bad (the caller poisons
    the result), so a bad block table never makes the kernel read outside the cache."""
    offs_n = tl.arange(0, BLOCK_N)
    for n in range(start_n, end_n, BLOCK_N):
        cols = n + offs_n  # (BLOCK_N,) key positions in the sequence
        if PAGED:
            if PAGE_SIZE % BLOCK_N == 0:  # the whole tile lies in one page
                page = tl.load(BT_row + n // PAGE_SIZE)
                page_ok = (page >= 0) & (page < num_pages)
                n_bad += tl.where(page_ok, 0, 1)
                page = tl.where(page_ok, page, 0).to(tl.int64)
                k_rows = page * stride_kp + (cols % PAGE_SIZE).to(tl.int64) * stride_kn
                v_rows = page * stride_vp + (cols % PAGE_SIZE).to(tl.int64) * stride_vn
            else:  # the tile spans several pages: look each key row's page up
                if MASKED:
                    pages = tl.load(BT_row + cols // PAGE_SIZE, mask=cols < seqlen_k, other=0)
                else:
                    pages = tl.load(BT_row + cols // PAGE_SIZE)
                pages_ok = (pages >= 0) & (pages < num_pages)
                n_bad += tl.sum(tl.where(pages_ok, 0, 1))
                pages = tl.where(pages_ok, pages, 0).to(tl.int64)
                k_rows = pages * stride_kp + (cols % PAGE_SIZE).to(tl.int64) * stride_kn
                v_rows = pages * stride_vp + (cols % PAGE_SIZE).to(tl.int64) * stride_vn
        else:
            k_rows = cols.to(tl.int64) * stride_kn
            v_rows = cols.to(tl.int64) * stride_vn
        k_ptrs = K_base + k_rows[:, None] + offs_d[None, :]  # (BLOCK_N, BLOCK_D), last dim contiguous
        v_ptrs = V_base + v_rows[:, None] + offs_d[None, :]
        if MASKED:
            kv_mask = cols[:, None] < seqlen_k
            if BLOCK_D != HEAD_DIM:
                kv_mask = kv_mask & (offs_d[None, :] < HEAD_DIM)
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        elif BLOCK_D != HEAD_DIM:
            k = tl.load(k_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
            v = tl.load(v_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        if UPCAST_DOT:  # the interpreter's bf16 dot is wrong: compute it in fp32 (exact products)
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N) fp32
        if MASKED:
            visible = cols[None, :] < seqlen_k
            if IS_CAUSAL:
                visible = visible & (cols[None, :] <= last_key[:, None])
            qk = tl.where(visible, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # A row that has seen no key yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
            qk = qk - m_new[:, None]
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            qk = qk * qk_scale - m_new[:, None]
        p = tl.math.exp2(qk)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if UPCAST_DOT:
            acc = tl.dot(p, v.to(tl.float32), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i, n_bad


@triton.jit
def _decode_split(
    Q, K, V, O, LSE,
    CACHE_SEQLENS,  # int32 (B,): keys already in the cache before this call's append
    BATCH_IDX,  # int32 (B,): cache row of each sequence (contiguous cache, HAS_BATCH_IDX)
    BLOCK_TABLE,  # int32 (B, max_pages) (PAGED)
    qk_scale,  # softmax_scale * log2(e)
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh,  # kb: batch row (contiguous) or page (paged)
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh, stride_os,  # os: split (0 when writing the final output)
    stride_lb, stride_lm, stride_lh, stride_ls,
    stride_btb,
    NUM_HEADS_KV, SEQLEN_Q, NUM_SPLITS,
    SEQLEN_NEW,  # keys appended by this call: sequence b attends to CACHE_SEQLENS[b] + SEQLEN_NEW keys
    CAPACITY,  # keys the cache holds per sequence
    NUM_CACHE_ROWS,  # rows of the contiguous cache (batch_size_cache) or pages of the paged one
    TUNE_SEQLEN_K,  # power-of-two bucket of keys per split: autotune key only
    GROUP_SIZE: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    off_b = pid_bh // NUM_HEADS_KV
    off_hk = pid_bh % NUM_HEADS_KV
    # Values are checked here, not on the host (no device-to-host sync): a sequence whose cache length or
    # cache row is out of range reads nothing and gets NaN (see flash_attn_with_kvcache).
    cached = tl.load(CACHE_SEQLENS + off_b)
    seqlen_k = cached + SEQLEN_NEW
    n_bad = ((cached < 0) | (seqlen_k > CAPACITY)).to(tl.int32)

    # Stacked rows: r = i * GROUP_SIZE + g  ->  query row i, query head off_hk * GROUP_SIZE + g.
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q_idx = rows // GROUP_SIZE
    off_h = off_hk * GROUP_SIZE + rows % GROUP_SIZE
    num_rows = SEQLEN_Q * GROUP_SIZE
    row_ok = rows < num_rows
    offs_d = tl.arange(0, BLOCK_D)

    q_ptrs = (Q + off_b.to(tl.int64) * stride_qb + q_idx.to(tl.int64)[:, None] * stride_qm
              + off_h[:, None] * stride_qh + offs_d[None, :] * stride_qd)
    q_mask = row_ok[:, None]
    if BLOCK_D != HEAD_DIM:
        q_mask = q_mask & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)  # (BLOCK_M, BLOCK_D)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    if PAGED:
        K_base = K + off_hk * stride_kh
        V_base = V + off_hk * stride_vh
        BT_row = BLOCK_TABLE + off_b.to(tl.int64) * stride_btb
    else:
        if HAS_BATCH_IDX:
            cache_b = tl.load(BATCH_IDX + off_b)
            row_bad = (cache_b < 0) | (cache_b >= NUM_CACHE_ROWS)
            n_bad += row_bad.to(tl.int32)
            cache_b = tl.where(row_bad, 0, cache_b).to(tl.int64)
        else:
            cache_b = off_b.to(tl.int64)
        K_base = K + cache_b * stride_kb + off_hk * stride_kh
        V_base = V + cache_b * stride_vb + off_hk * stride_vh
        BT_row = BLOCK_TABLE  # unused

    seqlen_k = tl.where(n_bad > 0, 0, seqlen_k)
    # This split's keys: whole BLOCK_N tiles, the same number per split, [start, end).
    blocks_per_split = tl.cdiv(tl.cdiv(seqlen_k, BLOCK_N), NUM_SPLITS)
    start = split * blocks_per_split * BLOCK_N
    end = tl.minimum(start + blocks_per_split * BLOCK_N, seqlen_k)
    # Keys [start, lo) are visible to every row of the tile and inside the sequence: no mask there.
    if IS_CAUSAL:
        causal_offset = seqlen_k - SEQLEN_Q
        last_key = q_idx + causal_offset  # (BLOCK_M,) last key each row sees
        first_row_q = (pid_m * BLOCK_M) // GROUP_SIZE
        last_row_q = (tl.minimum((pid_m + 1) * BLOCK_M, num_rows) - 1) // GROUP_SIZE
        end = tl.minimum(end, last_row_q + causal_offset + 1)
        lo = first_row_q + causal_offset + 1
    else:
        last_key = q_idx  # unused
        lo = seqlen_k
    end = tl.maximum(end, start)
    lo = tl.minimum(tl.maximum(lo, start), end)
    lo = start + (lo - start) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc, l_i, m_i, n_bad = _decode_tile(
        acc, l_i, m_i, n_bad, q, K_base, V_base, BT_row, NUM_CACHE_ROWS, stride_kb, stride_kn, stride_vb, stride_vn,
        offs_d, last_key, start, lo, seqlen_k, qk_scale,
        False, IS_CAUSAL, PAGED, PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, UPCAST_DOT, DOT_PRECISION,
    )
    acc, l_i, m_i, n_bad = _decode_tile(
        acc, l_i, m_i, n_bad, q, K_base, V_base, BT_row, NUM_CACHE_ROWS, stride_kb, stride_kn, stride_vb, stride_vn,
        offs_d, last_key, lo, end, seqlen_k, qk_scale,
        True, IS_CAUSAL, PAGED, PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, UPCAST_DOT, DOT_PRECISION,
    )

    # Rows (or whole splits) that saw no key: out 0, lse -inf, never NaN.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    # Invalid values: out NaN; lse NaN, or +inf in a partial result so that the merge gives NaN for both.
    poison = n_bad > 0
    out = tl.where(poison, float("nan"), out)
    lse = tl.where(poison, tl.where(NUM_SPLITS == 1, float("nan"), float("inf")), lse)

    q_off = q_idx.to(tl.int64)
    l_ptrs = LSE + off_b.to(tl.int64) * stride_lb + q_off * stride_lm + off_h * stride_lh + split * stride_ls
    tl.store(l_ptrs, lse, mask=row_ok)
    o_ptrs = (O + off_b.to(tl.int64) * stride_ob + q_off[:, None] * stride_om + off_h[:, None] * stride_oh
              + split * stride_os + offs_d[None, :])
    o_mask = row_ok[:, None]
    if BLOCK_D != HEAD_DIM:
        o_mask = o_mask & (offs_d[None, :] < HEAD_DIM)
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=o_mask)


@triton.jit
def _append_kv(
    K_NEW, V_NEW, K_CACHE, V_CACHE, CACHE_SEQLENS, BATCH_IDX, BLOCK_TABLE,
    stride_knb, stride_knm, stride_knh,  # k, v (B, S_new, Hkv, D), last dim contiguous
    stride_vnb, stride_vnm, stride_vnh,
    stride_kb, stride_kn, stride_kh,  # caches: kb is the batch row (contiguous) or the page (paged)
    stride_vb, stride_vn, stride_vh,
    stride_btb,
    SEQLEN_NEW, CAPACITY, NUM_CACHE_ROWS,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Write k, v rows [t, t + BLOCK_T) of (batch b, kv head h) at cache positions CACHE_SEQLENS[b] + t ...
    Grid (B, Hkv, token tiles). A sequence whose values are out of range (cache length, cache row, page)
    writes nothing there: the decode kernel gives it NaN."""
    off_b = tl.program_id(0)
    off_h = tl.program_id(1)
    t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,) new-token index
    offs_d = tl.arange(0, BLOCK_D)
    # Scalar validity folds into the number of rows to write (mixing scalar and tensor masks with `&` trips
    # triton 3.9's interpreter, which then builds int32 masks).
    cached = tl.load(CACHE_SEQLENS + off_b)
    n_new = tl.where((cached >= 0) & (cached + SEQLEN_NEW <= CAPACITY), SEQLEN_NEW, 0)
    if not PAGED:
        if HAS_BATCH_IDX:
            row = tl.load(BATCH_IDX + off_b)
            n_new = tl.where((row >= 0) & (row < NUM_CACHE_ROWS), n_new, 0)
        else:
            row = off_b
    rows_ok = t < n_new
    pos = cached + t  # (BLOCK_T,) position in the sequence
    if PAGED:
        page = tl.load(BLOCK_TABLE + off_b.to(tl.int64) * stride_btb + pos // PAGE_SIZE, mask=rows_ok, other=0)
        rows_ok = rows_ok & ((page >= 0) & (page < NUM_CACHE_ROWS))
        k_dst = page.to(tl.int64) * stride_kb + (pos % PAGE_SIZE).to(tl.int64) * stride_kn
        v_dst = page.to(tl.int64) * stride_vb + (pos % PAGE_SIZE).to(tl.int64) * stride_vn
    else:
        k_dst = row.to(tl.int64) * stride_kb + pos.to(tl.int64) * stride_kn
        v_dst = row.to(tl.int64) * stride_vb + pos.to(tl.int64) * stride_vn
    mask = rows_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)
    k = tl.load(K_NEW + off_b.to(tl.int64) * stride_knb + t64[:, None] * stride_knm + off_h * stride_knh
                + offs_d[None, :], mask=mask)
    v = tl.load(V_NEW + off_b.to(tl.int64) * stride_vnb + t64[:, None] * stride_vnm + off_h * stride_vnh
                + offs_d[None, :], mask=mask)
    tl.store(K_CACHE + k_dst[:, None] + off_h * stride_kh + offs_d[None, :], k, mask=mask)
    tl.store(V_CACHE + v_dst[:, None] + off_h * stride_vh + offs_d[None, :], v, mask=mask)


def append_kv(k, v, k_cache, v_cache, cache_seqlens, cache_batch_idx=None, block_table=None) -> None:
    """Write k, v (B, S_new, Hkv, D) into the caches at cache_seqlens[b].. (through block_table when paged),
    in place, one launch. Values out of range write nothing (see `_append_kv`)."""
    batch, seqlen_new, heads_kv, head_dim = k.shape
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    block_d = configs.padded_head_dim(head_dim)
    block_t = min(configs.next_power_of_2(seqlen_new), max(1, 4096 // block_d))
    dummy = cache_seqlens
    _append_kv[(batch, heads_kv, configs.cdiv(seqlen_new, block_t))](
        k, v, k_cache, v_cache, cache_seqlens,
        cache_batch_idx if cache_batch_idx is not None else dummy, block_table if paged else dummy,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0) if paged else 0,
        seqlen_new, capacity, k_cache.shape[0],
        HEAD_DIM=head_dim, BLOCK_D=block_d, PAGED=paged, PAGE_SIZE=k_cache.shape[1] if paged else 1,
        HAS_BATCH_IDX=cache_batch_idx is not None, BLOCK_T=block_t, num_warps=4,
    )


_decode_split_tuned = triton.autotune(
    configs=configs.DECODE_CONFIGS,
    key=configs.DECODE_AUTOTUNE_KEY,
    prune_configs_by={"early_config_prune": configs.prune_decode_configs},
    cache_results=True,
)(_decode_split)


@triton.jit
def _decode_merge(
    O_PART, LSE_PART, O, LSE,
    stride_pb, stride_pm, stride_ph, stride_ps,  # O_PART (B, Sq, Hq, S, D) fp32, last dim contiguous
    stride_qb, stride_qm, stride_qh, stride_qs,  # LSE_PART (B, Sq, Hq, S) fp32
    stride_ob, stride_om, stride_oh,  # O (B, Sq, Hq, D)
    stride_lb, stride_lm, stride_lh,  # LSE (B, Hq, Sq)
    NUM_HEADS, SEQLEN_Q, NUM_SPLITS,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One program per (b, i, h) row: combine the splits' partial results through their log-sum-exps."""
    pid = tl.program_id(0)
    off_h = pid % NUM_HEADS
    off_m = (pid // NUM_HEADS) % SEQLEN_Q
    off_b = pid // (NUM_HEADS * SEQLEN_Q)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    lse_base = LSE_PART + off_b.to(tl.int64) * stride_qb + off_m.to(tl.int64) * stride_qm + off_h * stride_qh
    lse_s = tl.load(lse_base + offs_s * stride_qs, mask=offs_s < NUM_SPLITS, other=float("-inf"))
    lse_max = tl.max(lse_s, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # all splits empty: weights exp(-inf) = 0
    total = tl.sum(tl.math.exp2((lse_s - lse_max) * 1.4426950408889634), 0)

    o_base = O_PART + off_b.to(tl.int64) * stride_pb + off_m.to(tl.int64) * stride_pm + off_h * stride_ph
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s in range(0, NUM_SPLITS):
        lse_i = tl.load(lse_base + s * stride_qs)
        w = tl.math.exp2((lse_i - lse_max) * 1.4426950408889634)
        o_s = tl.load(o_base + s * stride_ps + offs_d, mask=d_ok, other=0.0)
        acc += tl.where(w > 0.0, o_s * w, 0.0)

    empty = total == 0.0
    out = acc / tl.where(empty, 1.0, total)
    lse = tl.where(empty, float("-inf"), lse_max + tl.log(tl.where(empty, 1.0, total)))
    o_ptrs = O + off_b.to(tl.int64) * stride_ob + off_m.to(tl.int64) * stride_om + off_h * stride_oh + offs_d
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=d_ok)
    tl.store(LSE + off_b.to(tl.int64) * stride_lb + off_m.to(tl.int64) * stride_lm + off_h * stride_lh, lse)


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda" or INTERPRET:
        return configs.DECODE_INTERPRETER_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


def choose_num_splits(programs: int, max_seqlen_k: int, device: torch.device, num_sms: int | None = None) -> int:
    """How many chunks to cut each sequence's keys into (flash-attn's heuristic).

    `programs` = batch · kv heads · M tiles. If they nearly fill the GPU (`DECODE_PROGRAMS_PER_SM` per SM),
    no split;
    otherwise the fewest splits whose wave efficiency (programs / slots, over its ceiling) is within 85% of
    the best, with at least `DECODE_MIN_SPLIT_KEYS` keys per split and at most 128 splits. `num_sms`
    overrides the device's SM count (off the GPU a small `configs.DECODE_INTERPRETER_SMS`).
    """
    return _choose_num_splits(programs, max_seqlen_k, num_sms or _num_sms(device))


@functools.lru_cache(maxsize=4096)  # on every decode call's path: decoding repeats a few shapes
def _choose_num_splits(programs: int, max_seqlen_k: int, num_sms: int) -> int:
    slots = configs.DECODE_PROGRAMS_PER_SM * num_sms
    if programs >= 0.8 * slots:
        return 1
    n_blocks = max(1, math.ceil(max_seqlen_k / configs.DECODE_MIN_SPLIT_KEYS))
    max_splits = min(configs.DECODE_MAX_SPLITS, slots, n_blocks)

    def eligible(s: int) -> bool:  # a split count that gives the same chunk as s - 1 is not a new choice
        return s == 1 or math.ceil(n_blocks / s) != math.ceil(n_blocks / (s - 1))

    eff = {}
    for s in range(1, max_splits + 1):
        if eligible(s):
            waves = programs * s / slots
            eff[s] = waves / math.ceil(waves)
    best = max(eff.values())
    return next(s for s, e in eff.items() if e >= 0.85 * best)


def decode_block_m(rows: int) -> int:
    """M tile for `rows` = Sq · group stacked query rows: at least 16 (tl.dot), at most 64."""
    return min(max(16, configs.next_power_of_2(max(rows, 1))), 64)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    cache_batch_idx: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    num_splits: int = 0,
    config: dict | None = None,
    seqlen_new: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the decode kernels on validated inputs (`flashtriton.kvcache` checks them and appends new keys).

    q (B, Sq, Hq, D); k_cache, v_cache (B_cache, S_cache, Hkv, D), or paged (num_pages, page_size, Hkv, D)
    with block_table int32 (B, max_pages); cache_seqlens int32 (B,): keys in the cache before the append of
    `seqlen_new` keys (already written): sequence b attends to cache_seqlens[b] + seqlen_new keys;
    max_seqlen_k: an upper bound of those (a Python int: sizes the split heuristic and the autotune key).
    Out-of-range values (cache lengths, cache rows, pages) give that sequence NaN, never an out-of-bounds read;
    cache_batch_idx int32 (B,) or None (contiguous cache only). Caches must have a contiguous last dim.
    num_splits: 0 chooses, 1 no split, n > 1 n chunks. `config` forces {"BLOCK_N", "num_warps", "num_stages"}.
    Returns out (B, Sq, Hq, D) in q's dtype and lse (B, Hq, Sq) fp32 (natural log).
    """
    batch, seqlen_q, heads_q, head_dim = q.shape
    heads_kv = k_cache.shape[2]
    group = heads_q // heads_kv
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse.fill_(float("-inf"))

    paged = block_table is not None
    rows = seqlen_q * group
    block_m = decode_block_m(rows)
    m_tiles = configs.cdiv(rows, block_m)
    if num_splits == 0:
        num_splits = choose_num_splits(batch * heads_kv * m_tiles, max_seqlen_k, q.device)
    num_splits = max(1, int(num_splits))

    if num_splits == 1:
        dst, dst_lse = out, lse
        o_strides = (out.stride(0), out.stride(1), out.stride(2), 0)
        l_strides = (lse.stride(0), lse.stride(2), lse.stride(1), 0)
    else:
        dst = torch.empty((batch, seqlen_q, heads_q, num_splits, head_dim), dtype=torch.float32, device=q.device)
        dst_lse = torch.empty((batch, seqlen_q, heads_q, num_splits), dtype=torch.float32, device=q.device)
        o_strides = (dst.stride(0), dst.stride(1), dst.stride(2), dst.stride(3))
        l_strides = (dst_lse.stride(0), dst_lse.stride(1), dst_lse.stride(2), dst_lse.stride(3))

    dummy = cache_seqlens  # stands in for absent int32 pointers
    upcast, precision = dot_settings(q.dtype)
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    args = (
        q, k_cache, v_cache, dst, dst_lse, cache_seqlens,
        cache_batch_idx if cache_batch_idx is not None else dummy,
        block_table if paged else dummy,
        softmax_scale * LOG2E,
        *q.stride(),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *o_strides, *l_strides,
        block_table.stride(0) if paged else 0,
        heads_kv, seqlen_q, num_splits, seqlen_new, capacity, k_cache.shape[0],
        configs.seqlen_bucket(configs.cdiv(max(max_seqlen_k, 1), num_splits)),
    )
    constexprs = dict(
        GROUP_SIZE=group, HEAD_DIM=head_dim, BLOCK_D=configs.padded_head_dim(head_dim),
        IS_CAUSAL=bool(causal), PAGED=paged, PAGE_SIZE=k_cache.shape[1] if paged else 1,
        HAS_BATCH_IDX=cache_batch_idx is not None,
        UPCAST_DOT=upcast, DOT_PRECISION=precision, BLOCK_M=block_m,
    )
    grid = (batch * heads_kv, num_splits, m_tiles)
    if config is None and INTERPRET:
        config = configs.DECODE_INTERPRETER_CONFIG
    if config is None and not configs.AUTOTUNE:
        config = configs.default_decode_config(configs.padded_head_dim(head_dim), q.element_size())
    if config is None:
        _decode_split_tuned[grid](*args, **constexprs)
    else:
        _decode_split[grid](*args, **constexprs, **config)

    if num_splits > 1:
        _decode_merge[(batch * seqlen_q * heads_q,)](
            dst, dst_lse, out, lse,
            dst.stride(0), dst.stride(1), dst.stride(2), dst.stride(3),
            dst_lse.stride(0), dst_lse.stride(1), dst_lse.stride(2), dst_lse.stride(3),
            out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(2), lse.stride(1),
            heads_q, seqlen_q, num_splits,
            HEAD_DIM=head_dim, BLOCK_D=configs.padded_head_dim(head_dim),
            BLOCK_S=max(2, configs.next_power_of_2(num_splits)),
            num_warps=1 if head_dim <= 64 else 2 if head_dim <= 128 else 4,
        )
    return out, lse
