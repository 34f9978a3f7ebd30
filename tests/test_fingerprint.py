"""scripts/ptx_fingerprint.py: the PTX fingerprint of the dispatched kernels, compiled on the CPU.

The quick grid (one dense forward + backward and one decode call, for sm_90 and sm_80) runs in fresh processes with
the interpreter off, twice: the second run compares itself with the first and must find them the same. The
comparison's verdicts are checked on small hand-made fingerprints."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "ptx_fingerprint.py"


def _script():
    spec = importlib.util.spec_from_file_location("ptx_fingerprint", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(SCRIPT), "--quick", *args], env=env, capture_output=True, text=True,
                          timeout=300)


def test_quick_fingerprint_covers_both_targets_and_repeats(tmp_path):
    first = tmp_path / "first.json"
    proc = _run("-o", str(first))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(first.read_text())
    assert result["errors"] == {}
    entries = result["entries"].values()
    kernels = {(e["kernel"], e["target"]) for e in entries}
    # forward, preprocess (unless the dQ kernel does its work: TRITON_BWD_FUSED_DELTA), dK/dV, dQ, KV append and
    # decode on both targets; sm_90's forward is the Gluon kernel
    from flashtriton import configs

    expected = 2 * (6 - bool(configs.backward.TRITON_BWD_FUSED_DELTA))
    assert len(result["entries"]) >= expected and len(kernels) >= expected, sorted(kernels)
    assert {"_attn_fwd_gluon", "_attn_bwd_dkdv", "_attn_bwd_dq", "_decode_split", "_append_kv"} <= \
        {k for k, t in kernels if t == "sm_90"}
    assert ("_attn_fwd", "sm_80") in kernels
    assert all(len(e["sha256"]) == 64 for e in entries)
    assert all(result["calls"].values())  # every call launched something

    proc = _run("--compare", str(first))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SAME" in proc.stdout


def _fingerprint(entries: dict, calls: dict) -> dict:
    """A fingerprint of entries {key: sha256} whose calls name the entries by key."""
    entries = {k: dict(id=k, kernel=k.split("@")[0], target="sm_90", sha256=sha) for k, sha in entries.items()}
    return dict(entries=entries, calls=calls, errors={})


def test_compare_reports_every_difference():
    compare = _script().compare
    old = _fingerprint({"a@sm_90 X=1": "1", "b@sm_90 X=1": "2"}, {"call": ["a@sm_90 X=1", "b@sm_90 X=1"]})
    assert compare(old, old)[0]
    changed = _fingerprint({"a@sm_90 X=1": "1", "b@sm_90 X=1": "3"}, {"call": ["a@sm_90 X=1", "b@sm_90 X=1"]})
    same, report = compare(old, changed)
    assert not same and "PTX differs: 1" in report
    renamed = _fingerprint({"a@sm_90 Y=1": "1", "b@sm_90 Y=1": "2"}, {"call": ["a@sm_90 Y=1", "b@sm_90 Y=1"]})
    same, report = compare(old, renamed)
    assert not same and "missing (old only): 2" in report and "new (new only): 2" in report
    assert compare(old, renamed, ptx_only=True)[0]  # the same PTX under renamed keys
    assert not compare(old, changed, ptx_only=True)[0]
    fewer = _fingerprint({"a@sm_90 X=1": "1", "b@sm_90 X=1": "2"}, {"call": ["a@sm_90 X=1"]})
    assert not compare(old, fewer, ptx_only=True)[0]  # a call that launches less


def test_code_only_drops_debug_information():
    code_only = _script().code_only
    ptx = ("//\n.version 8.7\n.target sm_90a\n\t.file\t1 \"/x/forward.py\"\n\t.loc\t1 10 5\n$L__tmp0:\n"
           "\tmov.u32 \t%r1, 0;\n\t.section\t.debug_abbrev\n\t{\n\t}\n")
    assert code_only(ptx) == "//\n.version 8.7\n.target sm_90a\n\tmov.u32 \t%r1, 0;"
