"""Probe (session 15): the backward at bf16 D=128 non-causal T=512 (B=32, H=16) read 0.64-0.68 of cuDNN in the
sweeps of 3382976 and 6e71801 with a wide spread (p20/p50/p80 0.63/0.80/0.84 ms), and 1.04 in 3014340's; fp16 at the
same point reads 1.00. Per dtype: do_bench of `out.backward` as the sweep times it (100 ms warmup), then
torch.profiler over 30 calls: each kernel's GPU time, summed per call, against the wall time per call."""
import sys
import time

import torch
import triton.testing

sys.path.insert(0, "src")
import flashtriton  # noqa: E402

B, T, H, D = 32, 512, 16, 128
for dtype in (torch.bfloat16, torch.float16, torch.bfloat16):
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    out = flashtriton.flash_attn_func(q, k, v)
    dout = torch.randn_like(out)
    fn = lambda: out.backward(dout, retain_graph=True)  # noqa: E731
    ms = triton.testing.do_bench(fn, warmup=100, rep=40, grad_to_none=[q, k, v], quantiles=[0.2, 0.5, 0.8])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(30):
        for t in (q, k, v):
            t.grad = None
        fn()
    t_host = (time.perf_counter() - t0) / 30 * 1e3
    torch.cuda.synchronize()
    t_all = (time.perf_counter() - t0) / 30 * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(30):
            for t in (q, k, v):
                t.grad = None
            fn()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(e.name[:70], []).append(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
    print(f"{str(dtype)[6:]}: do_bench p20/p50/p80 {[round(x, 3) for x in ms]} ms; host issue {t_host:.3f} ms/call, "
          f"wall {t_all:.3f} ms/call", flush=True)
    for name, ts in sorted(kernels.items(), key=lambda kv: -sum(kv[1])):
        ts_sorted = sorted(ts)
        print(f"   {len(ts):3d}x {sum(ts) / 30:8.1f} us/call  min {ts_sorted[0]:7.1f} med {ts_sorted[len(ts) // 2]:7.1f} "
              f"max {ts_sorted[-1]:7.1f}  {name}", flush=True)
