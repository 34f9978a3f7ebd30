"""Fingerprint the PTX of every kernel and config that flashtriton's dispatch launches, on a CPU (no GPU).

    python scripts/ptx_fingerprint.py -o before.json            # on the old tree
    python scripts/ptx_fingerprint.py --compare before.json     # on the new one: exit 1 on any difference
    python scripts/ptx_fingerprint.py --compare before.json --ptx-only   # keys renamed, PTX the same: exit 0

What it does: each dispatch setting (`SETTINGS`: target GPU and the FLASHTRITON_* switches, which are read when
flashtriton is imported) runs in a fresh process that pretends to be that GPU (`pretend_gpu`) and calls the
public API (`flash_attn_func`, `flash_attn_varlen_func`, `scaled_dot_product_attention` forward and backward
through autograd, `flash_attn_with_kvcache`) on CPU tensors over a grid of shapes (`attention_calls`,
`decode_calls`) chosen to reach every branch of `configs.py`. Every kernel launch, whichever path it takes
(`kernels.launch.launch`, a launch plan, an autotuner, a plain `kernel[grid]`), ends in Triton's
`JITFunction.run`; here that compiles for the pretended target without launching and records the kernel, its
constexprs, argument signature (dtypes, 16-byte alignment, ints specialised to 1) and options with the sha256 of
its PTX. Outputs are never computed (nothing runs), so no host code may read them; none does today.

The PTX is hashed without its debug information (`.loc` / `.file` lines, `$L__tmp` labels, `.section .debug_*`),
which holds source paths and line numbers: moving a kernel within its file or the checkout elsewhere changes
nothing that runs. `--ptx-dir DIR` writes each normalised PTX as DIR/<sha256>.ptx, for `diff`.

The JSON holds `entries` (key: kernel@target, constexprs, options, argument types, the arguments specialised as
multiples of 16 -> sha256, a short id and the first call that launched it) and `calls` (each public call -> the
ids of the entries it launched, in order). `--compare OLD` runs the grid OLD was made with and reports entries
whose PTX differs, entries missing and new ones, and calls that launch other PTX; `--ptx-only` judges the PTX
alone (every call launching PTX of the same hashes, the same set of hashes overall), whatever the keys: for a
refactor that renames constexprs. The compile cache of the workers is their own (`--cache-dir`): a second run
on an unchanged tree takes ~20 s, a cold one a few minutes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The dispatch settings: (name, compute capability, environment, call grids as family:kind). Each runs in a fresh
# process: the switches are read when flashtriton is imported. Listed in the order they run (`--jobs` at a time):
# the two targets' full grids first, then the switches, whose grids mostly hit the compile cache.
SETTINGS = [
    ("sm90", 90, {}, ("attention:full", "decode:full")),
    ("sm80", 80, {}, ("attention:full", "decode:full")),
    ("sm90 FLASHTRITON_KERNEL=tma", 90, {"FLASHTRITON_KERNEL": "tma"}, ("attention:sweep",)),
    ("sm90 FLASHTRITON_KERNEL=portable", 90, {"FLASHTRITON_KERNEL": "portable"}, ("attention:sweep",)),
    ("sm90 FLASHTRITON_GLUON_BWD=0", 90, {"FLASHTRITON_GLUON_BWD": "0"}, ("attention:sweep",)),
    ("sm90 FLASHTRITON_KERNEL=auto,split", 90, {"FLASHTRITON_KERNEL": "auto,split"}, ("decode:sweep",)),
    ("sm90 FLASHTRITON_KERNEL=auto,stream", 90, {"FLASHTRITON_KERNEL": "auto,stream"}, ("decode:sweep",)),
    ("sm80 FLASHTRITON_KERNEL=auto,stream", 80, {"FLASHTRITON_KERNEL": "auto,stream"}, ("decode:sweep",)),
]
# `--autotune`: the autotuners' candidates (FLASHTRITON_AUTOTUNE=1, with the Hopper kernels off so that the portable
# kernel is tuned wherever it could run): every pruned config of every autotuned launch, on a small grid.
AUTOTUNE_SETTINGS = [
    ("sm90 FLASHTRITON_AUTOTUNE=1 FLASHTRITON_KERNEL=portable", 90,
     {"FLASHTRITON_AUTOTUNE": "1", "FLASHTRITON_KERNEL": "portable"}, ("attention:autotune", "decode:autotune")),
    ("sm80 FLASHTRITON_AUTOTUNE=1", 80, {"FLASHTRITON_AUTOTUNE": "1"}, ("attention:autotune", "decode:autotune")),
]
QUICK_SETTINGS = [("sm90", 90, {}, ("attention:quick", "decode:quick")),
                  ("sm80", 80, {}, ("attention:quick", "decode:quick"))]
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".triton", "ptx_fingerprint_cache")
GPUS = {90: ("NVIDIA H200", 132), 80: ("NVIDIA A100-SXM4-80GB", 108)}  # name, SMs
SWITCHES = ("FLASHTRITON_TMA", "FLASHTRITON_GLUON", "FLASHTRITON_GLUON_BWD", "FLASHTRITON_DECODE_SCHEDULE",
            "FLASHTRITON_AUTOTUNE", "FLASHTRITON_KERNEL", "TRITON_INTERPRET")


# ----------------------------------------------------------------------------------------------------------
# PTX normalisation and the record of launches
# ----------------------------------------------------------------------------------------------------------
_DEBUG_LINE = re.compile(r"^(\$L__tmp\d+:|\s*\.(loc|file)\b)")


def code_only(ptx: str) -> str:
    """The PTX without its debug information: the DWARF `.section`s at its end, the `.loc` / `.file` lines (source
    paths and positions) and the `$L__tmp` labels they point at."""
    ptx = ptx.split("\n\t.section")[0]
    return "\n".join(line for line in ptx.splitlines() if line.strip() and not _DEBUG_LINE.match(line))


def _plain(value):
    """A JSON-able, stable form of a constexpr value (tl.constexpr, dtype, layout, tuple)."""
    value = getattr(value, "value", value)
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return str(value)


class Recorder:
    """What the launches compiled: entries by key (kernel, target, constexprs, options, argument types and the
    arguments specialised as multiples of 16), and the entries each public call launched (by their short id)."""

    def __init__(self, target: str):
        self.target = target
        self.entries: dict = {}
        self.calls: dict = {}
        self.ptx: dict = {}  # sha256 -> normalised PTX (for --ptx-dir)
        self.call = None  # the label of the call running now
        self._hashes: dict = {}  # id(compiled kernel) -> sha256
        self._default_options = None

    def add(self, fn, kernel) -> None:
        src = kernel.src
        names = fn.arg_names
        constexprs = {names[path[0]] if len(path) == 1 else ".".join(map(str, path)): _plain(v)
                      for path, v in sorted(src.constants.items())}
        signature = {name: ty for name, ty in src.signature.items() if ty != "constexpr"}
        aligned = sorted(names[path[0]] for path, attrs in src.attrs.items() if len(path) == 1
                         and ["tt.divisibility", 16] in [list(a) for a in attrs])
        options = self._options(kernel)
        key = " ".join([f"{fn.__name__}@{self.target}", _pairs(constexprs), _pairs(options),
                        "sig:" + ",".join(signature.values()), "div16:" + ",".join(aligned)])
        sha = self._hashes.get(id(kernel))
        if sha is None:
            ptx = code_only(kernel.asm["ptx"])
            sha = hashlib.sha256(ptx.encode()).hexdigest()
            self._hashes[id(kernel)] = sha
            self.ptx[sha] = ptx
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = dict(id=entry_id(key), kernel=fn.__name__, target=self.target, sha256=sha,
                                             first_call=self.call)
        if self.call is not None:
            self.calls.setdefault(self.call, []).append(entry["id"])

    def _options(self, kernel) -> dict:
        """num_warps, num_stages and every other compile option that differs from Triton's default (not the
        libdevice path, which names the checkout)."""
        from triton.compiler import make_backend

        meta = kernel.metadata._asdict()
        if self._default_options is None:
            defaults = vars(make_backend(meta["target"]).parse_options({}))
            self._default_options = {name: _plain(v) for name, v in defaults.items()
                                     if name not in ("extern_libs", "debug", "instrumentation_mode", "arch")}
        return {name: _plain(meta[name]) for name, default in sorted(self._default_options.items())
                if name in meta and (name in ("num_warps", "num_stages") or _plain(meta[name]) != default)}


def entry_id(key: str) -> str:
    """The short id by which `calls` names an entry."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _pairs(values: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in values.items())


# ----------------------------------------------------------------------------------------------------------
# Pretending to be a GPU
# ----------------------------------------------------------------------------------------------------------
def pretend_gpu(capability: int, recorder: Recorder, count_only: bool = False) -> None:
    """Make this process look like one CUDA GPU of `capability` (90: H200, 80: A100) to flashtriton and Triton,
    with CPU memory behind every tensor, and make every kernel launch a compile that `recorder` records.

    - Triton: an active driver whose target is that GPU (the JIT compiles for it; the bundled ptxas runs on CPU).
    - torch.cuda: capability, properties (SM count), current device and stream, graph capture (never).
    - Tensors: CPU tensors report device cuda:0 (`Tensor.device`, `Tensor.is_cuda`), and factory calls asked for
      a cuda device allocate on the CPU (`_allocate_on_cpu`): the dispatch's device checks take the GPU paths.
    - Launches: a launch hook is installed, so that `kernels.launch.launch` and the launch plans take Triton's
      own path every time (as under a profiler: they never call a compiled kernel directly), and
      `JITFunction.run` compiles (warmup) instead of launching; an autotuner compiles every pruned config.
    - Compiles stop at the PTX (`_ptx_only`); with `count_only` nothing compiles (`_Uncompiled`).
    """
    import torch
    import triton.compiler
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime import autotuner, driver, jit

    name, sms = GPUS[capability]

    class FakeDriver(DriverBase):
        @classmethod
        def is_active(cls):
            return True

        def get_current_target(self):
            return GPUTarget("cuda", capability, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            raise RuntimeError("ptx_fingerprint: nothing is timed")

        def map_python_to_cpp_type(self, ty):
            return ty

    driver.set_active(FakeDriver())

    props = types.SimpleNamespace(name=name, major=capability // 10, minor=capability % 10,
                                  multi_processor_count=sms, total_memory=80 * 2**30,
                                  shared_memory_per_block_optin=(227 if capability == 90 else 163) * 1024)
    torch.cuda.get_device_capability = lambda device=None: (props.major, props.minor)
    torch.cuda.get_device_properties = lambda device=None: props
    torch.cuda.get_device_name = lambda device=None: name
    torch.cuda.current_device = lambda: 0
    torch.cuda.device_count = lambda: 1
    torch.cuda.is_current_stream_capturing = lambda: False
    torch._C._cuda_getCurrentRawStream = lambda index: 0

    cpu_device = torch._C.TensorBase.device.__get__
    cuda0 = torch.device("cuda", 0)
    torch.Tensor.device = property(lambda t: cuda0 if cpu_device(t).type == "cpu" else cpu_device(t))
    torch.Tensor.is_cuda = property(lambda t: True)
    torch.Tensor.cuda = lambda t, *args, **kwargs: t
    _allocate_on_cpu(torch)

    knobs.runtime.launch_enter_hook.add(_no_hook)
    knobs.runtime.add_stages_inspection_hook = _ptx_only
    if count_only:
        triton.compiler.compile = _Uncompiled

    compile_and_record = jit.JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = compile_and_record(self, *args, grid=grid, warmup=True, **kwargs)
        recorder.add(self, kernel)
        return kernel

    def tune(self, *args, **kwargs):
        kwargs.pop("warmup", None)
        grid = kwargs.pop("grid")
        self.nargs = dict(zip(self.arg_names, args))
        kernels = [self.fn.run(*args, grid=grid, warmup=True, **kwargs, **config.all_kwargs())
                   for config in self.prune_configs(kwargs)]
        self.nargs = None
        return kernels[-1]

    jit.JITFunction.run = run
    autotuner.Autotuner.run = tune


def _no_hook(*args, **kwargs):
    """Installed as Triton's launch hook; never called (nothing launches)."""


def _ptx_only(backend, stages, options, language, capability) -> None:
    """Triton's stage hook: an empty cubin instead of ptxas's (what runs after the PTX is not fingerprinted, and
    ptxas takes a third of a compile). The workers keep their own compile cache (`CACHE_DIR`), so that these
    cubin-less kernels never reach the cache that real launches read."""
    stages["cubin"] = lambda src, metadata: b""


class _Uncompiled:
    """`triton.compile` under `--count`: the source and options of a kernel, without compiling it."""

    def __init__(self, src, target=None, options=None, _env_vars=None):
        from triton.compiler import make_backend

        self.src = src
        backend = make_backend(target)
        meta = dict(vars(backend.parse_options(dict(options or {}))), target=target)
        self.metadata = types.SimpleNamespace(_asdict=lambda: meta)
        self.asm = {"ptx": ""}


# torch functions and Tensor methods that take a device: wrapped to allocate on the CPU when asked for cuda
_FACTORIES = ("empty", "zeros", "ones", "full", "arange", "tensor", "as_tensor", "empty_strided", "empty_like",
              "zeros_like", "ones_like", "full_like", "rand", "randn", "randint", "linspace")
_METHODS = ("to", "new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")


def _allocate_on_cpu(torch) -> None:
    """Wrap torch's factories and Tensor's device-taking methods so that a cuda device means the CPU. (Not a
    TorchFunctionMode: autograd runs backward functions with the mode stack empty.)"""

    def cpu(device):
        return torch.device("cpu") if isinstance(device, (str, torch.device)) and str(device).startswith("cuda") \
            else device

    def wrap(fn):
        def on_cpu(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = cpu(kwargs["device"])
            return fn(*(cpu(a) if isinstance(a, (str, torch.device)) else a for a in args), **kwargs)
        return on_cpu

    for name in _FACTORIES:
        setattr(torch, name, wrap(getattr(torch, name)))
    for name in _METHODS:
        setattr(torch.Tensor, name, wrap(getattr(torch.Tensor, name)))


# ----------------------------------------------------------------------------------------------------------
# The public calls
# ----------------------------------------------------------------------------------------------------------
def _standard(seqlen: int, head_dim: int) -> tuple[int, int]:
    """(batch, heads) of the benchmarks' standard sweep: batch x seqlen = 16384 tokens (at least 2 sequences),
    heads x head dim = 2048."""
    return max(2, 16384 // seqlen), 2048 // head_dim


def attention_calls(kind: str = "full"):
    """(label, thunk) of dense, varlen and SDPA calls, forward and backward.

    kind "sweep": the standard sweep's shapes at the lengths where the config rules change (configs.py: 512 / 2048
    / 4096 / 16384 tokens), a short call with little work (the backward's Triton kernels) and a long varlen batch;
    "full": that, then shapes that change the kernels' specialisation (GQA, odd lengths, one query row, Sq != Sk,
    torch's layout and top-left causal, unaligned inputs), a differentiated lse, a zero scale, the head dims and
    dtype only the portable kernel runs, more varlen batches; "autotune": one call per autotune key class;
    "quick": one small call."""
    import torch

    import flashtriton

    def tensor(shape, dtype, grad, offset=0):
        """An uninitialised tensor; `offset` elements past a 16-byte aligned address (the TMA kernels refuse it)."""
        n = 1
        for size in shape:
            n *= size
        return torch.empty(n + offset, dtype=dtype)[offset:].view(shape).requires_grad_(grad)

    def backward(outputs):
        torch.autograd.backward(outputs, [torch.empty_like(t) for t in outputs])

    def dense(b, sq, sk, hq, hkv, d, dtype, causal, sdpa=False, bwd=True, lse=False, scale=None, offset=0):
        def call():
            shape = (lambda h, s: (b, h, s, d)) if sdpa else (lambda h, s: (b, s, h, d))
            q, k, v = (tensor(shape(h, s), dtype, bwd, offset) for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))
            if sdpa:
                out = flashtriton.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
            else:
                out = flashtriton.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_attn_probs=lse)
            if bwd:
                backward(out[:2] if lse else [out])
        api = "scaled_dot_product_attention" if sdpa else "flash_attn_func"
        extra = (" d(lse)" if lse else "") + (f" scale={scale}" if scale is not None else "") + \
            (f" offset={offset}" if offset else "")
        return (f"{api} B={b} Sq={sq} Sk={sk} Hq={hq} Hkv={hkv} D={d} {_name(dtype)} causal={int(causal)}{extra} "
                f"{'fwd+bwd' if bwd else 'fwd'}", call)

    def varlen(lens_q, lens_k, hq, hkv, d, dtype, causal, lse=False):
        def call():
            cu_q, cu_k = (torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
                          for lens in (lens_q, lens_k))
            q = tensor((sum(lens_q), hq, d), dtype, True)
            k, v = (tensor((sum(lens_k), hkv, d), dtype, True) for _ in range(2))
            out = flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                                     return_attn_probs=lse)
            backward(out[:2] if lse else [out])
        return (f"flash_attn_varlen_func lens_q={_lens(lens_q)} lens_k={_lens(lens_k)} Hq={hq} Hkv={hkv} D={d} "
                f"{_name(dtype)} causal={int(causal)}{' d(lse)' if lse else ''} fwd+bwd", call)

    fp16, bf16, fp32 = torch.float16, torch.bfloat16, torch.float32
    if kind == "quick":
        yield dense(2, 256, 256, 4, 2, 64, fp16, True)
        return
    if kind == "autotune":
        for d in (64, 128, 80, 256):
            for causal in (False, True):
                yield dense(2, 2048, 2048, 16, 16, d, fp16, causal)
        yield dense(2, 128, 128, 16, 16, 128, bf16, True)  # short sequences: the pruning keeps small tiles
        yield dense(2, 1024, 1024, 16, 16, 64, fp32, False)
        yield varlen([300, 1000], [300, 1000], 16, 16, 128, fp16, True)
        return
    for d in (64, 128):
        for dtype in (fp16, bf16):
            for causal in (False, True):
                for s in (512, 2048, 4096, 16384):
                    b, h = _standard(s, d)
                    yield dense(b, s, s, h, h, d, dtype, causal)
                yield dense(2, 512, 512, 16, 16, d, dtype, causal)  # little work: the backward's Triton kernels
    # Varlen, a long batch: more than 2048 keys, enough work for the Gluon backward (not at D = 64 causal)
    long = [4096, 1000, 2048, 513, 17, 3000, 1]
    for d in (64, 128):
        for causal in (False, True):
            yield varlen(long, long, 8, 8, d, fp16, causal)
    if kind == "sweep":
        return
    for d in (64, 128):
        for causal in (False, True):
            yield dense(3, 1000, 1500, 12, 4, d, fp16, causal)  # GQA, odd lengths, Sq < Sk
            yield dense(4, 1, 4096, 32, 8, d, bf16, causal, bwd=False)  # one query row
    yield dense(4, 1024, 1024, 16, 16, 64, fp16, True, sdpa=True)  # torch's layout, top-left causal
    yield dense(4, 1024, 1024, 16, 16, 128, bf16, True, sdpa=True)
    yield dense(2, 8192, 1024, 16, 16, 128, bf16, True)  # Sq > Sk (the causal rules read Sq)
    yield dense(2, 1024, 1024, 16, 16, 128, fp16, True, lse=True)  # lse differentiated: the preprocess takes dlse
    yield dense(2, 2048, 2048, 16, 16, 128, bf16, True, scale=0.0)  # a zero scale: not the Gluon forward
    yield dense(2, 1024, 1024, 16, 16, 64, fp16, False, offset=1)  # unaligned: the portable kernels on sm_90
    # Head dims and dtype that only the portable kernel runs: every branch of default_fwd_config / _bwd_configs
    for causal in (False, True):
        for s in (512, 2048, 4096):
            yield dense(2, s, s, 16, 16, 80, fp16, causal)
        yield dense(2, 2048, 2048, 16, 16, 256, bf16, causal)
    for d, causal in ((64, False), (128, True), (256, True)):
        yield dense(2, 1024, 1024, 16, 16, d, fp32, causal)
    # Varlen: the long batch in bf16 with GQA, a short batch (little work, at most 512 keys)
    for causal in (False, True):
        yield varlen(long, long, 8, 2, 128, bf16, causal)
        for d in (64, 128):
            yield varlen([100, 300, 512, 64], [100, 300, 512, 64], 8, 2, d, fp16, causal)
    yield varlen([300, 1000], [300, 1500], 4, 4, 80, fp16, True)
    yield varlen([300, 1000], [300, 1500], 4, 4, 128, bf16, False, lse=True)


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _lens(lens: list) -> str:
    return "[" + ",".join(map(str, lens)) + "]"


def decode_calls(kind: str = "full"):
    """(label, thunk) of `flash_attn_with_kvcache` calls. kind "sweep": batch 1 / 8 / 64 against caches of 1k
    and 32k keys (batch 8 paged), appending new keys, at D = 64 (fp16) and 128 (bf16): the split counts, the
    stream schedule and the configs of `default_decode_config`; "full": that, then Sq > 1 (more stacked rows),
    cache_batch_idx, small pages, forced splits, MHA and MQA, lse returned, the portable-only head dims and
    fp32."""
    import torch

    import flashtriton

    def kv(b, cache, hq, hkv, d, dtype, causal, sq=1, paged=0, new=False, batch_idx=False, splits=0, lse=False):
        def call():
            q = torch.empty(b, sq, hq, d, dtype=dtype)
            if paged:
                pages = cache // paged
                k_cache, v_cache = (torch.empty(b * pages, paged, hkv, d, dtype=dtype) for _ in range(2))
                table = torch.arange(b * pages, dtype=torch.int32).reshape(b, pages)
            else:
                k_cache, v_cache = (torch.empty(b + batch_idx, cache, hkv, d, dtype=dtype) for _ in range(2))
                table = None
            k = v = None
            if new:
                k, v = (torch.empty(b, sq, hkv, d, dtype=dtype) for _ in range(2))
            lens = torch.full((b,), cache // 2, dtype=torch.int32)
            idx = torch.arange(b, dtype=torch.int32) if batch_idx else None
            flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, cache_batch_idx=idx,
                                                block_table=table, causal=causal, num_splits=splits,
                                                return_softmax_lse=lse)
        return (f"flash_attn_with_kvcache B={b} cache={cache} Sq={sq} Hq={hq} Hkv={hkv} D={d} {_name(dtype)} "
                f"causal={int(causal)} paged={paged} new={int(new)} batch_idx={int(batch_idx)} splits={splits} "
                f"lse={int(lse)}", call)

    fp16, bf16 = torch.float16, torch.bfloat16
    if kind == "quick":
        yield kv(8, 1024, 32, 8, 128, fp16, True, new=True)
        return
    if kind == "autotune":
        for d in (64, 128):
            yield kv(8, 4096, 32, 8, d, fp16, False)
        yield kv(2, 4096, 32, 8, 128, bf16, True, sq=4, paged=256, new=True)
        yield kv(4, 1024, 8, 8, 256, fp16, False)
        return
    for d, dtype in ((64, fp16), (128, bf16)):
        for b in (1, 8, 64):
            for cache in (1024, 32768):
                yield kv(b, cache, 32, 8, d, dtype, True, paged=256 if b == 8 else 0, new=True)
    if kind == "sweep":
        return
    yield kv(8, 32768, 32, 8, 128, fp16, False, lse=True)
    yield kv(8, 4096, 32, 8, 64, bf16, True, sq=4, new=True, batch_idx=True)
    yield kv(8, 4096, 32, 8, 128, fp16, True, sq=8, paged=16, new=True)  # 32 stacked rows
    yield kv(16, 8192, 16, 1, 128, bf16, True, sq=8, paged=256)  # 128 stacked rows: two M tiles
    yield kv(8, 32768, 32, 32, 128, fp16, False, splits=1)
    yield kv(8, 32768, 32, 32, 64, bf16, True, splits=8)
    for d in (80, 256):
        yield kv(8, 4096, 32, 8, d, fp16, True, new=True)
    yield kv(8, 4096, 32, 8, 128, torch.float32, False)


FAMILIES = {"attention": attention_calls, "decode": decode_calls}


def worker(setting: str, capability: int, grids: list[str], out: str, count_only: bool = False,
           with_ptx: bool = False) -> None:
    """Run one setting's calls in this (fresh) process and write what they compiled to `out` (`with_ptx`: the
    normalised PTX too)."""
    recorder = Recorder(f"sm_{capability}")
    pretend_gpu(capability, recorder, count_only)
    import triton

    import flashtriton

    errors = {}
    for grid in grids:
        family, kind = grid.split(":")
        for label, call in FAMILIES[family](kind):
            recorder.call = f"{setting} | {label}"
            recorder.calls[recorder.call] = []
            try:
                call()
            except Exception as e:  # recorded: a call that fails here takes no path a GPU would take
                errors[recorder.call] = f"{type(e).__name__}: {e}"
                recorder.calls[recorder.call].append(f"error: {type(e).__name__}: {e}")
    Path(out).write_text(json.dumps(dict(entries=recorder.entries, calls=recorder.calls, errors=errors,
                                         ptx=recorder.ptx if with_ptx else {},
                                         flashtriton=str(Path(flashtriton.__file__).parent),
                                         triton=triton.__version__)))


# ----------------------------------------------------------------------------------------------------------
# Driver: settings in subprocesses, merge, table, compare
# ----------------------------------------------------------------------------------------------------------
def run_setting(setting, tmp: str, cache_dir: str, count_only: bool, with_ptx: bool) -> dict:
    """One setting's record, from a fresh worker process with the FLASHTRITON_* switches of the setting only."""
    name, capability, env_vars, grids = setting
    env = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    env.update(env_vars, TRITON_CACHE_DIR=cache_dir)
    out = os.path.join(tmp, re.sub(r"\W+", "_", name) + ".json")
    cmd = [sys.executable, __file__, "--worker", name, "--capability", str(capability), "--grids", ",".join(grids),
           "--worker-out", out] + (["--count"] if count_only else []) + (["--with-ptx"] if with_ptx else [])
    start = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"setting {name!r} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    record = json.loads(Path(out).read_text())
    record["seconds"] = round(time.time() - start, 1)
    return record


def fingerprint(settings, jobs: int, cache_dir: str, count_only: bool = False,
                with_ptx: bool = False) -> tuple[dict, dict, dict]:
    """(the fingerprint, the normalised PTX by sha256 if `with_ptx`, seconds per setting), the settings run `jobs`
    at a time. An entry seen in several settings keeps the first setting's call (in the order of `settings`)."""
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(jobs) as pool:
        records = list(pool.map(lambda s: run_setting(s, tmp, cache_dir, count_only, with_ptx), settings))
    entries, calls, errors, ptx = {}, {}, {}, {}
    for record in records:
        for key, entry in record["entries"].items():
            entries.setdefault(key, entry)
        calls.update(record["calls"])
        errors.update(record["errors"])
        ptx.update(record["ptx"])
    meta = dict(tool="scripts/ptx_fingerprint.py", triton=records[0]["triton"],
                flashtriton=_commit(records[0]["flashtriton"]),
                settings={name: dict(capability=cap, env=env, grids=list(grids))
                          for name, cap, env, grids in settings})
    seconds = {name: record["seconds"] for (name, *_), record in zip(settings, records)}
    return dict(meta=meta, entries=dict(sorted(entries.items())), calls=calls, errors=errors), ptx, seconds


def _commit(source: str) -> str:
    """The commit of the flashtriton source fingerprinted (+ "-dirty" if its tracked files differ from it)."""
    git = ["git", "-C", source]
    sha = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    if not sha:
        return f"{source} (not a git checkout)"
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no", "--", "."], capture_output=True,
                           text=True).stdout.strip()
    return sha + ("-dirty" if dirty else "")


def summary(result: dict) -> str:
    """A table: kernel, target, configs (entries), distinct PTX."""
    rows: dict = {}
    for entry in result["entries"].values():
        row = rows.setdefault((entry["kernel"], entry["target"]), [0, set()])
        row[0] += 1
        row[1].add(entry["sha256"])
    lines = [f"{'kernel':<28} {'target':<6} {'configs':>7} {'PTX':>5}"]
    for (kernel, target), (n, shas) in sorted(rows.items()):
        lines.append(f"{kernel:<28} {target:<6} {n:>7} {len(shas):>5}")
    lines.append(f"{'total':<35} {len(result['entries']):>7} "
                 f"{len({e['sha256'] for e in result['entries'].values()}):>5}   "
                 f"({len(result['calls'])} calls, {len(result['errors'])} failed)")
    return "\n".join(lines)


def compare(old: dict, new: dict, ptx_only: bool = False) -> tuple[bool, str]:
    """(same, report). By key: entries whose PTX differs, missing (in old only) and new ones; calls whose
    launches differ. With `ptx_only` the verdict looks at PTX hashes alone (per call, and the set of all)."""
    lines = []
    old_e, new_e = old["entries"], new["entries"]
    differ = {k for k in old_e if k in new_e and old_e[k]["sha256"] != new_e[k]["sha256"]}
    missing = [k for k in old_e if k not in new_e]
    added = [k for k in new_e if k not in old_e]
    new_by_sha: dict = {}
    for k in added:
        new_by_sha.setdefault(new_e[k]["sha256"], []).append(k)
    for title, keys in (("PTX differs", sorted(differ)), ("missing (old only)", missing), ("new (new only)", added)):
        if keys:
            lines.append(f"{title}: {len(keys)}")
            for k in keys:
                lines.append(f"  {k}")
                if k in differ:
                    lines.append(f"    PTX {old_e[k]['sha256']} -> {new_e[k]['sha256']}")
                elif k in missing and old_e[k]["sha256"] in new_by_sha:
                    lines.append(f"    same PTX as the new {new_by_sha[old_e[k]['sha256']][0]}")

    old_sha, new_sha = ({e["id"]: e["sha256"] for e in r["entries"].values()} for r in (old, new))

    def shas(result, call):  # the PTX a call launched, in order (an error message stays as it is)
        by_id = old_sha if result is old else new_sha
        return [by_id.get(i, i) for i in result["calls"][call]]

    calls_differ = [c for c in old["calls"] if c in new["calls"] and shas(old, c) != shas(new, c)]
    calls_gone = [c for c in old["calls"] if c not in new["calls"]]
    calls_new = [c for c in new["calls"] if c not in old["calls"]]
    for title, calls in (("calls launching other PTX", calls_differ), ("calls missing", calls_gone),
                         ("calls new", calls_new)):
        if calls:
            lines.append(f"{title}: {len(calls)}")
            lines.extend(f"  {c}" for c in calls[:50])
            if len(calls) > 50:
                lines.append(f"  ... {len(calls) - 50} more")
    old_set = {e["sha256"] for e in old_e.values()}
    new_set = {e["sha256"] for e in new_e.values()}
    ptx_same = old_set == new_set and not calls_differ and not calls_gone and not calls_new
    same = ptx_same if ptx_only else (ptx_same and not (differ or missing or added))
    lines.append(f"{len(old_e)} entries before, {len(new_e)} now; {len(old_set)} distinct PTX before, "
                 f"{len(new_set)} now, {len(old_set & new_set)} in both")
    lines.append("SAME" if same else "DIFFERENT" + (" (PTX only)" if ptx_only else ""))
    return same, "\n".join(lines)


def _default_out(result: dict) -> Path:
    commit = result["meta"]["flashtriton"]
    name = commit.split("-")[0][:7] if re.match(r"^[0-9a-f]{7,}", commit) else "unknown"
    return ROOT / "benchmarks" / "ptx" / f"{name}.json"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-o", "--out", help="write the JSON here (default: benchmarks/ptx/<short sha>.json; none with "
                                       "--compare, --quick or --count)")
    p.add_argument("--compare", metavar="OLD_JSON", help="compare with a previous fingerprint (on its grid, unless "
                                                         "--quick / --autotune say otherwise); exit 1 if different")
    p.add_argument("--ptx-only", action="store_true", help="with --compare: judge the PTX hashes alone")
    p.add_argument("--quick", action="store_true", help="a tiny grid: one dense and one decode call, sm_90 and sm_80")
    p.add_argument("--autotune", action="store_true",
                   help="add the autotuners' candidate configs (FLASHTRITON_AUTOTUNE=1; ~13 more minutes cold)")
    p.add_argument("--count", action="store_true", help="list what the grid compiles, without compiling (no hashes)")
    p.add_argument("--jobs", type=int, default=2, help="settings compiled at once (processes; default 2)")
    p.add_argument("--ptx-dir", help="also write each normalised PTX as DIR/<sha256>.ptx")
    p.add_argument("--cache-dir", default=CACHE_DIR, help=f"the workers' Triton cache (default {CACHE_DIR})")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--capability", type=int, help=argparse.SUPPRESS)
    p.add_argument("--grids", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    p.add_argument("--with-ptx", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.capability, args.grids.split(","), args.worker_out, args.count, args.with_ptx)
        return 0

    old = json.loads(Path(args.compare).read_text()) if args.compare else None
    grid = "quick" if args.quick else "full+autotune" if args.autotune else old["meta"]["grid"] if old else "full"
    settings = QUICK_SETTINGS if grid == "quick" else SETTINGS + (AUTOTUNE_SETTINGS if "autotune" in grid else [])
    start = time.time()
    result, ptx, seconds = fingerprint(settings, args.jobs, args.cache_dir, args.count, bool(args.ptx_dir))
    result["meta"]["grid"] = grid
    print(summary(result))
    print(f"{time.time() - start:.0f} s (" + ", ".join(f"{name}: {s:.0f} s" for name, s in seconds.items()) + ")")
    for call, error in result["errors"].items():
        print(f"FAILED {call}: {error}")
    out = args.out or (None if args.compare or args.quick or args.count else _default_out(result))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
    if args.ptx_dir:
        Path(args.ptx_dir).mkdir(parents=True, exist_ok=True)
        for sha, text in ptx.items():
            (Path(args.ptx_dir) / f"{sha}.ptx").write_text(text + "\n")
    if args.compare:
        same, report = compare(old, result, args.ptx_only)
        print(report)
        return 0 if same else 1
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
