"""The attention implementations `flashtriton bench` measures side by side, behind one small interface.

A provider takes the problem in flash-attn's (B, T, H, D) layout and returns a `Prepared`: a `forward()`
closure over its own leaf tensors (in its preferred layout, made once, outside the timed region) and the two
layout converters the runner needs to feed it `dout` and read back outputs and gradients.

    flashtriton     flashtriton.flash_attn_func, (B, T, H, D)
    sdpa_flash      torch SDPA, FLASH_ATTENTION backend, (B, H, T, D) contiguous
    sdpa_cudnn      torch SDPA, CUDNN_ATTENTION backend
    sdpa_efficient  torch SDPA, EFFICIENT_ATTENTION backend
    sdpa_math       torch SDPA, MATH backend (materialises T x T scores: skipped above a memory estimate)
    flex            torch FlexAttention under torch.compile(dynamic=False); a causal BlockMask
    flash_attn      the flash-attn package (only when importable)
    seed            the notebook's kernel, benchmarks/seed_kernel.py (forward only; not in the default set)

v may have a head dim of its own (Dv != D, `--head-dims 192/128`): every provider gets v as it is, never padded. One
that cannot run it is skipped with the reason (`skip_reason`): the torch SDPA backends that torch's own check refuses
for the problem (FLASH always: q, k and v must share one head dim; EFFICIENT and cuDNN take Dv != D within their
alignment and head-dim limits; MATH anything), flash-attn 2 and the seed kernel (one head dim). FlexAttention takes
it (it requires only q's and k's to match).
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

PROVIDERS = ("flashtriton", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math", "flex", "flash_attn", "seed")
DEFAULT_PROVIDERS = PROVIDERS[:-1]
ALIASES = {"ours": "flashtriton", "flash": "sdpa_flash", "cudnn": "sdpa_cudnn", "efficient": "sdpa_efficient",
           "math": "sdpa_math", "fa2": "flash_attn", "flex_attention": "flex"}
SDPA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION",
                 "sdpa_efficient": "EFFICIENT_ATTENTION", "sdpa_math": "MATH"}
GIB = 1 << 30


def parse_providers(text: str | None, allowed=PROVIDERS, default=DEFAULT_PROVIDERS) -> list[str]:
    if not text or text == "all":
        return list(default)
    names = []
    for part in text.split(","):
        name = ALIASES.get(part.strip(), part.strip())
        if not name:
            continue
        if name not in allowed:
            raise ValueError(f"unknown provider {part!r}; choose from {', '.join(allowed)}")
        if name not in names:
            names.append(name)
    return names


@dataclass
class Prepared:
    forward: Callable[[], torch.Tensor]  # -> output in the provider's layout
    leaves: list  # q, k, v in the provider's layout (requires_grad when gradients are wanted)
    to_bshd: Callable[[torch.Tensor], torch.Tensor]  # provider layout -> (B, T, H, D)
    from_bshd: Callable[[torch.Tensor], torch.Tensor]  # (B, T, H, D) -> provider layout (a view)
    # Entered once around the provider's check and timing (torch SDPA's backend choice), so that its cost is
    # not timed with every call: a user picks the backend once, not per call.
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def _bshd(t):
    return t


def _bhsd(t):  # (B, T, H, D) <-> (B, H, T, D): the same transpose both ways
    return t.transpose(1, 2)


def _leaves_bshd(q, k, v, grad: bool) -> list:
    return [t.detach().requires_grad_(grad) for t in (q, k, v)]  # new leaves sharing q, k, v's memory


def _leaves_bhsd(q, k, v, grad: bool) -> list:
    return [t.detach().transpose(1, 2).contiguous().requires_grad_(grad) for t in (q, k, v)]


def sdpa_math_bytes(B: int, H: int, Tq: int, Tk: int, with_grad: bool) -> int:
    """Rough peak of the MATH backend: fp32-sized scores and probabilities, ×3 more with autograd."""
    return 4 * B * H * Tq * Tk * (3 if with_grad else 1)


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def skip_reason(name: str, device: torch.device, B: int, H: int, T: int, D: int, mode: str, opts, Dv: int | None = None,
                dtype: torch.dtype | None = None, causal: bool = False) -> str | None:
    """Why `name` cannot run this problem here (None when it can). `Dv`: v's head dim (None: D); where it differs
    from D, a provider that refuses it says so here (`head_dim_v_refusal`), so that its rows are skipped, not
    errors."""
    reason = _skip_reason(name, device, B, H, T, D, mode, opts)
    if reason is None and Dv is not None and Dv != D:
        reason = head_dim_v_refusal(name, device, T, D, Dv, mode, dtype or torch.float16, causal)
    return reason


def _skip_reason(name: str, device: torch.device, B: int, H: int, T: int, D: int, mode: str, opts) -> str | None:
    cuda = device.type == "cuda"
    if name.startswith("sdpa_") and name != "sdpa_math" and not cuda:
        return "CUDA only"
    if name == "sdpa_math":
        need = sdpa_math_bytes(B, H, T, T, mode != "fwd")
        limit = getattr(opts, "math_max_gib", 8.0) * GIB
        if need > limit:
            return f"T x T scores need ~{need / GIB:.0f} GiB > --math-max-gib {limit / GIB:g}"
    if name == "flex":
        if not cuda:
            return "CUDA only (compiled FlexAttention)"
        allowed = getattr(opts, "flex_seqlens", None)
        if allowed and T not in allowed:
            return "T not in --flex-seqlens (one torch.compile per shape)"
    if name == "flash_attn":
        if not cuda:
            return "CUDA only"
        if not flash_attn_available():
            return "flash-attn not installed"
    if name == "seed":
        if not cuda:
            return "CUDA only"
        if mode != "fwd":
            return "forward only"
        if T % 64 or D not in (16, 32, 64, 128):
            return "needs T % 64 == 0 and D in 16/32/64/128"
    return None


# torch's own check of each fused SDPA backend (torch.backends.cuda), and the header torch's dispatcher puts before
# that backend's reasons when no kernel can run a call
_SDPA_CHECKS = {"sdpa_flash": ("can_use_flash_attention", "Flash attention kernel not used because"),
                "sdpa_efficient": ("can_use_efficient_attention", "Memory efficient kernel not used because"),
                "sdpa_cudnn": ("can_use_cudnn_attention", "cuDNN attention kernel not used because")}


def head_dim_v_refusal(name: str, device: torch.device, T: int, D: int, Dv: int, mode: str, dtype: torch.dtype,
                       causal: bool) -> str | None:
    """Why provider `name` cannot run q and k of head dim D with v of head dim Dv (None when it can). The torch SDPA
    backends answer for themselves (`sdpa_refusal`); flash-attn 2 and the seed kernel have one head dim for all three;
    MATH, FlexAttention and flashtriton take any Dv."""
    if name == "flash_attn":
        return f"flash-attn 2 needs v's head dim equal to q's (its mha_fwd checks v's shape), got {D}/{Dv}"
    if name == "seed":
        return f"the seed kernel has one head dim for q, k and v, got {D}/{Dv}"
    if name in _SDPA_CHECKS and device.type == "cuda":
        return sdpa_refusal(name, device, T, D, Dv, mode != "fwd", dtype, causal)
    return None


def sdpa_refusal(name: str, device: torch.device, T: int, D: int, Dv: int, grad: bool, dtype: torch.dtype,
                 causal: bool) -> str | None:
    """Whether torch SDPA's backend `name` takes (1, 1, T, D) q and k with (1, 1, T, Dv) v (requiring grad when
    `grad`: some backends refuse the backward's head dims only), asked of torch itself
    (`torch.backends.cuda.can_use_*_attention`). Refused: the reason in torch's words, from the warnings a call
    under that backend alone raises (no kernel runs). None when it takes them, or when this torch cannot be asked
    (then the call itself tells, as an error row)."""
    check_name, header = _SDPA_CHECKS[name]
    check = getattr(torch.backends.cuda, check_name, None)
    params_type = getattr(torch.backends.cuda, "SDPAParams", None)
    if check is None or params_type is None:
        return None
    q, k = (torch.zeros(1, 1, T, D, device=device, dtype=dtype, requires_grad=grad) for _ in range(2))
    v = torch.zeros(1, 1, T, Dv, device=device, dtype=dtype, requires_grad=grad)
    try:
        try:
            params = params_type(q, k, v, None, 0.0, causal, False)
        except TypeError:  # a torch before enable_gqa
            params = params_type(q, k, v, None, 0.0, causal)
        if check(params, False):
            return None
    except Exception:  # noqa: BLE001  (this torch's check cannot be asked: the call itself tells)
        return None
    said = []
    from torch.nn.attention import sdpa_kernel

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel([_sdpa_backend(name)]):
                F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        except Exception:  # noqa: BLE001  ("No available kernel": the reasons are in the warnings)
            pass
        said = torch_reasons([str(w.message) for w in caught], header)
    what = f"q, k head dim {D}, v {Dv}, {str(dtype).replace('torch.', '')}" + (", backward" if grad else "")
    return (f"torch SDPA's {SDPA_BACKENDS[name]} backend refuses this problem ({what})"
            + (": " + "; ".join(said) if said else f" (torch.backends.cuda.{check_name})"))


_TRIGGERED = re.compile(r"\s*\(Triggered internally at [^)]*\)\.?\s*$")


def torch_reasons(messages: list[str], header: str) -> list[str]:
    """The reasons torch's SDPA dispatcher gave for one backend: the warnings after `header` ("Flash attention kernel
    not used because:") up to the next backend's header, without torch's "(Triggered internally at ...)" suffix."""
    out, inside = [], False
    for text in messages:
        text = _TRIGGERED.sub("", text).strip()
        if text.endswith("not used because:"):
            inside = text.startswith(header)
        elif inside and text and not text.startswith("No available kernel"):
            out.append(text)
    return out


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return getattr(SDPBackend, SDPA_BACKENDS[name])


def prepare(name: str, q, k, v, causal: bool, grad: bool) -> Prepared:
    """Set provider `name` up on (B, T, H, D) inputs; `grad`: its leaves require grad."""
    if name == "flashtriton":
        import flashtriton

        ql, kl, vl = leaves = _leaves_bshd(q, k, v, grad)
        return Prepared(lambda: flashtriton.flash_attn_func(ql, kl, vl, causal=causal), leaves, _bshd, _bshd)
    if name in SDPA_BACKENDS:
        from torch.nn.attention import sdpa_kernel

        backend = _sdpa_backend(name)
        ql, kl, vl = leaves = _leaves_bhsd(q, k, v, grad)
        gqa = ql.shape[1] != kl.shape[1]

        def sdpa():
            return F.scaled_dot_product_attention(ql, kl, vl, is_causal=causal, enable_gqa=gqa)

        return Prepared(sdpa, leaves, _bhsd, _bhsd, context=lambda: sdpa_kernel([backend]))
    if name == "flex":
        ql, kl, vl = leaves = _leaves_bhsd(q, k, v, grad)
        flex, block_mask = flex_callable(ql.shape[2], kl.shape[2], causal, ql.device)
        gqa = ql.shape[1] != kl.shape[1]
        return Prepared(lambda: flex(ql, kl, vl, block_mask=block_mask, enable_gqa=gqa), leaves, _bhsd, _bhsd)
    if name == "flash_attn":
        from flash_attn import flash_attn_func as fa_func

        ql, kl, vl = leaves = _leaves_bshd(q, k, v, grad)
        return Prepared(lambda: fa_func(ql, kl, vl, causal=causal), leaves, _bshd, _bshd)
    if name == "seed":
        seed_attention = load_seed_kernel()
        ql, kl, vl = leaves = _leaves_bhsd(q, k, v, False)
        return Prepared(lambda: seed_attention(ql, kl, vl, causal), leaves, _bhsd, _bhsd)
    raise ValueError(f"unknown provider {name!r}")


# ----------------------------------------------------------------------------------------------------------
# FlexAttention: one compiled function for the whole run, a static graph per shape
# ----------------------------------------------------------------------------------------------------------
_FLEX = None


def _causal_mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def flex_callable(seqlen_q: int, seqlen_k: int, causal: bool, device, mask_mod=None):
    """(compiled flex_attention, BlockMask or None): the causal mask, or `mask_mod` when given (a variant's,
    `Variant.mask_mod`). Raises the compile limit (every shape recompiles) and turns donated buffers off: backward
    timing calls backward(retain_graph=True), which they forbid."""
    global _FLEX
    if _FLEX is None:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit"):
            try:
                setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 1024))
            except (AttributeError, TypeError):  # knob absent (or renamed) in this torch
                pass
        try:
            import torch._functorch.config as functorch_config

            if hasattr(functorch_config, "donated_buffer"):
                functorch_config.donated_buffer = False
        except ImportError:
            pass
        _FLEX = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if causal or mask_mod is not None:
        from torch.nn.attention.flex_attention import create_block_mask

        block_mask = create_block_mask(mask_mod or _causal_mask_mod, None, None, seqlen_q, seqlen_k, device=device)
    return _FLEX, block_mask


def flashtriton_kernels(op: str) -> frozenset:
    """The function names of flashtriton's kernels for `op` (fwd, bwd, decode), from the dispatch table: what the
    launched-kernel check (`bench_measure.launched_kernels`) looks for."""
    from ..kernels.dispatch import KERNELS

    return frozenset(part.strip().rsplit(".", 1)[-1] for k in KERNELS if k.op == op for part in k.where.split("/"))


def load_seed_kernel():
    """seed_attention from benchmarks/seed_kernel.py next to the package's checkout."""
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "seed_kernel.py"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found (the seed provider runs from a checkout)")
    spec = importlib.util.spec_from_file_location("flashtriton_bench_seed_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.seed_attention
