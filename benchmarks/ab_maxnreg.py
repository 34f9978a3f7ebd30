"""A/B on the GPU: the TMA forward's D=64 tiles with a register cap (maxnreg), checked against float64, then GPU
time (CUDA graphs) beside cuDNN in the same process, standard sweep shapes."""
import sys, torch
sys.path.insert(0, "src"); sys.path.insert(0, "benchmarks")
from torch.nn.attention import SDPBackend, sdpa_kernel
from flashtriton import configs
from flashtriton.kernels import forward as F
from flashtriton.reference import attention_reference
import explore as X

CAPS = (0, 128, 120)
torch.manual_seed(0)
for (B, Sq, Sk, H, Hk, causal) in [(2, 1, 65, 2, 2, False), (2, 37, 100, 2, 1, True), (1, 300, 300, 2, 2, True), (1, 1024, 1024, 4, 2, True)]:
    q = torch.randn(B, Sq, H, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(B, Sk, Hk, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    ref = attention_reference(q, k, v, None, causal, True)
    line = f"check {B,Sq,Sk,H,Hk,causal}:"
    for cap in CAPS:
        c = dict(configs.default_fwd_tma_config(64, Sq, Sk, causal), maxnreg=cap)
        out = torch.empty_like(q); lse = torch.empty(B, H, Sq, device="cuda")
        F._launch_forward_tma(q, k, v, out, lse, 64 ** -0.5, causal, True, c)
        line += f" cap{cap} {(out.double() - ref).abs().max().item():.1e}"
    print(line, flush=True)
for dt in ("fp16", "bf16"):
    for causal in (True, False):
        for T in (512, 1024, 2048, 4096, 8192, 16384):
            if dt == "bf16" and T not in (512, 1024, 8192):
                continue
            q, k, v = X.fwd_inputs(T, 64, X.DTYPE[dt])
            flops = X.attention_flops(max(1, 16384 // T), 32, T, 64, causal, "fwd")
            row = f"{dt} causal={int(causal)} T={T}"
            for cap in CAPS:
                c = dict(configs.default_fwd_tma_config(64, T, T, causal), maxnreg=cap)
                out = torch.empty_like(q); lse = torch.empty(q.shape[0], q.shape[2], T, device="cuda")
                fn = lambda c=c: F._launch_forward_tma(q, k, v, out, lse, 64 ** -0.5, causal, True, c)
                row += f" | cap{cap} {flops / X.bench_graph(fn) / 1e9:.0f}"
            qb, kb, vb = (t.transpose(1, 2).contiguous() for t in (q, k, v))
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                ms = X.bench_graph(lambda: torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=causal))
            print(row + f" | cudnn {flops / ms / 1e9:.0f}", flush=True)
