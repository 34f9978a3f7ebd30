"""Launching a `@triton.jit` kernel with less host time than `kernel[grid](...)`.

`kernel[grid](*args, **meta)` binds the arguments, computes Triton's specialization of every one of them
(dtype, 16-byte alignment of pointers, divisibility of ints) and looks the compiled kernel up: ~40 us of
CPU per launch of a 35-argument kernel on the H200 machine's host (benchmarks/2026-11-29-h200/explore9/host_fa183e7cb3b0.json), more than the
GPU time of a small decode step. Decoding and short sequences call the same kernels with the same shapes
again and again, so `launch` remembers the compiled kernel under a key that is *stricter* than Triton's
specialization: the exact value of every int argument, every tensor's dtype and whether its address is a
multiple of 16, and the constexpr / option values. On a hit it calls the compiled kernel's launcher
directly; on a miss (and under the interpreter, with launch hooks installed, or for argument types it does
not know) it goes through Triton's own path, which compiles if needed.

Under the interpreter (TRITON_INTERPRET=1) every launch holds one process-wide lock: Triton's interpreter
patches `triton.language` and keeps the program ids in module-level state for the length of a launch, so two
threads launching at once read each other's. Every flashtriton kernel launch on the interpreter goes through
`launch` (the autotuned `kernel[grid]` calls never run there: the launchers force a config); on a GPU the lock
is never taken.
"""

from __future__ import annotations

import functools
import inspect
import threading

import torch
from triton import knobs
from triton.runtime.driver import driver

from .._env import INTERPRET

try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None
try:  # Gluon's (triton >= 3.6), which carry a shared-memory layout
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
except ImportError:  # pragma: no cover
    GluonTensorDescriptor = None

_Tensor = torch.Tensor

_INTERPRETER_LOCK = threading.Lock()  # serialises interpreter launches (see the module docstring)

# Triton option names (not kernel parameters) that may appear among the keyword arguments.
_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_pdl"})


def _arg_key(arg):
    """What of one runtime argument a compiled kernel depends on, or raise TypeError for unknown types.
    Stricter than Triton's specialization (which keys ints only on `== 1` and divisibility by 16)."""
    kind = type(arg)
    if kind is int:
        return arg
    if kind is float:
        return float
    if arg is None:
        return None
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if TensorDescriptor is not None and kind is TensorDescriptor:  # the launcher encodes it on every call
        base = arg.base
        return (TensorDescriptor, base.dtype, base.data_ptr() % 16 == 0, tuple(arg.shape), tuple(arg.strides),
                tuple(arg.block_shape), getattr(arg, "padding", None))
    if GluonTensorDescriptor is not None and kind is GluonTensorDescriptor:
        base = arg.base
        return (GluonTensorDescriptor, base.dtype, base.data_ptr() % 16 == 0, tuple(arg.shape), tuple(arg.strides),
                tuple(arg.block_shape), arg.layout, arg.padding)
    raise TypeError(kind.__name__)


def _launch_key(fn, device: int, args: tuple, meta: dict):
    """The cache key of a launch, or None for an argument type `_arg_key` does not cover. Ints and plain
    tensors are keyed inline: a decode launch has ~36 arguments, and this is on every call's path."""
    try:
        return (fn, device, tuple(meta.items()), tuple([
            a if type(a) is int else (a.dtype, not a.data_ptr() & 15) if type(a) is _Tensor else _arg_key(a)
            for a in args]))
    except TypeError:
        return None


class _Entry:
    __slots__ = ("kernel", "tail")

    def __init__(self, kernel, tail):
        self.kernel = kernel
        self.tail = tail  # constexpr values of the parameters after the positional ones, in parameter order


_CACHE: dict = {}
_CACHE_LIMIT = 4096  # entries; a workload with ever-new shapes starts over rather than growing without bound


def _hooks_installed() -> bool:
    """Whether a profiler (e.g. proton) has installed launch hooks: then every launch takes Triton's path.
    triton 3.6 keeps the hooks in (empty) HookChain objects, older versions in None-or-function fields."""
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def launch_tail(fn, n_args: int, meta: dict) -> tuple | None:
    """The values of `fn`'s parameters after its first `n_args` (the positional ones), in parameter order: from
    `meta`, or the parameter's default where `meta` leaves it out (as Triton binds them: e.g. the dropout flags,
    passed only with dropout); None if one has neither."""
    tail = []
    for param in list(inspect.signature(fn.fn).parameters.values())[n_args:]:  # (a miss's path only)
        if param.name in meta:
            tail.append(meta[param.name])
        elif param.default is not inspect.Parameter.empty:
            tail.append(param.default)
        else:
            return None
    return tuple(tail)


def launch(fn, grid: tuple, args: tuple, meta: dict):
    """`fn[grid](*args, **meta)`, with the argument binding skipped for a key seen before.

    fn: a `@triton.jit` function (not an autotuner); grid: (x, y, z) ints; args: the runtime arguments,
    positionally, in parameter order; meta: constexpr parameters by name and Triton options (num_warps,
    num_stages, ...). Returns the compiled kernel (as `fn[grid]` does).
    """
    if INTERPRET:
        with _INTERPRETER_LOCK:
            return fn[grid](*args, **meta)
    if _hooks_installed():
        return fn[grid](*args, **meta)
    device = driver.active.get_current_device()
    key = _launch_key(fn, device, args, meta)
    if key is None:  # an argument type the key does not cover
        return fn[grid](*args, **meta)
    entry = _CACHE.get(key)
    if entry is None:
        kernel = fn[grid](*args, **meta)
        if kernel is None or hasattr(kernel, "result"):  # not compiled synchronously: take the slow path again
            return kernel
        tail = launch_tail(fn, len(args), meta)
        if tail is None:  # a parameter neither given nor defaulted: Triton's path says what is wrong
            return kernel
        if len(_CACHE) >= _CACHE_LIMIT:
            _CACHE.clear()
        _CACHE[key] = _Entry(kernel, tail)
        return kernel
    kernel = entry.kernel
    stream = driver.active.get_current_stream(device)
    grid_y = grid[1] if len(grid) > 1 else 1
    grid_z = grid[2] if len(grid) > 2 else 1
    kernel.run(grid[0], grid_y, grid_z, stream, kernel.function, kernel.packed_metadata, None, None, None,
               *args, *entry.tail)
    return kernel


class Relaunch:
    """One compiled kernel, launched again with new argument values of the same signature without any key:
    for a caller that already knows the signature is unchanged (e.g. `kernels.decode_launch` keys its launch plans
    on shapes, strides and dtypes, and checks pointer alignment itself). Pointer arguments may be passed as
    ints (`tensor.data_ptr()`), which Triton's launcher takes as they are."""

    __slots__ = ("kernel", "tail", "device")

    def __init__(self, kernel, tail: tuple, device: int):
        self.kernel, self.tail, self.device = kernel, tail, device

    def __call__(self, grid: tuple[int, int, int], args: tuple, stream: int | None = None) -> None:
        """Launch on the current stream of the kernel's device, or on `stream` (a raw CUDA stream handle, as
        `torch._C._cuda_getCurrentRawStream` gives it) where the caller has already asked for it."""
        kernel = self.kernel
        if stream is None:
            stream = driver.active.get_current_stream(self.device)
        kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata, None, None, None,
                   *args, *self.tail)


def launch_and_keep(fn, grid: tuple, args: tuple, meta: dict) -> Relaunch | None:
    """`launch(fn, grid, args, meta)`, returning a `Relaunch` of the compiled kernel when it was remembered
    (None under the interpreter, with launch hooks, or for an argument signature `launch` does not cache)."""
    launch(fn, grid, args, meta)
    if INTERPRET or _hooks_installed():
        return None
    device = driver.active.get_current_device()
    key = _launch_key(fn, device, args, meta)
    entry = _CACHE.get(key) if key is not None else None
    return Relaunch(entry.kernel, entry.tail, device) if entry is not None else None


def on_inputs_device(fn):
    """Run `fn` with the GPU of its first argument (a tensor) as the current device when it is not already.
    Triton launches on the current device; without this, inputs on cuda:1 while cuda:0 is current (a model
    spread over GPUs, e.g. transformers' device_map="auto") would be read by a kernel running on cuda:0."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        device = args[0].device
        if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
            with torch.cuda.device(device.index):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper


def hooks_installed() -> bool:
    """Whether launches must take Triton's own path (a profiler's hooks are installed)."""
    return _hooks_installed()


def cache_size() -> int:
    """Number of (kernel, argument key) entries remembered (tests, diagnostics)."""
    return len(_CACHE)


class KeptLaunch:
    """One launch site of a plan whose argument signature never changes (the plan's key fixes every int, dtype and
    pointer alignment): the first call goes through `launch_and_keep`, later ones relaunch the compiled kernel. On
    the interpreter, with launch hooks, where `launch` does not cache the signature, or not `keep` (a plan built
    for one call), every call takes `launch`."""

    __slots__ = ("fn", "meta", "keep", "relaunch")

    def __init__(self, fn, meta: dict, keep: bool = True):
        self.fn, self.meta, self.keep, self.relaunch = fn, meta, keep, None

    def __call__(self, grid: tuple[int, int, int], args: tuple) -> None:
        if self.relaunch is not None and not _hooks_installed():
            self.relaunch(grid, args)
        elif self.keep:
            self.relaunch = launch_and_keep(self.fn, grid, args, self.meta)
        else:
            launch(self.fn, grid, args, self.meta)
