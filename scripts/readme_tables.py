"""Print the README's forward and backward tables (fp16 | bf16 per cell) from a `flashtriton bench` JSON.

    python scripts/readme_tables.py benchmarks/2026-11-29-h200/runs/<sha>/final/bench.json
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict


def main(path: str) -> None:
    data = json.load(open(path))
    rows = data["rows"] if isinstance(data, dict) else data
    tf = defaultdict(dict)  # (mode, D, causal, T) -> {(provider, dtype): TFLOP/s}
    for r in rows:
        if r.get("suite", "standard") == "standard" and r.get("tflops"):
            tf[(r["mode"], r["D"], int(r["causal"]), r["T"])][(r["provider"], r["dtype"])] = r["tflops"]

    def cell(v, key, fmt="{:.0f}"):
        return " \\| ".join(fmt.format(v[(key, dt)]) if (key, dt) in v else "-" for dt in ("fp16", "bf16"))

    def ratio(v, a, b):
        return " \\| ".join(f"{v[(a, dt)] / v[(b, dt)]:.2f}" if (a, dt) in v and (b, dt) in v else "-"
                            for dt in ("fp16", "bf16"))

    for mode in ("fwd", "bwd"):
        keys = sorted(k for k in tf if k[0] == mode)
        if mode == "fwd":
            print("| D | causal | T | flashtriton | sdpa_cudnn | seed (notebook) | sdpa_flash | ours / cuDNN | ours / seed |")
            print("|---|---|---|---|---|---|---|---|---|")
        else:
            print("| D | causal | T | flashtriton | sdpa_flash | sdpa_cudnn | ours / FLASH | ours / cuDNN |")
            print("|---|---|---|---|---|---|---|---|")
        logs = defaultdict(list)
        for k in keys:
            v = tf[k]
            if mode == "fwd":
                print(f"| {k[1]} | {k[2]} | {k[3]} | {cell(v, 'flashtriton')} | {cell(v, 'sdpa_cudnn')} | "
                      f"{cell(v, 'seed')} | {cell(v, 'sdpa_flash')} | {ratio(v, 'flashtriton', 'sdpa_cudnn')} | "
                      f"{ratio(v, 'flashtriton', 'seed')} |")
            else:
                print(f"| {k[1]} | {k[2]} | {k[3]} | {cell(v, 'flashtriton')} | {cell(v, 'sdpa_flash')} | "
                      f"{cell(v, 'sdpa_cudnn')} | {ratio(v, 'flashtriton', 'sdpa_flash')} | "
                      f"{ratio(v, 'flashtriton', 'sdpa_cudnn')} |")
            for dt in ("fp16", "bf16"):
                if ("flashtriton", dt) in v and ("sdpa_cudnn", dt) in v:
                    logs[(k[1], dt)].append(math.log(v[("flashtriton", dt)] / v[("sdpa_cudnn", dt)]))
        print()
        for (d, dt), ls in sorted(logs.items()):
            print(f"{mode} D={d} {dt}: geometric mean ours/cuDNN {math.exp(sum(ls) / len(ls)):.2f}, "
                  f"min {math.exp(min(ls)):.2f}")
        print()


if __name__ == "__main__":
    main(sys.argv[1])
