"""Offline sm_90 build analysis (no GPU): cuobjdump on the cubin. Run from the repository root (with a patch
of ../ applied where its .txt says), PYTHONPATH=src python THIS_FILE. Output in the matching .txt."""
import re, subprocess, tempfile, os
from flashtriton.kernels import forward_gluon_launch as G
from flashtriton.kernels.variant import Variant
from flashtriton.configs.forward import GLUON_BASE, GLUON_SHORT
BIN = os.path.join(os.path.dirname(__import__("triton").__file__), "backends/nvidia/bin/cuobjdump")
DIS = os.path.join(os.path.dirname(__import__("triton").__file__), "backends/nvidia/bin/nvdisasm")
def res(k):
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    out = subprocess.run([BIN, "-res-usage", f.name], capture_output=True, text=True).stdout
    sass = subprocess.run([BIN, "-sass", f.name], capture_output=True, text=True).stdout
    return " ".join(sorted(set(re.findall(r"(STACK:\d+)", out)))), sass.count("MUFU.EX2"), sass.count("MUFU.TANH"), sass.count("STS"), sass.count("LDS"), len(sass.splitlines())
for cfg in (GLUON_SHORT, GLUON_BASE):
    v = Variant.of(True, True, (-1, -1), 30.0)
    k = G.compile_for_sm90(128, True, cfg, variant=v)
    print("softcap", cfg["OVERLAP"], res(k), flush=True)
