"""A/B of Gluon forward configs against the config the dispatch picks, beside SDPA's cuDNN backend on the same call:
at the wide head dims (tiles of 256 columns: D = 192, 256, and QK 192 / V 128) the candidates below, and at every
head dim the dispatch's config with its output staged in the Q buffers ("dispatch+oq": O_IN_Q, where the
dispatch's config stages its output with one Q slot and no OVERLAP), also with a third K/V stage in the shared
memory that frees ("dispatch+oq_s3", where it fits).

Candidates (`CANDIDATES`, `configs.forward.GLUON_BASE` with): 32-key tiles with the output staged for a TMA store
("n32"), 64-key tiles stored from registers ("n64_regs"), 32-key tiles stored from registers with a third K/V stage
("n32_regs_s3"), or with two Q slots ("n32_q2_regs", so that the next item's Q loads while this one runs), two Q
slots and one K/V stage of 64 keys ("n64_q2_regs_s1"), and two Q slots with OVERLAP ("n32_q2_regs_ov": each item's
last P V beside the next item's first S; not at V head dim 192, whose two accumulators OVERLAP does not take), and
the output staged in the consumers' Q buffers (O_IN_Q: no staging tiles, so 64-key tiles in two stages fit beside
Q; "n64_oq", and "n32_oq_s3" with a third stage of 32-key tiles; not at QK 192 / V 128, whose tiles differ), and
at QK 192 / V 128 only (its narrower V tiles leave room) 64-key tiles in three stages stored from registers
("n64_regs_s3").
Each candidate's output is checked against the dispatch's (within 2e-2 of its scale), then the forward is timed by
`triton.testing.do_bench` (L2 flushed) in rounds whose order rotates (`bench_core.time_in_rounds`).

Cases: bf16, B·T = 16384 tokens, H·D ≈ 2048 (H = 32 / 16 / 10 / 8 at D = 64 / 128 / 192 / 256), T = 1k / 4k /
16k, causal and not.

    python benchmarks/fwd_config_ab.py --out DIR [--rounds 3] [--head-dims 192,256,192/128] [--seqlens 1024,4096]
        [--candidates n64_oq,dispatch+oq]   (names: CANDIDATES' and DISPATCH_OQ's; the dispatch's config always
        runs)

writes DIR/fwd_config_ab.json (rows with the GPU, torch, triton and git sha, ms and TFLOP/s) and prints a table.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from flashtriton import configs
from flashtriton.configs.forward import GLUON_BASE
from flashtriton.tools import bench_core as C

HEADS = {64: 32, 128: 16, 192: 10, 256: 8}
CANDIDATES = {
    "n32": dict(GLUON_BASE, BLOCK_N=32),
    "n64_regs": dict(GLUON_BASE, BLOCK_N=64, STORE_FROM_REGS=True),
    "n32_regs_s3": dict(GLUON_BASE, BLOCK_N=32, STORE_FROM_REGS=True, NUM_BUFFERS=3),
    "n32_q2_regs": dict(GLUON_BASE, BLOCK_N=32, Q_BUFFERS=2, STORE_FROM_REGS=True),
    "n64_q2_regs_s1": dict(GLUON_BASE, BLOCK_N=64, Q_BUFFERS=2, STORE_FROM_REGS=True, NUM_BUFFERS=1),
    "n32_q2_regs_ov": dict(GLUON_BASE, BLOCK_N=32, Q_BUFFERS=2, STORE_FROM_REGS=True, OVERLAP=True),
    "n64_oq": dict(GLUON_BASE, BLOCK_N=64, O_IN_Q=True),
    "n32_oq_s3": dict(GLUON_BASE, BLOCK_N=32, O_IN_Q=True, NUM_BUFFERS=3),
    "n64_regs_s3": dict(GLUON_BASE, BLOCK_N=64, STORE_FROM_REGS=True, NUM_BUFFERS=3),
}
DISPATCH_OQ = ("dispatch+oq", "dispatch+oq_s3")


def calls_of(T: int, D: int, Dv: int, causal: bool, wanted: set) -> tuple[dict, dict]:
    """({label: call}, {label: config}) of one case: the dispatch's config, each wanted candidate that applies,
    cuDNN."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashtriton.kernels import forward_gluon_launch as G
    from flashtriton.kernels.gluon_common import SHARED_MEMORY_LIMIT, head_block

    B, H = 16384 // T, HEADS[D]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(B, T, H, D, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(B, T, H, Dv, device="cuda", generator=gen, dtype=torch.bfloat16)
    out = torch.empty(B, T, H, Dv, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(B, H, T, device="cuda", dtype=torch.float32)

    def gluon(config):
        def call():
            G.launch_forward_gluon(q, k, v, out, lse, D ** -0.5, causal, True, config)
            return out.clone()
        return call

    dispatch = configs.gluon_fwd_config(D, T, T, causal, head_dim_v=Dv)
    calls, used = {"dispatch": gluon(dispatch)}, {"dispatch": dispatch}
    if not (dispatch["OVERLAP"] or dispatch["STORE_FROM_REGS"] or dispatch["Q_BUFFERS"] > 1 or Dv < D):
        for name, stages in zip(DISPATCH_OQ, (dispatch["NUM_BUFFERS"], 3)):
            config = dict(dispatch, O_IN_Q=True, NUM_BUFFERS=stages)
            if name in wanted and G.shared_memory_bytes(config, head_block(D)) <= SHARED_MEMORY_LIMIT:
                calls[name], used[name] = gluon(config), config
    for name, config in CANDIDATES.items():
        if name not in wanted or D <= 128 or (name.endswith("_ov") and Dv > 128) or ("_oq" in name and Dv < D):
            continue
        if G.shared_memory_bytes(config, head_block(D), head_dim_v=head_block(Dv)) > SHARED_MEMORY_LIMIT:
            continue  # (n64_regs_s3 at V tiles of 256 columns)
        calls[name], used[name] = gluon(config), config
    qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)
    calls["sdpa_cudnn"] = cudnn
    return calls, used


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--head-dims", default="192,256,192/128")
    parser.add_argument("--seqlens", default="1024,4096,16384")
    parser.add_argument("--candidates", default=",".join([*CANDIDATES, *DISPATCH_OQ]))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    wanted = {name.strip() for name in args.candidates.split(",")}
    env = C.environment()
    rows = []
    for D, Dv in C.parse_head_dims(args.head_dims):
        for causal in (False, True):
            for T in C.parse_int_list(args.seqlens, "--seqlens"):
                case = f"T={T} D={D}/{Dv}{' causal' if causal else ''}"
                calls, used = calls_of(T, D, Dv, causal, wanted)
                ref = calls["dispatch"]().float()
                bad = []
                for name in list(calls):
                    if name in ("dispatch", "sdpa_cudnn"):
                        continue
                    try:
                        err = (calls[name]().float() - ref).abs().max().item()
                    except Exception as exc:  # noqa: BLE001 (a config the kernel refuses: reported, not timed)
                        print(f"{case}: {name} failed: {str(exc)[:200]}", flush=True)
                        bad.append(name)
                        continue
                    if not err <= 2e-2 * ref.abs().max().item():
                        print(f"{case}: {name} differs from the dispatch's by {err:.3g}: not timed", flush=True)
                        bad.append(name)
                for name in bad:
                    del calls[name]
                flops = 2 * 16384 * T * HEADS[D] * (D + Dv) * (0.5 if causal else 1.0)
                times = C.time_in_rounds(calls, args.rounds)
                base = statistics.median(times["dispatch"])
                cudnn = statistics.median(times["sdpa_cudnn"])
                for name, rounds in times.items():
                    ms = statistics.median(rounds)
                    rows.append(dict(env, case=case, shape=(T, D, Dv, causal), candidate=name, ms=ms,
                                     rounds_ms=rounds, tflops=flops / ms * 1e-9, over_dispatch=base / ms,
                                     over_cudnn=cudnn / ms,
                                     config=used.get(name)))
                    print(f"{case:26s} {name:16s} {ms * 1e3:9.1f} us {flops / ms * 1e-9:6.0f} TFLOP/s  "
                          f"x{base / ms:.3f} of the dispatch's  x{cudnn / ms:.3f} of cuDNN's", flush=True)
                del calls
                C.free_memory()
    C.write_rows(args.out, "fwd_config_ab.json", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
