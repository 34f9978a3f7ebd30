"""A/B on the GPU (session 14): the Gluon forward at D = 64 now that OVERLAP is the flat loop (`_consume_flat`),
against the dispatched TMA kernel and cuDNN. Every Gluon config is checked against float64 on odd shapes first; then,
per point of the standard sweep (B·T = 16384, H·D = 2048), every variant, cuDNN included, is timed in CUDA graphs
(GPU time) in as many rounds as there are variants, each round starting one later, so that each is timed first
once (a GPU that paused runs faster for a moment: explore16/ab). Prints the mean TFLOP/s and the rounds."""
import sys

import torch

sys.path.insert(0, "src")
sys.path.insert(0, "benchmarks")
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import explore as X  # noqa: E402
from flashtriton import configs  # noqa: E402
from flashtriton.kernels import forward as F  # noqa: E402

D = 64
_G = dict(BLOCK_N=128, NUM_BUFFERS=2, CONSUMER_REGS=240, PINGPONG=False, PERSISTENT=True, N_CONSUMERS=2, Q_BUFFERS=1,
          CAUSAL_PAIRS=True, DYNAMIC=False, OVERLAP=False)
_G3 = dict(_G, N_CONSUMERS=3, CONSUMER_REGS=160)
GLUON = {"q2": dict(_G, Q_BUFFERS=2), "c3": _G3, "q2o": dict(_G, Q_BUFFERS=2, OVERLAP=True),
         "q2o_s3": dict(_G, Q_BUFFERS=2, OVERLAP=True, NUM_BUFFERS=3), "c3o": dict(_G3, OVERLAP=True),
         "c3o_s3": dict(_G3, OVERLAP=True, NUM_BUFFERS=3)}


if __name__ == "__main__":
    torch.manual_seed(0)
    bad = X.check_gluon_fwd(GLUON, D)
    print(f"checks: {bad} bad", flush=True)
    for dt in ("fp16", "bf16"):
        for causal in (False, True):
            for T in (512, 1024, 2048, 4096, 8192, 16384):
                q, k, v = X.fwd_inputs(T, D, X.DTYPE[dt])
                flops = X.attention_flops(max(1, 16384 // T), 2048 // D, T, D, causal, "fwd")
                out = torch.empty_like(q)
                lse = torch.empty(q.shape[0], q.shape[2], T, device="cuda")
                tc = configs.default_fwd_tma_config(D, T, T, causal)
                fns = {"tma": lambda: F._launch_forward_tma(q, k, v, out, lse, D ** -0.5, causal, True, tc)}
                fns.update({n: (lambda c=c: X.gluon_forward(q, k, v, causal, c, True, out, lse)) for n, c in GLUON.items()})
                qb, kb, vb = (t.transpose(1, 2).contiguous() for t in (q, k, v))

                def cudnn():
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        return torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=causal)
                fns["cudnn"] = cudnn
                res = X.time_rounds(fns, flops)
                print(f"{dt} causal={int(causal)} T={T}" + "".join(
                    f" | {n} {sum(r) / len(r):.0f}" for n, r in res.items()), flush=True)
