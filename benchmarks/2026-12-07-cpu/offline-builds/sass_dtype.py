"""The Gluon backward's dK/dV and dQ builds (the dispatch's configs, D = 64 / 128, non-causal) for sm_90 in fp16 and in
bf16, offline: their SASS instruction counts and the opcodes whose counts differ (sass_fp16_bf16.txt). Needs
cuobjdump (Triton's bundled one) on PATH; run without TRITON_INTERPRET."""
import re, subprocess, tempfile, os, collections, torch
from flashtriton import configs
from flashtriton.kernels import backward_gluon_launch as L, forward_gluon_launch as F
def sass_counts(k):
    cubin = k.asm["cubin"]
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f: f.write(cubin)
    out = subprocess.run(["cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
    ops = collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", out, re.M))
    return ops
for D, cfg in ((64, configs.backward.GLUON_BWD_D64), (128, configs.backward.GLUON_BWD_D128)):
    for kernel in ("dkdv", "dq"):
        res = {}
        for dt in (torch.float16, torch.bfloat16):
            k = L.compile_for_sm90(D, False, cfg[kernel], dtype=dt, kernel=kernel)
            res[dt] = sass_counts(k)
        a, b = res[torch.float16], res[torch.bfloat16]
        print(D, kernel, "fp16 total", sum(a.values()), "bf16 total", sum(b.values()))
        diff = {op: (a[op], b[op]) for op in set(a) | set(b) if a[op] != b[op]}
        print("   ", sorted(diff.items(), key=lambda x: -abs(x[1][0]-x[1][1]))[:12])
