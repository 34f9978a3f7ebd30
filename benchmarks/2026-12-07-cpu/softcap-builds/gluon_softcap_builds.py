"""Offline sm_90a builds of the Gluon backward kernels at D=128 causal with softcap and without (the dK/dV and dQ
configs the dispatch gives softcap; SPLIT on in both builds of each kernel): SASS instructions of the whole kernel
and the opcodes that differ most. A diagnostic of code size, not a measurement of time. From the repository root:
`env -u TRITON_INTERPRET PYTHONPATH=src python benchmarks/2026-12-07-cpu/softcap-builds/gluon_softcap_builds.py`."""
import collections
import os
import re
import subprocess
import tempfile

import torch
import triton

from flashtriton import configs
from flashtriton.kernels import backward_gluon_launch

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def opcodes(compiled):
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        open(cubin, "wb").write(compiled.asm["cubin"])
        sass = subprocess.run([CUOBJDUMP, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)
    return collections.Counter(ops)


def main():
    print("Offline sm_90a builds (triton 3.6; no GPU), bf16, D=128 causal: SASS instructions, softcap 30 against none")
    config = configs.gluon_bwd_config(128, 4096, 4096, True, softcap=True)
    for kernel in ("dkdv", "dq"):
        builds = {}
        for cap in (0.0, 30.0):
            builds[cap] = opcodes(backward_gluon_launch.compile_for_sm90(128, True, dict(config[kernel]),
                                                                         torch.bfloat16, kernel, softcap=cap))
        dense, capped = builds[0.0], builds[30.0]
        total0, total1 = sum(dense.values()), sum(capped.values())
        print(f"\n{kernel} {config[kernel]}: {total0} -> {total1} ({total1 / total0 - 1:+.1%})")
        for op in sorted(set(dense) | set(capped), key=lambda o: -abs(capped[o] - dense[o]))[:6]:
            print(f"  {op:24s} {dense[op]:6d} {capped[op]:6d}")


if __name__ == "__main__":
    main()
