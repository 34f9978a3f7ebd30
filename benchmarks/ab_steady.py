"""A/B on the GPU (session 15): the forward's candidates at the sweep points where it trails cuDNN most (D = 64 at
1k-4k keys, D = 128 non-causal 1k-2k), timed the way the README's sweep is: after 100 ms of warmup per timing
(steady state; `flashtriton bench --warmup 100`). The earlier A/Bs (explore16/ab/ab_d64.txt) warmed up for 5 ms,
and at D = 64 1k-2k they put the TMA kernel level with or ahead of cuDNN where the sweep has it 3-7 % behind.

Every new Gluon config is checked against float64 on odd shapes first; then, per point of the standard sweep (B·T =
16384, H·D = 2048), every variant, cuDNN included, is timed in CUDA graphs in as many rounds as there are variants,
each round starting one later (`explore.time_rounds`). Prints the mean TFLOP/s per variant and the rounds' spread."""
import sys

import torch

sys.path.insert(0, "src")
sys.path.insert(0, "benchmarks")
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import explore as X  # noqa: E402
from flashtriton import configs  # noqa: E402
from flashtriton.kernels import forward as F  # noqa: E402

_B = dict(BLOCK_N=128, NUM_BUFFERS=2, CONSUMER_REGS=240, PINGPONG=False, PERSISTENT=True, N_CONSUMERS=2, Q_BUFFERS=1,
          CAUSAL_PAIRS=True, DYNAMIC=False, OVERLAP=False)
_C3 = dict(_B, N_CONSUMERS=3, CONSUMER_REGS=160)
GLUON = {
    64: {"q2o": dict(_B, Q_BUFFERS=2, OVERLAP=True), "q2o_s3": dict(_B, Q_BUFFERS=2, OVERLAP=True, NUM_BUFFERS=3),
         "c3o": dict(_C3, OVERLAP=True), "c3o_s3": dict(_C3, OVERLAP=True, NUM_BUFFERS=3),
         "bn64_q2o_s4": dict(_B, BLOCK_N=64, Q_BUFFERS=2, OVERLAP=True, NUM_BUFFERS=4),
         "c3o_bn64": dict(_C3, OVERLAP=True, BLOCK_N=64, NUM_BUFFERS=3)},
    128: {"base": _B, "q2o": dict(_B, Q_BUFFERS=2, OVERLAP=True), "o": dict(_B, OVERLAP=True),
          "q2": dict(_B, Q_BUFFERS=2)},
}
NEW = {(64, "bn64_q2o_s4"), (64, "c3o_bn64"), (128, "o")}  # not checked on the device before
TMA_EXTRA = {64: {"tma128x64": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}}, 128: {}}
POINTS = {"short": [(64, False, 1024), (64, False, 2048), (64, True, 2048), (64, True, 4096), (64, True, 1024),
                    (128, False, 1024), (128, False, 2048)],  # run 1 (ab_steady.txt)
          "long": [(64, False, 4096), (64, True, 8192), (64, True, 16384), (128, False, 4096), (128, False, 8192),
                   (128, False, 16384), (128, True, 8192), (128, True, 16384)]}  # run 2 (ab_steady_long.txt)


if __name__ == "__main__":
    torch.manual_seed(0)
    which = sys.argv[1] if len(sys.argv) > 1 else "short"
    if which == "short":  # the long run times configs this one checked
        print(f"checks: {sum(X.check_gluon_fwd({name: GLUON[D][name]}, D) for D, name in sorted(NEW))} bad", flush=True)
    for dt in ("fp16", "bf16"):
        for D, causal, T in POINTS[which]:
            q, k, v = X.fwd_inputs(T, D, X.DTYPE[dt])
            flops = X.attention_flops(max(1, 16384 // T), 2048 // D, T, D, causal, "fwd")
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[0], q.shape[2], T, device="cuda")
            tmas = {"tma": configs.default_fwd_tma_config(D, T, T, causal), **TMA_EXTRA[D]}
            fns = {n: (lambda tc=tc: F._launch_forward_tma(q, k, v, out, lse, D ** -0.5, causal, True, tc))
                   for n, tc in tmas.items()}
            fns.update({n: (lambda c=c: X.gluon_forward(q, k, v, causal, c, True, out, lse)) for n, c in GLUON[D].items()})
            qb, kb, vb = (t.transpose(1, 2).contiguous() for t in (q, k, v))

            def cudnn():
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    return torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=causal)
            fns["cudnn"] = cudnn
            res = X.time_rounds(fns, flops, warmup=100)
            print(f"{dt} D={D} causal={int(causal)} T={T}" + "".join(
                f" | {n} {sum(r) / len(r):.0f} ({min(r):.0f}-{max(r):.0f})" for n, r in res.items()), flush=True)
