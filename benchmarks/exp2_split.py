"""The Gluon forward's EXP2_SPLIT (half of the softmax's exponentials by a polynomial on the FMA pipes instead of
the special-function unit, `kernels.variant.exp2_split`) against the same kernel without it, beside torch SDPA's
cuDNN backend, on an H200.

Points: B·T = 16384 tokens, H = 16, T = 4096 (`--seqlen`): bf16 at D = 64 and 128, causal and not; bf16 D = 128
causal with softcap 50 (cuDNN has no softcap: its column is the same shape without); fp16 D = 128 causal. Both
modes go through `flashtriton.flash_attn_func`, with the Gluon config the dispatch picks and EXP2_SPLIT forced off
or on (`forced_exp2_split`: a wrapped `configs.gluon_fwd_config`, the dense plans rebuilt). Each mode's output is
first checked against float64 on the first batch and two heads of the timed call: error within 2x the
reference's own in the inputs' dtype plus half an ulp at 1 (tests/accuracy.py's rule). Timing: do_bench medians
(L2 flushed) after 100 ms of warmup, in `--rounds` rounds whose order rotates, the median of the rounds; TFLOP/s
by FlashAttention's count (4·B·H·T²·D, halved causal). The table gives on/off and each against cuDNN; `--out DIR`
writes DIR/exp2_split.json.

    PYTHONPATH=src python benchmarks/exp2_split.py --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics

import torch

import flashtriton
from flashtriton import configs
from flashtriton.kernels import forward as F
from flashtriton.kernels.variant import Variant
from flashtriton.reference import attention_flops, attention_reference
from flashtriton.tools import bench_core as C

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FLOOR = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}  # half an ulp at 1.0 (tests/accuracy.py)
POINTS = [  # (dtype, D, causal, softcap)
    ("bf16", 64, False, 0.0), ("bf16", 64, True, 0.0), ("bf16", 128, False, 0.0), ("bf16", 128, True, 0.0),
    ("bf16", 128, True, 50.0), ("fp16", 128, True, 0.0),
]


@contextlib.contextmanager
def forced_exp2_split(on: bool):
    """Dense calls take the Gluon config of the dispatch with EXP2_SPLIT = on; yields the list of configs asked for
    (empty: no Gluon plan was made, the switch did not reach a kernel)."""
    original = configs.gluon_fwd_config
    asked = []

    def forced(*args, **kwargs):
        config = original(*args, **kwargs)
        asked.append(config)
        return None if config is None else dict(config, EXP2_SPLIT=on)

    configs.gluon_fwd_config = forced
    F._dense_tma_plan.cache_clear()  # plans are kept per call shape: rebuild them with the forced config
    try:
        yield asked
    finally:
        configs.gluon_fwd_config = original
        F._dense_tma_plan.cache_clear()


def cudnn_mode():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION])


def check(out, q, k, v, causal, softcap, dtype) -> dict:
    """Error of `out` against float64 on batch 0, heads 0-1, and the bound it must stay within."""
    sl = (slice(0, 1), slice(None), slice(0, 2))
    variant = Variant(causal=causal, softcap=softcap)
    exact = attention_reference(q[sl], k[sl], v[sl], variant=variant)
    own = attention_reference(q[sl], k[sl], v[sl], variant=variant, dtype=dtype)
    err = (out[sl].double() - exact).abs().max().item()
    ref_err = (own.double() - exact).abs().max().item()
    bound = 2 * ref_err + FLOOR[dtype] * max(1.0, exact.abs().max().item())
    return dict(err=err, ref_err=ref_err, bound=bound, ok=bool(err <= bound and torch.isfinite(out).all()))


def run_point(dtype_name, D, causal, softcap, T, rounds, rep) -> dict:
    dtype = DTYPES[dtype_name]
    B, H = 16384 // T, 16
    gen = torch.Generator(device="cuda").manual_seed(T + D + int(causal))
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # (B, H, T, D) for SDPA

    def ours():
        with torch.no_grad():
            return flashtriton.flash_attn_func(q, k, v, causal=causal, softcap=softcap)

    def cudnn():
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    modes = {"off": lambda: forced_exp2_split(False), "on": lambda: forced_exp2_split(True), "cudnn": cudnn_mode}
    calls = {"off": ours, "on": ours, "cudnn": cudnn}
    row = dict(dtype=dtype_name, B=B, H=H, T=T, D=D, causal=causal, softcap=softcap, checks={}, ms={})
    outs = {}
    for name in ("off", "on"):
        with modes[name]() as asked:
            outs[name] = ours()
        if not asked or asked[0] is None:
            raise RuntimeError(f"{dtype_name} D={D} causal={causal}: no Gluon config, EXP2_SPLIT reaches no kernel")
        row["config"] = asked[0]
        row["checks"][name] = check(outs[name], q, k, v, causal, softcap, dtype)
    row["max_on_minus_off"] = (outs["on"].float() - outs["off"].float()).abs().max().item()  # > 0: the switch works
    del outs
    names = list(calls)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            try:
                with modes[name]():
                    C.time_fn(calls[name], warmup=100, rep=1)  # steady clocks first
                    times[name].append(C.time_fn(calls[name], warmup=5, rep=rep)[1])
            except Exception as exc:  # noqa: BLE001 - cuDNN refusing a shape is a row, not the end of the run
                row.setdefault("errors", {})[name] = C.short_error(exc)
                times[name] = []
                names.remove(name)
    flops = attention_flops(B, H, T, D, causal)
    for name, ms in times.items():
        row["ms"][name] = statistics.median(ms) if ms else None
    row["tflops"] = {name: C.tflops(flops, ms) for name, ms in row["ms"].items()}
    return row


def ratio(a, b):
    return f"{a / b:6.3f}" if a and b else "     -"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rep", type=int, default=100, help="ms of timed runs per do_bench")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("needs a Hopper GPU (the Gluon forward compiles for sm_90 only)")
    env = C.environment()
    print(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, cuDNN {env['cudnn']}, "
          f"flashtriton {env['flashtriton']} ({env['git_sha']})", flush=True)
    rows, failed = [], False
    for point in POINTS:
        row = run_point(*point, args.seqlen, args.rounds, args.rep)
        rows.append(row)
        c = row["checks"]
        failed |= not (c["off"]["ok"] and c["on"]["ok"])
        print(f"{row['dtype']} D={row['D']:3} causal={row['causal']!s:5} softcap={row['softcap']:4.0f}: "
              f"err off {c['off']['err']:.2e} on {c['on']['err']:.2e} (bound {c['on']['bound']:.2e}, "
              f"reference in {row['dtype']} {c['on']['ref_err']:.2e}), |on - off| {row['max_on_minus_off']:.2e}, "
              "ms " + ", ".join(f"{n} {ms:.4f}" for n, ms in row["ms"].items() if ms), flush=True)
        torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "exp2_split.json"), "w") as f:
            json.dump(dict(env=env, args=vars(args), rows=rows), f, indent=1)
    print(f"\nforward TFLOP/s, B·T = 16384, H = 16, T = {args.seqlen} (cuDNN: no softcap)")
    print("dtype  D    causal softcap    off     on  cudnn  on/off off/cudnn on/cudnn  ok")
    for row in rows:
        t, c = row["tflops"], row["checks"]
        ok = "yes" if c["off"]["ok"] and c["on"]["ok"] else "FAIL"
        print(f"{row['dtype']:5} {row['D']:3} {row['causal']!s:>7} {row['softcap']:7.0f} "
              + " ".join(f"{t[n]:6.1f}" if t.get(n) else "     -" for n in ("off", "on", "cudnn"))
              + f" {ratio(t['on'], t['off'])}    {ratio(t['off'], t.get('cudnn'))}   "
              f"{ratio(t['on'], t.get('cudnn'))}  {ok}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
