"""The serving suites of `flashtriton bench` and the device's ceilings.

- `varlen`: N sequences of random lengths packed back to back (`flash_attn_varlen_func`) against padding
  them all to the longest and running dense attention (flashtriton, torch SDPA cudnn / flash). TFLOP/s count
  only the useful work (sum over sequences), so every provider's number is comparable and the speedup is the
  ratio of times. The padded baselines run without a key-padding mask: a lower bound on their time; with
  causal=1 their outputs on real tokens are exactly the varlen ones (and are checked), with causal=0 not.
- `decode`: one query token against a KV cache (`flash_attn_with_kvcache`, GQA 32/8, D=128) against torch
  SDPA with enable_gqa on the same cache in (B, Hkv, S, D); GB/s = bytes of K and V read / time, next to the
  device's copy and read bandwidths measured in the same run.
- ceilings: device-to-device copy bandwidth (read + write), read bandwidth (the faster of torch's sum and a
  Triton kernel that streams the buffer; decoding only reads) and an 8192³ matmul per dtype.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from tqdm import tqdm

from . import bench_core as C
from . import bench_providers as P
from .bench_measure import emit, measure_rows, report_problems

VARLEN_PROVIDERS = {  # varlen provider -> the --providers name that selects it
    "flashtriton": "flashtriton", "flashtriton_padded": "flashtriton",
    "sdpa_cudnn_padded": "sdpa_cudnn", "sdpa_flash_padded": "sdpa_flash", "flash_attn": "flash_attn",
}
DECODE_PROVIDERS = ("flashtriton", "flash_attn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math")


def ceiling_gbps(rows) -> dict:
    """{"copy": the copy rate, "read": the faster reader} of `run_ceilings` rows (None where missing)."""
    copy = [r["gbps"] for r in rows if r["op"] == "copy" and r["status"] == "ok"]
    read = [r["gbps"] for r in rows if r["op"] == "read" and r["status"] == "ok"]
    return {"copy": copy[0] if copy else None, "read": max(read) if read else None}


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


# ----------------------------------------------------------------------------------------------------------
# ceilings
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _stream_read(X, OUT, n, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """Sum X[0:n) (fp16) into OUT[program]: each program reads UNROLL blocks of BLOCK per step, the programs
    interleaved over the buffer; the sum keeps the loads from being removed."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * BLOCK * UNROLL, n, tl.num_programs(0) * BLOCK * UNROLL):
        for u in tl.static_range(UNROLL):
            offs = start + u * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(X + offs, mask=offs < n, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(OUT + pid, tl.sum(acc, 0))


def run_ceilings(args, env, copy_elems: int = 1 << 30, matmul_n: int = 8192) -> list[dict]:
    """Device-to-device copy of `copy_elems` fp16 values (2 GiB; GB/s counts read + write), reading them (torch's
    sum and `_stream_read`; GB/s counts the bytes read) and an n x n x n matmul per dtype (TFLOP/s = 2n³ / time),
    measured like everything else."""
    device, rows = _device(), []
    try:
        src = torch.randn(copy_elems, device=device, dtype=torch.float16)
        dst = torch.empty_like(src)
        ms = C.time_fn(lambda: dst.copy_(src), args.warmup, args.rep)
        moved = 2 * src.numel() * src.element_size()
        rows.append(C.make_row(env, op="copy", suite="ceiling", mode="d2d", provider="torch", dtype="fp16",
                               ms_p20=ms[0], ms_p50=ms[1], ms_p80=ms[2], gbps=moved / ms[1] / 1e6, status="ok",
                               extra={"bytes_read_plus_written": moved}))
        del dst
    except Exception as exc:  # noqa: BLE001
        rows.append(C.make_row(env, op="copy", suite="ceiling", mode="d2d", provider="torch", dtype="fp16",
                               status="error", error=C.short_error(exc)))
        src = None
    if src is not None:
        read = src.numel() * src.element_size()
        sums = torch.empty(_num_sms(device) * 4, device=device, dtype=torch.float32)
        readers = {"torch": lambda: src.sum(dtype=torch.float32),
                   "triton": lambda: _stream_read[(sums.numel(),)](src, sums, src.numel(), BLOCK=4096, UNROLL=4,
                                                                  num_warps=8)}
        for name, fn in readers.items():
            try:
                ms = C.time_fn(fn, args.warmup, args.rep)
                rows.append(C.make_row(env, op="read", suite="ceiling", mode="read", provider=name, dtype="fp16",
                                       ms_p20=ms[0], ms_p50=ms[1], ms_p80=ms[2], gbps=read / ms[1] / 1e6,
                                       status="ok", extra={"bytes_read": read}))
            except Exception as exc:  # noqa: BLE001  (a read failing is reported as that read, not as the copy)
                rows.append(C.make_row(env, op="read", suite="ceiling", mode="read", provider=name, dtype="fp16",
                                       status="error", error=C.short_error(exc)))
        del src, sums
    C.free_memory()
    for dt in ("fp16", "bf16"):
        try:
            a, b = (torch.randn(matmul_n, matmul_n, device=device, dtype=C.DTYPES[dt]) for _ in range(2))
            ms = C.time_fn(lambda: a @ b, args.warmup, args.rep)
            rows.append(C.make_row(env, op="matmul", suite="ceiling", mode="fwd", provider="torch", dtype=dt,
                                   ms_p20=ms[0], ms_p50=ms[1], ms_p80=ms[2],
                                   tflops=C.tflops(2 * matmul_n ** 3, ms[1]), status="ok",
                                   extra={"M": matmul_n, "N": matmul_n, "K": matmul_n}))
            del a, b
        except Exception as exc:  # noqa: BLE001
            rows.append(C.make_row(env, op="matmul", suite="ceiling", mode="fwd", provider="torch", dtype=dt,
                                   status="error", error=C.short_error(exc)))
        C.free_memory()
    return rows


# ----------------------------------------------------------------------------------------------------------
# varlen
# ----------------------------------------------------------------------------------------------------------
def varlen_seqlens(n: int, max_len: int, seed: int) -> list[int]:
    """n lengths uniform in 1..max_len, reproducible from the seed (CPU generator, any device)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, max_len + 1, (n,), generator=gen).tolist()


def packed_reference(q, k, v, dout, cu: list[int], causal: bool, heads: int, with_grad: bool) -> dict:
    """float32 attention per sequence on the first `heads` heads, packed: {"out", "dq", "dk", "dv"} (total, h, D)."""
    parts = []
    for start, end in zip(cu[:-1], cu[1:]):
        one = [t[start:end].unsqueeze(0) for t in (q, k, v)]  # (1, Ti, H, D)
        d = dout[start:end].unsqueeze(0) if dout is not None else None
        parts.append(C.reference_slices(*one, d, causal, heads, with_grad))
    return {name: torch.cat([p[name][0] for p in parts], dim=0) for name in parts[0]}


def run_varlen(args, env, sink=None) -> list[dict]:
    import flashtriton

    device = _device()
    chosen = P.parse_providers(args.providers)
    providers = [name for name, base in VARLEN_PROVIDERS.items() if base in chosen]
    lens = varlen_seqlens(args.varlen_n, args.varlen_max, args.seed)
    stats = C.padding_stats(lens)
    N, Tmax, H, D = len(lens), max(lens), args.varlen_heads, args.varlen_head_dim
    total = sum(lens)
    cu_list = [0]
    for t in lens:
        cu_list.append(cu_list[-1] + t)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=device)
    index = torch.cat([i * Tmax + torch.arange(t, device=device) for i, t in enumerate(lens)])  # real tokens
    print(f"\nvarlen: {N} sequences, lengths 1..{args.varlen_max} (seed {args.seed}), max {Tmax}, H={H} D={D}: "
          f"padding {stats['token_padding_frac']:.1%} of tokens, {stats['flop_padding_frac']:.1%} of attention "
          f"FLOPs (ideal speedup {stats['ideal_speedup']:.2f}x)", flush=True)
    rows = []
    bar = tqdm(total=len(args.dtype_list) * len(args.causal_list) * len(providers), desc="varlen",
               mininterval=1 if sys.stderr.isatty() else 30)
    for dt in args.dtype_list:
        dtype = C.DTYPES[dt]
        for causal in args.causal_list:
            gen = torch.Generator(device=device).manual_seed(args.seed)
            packed = [torch.randn(total, H, D, device=device, dtype=dtype, generator=gen) for _ in range(4)]
            # Padded copies: real tokens identical, padding random in q, k, v; dout is 0 on padding (a loss on
            # real tokens only), so that with causal=1 the real tokens' gradients are exactly varlen's.
            padded = [torch.randn(N, Tmax, H, D, device=device, dtype=dtype, generator=gen) for _ in range(3)]
            padded.append(torch.zeros(N, Tmax, H, D, device=device, dtype=dtype))
            for src, dst in zip(packed, padded):
                dst.view(N * Tmax, H, D)[index] = src
            q, k, v, dout = packed
            need_grad = any(m != "fwd" for m in args.modes_list)
            try:
                ref = packed_reference(q, k, v, dout, cu_list, causal, args.check_heads, need_grad)
            except Exception as exc:  # noqa: BLE001
                ref = None
                print(f"  varlen reference failed: {C.short_error(exc)}", file=sys.stderr)
            problem = []
            base = dict(op="attention_varlen", suite="varlen", B=N, H=H, H_kv=H, T=Tmax, T_k=Tmax, D=D,
                        causal=int(causal), dtype=dt)
            share = dict(stats)
            for name in providers:
                padded_run = name.endswith("_padded")

                def skip_for(mode, name=name):
                    base_name = VARLEN_PROVIDERS[name]
                    return P.skip_reason(base_name, device, N, H, Tmax, D, mode, args)

                def prepare_fn(grad, name=name):
                    if name == "flashtriton":
                        ql, kl, vl = leaves = [t.detach().requires_grad_(grad) for t in (q, k, v)]
                        fn = flashtriton.flash_attn_varlen_func
                        return P.Prepared(lambda: fn(ql, kl, vl, cu, cu, Tmax, Tmax, causal=causal), leaves,
                                          lambda t: t, lambda t: t)
                    if name == "flash_attn":
                        from flash_attn import flash_attn_varlen_func as fa_varlen

                        ql, kl, vl = leaves = [t.detach().requires_grad_(grad) for t in (q, k, v)]
                        return P.Prepared(lambda: fa_varlen(ql, kl, vl, cu, cu, Tmax, Tmax, causal=causal), leaves,
                                          lambda t: t, lambda t: t)
                    return P.prepare(VARLEN_PROVIDERS[name], *padded[:3], causal, grad)

                def to_ref(prepared, got, padded_run=padded_run):
                    out = {}
                    for n, t in got.items():
                        t = prepared.to_bshd(t)
                        if padded_run:  # (N, Tmax, H, D) -> the real tokens, packed
                            t = t.reshape(N * Tmax, *t.shape[2:])[index]
                        out[n] = t[:, :ref[n].shape[1]]
                    return out

                def make_dout(prepared, padded_run=padded_run):
                    source = padded[3] if padded_run else dout
                    return lambda out: torch.empty_like(out).copy_(prepared.from_bshd(source))

                # Padded without a mask and not causal attends to padding keys: a different function, unchecked.
                checked = ref if (causal or not padded_run) else None
                extra = dict(share, seqlens=lens) if name == "flashtriton" else dict(share)
                if checked is None:
                    extra["note"] = "no check: padding keys are attended (no mask)"
                new = measure_rows(name, args.modes_list, skip_for, prepare_fn, checked, to_ref, make_dout, dtype,
                                   lambda mode: C.varlen_flops(lens, H, D, causal, mode), env,
                                   dict(base, extra=extra), args)
                report_problems(new, bar)
                problem += new
                bar.update(1)
            _varlen_speedups(problem)
            rows += emit(sink, problem)
            del packed, padded, q, k, v, dout, ref
            C.free_memory()
    bar.close()
    return rows


def _varlen_speedups(rows) -> None:
    """Add speedup_vs_flashtriton_padded / speedup_vs_best_padded to the varlen flashtriton rows."""
    for mode in {r["mode"] for r in rows}:
        ms = {r["provider"]: r["ms_p50"] for r in rows if r["mode"] == mode and r["status"] == "ok" and r["ms_p50"]}
        ours = ms.get("flashtriton")
        if not ours:
            continue
        padded = {n: t for n, t in ms.items() if n.endswith("_padded")}
        for r in rows:
            if r["mode"] == mode and r["provider"] == "flashtriton":
                if "flashtriton_padded" in padded:
                    r["extra"]["speedup_vs_flashtriton_padded"] = padded["flashtriton_padded"] / ours
                if padded:
                    r["extra"]["speedup_vs_best_padded"] = min(padded.values()) / ours


# ----------------------------------------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------------------------------------
def _kvcache_function():
    try:
        from flashtriton import flash_attn_with_kvcache
    except ImportError:
        try:
            from flashtriton.kvcache import flash_attn_with_kvcache
        except ImportError:
            return None
    return flash_attn_with_kvcache


def run_decode(args, env, ceilings: dict | None = None, sink=None) -> list[dict]:
    """The decode suite; `ceilings` {"copy": GB/s, "read": GB/s} of the same run (`ceiling_gbps`) put each row's
    bandwidth beside the device's (extra pct_of_copy, pct_of_read)."""
    device = _device()
    kvcache = _kvcache_function()
    chosen = P.parse_providers(args.providers)
    providers = [p for p in DECODE_PROVIDERS if p in chosen]
    Hq, Hkv, D, Dv = args.decode_hq, args.decode_hkv, args.decode_d, args.decode_dv
    rows = []
    if kvcache is None:
        print("\ndecode: flashtriton.flash_attn_with_kvcache is missing: the flashtriton provider is skipped",
              file=sys.stderr)
    combos = [(dt, B, S) for dt in args.dtype_list for B in args.decode_batch_list for S in args.decode_seqlen_list]
    bar = tqdm(combos, desc="decode", mininterval=1 if sys.stderr.isatty() else 30)
    for dt, B, S in bar:
        bar.set_postfix_str(f"{dt} B={B} cache={S}", refresh=False)
        dtype = C.DTYPES[dt]
        kv_bytes = B * S * Hkv * (D + Dv) * dtype.itemsize
        base = dict(op="decode", suite="decode", B=B, H=Hq, H_kv=Hkv, T=1, T_k=S, D=D, Dv=Dv, causal=0, dtype=dt)
        if kv_bytes > args.max_cache_gib * P.GIB:
            new = [C.make_row(env, **base, mode="fwd", provider=p, status="skipped",
                              error=f"cache {kv_bytes / P.GIB:.0f} GiB > --max-cache-gib") for p in providers]
        else:
            try:
                new = _decode_one(args, env, kvcache, providers, base, dtype, kv_bytes, ceilings or {}, device, bar)
            except Exception as exc:  # noqa: BLE001  (inputs or reference out of memory: every provider says so)
                new = [C.make_row(env, **base, mode="fwd", provider=p, status="error", error=C.short_error(exc))
                       for p in providers]
        rows += emit(sink, new)
        C.free_memory()
    return rows


def _decode_one(args, env, kvcache, providers, base, dtype, kv_bytes, ceilings, device, bar=None) -> list[dict]:
    B, Hq, Hkv, S, D, Dv = base["B"], base["H"], base["H_kv"], base["T_k"], base["D"], base["Dv"]
    gen = torch.Generator(device=device).manual_seed(args.seed)
    q = torch.randn(B, 1, Hq, D, device=device, dtype=dtype, generator=gen)  # (B, 1, Hq, D)
    k_cache = torch.randn(B, S, Hkv, D, device=device, dtype=dtype, generator=gen)
    v_cache = torch.randn(B, S, Hkv, Dv, device=device, dtype=dtype, generator=gen)  # v's head dim may be its own
    cache_seqlens = torch.full((B,), S, dtype=torch.int32, device=device)
    ref = C.reference_slices(q, k_cache, v_cache, None, False, Hq // Hkv, False)  # batch 0, kv head 0's group
    bhsd = {}  # torch's (B, Hkv, S, D) copy of the cache, made once for all SDPA backends

    def skip_for(mode, name):
        if name == "flashtriton" and kvcache is None:
            return "flashtriton.flash_attn_with_kvcache not available"
        if name == "sdpa_math":
            expanded = B * Hq * S * (D + Dv) * dtype.itemsize  # math repeats K and V over each GQA group
            if expanded > args.math_max_gib * P.GIB:
                return f"GQA-expanded K, V need {expanded / P.GIB:.0f} GiB > --math-max-gib"
            return None
        return P.skip_reason(name, device, B, Hq, 1, D, mode, args)

    def prepare_fn(grad, name):
        if name in ("flashtriton", "flash_attn"):
            if name == "flash_attn":
                from flash_attn import flash_attn_with_kvcache as fn
            else:
                fn = kvcache
            return P.Prepared(lambda: fn(q, k_cache, v_cache, cache_seqlens=cache_seqlens, causal=False), [],
                              lambda t: t, lambda t: t)
        from torch.nn.attention import sdpa_kernel

        if not bhsd:
            bhsd.update(q=q.transpose(1, 2).contiguous(), k=k_cache.transpose(1, 2).contiguous(),
                        v=v_cache.transpose(1, 2).contiguous())
        backend = P._sdpa_backend(name)

        def sdpa():
            return F.scaled_dot_product_attention(bhsd["q"], bhsd["k"], bhsd["v"], enable_gqa=True)

        return P.Prepared(sdpa, [], lambda t: t.transpose(1, 2), lambda t: t.transpose(1, 2),
                          context=lambda: sdpa_kernel([backend]))

    def to_ref(prepared, got):
        return C.slice_like({n: prepared.to_bshd(t) for n, t in got.items()}, ref)

    flops = C.mode_flops(C.Shape(B, Hq, 1, D, Dv), False, "fwd") * S  # (one query row against S keys)
    rows = []
    for name in providers:
        new = measure_rows(name, ["fwd"], lambda mode, name=name: skip_for(mode, name),
                           lambda grad, name=name: prepare_fn(grad, name), ref, to_ref, lambda prepared: None, dtype,
                           lambda mode: flops, env, dict(base, extra={"kv_bytes": kv_bytes}), args)
        for r in new:
            if r["ms_p50"]:
                r["gbps"] = kv_bytes / r["ms_p50"] / 1e6
                for name, gbps in ceilings.items():
                    if gbps:
                        r["extra"][f"pct_of_{name}"] = 100.0 * r["gbps"] / gbps
        report_problems(new, bar)
        rows += new
    del q, k_cache, v_cache, bhsd
    return rows
