"""`flashtriton bench`: sweep generation, FLOP and padding accounting, tables, row schema, the variants suite's
cases and bars, and a smoke run of every suite on the CPU (flashtriton through the interpreter; CUDA-only providers
reported as skipped)."""

import argparse
import csv
import json
import statistics
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

import flashtriton
from flashtriton.kernels.variant import Variant
from flashtriton.tools import bench, bench_core as C, bench_measure as M, bench_providers as P, bench_report as R
from flashtriton.tools import bench_suites as S, bench_variants as V
from flashtriton.reference import attention_reference

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def parse(argv):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return bench.resolve(parser.parse_args(argv))


TINY = ["--warmup", "1", "--rep", "1"]


# ----------------------------------------------------------------------------------------------------------
# pure parts
# ----------------------------------------------------------------------------------------------------------
def test_standard_sweep_is_the_papers_sweep():
    shapes = C.standard_shapes([512, 1024, 2048, 4096, 8192, 16384], [64, 128, 256])
    assert len(shapes) == 18
    assert all(s.B * s.T == 16384 and s.H * s.D == 2048 for s in shapes)
    assert C.Shape(B=32, H=32, T=512, D=64) in shapes and C.Shape(B=1, H=8, T=16384, D=256) in shapes
    assert C.standard_shapes([32768], [128])[0].B == 1  # never zero
    odd = C.standard_shapes([4096], [80, 96, 192])  # the heads that fit, as the anchors' runs of these head dims
    assert [(s.B, s.H, s.D) for s in odd] == [(4, 25, 80), (4, 21, 96), (4, 10, 192)]
    with pytest.raises(ValueError):
        C.standard_shapes([512], [4096])  # a head dim past the hidden size


def test_default_and_quick_options():
    args = parse([])
    assert args.shapes == C.standard_shapes(bench.STANDARD_SEQLENS, [64, 128, 256])  # the issue's standard sweep
    assert args.modes_list == ["fwd", "bwd"] and args.dtype_list == ["fp16"] and args.causal_list == [False, True]
    assert args.flex_seqlens == {1024, 4096, 16384} and (args.warmup, args.rep) == (100, 100)
    assert args.decode_batch_list == [1, 8, 16, 64] and args.decode_seqlen_list[-1] == 128 * 1024
    quick = parse(["--quick"])
    assert [(s.T, s.D) for s in quick.shapes] == [(1024, 128), (4096, 128)] and quick.varlen_n == 16
    explicit = parse(["--shape", "2,3,100,40", "--shape", "1x4x7x8", "--seqlens", "1k", "--flex-seqlens", "all"])
    assert explicit.shapes == [C.Shape(2, 3, 100, 40), C.Shape(1, 4, 7, 8)] and explicit.flex_seqlens is None
    assert C.parse_int_list("512, 1k,2K") == [512, 1024, 2048]
    for bad in (["--modes", "fwd,sideways"], ["--dtypes", "fp8"], ["--shape", "1,2,3"]):
        with pytest.raises(ValueError):
            parse(bad)


def test_flop_accounting():
    shape = C.Shape(B=2, H=3, T=128, D=64)
    fwd = 4 * 2 * 3 * 128 * 128 * 64
    assert C.mode_flops(shape, False, "fwd") == fwd
    assert C.mode_flops(shape, True, "fwd") == fwd / 2
    assert C.mode_flops(shape, False, "bwd") == 2.5 * fwd
    assert C.mode_flops(shape, True, "fwd_bwd") == 3.5 * fwd / 2
    assert C.tflops(2e12, 1000.0) == pytest.approx(2.0) and C.tflops(1.0, None) is None
    assert C.varlen_flops([3, 5], 2, 8, False, "fwd") == 4 * 2 * 8 * (9 + 25)


def test_padding_fraction_math():
    stats = C.padding_stats([4, 2])
    assert stats["token_padding_frac"] == pytest.approx(1 - 6 / 8)
    assert stats["flop_padding_frac"] == pytest.approx(1 - 20 / 32)
    assert stats["ideal_speedup"] == pytest.approx(32 / 20)
    # the serving issue's bar: time saved >= the FLOP padding fraction (0.375 here) minus 10 points
    assert stats["target_speedup"] == pytest.approx(1 / (1 - 0.275))
    assert C.padding_stats([7, 7, 7])["flop_padding_frac"] == 0.0
    assert C.padding_stats([7, 7, 7])["target_speedup"] == 1.0
    with pytest.raises(ValueError):
        C.padding_stats([])
    lens = S.varlen_seqlens(64, 4096, seed=0)
    assert lens == S.varlen_seqlens(64, 4096, seed=0) != S.varlen_seqlens(64, 4096, seed=1)
    assert len(lens) == 64 and 1 <= min(lens) and max(lens) <= 4096


def test_compare_judges_relative_error():
    ref = {"out": torch.tensor([[0.5, -3.0]])}
    assert C.compare({"out": torch.tensor([[0.505, -3.0]])}, ref, torch.float16)[0]
    ok, max_err, rel = C.compare({"out": torch.tensor([[0.5, -2.7]])}, ref, torch.float16)
    assert not ok and max_err == pytest.approx(0.3, rel=1e-5) and rel == pytest.approx(0.1, rel=1e-5)
    assert not C.compare({"out": torch.tensor([[float("nan"), -3.0]])}, ref, torch.float16)[0]
    assert not C.compare({}, ref, torch.float16)[0]


def test_reference_slices_match_full_attention_with_gqa():
    torch.manual_seed(0)
    q, dout = torch.randn(2, 9, 4, 8), torch.randn(2, 9, 4, 8)
    k, v = torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 8)
    ref = C.reference_slices(q, k, v, dout, True, heads=1, with_grad=True)  # rounds up to one whole group
    assert ref["out"].shape == (1, 9, 2, 8) and ref["dk"].shape == (1, 9, 1, 8)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    full = attention_reference(*leaves, causal=True, dtype=torch.float64)
    full.backward(dout.double())
    got = {"out": full.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    ok, max_err, _ = C.compare(C.slice_like(got, ref), ref, torch.float32)
    assert ok and max_err < 1e-5


def test_row_schema_and_files(tmp_path):
    env = {"gpu": "g", "torch": "t", "triton": "tr", "cudnn": "", "flashtriton": "f", "git_sha": "s", "date": "d"}
    row = C.make_row(env, op="attention", mode="fwd", provider="flashtriton", B=1, T=8, first_call_s=0.5,
                     status="ok", max_err=math.inf)
    assert list(row) == C.ROW_FIELDS and row["extra"] == {"first_call_s": 0.5} and row["gpu"] == "g"
    R.write_results([row], str(tmp_path))
    newer = dict(row, ms_p50=2.0, extra={})
    other = dict(row, provider="sdpa_cudnn")
    _, merged = R.write_results([newer, other], str(tmp_path), existing=R.read_rows(str(tmp_path)))
    assert len(merged) == 2 and merged[0]["ms_p50"] == 2.0  # same key replaced, not duplicated
    rows = json.loads((tmp_path / "bench.json").read_text())
    assert rows[0]["max_err"] is None  # non-finite numbers become null, valid JSON
    with open(tmp_path / "bench.csv") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == C.ROW_FIELDS and len(list(reader)) == 2


def _row(provider, tflops, status="ok", mode="fwd", T=1024, error=None):
    env = dict.fromkeys(("gpu", "torch", "triton", "cudnn", "flashtriton", "git_sha", "date"), "")
    return C.make_row(env, op="attention", suite="standard", mode=mode, provider=provider, B=16, H=16, H_kv=16,
                      T=T, T_k=T, D=128, causal=0, dtype="fp16", tflops=tflops, status=status, error=error,
                      max_err=0.5 if status == "check_failed" else None, rel_err=0.1 if status == "check_failed" else None)


def test_markdown_table_ratios_and_marks():
    rows = [_row("flashtriton", 300.0), _row("sdpa_cudnn", 400.0), _row("sdpa_flash", 250.0),
            _row("flex", None, status="error", error="BackendCompilerFailed: boom"),
            _row("sdpa_math", None, status="check_failed"),
            _row("flashtriton", 120.0, mode="bwd"), _row("sdpa_cudnn", 100.0, mode="bwd")]
    table = R.standard_table(rows)
    lines = [l for l in table.splitlines() if l.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[-2:] == ["ours/best_other", "ours/cudnn"] and header.index("flashtriton") < header.index("flex")
    assert len({l.count("|") for l in lines}) == 1  # every row has every column
    fwd = [c.strip() for c in lines[2].strip("|").split("|")]
    assert fwd[0] == "fwd" and fwd[-2:] == ["0.75", "0.75"]
    assert fwd[header.index("flex")] == "err" and fwd[header.index("sdpa_math")] == "FAIL"
    bwd = [c.strip() for c in lines[3].strip("|").split("|")]
    assert bwd[0] == "bwd" and bwd[-2:] == ["1.20", "1.20"]
    assert "BackendCompilerFailed: boom" in table and "accuracy check failed" in table


def test_providers_and_skips():
    assert P.parse_providers(None) == list(P.DEFAULT_PROVIDERS) and "seed" not in P.DEFAULT_PROVIDERS
    assert P.parse_providers("ours,cudnn,math,cudnn") == ["flashtriton", "sdpa_cudnn", "sdpa_math"]
    with pytest.raises(ValueError):
        P.parse_providers("flashtriton,xformers")
    args = parse([])
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    # MATH's T x T scores: 16 x 16 x 2048^2 x 4 B = 4 GiB forward runs, x3 with gradients does not.
    assert P.skip_reason("sdpa_math", gpu, 16, 16, 2048, 128, "fwd", args) is None
    assert "GiB" in P.skip_reason("sdpa_math", gpu, 16, 16, 2048, 128, "bwd", args)
    assert "--flex-seqlens" in P.skip_reason("flex", gpu, 8, 16, 2048, 128, "fwd", args)
    assert P.skip_reason("flex", gpu, 16, 16, 1024, 128, "fwd", args) is None
    for name in ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex", "flash_attn"):
        assert "CUDA" in P.skip_reason(name, cpu, 1, 2, 64, 32, "fwd", args)
    assert P.skip_reason("seed", gpu, 1, 2, 64, 32, "bwd", args) == "forward only"


def test_head_dims_take_a_v_head_dim_of_its_own():
    """--head-dims QK/V: v's head dim its own (H = hidden // D still); a bad form names --head-dims."""
    args = parse(["--head-dims", "128,192/128", "--seqlens", "4k"])
    assert args.shapes == [C.Shape(4, 16, 4096, 128), C.Shape(4, 10, 4096, 192, 128)]
    assert [s.head_dims for s in args.shapes] == ["128", "192/128"] and args.shapes[0].Dv == 128
    assert parse(["--shape", "1,2,64,40/24"]).shapes == [C.Shape(1, 2, 64, 40, 24)]
    assert C.parse_head_dims("256/1, 64/64") == [(256, 1), (64, 64)]
    for bad in ("192/", "/128", "0/64", "64/0", "a/b", "64/257", "257", "192/128/64", ",", "-1"):
        with pytest.raises(ValueError, match="--head-dims wants head dims D or QK/V .* from 1 to 256"):
            parse(["--head-dims", bad])
    with pytest.raises(ValueError, match="--shape wants"):
        parse(["--shape", "1,2,64,40/"])


def test_flops_count_v_head_dim():
    """fwd 2·B·H·T²·(D + Dv) (QKᵀ at D, PV at Dv), halved when causal; bwd 2.5x, fwd_bwd 3.5x; 4·B·H·T²·D at Dv = D."""
    mla = C.Shape(B=2, H=3, T=128, D=192, Dv=128)
    fwd = 2 * 2 * 3 * 128 * 128 * (192 + 128)
    assert C.mode_flops(mla, False, "fwd") == fwd and C.mode_flops(mla, True, "fwd") == fwd / 2
    assert C.mode_flops(mla, False, "bwd") == 2.5 * fwd and C.mode_flops(mla, True, "fwd_bwd") == 3.5 * fwd / 2
    assert C.mode_flops(C.Shape(2, 3, 128, 64, 64), False, "bwd") == C.mode_flops(C.Shape(2, 3, 128, 64), False, "bwd")


def test_old_rows_without_dv_merge_as_dv_equal_d(tmp_path):
    """A bench.json written before rows had Dv loads with Dv = D: the same measurement made now replaces it, and a
    Dv != D one sits beside it; tables show D as QK/V where v's differs."""
    old = {k: v for k, v in _row("flashtriton", 100.0).items() if k != "Dv"}
    (tmp_path / "bench.json").write_text(json.dumps([old]))
    assert R.read_rows(str(tmp_path))[0]["Dv"] == 128 and list(R.read_rows(str(tmp_path))[0]) == C.ROW_FIELDS
    results = R.Results(str(tmp_path), append=True)
    same = _row("flashtriton", 200.0)
    assert same["Dv"] == 128  # make_row: Dv = D unless given
    mla = dict(_row("flashtriton", 300.0), D=192, Dv=128)
    results.add([same, mla])
    rows = json.loads((tmp_path / "bench.json").read_text())
    assert sorted((r["D"], r["Dv"], r["tflops"]) for r in rows) == [(128, 128, 200.0), (192, 128, 300.0)]
    lines = [l for l in R.standard_table(rows).splitlines() if l.startswith("|")]
    column = [c.strip() for c in lines[0].strip("|").split("|")].index("D")
    assert sorted(l.strip("|").split("|")[column].strip() for l in lines[2:]) == ["128", "192/128"]


def test_sdpa_backends_that_refuse_dv_are_skipped_with_torch_reason(monkeypatch):
    """On a GPU each SDPA backend is asked (torch.backends.cuda.can_use_*) whether it takes Dv != D; a refusal becomes a
    skip whose reason is torch's own (the warnings of a call under that backend alone), never a padded v."""
    messages = ["Memory efficient kernel not used because: (Triggered internally at sdp_utils.cpp:1.)",
                "Flash attention kernel not used because: (Triggered internally at sdp_utils.cpp:2.)",
                "Flash attention requires q,k,v to have the same last dimension and to be less than or equal to 256. "
                "Got Query.size(-1): 192, Key.size(-1): 192, Value.size(-1): 128 instead. (Triggered internally at "
                "/pytorch/aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:282.)",
                "cuDNN attention kernel not used because: (Triggered internally at sdp_utils.cpp:3.)",
                "cuDNN attention has been runtime disabled. (Triggered internally at sdp_utils.cpp:4.)"]
    assert P.torch_reasons(messages, "Flash attention kernel not used because") == [messages[2].split(" (Trig")[0]]
    asked = []

    def refuse(params, debug):
        asked.append((params.query.shape[-1], params.value.shape[-1], params.query.requires_grad))
        return False

    def no_kernel(q, k, v, **kw):
        for m in messages:
            warnings.warn(m)
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr(torch.backends.cuda, "can_use_flash_attention", refuse)
    monkeypatch.setattr(P.F, "scaled_dot_product_attention", no_kernel)
    reason = P.sdpa_refusal("sdpa_flash", torch.device("cpu"), 16, 192, 128, True, torch.bfloat16, True)
    assert asked == [(192, 128, True)]
    assert reason.startswith("torch SDPA's FLASH_ATTENTION backend refuses this problem (q, k head dim 192, v 128, "
                             "bfloat16, backward): Flash attention requires q,k,v to have the same last dimension")
    monkeypatch.setattr(torch.backends.cuda, "can_use_efficient_attention", lambda params, debug: True)
    assert P.sdpa_refusal("sdpa_efficient", torch.device("cpu"), 16, 192, 128, False, torch.float16, False) is None
    gpu = torch.device("cuda")
    assert "flash-attn 2 needs v's head dim equal to q's" in P.head_dim_v_refusal("flash_attn", gpu, 64, 192, 128,
                                                                                  "fwd", torch.float16, False)
    assert "one head dim" in P.head_dim_v_refusal("seed", gpu, 64, 64, 32, "fwd", torch.float16, False)
    for name in ("flashtriton", "sdpa_math", "flex"):  # take any Dv (Flex checks only q's and k's match)
        assert P.head_dim_v_refusal(name, gpu, 64, 192, 128, "bwd", torch.float16, True) is None


# ----------------------------------------------------------------------------------------------------------
# smoke runs (CPU: the interpreter; on a GPU the same code paths with real kernels)
# ----------------------------------------------------------------------------------------------------------
def test_standard_suite_checks_then_times():
    args = parse(["--shape", "1,2,64,32", "--modes", "fwd,bwd", "--causal", "1", *TINY])
    rows = bench.run_standard(args, C.environment(), ["flashtriton", "sdpa_math", "sdpa_cudnn", "flex"])
    by = {(r["provider"], r["mode"]): r for r in rows}
    assert len(rows) == 8
    for mode in ("fwd", "bwd"):
        ours = by[("flashtriton", mode)]
        assert ours["status"] == "ok" and ours["check_passed"] and ours["max_err"] < 1e-2
        assert 0 < ours["ms_p20"] <= ours["ms_p50"] <= ours["ms_p80"] and ours["tflops"] > 0
        assert by[("sdpa_math", mode)]["status"] == "ok" and by[("sdpa_math", mode)]["check_passed"]
        if not CUDA:
            assert by[("sdpa_cudnn", mode)]["status"] == "skipped" and "CUDA" in by[("sdpa_cudnn", mode)]["error"]
            assert by[("flex", mode)]["status"] == "skipped" and by[("flex", mode)]["tflops"] is None


def test_standard_suite_runs_a_v_head_dim_of_its_own():
    """--head-dims D/Dv on the CPU: flashtriton and MATH get v (and dout) of head dim Dv, are checked against the
    reference with that v (output and dq, dk, dv), and count 2·B·H·T²·(D + Dv) FLOPs."""
    args = parse(["--head-dims", "32/16", "--seqlens", "32", "--tokens", "32", "--hidden", "64", "--modes", "fwd,bwd",
                  "--causal", "1", *TINY])
    shape = C.Shape(1, 2, 32, 32, 16)
    assert args.shapes == [shape]
    rows = bench.run_standard(args, C.environment(), ["flashtriton", "sdpa_math"])
    assert len(rows) == 4
    for r in rows:
        assert (r["D"], r["Dv"], r["status"], r["check_passed"]) == (32, 16, "ok", True), r
        assert r["tflops"] == pytest.approx(C.mode_flops(shape, True, r["mode"]) / r["ms_p50"] / 1e9)
    assert C.mode_flops(shape, True, "fwd") == 2 * 1 * 2 * 32 * 32 * (32 + 16) / 2
    assert "32/16" in R.standard_table(rows)


def test_wrong_or_raising_provider_is_marked_not_timed(monkeypatch):
    real_prepare = P.prepare

    def fake_prepare(name, q, k, v, causal, grad):
        if name == "sdpa_math":  # stands in for a broken kernel: right shape, wrong values
            prepared = real_prepare("flashtriton", q, k, v, causal, grad)
            return P.Prepared(lambda: prepared.forward() * 1.5, prepared.leaves, prepared.to_bshd, prepared.from_bshd)
        if name == "sdpa_efficient":
            raise RuntimeError("No available kernel. Aborting execution.\nsecond line")
        return real_prepare(name, q, k, v, causal, grad)

    monkeypatch.setattr(P, "prepare", fake_prepare)
    monkeypatch.setattr(P, "skip_reason", lambda *a, **k: None)
    args = parse(["--shape", "1,2,32,16", "--modes", "fwd", "--causal", "0", *TINY])
    rows = {r["provider"]: r for r in bench.run_standard(args, C.environment(), ["sdpa_math", "sdpa_efficient"])}
    wrong, raising = rows["sdpa_math"], rows["sdpa_efficient"]
    assert wrong["status"] == "check_failed" and wrong["check_passed"] is False and wrong["max_err"] > 0.1
    assert wrong["ms_p50"] is None and wrong["tflops"] is None
    assert raising["status"] == "error" and raising["error"] == "RuntimeError: No available kernel. Aborting execution."
    assert raising["tflops"] is None


def test_varlen_suite_matches_dense_per_sequence():
    args = parse(["--suite", "varlen", "--varlen-n", "3", "--varlen-max", "40", "--varlen-heads", "2",
                  "--varlen-head-dim", "16", "--modes", "fwd", "--causal", "1", *TINY])
    rows = S.run_varlen(args, C.environment())
    by = {r["provider"]: r for r in rows}
    for name in ("flashtriton", "flashtriton_padded"):
        assert by[name]["status"] == "ok" and by[name]["check_passed"], by[name]
    extra = by["flashtriton"]["extra"]
    lens = S.varlen_seqlens(3, 40, 0)
    assert extra["seqlens"] == lens and extra["flop_padding_frac"] == C.padding_stats(lens)["flop_padding_frac"]
    assert extra["speedup_vs_flashtriton_padded"] == pytest.approx(by["flashtriton_padded"]["ms_p50"]
                                                                   / by["flashtriton"]["ms_p50"])
    assert by["flashtriton"]["tflops"] == pytest.approx(C.varlen_flops(lens, 2, 16, True, "fwd")
                                                        / by["flashtriton"]["ms_p50"] / 1e9)
    assert "speedup vs best padded" in R.varlen_table(rows)


def test_decode_suite_bandwidth_and_skips():
    if S._kvcache_function() is None:
        pytest.skip("flashtriton.flash_attn_with_kvcache is not there yet")
    args = parse(["--suite", "decode", "--decode-batches", "2", "--decode-seqlens", "100,300",
                  "--decode-heads", "4,2", "--decode-head-dim", "16", "--max-cache-gib", str(40000 / 2**30),
                  "--providers", "flashtriton,sdpa_math,sdpa_cudnn", *TINY])
    rows = S.run_decode(args, C.environment(), {"copy": 1.0, "read": 2.0})
    by = {(r["provider"], r["T_k"]): r for r in rows}
    ours = by[("flashtriton", 100)]
    assert ours["status"] == "ok" and ours["check_passed"]
    assert ours["gbps"] == pytest.approx(2 * 2 * 100 * 2 * 16 * 2 / ours["ms_p50"] / 1e6)
    assert ours["extra"]["pct_of_copy"] == pytest.approx(100 * ours["gbps"])
    assert ours["extra"]["pct_of_read"] == pytest.approx(50 * ours["gbps"])
    assert by[("sdpa_math", 100)]["status"] == "ok"
    assert all(by[(p, 300)]["status"] == "skipped" for p in ("flashtriton", "sdpa_math"))  # over --max-cache-gib
    assert "ours % of copy" in R.decode_table(rows) and "ours % of read" in R.decode_table(rows)


def test_decode_suite_takes_a_v_head_dim_of_its_own():
    """--decode-head-dim QK/V: a v_cache of V's head dim (DeepSeek's MLA: 192/128), its bytes in the bandwidth, the
    FLOPs at QK's and V's head dims, the pair in the table; a bad form is refused naming the option."""
    if S._kvcache_function() is None:
        pytest.skip("flashtriton.flash_attn_with_kvcache is not there yet")
    args = parse(["--suite", "decode", "--decode-batches", "2", "--decode-seqlens", "100",
                  "--decode-heads", "4,2", "--decode-head-dim", "32/16", "--providers", "flashtriton,sdpa_math",
                  *TINY])
    rows = S.run_decode(args, C.environment(), {"copy": 1.0})
    by = {r["provider"]: r for r in rows}
    ours = by["flashtriton"]
    assert ours["status"] == "ok" and ours["check_passed"] and (ours["D"], ours["Dv"]) == (32, 16)
    assert ours["gbps"] == pytest.approx(2 * 100 * 2 * (32 + 16) * 2 / ours["ms_p50"] / 1e6)
    assert ours["tflops"] == pytest.approx(2 * 2 * 4 * 100 * (32 + 16) / (ours["ms_p50"] * 1e-3) / 1e12)
    assert by["sdpa_math"]["status"] == "ok" and by["sdpa_math"]["check_passed"]
    assert "| 32/16 |" in R.decode_table(rows)
    with pytest.raises(ValueError, match="--decode-head-dim"):
        parse(["--suite", "decode", "--decode-head-dim", "192/x"])


def test_main_writes_rows_and_plots(tmp_path, capsys):
    argv = ["--shape", "1,2,32,16", "--modes", "fwd", "--causal", "0", "--providers", "flashtriton,math,cudnn",
            "--out", str(tmp_path), *TINY]
    assert bench.main(parse_raw(argv)) == 0
    out = capsys.readouterr().out
    assert "ours/best_other" in out and "sdpa_math" in out and "CUDA only" in out or CUDA
    rows = json.loads((tmp_path / "bench.json").read_text())
    ceilings = {"torch", "triton"} if CUDA else set()  # copy, read (torch's sum, the Triton stream), matmuls
    assert {r["provider"] for r in rows} == {"flashtriton", "sdpa_math", "sdpa_cudnn"} | ceilings
    assert all(list(r) == C.ROW_FIELDS for r in rows)
    assert rows[0]["flashtriton"] == flashtriton.__version__ and rows[0]["git_sha"]
    assert (tmp_path / "bench.csv").exists() and (tmp_path / "standard_fwd_fp16.png").stat().st_size > 1000


def parse_raw(argv):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


def test_python_m_bench_restarts_with_interpreter(tmp_path):
    """`python -m flashtriton.tools.bench` without TRITON_INTERPRET on a CPU machine restarts under the interpreter."""
    if CUDA:
        pytest.skip("CPU-only behaviour")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "flashtriton.tools.bench", "--shape", "1,1,16,16", "--modes", "fwd", "--causal", "0",
           "--providers", "flashtriton", "--out", str(tmp_path), *TINY]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "triton interpreter" in result.stdout
    assert json.loads((tmp_path / "bench.json").read_text())[0]["check_passed"] is True


def test_ceilings_rows():
    rows = S.run_ceilings(parse(TINY), C.environment(), copy_elems=1 << 16, matmul_n=64)
    copy, read_torch, read_triton, mm16, mm_bf16 = rows
    assert copy["op"] == "copy" and copy["status"] == "ok"
    assert copy["gbps"] == pytest.approx(2 * 2 * (1 << 16) / copy["ms_p50"] / 1e6)
    assert {read_torch["provider"], read_triton["provider"]} == {"torch", "triton"}
    assert read_triton["gbps"] == pytest.approx(2 * (1 << 16) / read_triton["ms_p50"] / 1e6)
    assert S.ceiling_gbps(rows) == {"copy": copy["gbps"], "read": max(read_torch["gbps"], read_triton["gbps"])}
    assert mm16["tflops"] == pytest.approx(2 * 64 ** 3 / mm16["ms_p50"] / 1e9) and mm_bf16["dtype"] == "bf16"
    assert all(word in R.ceilings_text(rows) for word in ("copy", "read", "matmul"))


def test_stream_read_reads_every_element():
    """The read ceiling's kernel sums the whole buffer (a length that is not a multiple of its step)."""
    x = torch.randn(100_003, dtype=torch.float16, device=DEVICE)
    sums = torch.empty(6, dtype=torch.float32, device=DEVICE)
    S._stream_read[(6,)](x, sums, x.numel(), BLOCK=1024, UNROLL=2, num_warps=4)
    assert sums.sum().item() == pytest.approx(x.float().sum().item(), abs=1e-2)


def test_sdpa_backend_is_chosen_once_around_the_timing_not_per_call(monkeypatch):
    """SDPA providers carry their backend choice as a context that the bench enters once around the check and
    the timing (a user selects a backend once, not per call); the timed call itself is the bare SDPA call."""
    from torch.nn.attention import SDPBackend

    import torch.nn.attention as attention

    entered = []

    original = attention.sdpa_kernel

    def spy(backends, *a, **kw):
        entered.append(list(backends))
        return original(backends, *a, **kw)

    monkeypatch.setattr(attention, "sdpa_kernel", spy)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, 2, 8, generator=gen) for _ in range(3))
    prepared = P.prepare("sdpa_math", q, k, v, True, False)
    assert entered == [] and prepared.context is not None
    with prepared.context():
        got = prepared.to_bshd(prepared.forward())
        again = prepared.to_bshd(prepared.forward())
    assert entered == [[SDPBackend.MATH]]  # once, however many calls
    expected = attention_reference(q, k, v, causal=True, bottom_right=False, dtype=torch.float64)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(got, again)


def test_readme_tables_compare_with_the_tutorial_anchors(tmp_path, capsys):
    """scripts/readme_tables.py: the forward table and the comparison at the anchors file's tutorial points."""
    import runpy
    from pathlib import Path

    script = runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "readme_tables.py"))
    rows = [dict(suite="standard", mode="fwd", D=64, causal=0, T=1024, provider=p, dtype="fp16", tflops=t,
                 extra={"warmup_ms": 25}) for p, t in (("flashtriton", 400.0), ("sdpa_cudnn", 420.0))]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"rows": rows}))
    script["main"](str(path))
    out = capsys.readouterr().out
    assert "| 64 | 0 | 1024 | 400 \\| - | 420 \\| - |" in out and "geometric mean ours/cuDNN 0.95" in out
    assert "| 64 | 0 | 1024 | 400 | 391 | yes | 0.95 | 0.94 |" in out and "warmup: [25] ms" in out
    assert "above the tutorial's anchor at 1 of 12 points" in out


def _cpu_rows(gpu):
    env = dict.fromkeys(("torch", "triton", "cudnn", "flashtriton", "git_sha", "date"), "")
    env["gpu"] = gpu
    attention = [C.make_row(env, op="attention", suite="standard", mode="fwd", provider=p, B=1, H=2, H_kv=2, T=T,
                            T_k=T, D=64, causal=0, dtype="fp16", tflops=1e-4 * T, ms_p50=1.0, status="ok")
                 for p in ("flashtriton", "sdpa_math") for T in (64, 128)]
    decode = [C.make_row(env, op="decode", suite="decode", mode="fwd", provider="flashtriton", B=1, H=2, H_kv=2, T=1,
                         T_k=T, D=64, causal=0, dtype="fp16", gbps=0.1, ms_p50=1.0, status="ok") for T in (64, 128)]
    return attention + decode


@pytest.mark.parametrize("gpu,labelled", [("cpu (triton interpreter)", True), ("NVIDIA H200", False)])
def test_cpu_timings_are_labelled_as_not_gpu_performance(gpu, labelled, tmp_path, monkeypatch):
    """Tables and plot titles of rows timed on the CPU (Triton's interpreter) say so; GPU rows carry no label."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    titles = []
    save = Figure.savefig

    def savefig(fig, *args, **kwargs):
        titles.append(" ".join([fig._suptitle.get_text() if fig._suptitle else ""]
                               + [ax.get_title() for ax in fig.axes]))
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    rows = _cpu_rows(gpu)
    note = "Triton interpreter on CPU, not GPU performance"
    assert (note in R.standard_table(rows)) is labelled
    assert (note in R.decode_table(rows)) is labelled
    assert len(R.write_plots(rows, str(tmp_path))) == 2 and len(titles) == 2
    assert all((note in t) is labelled for t in titles), titles


def test_main_on_the_cpu_says_its_timings_are_not_gpu_performance(tmp_path, capsys):
    if CUDA:
        pytest.skip("CPU-only behaviour")
    argv = ["--shape", "1,1,16,16", "--modes", "fwd", "--causal", "0", "--providers", "flashtriton", *TINY]
    assert bench.main(parse_raw(argv)) == 0
    captured = capsys.readouterr()
    assert "Triton interpreter on CPU, not GPU performance" in captured.out + captured.err


# ----------------------------------------------------------------------------------------------------------
# the variants suite
# ----------------------------------------------------------------------------------------------------------
def test_variants_suite_cases_are_the_issues():
    args = parse(["--suite", "variants"])
    cases = {c.name: c for c in args.variant_cases}
    assert args.variant_dtypes == ["bf16"] and args.variant_modes == ["fwd", "bwd", "fwd_bwd"] and args.rounds == 2
    for w in (1024, 4096):
        c = cases[f"window{w} T=16384 D=128"]
        assert c.shape == (1, 16, 16384, 128) and c.window == (w - 1, 0) and c.flex is None
    for name, shape in (("T=4096 D=128", (4, 16, 4096, 128)), ("T=8192 D=256", (2, 8, 8192, 256))):
        assert cases[f"softcap50 {name}"].shape == shape and cases[f"softcap50 {name}"].softcap == 50.0
        assert cases[f"alibi {name}"].shape == shape and cases[f"alibi {name}"].alibi
    for D in (64, 128):
        sinks, windowed = cases[f"sinks T=4096 D={D}"], cases[f"sinks+window128 T=4096 D={D}"]
        assert sinks.sinks and sinks.base == "causal" and sinks.flex == V.NO_SINKS
        assert windowed.sinks and windowed.window == (127, 0) and windowed.base == "window128"
        assert cases[f"window128 T=4096 D={D}"].window == (127, 0)
    assert all(name in cases for bar in R.BARS for name in bar.cases)  # every bar judges a case that runs
    assert len(cases) == len(args.variant_cases)  # names identify cases (the bars and tables look them up)
    some = parse(["--suite", "variants", "--variants", "sinks+window128,softcap50", "--modes", "fwd", "--rounds", "3"])
    assert sorted({c.variant for c in some.variant_cases}) == ["sinks+window128", "softcap50", "window128"]
    assert some.variant_modes == ["fwd"] and some.rounds == 3
    assert parse(["--suite", "variants", "--dtypes", "fp16"]).variant_dtypes == ["fp16"]
    for bad in (["--variants", "dropout"], ["--rounds", "0"]):
        with pytest.raises(ValueError):
            parse(["--suite", "variants", *bad])
    tiny = [c.shrunk() for c in V.CASES]
    assert all(t.name == c.name and t.B == 1 and t.H == 2 and t.T <= 128 for t, c in zip(tiny, V.CASES))
    assert len({t.shape for t in tiny}) == len({c.shape for c in V.CASES})  # shapes stay apart when shrunk


def test_window_flops_are_the_visible_area():
    """The suite counts a window's FLOPs over its visible pairs: T keys rows each see min(i + 1, w) keys."""
    B, H, T, D, w = 1, 16, 16384, 128, 1024
    pairs = w * T - w * (w - 1) // 2
    assert Variant(causal=True, window=(w - 1, 0)).visible_flops(B, H, T, T, D, "fwd") == 4 * B * H * D * pairs
    assert Variant(causal=True).visible_flops(B, H, T, T, D, "bwd") == 2.5 * 4 * B * H * D * T * (T + 1) // 2


def _variant_row(case, provider, mode, ms, variant=None, pairs=None, dtype="bf16"):
    env = dict.fromkeys(("gpu", "torch", "triton", "cudnn", "flashtriton", "git_sha", "date"), "NVIDIA H200")
    size = case.split(" ", 1)[1]
    label = variant or case.split(" ", 1)[0]
    flops = 1e12 * (pairs or 1)
    return C.make_row(env, op=R.VARIANT_OP, suite="variants", mode=mode, provider=provider, B=1, H=16, H_kv=16, T=4096,
                      T_k=4096, D=128, causal=1, dtype=dtype, variant=label, ms_p50=ms, tflops=C.tflops(flops, ms),
                      status="ok" if ms else "skipped",
                      extra=dict(case=case, size=size, base=None if provider != "flashtriton" else (
                          "window128" if label == "sinks+window128" else "causal"), visible_pairs=pairs or 1))


def test_bars_judge_a_result_table():
    rows = [
        _variant_row("window1024 T=16384 D=128", "flashtriton", "fwd", 1.0, pairs=3),
        _variant_row("window1024 T=16384 D=128", "flex", "fwd", 1.35, pairs=3),  # ours 1.35x: PASS (>= 1.3)
        _variant_row("window1024 T=16384 D=128", "flashtriton", "bwd", 1.0, pairs=3),
        _variant_row("window1024 T=16384 D=128", "flex", "bwd", 1.1, pairs=3),  # 1.1x: FAIL (< 1.2)
        _variant_row("causal T=4096 D=128", "flashtriton_dense", "fwd", 1.0, variant="causal"),
        _variant_row("causal T=4096 D=128", "flashtriton_dense", "bwd", 1.0, variant="causal"),
        _variant_row("softcap50 T=4096 D=128", "flashtriton", "fwd", 1.05),  # +5 %: PASS
        _variant_row("softcap50 T=4096 D=128", "flashtriton", "bwd", 1.15),  # +15 %: FAIL
        _variant_row("softcap50 T=4096 D=128", "flex", "fwd", 2.2),  # ours 2.10x Flex: PASS
        _variant_row("softcap50 T=4096 D=128", "flex", "bwd", None),  # skipped: n/a
        _variant_row("window128 T=4096 D=128", "flashtriton", "fwd", 0.5, pairs=2),
        _variant_row("sinks+window128 T=4096 D=128", "flashtriton", "fwd", 0.51, pairs=2),  # +2 % of window128: PASS
    ]
    got = {(v["bar"], v["case"], v["mode"]): v for v in R.evaluate_bars(rows)}
    verdict = lambda bar, case, mode: got[(bar, case, mode)]["verdict"]  # noqa: E731
    window_fwd, window_bwd, softcap, softcap_flex, sinks = (b.text for b in (R.BARS[0], R.BARS[1], R.BARS[2],
                                                                             R.BARS[4], R.BARS[5]))
    assert verdict(window_fwd, "window1024 T=16384 D=128", "fwd") == "PASS"
    assert got[(window_fwd, "window1024 T=16384 D=128", "fwd")]["value"] == pytest.approx(1.35)
    assert verdict(window_bwd, "window1024 T=16384 D=128", "bwd") == "FAIL"
    assert (window_fwd, "window4096 T=16384 D=128", "fwd") not in got  # a case the run left out
    assert verdict(softcap, "softcap50 T=4096 D=128", "fwd") == "PASS"
    assert got[(softcap, "softcap50 T=4096 D=128", "bwd")]["value"] == pytest.approx(0.15)
    assert verdict(softcap, "softcap50 T=4096 D=128", "bwd") == "FAIL"
    assert verdict(softcap_flex, "softcap50 T=4096 D=128", "fwd") == "PASS"
    assert verdict(softcap_flex, "softcap50 T=4096 D=128", "bwd") == "n/a"
    assert got[(sinks, "sinks+window128 T=4096 D=128", "fwd")]["value"] == pytest.approx(0.02)
    assert verdict(sinks, "sinks+window128 T=4096 D=128", "fwd") == "PASS"
    # a window's cost against the dense call is not defined (a different area); its speed ratio is
    d = R.variant_ratios(rows)[("window1024 T=16384 D=128", "fwd", "bf16")]
    assert d["cost"] is None and d["vs_flex"] == pytest.approx(1.35)
    table = R.bars_table(rows)
    assert "4 PASS, 2 FAIL, 2 n/a" in table and "+15.0 %" in table and "1.35x" in table and "NOTE" not in table
    assert "cost" in R.variants_table(rows) and "(vs window128)" in R.variants_table(rows)


def test_variant_cost_pairs_the_readings_of_a_round():
    """The cost is the median of each round's ratio: a clock that drifts between rounds (the H200 under its
    power cap) moves both readings of a round, not their ratio; rows whose rounds do not pair up fall back to the
    medians' ratio."""
    ours = {"ms_p50": 1.5, "extra": {"round_ms": [1.1, 1.5, 2.2]}}
    base = {"ms_p50": 1.0, "extra": {"round_ms": [1.0, 1.0, 2.0]}}  # round 3 ran 2x slower for both
    assert R._paired_cost(ours, base) == pytest.approx(0.1)  # medians' ratio would say +50 %
    assert R._paired_cost(ours, {"ms_p50": 1.0, "extra": {"round_ms": [1.0]}}) == pytest.approx(0.5)
    assert R._paired_cost({"ms_p50": 1.2, "extra": {}}, base) == pytest.approx(0.2)


def _tiny_variant_args(variants, modes="fwd,bwd"):
    args = parse(["--suite", "variants", "--variants", variants, "--modes", modes, *TINY])
    args.variant_cases = [c.shrunk() for c in args.variant_cases]  # parse() resolves the GPU sizes
    return args


def test_variants_suite_checks_kernels_then_times():
    args = _tiny_variant_args("sinks+window128")
    args.variant_cases = [c for c in args.variant_cases if c.D == 16]  # the D=64 case, shrunk
    rows = V.run_variants(args, C.environment())
    by = {(r["provider"], r["variant"], r["mode"]): r for r in rows}
    assert len(rows) == (2 * 2 + 2) * 2  # (ours, flex) x 2 variants and (dense, cudnn), x 2 modes
    for key in [("flashtriton", v, m) for v in ("window128", "sinks+window128") for m in ("fwd", "bwd")] + [
            ("flashtriton_dense", "causal", "fwd"), ("flashtriton_dense", "causal", "bwd")]:
        r = by[key]
        assert r["status"] == "ok" and r["check_passed"], r
        assert r["extra"]["kernels"] and "_attn_fwd" in r["extra"]["kernels"] or CUDA
        assert r["tflops"] == pytest.approx(Variant(causal=True, window=tuple(r["extra"]["window"])).visible_flops(
            1, 2, r["T"], r["T"], r["D"], r["mode"]) / r["ms_p50"] / 1e9)
    bwd_kernels = set(by[("flashtriton", "sinks+window128", "bwd")]["extra"]["kernels"])
    assert bwd_kernels >= {"_attn_bwd_dkdv", "_attn_bwd_dq"} or CUDA
    assert by[("flex", "sinks+window128", "fwd")]["status"] == "skipped"
    ours, ref = by[("flashtriton", "sinks+window128", "fwd")], by[("flashtriton", "window128", "fwd")]
    paired = [a / b for a, b in zip(ours["extra"]["round_ms"], ref["extra"]["round_ms"])]
    assert ours["extra"]["cost"] == pytest.approx(statistics.median(paired) - 1)
    dense = by[("flashtriton_dense", "causal", "fwd")]
    assert ours["extra"]["vs_dense"] == pytest.approx(ours["tflops"] / dense["tflops"])
    if not CUDA:
        assert by[("sdpa_cudnn", "causal", "fwd")]["status"] == "skipped"


def test_variants_suite_fails_a_wrong_variant_and_a_call_without_our_kernel(monkeypatch):
    real = V.prepare

    def dropped_window(provider, case, *a):  # stands in for a kernel that ignores the window
        return real(provider, None if provider == "flashtriton" else case, *a)

    monkeypatch.setattr(V, "prepare", dropped_window)
    args = _tiny_variant_args("window1024", modes="fwd")
    rows = {r["provider"]: r for r in V.run_variants(args, C.environment())}
    assert rows["flashtriton"]["status"] == "check_failed" and rows["flashtriton"]["tflops"] is None
    assert rows["flashtriton_dense"]["status"] == "ok"
    monkeypatch.setattr(V, "prepare", real)
    monkeypatch.setattr(V, "launched_kernels", lambda fn: (fn(), ["some_other_kernel"])[1])
    rows = {r["provider"]: r for r in V.run_variants(args, C.environment())}
    for name in ("flashtriton", "flashtriton_dense"):
        assert rows[name]["status"] == "error" and "no flashtriton fwd kernel" in rows[name]["error"]
    assert V._kernel_problem("flashtriton", None, ["fwd"]) is None  # the profiler could not tell: not an error
    assert V._kernel_problem("flex", ["triton_tem_fused_0"], ["fwd"]) is None


def test_launched_kernels_names_flashtriton_kernels():
    q, k, v = (torch.randn(1, 32, 2, 16, device=DEVICE, dtype=torch.float16) for _ in range(3))
    names = M.launched_kernels(lambda: flashtriton.flash_attn_func(q, k, v, causal=True))
    assert names is None or P.flashtriton_kernels("fwd") & set(names), names


def test_variants_suite_end_to_end_on_the_cpu(tmp_path, capsys):
    if CUDA:
        pytest.skip("CPU-only behaviour (the GPU sizes take minutes)")
    argv = ["--suite", "variants", "--variants", "window1024", "--modes", "fwd", "--out", str(tmp_path), *TINY]
    assert bench.main(parse_raw(argv)) == 0
    out = capsys.readouterr().out
    assert "Triton interpreter on CPU, not GPU performance" in out
    assert out.rstrip().splitlines()[-1].startswith("wrote ")
    assert out.index("ours/dense") < out.index("issue 25's bars")  # the bars table comes last
    rows = json.loads((tmp_path / "bench.json").read_text())
    assert {(r["provider"], r["variant"], r["status"]) for r in rows} == {
        ("flashtriton", "window1024", "ok"), ("flex", "window1024", "skipped"),
        ("flashtriton_dense", "causal", "ok"), ("sdpa_cudnn", "causal", "skipped")}
    assert all(list(r) == C.ROW_FIELDS and r["gpu"] and r["torch"] and r["triton"] and r["git_sha"] for r in rows)
    summary = json.loads((tmp_path / "variants_bars.json").read_text())
    assert summary["environment"]["gpu"].startswith("cpu") and summary["environment"]["git_sha"]
    assert {b["bar"] for b in summary["bars"]} == {"window, forward: ours >= 1.3x Flex",
                                                   "window, backward: ours >= 1.2x Flex"}
    assert "issue 25's bars" in (tmp_path / "variants.md").read_text()
