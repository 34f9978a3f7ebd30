"""`flashtriton bench`: flashtriton against torch SDPA's backends, FlexAttention and flash-attn, side by side.

    flashtriton bench                                   # the standard sweep: fwd+bwd, fp16, D 64/128, causal 0/1
    flashtriton bench --modes fwd --dtypes bf16 --head-dims 128,256 --out benchmarks/DATE-h200 --append
    flashtriton bench --head-dims 128,192/128                # QK/V: v with a head dim of its own (DeepSeek's MLA)
    flashtriton bench --suite varlen | decode | all     # serving features (varlen packing, KV-cache decode)
    flashtriton bench --suite variants --out DIR        # window / softcap / ALiBi / sinks beside Flex, dense, cuDNN
    python -m flashtriton.tools.bench --quick           # a small subset

Each provider is checked on every shape before it is timed (output and, for bwd, gradients against float32
attention on batch 0 and the first heads); one that fails is reported as FAIL, never as a speed, and one that
raises is reported with its error. Timing is `triton.testing.do_bench` (median, p20/p80). `--out DIR`
writes long-format rows (bench.json, bench.csv) and plots; see benchmarks/README.md. Without a GPU the kernels
run through Triton's interpreter: the output, tables and plot titles say these are not GPU timings.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from .._env import INTERPRET
from . import bench_core as C
from . import bench_providers as P
from .bench_measure import emit, measure_rows, report_problems

SUITES = ("standard", "varlen", "decode", "variants", "all")
STANDARD_SEQLENS = [512, 1024, 2048, 4096, 8192, 16384]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `flashtriton bench` (also `python -m flashtriton.tools.bench`)."""
    a = parser.add_argument
    a("--suite", choices=SUITES, default="standard",
      help="standard sweep, varlen packing, KV-cache decode, variants (window, softcap, ALiBi, sinks), or all")
    a("--providers", default=None, help=f"comma list from {','.join(P.PROVIDERS)} (default: all but seed)")
    a("--modes", default=None,
      help="comma list of fwd,bwd,fwd_bwd (default fwd,bwd; variants fwd,bwd,fwd_bwd; decode is always fwd)")
    a("--dtypes", default=None, help="comma list of fp16,bf16,fp32 (default fp16; variants bf16)")
    a("--causal", default=None, help="comma list of 0,1 (default 0,1)")
    a("--head-dims", default=None,
      help="standard sweep head dims (default 64,128,256; quick 128; e.g. 64,80,96,128,192,256: H = hidden // D); "
           f"QK/V gives v a head dim of its own (e.g. 128,192/128: q, k 192, v 128), each 1..{C.MAX_HEAD_DIM}")
    a("--seqlens", default=None, help="standard sweep T values (default 512,...,16384; 1k style allowed)")
    a("--tokens", type=int, default=16384, help="standard sweep: B*T (default 16384)")
    a("--hidden", type=int, default=2048, help="standard sweep: H*D (default 2048)")
    a("--shape", action="append", default=None, metavar="B,H,T,D",
      help="explicit shape (repeatable; D may be QK/V, e.g. 4,16,4096,192/128); replaces the sweep")
    a("--quick", action="store_true", help="a small subset: T 1k,4k, D 128; shorter timing; smaller varlen/decode")
    a("--warmup", type=int, default=None,
      help="do_bench warmup in ms (default 100, quick 25): a GPU runs faster for a moment after a pause (up to 10 %% "
           "on an H200), which a short warmup hands to whichever provider is timed first after one")
    a("--rep", type=int, default=None, help="do_bench repetition time in ms (default 100, quick 30)")
    a("--check-heads", type=int, default=2, help="heads of batch 0 checked against float32 attention (default 2)")
    a("--math-max-gib", type=float, default=8.0, help="skip sdpa_math when its T x T scores exceed this (GiB)")
    a("--flex-seqlens", default="1024,4096,16384",
      help="T values at which flex runs (each shape costs a torch.compile); 'all' for every T")
    a("--varlen-n", type=int, default=None, help="varlen: number of sequences (default 64, quick 16)")
    a("--varlen-max", type=int, default=None, help="varlen: lengths uniform in 1..this (default 4096)")
    a("--varlen-heads", type=int, default=16, help="varlen: heads (default 16)")
    a("--varlen-head-dim", type=int, default=128, help="varlen: head dim (default 128)")
    a("--decode-batches", default=None, help="decode: batch sizes (default 1,8,16,64)")
    a("--decode-seqlens", default=None, help="decode: cache lengths (default 1k,4k,16k,32k,64k,128k)")
    a("--decode-heads", default="32,8", help="decode: query heads, kv heads (default 32,8)")
    a("--decode-head-dim", default="128",
      help="decode: head dim D, or QK/V (e.g. 192/128: a v_cache with a head dim of its own; default 128)")
    a("--max-cache-gib", type=float, default=40.0, help="decode: skip caches (K+V) larger than this (GiB)")
    a("--variants", default=None,
      help="variants suite: comma list of window1024,window4096,softcap50,alibi,sinks,window128,sinks+window128 "
           "(default all; a variant's cost reference comes with it)")
    a("--rounds", type=int, default=None,
      help="variants suite: interleaved timing rounds, each starting one provider later (default 2; interpreter 1)")
    a("--seed", type=int, default=0, help="random seed of inputs and varlen lengths")
    a("--out", default=None, metavar="DIR", help="write bench.json, bench.csv and PNG plots to DIR")
    a("--append", action="store_true", help="with --out: merge into DIR's existing bench.json (same key: replaced)")
    a("--no-plots", action="store_true", help="with --out: skip the PNG plots")


def resolve(args: argparse.Namespace, interpreter: bool = False) -> argparse.Namespace:
    """Fill the defaults that depend on --quick; parse the comma lists. Under Triton's interpreter (no GPU)
    the default sizes shrink to ones it can run in seconds: it needs minutes for one full-size shape."""
    quick = args.quick
    args.modes_list = [m.strip() for m in (args.modes or "fwd,bwd").split(",") if m.strip()]
    for m in args.modes_list:
        if m not in C.MODES:
            raise ValueError(f"unknown mode {m!r}; choose from {', '.join(C.MODES)}")
    args.dtype_list = []
    for d in (args.dtypes or "fp16").split(","):
        if d.strip() not in C.DTYPES:
            raise ValueError(f"unknown dtype {d!r}; choose from {', '.join(C.DTYPES)}")
        args.dtype_list.append(d.strip())
    P.parse_providers(args.providers)  # unknown names fail here, before anything runs
    causal = C.parse_int_list(args.causal or "0,1", "--causal")
    if any(c not in (0, 1) for c in causal):
        raise ValueError(f"--causal wants a comma list of 0 and 1, got {args.causal!r}")
    args.causal_list = [bool(c) for c in causal]
    if args.append and not args.out:
        raise ValueError("--append merges into --out DIR's bench.json: give --out")
    head_dims = (C.parse_head_dims(args.head_dims) if args.head_dims
                 else ([128] if quick else [64, 128, 256]))  # the FlashAttention papers' sweep
    seqlens = (C.parse_int_list(args.seqlens, "--seqlens") if args.seqlens
               else ([1024, 4096] if quick else STANDARD_SEQLENS))
    if args.shape:
        args.shapes = [C.parse_shape(s) for s in args.shape]
    elif interpreter and not args.seqlens:
        print("flashtriton bench: no GPU (Triton's interpreter): the sweep's shapes would take hours; running "
              "B,H,T,D = 1,2,128,64 instead (choose with --shape)", file=sys.stderr)
        args.shapes = [C.Shape(1, 2, 128, 64)]
    else:
        args.shapes = C.standard_shapes(seqlens, head_dims, args.tokens, args.hidden)
    args.flex_seqlens = None if str(args.flex_seqlens).strip() == "all" else set(C.parse_int_list(args.flex_seqlens))
    args.warmup = args.warmup if args.warmup is not None else (25 if quick else 100)
    args.rep = args.rep if args.rep is not None else (30 if quick else 100)
    args.varlen_n = args.varlen_n if args.varlen_n is not None else (4 if interpreter else 16 if quick else 64)
    args.varlen_max = args.varlen_max if args.varlen_max is not None else (128 if interpreter else 4096)
    small = interpreter and not args.decode_batches and not args.decode_seqlens
    args.decode_batch_list = C.parse_int_list(args.decode_batches or ("1,2" if small else "1,16" if quick else "1,8,16,64"),
                                              "--decode-batches")
    args.decode_seqlen_list = C.parse_int_list(
        args.decode_seqlens or ("256" if small else "4k,32k" if quick else "1k,4k,16k,32k,64k,128k"), "--decode-seqlens")
    args.decode_hq, args.decode_hkv = C.parse_int_list(args.decode_heads)
    args.decode_d, args.decode_dv = C.parse_head_dim(args.decode_head_dim, "--decode-head-dim")
    from . import bench_variants as V

    V.resolve(args, interpreter)
    return args


# ----------------------------------------------------------------------------------------------------------
# the standard sweep
# ----------------------------------------------------------------------------------------------------------
def standard_problems(args) -> list[tuple]:
    return [(dt, shape, causal) for dt in args.dtype_list for shape in args.shapes for causal in args.causal_list]


def run_standard(args, env, providers, bar=None, sink=None) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for dt, shape, causal in standard_problems(args):
        dtype = C.DTYPES[dt]
        gen = torch.Generator(device=device).manual_seed(args.seed)
        # (B, T, H, D) for q and k, (B, T, H, Dv) for v and dout (drawn in this order: Dv = D draws as before)
        q, k, v, dout = (torch.randn(shape.B, shape.T, shape.H, d, device=device, dtype=dtype, generator=gen)
                         for d in (shape.D, shape.D, shape.Dv, shape.Dv))
        base = dict(op="attention", suite="standard", B=shape.B, H=shape.H, H_kv=shape.H, T=shape.T, T_k=shape.T,
                    D=shape.D, Dv=shape.Dv, causal=int(causal), dtype=dt)
        try:
            ref = C.reference_slices(q, k, v, dout, causal, args.check_heads, any(m != "fwd" for m in args.modes_list))
        except Exception as exc:  # noqa: BLE001  (timed without a check; the rows say so)
            ref, base["extra"] = None, {"reference_error": C.short_error(exc)}
            C.free_memory()
        for name in providers:
            if bar is not None:
                bar.set_postfix_str(f"{dt} D={shape.head_dims} T={shape.T} c={int(causal)} {name}", refresh=False)

            def prepare_fn(grad, name=name):
                return P.prepare(name, q, k, v, causal, grad)

            def make_dout(prepared):
                return lambda out: torch.empty_like(out).copy_(prepared.from_bshd(dout))

            def to_ref(prepared, got):
                return C.slice_like({n: prepared.to_bshd(t) for n, t in got.items()}, ref)

            new = measure_rows(
                name, args.modes_list,
                lambda mode, name=name: P.skip_reason(name, device, shape.B, shape.H, shape.T, shape.D, mode, args,
                                                      Dv=shape.Dv, dtype=dtype, causal=causal),
                prepare_fn, ref, to_ref, make_dout, dtype,
                lambda mode: C.mode_flops(shape, causal, mode), env, base, args,
            )
            report_problems(new, bar)
            rows += emit(sink, new)
            if bar is not None:
                bar.update(1)
        del q, k, v, dout, ref
        C.free_memory()
    return rows


# ----------------------------------------------------------------------------------------------------------
# entry points
# ----------------------------------------------------------------------------------------------------------
def main(args: argparse.Namespace) -> int:
    """Run the chosen suites, print the tables, write the files. 0 unless nothing could be measured or
    some provider failed its accuracy check (then 1)."""
    from tqdm import tqdm

    from . import bench_report as R
    from . import bench_suites as S
    from . import bench_variants as V

    try:
        args = resolve(args, interpreter=INTERPRET)
    except ValueError as exc:
        print(f"flashtriton bench: {exc}", file=sys.stderr)
        return 2
    env = C.environment()
    print(f"# flashtriton bench: {env['gpu']}, torch {env['torch']}, triton {env['triton']}, "
          f"flashtriton {env['flashtriton']} ({env['git_sha']}), {env['date']}", flush=True)
    if not torch.cuda.is_available():
        print(f"# WARNING: {R.CPU_NOTE}: no CUDA GPU, so flashtriton's timings below are of its kernels run by "
              "Triton's interpreter on the host and torch's are on the CPU; they check that the bench runs and "
              "say nothing about speed on a GPU", flush=True)
    suites = ("standard", "varlen", "decode", "variants") if args.suite == "all" else (args.suite,)
    results = R.Results(args.out, args.append)
    try:
        if torch.cuda.is_available():
            results.add(S.run_ceilings(args, env))
            print(R.ceilings_text(results.rows), flush=True)
        if "standard" in suites:
            providers = P.parse_providers(args.providers)
            total = len(standard_problems(args)) * len(providers)
            with tqdm(total=total, desc="standard", mininterval=1 if sys.stderr.isatty() else 30) as bar:
                run_standard(args, env, providers, bar, results)
            print("\n" + R.standard_table(results.rows), flush=True)
        if "varlen" in suites:
            S.run_varlen(args, env, results)
            print("\n" + R.varlen_table(results.rows), flush=True)
        if "decode" in suites:
            S.run_decode(args, env, S.ceiling_gbps(results.rows), results)
            print("\n" + R.decode_table(results.rows), flush=True)
        if "variants" in suites:
            if V.interpreter_note():
                print(V.interpreter_note(), file=sys.stderr)
            V.run_variants(args, env, results)
            print("\n" + R.variants_table(results.rows), flush=True)
            print("\n" + R.bars_table(results.rows), flush=True)  # last: the bars on this run
    finally:
        if args.out and results.rows:
            paths, all_rows = results.write()
            paths += R.write_variants_summary(results.rows, args.out)
            if not args.no_plots:
                paths += R.write_plots(all_rows, args.out)
            print("\nwrote " + ", ".join(paths), flush=True)
    rows = results.rows
    measured = [r for r in rows if r["status"] == "ok" and r["op"] not in ("copy", "read", "matmul")]
    failed = [r for r in rows if r["status"] == "check_failed"]
    if failed:
        print(f"\n{len(failed)} measurement(s) failed the accuracy check (FAIL above)", file=sys.stderr)
    return 1 if failed or not measured else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flashtriton.tools.bench", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser


if __name__ == "__main__":
    from .._env import INTERPRET, enable_interpreter_if_no_cuda

    # The package (and its @triton.jit kernels) was imported before this line ran; when the interpreter has
    # to be switched on, start again with TRITON_INTERPRET set so that the kernels are defined under it.
    if enable_interpreter_if_no_cuda() and not INTERPRET:
        os.execv(sys.executable, [sys.executable, "-m", "flashtriton.tools.bench", *sys.argv[1:]])
    sys.exit(main(_parser().parse_args()))
