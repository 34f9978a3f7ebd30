"""Offline sm_90 builds of the Gluon forward with and without dropout (the rules configs.GLUON_DROPOUT_FWD names):
SASS opcode counts of the whole kernel (both consumer partitions; the softmax appears twice in each, in the loop
and for the first tile). `PYTHONPATH=src python benchmarks/2026-12-03-h200/offline-builds/gluon_dropout_sass_counts.py`."""
import collections, re, subprocess, sys, tempfile, torch
from flashtriton.configs import forward as cf
from flashtriton.kernels.forward_gluon_launch import compile_for_sm90
from flashtriton.kernels.variant import Variant
from triton.backends.nvidia.compiler import get_ptxas
cf.GLUON_DROPOUT = cf.GLUON_DROPOUT_ALL = True
cuobjdump = get_ptxas(90).path.replace("ptxas", "cuobjdump")
def counts(compiled):
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(compiled.asm["cubin"]); f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)
    return collections.Counter(o.split(".")[0] for o in ops), len(ops)
print("Offline sm_90a builds (triton 3.6, its ptxas; no GPU): SASS instructions of the whole kernel, by opcode.")
print("A diagnostic of code size, not a measurement of time.")
for head_dim, causal, keys in ((128, False, 16384), (128, True, 1024), (64, False, 16384)):
    config = cf.gluon_fwd_config(head_dim, keys, keys, causal, dropout=True)
    rows = {}
    for p in (0.0, 0.1):
        c, n = counts(compile_for_sm90(head_dim, causal, config, variant=Variant.of(causal, dropout_p=p)))
        rows[p] = (c, n)
    print(f"\nD={head_dim} causal={causal} config={config}")
    (c0, n0), (c1, n1) = rows[0.0], rows[0.1]
    print(f"  total            {n0:7d} {n1:7d}")
    for op in ("IMAD", "LOP3", "SHF", "ISETP", "FSEL", "SEL", "PRMT", "SHFL", "HGMMA", "MUFU", "FFMA", "FMUL", "STL", "LDL"):
        print(f"  {op:16s} {c0.get(op, 0):7d} {c1.get(op, 0):7d}")
