"""Rule tables: the keys a tuning rule names, and how a call's config is looked up.

A table is a list of rules in order; the first rule whose keys all match the call gives the config. Each table
ends with a rule that matches everything, so that every call finds one. A key is one of
- `ANY`: every value;
- a value: equal to it (`128` for a head dim, `SM90` for a GPU class, `CAUSAL` for a variant class);
- an inclusive range `(lo, hi)`, `None` for an open end: `(None, 1024)` is "at most 1024", `(2048, None)` "at
  least 2048".
Each rule names its source last: a results file of the repository (`H200 + "explore/fwd.json"`) or, where no
measurement decides it, a one-line reason (`why: ...`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..kernels.host import capability, next_power_of_2

ANY = None

# GPU classes (the `gpu` key): CUDA devices of capability 9.0 and newer (H100 / H200, measured on the H200), and
# the rest (A100 and other Ampere / Ada GPUs; CPU tensors, which only direct calls bring here).
SM90 = "sm90+"
SM80 = "sm80"
GPUS = (SM90, SM80)

# Input widths in bits (the `dtype` key): "16" for fp16 / bf16 (and any width other than 4 bytes), "32" for fp32.
DTYPES = ("16", "32")

# Variant classes (the `variant` key): which scores exist. Windows, softcap and the other variants add classes.
CAUSAL = "causal"
FULL = "full"
VARIANTS = (CAUSAL, FULL)

# The runs (benchmarks/README.md) whose files the rules cite: the H200's, and an H100's where no H200 came.
H200 = "benchmarks/2026-11-29-h200/"
H200_DEC = "benchmarks/2026-12-01-h200/"
H200_HEADS = "benchmarks/2026-12-02-h200/gluon-head-dims/h200/"
H200_WIDE = "benchmarks/2026-12-02-h200/gluon-bwd-wide/h200/"
H200_MERGED = "benchmarks/2026-12-02-h200/gluon-merged/"
H200_PAGED = "benchmarks/2026-12-02-h200/paged-small/h200/"
H200_LATE = "benchmarks/2026-12-03-h200/"
H200_DEC4 = "benchmarks/2026-12-04-h200/"
H100_DEC6 = "benchmarks/2026-12-06-h100/"  # an H100's runs: each file holds its own baseline
H100_DEC7 = "benchmarks/2026-12-07-h100/"
RUNS = (H200, H200_DEC, H200_HEADS, H200_WIDE, H200_MERGED, H200_PAGED, H200_LATE, H200_DEC4, H100_DEC6, H100_DEC7)


def gpu_class(device: torch.device) -> str:
    return SM90 if device.type == "cuda" and capability(device)[0] >= 9 else SM80


def width(elem_bytes: int) -> str:
    return "32" if elem_bytes == 4 else "16"


def variant_class(causal) -> str:
    return CAUSAL if causal else FULL


def tiles(block_m: int, block_n: int, num_warps: int, num_stages: int, **extra) -> dict:
    """A Triton kernel's config: tile sizes, warps and pipeline stages (and any extra option, e.g. maxnreg)."""
    return dict({"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps, "num_stages": num_stages}, **extra)


def padded_head_dims(named_args: dict, kwargs: dict) -> int:
    """The wider of a kernel launch's padded head dims, BLOCK_D (Q, K) and BLOCK_DV (V, O; absent: BLOCK_D's): what
    a config's tiles must hold."""
    def get(name):
        return kwargs.get(name) or named_args.get(name) or 0
    return max(get("BLOCK_D"), get("BLOCK_DV"))


def seqlen_bucket(seqlen: int) -> int:
    """Power-of-two bucket used in autotune keys (16 … 65536+)."""
    return min(max(16, next_power_of_2(max(int(seqlen), 1))), 1 << 16)


def fresh(config):
    """A copy of a table's config (dicts one level deep), so that no caller can change the table."""
    if isinstance(config, dict):
        return {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
    return config


def _copier(config):
    """`fresh` for this config, cheap on the call path: most configs are flat dicts."""
    if not isinstance(config, dict):
        return None
    return fresh if any(isinstance(v, dict) for v in config.values()) else dict


class Rule(NamedTuple):
    keys: tuple
    config: Any
    source: str


class Table:
    """Rules over `columns`, each row `(key, ..., config, source)`; `lookup` takes one value per column, in order.
    A first column "gpu" takes a GPU class or a torch.device, whose class (a device query) is asked only when a
    rule's other keys match and its GPU key is not ANY. The rules a call's other values select are remembered."""

    MEMO = 4096  # distinct calls remembered per table

    def __init__(self, columns: tuple[str, ...], rows: list[tuple]):
        self.columns = tuple(columns)
        self.rules = []
        for row in rows:
            if len(row) != len(self.columns) + 2:
                raise ValueError(f"a rule has {len(self.columns)} keys, a config and a source: {row!r}")
            self.rules.append(Rule(tuple(row[:-2]), row[-2], row[-1]))
        self._gpu = self.columns[0] == "gpu"
        first = 1 if self._gpu else 0
        self._tests = [tuple(_test(i, key) for i, key in enumerate(rule.keys[first:]) if key is not ANY)
                       for rule in self.rules]
        self._memo: dict[tuple, tuple] = {}
        self._copy = {id(rule): _copier(rule.config) for rule in self.rules}

    def _candidates(self, values: tuple) -> tuple:
        """(GPU key, rule) of each rule whose keys other than the GPU match `values`, up to one with GPU key ANY."""
        found = []
        for tests, rule in zip(self._tests, self.rules):
            if all(_passes(test, values[test[0]]) for test in tests):
                gpu = rule.keys[0] if self._gpu else ANY
                found.append((gpu, rule))
                if gpu is ANY:
                    break
        return tuple(found)

    def rule(self, *values) -> Rule:
        """The first rule matching `values` (one per column)."""
        gpu, rest = (values[0], values[1:]) if self._gpu else (ANY, values)
        try:
            candidates = self._memo.get(rest)
        except TypeError:  # an unhashable value: look it up without remembering
            candidates = self._candidates(rest)
        if candidates is None:
            if len(self._memo) >= self.MEMO:
                self._memo.clear()
            candidates = self._memo[rest] = self._candidates(rest)
        for key, rule in candidates:
            if key is ANY:
                return rule
            if not isinstance(gpu, str):
                gpu = gpu_class(gpu)
            if gpu == key:
                return rule
        raise LookupError(f"no rule of {self.columns} matches {values}")

    def lookup(self, *values):
        """A copy of the first matching rule's config."""
        rule = self.rule(*values)
        copy = self._copy[id(rule)]
        return rule.config if copy is None else copy(rule.config)


def _test(index: int, key) -> tuple:
    if isinstance(key, tuple):
        lo, hi = key
        return index, ("in" if lo is not None and hi is not None else "le" if lo is None else "ge"), lo, hi
    return index, "eq", key, None


def _passes(test: tuple, value) -> bool:
    _, kind, lo, hi = test
    if kind == "eq":
        return value == lo
    if kind == "le":
        return value <= hi
    if kind == "ge":
        return lo <= value
    return lo <= value <= hi
