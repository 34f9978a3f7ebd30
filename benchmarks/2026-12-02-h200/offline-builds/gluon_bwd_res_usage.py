"""Offline sm_90 build analysis (no GPU): cuobjdump on the cubin. Run from the repository root (with a patch
of ../ applied where its .txt says), PYTHONPATH=src python THIS_FILE. Output in the matching .txt."""
import re, subprocess, tempfile, os
from flashtriton.kernels import backward_gluon_launch as BG
from flashtriton import configs
BIN = os.path.join(os.path.dirname(__import__("triton").__file__), "backends/nvidia/bin/cuobjdump")
def res(k):
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    out = subprocess.run([BIN, "-res-usage", f.name], capture_output=True, text=True).stdout
    return " ".join(sorted(set(re.findall(r"(STACK:\d+|LOCAL:\d+)", out))))
for d in (80, 96, 112, 128):
    cfg = configs.gluon_bwd_config(d, 4096, 4096, True)
    for kernel in ("dkdv", "dq"):
        for varlen in (False, True):
            k = BG.compile_for_sm90(d, True, cfg[kernel], kernel=kernel, varlen=varlen)
            print(d, kernel, "varlen" if varlen else "dense", res(k), flush=True)
