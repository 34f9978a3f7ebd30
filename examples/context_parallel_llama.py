"""Train a Llama-shaped Hugging Face model with its sequence sharded over a torch.distributed group.

Every rank holds the whole model and the same batch; it keeps its zigzag shard of the tokens (input ids, labels,
position ids: `flashtriton.parallel.shard`) and runs the model on it. The one change to the model is its attention
function: `ring_attention_forward` (registered with transformers as "ring_attention") passes the K/V shards round
the group, so that every shard's queries attend to the whole sequence. The rest of the model acts on its own
tokens and is data-parallel over the same ranks (DistributedDataParallel averages the gradients).

    torchrun --nproc-per-node 8 examples/context_parallel_llama.py --seqlen 131072 --steps 10   # GPUs, NCCL
    TRITON_INTERPRET=1 torchrun --nproc-per-node 2 examples/context_parallel_llama.py --device cpu --tiny

It prints the loss of each step and the tokens per second of the whole group (after the first step, which
compiles the kernels). tests/test_parallel.py checks one step against the same model on the whole sequence.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from flashtriton import parallel

NAME = "ring_attention"  # (no "flash" in it: transformers would take it for a flash-attention flavour)
LAYOUT = "zigzag"  # equal causal work on every rank
IGNORE = -100  # transformers' label of a position without a next token


def ring_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                           sliding_window=None, softcap=None, is_causal=None, s_aux=None, group=None, **kwargs):
    """transformers' attention-function signature, on this rank's shard: query (B, Hq, n, D), key and value
    (B, Hkv, n, D) -> ((B, n, Hq, D), None). `group`: the process group (a kwarg of the model's forward);
    sliding_window, softcap and s_aux (gpt-oss' sinks) as transformers' flash-attention path passes them."""
    if attention_mask is not None:
        raise NotImplementedError("ring_attention_forward takes unpadded sequences (pack documents instead)")
    if dropout:
        raise NotImplementedError("ring_attention_forward: attention dropout is not taken in the ring")
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = parallel.ring_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                  causal=bool(causal), group=group, layout=LAYOUT, softmax_scale=scaling,
                                  window_size=window, softcap=float(softcap or 0.0), learnable_sink=s_aux)
    return out, None


def register() -> None:
    """Register the attention function, and a mask function that builds no mask (the ring masks by position)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, ring_attention_forward)
    AttentionMaskInterface.register(NAME, lambda *args, **kwargs: None)


def tiny_config(**overrides):
    """A Llama of a few thousand parameters (tests, the interpreter)."""
    from transformers import LlamaConfig

    fields = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False)
    return LlamaConfig(**{**fields, **overrides})


def llama_config(seqlen: int, layers: int):
    """Llama-3-8B's layer shape (hidden 4096, 32 query / 8 kv heads of 128) with `layers` layers."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=seqlen,
                       rope_theta=500000.0, tie_word_embeddings=False)


def build_model(config, device, dtype, seed: int = 0):
    """The same initial weights on every rank (one seed), attention through the ring."""
    from transformers import AutoModelForCausalLM

    register()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.set_attn_implementation(NAME)
    if model.config._attn_implementation != NAME:
        raise RuntimeError(f"transformers kept attention {model.config._attn_implementation!r}, not {NAME!r}")
    return model.to(device)


def labels_of(input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token labels of the whole sequence, made before sharding (a shard's last token's label lies on
    another rank)."""
    labels = torch.full_like(input_ids, IGNORE)
    labels[:, :-1] = input_ids[:, 1:]
    return labels


def sharded_loss(model, input_ids: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's share of the whole sequence's mean next-token loss: the sum over its tokens divided by the count
    over all tokens, times the world size (DistributedDataParallel averages the ranks' gradients, so that the
    gradient is the whole loss's)."""
    labels = labels_of(input_ids)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    ids, lab, pos = (parallel.shard(t, group, LAYOUT) for t in (input_ids, labels, positions))
    logits = model(input_ids=ids, position_ids=pos, group=group, use_cache=False).logits
    total = (labels != IGNORE).sum()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), lab.flatten(), ignore_index=IGNORE,
                                             reduction="sum")
    return loss / total * dist.get_world_size(group)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, default=32768, help="tokens of the whole sequence")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="the tiny config (CPU, the interpreter)")
    ap.add_argument("--no-checkpointing", action="store_true", help="keep every layer's activations")
    args = ap.parse_args()

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    seqlen = 32 * world if args.tiny else args.seqlen
    config = tiny_config() if args.tiny else llama_config(seqlen, args.layers)
    model = build_model(config, device, dtype)
    if not args.no_checkpointing:  # activations of long sequences: recomputed per layer in the backward
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(1)  # the same batch on every rank
    for step in range(args.steps):
        input_ids = torch.randint(config.vocab_size, (1, seqlen), generator=generator).to(device)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = sharded_loss(ddp, input_ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        whole = loss.detach().clone()
        dist.all_reduce(whole)
        if rank == 0:
            print(f"step {step}: loss {whole.item() / world:.4f}, {seqlen / seconds:,.0f} tokens/s "
                  f"({world} ranks, {seconds * 1e3:.0f} ms)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
