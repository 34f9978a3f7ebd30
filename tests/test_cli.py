"""The `flashtriton` command: entry points, `check` on the CPU (interpreter), exit statuses, `bench` dispatch.

GPU-only checks SKIP under the interpreter; their table, plot and verdict are tested on made-up rows.
"""

import json
import os
import shutil
import subprocess
import sys
import types

import pytest

import flashtriton
import flashtriton.tools
from flashtriton import cli
from flashtriton._env import INTERPRET
from flashtriton.tools import checks

GPU_CHECKS = ["triton_fa2_at_least_3x_naive", "triton_fa2_fwd_bwd_faster_than_naive", "memory_linear_in_T"]


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"flashtriton {flashtriton.__version__}"


def test_console_script_version():
    exe = shutil.which("flashtriton", path=os.path.dirname(sys.executable)) or shutil.which("flashtriton")
    if exe is None:
        pytest.skip("the flashtriton console script is not installed")
    result = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == f"flashtriton {flashtriton.__version__}"


def test_python_m_tune_restarts_with_interpreter(tmp_path):
    """`python -m flashtriton` without TRITON_INTERPRET: on a CPU it restarts itself with the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "flashtriton", "tune", "-B", "1", "-H", "2", "-T", "128", "-D", "32",
           "--causal", "--out", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "tune.json").read_text())
    statuses = {row["status"] for row in report["rows"]}
    assert statuses <= {"ok", "pruned"} and "ok" in statuses
    if INTERPRET:
        assert report["mode"] == "interpreter-correctness-only"
        assert "SKIP" in result.stdout


TIMING_CHECKS = {"triton_fa2_at_least_3x_naive", "triton_fa2_fwd_bwd_faster_than_naive"}


def test_check_quick_writes_json(tmp_path):
    rc = cli.main(["check", "--quick", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "check.json").read_text())
    results = {c["name"]: c for c in report["checks"]}
    failed = {name for name, c in results.items() if c["status"] == "FAIL"}
    assert rc == (1 if failed else 0)
    # Speed checks can lose on a GPU shared with other test processes (pytest -n); correctness never may.
    # (`flashtriton check` alone passes them: benchmarks/2026-11-29-h200/check/.)
    assert failed <= TIMING_CHECKS, failed
    assert [name for name, _, _ in checks.STEPS] == list(results)
    fwd = results["triton_fa2_error_within_2x_sdpa_math_or_1e_minus_3"]
    assert fwd["status"] == "PASS" and fwd["data"]["max_err"] <= fwd["data"]["allowed"]
    assert results["triton_fa2_grads_match_float64"]["status"] == "PASS"
    assert results["attention_ai_above_128"]["data"]["ai"] == pytest.approx(512.0)
    assert results["memory_linear_in_T"]["status"] == "SKIP"
    if INTERPRET:
        for name in GPU_CHECKS:
            assert results[name]["status"] == "SKIP" and "GPU" in results[name]["message"]
    for key in ("gpu", "torch", "triton", "git_sha", "date", "interpreter"):
        assert key in report["environment"]


def test_failing_check_exits_1(monkeypatch, tmp_path):
    monkeypatch.setattr(checks.flashtriton, "attention_flops", lambda *a, **k: 0.0)
    assert cli.main(["check", "--only", "attention_ai_above_128", "--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "check.json").read_text())
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert statuses["attention_ai_above_128"] == "FAIL"
    assert {s for n, s in statuses.items() if n != "attention_ai_above_128"} == {"SKIP"}


def test_check_that_raises_fails(monkeypatch):
    def broken(env, opts):
        raise RuntimeError("boom")

    monkeypatch.setattr(checks, "STEPS", [("attention_ai_above_128", broken, None)])
    assert cli.main(["check"]) == 1


def test_backward_that_does_not_import_fails(monkeypatch, capsys):
    real_import = checks.importlib.import_module

    def import_module(name, *args):
        if name == "flashtriton.kernels.backward":
            raise ImportError("no backward here")
        return real_import(name, *args)

    monkeypatch.setattr(checks.importlib, "import_module", import_module)
    assert cli.main(["check", "--only", "triton_fa2_grads_match_float64"]) == 1
    assert "no backward here" in capsys.readouterr().out


def test_unknown_option_is_an_error():
    with pytest.raises(SystemExit) as exc:
        cli.main(["check", "--no-such-option"])
    assert exc.value.code == 2


def test_bench_passes_its_arguments_through(monkeypatch):
    fake = types.ModuleType("flashtriton.tools.bench")
    fake.add_arguments = lambda parser: parser.add_argument("--seqlens", type=int)
    fake.main = lambda args: 0 if args.seqlens == 7 else 5
    monkeypatch.setitem(sys.modules, "flashtriton.tools.bench", fake)
    monkeypatch.setattr(flashtriton.tools, "bench", fake, raising=False)
    assert cli.main(["bench", "--seqlens", "7"]) == 0


def test_bench_missing_exits_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "flashtriton.tools.bench", None)
    monkeypatch.delattr(flashtriton.tools, "bench", raising=False)
    assert cli.main(["bench"]) == 2
    assert "no flashtriton.tools.bench" in capsys.readouterr().err


def _rows(ft_growth):
    """Made-up memory sweep rows: flashtriton's extra MiB grows as T**ft_growth, MATH's as T**2."""
    rows = []
    for T in (256, 1024, 4096):
        for mode in checks.MODES:
            rows.append(dict(T=T, provider="flashtriton", mode=mode, extra_mib=(T / 256) ** ft_growth,
                             ms=T / 1e3, note=""))
            fits = T < 4096
            rows.append(dict(T=T, provider="math", mode=mode, extra_mib=(T / 256) ** 2 if fits else None,
                             ms=T / 1e2 if fits else None, note="" if fits else "skipped: ~9 GiB estimated"))
    return rows


def test_memory_verdict_table_and_plot(tmp_path):
    linear = checks.judge_memory("memory_linear_in_T", _rows(1.0))
    assert linear.status == "PASS" and linear.data["ratios"]["fwd"] == pytest.approx(4.0)
    assert checks.judge_memory("memory_linear_in_T", _rows(2.0)).status == "FAIL"
    table = checks.memory_table(_rows(1.0))
    assert "skipped: ~9 GiB estimated" in table and len(table.splitlines()) == 2 + 3 * len(checks.MODES)
    path = checks.memory_plot(_rows(1.0), tmp_path / "memory_latency.png")
    assert path.stat().st_size > 0


@pytest.mark.parametrize("argv,message", [
    (["bench", "--providers", "foo"], "unknown provider 'foo'"),
    (["bench", "--causal", "2"], "--causal wants a comma list of 0 and 1"),
    (["bench", "--append"], "--append merges into --out"),
    (["bench", "--shape", "a,b,c,d"], "--shape wants B,H,T,D"),
    (["bench", "--seqlens", "1q"], "--seqlens wants comma-separated integers"),
    (["tune", "-D", "300"], "-D in 1..256"),
])
def test_bad_options_give_one_line_and_exit_2(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_check_names_say_what_they_judge(monkeypatch):
    """The forward check passes on max abs error vs float64 <= max(1e-3, 2x torch MATH's own): its name says
    both bounds, and a result 1.05e-3 from exact passes only where MATH's own error allows it."""
    names = [name for name, _, _ in checks.STEPS]
    assert "triton_fa2_error_within_2x_sdpa_math_or_1e_minus_3" in names
    assert not any(name.endswith("within_1e_minus_3") for name in names)
    monkeypatch.setattr(checks, "NOTEBOOK_SHAPE", (1, 1, 16, 16))
    monkeypatch.setattr(checks, "naive", lambda q, k, v: checks.sdpa_reference(q, k, v, is_causal=True))  # exact
    monkeypatch.setattr(checks, "ours", lambda q, k, v: checks.sdpa_reference(q, k, v, is_causal=True) + 1.05e-3)
    env = checks.Env("cpu", None, None, {})
    result = checks.check_forward_matches(env, None)
    assert result.name in names and result.status == checks.FAIL  # MATH exact here: the bound is 1e-3
    assert "above the allowed" in result.message and "max(1e-3, 2x MATH's own" in result.message
