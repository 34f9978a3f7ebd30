"""flashtriton as a Hugging Face transformers attention implementation.

    import flashtriton.integrations.transformers as ft_hf
    ft_hf.register()                                   # once per process; idempotent
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="flashtriton")
    model.set_attn_implementation("flashtriton")       # or switch an existing model

`register()` adds the attention function `flashtriton_attention_forward` to transformers' `AttentionInterface`
and the mask function `flashtriton_mask` to its `AttentionMaskInterface`. transformers hands the mask function
each layer type's pattern as a function of (query, key) positions; `hf_masks.analyse` decides whether it is
causal or full attention (with padding and packed sequences), narrowed or not to a sliding window, and refuses
everything else. Then:

- no padding: `flash_attn_func` on the (B, S, H, D) views, causal bottom-right aligned, so prefill and
  decoding with a KV cache (queries are the last tokens of the keys) are both exact;
- padding (left or right): `flash_attn_varlen_func` on each row's real keys. Causal attention keeps each
  row's real queries (padded query positions return 0); non-causal attention (encoders, cross-attention to a
  padded encoder) keeps every query, or with a window (ModernBERT's local attention) the real ones;
- packed sequences (position ids that restart, in any row, as transformers' masks detect them; in one row
  whose mask says nothing of them, or without a mask, as its flash-attention path reads them; or explicit
  `cu_seq_lens_q/k` kwargs, as `DataCollatorWithFlattening` makes): varlen over the packed sequences;
- sliding windows as flash-attn's `window_size`, around each query's own position (per sequence in varlen):
  the window the mask function describes (`hf_masks`: transformers' `sliding_window_overlay(w)`, key k
  visible to query q iff q - w < k <= q, is (w - 1, 0); `sliding_window_bidirectional_overlay(w)`, |q - k| <=
  w, is (w, w)), or without a mask verdict the layer's `sliding_window` kwarg as transformers' own
  flash-attention path passes it: (w - 1, w - 1), causal making the right side 0. A window that hides no key
  of the call is not passed (the plain kernels run);
- `softcap` (Gemma 2's attn_logit_softcapping): flash-attn's softcap, softcap · tanh(scaled scores / softcap)
  before the mask, as eager does;
- attention sinks (`s_aux`: gpt-oss' `sinks`, one logit per query head that eager appends to the scores before
  the softmax and drops after) as flash-attn / FlashAttention-4's `learnable_sink`, with or without a window, in
  every path above; their gradient flows back to the model's parameter;
- attention dropout in training (`dropout`, the module's attention dropout, which transformers passes in train
  mode only) as flash-attn's `dropout_p`, in every path above;
- GQA/MQA natively (no repeat of the kv heads); fp16, bf16 and fp32 (exact fp32 dots).

Refused with a NotImplementedError (or, for a model class, a ValueError when it is built) rather than a wrong
answer, each message saying what to load instead: masks that are neither causal nor full over the keys nor a
window of them (chunked attention, prefix-LM or image-token bidirectional overlays), a window over padded rows
whose real tokens are not contiguous, sinks that are not one logit per query head,
position biases (T5-style `position_bias`; no model of transformers 5.x passes ALiBi slopes through the
attention interface: BLOOM and MPT add theirs in their own attention code, Falcon with `alibi=True` adds its
bias to the 4-D mask, refused when the model is built; `hf_alibi.patch_alibi_attention` runs those three on
flashtriton's ALiBi kernels instead), head dims past 256 (as flash-attn), 4-D custom attention masks, models
transformers marks `_supports_flash_attn = False`, and models that switch to their own flash-attn classes (GPT-Neo,
Bark, and Falcon before transformers 5.25).

transformers treats every implementation whose name contains "flash" as a flash-attention flavour: it preloads
its functions when a model is created (`register()` teaches that loader the name "flashtriton", which would
otherwise be looked up as a hub kernel) and swaps it for the hub kernels some models list in
`_compatible_flash_implementations` (`register()` keeps "flashtriton" there: see `_guard_model_checks`).
"""

from __future__ import annotations

import functools
import inspect
import math
import re
import sys
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..interface import flash_attn_func, flash_attn_varlen_func, key_padded_attention, unpad
from ..validation import MAX_HEAD_DIM
from . import hf_masks

NAME = "flashtriton"
SUPPORTED_TRANSFORMERS = ">=5.0,<6"

_registered = False
_KIND = "_flashtriton_kind"  # attribute of a returned key mask: the analysed kind (hf_masks.CAUSAL / FULL)
_DENSE = "_flashtriton_dense"  # attribute of a returned key mask: no key is padded
_REFUSAL = "_flashtriton_refusal"  # attribute of a returned int8 marker: why the kernels cannot run that mask
_WINDOW = "_flashtriton_window"  # attribute of a returned mask: the window it describes (hf_masks.MaskSpec.window)
_UNPADDED = "_flashtriton_unpadded"  # attribute of a padding mask: (its version, `_unpad_indices`'s result)


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
    s_aux: Optional[torch.Tensor] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature.

    query (B, Hq, Sq, D); key, value (B, Hkv, Sk, D) (with a cache: all the keys so far);
    attention_mask: what `flashtriton_mask` made — None, a (B, Sk') bool key mask (True = real token),
    (B, 1, 1, S) int32 sequence ids of packed rows (negative: -1 - id), or a (B, 1, 1, Sk) int8 refusal.
    sliding_window: the layer's window (transformers' convention: w keys up to and including the query's own, so
    flash-attn's (w - 1, w - 1)); used when the mask carries no verdict of its own. softcap: flash-attn's.
    s_aux: attention sinks, (Hq,), flash-attn's learnable_sink (`_sink`).
    Returns (attn_output (B, Sq, Hq, D), None): attention weights are never formed.
    """
    marker = attention_mask if _is_marker(attention_mask) else None
    if marker is not None and marker.dtype == torch.int8:  # flashtriton_mask's refusal
        raise _refusal_for(module, getattr(marker, _REFUSAL, None))
    _check_supported(module, query, key, value, None if marker is not None else attention_mask, kwargs)
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
    sink = _sink(module, s_aux, query)

    q = query.transpose(1, 2)  # (B, Sq, Hq, D) views: no copy
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)

    # transformers passes the module's attention dropout in training and 0.0 in eval mode
    variant = dict(softcap=float(softcap) if softcap else 0.0, sink=sink, dropout_p=float(dropout or 0.0))
    if attention_mask is not None:
        kind = getattr(attention_mask, _KIND, None)  # the mask function's verdict beats the layer's default
        if kind is not None:
            causal = kind == hf_masks.CAUSAL
        if hasattr(attention_mask, _WINDOW):  # so does its window (the one eager and sdpa apply)
            window = getattr(attention_mask, _WINDOW)
        elif kind is not None:  # a plain causal / full verdict: no window, whatever the layer's sliding_window
            window = None  # (eager and sdpa apply the mask alone: OLMoE passes config.sliding_window over it)
        else:
            window = _layer_window(sliding_window, causal)
        if marker is not None:  # packed rows: per-token sequence ids
            window = _hiding(window, causal, k.shape[1], k.shape[1])
            return _segments_attention(q, k, v, -1 - marker[:, 0, 0], scaling, causal, window, **variant), None
        if k.shape[1] > attention_mask.shape[-1]:  # a static cache larger than what was written so far
            k, v = k[:, : attention_mask.shape[-1]], v[:, : attention_mask.shape[-1]]
        window = _hiding(window, causal, seqlen_q, k.shape[1])
        if not getattr(attention_mask, _DENSE, False):
            return _padded_attention(q, k, v, attention_mask.bool(), scaling, causal, window, module=module,
                                     **variant), None
    else:
        window = _hiding(_layer_window(sliding_window, causal), causal, seqlen_q, k.shape[1])
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:  # padding-free batch with its boundaries given
        return _packed_attention(q, k, v, cu_q, cu_k, kwargs.get("max_length_q"), kwargs.get("max_length_k"),
                                 scaling, causal, window, **variant), None
    # Position ids that restart mark packed sequences where no mask says otherwise, or, as transformers' flash
    # attention reads them, in a single row; a mask the model built for several rows (whose packing it would
    # carry: the segments above) is what eager and sdpa apply, and flash attention too.
    segments = (_segments_from_positions(kwargs.get("position_ids"), batch, seqlen_q, k.shape[1])
                if attention_mask is None or batch == 1 else None)
    if segments is not None:
        return _segments_attention(q, k, v, segments, scaling, causal, window, **variant), None

    out = flash_attn_func(q, k, v, softmax_scale=scaling, causal=causal,  # bottom-right: right for a KV cache
                          window_size=window or (-1, -1), softcap=variant["softcap"], learnable_sink=sink,
                          dropout_p=variant["dropout_p"])
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
    """transformers' mask-interface signature: what `flashtriton_attention_forward` needs to run this mask
    exactly, or a refusal marker when the kernels cannot express it (`hf_masks.analyse`).

    Returns the 2-D key mask sliced to the keys (as transformers' flash-attention mask does; all True where no key
    is padded), None for a single query that sees every key (causal or not alike) in a model whose config sets no
    sliding window (a layer's sliding_window then has nothing to overrule), or for packed rows their
    sequence ids as (B, 1, 1, S) int32 `-1 - id`. A causal call whose last keys lie after the last query (a static cache's unwritten slots) gets a
    key mask that ends at the last query. A returned mask carries the verdict, causal or full
    (`_flashtriton_kind`, which beats the layer's own is_causal: that flag only decides when no mask exists), the
    window it describes where the mask function is more than plain causal or full, or narrows attention to a window
    (`_flashtriton_window`: flash-attn's (left, right), or None when it hides no key of the call; absent on a plain
    mask, whose verdict has no window: a layer's sliding_window applies only where no mask exists, as eager and
    sdpa apply the mask alone), and a mask with no padded key says so (`_flashtriton_dense`).
    transformers passes everything by keyword (before q_length / q_offset existed, a cache_position).

    transformers builds every layer type's mask, used or not (Qwen2-MoE builds a sliding-window mask of width
    0 that no layer reads): a mask the kernels cannot run comes back as a (B, 1, 1, Sk) int8 tensor carrying its
    refusal (`_flashtriton_refusal`), and the attention function raises it when a layer receives it.

    A mask this function returned comes back unchanged when it is passed in again (generate prepares a static
    cache's mask, windowed where the cache has sliding layers, and the model's forward hands it to its own mask
    function), as transformers passes a prepared 4-D mask through.
    """
    if isinstance(attention_mask, torch.Tensor) and hasattr(attention_mask, _KIND):
        return attention_mask  # generate's verdict (a static cache's window) is not overruled by the model's
    try:
        return _mask_for_kernels(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                                 attention_mask, **kwargs)
    except NotImplementedError as refusal:
        batch = batch_size or (attention_mask.shape[0] if attention_mask is not None else 1)
        keys = kv_length or (attention_mask.shape[-1] if attention_mask is not None else 0)
        marker = torch.zeros(batch, 1, 1, keys, dtype=torch.int8, device=kwargs.get("device"))
        setattr(marker, _REFUSAL, refusal)
        return marker


def _is_marker(mask) -> bool:
    """A 4-D int8 / int32 tensor: `flashtriton_mask`'s refusal or packed sequence ids. 4-D, so that model code
    that rebuilds masks from a 2-D padding mask passes it through as a prepared mask."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.dtype in (torch.int8, torch.int32)


def _mask_for_kernels(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                      **kwargs) -> Optional[torch.Tensor]:
    """`flashtriton_mask`'s work; NotImplementedError for a mask the kernels cannot run."""
    if q_length is None and kwargs.get("cache_position") is not None:
        position = kwargs["cache_position"]
        q_length, q_offset = int(position.shape[0]), int(position[0]) if position.numel() else 0
    if kv_length is None:
        kv_length = attention_mask.shape[-1] if attention_mask is not None else q_length
    if q_length is None:
        q_length = kv_length
    if batch_size is None:
        batch_size = attention_mask.shape[0] if attention_mask is not None else 1
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    config = kwargs.get("config")
    spec = hf_masks.analyse(mask_function, batch_size, q_length, kv_length, q_offset, kv_offset,
                            use_vmap=bool(kwargs.get("use_vmap", False)), device=kwargs.get("device"),
                            model_type=getattr(config, "model_type", "") or "")
    if spec.segments is not None:
        if q_length != kv_length or q_offset != kv_offset or spec.segments.shape[-1] != q_length:
            raise NotImplementedError(f"flashtriton supports packed sequences only without a cache (queries = keys); "
                                      f"got {q_length} queries at {q_offset} and {kv_length} keys at {kv_offset}")
        if attention_mask is not None and not bool(attention_mask[:, -kv_length:].all()):
            raise NotImplementedError("flashtriton does not support padding inside packed sequences")
        ids = (-1 - spec.segments.expand(batch_size, -1)).to(torch.int32)[:, None, None, :]
        setattr(ids, _KIND, spec.kind)
        setattr(ids, _WINDOW, spec.window)
        return ids
    keys = attention_mask[:, -kv_length:] if attention_mask is not None else None
    if spec.kind == hf_masks.CAUSAL:
        visible = q_offset + q_length - kv_offset  # keys up to the last query's own position
        if visible > kv_length or visible < q_length:
            raise NotImplementedError(
                f"flashtriton runs causal attention with the queries as the last keys; this call has {q_length} "
                f"queries from position {q_offset} and {kv_length} keys from position {kv_offset}")
        if visible < kv_length and (keys is None or keys.shape[-1] > visible):
            keys = (keys if keys is not None else torch.ones(batch_size, kv_length, dtype=torch.bool,
                                                             device=kwargs.get("device")))[:, :visible]
    elif spec.window is not None and q_offset + q_length != kv_offset + kv_length:
        raise NotImplementedError(
            f"flashtriton runs a window around each query with the queries as the last keys; this call has "
            f"{q_length} queries from position {q_offset} and {kv_length} keys from position {kv_offset}")
    dense = keys is None or bool(keys.all())
    plain = dense and not spec.derived and spec.window is None and (keys is None or keys.shape[-1] == kv_length)
    if plain and q_length == 1 and not getattr(config, "sliding_window", None):
        return None  # one query sees every key, causal or not, and no layer's window could narrow them
    if keys is None:
        keys = torch.ones(batch_size, kv_length, dtype=torch.bool, device=kwargs.get("device"))
    keys = keys.bool()[:, :]  # a tensor object of our own, to carry the verdict
    setattr(keys, _DENSE, dense)
    # Causal or full is what eager applies, whatever the layer's is_causal (PEGASUS-X's decoder layers keep the
    # default False over a causal mask: the flag alone would let each token see the ones after it).
    setattr(keys, _KIND, spec.kind)
    if not plain:  # the window the mask applies, whatever the layer's sliding_window (a plain mask: the layer's)
        setattr(keys, _WINDOW, spec.window)
    return keys


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
    _guard_model_checks()
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


def _guard_model_checks() -> None:
    """Make `attn_implementation="flashtriton"` always mean flashtriton, or fail when the model is built.

    transformers checks the requested implementation in `PreTrainedModel._check_and_adjust_attn_implementation`
    (at init and in `set_attn_implementation`). Because the name contains "flash", that check would let through
    models transformers marks unable to use a flash kernel (`_supports_flash_attn = False`: their masks need
    more than causal + padding), and would swap the name for the hub kernels a model lists in
    `_compatible_flash_implementations` (gpt-oss, granite_swa, flint...). The wrapped check refuses the first,
    skips the swap (flashtriton then runs, or its attention function refuses what it cannot do), and refuses
    models whose attention goes through their own flash-attn classes (GPT-Neo, Falcon, Bark).
    """
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        return
    original = PreTrainedModel._check_and_adjust_attn_implementation
    if getattr(original, "_flashtriton", False):
        return

    @functools.wraps(original)
    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        if attn_implementation != NAME:
            return original(self, attn_implementation, *args, **kwargs)
        refuse_unsupported_model(type(self), getattr(self, "config", None))
        if not getattr(self, "_compatible_flash_implementations", None):
            return original(self, attn_implementation, *args, **kwargs)
        self.__dict__["_compatible_flash_implementations"] = None  # shadows the class's list for this check
        try:
            return original(self, attn_implementation, *args, **kwargs)
        finally:
            self.__dict__.pop("_compatible_flash_implementations", None)

    _check_and_adjust_attn_implementation._flashtriton = True
    PreTrainedModel._check_and_adjust_attn_implementation = _check_and_adjust_attn_implementation


# Model configurations whose bias a flash-named implementation never receives: (model_type, config field, what
# the model does with it). Falcon with `alibi=True` adds its ALiBi bias to the 4-D mask of eager/SDPA, and its
# forward raises for any flash-named implementation (transformers >= 5.25) or runs a flash-attn class (earlier).
_CONFIG_REFUSALS = (
    ("falcon", "alibi", "adds its ALiBi bias to the attention mask, which flash-attention implementations do not "
                        "receive (it reaches no attention function as slopes)"),
)


def refuse_unsupported_model(cls: type, config=None) -> None:
    """ValueError if transformers model class `cls` (built from `config`, when given) cannot run its attention
    through flashtriton exactly."""
    advice = _advice_for(cls) + _alibi_advice(cls, config)
    model_type = getattr(config, "model_type", None)
    for refused_type, field, what in _CONFIG_REFUSALS:
        if model_type == refused_type and getattr(config, field, False):
            raise ValueError(
                f"{cls.__name__} with config.{field}={getattr(config, field)!r} cannot use "
                f"attn_implementation='flashtriton': it {what}. {advice}")
    if not (getattr(cls, "_supports_flash_attn", False) or getattr(cls, "_supports_flash_attn_2", False)):
        raise ValueError(
            f"{cls.__name__} cannot use attn_implementation='flashtriton': transformers marks it as unable to use "
            f"flash-attention kernels (_supports_flash_attn = False; for example its mask is bidirectional over "
            f"image or prefix tokens, which a causal + padding kernel drops). {advice}")
    private = _private_flash_path(cls.__module__)
    if private:
        raise ValueError(
            f"{cls.__name__} cannot use attn_implementation='flashtriton': for any flash-attention name it switches "
            f"to its own flash-attention code ({private}), which calls the flash-attn package instead of "
            f"transformers' AttentionInterface, so flashtriton would not run. {advice}")


@functools.lru_cache(maxsize=None)
def _private_flash_path(module_name: str) -> str:
    """What in a modeling file bypasses the AttentionInterface for flash-named implementations: a
    `*FlashAttention2` class (GPT-Neo, Falcon, Bark), or an import of the flash-attn package itself
    (ModernBERT, GPT-J, Moshi in early transformers 5.x); '' when nothing does."""
    module = sys.modules.get(module_name)
    if module is None:
        return ""
    private = sorted(n for n in vars(module) if n.endswith("FlashAttention2"))
    if private:
        return f"the {private[0]} class"
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return ""
    found = re.search(r"^\s*(from flash_attn\b[\w.]*\s+import\s+\w+|import flash_attn\b)", source, re.MULTILINE)
    return f"'{found.group(1).strip()}'" if found else ""


def _refusal_for(module, refusal: Optional[NotImplementedError]) -> NotImplementedError:
    """The mask function's refusal, with advice for the model this layer belongs to."""
    where = f" ({type(module).__name__})" if module is not None else ""
    advice = _advice_for(_model_class(module))
    if isinstance(refusal, hf_masks.Unexpressible):
        return NotImplementedError(f"flashtriton cannot run this attention{where}: {refusal.what}. flashtriton "
                                   f"does not support {refusal.feature} yet. {advice}")
    if refusal is not None:
        return NotImplementedError(f"{refusal} {advice}")
    return NotImplementedError(f"flashtriton cannot run the mask this attention layer{where} received. {advice}")


def _advice_for(cls: Optional[type]) -> str:
    """Advice that transformers accepts for this model class: 'sdpa' where it supports it, else 'eager'."""
    if cls is not None and getattr(cls, "_supports_sdpa", False):
        return "Load the model with attn_implementation='sdpa' (or 'eager') instead."
    return "Load the model with attn_implementation='eager' instead."


def _alibi_advice(cls: Optional[type], config=None) -> str:
    """For the ALiBi models (BLOOM, MPT, Falcon with config.alibi): how to run their attention on flashtriton."""
    module = getattr(cls, "__module__", "") or ""
    alibi = module.endswith(("modeling_bloom", "modeling_mpt")) or (
        module.endswith("modeling_falcon") and getattr(config, "alibi", False))
    return (" Its ALiBi attention then runs on flashtriton after "
            "flashtriton.integrations.hf_alibi.patch_alibi_attention(model).") if alibi else ""


def _model_class(module) -> Optional[type]:
    """The PreTrainedModel base class of the modeling file that defines attention layer `module`."""
    mod = sys.modules.get(type(module).__module__) if module is not None else None
    if mod is None:
        return None
    for name, obj in vars(mod).items():
        if isinstance(obj, type) and name.endswith("PreTrainedModel") and hasattr(obj, "_supports_sdpa"):
            return obj
    return None


def _check_supported(module, query, key, value, attention_mask, kwargs) -> None:
    where = f" ({type(module).__name__})" if module is not None else ""

    def refusal(what: str) -> NotImplementedError:  # the advice (a walk over the model's module) only when raising
        return NotImplementedError(f"flashtriton attention{where} {what}. {_advice_for(_model_class(module))}")

    if kwargs.get("position_bias") is not None:
        raise refusal("does not support position biases yet")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
        shape = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
        raise refusal(f"takes only a 2-D padding mask (batch, keys), got {shape}: a custom 4-D mask cannot be "
                      "honoured")
    if query.dim() != 4 or key.dim() != 4:
        raise ValueError(f"expected query/key of shape (batch, heads, seqlen, head_dim), got "
                         f"{tuple(query.shape)} and {tuple(key.shape)}")
    if max(query.shape[-1], value.shape[-1]) > MAX_HEAD_DIM:
        raise refusal(f"runs head dims up to {MAX_HEAD_DIM} (as flash-attn), this model's query/key head dim is "
                      f"{query.shape[-1]} and its value head dim {value.shape[-1]}")


def _sink(module, s_aux, query: torch.Tensor) -> Optional[torch.Tensor]:
    """The attention sinks as flash-attn's `learnable_sink`: (Hq,), fp32 or the query's dtype, on its device.

    Every transformers model that passes `s_aux` (gpt-oss and the models built like it) adds one logit per query
    head, unscaled, to the softmax's denominator only (eager: concatenated to the masked scores, dropped after the
    softmax; or granite-swa's sigmoid(lse - sink) rescaling, the same thing): `learnable_sink`'s semantics. A
    sink of another dtype is cast to fp32 (differentiably: the model's parameter gets the gradient)."""
    if s_aux is None:
        return None
    heads = query.shape[1]
    if not isinstance(s_aux, torch.Tensor) or tuple(s_aux.shape) != (heads,):
        where = f" ({type(module).__name__})" if module is not None else ""
        shape = tuple(s_aux.shape) if isinstance(s_aux, torch.Tensor) else type(s_aux).__name__
        raise NotImplementedError(
            f"flashtriton attention{where} runs attention sinks as one logit per query head ({heads},); got "
            f"{shape}. {_advice_for(_model_class(module))}")
    sink = s_aux if s_aux.dtype in (torch.float32, query.dtype) else s_aux.float()
    return sink.to(query.device)


def _layer_window(sliding_window: Optional[int], causal: bool) -> Optional[tuple[int, int]]:
    """The window of a layer's `sliding_window` kwarg as transformers' flash-attention path passes it
    (`_process_flash_attention_kwargs`: window_size = (w - 1, w - 1), w keys up to and including the query's own
    when causal, which makes the right side 0), or None."""
    if sliding_window is None:
        return None
    w = int(sliding_window)
    if w < 1:
        raise NotImplementedError(f"flashtriton cannot run a sliding window of {w} keys (sliding_window={w})")
    return (w - 1, 0 if causal else w - 1)


def _hiding(window: Optional[tuple[int, int]], causal: bool, seqlen_q: int,
            seqlen_k: int) -> Optional[tuple[int, int]]:
    """`window` with each side that hides no key of a (seqlen_q, seqlen_k) call (bottom-right aligned; every
    sequence of a varlen call is at most that long) set to -1; None when neither side hides one, so that the
    plain kernels run."""
    if window is None:
        return None
    left, right = window
    if left >= seqlen_k - 1:  # the last query sees back to the first key
        left = -1
    if causal or right >= seqlen_q - 1:  # the first query sees up to the last key
        right = -1 if not causal else 0
    return None if left == -1 and (causal or right == -1) else (left, right)


def _check_contiguous(mask: torch.Tensor, module) -> None:
    """A window counts positions; after unpadding it counts real tokens. They agree when each row's real tokens
    are one run (left or right padding), not when padding sits between them."""
    runs = (mask & ~torch.nn.functional.pad(mask[:, :-1], (1, 0), value=False)).sum(-1)
    if bool((runs > 1).any()):
        where = f" ({type(module).__name__})" if module is not None else ""
        raise NotImplementedError(
            f"flashtriton attention{where} runs a sliding window over padded rows only when each row's real tokens "
            f"are contiguous (left or right padding); this mask has padding between them. "
            f"{_advice_for(_model_class(module))}")


def _padded_attention(q, k, v, mask: torch.Tensor, scale: float, causal: bool, window=None, softcap: float = 0.0,
                      sink=None, dropout_p: float = 0.0, module=None, alibi_slopes=None) -> torch.Tensor:
    """Unpad, run varlen, pad back. q (B, Sq, Hq, D); k, v (B, Sk, Hkv, D); mask (B, Sk) bool, True = token;
    `alibi_slopes` (H,) fp32 (`hf_alibi`: ALiBi per sequence, over its real tokens).

    The mask describes the keys. Without a causal mask (encoders, cross-attention) every query is kept and
    attends to its row's real keys: a decoder query never loses its keys because the encoder was padded.
    With a window around each query (self-attention: Sq = Sk) the queries are the real tokens, as the keys.
    With a causal mask, the queries are the last Sq positions of the keys (prefill: all of them; with a KV
    cache: the new tokens), so each sequence's query tokens are its last q_len real tokens and bottom-right
    causal alignment per sequence is exact; padded query positions return 0. With one query per sequence
    (decoding) it is kept even where the mask marks it as padding (right-padded decoding), as transformers'
    flash-attention does. A window needs each row's real tokens contiguous (`_check_contiguous`).
    """
    batch, seqlen_q = q.shape[:2]
    if window is not None:
        _check_contiguous(mask, module)
        if not causal and seqlen_q != mask.shape[1]:
            raise NotImplementedError(f"flashtriton runs a non-causal window over padded keys only for "
                                      f"self-attention (as many queries as keys); got {seqlen_q} queries and "
                                      f"{mask.shape[1]} keys")
    variant = dict(window_size=window or (-1, -1), softcap=softcap, learnable_sink=sink, dropout_p=dropout_p,
                   alibi_slopes=alibi_slopes)
    if not causal and window is None:
        return key_padded_attention(q, k, v, _unpad_indices(mask), scale, **variant)
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
        softmax_scale=scale, causal=causal, **variant,
    )
    return _scatter(out, q_idx, batch, seqlen_q)


def _segments_attention(q, k, v, segments: torch.Tensor, scale: float, causal: bool, window=None,
                        softcap: float = 0.0, sink=None, dropout_p: float = 0.0) -> torch.Tensor:
    """Packed rows: q (B, S, Hq, D), k, v (B, S, Hkv, D); segments (B, S) sequence ids, equal within one
    sequence. A sequence starts at every row's first token and wherever the id changes; each attends only
    to itself."""
    batch, seqlen = segments.shape
    segments = segments.to(q.device)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    cu = torch.cat([torch.nonzero(starts.reshape(-1)).flatten(),
                    torch.tensor([batch * seqlen], device=q.device)]).to(torch.int32)
    return _packed_attention(q, k, v, cu, cu, None, None, scale, causal, window, softcap, sink, dropout_p)


def _packed_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale: float, causal: bool, window=None,
                      softcap: float = 0.0, sink=None, dropout_p: float = 0.0) -> torch.Tensor:
    """Packed sequences: q (B, S, Hq, D), k, v (B, S, Hkv, D), taken as B·S tokens back to back with
    boundaries cu_q / cu_k (int32, over the flattened tokens); a window applies within each sequence."""
    cu_q, cu_k = cu_q.to(device=q.device, dtype=torch.int32), cu_k.to(device=q.device, dtype=torch.int32)
    max_q = int((cu_q[1:] - cu_q[:-1]).max()) if max_q is None else int(max_q)
    max_k = int((cu_k[1:] - cu_k[:-1]).max()) if max_k is None else int(max_k)
    out = flash_attn_varlen_func(
        q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
        cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal, window_size=window or (-1, -1),
        softcap=softcap, learnable_sink=sink, dropout_p=dropout_p,
    )
    return out.view(q.shape[0], -1, *out.shape[1:])


def _unpad_indices(mask: torch.Tensor):
    """`interface.unpad` of a (B, S) padding mask. It syncs the host with the device twice (`nonzero`, the
    maximum), and every layer of a forward pass gets the same mask tensor (or one of two, where sliding and full
    layers alternate): in eager calls the result is kept on the mask tensor with its version counter and reused
    while the tensor is unchanged, so that a model's forward syncs once per mask, not once per layer."""
    eager = (type(mask) is torch.Tensor and not torch.compiler.is_compiling()
             and _get_current_dispatch_mode() is None)
    kept = getattr(mask, _UNPADDED, None) if eager else None
    if kept is not None and kept[0] == mask._version:
        return kept[1]
    result = unpad(mask)
    if eager:
        setattr(mask, _UNPADDED, (mask._version, result))
    return result


def _gather(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, *x.shape[2:])[indices]  # (B, S, H, D) -> (tokens, H, D)


def _scatter(x: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    out = x.new_zeros((batch * seqlen, *x.shape[1:]))
    out[indices] = x
    return out.view(batch, seqlen, *x.shape[1:])


def _pad(hidden_states, indices, batch, seqlen):  # transformers' pad_input contract, if it lacks one
    return _scatter(hidden_states, indices, batch, seqlen)


def _segments_from_positions(position_ids, batch: int, seqlen_q: int, seqlen_k: int) -> Optional[torch.Tensor]:
    """(B, S) sequence ids of rows whose position ids restart (a new sequence wherever the position does not
    grow by one, in every row), or None: no restart, not a prefill (queries = keys), or not (B, S) positions.

    transformers detects packing in its mask only without a cache; a forward with `use_cache=True` creates an
    empty one, so the positions are read here as its flash-attention path does (one device-to-host sync per layer),
    for a single row or a call without a mask (`flashtriton_attention_forward`)."""
    if (position_ids is None or position_ids.dim() != 2 or seqlen_q != seqlen_k or seqlen_q < 2
            or position_ids.shape[-1] != seqlen_q or position_ids.shape[0] not in (1, batch)):
        return None
    starts = torch.diff(position_ids, dim=-1) != 1  # (B, S - 1): token t + 1 starts a sequence
    if not bool(starts.any()):
        return None
    segments = torch.nn.functional.pad(starts.to(torch.int32).cumsum(-1, dtype=torch.int32), (1, 0))
    return segments.expand(batch, -1)


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    import warnings

    warnings.warn(message, stacklevel=3)
