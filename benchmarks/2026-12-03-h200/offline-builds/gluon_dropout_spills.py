"""Offline sm_90 builds of the Gluon kernels' dropout (no GPU): bytes of spill stores (`ptxas -v`, triton 3.6's
ptxas) of the forward under each config rule a dropout call can take and of both backward kernels, each beside the
same build without dropout. `PYTHONPATH=src python benchmarks/2026-12-03-h200/offline-builds/gluon_dropout_spills.py`."""
import re
import subprocess
import tempfile

import torch
from triton.backends.nvidia.compiler import get_ptxas

from flashtriton import configs
from flashtriton.configs import forward as cf
from flashtriton.kernels import backward_gluon_launch as B
from flashtriton.kernels import forward_gluon_launch as F
from flashtriton.kernels.variant import Variant


def spills(compiled) -> int:
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"]); f.flush()
        report = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                                capture_output=True, text=True, check=True).stderr
    return max(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))


print("bytes of spill stores, without / with dropout (p = 0.1), bf16")
forward = [("flat loop (GLUON_DROPOUT_FWD), D=128", 128, False, False, cf.GLUON_SHORT),
           ("flat loop (GLUON_DROPOUT_FWD), D=128 causal", 128, True, False, cf.GLUON_SHORT),
           ("flat loop (GLUON_DROPOUT_FWD), D=64", 64, False, False, cf.GLUON_SHORT_D64),
           ("item by item (GLUON_BASE), D=128", 128, False, False, cf.GLUON_BASE),
           ("three consumers (GLUON_THREE), D=64", 64, False, False, cf.GLUON_THREE),
           ("D=256, 32-key tiles (GLUON_D256)", 256, False, False, cf.GLUON_D256),
           ("D=256, 64-key tiles (GLUON_D256_N64)", 256, False, False, cf.GLUON_D256_N64),
           ("varlen (GLUON_DYNAMIC), D=128 causal", 128, True, True, cf.GLUON_DYNAMIC)]
for name, d, causal, varlen, config in forward:
    counts = [spills(F.compile_for_sm90(d, causal, config, varlen=varlen, variant=Variant.of(causal, dropout_p=p)))
              for p in (0.0, 0.1)]
    print(f"forward  {name:45s} {counts[0]:5d} {counts[1]:5d}", flush=True)
for kernel, d, causal, varlen in (("dkdv", 64, False, False), ("dq", 64, True, True), ("dkdv", 128, False, False),
                                  ("dkdv", 128, True, False), ("dq", 128, False, False), ("dq", 128, True, True)):
    config = configs.gluon_bwd_config(d, 4096, 4096, causal, varlen=varlen)[kernel]
    counts = [spills(B.compile_for_sm90(d, causal, config, torch.bfloat16, kernel, varlen, dropout_p=p))
              for p in (0.0, 0.1)]
    name = f"{kernel} D={d}" + (" causal" if causal else "") + (" varlen" if varlen else "")
    print(f"backward {name:45s} {counts[0]:5d} {counts[1]:5d}", flush=True)
