"""First look on the GPU: forward TFLOP/s of flashtriton vs the notebook kernel and torch SDPA backends.

Usage (on a GPU): PYTHONPATH=src python benchmarks/quick_fwd.py OUT.json
"""

import json
import os
import sys
import time

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtriton
from flashtriton.kernels import forward as fwd

sys.path.insert(0, os.path.dirname(__file__))
from seed_kernel import seed_attention  # noqa: E402


def sdpa(backend, q, k, v, causal):
    with sdpa_kernel([backend]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def main(out_path):
    rows = []
    for dtype, head_dims in [(torch.float16, (64, 128)), (torch.bfloat16, (128,))]:
        for D in head_dims:
            H = 2048 // D
            for causal in (False, True):
                for T in (512, 1024, 2048, 4096, 8192, 16384):
                    B = 16384 // T
                    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=dtype) for _ in range(3))
                    flops = flashtriton.attention_flops(B, H, T, D, causal)
                    providers = {
                        "ours": lambda: flashtriton.scaled_dot_product_attention(q, k, v, is_causal=causal),
                        "seed": lambda: seed_attention(q, k, v, causal),
                        "cudnn": lambda: sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, causal),
                        "flash": lambda: sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, causal),
                    }
                    row = dict(dtype=str(dtype), D=D, causal=causal, T=T, B=B, H=H)
                    ref = providers["cudnn"]()
                    for name, fn in providers.items():
                        try:
                            t0 = time.time()
                            out = fn()
                            torch.cuda.synchronize()
                            row[name + "_first_s"] = round(time.time() - t0, 2)
                            row[name + "_maxdiff_vs_cudnn"] = (out.float() - ref.float()).abs().max().item()
                            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                            row[name] = round(flops / ms / 1e9, 1)
                        except Exception as e:  # noqa: BLE001
                            row[name] = None
                            row[name + "_err"] = f"{type(e).__name__}: {e}"[:300]
                    row["config"] = str(fwd._attn_fwd_tuned.best_config)
                    rows.append(row)
                    print(f"{row['dtype'][6:]:8s} D={D:3d} c={int(causal)} T={T:5d} ours={row['ours']} "
                          f"seed={row['seed']} cudnn={row['cudnn']} flash={row['flash']} cfg={row['config']} "
                          f"tune={row.get('ours_first_s')}s diff={row.get('ours_maxdiff_vs_cudnn')}", flush=True)
                    del q, k, v, ref
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    with open(out_path, "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
