"""flashtriton.parallel on gloo groups of 2 and 4 spawned processes, the kernels through the interpreter: ring
attention (zigzag and contiguous, causal and not, a window, GQA, sinks) and Ulysses (GQA, MQA, zigzag order, sinks), dense
and packed documents, forward and backward,
equal to flashtriton on the gathered sequence and through it to float64; deterministic; subgroups and a group of
one; bad input raises on every rank and leaves the group usable; one training step of examples/
context_parallel_llama.py equals the whole-sequence model's (tests/parallel_worker.py runs each rank)."""

import importlib.util
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

WORKER = Path(__file__).with_name("parallel_worker.py")
GROUP_TIMEOUT_S = 240  # the whole group: a hang fails the test instead of CI



def _interpreter_breaks() -> str:
    """Why Triton's interpreter, which the ranks run the kernels through, fails on this machine ('' if it runs):
    triton 3.6's fails with numpy >= 2.4 (as on a GPU machine whose numpy is not the `cpu` extra's)."""
    import numpy
    import triton
    from numpy.lib import NumpyVersion

    if NumpyVersion(numpy.__version__) >= "2.4.0" and NumpyVersion(triton.__version__) < "3.9.0":
        return f"the ranks' Triton interpreter: triton {triton.__version__} fails with numpy {numpy.__version__}"
    return ""


_BROKEN = _interpreter_breaks()
pytestmark = [pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="torch.distributed with gloo is needed"),
              pytest.mark.skipif(bool(_BROKEN), reason=_BROKEN or "-")]


# examples/context_parallel_llama.py's one-step check needs transformers (the `test` extra has it)
LLAMA = ["llama_training"] if importlib.util.find_spec("transformers") else []


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
    run_group(2, ["ring_zigzag_causal_gqa", "ring_contiguous_causal_window_sink", "ring_zigzag_full",
                  "ring_contiguous_full", "ulysses_causal_gqa_sink", "ulysses_full", "ring_packed_zigzag_causal_gqa",
                  "ring_packed_zigzag_full", "ring_packed_contiguous_window", "ulysses_packed_zigzag_causal",
                  "ring_lse", "ulysses_lse", *LLAMA, "bad_inputs"], tmp_path)


def test_group_of_four(tmp_path):
    """What needs more ranks than kv heads (MQA Ulysses), subgroups, and a longer ring."""
    run_group(4, ["ring_zigzag_causal_mqa", "ulysses_zigzag_causal_mqa", "ring_packed_zigzag_causal_window_sink",
                  "deterministic_and_subgroups", "bad_inputs"], tmp_path)


def _visible(q_pos, k_pos, causal, window, doc_of):
    left, right = window
    if doc_of[q_pos] != doc_of[k_pos] or (causal and k_pos > q_pos):
        return False
    return (left < 0 or k_pos >= q_pos - left) and (right < 0 or k_pos <= q_pos + right)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_packed_step_plans_cover_each_visible_pair_once(layout, world):
    """The ring's per-step calls over packed documents, for every (rank, source) of a ring: each call's rows and
    keys lie in the shards, and together they cover every visible (query, key) pair of the whole sequence once and
    no hidden pair (what each call's kernel masks: a DocCall's pieces attend to themselves, a Call at its
    positions) — random documents, empty ones included, over the mask variants."""
    from flashtriton.parallel.layout import segments
    from flashtriton.parallel.ring import DocCall, _Spec

    rng = random.Random(world)
    n = 12
    total = n * world
    for trial in range(12):
        bounds = sorted({0, total, *(rng.randrange(total + 1) for _ in range(rng.randrange(6)))})
        if trial % 3 == 0:
            bounds.insert(1, bounds[1])  # an empty document
        doc_of = [next(i for i in range(len(bounds) - 1) if bounds[i] <= p < bounds[i + 1]) for p in range(total)]
        for causal, window in ((True, (-1, -1)), (False, (-1, -1)), (True, (5, 0)), (False, (4, 2))):
            seen = {}
            for rank in range(world):
                spec = _Spec(None, rank, world, layout, causal, window, 1.0, 0.0, tuple(bounds))
                pos_q = {s.row + i: s.pos + i for s in segments(layout, rank, world, n) for i in range(s.length)}
                for src in range(world):
                    pos_k = {s.row + i: s.pos + i for s in segments(layout, src, world, n) for i in range(s.length)}
                    for c in spec.calls(n, src):
                        if isinstance(c, DocCall):
                            pieces = [(c.rows.start + a, c.rows.start + b) for a, b in zip(c.cuts[:-1], c.cuts[1:])]
                            pairs = [(pos_q[r], pos_k[t]) for a, b in pieces for r in range(a, b) for t in range(a, b)
                                     if _visible_as_piece(r - a, t - a, b - a, causal, window)]
                            assert src == rank
                        else:
                            pairs = [(pos_q[r], pos_k[t]) for r in range(c.q_rows.start, c.q_rows.stop)
                                     for t in range(c.k_rows.start, c.k_rows.stop)
                                     if _visible(pos_q[r], pos_k[t], c.causal, c.window, [0] * total)]
                        for p in pairs:
                            seen[p] = seen.get(p, 0) + 1
            want = {(p, t) for p in range(total) for t in range(total) if _visible(p, t, causal, window, doc_of)}
            assert set(seen) == want and all(v == 1 for v in seen.values()), (bounds, causal, window)


def _visible_as_piece(i, j, length, causal, window):
    """A DocCall piece (one document's rows attending to themselves): the kernels' bottom-right mask."""
    return _visible(i, j, causal, window, [0] * length)
