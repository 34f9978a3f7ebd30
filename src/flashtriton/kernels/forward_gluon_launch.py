"""The host side of Hopper's Gluon forward (`forward_gluon`): a config checked against the kernel and sm_90,
the grid (one persistent program per SM, at most one per work unit), the runtime arguments and constexprs, the
launch, and an offline compile for sm_90 that needs no GPU.

A config is a dict of the kernel's schedule constexprs (BLOCK_N, NUM_BUFFERS, CONSUMER_REGS, N_CONSUMERS,
Q_BUFFERS, CAUSAL_PAIRS, DYNAMIC, OVERLAP, STORE_FROM_REGS), as `configs.gluon_fwd_config` and
`configs.gluon_varlen_config` give.
"""

from __future__ import annotations

import torch
import triton

from .. import configs
from .common import sm_count
from .forward_gluon import ROWS, _attn_fwd_gluon
from .gluon_common import SHARED_MEMORY_LIMIT, descriptor, head_block, trimmed_width
from .host import cdiv
from .launch import launch
from .variant import Variant

KERNEL = _attn_fwd_gluon
# The keys of a Gluon forward config (configs/forward.py GLUON_BASE says what each means).
CONFIG_KEYS = frozenset({"BLOCK_N", "NUM_BUFFERS", "CONSUMER_REGS", "N_CONSUMERS", "Q_BUFFERS", "CAUSAL_PAIRS",
                         "DYNAMIC", "OVERLAP", "STORE_FROM_REGS"})
# Keys a config may leave out, the kernel's default then: O_IN_Q (True: dense outputs staged for their TMA store in
# the consumers' own Q buffers, which frees the staging tiles' shared memory; one Q slot, no OVERLAP, Q and V in
# tiles of one width: `forward_gluon._consume_item`).
OPTIONAL_KEYS = frozenset({"O_IN_Q"})
# Work units are counted in int32, and a program's last draw (or static slot) runs up to one grid past the end.
UNIT_LIMIT = 2**31 - 2**20


def work_units(seqlen_q: int, heads_q: int, batch: int, config: dict, causal: bool) -> int:
    """How many work units a launch hands out: query tiles (in pairs: pairs of them) x heads x batch entries;
    varlen: over the longest sequence's tiles, for every sequence."""
    n_m = cdiv(seqlen_q, ROWS.value * config["N_CONSUMERS"])
    return ((n_m + 1) // 2 if causal and config["CAUSAL_PAIRS"] else n_m) * heads_q * batch


def shared_memory_bytes(config: dict, head_dim: int, elem_bytes: int = 2, varlen: bool = False,
                        head_dim_v: int | None = None) -> int:
    """Shared memory of the kernel's tiles under `config` (barriers aside): Q slots, the K/V ring and, dense, the O
    staging tiles (none with STORE_FROM_REGS or O_IN_Q), for tiles of `head_dim` columns (V and O: `head_dim_v`'s,
    default the same). Three consumers with two Q slots at D = 128 need 272 KB: more than sm_90 has."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    rows = ROWS.value * config["N_CONSUMERS"]
    q = config["Q_BUFFERS"] * rows * head_dim
    kv = config["NUM_BUFFERS"] * config["BLOCK_N"] * (head_dim + head_dim_v)
    o = 0 if varlen or config["STORE_FROM_REGS"] or config.get("O_IN_Q") else rows * head_dim_v
    return elem_bytes * (q + kv + o)


def kernel_config(config: dict) -> dict:
    """`config` if its keys are CONFIG_KEYS (and any of OPTIONAL_KEYS); ValueError naming the keys it lacks or does
    not know."""
    if not CONFIG_KEYS <= config.keys() <= CONFIG_KEYS | OPTIONAL_KEYS:
        unknown = sorted(config.keys() - CONFIG_KEYS - OPTIONAL_KEYS)
        missing = sorted(CONFIG_KEYS - config.keys())
        raise ValueError(f"Gluon forward config {config}: unknown keys {unknown}, missing {missing}")
    return config


# Softcap's scores against a fixed max (`forward_gluon_tiles.softmax_tile`'s CAP_FIXED; configs.forward.GLUON_CAP_FIXED):
# bf16 inputs (P in bf16 keeps fp32's exponent range, fp16's would not), no ALiBi (its bias is not bounded), and
# cap · log2(e) at most CAP_FIXED_LIMIT, so that every p lies in [2^-125, 2^31] (Gemma 2's cap of 50: 72.1).
CAP_FIXED_LIMIT = 78.0


def cap_fixed(variant: Variant, dtype: torch.dtype) -> bool:
    """Whether a Gluon forward of `variant` on `dtype` inputs takes softcap's fixed max (CAP_FIXED)."""
    return bool(configs.forward.GLUON_CAP_FIXED and dtype == torch.bfloat16 and variant.softcap
                and not variant.has_alibi and variant.softcap * 1.4426950408889634 <= CAP_FIXED_LIMIT)


def qk_width(head_dim: int) -> int:
    """The columns the Gluon forward's Q Kᵀ runs on at `head_dim` (the kernel's QK_WIDTH,
    `gluon_common.product_width`) where its tiles are wider and `configs.forward.GLUON_QK_TRIM` takes their width;
    0: the tiles' whole width."""
    return trimmed_width(head_dim, configs.forward.GLUON_QK_TRIM)


def pv_split(head_dim_v: int) -> bool:
    """Whether the Gluon forward keeps its output in two accumulators over V's columns 0 … 127 and 128 … 191
    (PV_SPLIT: Dv of 129 … 192 in 256-column tiles, under `configs.forward.GLUON_PV_SPLIT`), so that P V skips
    the tiles' zero columns."""
    return bool(configs.forward.GLUON_PV_SPLIT and 128 < head_dim_v <= 192)


def launch_parts(q_shape, k_shape, causal: bool, causal_bottom_right: bool, config: dict, sms: int,
                 batch: int | None = None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                 variant: Variant | None = None, head_dim_v: int | None = None, fixed_cap: bool = False,
                 qk_columns: int = 0, split_pv: bool = False):
    """(grid, int arguments after the variant's, constexprs and options) of a launch. Dense (batch None):
    q (B, Sq, Hq, D), k (B, Sk, Hkv, D), contiguous out like q and lse (B, Hq, Sq). Varlen: q (total_q, Hq, D),
    k (total_k, Hkv, D), `batch` sequences of at most max_seqlen_q / max_seqlen_k tokens, contiguous out like q
    and lse (Hq, total_q). `variant` (default: causal or not) overrides causal and causal_bottom_right.
    `head_dim_v`: V's (and out's) head dim, default D. `fixed_cap`: CAP_FIXED (`cap_fixed` says where);
    `qk_columns`: Q Kᵀ's product width where narrower than the tiles (`qk_width`; 0: the whole tiles);
    `split_pv`: PV_SPLIT (`pv_split` says where)."""
    variant = Variant.of(causal, causal_bottom_right) if variant is None else variant
    config = kernel_config(config)
    varlen = batch is not None
    heads_q, head_dim, heads_kv = q_shape[-2], q_shape[-1], k_shape[-2]
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    block_d = head_block(head_dim)  # the tiles' head dim (the kernel's HEAD_DIM); strides keep the tensors' own
    block_dv = head_block(head_dim_v)  # V's and O's (HEAD_DIM_V)
    if varlen:
        seqlen_q, seqlen_k, lse_strides = max_seqlen_q, max_seqlen_k, (0, q_shape[0])
    else:
        batch, seqlen_q, seqlen_k = q_shape[0], q_shape[1], k_shape[1]
        lse_strides = (heads_q * seqlen_q, seqlen_q)
    smem = shared_memory_bytes(config, block_d, 2, varlen, block_dv)
    if smem > SHARED_MEMORY_LIMIT:
        raise ValueError(f"Gluon forward config {config} needs {smem} bytes of shared memory at head dims "
                         f"{head_dim} / {head_dim_v}; sm_90 has {SHARED_MEMORY_LIMIT}")
    if config["DYNAMIC"] and causal and config["CAUSAL_PAIRS"]:
        raise ValueError(f"Gluon forward config {config}: the dynamic schedule takes items one at a time")
    if split_pv and config["OVERLAP"]:
        raise ValueError(f"Gluon forward config {config}: OVERLAP does not take the output in two accumulators "
                         f"(PV_SPLIT, V head dim {head_dim_v})")
    if config.get("O_IN_Q") and (config["Q_BUFFERS"] != 1 or config["OVERLAP"] or block_dv != block_d):
        raise ValueError(f"Gluon forward config {config}: O_IN_Q takes one Q slot, no OVERLAP, and V in tiles as "
                         f"wide as Q's (head dims {head_dim} / {head_dim_v})")
    units = work_units(seqlen_q, heads_q, batch, config, causal)  # pairs of items, or items
    if units >= UNIT_LIMIT:
        raise ValueError(f"Gluon forward: {units} work units do not fit its 32-bit counters")
    grid = (min(units, sms), 1, 1)
    ints = (heads_q * head_dim_v, head_dim_v, *lse_strides, heads_q, batch, heads_q // heads_kv, seqlen_q, seqlen_k)
    meta = dict(**variant.forward_constexprs, IS_VARLEN=varlen, HEAD_DIM=block_d, HEAD_DIM_V=block_dv, PAGE_SIZE=0,
                num_warps=4, **config)
    if variant.dropout_p:  # (absent otherwise: the kernel's default, and the launch key of the dropout-free calls)
        meta.update(variant.dropout_constexprs)
    if fixed_cap:  # (likewise)
        meta["CAP_FIXED"] = True
    if qk_columns:  # (likewise)
        meta["QK_WIDTH"] = qk_columns
    if split_pv:  # (likewise)
        meta["PV_SPLIT"] = True
    return grid, ints, meta


def launch_args(q, k, v, out, lse, scalars: tuple, block_n: int, ints: tuple, cu_seqlens_q=None,
                cu_seqlens_k=None, counter=None, block_table=None, kv_rows: int = 0) -> tuple:
    """The kernel's runtime arguments: the four descriptors, out, lse, cu_seqlens (varlen; else lse stands in),
    the dynamic schedule's counter (a zeroed int32; else lse stands in), the variant's arguments
    (`Variant.forward_args`: the scale first, then `Variant.dropout_args`), `ints`, then the block table and its row stride (paged; else lse
    and 0). Paged: k and v are the page pools flattened to (pages · page_size, Hkv, D) (`flat_pages`); `kv_rows`
    (pages smaller than a tile): their descriptors' boxes hold a page's rows (default: a tile's, block_n)."""
    varlen = cu_seqlens_q is not None
    rows = ROWS.value
    block_d, block_dv = head_block(q.shape[-1]), head_block(v.shape[-1])
    kv_rows = kv_rows or block_n
    return (descriptor(q, rows, varlen, block_d), descriptor(k, kv_rows, varlen, block_d),
            descriptor(v, kv_rows, varlen, block_dv), descriptor(out, rows, varlen, block_dv), out, lse,
            cu_seqlens_q if varlen else lse,
            cu_seqlens_k if varlen else lse, lse if counter is None else counter, *scalars, *ints,
            lse if block_table is None else block_table, 0 if block_table is None else block_table.stride(0))


def pages_fit(page_size: int, block_n: int) -> bool:
    """Whether the Gluon forward reads pages of `page_size` keys in `block_n`-key tiles: pages of whole tiles, or
    tiles of whole pages that are whole 8-row swizzle atoms of the stage's layout (`load_item` gathers them)."""
    return page_size > 0 and (page_size % block_n == 0 or (block_n % page_size == 0 and page_size % 8 == 0))


def flat_pages(pool: torch.Tensor) -> torch.Tensor | None:
    """A page pool (num_pages, page_size, Hkv, D) as the (num_pages · page_size, Hkv, D) view the TMA reads
    rows of, or None where its pages are not evenly spaced rows (no such view)."""
    if pool.stride(0) != pool.shape[1] * pool.stride(1):
        return None
    return pool.view(pool.shape[0] * pool.shape[1], *pool.shape[2:])


def launch_forward_gluon(q, k, v, out, lse, softmax_scale, causal, causal_bottom_right, config, cu_seqlens_q=None,
                         cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, variant: Variant | None = None,
                         alibi_slopes=None, learnable_sink=None, block_table=None, page_size: int = 0,
                         rng_state=None) -> None:
    """Dense q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), out (B, Sq, Hq, Dv), lse (B, Hq, Sq); or
    varlen q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv), out (total_q, Hq, Dv), lse (Hq,
    total_q), cu_seqlens int32 (B + 1,). out and lse contiguous,
    fp16/bf16, D of `dispatch`'s gluon_fwd (tiles of `gluon_common.head_block(D)`), inputs that pass
    `common.tma_ok`, softmax_scale > 0, Sq > 0 (the caller checks).
    `variant` (default: causal or not) with its ALiBi slopes and sinks, as `forward.launch_forward` takes them;
    with dropout, `rng_state` the call's int64 (seed, offset) tensor on q's device.
    Paged (varlen): k, v the flattened page pools (`flat_pages`), block_table int32 (B, pages per sequence) whose
    used entries are pages, `page_size` a multiple of the config's BLOCK_N or a multiple of 8 dividing it (a tile
    gathers pages: `forward_gluon_producer.load_item`), cu_seqlens_k's differences each
    sequence's key count (`forward._paged_gluon_keys` makes them)."""
    batch = None if cu_seqlens_q is None else cu_seqlens_q.numel() - 1
    variant = Variant.of(causal, causal_bottom_right) if variant is None else variant
    grid, ints, meta = launch_parts(q.shape, k.shape, causal, causal_bottom_right, config, sm_count(q.device.index),
                                    batch, max_seqlen_q, max_seqlen_k, variant, v.shape[-1], cap_fixed(variant, q.dtype),
                                    qk_width(q.shape[-1]), pv_split(v.shape[-1]))
    counter = torch.zeros(1, dtype=torch.int32, device=q.device) if config["DYNAMIC"] else None  # one per launch
    # `launch` skips Triton's argument binding for a call shape seen before: ~0.2 ms of host time per varlen call
    # on the H200 machine's CPU, which a benchmark that idles the GPU between calls sees as GPU idle time.
    scalars = variant.forward_args(softmax_scale, alibi_slopes, learnable_sink) + variant.dropout_args(rng_state)
    if block_table is not None:
        if not pages_fit(page_size, config["BLOCK_N"]):
            raise ValueError(f"Gluon forward: pages of {page_size} keys are neither whole tiles of "
                             f"{config['BLOCK_N']} keys nor whole 8-row parts of one")
        meta = dict(meta, PAGE_SIZE=page_size)
    kv_rows = min(page_size, config["BLOCK_N"]) if block_table is not None else 0
    launch(_attn_fwd_gluon, grid, launch_args(q, k, v, out, lse, scalars, config["BLOCK_N"], ints, cu_seqlens_q,
                                              cu_seqlens_k, counter, block_table, kv_rows), meta)


def compile_for_sm90(head_dim: int, causal: bool, config: dict, dtype: torch.dtype = torch.bfloat16,
                     varlen: bool = False, variant: Variant | None = None, head_dim_v: int | None = None,
                     page_size: int = 0):
    """Compile the kernel for sm_90 without a GPU (Triton's frontend and Hopper passes, then its bundled ptxas):
    compiled.asm["ptx"] / ["cubin"], compiled.metadata.shared. For tests and for looking at what a change does
    to registers and spills (`ptxas -v` on the PTX) before spending device time. Not under the interpreter.
    `head_dim_v`: V's head dim (default: head_dim); `page_size` > 0: paged K/V (varlen)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    t = torch.empty(512, 4, head_dim, dtype=dtype) if varlen else torch.empty(2, 256, 4, head_dim, dtype=dtype)
    tv = torch.empty(*t.shape[:-1], head_dim_v, dtype=dtype)
    batch = 2 if varlen else None
    variant = Variant.of(causal, True) if variant is None else variant
    _, _, meta = launch_parts(t.shape, t.shape, causal, True, config, 1, batch, 256, 256, variant, head_dim_v,
                              cap_fixed(variant, dtype), qk_width(head_dim),
                              pv_split(head_dim_v))
    if page_size:
        meta["PAGE_SIZE"] = page_size
    slopes = torch.empty(4) if variant.has_alibi else None
    sinks = torch.empty(4) if variant.has_sinks else None
    rng = torch.empty(2, dtype=torch.int64) if variant.dropout_p else None
    for name, value in zip(("qk_scale", "window_left", "window_right", "softcap", "ALIBI", "stride_alibi_b", "SINKS",
                            "DROPOUT_RNG", "dropout_threshold", "dropout_scale"),
                           variant.forward_args(1.0, slopes, sinks) + variant.dropout_args(rng)):
        if value is None:
            meta[name] = None  # off: a constexpr
    for param in _attn_fwd_gluon.params:  # constexprs a launch leaves at their defaults (HAS_DROPOUT)
        if param.is_constexpr and param.has_default and param.name not in meta:
            meta[param.name] = param.default
    options = {"num_warps": meta.pop("num_warps")}
    rows = ROWS.value
    block_d, block_dv = head_block(head_dim), head_block(head_dim_v)
    kv_rows = min(page_size, config["BLOCK_N"]) if page_size else config["BLOCK_N"]  # (smaller pages: a page's rows)
    descriptors = {"desc_q": descriptor(t, rows, varlen, block_d), "desc_o": descriptor(tv, rows, varlen, block_dv),
                   "desc_k": descriptor(t, kv_rows, varlen, block_d),
                   "desc_v": descriptor(tv, kv_rows, varlen, block_dv)}
    pointers = {"O": "*bf16" if dtype == torch.bfloat16 else "*fp16", "LSE": "*fp32",
                "CU_SEQLENS_Q": "*i32" if varlen else "*fp32", "CU_SEQLENS_K": "*i32" if varlen else "*fp32",
                "COUNTER": "*i32" if config["DYNAMIC"] else "*fp32", "ALIBI": "*fp32", "SINKS": "*fp32",
                "BLOCK_TABLE": "*i32" if page_size else "*fp32", "DROPOUT_RNG": "*i64"}
    names = _attn_fwd_gluon.arg_names
    signature = {name: "constexpr" if name in meta else mangle_type(descriptors[name]) if name in descriptors
                 else pointers[name] if name in pointers
                 else "fp32" if name in ("qk_scale", "softcap", "dropout_scale") else "i32"
                 for name in names}
    source = GluonASTSource(_attn_fwd_gluon, signature, constexprs=meta,
                            attrs={(names.index(name),): [["tt.divisibility", 16]] for name in pointers
                                   if name not in meta})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
