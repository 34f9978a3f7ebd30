"""flash_attn_combine: attention over chunks of the keys, merged through the chunks' lse, is attention over all of
them (against float64), with FA3's layouts, -inf splits, out= / out_dtype, gradients and refusals by name."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashtriton


def partial_attention(q, k, v, visible, chunks):
    """float64 attention of q (B, S, H, D) over each key chunk: out (splits, B, S, H, D), lse (splits, B, S, H),
    and over all keys: out, lse. visible: (S, Sk) bool. A row that sees no key of a chunk: out 0, lse -inf."""
    scores = torch.einsum("bshd,bthd->bhst", q.double(), k.double()) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~visible, float("-inf"))

    def attend(keys):
        s = scores[..., keys]
        lse = torch.logsumexp(s, -1)  # (B, H, S)
        p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0)[..., None])
        out = torch.einsum("bhst,bthd->bshd", p, v.double()[:, keys])
        return out, lse.transpose(1, 2)  # (B, S, H, D), (B, S, H)

    parts = [attend(c) for c in chunks]
    full = attend(slice(None))
    return torch.stack([o for o, _ in parts]), torch.stack([lse for _, lse in parts]), *full


def random_case(gen, batch=2, seqlen=19, seqlen_k=45, heads=3, dim=24, causal=True, cuts=(0, 7, 30, 31, 45)):
    q, k, v = (torch.randn(batch, s, heads, dim, generator=gen) for s in (seqlen, seqlen_k, seqlen_k))
    rows, cols = torch.arange(seqlen)[:, None], torch.arange(seqlen_k)[None, :]
    visible = cols <= rows + seqlen_k - seqlen if causal else torch.ones(seqlen, seqlen_k, dtype=torch.bool)
    chunks = [slice(a, b) for a, b in zip(cuts[:-1], cuts[1:])]
    return partial_attention(q, k, v, visible, chunks)


@pytest.mark.parametrize("causal", [False, True])
def test_merged_chunks_equal_full_attention(causal, device):
    """Causal: the later chunks are -inf for the first rows (and the last chunk for all but the last row)."""
    out_p, lse_p, out, lse = random_case(torch.Generator().manual_seed(0), causal=causal)
    if causal:
        assert torch.isinf(lse_p).any()
    out_p = torch.where(torch.isfinite(lse_p)[..., None], out_p, float("nan"))  # what -inf splits hold is ignored
    got, got_lse = flashtriton.flash_attn_combine(out_p.float().to(device), lse_p.float().to(device))
    assert got.dtype == torch.float32 and got.shape == out.shape and got_lse.shape == lse.shape
    assert got_lse.stride() == torch.empty(2, 3, 19).transpose(1, 2).stride()  # FA3's (B, H, S) storage
    torch.testing.assert_close(got.double().cpu(), out, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got_lse.double().cpu(), lse, atol=2e-6, rtol=1e-6)


def test_rows_whose_splits_are_all_minus_inf(device):
    gen = torch.Generator().manual_seed(1)
    out_p, lse_p = torch.randn(4, 1, 6, 2, 8, generator=gen), torch.randn(4, 1, 6, 2, generator=gen)
    lse_p[:, :, 2] = float("-inf")  # row 2: no split saw a key
    lse_p[1:, :, 3, 1] = float("-inf")  # row 3, head 1: only split 0 did
    out_p[lse_p == float("-inf")] = float("nan")
    out_p, lse_p = out_p.to(device), lse_p.to(device)
    got, got_lse = flashtriton.flash_attn_combine(out_p, lse_p)
    assert torch.all(got[:, 2] == 0) and torch.all(got_lse[:, 2] == float("-inf"))
    assert torch.equal(got[:, 3, 1], out_p[0, :, 3, 1])
    assert torch.isfinite(got).all()


def test_single_split_is_the_split(device):
    gen = torch.Generator().manual_seed(2)
    out_p, lse_p = torch.randn(1, 2, 33, 4, 40, generator=gen).to(device), 5 * torch.randn(1, 2, 33, 4).to(device)
    got, got_lse = flashtriton.flash_attn_combine(out_p, lse_p)
    assert torch.equal(got, out_p[0])
    torch.testing.assert_close(got_lse, lse_p[0], atol=0, rtol=1e-6)


def test_flashtritons_own_chunks_and_strided_layouts(device):
    """Ring attention's use: flash_attn_func over two key chunks, lse stacked and transposed (views), merged."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, s, 4, 32, generator=gen).to(device) for s in (11, 40, 40))
    parts = [flashtriton.flash_attn_func(q, k[:, c], v[:, c], return_attn_probs=True) for c in (slice(0, 25),
                                                                                               slice(25, 40))]
    lse_p = torch.stack([lse for _, lse, _ in parts]).transpose(2, 3)  # (2, B, S, H), not contiguous
    out, lse = flashtriton.flash_attn_combine(torch.stack([o for o, _, _ in parts]), lse_p)
    full, full_lse, _ = flashtriton.flash_attn_func(q, k, v, return_attn_probs=True)
    torch.testing.assert_close(out, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, full_lse.transpose(1, 2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_out_dtype_and_out(out_dtype, device):
    out_p, lse_p, exact, _ = random_case(torch.Generator().manual_seed(4), seqlen=7, seqlen_k=20, cuts=(0, 9, 20))
    out_p, lse_p = out_p.float().to(device), lse_p.float().to(device)
    got, _ = flashtriton.flash_attn_combine(out_p, lse_p, out_dtype=out_dtype)
    assert got.dtype == out_dtype
    ulp = {torch.float16: 2**-10, torch.bfloat16: 2**-7}[out_dtype]  # the interpreter truncates to bf16
    torch.testing.assert_close(got.double().cpu(), exact, atol=ulp, rtol=ulp)
    buffer = torch.full((2, 3, 7, 24), float("nan"), dtype=out_dtype, device=device)
    out = buffer.transpose(1, 2)  # (B, S, H, D) with strides of its own
    returned, lse = flashtriton.flash_attn_combine(out_p, lse_p, out=out, out_dtype=out_dtype)
    assert returned is out and torch.equal(out, got) and lse.shape == (2, 7, 3)


def test_varlen_form(device):
    """FA4's (num_splits, total_q, nheads, headdim) form: the batch dim left out."""
    out_p, lse_p, exact, exact_lse = random_case(torch.Generator().manual_seed(5), batch=1, seqlen=9, seqlen_k=20,
                                                 cuts=(0, 12, 20))
    got, got_lse = flashtriton.flash_attn_combine(out_p[:, 0].float().to(device), lse_p[:, 0].float().to(device))
    assert got.shape == (9, 3, 24) and got_lse.shape == (9, 3)
    torch.testing.assert_close(got.double().cpu(), exact[0], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got_lse.double().cpu(), exact_lse[0], atol=2e-6, rtol=1e-6)
    out = torch.empty(9, 3, 24, device=device)
    assert flashtriton.flash_attn_combine(out_p[:, 0].float().to(device), lse_p[:, 0].float().to(device),
                                          out=out)[0] is out
    torch.testing.assert_close(out, got, atol=0, rtol=0)


def test_gradients_match_autograd_of_the_formula(device):
    gen = torch.Generator().manual_seed(6)
    out_p, lse_p = torch.randn(3, 2, 5, 2, 8, generator=gen), torch.randn(3, 2, 5, 2, generator=gen)
    lse_p[2, :, :2] = float("-inf")  # a split without keys for two rows
    lse_p[:, 1, 4] = float("-inf")  # a row without keys at all
    g_out, g_lse = torch.randn(2, 5, 2, 8, generator=gen), torch.randn(2, 5, 2, generator=gen)

    def formula(o, lse_s):
        lse = torch.logsumexp(lse_s, 0)
        w = torch.exp(lse_s - torch.where(torch.isfinite(lse), lse, 0))
        return (w[..., None] * o).sum(0), lse

    ref_leaves = [out_p.double().requires_grad_(), lse_p.double().requires_grad_()]
    ref_out, ref_lse = formula(*ref_leaves)
    ((ref_out * g_out).sum() + (torch.where(torch.isfinite(ref_lse), ref_lse, 0) * g_lse).sum()).backward()
    leaves = [out_p.to(device).requires_grad_(), lse_p.to(device).requires_grad_()]
    out, lse = flashtriton.flash_attn_combine(*leaves)
    ((out * g_out.to(device)).sum() + (torch.where(torch.isfinite(lse), lse, 0) * g_lse.to(device)).sum()).backward()
    for got, ref in zip(leaves, ref_leaves):
        ref_grad = torch.nan_to_num(ref.grad, nan=0.0)  # logsumexp's backward over an all -inf row: NaN
        torch.testing.assert_close(got.grad.double().cpu(), ref_grad, atol=1e-6, rtol=1e-5)
    assert torch.all(leaves[1].grad[:, 1, 4] == 0) and torch.all(leaves[1].grad[2, :, :2] == 0)


def test_empty_and_no_grad_paths(device):
    out, lse = flashtriton.flash_attn_combine(torch.zeros(2, 0, 3, 4, 8, device=device),
                                              torch.zeros(2, 0, 3, 4, device=device))
    assert out.shape == (0, 3, 4, 8) and lse.shape == (0, 3, 4)
    with torch.no_grad():
        out, _ = flashtriton.flash_attn_combine(torch.zeros(2, 1, 3, 4, 8, device=device, requires_grad=True),
                                                torch.zeros(2, 1, 3, 4, device=device))
    assert out.grad_fn is None


def test_bad_inputs_raise_naming_the_argument(device):
    op, lp = torch.zeros(2, 1, 3, 4, 8, device=device), torch.zeros(2, 1, 3, 4, device=device)
    combine = flashtriton.flash_attn_combine
    with pytest.raises(TypeError, match="out_partial must be a torch.Tensor"):
        combine(op.tolist(), lp)
    with pytest.raises(TypeError, match="out_partial must be float32"):
        combine(op.half(), lp)
    with pytest.raises(TypeError, match="lse_partial must be float32"):
        combine(op, lp.double())
    with pytest.raises(ValueError, match="out_partial must have 5 dims"):
        combine(op[0, 0], lp[0])
    with pytest.raises(ValueError, match=r"lse_partial must have shape \(num_splits, batch, seqlen, nheads\)"):
        combine(op, lp.transpose(2, 3))
    with pytest.raises(ValueError, match="lse_partial must have shape"):
        combine(op, lp[:1])
    with pytest.raises(ValueError, match="at least one split"):
        combine(op[:0], lp[:0])
    with pytest.raises(ValueError, match="headdim must be at most 512"):
        combine(torch.zeros(1, 1, 1, 1, 513, device=device), torch.zeros(1, 1, 1, 1, device=device))
    with pytest.raises(TypeError, match="out_dtype must be"):
        combine(op, lp, out_dtype=torch.float64)
    with pytest.raises(TypeError, match="out must have dtype torch.float32"):
        combine(op, lp, out=torch.zeros(1, 3, 4, 8, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match=r"out must have shape \(1, 3, 4, 8\)"):
        combine(op, lp, out=torch.zeros(1, 4, 3, 8, device=device))
    with pytest.raises(ValueError, match="stride-0"):
        combine(op, lp, out=torch.zeros(1, 1, 1, 8, device=device).expand(1, 3, 4, 8))
    with pytest.raises(TypeError, match="out must be a torch.Tensor or None"):
        combine(op, lp, out=0)
    with pytest.raises(RuntimeError, match="with out= is not differentiable"):
        combine(op.clone().requires_grad_(), lp, out=torch.zeros(1, 3, 4, 8, device=device))
    with pytest.raises(ValueError, match="all inputs must be on one device"):
        combine(op, lp.to("meta"))
    with pytest.raises(ValueError, match="flashtriton runs on CUDA GPUs"):
        combine(op.to("meta"), lp.to("meta"))


def test_kernel_compiles_for_sm90_without_a_gpu():
    """Triton's compiler (not the interpreter) takes the kernel at the head dims and output dtypes it serves: in a
    fresh process without the interpreter."""
    script = (
        "import torch\n"
        "from flashtriton.kernels.combine import compile_for_sm90\n"
        "for d, dtype in ((1, torch.float32), (64, torch.bfloat16), (128, torch.float16), (512, torch.float32)):\n"
        "    assert '.target sm_90' in compile_for_sm90(d, dtype).asm['ptx']\n"
        "    print('compiled', d, dtype)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(flashtriton.__file__).parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 4


def test_torch_compile_fullgraph(device):
    """One graph: the ops flashtriton::combine (with its backward) and flashtriton::combine_out."""
    import torch._dynamo.testing

    torch._dynamo.reset()
    out_p, lse_p, _, _ = random_case(torch.Generator().manual_seed(7), seqlen=5, seqlen_k=12, cuts=(0, 4, 12))
    out_p, lse_p = out_p.float().to(device), lse_p.float().to(device)

    def step(o, lse_s, buffer):
        out, lse = flashtriton.flash_attn_combine(o, lse_s)
        flashtriton.flash_attn_combine(o.detach(), lse_s.detach(), out=buffer)
        return out, lse

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    results = {}
    for name, fn in (("eager", step), ("compiled", compiled)):
        leaves = [out_p.clone().requires_grad_(), lse_p.clone().requires_grad_()]
        buffer = torch.empty(out_p.shape[1:], device=device)
        out, lse = fn(*leaves, buffer)
        (out.sum() + lse.sum()).backward()
        results[name] = (out, lse, buffer, *(t.grad for t in leaves))
    assert counter.frame_count == 1
    for eager, compiled_result in zip(results["eager"], results["compiled"]):
        torch.testing.assert_close(compiled_result, eager, atol=0, rtol=0)
