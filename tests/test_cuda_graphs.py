"""Training calls captured in CUDA graphs: a replayed forward and backward give the eager call's bits, on fresh
inputs copied into the captured tensors; with dropout each replay draws a new mask (torch's generator advances
on the device, as its own dropout does) and gives the bits of an eager call with that replay's (seed, offset).

CUDA graphs need a CUDA GPU: on CPU (CI) these tests skip. Decoding in graphs: tests/test_kvcache.py."""

import math

import pytest
import torch

import flashtriton
from flashtriton import ops, testing

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs: a CUDA GPU only")


def capture(step):
    """(graph, step's outputs as captured): two warm-up calls on a side stream (compiles, plans, the allocator's
    pool), then the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


def inputs(batch, seqlen, heads, heads_kv, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, seqlen, heads, head_dim), (batch, seqlen, heads_kv, head_dim),
              (batch, seqlen, heads_kv, head_dim), (batch, seqlen, heads, head_dim)]
    return [torch.randn(s, generator=gen).to("cuda", dtype) for s in shapes]


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 512, 8, 8, 128), (2, 1024, 8, 2, 64), (4, 4096, 16, 16, 128)],
                         ids=["T512", "T1k-gqa", "T4k-gluon-bwd"])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_backward_replay_equals_eager(shape, causal):
    """T=512 and 1k take the Triton backward, T=4k (5e11 forward FLOPs) the Gluon one; every replay on new
    inputs equals an eager call on them, bit for bit (both backward kernels are deterministic)."""
    batch, seqlen, heads, heads_kv, head_dim = shape
    q, k, v, dout = (t.requires_grad_(i < 3) for i, t in enumerate(inputs(batch, seqlen, heads, heads_kv, head_dim,
                                                                           torch.bfloat16, 0)))

    def step():
        out = flashtriton.flash_attn_func(q, k, v, causal=causal)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    graph, captured = capture(step)
    for seed in (1, 2):
        with torch.no_grad():
            for t, new in zip((q, k, v, dout), inputs(batch, seqlen, heads, heads_kv, head_dim, torch.bfloat16, seed)):
                t.copy_(new)
        graph.replay()
        eager = step()
        for name, a, b in zip(("out", "dq", "dk", "dv"), captured, eager):
            assert torch.equal(a, b), f"seed {seed}: {name} replayed differs from eager"


@needs_cuda
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_replays_draw_new_masks(causal):
    """Each replay of a dropout call draws its own (seed, offset) on the device: outputs differ between replays,
    and each equals the eager call with that replay's state (read from the captured draw's output)."""
    q, k, v, _ = inputs(2, 256, 4, 4, 64, torch.float16, 3)
    scale = 1 / math.sqrt(64)
    with testing.record_dropout() as calls:
        graph, (out, _lse) = capture(lambda: ops.attention(q, k, v, scale, causal, True, dropout_p=0.2))
    state = calls[-1]  # the captured draw's output tensor: each replay writes its (seed, offset) there
    results, states = [], []
    for _ in range(3):
        graph.replay()
        results.append(out.clone())
        states.append(state.clone())
    assert len({tuple(s.tolist()) for s in states}) == 3, "replays reused a dropout state"
    assert not torch.equal(results[0], results[1]) and not torch.equal(results[1], results[2])
    for got, s in zip(results, states):
        expected, _ = ops.attention(q, k, v, scale, causal, True, dropout_p=0.2, rng_state=s)
        assert torch.equal(got, expected)
        keep = testing.dropout_mask(s, 2, 4, 256, 256, 0.2)
        assert abs(keep.float().mean().item() - 0.8) < 0.01
