#!/usr/bin/env bash
# One device call: GPU tests, `flashtriton check`, `flashtriton tune` and the side-by-side benchmarks;
# everything lands in $OUT/results.tar.gz (the device tool returns at most 8 files). The device gets no .git,
# so pass the commit:   FLASHTRITON_GIT_SHA=$(git rev-parse --short=12 HEAD) bash benchmarks/h200_run.sh STEPS...
# Steps: tests (whole suite; ~600 s), bwd_ab (benchmarks/gluon_bwd_ab.py: Gluon backward configs, kernel times; AB_CASES, AB_ROUNDS, AB_LABELS), regs (KV_REGS: its GPU tests, gluon_bwd_ab.py's K/V from shared memory), fused_ab (the preprocess inside the dQ kernels: GPU tests and benchmarks/fused_delta_ab.py), bwd_timeline (benchmarks/bwd_timeline.py), softcap_ab (tests and benchmarks/softcap_ab.py), decode_dims (decode at D=256 and 192/128 beside cuDNN; DECODE_DIMS narrows), o_in_q (O_IN_Q's GPU tests and its wide forward timed; O_IN_Q_AB=0: the tests only), pyk (PYK_FILES filtered by PYK_K), tests1 / tests2 (its files in two halves), testpart (PART=i/N: every N-th file from the i-th), blocking (tests1 with CUDA_LAUNCH_BLOCKING=1, -v), memcheck (compute-sanitizer over the Gluon variant tests), fuzz (scripts/fuzz.py on the GPU, FUZZ_S seconds twice), varlen_wide (benchmarks/varlen_wide_ab.py), trim_ab (benchmarks/trim_ab.py: the trimmed products and accumulator splits at D=192; TRIM_DIMS, TRIM_T), padded (padded head dims: tests, speed), dims8 (every head dim against float64, the multiples of 8 timed), paged_ab (paged prefill's tests and timing, then again with AB_SWAP's file: an A/B), gluon_paged (separate-V and paged-prefill tests, paged_prefill.py, 192/128 timed), wide (D=256/192 beside cuDNN and FLASH, fwd+bwd, fp16+bf16), graphs (training calls and decoding in CUDA graphs), bwdtests (test_backward.py), quick (launch, kvcache, varlen, forward tests), kvtests (launch, kvcache), gputests (the `gpu`-marked ones), diag (one file per process, first failure),
# eco (notebook, compile, transformers tests), dropout (dropout.py), gluon_dropout (the dropout tests with the Gluon kernels', dropout.py --gluon), dropout_ab (dropout.py --gluon on the tree and on 5267c80's mask code; DAB_T), bert_dropout (a BERT-base fine-tuning step with attention dropout against sdpa: benchmarks/bert_dropout.py), bert_unpad_ab (bert_dropout.py on the tree, then with the HF integration's kept unpadding reversed), check, tune, explore_{fwd,bwd,decode,host,tma,varlen,gluon} (variant sweeps, benchmarks/explore.py), final (fwd+bwd, fp16+bf16, D=64/128: the standard sweep), d256 (the D=256 sweep, fwd+bwd), bench_std, bench_extra (bf16, D=256), fwdfinal (forward sweep fp16+bf16), varlen (the varlen suite), serving (varlen,
# decode), anchors (the forward at the anchors file's tutorial-kernel points, timed as the anchors were: 25 ms warmup,
# 100 ms rep; scripts/readme_tables.py compares); final and fwdfinal warm each timing up for 100 ms (a GPU that has paused runs up to 10 % faster at first:
# benchmarks/2026-11-29-h200/explore16/warmup/); EXPLORE_ARGS passes options to explore.py (e.g. --decode-points 1x1024,64x1024), VH_ARGS to variant_host.py. Each step has its own time limit; typical seconds: tests 240, gputests ~400 (GPU_S caps it),
# check 20, tune 60, bench_std 75, bench_extra 45, fwdfinal 50, serving 60 (plus ~60 s to start the machine).
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
# results of earlier calls can survive on the device (check git_sha.txt); KEEP_RESULTS=1 keeps them, for a second
# invocation in the same call whose results should join the first's
R=/tmp/results; [ -n "${KEEP_RESULTS:-}" ] || rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,temperature.gpu --format=csv | tee $R/nvidia-smi.txt
# the commit the caller names (the device's checkout may hold an older .git), else what git says there
[ -n "${FLASHTRITON_GIT_SHA:-}" ] && echo "$FLASHTRITON_GIT_SHA" > $R/git_sha.txt || git rev-parse HEAD > $R/git_sha.txt 2>/dev/null || echo unknown > $R/git_sha.txt
# An A/B against the tree before a change: run the command with the change's patch ($1) reversed, then restore it.
with_patch_reversed() {
  local patch_file=$1; shift
  if patch -R -p1 -s --dry-run < "$patch_file" > /dev/null; then
    patch -R -p1 -s < "$patch_file"; "$@"; patch -p1 -s < "$patch_file"
  else echo "$patch_file does not reverse-apply here"; fi
}
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    tests) timeout 560 python -m pytest -q -n 14 -p no:cacheprovider --tb=short -rf tests > $R/pytest.txt 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" $R/pytest.txt | head -40 ;;
    tests1|tests2) # the suite in two halves, every other file by name (about 1050 s together on the H100, near the limit of a call each: `testpart` with PART=i/3 for shorter calls)
      half=$(ls tests/test_*.py | sort | awk -v i=$([ $step = tests1 ] && echo 1 || echo 0) 'NR % 2 == i')
      timeout 560 python -m pytest -q -n 14 -p no:cacheprovider --tb=short -rf --durations=20 $half > $R/pytest_$step.txt 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" $R/pytest_$step.txt | head -40 ;;
    testpart) # one of N parts of the suite's files (PART=i/N, default 1/3; by sorted name), for calls shorter than tests1's
      part=${PART:-1/3}; i=${part%/*}; n=${part#*/}; files=$(ls tests/test_*.py | sort | awk -v i=$i -v n=$n '(NR - 1) % n == i - 1')
      timeout ${PART_S:-420} python -m pytest -q -n 14 -p no:cacheprovider --tb=short -rf --durations=10 $files \
        > $R/pytest_part${i}of${n}.txt 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" $R/pytest_part${i}of${n}.txt | head -40 ;;
    check) timeout 40 python -m flashtriton check --out $R/check 2>&1 | tail -12 | tee $R/check.txt ;;
    bench_std) timeout 130 python -m flashtriton bench --providers flashtriton,sdpa_flash,sdpa_cudnn,seed --rep 60 --warmup 15 \
        --modes fwd,bwd --head-dims 64,128 --out $R/bench_std --no-plots > $R/bench_std.txt 2>&1; grep -v "it/s" $R/bench_std.txt | tail -56 ;;
    bench_extra) timeout 45 python -m flashtriton bench --providers flashtriton,sdpa_flash,sdpa_cudnn,seed --modes fwd --rep 60 --warmup 15 \
        --dtypes bf16 --head-dims 128 --out $R/bench_bf16 --no-plots > $R/bench_bf16.txt 2>&1
      timeout 40 python -m flashtriton bench --providers flashtriton,sdpa_flash,sdpa_cudnn --modes fwd,bwd --rep 60 --warmup 15 \
        --head-dims 256 --seqlens 512,2048,8192 --out $R/bench_d256 --no-plots > $R/bench_d256.txt 2>&1
      grep -v "it/s" $R/bench_bf16.txt | tail -20; grep -v "it/s" $R/bench_d256.txt | tail -16 ;;
    serving) timeout 60 python -m flashtriton bench --suite varlen --rep 60 --warmup 15 --out $R/varlen --no-plots > $R/varlen.txt 2>&1
      timeout 80 python -m flashtriton bench --suite decode --rep 60 --warmup 15 --decode-batches 1,8,64 \
        --decode-seqlens 1024,4096,32768,131072 --out $R/decode --no-plots > $R/decode.txt 2>&1
      grep -v "it/s" $R/varlen.txt | tail -14; grep -v "it/s" $R/decode.txt | tail -24 ;;
    varlen) timeout 60 python -m flashtriton bench --suite varlen --rep 60 --warmup 15 --out $R/varlen --no-plots > $R/varlen.txt 2>&1
      grep -v "it/s" $R/varlen.txt | tail -14 ;;
    final) timeout 400 python -m flashtriton bench --providers flashtriton,sdpa_flash,sdpa_cudnn,seed --modes fwd,bwd \
        --dtypes fp16,bf16 --head-dims 64,128 --rep 40 --warmup 100 --out $R/final --no-plots > $R/final.txt 2>&1
      grep -v "it/s" $R/final.txt | tail -100 ;;
    d256) timeout 90 python -m flashtriton bench --providers flashtriton,sdpa_flash,sdpa_cudnn --modes fwd,bwd --rep 40 --warmup 10 \
        --dtypes fp16,bf16 --head-dims 256 --out $R/d256 --no-plots > $R/d256.txt 2>&1; grep -v "it/s" $R/d256.txt | tail -30 ;;
    anchors) timeout 120 python -m flashtriton bench --providers flashtriton,sdpa_flash,sdpa_cudnn --modes fwd --dtypes fp16 \
        --head-dims 64,128 --seqlens 1024,4096,16384 --warmup 25 --rep 100 --out $R/anchors --no-plots > $R/anchors.txt 2>&1
      python scripts/readme_tables.py $R/anchors/bench.json | tail -18 ;;
    fwdfinal) timeout 110 python -m flashtriton bench --providers flashtriton,sdpa_cudnn,seed --modes fwd --dtypes fp16,bf16 \
        --head-dims 64,128 --rep 40 --warmup 100 --out $R/fwd_final --no-plots > $R/fwd_final.txt 2>&1; grep -v "it/s" $R/fwd_final.txt | tail -52 ;;
    quick) timeout 150 python -m pytest -q -n 8 -p no:cacheprovider --tb=short -rf tests/test_launch.py tests/test_kvcache.py \
        tests/test_varlen.py tests/test_forward.py tests/test_backward.py > $R/pytest_quick.txt 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" $R/pytest_quick.txt | head -30 ;;
    gluontests) timeout 200 python -m pytest -q -n 8 -p no:cacheprovider --tb=short -rf tests/test_forward_gluon.py tests/test_forward.py tests/test_varlen.py \
        > $R/pytest_gluon.txt 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" $R/pytest_gluon.txt | head -30 ;;
    bwdtests) timeout 200 python -m pytest -q -n 8 -p no:cacheprovider --tb=short -rf tests/test_backward.py tests/test_backward_gluon.py \
        > $R/pytest_bwd.txt 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" $R/pytest_bwd.txt | head -30 ;;
    kvtests) timeout 150 python -m pytest -q -n 8 -p no:cacheprovider --tb=short -rf tests/test_launch.py tests/test_kvcache.py \
        > $R/pytest_kv.txt 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" $R/pytest_kv.txt | head -30 ;;
    gputests) timeout ${GPU_S:-400} python -m pytest -v -n 14 -p no:cacheprovider --tb=line -m gpu tests > $R/pytest_gpu.txt 2>&1
      grep -cE "PASSED" $R/pytest_gpu.txt; grep -E "FAILED|ERROR|passed|failed" $R/pytest_gpu.txt | head -20 ;;
    diag) for f in forward backward varlen kvcache compile transformers cli; do
        (CUDA_LAUNCH_BLOCKING=1 timeout 200 python -m pytest -x -q -p no:cacheprovider --tb=short tests/test_$f.py > $R/diag_$f.txt 2>&1) &
      done; wait; for f in forward backward varlen kvcache compile transformers cli; do echo "--- $f"; grep -E "^(E |FAILED|tests/|src/)|passed|failed" $R/diag_$f.txt | head -25; done ;;
    tune) timeout 100 python -m flashtriton tune -B 4 -H 32 -T 4096 -D 64 --causal --out $R/tune_d64 2>&1 | tail -25 | tee $R/tune_d64.txt
      timeout 120 python -m flashtriton tune -B 4 -H 16 -T 4096 -D 128 --causal --out $R/tune_d128 2>&1 | tail -25 | tee $R/tune_d128.txt ;;
    eco) timeout 200 python -m pytest -v -n 4 -p no:cacheprovider --tb=short -rs tests/test_notebook.py tests/test_compile.py \
        tests/test_transformers.py > $R/pytest_eco.txt 2>&1; grep -E "FAILED|ERROR|SKIPPED|passed|failed" $R/pytest_eco.txt | head -20 ;;
    variants) timeout 300 python -m flashtriton bench --suite variants --rounds ${ROUNDS:-2} ${VARIANT_ARGS:-} --out $R/variants --no-plots \
        > $R/variants.txt 2>&1; grep -v "it/s" $R/variants.txt | tail -60 ;;
    decode_dims) # decode at D=256 and QK 192 / V 128 (issue 26): batch 1, 8, 64 over caches of 4k, 32k, 128k
      for d in ${DECODE_DIMS:-256 192/128}; do n=decode_${d/\//_}
        timeout 120 python -m flashtriton bench --suite decode --decode-head-dim $d --decode-batches 1,8,64 \
          --decode-seqlens 4k,32k,128k --rep 60 --warmup 15 --out $R/$n --no-plots > $R/$n.txt 2>&1
        grep -v "it/s" $R/$n.txt | tail -14; done ;;
    o_in_q) # the output staged in the Q buffers (O_IN_Q): its float64 GPU tests (the wide configs, the variant matrix,
      # the dispatch with configs.forward.GLUON_O_IN_Q on), then its wide forward beside the dispatch's and cuDNN
      timeout 240 python -m pytest -q -n 14 -p no:cacheprovider --tb=short -rf tests/test_forward_gluon.py \
        -k "output or wide or qk_width or pads_other" > $R/pytest_o_in_q.txt 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" $R/pytest_o_in_q.txt | head -20
      [ "${O_IN_Q_AB:-1}" = 1 ] && timeout 240 python benchmarks/fwd_config_ab.py --head-dims 192,256 --seqlens 1024,4096,16384 --candidates n64_oq \
        --rounds 3 --out $R/o_in_q > $R/o_in_q.txt 2>&1; grep -v cudnn $R/o_in_q.txt | tail -24 ;;
    decode_host) timeout 120 python benchmarks/decode_host.py --out $R/decode_host.txt > /dev/null 2>&1; head -40 $R/decode_host.txt ;;
    headdims) timeout ${HD_S:-240} python -m flashtriton bench --providers flashtriton,sdpa_flash,sdpa_cudnn --modes fwd,bwd --rep 40 --warmup 25 \
        --dtypes bf16 --head-dims ${HEAD_DIMS:-80,96,192/128,256} --seqlens 1024,4096 --causal 1 --out $R/headdims --no-plots \
        > $R/headdims.txt 2>&1; grep -v "it/s" $R/headdims.txt | tail -40 ;;
    fuzz) # scripts/fuzz.py on the GPU: FUZZ_S seconds of random calls against float64, then as long with the Gluon
      # backward at every size (--gluon-bwd-everywhere); each failure printed with the seed that reproduces it
      timeout $(( ${FUZZ_S:-60} + 60 )) python scripts/fuzz.py --device cuda --seconds ${FUZZ_S:-60} > $R/fuzz.txt 2>&1
      timeout $(( ${FUZZ_S:-60} + 60 )) python scripts/fuzz.py --device cuda --seconds ${FUZZ_S:-60} --gluon-bwd-everywhere \
        > $R/fuzz_gluon_bwd.txt 2>&1; grep -hE "^FAILED|cases," $R/fuzz.txt $R/fuzz_gluon_bwd.txt | cut -c1-300 ;;
    paged_ab) # paged prefill: its GPU tests and paged_prefill.py (PAGES) on the working tree, then (AB_SWAP="dst=src")
      # again with file src copied over dst: an A/B of kernel code in one call, each side with its own dense baseline
      timeout 200 python -m pytest -q -n 14 -p no:cacheprovider --tb=short -rf tests/test_paged_prefill.py \
        > $R/pytest_paged.txt 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" $R/pytest_paged.txt | head -20
      timeout 150 python benchmarks/paged_prefill.py --pages ${PAGES:-8,16,32} --out $R/paged_a > $R/paged_a.txt 2>&1
      tail -6 $R/paged_a.txt
      if [ -n "${AB_SWAP:-}" ]; then cp "${AB_SWAP#*=}" "${AB_SWAP%%=*}"
        timeout 150 python benchmarks/paged_prefill.py --pages ${PAGES:-8,16,32} --out $R/paged_b > $R/paged_b.txt 2>&1
        tail -6 $R/paged_b.txt; fi ;;
    paged_prefill) timeout 240 python benchmarks/paged_prefill.py --out $R/paged_prefill > $R/paged_prefill.txt 2>&1
      tail -8 $R/paged_prefill.txt ;;
    context_parallel) timeout 300 python benchmarks/context_parallel.py --out $R/context_parallel > $R/context_parallel.txt 2>&1
      tail -14 $R/context_parallel.txt ;;
    pyk) # PYK_FILES (tests/... paths) filtered by -k "$PYK_K"
      timeout ${PYK_S:-240} python -m pytest -q -n 8 -p no:cacheprovider --tb=short -rf ${PYK_FILES:-tests} -k "${PYK_K:-}" \
        > $R/pytest_k.txt 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" $R/pytest_k.txt | head -30 ;;
    regs) # the dK/dV kernel's K and V in registers (KV_REGS): its float64 GPU tests (varlen and the variants too),
      # then gluon_bwd_ab.py's "K/V from shared memory" beside the dispatch's configs
      timeout ${REGS_S:-200} python -m pytest -q -n 8 -p no:cacheprovider --tb=short -rf tests/test_backward_gluon.py \
        -k operands_in_registers > $R/pytest_regs.txt 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" $R/pytest_regs.txt | head -20
      timeout 300 python benchmarks/gluon_bwd_ab.py --cases ${AB_CASES:-dense4k_d64_full,dense4k_d64} \
        --rounds ${AB_ROUNDS:-4} --labels "K/V from shared memory" --out $R/regs_ab > $R/regs_ab.txt 2>&1
      grep -v -i warn $R/regs_ab.txt | tail -20 ;;
    bwd_ab) # Gluon backward config candidates beside the dispatch's, with each kernel's time (AB_CASES, AB_ROUNDS)
      timeout 300 python benchmarks/gluon_bwd_ab.py --cases ${AB_CASES:-window1024,window4096,dense4k,dense4k_d64,softcap4k} \
        --rounds ${AB_ROUNDS:-4} --labels "${AB_LABELS:-}" --out $R/gluon_bwd_ab > $R/gluon_bwd_ab.txt 2>&1; grep -v -i warn $R/gluon_bwd_ab.txt | tail -40 ;;
    fused_ab) # the preprocess inside the dQ kernels (Triton: TRITON_BWD_FUSED_DELTA; Gluon with a sink:
      # GLUON_BWD_FUSED_SINK): their GPU tests, then benchmarks/fused_delta_ab.py beside the preprocess kernel and cuDNN
      timeout 240 python -m pytest -q -n 8 -p no:cacheprovider --tb=short -rf tests/test_backward_gluon.py \
        -k "fused" > $R/pytest_fused.txt 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" $R/pytest_fused.txt | head -20
      timeout 300 python benchmarks/fused_delta_ab.py --rounds ${AB_ROUNDS:-5} --out $R/fused_delta_ab \
        > $R/fused_delta_ab.txt 2>&1; tail -30 $R/fused_delta_ab.txt ;;
    bwd_timeline) # where a timed backward's time goes: kernels and the GPU's idle time in do_bench's loop (TL_CASES)
      timeout 240 python benchmarks/bwd_timeline.py --cases ${TL_CASES:-dense4k,dense4k_d64,window4096} --out $R/bwd_timeline \
        > $R/bwd_timeline.txt 2>&1; grep -v -i warn $R/bwd_timeline.txt | tail -20 ;;
    softcap_ab) # the Gluon forward's softcap against a fixed max: its GPU tests, then benchmarks/softcap_ab.py
      timeout 240 python -m pytest -q -n 14 -p no:cacheprovider --tb=short -rf tests/test_forward_gluon.py \
        -k "fixed or variants" > $R/pytest_softcap_fixed.txt 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" $R/pytest_softcap_fixed.txt | head -20
      timeout 200 python benchmarks/softcap_ab.py --rounds ${AB_ROUNDS:-5} --out $R/softcap_ab > $R/softcap_ab.txt 2>&1
      grep -v -i warn $R/softcap_ab.txt | tail -12 ;;
    variant_host) timeout 300 python benchmarks/variant_host.py ${VH_ARGS:-} --out $R/variant_host > /dev/null 2>&1
      head -150 $R/variant_host/variant_host.txt ;;
    chunked) timeout 300 python -m pytest -q -n 8 -p no:cacheprovider --tb=short -rf tests/test_chunked.py tests/test_parallel.py \
        > $R/pytest_chunked.txt 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" $R/pytest_chunked.txt | head -30 ;;
    decode_window) timeout 200 python benchmarks/decode_window.py --out $R/decode_window > $R/decode_window.txt 2>&1
      tail -14 $R/decode_window.txt ;;
    blocking) # the first half of the suite with launches synchronous and each worker's order kept (-v): an illegal
      # memory access fails the test whose kernel made it, not a later one of the same worker
      files=$(ls tests/test_*.py | sort); n=$(echo "$files" | wc -l)
      CUDA_LAUNCH_BLOCKING=1 timeout ${BLOCKING_S:-400} python -m pytest -v -n 14 -p no:cacheprovider --tb=short -rf \
        ${BLOCKING_FILES:-$(echo "$files" | head -n $((n / 2)))} > $R/pytest_blocking.txt 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" $R/pytest_blocking.txt | head -20 ;;
    memcheck) # compute-sanitizer over the Gluon variant tests; torch's caching allocator off, or an access past a
      # tensor but inside the allocator's segment goes unseen (MEMCHECK_K narrows the tests)
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${MEMCHECK_S:-400} compute-sanitizer --tool memcheck --print-limit 20 \
        python -m pytest -q -p no:cacheprovider --tb=short -rf tests/test_forward_gluon.py tests/test_backward_gluon.py \
        -k "${MEMCHECK_K:-variants}" > $R/memcheck.txt 2>&1
      grep -E "Invalid|ERROR SUMMARY|passed|failed" $R/memcheck.txt | head -20 ;;
    gluon_paged) # the Gluon forward's separate V head dim and paged prefill: their tests, paged_prefill.py, (192, 128) beside cuDNN
      timeout 300 python -m pytest -q -n 14 -p no:cacheprovider --tb=short -rf tests/test_paged_prefill.py tests/test_varlen.py \
        tests/test_forward_gluon.py tests/test_head_dim_v.py tests/test_dispatch.py tests/test_configs.py > $R/pytest_gluon_paged.txt 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" $R/pytest_gluon_paged.txt | head -20
      timeout 240 python benchmarks/paged_prefill.py --out $R/paged_prefill_gluon > $R/paged_prefill_gluon.txt 2>&1
      tail -8 $R/paged_prefill_gluon.txt
      timeout 200 python -m flashtriton bench --providers flashtriton,sdpa_flash,sdpa_cudnn --modes fwd,bwd --rep 40 --warmup 25 \
        --dtypes bf16 --head-dims 192/128 --seqlens 1024,4096,16384 --causal 0,1 --out $R/separate_v --no-plots \
        > $R/separate_v.txt 2>&1; grep -v "it/s" $R/separate_v.txt | tail -16 ;;
    wide) # D = 256 / 192 (and 192/128) beside cuDNN and FLASH, fwd and bwd, fp16 and bf16 (DTYPES narrows; WIDE_TAG names a second run's files)
      timeout 400 python -m flashtriton bench --providers flashtriton,sdpa_flash,sdpa_cudnn --modes fwd,bwd --rep 40 --warmup 25 \
        --dtypes ${DTYPES:-fp16,bf16} --head-dims ${HEAD_DIMS:-256,192} --seqlens 1024,4096,16384 --causal 0,1 --out $R/wide${WIDE_TAG:-} --no-plots \
        > $R/wide${WIDE_TAG:-}.txt 2>&1; grep -v "it/s" $R/wide${WIDE_TAG:-}.txt | tail -60 ;;
    graphs) timeout 200 python -m pytest -v -p no:cacheprovider --tb=short -rf tests/test_cuda_graphs.py \
        tests/test_kvcache.py -k "graph" > $R/pytest_graphs.txt 2>&1; grep -E "PASSED|FAILED|ERROR|passed|failed" $R/pytest_graphs.txt | tail -16 ;;
    padded) # head dims padded to the Gluon kernels' (ops.PAD_HEAD_DIMS): their GPU tests and the varlen wide tiles' with
      # variants, then their speed beside cuDNN and FLASH (D = 40, 59, 111, 160, 224; bf16, causal, T = 1k / 4k)
      timeout 300 python -m pytest -q -n 14 -p no:cacheprovider --tb=short -rf tests/test_padded_head_dims.py \
        tests/test_forward_gluon.py -k "padded or varlen_wide_tiles or pads_other" > $R/pytest_padded.txt 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" $R/pytest_padded.txt | head -30
      timeout 150 python -m flashtriton bench --providers flashtriton,sdpa_flash,sdpa_cudnn --modes fwd,bwd --rep 40 \
        --warmup 25 --dtypes bf16 --head-dims 40,59,111,160,224 --seqlens 1024,4096 --causal 1 --out $R/padded \
        --no-plots > $R/padded.txt 2>&1; grep -v "it/s" $R/padded.txt | tail -30 ;;
    dims8) # every head dim 1-256 (tests/test_every_head_dim.py) and the Gluon kernels' multiples of 8 and padded head
      # dims against float64 on the GPU, then D = 40 / 72 / 160 / 224 beside cuDNN
      timeout 330 python -m pytest -q -n 14 -p no:cacheprovider --tb=short -rf tests/test_every_head_dim.py \
        tests/test_padded_head_dims.py tests/test_forward_gluon.py tests/test_backward_gluon.py \
        -k "every_head_dim or sampled_head_dims or padded or pads_other or multiples_of_8" > $R/pytest_dims8.txt 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" $R/pytest_dims8.txt | head -30
      timeout 120 python -m flashtriton bench --providers flashtriton,sdpa_flash,sdpa_cudnn --modes fwd,bwd --rep 40 \
        --warmup 25 --dtypes bf16 --head-dims 40,72,160,224 --seqlens 1024,4096 --causal 0,1 --out $R/dims8 \
        --no-plots > $R/dims8.txt 2>&1; grep -v "it/s" $R/dims8.txt | tail -40 ;;
    trim_ab) # benchmarks/trim_ab.py: the products over the head's own columns, the forward's two accumulators and the
      # backward's dQ in two (GLUON_BWD_DQ_SPLIT) at D = 192 against the whole tiles, beside cuDNN (TRIM_DIMS, TRIM_T)
      timeout ${TRIM_S:-300} python benchmarks/trim_ab.py --head-dims ${TRIM_DIMS:-192,192/128} --seqlens ${TRIM_T:-1024,4096,16384} \
        --out $R/trim_ab > $R/trim_ab.txt 2>&1; tail -40 $R/trim_ab.txt ;;
    varlen_wide) # the Gluon forward on packed batches at 64- and 256-column tiles against the dispatch's (VW_DIMS)
      timeout 300 python benchmarks/varlen_wide_ab.py --head-dims ${VW_DIMS:-64,192,256,192/128} --out $R/varlen_wide \
        > $R/varlen_wide.txt 2>&1; tail -40 $R/varlen_wide.txt ;;
    shapes) # explicit shapes beside cuDNN, fwd + bwd (SHAPES="B,H,T,D ...", CAUSAL, DTYPES; SHAPES_TAG names the files):
      # e.g. the same work in a number of units that divides the SMs and one that does not
      timeout ${SHAPES_S:-240} python -m flashtriton bench --providers flashtriton,sdpa_cudnn --modes fwd,bwd --rep 60 --warmup 25 \
        --dtypes ${DTYPES:-bf16} --causal ${CAUSAL:-0,1} $(for s in ${SHAPES:-4,16,4096,128}; do echo --shape $s; done) \
        --out $R/shapes${SHAPES_TAG:-} --no-plots > $R/shapes${SHAPES_TAG:-}.txt 2>&1; grep -v "it/s" $R/shapes${SHAPES_TAG:-}.txt | tail -40 ;;
    fa_suite) # flash-attn 2's own tests/test_flash_attn.py against flashtriton (scripts/flash_attn_suite): the test
      # file is not in the repository: carry out/flash_attn_suite (holding test_flash_attn.py); FA_PER_TEST, FA_S
      timeout $(( ${FA_S:-420} + 60 )) python scripts/flash_attn_suite/run.py --device cuda --per-test ${FA_PER_TEST:-40} \
        --budget ${FA_S:-420} --seed ${FA_SEED:-1} --results $R/flash_attn_suite > $R/flash_attn_suite.txt 2>&1
      head -40 $R/flash_attn_suite/summary.txt ;;
    dropout) timeout 300 python benchmarks/dropout.py --out $R/dropout > $R/dropout.txt 2>&1; tail -34 $R/dropout.txt ;;
    gluon_dropout) # the Gluon kernels' dropout: its GPU tests, then timed beside the portable kernels and cuDNN
      timeout 300 python -m pytest -q -n 14 -p no:cacheprovider --tb=short -rf tests/test_dropout.py \
        > $R/pytest_gluon_dropout.txt 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" $R/pytest_gluon_dropout.txt | head -20
      timeout 300 python benchmarks/dropout.py --gluon --out $R/gluon_dropout > $R/gluon_dropout.txt 2>&1
      tail -36 $R/gluon_dropout.txt ;;
    bert_dropout) timeout 300 python benchmarks/bert_dropout.py --out $R/bert_dropout > $R/bert_dropout.txt 2>&1
      tail -8 $R/bert_dropout.txt ;;
    bert_unpad_ab) # the HF integration's padding mask unpadded once per forward (the tree) against once per layer
      # (unpad_memo.patch reversed, then restored): bert_dropout.py's step times and losses on each
      timeout 150 python benchmarks/bert_dropout.py --seeds ${BERT_SEEDS:-96} --out $R/bert_unpad_after > /dev/null 2>&1
      tail -7 $R/bert_unpad_after/bert_dropout.txt
      with_patch_reversed benchmarks/2026-12-07-cpu/bert-unpad/unpad_memo.patch \
        timeout 120 python benchmarks/bert_dropout.py --seeds 8 --out $R/bert_unpad_before > /dev/null 2>&1
      tail -7 $R/bert_unpad_before/bert_dropout.txt ;;
    dropout_ab) # the dropout mask code against 5267c80's (mask_code.patch reversed, then restored): dropout.py --gluon
      # (the Gluon and the portable kernels, ours without dropout and cuDNN beside them) on each tree, T = DAB_T
      timeout 240 python benchmarks/dropout.py --gluon --seqlens ${DAB_T:-4096} --out $R/dropout_after \
        > $R/dropout_after.txt 2>&1; tail -24 $R/dropout_after.txt
      with_patch_reversed benchmarks/2026-12-07-cpu/dropout-builds/mask_code.patch \
        timeout 240 python benchmarks/dropout.py --gluon --seqlens ${DAB_T:-4096} --out $R/dropout_before \
        > $R/dropout_before.txt 2>&1; tail -24 $R/dropout_before.txt ;;
    explore_*) sweep=${step#explore_}; lim=$(case $sweep in fwd) echo 200;; bwd) echo 300;; decode) echo 240;; decode_schedule) echo 300;; tma) echo 400;; gluon) echo 360;; gluon_bwd) echo 300;; varlen) echo 150;; varlen_bwd) echo 220;; bwd_host) echo 150;; *) echo 60;; esac)
      timeout $lim python benchmarks/explore.py $sweep --out $R/explore ${EXPLORE_ARGS:-} > $R/explore_$sweep.txt 2>&1; tail -40 $R/explore_$sweep.txt ;;
  esac
  tar czf $OUT/results.tar.gz -C /tmp results  # after every step: a call cut short still returns what it ran
done
