"""Every input flashtriton does not accept gets a clear error naming the argument; nothing is ignored."""

import fractions
import math

import numpy as np
import pytest
import torch

import flashtriton
from flashtriton import kvcache, validation


def qkv(device, b=1, s=8, h=2, d=16, dtype=torch.float16):
    return tuple(torch.randn(b, s, h, d, device=device, dtype=dtype) for _ in range(3))


@pytest.mark.parametrize("dropout_p,error", [(1.0, ValueError), (-0.1, ValueError), (float("nan"), ValueError),
                                             (2, ValueError), ("0.1", TypeError), (True, TypeError), (None, TypeError),
                                             (torch.tensor(0.1), TypeError)])
def test_a_bad_dropout_p_is_refused_by_name(dropout_p, error, device):
    q, k, v = qkv(device)
    for call in (lambda: flashtriton.flash_attn_func(q, k, v, dropout_p=dropout_p),
                 lambda: flashtriton.flash_attn_varlen_func(q[0], k[0], v[0], *_cu(device), 8, 8, dropout_p=dropout_p),
                 lambda: flashtriton.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                                                  dropout_p=dropout_p)):
        with pytest.raises(error, match="dropout_p"):
            call()


@pytest.mark.parametrize("flag", ["False", "True", None, 1.0, torch.tensor(False), [True]])
def test_a_bool_argument_that_is_not_a_bool_is_refused_by_name(flag, device):
    """causal="False" would be true by its truth value: every bool argument of the public functions takes a Python
    or NumPy bool or an integer and refuses the rest by name."""
    q, k, v = qkv(device)
    kc, vc = (torch.zeros(1, 16, 2, 16, device=device, dtype=q.dtype) for _ in range(2))
    lens = torch.tensor([4], device=device, dtype=torch.int32)
    sdpa = lambda **kw: flashtriton.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), **kw)  # noqa: E731
    calls = {
        "causal": [lambda f: flashtriton.flash_attn_func(q, k, v, causal=f),
                   lambda f: flashtriton.flash_attn_varlen_func(q[0], k[0], v[0], *_cu(device), 8, 8, causal=f),
                   lambda f: flashtriton.flash_attn_with_kvcache(q[:, :1], kc, vc, cache_seqlens=lens, causal=f)],
        "return_attn_probs": [lambda f: flashtriton.flash_attn_func(q, k, v, return_attn_probs=f)],
        "deterministic": [lambda f: flashtriton.flash_attn_varlen_func(q[0], k[0], v[0], *_cu(device), 8, 8,
                                                                       deterministic=f)],
        "is_causal": [lambda f: sdpa(is_causal=f)],
        "enable_gqa": [lambda f: sdpa(enable_gqa=f)],
        "rotary_interleaved": [lambda f: flashtriton.flash_attn_with_kvcache(q[:, :1], kc, vc, cache_seqlens=lens,
                                                                             rotary_interleaved=f)],
        "return_softmax_lse": [lambda f: flashtriton.flash_attn_with_kvcache(q[:, :1], kc, vc, cache_seqlens=lens,
                                                                             return_softmax_lse=f)],
    }
    for name, fns in calls.items():
        for fn in fns:
            with pytest.raises(TypeError, match=name):
                fn(flag)


def test_bool_arguments_take_numpy_bools_and_integers(device):
    q, k, v = qkv(device)
    causal = flashtriton.flash_attn_func(q, k, v, causal=True)
    for flag in (np.bool_(True), 1):
        assert torch.equal(flashtriton.flash_attn_func(q, k, v, causal=flag), causal)
    assert torch.equal(flashtriton.flash_attn_func(q, k, v, causal=np.bool_(False)), flashtriton.flash_attn_func(q, k, v))


@pytest.mark.parametrize("window,error", [((-2, 0), ValueError), ((1.5, 0), TypeError), ((True, 0), TypeError),
                                          (3, TypeError), ((1, 2, 3), TypeError), (torch.tensor([1.0, 1.0]), TypeError),
                                          (torch.tensor([1, 2, 3]), TypeError), (torch.tensor([[1, 1]]), TypeError),
                                          (torch.tensor([-2, 1]), ValueError), (torch.tensor([True, False]), TypeError),
                                          ((torch.tensor(1.5), 0), TypeError)])
def test_a_bad_window_is_refused_by_name(window, error, device):
    for call in (lambda: flashtriton.flash_attn_func(*qkv(device), window_size=window),
                 lambda: flashtriton.flash_attn_varlen_func(*(t[0] for t in qkv(device)), *_cu(device), 8, 8,
                                                            window_size=window)):
        with pytest.raises(error, match="window_size"):
            call()


def test_a_window_as_flash_attn_tests_draw_it(device):
    """flash-attn's own tests pass window_size = torch.randint(0, seqlen_k, (2,)): a 1-D integer tensor of two
    (or a pair of 0-d ones) is the window of its values, on any device."""
    q, k, v = qkv(device)
    expected = flashtriton.flash_attn_func(q, k, v, window_size=(3, 1))
    for window in (torch.tensor([3, 1]), torch.tensor([3, 1], dtype=torch.int32, device=device),
                   (torch.tensor(3), torch.tensor(1)), [3, torch.tensor(1, device=device)]):
        assert torch.equal(flashtriton.flash_attn_func(q, k, v, window_size=window), expected), window
        out = flashtriton.flash_attn_varlen_func(*(t[0] for t in (q, k, v)), *_cu(device), 8, 8, window_size=window)
        assert torch.equal(out, flashtriton.flash_attn_varlen_func(*(t[0] for t in (q, k, v)), *_cu(device), 8, 8,
                                                                     window_size=(3, 1)))


@pytest.mark.parametrize("softcap,error", [(-1.0, ValueError), (float("inf"), ValueError), (float("nan"), ValueError),
                                           ("30", TypeError), (True, TypeError)])
def test_a_bad_softcap_is_refused_by_name(softcap, error, device):
    with pytest.raises(error, match="softcap"):
        flashtriton.flash_attn_func(*qkv(device), softcap=softcap)


def _cu(device):
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
    return cu, cu


@pytest.mark.parametrize("slopes,error", [(lambda d: torch.ones(2, device=d, dtype=torch.float16), TypeError),
                                          (lambda d: torch.ones(3, device=d), ValueError),
                                          (lambda d: torch.ones(2, 2, device=d), ValueError),
                                          (lambda d: [0.5, 0.25], TypeError)])
def test_bad_alibi_slopes_are_refused_by_name(slopes, error, device):
    with pytest.raises(error, match="alibi_slopes"):
        flashtriton.flash_attn_func(*qkv(device), alibi_slopes=slopes(device))


def test_window_size_given_as_list_of_defaults_is_fine(device):
    flashtriton.flash_attn_func(*qkv(device), window_size=[-1, -1])


def test_sdpa_attn_mask_it_does_not_take_raises(device):
    """A general query-dependent mask, a causal mask below the diagonal or combined with key padding, a band the
    bottom-right window cannot state, a bias, a mask with is_causal, a mask of the wrong shape, dtype or device:
    each refused by name, never run as something else (tests/test_sdpa_mask.py runs the masks it takes)."""
    q, k, v = (t.transpose(1, 2) for t in qkv(device, b=2))
    causal = torch.ones(8, 8, dtype=torch.bool, device=device).tril()
    strictly_below = torch.ones(8, 8, dtype=torch.bool, device=device).tril(-1)
    general = causal.clone()
    general[5, 1] = False
    padded = causal[None, None].repeat(q.shape[0], 1, 1, 1)
    padded[0, :, :, 7] = False
    for mask in (strictly_below, general):
        with pytest.raises(NotImplementedError, match="causal mask .top-left or bottom-right. or a band"):
            flashtriton.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with pytest.raises(NotImplementedError, match="combined with key padding"):
        flashtriton.scaled_dot_product_attention(q, k, v, attn_mask=padded)
    # a top-left band with Sq < Sk: its right side would be negative about the bottom-right diagonal
    k2, v2 = torch.cat([k, k], 2), torch.cat([v, v], 2)
    band = (torch.arange(16, device=device)[None, :] - torch.arange(8, device=device)[:, None]).abs() <= 1
    with pytest.raises(NotImplementedError, match="neither"):
        flashtriton.scaled_dot_product_attention(q, k2, v2, attn_mask=band)
    with pytest.raises(NotImplementedError, match="bias"):
        flashtriton.scaled_dot_product_attention(q, k, v, attn_mask=torch.full((8,), 0.5, device=device))
    with pytest.raises(NotImplementedError, match="gradient"):  # (a float mask that would need its gradient)
        flashtriton.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(8, device=device, requires_grad=True))
    with pytest.raises(NotImplementedError, match="is_causal"):
        flashtriton.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, dtype=torch.bool, device=device),
                                                 is_causal=True)
    with pytest.raises(ValueError, match="does not broadcast"):
        flashtriton.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(7, dtype=torch.bool, device=device))
    with pytest.raises(TypeError, match="bool or floating"):
        flashtriton.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, dtype=torch.int32, device=device))
    with pytest.raises(TypeError, match="attn_mask must be a torch.Tensor"):
        flashtriton.scaled_dot_product_attention(q, k, v, attn_mask=[True] * 8)


def test_wrong_number_of_dims(device):
    q, k, v = qkv(device)
    with pytest.raises(ValueError, match=r"q must have 4 dims"):
        flashtriton.flash_attn_func(q[0], k, v)


def test_not_a_tensor(device):
    q, k, v = qkv(device)
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        flashtriton.flash_attn_func(q, k.tolist(), v)


@pytest.mark.parametrize("which,change,match", [
    ("k", lambda t: t[:, :5], "sequence lengths of k and v"),
    ("q", lambda t: torch.cat([t, t]), "batch sizes"),
    ("k", lambda t: t[..., :8], "head dims of q and k must match"),
    ("v", lambda t: t[..., :0], "v's head dim"),  # (v may have a head dim of its own: tests/test_head_dim_v.py)
    ("v", lambda t: t[:, :, :1], "same number of heads"),
])
def test_shape_mismatches(which, change, match, device):
    tensors = dict(zip("qkv", qkv(device)))
    tensors[which] = change(tensors[which])
    with pytest.raises(ValueError, match=match):
        flashtriton.flash_attn_func(tensors["q"], tensors["k"], tensors["v"])


def test_query_heads_not_a_multiple_of_kv_heads(device):
    q = torch.randn(1, 8, 3, 16, device=device, dtype=torch.float16)
    k = v = torch.randn(1, 8, 2, 16, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match="multiple of the number of key/value heads.*q: 3.*k/v: 2"):
        flashtriton.flash_attn_func(q, k, v)


def test_head_dim_above_256(device):
    with pytest.raises(ValueError, match="head dim must be between 1 and 256, got 272"):
        flashtriton.flash_attn_func(*qkv(device, d=272))


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.int8])
def test_unsupported_dtypes(dtype, device):
    q, k, v = qkv(device)
    with pytest.raises(TypeError, match="q must be float16, bfloat16 or float32"):
        flashtriton.flash_attn_func(q.to(dtype), k, v)


def test_mixed_dtypes(device):
    q, k, v = qkv(device)
    with pytest.raises(TypeError, match="share one dtype.*v=torch.bfloat16"):
        flashtriton.flash_attn_func(q, k, v.bfloat16())


def test_tensors_on_different_devices(device):
    q, k, v = qkv(device)
    with pytest.raises(ValueError, match="one device.*q on .*k on meta"):
        flashtriton.flash_attn_func(q, k.to("meta"), v)


def test_cpu_tensors_without_the_interpreter_say_what_to_do(monkeypatch):
    monkeypatch.setattr(validation, "INTERPRET", False)
    q, k, v = qkv("cpu")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        flashtriton.flash_attn_func(q, k, v)


def test_gpu_below_ampere_names_its_capability(monkeypatch):
    monkeypatch.setattr(flashtriton.configs, "capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    fake = torch.empty(0)
    with pytest.raises(RuntimeError, match="compute capability >= 8.0.*Tesla T4 has 7.5"):
        validation.check_device(("q",), (_CudaLooking(fake),))


class _CudaLooking:
    """Stands in for a CUDA tensor on a machine without one: only `.device` is read."""

    def __init__(self, tensor):
        self.device = torch.device("cuda", 0)


def test_softmax_scale_type(device):
    with pytest.raises(TypeError, match="softmax_scale must be a real number"):
        flashtriton.flash_attn_func(*qkv(device), softmax_scale="0.1")


def test_sdpa_gqa_needs_enable_gqa(device):
    q = torch.randn(1, 4, 8, 16, device=device, dtype=torch.float16)
    k = v = torch.randn(1, 2, 8, 16, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        flashtriton.scaled_dot_product_attention(q, k, v)


class TestVarlenCuSeqlens:
    def setup(self, device, cu=(0, 3, 8), total=8):
        x = torch.randn(total, 2, 16, device=device, dtype=torch.float16)
        return x, torch.tensor(cu, dtype=torch.int32, device=device)

    def test_not_int32(self, device):
        x, cu = self.setup(device)
        with pytest.raises(TypeError, match="cu_seqlens_k must have dtype torch.int32"):
            flashtriton.flash_attn_varlen_func(x, x, x, cu, cu.long(), 5, 5)

    def test_decreasing(self, device):
        x, cu = self.setup(device, cu=(0, 5, 3))
        with pytest.raises(ValueError, match="non-decreasing"):
            flashtriton.flash_attn_varlen_func(x, x, x, cu, cu, 5, 5)

    def test_past_the_end(self, device):
        x, cu = self.setup(device, cu=(0, 3, 9))
        with pytest.raises(ValueError, match="past the end"):
            flashtriton.flash_attn_varlen_func(x, x, x, cu, cu, 6, 6)

    def test_wrong_length(self, device):
        x, cu = self.setup(device)
        with pytest.raises(ValueError, match="length batch \\+ 1 = 3"):
            flashtriton.flash_attn_varlen_func(x, x, x, cu, cu[:2], 5, 5)

    def test_max_seqlen_too_small(self, device):
        x, cu = self.setup(device)
        with pytest.raises(ValueError, match="max_seqlen_k=4 is smaller than the longest sequence"):
            flashtriton.flash_attn_varlen_func(x, x, x, cu, cu, 5, 4)

    def test_max_seqlen_not_an_int(self, device):
        x, cu = self.setup(device)
        with pytest.raises(TypeError, match="max_seqlen_q must be a non-negative Python int"):
            flashtriton.flash_attn_varlen_func(x, x, x, cu, cu, torch.tensor(5), 5)

    def test_other_device(self, device):
        x, cu = self.setup(device)
        with pytest.raises(ValueError, match="cu_seqlens_q must be on"):
            flashtriton.flash_attn_varlen_func(x, x, x, cu.to("meta"), cu, 5, 5)

    def test_block_table_needs_page_pools(self, device):
        x, cu = self.setup(device)
        with pytest.raises(ValueError, match=r"k must have 4 dims \(num_pages, page_size, nheads_k, headdim\) with "
                                             "block_table"):
            flashtriton.flash_attn_varlen_func(x, x, x, cu, cu, 5, 5, block_table=cu)


@pytest.mark.parametrize("scale,exc", [(float("inf"), ValueError), (float("nan"), ValueError), (True, TypeError),
                                       (np.float32("nan"), ValueError), (np.bool_(True), TypeError)])
def test_softmax_scale_must_be_finite(scale, exc, device):
    with pytest.raises(exc, match="softmax_scale"):
        flashtriton.flash_attn_func(*qkv(device), softmax_scale=scale)
    q, k, v = (t.transpose(1, 2) for t in qkv(device))
    with pytest.raises(exc, match="scale"):
        flashtriton.scaled_dot_product_attention(q, k, v, scale=scale)


def test_softmax_scale_as_a_tensor_says_to_pass_a_number(device):
    with pytest.raises(TypeError, match=r"softmax_scale must be a real number.*got a torch.Tensor.*float\(\)"):
        flashtriton.flash_attn_func(*qkv(device), softmax_scale=torch.tensor(0.25))


@pytest.mark.parametrize("scale", [np.float32(0.3), np.float64(0.3), np.int64(1), fractions.Fraction(3, 10)])
def test_softmax_scale_accepts_any_real_number(scale, device):
    q, k, v = qkv(device)
    want = flashtriton.flash_attn_func(q, k, v, softmax_scale=float(scale))
    torch.testing.assert_close(flashtriton.flash_attn_func(q, k, v, softmax_scale=scale), want, atol=0, rtol=0)
    sdpa = flashtriton.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), scale=scale)
    torch.testing.assert_close(sdpa.transpose(1, 2), want, atol=0, rtol=0)


def test_a_negative_scale_is_refused_where_the_kernels_need_a_positive_one():
    """flash_attn_func / varlen / SDPA take a negative scale; a check without allow_negative (the decode path's)
    refuses it by name."""
    validation.check_scale("softmax_scale", -0.5, allow_negative=True)
    with pytest.raises(ValueError, match="softmax_scale must be a finite number >= 0.*got -0.5"):
        validation.check_scale("softmax_scale", -0.5)


def test_softcap_none_means_no_softcap(device):
    q, k, v = qkv(device)
    want = flashtriton.flash_attn_func(q, k, v)
    torch.testing.assert_close(flashtriton.flash_attn_func(q, k, v, softcap=None), want, atol=0, rtol=0)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=device)
    torch.testing.assert_close(flashtriton.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 8, 8, softcap=None,
                                                                  window_size=[-1, -1]), want[0], atol=0, rtol=0)
    validation.not_implemented("softcap", None, 0.0)  # what flash_attn_with_kvcache calls
    with pytest.raises(NotImplementedError, match="dropout_p=None"):  # None is no other argument's default
        validation.not_implemented("dropout_p", None, 0.0)


class _Strided:
    """Only shape and strides, as check_int32_offsets reads them (a real one would need >= 4 GiB)."""

    def __init__(self, shape, stride):
        self.shape, self._stride = shape, stride

    def stride(self, dim=None):
        return self._stride if dim is None else self._stride[dim]


@pytest.mark.parametrize("shape,stride", [
    ((1, 2**20, 32, 128), (2**32, 32 * 128, 128, 1)),  # 1M tokens x 32 heads x 128: S*H*D = 2**32
    ((1, 2**18, 64, 128), (2**31, 128, 2**25, 1)),  # torch's (B, H, S, D) seen as (B, S, H, D): H x S*D
    ((2, 1100, 8, 64), (2**32, 2**21, 64, 1)),  # a strided view with huge row strides
])
def test_offsets_beyond_int32_are_refused(shape, stride):
    t = _Strided(shape, stride)
    with pytest.raises(NotImplementedError, match="32-bit offsets"):
        validation.check_int32_offsets(("q",), (t,), (shape[1],))


def test_offsets_within_int32_pass():
    validation.check_int32_offsets(("q",), (_Strided((64, 4096, 32, 128), (2**24, 4096, 128, 1)),), (4096,))


def test_an_output_of_v_s_larger_head_dim_counts():
    """q (1M tokens, 16 heads, D=64) spans 2**30 elements, its output of v's head dim 128 2**31."""
    q = _Strided((1, 2**20, 16, 64), (2**30, 16 * 64, 64, 1))
    validation.check_int32_offsets(("q",), (q,), (2**20,), 64)
    with pytest.raises(NotImplementedError, match="32-bit offsets"):
        validation.check_int32_offsets(("q",), (q,), (2**20,), 128)


def test_batches_and_heads_beyond_the_launch_grid_are_refused(device):
    """The kernels' grid holds heads and batch entries on CUDA's y / z axes (at most 65535 each): more is refused
    before anything is launched, in every entry point (tensors with expanded strides: no memory behind them)."""
    many = validation.GRID_LIMIT + 1
    q = torch.randn(1, 1, 1, 16, device=device, dtype=torch.float16).expand(many, 1, 1, 16)
    with pytest.raises(NotImplementedError, match="launch grid"):
        flashtriton.flash_attn_func(q, q, q)
    with pytest.raises(NotImplementedError, match="launch grid"):
        flashtriton.scaled_dot_product_attention(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2))
    heads = torch.randn(1, 1, 1, 16, device=device, dtype=torch.float16).expand(1, 1, many, 16)
    with pytest.raises(NotImplementedError, match="launch grid"):
        flashtriton.flash_attn_func(heads, heads, heads)
    packed = torch.randn(1, 1, 16, device=device, dtype=torch.float16)
    cu = torch.tensor([0] + [1] * many, dtype=torch.int32, device=device)  # one token, then empty sequences
    with pytest.raises(NotImplementedError, match="launch grid"):
        flashtriton.flash_attn_varlen_func(packed, packed, packed, cu, cu, 1, 1)
    validation.check_grid(validation.GRID_LIMIT, validation.GRID_LIMIT)  # the limit itself is fine


def test_gluon_work_units_must_fit_32_bit_counters():
    """Varlen work units span the longest sequence's query tiles for every sequence: many (empty) sequences with
    one long one would overflow the Gluon kernel's int32 unit count; its launcher refuses that, and the
    dispatch leaves such batches to the TMA kernel (whose grid is (tiles, heads, batch))."""
    gluon_launch = pytest.importorskip("flashtriton.kernels.forward_gluon_launch")
    from flashtriton import configs

    config = configs.gluon_varlen_config(128, 2**20, 2**20, True)
    assert gluon_launch.work_units(2**20, 64, 40000, config, True) >= gluon_launch.UNIT_LIMIT
    assert gluon_launch.work_units(4096, 16, 64, config, True) == 32 * 16 * 64
    with pytest.raises(ValueError, match="32-bit"):
        gluon_launch.launch_parts((2**20, 64, 128), (2**20, 8, 128), True, True, config, 132, 40000, 2**20, 2**20)


def test_strided_cu_seqlens_are_read_as_their_values(device):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(10, 2, 16, generator=gen).to(device=device, dtype=torch.float16)
    cu_strided = torch.tensor([0, 0, 3, 3, 10, 10], dtype=torch.int32, device=device)[::2]  # values 0, 3, 10
    cu = cu_strided.contiguous()
    assert not cu_strided.is_contiguous()
    torch.testing.assert_close(flashtriton.flash_attn_varlen_func(x, x, x, cu_strided, cu_strided, 7, 7),
                               flashtriton.flash_attn_varlen_func(x, x, x, cu, cu, 7, 7))


def test_cu_seqlens_values_are_copied_once_per_tensor_until_written(device, monkeypatch):
    """The value check copies cu_seqlens to the host, which waits for the GPU: a tensor that passed is not
    copied again until it is written (version counter), and a new tensor is always checked."""
    calls = []
    check = validation._check_cu_seqlens_values
    monkeypatch.setattr(validation, "_check_cu_seqlens_values", lambda *a: calls.append(1) or check(*a))
    monkeypatch.setattr(validation, "_CHECKED_CU_SEQLENS", {})
    x = torch.randn(10, 2, 16, device=device, dtype=torch.float16)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32, device=device)
    first = flashtriton.flash_attn_varlen_func(x, x, x, cu, cu, 7, 7)
    torch.testing.assert_close(flashtriton.flash_attn_varlen_func(x, x, x, cu, cu, 7, 7), first)
    assert len(calls) == 1
    flashtriton.flash_attn_varlen_func(x, x, x, cu, cu, 8, 8)  # another maximum: checked again
    assert len(calls) == 2
    fresh = cu.clone()
    flashtriton.flash_attn_varlen_func(x, x, x, fresh, fresh, 7, 7)
    assert len(calls) == 3
    cu[1] = 11  # written in place: past the end now, and found
    with pytest.raises(ValueError, match="non-decreasing|past the end"):
        flashtriton.flash_attn_varlen_func(x, x, x, cu, cu, 7, 7)
    with torch.inference_mode():  # inference tensors carry no version counter: always checked
        cu_inf = torch.tensor([0, 3, 10], dtype=torch.int32, device=device)
        flashtriton.flash_attn_varlen_func(x, x, x, cu_inf, cu_inf, 7, 7)
        flashtriton.flash_attn_varlen_func(x, x, x, cu_inf, cu_inf, 7, 7)
    assert len(calls) == 6


def test_checks_are_remembered_per_signature(device, monkeypatch):
    """A call whose signature passed the checks skips them (not a check runs), with the same result; any argument
    the checks would refuse is another signature and still gets its error, as does the same signature once the
    state the checks read (the interpreter switch) changes."""
    q, k, v = qkv(device, b=2)
    first = flashtriton.flash_attn_func(q, k, v, causal=True, window_size=(3, 0), softcap=5.0)
    assert validation.checked(validation.checked_key((q, k, v), (None, None), (0.0, None, (3, 0), 5.0))) is not None

    def refuse(*args, **kwargs):
        raise AssertionError("a check ran for a signature that passed")

    with monkeypatch.context() as m:
        m.setattr(validation, "check_tensors", refuse)
        again = flashtriton.flash_attn_func(q, k, v, causal=True, window_size=(3, 0), softcap=5.0)
    assert torch.equal(first, again)
    with pytest.raises(ValueError, match="softcap"):
        flashtriton.flash_attn_func(q, k, v, causal=True, window_size=(3, 0), softcap=-5.0)
    with pytest.raises(ValueError, match="window_size"):
        flashtriton.flash_attn_func(q, k, v, causal=True, window_size=(-3, 0), softcap=5.0)
    with pytest.raises(ValueError, match="softmax_scale must be a finite"):
        flashtriton.flash_attn_func(q, k, v, causal=True, window_size=(3, 0), softcap=5.0, softmax_scale=math.nan)
    with pytest.raises(ValueError, match="batch sizes"):
        flashtriton.flash_attn_func(q, k[:1], v[:1], causal=True, window_size=(3, 0), softcap=5.0)
    with pytest.raises(TypeError, match="window_size must hold two ints"):
        flashtriton.flash_attn_func(q, k, v, causal=True, window_size=(3.0, 0), softcap=5.0)
    if device == "cpu":
        monkeypatch.setattr(validation, "INTERPRET", False)
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            flashtriton.flash_attn_func(q, k, v, causal=True, window_size=(3, 0), softcap=5.0)


def test_window_none_is_unbounded(device, monkeypatch):
    """None for the whole window or for one side is unbounded (FlashAttention-4's spelling), the same call as -1,
    in the dense, varlen and KV-cache entry points."""
    q, k, v = qkv(device, b=2, s=24)
    for none, ints in (((None, None), (-1, -1)), (None, (-1, -1)), ((5, None), (5, -1)), ((None, 3), (-1, 3))):
        assert validation.check_window(none) == ints
        assert torch.equal(flashtriton.flash_attn_func(q, k, v, window_size=none),
                           flashtriton.flash_attn_func(q, k, v, window_size=ints))
    cu = torch.tensor([0, 24, 48], dtype=torch.int32, device=device)
    packed = [t.reshape(48, *t.shape[2:]) for t in (q, k, v)]
    assert torch.equal(flashtriton.flash_attn_varlen_func(*packed, cu, cu, 24, 24, causal=True, window_size=(7, None)),
                       flashtriton.flash_attn_varlen_func(*packed, cu, cu, 24, 24, causal=True, window_size=(7, -1)))
    planned = flashtriton.flash_attn_with_kvcache(q[:, :1], k, v, causal=True)
    with monkeypatch.context() as m:  # a None side keys the plan an explicit -1 made
        m.setattr(kvcache, "_unplanned_call", lambda *a, **kw: pytest.fail("None took the unplanned path"))
        assert torch.equal(flashtriton.flash_attn_with_kvcache(q[:, :1], k, v, causal=True, window_size=(None, None)),
                           planned)
    with pytest.raises(TypeError, match="window_size must hold two ints"):
        validation.check_window((None, 2.5))


def test_sdpa_checks_are_remembered_per_signature(device, monkeypatch):
    """As `test_checks_are_remembered_per_signature`, for `scaled_dot_product_attention`."""
    q, k, v = (t.transpose(1, 2) for t in qkv(device, b=2))
    first = flashtriton.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    with monkeypatch.context() as m:
        m.setattr(validation, "check_tensors", lambda *a, **kw: pytest.fail("a check ran for a signature that passed"))
        assert torch.equal(first, flashtriton.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3))
    causal = torch.ones(8, 8, dtype=torch.bool, device=device).tril()
    assert torch.equal(first, flashtriton.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=0.3))
    causal[6, 2] = False  # (no longer a causal mask: refused)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        flashtriton.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=0.3)
    with pytest.raises(ValueError, match="enable_gqa"):
        flashtriton.scaled_dot_product_attention(q, k[:, :1], v[:, :1], is_causal=True, scale=0.3)
    with pytest.raises(ValueError, match="dropout_p must be in"):
        flashtriton.scaled_dot_product_attention(q, k, v, dropout_p=1.5, is_causal=True, scale=0.3)
