"""`flashtriton tune`: the occupancy arithmetic, the summary, and the interpreter's correctness-only sweep."""

import types

import pytest

from flashtriton.tools import tune

H200 = dict(regs=65536, smem=228 * 1024, warps=64, blocks=32, sms=132, name="H200")


@pytest.mark.parametrize(
    "n_regs, shared, warps, blocks, limited_by",
    [
        (255, 64 * 1024, 8, 1, "registers"),  # 255 * 32 * 8 = 65280 registers: one block
        (128, 40 * 1024, 4, 4, "registers"),  # 65536 / (128 * 32 * 4) = 4
        (64, 100 * 1024, 4, 2, "shared"),  # 228 KiB / (100 + 1) KiB = 2
        (24, 0, 8, 8, "warps"),  # 64 warps / 8 (registers would allow 10)
        (16, 0, 1, 32, "blocks"),
    ],
)
def test_occupancy(n_regs, shared, warps, blocks, limited_by):
    occ = tune.occupancy(n_regs, shared, warps, H200)
    assert (occ["blocks_per_sm"], occ["limited_by"]) == (blocks, limited_by)
    assert occ["occupancy_pct"] == pytest.approx(100 * blocks * warps / 64)


def _row(bm, regs, warps, tflops):
    occ = tune.occupancy(regs, 32 * 1024, warps, H200)
    return dict(BLOCK_M=bm, BLOCK_N=64, num_warps=warps, num_stages=3, status="ok", error=None, n_regs=regs,
                n_spills=0, shared=32 * 1024, ms=1.0, tflops=tflops, max_err=1e-3, allowed_err=2e-3, **occ)


def test_table_and_conclusion():
    rows = [_row(64, 128, 4, 300.0), _row(128, 255, 8, 350.0),
            dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2, status="pruned", error=None)]
    text = tune.table(rows)
    assert "pruned" in text and "350.0" in text
    lines = tune.conclusion(rows)
    assert lines[0].startswith("best: BLOCK_M=128 BLOCK_N=64 num_warps=8 num_stages=3: 350.0 TFLOP/s")
    assert any(line.startswith("BLOCK_M= 64: 128-128 regs/thread") for line in lines)
    assert "registers limit residency in 2/2 configs" in lines[-1]


def test_sweep_checks_every_kept_config(device):
    rows = tune.sweep((1, 2, 64, 16), tune.DTYPES["fp16"], True, device)
    assert len(rows) == len(tune.configs.FWD_CONFIGS)
    assert all(r["status"] in ("ok", "pruned") for r in rows), [r for r in rows if r["status"] not in ("ok", "pruned")]
    assert [r["BLOCK_M"] for r in rows] == sorted(r["BLOCK_M"] for r in rows)


def test_sweep_reads_the_compiled_kernel(monkeypatch, device):
    """The GPU branch (registers, occupancy, timing) with a stand-in compiled kernel and clock."""
    import triton.testing

    launch = tune.launch_forward

    def launch_with_kernel(*args, config, **kwargs):
        out, lse, _ = launch(*args, config=config, **kwargs)
        regs = {32: 96, 64: 168, 128: 255}[config["BLOCK_M"]]
        return out, lse, types.SimpleNamespace(n_regs=regs, n_spills=0, metadata=types.SimpleNamespace(shared=0))

    monkeypatch.setattr(tune, "launch_forward", launch_with_kernel)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, return_mode: float(fn() is not None))
    rows = tune.sweep((1, 1, 32, 16), tune.DTYPES["fp16"], False, device, H200)
    ok = [r for r in rows if r["status"] == "ok"]
    assert ok and all(r["ms"] == 1.0 and r["tflops"] > 0 for r in ok)
    assert {r["limited_by"] for r in ok if r["BLOCK_M"] == 128} == {"registers"}
    assert tune.conclusion(rows)[0].startswith("best: ")


def _opts(tmp_path, **kw):
    base = dict(batch=4, heads=16, seqlen=4096, head_dim=16, dtype="fp16", causal=True, out=str(tmp_path))
    return types.SimpleNamespace(**{**base, **kw})


def test_interpreter_says_loudly_which_shape_it_runs_instead(tmp_path, capsys):
    """Under the interpreter a shape too large for it is cut down, and the output and tune.json say so."""
    if not tune.INTERPRET:
        pytest.skip("the shape is cut down only under the interpreter")
    assert tune.main(_opts(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "WARNING" in out and "B,H,T,D=(4, 16, 4096, 16)" in out and "(1, 2, 128, 16)" in out
    report = __import__("json").loads((tmp_path / "tune.json").read_text())
    assert report["requested_shape"] == dict(B=4, H=16, T=4096, D=16)
    assert report["shape"] == dict(B=1, H=2, T=128, D=16) and report["shape_replaced"] is True


def test_interpreter_honours_a_shape_it_can_run(tmp_path, capsys):
    if not tune.INTERPRET:
        pytest.skip("interpreter behaviour")
    assert tune.main(_opts(tmp_path, batch=1, heads=1, seqlen=32)) == 0
    assert "WARNING" not in capsys.readouterr().out
    report = __import__("json").loads((tmp_path / "tune.json").read_text())
    assert report["shape"] == report["requested_shape"] == dict(B=1, H=1, T=32, D=16)
    assert report["shape_replaced"] is False
