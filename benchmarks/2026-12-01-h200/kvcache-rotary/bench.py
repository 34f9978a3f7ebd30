"""Decode step: GPU time (CUDA-graph replay) and eager wall time per call, with and without rotary / left padding."""
import json, math, os, time
import torch, triton
from flashtriton.kvcache import flash_attn_with_kvcache
rows = []
for batch, cap in ((1, 4096), (8, 32768)):
    dev = "cuda"
    q = torch.randn(batch, 1, 32, 128, device=dev, dtype=torch.float16)
    kc = torch.randn(batch, cap, 8, 128, device=dev, dtype=torch.float16); vc = torch.randn_like(kc)
    k = torch.randn(batch, 1, 8, 128, device=dev, dtype=torch.float16); v = torch.randn_like(k)
    lens = torch.full((batch,), cap - 2, dtype=torch.int32, device=dev)
    pad = torch.full((batch,), 7, dtype=torch.int32, device=dev)
    ang = torch.rand(cap, 64, device=dev) * 2 * math.pi
    cos, sin = ang.cos().half(), ang.sin().half()
    cases = {"plain": {}, "rotary": dict(rotary_cos=cos, rotary_sin=sin), "leftpad": dict(cache_leftpad=pad),
             "rotary+leftpad": dict(rotary_cos=cos, rotary_sin=sin, cache_leftpad=pad)}
    with torch.no_grad():
        for rnd in range(3):
            for name, extra in (list(cases.items()) if rnd % 2 == 0 else list(cases.items())[::-1]):
                fn = lambda: flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=True, **extra)
                for _ in range(20): fn()
                torch.cuda.synchronize(); t = time.perf_counter()
                for _ in range(300): fn()
                torch.cuda.synchronize(); wall = (time.perf_counter() - t) / 300 * 1e6
                g = torch.cuda.CUDAGraph()
                s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    fn()
                torch.cuda.current_stream().wait_stream(s)
                with torch.cuda.graph(g):
                    fn()
                gpu = triton.testing.do_bench(g.replay, warmup=50, rep=200, return_mode="median") * 1e3
                if rnd:
                    rows.append(dict(batch=batch, cache=cap, case=name, eager_us=wall, graph_us=gpu))
for r in rows:
    print(f"batch {r['batch']} cache {r['cache']:>6} {r['case']:>15}: eager {r['eager_us']:7.1f} us  graph {r['graph_us']:7.1f} us")
out = os.environ.get("OUT")
if out:
    json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, rows=rows),
              open(os.path.join(out, "rotary_bench.json"), "w"), indent=1)
