"""A/B of two source trees' backward: run as `python _d8/ab_bwd.py LABEL` with PYTHONPATH at one tree's src;
prints one JSON line {label, case: [median us of the backward, {kernel: us}]}."""
import json, sys, torch, triton
import flashtriton
sys.path.insert(0, "benchmarks")
CASES = {  # B, H, T, D, causal, window, softcap
    "d128_causal_4k": (4, 16, 4096, 128, True, (-1, -1), 0.0),
    "d128_full_4k": (4, 16, 4096, 128, False, (-1, -1), 0.0),
    "d64_causal_4k": (4, 32, 4096, 64, True, (-1, -1), 0.0),
    "d128_causal_16k": (1, 16, 16384, 128, True, (-1, -1), 0.0),
    "softcap_4k": (4, 16, 4096, 128, True, (-1, -1), 50.0),
    "window4096_16k": (1, 16, 16384, 128, True, (4095, 0), 0.0),
}
res = {"label": sys.argv[1], "gpu": torch.cuda.get_device_name()}
for name, (B, H, T, D, causal, window, softcap) in CASES.items():
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    dout = torch.randn(B, T, H, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    out = flashtriton.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap)
    call = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    g = call()
    chk = [float(x.float().norm()) for x in g]
    ms = triton.testing.do_bench(call, warmup=100, rep=400, return_mode="median")
    from gluon_bwd_ab import kernel_times
    res[name] = [round(ms * 1000, 1), {k: round(t, 1) for k, t in kernel_times(call).items()}, chk]
print(json.dumps(res))
