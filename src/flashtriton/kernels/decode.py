"""Split-KV decoding ("flash-decoding") over a contiguous or paged KV cache: the Triton kernels. Their host side (the
launchers `decode_attention` and `append_kv`, launch plans, split counts, the kept ticket counters and workspace) is
`decode_launch`.

Decoding has few query rows (Sq = 1 .. a few) against a long cache, so the work is reading K and V once, at
memory bandwidth. One launch (`_decode_split`): program (b·hk, split, m) takes batch b, kv head hk and one
chunk (`split`) of that sequence's keys. GQA: the Hq / Hkv query heads of kv head hk and the Sq query rows
are stacked into the M dimension of one tile (row r = query i · group + head g, padded to BLOCK_M >= 16 for
tl.dot), so the group reads its K/V once. K/V stream in BLOCK_N tiles with the online softmax of
FlashAttention-2 (base 2: log2(e) folded into the scale).

With one split the program writes the final (out, lse). With several, each writes a partial (out_s, lse_s)
in fp32 (a split with no keys writes 0 and -inf) and takes a ticket from a per-tile counter; the split that
arrives last merges them all, out = sum_s exp(lse_s - lse) · out_s with lse = logsumexp_s(lse_s), writes
the result and resets the counter to zero. A row with no key in any split gives out 0, lse -inf (never NaN).

The stream schedule (`_decode_stream`, `dispatch.decode_schedule()`) launches a fixed number of programs instead:
the key tiles of all units (b, hk, M tile), laid end to end, are cut into one equal range per program from the
cache lengths on the GPU, so that programs stay equal when the sequences' lengths differ (the split grid gives
each sequence the same number of programs whatever its length). A unit shared by several programs is merged as
above by whichever finishes last.

Q and K have the head dim HEAD_DIM (padded to BLOCK_D); V, O and the split-KV partials V's, HEAD_DIM_V (BLOCK_DV),
which may differ (DeepSeek's MLA).

Paged cache: `block_table[b, j // PAGE_SIZE]` is the page that holds key j of sequence b, at row
`j % PAGE_SIZE` of the page. Pages may be smaller or larger than BLOCK_N: each key row's page is looked up.

Causal is bottom-right: query i of Sq sees key j iff j <= i + Sk_b - Sq (Sk_b = the sequence's key count).
The variants (`variant.Variant`: a window around that diagonal, softcap, ALiBi, attention sinks) use the device
helpers of `variant` like every kernel. A unit's keys are the band its query rows see (`_unit_keys`, from
`variant.key_blocks`): both schedules cut that band, not the whole sequence, so a sliding window reads only the
window's tiles and pages. A window side is clipped to what the tile's rows can reach (the same mask for them), so
that no index sum can wrap for caches near the int32 limit, and the tiles' masks and ALiBi see key positions
relative to the tile's first diagonal key (`base`: small numbers, exact in fp32 whatever the cache's length). A sink
joins each row once, in its final result (`_with_sink`): after the merge when a unit is split.
Offsets into the cache are int64. Key positions are int32: the host keeps CAPACITY (keys per sequence) below
`decode_launch.MAX_CAPACITY`, and a length read from CACHE_SEQLENS is tested as `cached > CAPACITY - SEQLEN_NEW`
(never by forming cached + SEQLEN_NEW, which wraps for lengths near 2**31) before any position is derived from it.

Rotary embedding (ROTARY_DIM > 0, `rotary`): `_append_kv` rotates each new key at its cache row before writing it,
and every program rotates its query tile as it loads it (at cached + query index, or at cached for all queries),
so the kernels read rotated keys from the cache and attend with rotated queries. Left padding (HAS_LEFTPAD,
contiguous caches): sequence b's keys are its cache rows LEFTPAD[b] .. cached + SEQLEN_NEW - 1; the kernels see
them as keys 0 .. Sk_b - 1 (the base pointers start at the pad), so masks, windows and ALiBi align on them.

Bad values (`_unit_inputs`, `_append_kv`): a sequence whose length is out of range, whose cache row is not a row of
the cache, or one of whose used pages (block-table entries for its keys 0 .. cached + SEQLEN_NEW - 1, the new ones
included) is not a page of the cache, whose left pad is outside 0 .. cached, or whose positions run past the rotary
tables, appends nothing at all and gets NaN in every output row and lse. Pages of keys
a unit does not read (outside its band: a window, or causal rows of an early M tile) are checked by a scan of the
block-table row (`_check_unread_pages`), so that every unit of such a sequence is poisoned too.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import load_tile, softmax_finish, softmax_step
from .rotary import rotary_columns, rotate
from .variant import add_sink, diagonal, key_blocks

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _decode_tile(
    acc, l_i, m_i, n_bad, q, K_base, V_base, BT_row, num_pages,
    stride_kp, stride_kn, stride_vp, stride_vn,
    offs_d, offs_dv, rows, base, start_n, end_n, seqlen_k, qk_scale, window_left, window_right, softcap, slope,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold key tiles [start_n, end_n) into the running (acc, l_i, m_i) of the stacked query tile. The rows meet
    their own diagonal at keys base + rows: the mask and ALiBi see key j as j - base (`_unit_keys`).
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
        v_ptrs = V_base + v_rows[:, None] + offs_dv[None, :]  # (BLOCK_N, BLOCK_DV)
        k = load_tile(k_ptrs, cols, seqlen_k, offs_d, MASKED, HEAD_DIM, BLOCK_D)
        v = load_tile(v_ptrs, cols, seqlen_k, offs_dv, MASKED, HEAD_DIM_V, BLOCK_DV)
        if UPCAST_DOT:  # the interpreter's bf16 dot is wrong: compute it in fp32 (exact products)
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N) fp32
        # Row r's diagonal is rows[r] (less base): the shared step's mask and bias with diagonal 0.
        acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v, cols - base, rows, seqlen_k - base, 0, qk_scale,
                                     MASKED, IS_CAUSAL, UPCAST_DOT, DOT_PRECISION, HAS_WINDOW, window_left,
                                     window_right, HAS_SOFTCAP, softcap, HAS_ALIBI, slope)
    return acc, l_i, m_i, n_bad


@triton.jit
def _unit_inputs(
    Q, K, V, CACHE_SEQLENS, BATCH_IDX, BLOCK_TABLE, COS, SIN, LEFTPAD, off_b, off_hk, pid_m,
    stride_qb, stride_qm, stride_qh, stride_qd, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_btb, SEQLEN_Q, SEQLEN_NEW, CAPACITY, NUM_CACHE_ROWS, ROTARY_MAX_CACHED,
    GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGED: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr, ROTARY_DIM: tl.constexpr, ROTARY_INTERLEAVED: tl.constexpr,
    ROTARY_PER_QUERY: tl.constexpr, HAS_LEFTPAD: tl.constexpr, UPCAST_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """What attending one unit (sequence off_b, kv head off_hk, M tile pid_m) needs: the stacked query tile q
    (BLOCK_M, BLOCK_D), each row's query index and head, which rows exist, the cache's base pointers (or the
    block-table row), the sequence's key count and n_bad (1 when its cache length or cache row is out of range:
    then the key count is 0, nothing is read, and the caller poisons the result).
    ROTARY_DIM > 0: q is rotated (`rotary`) at table rows cached + query index (ROTARY_PER_QUERY) or cached, and
    rounded to its dtype; a sequence with cached > ROTARY_MAX_CACHED (the table is too short for it) is bad.
    HAS_LEFTPAD (contiguous cache): the sequence's keys are cache rows [LEFTPAD[b], cached + SEQLEN_NEW), so the
    base pointers start at its first key and the key count leaves the pad out; a pad outside [0, cached] is bad."""
    # Values are checked here, not on the host (no device-to-host sync): a sequence whose cache length or
    # cache row is out of range reads nothing and gets NaN (see flash_attn_with_kvcache).
    cached = tl.load(CACHE_SEQLENS + off_b)
    len_bad = (cached < 0) | (cached > CAPACITY - SEQLEN_NEW)  # no sum that could wrap (module docstring)
    n_bad = len_bad.to(tl.int32)
    seqlen_k = tl.where(len_bad, 0, cached) + SEQLEN_NEW

    # Stacked rows: r = i * GROUP_SIZE + g  ->  query row i, query head off_hk * GROUP_SIZE + g.
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q_idx = rows // GROUP_SIZE
    off_h = off_hk * GROUP_SIZE + rows % GROUP_SIZE
    row_ok = rows < SEQLEN_Q * GROUP_SIZE
    offs_d = tl.arange(0, BLOCK_D)

    q_ptrs = (Q + off_b.to(tl.int64) * stride_qb + q_idx.to(tl.int64)[:, None] * stride_qm
              + off_h[:, None] * stride_qh + offs_d[None, :] * stride_qd)
    q_mask = row_ok[:, None]
    if BLOCK_D != HEAD_DIM:
        q_mask = q_mask & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)  # (BLOCK_M, BLOCK_D)
    if ROTARY_DIM > 0:
        ro_bad = cached > ROTARY_MAX_CACHED  # the table is too short for this sequence
        n_bad += ro_bad.to(tl.int32)
        pos = tl.where(len_bad | ro_bad, 0, cached)
        if ROTARY_PER_QUERY:
            pos = pos + q_idx
        else:
            pos = pos + tl.zeros_like(q_idx)
        partner, col, first, rotated = rotary_columns(offs_d, ROTARY_DIM, ROTARY_INTERLEAVED)
        q_partner = tl.load(Q + off_b.to(tl.int64) * stride_qb + q_idx.to(tl.int64)[:, None] * stride_qm
                            + off_h[:, None] * stride_qh + partner[None, :] * stride_qd, mask=q_mask, other=0.0)
        q = rotate(q, q_partner, COS, SIN, pos, row_ok, col, first, rotated, ROTARY_DIM).to(q.dtype)
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
        if HAS_LEFTPAD:
            pad = tl.load(LEFTPAD + off_b)
            pad_bad = (pad < 0) | (pad > cached)
            n_bad += pad_bad.to(tl.int32)
            pad = tl.where(len_bad | pad_bad, 0, pad)
            seqlen_k -= pad
            K_base += pad.to(tl.int64) * stride_kn
            V_base += pad.to(tl.int64) * stride_vn

    seqlen_k = tl.where(n_bad > 0, 0, seqlen_k)
    return q, q_idx, off_h, row_ok, K_base, V_base, BT_row, seqlen_k, n_bad


@triton.jit
def _unit_keys(seqlen_k, pid_m, window_left, window_right, SEQLEN_Q, GROUP_SIZE: tl.constexpr,
               IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_ALIBI: tl.constexpr, QUERY_ROWS: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The band of keys M tile pid_m's rows see, as `variant.key_blocks` gives it for a tile of QUERY_ROWS query
    rows from the tile's first query row on (an upper bound of the rows its BLOCK_M stacked rows hold):
    (first, start, lo, hi, base, first_row, left, right). Keys [first, start) and [lo, hi) need the mask, [start, lo)
    do not; first, start and lo are multiples of BLOCK_N. base is the first query row's diagonal key, first_row that
    row. left / right: the window's sides clipped to the longest that changes nothing for these rows (the right one
    to the sequence's last key, the left one to key 0), so that every key position formed from them stays within
    int32."""
    first_row = (pid_m * BLOCK_M) // GROUP_SIZE
    diag = diagonal(SEQLEN_Q, seqlen_k, IS_CAUSAL, True, HAS_WINDOW or HAS_ALIBI)
    base = first_row + diag  # the first row's diagonal key
    left = window_left
    right = window_right
    if HAS_WINDOW:
        right = tl.minimum(right, SEQLEN_Q - 1 - first_row)  # row first_row + i: to key seqlen_k - 1 + i
        left = tl.minimum(left, tl.maximum(base + QUERY_ROWS, 0))  # row first_row + i: from key i - QUERY_ROWS
    first, start, lo, hi = key_blocks(0, seqlen_k, base, IS_CAUSAL, QUERY_ROWS, BLOCK_N, HAS_WINDOW, left, right)
    return first, start, lo, hi, base, first_row, left, right


@triton.jit
def _attend_keys(
    q, rows, base, n_bad, K_base, V_base, BT_row, piece_start, piece_end, first, start, lo, hi, check_unread,
    seqlen_k, qk_scale, window_left, window_right, softcap, slope,
    stride_kb, stride_kn, stride_vb, stride_vn, NUM_CACHE_ROWS,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    UNREAD_PAGES: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """(out, lse, n_bad) of the unit's stacked rows over the keys of its band (`_unit_keys`: first, start, lo, hi)
    that fall in this program's piece [piece_start, piece_end) (piece_start a multiple of BLOCK_N): the masked
    left edge, the unmasked middle, the masked right edge. Rows (or pieces) without a visible key get out 0,
    lse -inf. UNREAD_PAGES (paged, and a band that may not cover the sequence): with `check_unread` (the piece
    holding the band's first tile), the pages of the sequence's keys outside the band are checked too. out has V's
    head dim (BLOCK_DV)."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = offs_d if BLOCK_DV == BLOCK_D else tl.arange(0, BLOCK_DV)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if HAS_WINDOW:  # the window's left edge
        acc, l_i, m_i, n_bad = _decode_tile(
            acc, l_i, m_i, n_bad, q, K_base, V_base, BT_row, NUM_CACHE_ROWS, stride_kb, stride_kn, stride_vb,
            stride_vn, offs_d, offs_dv, rows, base, tl.maximum(piece_start, first), tl.minimum(piece_end, start),
            seqlen_k,
            qk_scale, window_left, window_right, softcap, slope,
            True, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, PAGED, PAGE_SIZE, HEAD_DIM, BLOCK_D, HEAD_DIM_V,
            BLOCK_DV, BLOCK_N, UPCAST_DOT, DOT_PRECISION,
        )
    acc, l_i, m_i, n_bad = _decode_tile(  # keys every row sees, inside the sequence: no mask
        acc, l_i, m_i, n_bad, q, K_base, V_base, BT_row, NUM_CACHE_ROWS, stride_kb, stride_kn, stride_vb, stride_vn,
        offs_d, offs_dv, rows, base, tl.maximum(piece_start, start), tl.minimum(piece_end, lo), seqlen_k,
        qk_scale, window_left, window_right, softcap, slope,
        False, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, PAGED, PAGE_SIZE, HEAD_DIM, BLOCK_D, HEAD_DIM_V,
        BLOCK_DV, BLOCK_N, UPCAST_DOT, DOT_PRECISION,
    )
    acc, l_i, m_i, n_bad = _decode_tile(  # the diagonal or the window's right edge, and the end of the keys
        acc, l_i, m_i, n_bad, q, K_base, V_base, BT_row, NUM_CACHE_ROWS, stride_kb, stride_kn, stride_vb, stride_vn,
        offs_d, offs_dv, rows, base, tl.maximum(piece_start, lo), tl.minimum(piece_end, hi), seqlen_k,
        qk_scale, window_left, window_right, softcap, slope,
        True, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, PAGED, PAGE_SIZE, HEAD_DIM, BLOCK_D, HEAD_DIM_V,
        BLOCK_DV, BLOCK_N, UPCAST_DOT, DOT_PRECISION,
    )
    if UNREAD_PAGES:
        n_bad = _check_unread_pages(BT_row, first, hi, seqlen_k, check_unread, NUM_CACHE_ROWS, n_bad, PAGE_SIZE)
    out, lse = softmax_finish(acc, l_i, m_i)  # rows (or whole pieces) that saw no key: out 0, lse -inf
    return out, lse, n_bad


@triton.jit
def _check_unread_pages(BT_row, first, hi, seqlen_k, check, num_pages, n_bad, PAGE_SIZE: tl.constexpr):
    """n_bad plus the bad block-table entries among the pages of the sequence's keys [0, seqlen_k) that a band of
    keys [first, hi) does not read (those wholly before `first` or after `hi`; every page when the band is
    empty): a bad page anywhere in the sequence poisons every unit of it, also those that skip its keys. Only
    where `check` (one piece per unit): nothing is read otherwise."""
    read = first < hi
    before = tl.where(check, tl.where(read, first // PAGE_SIZE, 0), 0)
    after = tl.where(read, tl.cdiv(hi, PAGE_SIZE), 0)
    end = tl.where(check, tl.cdiv(seqlen_k, PAGE_SIZE), 0)
    n_bad = _count_bad_pages(BT_row, 0, before, num_pages, n_bad)
    return _count_bad_pages(BT_row, after, end, num_pages, n_bad)


@triton.jit
def _row_slopes(ALIBI, off_b, stride_alibi_b, off_h, HAS_ALIBI: tl.constexpr):
    """Each stacked row's ALiBi slope in base 2, (BLOCK_M, 1) to broadcast against a score tile; 0.0 without."""
    if HAS_ALIBI:
        return (tl.load(ALIBI + off_b.to(tl.int64) * stride_alibi_b + off_h) * LOG2E)[:, None]
    else:
        return 0.0


@triton.jit
def _with_sink(out, lse, SINKS, off_h, BLOCK_M: tl.constexpr):
    """A unit's finished rows (out, lse) with each row's head's sink folded in (`variant.add_sink`, base 2): the
    normalized out stands for acc with l = 1 and m = lse · log2(e). A row that saw no key gets out 0 and lse =
    the sink; NaN (bad values) stays NaN."""
    sink = tl.load(SINKS + off_h).to(tl.float32) * LOG2E
    acc, l_i, m_i = add_sink(out, tl.full([BLOCK_M], 1.0, tl.float32), lse * LOG2E, sink)
    return softmax_finish(acc, l_i, m_i)


# Block-table entries checked per load by `_count_bad_pages`.
PAGE_CHECK_BLOCK = tl.constexpr(1024)


@triton.jit
def _count_bad_pages(BT_row, first_page, end_page, num_pages, n_bad):
    """n_bad plus the number of block-table entries BT_row[first_page:end_page] that are not pages of the cache
    (outside [0, num_pages)); nothing is read for an empty range."""
    offs = tl.arange(0, PAGE_CHECK_BLOCK)
    for p0 in range(first_page, end_page, PAGE_CHECK_BLOCK):
        p = p0 + offs
        pages = tl.load(BT_row + p, mask=p < end_page, other=0)
        n_bad += tl.sum(((pages < 0) | (pages >= num_pages)).to(tl.int32))
    return n_bad


@triton.jit
def _store_result(O, LSE, SINKS, off_b, q_idx, off_h, row_ok, out, lse, stride_ob, stride_om, stride_oh, stride_lb,
                  stride_lm, stride_lh, HAS_SINKS: tl.constexpr, STORE_LSE: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """The unit's final rows, with the sinks folded in (HAS_SINKS, `_with_sink`): out (BLOCK_M, BLOCK_D) into O in
    its dtype, lse into LSE (if STORE_LSE). HEAD_DIM / BLOCK_D: O's head dim (V's)."""
    if HAS_SINKS:
        out, lse = _with_sink(out, lse, SINKS, off_h, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_off = q_idx.to(tl.int64)
    if STORE_LSE:
        l_ptrs = LSE + off_b.to(tl.int64) * stride_lb + q_off * stride_lm + off_h * stride_lh
        tl.store(l_ptrs, lse, mask=row_ok)
    o_ptrs = O + off_b.to(tl.int64) * stride_ob + q_off[:, None] * stride_om + off_h[:, None] * stride_oh + offs_d[None, :]
    o_mask = row_ok[:, None]
    if BLOCK_D != HEAD_DIM:
        o_mask = o_mask & (offs_d[None, :] < HEAD_DIM)
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=o_mask)


@triton.jit
def _decode_split(
    Q, K, V,
    O, LSE,  # (B, Sq, Hq, Dv) q's dtype; (B, Hq, Sq) fp32 (written if STORE_LSE)
    PART,  # SPLIT_KV: fp32 (B, Sq, Hq, NUM_SPLITS, BLOCK_DV + PART_PAD): partial out, then lse
    TICKETS,  # SPLIT_KV: int32 (B·Hkv·M tiles,), zero before the launch and after it
    CACHE_SEQLENS,  # int32 (B,): keys already in the cache before this call's append
    BATCH_IDX,  # int32 (B,): cache row of each sequence (contiguous cache, HAS_BATCH_IDX)
    BLOCK_TABLE,  # int32 (B, max_pages) (PAGED)
    ALIBI,  # fp32 (Hq,) or (B, Hq) ALiBi slopes (HAS_ALIBI)
    SINKS,  # (Hq,) one logit per query head, fp32 or q's dtype (HAS_SINKS)
    qk_scale,  # softmax_scale * log2(e); with HAS_SOFTCAP softmax_scale / softcap (`Variant.scalars`)
    window_left, window_right,  # HAS_WINDOW: the window's sides (`decode_launch.band_bounds`; causal: right 0)
    softcap,  # HAS_SOFTCAP: softcap * log2(e)
    stride_alibi_b,  # ALiBi slopes' batch stride (0 for (Hq,))
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh,  # kb: batch row (contiguous) or page (paged)
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lm, stride_lh,
    stride_btb,
    NUM_HEADS_KV, SEQLEN_Q, NUM_SPLITS,
    SEQLEN_NEW,  # keys appended by this call: sequence b attends to CACHE_SEQLENS[b] + SEQLEN_NEW keys
    CAPACITY,  # keys the cache holds per sequence
    NUM_CACHE_ROWS,  # rows of the contiguous cache (batch_size_cache) or pages of the paged one
    TUNE_SEQLEN_K,  # power-of-two bucket of keys per split: autotune key only
    COS, SIN,  # ROTARY_DIM > 0: (seqlen_ro, ROTARY_DIM / 2) in q's dtype, contiguous (None without)
    LEFTPAD,  # HAS_LEFTPAD: int32 (B,), the first cache row of each sequence (None without)
    ROTARY_MAX_CACHED,  # ROTARY_DIM > 0: the longest cache length the tables serve (None without)
    GROUP_SIZE: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,  # Q and K's head dim, padded to BLOCK_D
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,  # V and O's, padded to BLOCK_DV
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
    UNREAD_PAGES: tl.constexpr,  # paged, with a band that may not cover the sequence: check the pages outside it
    SPLIT_KV: tl.constexpr,  # NUM_SPLITS > 1
    STORE_LSE: tl.constexpr,
    SPLITS_P2: tl.constexpr,  # next power of two >= NUM_SPLITS (the merge's lse tile)
    ROTARY_DIM: tl.constexpr,  # 0: no rotary; else q rotates in its first ROTARY_DIM dims (`_unit_inputs`)
    ROTARY_INTERLEAVED: tl.constexpr, ROTARY_PER_QUERY: tl.constexpr,  # pairs (2c, 2c + 1); q at cached + i
    HAS_LEFTPAD: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    QUERY_ROWS: tl.constexpr,  # query rows an M tile's stacked rows span at most (`_unit_keys`)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (B·Hkv, NUM_SPLITS, M tiles): program (b·hk, split, m) attends unit (b, hk, m) over its split's
    share of the unit's band of keys; with several splits the last one to finish merges them (see the module
    docstring)."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    off_b = pid_bh // NUM_HEADS_KV
    off_hk = pid_bh % NUM_HEADS_KV
    q, q_idx, off_h, row_ok, K_base, V_base, BT_row, seqlen_k, n_bad = _unit_inputs(
        Q, K, V, CACHE_SEQLENS, BATCH_IDX, BLOCK_TABLE, COS, SIN, LEFTPAD, off_b, off_hk, pid_m,
        stride_qb, stride_qm, stride_qh, stride_qd, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        stride_btb, SEQLEN_Q, SEQLEN_NEW, CAPACITY, NUM_CACHE_ROWS, ROTARY_MAX_CACHED,
        GROUP_SIZE, HEAD_DIM, BLOCK_D, PAGED, HAS_BATCH_IDX, ROTARY_DIM, ROTARY_INTERLEAVED, ROTARY_PER_QUERY,
        HAS_LEFTPAD, UPCAST_DOT, BLOCK_M)
    first, start, lo, hi, base, first_row, left, right = _unit_keys(
        seqlen_k, pid_m, window_left, window_right, SEQLEN_Q, GROUP_SIZE, IS_CAUSAL, HAS_WINDOW, HAS_ALIBI,
        QUERY_ROWS, BLOCK_M, BLOCK_N)
    # This split's keys: whole BLOCK_N tiles of the band, the same number per split.
    blocks_per_split = tl.cdiv(tl.cdiv(hi - first, BLOCK_N), NUM_SPLITS)
    piece_start = first + split * blocks_per_split * BLOCK_N
    piece_end = tl.minimum(piece_start + blocks_per_split * BLOCK_N, hi)
    out, lse, n_bad = _attend_keys(
        q, q_idx - first_row, base, n_bad, K_base, V_base, BT_row, piece_start, piece_end, first, start, lo, hi,
        split == 0, seqlen_k, qk_scale, left, right, softcap,
        _row_slopes(ALIBI, off_b, stride_alibi_b, off_h, HAS_ALIBI),
        stride_kb, stride_kn, stride_vb, stride_vn, NUM_CACHE_ROWS,
        HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, PAGED, PAGE_SIZE,
        UNREAD_PAGES, UPCAST_DOT, DOT_PRECISION, BLOCK_M, BLOCK_N)

    # Invalid values: out NaN; lse NaN, or +inf in a partial result so that the merge gives NaN for both.
    poison = n_bad > 0
    out = tl.where(poison, float("nan"), out)
    if SPLIT_KV:
        lse = tl.where(poison, float("inf"), lse)
        # Partial result of split s for row (b, i, h): PART row ((b·Sq + i)·Hq + h)·NUM_SPLITS + s.
        part0 = ((off_b.to(tl.int64) * SEQLEN_Q + q_idx.to(tl.int64)) * (NUM_HEADS_KV * GROUP_SIZE) + off_h) * NUM_SPLITS
        _store_partial(PART + (part0 + split) * (BLOCK_DV + PART_PAD), out, lse, row_ok, BLOCK_DV)
        tile = pid_bh * tl.num_programs(2) + pid_m
        is_last = tl.atomic_add(TICKETS + tile, 1) == NUM_SPLITS - 1
        if is_last:  # the other splits are done: merge them all, and leave the counter at zero
            out, lse = _merge_splits(PART, part0, row_ok, tl.arange(0, BLOCK_DV), NUM_SPLITS, BLOCK_M, BLOCK_DV,
                                     SPLITS_P2)
            tl.atomic_xchg(TICKETS + tile, 0)
    else:
        lse = tl.where(poison, float("nan"), lse)
        is_last = True
    if is_last:
        _store_result(O, LSE, SINKS, off_b, q_idx, off_h, row_ok, out, lse, stride_ob, stride_om, stride_oh,
                      stride_lb, stride_lm, stride_lh, HAS_SINKS, STORE_LSE, HEAD_DIM_V, BLOCK_DV, BLOCK_M)


@triton.jit
def _decode_stream(
    Q, K, V,
    O, LSE,  # (B, Sq, Hq, Dv) q's dtype; (B, Hq, Sq) fp32 (written if STORE_LSE)
    PART,  # fp32 (programs, 2, BLOCK_M, BLOCK_DV + PART_PAD): each program's first and last partial unit
    TICKETS,  # int32 (B·Hkv·M tiles,), zero before the launch and after it
    CACHE_SEQLENS, BATCH_IDX, BLOCK_TABLE, ALIBI, SINKS,  # as in _decode_split
    qk_scale, window_left, window_right, softcap, stride_alibi_b,  # as in _decode_split
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lm, stride_lh,
    stride_btb,
    NUM_HEADS_KV, SEQLEN_Q, BATCH, SEQLEN_NEW, CAPACITY, NUM_CACHE_ROWS,
    BAND_TILES,  # an upper bound of the key tiles of any unit's band (`_unit_keys`): the window's, or more
    COS, SIN, LEFTPAD, ROTARY_MAX_CACHED,  # as in _decode_split
    GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,  # as in _decode_split
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
    UNREAD_PAGES: tl.constexpr,  # as in _decode_split
    STORE_LSE: tl.constexpr,
    ROTARY_DIM: tl.constexpr, ROTARY_INTERLEAVED: tl.constexpr, ROTARY_PER_QUERY: tl.constexpr,  # as in _decode_split
    HAS_LEFTPAD: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_B: tl.constexpr,  # next power of two >= BATCH
    QUERY_ROWS: tl.constexpr,  # as in _decode_split
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (programs, 1, 1): the key tiles of every unit (b, hk, m), laid end to end in that order (each unit of
    sequence b min(cdiv(its keys, BLOCK_N), BAND_TILES) tiles, at least one; unit m reads those of its band from the
    band's first tile on, `_unit_keys`), are cut into one equal range per program, so that
    every program reads the same number of tiles whatever the lengths (the split grid gives every sequence the same
    number of programs, which are as unequal as the lengths). A program attends each unit its range touches:
    a unit wholly inside the range is written out; a unit shared with other programs leaves a partial result
    (the program's first or last unit: slot 0 or 1 of its two) and a ticket, and the program that takes the
    last ticket merges the unit's partials and resets the counter. Lengths come from CACHE_SEQLENS on the GPU
    (no host sync); a program's range is fixed by them and by its index alone."""
    pid = tl.program_id(0)
    num_rows = SEQLEN_Q * GROUP_SIZE
    m_tiles = tl.cdiv(num_rows, BLOCK_M)
    units_per_seq = NUM_HEADS_KV * m_tiles
    offs_b = tl.arange(0, BLOCK_B)
    in_batch = offs_b < BATCH
    cached = tl.load(CACHE_SEQLENS + offs_b, mask=in_batch, other=0)
    len_ok = (cached >= 0) & (cached <= CAPACITY - SEQLEN_NEW)  # no sum that could wrap (module docstring)
    keys = tl.where(len_ok, tl.where(len_ok, cached, 0) + SEQLEN_NEW, 0)  # bad lengths: one tile, read nothing
    if HAS_LEFTPAD:  # the keys after each sequence's pad (a bad pad: one tile, read nothing)
        pads = tl.load(LEFTPAD + offs_b, mask=in_batch, other=0)
        keys = tl.where((pads >= 0) & (pads <= cached), keys - pads, 0)
    unit_tiles = tl.where(in_batch, tl.maximum(tl.minimum(tl.cdiv(keys, BLOCK_N), BAND_TILES), 1), 0)  # (BLOCK_B,)
    seq_tiles = unit_tiles.to(tl.int64) * units_per_seq
    seq_end = tl.cumsum(seq_tiles, 0)  # (BLOCK_B,) global tile after each sequence's units
    total = tl.sum(seq_tiles, 0)
    # Programs past the number of tiles get nothing (every other program holds at least one tile, so a unit's
    # partials come from consecutive programs that all hold some of it).
    programs = tl.minimum(tl.num_programs(0).to(tl.int64), total)
    lo = pid * total // programs
    hi = tl.where(pid < programs, (pid + 1) * total // programs, lo)
    cur = lo
    while cur < hi:
        off_b = tl.sum((seq_end <= cur).to(tl.int32), 0)
        seq_start = tl.sum(tl.where(offs_b < off_b, seq_tiles, 0), 0)
        n_tiles = tl.sum(tl.where(offs_b == off_b, unit_tiles, 0), 0)
        unit = ((cur - seq_start) // n_tiles).to(tl.int32)
        unit_start = seq_start + unit.to(tl.int64) * n_tiles  # the unit's first tile, globally
        piece_end = tl.minimum(hi, unit_start + n_tiles)
        off_hk = unit // m_tiles
        pid_m = unit % m_tiles
        q, q_idx, off_h, row_ok, K_base, V_base, BT_row, seqlen_k, n_bad = _unit_inputs(
            Q, K, V, CACHE_SEQLENS, BATCH_IDX, BLOCK_TABLE, COS, SIN, LEFTPAD, off_b, off_hk, pid_m,
            stride_qb, stride_qm, stride_qh, stride_qd, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn,
            stride_vh, stride_btb, SEQLEN_Q, SEQLEN_NEW, CAPACITY, NUM_CACHE_ROWS, ROTARY_MAX_CACHED,
            GROUP_SIZE, HEAD_DIM, BLOCK_D, PAGED, HAS_BATCH_IDX, ROTARY_DIM, ROTARY_INTERLEAVED, ROTARY_PER_QUERY,
            HAS_LEFTPAD, UPCAST_DOT, BLOCK_M)
        k_first, k_start, k_lo, k_hi, base, first_row, left, right = _unit_keys(
            seqlen_k, pid_m, window_left, window_right, SEQLEN_Q, GROUP_SIZE, IS_CAUSAL, HAS_WINDOW, HAS_ALIBI,
            QUERY_ROWS, BLOCK_M, BLOCK_N)
        # This program's tiles of the unit, from the band's first tile on (tiles past the band hold no keys).
        piece_start = tl.minimum((cur - unit_start).to(tl.int32) * BLOCK_N, k_hi - k_first) + k_first
        piece_stop = tl.minimum((piece_end - unit_start).to(tl.int32) * BLOCK_N, k_hi - k_first) + k_first
        out, lse, n_bad = _attend_keys(
            q, q_idx - first_row, base, n_bad, K_base, V_base, BT_row, piece_start, piece_stop, k_first, k_start,
            k_lo, k_hi, cur == unit_start, seqlen_k, qk_scale, left, right, softcap,
            _row_slopes(ALIBI, off_b, stride_alibi_b, off_h, HAS_ALIBI),
            stride_kb, stride_kn, stride_vb, stride_vn, NUM_CACHE_ROWS,
            HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, PAGED,
            PAGE_SIZE, UNREAD_PAGES, UPCAST_DOT, DOT_PRECISION, BLOCK_M, BLOCK_N)
        poison = n_bad > 0
        out = tl.where(poison, float("nan"), out)
        # The programs holding the unit's first and last tiles (program p holds [p·total // programs, ...)).
        first_prog = ((unit_start + 1) * programs - 1) // total
        last_prog = ((unit_start + n_tiles) * programs - 1) // total
        is_last = first_prog == last_prog
        if is_last:
            lse = tl.where(poison, float("nan"), lse)
        else:
            lse = tl.where(poison, float("inf"), lse)
            slot = tl.where(cur == lo, 0, 1)
            part_rows = (pid * 2 + slot) * BLOCK_M + tl.arange(0, BLOCK_M)
            _store_partial(PART + part_rows.to(tl.int64) * (BLOCK_DV + PART_PAD), out, lse, row_ok, BLOCK_DV)
            tile = off_b * units_per_seq + unit
            is_last = tl.atomic_add(TICKETS + tile, 1) == (last_prog - first_prog).to(tl.int32)
            if is_last:
                first_slot = tl.where(first_prog * total // programs == unit_start, 0, 1)
                out, lse = _merge_programs(PART, first_prog, (last_prog - first_prog + 1).to(tl.int32), first_slot,
                                           row_ok, BLOCK_M, BLOCK_DV)
                tl.atomic_xchg(TICKETS + tile, 0)
        if is_last:
            _store_result(O, LSE, SINKS, off_b, q_idx, off_h, row_ok, out, lse, stride_ob, stride_om, stride_oh,
                          stride_lb, stride_lm, stride_lh, HAS_SINKS, STORE_LSE, HEAD_DIM_V, BLOCK_DV, BLOCK_M)
        cur = piece_end


@triton.jit
def _store_partial(part_row, out, lse, row_ok, BLOCK_D: tl.constexpr):
    """Write a partial result (out, lse) at the workspace rows `part_row` (BLOCK_M,), then make it visible: every
    thread's stores land before the caller takes its ticket (the atomic is acq_rel, gpu scope)."""
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(part_row + BLOCK_D, lse, mask=row_ok)
    tl.store(part_row[:, None] + offs_d[None, :], out, mask=row_ok[:, None])
    tl.debug_barrier()


# A row of the split-KV workspace holds one split's partial result: BLOCK_DV outputs (V's head dim), then the lse,
# then padding that keeps rows 16-byte aligned. Row width BLOCK_DV + PART_PAD (fp32).
PART_PAD = tl.constexpr(4)
# The merge keeps MERGE_TILE_ROWS // BLOCK_M partial outs' loads in flight together (BLOCK_M <= 64): with the usual
# 16-row tile (one query token, GQA group <= 16) 8 splits' partials arrive in one round trip instead of two.
MERGE_TILE_ROWS = tl.constexpr(128)


@triton.jit
def _merge_splits(PART, part0, row_ok, offs_d, NUM_SPLITS, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                  SPLITS_P2: tl.constexpr):
    """(out, lse) of BLOCK_M rows from their NUM_SPLITS partials (PART rows part0 + s): out is the
    lse-weighted sum of the partial outs, lse = logsumexp of the partial lses; a row whose splits are all
    empty (-inf) gets 0 and -inf; a +inf partial (bad values) makes the row NaN. Loads bypass L1 (.cg):
    the partials were written by other programs. This runs after the last split's own work, on the launch's
    critical path: every partial lse comes in one (BLOCK_M, SPLITS_P2) load, the partial outs MERGE_UNROLL at a
    time, so that their loads are in flight together instead of one round trip per split."""
    PART_WIDTH = BLOCK_D + PART_PAD
    MERGE_UNROLL: tl.constexpr = MERGE_TILE_ROWS // BLOCK_M  # BLOCK_M <= 64: at least 2
    offs_s = tl.arange(0, SPLITS_P2)
    lse_all = tl.load(PART + (part0[:, None] + offs_s[None, :]) * PART_WIDTH + BLOCK_D,
                      mask=row_ok[:, None] & (offs_s[None, :] < NUM_SPLITS), other=float("-inf"),
                      cache_modifier=".cg")  # (BLOCK_M, SPLITS_P2)
    lse_max = tl.max(lse_all, 1)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # all splits empty: weights exp(-inf) = 0
    w_all = tl.math.exp2((lse_all - lse_max[:, None]) * 1.4426950408889634)  # (BLOCK_M, SPLITS_P2)
    total = tl.sum(w_all, 1)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, NUM_SPLITS, MERGE_UNROLL):
        for j in tl.static_range(MERGE_UNROLL):
            s = s0 + j
            w = tl.sum(tl.where(offs_s[None, :] == s, w_all, 0.0), 1)  # (BLOCK_M,) split s's weights
            o_s = tl.load(PART + (part0 + s)[:, None] * PART_WIDTH + offs_d[None, :],
                          mask=row_ok[:, None] & (s < NUM_SPLITS), other=0.0, cache_modifier=".cg")
            acc += tl.where(w[:, None] > 0.0, o_s * w[:, None], 0.0)
    empty = total == 0.0
    out = acc / tl.where(empty, 1.0, total)[:, None]
    lse = tl.where(empty, float("-inf"), lse_max + tl.log(tl.where(empty, 1.0, total)))
    return out, lse


# The stream schedule's merge combines MERGE_CHUNK programs' partials per round trip (a unit is usually shared by
# two or three programs).
MERGE_CHUNK = tl.constexpr(8)


@triton.jit
def _merge_programs(PART, first_prog, n_parts, first_slot, row_ok, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """(out, lse) of a unit's BLOCK_M rows from the partials of programs first_prog .. first_prog + n_parts - 1
    (`_decode_stream`: slot 0 of each, `first_slot` of the first). The same weights as `_merge_splits`, combined
    online over chunks of MERGE_CHUNK programs whose loads are issued together; all-empty rows get 0 and -inf, a
    +inf partial (bad values) makes the row NaN."""
    PART_WIDTH = BLOCK_D + PART_PAD
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, MERGE_CHUNK)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for c0 in range(0, n_parts, MERGE_CHUNK):
        part = c0 + offs_c  # (MERGE_CHUNK,)
        row0 = ((first_prog + part) * 2 + tl.where(part == 0, first_slot, 0)) * BLOCK_M
        lse_c = tl.load(PART + (row0[None, :] + offs_r[:, None]) * PART_WIDTH + BLOCK_D,
                        mask=row_ok[:, None] & (part[None, :] < n_parts), other=float("-inf"),
                        cache_modifier=".cg")  # (BLOCK_M, MERGE_CHUNK)
        m_new = tl.maximum(m, tl.max(lse_c, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: weights exp(-inf) = 0
        w_c = tl.math.exp2((lse_c - m_safe[:, None]) * 1.4426950408889634)
        alpha = tl.math.exp2((m - m_safe) * 1.4426950408889634)
        total = total * alpha + tl.sum(w_c, 1)
        acc = acc * alpha[:, None]
        for j in tl.static_range(MERGE_CHUNK):
            k = c0 + j
            row0_j = ((first_prog + k) * 2 + tl.where(k == 0, first_slot, 0)) * BLOCK_M
            w = tl.sum(tl.where(offs_c[None, :] == j, w_c, 0.0), 1)  # (BLOCK_M,)
            o_j = tl.load(PART + (row0_j + offs_r)[:, None] * PART_WIDTH + offs_d[None, :],
                          mask=row_ok[:, None] & (k < n_parts), other=0.0, cache_modifier=".cg")
            acc += tl.where(w[:, None] > 0.0, o_j * w[:, None], 0.0)
        m = m_new
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    empty = total == 0.0
    out = acc / tl.where(empty, 1.0, total)[:, None]
    lse = tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, total)))
    return out, lse


@triton.jit
def _append_kv(
    K_NEW, V_NEW, K_CACHE, V_CACHE, CACHE_SEQLENS, BATCH_IDX, BLOCK_TABLE,
    stride_knb, stride_knm, stride_knh,  # k (B, S_new, Hkv, D), v (B, S_new, Hkv, Dv), last dim contiguous
    stride_vnb, stride_vnm, stride_vnh,
    stride_kb, stride_kn, stride_kh,  # caches: kb is the batch row (contiguous) or the page (paged)
    stride_vb, stride_vn, stride_vh,
    stride_btb,
    SEQLEN_NEW, CAPACITY, NUM_CACHE_ROWS,
    COS, SIN, LEFTPAD, ROTARY_MAX_CACHED,  # as in _decode_split (None without rotary / left padding)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
    ROTARY_DIM: tl.constexpr, ROTARY_INTERLEAVED: tl.constexpr, HAS_LEFTPAD: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Write k, v rows [t, t + BLOCK_T) of (batch b, kv head h) at cache positions CACHE_SEQLENS[b] + t ...
    Grid (B, Hkv, token tiles). ROTARY_DIM > 0: k row t is rotated (`rotary`) at table row CACHE_SEQLENS[b] + t
    first. A sequence whose values are out of range (its cache length, its cache row, any page it uses after the
    append, its left pad, a cache length the rotary tables do not serve) writes nothing at all: the decode kernel
    gives it NaN."""
    off_b = tl.program_id(0)
    off_h = tl.program_id(1)
    t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,) new-token index
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = offs_d if BLOCK_DV == BLOCK_D else tl.arange(0, BLOCK_DV)
    # Scalar validity folds into the number of rows to write (mixing scalar and tensor masks with `&` trips
    # triton 3.9's interpreter, which then builds int32 masks).
    cached = tl.load(CACHE_SEQLENS + off_b)
    len_bad = (cached < 0) | (cached > CAPACITY - SEQLEN_NEW)  # no sum that could wrap (module docstring)
    cached = tl.where(len_bad, 0, cached)
    n_new = tl.where(len_bad, 0, SEQLEN_NEW)
    if PAGED:
        # Every page the sequence uses after the append must be a page of the cache, or none of its keys is
        # written (the decode kernel checks the same pages and gives it NaN).
        BT_row = BLOCK_TABLE + off_b.to(tl.int64) * stride_btb
        n_bad = _count_bad_pages(BT_row, 0, tl.cdiv(cached + n_new, PAGE_SIZE), NUM_CACHE_ROWS,
                                 len_bad.to(tl.int32))
        n_new = tl.where(n_bad > 0, 0, n_new)
    else:
        if HAS_BATCH_IDX:
            row = tl.load(BATCH_IDX + off_b)
            n_new = tl.where((row >= 0) & (row < NUM_CACHE_ROWS), n_new, 0)
        else:
            row = off_b
    if HAS_LEFTPAD:
        pad = tl.load(LEFTPAD + off_b)
        n_new = tl.where((pad >= 0) & (pad <= cached), n_new, 0)
    if ROTARY_DIM > 0:
        n_new = tl.where(cached > ROTARY_MAX_CACHED, 0, n_new)
    rows_ok = t < n_new
    pos = cached + t  # (BLOCK_T,) position in the sequence
    if PAGED:
        page = tl.load(BT_row + pos // PAGE_SIZE, mask=rows_ok, other=0)
        k_dst = page.to(tl.int64) * stride_kb + (pos % PAGE_SIZE).to(tl.int64) * stride_kn
        v_dst = page.to(tl.int64) * stride_vb + (pos % PAGE_SIZE).to(tl.int64) * stride_vn
    else:
        k_dst = row.to(tl.int64) * stride_kb + pos.to(tl.int64) * stride_kn
        v_dst = row.to(tl.int64) * stride_vb + pos.to(tl.int64) * stride_vn
    mask = rows_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    v_mask = rows_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
    t64 = t.to(tl.int64)
    k = tl.load(K_NEW + off_b.to(tl.int64) * stride_knb + t64[:, None] * stride_knm + off_h * stride_knh
                + offs_d[None, :], mask=mask)
    if ROTARY_DIM > 0:
        partner, col, first, rotated = rotary_columns(offs_d, ROTARY_DIM, ROTARY_INTERLEAVED)
        k_partner = tl.load(K_NEW + off_b.to(tl.int64) * stride_knb + t64[:, None] * stride_knm + off_h * stride_knh
                            + partner[None, :], mask=mask)
        k = rotate(k, k_partner, COS, SIN, pos, rows_ok, col, first, rotated, ROTARY_DIM).to(k.dtype)
    v = tl.load(V_NEW + off_b.to(tl.int64) * stride_vnb + t64[:, None] * stride_vnm + off_h * stride_vnh
                + offs_dv[None, :], mask=v_mask)
    tl.store(K_CACHE + k_dst[:, None] + off_h * stride_kh + offs_d[None, :], k, mask=mask)
    tl.store(V_CACHE + v_dst[:, None] + off_h * stride_vh + offs_dv[None, :], v, mask=v_mask)
