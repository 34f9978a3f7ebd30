"""D=64 causal at long T: the dispatched 128x64 tiles against 64x64 tiles with the 128-register cap (the short-T
dispatch), checked against float64 on a small shape, then GPU time beside cuDNN (performance.md, forward 36)."""
import sys, torch
sys.path.insert(0, "src"); sys.path.insert(0, "benchmarks")
from torch.nn.attention import SDPBackend, sdpa_kernel
from flashtriton import configs
from flashtriton.kernels import forward as F
from flashtriton.reference import attention_reference
import explore as X

SMALL = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, maxnreg=128)
q, k, v = (torch.randn(1, 1000, 4, 64, device="cuda", dtype=torch.float16) for _ in range(3))
out = torch.empty_like(q); lse = torch.empty(1, 4, 1000, device="cuda")
F._launch_forward_tma(q, k, v, out, lse, 64 ** -0.5, True, True, SMALL)
print("check 64x64 cap128:", (out.double() - attention_reference(q, k, v, None, True, True)).abs().max().item())
for dt in ("fp16", "bf16"):
    for T in (4096, 8192, 16384):
        q, k, v = X.fwd_inputs(T, 64, X.DTYPE[dt])
        flops = X.attention_flops(max(1, 16384 // T), 32, T, 64, True, "fwd")
        row = f"{dt} causal T={T}"
        for name, c in (("dispatch", configs.default_fwd_tma_config(64, T, T, True)), ("64x64_cap128", SMALL)):
            out = torch.empty_like(q); lse = torch.empty(q.shape[0], q.shape[2], T, device="cuda")
            ms = X.bench_graph(lambda c=c: F._launch_forward_tma(q, k, v, out, lse, 64 ** -0.5, True, True, c))
            row += f" | {name} {flops / ms / 1e9:.0f}"
        qb, kb, vb = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            ms = X.bench_graph(lambda: torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True))
        print(row + f" | cudnn {flops / ms / 1e9:.0f}", flush=True)
