"""pytest plugin of the flash-attn test harness (loaded by run.py with `-p fa_plugin`).

* FA_SELECTION (json): {test_function: [{"id": str, "idx": [index into each parametrize mark's values]}]}.
  For a listed function the plugin replaces the full cross product of its @pytest.mark.parametrize marks with
  just those combinations (ids built the way pytest builds them), so that a 300k-item test function is never
  enumerated. Functions not listed are left alone.
* FA_DEADLINE (epoch seconds): items whose setup starts after it are skipped ("fa-harness: budget exhausted").
* FA_REPORT (jsonl): one line per test report phase, written by the controlling process as tests finish
  (so a run killed at the budget still leaves its results).
* FA_BF16_RTNE=1 (run.py sets it for --device cpu): Triton's interpreter casts fp32 -> bf16 by truncation
  (`.to(tl.bfloat16)`; GPUs round to nearest even), which makes e.g. a softmax probability of 0.99999994 become
  0.99609375 instead of 1.0 and fails flash-attn's tight bf16 gradient checks on CPU only. The plugin patches
  the interpreter's cast to round to nearest even, as the GPU does. Harness-only; flashtriton is untouched.
Items are reordered round-robin across test functions so a budget cut-off leaves every function some items.
"""

import json
import os
import time

import pytest

_CONFIG = None
_SELECTION = None
BUDGET_REASON = "fa-harness: budget exhausted"


def _argnames(mark):
    names = mark.args[0] if mark.args else mark.kwargs["argnames"]
    if isinstance(names, str):
        return [n.strip() for n in names.split(",") if n.strip()]
    return list(names)


def _argvalues(mark):
    return list(mark.args[1] if len(mark.args) > 1 else mark.kwargs["argvalues"])


def _values(value, n):
    if hasattr(value, "values") and hasattr(value, "marks") and hasattr(value, "id"):  # pytest.param(...)
        value = value.values if n > 1 else value.values[0]
    return list(value) if n > 1 else [value]


def _patch_interpreter_bf16_rtne():
    try:
        import numpy as np
        import torch
        import triton.language as tl
        import triton.runtime.interpreter as interp
    except Exception as e:  # pragma: no cover
        print(f"[fa_plugin] bf16 RTNE patch not applied: {e}")
        return False
    builder = getattr(interp, "InterpreterBuilder", None)
    if builder is None or not hasattr(builder, "cast_impl") or getattr(builder, "_fa_rtne", False):
        return False
    orig = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            a = np.ascontiguousarray(src.data, dtype=np.float32)
            t = torch.from_numpy(a.reshape(-1)).to(torch.bfloat16)  # round to nearest even
            return interp.TensorHandle(t.view(torch.int16).numpy().view(np.uint16).reshape(a.shape),
                                       dst_type.scalar)
        return orig(self, src, dst_type)

    builder.cast_impl = cast_impl
    builder._fa_rtne = True
    return True


def pytest_configure(config):
    global _CONFIG, _SELECTION
    _CONFIG = config
    if os.environ.get("FA_BF16_RTNE") == "1":
        _patch_interpreter_bf16_rtne()
    path = os.environ.get("FA_SELECTION")
    if path and os.path.exists(path):
        with open(path) as f:
            _SELECTION = json.load(f)


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc):
    if not _SELECTION:
        return
    entries = _SELECTION.get(metafunc.function.__name__)
    if entries is None:
        return
    own = metafunc.definition.own_markers
    marks = [m for m in own if m.name == "parametrize"]
    if not marks:
        return
    own[:] = [m for m in own if m.name != "parametrize"]  # the built-in hook then parametrizes nothing
    names = []
    for m in marks:
        names.extend(_argnames(m))
    params = []
    for e in entries:
        vals = []
        for m, i in zip(marks, e["idx"]):
            vals.extend(_values(_argvalues(m)[i], len(_argnames(m))))
        params.append(pytest.param(*vals, id=e["id"]))
    metafunc.parametrize(names, params)


def pytest_collection_modifyitems(config, items):
    groups = {}
    for it in items:
        groups.setdefault(getattr(it, "originalname", it.name), []).append(it)
    out, lists = [], list(groups.values())
    while any(lists):
        for lst in lists:
            if lst:
                out.append(lst.pop(0))
    items[:] = out


def pytest_runtest_setup(item):
    deadline = os.environ.get("FA_DEADLINE")
    if deadline and time.time() > float(deadline):
        pytest.skip(BUDGET_REASON)


def pytest_runtest_logreport(report):
    path = os.environ.get("FA_REPORT")
    if not path or _CONFIG is None or hasattr(_CONFIG, "workerinput"):  # controller only (xdist)
        return
    rec = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
           "duration": round(getattr(report, "duration", 0.0), 3)}
    if report.skipped:
        lr = report.longrepr
        rec["reason"] = lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
    elif report.failed:
        rec["longrepr"] = (report.longreprtext or "")[-8000:]
        rec["stdout"] = (getattr(report, "capstdout", "") or "")[-4000:]
    try:
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
    except OSError as e:  # never take the run down over the report file
        print(f"[fa_plugin] cannot write {path}: {e}")
