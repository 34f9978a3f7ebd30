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
