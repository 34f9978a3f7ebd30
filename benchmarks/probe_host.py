"""Probe (session 15): where the host time of one backward call goes. probe_bwd512 found the backward at bf16/fp16
D=128 non-causal T=512 issuing at 0.52-1.03 ms of host time per call against 0.47 ms of GPU time, so that the sweep
timed the host there. cProfile over 200 backward calls (and 200 forward calls for comparison), top entries by own
time and by cumulative time."""
import cProfile
import pstats
import sys
import time

import torch

sys.path.insert(0, "src")
import flashtriton  # noqa: E402

B, T, H, D = 32, 512, 16, 128
q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
out = flashtriton.flash_attn_func(q, k, v)
dout = torch.randn_like(out)


def backward_calls(n):
    for _ in range(n):
        for t in (q, k, v):
            t.grad = None
        out.backward(dout, retain_graph=True)


def forward_calls(n):
    with torch.no_grad():
        for _ in range(n):
            flashtriton.flash_attn_func(q, k, v)


for name, fn in (("backward", backward_calls), ("forward", forward_calls)):
    fn(20)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(200)
    t_host = (time.perf_counter() - t0) / 200 * 1e3
    torch.cuda.synchronize()
    print(f"== {name}: host {t_host:.3f} ms/call, wall {(time.perf_counter() - t0) / 200 * 1e3:.3f} ms/call", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    fn(200)
    prof.disable()
    torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=sys.stdout).sort_stats(key).print_stats(28)
