"""The variants beside FlexAttention, flashtriton's own dense call and cuDNN: `flashtriton bench --suite variants`
(src/flashtriton/tools/bench_variants.py), with this script's arguments passed through and `--out $OUT` when OUT is
set and no --out is given:

    PYTHONPATH=src python benchmarks/variants.py [--variants window1024,softcap50] [--modes fwd,bwd] [--rounds 3]

The results of 2026-12-01 (benchmarks/2026-12-01-h200/variants/) came from this script's standalone predecessor at
0f336b2."""
import os
import sys

from flashtriton.cli import main

if __name__ == "__main__":
    rest = sys.argv[1:]
    if "--out" not in rest and os.environ.get("OUT"):
        rest += ["--out", os.environ["OUT"]]
    # main() without arguments reads sys.argv: without a GPU it restarts itself under Triton's interpreter
    sys.argv = [sys.argv[0], "bench", "--suite", "variants", *rest]
    sys.exit(main())
