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
"""

from __future__ import annotations

import contextlib
import importlib.util
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


def skip_reason(name: str, device: torch.device, B: int, H: int, T: int, D: int, mode: str, opts) -> str | None:
    """Why `name` cannot run this problem here (None when it can)."""
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
