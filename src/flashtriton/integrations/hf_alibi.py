"""flashtriton's ALiBi kernels in the Hugging Face models whose position bias never reaches an attention interface.

    from flashtriton.integrations.hf_alibi import patch_alibi_attention
    model = AutoModelForCausalLM.from_pretrained("bigscience/bloom-560m")   # attn_implementation "eager" or "sdpa"
    patch_alibi_attention(model)                   # its attention layers run flashtriton with alibi_slopes

BLOOM and MPT compute their ALiBi bias inside their own attention code, and Falcon (`alibi=True`) adds it to the
4-D mask, so `attn_implementation="flashtriton"` never sees slopes (`transformers.refuse_unsupported_model` says so).
`patch_alibi_attention` replaces the forward of each such attention layer (`BloomAttention`, `MptAttention`,
`FalconAttention` of an ALiBi config) with one that projects Q, K, V as the layer does, updates the cache, and runs
flashtriton with the model's slopes, causal bottom-right per sequence:

- the bias: each model's bias is linear in the key position (BLOOM and Falcon: slope · the key's position among the
  row's real tokens; MPT: slope · (key index − keys + 1)), which within a causal row differs from flash-attn's
  −slope · (query − key) by a constant per row, which the softmax drops. Slopes are the model's own, read off its
  own bias builders: BLOOM's and MPT's in fp32, Falcon's rounded to bf16 as its `build_alibi_tensor` rounds them,
  and divided by √head_dim as Falcon divides its bias. Falcon's logits are those of its SDPA attention, one bias
  per score: the eager FalconAttention of some transformers versions (5.17) adds the bias a second time, to the
  scores beside the mask that already carries it;
- the mask: the model still builds its eager 4-D mask; it must be causal over each row's real keys (with padding
  on either side, or none), which is checked row by row; padded batches run `flash_attn_varlen_func` on the real
  tokens (`transformers._padded_attention`), others `flash_attn_func`. Any other mask (a custom 4-D mask) is a
  NotImplementedError, never a different answer. The layers of one forward share its mask tensor, which is
  checked at the first of them;
- attention dropout in training as flash-attn's `dropout_p`; `output_attentions` is refused (no probabilities).

Returns the number of layers patched; a model with none of these layers (or an ALiBi-free Falcon) is a ValueError.
"""

from __future__ import annotations

import functools
import inspect
import math
import types
import weakref

import torch

from ..interface import flash_attn_func
from .transformers import _padded_attention


def patch_alibi_attention(model: torch.nn.Module) -> int:
    """Run the ALiBi attention layers of a BLOOM, MPT or Falcon (alibi=True) model on flashtriton (module doc)."""
    patched = 0
    for module in model.modules():
        forward = _FORWARDS.get(type(module).__name__)
        if forward is None or getattr(module, "_flashtriton_alibi", False):
            continue
        if type(module).__name__ == "FalconAttention" and not module.config.alibi:
            continue  # rotary Falcon: attn_implementation="flashtriton" runs it
        module.forward = types.MethodType(forward, module)
        module._flashtriton_alibi = True
        patched += 1
    if not patched and not any(getattr(m, "_flashtriton_alibi", False) for m in model.modules()):
        raise ValueError(f"patch_alibi_attention: {type(model).__name__} has no ALiBi attention layer it takes "
                         f"(BloomAttention, MptAttention, FalconAttention with config.alibi); for other models use "
                         f"attn_implementation='flashtriton'")
    return patched


@functools.lru_cache(maxsize=64)
def bloom_slopes(num_heads: int, device) -> torch.Tensor:
    """BLOOM's ALiBi slopes (H,) fp32, read off its own `build_alibi_tensor` (slope · key position) at position 1."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    ones = torch.ones(1, 2, dtype=torch.long, device=device)
    return build_alibi_tensor(ones, num_heads, torch.float32)[:, 0, 1].contiguous()


@functools.lru_cache(maxsize=64)
def falcon_slopes(num_heads: int, head_dim: int, device) -> torch.Tensor:
    """Falcon's ALiBi slopes (H,) fp32 as its mask carries them: its `build_alibi_tensor` (which rounds the slopes
    to bf16) at position 1, over √head_dim."""
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    ones = torch.ones(1, 2, dtype=torch.long, device=device)
    return (build_alibi_tensor(ones, num_heads, torch.float32)[:, 0, 1] / math.sqrt(head_dim)).contiguous()


def mpt_slopes(num_heads: int, alibi_bias_max: float, device) -> torch.Tensor:
    """MPT's ALiBi slopes (H,) fp32, read off its own `build_mpt_alibi_tensor` (`_mpt_layer_slopes`)."""
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    return _mpt_layer_slopes(build_mpt_alibi_tensor(num_heads, 2, alibi_bias_max, device=device))


def alibi_attention(q, k, v, mask, slopes: torch.Tensor, scale: float, dropout_p: float = 0.0, where: str = ""):
    """Causal attention with ALiBi of q (B, Sq, H, D) against k, v (B, Sk, Hkv, D), the queries the last Sq
    positions of the keys, under a model's eager 4-D mask `mask` (B, 1 or H, Sq, Sk): float, visible where it is
    above half the dtype's lowest value, or bool, True where masked; None: no mask. Returns (B, Sq, H, D)."""
    if mask is None:
        return flash_attn_func(q, k, v, dropout_p, softmax_scale=scale, causal=True, alibi_slopes=slopes)
    keys, padded = _causal_key_mask(mask, q.shape[1], k.shape[1], where)
    if not padded:
        return flash_attn_func(q, k, v, dropout_p, softmax_scale=scale, causal=True, alibi_slopes=slopes)
    return _padded_attention(q, k, v, keys, scale, True, dropout_p=dropout_p, alibi_slopes=slopes)


# The last mask `_causal_key_mask` checked and its verdict: every layer of one forward gets the same mask tensor,
# so the check (and its two host syncs) runs once per forward, not once per layer.
_last_checked: list = [None, None]


def _causal_key_mask(mask: torch.Tensor, seqlen_q: int, seqlen_k: int, where: str) -> tuple[torch.Tensor, bool]:
    """((B, Sk) bool, True = a real key; whether any key is padding) of an eager 4-D mask that is causal
    (bottom-right) over each row's real keys for every real query; NotImplementedError otherwise (a custom mask
    the kernels would not reproduce)."""
    ref, verdict = _last_checked
    if ref is not None and ref() is mask and verdict[0] == (seqlen_q, seqlen_k):
        return verdict[1]
    if mask.dim() != 4 or mask.shape[-2:] != (seqlen_q, seqlen_k):
        raise NotImplementedError(f"{where}: flashtriton takes a 4-D (batch, 1, {seqlen_q}, {seqlen_k}) mask here; "
                                  f"got shape {tuple(mask.shape)}")
    visible = ~mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    keys = visible[:, 0, -1, :]  # the last query is a real token (left padding) or sees every real key (right)
    causal = (torch.arange(seqlen_k, device=mask.device)[None, :]
              <= torch.arange(seqlen_q, device=mask.device)[:, None] + (seqlen_k - seqlen_q))
    wanted = keys[:, None, None, :] & causal
    real_rows = keys[:, seqlen_k - seqlen_q:][:, None, :, None]  # padded queries: outputs nobody reads
    if bool(((visible != wanted) & real_rows).any()):
        raise NotImplementedError(f"{where}: flashtriton runs ALiBi models under a causal mask over each row's real "
                                  f"tokens only; this mask is another (a custom 4-D mask?). Use the model's eager "
                                  f"attention for it")
    verdict = (keys, not bool(keys.all()))
    _last_checked[:] = [weakref.ref(mask), ((seqlen_q, seqlen_k), verdict)]
    return verdict


def _check_outputs(output_attentions: bool, where: str) -> None:
    if output_attentions:
        raise NotImplementedError(f"{where}: flashtriton returns no attention probabilities (output_attentions=True)")


def _bloom_forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
                   output_attentions=False, **kwargs):
    """BloomAttention.forward on flashtriton (the module's projections and cache, ALiBi by slopes)."""
    from transformers.models.bloom.modeling_bloom import dropout_add

    _check_outputs(output_attentions, "BloomAttention")
    batch_size, q_length, _ = hidden_states.shape
    query, key, value = self._reshape(self.query_key_value(hidden_states))  # (B, H, S, D)
    if layer_past is not None:
        key, value = layer_past.update(key, value, self.layer_idx)
    dropout_p = self.attention_dropout.p if self.training else 0.0
    out = alibi_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attention_mask,
                          bloom_slopes(self.num_heads, hidden_states.device), self.inv_norm_factor, dropout_p,
                          "BloomAttention")
    context = out.reshape(batch_size, q_length, self.num_heads * self.head_dim)
    if self.pretraining_tp > 1 and self.slow_but_exact:
        slices = self.hidden_size / self.pretraining_tp
        output = torch.zeros_like(context)
        for i in range(self.pretraining_tp):
            output = output + torch.nn.functional.linear(context[:, :, int(i * slices):int((i + 1) * slices)],
                                                         self.dense.weight[:, int(i * slices):int((i + 1) * slices)])
    else:
        output = self.dense(context)
    return dropout_add(output, residual, self.hidden_dropout, self.training), None


def _mpt_forward(self, hidden_states, position_bias, cache=None, attention_mask=None, **kwargs):
    """MptAttention.forward on flashtriton (the module's projections, clipping and cache, ALiBi by slopes)."""
    _check_outputs(kwargs.get("output_attentions", False), "MptAttention")
    if cache is None and "past_key_values" in kwargs:
        cache = kwargs.pop("past_key_values")
    batch_size, seq_length = hidden_states.shape[:2]
    mixed = self.Wqkv(hidden_states)
    if self.clip_qkv:
        mixed = mixed.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    query, key, value = (t.reshape(batch_size, seq_length, self.n_heads, self.head_dim) for t in mixed.chunk(3, dim=2))
    if cache is not None:
        key, value = cache.update(key.transpose(1, 2), value.transpose(1, 2), self.layer_idx, kwargs=kwargs)
        key, value = key.transpose(1, 2), value.transpose(1, 2)
    if position_bias is None:
        raise NotImplementedError("MptAttention without ALiBi (position_bias None): use the model's own attention")
    slopes = _mpt_layer_slopes(position_bias)
    dropout_p = self.attn_dropout_p if self.training else 0.0
    out = alibi_attention(query, key, value, attention_mask, slopes, self.softmax_scale, dropout_p, "MptAttention")
    return self.out_proj(out.reshape(batch_size, seq_length, -1)), None


def _mpt_layer_slopes(position_bias: torch.Tensor) -> torch.Tensor:
    """MPT's slopes read off the bias it hands the layer ((H, 1, L): slope · (index − L + 1), L ≥ 2), so that any
    alibi_bias_max the model was built with is the one used."""
    if position_bias.dim() != 3 or position_bias.shape[-1] < 2:
        raise NotImplementedError(f"MptAttention: a position bias of shape {tuple(position_bias.shape)} is not "
                                  f"MPT's ALiBi (heads, 1, max_seq_len)")
    row = position_bias[:, 0, :].float()
    slopes = row[:, -1] - row[:, -2]
    if not torch.allclose(row, slopes[:, None] * (torch.arange(row.shape[-1], device=row.device) - row.shape[-1] + 1),
                          rtol=1e-3, atol=1e-3):
        raise NotImplementedError("MptAttention: its position bias is not linear in the key index (not ALiBi)")
    return slopes.contiguous()


def _falcon_forward(self, *args, **kwargs):
    """FalconAttention.forward of an ALiBi Falcon on flashtriton: its projections (every head layout) and cache,
    the slopes its `build_alibi_tensor` gives (bf16-rounded where that rounds them), over √head_dim as Falcon scales
    its bias. The call's arguments are bound to the layer class's own `forward`, which transformers has shaped two
    ways: the bias folded into `attention_mask` (returns (out, weights)), or passed as `alibi` beside the mask, with
    `head_mask` (returns (out, layer_past)); the mask's bias values are never read, only where it is visible."""
    bound = _forward_signature(type(self)).bind(self, *args, **kwargs)
    bound.apply_defaults()
    call = bound.arguments
    extra = call.get("kwargs", {})
    _check_outputs(call.get("output_attentions", False) or extra.get("output_attentions", False), "FalconAttention")
    if call.get("head_mask") is not None:
        raise NotImplementedError("FalconAttention: flashtriton takes no head_mask (use the model's eager attention)")
    hidden_states, attention_mask = call["hidden_states"], call.get("attention_mask")
    layer_past = call.get("layer_past")
    if layer_past is None:
        layer_past = extra.get("past_key_values")
    input_shape = hidden_states.shape[:-1]
    fused = self.query_key_value(hidden_states).view(*input_shape, -1, self.head_dim)
    if self.new_decoder_architecture:
        grouped = fused.view(*input_shape, self.num_kv_heads, -1, self.head_dim)
        query, key, value = grouped[..., :-2, :].flatten(-3, -2), grouped[..., -2, :], grouped[..., -1, :]
    elif self.multi_query:
        query, key, value = fused.split([self.num_heads, 1, 1], dim=-2)
    else:
        query, key, value = fused.unflatten(-2, (self.num_heads, 3)).unbind(-2)
    if layer_past is not None:
        key, value = layer_past.update(key.transpose(1, 2), value.transpose(1, 2), self.layer_idx)
        key, value = key.transpose(1, 2), value.transpose(1, 2)
    slopes = falcon_slopes(self.num_heads, self.head_dim, hidden_states.device)
    scale = getattr(self, "scaling", None) or self.inv_norm_factor
    dropout = self.attention_dropout
    dropout_p = (dropout.p if isinstance(dropout, torch.nn.Dropout) else float(dropout)) if self.training else 0.0
    out = alibi_attention(query, key, value, attention_mask, slopes, scale, dropout_p, "FalconAttention")
    out = self.dense(out.reshape(*input_shape, -1))
    return (out, layer_past) if "alibi" in call else (out, None)


@functools.lru_cache(maxsize=None)
def _forward_signature(cls) -> inspect.Signature:
    return inspect.signature(cls.forward)


_FORWARDS = {"BloomAttention": _bloom_forward, "MptAttention": _mpt_forward, "FalconAttention": _falcon_forward}
