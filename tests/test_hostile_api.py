"""Uses of the public API beyond a plain call: double backward, threads, torch.func transforms, the gradient of
the returned log-sum-exp. Each either works exactly or raises an error that names what is not supported."""

import threading

import pytest
import torch

import flashtriton
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


def test_kvcache_refuses_a_negative_scale_by_name(device):
    """The decode kernels take the running maximum of the unscaled scores: a negative scale is refused there."""
    q = torch.randn(1, 1, 2, 16, device=device)
    cache = torch.randn(1, 16, 2, 16, device=device)
    with pytest.raises(ValueError, match="softmax_scale must be a finite number >= 0"):
        flashtriton.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=5, softmax_scale=-0.5)


def test_kvcache_takes_numpy_scales_and_softcap_none(device):
    np = pytest.importorskip("numpy")
    q = torch.randn(1, 1, 2, 16, device=device)
    k_cache, v_cache = torch.randn(1, 16, 2, 16, device=device), torch.randn(1, 16, 2, 16, device=device)
    want = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5, softmax_scale=0.3)
    got = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5, softmax_scale=np.float32(0.3),
                                              softcap=None, window_size=[-1, -1])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
