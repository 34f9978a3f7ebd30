"""Offline sm_90 builds (no GPU; triton's own ptxas and cuobjdump): the Gluon backward kernels' tile loops, with and
without SPLIT, and their register spills. For each build: ptxas' spill-store bytes, then every loop of the SASS
(a backward branch) that holds wgmma instructions (HGMMA) and fewer than 800 instructions - the tile loops - with
its instruction count and its spill stores / loads (STL / LDL). Instruction counts are static (a loop's branches
both counted), not a measurement of speed.

    python benchmarks/2026-12-04-h200/offline-builds/split_sass_counts.py > .../split_sass_counts.txt
"""

import glob
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402

from flashtriton import configs  # noqa: E402
from flashtriton.kernels.backward_gluon_launch import compile_for_sm90  # noqa: E402

BIN = os.path.dirname(get_ptxas(90).path)
BUILDS = [  # (label, kernel, head dim, causal, variant keywords, config overrides)
    ("dkdv window 1024, 2 stages", "dkdv", 128, True, dict(window_size=(1023, 0)), dict(NUM_STAGES=2)),
    ("dkdv window 1024, 2 stages, SPLIT", "dkdv", 128, True, dict(window_size=(1023, 0)), dict(NUM_STAGES=2, SPLIT=1)),
    ("dkdv causal, 2 stages", "dkdv", 128, True, {}, dict(NUM_STAGES=2)),
    ("dkdv causal, 2 stages, SPLIT", "dkdv", 128, True, {}, dict(NUM_STAGES=2, SPLIT=1)),
    ("dkdv causal D=64", "dkdv", 64, True, {}, dict(SPLIT=0)),
    ("dkdv causal D=64, SPLIT", "dkdv", 64, True, {}, dict(SPLIT=1)),
    ("dkdv causal softcap", "dkdv", 128, True, dict(softcap=30.0), dict(SPLIT=0)),
    ("dkdv causal softcap, SPLIT", "dkdv", 128, True, dict(softcap=30.0), dict(SPLIT=1)),
    ("dkdv window + ALiBi, SPLIT", "dkdv", 128, True, dict(window_size=(1023, 0), alibi=True),
     dict(NUM_STAGES=2, SPLIT=1)),
    ("dkdv varlen causal, SPLIT (not built split: SPLIT_ON leaves varlen)", "dkdv", 128, True, dict(varlen=True),
     dict(NUM_STAGES=2, SPLIT=1)),
    ("dq window 1024", "dq", 128, True, dict(window_size=(1023, 0)), {}),
    ("dq window 1024, SPLIT", "dq", 128, True, dict(window_size=(1023, 0)), dict(SPLIT=1)),
    ("dq causal", "dq", 128, True, {}, {}),
    ("dq causal, SPLIT", "dq", 128, True, {}, dict(SPLIT=1)),
    ("dq non-causal (no mask)", "dq", 128, False, {}, {}),
]


def spill_bytes(ptx: str) -> int:
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        report = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                                capture_output=True, text=True, check=True).stderr
    return max(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))


def tile_loops(cubin: bytes) -> list[str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    loops = []
    for addr, text in ins:
        target = re.search(r"BRA.*0x([0-9a-f]+)\s*$", text)
        if target and int(target.group(1), 16) <= addr:
            body = [t for a, t in ins if int(target.group(1), 16) <= a <= addr]
            mma = sum("HGMMA" in t for t in body)
            if mma and len(body) < 800:
                loops.append(f"{len(body)} instructions, HGMMA {mma}, STL {sum('STL' in t for t in body)}, "
                             f"LDL {sum('LDL' in t for t in body)}")
    return loops


for label, kernel, d, causal, variant, overrides in BUILDS:
    config = dict(configs.gluon_bwd_config(d, 4096, 4096, causal)[kernel], **overrides)
    compiled = compile_for_sm90(d, causal, config, torch.bfloat16, kernel, **variant)
    print(f"{label} ({kernel}, D={d}, config {config}): spill stores {spill_bytes(compiled.asm['ptx'])} bytes")
    for loop in tile_loops(compiled.asm["cubin"]):
        print(f"    tile loop: {loop}")
