"""flashtriton.parallel on gloo groups of 2 and 4 spawned processes, the kernels through the interpreter: ring
attention (zigzag and contiguous, causal and not, a window, GQA) and Ulysses (GQA, MQA, zigzag order), forward and backward,
equal to flashtriton on the gathered sequence and through it to float64; deterministic; subgroups and a group of
one; bad input raises on every rank and leaves the group usable (tests/parallel_worker.py runs each rank)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

WORKER = Path(__file__).with_name("parallel_worker.py")
GROUP_TIMEOUT_S = 240  # the whole group: a hang fails the test instead of CI

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is needed")


def run_group(world: int, checks: list[str], tmp_path: Path) -> None:
    """Spawn `world` ranks running `checks`; fail with every rank's output if one fails or the group outlives
    GROUP_TIMEOUT_S (then every rank is killed)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    init = tmp_path / "init"
    logs = [tmp_path / f"rank{r}.log" for r in range(world)]
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen([sys.executable, str(WORKER), str(rank), str(world), str(init), *checks],
                                          stdout=f, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + GROUP_TIMEOUT_S
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    if any(codes):
        report = "\n".join(f"--- rank {r} (exit {c}) ---\n{log.read_text()}" for r, (c, log) in
                           enumerate(zip(codes, logs)))
        pytest.fail(f"group of {world}: exit codes {codes}\n{report}")


def test_group_of_two(tmp_path):
    run_group(2, ["ring_zigzag_causal_gqa", "ring_contiguous_causal_window", "ring_zigzag_full", "ulysses_causal_gqa",
                  "bad_inputs"], tmp_path)


def test_group_of_four(tmp_path):
    run_group(4, ["ring_zigzag_causal_mqa", "ring_contiguous_full", "ulysses_zigzag_causal_mqa", "ulysses_full",
                  "deterministic_and_subgroups", "bad_inputs"], tmp_path)
