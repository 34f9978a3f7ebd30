"""Offline sm_90 build analysis (no GPU): cuobjdump on the cubin. Run from the repository root (with a patch
of ../ applied where its .txt says), PYTHONPATH=src python THIS_FILE. Output in the matching .txt."""
import re, sys, time, subprocess, tempfile, os
import torch
from flashtriton.kernels import forward_gluon_launch as G
from flashtriton.configs.forward import GLUON_BASE, GLUON_SHORT
BIN = os.path.join(os.path.dirname(__import__("triton").__file__), "backends/nvidia/bin/cuobjdump")
def res(k):
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    out = subprocess.run([BIN, "-res-usage", f.name], capture_output=True, text=True).stdout
    return " ".join(re.findall(r"(REG:\d+|STACK:\d+|SHARED:\d+|LOCAL:\d+)", out))
cfgs = eval(sys.argv[1])
for hd, cfg in cfgs:
    t = time.time()
    try:
        k = G.compile_for_sm90(hd, True, cfg)
    except Exception as e:
        print(hd, "FAILED", type(e).__name__, str(e)[:800]); continue
    print(hd, {k_: cfg[k_] for k_ in ("BLOCK_N","NUM_BUFFERS","Q_BUFFERS","OVERLAP")}, res(k), f"{time.time()-t:.0f}s", flush=True)
