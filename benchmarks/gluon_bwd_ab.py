"""A/B of Gluon backward configs on chosen shapes: each candidate's time against the dispatch's config, same run.

Cases (`--cases`, comma list of CASES' names):
  window1024, window4096   B=1 H=16 T=16384 D=128 bf16 causal, window (w - 1, 0): issue 25's window backward
  dense16k                 the same shape causal without a window (the window's reference)
  dense4k, dense4k_full    B=4 H=16 T=4096 D=128 bf16, causal / not
  dense4k_d64(_full)       B=4 H=32 T=4096 D=64 bf16, causal / not
  softcap4k                B=4 H=16 T=4096 D=128 bf16 causal, softcap 50
  mla, mla_causal          QK 192 / V 128 (DeepSeek's MLA), B=4 H=10 T=4096 bf16, non-causal / causal
Candidates per case: the dispatch's config (`configs.gluon_bwd_config`) and the overrides of CANDIDATES[case] on it
(constexprs of the dK/dV or the dQ kernel: NUM_STAGES, BLOCK_N, ...; "switches": `configs.backward`'s module
switches set for the candidate's calls). Each candidate's gradients are checked against
the dispatch config's (the same sums: equal but for the order of additions, judged at 1e-2 of their scale; the table
says where they are not bitwise equal), then the
backward (`torch.autograd.grad` of one forward, retained) is timed by `triton.testing.do_bench` (L2 flushed), median
of `--rounds` rounds in rotating order after a warmup, and each kernel's device time per call read by torch.profiler
over 5 calls, median of `--rounds` readings in rotating order (the preprocess, dK/dV, dQ; a candidate read right after
the timing rounds reads 3-6 % high, so no candidate always goes first). Prints a table and writes
DIR/gluon_bwd_ab.json with the GPU, torch, triton and git sha.

    python benchmarks/gluon_bwd_ab.py --out DIR [--cases window1024,mla_causal] [--rounds 5] [--labels "split dQ"]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton

import flashtriton
from flashtriton import configs
from flashtriton.tools import bench_core as C

CASES = {  # name: (B, H, T, D, Dv, causal, window)
    "window1024": (1, 16, 16384, 128, 128, True, (1023, 0)),
    "dense16k": (1, 16, 16384, 128, 128, True, (-1, -1)),
    "dense4k": (4, 16, 4096, 128, 128, True, (-1, -1)),
    "dense4k_full": (4, 16, 4096, 128, 128, False, (-1, -1)),
    "dense4k_d64": (4, 32, 4096, 64, 64, True, (-1, -1)),
    "softcap4k": (4, 16, 4096, 128, 128, True, (-1, -1), 50.0),
    "dense4k_d64_full": (4, 32, 4096, 64, 64, False, (-1, -1)),
    "window4096": (1, 16, 16384, 128, 128, True, (4095, 0)),
    "mla": (4, 10, 4096, 192, 128, False, (-1, -1)),
    "mla_causal": (4, 10, 4096, 192, 128, True, (-1, -1)),
}
SPLIT = {"unsplit, 2 stages": {"dkdv": dict(NUM_STAGES=2, SPLIT=0)},
         "unsplit, 3 stages": {"dkdv": dict(NUM_STAGES=3, SPLIT=0)},
         "split, 2 stages": {"dkdv": dict(NUM_STAGES=2, SPLIT=1)},
         "split, 3 stages": {"dkdv": dict(NUM_STAGES=3, SPLIT=1)},
         "split late dP, 2 stages": {"dkdv": dict(NUM_STAGES=2, SPLIT=2)},
         "split dQ": {"dq": dict(SPLIT=1)},
         # the preprocess as a kernel of its own, dK/dV, then dQ (what runs with a sink or varlen)
         "preprocess kernel": {"switches": dict(GLUON_BWD_FUSED_DELTA=False)}}
CANDIDATES = {  # name: {label: {"dkdv": overrides, "dq": overrides}}
    "dense16k": SPLIT,
    "dense4k": SPLIT,
    "dense4k_full": {"dK/dV 3 stages": {"dkdv": dict(NUM_STAGES=3)}, "dQ 3 stages": {"dq": dict(NUM_STAGES=3)}},
    "dense4k_d64": dict(SPLIT, **{"K/V from shared memory": {"dkdv": dict(KV_REGS=0)}}),
    "softcap4k": SPLIT,
    "window1024": SPLIT,
    "window4096": SPLIT,
    # D=64 non-causal: the standard sweep's lowest backward points (0.74-0.87x cuDNN at T >= 4k on an H100)
    "dense4k_d64_full": {"dK/dV 3 stages": {"dkdv": dict(NUM_STAGES=3)}, "dQ 3 stages": {"dq": dict(NUM_STAGES=3)},
                         "dQ 64-key tiles": {"dq": dict(BLOCK_N=64)},
                         "dQ 64-key tiles, 3 stages": {"dq": dict(BLOCK_N=64, NUM_STAGES=3)},
                         "preprocess kernel": SPLIT["preprocess kernel"],
                         # Sᵀ's and dPᵀ's A operands (K, V) read from shared memory at every tile (KV_REGS off)
                         "K/V from shared memory": {"dkdv": dict(KV_REGS=0)}},
    "mla": {"dK/dV 3 stages": {"dkdv": dict(NUM_STAGES=3)}, "dQ 3 stages": {"dq": dict(NUM_STAGES=3)},
            "dQ 64-key tiles": {"dq": dict(BLOCK_N=64)}},
    "mla_causal": {"dK/dV 3 stages": {"dkdv": dict(NUM_STAGES=3)}, "dQ 3 stages": {"dq": dict(NUM_STAGES=3)},
                   "dQ 64-key tiles": {"dq": dict(BLOCK_N=64)}},
}


def backward_call(case, config, switches=None):
    """(call, grads): the timed backward of one forward of `case` under the Gluon config `config` and
    `configs.backward`'s switches as `switches` ({name: value}) sets them."""
    switches = switches or {}
    B, H, T, D, Dv, causal, window = CASES[case][:7]
    softcap = CASES[case][7] if len(CASES[case]) > 7 else 0.0
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(B, T, H, D, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
            for _ in range(2))
    v = torch.randn(B, T, H, Dv, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
    dout = torch.randn(B, T, H, Dv, device="cuda", generator=gen, dtype=torch.bfloat16)
    out = flashtriton.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap)

    def fixed(*a, **kw):  # one function per candidate: the backward keeps its plan under it (`backward._plan_key`)
        return config

    def call():
        with C.switched(configs, gluon_bwd_config=fixed), C.switched(configs.backward, **switches):
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    return call, call()


def kernel_times(call, calls: int = 10) -> dict:
    """{kernel name: device time per call (us)} of `calls` calls of `call` (torch.profiler), after one warm call."""
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
        if total and event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.key[:40]] = total / calls
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--labels", default="", help="comma list: only these candidates beside the dispatch's")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    env = C.environment()
    rows = []
    for case in args.cases.split(","):
        B, H, T, D, Dv, causal, window = CASES[case][:7]
        softcap = CASES[case][7] if len(CASES[case]) > 7 else 0.0
        base = configs.gluon_bwd_config(D, T, T, causal, head_dim_v=Dv, window=window != (-1, -1),
                                        softcap=softcap > 0)
        candidates, switches = {"dispatch": base}, {}
        for label, over in CANDIDATES[case].items():
            if args.labels and label not in args.labels.split(","):
                continue
            candidates[label] = {kernel: dict(base[kernel], **over.get(kernel, {})) for kernel in ("dkdv", "dq")}
            switches[label] = over.get("switches", {})
        calls, reference, bitwise = {}, None, {}
        for label, config in candidates.items():
            calls[label], grads = backward_call(case, config, switches.get(label))
            if reference is None:
                reference = grads
            bitwise[label] = all(torch.equal(g, r) for g, r in zip(grads, reference))
            for name, g, r in zip(("dq", "dk", "dv"), grads, reference):
                scale = r.float().abs().max().item()
                err = (g.float() - r.float()).abs().max().item()
                if not err <= 1e-2 * scale:
                    raise AssertionError(f"{case} {label}: {name} differs from the dispatch config's by {err:.3g}")
        times = {label: [] for label in calls}
        labels = list(calls)
        for fn in calls.values():
            triton.testing.do_bench(fn, warmup=100, rep=100)
        for r in range(args.rounds):
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                times[label].append(triton.testing.do_bench(calls[label], warmup=10, rep=100))
        ms = {label: statistics.median(t) for label, t in times.items()}
        readings = {label: [] for label in labels}  # kernel times in rotating order too (the first reads high)
        for r in range(args.rounds):
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                readings[label].append(kernel_times(calls[label], calls=5))
        for label in labels:
            kernels = {name: statistics.median(reading.get(name, 0.0) for reading in readings[label])
                       for name in readings[label][0]}
            rows.append(dict(env, case=case, shape=CASES[case], candidate=label, config=candidates[label],
                             switches=switches.get(label, {}),
                             ms=ms[label], times=times[label], over_dispatch=ms["dispatch"] / ms[label],
                             bitwise_equal=bitwise[label],
                             kernel_us=kernels))
            print(f"{case:12s} {label:20s} {ms[label]:8.3f} ms  x{ms['dispatch'] / ms[label]:.3f} of the dispatch's"
                  f"{'' if bitwise[label] else ' (gradients not bitwise equal)'}"
                  f"  ({', '.join(f'{k}: {t:.0f} us' for k, t in sorted(kernels.items()))})", flush=True)
    C.write_rows(args.out, "gluon_bwd_ab.json", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
