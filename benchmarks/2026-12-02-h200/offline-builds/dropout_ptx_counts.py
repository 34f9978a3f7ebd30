"""PTX instruction counts of the portable kernels with dropout (D=128, fp16, sm_90 builds on a CPU through
tests/sm90_builds.py): run from the repository root, PYTHONPATH=src python THIS_FILE."""
import sys, re
sys.argv=[sys.argv[0]]
sys.path.insert(0, "tests")
import sm90_builds as H
import torch, flashtriton, triton
from triton.runtime.jit import JITFunction
kernels = {}
orig = H._run
def run(self, *args, grid, warmup, **kw):
    k = orig(self, *args, grid=grid, warmup=True, **kw)
    kernels.setdefault(self.fn.__name__, k)
JITFunction.run = run
q, k, v = (torch.randn(1, 512, 8, 128, dtype=torch.float16, requires_grad=True) for _ in range(3))
flashtriton.flash_attn_func(q, k, v, dropout_p=0.1).sum().backward()
for name, kern in kernels.items():
    ptx = kern.asm["ptx"]
    n = lambda pat: len(re.findall(pat, ptx))
    print(f"{name}: lines {ptx.count(chr(10))} mul.hi {n(r'mul.hi')} st.shared {n(r'st.shared')} ld.shared {n(r'ld.shared')} bar {n(r'bar.sync')}")
