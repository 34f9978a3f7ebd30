"""Argument checks shared by every public function: bad input gets a clear error, never a wrong answer.

Every message names the argument, what was expected and what came.
"""

from __future__ import annotations

import math
import numbers

import torch

from . import configs
from .kernels.memo import remembered
from ._env import INTERPRET

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MIN_CAPABILITY = (8, 0)


# Arguments whose None means "off" as their default does (flash-attn callers pass softcap=None for no softcap).
_NONE_IS_DEFAULT = frozenset({"softcap"})


def not_implemented(name: str, value, default) -> None:
    """Raise for an argument whose feature is not built yet, unless it has its neutral value (a list compares as
    a tuple; None counts as the default for the arguments in `_NONE_IS_DEFAULT`)."""
    if value is None and name in _NONE_IS_DEFAULT:
        return
    if isinstance(value, list):
        value = tuple(value)
    if isinstance(value, torch.Tensor) or value != default:
        shown = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
        raise NotImplementedError(
            f"flashtriton does not support {name}={shown} yet (only {name}={default!r}); "
            "it is never silently ignored."
        )


def check_tensors(names: tuple[str, ...], tensors: tuple, ndim: int, layout: str) -> None:
    """Type, rank, dtype and device of the attention inputs; none may be a torch.func transform's tensor."""
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_not_transformed(names, tensors)
    for name, t in zip(names, tensors):
        if t.dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dims {layout}, got {t.dim()} dims with shape {tuple(t.shape)}")
    dtypes = {n: t.dtype for n, t in zip(names, tensors)}
    for name, dtype in dtypes.items():
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {dtype}")
    if len(set(dtypes.values())) > 1:
        raise TypeError(f"{', '.join(names)} must share one dtype, got " + ", ".join(f"{n}={d}" for n, d in dtypes.items()))
    check_device(names, tensors)


def check_device(names: tuple[str, ...], tensors: tuple) -> None:
    devices = {n: t.device for n, t in zip(names, tensors)}
    if len(set(devices.values())) > 1:
        raise ValueError("all inputs must be on one device, got " + ", ".join(f"{n} on {d}" for n, d in devices.items()))
    device = tensors[0].device
    if device.type == "cuda":
        capability = configs.capability(device)
        if capability < MIN_CAPABILITY:
            raise RuntimeError(
                f"flashtriton needs a GPU of compute capability >= 8.0 (Ampere or newer); "
                f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}"
            )
    elif device.type == "cpu":
        if not INTERPRET:
            raise ValueError(
                f"{names[0]} is on the CPU but Triton's interpreter is off: move the tensors to a CUDA GPU, "
                "or set the environment variable TRITON_INTERPRET=1 before importing flashtriton to run the "
                "kernels on the CPU through Triton's interpreter (slow; for testing)"
            )
    else:
        raise ValueError(f"{names[0]} is on {device}; flashtriton runs on CUDA GPUs (or the CPU under TRITON_INTERPRET=1)")


def check_heads_and_dims(q_heads: int, kv_heads: int, head_dim: int, v_head_dim: int, k_heads_v: int,
                         separate_v: bool = False) -> None:
    """Heads (k's and v's equal, q's a multiple of them) and head dims (1..MAX_HEAD_DIM). `separate_v`: v may have a
    head dim of its own (the output's; DeepSeek's MLA), else v's must be q and k's. (k's head dim is q's: the
    callers check it.)"""
    if kv_heads != k_heads_v:
        raise ValueError(f"k and v must have the same number of heads, got k: {kv_heads}, v: {k_heads_v}")
    if kv_heads == 0 or q_heads % kv_heads != 0:
        raise ValueError(
            f"the number of query heads must be a multiple of the number of key/value heads (GQA/MQA), "
            f"got q: {q_heads} heads, k/v: {kv_heads} heads"
        )
    if not separate_v and head_dim != v_head_dim:
        raise ValueError(f"q, k and v must have the same head dim, got q/k: {head_dim}, v: {v_head_dim}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be between 1 and {MAX_HEAD_DIM}, got {head_dim}")
    if not 1 <= v_head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"v's head dim (the output's) must be between 1 and {MAX_HEAD_DIM}, got {v_head_dim}")


def check_same(what: str, **values: int) -> None:
    first, *rest = values.values()
    if any(v != first for v in rest):  # no set(): hashing a SymInt would specialise it under torch.compile
        raise ValueError(f"{what} must match, got " + ", ".join(f"{n}: {v}" for n, v in values.items()))


def check_flag(name: str, value) -> bool:
    """A boolean argument (causal, is_causal, return_attn_probs, ...) as a bool: a Python or NumPy bool or an
    integer, as flash-attn's and torch's bool parameters take them; anything else (a string such as "False", whose
    truth would be True; None; a tensor, whose truth would wait for the GPU) raises, naming the argument."""
    if isinstance(value, (bool, numbers.Integral)) or (type(value).__module__ == "numpy"
                                                        and type(value).__name__ in ("bool_", "bool")):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {type(value).__name__}" + (f" {value!r}" if isinstance(value, str)
                                                                             else ""))


def check_scale(name: str, scale, allow_negative: bool = False) -> None:
    """None, or a finite real number (Python or NumPy; not a bool, not a tensor). Negative only with
    `allow_negative`: the kernels take the running row maximum of the unscaled scores times the scale, which a
    negative scale would turn into a minimum; the callers that allow it (`interface`, `kvcache`) negate q instead."""
    if scale is None:
        return
    if isinstance(scale, torch.Tensor):
        raise TypeError(f"{name} must be a real number (float) or None, got a torch.Tensor; pass float() of it "
                        "(a GPU tensor's float() waits for the GPU)")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{name} must be a real number (float) or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"{name} must be a finite number, got {scale}")
    if scale < 0 and not allow_negative:
        raise ValueError(f"{name} must be a finite number >= 0 here (the kernels keep the running maximum of "
                         f"the unscaled scores), got {scale}")


def _integer_tensor(t) -> bool:
    return isinstance(t, torch.Tensor) and not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def check_window(window_size) -> tuple[int, int]:
    """flash-attn's window_size: two ints >= -1 (-1 = unbounded on that side) -> a tuple. As flash-attn indexes
    it, a tuple or list, or a 1-D integer tensor of two (flash-attn's tests draw it with torch.randint; its values
    are read on the host: a sync for a GPU tensor); sides may be 0-d integer tensors. None, for the whole window or
    a side, is unbounded (FlashAttention-4's spelling)."""
    if window_size is None:
        return -1, -1
    if _integer_tensor(window_size) and window_size.dim() == 1 and window_size.numel() == 2:
        window_size = window_size.tolist()
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a tuple of two ints (left, right), -1 for unbounded, got {window_size!r}")
    window_size = [-1 if side is None else side.item() if _integer_tensor(side) and side.dim() == 0 else side
                   for side in window_size]
    for side in window_size:
        if isinstance(side, bool) or not isinstance(side, numbers.Integral):
            raise TypeError(f"window_size must hold two ints, got {window_size!r}")
        if side < -1:
            raise ValueError(f"window_size sides must be >= -1 (-1 = unbounded), got {window_size!r}")
    return int(window_size[0]), int(window_size[1])


def check_softcap(softcap) -> float:
    """flash-attn's softcap: a finite real number >= 0 (0 or None: off) -> a float."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, torch.Tensor) or isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number (float), got {type(softcap).__name__}")
    if not 0 <= softcap < math.inf:  # (comparisons, not math.isfinite: torch.compile traces them)
        raise ValueError(f"softcap must be a finite number >= 0 (0: off), got {softcap}")
    return float(softcap)


def check_dropout(dropout_p, name: str = "dropout_p") -> float:
    """Attention dropout's probability: a real number in [0, 1) (Python or NumPy; not a bool, not a tensor; 0: off)
    -> a float."""
    if isinstance(dropout_p, torch.Tensor) or isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"{name} must be a real number (float) in [0, 1), got {type(dropout_p).__name__}")
    if not 0 <= dropout_p < 1:  # (comparisons: NaN fails them too)
        raise ValueError(f"{name} must be in [0, 1) (the probability of dropping an attention weight; 0: off), "
                         f"got {dropout_p}")
    return float(dropout_p)


def check_alibi(alibi_slopes, batch: int, heads: int, device) -> torch.Tensor | None:
    """flash-attn's alibi_slopes: None, or an fp32 tensor (nheads,) or (batch, nheads) on the inputs' device ->
    the tensor with a contiguous last dim."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32 (flash-attn's dtype), got {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must have shape (nheads,) = ({heads},) or (batch, nheads) = ({batch}, {heads}), "
                         f"got {tuple(alibi_slopes.shape)}")
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes must be on the inputs' device ({device}), got {alibi_slopes.device}")
    check_not_transformed(("alibi_slopes",), (alibi_slopes,))
    return alibi_slopes if alibi_slopes.stride(-1) == 1 else alibi_slopes.contiguous()


def check_sink(learnable_sink, heads: int, dtype: torch.dtype, device) -> torch.Tensor | None:
    """learnable_sink (FlashAttention-4's name): None, or a (nheads,) tensor, fp32 or the inputs' dtype, on their
    device -> the tensor, contiguous."""
    if learnable_sink is None:
        return None
    if not isinstance(learnable_sink, torch.Tensor):
        raise TypeError(f"learnable_sink must be a torch.Tensor or None, got {type(learnable_sink).__name__}")
    if learnable_sink.dtype not in (torch.float32, dtype):
        raise TypeError(f"learnable_sink must be float32 or the inputs' dtype {dtype}, got {learnable_sink.dtype}")
    if tuple(learnable_sink.shape) != (heads,):
        raise ValueError(f"learnable_sink must have shape (nheads,) = ({heads},), got {tuple(learnable_sink.shape)}")
    if learnable_sink.device != device:
        raise ValueError(f"learnable_sink must be on the inputs' device ({device}), got {learnable_sink.device}")
    check_not_transformed(("learnable_sink",), (learnable_sink,))
    return learnable_sink.contiguous()


INT32_LIMIT = 2**31


def check_int32_offsets(names: tuple[str, ...], tensors: tuple, seq_len_of: tuple[int, ...],
                        out_head_dim: int = 0) -> None:
    """The kernels address one sequence of one batch entry with 32-bit offsets (the batch / sequence start
    is 64-bit): rows x row stride, heads x head stride and the (S, H, D) output must stay below 2**31.
    out_head_dim: the output's head dim (v's) where it may differ from the first tensor's (q: the output and its
    gradient have q's rows and heads)."""
    for i, (name, t, seqlen) in enumerate(zip(names, tensors, seq_len_of)):
        heads, head_dim = t.shape[-2], t.shape[-1]
        if i == 0:
            head_dim = max(head_dim, out_head_dim)
        seq_stride, head_stride = abs(t.stride(-3)), abs(t.stride(-2))
        extent = max(seqlen * seq_stride, heads * head_stride, seqlen * heads * head_dim)
        if extent >= INT32_LIMIT:
            raise NotImplementedError(
                f"{name}: one sequence spans {extent} elements (sequence length {seqlen}, {heads} heads, strides "
                f"{tuple(t.stride())}); flashtriton's kernels use 32-bit offsets within a sequence, so this must be "
                f"below 2**31 (split the heads across calls)"
            )


GRID_LIMIT = 65535  # CUDA's largest grid y / z: the attention kernels put heads and batch entries there


def check_grid(batch: int, heads: int) -> None:
    """The forward and backward kernels run a grid (tiles, heads, batch): both must fit CUDA's y / z limit."""
    if batch > GRID_LIMIT or heads > GRID_LIMIT:
        raise NotImplementedError(
            f"batch {batch} and heads {heads} must each be at most {GRID_LIMIT} (the kernels' launch grid); "
            f"split the call"
        )


def plain_tensors(*tensors, names: tuple[str, ...] = ()) -> bool:
    """Whether every argument is a plain torch.Tensor or None: no subclass (fake, functional) is being traced.
    Raises NotImplementedError for a torch.func transform's tensor (`check_not_transformed`), which passes for
    a plain one by its type."""
    check_not_transformed(names, tensors)
    return all(t is None or type(t) is torch.Tensor for t in tensors)


_TRANSFORMS_ACTIVE = getattr(torch._C, "_are_functorch_transforms_active", None)
_IS_WRAPPED = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)


def check_not_transformed(names: tuple[str, ...], tensors: tuple) -> None:
    """Raise NotImplementedError naming the first tensor that a torch.func transform (vmap, grad, vjp, jvp,
    jacrev, jacfwd, hessian, functionalize) wraps: the kernels read the tensors' memory, which such a tensor does
    not expose, and the transforms have no rules for the kernels. One cheap query while no transform is active;
    tensors a transform does not wrap (a closure's) are fine. `names` name the tensors (positions otherwise).
    Torch builds without the queries skip it."""
    if _TRANSFORMS_ACTIVE is None or _IS_WRAPPED is None or not _TRANSFORMS_ACTIVE():
        return
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor) and _IS_WRAPPED(t):
            name = names[i] if i < len(names) else f"tensor argument {i}"
            raise NotImplementedError(
                f"flashtriton does not support torch.func transforms (torch.vmap, torch.func.grad / vjp / jvp / "
                f"jacrev / jacfwd / hessian, functionalize): {name} is wrapped by one. Call flashtriton on plain "
                "tensors: fold a vmapped dimension into the batch dimension, take gradients with torch.autograd")


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Kernels take any strides but a contiguous last dim; copy only when that is not so."""
    return t if t.stride(-1) == 1 else t.contiguous()


def check_cu_seqlens(name: str, cu_seqlens, total: int, max_seqlen, max_name: str, batch: int | None,
                     device: torch.device) -> int:
    """Static checks on a cu_seqlens tensor; returns the batch size. Values are checked by `check_cu_seqlens_values`."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor of shape (batch + 1,), got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{name} must be 1-D of length batch + 1 >= 1, got shape {tuple(cu_seqlens.shape)}")
    if batch is not None and cu_seqlens.numel() != batch + 1:
        raise ValueError(f"{name} must have length batch + 1 = {batch + 1} (like the other cu_seqlens), got {cu_seqlens.numel()}")
    if cu_seqlens.device != device:
        raise ValueError(f"{name} must be on {device} like q, k and v, got {cu_seqlens.device}")
    if not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool) or max_seqlen < 0:
        raise TypeError(f"{max_name} must be a non-negative Python int, got {max_seqlen!r}")
    return cu_seqlens.numel() - 1


def check_cu_seqlens_values(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, total_k: int,
                            max_seqlen_q: int, max_seqlen_k: int) -> tuple[bool, bool]:
    """Host-side check of both cu_seqlens' values, with one small copy to the CPU for the two of them.

    Returns, for q and for k, whether the sequences cover every token (cu[0] == 0 and cu[-1] == total).
    The copy waits for the GPU, so a call whose tensors passed already skips it: the same tensor objects, not
    written since (torch's version counter; inference tensors have none and are always copied), with the same
    totals and maxima. A model's layers share one batch's cu_seqlens, and its backward the forward's."""
    key = (id(cu_seqlens_q), id(cu_seqlens_k), total_q, total_k, max_seqlen_q, max_seqlen_k)
    return remembered(_CHECKED_CU_SEQLENS, key, (cu_seqlens_q, cu_seqlens_k), lambda: _check_cu_seqlens_values(
        cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k))


_CHECKED_CU_SEQLENS: dict = {}  # (ids, totals, maxima) -> (stamp, weakrefs to the two tensors, result)


def _check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k):
    n = cu_seqlens_q.numel()
    same = cu_seqlens_k is cu_seqlens_q
    both = (cu_seqlens_q if same else torch.cat([cu_seqlens_q, cu_seqlens_k])).tolist()
    values_q, values_k = (both, both) if same else (both[:n], both[n:])
    return (_check_values("cu_seqlens_q", values_q, total_q, max_seqlen_q, "max_seqlen_q"),
            _check_values("cu_seqlens_k", values_k, total_k, max_seqlen_k, "max_seqlen_k"))


def _check_values(name: str, values: list[int], total: int, max_seqlen: int, max_name: str) -> bool:
    if values[0] < 0:
        raise ValueError(f"{name}[0] must be >= 0, got {values[0]}")
    lengths = [b - a for a, b in zip(values[:-1], values[1:])]
    if any(n < 0 for n in lengths):
        i = next(i for i, n in enumerate(lengths) if n < 0)
        raise ValueError(f"{name} must be non-decreasing, got {name}[{i}]={values[i]} > {name}[{i + 1}]={values[i + 1]}")
    if values[-1] > total:
        raise ValueError(f"{name}[-1]={values[-1]} is past the end of the packed tensor ({total} tokens)")
    longest = max(lengths, default=0)
    if longest > max_seqlen:
        raise ValueError(f"{max_name}={max_seqlen} is smaller than the longest sequence in {name} ({longest})")
    return values[0] == 0 and values[-1] == total


# Signatures of calls whose checks passed (`checked_key`) -> what the checks returned. A repeated call (a model's
# every layer, every step) skips the checks that depend on its signature alone.
_CHECKED: dict = {}
_CHECKED_LIMIT = 1024
_SCALAR_TYPES = frozenset({int, float, bool, type(None)})


def checked_key(tensors: tuple, optional: tuple, scalars: tuple):
    """The key under which a call's checks are remembered: each tensor's type, shape, strides, dtype and device
    (`optional`: tensors or None), each scalar's type and value, and the module state the checks read; None (check
    every time) for anything the checks look at beyond that: under tracing, a tensor subclass, a scalar of another
    type (NumPy, a tensor), a window_size that is not a tuple of two ints."""
    if torch.compiler.is_compiling():
        return None
    for t in tensors:
        if type(t) is not torch.Tensor:
            return None
    for t in optional:
        if t is not None and type(t) is not torch.Tensor:
            return None
    for s in scalars:
        kind = type(s)
        if kind is tuple:
            if len(s) != 2 or type(s[0]) is not int or type(s[1]) is not int:
                return None
        elif kind not in _SCALAR_TYPES:
            return None
    return (tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors),
            tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in optional),
            tuple((type(s), s) for s in scalars), INTERPRET)


def checked(key):
    """What the checks of a call with this `checked_key` returned, or None: not seen (or key None)."""
    return None if key is None else _CHECKED.get(key)


def remember_checked(key, value) -> None:
    """Remember that a call with this key passed its checks, which returned `value` (not None)."""
    if key is None:
        return
    if len(_CHECKED) >= _CHECKED_LIMIT:
        _CHECKED.clear()
    _CHECKED[key] = value
