"""The config tables: every rule well-formed, reachable and sourced, every call covered; the host arithmetic."""

import ast
import itertools
import math
import re
from pathlib import Path

import pytest
import torch
import triton

from flashtriton import configs
from flashtriton.configs import table as T
from flashtriton.kernels import host

REPO = Path(__file__).resolve().parents[1]
CONFIGS_DIR = REPO / "src" / "flashtriton" / "configs"
SENTINELS = {"the dense rule", "the first candidate"}  # configs that send the caller to another rule


def _range_ok(key, least: int) -> bool:
    if key is T.ANY:
        return True
    if isinstance(key, tuple):
        lo, hi = key
        bounds = [b for b in key if b is not None]
        return (len(key) == 2 and bounds and all(isinstance(b, int) and b >= least for b in bounds)
                and (lo is None or hi is None or lo <= hi))
    return isinstance(key, int) and not isinstance(key, bool) and key >= least


KEY_OK = {
    "gpu": lambda k: k is T.ANY or k in T.GPUS,
    "dtype": lambda k: k is T.ANY or k in T.DTYPES,
    "variant": lambda k: k is T.ANY or k in T.VARIANTS,
    "head_dim": lambda k: _range_ok(k, 1),
    "head_dim_v": lambda k: _range_ok(k, 1),
    "page_size": lambda k: _range_ok(k, 1),
    "seqlen_q": lambda k: _range_ok(k, 0) and not isinstance(k, int),
    "seqlen_k": lambda k: _range_ok(k, 0) and not isinstance(k, int),
    "longest": lambda k: _range_ok(k, 0) and not isinstance(k, int),
    "busy": lambda k: k is T.ANY or isinstance(k, bool),
    "band": lambda k: _range_ok(k, 1) and not isinstance(k, int),
}


def _config_ok(config) -> bool:
    if config is None or isinstance(config, str) and config in SENTINELS:
        return True
    if not isinstance(config, dict) or not config:
        return False
    if all(isinstance(v, dict) for v in config.values()):  # one config per kernel ({"dkdv": .., "dq": ..})
        return all(_config_ok(v) for v in config.values())
    for name, value in config.items():
        if not (isinstance(value, (int, bool)) and re.fullmatch(r"[A-Za-z_]+", name)):
            return False
        if name in ("BLOCK_M", "BLOCK_N") and (value < 16 or value & (value - 1)):
            return False
        if name == "num_warps" and value not in (1, 2, 4, 8, 16):
            return False
        if name == "num_stages" and value < 1:
            return False
    return True


def _cited_paths() -> set[str]:
    """Every repository path the configs package names: rule sources and the paths in its comments."""
    paths = {r.source for t in configs.TABLES.values() for r in t.rules if not r.source.startswith("why: ")}
    for path in CONFIGS_DIR.glob("*.py"):
        paths.update(re.findall(r"\b((?:benchmarks|docs)/[\w./-]+\w)", path.read_text()))
    paths -= {run.rstrip("/") for run in T.RUNS}
    return paths


def test_tables_are_all_listed():
    found = {name for module in (configs.forward, configs.backward, configs.decode)
             for name, value in vars(module).items() if isinstance(value, T.Table)}
    assert found == set(configs.TABLES)
    assert all(getattr(configs, name) is table for name, table in configs.TABLES.items())


def test_every_cited_evidence_path_exists():
    paths = _cited_paths()
    assert len(paths) >= 15
    missing = sorted(p for p in paths if not (REPO / p).is_file())
    assert not missing, f"configs cite files that are not in the repository: {missing}"


def test_every_rule_names_its_source():
    for name, table in configs.TABLES.items():
        for rule in table.rules:
            source = rule.source
            assert isinstance(source, str) and (source.startswith("why: ") and len(source) > 12
                                                or source.startswith(T.RUNS)), (name, rule)


@pytest.mark.parametrize("name", sorted(configs.TABLES))
def test_table_keys_are_well_formed(name):
    table = configs.TABLES[name]
    assert set(table.columns) <= set(KEY_OK) and len(set(table.columns)) == len(table.columns)
    assert "gpu" not in table.columns[1:], "the GPU key comes first (its device query is made last)"
    for rule in table.rules:
        assert len(rule.keys) == len(table.columns)
        for column, key in zip(table.columns, rule.keys):
            assert KEY_OK[column](key), f"{name}: bad {column} key {key!r} in {rule}"
        assert _config_ok(rule.config), f"{name}: bad config in {rule}"
    assert all(k is T.ANY for k in table.rules[-1].keys), f"{name} must end with a rule that matches every call"


def _grid(table: T.Table) -> list[list]:
    """Values per column: each bound of the table's keys and its neighbours, and the classes."""
    values = []
    for i, column in enumerate(table.columns):
        if column == "gpu":
            values.append(list(T.GPUS))
        elif column == "dtype":
            values.append(list(T.DTYPES))
        elif column == "variant":
            values.append(list(T.VARIANTS))
        elif column == "busy":
            values.append([False, True])
        else:
            points = {1, 16, 64, 128, 256, 1 << 20}
            for rule in table.rules:
                key = rule.keys[i]
                for b in (key if isinstance(key, tuple) else (key,)):
                    if isinstance(b, int):
                        points.update((b - 1, b, b + 1))
            values.append(sorted(p for p in points if p >= 0))
    return values


@pytest.mark.parametrize("name", sorted(configs.TABLES))
def test_every_rule_is_reached(name):
    """A rule that no call reaches sits below a broader one: the table's order is wrong."""
    table = configs.TABLES[name]
    reached = {id(table.rule(*values)) for values in itertools.product(*_grid(table))}
    unreached = [rule for rule in table.rules if id(rule) not in reached]
    assert not unreached, f"{name}: rules no call reaches: {unreached}"


def _fake_gpu(monkeypatch, cap):
    monkeypatch.setattr(host, "_capability", lambda index: cap)  # in place of the cached query
    return torch.device("cuda", 0)


DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("cap", [None, (8, 0), (8, 6), (9, 0)])
def test_fallbacks_cover_every_head_dim_and_dtype(cap, monkeypatch):
    device = torch.device("cpu") if cap is None else _fake_gpu(monkeypatch, cap)
    for d, dtype, causal in itertools.product(range(1, 257), DTYPES, (False, True)):
        padded, size = host.padded_head_dim(d), dtype.itemsize
        for seqlen in (1, 1000, 5000, 100000):
            fwd = configs.default_fwd_config(padded, size, device, seqlen, seqlen, causal)
            assert fwd.keys() == {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}
            if size == 2:  # fits the shared memory and registers of every supported GPU
                assert configs.forward._fwd_fits(triton.Config({"BLOCK_M": fwd["BLOCK_M"], "BLOCK_N": fwd["BLOCK_N"]},
                                                               num_warps=fwd["num_warps"],
                                                               num_stages=fwd["num_stages"]), padded, size), (d, fwd)
            dec = configs.default_decode_config(padded, size, 300, 132, seqlen)
            assert (dec["BLOCK_N"], dec["num_warps"], dec["num_stages"]) in configs.DECODE_CANDIDATES
            tma = configs.default_fwd_tma_config(d, seqlen, seqlen, causal)
            assert tuple(tma[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")) in configs.FWD_CANDIDATES
            assert configs.varlen_fwd_tma_config(d, seqlen, seqlen, causal)["num_stages"] == 3
            assert (configs.gluon_fwd_config(d, seqlen, seqlen, causal) is None) == (d not in configs.GLUON_HEAD_DIMS)
            assert ((configs.gluon_varlen_config(d, seqlen, seqlen, causal) is None)  # D=64: the TMA kernel
                    == (configs.gluon_head_block(d) is None or d == 64))
            assert (configs.gluon_bwd_config(d, seqlen, 4096, causal) is None) == (d not in configs.GLUON_BWD_HEAD_DIMS)
        bwd = configs.default_bwd_configs(padded, size, device, causal)
        for kernel in ("dkdv", "dq"):  # a default is one of the candidates autotuning and pruning know
            width = "32" if size == 4 else "16"
            tiles = tuple(bwd[kernel][k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"))
            assert tiles in configs.BWD_CANDIDATES[kernel][(width, max(64, padded))], (d, dtype, kernel)


def test_gpu_class_reads_the_capability(monkeypatch):
    assert configs.default_fwd_config(128, 2, _fake_gpu(monkeypatch, (9, 0)), 4096, 4096, False)["num_stages"] == 3
    assert configs.default_fwd_config(128, 2, _fake_gpu(monkeypatch, (8, 0)), 4096, 4096, False)["num_stages"] == 2


def test_no_device_query_where_no_rule_needs_one(monkeypatch):
    def refuse(index):
        raise AssertionError("queried")

    monkeypatch.setattr(host, "_capability", refuse)
    cuda = torch.device("cuda", 0)
    assert configs.default_fwd_config(64, 4, cuda) == T.tiles(64, 32, 4, 2)  # fp32: every GPU alike
    assert configs.default_fwd_config(64, 2, cuda, 512, 512, True) == T.tiles(64, 64, 4, 3)
    assert configs.default_bwd_configs(256, 2, cuda)["dq"] == T.tiles(64, 32, 8, 2)
    with pytest.raises(AssertionError, match="queried"):
        configs.default_fwd_config(128, 2, cuda)


def test_lookups_return_copies():
    first = configs.gluon_fwd_config(128, 4096, 4096, True)
    first["BLOCK_N"] = 0
    bwd = configs.gluon_bwd_config(64, 4096, 4096, True)
    bwd["dq"]["BLOCK_N"] = 0
    assert configs.gluon_fwd_config(128, 4096, 4096, True)["BLOCK_N"] == 128
    assert configs.gluon_bwd_config(64, 4096, 4096, True)["dq"]["BLOCK_N"] == 128


def test_table_refuses_malformed_rules_and_unmatched_calls():
    with pytest.raises(ValueError, match="keys, a config and a source"):
        T.Table(("dtype", "head_dim"), rows=[("16", 64, {})])
    partial = T.Table(("gpu", "head_dim"), rows=[(T.SM90, (None, 64), {}, "why: a test table")])
    assert partial.lookup(T.SM90, 64) == {}
    with pytest.raises(LookupError):
        partial.lookup(T.SM80, 64)
    with pytest.raises(LookupError):
        partial.lookup(T.SM90, 65)


def test_cdiv():
    for a in range(-50, 200):
        for b in (1, 2, 3, 7, 16, 64, 128):
            assert host.cdiv(a, b) == math.ceil(a / b)
    assert host.cdiv(0, 128) == 0
    assert host.cdiv(2**40 + 1, 2**20) == 2**20 + 1
    assert host.cdiv(10**30 + 1, 10**15) == 10**15 + 1  # exact beyond float precision
    with pytest.raises(ZeroDivisionError):
        host.cdiv(1, 0)


def test_next_power_of_2():
    for n in range(1, 5000):
        assert host.next_power_of_2(n) == triton.next_power_of_2(n)
    assert [host.next_power_of_2(n) for n in (-5, 0, 1, 2, 3)] == [1, 1, 1, 2, 4]
    assert host.next_power_of_2(2**40) == 2**40 and host.next_power_of_2(2**40 + 1) == 2**41
    assert [host.padded_head_dim(d) for d in (1, 16, 17, 64, 80, 96, 128, 192, 256)] == [16, 16, 32, 64, 128, 128,
                                                                                         128, 256, 256]
    assert [configs.seqlen_bucket(n) for n in (0, 1, 16, 17, 4096, 4097, 65536, 10**6)] == [16, 16, 16, 32, 4096,
                                                                                            8192, 65536, 65536]


def test_capability_is_asked_once_per_device(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: calls.append(index) or (9, 0))
    host._capability.cache_clear()
    try:
        assert host.capability(torch.device("cuda", 1)) == (9, 0)
        assert host.capability(torch.device("cuda", 1)) == (9, 0)
        assert calls == [1]
    finally:
        host._capability.cache_clear()


def test_configs_reexport_the_host_functions():
    for name in ("cdiv", "next_power_of_2", "padded_head_dim", "capability"):
        assert getattr(configs, name) is getattr(host, name)


def test_host_imports_nothing_from_the_package_but_env():
    tree = ast.parse((REPO / "src" / "flashtriton" / "kernels" / "host.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            assert module == "_env" if node.level else (not module.startswith("flashtriton")
                                                         or module == "flashtriton._env"), module
        elif isinstance(node, ast.Import):
            assert all(not a.name.startswith("flashtriton") for a in node.names)
