"""Ran on session 14's uncommitted working tree (kernel keys since folded in: FLAT=True is now OVERLAP, the
flat loop; FLAT=2 was the flat loop with the committed mask and epilogue; CAUSAL_PAIRS=2 was head-major pairs, now
what CAUSAL_PAIRS means); the _ab_base_* modules were `git show 55f2285:<file>` copies (_ab_compact_forward_gluon.py:
that tree's kernel with COMPACT's default True). Kept as the record of what benchmarks/2026-11-29-h200/explore16/
measured (they were benchmarks/ab_flat*.py), not to be rerun as they are.

Third A/B on the GPU (session 14), in rounds of alternating order (a kernel timed first after the GPU idled
reads up to 10 % faster than one timed after another: ab_flat2.py's two rounds):
- the consumers that take one item at a time (`_consume_in_turn`, dispatched for non-causal from 2k keys and causal
  from 8k) with the committed mask and epilogue (`base`) or the compact ones (`compact`: one compare per score, one
  reciprocal per row; module _ab_compact_forward_gluon.py = this tree's kernel with COMPACT's default True);
- causal 8k/16k with the causal pairs head-major (`hm`, CAUSAL_PAIRS=2) instead of in L2-sized head groups;
- causal 4k: the committed OVERLAP loop (`base`) against the flat loop with head-major pairs (`flat_hm`)."""
import sys

import torch

sys.path.insert(0, "src")
sys.path.insert(0, "benchmarks")
import explore as X  # noqa: E402
from ab_flat2 import cudnn_tflops  # noqa: E402
from flashtriton import configs  # noqa: E402
from flashtriton.kernels import _ab_base_forward_gluon as GB  # noqa: E402
from flashtriton.kernels import _ab_compact_forward_gluon as GC  # noqa: E402
from flashtriton.kernels import forward_gluon as GN  # noqa: E402
from flashtriton.reference import attention_reference  # noqa: E402

D = 128
for dt in ("fp16", "bf16"):
    for causal, T in [(False, 2048), (False, 4096), (False, 8192), (False, 16384), (True, 4096), (True, 8192),
                      (True, 16384)]:
        disp = configs.gluon_fwd_config(D, T, T, causal)
        var = {"base": (GB, disp), "compact": (GC, disp)}
        if causal and T >= 8192:
            var["hm"] = (GN, dict(disp, CAUSAL_PAIRS=2))
        if causal and T == 4096:
            var = {"base": (GB, disp), "flat_hm": (GN, dict(disp, FLAT=True, CAUSAL_PAIRS=2))}
        q, k, v = X.fwd_inputs(T, D, X.DTYPE[dt])
        flops = X.attention_flops(max(1, 16384 // T), 2048 // D, T, D, causal, "fwd")
        ref = attention_reference(q[:1, :, :2], k[:1, :, :2], v[:1, :, :2], None, causal)
        res = {name: [] for name in var}
        names = list(var)
        for r in range(2 * len(names)):  # every variant first once in each direction
            order = names[r % len(names):] + names[:r % len(names)]
            order = order if r < len(names) else order[::-1]
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
        print(f"{dt} causal={int(causal)} T={T}" + "".join(
            f" | {n} {sum(r) / len(r):.0f} ({'/'.join(f'{x:.0f}' for x in r)})" for n, r in res.items())
            + f" | cudnn {cu:.0f}", flush=True)
