"""Offline sm_90a builds of the portable (Triton) kernels with dropout (p = 0.1) and without, as a bf16
flash_attn_func call (B=2, T=1024, H=4, D=64) and its backward launch them (tests/sm90_builds.py's compile-only
launches): bytes of spill stores (cuobjdump's STACK) and SASS instructions of each kernel. A diagnostic of code size,
not a measurement of time. From the repository root: `PYTHONPATH=src python
benchmarks/2026-12-07-cpu/dropout-builds/portable_dropout_builds.py` (no TRITON_INTERPRET)."""
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, "tests")
import sm90_builds  # noqa: E402  (compile-only launches for sm_90; must come before flashtriton)
import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import flashtriton  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
KEPT = {}


def _keep(self, *args, grid, warmup, **kwargs):
    KEPT.setdefault(self.fn.__name__, sm90_builds._run(self, *args, grid=grid, warmup=True, **kwargs))


def report(kernel):
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        open(cubin, "wb").write(kernel.asm["cubin"])
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
    return int(re.search(r"STACK:(\d+)", usage).group(1)), len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+\S", sass, re.M))


def main():
    JITFunction.run = _keep
    print("Offline sm_90a builds of the portable kernels (triton 3.6; no GPU), bf16 B=2 T=1024 H=4 D=64: STACK bytes")
    print("and SASS instructions. A diagnostic of code size, not a measurement of time.")
    print(f"{'kernel':16s} {'p':>4s} {'stack B':>8s} {'SASS':>6s}")
    for p in (0.0, 0.1):
        KEPT.clear()
        q, k, v = (torch.randn(2, 1024, 4, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        flashtriton.flash_attn_func(q, k, v, dropout_p=p).sum().backward()
        for name, kernel in KEPT.items():
            stack, sass = report(kernel)
            print(f"{name:16s} {p:4.1f} {stack:8d} {sass:6d}")


if __name__ == "__main__":
    main()
