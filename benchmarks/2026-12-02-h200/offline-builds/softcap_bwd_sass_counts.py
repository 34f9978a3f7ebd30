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
    sass = subprocess.run([BIN, "-sass", f.name], capture_output=True, text=True).stdout
    return " ".join(sorted(set(re.findall(r"(STACK:\d+)", out)))), "EX2", sass.count("MUFU.EX2"), "TANH", sass.count("MUFU.TANH"), "STS", sass.count("STS"), "LDS", sass.count("LDS")
cfg = configs.gluon_bwd_config(128, 4096, 4096, True)
for kernel in ("dkdv", "dq"):
    k = BG.compile_for_sm90(128, True, cfg[kernel], kernel=kernel, softcap=30.0)
    print(kernel, res(k), flush=True)
