"""Ran on session 14's uncommitted working tree (kernel keys since folded in: FLAT=True is now OVERLAP, the
flat loop; FLAT=2 was the flat loop with the committed mask and epilogue; CAUSAL_PAIRS=2 was head-major pairs, now
what CAUSAL_PAIRS means); the _ab_base_* modules were `git show 55f2285:<file>` copies (_ab_compact_forward_gluon.py:
that tree's kernel with COMPACT's default True). Kept as the record of what benchmarks/2026-11-29-h200/explore16/
measured (they were benchmarks/ab_flat*.py), not to be rerun as they are.

A/B on the GPU (session 14): the Gluon forward at D = 128 before and after
- one reciprocal per row in the epilogue and one compare per score in the mask (`base` = the committed kernel,
  `new` = this tree, both with the dispatched config);
- FLAT: OVERLAP as one loop over all the program's K/V tiles (`_consume_flat`), one or two Q slots;
- CAUSAL_PAIRS=2: causal pairs head-major (both pairs of a head at once) instead of in L2-sized head groups.
Each variant is checked against float64 on odd shapes, then timed in CUDA graphs (GPU time) beside cuDNN, in one
process, on the standard sweep's shapes (B·T = 16384, H·D = 2048). Needs src/flashtriton/kernels/_ab_base_forward_gluon.py
(`git show <base>:src/flashtriton/kernels/forward_gluon.py`)."""
import sys

import torch

sys.path.insert(0, "src")
sys.path.insert(0, "benchmarks")
sys.path.insert(0, "tests")
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import explore as X  # noqa: E402
from accuracy import torch_attention  # noqa: E402
from flashtriton import configs  # noqa: E402
from flashtriton.kernels import _ab_base_forward_gluon as GB  # noqa: E402
from flashtriton.kernels import forward_gluon as GN  # noqa: E402
from flashtriton.reference import attention_reference  # noqa: E402

D = 128


def variants(T, causal):
    disp = configs.gluon_fwd_config(D, T, T, causal)
    v = {"base": (GB, disp), "new": (GN, disp),
         "flat_q2": (GN, dict(disp, Q_BUFFERS=2, OVERLAP=True, FLAT=True)),
         "flat_q1": (GN, dict(disp, Q_BUFFERS=1, OVERLAP=True, FLAT=True))}
    if causal:
        v["new_hm"] = (GN, dict(disp, CAUSAL_PAIRS=2))
        v["flat_q2_hm"] = (GN, dict(disp, Q_BUFFERS=2, OVERLAP=True, FLAT=True, CAUSAL_PAIRS=2))
    return v


def run(mod, q, k, v, causal, config, bottom_right=True):
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device)
    mod.launch_forward_gluon(q, k, v, out, lse, D ** -0.5, causal, bottom_right, config)
    return out, lse


torch.manual_seed(0)
bad = 0
for dt in (torch.float16, torch.bfloat16):
    for causal, br in ((False, True), (True, True), (True, False)):
        for (B, Sq, Sk, H, Hk) in X.GLUON_CHECKS:
            q = torch.randn(B, Sq, H, D, device="cuda", dtype=dt)
            k, v = (torch.randn(B, Sk, Hk, D, device="cuda", dtype=dt) for _ in range(2))
            ref, ref_lse = attention_reference(q, k, v, None, causal, br, return_lse=True)
            t_out = torch_attention(q, k, v, None, causal, br).double()
            fin = torch.isfinite(t_out)
            torch_err = (t_out - ref).abs()[fin].max().item() if fin.any() else 0.0
            line = f"check {str(dt)[6:]} causal={int(causal)} br={int(br)} {(B, Sq, Sk, H, Hk)} rounding {torch_err:.1e}:"
            for name, (mod, c) in variants(4096 if Sk > 1024 else 1024, causal).items():
                o, lse = run(mod, q, k, v, causal, c, br)
                err = (o.double() - ref).abs().max().item()
                seen = torch.isfinite(ref_lse)
                lse_ok = bool(torch.equal(torch.isfinite(lse), seen)) and (
                    not seen.any() or (lse.double() - ref_lse)[seen].abs().max().item() < 1e-3)
                ok = err <= 2 * torch_err + 2e-3 and lse_ok and bool(torch.all(o[~seen.transpose(1, 2)] == 0))
                bad += not ok
                line += f" {name} {err:.1e}{'' if ok else ' BAD'}"
            print(line, flush=True)
print(f"checks: {bad} bad", flush=True)

for dt in ("fp16", "bf16"):
    for causal in (True, False):
        for T in (512, 1024, 2048, 4096, 8192, 16384):
            q, k, v = X.fwd_inputs(T, D, X.DTYPE[dt])
            flops = X.attention_flops(max(1, 16384 // T), 2048 // D, T, D, causal, "fwd")
            row = f"{dt} causal={int(causal)} T={T}"
            for name, (mod, c) in variants(T, causal).items():
                out = torch.empty_like(q)
                lse = torch.empty(q.shape[0], q.shape[2], T, device="cuda")
                fn = lambda mod=mod, c=c: mod.launch_forward_gluon(q, k, v, out, lse, D ** -0.5, causal, True, c)  # noqa: E731
                row += f" | {name} {flops / X.bench_graph(fn) / 1e9:.0f}"
            qb, kb, vb = (t.transpose(1, 2).contiguous() for t in (q, k, v))
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                ms = X.bench_graph(lambda: torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=causal))
            print(row + f" | cudnn {flops / ms / 1e9:.0f}", flush=True)
