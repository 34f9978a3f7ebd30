"""Every kind of public call builds for sm_90: tests/sm90_builds.py runs them on CPU tensors in a process without
the interpreter, with each kernel launch compiled for a Hopper target (Triton's binding, specialization and
compiler, its bundled ptxas) instead of run. The interpreter the other CPU tests use runs code the compiler
refuses; this is the CPU's check of what the first GPU call would compile."""

import os
import subprocess
import sys
from pathlib import Path

import flashtriton

SCRIPT = Path(__file__).with_name("sm90_builds.py")


def test_public_calls_build_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(flashtriton.__file__).parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900)
    report = done.stdout + done.stderr[-3000:]
    assert done.returncode == 0, report
    built = [line for line in done.stdout.splitlines() if line.startswith("built ")]
    cases = int(done.stdout.split("cases ")[-1])
    assert cases >= 9 and len(built) == cases, report  # (the script patches Triton: never imported here)
    assert all(line.split(": ", 1)[1] for line in built), report  # each case launched (and built) a kernel
