"""`hf_alibi.patch_alibi_attention`: BLOOM, MPT and ALiBi Falcon on flashtriton's ALiBi kernels, against the same
model's eager attention (Falcon's SDPA attention: `_models`) on the same weights and inputs (tiny random-weight fp32
models, no downloads): logits on the real positions, greedy tokens with a KV cache past padded prompts, gradients in training; flashtriton's kernels
must have run, and what it does not take (a custom mask, attention probabilities, a model without these layers) is
refused by name."""

from __future__ import annotations

import copy
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashtriton._env import INTERPRET  # noqa: E402
from flashtriton.integrations import hf_alibi  # noqa: E402
from flashtriton.integrations import transformers as ft_hf  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
ATOL = 1e-4
VOCAB, PAD, BOS, EOS = 128, 0, 1, 2
SPECIAL = dict(pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)

FAMILIES = {
    "bloom": lambda: transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, **SPECIAL),
    "bloom_6_heads": lambda: transformers.BloomConfig(vocab_size=VOCAB, hidden_size=48, n_layer=1, n_head=6,
                                                      **SPECIAL),
    "mpt": lambda: transformers.MptConfig(vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
                                          **SPECIAL),
    "mpt_6_heads_clip": lambda: transformers.MptConfig(vocab_size=VOCAB, d_model=48, n_heads=6, n_layers=1,
                                                       max_seq_len=64, attn_config=dict(clip_qkv=0.5,
                                                                                        alibi_bias_max=4),
                                                       **SPECIAL),
    "falcon_alibi": lambda: transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                      num_attention_heads=4, alibi=True, multi_query=False,
                                                      **SPECIAL),
    "falcon_alibi_multi_query": lambda: transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32,
                                                                  num_hidden_layers=1, num_attention_heads=4,
                                                                  alibi=True, multi_query=True, **SPECIAL),
    "falcon_alibi_grouped": lambda: transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                                              num_attention_heads=4, num_kv_heads=2, alibi=True,
                                                              new_decoder_architecture=True, **SPECIAL),
}


def _models(family: str):
    """(reference, patched copy) on the test device, fp32, eval mode, the same weights. The reference runs the
    model's eager attention; Falcon's its SDPA attention, which adds the bias once on every transformers version,
    where the eager FalconAttention of some (5.17) adds it twice: to the scores and again through the 4-D mask the
    model folds it into (`test_falcon_reference_adds_the_bias_once`)."""
    torch.manual_seed(0)
    config = FAMILIES[family]()
    config._attn_implementation = "sdpa" if family.startswith("falcon") else "eager"
    reference = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE).eval()
    patched = copy.deepcopy(reference)
    layers = hf_alibi.patch_alibi_attention(patched)
    assert layers == sum(1 for m in patched.modules() if getattr(m, "_flashtriton_alibi", False)) > 0
    assert hf_alibi.patch_alibi_attention(patched) == 0  # twice: nothing more to patch
    return reference, patched


def _batch(lengths, seqlen, side):
    gen = torch.Generator().manual_seed(sum(lengths) + seqlen)
    ids = torch.randint(3, VOCAB, (len(lengths), seqlen), generator=gen)
    mask = torch.zeros(len(lengths), seqlen, dtype=torch.long)
    for row, n in enumerate(lengths):
        if side == "left":
            mask[row, seqlen - n:] = 1
        else:
            mask[row, :n] = 1
    return ids.masked_fill(mask == 0, PAD).to(DEVICE), mask.to(DEVICE)


@pytest.fixture
def kernel_calls(monkeypatch):
    """How many times flashtriton's dense and varlen entry points ran under hf_alibi."""
    calls = {"dense": 0, "varlen": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            assert kwargs.get("alibi_slopes") is not None and kwargs.get("causal") is True
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(hf_alibi, "flash_attn_func", counting("dense", hf_alibi.flash_attn_func))
    monkeypatch.setattr(ft_hf, "flash_attn_varlen_func", counting("varlen", ft_hf.flash_attn_varlen_func))
    return calls


# every family left-padded; the three models unpadded and right-padded too
LOGIT_CASES = [(family, "left") for family in FAMILIES] + [
    (family, padding) for family in ("bloom", "mpt", "falcon_alibi") for padding in ("none", "right")]


@pytest.mark.parametrize("family,padding", LOGIT_CASES)
def test_patched_alibi_models_match_eager_logits(family, padding, kernel_calls):
    reference, patched = _models(family)
    if padding == "none":
        ids, mask = _batch([11, 11], 11, "left")
    else:
        ids, mask = _batch([11, 5, 8], 11, padding)
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).logits
        got = patched(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert torch.allclose(got[real], want[real], atol=ATOL, rtol=1e-4), \
        f"{family}, {padding}: max |diff| {(got[real] - want[real]).abs().max().item():.3g}"
    assert kernel_calls["varlen" if padding != "none" else "dense"] > 0, kernel_calls


@pytest.mark.parametrize("family", ["bloom", "mpt", "falcon_alibi", "falcon_alibi_grouped"])
def test_patched_alibi_models_generate_eagers_tokens(family, kernel_calls):
    """Greedy decoding with a KV cache from left-padded prompts: each step's one query against the cache."""
    reference, patched = _models(family)
    ids, mask = _batch([9, 4, 7], 9, "left")
    settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    want = reference.generate(input_ids=ids, attention_mask=mask, **settings)
    got = patched.generate(input_ids=ids, attention_mask=mask, **settings)
    assert torch.equal(got, want), f"{family}: {got.tolist()} != {want.tolist()}"
    assert kernel_calls["varlen"] > 0


@pytest.mark.parametrize("family", ["bloom", "mpt", "falcon_alibi_grouped"])
def test_patched_alibi_models_train_like_eager(family, kernel_calls):
    """A training step's loss and gradients (attention dropout off, so both sides are deterministic)."""
    reference, patched = _models(family)
    ids, mask = _batch([10, 6], 10, "right")
    labels = ids.masked_fill(mask == 0, -100)
    losses = []
    for model in (reference, patched):
        model.train()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) < 1e-4, losses
    for (name, a), (_, b) in zip(reference.named_parameters(), patched.named_parameters()):
        if a.grad is not None:
            assert torch.allclose(a.grad, b.grad, atol=1e-4, rtol=1e-3), name


def _alibi_paper_slopes(heads: int) -> torch.Tensor:
    """The ALiBi paper's slopes, BLOOM's: 2^(-8 i / n) for the n = 2^floor(log2 heads) first heads, then every other
    slope of the 2n-head sequence for the rest."""
    n = 2 ** math.floor(math.log2(heads))
    slopes = [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]
    slopes += [2.0 ** (-8.0 * i / (2 * n)) for i in range(1, 2 * (heads - n), 2)]
    return torch.tensor(slopes, dtype=torch.float32)


def test_slopes_are_the_models_own():
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    for heads in (1, 4, 6, 12, 16, 40, 71):
        assert torch.allclose(hf_alibi.bloom_slopes(heads, "cpu"), _alibi_paper_slopes(heads), rtol=1e-6)
        for bias_max in (8, 4):
            bias = build_mpt_alibi_tensor(heads, 16, bias_max)  # (H, 1, 16): slope * (index - 15)
            assert torch.allclose(hf_alibi.mpt_slopes(heads, bias_max, "cpu"), -bias[:, 0, 0] / 15, rtol=1e-6)
            assert torch.allclose(hf_alibi._mpt_layer_slopes(bias), hf_alibi.mpt_slopes(heads, bias_max, "cpu"),
                                  rtol=1e-5)


def _falcon_with_the_older_layer(reference):
    """A copy of an ALiBi Falcon whose attention layers have the older FalconAttention's shape: forward(hidden_states,
    alibi, attention_mask, position_ids, layer_past, head_mask, use_cache, output_attentions, cache_position,
    position_embeddings) returning (out, layer_past), `inv_norm_factor` and no `scaling`, an nn.Dropout module as
    `attention_dropout` (transformers before the bias moved into the mask)."""
    from transformers.models.falcon.modeling_falcon import FalconAttention

    def forward(self, hidden_states, alibi=None, attention_mask=None, position_ids=None, layer_past=None,
                head_mask=None, use_cache=False, output_attentions=False, cache_position=None,
                position_embeddings=None):
        raise AssertionError("patched away")

    older_falcon_attention = type("FalconAttention", (FalconAttention,), {"forward": forward})  # (the patch's name)
    model = copy.deepcopy(reference)
    for module in model.modules():
        if type(module) is FalconAttention:
            module.__class__ = older_falcon_attention
            if hasattr(module, "scaling"):  # (transformers whose layer is the older one already keep theirs)
                module.inv_norm_factor = module.scaling
                del module.scaling
            if not isinstance(module.attention_dropout, torch.nn.Dropout):
                module.attention_dropout = torch.nn.Dropout(module.attention_dropout)
    return model


def test_falcon_reference_adds_the_bias_once():
    """The Falcon reference (its SDPA attention) against ALiBi written out in float64 from the model's own
    projections: one bias per score, slope · key position / √head_dim (as the model was trained), which the
    patched layers reproduce; whatever the eager attention of the installed transformers does."""
    reference, patched = _models("falcon_alibi_multi_query")
    ids, mask = _batch([7, 7], 7, "left")
    layer = next(m for m in reference.modules() if type(m).__name__ == "FalconAttention")
    captured = {}
    hook = layer.register_forward_pre_hook(lambda m, args, kwargs: captured.update(x=args[0] if args else
                                                                                   kwargs["hidden_states"]),
                                           with_kwargs=True)
    out_hook = layer.register_forward_hook(lambda m, args, kwargs, out: captured.update(out=out[0]),
                                           with_kwargs=True)
    with torch.no_grad():
        reference(input_ids=ids, attention_mask=mask)
    hook.remove()
    out_hook.remove()
    x = captured["x"].double()
    heads, d = layer.num_heads, layer.head_dim
    def linear(module, t):
        return torch.nn.functional.linear(t, module.weight.double(),
                                          None if module.bias is None else module.bias.double())

    fused = linear(layer.query_key_value, x).view(*x.shape[:2], heads + 2, d)
    q, k, v = fused[..., :heads, :], fused[..., heads:heads + 1, :], fused[..., heads + 1:, :]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.expand(-1, -1, heads, -1)) / math.sqrt(d)
    slopes = hf_alibi.falcon_slopes(heads, d, x.device).double()
    positions = torch.arange(x.shape[1], device=x.device, dtype=torch.float64)
    scores = scores + slopes[:, None, None] * positions  # slope · key position (/ √d in the slopes)
    scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
    attn = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.expand(-1, -1, heads, -1)).flatten(2)
    want = linear(layer.dense, attn)
    assert torch.allclose(captured["out"].double(), want, atol=1e-5), (captured["out"].double() - want).abs().max()


def test_falcon_layers_of_either_shape(kernel_calls):
    """The patched Falcon layer binds its call to the layer class's own forward: the older shape (the bias beside
    the mask, head_mask, (out, layer_past) returned) gives the same logits and greedy tokens as the current one."""
    reference, patched = _models("falcon_alibi")
    older = _falcon_with_the_older_layer(reference)
    assert hf_alibi.patch_alibi_attention(older) == 2
    ids, mask = _batch([9, 4, 7], 9, "left")
    with torch.no_grad():
        want, got = (m(input_ids=ids, attention_mask=mask).logits for m in (reference, older))
    real = mask.bool()
    assert torch.allclose(got[real], want[real], atol=ATOL, rtol=1e-4)
    assert kernel_calls["varlen"] > 0
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    assert torch.equal(older.generate(input_ids=ids, attention_mask=mask, **settings),
                       reference.generate(input_ids=ids, attention_mask=mask, **settings))
    layer = next(m for m in older.modules() if getattr(m, "_flashtriton_alibi", False))
    hidden = torch.randn(1, 5, 32, device=DEVICE)
    with pytest.raises(NotImplementedError, match="head_mask"):
        layer(hidden, None, None, head_mask=torch.ones(4, device=DEVICE))


def test_what_patch_alibi_attention_refuses():
    _, patched = _models("bloom")
    ids, mask = _batch([6, 6], 6, "left")
    with pytest.raises(NotImplementedError, match="output_attentions"):
        patched(input_ids=ids, attention_mask=mask, output_attentions=True)
    layer = next(m for m in patched.modules() if getattr(m, "_flashtriton_alibi", False))
    hidden = torch.randn(1, 5, 32, device=DEVICE)
    bidirectional = torch.zeros(1, 1, 5, 5, device=DEVICE)  # every key visible to every query: not causal
    with pytest.raises(NotImplementedError, match="causal mask over each row's real tokens"):
        layer(hidden, torch.zeros_like(hidden), None, bidirectional)
    rotary = transformers.AutoModelForCausalLM.from_config(transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, **SPECIAL))
    with pytest.raises(ValueError, match="no ALiBi attention layer"):
        hf_alibi.patch_alibi_attention(rotary)
    with pytest.raises(ValueError, match="no ALiBi attention layer"):
        hf_alibi.patch_alibi_attention(torch.nn.Linear(2, 2))
