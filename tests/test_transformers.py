"""Hugging Face transformers integration: attn_implementation="flashtriton" matches "sdpa".

Tiny randomly initialised models built from configs (no downloads), fp32 (flashtriton's fp32 path uses exact
fp32 dots), on the CPU through the interpreter or on a GPU.
"""

import copy
import importlib.util
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashtriton._env import INTERPRET  # noqa: E402
from flashtriton.integrations import transformers as ft_hf  # noqa: E402

from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config  # noqa: E402
from transformers import AttentionInterface  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
ATOL = 2e-5
HAS_BACKWARD = importlib.util.find_spec("flashtriton.kernels.backward") is not None
TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=128, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
CONFIGS = {
    "llama": lambda **kw: LlamaConfig(**{**TINY, **kw}),
    "qwen2": lambda **kw: Qwen2Config(**{**TINY, "use_sliding_window": False, **kw}),
    "mistral": lambda **kw: MistralConfig(**{**TINY, "sliding_window": None, **kw}),
}


@pytest.fixture(scope="module", autouse=True)
def _register():
    ft_hf.register()


def _pair(kind: str, **overrides):
    """(flashtriton model, sdpa model) with the same random weights, in eval mode, on the test device."""
    config = CONFIGS[kind](**overrides)
    torch.manual_seed(0)
    # from_config stores the implementation in the config it is given: one copy per model
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="flashtriton")
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    ref.load_state_dict(ours.state_dict())
    return ours.to(DEVICE).eval(), ref.to(DEVICE).eval()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def models(request):
    return _pair(request.param)


def _batch(device, lengths=(9, 6, 4), seqlen=9, left=True, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, TINY["vocab_size"], (len(lengths), seqlen), generator=g)
    mask = torch.zeros(len(lengths), seqlen, dtype=torch.long)
    for b, n in enumerate(lengths):
        if left:
            mask[b, seqlen - n:] = 1
        else:
            mask[b, :n] = 1
    ids = ids.masked_fill(mask == 0, TINY["pad_token_id"])
    return ids.to(device), mask.to(device)


def test_register_is_idempotent_and_complete():
    ft_hf.register()
    ft_hf.register()
    assert ft_hf.is_registered()
    assert AttentionInterface()["flashtriton"] is ft_hf.flashtriton_attention_forward
    assert AttentionMaskInterface()["flashtriton"] is ft_hf.flashtriton_mask


def test_from_config_and_set_attn_implementation(device):
    ours, ref = _pair("llama")
    assert ours.config._attn_implementation == "flashtriton"
    ids, _ = _batch(device, lengths=(7,), seqlen=7)
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
        ref.set_attn_implementation("flashtriton")
        assert ref.config._attn_implementation == "flashtriton"
        got = ref(input_ids=ids).logits
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_logits_unpadded(models, device):
    ours, ref = models
    ids, _ = _batch(device, lengths=(9, 9), seqlen=9)
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, ref(input_ids=ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("left", [True, False], ids=["left_pad", "right_pad"])
def test_logits_padded(models, device, left):
    ours, ref = models
    ids, mask = _batch(device, left=left)
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=mask).logits
        expected = ref(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=ATOL, rtol=0)
    assert torch.all(torch.isfinite(got))


def test_generate_padded_batch_matches_sdpa(models, device):
    ours, ref = models
    ids, mask = _batch(device, lengths=(8, 5, 3), seqlen=8)
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=TINY["pad_token_id"])
    with torch.no_grad():
        got = ours.generate(ids, **kwargs)
        expected = ref.generate(ids, **kwargs)
    assert torch.equal(got, expected)


def test_packed_sequences_from_position_ids(device):
    """Batch 1 whose position ids restart: each packed sequence attends only to itself."""
    ours, ref = _pair("qwen2")
    ids, _ = _batch(device, lengths=(10,), seqlen=10, seed=3)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]], device=device)
    with torch.no_grad():
        packed = ours(input_ids=ids, position_ids=position_ids).logits
        first = ref(input_ids=ids[:, :6]).logits
        second = ref(input_ids=ids[:, 6:]).logits
    torch.testing.assert_close(packed, torch.cat([first, second], dim=1), atol=ATOL, rtol=0)


def test_attention_function_with_cache_chunk_and_left_padding(device):
    """Sq < Sk (a chunk of new queries after a cache) with a left-padding mask, vs sdpa with the same mask."""
    torch.manual_seed(0)
    batch, hq, hkv, sq, sk, d = 3, 4, 2, 3, 7, 16
    q = torch.randn(batch, hq, sq, d, device=device)
    k = torch.randn(batch, hkv, sk, d, device=device)
    v = torch.randn(batch, hkv, sk, d, device=device)
    pad = torch.tensor([0, 2, 4], device=device)  # left padding of each sequence
    mask2d = torch.arange(sk, device=device)[None, :] >= pad[:, None]
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, hq // hkv
    out, weights = ft_hf.flashtriton_attention_forward(module, q, k, v, mask2d, scaling=0.3)
    assert weights is None and out.shape == (batch, sq, hq, d)
    # sdpa reference: query i sits at key position sk - sq + i; it sees real keys j <= that position
    causal = torch.arange(sk, device=device)[None, :] <= torch.arange(sk - sq, sk, device=device)[:, None]
    mask4d = (causal[None] & mask2d[:, None, :])[:, None]
    expected, _ = sdpa_attention_forward(module, q, k, v, mask4d, scaling=0.3)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_sliding_window_matches_sdpa(device):
    """A window shorter than the keys (unpadded, left- and right-padded) and one that holds them all."""
    ours, ref = _pair("mistral", sliding_window=4)
    for lengths, seqlen, left in (((8,), 8, True), ((9, 6, 4), 9, True), ((9, 6, 4), 9, False), ((4,), 4, True)):
        ids, mask = _batch(device, lengths=lengths, seqlen=seqlen, left=left)
        with torch.no_grad():
            got = ours(input_ids=ids, attention_mask=mask).logits
            expected = ref(input_ids=ids, attention_mask=mask).logits
        real = mask.bool()
        torch.testing.assert_close(got[real], expected[real], atol=ATOL, rtol=0)


def _eager(q, k, v, visible, scale, softcap=None):
    """transformers' Gemma 2 eager attention (softcap, then the mask) with a (.., Sq, Sk) bool mask."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    module = torch.nn.Module()
    module.num_key_value_groups, module.training = q.shape[1] // k.shape[1], False
    bias = torch.zeros(visible.shape, device=q.device).masked_fill(~visible, torch.finfo(torch.float32).min)
    return eager_attention_forward(module, q, k, v, bias, scaling=scale, softcap=softcap)[0]


def test_softcap_and_window_kwargs_match_eager(device):
    """Without a mask verdict the layer's kwargs decide: sliding_window w is flash-attn's (w - 1, w - 1) (causal:
    (w - 1, 0)), as transformers' flash-attention path passes it; softcap caps the scaled scores before the mask."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 7, 16, device=device) * 3
    k, v = (torch.randn(2, 2, 7, 16, device=device) * 3 for _ in range(2))
    i, j = torch.arange(7, device=device)[:, None], torch.arange(7, device=device)[None, :]
    for causal, window, softcap in ((True, None, 30.0), (True, 3, None), (True, 3, 5.0), (False, 3, 5.0)):
        module = torch.nn.Module()
        module.is_causal = causal
        out, _ = ft_hf.flashtriton_attention_forward(module, q, k, v, None, scaling=0.25, sliding_window=window,
                                                     softcap=softcap)
        visible = (j <= i) if causal else torch.ones(7, 7, dtype=torch.bool, device=device)
        if window is not None:
            visible = visible & ((i - j).abs() < window)
        expected = _eager(q, k, v, visible.expand(2, 1, 7, 7), 0.25, softcap)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0, msg=f"causal={causal} window={window} "
                                                                         f"softcap={softcap}")


def test_window_with_cache_chunk_and_packed_rows(device):
    """A window over a chunk of queries after a cache (Sq < Sk, left padding) and over packed rows."""
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.is_causal = True
    q = torch.randn(3, 4, 3, 16, device=device)
    k, v = (torch.randn(3, 2, 9, 16, device=device) for _ in range(2))
    mask2d = torch.arange(9, device=device)[None, :] >= torch.tensor([0, 2, 4], device=device)[:, None]
    out, _ = ft_hf.flashtriton_attention_forward(module, q, k, v, mask2d, scaling=0.3, sliding_window=4, softcap=2.0)
    position = torch.arange(6, 9, device=device)[:, None]  # query i is key 6 + i
    visible = (torch.arange(9, device=device)[None, :] <= position) & (torch.arange(9, device=device) > position - 4)
    expected = _eager(q, k, v, (visible[None] & mask2d[:, None, :])[:, None], 0.3, 2.0)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)

    positions = torch.tensor([list(range(3, 13)) + list(range(6))], device=device)  # two documents
    q, k, v = (torch.randn(1, h, 16, 16, device=device) for h in (4, 2, 2))
    out, _ = ft_hf.flashtriton_attention_forward(module, q, k, v, None, scaling=0.25, sliding_window=5,
                                                 position_ids=positions)
    ids = torch.arange(16, device=device) >= 10
    i, j = torch.arange(16, device=device)[:, None], torch.arange(16, device=device)[None, :]
    visible = (ids[:, None] == ids[None, :]) & (j <= i) & (j > i - 5)
    torch.testing.assert_close(out, _eager(q, k, v, visible[None, None], 0.25), atol=ATOL, rtol=0)


def test_window_over_padding_between_tokens_is_refused(device):
    module = torch.nn.Module()
    q = torch.randn(1, 2, 6, 8, device=device)
    holes = torch.tensor([[True, True, False, True, True, True]], device=device)
    with pytest.raises(NotImplementedError, match="contiguous"):
        ft_hf.flashtriton_attention_forward(module, q, q, q, holes, sliding_window=2)
    out, _ = ft_hf.flashtriton_attention_forward(module, q, q, q, holes, sliding_window=6)  # hides no key
    assert out.shape == (1, 6, 2, 8)


def test_unsupported_features_raise(device):
    q = torch.randn(1, 4, 5, 16, device=device)
    k = torch.randn(1, 2, 5, 16, device=device)
    module = torch.nn.Module()
    with pytest.raises(NotImplementedError, match="one logit per query head"):
        ft_hf.flashtriton_attention_forward(module, q, k, k, None, s_aux=torch.zeros(1, 4, device=device))
    with pytest.raises(NotImplementedError, match="position biases"):
        ft_hf.flashtriton_attention_forward(module, q, k, k, None, position_bias=torch.zeros(1, 4, 5, 5))
    with pytest.raises(NotImplementedError, match="4-D|2-D"):
        ft_hf.flashtriton_attention_forward(module, q, k, k, torch.ones(1, 1, 5, 5, dtype=torch.bool, device=device))


def test_attention_dropout_runs_in_training(device):
    """transformers passes the module's attention dropout in train mode: it reaches the kernels (two seeds, two
    outputs; one seed, one output), and eval mode (dropout 0.0) equals the dropout-free call."""
    q = torch.randn(1, 4, 5, 16, device=device)
    k = torch.randn(1, 2, 5, 16, device=device)
    module = torch.nn.Module()
    torch.manual_seed(0)
    a, _ = ft_hf.flashtriton_attention_forward(module, q, k, k, None, dropout=0.1)
    b, _ = ft_hf.flashtriton_attention_forward(module, q, k, k, None, dropout=0.1)
    torch.manual_seed(0)
    c, _ = ft_hf.flashtriton_attention_forward(module, q, k, k, None, dropout=0.1)
    assert not torch.equal(a, b) and torch.equal(a, c)
    ours, _ = _pair("llama", attention_dropout=0.1)
    ids, _ = _batch(device, lengths=(5,), seqlen=5)
    ours.train()
    ours(input_ids=ids).logits.sum().backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in ours.parameters())



def test_unpadding_is_kept_for_the_same_unchanged_mask(device):
    """The layers of a forward share one padding mask (or alternate between two): its unpadding (two host syncs)
    is computed once while the tensor is unchanged, and again after an in-place change or for another tensor."""
    from flashtriton.integrations.transformers import _unpad_indices

    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool, device=device)
    first = _unpad_indices(mask)
    assert _unpad_indices(mask) is first
    mask[1, 2] = True  # in place: the version counter moves
    indices, cu, longest = _unpad_indices(mask)
    assert indices.tolist() == [0, 1, 2, 4, 5, 6] and cu.tolist() == [0, 3, 6] and longest == 3
    other = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool, device=device)
    indices, cu, longest = _unpad_indices(other)
    assert indices.tolist() == [0, 4, 5, 6, 7] and cu.tolist() == [0, 1, 5] and longest == 4
    # layers that alternate between two masks keep both
    kept_mask, kept_other = _unpad_indices(mask), _unpad_indices(other)
    assert _unpad_indices(mask) is kept_mask and _unpad_indices(other) is kept_other

def _bert_dropout():
    """benchmarks/bert_dropout.py, the BERT fine-tuning step of issue 29, as a module."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bert_dropout.py"
    spec = importlib.util.spec_from_file_location("bert_dropout", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bert_training_step_with_attention_dropout(device):
    """A tiny BERT (its default dropout probabilities) trains on flashtriton: eval losses equal sdpa's, and in
    train mode the loss is finite, moves with the seed, differs from the eval loss and repeats with a seed."""
    bd = _bert_dropout()
    models = bd.build("tiny", device)
    ids, mask, labels = bd.make_batch(models[0].config.vocab_size, 3, 12, device)
    eval_ours, eval_sdpa = bd.eval_losses(models, ids, mask, labels, autocast=False)
    assert abs(eval_ours - eval_sdpa) <= 1e-4
    (ours, _) = bd.seeded_losses(models, ids, mask, labels, 3, autocast=False)
    assert all(math.isfinite(x) for x in ours) and len(set(ours)) == 3 and eval_ours not in ours
    torch.manual_seed(1)
    assert bd.step(models[0], ids, mask, labels, autocast=False) == ours[1]


@pytest.mark.gpu
def test_bert_base_training_step_matches_sdpa_in_expectation():
    """BERT-base (default config, random weights), 16 x 128 tokens, bf16 autocast: the step's loss over 32 seeds
    equals sdpa's in expectation and spread, and the eval losses agree (benchmarks/bert_dropout.py)."""
    bd = _bert_dropout()
    r = bd.run("base", seeds=32, batch=16, seqlen=128, rep=0)
    assert bd.verdicts(r, eval_atol=2e-2) == dict(eval=True, mean=True, spread=True), bd.report(r, 2e-2)


def _training_step_grads(models, device) -> list[dict]:
    """Each model's parameter gradients after one training step on the same padded batch (the two models
    share weights), with the same parameters having gradients in both."""
    ids, mask = _batch(device, lengths=(7, 4), seqlen=7)
    grads = []
    for model in models:
        model.train()
        model.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    return grads


@pytest.mark.skipif(not HAS_BACKWARD, reason="flashtriton's backward kernel is not in this tree yet")
@pytest.mark.parametrize("kind, overrides", [("llama", {}), ("mistral", {"sliding_window": 3})],
                         ids=["llama", "mistral_window3"])
def test_training_step_gradients_match_sdpa(device, kind, overrides):
    ours, ref = _pair(kind, **overrides)
    grads = _training_step_grads((ours, ref), device)
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-4, rtol=1e-4, msg=name)


# ------------------------------------------------------------------ the mask function: honoured or refused

from transformers import masking_utils as mu  # noqa: E402

from flashtriton.integrations import hf_masks  # noqa: E402


def _analyse(fn, q_length, kv_length, q_offset=0, kv_offset=0, batch=2, use_vmap=False):
    return hf_masks.analyse(fn, batch, q_length, kv_length, q_offset, kv_offset, use_vmap=use_vmap)


def test_mask_analysis_plain_and_derived_kinds():
    assert _analyse(mu.causal_mask_function, 6, 6) == hf_masks.MaskSpec(hf_masks.CAUSAL)
    assert _analyse(mu.bidirectional_mask_function, 6, 9) == hf_masks.MaskSpec(hf_masks.FULL)
    # a composed function equal to full attention (Gemma 3's bidirectional text overlay)
    spec = _analyse(mu.or_masks(mu.causal_mask_function, lambda *a: torch.tensor(True)), 5, 5, use_vmap=True)
    assert spec.kind == hf_masks.FULL and spec.derived
    # a chunk that holds every key is plain causal attention, a smaller one is refused
    assert _analyse(mu.chunked_causal_mask_function(8, torch.zeros(2, dtype=torch.long)), 8, 8).kind == "causal"
    with pytest.raises(NotImplementedError, match="neither causal nor full"):
        _analyse(mu.chunked_causal_mask_function(4, torch.zeros(2, dtype=torch.long)), 8, 8)


def test_mask_analysis_sliding_window_from_offsets():
    """transformers' window w (q - w < k <= q) is flash-attn's (w - 1, 0); |q - k| <= w is (w, w); a window that
    hides no key of the call is None."""
    window = mu.sliding_window_causal_mask_function(4)
    assert _analyse(window, 4, 4) == hf_masks.MaskSpec(hf_masks.CAUSAL, derived=True)  # the keys fit in it
    assert _analyse(window, 5, 5).window == (3, 0)
    assert _analyse(window, 1, 9, q_offset=8).window == (3, 0)  # decoding over a full cache
    # a sliding cache keeps the last keys only (kv_offset > 0): decoding over them is causal attention
    assert _analyse(window, 1, 4, q_offset=8, kv_offset=5) == hf_masks.MaskSpec(hf_masks.CAUSAL, derived=True)
    assert _analyse(window, 2, 5, q_offset=8, kv_offset=5).window == (3, 0)  # two queries past a sliding cache
    local = mu.sliding_window_bidirectional_mask_function(2)  # ModernBERT's local attention
    assert _analyse(local, 6, 6) == hf_masks.MaskSpec(hf_masks.FULL, derived=True, window=(2, 2))
    assert _analyse(local, 3, 3).window is None
    for fn, q_len, kv_len, q_off, kv_off in ((window, 5, 5, 0, 0), (window, 2, 5, 8, 5), (local, 6, 6, 0, 0)):
        spec = _analyse(fn, q_len, kv_len, q_off, kv_off)
        q = torch.arange(q_len)[:, None] + q_off
        kv = torch.arange(kv_len)[None, :] + kv_off
        left, right = spec.window
        band = (kv >= q - left) & ((kv <= q) if spec.kind == hf_masks.CAUSAL else (kv <= q + right))
        assert torch.equal(band, fn(0, 0, q, kv)), (fn, spec)


def test_mask_analysis_finds_windows_in_composed_functions():
    """An arbitrary function is evaluated: a band of keys around each query is a window (Gemma 3's bidirectional
    window overlay, |q - k| < w, or-ed onto its causal window), anything else is refused."""
    overlay = lambda b, h, q, kv: (q - kv).abs() < 3  # noqa: E731
    gemma3_bidirectional = mu.or_masks(mu.sliding_window_causal_mask_function(3), overlay)
    assert _analyse(gemma3_bidirectional, 8, 8) == hf_masks.MaskSpec(hf_masks.FULL, derived=True, window=(2, 2))
    causal_band = mu.and_masks(mu.causal_mask_function, lambda b, h, q, kv: q - kv < 3)
    assert _analyse(causal_band, 8, 8).window == (2, 0)
    with pytest.raises(NotImplementedError, match="neither causal nor full"):
        _analyse(mu.and_masks(mu.causal_mask_function, lambda b, h, q, kv: q - kv != 1), 8, 8)


def test_packed_rows_with_a_window():
    positions = torch.tensor([[5, 6, 7, 0, 1, 2, 3, 4, 5, 6]])
    ids = mu.find_packed_sequence_indices(positions)
    remap = getattr(mu, "remap_positions_for_packed_sequence", None)
    base = mu.sliding_window_causal_mask_function(4)
    fn = mu.and_masks(remap(base, positions) if remap else base, mu.packed_sequence_mask_function(ids))
    spec = _analyse(fn, 10, 10, batch=1)
    assert spec.kind == hf_masks.CAUSAL and spec.window == (3, 0) and torch.equal(spec.segments, ids)
    mask = ft_hf.flashtriton_mask(batch_size=1, q_length=10, kv_length=10, mask_function=fn)
    assert getattr(mask, "_flashtriton_window") == (3, 0)


def test_mask_analysis_image_and_prefix_overlays_are_refused():
    groups = torch.tensor([[-1, 0, 0, 0, -1, -1], [-1, -1, -1, -1, -1, -1]])  # tokens 1..3 of row 0: an image

    def blocks(ids):  # an image block attends to itself both ways (as Gemma 3's and PaliGemma's overlays do)
        def inner(b, h, q, kv):
            return (ids[b, q] == ids[b, kv]) & (ids[b, q] >= 0)
        return inner

    image = mu.or_masks(mu.causal_mask_function, blocks(groups))
    with pytest.raises(NotImplementedError, match=r"batch 0, query 1, key 2 is visible"):
        _analyse(image, 6, 6, use_vmap=True)
    no_image = mu.or_masks(mu.causal_mask_function, blocks(groups[1:]))
    assert _analyse(no_image, 6, 6, batch=1, use_vmap=True).kind == hf_masks.CAUSAL


def test_mask_analysis_packed_rows():
    positions = torch.tensor([[5, 6, 7, 0, 1, 2], [0, 1, 0, 1, 2, 3]])
    ids = mu.find_packed_sequence_indices(positions)
    remap = getattr(mu, "remap_positions_for_packed_sequence", None)  # transformers >= 5.2x remaps positions
    bases = [mu.causal_mask_function] + ([remap(mu.causal_mask_function, positions)] if remap else [])
    for base in bases:
        fn = mu.and_masks(base, mu.packed_sequence_mask_function(ids))
        spec = _analyse(fn, 6, 6)
        assert spec.kind == hf_masks.CAUSAL and torch.equal(spec.segments, ids)
        mask = ft_hf.flashtriton_mask(batch_size=2, q_length=6, kv_length=6, mask_function=fn)
        assert mask.dtype == torch.int32 and mask.shape == (2, 1, 1, 6)  # 4-D: passed through as a prepared mask
        assert torch.equal(-1 - mask[:, 0, 0], ids.to(torch.int32))


def test_mask_function_static_cache_and_alignment(device):
    # a static cache of 16 slots, 5 written, one new query at position 5: keys end at the last query
    mask = ft_hf.flashtriton_mask(batch_size=2, q_length=1, kv_length=16, q_offset=5,
                                  mask_function=mu.causal_mask_function)
    assert mask.shape == (2, 6) and bool(mask.all()) and getattr(mask, "_flashtriton_dense")
    # no padding: a dense key mask that carries the verdict (a layer's is_causal does not decide), and no window of
    # its own (the layers' sliding_window holds); one query that sees every key: None
    plain = ft_hf.flashtriton_mask(batch_size=2, q_length=4, kv_length=4, mask_function=mu.causal_mask_function,
                                  device=device)
    assert plain.shape == (2, 4) and bool(plain.all()) and getattr(plain, "_flashtriton_dense")
    assert getattr(plain, "_flashtriton_kind") == hf_masks.CAUSAL and not hasattr(plain, "_flashtriton_window")
    assert ft_hf.flashtriton_mask(batch_size=2, q_length=1, kv_length=4, q_offset=3,
                                  mask_function=mu.causal_mask_function) is None
    q, k = torch.randn(2, 2, 4, 8, device=device), torch.randn(2, 2, 4, 8, device=device)
    module = torch.nn.Module()
    module.is_causal = False  # as PEGASUS-X's decoder layers: the mask's causal verdict holds
    out, _ = ft_hf.flashtriton_attention_forward(module, q, k, k, plain)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    padding = torch.tensor([[True] * 4, [False, True, True, True]], device=device)
    assert torch.equal(ft_hf.flashtriton_mask(batch_size=2, q_length=4, kv_length=4, attention_mask=padding,
                                              mask_function=mu.causal_mask_function, device=device), padding)
    # a mask it made, passed in again (generate's prepared mask through the model's own mask function): kept, window
    # and all, whatever the model's own mask function says
    windowed = ft_hf.flashtriton_mask(batch_size=2, q_length=4, kv_length=4, attention_mask=padding, device=device,
                                      mask_function=mu.and_masks(mu.causal_mask_function, mu.sliding_window_overlay(2)))
    assert getattr(windowed, "_flashtriton_window") == (1, 0)
    assert ft_hf.flashtriton_mask(batch_size=2, q_length=4, kv_length=4, attention_mask=windowed, device=device,
                                  mask_function=mu.causal_mask_function) is windowed
    # queries past the keys: a marker that refuses when a layer receives it (transformers builds unused masks too)
    marker = ft_hf.flashtriton_mask(batch_size=1, q_length=2, kv_length=4, q_offset=6,
                                    mask_function=mu.causal_mask_function, device=device)
    assert marker.dtype == torch.int8
    q = torch.randn(1, 2, 2, 8, device=device)
    module = torch.nn.Module()
    with pytest.raises(NotImplementedError, match="queries as the last keys"):
        ft_hf.flashtriton_attention_forward(module, q, torch.randn(1, 2, 4, 8, device=device),
                                            torch.randn(1, 2, 4, 8, device=device), marker)


def test_unused_unexpressible_mask_does_not_refuse_the_model(device):
    """Qwen2-MoE without sliding windows still builds a (width 0) sliding mask that no layer reads."""
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(**{**TINY, "intermediate_size": 64}, moe_intermediate_size=32,
                            shared_expert_intermediate_size=32, num_experts=2, num_experts_per_tok=1,
                            use_sliding_window=False)
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="flashtriton")
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    ref.load_state_dict(ours.state_dict())
    ids, _ = _batch(device, lengths=(9,), seqlen=9)
    with torch.no_grad():
        got, expected = ours.to(device).eval()(input_ids=ids).logits, ref.to(device).eval()(input_ids=ids).logits
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def _reference(module, q, k, v, mask4d, scale):
    return sdpa_attention_forward(module, q, k, v, mask4d, scaling=scale, is_causal=False)[0]


def test_cross_attention_to_a_padded_encoder_keeps_every_query(device):
    """Non-causal attention with a key mask: every decoder query (fewer, as many or more than the encoder's
    tokens) attends to its row's real encoder tokens."""
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = False, 2
    enc = torch.tensor([[True] * 7, [True] * 4 + [False] * 3], device=device)  # row 1: right-padded encoder
    for sq in (3, 7, 10):
        q = torch.randn(2, 4, sq, 16, device=device)
        k, v = (torch.randn(2, 2, 7, 16, device=device) for _ in range(2))
        out, _ = ft_hf.flashtriton_attention_forward(module, q, k, v, enc, scaling=0.25)
        expected = _reference(module, q, k, v, enc[:, None, None, :].expand(2, 1, sq, 7), 0.25)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_packed_rows_from_position_ids_in_a_batch_of_two(device):
    """Position ids restart in both rows, one row starting mid-document: every sequence sees only itself."""
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    positions = torch.tensor([list(range(5, 15)) + list(range(14)), list(range(12)) * 2], device=device)
    q = torch.randn(2, 4, 24, 16, device=device)
    k, v = (torch.randn(2, 2, 24, 16, device=device) for _ in range(2))
    out, _ = ft_hf.flashtriton_attention_forward(module, q, k, v, None, scaling=0.25, position_ids=positions)
    starts = torch.nn.functional.pad(torch.diff(positions, dim=-1) != 1, (1, 0))
    ids = starts.cumsum(-1)
    same = ids[:, :, None] == ids[:, None, :]
    causal = torch.ones(24, 24, dtype=torch.bool, device=device).tril()
    expected = _reference(module, q, k, v, (same & causal)[:, None], 0.25)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_position_ids_under_a_mask_of_several_rows_follow_the_mask(device):
    """Position ids that restart under a mask the model built for two rows without packing (gpt-oss builds its
    masks without the position ids): the mask is what eager, sdpa and flash attention apply, so each row attends
    causally across the restart; one row reads its restarts, as transformers' flash attention does."""
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    positions = torch.tensor([list(range(10)) + list(range(14)), list(range(3, 27))], device=device)
    q = torch.randn(2, 4, 24, 16, device=device)
    k, v = (torch.randn(2, 2, 24, 16, device=device) for _ in range(2))
    mask = ft_hf.flashtriton_mask(batch_size=2, q_length=24, kv_length=24, mask_function=mu.causal_mask_function,
                                  device=device)
    out, _ = ft_hf.flashtriton_attention_forward(module, q, k, v, mask, scaling=0.25, position_ids=positions)
    causal = torch.ones(24, 24, dtype=torch.bool, device=device).tril()
    torch.testing.assert_close(out, _reference(module, q, k, v, causal[None, None].expand(2, 1, 24, 24), 0.25),
                               atol=ATOL, rtol=0)
    one = ft_hf.flashtriton_mask(batch_size=1, q_length=24, kv_length=24, mask_function=mu.causal_mask_function,
                                 device=device)
    out, _ = ft_hf.flashtriton_attention_forward(module, q[:1], k[:1], v[:1], one, scaling=0.25,
                                                 position_ids=positions[:1])
    same = torch.arange(24, device=device) < 10
    packed = causal & (same[:, None] == same[None, :])
    torch.testing.assert_close(out, _reference(module, q[:1], k[:1], v[:1], packed[None, None], 0.25),
                               atol=ATOL, rtol=0)


class _NoFlash(transformers.PreTrainedModel):
    _supports_flash_attn = False


def test_models_flashtriton_cannot_run_are_refused_when_built():
    from transformers import Gemma3ForConditionalGeneration, GPTNeoForCausalLM, PaliGemmaForConditionalGeneration

    # transformers 5.2x marks these two unable to use flash kernels (their image / prefix masks); 5.17 does not,
    # and then their masks are refused when a layer receives them (tests/test_hf_families.py)
    for cls in (Gemma3ForConditionalGeneration, PaliGemmaForConditionalGeneration, _NoFlash):
        if not cls._supports_flash_attn:
            with pytest.raises(ValueError, match="_supports_flash_attn = False"):
                ft_hf.refuse_unsupported_model(cls)
    with pytest.raises(ValueError, match="GPTNeoFlashAttention2"):
        ft_hf.refuse_unsupported_model(GPTNeoForCausalLM)
    from transformers import GPTNeoConfig

    with pytest.raises(ValueError, match="flashtriton"):
        AutoModelForCausalLM.from_config(GPTNeoConfig(hidden_size=32, num_layers=1, num_heads=4, vocab_size=64,
                                                      attention_types=[[["global"], 1]]),
                                         attn_implementation="flashtriton")


def test_falcon_with_alibi_is_refused_when_built():
    from transformers import FalconConfig

    tiny = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
    with pytest.raises(ValueError, match=r"config\.alibi=True cannot use attn_implementation='flashtriton'"):
        AutoModelForCausalLM.from_config(FalconConfig(**tiny, alibi=True), attn_implementation="flashtriton")
    from transformers.models.falcon import modeling_falcon

    if ft_hf._private_flash_path(modeling_falcon.__name__):  # transformers < 5.25: its FalconFlashAttention2
        with pytest.raises(ValueError, match="FalconFlashAttention2"):
            AutoModelForCausalLM.from_config(FalconConfig(**tiny), attn_implementation="flashtriton")
        return
    model = AutoModelForCausalLM.from_config(FalconConfig(**tiny, alibi=False), attn_implementation="flashtriton")
    assert model.config._attn_implementation == "flashtriton"


def _gpt_oss_pair(device, **overrides):
    """(flashtriton, eager) tiny gpt-oss models with the same weights, sinks of a size that matters (N(0, 1)
    rather than the init's N(0, 0.02)), or None where this transformers' gpt-oss refuses every name but its hub
    kernel (5.0)."""
    from transformers import GptOssConfig

    tiny = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, vocab_size=TINY["vocab_size"], num_local_experts=2, num_experts_per_tok=1, sliding_window=3,
                layer_types=["sliding_attention", "full_attention"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # no YaRN for a few positions
    config = GptOssConfig(**{**tiny, **overrides})
    torch.manual_seed(0)
    try:
        ours = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="flashtriton")
    except ValueError as refused:
        assert "flashtriton" in str(refused)
        return None
    with torch.no_grad():
        for layer in ours.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(config.num_attention_heads))
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
    ref.load_state_dict(ours.state_dict())
    return ours.to(device).eval(), ref.to(device).eval()


def test_hub_kernel_swap_keeps_flashtriton_and_runs_sinks(device):
    """gpt-oss lists hub kernels for any flash-named implementation; flashtriton stays and runs its sinks
    (learnable_sink) with its sliding window, padded, equal to eager."""
    pair = _gpt_oss_pair(device)
    if pair is None:
        return
    ours, ref = pair
    assert ours.config._attn_implementation == "flashtriton"
    ids, mask = _batch(device, lengths=(7, 4), seqlen=7)
    with torch.no_grad():
        got, expected = (m(input_ids=ids, attention_mask=mask).logits for m in (ours, ref))
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-4, rtol=0)


@pytest.mark.skipif(not HAS_BACKWARD, reason="flashtriton's backward kernel is not in this tree yet")
def test_training_step_sink_gradients_match_eager(device):
    """A gpt-oss training step (sinks on every layer, a window of 3 on the first, left padding): every
    parameter's gradient, the sinks' (flashtriton's dsink) among them, is eager's."""
    pair = _gpt_oss_pair(device)
    if pair is None:
        return
    grads = _training_step_grads(pair, device)
    sinks = [n for n in grads[0] if n.endswith("self_attn.sinks")]
    assert len(sinks) == 2 and all(grads[0][n].abs().max() > 1e-3 for n in sinks)
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-4, rtol=1e-4, msg=name)


def test_refusal_advice_works():
    """The advice names what transformers accepts: 'eager' where sdpa is not."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention, Gemma2Config

    q = torch.randn(1, 4, 5, 8)
    gemma = Gemma2Attention(Gemma2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, head_dim=8),
                            layer_idx=0)
    with pytest.raises(NotImplementedError, match="attn_implementation='eager' instead") as err:
        ft_hf.flashtriton_attention_forward(gemma, q, q, q, None, softcap=50.0,
                                            position_bias=torch.zeros(1, 4, 5, 5))
    assert "sdpa" not in str(err.value)
