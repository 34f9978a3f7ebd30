"""Print the README's results table from a `flashtriton bench` JSON of the standard sweep: flashtriton's TFLOP/s over
SDPA cuDNN's per head dim and causal mode, the geometric mean over T (lowest-highest point), forward and backward,
fp16 and bf16; the lowest ratio to SDPA's FLASH backend and the best forward; then every point's TFLOP/s and ratios
(fp16 | bf16 per cell) with the geometric means per head dim; then the forward at the 12 points where the anchors
file has Triton's tutorial kernel. Rows whose V head dim differs from QK's are left out.

    python scripts/readme_tables.py benchmarks/2026-11-29-h200/runs/6e71801/final/bench.json
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict

# Triton's tutorial kernel (06-fused-attention) and cuDNN in the anchors file (`../shared/anchors/h200-2026-11-29.md`,
# beside the repository), forward fp16 TFLOP/s, timed with do_bench's defaults (25 ms warmup, 100 ms rep):
# (D, causal, T) -> (tutorial, cuDNN).
TUTORIAL_ANCHORS = {
    (64, 0, 1024): (391.4, 417.8), (64, 0, 4096): (406.4, 438.9), (64, 0, 16384): (411.9, 438.4),
    (64, 1, 1024): (318.1, 333.4), (64, 1, 4096): (359.1, 404.3), (64, 1, 16384): (392.2, 437.0),
    (128, 0, 1024): (520.8, 550.2), (128, 0, 4096): (512.9, 622.5), (128, 0, 16384): (528.3, 588.0),
    (128, 1, 1024): (373.8, 403.1), (128, 1, 4096): (436.1, 504.3), (128, 1, 16384): (473.1, 546.4),
}


def print_tutorial_comparison(tf: dict, warmups: set) -> None:
    """Ours against the tutorial's anchor at each of its points, in absolute numbers and as ratios to cuDNN (ours in
    this run, the tutorial's in the anchors file's). The anchors were timed with a 25 ms warmup: readings taken with
    another differ (benchmarks/2026-11-29-h200/explore16/warmup/)."""
    print(f"Against the tutorial kernel's anchors (fp16 forward; this run's warmup: {sorted(warmups) or '?'} ms, the "
          "anchors' 25 ms):")
    print("| D | causal | T | flashtriton | tutorial (anchors) | above | ours / cuDNN | tutorial / cuDNN (anchors) |")
    print("|---|---|---|---|---|---|---|---|")
    above = 0
    for (d, c, t), (tut, tut_cudnn) in TUTORIAL_ANCHORS.items():
        v = tf.get(("fwd", d, c, t), {})
        ours, cudnn = v.get(("flashtriton", "fp16")), v.get(("sdpa_cudnn", "fp16"))
        if ours is None:
            print(f"| {d} | {c} | {t} | - | {tut:.0f} | - | - | {tut / tut_cudnn:.2f} |")
            continue
        above += ours > tut
        ratio = f"{ours / cudnn:.2f}" if cudnn else "-"
        print(f"| {d} | {c} | {t} | {ours:.0f} | {tut:.0f} | {'yes' if ours > tut else 'NO'} | {ratio} | "
              f"{tut / tut_cudnn:.2f} |")
    print(f"\nabove the tutorial's anchor at {above} of {len(TUTORIAL_ANCHORS)} points")


def main(path: str) -> None:
    data = json.load(open(path))
    rows = data["rows"] if isinstance(data, dict) else data
    tf = defaultdict(dict)  # (mode, D, causal, T) -> {(provider, dtype): TFLOP/s}
    warmups = set()
    for r in rows:
        # (rows with a V head dim of their own, `--head-dims 192/128`, are not the README's: left out, never mixed
        # into their QK head dim's)
        if r.get("suite", "standard") == "standard" and r.get("tflops") and r.get("Dv", r["D"]) == r["D"]:
            tf[(r["mode"], r["D"], int(r["causal"]), r["T"])][(r["provider"], r["dtype"])] = r["tflops"]
            warmups.add((r.get("extra") or {}).get("warmup_ms"))

    dtypes, modes = ("fp16", "bf16"), ("fwd", "bwd")
    logs = defaultdict(list)  # (mode, D, causal, dtype) -> [log(ours / cuDNN) per T]
    flash = defaultdict(list)  # mode -> [ours / FLASH per point]
    best = {}  # dtype -> the best forward TFLOP/s
    for (mode, d, c, t), v in sorted(tf.items()):
        for dt in dtypes:
            ours = v.get(("flashtriton", dt))
            if ours is None:
                continue
            if ("sdpa_cudnn", dt) in v:
                logs[(mode, d, c, dt)].append(math.log(ours / v[("sdpa_cudnn", dt)]))
            if ("sdpa_flash", dt) in v:
                flash[mode].append(ours / v[("sdpa_flash", dt)])
            if mode == "fwd":
                best[dt] = max(best.get(dt, 0.0), ours)

    def cell(ls):
        if not ls:
            return "-"
        return f"{math.exp(sum(ls) / len(ls)):.2f} ({math.exp(min(ls)):.2f}–{math.exp(max(ls)):.2f})"

    names = {"fwd": "forward", "bwd": "backward"}
    print("| D | causal | " + " | ".join(f"{names[m]} {dt}" for m in modes for dt in dtypes) + " |")
    print("|---|---|" + "---|" * (len(modes) * len(dtypes)))
    for d, c in sorted({(k[1], k[2]) for k in logs}):
        print(f"| {d} | {'yes' if c else 'no'} | "
              + " | ".join(cell(logs.get((m, d, c, dt), [])) for m in modes for dt in dtypes) + " |")
    print()
    for mode in modes:
        if flash[mode]:
            print(f"{mode}: ours / sdpa_flash >= {min(flash[mode]):.2f} at every point")
    if best:
        print("best forward: " + " / ".join(f"{best[dt]:.0f}" for dt in dtypes if dt in best)
              + " TFLOP/s (" + " / ".join(dt for dt in dtypes if dt in best) + ")")
    print()

    # every point, fp16 | bf16 in each cell (the per-point ratios docs/performance.md quotes)
    def point(v, key, fmt="{:.0f}"):
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
                print(f"| {k[1]} | {k[2]} | {k[3]} | {point(v, 'flashtriton')} | {point(v, 'sdpa_cudnn')} | "
                      f"{point(v, 'seed')} | {point(v, 'sdpa_flash')} | {ratio(v, 'flashtriton', 'sdpa_cudnn')} | "
                      f"{ratio(v, 'flashtriton', 'seed')} |")
            else:
                print(f"| {k[1]} | {k[2]} | {k[3]} | {point(v, 'flashtriton')} | {point(v, 'sdpa_flash')} | "
                      f"{point(v, 'sdpa_cudnn')} | {ratio(v, 'flashtriton', 'sdpa_flash')} | "
                      f"{ratio(v, 'flashtriton', 'sdpa_cudnn')} |")
            for dt in ("fp16", "bf16"):
                if ("flashtriton", dt) in v and ("sdpa_cudnn", dt) in v:
                    logs[(k[1], dt)].append(math.log(v[("flashtriton", dt)] / v[("sdpa_cudnn", dt)]))
        print()
        for (d, dt), ls in sorted(logs.items()):
            print(f"{mode} D={d} {dt}: geometric mean ours/cuDNN {math.exp(sum(ls) / len(ls)):.2f}, "
                  f"min {math.exp(min(ls)):.2f}")
        print()
    print_tutorial_comparison(tf, warmups - {None})


if __name__ == "__main__":
    main(sys.argv[1])
