"""One rank of a gloo group for tests/test_parallel.py: runs the named checks in order, exit status 1 if one fails.

    python tests/parallel_worker.py RANK WORLD INIT_FILE CHECK [CHECK ...]

Every rank runs the same checks (they are collective); inputs come from one seed, so that every rank builds the
same full sequence and shards it. Rank 0 compares the gathered results with flashtriton on the whole sequence (and
that with float64).
"""

import copy
import os
import sys
import time
import traceback
from datetime import timedelta

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels run on CPU tensors

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import flashtriton  # noqa: E402
from flashtriton import parallel  # noqa: E402
from flashtriton.kernels.variant import Variant  # noqa: E402
from flashtriton.reference import attention_reference  # noqa: E402

TIMEOUT_S = 60  # the process group's: a rank that never arrives makes the others raise after this


def inputs(world, hq, hkv, seed=0, batch=1, per_rank=16, dim=16):
    gen = torch.Generator().manual_seed(seed)
    seqlen = per_rank * world
    q = torch.randn(batch, seqlen, hq, dim, generator=gen)
    k, v = (torch.randn(batch, seqlen, hkv, dim, generator=gen) for _ in range(2))
    return q, k, v, torch.randn(batch, seqlen, hq, dim, generator=gen)


def sink_of(heads, sink):
    """Attention sinks (fp32 logits near the scores' size) for a case that has them, else None."""
    return torch.linspace(-1.0, 2.0, heads) if sink else None


def sink_leaf(sink):
    return None if sink is None else sink.clone().requires_grad_()


def summed_grad(leaf):
    """A replicated parameter's gradient over the group: the sum of the ranks' shares (none: no sink)."""
    if leaf is None:
        return []
    grad = leaf.grad.clone()
    dist.all_reduce(grad)
    return [grad]


def sharded_run(fn, q, k, v, dout, layout, group=None, sink=None, **kw):
    """fn on this rank's shards, forward and backward; the gathered out and gradients (every rank), and the
    sinks' summed gradient when there are sinks."""
    local = [parallel.shard(t, group, layout).detach().requires_grad_() for t in (q, k, v)]
    sink = sink_leaf(sink)
    out = fn(*local, group=group, layout=layout, learnable_sink=sink, **kw)
    out.backward(parallel.shard(dout, group, layout))
    return [parallel.unshard(t, group, layout) for t in (out.detach(), *(t.grad for t in local))] + summed_grad(sink)


def check_against_full(got, q, k, v, dout, causal, what, window=(-1, -1), sink=None):
    """got: (out, dq, dk, dv[, dsink]) of the whole sequence; flashtriton's full call, and float64 for the
    output."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([] if sink is None else [sink_leaf(sink)])
    out = flashtriton.flash_attn_func(*leaves[:3], causal=causal, window_size=window,
                                      learnable_sink=None if sink is None else leaves[3])
    out.backward(dout)
    exact = attention_reference(q, k, v, variant=Variant(causal=causal, window=window, sinks=sink))
    torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=1e-5, msg=f"{what}: full call vs float64")
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsink"), got, (out, *(t.grad for t in leaves))):
        torch.testing.assert_close(a, b.detach(), atol=3e-5, rtol=1e-5, msg=f"{what}: {name}")


def ring_case(layout, causal, hq, hkv, window=(-1, -1), sink=False):
    def run(rank, world):
        q, k, v, dout = inputs(world, hq, hkv)
        got = sharded_run(parallel.ring_attention, q, k, v, dout, layout, causal=causal, window_size=window,
                          sink=sink_of(hq, sink))
        if rank == 0:
            check_against_full(got, q, k, v, dout, causal, f"ring {layout} causal={causal} {hq}/{hkv} {window}",
                               window, sink_of(hq, sink))
    return run


def ulysses_case(layout, causal, hq, hkv, sink=False):
    def run(rank, world):
        q, k, v, dout = inputs(world, hq, hkv, seed=1)
        got = sharded_run(parallel.ulysses_attention, q, k, v, dout, layout, causal=causal, sink=sink_of(hq, sink))
        if rank == 0:
            check_against_full(got, q, k, v, dout, causal, f"ulysses {layout} causal={causal} {hq}/{hkv}",
                               sink=sink_of(hq, sink))
    return run


# Document lengths of the packed cases (64 tokens over 2 or 4 ranks): documents cross shard and zigzag-chunk
# boundaries, one is empty, one is a single token, one spans several ranks' shards.
DOCS = (5, 1, 0, 23, 3, 11, 21)


def packed_inputs(world, hq, hkv, seed=3, per_rank=16, dim=16):
    q, k, v, dout = (t[0] for t in inputs(world, hq, hkv, seed=seed, per_rank=per_rank, dim=dim))
    bounds = [0]
    for n in DOCS:
        bounds.append(min(bounds[-1] + n, q.shape[0]))
    bounds[-1] = q.shape[0]
    return q, k, v, dout, torch.tensor(bounds, dtype=torch.int32)


def packed_case(fn, layout, causal, hq, hkv, window=(-1, -1), sink=False):
    """fn on shards of packed documents (cu_seqlens over the whole sequence), forward and backward, against
    flash_attn_varlen_func on the whole packed sequence and that against float64 per document."""
    def run(rank, world):
        q, k, v, dout, cu = packed_inputs(world, hq, hkv)
        local = [parallel.shard(t, None, layout, dim=0).detach().requires_grad_() for t in (q, k, v)]
        sinks = sink_of(hq, sink)
        leaf = sink_leaf(sinks)
        out = fn(*local, causal=causal, layout=layout, window_size=window, cu_seqlens=cu, learnable_sink=leaf)
        out.backward(parallel.shard(dout, None, layout, dim=0))
        got = [parallel.unshard(t, None, layout, dim=0) for t in (out.detach(), *(t.grad for t in local))]
        got += summed_grad(leaf)
        if rank:
            return
        what = f"{fn.__name__} packed {layout} causal={causal} {hq}/{hkv} {window}"
        leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([] if sinks is None else [sink_leaf(sinks)])
        longest = int((cu[1:] - cu[:-1]).max())
        want = flashtriton.flash_attn_varlen_func(*leaves[:3], cu, cu, longest, longest, causal=causal,
                                                  window_size=window, learnable_sink=leaves[3] if sink else None)
        want.backward(dout)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            exact = attention_reference(q[None, a:b], k[None, a:b], v[None, a:b],
                                        variant=Variant(causal=causal, window=window, sinks=sinks))[0]
            torch.testing.assert_close(want[a:b].double(), exact, atol=1e-5, rtol=1e-5,
                                       msg=f"{what}: varlen vs float64")
        for name, x, y in zip(("out", "dq", "dk", "dv", "dsink"), got, (want, *(t.grad for t in leaves))):
            torch.testing.assert_close(x, y.detach(), atol=3e-5, rtol=1e-5, msg=f"{what}: {name}")
    return run


def check_lse_zigzag(attention, what, world, hq, hkv, seed):
    """`attention` (ring or Ulysses) with return_lse on zigzag shards, causal with sinks: the shard of the whole
    call's lse, and the gradients of a loss of out and lse together (dsink takes the lse's gradient too), against
    the whole call's. Returns (q, k, v, local shards) for further checks."""
    q, k, v, dout = inputs(world, hq, hkv, seed=seed)
    dlse = torch.randn(1, hq, q.shape[1], generator=torch.Generator().manual_seed(seed + 1))
    sinks = sink_of(hq, True)
    local = [parallel.shard(t, None, "zigzag").detach().requires_grad_() for t in (q, k, v)]
    leaf = sink_leaf(sinks)
    out, lse = attention(*local, causal=True, layout="zigzag", return_lse=True, learnable_sink=leaf)
    assert lse.shape == (1, hq, q.shape[1] // world), lse.shape
    torch.autograd.backward([out, lse], [parallel.shard(dout, None, "zigzag"),
                                         parallel.shard(dlse, None, "zigzag", dim=2)])
    got = [parallel.unshard(t, None, "zigzag") for t in (out.detach(), *(t.grad for t in local))]
    got += summed_grad(leaf)
    got_lse = parallel.unshard(lse.detach(), None, "zigzag", dim=2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + [sink_leaf(sinks)]
    full_out, full_lse = flashtriton.flash_attn_func(*leaves[:3], causal=True, learnable_sink=leaves[3],
                                                     return_attn_probs=True)[:2]
    torch.autograd.backward([full_out, full_lse], [dout, dlse])
    torch.testing.assert_close(got_lse, full_lse.detach(), atol=3e-5, rtol=1e-5)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsink"), got, (full_out, *(t.grad for t in leaves))):
        torch.testing.assert_close(a, b.detach(), atol=3e-5, rtol=1e-5, msg=f"{what} lse gradient: {name}")
    return q, k, v, local


def ring_lse(rank, world):
    """ring_attention's return_lse (`check_lse_zigzag`, GQA 2/1); a loss of the lse alone trains too."""
    *_, local = check_lse_zigzag(parallel.ring_attention, "ring", world, 2, 1, seed=4)
    only_lse = parallel.ring_attention(*(t.detach().requires_grad_() for t in local), causal=True,
                                       return_lse=True)[1]
    only_lse.sum().backward()  # out unused: its gradient is None, the backward takes zeros


def ulysses_lse(rank, world):
    """ulysses_attention's return_lse: zigzag GQA 4/2 causal with sinks (`check_lse_zigzag`), and packed
    documents in the contiguous layout."""
    q, k, v, _ = check_lse_zigzag(parallel.ulysses_attention, "ulysses", world, 4, 2, seed=6)
    # packed documents: lse (nheads, total / world), this rank's contiguous shard of the whole call's
    cu = torch.tensor([0, 5, 5 + 3 * world, 16 * world], dtype=torch.int32)
    packed = [t[0] for t in (q, k, v)]
    rows = slice(rank * 16, (rank + 1) * 16)
    out, lse = parallel.ulysses_attention(*(t[rows] for t in packed), causal=True, cu_seqlens=cu, return_lse=True)
    full_lse = flashtriton.flash_attn_varlen_func(*packed, cu, cu, 16 * world, 16 * world, causal=True,
                                                  return_attn_probs=True)[1]
    assert lse.shape == (4, 16), lse.shape
    torch.testing.assert_close(lse, full_lse[:, rows], atol=3e-5, rtol=1e-5)


def llama_training(rank, world):
    """examples/context_parallel_llama.py: one step of the tiny Llama on the sharded sequence (ring attention,
    DistributedDataParallel) gives the loss and the gradients of the same model on the whole sequence (eager)."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "examples", "context_parallel_llama.py")
    spec = importlib.util.spec_from_file_location("context_parallel_llama", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    from transformers import AutoModelForCausalLM

    config = example.tiny_config()
    model = example.build_model(config, torch.device("cpu"), torch.float32)
    whole = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
    whole.load_state_dict(model.state_dict())
    ids = torch.randint(config.vocab_size, (1, 24 * world), generator=torch.Generator().manual_seed(5))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    loss = example.sharded_loss(ddp, ids)
    loss.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    want = whole(input_ids=ids).logits
    want_loss = torch.nn.functional.cross_entropy(want[0], example.labels_of(ids)[0], ignore_index=example.IGNORE)
    want_loss.backward()
    torch.testing.assert_close(mean / world, want_loss.detach(), atol=1e-5, rtol=1e-5)
    grads = dict(whole.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=2e-5, rtol=1e-4, msg=f"llama gradient of {name}")


def deterministic_and_subgroups(rank, world):
    """Two forward runs give the same bits; a ring over pairs of ranks (subgroups: group ranks are not global
    ranks) and over each rank alone (world size 1) equals the full call."""
    q, k, v, _ = inputs(2, 2, 1, seed=2, per_rank=8)
    local = [parallel.shard(t, None, "zigzag") for t in inputs(world, 2, 1, seed=2, per_rank=8)[:3]]
    first, second = (parallel.ring_attention(*local, causal=True) for _ in range(2))
    assert torch.equal(first, second), "ring_attention is not deterministic"
    pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]  # (collective: every rank builds all)
    solo = [dist.new_group([r]) for r in range(world)]
    pair = pairs[rank // 2]
    want = flashtriton.flash_attn_func(q, k, v, causal=True)
    out = parallel.ring_attention(*(parallel.shard(t, pair, "zigzag") for t in (q, k, v)), causal=True, group=pair)
    torch.testing.assert_close(parallel.unshard(out, pair, "zigzag"), want, atol=3e-5, rtol=1e-5)
    out = parallel.ring_attention(q, k, v, causal=True, group=solo[rank], layout="contiguous")
    torch.testing.assert_close(out, want, atol=3e-5, rtol=1e-5)


def expect(error, match, fn, *args, **kw):
    try:
        fn(*args, **kw)
    except error as e:
        assert match in str(e), f"{error.__name__} without {match!r}: {e}"
        return
    raise AssertionError(f"no {error.__name__} ({match!r})")


def bad_inputs(rank, world):
    """Each raises on every rank (the ones with good inputs too), and the group stays usable."""
    q, k, v, _ = inputs(world, 4, 2)
    ql, kl, vl = (parallel.shard(t, None, "contiguous") for t in (q, k, v))
    expect(ValueError, "must be a multiple of", parallel.shard, q[:, :-2], None, "zigzag")
    odd = [t[:, :-1] for t in (ql, kl, vl)]  # 15 positions a rank: zigzag needs an even shard
    expect(ValueError, "positive multiple of 2", parallel.ring_attention, *odd, causal=True)
    short = [t[:, :8] if rank == 1 else t for t in (ql, kl, vl)]  # rank 1's shards are shorter
    expect(ValueError, "q's shard shape must be the same on every rank", parallel.ring_attention, *short,
           layout="contiguous")
    half = [t.bfloat16() if rank == 0 else t for t in (ql, kl, vl)]
    expect(ValueError, "dtype must be the same on every rank", parallel.ring_attention, *half, layout="contiguous")
    flat = [t[0] if rank == 1 else t for t in (ql, kl, vl)]  # rank 1: 3-D tensors
    if rank == 1:
        expect(ValueError, "must have 4 dims", parallel.ring_attention, *flat, layout="contiguous")
    else:
        expect(ValueError, "rank 1 of the group refused its inputs", parallel.ring_attention, *flat,
               layout="contiguous")
    meta = [t.to("meta") for t in (ql, kl, vl)]
    expect(ValueError, "group: its backend 'gloo' cannot move meta tensors", parallel.ring_attention, *meta)
    many = [ql[:, :, :3]] * 3  # 3 heads: not a multiple of 2 or 4
    expect(ValueError, "must be a multiple of the world size", parallel.ulysses_attention, *many)
    grads = [t.clone().requires_grad_(rank == 0) for t in (ql, kl, vl)]  # a backward only rank 0 would run
    expect(ValueError, "requires_grad must be the same on every rank", parallel.ring_attention, *grads,
           layout="contiguous")
    packed = [t[0] for t in (ql, kl, vl)]
    total = 16 * world
    cu = torch.tensor([0, 7, total], dtype=torch.int32)
    other = torch.tensor([0, 8 if rank == 1 else 7, total], dtype=torch.int32)
    expect(ValueError, "cu_seqlens must be the same on every rank", parallel.ring_attention, *packed,
           layout="contiguous", cu_seqlens=other)
    expect(ValueError, "must run from 0 to the whole packed sequence's length", parallel.ring_attention, *packed,
           layout="contiguous", cu_seqlens=cu[:2])
    expect(TypeError, "cu_seqlens must be a 1-D int32", parallel.ulysses_attention, *packed, cu_seqlens=cu.long())
    expect(ValueError, "must have 3 dims", parallel.ring_attention, ql, kl, vl, layout="contiguous", cu_seqlens=cu)
    out = parallel.ring_attention(ql, kl, vl, layout="contiguous")  # the group still works
    torch.testing.assert_close(parallel.unshard(out, None, "contiguous"), flashtriton.flash_attn_func(q, k, v),
                               atol=3e-5, rtol=1e-5)


CHECKS = {
    "ring_zigzag_causal_gqa": ring_case("zigzag", True, 4, 2),
    "ring_zigzag_causal_mqa": ring_case("zigzag", True, 2, 1),
    "ring_zigzag_full": ring_case("zigzag", False, 2, 2),
    "ring_contiguous_causal_window_sink": ring_case("contiguous", True, 2, 1, window=(12, 0), sink=True),
    "ring_contiguous_full": ring_case("contiguous", False, 1, 1),
    "ulysses_causal_gqa_sink": ulysses_case("contiguous", True, 4, 2, sink=True),
    "ulysses_zigzag_causal_mqa": ulysses_case("zigzag", True, 4, 1),
    "ulysses_full": ulysses_case("contiguous", False, 4, 4),
    "ring_packed_zigzag_causal_gqa": packed_case(parallel.ring_attention, "zigzag", True, 4, 2),
    "ring_packed_contiguous_window": packed_case(parallel.ring_attention, "contiguous", False, 2, 1, window=(6, 3)),
    "ring_packed_zigzag_full": packed_case(parallel.ring_attention, "zigzag", False, 2, 2),
    "ring_packed_zigzag_causal_window_sink": packed_case(parallel.ring_attention, "zigzag", True, 2, 1,
                                                          window=(9, 0), sink=True),
    "ulysses_packed_zigzag_causal": packed_case(parallel.ulysses_attention, "zigzag", True, 4, 2),
    "ring_lse": ring_lse,
    "ulysses_lse": ulysses_lse,
    "llama_training": llama_training,
    "deterministic_and_subgroups": deterministic_and_subgroups,
    "bad_inputs": bad_inputs,
}


def main():
    rank, world, init_file, *names = sys.argv[1:]
    rank, world = int(rank), int(world)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S))
    failed = []
    for name in names:
        start, cpu = time.perf_counter(), time.process_time()
        try:
            CHECKS[name](rank, world)
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
            print(f"rank {rank}: {name} ok ({seconds:.1f} s, cpu {cpu:.1f} s)", flush=True)
        except Exception:  # report and go on: the other ranks run the same collectives
            failed.append(name)
            print(f"rank {rank}: {name} FAILED\n{traceback.format_exc()}", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
