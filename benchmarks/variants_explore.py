"""What the variants cost, kernel by kernel, and the alternatives a variant's config could take (issue 25).

Sections (each checks its calls against float64 first, then times them by `triton.testing.do_bench`, L2 flushed,
median of rounds in rotating order after ~100 ms of warmup):
  profile   per-kernel GPU time (torch.profiler) of one forward and one forward + backward per variant, beside the
            dense call: where a variant's extra time goes (a kernel's, or launches around it)
  fwd_cfg   the Gluon forward under each candidate config for the window bands (T=16k, windows 1k and 4k)
  bwd_min   the small-band backward (window 128, with and without sinks) on the Triton kernels (the default
            below configs.GLUON_BWD_MIN_FLOPS) and forced onto the Gluon ones
  decode    decode with a 4k window over a 32k cache (batch 8): every split count x decode config
  host      host time per call (the GPU kept busy) and its cProfile, per variant

    python benchmarks/variants_explore.py --out DIR [--sections profile,fwd_cfg,bwd_min,decode]
writes DIR/variants_explore.json and prints a table per section.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess

import torch
import triton

import flashtriton
from flashtriton import configs
from flashtriton.kernels import decode_launch as Dk
from flashtriton.kernels import forward as F
from flashtriton.kernels.variant import Variant
from flashtriton.reference import attention_reference


def timed(fns: dict, rounds: int = 3) -> dict:
    """Median over `rounds` of do_bench medians, the providers' order rotated each round (ms)."""
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(triton.testing.do_bench(fns[name], warmup=100, rep=200, return_mode="median"))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def inputs(B_, H, T, D, dtype=torch.bfloat16, seed=0, grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B_, T, H, D, device="cuda", dtype=dtype, generator=g).requires_grad_(grad)
               for _ in range(3))
    slopes = (2.0 ** (-8.0 * torch.arange(1, H + 1, device="cuda") / H)).float()
    sinks = torch.randn(H, device="cuda", generator=g, dtype=torch.float32).requires_grad_(grad)
    return q, k, v, slopes, sinks


VARIANTS = {  # name: flash_attn_func keywords (slopes and sinks filled in)
    "dense": {},
    "sinks": {"learnable_sink": True},
    "alibi": {"alibi_slopes": True},
    "softcap": {"softcap": 50.0},
    "window128": {"window_size": (127, 0)},
    "sinks+window128": {"window_size": (127, 0), "learnable_sink": True},
    "window1024": {"window_size": (1023, 0)},
    "window4096": {"window_size": (4095, 0)},
}


def kwargs_of(name, slopes, sinks):
    kw = dict(VARIANTS[name])
    if kw.pop("learnable_sink", False):
        kw["learnable_sink"] = sinks
    if kw.pop("alibi_slopes", False):
        kw["alibi_slopes"] = slopes
    return kw


def variant_of(kw):
    return Variant(causal=True, window=tuple(kw.get("window_size", (-1, -1))), softcap=kw.get("softcap", 0.0),
                   alibi_slopes=kw.get("alibi_slopes"), sinks=kw.get("learnable_sink"))


def check_fwd(q, k, v, kw, out):
    """max |out - float64| over the first sequence's first two heads, against 2 x torch's own error in the dtype
    + a floor."""
    kw = {n: (t[:2].detach() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    q, k, v = (t[:1, :, :2].detach() for t in (q, k, v))
    ref = attention_reference(q, k, v, variant=variant_of(kw))
    same = attention_reference(q, k, v, variant=variant_of(kw), dtype=q.dtype)
    err = (out[:1, :, :2].double() - ref).abs().max().item()
    torch_err = (same.double() - ref).abs().max().item()
    return dict(err=err, torch_err=torch_err, ok=bool(err <= 2 * torch_err + 1.6e-2))


def kernel_times(fn, iters=10) -> dict:
    """Per-kernel GPU time (us per call) of fn over `iters` calls."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t and e.count:
            out[e.key[:60]] = out.get(e.key[:60], 0.0) + t / iters
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def section_profile(rows):
    for D in (128, 64):
        q, k, v, slopes, sinks = inputs(4, 16, 4096, D, grad=True)
        dout = torch.randn_like(q)
        for name in ("dense", "sinks", "alibi", "softcap", "window128", "sinks+window128"):
            if D == 64 and name in ("alibi", "softcap"):
                continue
            kw = kwargs_of(name, slopes, sinks)
            with torch.no_grad():
                out = flashtriton.flash_attn_func(q, k, v, causal=True, **kw)
            chk = check_fwd(q, k, v, kw, out)

            def fwd(kw=kw):
                with torch.no_grad():
                    return flashtriton.flash_attn_func(q, k, v, causal=True, **kw)

            def fwd_bwd(kw=kw):
                o = flashtriton.flash_attn_func(q, k, v, causal=True, **kw)
                o.backward(dout)

            ms = timed({"fwd": fwd, "fwd_bwd": fwd_bwd}, rounds=2)
            for mode, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
                kt = kernel_times(fn)
                rows.append(dict(section="profile", D=D, variant=name, mode=mode, ms=ms[mode], kernels=kt, **chk))
                print(f"profile D={D} {name:16} {mode:7} {ms[mode] * 1e3:8.1f} us  ok={chk['ok']}  " +
                      ", ".join(f"{n[:28]}={t:.1f}" for n, t in list(kt.items())[:6]))
            q.grad = k.grad = v.grad = sinks.grad = None


FWD_CANDIDATES = {
    "base": configs.forward.GLUON_BASE,
    "short": configs.forward.GLUON_SHORT,
    "base_nopairs": dict(configs.forward.GLUON_BASE, CAUSAL_PAIRS=False),
    "short_nopairs": dict(configs.forward.GLUON_SHORT, CAUSAL_PAIRS=False),
    "base_buf3": dict(configs.forward.GLUON_BASE, NUM_BUFFERS=3),
    "short_buf3": dict(configs.forward.GLUON_SHORT, NUM_BUFFERS=3),
    "dynamic": configs.forward.GLUON_DYNAMIC,
}


def section_fwd_cfg(rows):
    q, k, v, slopes, sinks = inputs(1, 16, 16384, 128)
    original = configs.gluon_fwd_config
    for name in ("window1024", "window4096", "dense"):
        kw = kwargs_of(name, slopes, sinks)
        checks, res = {}, {}
        for cname, cfg in FWD_CANDIDATES.items():
            configs.gluon_fwd_config = lambda *a, cfg=cfg: dict(cfg)
            F._dense_tma_plan.cache_clear()

            def plain(kw=kw):
                with torch.no_grad():
                    return flashtriton.flash_attn_func(q, k, v, causal=True, **kw)
            try:
                checks[cname] = check_fwd(q, k, v, kw, plain())
            except Exception as e:  # noqa: BLE001 - a config the kernel refuses is a row, not the end of the run
                print(f"fwd_cfg {name} {cname}: {type(e).__name__}: {str(e)[:200]}")
                continue
            res[cname] = timed({cname: plain}, rounds=3)[cname]  # the plan (this config) built once, then cached
        flops = variant_of(kw).visible_flops(1, 16, 16384, 16384, 128)
        for cname, ms in res.items():
            rows.append(dict(section="fwd_cfg", variant=name, config=cname, ms=ms, tflops=flops / ms * 1e-9,
                             **checks[cname]))
            print(f"fwd_cfg {name:11} {cname:14} {ms * 1e3:8.1f} us {flops / ms * 1e-9:6.1f} TFLOP/s "
                  f"ok={checks[cname]['ok']}")
    configs.gluon_fwd_config = original
    F._dense_tma_plan.cache_clear()


def section_bwd_min(rows):
    for D in (128, 64):
        q, k, v, slopes, sinks = inputs(4, 16, 4096, D, grad=True)
        dout = torch.randn_like(q)
        for name in ("window128", "sinks+window128", "window1024"):
            kw = kwargs_of(name, slopes, sinks)
            res = {}
            for forced in (False, True):
                old = configs.backward.GLUON_BWD_MIN_FLOPS  # (what gluon_bwd_config reads)
                configs.backward.GLUON_BWD_MIN_FLOPS = 0 if forced else old

                def fwd_bwd(kw=kw):
                    o = flashtriton.flash_attn_func(q, k, v, causal=True, **kw)
                    o.backward(dout)
                fwd_bwd()
                res[forced] = (timed({"x": fwd_bwd}, rounds=3)["x"], kernel_times(fwd_bwd))
                configs.backward.GLUON_BWD_MIN_FLOPS = old
                q.grad = k.grad = v.grad = sinks.grad = None
            for forced, (ms, kt) in res.items():
                rows.append(dict(section="bwd_min", D=D, variant=name, gluon_forced=forced, ms=ms, kernels=kt))
                print(f"bwd_min D={D} {name:16} gluon={forced!s:5} {ms * 1e3:8.1f} us  " +
                      ", ".join(f"{n[:28]}={t:.1f}" for n, t in list(kt.items())[:5]))


def section_decode(rows):
    Bsz, Hq, Hkv, D, cap, W = 8, 32, 8, 128, 32768, 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(Bsz, 1, Hq, D, device="cuda", dtype=torch.float16, generator=g)
    kc = torch.randn(Bsz, cap, Hkv, D, device="cuda", dtype=torch.float16, generator=g)
    vc = torch.randn_like(kc)
    seqlens = torch.full((Bsz,), cap, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * Bsz * Hkv * W * D * 2
    ref = None
    for cand in configs.DECODE_CANDIDATES + [None]:
        cfg = None if cand is None else configs.decode.keys(*cand)
        for splits in (0, 1, 2, 3, 4, 6, 8, 12, 16):
            if cand is None and splits:
                continue

            def call(cfg=cfg, splits=splits):
                return Dk.decode_attention(q, kc, vc, seqlens, cap, D ** -0.5, True, num_splits=splits, config=cfg,
                                           window_size=(W - 1, 0))
            try:
                out = call()[0]
            except Exception as e:  # noqa: BLE001
                print(f"decode {cand} splits={splits}: {type(e).__name__}: {str(e)[:120]}")
                continue
            if ref is None:
                ref = attention_reference(q[:2], kc[:2], vc[:2], variant=Variant(causal=True, window=(W - 1, 0)))
            err = (out[:2].double() - ref).abs().max().item()
            ms = timed({"x": call}, rounds=2)["x"]
            rows.append(dict(section="decode", config=cand, splits=splits, ms=ms, gbps=kv_bytes / ms * 1e-6, err=err))
            print(f"decode {str(cand):14} splits={splits:2} {ms * 1e3:7.1f} us {kv_bytes / ms * 1e-6:6.0f} GB/s "
                  f"err={err:.2e}")


def section_host(rows):
    """Host time per call (CPU time to issue it, the GPU kept busy) and where it goes (cProfile)."""
    import cProfile
    import io
    import pstats
    import time
    for D in (128, 64):
        q, k, v, slopes, sinks = inputs(4, 16, 4096, D, grad=True)
        dout = torch.randn_like(q)
        for name in ("dense", "sinks", "window128", "sinks+window128"):
            kw = kwargs_of(name, slopes, sinks)

            def fwd(kw=kw):
                with torch.no_grad():
                    return flashtriton.flash_attn_func(q, k, v, causal=True, **kw)

            def fwd_bwd(kw=kw):
                o = flashtriton.flash_attn_func(q, k, v, causal=True, **kw)
                torch.autograd.grad(o, (q, k, v), dout)
            for mode, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                n = 20
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                host = (time.perf_counter() - t0) / n
                torch.cuda.synchronize()
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(n):
                    fn()
                prof.disable()
                torch.cuda.synchronize()
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
                top = [line for line in buf.getvalue().splitlines() if line.strip()[:1].isdigit()][:14]
                rows.append(dict(section="host", D=D, variant=name, mode=mode, host_us=host * 1e6, top=top))
                print(f"host D={D} {name:16} {mode:7} {host * 1e6:8.1f} us/call (issue, GPU busy)")
                for line in top[:8]:
                    print("    " + line[:150])


SECTIONS = {"host": section_host, "profile": section_profile, "fwd_cfg": section_fwd_cfg, "bwd_min": section_bwd_min,
            "decode": section_decode}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--sections", default=",".join(SECTIONS))
    args = parser.parse_args()
    rows = []
    for s in args.sections.split(","):
        try:
            SECTIONS[s](rows)
        except Exception as e:  # noqa: BLE001 - keep the other sections' rows
            import traceback
            traceback.print_exc()
            rows.append(dict(section=s, error=f"{type(e).__name__}: {e}"))
        torch.cuda.empty_cache()
    sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or \
        os.environ.get("FLASHTRITON_GIT_SHA", "")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "variants_explore.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, git=sha,
                       rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
