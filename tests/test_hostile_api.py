"""Uses of the public API beyond a plain call: double backward, threads, torch.func transforms, the gradient of
the returned log-sum-exp. Each either works exactly or raises an error that names what is not supported."""

import threading

import pytest
import torch

import flashtriton
from flashtriton.kernels import dispatch
from flashtriton.reference import attention_reference

from accuracy import assert_close_to_exact


def leaves(device, b=1, sq=8, sk=8, hq=2, hkv=2, d=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d))
    return tuple(torch.randn(s, generator=gen).to(device=device, dtype=dtype).requires_grad_() for s in shapes)


def _through_op(q, k, v):
    """The registered op, called directly (what torch.compile's graphs call)."""
    return torch.ops.flashtriton.fwd(q, k, v, q.shape[-1] ** -0.5, False, True, None, None, q.shape[1], k.shape[1])[0]


PATHS = {"eager": lambda q, k, v: flashtriton.flash_attn_func(q, k, v), "op": _through_op}


# ---------------------------------------------------------------------------------------------------------
# Double backward: the backward kernels are not differentiable; differentiating through them raises
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
def test_double_backward_raises_a_clear_error(path, device):
    q, k, v = leaves(device)
    out = PATHS[path](q, k, v)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout, create_graph=True)
    first = torch.autograd.grad(PATHS[path](q, k, v), (q, k, v), dout)
    for got, want in zip((dq, dk, dv), first):  # the first-order values are unchanged by create_graph
        torch.testing.assert_close(got.detach(), want)
    with pytest.raises(RuntimeError, match=r"flashtriton's attention backward is not differentiable \(double "
                                           r"backward\)"):
        (dq.square().sum() + dk.square().sum() + dv.square().sum()).backward()
    with pytest.raises(RuntimeError, match="double backward"):  # also when asking for one input's gradient only
        torch.autograd.grad(dq.sum(), q)


@pytest.mark.parametrize("path", PATHS)
def test_create_graph_without_differentiating_the_gradients_is_fine(path, device):
    """create_graph=True alone (e.g. a gradient penalty on other parameters) raises nothing."""
    q, k, v = leaves(device)
    out = PATHS[path](q, k, v)
    dq, = torch.autograd.grad(out.sum(), (q,), create_graph=True)
    want, = torch.autograd.grad(PATHS[path](q, k, v).sum(), (q,))
    torch.testing.assert_close(dq.detach(), want)


# ---------------------------------------------------------------------------------------------------------
# Threads: concurrent calls give each caller its own, exact result
# ---------------------------------------------------------------------------------------------------------
def test_concurrent_calls_from_threads_are_exact(device):
    """Four threads call forward and backward at once on different inputs (Triton's interpreter keeps
    process-wide state: flashtriton serialises its launches there)."""
    cases = [leaves(device, sq=8 + 5 * i, sk=11 + 3 * i, hq=2, hkv=1 + i % 2, d=16, seed=i) for i in range(4)]
    results, errors = [None] * 4, []
    start = threading.Barrier(4)

    def work(i):
        try:
            q, k, v = cases[i]
            start.wait()
            outs = []
            for _ in range(3):
                out = flashtriton.flash_attn_func(q, k, v, causal=i % 2 == 1)
                outs.append((out.detach(), torch.autograd.grad(out.sum(), (q,))[0]))
            results[i] = outs
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, (q, k, v) in enumerate(cases):
        q64 = q.detach().double().requires_grad_()
        exact = attention_reference(q64, k.detach(), v.detach(), causal=i % 2 == 1)
        dq_exact, = torch.autograd.grad(exact.sum(), (q64,))
        for out, dq in results[i]:
            torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(dq.double(), dq_exact, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# torch.func transforms: refused by name (the kernels read raw memory, which their wrapped tensors do not have)
# ---------------------------------------------------------------------------------------------------------
TRANSFORMS = {
    "vmap": lambda f, q: torch.vmap(f)(q[None].expand(2, *q.shape)),
    "grad": lambda f, q: torch.func.grad(lambda x: f(x).sum())(q),
    "jvp": lambda f, q: torch.func.jvp(f, (q,), (torch.ones_like(q),)),
    "jacrev": lambda f, q: torch.func.jacrev(f)(q),
}


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("api", ["flash_attn_func", "scaled_dot_product_attention", "flash_attn_varlen_func"])
def test_torch_func_transforms_are_refused_by_name(transform, api, device):
    q, k, v = (t.detach() for t in leaves(device, sq=4, sk=4))
    cu = torch.tensor([0, 4], dtype=torch.int32, device=device)
    calls = {
        "flash_attn_func": lambda x: flashtriton.flash_attn_func(x, k, v),
        "scaled_dot_product_attention": lambda x: flashtriton.scaled_dot_product_attention(
            x.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)),
        "flash_attn_varlen_func": lambda x: flashtriton.flash_attn_varlen_func(x[0], k[0], v[0], cu, cu, 4, 4),
    }
    with pytest.raises(NotImplementedError, match=r"torch\.func transforms.*(q|query) is wrapped"):
        TRANSFORMS[transform](calls[api], q)


def test_closures_under_a_transform_still_run(device):
    """Tensors a transform does not wrap (a closure's) are plain: such calls are not refused."""
    q, k, v = (t.detach() for t in leaves(device, sq=4, sk=4))
    want = flashtriton.flash_attn_func(q, k, v)
    got = torch.vmap(lambda x: x + flashtriton.flash_attn_func(q, k, v))(torch.zeros(2, *q.shape, device=device))
    torch.testing.assert_close(got, want.expand(2, *want.shape))


def test_kvcache_under_vmap_is_refused_by_name(device):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 1, 2, 16, generator=gen).to(device)
    k_cache, v_cache = (torch.randn(1, 16, 2, 16, generator=gen).to(device) for _ in range(2))
    for _ in range(2):  # the second call's signature was never checked either: refused again
        with pytest.raises(NotImplementedError, match=r"torch\.func transforms"):
            torch.vmap(lambda x: flashtriton.flash_attn_with_kvcache(x, k_cache, v_cache, cache_seqlens=5))(q)


# ---------------------------------------------------------------------------------------------------------
# Scales torch and flash-attn accept: negative and zero, forward and backward, against float64
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [-3.0, -0.25, 0.0])
@pytest.mark.parametrize("causal", [False, True])
def test_negative_and_zero_scales_match_float64(scale, causal, device):
    """A negative scale flips which key scores highest; -3 spreads fp16 scores far past what an exp2 of
    unshifted scores survives (2**16), so a kernel that took the maximum of the unscaled scores fails."""
    from test_backward import check_grads, make_qkv

    from accuracy import torch_attention

    q, k, v, dout = make_qkv(2, 20, 27, 4, 2, 16, torch.float16, device, seed=int(10 * scale) + causal)
    leaves_ = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = flashtriton.flash_attn_func(*leaves_, softmax_scale=scale, causal=causal, return_attn_probs=True)
    exact, exact_lse = attention_reference(q, k, v, scale, causal, return_lse=True)
    assert_close_to_exact(out, torch_attention(q, k, v, scale, causal), exact, torch.float16)
    torch.testing.assert_close(lse.double(), exact_lse, atol=1e-3, rtol=1e-3)
    out.backward(dout)
    check_grads([t.grad for t in leaves_], q, k, v, dout, causal, softmax_scale=scale)

    sdpa = flashtriton.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal,
                                                    scale=scale, enable_gqa=True).transpose(1, 2)
    assert_close_to_exact(sdpa, torch_attention(q, k, v, scale, causal, bottom_right=False),
                          attention_reference(q, k, v, scale, causal, bottom_right=False), torch.float16)

    cu_q = torch.tensor([0, 20, 40], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 27, 54], dtype=torch.int32, device=device)
    packed = [t.flatten(0, 1).clone().requires_grad_() for t in (q, k, v)]
    varlen = flashtriton.flash_attn_varlen_func(*packed, cu_q, cu_k, 20, 27, softmax_scale=scale, causal=causal)
    assert_close_to_exact(varlen.view_as(q), torch_attention(q, k, v, scale, causal), exact, torch.float16)
    varlen.backward(dout.flatten(0, 1))
    check_grads([t.grad.view_as(x) for t, x in zip(packed, (q, k, v))], q, k, v, dout, causal,
                softmax_scale=scale, what="varlen ")


def test_kvcache_negative_scale_is_exact(device):
    """flash_attn_with_kvcache with a negative scale gives the float64 answer (never the overflow of a kernel
    that keeps the maximum of the unscaled scores: -3 spreads fp16 scores far)."""
    from accuracy import torch_attention

    gen = torch.Generator().manual_seed(6)
    q = torch.randn(2, 1, 4, 16, generator=gen).to(device=device, dtype=torch.float16)
    k_cache, v_cache = (torch.randn(2, 64, 2, 16, generator=gen).to(device=device, dtype=torch.float16)
                        for _ in range(2))
    out = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=40, softmax_scale=-3.0)
    k, v = k_cache[:, :40], v_cache[:, :40]
    assert_close_to_exact(out, torch_attention(q, k, v, -3.0), attention_reference(q, k, v, -3.0), torch.float16)


def test_kvcache_takes_numpy_scales_and_softcap_none(device):
    np = pytest.importorskip("numpy")
    q = torch.randn(1, 1, 2, 16, device=device)
    k_cache, v_cache = torch.randn(1, 16, 2, 16, device=device), torch.randn(1, 16, 2, 16, device=device)
    want = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5, softmax_scale=0.3)
    got = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5, softmax_scale=np.float32(0.3),
                                              softcap=None, window_size=[-1, -1])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------------------
# The returned log-sum-exp is differentiable: d lse_i / d s_ij = P_ij (what ring attention's merge needs)
# ---------------------------------------------------------------------------------------------------------
def _reference_grads(q, k, v, w, u, causal, dtype, cu_q=None, cu_k=None):
    """Gradients of sum(out * w) + sum(lse * u) by the reference in `dtype` (float64: exact), sequence by sequence
    for packed inputs. Rows that see no key (lse -inf) carry no lse term: their derivative is 0 (the reference's
    own logsumexp would give NaN there)."""
    leaves_ = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    if cu_q is None:
        pieces = [(leaves_[0], leaves_[1], leaves_[2], w, u)]
    else:
        bounds = list(zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:]))
        pieces = [(leaves_[0][None, a:b], leaves_[1][None, c:d], leaves_[2][None, c:d], w[None, a:b], u[None, :, a:b])
                  for a, b, c, d in bounds if b > a]
    loss = 0
    for qb, kb, vb, wb, ub in pieces:
        out, lse = attention_reference(qb, kb, vb, causal=causal, dtype=dtype, return_lse=True)
        seen = torch.isfinite(lse)
        loss = loss + (out * wb.to(dtype)).sum() + torch.where(seen, lse, 0).mul(torch.where(seen, ub.to(dtype), 0)).sum()
    return torch.autograd.grad(loss, leaves_, allow_unused=True)


def _check_lse_grads(ours, q, k, v, w, u, causal, cu_q=None, cu_k=None):
    exact = _reference_grads(q, k, v, w, u, causal, torch.float64, cu_q, cu_k)
    same_dtype = _reference_grads(q, k, v, w, u, causal, q.dtype, cu_q, cu_k)
    for name, g, t, e in zip(("dq", "dk", "dv"), ours, same_dtype, exact):
        e = torch.zeros_like(g, dtype=torch.float64) if e is None else e
        t = torch.zeros_like(g) if t is None else t
        assert_close_to_exact(g, t, e, q.dtype, name)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk,hq,hkv,dtype", [(9, 21, 4, 2, torch.float16), (23, 7, 2, 1, torch.float16),
                                                (12, 12, 2, 2, torch.float32)])
def test_lse_gradient_dense(sq, sk, hq, hkv, dtype, causal, device):
    """Sq > Sk causal: the first Sq - Sk rows see no key (lse -inf); their lse gradient must add 0, not NaN."""
    q, k, v = leaves(device, b=2, sq=sq, sk=sk, hq=hq, hkv=hkv, d=16, dtype=dtype, seed=sq + causal)
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(q.shape, generator=gen).to(device=device, dtype=dtype)
    u = torch.randn((2, hq, sq), generator=gen).to(device)
    out, lse, _ = flashtriton.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert lse.requires_grad
    ours = torch.autograd.grad((out, lse), (q, k, v), (w, u))
    _check_lse_grads(ours, q, k, v, w, u, causal)
    _, lse, _ = flashtriton.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    only_lse = torch.autograd.grad(lse, (q, k, v), u)  # out unused: its gradient is None inside
    _check_lse_grads(only_lse, q, k, v, torch.zeros_like(w), u, causal)
    empty = lse.detach() == float("-inf")
    if empty.any():  # the lse of a row that sees no key is a constant: whatever its gradient, q, k, v get 0 from it
        out, lse, _ = flashtriton.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        poisoned = torch.autograd.grad((out, lse), (q, k, v), (w, torch.where(empty, float("nan"), u)))
        for a, b in zip(poisoned, ours):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_lse_gradient_varlen(causal, device):
    """Sequences of mixed lengths, one without keys and one without queries, GQA."""
    gen = torch.Generator().manual_seed(3)
    lengths_q, lengths_k = [5, 9, 0, 17, 3], [12, 0, 4, 6, 3]
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = torch.randn(sum(lengths_q), 4, 16, generator=gen).to(device=device, dtype=torch.float16).requires_grad_()
    k, v = (torch.randn(sum(lengths_k), 2, 16, generator=gen).to(device=device, dtype=torch.float16).requires_grad_()
            for _ in range(2))
    w = torch.randn(q.shape, generator=gen).to(device=device, dtype=torch.float16)
    u = torch.randn((4, q.shape[0]), generator=gen).to(device)
    out, lse, _ = flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                     causal=causal, return_attn_probs=True)
    ours = torch.autograd.grad((out, lse), (q, k, v), (w, u))
    _check_lse_grads(ours, q, k, v, w, u, causal, cu_q, cu_k)


def test_lse_gradient_through_the_registered_op(device):
    """The op torch.compile calls: the same gradient, and torch.library.opcheck of the backward op with dlse."""
    q, k, v = leaves(device, b=1, sq=10, sk=6, hq=2, hkv=1, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(q.shape, generator=gen).to(device)
    u = torch.randn((1, 2, 10), generator=gen).to(device)
    out, lse = torch.ops.flashtriton.fwd(q, k, v, 0.25, True, True, None, None, 10, 6)
    ours = torch.autograd.grad((out, lse), (q, k, v), (w, u))
    eager = torch.autograd.grad(flashtriton.flash_attn_func(q, k, v, softmax_scale=0.25, causal=True,
                                                            return_attn_probs=True)[:2], (q, k, v), (w, u))
    for a, b in zip(ours, eager):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    detached = [t.detach() for t in (q, k, v)]
    out, lse = torch.ops.flashtriton.fwd(*detached, 0.25, True, True, None, None, 10, 6)
    torch.library.opcheck(torch.ops.flashtriton.bwd.default, [w, *detached, out, lse, 0.25, True, True, None, None,
                                                              10, 6, u])


def test_preprocess_subtracts_dlse_in_both_layouts(device):
    """The one preprocess launch writes delta - dlse for the Triton kernels (like lse) and the Gluon kernels
    (padded); dlse may be expanded (stride 0); rows whose lse is -inf keep delta."""
    from flashtriton.kernels import backward as B

    bg = pytest.importorskip("flashtriton.kernels.backward_gluon_launch")
    gen = torch.Generator().manual_seed(5)

    def rand(*shape, dt=torch.float16):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dt)

    out, dout, lse = rand(2, 70, 3, 32), rand(2, 70, 3, 32), rand(2, 3, 70, dt=torch.float32)
    lse[:, :, :4] = float("-inf")
    dlse = rand(1, 3, 1, dt=torch.float32).expand(2, 3, 70)
    want = (out.float() * dout.float()).sum(-1).transpose(1, 2) - torch.where(lse == float("-inf"), 0, dlse)
    _, plain, _ = B.preprocess(out, dout, lse, dlse=dlse)
    torch.testing.assert_close(plain, want, rtol=1e-5, atol=1e-5)
    _, padded, _ = B.preprocess(out, dout, lse, padded=True, dlse=dlse)
    torch.testing.assert_close(padded[..., :70], want, rtol=1e-5, atol=1e-5)
    assert torch.all(padded[..., 70:] == 0)

    lengths = [5, 0, 70, 3]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    total = sum(lengths)
    out, dout, lse = rand(total, 3, 32), rand(total, 3, 32), rand(3, total, dt=torch.float32)
    dlse = rand(total, 3, dt=torch.float32).t()  # strided
    want = (out.float() * dout.float()).sum(-1).t() - dlse
    _, plain, _ = B.preprocess(out, dout, lse, cu, max(lengths), dlse=dlse)
    torch.testing.assert_close(plain, want, rtol=1e-5, atol=1e-5)
    _, padded, _ = B.preprocess(out, dout, lse, cu, max(lengths), padded=True, dlse=dlse)
    for b, n in enumerate(lengths):
        start = 4 * (-(-int(cu[b]) // 4) + b)  # backward_gluon.lse_rows
        torch.testing.assert_close(padded[:, start:start + n], want[:, cu[b]:cu[b + 1]], rtol=1e-5, atol=1e-5)
    assert padded.shape[1] == bg.padded_rows(total, True, len(lengths))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_lse_gradient_at_gluon_sizes(causal, device, monkeypatch):
    """Enough work for the Gluon backward kernels on sm_90 (configs.gluon_bwd_config: at least GLUON_BWD_MIN_FLOPS of
    forward work, causal too): dense and varlen, bf16, GQA."""
    from flashtriton import configs
    from flashtriton.kernels import backward as B
    from flashtriton.kernels.host import capability

    from test_backward_gluon import record_gluon_launches

    ran = record_gluon_launches(monkeypatch)
    q, k, v = leaves(device, b=1, sq=2048, sk=2048, hq=48, hkv=8, d=128, dtype=torch.bfloat16, seed=11)
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(q.shape, generator=gen).to(device=device, dtype=torch.bfloat16)
    u = torch.randn((1, 48, 2048), generator=gen).to(device)
    out, lse, _ = flashtriton.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    _check_lse_grads(torch.autograd.grad((out, lse), (q, k, v), (w, u)), q, k, v, w, u, causal)

    q, k, v = (t.detach().flatten(0, 1).requires_grad_() for t in leaves(device, b=1, sq=4096, sk=4096, hq=24,
                                                                            hkv=8, d=128, dtype=torch.bfloat16))
    cu = torch.tensor([0, 2000, 2048, 4096], dtype=torch.int32, device=device)
    w = torch.randn(q.shape, generator=gen).to(device=device, dtype=torch.bfloat16)
    u = torch.randn((24, 4096), generator=gen).to(device)
    out, lse, _ = flashtriton.flash_attn_varlen_func(q, k, v, cu, cu, 2048, 2048, causal=causal,
                                                     return_attn_probs=True)
    _check_lse_grads(torch.autograd.grad((out, lse), (q, k, v), (w, u)), q, k, v, w, u, causal, cu, cu)
    if (B.backward_gluon_launch is not None and dispatch.gluon_bwd_allowed()
            and capability(q.device)[0] == 9):
        assert ran.count("launch_dkdv_gluon") == 2  # both backwards ran the Gluon kernels, which read the padded delta


def test_lse_gradient_under_torch_compile(device):
    q, k, v = leaves(device, b=1, sq=10, sk=6, hq=2, hkv=1, dtype=torch.float32, seed=4)
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(q.shape, generator=gen).to(device)
    u = torch.randn((1, 2, 10), generator=gen).to(device)

    def loss(q, k, v):
        out, lse, _ = flashtriton.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        return (out * w).sum() + (lse * u).sum()

    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True)(q, k, v), (q, k, v))
    eager = torch.autograd.grad(loss(q, k, v), (q, k, v))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    _check_lse_grads(compiled, q, k, v, w, u, True)
