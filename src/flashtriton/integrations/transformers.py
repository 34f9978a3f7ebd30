"""flashtriton as a Hugging Face transformers attention implementation.

    import flashtriton.integrations.transformers as ft_hf
    ft_hf.register()                                   # once per process; idempotent
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="flashtriton")
    model.set_attn_implementation("flashtriton")       # or switch an existing model

`register()` adds the attention function `flashtriton_attention_forward` to transformers' `AttentionInterface`
and, to `AttentionMaskInterface`, a mask function that hands the attention the 2-D padding mask (or None
when nothing is padded), as transformers does for flash-attention. Then:

- no padding: `flash_attn_func` on the (B, S, H, D) views, causal bottom-right aligned, so prefill and
  decoding with a KV cache (queries are the last tokens of the keys) are both exact;
- padding (left or right): the tokens are unpadded and `flash_attn_varlen_func` runs on the real tokens of
  each sequence; padded query positions return 0;
- packed sequences (batch 1 whose `position_ids` restart, or explicit `cu_seq_lens_q/k` kwargs, as
  `DataCollatorWithFlattening` makes): varlen over the packed sequences;
- GQA/MQA natively (no repeat of the kv heads); fp16, bf16 and fp32 (exact fp32 dots).

Not supported, with a NotImplementedError rather than a wrong answer: a sliding window that is shorter than
the keys (Mistral with `sliding_window` set; while the keys fit in the window it changes nothing and
attention runs), logit softcapping (Gemma 2), dropout > 0 (training with `attention_dropout`), attention
sinks (`s_aux`), position biases, and 4-D custom attention masks.

transformers treats every implementation whose name contains "flash" as a flash-attention flavour and
preloads its functions when a model is created; `register()` teaches that loader the name "flashtriton"
(flashtriton's `flash_attn_func` / `flash_attn_varlen_func`), otherwise `from_pretrained(...,
attn_implementation="flashtriton")` would look for a hub kernel of that name.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import torch

from ..interface import flash_attn_func, flash_attn_varlen_func

NAME = "flashtriton"
SUPPORTED_TRANSFORMERS = ">=5.0,<6"

_registered = False


def flashtriton_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature.

    query (B, Hq, Sq, D); key, value (B, Hkv, Sk, D) (with a cache: all the keys so far);
    attention_mask: None or a (B, Sk') bool/int padding mask, 1 = real token (made by `flashtriton_mask`).
    Returns (attn_output (B, Sq, Hq, D), None): attention weights are never formed.
    """
    _check_supported(module, query, key, dropout, sliding_window, softcap, attention_mask, kwargs)
    if kwargs.get("output_attentions", False):
        _warn_once("flashtriton does not return attention weights (output_attentions=True gives None).")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    causal = bool(is_causal)
    batch, _, seqlen_q, head_dim = query.shape
    if scaling is None:
        scaling = 1.0 / math.sqrt(head_dim)
    if key.dtype != query.dtype or value.dtype != query.dtype:
        key, value = key.to(query.dtype), value.to(query.dtype)

    q = query.transpose(1, 2)  # (B, Sq, Hq, D) views: no copy
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)

    if attention_mask is not None:
        if k.shape[1] > attention_mask.shape[-1]:  # a static cache larger than what was written so far
            k, v = k[:, : attention_mask.shape[-1]], v[:, : attention_mask.shape[-1]]
        _check_window(sliding_window, k.shape[1])
        return _padded_attention(q, k, v, attention_mask.bool(), scaling, causal), None

    _check_window(sliding_window, k.shape[1])
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:  # padding-free batch with its boundaries given
        return _packed_attention(q, k, v, cu_q, cu_k, kwargs.get("max_length_q"), kwargs.get("max_length_k"),
                                 scaling, causal), None
    position_ids = kwargs.get("position_ids")
    if batch == 1 and seqlen_q == k.shape[1] and _is_packed(position_ids):
        cu = _cu_seqlens_from_position_ids(position_ids)
        return _packed_attention(q, k, v, cu, cu, None, None, scaling, causal), None

    out = flash_attn_func(q, k, v, softmax_scale=scaling, causal=causal)  # bottom-right: right for a KV cache
    return out, None


def flashtriton_mask(
    batch_size: Optional[int] = None,
    q_length: Optional[int] = None,
    kv_length: Optional[int] = None,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Optional[Callable] = None,
    attention_mask: Optional[torch.Tensor] = None,
    **kwargs,
) -> Optional[torch.Tensor]:
    """transformers' mask-function signature: the 2-D padding mask sliced to the keys, or None when no key
    is padded (then causal attention needs no mask). The same contract as transformers' flash-attention mask.
    transformers passes everything by keyword (and, before 5.x's q_length/q_offset, a cache_position)."""
    if attention_mask is None:
        return None
    if kv_length is None:
        kv_length = attention_mask.shape[-1]
    attention_mask = attention_mask[:, -kv_length:]
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


def register() -> None:
    """Register "flashtriton" with transformers' AttentionInterface and AttentionMaskInterface. Idempotent."""
    global _registered
    if _registered:
        return
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"flashtriton.integrations.transformers needs transformers{SUPPORTED_TRANSFORMERS}: "
            "pip install 'flashtriton[hf]'"
        ) from err
    AttentionInterface.register(NAME, flashtriton_attention_forward)
    AttentionMaskInterface.register(NAME, flashtriton_mask)
    _teach_flash_loader()
    _registered = True


def is_registered() -> bool:
    return _registered


# ----------------------------------------------------------------------------------------------- internals


def _teach_flash_loader() -> None:
    """Let transformers' flash-attention preloader resolve the name "flashtriton".

    transformers calls `lazy_import_flash_attention(name)` for any name containing "flash" when a model is
    created or switched; for an unknown name it looks for a hub kernel and fails. Its `_lazy_imports` is
    wrapped so that "flashtriton" resolves to flashtriton's own functions; every other name is untouched.
    """
    try:
        from transformers import modeling_flash_attention_utils as mfa
    except ImportError:  # pragma: no cover
        return
    original = getattr(mfa, "_lazy_imports", None)
    if original is None or getattr(original, "_flashtriton", False):
        return

    with_kvcache = hasattr(mfa, "_flash_with_kvcache_fn")  # later 5.x also preload flash_attn_with_kvcache

    @functools.wraps(original)
    def _lazy_imports(implementation, *args, **kwargs):
        if implementation != NAME:
            return original(implementation, *args, **kwargs)
        pad = getattr(mfa, "_pad_input", _pad)
        unpad = getattr(mfa, "_unpad_input", None)
        if not with_kvcache:
            return flash_attn_func, flash_attn_varlen_func, pad, unpad
        try:
            from ..kvcache import flash_attn_with_kvcache
        except ImportError:
            flash_attn_with_kvcache = None
        return flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, pad, unpad

    _lazy_imports._flashtriton = True
    mfa._lazy_imports = _lazy_imports


def _check_supported(module, query, key, dropout, sliding_window, softcap, attention_mask, kwargs) -> None:
    where = f" ({type(module).__name__})" if module is not None else ""
    if dropout and float(dropout) > 0.0:
        raise NotImplementedError(
            f"flashtriton attention{where} does not support attention dropout (dropout={dropout}); "
            "set config.attention_dropout=0.0, or use attn_implementation='sdpa' for training with dropout."
        )
    if softcap is not None and float(softcap) != 0.0:
        raise NotImplementedError(
            f"flashtriton attention{where} does not support logit softcapping (softcap={softcap}); "
            "use attn_implementation='sdpa' or 'eager' for this model."
        )
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"flashtriton attention{where} does not support attention sinks (s_aux).")
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError(f"flashtriton attention{where} does not support position biases.")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
        shape = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
        raise NotImplementedError(
            f"flashtriton attention{where} takes only a 2-D padding mask (batch, keys), got {shape}: a custom "
            "4-D mask cannot be honoured; use attn_implementation='sdpa' for it."
        )
    if query.dim() != 4 or key.dim() != 4:
        raise ValueError(f"expected query/key of shape (batch, heads, seqlen, head_dim), got "
                         f"{tuple(query.shape)} and {tuple(key.shape)}")


def _check_window(sliding_window: Optional[int], seqlen_k: int) -> None:
    """A window at least as long as the keys changes nothing; a shorter one is not supported."""
    if sliding_window is not None and seqlen_k > sliding_window:
        raise NotImplementedError(
            f"flashtriton does not support sliding-window attention yet: this layer has sliding_window="
            f"{sliding_window} and {seqlen_k} keys. Use attn_implementation='sdpa' for this model (or keep "
            "sequences within the window)."
        )


def _padded_attention(q, k, v, mask: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """Unpad, run varlen, pad back. q (B, Sq, Hq, D); k, v (B, Sk, Hkv, D); mask (B, Sk) bool, True = token.

    The queries are the last Sq positions of the keys (prefill: all of them; with a KV cache: the new
    tokens), so each sequence's query tokens are its last q_len real tokens and bottom-right causal
    alignment per sequence is exact. With one query per sequence (decoding) it is kept even where the mask
    marks it as padding (right-padded decoding), as transformers' flash-attention does.
    """
    batch, seqlen_q = q.shape[:2]
    k_idx, cu_k, max_k = _unpad_indices(mask)
    if seqlen_q == mask.shape[1]:
        q_idx, cu_q, max_q = k_idx, cu_k, max_k
    elif seqlen_q == 1:
        q_idx = torch.arange(batch, device=q.device)
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
        max_q = 1
    else:
        q_idx, cu_q, max_q = _unpad_indices(mask[:, -seqlen_q:])
    out = flash_attn_varlen_func(
        _gather(q, q_idx), _gather(k, k_idx), _gather(v, k_idx), cu_q, cu_k, max_q, max_k,
        softmax_scale=scale, causal=causal,
    )
    return _scatter(out, q_idx, batch, seqlen_q)


def _packed_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale: float, causal: bool) -> torch.Tensor:
    """Batch 1 of packed sequences: q (1, total, Hq, D) with boundaries cu_q / cu_k."""
    cu_q, cu_k = cu_q.to(device=q.device, dtype=torch.int32), cu_k.to(device=q.device, dtype=torch.int32)
    max_q = int((cu_q[1:] - cu_q[:-1]).max()) if max_q is None else int(max_q)
    max_k = int((cu_k[1:] - cu_k[:-1]).max()) if max_k is None else int(max_k)
    out = flash_attn_varlen_func(
        q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
        cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal,
    )
    return out.view(q.shape[0], -1, *out.shape[1:])


def _unpad_indices(mask: torch.Tensor):
    lengths = mask.sum(-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    return indices, cu, int(lengths.max()) if lengths.numel() else 0


def _gather(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, *x.shape[2:])[indices]  # (B, S, H, D) -> (tokens, H, D)


def _scatter(x: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    out = x.new_zeros((batch * seqlen, *x.shape[1:]))
    out[indices] = x
    return out.view(batch, seqlen, *x.shape[1:])


def _pad(hidden_states, indices, batch, seqlen):  # transformers' pad_input contract, if it lacks one
    return _scatter(hidden_states, indices, batch, seqlen)


def _is_packed(position_ids: Optional[torch.Tensor]) -> bool:
    """Batch-1 position ids that restart (several sequences packed back to back)."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[0] != 1:
        return False
    pos = position_ids[0]
    expected = torch.arange(pos.numel(), device=pos.device, dtype=pos.dtype) + pos.min()
    return not torch.equal(pos, expected)


def _cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == pos.min(), as_tuple=False).flatten().to(torch.int32)
    total = torch.tensor([pos.numel()], dtype=torch.int32, device=pos.device)
    return torch.cat([starts, total])


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    import warnings

    warnings.warn(message, stacklevel=3)
