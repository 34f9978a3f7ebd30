"""A/B of the Gluon forward on packed (varlen) batches at the tile widths `configs.GLUON_VARLEN_FWD` has no row
for (64 and 256 columns: D = 64, 192, 256; QK 192 / V 128, DeepSeek's MLA), against what the dispatch runs there
without one (the TMA forward at D=64, the portable forward at 192 / 256 and 192 / 128), beside torch's
FlashAttention-2 varlen forward (`aten._flash_attention_forward` with cumulative lengths, SDPA's FLASH backend) and,
for scale, SDPA's cuDNN on a dense batch of the same tokens (T = 2048).

The batch is the varlen suite's (64 sequences, lengths uniform in 1..4096, seed 0), bf16, H · D ≈ 2048 (H = 32 / 10 /
8 at D = 64 / 192 / 256, 10 at 192 / 128), causal and not. Each candidate's output is checked against float32 attention per sequence
on the first two heads (within 2e-2 of its scale), then the forwards are timed by `triton.testing.do_bench`
(L2 flushed) in rounds whose order rotates (`bench_core.time_in_rounds`). TFLOP/s count the useful work (the sum
over sequences).

    python benchmarks/varlen_wide_ab.py --out DIR [--rounds 3] [--head-dims 64,192,256,192/128]

writes DIR/varlen_wide_ab.json and prints a table.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import flashtriton
from flashtriton import configs
from flashtriton.configs import forward as F
from flashtriton.kernels.host import gluon_tile_width
from flashtriton.tools import bench_core as C
from flashtriton.tools.bench_suites import packed_reference, varlen_seqlens

HEADS = {64: 32, 128: 16, 192: 10, 256: 8}
DYNAMIC = dict(CAUSAL_PAIRS=False, DYNAMIC=True)
# Candidates per tile width: the packed-batch rule of D=128 (items from a counter) on each width's dense tiles.
CANDIDATES = {
    64: {"gluon dynamic": dict(F.GLUON_DYNAMIC), "gluon short d64": dict(F.GLUON_SHORT_D64, **DYNAMIC)},
    256: {"gluon n64": dict(F.GLUON_D256_N64, **DYNAMIC), "gluon n32": dict(F.GLUON_D256, **DYNAMIC),
          "gluon n32 3 stages": dict(F.GLUON_D256, NUM_BUFFERS=3, **DYNAMIC)},
    (256, 128): {"gluon n64": dict(F.GLUON_D256_V128, **DYNAMIC)},
}


def calls_of(D: int, Dv: int, causal: bool, n: int, max_len: int) -> tuple[dict, dict, torch.Tensor]:
    lens = varlen_seqlens(n, max_len, 0)
    cu_list = [0]
    for t in lens:
        cu_list.append(cu_list[-1] + t)
    cu = torch.tensor(cu_list, dtype=torch.int32, device="cuda")
    total, Tmax, H = cu_list[-1], max(lens), HEADS[D]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(total, H, D, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(total, H, Dv, device="cuda", generator=gen, dtype=torch.bfloat16)
    ref = packed_reference(q, k, v, None, cu_list, causal, 2, False)["out"]

    def ours(config=None):  # the dispatch's kernel, or the Gluon forward under `config`
        rule = {} if config is None else {"gluon_varlen_config": lambda *a, **kw: config}

        def call():
            with C.switched(configs, **rule), torch.no_grad():
                return flashtriton.flash_attn_varlen_func(q, k, v, cu, cu, Tmax, Tmax, causal=causal)
        return call

    def fa2():
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, Tmax, Tmax, 0.0, causal, False,
                                                       scale=D ** -0.5)[0]

    B = total // 2048
    qd, kd, vd = (t[:B * 2048].view(B, 2048, H, t.shape[-1]).transpose(1, 2) for t in (q, k, v))

    def cudnn_dense():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=causal)

    tiles = gluon_tile_width(D) if Dv == D else (gluon_tile_width(D), gluon_tile_width(Dv))
    calls = {"dispatch": ours(), **{name: ours(c) for name, c in CANDIDATES[tiles].items()}}
    if Dv == D:  # (FLASH's varlen forward wants V's head dim to be QK's)
        calls["sdpa_flash varlen"] = fa2
    scale = (D + Dv) / (2 * D)  # the FLOPs of Q Kᵀ at D and of P V at Dv
    flops = {name: C.varlen_flops(lens, H, D, causal, "fwd") * scale for name in calls}
    calls["sdpa_cudnn dense T=2048"] = cudnn_dense
    flops["sdpa_cudnn dense T=2048"] = C.attention_flops(B, H, 2048, D, causal, "fwd") * scale
    return calls, flops, ref


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--head-dims", default="64,192,256,192/128")
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    env = C.environment()
    rows = []
    for D, Dv in C.parse_head_dims(args.head_dims):
        for causal in (True, False):
            case = f"D={D}{'' if Dv == D else f'/{Dv}'}{' causal' if causal else ''}"
            calls, flops, ref = calls_of(D, Dv, causal, args.n, args.max_len)
            checked = {}
            for name, call in calls.items():
                if name.startswith("sdpa_cudnn"):
                    continue
                try:
                    got = call()[:, :2].float()
                    err = (got - ref).abs().max().item()
                    checked[name] = err <= 2e-2 * ref.abs().max().item()
                    print(f"{case}: {name} max error {err:.3g} ({'ok' if checked[name] else 'WRONG'})", flush=True)
                except Exception as exc:  # noqa: BLE001  (a candidate that does not launch is reported, not timed)
                    checked[name] = False
                    print(f"{case}: {name} failed: {C.short_error(exc)}", flush=True)
            timed = {name: call for name, call in calls.items() if checked.get(name, True)}
            times = C.time_in_rounds(timed, args.rounds)
            base = statistics.median(times["dispatch"]) if "dispatch" in times else None
            for name in calls:
                if name not in times:
                    rows.append(dict(env, case=case, candidate=name, ok=False))
                    continue
                ms = statistics.median(times[name])
                tflops = flops[name] / ms * 1e-9
                rows.append(dict(env, case=case, head_dim=D, head_dim_v=Dv, causal=causal, candidate=name, ok=True,
                                 ms=ms, rounds_ms=times[name], tflops=tflops, over_dispatch=base / ms if base else None))
                print(f"{case:12s} {name:26s} {ms * 1e3:9.1f} us {tflops:6.0f} TFLOP/s"
                      + (f"  x{base / ms:.3f} of the dispatch's" if base else ""), flush=True)
            del calls, ref
            C.free_memory()
    C.write_rows(args.out, "varlen_wide_ab.json", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
