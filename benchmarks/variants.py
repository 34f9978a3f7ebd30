"""Where the variants stand on the H200 (results: benchmarks/2026-12-01-h200/variants/): flashtriton with a window,
softcap, ALiBi or sinks beside its own dense causal call and FlexAttention (compiled, the equivalent mask_mod /
score_mod), forward and forward+backward, TFLOP/s over the visible area; one process, writes $OUT/variants.json.
The seed of `flashtriton bench`'s variants suite (issue 25)."""
import json, math, os, sys
import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
import flashtriton
from flashtriton.kernels.variant import Variant

flex = torch.compile(flex_attention, dynamic=False)
rows = []

def bench(fn, grad=False, args=()):
    if grad:
        def step():
            out = fn()
            out.backward(gout if out.shape == gout.shape else gout.transpose(1, 2))
        return triton.testing.do_bench(step, warmup=100, rep=200)
    return triton.testing.do_bench(fn, warmup=100, rep=200)

def run(name, B, H, T, D, variant, causal=True):
    global gout
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    gout = torch.randn_like(q)
    slopes = (2.0 ** (-8.0 * torch.arange(1, H + 1, device="cuda") / H)).float() if variant.get("alibi") else None
    sinks = torch.randn(H, device="cuda", requires_grad=True) if variant.get("sinks") else None
    window = variant.get("window", (-1, -1)); cap = variant.get("softcap", 0.0)
    ft = lambda: flashtriton.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=cap,
                                            alibi_slopes=slopes, learnable_sink=sinks)
    dense = lambda: flashtriton.flash_attn_func(q, k, v, causal=causal)
    qh, kh, vh = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    left = window[0]
    def mask_mod(b, h, qi, ki):
        ok = ki <= qi
        if left >= 0:
            ok = ok & (qi - ki <= left)
        return ok
    bm = create_block_mask(mask_mod, 1, 1, T, T, device="cuda")
    def score_mod(s, b, h, qi, ki):
        if cap:
            s = cap * torch.tanh(s / cap)
        if slopes is not None:
            s = s - slopes[h] * (qi - ki).abs()
        return s
    fx = lambda: flex(qh, kh, vh, score_mod=score_mod if (cap or slopes is not None) else None, block_mask=bm)
    var = Variant(causal=causal, window=window)
    pairs = var.visible_pairs(T, T)
    for mode in ("fwd", "fwd_bwd"):
        g = mode == "fwd_bwd"
        flops = 4.0 * B * H * pairs * D * (3.5 if g else 1.0)
        res = {"name": name, "mode": mode, "B": B, "H": H, "T": T, "D": D, "variant": {k: str(v) for k, v in variant.items()}}
        for prov, fn in (("flashtriton", ft), ("flashtriton_dense_causal", dense), ("flex", None if sinks is not None else fx)):
            if fn is None:
                continue
            try:
                ms = bench(fn, g)
                res[prov + "_ms"] = ms
                fl = flops if prov != "flashtriton_dense_causal" else 4.0 * B * H * Variant(causal=True).visible_pairs(T, T) * D * (3.5 if g else 1.0)
                res[prov + "_tflops"] = fl / ms / 1e9
            except Exception as e:
                res[prov + "_error"] = repr(e)[:200]
        print(json.dumps(res), flush=True)
        rows.append(res)

run("window1024", 1, 16, 16384, 128, {"window": (1023, 0)})
run("window4096", 1, 16, 16384, 128, {"window": (4095, 0)})
run("softcap", 4, 16, 4096, 128, {"softcap": 30.0})
run("alibi", 4, 16, 4096, 128, {"alibi": True})
run("sinks_window128", 4, 16, 4096, 64, {"sinks": True, "window": (127, 0)})
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "variants.json"), "w"), indent=1)
