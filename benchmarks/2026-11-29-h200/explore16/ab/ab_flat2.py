"""Ran on session 14's uncommitted working tree (kernel keys since folded in: FLAT=True is now OVERLAP, the
flat loop; FLAT=2 was the flat loop with the committed mask and epilogue; CAUSAL_PAIRS=2 was head-major pairs, now
what CAUSAL_PAIRS means); the _ab_base_* modules were `git show 55f2285:<file>` copies (_ab_compact_forward_gluon.py:
that tree's kernel with COMPACT's default True). Kept as the record of what benchmarks/2026-11-29-h200/explore16/
measured (they were benchmarks/ab_flat*.py), not to be rerun as they are.

Second A/B on the GPU (session 14), after ab_flat.py:
- gluon: causal T = 512..4096 and non-causal T = 512, 1024 at D = 128, the dispatched (committed) config against the
  flat loop with head-major pairs, with the compact mask and epilogue (FLAT=True) or the committed ones (FLAT=2), and
  the flat loop without head-major pairs; two rounds in opposite orders, GPU time in CUDA graphs, cuDNN beside.
- tma: the TMA forward at D = 64 (every point of the standard sweep) with the committed common.py (base) against this
  tree's (one compare per score in the mask, one reciprocal per row in the epilogue).
Needs src/flashtriton/kernels/_ab_base_{forward_gluon,forward,common}.py (the committed files; see ab_flat.py)."""
import sys

import torch

sys.path.insert(0, "src")
sys.path.insert(0, "benchmarks")
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import explore as X  # noqa: E402
from flashtriton import configs  # noqa: E402
from flashtriton.kernels import _ab_base_forward as FB  # noqa: E402
from flashtriton.kernels import _ab_base_forward_gluon as GB  # noqa: E402
from flashtriton.kernels import forward as FN  # noqa: E402
from flashtriton.kernels import forward_gluon as GN  # noqa: E402
from flashtriton.reference import attention_reference  # noqa: E402


def cudnn_tflops(q, k, v, causal, flops):
    qb, kb, vb = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        ms = X.bench_graph(lambda: torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=causal))
    return flops / ms / 1e9


def gluon():
    D = 128
    for dt in ("fp16", "bf16"):
        for causal, seqlens in ((True, (512, 1024, 2048, 4096)), (False, (512, 1024))):
            for T in seqlens:
                disp = configs.gluon_fwd_config(D, T, T, causal)
                flat = dict(disp, Q_BUFFERS=2, OVERLAP=True, FLAT=True)
                var = {"base": (GB, disp), "flat_hm": (GN, dict(flat, CAUSAL_PAIRS=2)),
                       "flat_hm_oldforms": (GN, dict(flat, CAUSAL_PAIRS=2, FLAT=2)), "flat": (GN, flat)}
                if not causal:
                    var = {"base": (GB, disp), "flat": (GN, flat), "flat_oldforms": (GN, dict(flat, FLAT=2))}
                q, k, v = X.fwd_inputs(T, D, X.DTYPE[dt])
                flops = X.attention_flops(max(1, 16384 // T), 2048 // D, T, D, causal, "fwd")
                ref = attention_reference(q[:1, :, :2], k[:1, :, :2], v[:1, :, :2], None, causal)
                res = {name: [] for name in var}
                for order in (list(var), list(var)[::-1]):
                    for name in order:
                        mod, c = var[name]
                        out = torch.empty_like(q)
                        lse = torch.empty(q.shape[0], q.shape[2], T, device="cuda")
                        fn = lambda mod=mod, c=c: mod.launch_forward_gluon(q, k, v, out, lse, D ** -0.5, causal, True, c)  # noqa: E731
                        fn()
                        err = (out[:1, :, :2].double() - ref).abs().max().item()
                        assert err < 2e-2, (name, err)
                        res[name].append(flops / X.bench_graph(fn) / 1e9)
                cu = cudnn_tflops(q, k, v, causal, flops)
                print(f"gluon {dt} causal={int(causal)} T={T}" + "".join(
                    f" | {n} {r[0]:.0f}/{r[1]:.0f}" for n, r in res.items()) + f" | cudnn {cu:.0f}", flush=True)


def tma():
    D = 64
    for dt in ("fp16", "bf16"):
        for causal in (True, False):
            for T in (512, 1024, 2048, 4096, 8192, 16384):
                q, k, v = X.fwd_inputs(T, D, X.DTYPE[dt])
                flops = X.attention_flops(max(1, 16384 // T), 2048 // D, T, D, causal, "fwd")
                c = configs.default_fwd_tma_config(D, T, T, causal)
                ref = attention_reference(q[:1, :, :2], k[:1, :, :2], v[:1, :, :2], None, causal)
                res = {"base": [], "new": []}
                for order in (("base", "new"), ("new", "base")):
                    for name in order:
                        mod = FB if name == "base" else FN
                        out = torch.empty_like(q)
                        lse = torch.empty(q.shape[0], q.shape[2], T, device="cuda")
                        fn = lambda mod=mod: mod._launch_forward_tma(q, k, v, out, lse, D ** -0.5, causal, True, c)  # noqa: E731
                        fn()
                        err = (out[:1, :, :2].double() - ref).abs().max().item()
                        assert err < 2e-2, (name, err)
                        res[name].append(flops / X.bench_graph(fn) / 1e9)
                cu = cudnn_tflops(q, k, v, causal, flops)
                print(f"tma {dt} causal={int(causal)} T={T}" + "".join(
                    f" | {n} {r[0]:.0f}/{r[1]:.0f}" for n, r in res.items()) + f" | cudnn {cu:.0f}", flush=True)


for what in sys.argv[1:]:
    {"gluon": gluon, "tma": tma}[what]()
