"""torch.compile / torch.export: flashtriton's ops are opaque custom ops with fake impls and autograd.

A model calling flashtriton compiles with fullgraph=True (no graph break), forward and backward equal eager,
and exports. On the CPU the kernels run through the interpreter; backend "aot_eager" everywhere, "inductor"
too (its C++ backend on the CPU, Triton on a GPU).
"""

import shutil

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
import torch._inductor.config

import flashtriton
from flashtriton._env import INTERPRET

DEVICE = "cpu" if INTERPRET else "cuda"
HAS_INDUCTOR = torch.cuda.is_available() or shutil.which("g++") is not None or shutil.which("c++") is not None
BACKENDS = ["aot_eager"] + (["inductor"] if HAS_INDUCTOR else [])

class Block(torch.nn.Module):
    """Projections + flashtriton in both layouts, GQA, causal; k and v are strided views (no copy), the
    (B, H, S, D) tensors reach the kernels as transposed views."""

    def __init__(self, dim=32, heads_q=4, heads_kv=2, head_dim=8):
        super().__init__()
        self.hq, self.hkv, self.d = heads_q, heads_kv, head_dim
        self.q_proj = torch.nn.Linear(dim, heads_q * head_dim)
        self.kv_proj = torch.nn.Linear(dim, 2 * heads_kv * head_dim)
        self.o_proj = torch.nn.Linear(heads_q * head_dim, dim)

    def forward(self, x):
        batch, seqlen, _ = x.shape
        q = self.q_proj(x).view(batch, seqlen, self.hq, self.d)
        k, v = self.kv_proj(x).view(batch, seqlen, 2, self.hkv, self.d).unbind(2)
        a = flashtriton.flash_attn_func(q, k, v, causal=True)  # (B, S, H, D)
        # torch's layout as a transformers model makes it (contiguous (B, H, S, D) after RoPE), top-left causal
        qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        b = flashtriton.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True).transpose(1, 2)
        return self.o_proj((a + b).reshape(batch, seqlen, -1))


class Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return flashtriton.flash_attn_func(q, k, v, causal=True)


def _block_and_input(seed=0, batch=2, seqlen=7):
    torch.manual_seed(seed)
    block = Block().to(DEVICE)
    x = torch.randn(batch, seqlen, 32, device=DEVICE, requires_grad=True)
    return block, x


def _run(fn, module, x):
    module.zero_grad()
    x.grad = None
    out = fn(x)
    out.square().sum().backward()
    return out.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in module.named_parameters()}


def _varlen(q, k, v, cu_q, cu_k):
    return flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 7, causal=True)


def _varlen_inputs(requires_grad=False):
    torch.manual_seed(1)
    cu_q = torch.tensor([0, 5, 5, 8], dtype=torch.int32, device=DEVICE)  # an empty sequence too
    cu_k = torch.tensor([0, 7, 9, 12], dtype=torch.int32, device=DEVICE)
    q = torch.randn(8, 4, 16, device=DEVICE, requires_grad=requires_grad)
    k = torch.randn(12, 2, 16, device=DEVICE, requires_grad=requires_grad)
    v = torch.randn(12, 2, 16, device=DEVICE, requires_grad=requires_grad)
    return q, k, v, cu_q, cu_k


def test_no_graph_breaks():
    block, x = _block_and_input()
    explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    torch.compile(block, backend=counter, fullgraph=True)(x).sum().backward()
    assert counter.frame_count == 1
    assert counter.op_count > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_forward_backward_matches_eager(backend):
    torch._dynamo.reset()
    block, x = _block_and_input()
    out, dx, grads = _run(block, block, x)
    compiled = torch.compile(block, backend=backend, fullgraph=True)
    # no on-disk inductor cache: a graph compiled against an older fake impl of the op would be reused
    with torch._inductor.config.patch(force_disable_caches=True):
        out_c, dx_c, grads_c = _run(compiled, block, x)
    torch.testing.assert_close(out_c, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx_c, dx, atol=1e-5, rtol=1e-5)
    for name in grads:
        torch.testing.assert_close(grads_c[name], grads[name], atol=1e-5, rtol=1e-5, msg=name)


def test_varlen_compiles_forward_backward():
    torch._dynamo.reset()
    q, k, v, cu_q, cu_k = _varlen_inputs(requires_grad=True)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_varlen, backend=counter, fullgraph=True)
    results = []
    for fn in (_varlen, compiled):
        out = fn(q, k, v, cu_q, cu_k)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        results.append((out.detach(), *grads))
    assert counter.frame_count == 1
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_varlen_bad_cu_seqlens_still_checked_under_compile():
    """cu_seqlens' values are checked inside the op, so a compiled graph still rejects bad ones."""
    torch._dynamo.reset()
    q, k, v, cu_q, cu_k = _varlen_inputs()
    compiled = torch.compile(_varlen, backend="aot_eager", fullgraph=True)
    compiled(q, k, v, cu_q, cu_k)
    bad = torch.tensor([0, 6, 5, 8], dtype=torch.int32, device=DEVICE)
    with pytest.raises(Exception, match="non-decreasing"):
        compiled(q, k, v, bad, cu_k)


def test_dynamic_shapes_do_not_recompile():
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(Attention(), backend=counter, fullgraph=True, dynamic=True)
    for seqlen in (5, 9, 12):
        q = torch.randn(2, seqlen, 4, 16, device=DEVICE)
        k = torch.randn(2, seqlen + 3, 2, 16, device=DEVICE)
        v = torch.randn(2, seqlen + 3, 2, 16, device=DEVICE)
        torch.testing.assert_close(compiled(q, k, v), Attention()(q, k, v))
        if seqlen == 5:
            compiles = counter.frame_count
    assert counter.frame_count == compiles


def test_export_inference():
    torch.manual_seed(0)
    q = torch.randn(2, 5, 4, 16, device=DEVICE)
    k = torch.randn(2, 7, 2, 16, device=DEVICE)
    v = torch.randn(2, 7, 2, 16, device=DEVICE)
    with torch.no_grad():
        program = torch.export.export(Attention(), (q, k, v))
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert torch.ops.flashtriton.fwd.default in targets
    torch.testing.assert_close(program.module()(q, k, v), Attention()(q, k, v))

    block, x = _block_and_input()
    with torch.no_grad():
        program = torch.export.export(block.eval(), (x.detach(),))
        torch.testing.assert_close(program.module()(x.detach()), block(x.detach()))


def test_export_dynamic_seqlen():
    q = torch.randn(2, 5, 4, 16, device=DEVICE)
    k = torch.randn(2, 7, 2, 16, device=DEVICE)
    v = torch.randn(2, 7, 2, 16, device=DEVICE)
    sq, sk = torch.export.Dim("sq", max=4096), torch.export.Dim("sk", max=4096)
    with torch.no_grad():
        program = torch.export.export(
            Attention(), (q, k, v), dynamic_shapes={"q": {1: sq}, "k": {1: sk}, "v": {1: sk}}
        )
    q2, k2, v2 = torch.randn(2, 9, 4, 16, device=DEVICE), torch.randn(2, 4, 2, 16, device=DEVICE), torch.randn(
        2, 4, 2, 16, device=DEVICE
    )
    torch.testing.assert_close(program.module()(q2, k2, v2), Attention()(q2, k2, v2))


# torch.library.opcheck: schema, autograd registration, fake impl vs the real op (shapes *and* strides),
# and AOT dispatch with dynamic shapes.
def _dense_args(transposed):
    torch.manual_seed(2)
    if transposed:  # torch's (B, H, S, D) tensors seen as (B, S, H, D) views, what scaled_dot_product_attention passes
        q = torch.randn(2, 4, 5, 16, device=DEVICE).transpose(1, 2)
        k = torch.randn(2, 2, 7, 16, device=DEVICE).transpose(1, 2)
        v = torch.randn(2, 2, 7, 16, device=DEVICE).transpose(1, 2)
    else:
        q = torch.randn(2, 5, 4, 16, device=DEVICE)
        k = torch.randn(2, 7, 2, 16, device=DEVICE)
        v = torch.randn(2, 7, 2, 16, device=DEVICE)
    return [q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), 0.25, True, False, None, None, 5, 7]


OPCHECK_CASES = {
    "dense": lambda: _dense_args(False),
    "dense_transposed_views": lambda: _dense_args(True),
    "varlen": lambda: [*_varlen_inputs(True)[:3], 0.25, True, True, *_varlen_inputs()[3:], 5, 7],
}


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck(case):
    args = OPCHECK_CASES[case]()
    torch.library.opcheck(torch.ops.flashtriton.fwd.default, args)
    q, k, v = (t.detach() for t in args[:3])
    out, lse = torch.ops.flashtriton.fwd(q, k, v, *args[3:])
    dout = torch.randn_like(out)
    if case == "dense_transposed_views":
        dout = dout.transpose(1, 2).contiguous().transpose(1, 2)  # autograd hands strided grads too
    torch.library.opcheck(torch.ops.flashtriton.bwd.default, [dout, q, k, v, out, lse, *args[3:]])



# ---------------------------------------------------------------------------------------------------------
# flash_attn_with_kvcache: the op flashtriton::kvcache (mutates the caches) under torch.compile
# ---------------------------------------------------------------------------------------------------------
def _decode_step(q, k_cache, v_cache, k, v, cache_seqlens):
    out, lse = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                                   causal=True, num_splits=2, return_softmax_lse=True)
    return out * 2, lse


def _decode_inputs(seed=0, batch=2, capacity=40, heads_q=4, heads_kv=2, head_dim=16):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 1, heads_q, head_dim, generator=gen).to(DEVICE)
    k_cache, v_cache = (torch.randn(batch, capacity, heads_kv, head_dim, generator=gen).to(DEVICE) for _ in range(2))
    k, v = (torch.randn(batch, 1, heads_kv, head_dim, generator=gen).to(DEVICE) for _ in range(2))
    return q, k_cache, v_cache, k, v


@pytest.mark.parametrize("backend", BACKENDS)
def test_kvcache_compiles_without_graph_breaks_and_appends_like_eager(backend):
    """A decode step (append + attention) compiles with fullgraph=True; two steps with growing cache lengths
    (a tensor: no recompile) give eager's outputs, lse and caches."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(_decode_step, backend=counter, fullgraph=True)
    q, k_cache, v_cache, k, v = _decode_inputs()
    caches = {"eager": (k_cache.clone(), v_cache.clone()), "compiled": (k_cache.clone(), v_cache.clone())}
    with torch.no_grad():
        for step, lengths in enumerate(([3, 17], [4, 18])):
            seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
            out_e, lse_e = _decode_step(q, *caches["eager"], k + step, v - step, seqlens)
            out_c, lse_c = compiled(q, *caches["compiled"], k + step, v - step, seqlens)
            torch.testing.assert_close(out_c, out_e, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse_c, lse_e, atol=1e-5, rtol=1e-5)
            for got, expected in zip(caches["compiled"], caches["eager"]):
                assert torch.equal(got, expected)
    assert counter.frame_count == 1
    assert not torch.equal(caches["compiled"][0], k_cache)  # the compiled graph did write the new keys


def test_kvcache_same_memory_caches_still_refused_under_compile():
    torch._dynamo.reset()
    compiled = torch.compile(_decode_step, backend="aot_eager", fullgraph=True)
    q, k_cache, _, k, v = _decode_inputs()
    seqlens = torch.tensor([3, 17], dtype=torch.int32, device=DEVICE)
    with torch.no_grad(), pytest.raises(Exception, match="same memory"):
        compiled(q, k_cache, k_cache, k, v, seqlens)


@pytest.mark.parametrize("paged,appends", [(False, True), (False, False), (True, True)])
def test_kvcache_opcheck(paged, appends):
    q, k_cache, v_cache, k, v = _decode_inputs(capacity=32)
    block_table = None
    if paged:  # 2 sequences x 2 pages of 16 keys, pages shuffled
        k_cache, v_cache = (c.reshape(4, 16, *c.shape[2:]) for c in (k_cache, v_cache))
        block_table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32, device=DEVICE)
    seqlens = torch.tensor([5, 20], dtype=torch.int32, device=DEVICE)
    args = [q, k_cache, v_cache, k if appends else None, v if appends else None, seqlens, None, block_table, 0.25,
            True, 2, 32, 1 if appends else 0]
    torch.library.opcheck(torch.ops.flashtriton.kvcache.default, args)


@pytest.mark.parametrize("varlen", [False, True])
def test_every_variant_field_compiles_with_its_gradients(varlen):
    """Window, softcap, ALiBi and a learnable sink together: one graph, the eager values and gradients (dsink
    included)."""
    torch._dynamo.reset()
    q, k, v, cu_q, cu_k = _varlen_inputs(requires_grad=True)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=DEVICE)
    sink = torch.tensor([0.3, -1.0, 1.5, 0.0], device=DEVICE, requires_grad=True)
    extra = dict(causal=True, window_size=(3, 0), softcap=4.0, alibi_slopes=slopes, learnable_sink=sink)

    def fn(q, k, v, sink):
        if varlen:
            return flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 7, **{**extra, "learnable_sink": sink})
        return flashtriton.flash_attn_func(q[None], k[None], v[None], **{**extra, "learnable_sink": sink})

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    results = []
    for f in (fn, torch.compile(fn, backend=counter, fullgraph=True)):
        out = f(q, k, v, sink)
        results.append((out.detach(), *torch.autograd.grad(out.square().sum(), (q, k, v, sink))))
    assert counter.frame_count == 1
    assert results[0][-1].abs().sum() > 0  # the sink has a gradient
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
