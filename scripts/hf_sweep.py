"""A broad automatic sweep of attn_implementation="flashtriton" over transformers' model families.

    TRITON_INTERPRET=1 PYTHONPATH=src .venv/bin/python scripts/hf_sweep.py --minutes 60      # CPU (interpreter)
    PYTHONPATH=src .venv/bin/python scripts/hf_sweep.py --device cuda                          # a GPU
    ... scripts/hf_sweep.py --only qwen3,mixtral --no-resume                                   # a few model types
    ... scripts/hf_sweep.py --seqlen 100 --hard                                                # multi-tile lengths

tests/test_hf_families.py checks ~45 families by hand; this script walks transformers' auto mappings (causal LM,
seq2seq LM, masked LM, image-text-to-text, image classification, base models) and, for every model type, builds a
tiny config from the config class's defaults (hidden 64, 2 layers, 4 heads / 2 kv heads, head dim 16, vocab 128,
16x16 images; sliding windows of 8, lists per layer cut to 2 layers keeping one of each layer type), random weights
(seed 0), fp32. It runs the same weights and inputs with "flashtriton" and with "sdpa" ("eager" where the model has
no sdpa, or where sdpa fails to build) and judges each case by the contract of tests/test_hf_families.py:

- matched:   flashtriton's kernels launched, torch's sdpa never ran in the flashtriton model, every config names
             flashtriton, and the outputs match (max abs diff <= ATOL on the real positions; identical greedy tokens);
- refused:   a NotImplementedError / ValueError naming flashtriton (when built or when run);
- MISMATCH:  it ran and the answer differs (max abs diff, the case);
- NOT_RUN:   it "ran" but flashtriton's kernels never launched, sdpa ran inside it, or a config names another
             implementation;
- ERROR:     any other exception from the flashtriton model where the reference ran;
- skipped:   no tiny config / no generic inputs / the reference itself fails on the case (why is recorded).

Cases (at the default --seqlen 12): text models (a) 2 x 12 tokens, (b) left-padded rows (12 and 7 real tokens),
(c) right-padded rows; causal LMs and seq2seq LMs also (d) greedy generate of 4 tokens from left-padded prompts
(seq2seq: a padded encoder). Seq2seq forward cases pad the encoder and compare every decoder position. Vision
models: one batch of 2 images. Vision-language models run their text path (no images). A generate whose tokens
differ only after a near tie (the logits agree up to the diverging step, top-2 gap <= 10 ATOL) counts as matched.
--hard adds, for causal LMs, a prefill in two calls through one DynamicCache, a static-cache generate and packed
documents (position ids that restart, no attention mask); and for every model the sdpa/eager model switched with
set_attn_implementation("flashtriton") on its first padded forward case. Where torch's sdpa runs inside the
flashtriton model as often as inside the eager one (a pooling head calling it directly), it is noted, not failed.

Results go to --out (JSON, rewritten after every model, so an interrupted sweep resumes where it stopped; a model
that killed the process is recorded as CRASH) and a readable --summary. One process, one thread by default.

    ... hf_sweep.py --statuses skipped --hard --out results.json     # re-run the skipped ones of an earlier sweep
    ... hf_sweep.py --merge first.json later.json --out all.json      # add a later sweep's cases to the first's
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import signal
import sys
import time
import traceback
import warnings
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers.models.auto import modeling_auto  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402

import test_hf_families as T  # noqa: E402  (the families test: its spy, routing and implementation checks)
from flashtriton.integrations import transformers as ft_hf  # noqa: E402

ATOL = T.ATOL
W, F, L, H, KV, D = 64, 128, 2, 4, 2, 16  # hidden, ffn, layers, heads, kv heads, head dim
VOCAB, PAD, BOS, EOS = 128, 0, 1, 2
ID_HIGH = 100  # random input ids in [3, ID_HIGH): special tokens (image, audio, ...) are moved to 100..127
SEQ, SHORT = 12, 7  # --seqlen N: SEQ = N, SHORT = 3 N / 5, WINDOW = N / 3, GEN = N - 2 (multi-tile sequences)
GEN, GEN_SHORT = 10, 6  # the generate cases' prompts
IMAGE, PATCH = 16, 4
WINDOW = 8
POSITIONS = 64

# the heads, in priority order: one per model type, the first mapping that has it
HEADS = [
    ("causal_lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("seq2seq_lm", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    ("masked_lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    ("image_text_to_text", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"),
    ("image_classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
    ("base", "MODEL_MAPPING_NAMES"),
]

# ------------------------------------------------------------------------------------------- tiny configs

_WIDTH = {"hidden_size", "d_model", "n_embd", "embed_dim", "dim", "model_dim", "d_embed", "hidden_dim",
          "embedding_size", "word_embed_proj_dim", "n_embed", "width"}
_FFN = {"intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "n_inner", "ffn_hidden_size",
        "inner_hidden_size", "feed_forward_size", "intermediate_dim", "mlp_dim", "dim_feedforward", "ffn_size",
        "decoder_intermediate_size", "encoder_intermediate_size", "inner_dim"}
_LAYERS = {"num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers",
           "num_decoder_layers", "num_encoder_layers", "encoder_num_hidden_layers", "decoder_num_hidden_layers",
           "depth", "num_text_layers", "encoder_num_layers", "decoder_num_layers", "text_layers"}
_HEADS = {"num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
          "decoder_attention_heads", "encoder_num_attention_heads", "decoder_num_attention_heads",
          "encoder_num_heads", "decoder_num_heads", "num_query_heads"}
_KV_HEADS = {"num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "num_kv_groups",
             "encoder_num_key_value_heads", "decoder_num_key_value_heads", "n_head_kv", "num_head_kv"}
_HEAD_DIM = {"head_dim", "d_kv", "kv_channels", "attention_head_dim", "attention_head_size", "d_head",
             "head_size", "dim_head", "key_value_proj_dim", "global_head_dim"}
_POSITIONS = {"max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "n_ctx",
              "max_target_positions", "max_seq_length", "seq_length", "block_size_positions"}
_MOE = {"num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4, "n_experts": 4,
        "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2, "num_selected_experts": 2, "moe_top_k": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
        "n_shared_experts": 1, "num_shared_experts": 1, "kv_lora_rank": 16, "q_lora_rank": 16,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_head_dim": 24}
_VISION = {"image_size": IMAGE, "patch_size": PATCH, "num_channels": 3}
_KEEP = object()
# what a generic shrink cannot guess: constructor-only arguments
_EXTRA = {name: dict(global_head_dim=2 * D, hidden_size_per_layer_input=0)
          for name in ("gemma4_text", "gemma4_unified_text", "gemma4_assistant", "gemma4_unified_assistant",
                       "diffusion_gemma")}
_SKIP_FIELDS = {"architectures", "id2label", "label2id", "transformers_version", "dtype", "torch_dtype", "problem_type",
                "num_labels", "layer_types", "rope_parameters", "rope_scaling", "tokenizer_class",
                "task_specific_params"}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _TokenPool:
    def __init__(self):
        self.next = VOCAB - 1

    def take(self) -> int:
        value, self.next = self.next, self.next - 1
        return value


def _tiny_value(name: str, value, width0, ffn0, pool: _TokenPool):
    low = name.lower()
    if name in _WIDTH and _is_int(value):
        return W
    if name in _FFN and (_is_int(value) or value is None):
        return F if _is_int(value) else _KEEP
    if name in _LAYERS and _is_int(value):
        return L
    if name in _HEADS and _is_int(value):
        return H
    if name in _KV_HEADS and (_is_int(value) or (value is None and name == "num_key_value_heads")):
        return KV
    if name in _HEAD_DIM and (_is_int(value) or (value is None and name == "head_dim")):
        return D
    if name in _MOE and _is_int(value):
        return _MOE[name]
    if name in _VISION and _is_int(value):
        return _VISION[name]
    if name == "vocab_size" or (low.startswith("vocab_size") and _is_int(value)) or low.endswith("_vocab_size"):
        return VOCAB if _is_int(value) or value is None else _KEEP
    if name in _POSITIONS and _is_int(value):
        return POSITIONS
    if name in ("sliding_window", "sliding_window_size") and (_is_int(value) or value is None):
        return WINDOW
    if name == "use_sliding_window" and isinstance(value, bool):
        return True  # Qwen2-style: max_window_layers (1) full layers first, then sliding ones
    if name == "max_window_layers" and _is_int(value):
        return 1
    if name in ("rotary_dim", "rotary_emb_dim", "rope_dim") and _is_int(value):
        return D // 2
    if name in ("moe_k",) and _is_int(value):
        return 2
    if name in ("attn_layer_indices", "attention_layer_indices") and (value is None or isinstance(value, list)):
        return [1]  # hybrids (Bamba...): the second of the two layers is an attention layer
    if isinstance(value, float) and any(s in low for s in ("dropout", "pdrop", "drop_prob", "layerdrop", "drop_path")):
        return 0.0
    if name == "pad_token_id":
        return PAD
    if name == "bos_token_id":
        return BOS
    if name == "eos_token_id":
        return EOS if (_is_int(value) or value is None or isinstance(value, list)) else _KEEP
    if name in ("decoder_start_token_id",):
        return BOS
    if (low.endswith("_token_id") or low.endswith("_token_index") or low.endswith("_token_idx")) and _is_int(value):
        return pool.take() if value >= ID_HIGH else (value if value < 3 else pool.take())
    if _is_int(value) and value > 1 and width0 and value == width0 and any(
            s in low for s in ("hidden", "dim", "size", "embd", "width", "d_model")) and not any(
            s in low for s in ("vocab", "position", "image", "patch", "window", "chunk", "bucket", "state", "conv")):
        return W
    if _is_int(value) and value > 1 and ffn0 and value == ffn0 and any(
            s in low for s in ("intermediate", "ffn", "ff", "inner", "mlp")):
        return F
    return _KEEP


def _get(config, name, default=None):
    """getattr that also survives per-layer attributes of heterogeneous configs (a RuntimeError there)."""
    try:
        return getattr(config, name, default)
    except Exception:  # noqa: BLE001
        return default


def _first(config, names):
    for n in names:
        v = _get(config, n)
        if _is_int(v):
            return n, v
    return None, None


def _mentions(config_cls, word: str) -> bool:
    """Whether the modeling file next to config_cls's configuration file mentions `word`."""
    module = sys.modules.get(config_cls.__module__.replace(".configuration_", ".modeling_"))
    if module is None:
        try:
            import importlib

            module = importlib.import_module(config_cls.__module__.replace(".configuration_", ".modeling_"))
        except Exception:  # noqa: BLE001
            return False
    try:
        return word in inspect.getsource(module)
    except (OSError, TypeError):
        return False


def _layer_selection(layer_types, n: int) -> list[int]:
    """Indices of `n` layers (or more, up to 4, to keep one of each layer type), in order."""
    keep = []
    for i, t in enumerate(layer_types):
        if t not in [layer_types[j] for j in keep]:
            keep.append(i)
    keep = keep[:4]
    i = 0
    while len(keep) < n and i < len(layer_types):
        if i not in keep:
            keep.append(i)
        i += 1
    return sorted(keep)


def _fields(config_cls, default) -> dict:
    names = {}
    try:
        params = inspect.signature(config_cls.__init__).parameters
    except (TypeError, ValueError):
        params = {}
    for name in params:
        if name in ("self", "kwargs", "args"):
            continue
        names[name] = _get(default, name, params[name].default)
    for name, value in vars(default).items():
        if not name.startswith("_"):
            names.setdefault(name, value)
    return names


def tiny_config(config_cls, default=None, pool: Optional[_TokenPool] = None, depth: int = 0):
    """A tiny instance of config_cls: its defaults with the size fields shrunk (module doc)."""
    pool = pool or _TokenPool()
    default = default if default is not None else config_cls()
    fields = _fields(config_cls, default)
    _, width0 = _first(default, sorted(_WIDTH))
    _, ffn0 = _first(default, sorted(_FFN))
    layers_name, layers0 = _first(default, ["num_hidden_layers", "n_layer", "num_layers", "n_layers", "depth",
                                            "decoder_layers", "encoder_layers"])
    sub_configs = dict(getattr(config_cls, "sub_configs", {}) or {})
    kwargs = {}
    for name, value in fields.items():
        if name in _SKIP_FIELDS or name in sub_configs:
            continue
        if isinstance(value, transformers.PreTrainedConfig):
            sub_configs.setdefault(name, type(value))
            continue
        new = _tiny_value(name, value, width0, ffn0, pool)
        if new is not _KEEP:
            kwargs[name] = new
    # rope: mrope sections scaled to the new head dim; per-dimension factor lists (longrope) dropped
    rope = _get(default, "rope_parameters", None)
    if isinstance(rope, dict):
        rope = copy.deepcopy(rope)
        factor = rope.get("partial_rotary_factor", _get(default, "partial_rotary_factor", 1.0)) or 1.0
        pairs = max(3, int(D * factor) // 2)
        if "mrope_section" in rope or _mentions(config_cls, "mrope_section"):  # the model's default is for 128
            sec = list(rope.get("mrope_section") or [16, 24, 24])
            total = sum(sec)
            new = [max(1, round(s * pairs / total)) for s in sec]
            new[0] += pairs - sum(new)
            rope["mrope_section"] = new
        if any(k in rope for k in ("short_factor", "long_factor")):
            rope = {"rope_type": "default", "rope_theta": rope.get("rope_theta", 10000.0)}
        kwargs["rope_parameters"] = rope
    # per-layer lists: cut to the kept layers (one of each layer type)
    if layers_name and layers0 and layers0 > L:
        types = getattr(default, "layer_types", None)
        keep = _layer_selection(list(types), L) if isinstance(types, (list, tuple)) and len(types) == layers0 \
            else list(range(L))
        for name, value in fields.items():
            if name in sub_configs or name in ("id2label", "label2id"):
                continue
            if isinstance(value, (list, tuple)) and len(value) == layers0:
                kwargs[name] = type(value)(value[i] for i in keep)
        for name in (_LAYERS & set(fields)):
            if _is_int(fields[name]) and fields[name] == layers0:
                kwargs[name] = len(keep)
    for name, sub_cls in sub_configs.items():
        sub_default = getattr(default, name, None)
        if sub_default is None:
            continue
        if isinstance(sub_default, dict):
            sub_default = sub_cls(**sub_default) if sub_cls is not transformers.AutoConfig else None
            if sub_default is None:
                continue
        kwargs[name] = tiny_config(type(sub_default), copy.deepcopy(sub_default), pool, depth + 1)
    kwargs.update(_EXTRA.get(getattr(config_cls, "model_type", ""), {}))
    if "qk_rope_head_dim" in fields:  # MLA: head_dim is the rotary part; as many kv heads as heads
        if "head_dim" in kwargs:
            kwargs["head_dim"] = _MOE["qk_rope_head_dim"]
        if "num_key_value_heads" in kwargs:
            kwargs["num_key_value_heads"] = H
    return config_cls(**kwargs)


# ------------------------------------------------------------------------------------------------ inputs


def _ids(batch, seqlen, seed=1):
    return T._ids(batch, seqlen, seed, high=ID_HIGH)


def _text(seqlen=None, lengths=None, left=True):
    seqlen = seqlen or SEQ
    ids = _ids(2, seqlen)
    if lengths is None:
        return {"input_ids": ids}
    mask = T._mask(lengths, seqlen, left)
    return {"input_ids": ids.masked_fill(mask == 0, PAD), "attention_mask": mask}


def _packed():
    """Two rows of SEQ tokens, no attention mask: row 0 two documents (SHORT tokens, then the rest), row 1 one
    document that starts mid-way (positions 3 ...); the mask comes from the position ids' restarts."""
    inputs = T._packed([(0, SHORT), (0, SEQ - SHORT)], [(3, SEQ + 3)])
    inputs["input_ids"] = inputs["input_ids"] % (ID_HIGH - 3) + 3
    return inputs


def _seq2seq(left, dec_len=8):
    mask = T._mask((SEQ, SHORT), SEQ, left)
    return {"input_ids": _ids(2, SEQ).masked_fill(mask == 0, PAD), "attention_mask": mask,
            "decoder_input_ids": _ids(2, dec_len, seed=4)}


def _pixels(config):
    vision = getattr(config, "vision_config", None) or config
    size = getattr(vision, "image_size", IMAGE)
    size = size[0] if isinstance(size, (list, tuple)) else (size if _is_int(size) else IMAGE)
    channels = getattr(vision, "num_channels", 3)
    channels = channels if _is_int(channels) else 3
    return torch.randn(2, channels, size, size, generator=torch.Generator().manual_seed(2))


def cases_for(head: str, config, model_cls) -> list[tuple[str, dict, str]]:
    """(case name, inputs, kind); --hard adds a switched model (set_attn_implementation) on the first padded
    (else the first) forward case."""
    cases = _cases_for(head, config, model_cls)
    if HARD and cases:
        forwards = [c for c in cases if c[2] in ("forward", "forward_seq2seq")]
        padded = [c for c in forwards if "attention_mask" in c[1]]
        base = (padded or forwards or [None])[0]
        if base is not None:
            cases.append(("switched_" + base[0], base[1], "switch"))
    return cases


def _cases_for(head: str, config, model_cls) -> list[tuple[str, dict, str]]:
    """(case name, inputs, kind) with kind 'forward', 'forward_seq2seq' or 'generate'."""
    params = inspect.signature(model_cls.forward).parameters
    if head in ("image_classification",) or ("input_ids" not in params and "pixel_values" in params):
        return [("images", {"pixel_values": _pixels(config)}, "forward")]
    if "input_ids" not in params:
        return []
    if head == "seq2seq_lm" or (getattr(config, "is_encoder_decoder", False) and head != "causal_lm"):
        if "decoder_input_ids" not in params:
            return []
        out = [("enc_right_padded", _seq2seq(left=False), "forward_seq2seq"),
               ("enc_left_padded", _seq2seq(left=True), "forward_seq2seq")]
        if head == "seq2seq_lm":
            gen = _seq2seq(left=False)
            gen.pop("decoder_input_ids")
            out.append(("generate_padded_encoder", gen, "generate"))
        return out
    out = [("plain", _text(), "forward"), ("left_padded", _text(lengths=(SEQ, SHORT), left=True), "forward"),
           ("right_padded", _text(lengths=(SEQ, SHORT), left=False), "forward")]
    if head in ("causal_lm", "image_text_to_text") and hasattr(model_cls, "generate"):
        out.append(("generate_left_padded", _text(seqlen=GEN, lengths=(GEN, GEN_SHORT), left=True), "generate"))
        if HARD:  # a cache filled in two calls; a static cache (keys past the written ones)
            out.append(("chunked_prefill_left_padded", _text(lengths=(SEQ, SHORT), left=True), "chunked"))
            out.append(("generate_static_cache", _text(seqlen=GEN, lengths=(GEN, GEN_SHORT), left=True),
                        "generate_static"))
    if HARD and head == "causal_lm" and "position_ids" in params:  # documents back to back, as in packed training
        out.append(("packed_documents", _packed(), "forward"))
    return out


HARD = False  # --hard: the cache cases too
CASES: set = set()  # --cases: only these


# ---------------------------------------------------------------------------------------------- running


class Timeout(BaseException):  # not an Exception: model code's `except Exception` must not swallow it
    pass


CURRENT: dict = {}  # the record being filled (kept on a timeout)


def _alarm(signum, frame):
    raise Timeout("per-model time limit")


def _main_output(out) -> Optional[torch.Tensor]:
    for name in ("logits", "last_hidden_state", "prediction_logits", "start_logits"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(out, (tuple, list)):
        for value in out:
            if isinstance(value, torch.Tensor):
                return value
    if hasattr(out, "to_tuple"):
        for value in out.to_tuple():
            if isinstance(value, torch.Tensor):
                return value
    return None


def _run(model, inputs, kind, device):
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    torch.manual_seed(0)
    with torch.no_grad():
        if kind in ("generate", "generate_static"):
            extra = {"cache_implementation": "static"} if kind == "generate_static" else {}
            out = model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False, num_beams=1,
                                 pad_token_id=PAD, output_logits=True, return_dict_in_generate=True, **extra)
            return out.sequences.cpu(), torch.stack(list(out.logits), 1).float().cpu()
        if kind == "chunked":  # prefill in two calls through one DynamicCache (7 tokens, then 5)
            ids, mask = inputs["input_ids"], inputs["attention_mask"]
            cache = transformers.DynamicCache(config=model.config)
            kw = {T._cache_kwarg(model): cache, "use_cache": True}
            first = _main_output(model(input_ids=ids[:, :SHORT], attention_mask=mask[:, :SHORT], **kw))
            second = _main_output(model(input_ids=ids[:, SHORT:], attention_mask=mask, **kw))
            return torch.cat([first, second], dim=1).float().cpu()
        out = _main_output(model(**inputs))  # "forward", "forward_seq2seq", "switch"
        if out is None:
            raise RuntimeError("no tensor output")
        return out.float().cpu()


def _compare(kind, inputs, got, expected) -> tuple[bool, str, float]:
    """(matched, detail, max abs diff)."""
    if kind in ("generate", "generate_static"):
        (seq_a, log_a), (seq_b, log_b) = got, expected
        if seq_a.shape != seq_b.shape:
            return False, f"sequence shapes {tuple(seq_a.shape)} vs {tuple(seq_b.shape)}", float("inf")
        steps = min(log_a.shape[1], log_b.shape[1])
        new_a, new_b = seq_a[:, -steps:], seq_b[:, -steps:]
        same = torch.equal(seq_a, seq_b)
        if same:
            diff = (log_a[:, :steps] - log_b[:, :steps]).abs().max().item()
            return diff <= ATOL, f"same tokens, step logits max abs diff {diff:.3g}", diff
        first = int((new_a != new_b).any(0).nonzero()[0]) if (new_a != new_b).any() else 0
        diff = (log_a[:, :first + 1] - log_b[:, :first + 1]).abs().max().item()
        # a near tie at the diverging step with logits that agree is not the integration's fault
        top = log_b[:, first].topk(2, dim=-1).values
        gap = (top[:, 0] - top[:, 1]).min().item()
        tie = diff <= ATOL and gap <= 10 * ATOL
        return tie, (f"tokens differ from step {first}; logits up to it max abs diff {diff:.3g}, top-2 gap "
                     f"{gap:.3g}{' (a tie)' if tie else ''}\n  got {seq_a.tolist()}\n  ref {seq_b.tolist()}"), diff
    if got.shape != expected.shape:
        return False, f"shapes {tuple(got.shape)} vs {tuple(expected.shape)}", float("inf")
    mask = inputs.get("attention_mask")
    real = None
    if (kind in ("forward", "chunked", "switch") and mask is not None and got.dim() >= 2
            and tuple(got.shape[:2]) == tuple(mask.shape)):
        real = mask.bool()
    a, b = (got[real], expected[real]) if real is not None else (got, expected)
    finite = torch.isfinite(a) & torch.isfinite(b)
    if not bool(finite.all()) and not torch.equal(torch.isnan(a), torch.isnan(b)):
        return False, "non-finite values differ", float("inf")
    diff = (a[finite] - b[finite]).abs().max().item() if bool(finite.any()) else 0.0
    scale = b[finite].abs().max().item() if bool(finite.any()) else 0.0
    return diff <= ATOL, f"max abs diff {diff:.3g} (reference max |x| {scale:.3g})" + (
        "" if real is not None or mask is None else " (all positions)"), diff


def _refusal(exc) -> bool:
    return isinstance(exc, (NotImplementedError, ValueError)) and "flashtriton" in str(exc).lower()


def _short(exc, limit=400) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[:limit] + "..."


def _build(model_cls, config, implementation, device):
    config = copy.deepcopy(config)
    torch.manual_seed(0)
    model = model_cls._from_config(config, attn_implementation=implementation)
    return model.to(device).eval()


def sweep_one(model_type, head, class_name, device) -> dict:
    rec: dict[str, Any] = {"model_type": model_type, "head": head, "class": class_name, "cases": {}}
    CURRENT["rec"] = rec
    model_cls = getattr(transformers, class_name, None)
    if model_cls is None:
        return dict(rec, status="skipped", why=f"transformers has no {class_name}")
    rec["supports_flash_attn"] = bool(getattr(model_cls, "_supports_flash_attn", False))
    rec["supports_attention_backend"] = bool(getattr(model_cls, "_supports_attention_backend", False))
    try:
        config_cls = CONFIG_MAPPING[model_type]
    except KeyError:
        config_cls = None
    own = getattr(model_cls, "config_class", None)
    if isinstance(own, type) and issubclass(own, transformers.PreTrainedConfig) and own is not config_cls:
        config_cls = own  # e.g. Qwen3_5ForCausalLM under model type qwen3_5 takes the text config
    if config_cls is None:
        return dict(rec, status="skipped", why="no config class")
    try:
        config = tiny_config(config_cls)
    except Exception as exc:  # noqa: BLE001
        return dict(rec, status="skipped", why=f"tiny config failed: {_short(exc)}")
    # flashtriton first: a build-time refusal needs no reference
    try:
        ours = _build(model_cls, config, ft_hf.NAME, device)
        ours_build_error = None
    except Exception as exc:  # noqa: BLE001
        if _refusal(exc):
            return dict(rec, status="refused", why=f"at build: {_short(exc, 600)}")
        ours, ours_build_error = None, exc
    reference_name = "sdpa" if getattr(model_cls, "_supports_sdpa", False) else "eager"
    try:
        reference = _build(model_cls, config, reference_name, device)
    except Exception as exc:  # noqa: BLE001
        if reference_name == "sdpa":
            try:
                reference_name = "eager"
                reference = _build(model_cls, config, reference_name, device)
            except Exception as exc2:  # noqa: BLE001
                return dict(rec, status="skipped", why=f"reference build failed: {_short(exc2)}")
        else:
            return dict(rec, status="skipped", why=f"reference build failed: {_short(exc)}")
    rec["reference"] = reference_name
    if ours_build_error is not None:
        return dict(rec, status="ERROR", why=f"flashtriton build failed where {reference_name} builds: "
                                             f"{_short(ours_build_error, 800)}")
    try:
        missing = ours.load_state_dict(reference.state_dict(), strict=False)
        if missing.missing_keys or missing.unexpected_keys:
            rec["state_dict_note"] = f"missing {missing.missing_keys[:3]} unexpected {missing.unexpected_keys[:3]}"
    except Exception as exc:  # noqa: BLE001
        return dict(rec, status="skipped", why=f"weights do not transfer: {_short(exc)}")
    impls = T._implementations(ours)
    rec["implementations"] = impls
    cases = [c for c in cases_for(head, config, model_cls) if not CASES or c[0] in CASES]
    if not cases:
        return dict(rec, status="skipped", why="no generic inputs for this model")
    for name, inputs, kind in cases:
        case: dict[str, Any] = {}
        rec["cases"][name] = case
        try:
            with T._spy() as ref_spy:
                expected = _run(reference, inputs, kind, device)
        except Exception as exc:  # noqa: BLE001
            case.update(status="skipped", why=f"reference fails: {_short(exc)}")
            continue
        model, model_impls = ours, impls
        spy = T.Spy()
        try:
            if kind == "switch":  # the sdpa/eager model switched with set_attn_implementation("flashtriton")
                model = copy.deepcopy(reference)
                model.set_attn_implementation(ft_hf.NAME)
                model_impls = T._implementations(model)
            with T._spy() as spy:
                got = _run(model, inputs, kind, device)
        except Exception as exc:  # noqa: BLE001
            routing = T._routing(spy)
            if _refusal(exc):
                case.update(status="refused", why=_short(exc, 600), routing=routing)
            else:
                case.update(status="ERROR", why=_short(exc, 800), routing=routing,
                            trace="".join(traceback.format_exception(exc)[-6:])[-2500:])
            continue
        routing = T._routing(spy)
        case.update(routing=routing, variants=sorted(spy.variants), kernels=spy.kernels)
        problems = []
        if spy.kernels == 0 and reference_name == "sdpa" and ref_spy.sdpa == 0 and not spy.attention_calls:
            case.update(status="skipped", why="no attention layer ran in this tiny config (the sdpa reference "
                                              "never called torch's sdpa either)", routing=routing)
            continue
        if spy.kernels == 0:
            problems.append("flashtriton's kernels never launched")
        if spy.sdpa:  # hard-coded in the model (a pooling head...) when eager calls it as often
            eager_sdpa = None
            try:
                eager = _build(model_cls, config, "eager", device)
                eager.load_state_dict(reference.state_dict(), strict=False)
                with T._spy() as eager_spy:
                    _run(eager, inputs, kind, device)
                eager_sdpa = eager_spy.sdpa
            except Exception:  # noqa: BLE001
                pass
            if eager_sdpa == spy.sdpa:
                case["note"] = (f"torch sdpa ran {spy.sdpa} times, as in the eager model: the model calls it "
                                "outside the AttentionInterface for every implementation")
            else:
                problems.append(f"torch sdpa ran {spy.sdpa} times inside the flashtriton model (eager: {eager_sdpa})")
        if not all(v == ft_hf.NAME for v in model_impls.values()):
            problems.append(f"configs name {model_impls}")
        if ref_spy.kernels:
            problems.append("the reference launched flashtriton kernels")
        ok, detail, diff = _compare(kind, inputs, got, expected)
        case["detail"], case["diff"] = detail, diff
        if problems:
            case.update(status="NOT_RUN", why="; ".join(problems))
        elif ok:
            case["status"] = "matched"
        else:
            case["status"] = "MISMATCH"
            # is it sdpa's quirk? compare with eager too
            if reference_name == "sdpa" and kind in ("forward", "forward_seq2seq", "switch"):
                try:
                    eager = _build(model_cls, config, "eager", device)
                    eager.load_state_dict(reference.state_dict(), strict=False)
                    e_out = _run(eager, inputs, kind, device)
                    case["vs_eager"] = _compare(kind, inputs, got, e_out)[1]
                    case["sdpa_vs_eager"] = _compare(kind, inputs, expected, e_out)[1]
                except Exception as exc:  # noqa: BLE001
                    case["vs_eager"] = f"eager failed: {_short(exc)}"
    return _judge(rec)


def _judge(rec: dict) -> dict:
    """The model's status from its cases' (the worst one wins)."""
    statuses = [c.get("status", "unfinished") for c in rec["cases"].values()]
    for status in ("ERROR", "MISMATCH", "NOT_RUN", "unfinished"):
        if status in statuses:
            rec["status"] = "TIMEOUT" if status == "unfinished" else status
            if status != "unfinished":
                rec.pop("why", None)
            break
    else:
        if "matched" in statuses:
            rec["status"] = "matched" if "refused" not in statuses else "partly_refused"
            rec.pop("why", None)
        elif "refused" in statuses:
            rec["status"] = "refused"
        else:
            rec["status"] = "skipped"
            rec["why"] = "every case's reference fails"
    return rec


def merge(results: dict, other: dict) -> dict:
    """Add the cases of a later sweep (`other`, e.g. --hard --cases ...) to `results`' records of the same model
    types; a case name both have keeps the earlier one and gets the later one as `name@2`."""
    for model_type, rec in other.items():
        old = results.get(model_type)
        if old is None or not old.get("cases") or old.get("status") in ("refused", "TIMEOUT", "CRASH"):
            results[model_type] = rec
            continue
        if rec.get("status") in ("TIMEOUT", "CRASH") and not rec.get("cases"):
            old.setdefault("notes", []).append(f"later sweep: {rec['status']} {rec.get('why', '')}")
            continue
        for name, case in rec.get("cases", {}).items():
            key = name if name not in old["cases"] or old["cases"][name] == case else f"{name}@2"
            old["cases"][key] = case
        _judge(old)
    return results


# ---------------------------------------------------------------------------------------------- the plan


def _covered_model_types() -> set[str]:
    covered = set()
    for family in T.FAMILIES.values():
        try:
            covered.add(family.config().model_type)
        except BaseException:  # noqa: BLE001 - pytest.skip is a BaseException
            pass
    return covered


def plan(covered: set[str]) -> list[tuple[str, str, str]]:
    chosen: dict[str, tuple[str, str]] = {}
    for head, mapping in HEADS:
        for model_type, class_name in getattr(modeling_auto, mapping, {}).items():
            if isinstance(class_name, (list, tuple)):
                class_name = class_name[0]
            chosen.setdefault(model_type, (head, class_name))

    def order(item):
        model_type, (head, class_name) = item
        cls = getattr(transformers, class_name, None)
        flash = bool(getattr(cls, "_supports_flash_attn", False))
        return (model_type in covered, not flash, [h for h, _ in HEADS].index(head), model_type)

    return [(mt, head, cn) for mt, (head, cn) in sorted(chosen.items(), key=order)]


# ------------------------------------------------------------------------------------------------- output


def summarize(results: dict) -> str:
    recs = list(results.values())
    by = {}
    for r in recs:
        by.setdefault(r["status"], []).append(r)
    lines = [f"flashtriton HF sweep: transformers {transformers.__version__}, torch {torch.__version__}",
             f"{len(recs)} model types swept: " + ", ".join(f"{k} {len(v)}" for k, v in sorted(by.items())), ""]
    for status in ("MISMATCH", "ERROR", "NOT_RUN", "CRASH", "TIMEOUT"):
        for r in by.get(status, []):
            lines.append(f"== {status}: {r['model_type']} ({r['class']}, reference {r.get('reference')})")
            if r.get("why"):
                lines.append(f"   {r['why']}")
            for name, c in r.get("cases", {}).items():
                if c.get("status", "unfinished") in ("matched",):
                    lines.append(f"   [{name}] matched ({c.get('detail', '')})")
                    continue
                status = c.get("status", "unfinished")
                lines.append(f"   [{name}] {status}: {c.get('why', '')} {c.get('detail', '')}".rstrip())
                for k in ("vs_eager", "sdpa_vs_eager", "routing"):
                    if c.get(k):
                        lines.append(f"      {k}: {c[k]}")
            lines.append("")
    lines.append("== partly refused (ran some cases, refused others)")
    for r in by.get("partly_refused", []):
        refused = {n: c["why"][:200] for n, c in r["cases"].items() if c.get("status", "unfinished") == "refused"}
        lines.append(f"   {r['model_type']} ({r['class']}): refused {refused}")
    lines.append("")
    lines.append("== matched")
    for r in by.get("matched", []):
        variants = sorted({v for c in r["cases"].values() for v in c.get("variants", [])})
        ran = [n for n, c in r["cases"].items() if c.get("status", "unfinished") == "matched"]
        skipped = {n: c["why"][:100] for n, c in r["cases"].items() if c.get("status", "unfinished") == "skipped"}
        lines.append(f"   {r['model_type']} ({r['class']}, vs {r.get('reference')}): {', '.join(ran)}"
                     + (f"; variants {variants}" if variants else "")
                     + (f"; case skipped {skipped}" if skipped else ""))
    lines.append("")
    lines.append("== refused")
    for r in by.get("refused", []):
        why = r.get("why") or "; ".join(sorted({c.get("why", "")[:240] for c in r["cases"].values()
                                                if c.get("status", "unfinished") == "refused"}))
        lines.append(f"   {r['model_type']} ({r['class']}): {why[:300]}")
    lines.append("")
    lines.append("== skipped")
    for r in by.get("skipped", []):
        lines.append(f"   {r['model_type']} ({r['class']}): {str(r.get('why'))[:240]}")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/hf_sweep_results.json")
    parser.add_argument("--summary", default="/tmp/hf_sweep_summary.txt")
    parser.add_argument("--minutes", type=float, default=60.0, help="stop starting new models after this long")
    parser.add_argument("--per-model", type=int, default=120, help="seconds per model (signal.alarm)")
    parser.add_argument("--only", default="", help="comma-separated model types")
    parser.add_argument("--include-covered", action="store_true",
                        help="also sweep the model types tests/test_hf_families.py covers (last)")
    parser.add_argument("--no-resume", action="store_true")
    parser.add_argument("--device", default="cpu" if T.INTERPRET else "cuda")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hard", action="store_true",
                        help="causal LMs: also a chunked prefill through a DynamicCache, a static-cache generate "
                             "and packed documents")
    parser.add_argument("--cases", default="", help="comma-separated case names to run (default: all)")
    parser.add_argument("--seqlen", type=int, default=12,
                        help="tokens a sequence (default 12: one tile); longer ones span several of the kernels' "
                             "tiles, with the padded rows 3/5 as long, windows a third and prompts 2 shorter")
    parser.add_argument("--merge", nargs="+", default=[],
                        help="merge these result files' cases into --out (first the earlier), write --summary, stop")
    parser.add_argument("--statuses", default="",
                        help="with --out of an earlier sweep: re-run only the model types that had these statuses "
                             "(e.g. skipped,matched); their new records replace the old ones")
    args = parser.parse_args()

    global HARD, CASES, SEQ, SHORT, WINDOW, GEN, GEN_SHORT, POSITIONS
    HARD = args.hard
    if args.seqlen != 12:
        SEQ, SHORT, WINDOW = args.seqlen, args.seqlen * 3 // 5, max(8, args.seqlen // 3)
        GEN, GEN_SHORT, POSITIONS = args.seqlen - 2, (args.seqlen - 2) // 2, max(64, 2 * args.seqlen + 16)
    CASES = set(filter(None, args.cases.split(",")))
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    ft_hf.register()

    results: dict = {}
    if args.merge:
        for path in args.merge:
            with open(path) as fh:
                results = merge(results, json.load(fh)) if results else json.load(fh)
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1, default=str)
        with open(args.summary, "w") as fh:
            fh.write(summarize(results))
        print(f"merged {len(args.merge)} files into {args.out} and {args.summary}")
        return
    if not args.no_resume and os.path.exists(args.out):
        with open(args.out) as fh:
            results = json.load(fh)
    current_file = args.out + ".current"
    if os.path.exists(current_file):  # the previous process died inside this model
        with open(current_file) as fh:
            crashed = json.load(fh)
        if crashed["model_type"] not in results:
            results[crashed["model_type"]] = dict(crashed, status="CRASH", why="the process died in this model",
                                                  cases={})
        os.remove(current_file)

    covered = _covered_model_types()
    todo = plan(covered)
    rerun = set()
    if args.statuses:
        statuses = set(args.statuses.split(","))
        rerun = {mt for mt, r in results.items() if r.get("status") in statuses}
        todo = [t for t in todo if t[0] in rerun]
    elif args.only:
        wanted = set(args.only.split(","))
        todo = [t for t in todo if t[0] in wanted]
        rerun = wanted
    elif not args.include_covered:
        todo = [t for t in todo if t[0] not in covered]
    start = time.time()
    signal.signal(signal.SIGALRM, _alarm)
    for model_type, head, class_name in todo:
        if model_type in results and model_type not in rerun:
            continue
        rerun.discard(model_type)
        if time.time() - start > args.minutes * 60:
            print(f"time is up after {len(results)} models", flush=True)
            break
        with open(current_file, "w") as fh:
            json.dump({"model_type": model_type, "head": head, "class": class_name}, fh)
        t0 = time.time()
        CURRENT.clear()
        signal.alarm(args.per_model)
        try:
            rec = sweep_one(model_type, head, class_name, args.device)
        except Timeout:
            rec = CURRENT.get("rec") or {"model_type": model_type, "head": head, "class": class_name, "cases": {}}
            rec.update(status="TIMEOUT", why=f"over {args.per_model} s (cases done are kept)")
            for case in rec.get("cases", {}).values():
                case.setdefault("status", "unfinished")
        except Exception as exc:  # noqa: BLE001 - the sweep's own failure: recorded, never fatal
            rec = {"model_type": model_type, "head": head, "class": class_name, "status": "skipped",
                   "why": f"sweep error: {_short(exc)}", "cases": {}}
        finally:
            signal.alarm(0)
        rec["seconds"] = round(time.time() - t0, 1)
        results[model_type] = rec
        os.remove(current_file)
        with open(args.out + ".tmp", "w") as fh:  # atomically: a reader never sees half a file
            json.dump(results, fh, indent=1, default=str)
        os.replace(args.out + ".tmp", args.out)
        cases = " ".join(f"{n}:{c.get('status', 'unfinished')}" for n, c in rec.get("cases", {}).items())
        print(f"{rec['seconds']:6.1f}s {model_type:28s} {rec['status']:9s} {cases} {str(rec.get('why', ''))[:150]}",
              flush=True)
    with open(args.summary, "w") as fh:
        fh.write(summarize(results))
    print(f"wrote {args.out} and {args.summary}")


if __name__ == "__main__":
    main()
