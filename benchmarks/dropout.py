"""Attention dropout's speed (issue 29's bar): flashtriton with dropout_p against its own call without dropout and
against SDPA's cuDNN and FLASH backends with the same p, forward and backward.

Points: p = 0.1 (`--p`), D = 64 and 128, T = 1k, 4k, 16k (16384 tokens per batch: B = 16384 / T), H = 2048 / D,
causal and not, bf16. Every flashtriton call is first checked against float64 with the exact keep-mask it used
(`flashtriton.testing.record_dropout` / `dropout_mask`, on the first batch and heads of a shortened copy of the
point: T ≤ 1024), and every provider's output for finiteness and its mean against the call without dropout (the
masks of different libraries differ; each is unbiased: E[out] is the same). Timing: `triton.testing.do_bench`
(median, L2 flushed) in `--rounds` rounds of rotating order after 100 ms of warmup (`bench_core.time_in_rounds`); TFLOP/s with the
FlashAttention count (fwd 4·B·H·T²·D, /2 causal; bwd ×2.5). The table gives ours / ours without dropout and ours
/ cuDNN per point, the geometric means, and the bars last; `--out DIR` writes DIR/dropout.json. Without
`--gluon`, flashtriton's calls take the shipped rules (the Gluon kernels where `configs.GLUON_DROPOUT_FWD` /
`configs.backward.GLUON_BWD_DROPOUT_CASES` name the case). `--gluon`: the Gluon kernels for every point
(`configs.forward.GLUON_DROPOUT_ALL`, `configs.backward.GLUON_BWD_DROPOUT_ALL`), timed beside the portable
kernels' on the same points (`flashtriton_portable`, the portable kernels forced forward and backward).

    python benchmarks/dropout.py --out DIR [--gluon]
    TRITON_INTERPRET=1 python benchmarks/dropout.py --quick      # a tiny point on the CPU (the script's path only)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics

import torch

import flashtriton
from flashtriton import testing
from flashtriton.reference import attention_reference
from flashtriton.tools import bench_core as C

BAR_OWN, BAR_CUDNN, BAR_CUDNN_GEOMEAN_FWD = 0.85, 1.0, 1.3


def sdpa_call(backend_name, q, k, v, causal, p):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION}[backend_name]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def run():
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, dropout_p=p,
                                                                    is_causal=causal).transpose(1, 2)
    return run


def switch(name):
    """The kernel switch a provider runs under, forward and backward: the portable kernels for
    `flashtriton_portable`, else the default."""
    from flashtriton.kernels import dispatch

    return dispatch.force("portable") if name == "flashtriton_portable" else contextlib.nullcontext()


def portable_call(q, k, v, causal, p):
    def run():
        with switch("flashtriton_portable"):
            return flashtriton.flash_attn_func(q, k, v, dropout_p=p, causal=causal)
    return run


def providers(q, k, v, causal, p, gluon=False):
    calls = {"flashtriton": lambda: flashtriton.flash_attn_func(q, k, v, dropout_p=p, causal=causal),
             "flashtriton_no_dropout": lambda: flashtriton.flash_attn_func(q, k, v, causal=causal)}
    if gluon:
        calls["flashtriton_portable"] = portable_call(q, k, v, causal, p)
    if torch.cuda.is_available():
        calls["sdpa_cudnn"] = sdpa_call("sdpa_cudnn", q, k, v, causal, p)
        calls["sdpa_flash"] = sdpa_call("sdpa_flash", q, k, v, causal, p)
    return calls


def check_exact(B, H, T, D, causal, p, dtype, device):
    """flashtriton's dropout call against float64 on the mask it used (first batch, two heads)."""
    gen = torch.Generator(device=device).manual_seed(T + D)
    q, k, v = (torch.randn(B, T, H, D, device=device, dtype=dtype, generator=gen) for _ in range(3))
    with testing.record_dropout() as calls:
        out = flashtriton.flash_attn_func(q, k, v, dropout_p=p, causal=causal)
    keep = testing.dropout_mask(calls[0], B, H, T, T, p, device=device)
    sl = slice(0, 1)
    exact = attention_reference(q[sl].double(), k[sl].double(), v[sl].double(), causal=causal,
                                dropout_mask=keep[sl], dropout_p=p)
    own = attention_reference(q[sl], k[sl], v[sl], causal=causal, dtype=dtype, dropout_mask=keep[sl], dropout_p=p)
    err = (out[sl].double() - exact).abs().max().item()
    torch_err = (own.double() - exact).abs().max().item()
    if not err <= 2 * torch_err + 1e-3:
        raise AssertionError(f"dropout B={B} H={H} T={T} D={D} causal={causal}: error {err:.3g} against float64 "
                             f"on its mask, torch's own {torch_err:.3g}")
    return err, torch_err


def _grad(name, out, inputs, dout):
    with switch(name):
        return torch.autograd.grad(out, inputs, dout, retain_graph=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seqlens", default="1024,4096,16384")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="one tiny point (the interpreter's)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--gluon", action="store_true", help="the Gluon kernels for every point, beside the portable ones")
    args = parser.parse_args()
    if args.gluon:
        from flashtriton import configs

        configs.forward.GLUON_DROPOUT = configs.forward.GLUON_DROPOUT_ALL = True
        configs.backward.GLUON_BWD_DROPOUT = configs.backward.GLUON_BWD_DROPOUT_ALL = True
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float16  # (bf16 dots are wrong in the interpreter)
    env = C.environment()
    if args.quick:
        points = [(1, 2, 64, 16, c) for c in (False, True)]
    else:
        points = [(16384 // T, 2048 // D, T, D, c) for D in C.parse_int_list(args.head_dims, "--head-dims")
                  for T in C.parse_int_list(args.seqlens, "--seqlens") for c in (False, True)]
    rows = []
    for B, H, T, D, causal in points:
        checked = check_exact(min(B, 2), H, min(T, 1024), D, causal, args.p, dtype, device)
        gen = torch.Generator(device=device).manual_seed(1)
        q, k, v = (torch.randn(B, T, H, D, device=device, dtype=dtype, generator=gen, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn(B, T, H, D, device=device, dtype=dtype, generator=gen)
        calls = providers(q, k, v, causal, args.p, args.gluon)
        means, errors = {}, {}
        for name, fn in list(calls.items()):
            try:
                with torch.no_grad():
                    out = fn()
                if not torch.isfinite(out).all():
                    raise AssertionError("non-finite output")
                means[name] = out.float().mean().item()
            except Exception as e:  # noqa: BLE001  (a backend that refuses the point: reported, not timed)
                errors[name] = C.short_error(e)
                del calls[name]
        fwd_flops = 4.0 * B * H * T * T * D / (2 if causal else 1)
        timed = {}
        for name, fn in calls.items():  # the backward alone: one forward's graph, re-run
            timed[(name, "fwd")] = fn
            timed[(name, "bwd")] = lambda out=fn(), name=name: _grad(name, out, (q, k, v), dout)
        times = C.time_in_rounds(timed, args.rounds, rep=3 if args.quick else 100)
        del timed
        for mode in ("fwd", "bwd"):
            flops = fwd_flops * (2.5 if mode == "bwd" else 1.0)
            ms = {name: statistics.median(times[(name, mode)]) for name in calls}
            rows.append(dict(env, p=args.p, B=B, H=H, T=T, D=D, causal=causal, mode=mode,
                             dtype=str(dtype).split(".")[-1], ms=ms,
                             tflops={n: C.tflops(flops, m) for n, m in ms.items()}, output_mean=means,
                             errors=errors, exact_error=checked[0], torch_error=checked[1]))
    print(f"\ndropout p={args.p} ({env['gpu']}, {env['git_sha']}): TFLOP/s, {rows[0]['dtype']}")
    print("| mode | causal | D | T | ours | ours, no dropout | cuDNN | FLASH | ours / no dropout | ours / cuDNN |"
          + (" ours / portable |" if args.gluon else ""))
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if args.gluon else ""))
    ratios = {"own": {"fwd": [], "bwd": []}, "cudnn": {"fwd": [], "bwd": []}}
    for row in rows:
        t = row["tflops"]
        own = t["flashtriton"] / t["flashtriton_no_dropout"]
        cudnn = t["flashtriton"] / t["sdpa_cudnn"] if t.get("sdpa_cudnn") else None
        ratios["own"][row["mode"]].append(own)
        if cudnn is not None:
            ratios["cudnn"][row["mode"]].append(cudnn)
        fmt = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
        print(f"| {row['mode']} | {int(row['causal'])} | {row['D']} | {row['T']} | {fmt(t['flashtriton'])} | "
              f"{fmt(t['flashtriton_no_dropout'])} | {fmt(t.get('sdpa_cudnn'))} | {fmt(t.get('sdpa_flash'))} | "
              f"{own:.2f} | {'-' if cudnn is None else f'{cudnn:.2f}'} |"
              + (f" {t['flashtriton'] / t['flashtriton_portable']:.2f} |" if t.get("flashtriton_portable") else ""))
    geo = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None  # noqa: E731
    print("\nissue 29's bars:")
    for mode in ("fwd", "bwd"):
        own_min = min(ratios["own"][mode])
        print(f"- {mode}: ours / no dropout min {own_min:.2f} (>= {BAR_OWN}: {'PASS' if own_min >= BAR_OWN else 'FAIL'})")
        if ratios["cudnn"][mode]:
            low, g = min(ratios["cudnn"][mode]), geo(ratios["cudnn"][mode])
            print(f"- {mode}: ours / cuDNN min {low:.2f} (>= {BAR_CUDNN}: {'PASS' if low >= BAR_CUDNN else 'FAIL'}),"
                  f" geomean {g:.2f}" + (f" (>= {BAR_CUDNN_GEOMEAN_FWD}: "
                                         f"{'PASS' if g >= BAR_CUDNN_GEOMEAN_FWD else 'FAIL'})" if mode == "fwd" else ""))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "dropout.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
