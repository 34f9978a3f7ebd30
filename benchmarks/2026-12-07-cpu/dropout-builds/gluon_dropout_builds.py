"""Offline sm_90a builds of the Gluon dropout kernels (forward under configs.GLUON_DROPOUT_FWD's rules, both
backward kernels under configs.gluon_bwd_config's) beside the same configs without dropout: bytes of spill stores
(ptxas -v) and SASS instructions of the whole kernel (cuobjdump). A diagnostic of code size, not a measurement of
time. From the repository root: `env -u TRITON_INTERPRET PYTHONPATH=src python
benchmarks/2026-12-07-cpu/dropout-builds/gluon_dropout_builds.py`."""
import os
import re
import subprocess
import tempfile

import torch
import triton

from flashtriton import configs
from flashtriton.configs import backward as cb, forward as cf
from flashtriton.kernels import backward_gluon_launch, forward_gluon_launch
from flashtriton.kernels.variant import Variant

cf.GLUON_DROPOUT = cf.GLUON_DROPOUT_ALL = True
cb.GLUON_BWD_DROPOUT = cb.GLUON_BWD_DROPOUT_ALL = True
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def report(compiled):
    """(bytes of spill stores, SASS instructions) of a compiled kernel."""
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        open(ptx, "w").write(compiled.asm["ptx"])
        open(cubin, "wb").write(compiled.asm["cubin"])
        ptxas = subprocess.run([os.path.join(BIN, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", os.devnull],
                               capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    spill = max(int(n) for n in re.findall(r"(\d+) bytes spill stores", ptxas))
    return spill, len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+\S", sass, re.M))


def main():
    rows = []
    for d, causal, keys in ((128, False, 16384), (128, True, 1024), (64, False, 16384)):
        config = cf.gluon_fwd_config(d, keys, keys, causal, dropout=True)
        for p in (0.0, 0.1):
            variant = Variant.of(causal, dropout_p=p)
            compiled = forward_gluon_launch.compile_for_sm90(d, causal, config, variant=variant)
            rows.append(("forward", d, causal, p) + report(compiled))
    for kernel, d, causal, varlen in (("dkdv", 64, False, False), ("dq", 64, True, True), ("dq", 128, False, False),
                                      ("dq", 128, True, False), ("dkdv", 128, False, False), ("dkdv", 128, True, False)):
        config = configs.gluon_bwd_config(d, 4096, 4096, causal, varlen=varlen, dropout=True)[kernel]
        for p in (0.0, 0.1):
            compiled = backward_gluon_launch.compile_for_sm90(d, causal, config, torch.bfloat16, kernel, varlen,
                                                              dropout_p=p)
            rows.append((kernel + (" varlen" if varlen else ""), d, causal, p) + report(compiled))
    print("Offline sm_90a builds (triton 3.6, its ptxas and cuobjdump; no GPU), bf16: bytes of spill stores and SASS")
    print("instructions of the whole kernel. A diagnostic of code size, not a measurement of time.")
    print(f"{'kernel':12s} {'D':>4s} {'causal':>6s} {'p':>4s} {'spill B':>8s} {'SASS':>6s}")
    for r in rows:
        print(f"{r[0]:12s} {r[1]:4d} {str(r[2]):>6s} {r[3]:4.1f} {r[4]:8d} {r[5]:6d}")


if __name__ == "__main__":
    main()
