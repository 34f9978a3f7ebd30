#!/usr/bin/env bash
# Create .venv (once) and install flashtriton with the given extras into it. Usage: scripts/setup-venv.sh EXTRAS
# torch is installed first: a GPU machine keeps the CUDA build pip chooses (and the triton it pins); a machine
# without a GPU gets the CPU build (torch 2.13.0, where available) so that nothing downloads gigabytes of CUDA
# libraries, and triton 3.6.0, the version the H200 machine runs, so that the interpreter tests what is timed.
set -euo pipefail
extras=${1:-cpu}
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
py=.venv/bin/python
$py -m pip install -q --upgrade pip >/dev/null
if ! $py -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    $py -m pip install -q torch
  else
    $py -m pip install -q torch==2.13.0 || $py -m pip install -q torch
  fi
fi
if ! command -v nvidia-smi >/dev/null 2>&1 && ! $py -c "import triton" 2>/dev/null; then
  $py -m pip install -q "triton==3.6.0" || true  # else pyproject's triton>=3.2 picks one
fi
$py -m pip install -q -e ".[$extras]"
