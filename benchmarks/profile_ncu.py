"""One forward call of one case, for Nsight Compute (the device machine has `ncu`; see benchmarks/profile_ncu.sh).

    ncu --clock-control none --nvtx --nvtx-include "prof/" --set full -o DIR/CASE python benchmarks/profile_ncu.py CASE

The call is made twice to compile and warm up, then once inside the NVTX range "prof", so that ncu profiles
exactly one kernel: flashtriton's or cuDNN's through torch SDPA. Cases: NAME = PROVIDER-D-causal-T, e.g.
gluon_q1-128-0-4096, tma-64-1-512, cudnn-64-1-512. `tma` is the public forward with the Gluon kernels off (as
FLASHTRITON_KERNEL=tma runs it: the TMA kernel at the dispatch's tile); `gluon_*` the Gluon forward's public
launcher with the config VARIANTS names; `api_<variant>` the public flash_attn_func with a variant (dense, alibi,
softcap, sinks, window1024), e.g. api_alibi-128-1-4096. Inputs are the standard sweep's (B·T = 16384,
H·D = 2048), fp16.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from flashtriton.kernels import dispatch  # noqa: E402
from flashtriton.kernels import forward as F  # noqa: E402
from flashtriton.kernels import forward_gluon_launch as G  # noqa: E402

GLUON = dict(BLOCK_N=128, NUM_BUFFERS=2, CONSUMER_REGS=240, N_CONSUMERS=2, Q_BUFFERS=1, CAUSAL_PAIRS=True,
             DYNAMIC=False, OVERLAP=False)
VARIANTS = {"gluon_q1": GLUON, "gluon_q2": dict(GLUON, Q_BUFFERS=2),
            "gluon_q2o": dict(GLUON, Q_BUFFERS=2, OVERLAP=True),
            "gluon_c3": dict(GLUON, N_CONSUMERS=3, CONSUMER_REGS=160)}


def case_fn(name: str):
    provider, d, c, t = name.split("-")
    D, causal, T = int(d), bool(int(c)), int(t)
    B, H = max(1, 16384 // T), 2048 // D
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(B, H, T, device="cuda", dtype=torch.float32)
    scale = D ** -0.5
    if provider == "cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qb, kb, vb = (x.transpose(1, 2).contiguous() for x in (q, k, v))

        def fn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=causal)
    elif provider == "tma":
        if torch.cuda.get_device_capability()[0] != 9:
            raise SystemExit("tma: the TMA kernels need an sm_90 GPU")
        dispatch.CHOICE = dispatch.Choice(level="tma")  # FLASHTRITON_KERNEL=tma, read by the launcher on each call

        def fn():
            F.attention_forward(q, k, v, scale, causal)
    elif provider.startswith("api_"):  # the public call with a variant: api_dense, api_alibi, api_softcap, ...
        import flashtriton
        kw = {"dense": {}, "alibi": {"alibi_slopes": (2.0 ** (-8.0 * torch.arange(1, H + 1) / H)).float().cuda()},
              "softcap": {"softcap": 50.0}, "sinks": {"learnable_sink": torch.randn(H, device="cuda")},
              "window1024": {"window_size": (1023, 0)}}[provider[4:]]

        def fn():
            return flashtriton.flash_attn_func(q, k, v, causal=causal, **kw)
    else:
        config = VARIANTS[provider]

        def fn():
            G.launch_forward_gluon(q, k, v, out, lse, scale, causal, True, config)
    return fn


def main() -> None:
    fn = case_fn(sys.argv[1])
    fn()
    fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("prof")
    fn()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
