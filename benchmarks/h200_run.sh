#!/usr/bin/env bash
# One device call: GPU tests, `flashtriton check`, and the side-by-side benchmarks; everything lands in
# $OUT/results.tar.gz (the device tool returns at most 8 files). Usage: bash benchmarks/h200_run.sh STEPS...
# Steps: tests check bench_std bench_extra serving tune. Each step has its own time limit.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
R=/tmp/results; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,temperature.gpu --format=csv | tee $R/nvidia-smi.txt
git rev-parse HEAD > $R/git_sha.txt 2>/dev/null || echo unknown > $R/git_sha.txt
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    tests) timeout 240 python -m pytest -q -n 14 -p no:cacheprovider --tb=short -rf tests > $R/pytest.txt 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" $R/pytest.txt | head -40 ;;
    check) timeout 150 python -m flashtriton check --out $R/check 2>&1 | tail -45 | tee $R/check.txt ;;
    bench_std) timeout 200 python -m flashtriton bench --providers flashtriton,sdpa_flash,sdpa_cudnn,sdpa_efficient,seed \
        --modes fwd,bwd --head-dims 64,128 --out $R/bench_std --no-plots 2>&1 | tail -60 > $R/bench_std.txt; tail -52 $R/bench_std.txt ;;
    bench_extra) timeout 150 python -m flashtriton bench --providers flashtriton,sdpa_flash,sdpa_cudnn,seed --modes fwd \
        --dtypes bf16 --head-dims 128 --out $R/bench_bf16 --no-plots 2>&1 | tail -20 > $R/bench_bf16.txt
      timeout 100 python -m flashtriton bench --providers flashtriton,sdpa_flash,sdpa_cudnn --modes fwd,bwd \
        --head-dims 256 --seqlens 512,2048,8192 --out $R/bench_d256 --no-plots 2>&1 | tail -20 > $R/bench_d256.txt; tail -14 $R/bench_bf16.txt $R/bench_d256.txt ;;
    serving) timeout 100 python -m flashtriton bench --suite varlen --out $R/varlen --no-plots 2>&1 | tail -30 > $R/varlen.txt
      timeout 150 python -m flashtriton bench --suite decode --out $R/decode --no-plots 2>&1 | tail -45 > $R/decode.txt; tail -25 $R/varlen.txt $R/decode.txt ;;
    diag) for f in forward backward varlen kvcache compile transformers cli; do
        (CUDA_LAUNCH_BLOCKING=1 timeout 200 python -m pytest -x -q -p no:cacheprovider --tb=short tests/test_$f.py > $R/diag_$f.txt 2>&1) &
      done; wait; for f in forward backward varlen kvcache compile transformers cli; do echo "--- $f"; grep -E "^(E |FAILED|tests/|src/)|passed|failed" $R/diag_$f.txt | head -25; done ;;
    tune) timeout 100 python -m flashtriton tune -B 4 -H 32 -T 4096 -D 64 --causal --out $R/tune_d64 2>&1 | tail -25 | tee $R/tune_d64.txt
      timeout 120 python -m flashtriton tune -B 4 -H 16 -T 4096 -D 128 --causal --out $R/tune_d128 2>&1 | tail -25 | tee $R/tune_d128.txt ;;
  esac
done
tar czf $OUT/results.tar.gz -C /tmp results
