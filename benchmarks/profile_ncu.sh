#!/usr/bin/env bash
# Nsight Compute on the device machine: one kernel per case (benchmarks/profile_ncu.py), the full section set,
# each report also dumped as CSV (the details page, every raw metric, and the SASS source page with its stall samples).
#   bash benchmarks/profile_ncu.sh OUTDIR CASE...      e.g. CASE = gluon_q1-128-0-4096, cudnn-128-0-4096, tma-64-1-512
# NCU_REUSE=1: for a case whose OUTDIR/CASE.ncu-rep exists, only dump its raw metrics again (no new profile).
set -u
out=$1; shift
mkdir -p "$out"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
for case in "$@"; do
  echo "=== $case $(date +%T)"
  if [ -f "$out/$case.ncu-rep" ] && [ -n "${NCU_REUSE:-}" ]; then  # dump an earlier report again
    ncu -i "$out/$case.ncu-rep" --page raw --csv > "$out/$case.raw.csv" 2> "$out/$case.raw.err"; continue
  fi
  timeout 150 ncu --clock-control none --nvtx --nvtx-include "prof/" --set full --import-source no \
      -o "$out/$case" -f python benchmarks/profile_ncu.py "$case" > "$out/$case.log" 2>&1
  tail -3 "$out/$case.log"
  ncu -i "$out/$case.ncu-rep" --page details --csv > "$out/$case.details.csv" 2> "$out/$case.details.err"
  ncu -i "$out/$case.ncu-rep" --page raw --csv > "$out/$case.raw.csv" 2> "$out/$case.raw.err"
  ncu -i "$out/$case.ncu-rep" --page source --csv --print-source sass > "$out/$case.sass.csv" 2> "$out/$case.sass.err"
  wc -c "$out/$case.details.csv" "$out/$case.sass.csv" | head -2
done
