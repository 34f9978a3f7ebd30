"""attn_implementation="flashtriton" across Hugging Face model families, against "sdpa" (or "eager").

One tiny random-weight model per family (built from a config, no downloads), fp32 on the test device, run
with flashtriton and with the reference implementation on the same weights and inputs. The product's
contract, checked for every case:

- either flashtriton *ran* (its kernels did the attention: no other kernel, no swap to another
  implementation) and the result is the reference's: logits within ATOL on the positions that mean
  something, identical tokens for `generate`;
- or it was *refused*: a NotImplementedError / ValueError raised on purpose, whose message names flashtriton
  and whose advice works (every attention implementation it names builds and runs this model; a
  `config.<field>` it mentions exists; a `<field>=0.0` it advises makes flashtriton run the case). Cases
  built with `runs(...)` need nothing flashtriton lacks: for them a refusal fails too.

Anything else fails: a silently different result, another exception type, or a model that ran something
other than flashtriton (its kernels never launched, torch's sdpa ran, or the configs name another
implementation: transformers swaps "flash" names for hub kernels on some models). Padded query positions
are not compared (their reference values mean nothing); every decoder position of a cross-attention is real
and is compared.
"""

from __future__ import annotations

import copy
import functools
import inspect
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashtriton.kvcache  # noqa: E402
import flashtriton.ops  # noqa: E402
from flashtriton._env import INTERPRET  # noqa: E402
from flashtriton.integrations import transformers as ft_hf  # noqa: E402

from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
ATOL = 1e-4
VOCAB, PAD, BOS, EOS = 128, 0, 1, 2
IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN = VOCAB - 1, VOCAB - 2, VOCAB - 3
DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=64,
               pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
SEQ2SEQ = dict(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
               pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, decoder_start_token_id=BOS,
               forced_eos_token_id=None, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=16,
              patch_size=4)  # 16 patches


# ------------------------------------------------------------------------------------------ the families


def _config(name: str, **kwargs):
    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return cls(**kwargs)


@dataclass(frozen=True)
class Family:
    config: Callable[[], Any]
    auto: str = "AutoModelForCausalLM"  # the Auto class whose from_config builds it
    reference: str = "sdpa"  # "eager" where the family has no sdpa
    train: bool = False  # built in train mode (dropout cases)


def _modernbert(local_attention: int):
    return _config("ModernBertConfig", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, global_attn_every_n_layers=2, local_attention=local_attention,
                   max_position_embeddings=64, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
                   cls_token_id=BOS, sep_token_id=EOS)


def _gemma3_multimodal():
    text = _config("Gemma3TextConfig", **DECODER, sliding_window=32, query_pre_attn_scalar=8,
                   layer_types=["sliding_attention", "full_attention"])
    return _config("Gemma3Config", text_config=text, vision_config=_config("SiglipVisionConfig", **SIGLIP),
                   mm_tokens_per_image=4, image_token_index=IMAGE_TOKEN, boi_token_index=BOI_TOKEN,
                   eoi_token_index=EOI_TOKEN)


def _paligemma():
    text = _config("GemmaConfig", **DECODER)
    return _config("PaliGemmaConfig", text_config=text, vision_config=_config("SiglipVisionConfig", **SIGLIP),
                   projection_dim=32, hidden_size=32, vocab_size=VOCAB, image_token_index=IMAGE_TOKEN)


_GEMMA2 = dict(DECODER, query_pre_attn_scalar=8, final_logit_softcapping=None)
_GPT_OSS = dict(DECODER, num_local_experts=4, num_experts_per_tok=2,
                layer_types=["sliding_attention", "full_attention"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # no YaRN for 64 positions
_DEEPSEEK_V3 = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                    n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
                    q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                    max_position_embeddings=64, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
VSTART, VEND, VIDEO_TOKEN = VOCAB - 2, VOCAB - 3, VOCAB - 4  # Qwen-VL's vision start / end, video tokens
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}  # head dim 8: 4 rotary pairs


def _qwen_vl(name: str, vision: dict):
    text = dict({k: v for k, v in DECODER.items() if k != "head_dim"}, rope_parameters=_MROPE)
    return _config(name, text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN,
                   video_token_id=VIDEO_TOKEN, vision_start_token_id=VSTART, vision_end_token_id=VEND)


def _t5gemma(sliding_window: int):
    stack = dict(DECODER, query_pre_attn_scalar=8, sliding_window=sliding_window, attn_logit_softcapping=None,
                 final_logit_softcapping=None, layer_types=["sliding_attention", "full_attention"])
    return _config("T5GemmaConfig", encoder=stack, decoder=stack, vocab_size=VOCAB, dropout_rate=0.0,
                   attention_dropout=0.0, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
                   decoder_start_token_id=BOS)


def _gemma3n():
    return _config("Gemma3nTextConfig", **dict(DECODER, num_hidden_layers=4), sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2, laurel_rank=4,
                   hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, altup_num_inputs=2,
                   activation_sparsity_pattern=[0.0] * 4)

FAMILIES: dict[str, Family] = {
    "llama": Family(lambda: _config("LlamaConfig", **DECODER)),
    "llama_head_dim_512": Family(lambda: _config("LlamaConfig", **{**DECODER, "head_dim": 512})),
    "mistral_window8": Family(lambda: _config("MistralConfig", **DECODER, sliding_window=8)),
    "mistral_window64": Family(lambda: _config("MistralConfig", **DECODER, sliding_window=64)),
    "qwen2": Family(lambda: _config("Qwen2Config", **DECODER)),
    "qwen2_window8": Family(lambda: _config("Qwen2Config", **DECODER, use_sliding_window=True, sliding_window=8,
                                            max_window_layers=0)),
    "qwen2_moe": Family(lambda: _config("Qwen2MoeConfig", **DECODER, **_MOE)),
    "qwen2_moe_window8": Family(lambda: _config("Qwen2MoeConfig", **DECODER, **_MOE, use_sliding_window=True,
                                                sliding_window=8, max_window_layers=2)),
    "phimoe_window8": Family(lambda: _config("PhimoeConfig", **DECODER, num_local_experts=4, num_experts_per_tok=2,
                                             sliding_window=8)),
    "phi3": Family(lambda: _config("Phi3Config", **DECODER)),
    "gemma2": Family(lambda: _config("Gemma2Config", **_GEMMA2, sliding_window=8, attn_logit_softcapping=50.0),
                     reference="eager"),
    "gemma2_softcap_window64": Family(lambda: _config("Gemma2Config", **_GEMMA2, sliding_window=64,
                                                      attn_logit_softcapping=50.0), reference="eager"),
    "gemma2_no_softcap_window8": Family(lambda: _config("Gemma2Config", **_GEMMA2, sliding_window=8,
                                                        attn_logit_softcapping=None), reference="eager"),
    "gemma2_no_softcap_window64": Family(lambda: _config("Gemma2Config", **_GEMMA2, sliding_window=64,
                                                         attn_logit_softcapping=None), reference="eager"),
    "gemma3_text_window8": Family(lambda: _config("Gemma3TextConfig", **DECODER, sliding_window=8,
                                                  query_pre_attn_scalar=8,
                                                  layer_types=["sliding_attention", "full_attention"])),
    "gemma3_text_window64": Family(lambda: _config("Gemma3TextConfig", **DECODER, sliding_window=64,
                                                   query_pre_attn_scalar=8,
                                                   layer_types=["sliding_attention", "full_attention"])),
    "gemma3_multimodal": Family(_gemma3_multimodal, auto="AutoModelForImageTextToText"),
    "paligemma": Family(_paligemma, auto="AutoModelForImageTextToText"),
    "gpt_oss": Family(lambda: _config("GptOssConfig", **_GPT_OSS, sliding_window=8), reference="eager"),
    "gpt_oss_window64": Family(lambda: _config("GptOssConfig", **_GPT_OSS, sliding_window=64), reference="eager"),
    "gpt_neo_window8": Family(lambda: _config("GPTNeoConfig", vocab_size=VOCAB, max_position_embeddings=64,
                                              hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                                              attention_types=[[["global", "local"], 1]], window_size=8,
                                              pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS),
                              reference="eager"),
    "gpt_neo_window64": Family(lambda: _config("GPTNeoConfig", vocab_size=VOCAB, max_position_embeddings=64,
                                               hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                                               attention_types=[[["global", "local"], 1]], window_size=64,
                                               pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS),
                               reference="eager"),
    # DeepSeek-V3's multi-head latent attention: a QK head dim (nope 16 + rope 8) unlike V's (16), V not padded
    "deepseek_v3": Family(lambda: _config("DeepseekV3Config", **_DEEPSEEK_V3)),
    "falcon": Family(lambda: _config("FalconConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)),
    "falcon_alibi": Family(lambda: _config("FalconConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                           num_attention_heads=4, alibi=True, pad_token_id=PAD, bos_token_id=BOS,
                                           eos_token_id=EOS)),
    "bert": Family(lambda: _config("BertConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=PAD),
                   auto="AutoModelForMaskedLM"),
    "bert_train_dropout": Family(lambda: _config("BertConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                 num_attention_heads=4, intermediate_size=64,
                                                 max_position_embeddings=64, hidden_dropout_prob=0.0,
                                                 attention_probs_dropout_prob=0.3, pad_token_id=PAD),
                                 auto="AutoModelForMaskedLM", train=True),
    "modernbert_local8": Family(lambda: _modernbert(local_attention=8), auto="AutoModelForMaskedLM"),
    "modernbert_local64": Family(lambda: _modernbert(local_attention=64), auto="AutoModelForMaskedLM"),
    "vit": Family(lambda: _config("ViTConfig", image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64), auto="AutoModel"),
    "vit_train_dropout": Family(lambda: _config("ViTConfig", image_size=16, patch_size=4, hidden_size=32,
                                                num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.3),
                                auto="AutoModel", train=True),
    "whisper": Family(lambda: _config("WhisperConfig", **{k: v for k, v in SEQ2SEQ.items()
                                                          if k != "max_position_embeddings"},
                                      num_mel_bins=8, max_source_positions=12, max_target_positions=32,
                                      begin_suppress_tokens=None, suppress_tokens=None),
                      auto="AutoModelForSpeechSeq2Seq"),
    "bart": Family(lambda: _config("BartConfig", **SEQ2SEQ), auto="AutoModelForSeq2SeqLM"),
    "marian": Family(lambda: _config("MarianConfig", **SEQ2SEQ), auto="AutoModelForSeq2SeqLM"),
    "qwen3": Family(lambda: _config("Qwen3Config", **DECODER)),
    "qwen3_moe": Family(lambda: _config("Qwen3MoeConfig", **DECODER, num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=32)),
    "olmo2": Family(lambda: _config("Olmo2Config", **DECODER)),
    "smollm3": Family(lambda: _config("SmolLM3Config", **DECODER)),
    "cohere2_window8": Family(lambda: _config("Cohere2Config", **DECODER, sliding_window=8,
                                              layer_types=["sliding_attention", "full_attention"])),
    "starcoder2_window8": Family(lambda: _config("Starcoder2Config", **DECODER, sliding_window=8)),
    "gpt2": Family(lambda: _config("GPT2Config", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                   pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)),
    "roberta": Family(lambda: _config("RobertaConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=PAD),
                      auto="AutoModelForMaskedLM"),
    "distilbert": Family(lambda: _config("DistilBertConfig", vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4,
                                         hidden_dim=64, max_position_embeddings=64, dropout=0.0,
                                         attention_dropout=0.0, pad_token_id=PAD), auto="AutoModelForMaskedLM"),
    "esm": Family(lambda: _config("EsmConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                  position_embedding_type="rotary", hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, pad_token_id=PAD, mask_token_id=3),
                  auto="AutoModelForMaskedLM"),
    "mbart": Family(lambda: _config("MBartConfig", **SEQ2SEQ), auto="AutoModelForSeq2SeqLM"),
    "pegasus": Family(lambda: _config("PegasusConfig", **SEQ2SEQ), auto="AutoModelForSeq2SeqLM"),
    # PEGASUS-X's decoder self-attention keeps is_causal = False over its causal mask: the mask's verdict decides
    "pegasus_x": Family(lambda: _config("PegasusXConfig", **SEQ2SEQ, block_size=4, num_global_tokens=4),
                        auto="AutoModelForSeq2SeqLM", reference="eager"),
    # OLMoE passes config.sliding_window to its layers over a plain causal mask: eager and sdpa apply no window
    "olmoe_window4": Family(lambda: _config("OlmoeConfig", **DECODER, num_experts=4, num_experts_per_tok=2,
                                            sliding_window=4)),
    # vision towers that call the attention with cu_seq_lens (one sequence per image; Qwen2.5-VL: per window too)
    "qwen2_vl": Family(lambda: _qwen_vl("Qwen2VLConfig", dict(depth=1, embed_dim=32, hidden_size=32, num_heads=4,
                                                              mlp_ratio=2, patch_size=2, spatial_merge_size=2,
                                                              temporal_patch_size=2)),
                       auto="AutoModelForImageTextToText"),
    "qwen2_5_vl": Family(lambda: _qwen_vl("Qwen2_5_VLConfig", dict(depth=2, hidden_size=32, intermediate_size=64,
                                                                   num_heads=4, patch_size=2, spatial_merge_size=2,
                                                                   temporal_patch_size=2, out_hidden_size=32,
                                                                   window_size=8, fullatt_block_indexes=[1])),
                         auto="AutoModelForImageTextToText"),
    # EmbeddingGemma-style bidirectional Gemma 3: or_masks over the causal masks, a band |q - k| < w when sliding
    "gemma3_bidirectional_window4": Family(lambda: _config("Gemma3TextConfig", **DECODER, sliding_window=4,
                                                           query_pre_attn_scalar=8, use_bidirectional_attention=True,
                                                           layer_types=["sliding_attention", "full_attention"]),
                                           auto="AutoModel"),
    # a bidirectional sliding-window encoder (|q - k| <= w) and a sliding causal decoder with cross-attention
    "t5gemma_window4": Family(lambda: _t5gemma(4), auto="AutoModelForSeq2SeqLM", reference="eager"),
    "idefics3": Family(lambda: _config("Idefics3Config", vision_config=dict(SIGLIP, num_hidden_layers=2),
                                       text_config=_config("LlamaConfig", **DECODER), image_token_id=IMAGE_TOKEN,
                                       scale_factor=2), auto="AutoModelForImageTextToText"),
    "moonshine": Family(lambda: _config("MoonshineConfig", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                        encoder_num_hidden_layers=1, decoder_num_hidden_layers=1,
                                        encoder_num_attention_heads=4, decoder_num_attention_heads=4,
                                        max_position_embeddings=64, pad_token_id=PAD, bos_token_id=BOS,
                                        eos_token_id=EOS, decoder_start_token_id=BOS),
                        auto="AutoModelForSpeechSeq2Seq"),
    # Gemma 3n: the last layers reuse earlier layers' keys and values (num_kv_shared_layers), windows on half
    "gemma3n_window8": Family(_gemma3n),
    # hybrid: a Mamba layer, then an attention layer (a hybrid cache in generation)
    "jamba": Family(lambda: _config("JambaConfig", **{k: v for k, v in DECODER.items() if k != "head_dim"},
                                    num_experts=2, num_experts_per_tok=1, expert_layer_period=2, expert_layer_offset=1,
                                    attn_layer_period=2, attn_layer_offset=1, use_mamba_kernels=False,
                                    mamba_d_state=4, mamba_dt_rank=4, mamba_expand=2)),
    # ALiBi (BLOOM) and T5's relative position bias: transformers marks both _supports_flash_attn = False
    "bloom": Family(lambda: _config("BloomConfig", vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4,
                                    pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS), reference="eager"),
    "t5": Family(lambda: _config("T5Config", vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                 dropout_rate=0.0, pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD),
                 auto="AutoModelForSeq2SeqLM"),
}


# -------------------------------------------------------------------------------------------- the inputs


def _ids(batch: int, seqlen: int, seed: int = 1, high: int = VOCAB - 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, high, (batch, seqlen), generator=g)


def _mask(lengths, seqlen: int, left: bool) -> torch.Tensor:
    mask = torch.zeros(len(lengths), seqlen, dtype=torch.long)
    for b, n in enumerate(lengths):
        if left:
            mask[b, seqlen - n:] = 1
        else:
            mask[b, :n] = 1
    return mask


def _text(batch: int = 2, seqlen: int = 16, lengths=None, left: bool = True, **extra):
    ids = _ids(batch, seqlen)
    inputs = {"input_ids": ids}
    if lengths is not None:
        mask = _mask(lengths, seqlen, left)
        inputs.update(input_ids=ids.masked_fill(mask == 0, PAD), attention_mask=mask)
    return {**inputs, **extra}


def _packed(*rows):
    """No attention mask; position ids restart inside a row (several documents back to back), no cache (as in
    training: transformers detects packing only without a cache)."""
    position_ids = torch.stack([torch.cat([torch.arange(a, b) for a, b in row]) for row in rows])
    return {"input_ids": _ids(*position_ids.shape, seed=3), "position_ids": position_ids, "use_cache": False}


def _pixels(batch: int, size: int = 16, seed: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _gemma3_images():
    """Two rows: text, <boi>, 4 image tokens (token_type 1: bidirectional among themselves), <eoi>, text."""
    ids = _ids(2, 16)
    ids[:, 4], ids[:, 5:9], ids[:, 9] = BOI_TOKEN, IMAGE_TOKEN, EOI_TOKEN
    return {"input_ids": ids, "token_type_ids": (ids == IMAGE_TOKEN).long(), "pixel_values": _pixels(2)}


def _paligemma_prefix():
    """16 image tokens and a 4-token prompt (the prefix: token_type 0, bidirectional), then a 4-token suffix."""
    ids = _ids(2, 24)
    ids[:, :16] = IMAGE_TOKEN
    token_type_ids = torch.zeros_like(ids)
    token_type_ids[:, 20:] = 1
    return {"input_ids": ids, "token_type_ids": token_type_ids, "pixel_values": _pixels(2)}


def _seq2seq(dec_len: int, enc_lengths=(16, 9), enc_len: int = 16, left: bool = False):
    """Encoder right-padded (or left-padded); decoder inputs all real (every decoder position is compared)."""
    mask = _mask(enc_lengths, enc_len, left=left)
    return {"input_ids": _ids(len(enc_lengths), enc_len).masked_fill(mask == 0, PAD), "attention_mask": mask,
            "decoder_input_ids": _ids(len(enc_lengths), dec_len, seed=4)}


def _whisper(dec_len: int):
    features = torch.randn(2, 8, 24, generator=torch.Generator().manual_seed(5))  # 12 encoder positions
    return {"input_features": features, "decoder_input_ids": _ids(2, dec_len, seed=4)}


def _qwen_vl_images(grids=((1, 4, 4), (1, 2, 4)), seqlen: int = 16, lengths=None):
    """One image per row (grid t, h, w of 2x2 patches; 4 patches merge into one token), images of different sizes:
    <vision start>, the image's tokens, <vision end> two tokens into each row's text; left-padded rows."""
    ids = _ids(len(grids), seqlen, high=VOCAB - 6)
    mask = _mask(lengths or (seqlen,) * len(grids), seqlen, left=True)
    for b, (t, h, w) in enumerate(grids):
        start = int(mask[b].nonzero()[0]) + 2
        ids[b, start], ids[b, start + 1:start + 1 + t * h * w // 4], ids[b, start + 1 + t * h * w // 4] = (
            VSTART, IMAGE_TOKEN, VEND)
    patches = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 2 * 2,  # channels x t x h x w of a patch
                          generator=torch.Generator().manual_seed(2))
    inputs = {"input_ids": ids.masked_fill(mask == 0, PAD), "pixel_values": patches,
              "image_grid_thw": torch.tensor(grids), "mm_token_type_ids": (ids == IMAGE_TOKEN).long()}
    return {**inputs, "attention_mask": mask} if lengths is not None else inputs


def _idefics3_padded_patches():
    """Two 16x16 images (4 tokens each after the 2x2 pixel shuffle); the second's right half is padding, so its
    vision tower attends over 8 real patches of 16, in two runs per patch row."""
    ids = _ids(2, 16, high=VOCAB - 6)
    ids[:, 2:6] = IMAGE_TOKEN
    pixel_mask = torch.ones(2, 1, 16, 16, dtype=torch.bool)
    pixel_mask[1, 0, :, 8:] = False
    return {"input_ids": ids, "pixel_values": _pixels(2)[:, None] * pixel_mask[:, :, None],
            "pixel_attention_mask": pixel_mask}


def _moonshine(dec_len: int):
    """Raw audio, the second row right-padded (the encoder's mask comes from the samples' mask)."""
    mask = _mask((6400, 4266), 6400, left=False)
    audio = torch.randn(2, 6400, generator=torch.Generator().manual_seed(7)) * mask
    return {"input_values": audio, "attention_mask": mask, "decoder_input_ids": _ids(2, dec_len, seed=4)}


# ------------------------------------------------------------------------------------------ the runners


def _output(out) -> torch.Tensor:
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _forward(model, inputs):
    return _output(model(**inputs))


def _cache_kwarg(model) -> str:  # transformers 5.x renames past_key_values -> cache
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _chunked_prefill(split: int):
    def run(model, inputs):
        ids, mask = inputs["input_ids"], inputs.get("attention_mask")
        cache = transformers.DynamicCache(config=model.config)
        kw = {_cache_kwarg(model): cache, "use_cache": True}
        first = model(input_ids=ids[:, :split], attention_mask=None if mask is None else mask[:, :split], **kw)
        second = model(input_ids=ids[:, split:], attention_mask=mask, **kw)
        return torch.cat([first.logits, second.logits], dim=1)

    return run


def _tokens_and_logits(out) -> tuple:
    """generate's tokens and each step's logits (a step can differ while its greedy token stays the same)."""
    return out.sequences, torch.stack(list(out.logits), 1)


def _greedy(model, inputs, **kwargs) -> tuple:
    """Six greedy tokens and their steps' logits (`_tokens_and_logits`)."""
    return _tokens_and_logits(model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=PAD,
                                             output_logits=True, return_dict_in_generate=True, **kwargs))


def _generate(**kwargs):
    def run(model, inputs):
        return _greedy(model, inputs, **kwargs)

    return run


def _generate_full_cache(**kwargs):
    """Generation with a DynamicCache that keeps every key (no config: no sliding layers), so that decoding past
    the window runs the window over the whole cache."""
    def run(model, inputs):
        return _greedy(model, inputs, **{_cache_kwarg(model): transformers.DynamicCache()}, **kwargs)

    return run


def _real_tokens(inputs) -> Optional[torch.Tensor]:
    """Positions whose outputs mean something: the 2-D mask's real tokens; all positions without a mask.
    Seq2seq: the outputs are the decoder's, all real (the encoder mask pads keys, not decoder queries)."""
    if "decoder_input_ids" in inputs or "attention_mask" not in inputs:
        return None
    return inputs["attention_mask"].bool()


@dataclass(frozen=True)
class Case:
    family: str
    inputs: Callable[[], dict]
    run: Callable = _forward
    tokens: bool = False  # compare generated tokens exactly (else logits within ATOL)
    must_run: bool = False  # nothing flashtriton lacks is involved: a refusal fails too
    # the kernel variants the run must launch, all of them and no other ("window": a window that hides keys,
    # "separate_v": V's head dim unlike QK's,
    # "softcap", "sink": attention sinks); None: not checked
    variants: Optional[tuple] = None


def _own_flash_code(model: str) -> bool:
    """Whether this transformers' modeling file for `model` bypasses the AttentionInterface for flash names."""
    import importlib

    module = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    return bool(ft_hf._private_flash_path(module.__name__))


def runs(family: str, inputs: Callable[[], dict], **kwargs) -> Case:
    """A case that needs nothing flashtriton lacks: it must run and match."""
    return Case(family, inputs, must_run=True, **kwargs)


def may_refuse(family: str, inputs: Callable[[], dict], **kwargs) -> Case:
    """A case that needs a feature flashtriton may lack: it must match or be refused clearly."""
    return Case(family, inputs, **kwargs)


_PADDED = dict(lengths=(16, 9))
_PROMPTS = dict(seqlen=10, lengths=(10, 6))

CASES: dict[str, Case] = {
    "llama": runs("llama", lambda: _text()),
    "llama_left_padded": runs("llama", lambda: _text(**_PADDED, left=True)),
    "llama_right_padded": runs("llama", lambda: _text(**_PADDED, left=False)),
    "llama_packed_1row": runs("llama", lambda: _packed([(0, 10), (0, 14)])),
    "llama_packed_1row_mid_document": runs("llama", lambda: _packed([(5, 15), (0, 14)])),
    "llama_packed_2rows": runs("llama", lambda: _packed([(0, 12), (0, 12)], [(5, 15), (0, 14)])),
    "llama_chunked_prefill": runs("llama", lambda: _text(), run=_chunked_prefill(10)),
    "llama_chunked_prefill_left_padded": runs("llama", lambda: _text(**_PADDED), run=_chunked_prefill(10)),
    "llama_static_cache_generate": runs("llama", lambda: _text(**_PROMPTS), tokens=True,
                                        run=_generate(cache_implementation="static")),
    "llama_greedy_generate": runs("llama", lambda: _text(**_PROMPTS), run=_generate(), tokens=True),
    "llama_beam_generate": runs("llama", lambda: _text(**_PROMPTS), run=_generate(num_beams=2), tokens=True),
    # sliding windows shorter than the keys: flash-attn's window_size (the mask's window), per sequence in varlen
    "mistral_window_shorter": runs("mistral_window8", lambda: _text(), variants=("window",)),
    "mistral_window_shorter_left_padded": runs("mistral_window8", lambda: _text(**_PADDED, left=True),
                                               variants=("window",)),
    "mistral_window_shorter_right_padded": runs("mistral_window8", lambda: _text(**_PADDED, left=False),
                                                variants=("window",)),
    "mistral_window_shorter_packed_2rows": runs("mistral_window8", lambda: _packed([(0, 12), (0, 12)],
                                                                                   [(5, 15), (0, 14)]),
                                                 variants=("window",)),
    # chunked prefill through the sliding cache (DynamicCache(config=...) keeps the last window - 1 keys)
    "mistral_window_shorter_chunked_prefill": runs("mistral_window8", lambda: _text(**_PADDED),
                                                   run=_chunked_prefill(10), variants=("window",)),
    # prompts inside the window, generation past it: the sliding cache keeps every call within the window
    "mistral_window_shorter_generate": runs("mistral_window8", lambda: _text(seqlen=6, lengths=(6, 4)),
                                            run=_generate(), tokens=True, variants=()),
    # prompts longer than the window, generation past it: sliding caches (dynamic, static) and a full DynamicCache
    "mistral_window_shorter_generate_long_prompts": runs("mistral_window8", lambda: _text(**_PROMPTS),
                                                         run=_generate(), tokens=True, variants=("window",)),
    "mistral_window_shorter_static_cache_generate": runs("mistral_window8", lambda: _text(**_PROMPTS), tokens=True,
                                                         run=_generate(cache_implementation="static"),
                                                         variants=("window",)),
    "mistral_window_shorter_full_cache_generate": runs("mistral_window8", lambda: _text(**_PROMPTS), tokens=True,
                                                       run=_generate_full_cache(), variants=("window",)),
    "mistral_window_longer": runs("mistral_window64", lambda: _text(**_PADDED), variants=()),
    "qwen2": runs("qwen2", lambda: _text(**_PADDED)),
    "qwen2_window_shorter": runs("qwen2_window8", lambda: _text(**_PADDED), variants=("window",)),
    "qwen2_moe": runs("qwen2_moe", lambda: _text(**_PADDED)),
    "qwen2_moe_window_shorter": runs("qwen2_moe_window8", lambda: _text(**_PADDED), variants=("window",)),
    "phimoe_window_shorter": runs("phimoe_window8", lambda: _text(**_PADDED), variants=("window",)),
    "phi3": runs("phi3", lambda: _text(**_PADDED)),
    # softcap (attn_logit_softcapping, the `softcap` kwarg) with windows shorter and longer than the keys
    "gemma2_softcap_window_shorter": runs("gemma2", lambda: _text(**_PADDED), variants=("softcap", "window")),
    "gemma2_softcap_window_shorter_generate": runs("gemma2", lambda: _text(**_PROMPTS), run=_generate(),
                                                   tokens=True, variants=("softcap", "window")),
    "gemma2_softcap_window_longer": runs("gemma2_softcap_window64", lambda: _text(), variants=("softcap",)),
    "gemma2_window_shorter": runs("gemma2_no_softcap_window8", lambda: _text(), variants=("window",)),
    "gemma2_window_longer": runs("gemma2_no_softcap_window64", lambda: _text(**_PADDED), variants=()),
    "gemma3_text_window_shorter": runs("gemma3_text_window8", lambda: _text(**_PADDED, left=False),
                                       variants=("window",)),
    "gemma3_text_window_shorter_packed": runs("gemma3_text_window8", lambda: _packed([(0, 10), (0, 14)]),
                                              variants=("window",)),
    "gemma3_text_window_longer": runs("gemma3_text_window64", lambda: _text(**_PADDED), variants=()),
    "gemma3_multimodal_images": may_refuse("gemma3_multimodal", _gemma3_images),
    "gemma3_multimodal_text_only": may_refuse("gemma3_multimodal", lambda: _text(**_PADDED)),
    "paligemma_prefix_lm": may_refuse("paligemma", _paligemma_prefix),
    # attention sinks (s_aux: flash-attn's learnable_sink) on every layer, a window on alternate ones; no packed
    # case: gpt-oss builds its masks without the position ids, so eager attends across packed documents
    "gpt_oss_window_shorter": runs("gpt_oss", lambda: _text(), variants=("sink", "window")),
    "gpt_oss_window_shorter_left_padded": runs("gpt_oss", lambda: _text(**_PADDED), variants=("sink", "window")),
    "gpt_oss_window_shorter_chunked_prefill": runs("gpt_oss", lambda: _text(**_PADDED), run=_chunked_prefill(10),
                                                   variants=("sink", "window")),
    "gpt_oss_window_shorter_generate": runs("gpt_oss", lambda: _text(**_PROMPTS), run=_generate(), tokens=True,
                                            variants=("sink", "window")),
    "gpt_oss_window_longer": runs("gpt_oss_window64", lambda: _text(**_PADDED, left=False), variants=("sink",)),
    "gpt_neo_window_shorter": may_refuse("gpt_neo_window8", lambda: _text()),
    "gpt_neo_window_longer": may_refuse("gpt_neo_window64", lambda: _text(**_PADDED)),
    "falcon": may_refuse("falcon", lambda: _text(**_PADDED)),
    "falcon_alibi": may_refuse("falcon_alibi", lambda: _text()),
    "bert_right_padded": runs("bert", lambda: _text(**_PADDED, left=False)),
    "bert_train_dropout": runs("bert_train_dropout", lambda: _text(**_PADDED, left=False)),
    # local attention: |q - k| <= local_attention // 2 around each query (flash-attn's (w, w)), right-padded rows;
    # early transformers 5.x run ModernBERT's flash path through flash-attn itself: refused there
    "modernbert_local_attention": (may_refuse if _own_flash_code("modernbert") else runs)(
        "modernbert_local8", lambda: _text(lengths=(16, 11), left=False), variants=("window",)),
    "modernbert_local_attention_unpadded": (may_refuse if _own_flash_code("modernbert") else runs)(
        "modernbert_local8", lambda: _text(), variants=("window",)),
    "modernbert_local_attention_longer": (may_refuse if _own_flash_code("modernbert") else runs)(
        "modernbert_local64", lambda: _text(lengths=(16, 11), left=False), variants=()),
    "deepseek_v3": runs("deepseek_v3", lambda: _text(), variants=("separate_v",)),
    "deepseek_v3_left_padded": runs("deepseek_v3", lambda: _text(**_PADDED, left=True), variants=("separate_v",)),
    "deepseek_v3_generate": runs("deepseek_v3", lambda: _text(**_PROMPTS), run=_generate(), tokens=True,
                                 variants=("separate_v",)),
    "vit": runs("vit", lambda: {"pixel_values": _pixels(2)}),
    "vit_train_dropout": runs("vit_train_dropout", lambda: {"pixel_values": _pixels(2)}),
    "whisper": runs("whisper", lambda: _whisper(10)),
    "whisper_decoder_longer": runs("whisper", lambda: _whisper(20)),
    "bart_decoder10": runs("bart", lambda: _seq2seq(10)),
    "bart_decoder16_as_encoder": runs("bart", lambda: _seq2seq(16)),
    "bart_decoder24": runs("bart", lambda: _seq2seq(24)),
    "marian_decoder10": runs("marian", lambda: _seq2seq(10)),
    "qwen3_left_padded": runs("qwen3", lambda: _text(**_PADDED)),
    "qwen3_greedy_generate": runs("qwen3", lambda: _text(**_PROMPTS), run=_generate(), tokens=True),
    "qwen3_moe_right_padded": runs("qwen3_moe", lambda: _text(**_PADDED, left=False)),
    "olmo2_left_padded": runs("olmo2", lambda: _text(**_PADDED)),
    "smollm3_left_padded": runs("smollm3", lambda: _text(**_PADDED)),  # no RoPE on some layers
    # sliding layers alternating with full ones (layer_types), windows shorter than the keys
    "cohere2_window_shorter_left_padded": runs("cohere2_window8", lambda: _text(**_PADDED), variants=("window",)),
    "cohere2_window_shorter_generate": runs("cohere2_window8", lambda: _text(**_PROMPTS), run=_generate(),
                                            tokens=True, variants=("window",)),
    "starcoder2_window_shorter_right_padded": runs("starcoder2_window8", lambda: _text(**_PADDED, left=False),
                                                   variants=("window",)),
    "gpt2_right_padded": runs("gpt2", lambda: _text(**_PADDED, left=False)),
    "roberta_right_padded": runs("roberta", lambda: _text(**_PADDED, left=False)),
    "distilbert_left_padded": runs("distilbert", lambda: _text(**_PADDED)),
    "esm_right_padded": runs("esm", lambda: _text(**_PADDED, left=False)),  # rotary inside a padded encoder
    "mbart_decoder10": runs("mbart", lambda: _seq2seq(10)),
    "pegasus_decoder10": runs("pegasus", lambda: _seq2seq(10)),
    "pegasus_x_decoder10": runs("pegasus_x", lambda: _seq2seq(10)),
    "pegasus_x_unpadded": runs("pegasus_x", lambda: _seq2seq(8, enc_lengths=(16, 16))),
    # a layer's sliding_window under a plain causal verdict: no window, padded or not, in prefill and in decoding
    # over a cache that keeps every key
    "olmoe_window_over_plain_mask": runs("olmoe_window4", lambda: _text(), variants=()),
    "olmoe_window_over_plain_mask_generate": runs("olmoe_window4", lambda: _text(seqlen=10), tokens=True,
                                                  run=_generate_full_cache(), variants=()),
    # a static cache of sliding layers (the config's sliding_window) makes generate prepare a windowed mask, which
    # the model's own plain mask function must not overrule: sdpa keeps the prepared 4-D mask as it is
    "olmoe_window_static_cache_generate": runs("olmoe_window4", lambda: _text(**_PROMPTS), tokens=True,
                                               run=_generate(cache_implementation="static")),
    "qwen2_vl_images_left_padded": runs("qwen2_vl", lambda: _qwen_vl_images(lengths=(16, 12)), variants=()),
    "qwen2_5_vl_window_vision": runs("qwen2_5_vl", lambda: _qwen_vl_images(((1, 8, 8), (1, 4, 4)), seqlen=24,
                                                                          lengths=(24, 20)), variants=()),
    "gemma3_bidirectional_window_right_padded": runs("gemma3_bidirectional_window4",
                                                     lambda: _text(**_PADDED, left=False), variants=("window",)),
    "t5gemma_window_encoder_left_padded": runs("t5gemma_window4", lambda: _seq2seq(10, left=True),
                                               variants=("window",)),
    "idefics3_padded_image_patches": runs("idefics3", _idefics3_padded_patches),
    "moonshine_padded_audio": runs("moonshine", lambda: _moonshine(10)),
    "gemma3n_shared_kv_left_padded": runs("gemma3n_window8", lambda: _text(**_PADDED), variants=("window",)),
    "jamba_hybrid_generate": runs("jamba", lambda: _text(**_PROMPTS), run=_generate(), tokens=True),
    "bloom_alibi": may_refuse("bloom", lambda: _text(**_PADDED)),
    "t5_position_bias": may_refuse("t5", lambda: _seq2seq(10)),
    "llama_head_dim_512": may_refuse("llama_head_dim_512", lambda: _text()),  # past flashtriton's 256: refused
}


# ------------------------------------------------------------------------------ what ran: the spy


@dataclass
class Spy:
    """What one model run called: flashtriton's kernels, transformers' attention/mask entries, torch's sdpa."""

    kernels: int = 0  # flashtriton kernel launches (dense/varlen forward, decode)
    variants: set = field(default_factory=set)  # what those launches ran: "window", "softcap", "sink", "alibi",
    # "separate_v" (a V head dim unlike QK's)
    sdpa: int = 0  # torch.nn.functional.scaled_dot_product_attention calls
    attention_calls: list = field(default_factory=list)  # kwargs seen by the "flashtriton" attention entry
    mask_calls: list = field(default_factory=list)  # kwargs seen by the "flashtriton" mask entry


def _describe(value):
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}"
    if callable(value):
        return getattr(value, "__qualname__", type(value).__name__)
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    return type(value).__name__


@contextmanager
def _spy():
    spy = Spy()
    patches = pytest.MonkeyPatch()

    def counting(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            spy.kernels += 1
            if tuple(kwargs.get("window_size", (-1, -1))) != (-1, -1):
                spy.variants.add("window")
            if kwargs.get("softcap"):
                spy.variants.add("softcap")
            if kwargs.get("learnable_sink") is not None:
                spy.variants.add("sink")
            if kwargs.get("alibi_slopes") is not None:
                spy.variants.add("alibi")
            if len(args) >= 3 and args[0].shape[-1] != args[2].shape[-1]:  # q's head dim against v's
                spy.variants.add("separate_v")
            return fn(*args, **kwargs)

        return wrapper

    def recording(fn, log):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            log.append({k: _describe(v) for k, v in kwargs.items()})
            return fn(*args, **kwargs)

        return wrapper

    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def sdpa(*args, **kwargs):
        spy.sdpa += 1
        return real_sdpa(*args, **kwargs)

    patches.setattr(flashtriton.ops, "attention_forward", counting(flashtriton.ops.attention_forward))
    if hasattr(flashtriton.kvcache, "decode_attention"):
        patches.setattr(flashtriton.kvcache, "decode_attention", counting(flashtriton.kvcache.decode_attention))
    patches.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    for interface, log in ((AttentionInterface, spy.attention_calls), (AttentionMaskInterface, spy.mask_calls)):
        if ft_hf.NAME in interface._global_mapping:
            patches.setitem(interface._global_mapping, ft_hf.NAME,
                            recording(interface._global_mapping[ft_hf.NAME], log))
    try:
        yield spy
    finally:
        patches.undo()


_SHOWN = ("sliding_window", "softcap", "is_causal", "dropout", "s_aux", "token_type_ids", "position_ids",
          "cu_seq_lens_q", "cu_seq_lens_k", "position_bias")


def _routing(spy: Spy) -> str:
    """A short account of what transformers handed flashtriton: the mask functions its mask entry got and the
    kwargs its attention entry got (values of the interesting ones)."""
    masks = sorted({str(c.get("mask_function")) + "".join(f" {k}={c[k]}" for k in ("local_size",) if k in c)
                    for c in spy.mask_calls})
    keys = sorted({k for c in spy.attention_calls for k in c})
    shown = sorted({f"{k}={c[k]}" for c in spy.attention_calls for k in _SHOWN if k in c})
    return (f"{spy.kernels} kernel launches ({', '.join(sorted(spy.variants)) or 'plain'}), "
            f"{len(spy.attention_calls)} attention calls with kwargs {keys} "
            f"({', '.join(shown) or '-'}), mask functions {masks or '-'}")


def _implementations(model) -> dict[str, Optional[str]]:
    """config._attn_implementation of the model's config and of each of its sub-configs."""
    config = model.config
    found = {"config": config._attn_implementation}
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            found[name] = sub._attn_implementation
    return found


# ------------------------------------------------------------------------ ran or refused, and its advice


def _run_or_refused(fn):
    """("ran", fn()) or ("refused", exc) for a NotImplementedError / ValueError that names flashtriton.
    Any other exception fails the test: it is not a refusal, it is a bug."""
    try:
        return "ran", fn()
    except (NotImplementedError, ValueError) as exc:
        if "flashtriton" not in str(exc).lower():
            pytest.fail(f"{type(exc).__name__} that does not name flashtriton (not a clear refusal): {exc}")
        return "refused", exc
    except Exception as exc:  # noqa: BLE001 - anything else is a failure, reported with its type
        pytest.fail(f"{type(exc).__name__} (not a clear refusal): {exc}")


_IMPLEMENTATIONS = r"eager|sdpa|flex_attention|flash_attention_[234]"


def _check_advice(exc: Exception, family: Family, case: Case) -> None:
    """The refusal's advice must be something transformers accepts for this very model: every implementation
    it names builds and runs the case; every `config.<field>` it names exists; a `<field>=0` it advises makes
    flashtriton run the case."""
    message = str(exc)
    advised = set(re.findall(r"attn_implementation\s*=\s*['\"]([\w\-/|]+)['\"]", message))
    advised |= set(re.findall(rf"['\"]({_IMPLEMENTATIONS})['\"]", message))
    for implementation in sorted(advised - {ft_hf.NAME}):
        try:
            _run(case, _build(family, implementation))
        except Exception as err:  # noqa: BLE001
            pytest.fail(f"the refusal advises attn_implementation={implementation!r}, which fails here with "
                        f"{type(err).__name__}: {err}\n(refusal: {message})")
    config = family.config()
    configs = [config] + [getattr(config, s) for s in (getattr(config, "sub_configs", {}) or {})
                          if getattr(config, s, None) is not None]
    for name in set(re.findall(r"config\.(\w+)", message)):
        assert any(hasattr(c, name) for c in configs), (
            f"the refusal mentions config.{name}, which {type(config).__name__} does not have\n(refusal: {message})")
    for name in set(re.findall(r"\b(\w+)=0(?:\.0)?\b", message)) & {n for c in configs for n in vars(c)}:
        model = _build(family, ft_hf.NAME, **{name: 0.0})
        status, got = _run_or_refused(lambda: _run(case, model))
        assert status == "ran", f"the refusal advises {name}=0, and flashtriton still refuses: {got}"


# ---------------------------------------------------------------------------------------------- building


@pytest.fixture(scope="module", autouse=True)
def _register():
    ft_hf.register()


def _build(family: Family, implementation: str, **overrides):
    """The family's model with fixed random weights (seed 0), so every implementation gets the same ones.
    from_config stores the implementation in the config it is given: one copy per model."""
    config = copy.deepcopy(family.config())
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    auto = getattr(transformers, family.auto)
    model = auto.from_config(config, attn_implementation=implementation)
    return model.to(DEVICE).train(family.train)


@functools.lru_cache(maxsize=None)
def _reference(family_name: str):
    family = FAMILIES[family_name]
    return _build(family, family.reference)


@functools.lru_cache(maxsize=None)
def _ours(family_name: str):
    """("ran", model) or ("refused", exc): building the model may already refuse."""
    family = FAMILIES[family_name]
    weights = _reference(family_name).state_dict()  # outside: a reference that fails to build is no refusal

    def build():
        model = _build(family, ft_hf.NAME)
        model.load_state_dict(weights)
        return model

    return _run_or_refused(build)


def _to_device(inputs: dict) -> dict:
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _run(case: Case, model, seed: int = 0):
    torch.manual_seed(seed)
    with torch.no_grad():
        return case.run(model, _to_device(case.inputs()))


# -------------------------------------------------------------------------------------------------- test


@pytest.mark.parametrize("name", list(CASES))
def test_family_matches_reference_or_refuses(name):
    case = CASES[name]
    family = FAMILIES[case.family]
    status, built = _ours(case.family)
    if status == "refused":
        assert not case.must_run, f"refused a case that needs nothing flashtriton lacks: {built}"
        _check_advice(built, family, case)
        print(f"[{name}] refused at build: {type(built).__name__}: {built}")
        return
    ours = built
    implementations = _implementations(ours)
    assert all(v == ft_hf.NAME for v in implementations.values()), (
        f"the model built with attn_implementation='flashtriton' uses {implementations}: another kernel "
        "would run under flashtriton's name")

    with _spy() as spy:
        status, got = _run_or_refused(lambda: _run(case, ours))
    routing = _routing(spy)
    if status == "refused":
        assert not case.must_run, f"refused a case that needs nothing flashtriton lacks: {got}\n{routing}"
        _check_advice(got, family, case)
        print(f"[{name}] refused at run: {type(got).__name__}: {got}\n    routing: {routing}")
        return
    assert spy.kernels > 0, f"flashtriton's kernels never ran (sdpa calls: {spy.sdpa}); {routing}"
    assert spy.sdpa == 0, f"torch sdpa ran {spy.sdpa} times inside the flashtriton model; {routing}"
    if case.variants is not None:
        assert spy.variants == set(case.variants), (
            f"the kernels ran {sorted(spy.variants) or 'no variant'}, not {sorted(case.variants) or 'no variant'}; "
            f"{routing}")

    if family.train:  # attention dropout: no reference to compare with; it must at least be applied
        again = _run(case, ours, seed=1)
        assert not torch.equal(got, again), (
            "flashtriton ran a training forward with attention dropout > 0 and two seeds give the same output: "
            f"the dropout was silently ignored; {routing}")
        assert torch.equal(got, _run(case, ours, seed=0)), f"torch.manual_seed does not reproduce the run; {routing}"
        print(f"[{name}] ran with dropout applied; {routing}")
        return

    with _spy() as ref_spy:
        expected = _run(case, _reference(case.family))
    assert ref_spy.kernels == 0, "the reference ran flashtriton's kernels: the comparison would prove nothing"
    if family.reference == "sdpa":  # the spy sees torch's sdpa (so its 0 in the flashtriton run means something)
        assert ref_spy.sdpa > 0, "the sdpa reference never called torch's scaled_dot_product_attention"

    if case.tokens:
        (tokens, logits), (tokens_ref, logits_ref) = got, expected
        assert torch.equal(tokens, tokens_ref), f"generated tokens differ:\n{tokens}\nvs\n{tokens_ref}; {routing}"
        diff = (logits - logits_ref).abs().max().item()
        assert diff <= ATOL, f"same tokens, but the steps' logits differ: max abs diff {diff:.3g}; {routing}"
        print(f"[{name}] ran, same tokens, steps' logits within {diff:.2g}; {routing}")
        return
    assert got.shape == expected.shape
    real = _real_tokens(case.inputs())
    if real is not None:
        real = real.to(got.device)
        got, expected = got[real], expected[real]
    diff = (got - expected).abs().max().item()
    assert diff <= ATOL, f"outputs differ from {family.reference}: max abs diff {diff:.3g}; {routing}"
    print(f"[{name}] ran, max abs diff {diff:.2g}; {routing}")
