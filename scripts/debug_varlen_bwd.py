"""Which Gluon varlen backward kernel faults, and with which piece (run each variant in its own process)."""
import os
import subprocess
import sys

VARIANT = os.environ.get("VARIANT")
if VARIANT is None:
    for v in ("dkdv", "dq", "dkdv_nostore", "dq_nostore", "dkdv_dense_like", "dq_dense_like"):
        r = subprocess.run([sys.executable, __file__], env={**os.environ, "VARIANT": v, "CUDA_LAUNCH_BLOCKING": "1"},
                           capture_output=True, text=True, timeout=120)
        tail = (r.stdout + r.stderr).strip().splitlines()[-2:]
        print(v, "rc", r.returncode, "|", " / ".join(tail)[:300], flush=True)
    sys.exit(0)

import torch  # noqa: E402
from triton.experimental import gluon  # noqa: E402

sys.path.insert(0, "tests")
from flashtriton.kernels import backward_gluon as BG  # noqa: E402
from flashtriton.kernels.backward import preprocess  # noqa: E402
from flashtriton.kernels.forward import attention_forward  # noqa: E402
from test_varlen import pack  # noqa: E402

if VARIANT.endswith("nostore"):
    @gluon.jit
    def _no_store(base, stride_n, first, n_valid, vals, layout: gluon.language.constexpr, HEAD_DIM: gluon.language.constexpr):
        pass
    BG._store_rows = _no_store

lengths_q, lengths_k = [5, 0, 1, 200, 33, 130, 64], [9, 4, 1, 150, 20, 0, 64]
if VARIANT.endswith("dense_like"):
    lengths_q, lengths_k = [256, 256], [256, 256]
gen = torch.Generator().manual_seed(11)
dev = "cuda"
q, cu_q = pack(lengths_q, 4, 128, torch.float16, dev, gen)
k, cu_k = pack(lengths_k, 2, 128, torch.float16, dev, gen)
v, _ = pack(lengths_k, 2, 128, torch.float16, dev, gen)
do, _ = pack(lengths_q, 4, 128, torch.float16, dev, gen)
out, lse = attention_forward(q, k, v, 128 ** -0.5, True, True, cu_q, cu_k, max(lengths_q), max(lengths_k))
torch.cuda.synchronize()
lse_pad, delta = preprocess(out, do, lse, cu_q, max(lengths_q), padded=True)  # the layout the kernels read
dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
args = (cu_q, cu_k, max(lengths_q), max(lengths_k))
if VARIANT.startswith("dkdv"):
    BG.launch_dkdv_gluon(q, k, v, do, dk, dv, lse_pad, delta, 0.1, True, True, dict(NUM_STAGES=3, CONSUMER_REGS=240), *args)
else:
    BG.launch_dq_gluon(q, k, v, do, dq, lse_pad, delta, 0.1, True, True, dict(BLOCK_N=64, NUM_STAGES=3, CONSUMER_REGS=240), *args)
torch.cuda.synchronize()
print("ok", float(dq.float().abs().sum()), float(dk.float().abs().sum()))
