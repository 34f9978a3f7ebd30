"""Tile configs for paged prefill over pages smaller than 128 keys, on the H200: benchmarks/paged_prefill.py run
once per candidate with `configs.gluon_paged_config` patched to return it (tiles of one page each).

    python benchmarks/2026-12-02-h200/paged-small/explore_paged.py OUT_DIR
"""
import runpy
import sys

from flashtriton import configs

BASE = configs.gluon_varlen_config(128, 4096, 4096, True)
CANDIDATES = {  # name: (page size, config)
    "p32_b4": (32, dict(BASE, BLOCK_N=32, NUM_BUFFERS=4)),
    "p64_b4": (64, dict(BASE, BLOCK_N=64, NUM_BUFFERS=4)),
    "p64_b3": (64, dict(BASE, BLOCK_N=64, NUM_BUFFERS=3)),
    "p64_b4_q2": (64, dict(BASE, BLOCK_N=64, NUM_BUFFERS=4, Q_BUFFERS=2)),
}
out = sys.argv[1]
for name, (page, config) in CANDIDATES.items():
    configs.gluon_paged_config = lambda *a, _c=config, **k: dict(_c)
    print(f"=== {name} {config}", flush=True)
    sys.argv = ["paged_prefill.py", "--pages", str(page), "--out", f"{out}/{name}"]
    try:
        runpy.run_path("benchmarks/paged_prefill.py", run_name="__main__")
    except SystemExit:  # (the script exits non-zero when a page size misses its bar)
        pass
