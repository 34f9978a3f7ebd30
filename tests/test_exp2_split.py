"""`variant.exp2_split` (half of the exponentials by a polynomial on the FMA pipes) and the Gluon forward's
EXP2_SPLIT config key.

The PTX cannot run on a CPU: here a float32 emulation of its polynomial half, instruction by instruction, with the
constants read from the PTX text itself, measures its error over every exponent; the offline sm_90 build shows
that the switch reaches the kernel (half the MUFU.EX2, no conversion instruction added); on a Hopper GPU the
kernel with it on is checked against float64."""

import math
import re

import pytest
import torch

from flashtriton import configs
from flashtriton.kernels import forward_gluon_launch as G
from flashtriton.kernels import variant as V
from flashtriton.kernels.variant import Variant
from flashtriton.reference import attention_reference

from accuracy import assert_close_to_exact, torch_attention
from test_forward import make_qkv
from test_forward_gluon import GLUON_VARIANTS, SHAPES, compile_in_fresh_process, hopper_only


def _f32(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32).item()


def _ptx_constants():
    """(clamp, shift, coefficients c4 .. c0) as the PTX spells them (0fXXXXXXXX literals, in order)."""
    values = [_f32(int(h, 16)) for h in re.findall(r"0f([0-9A-F]{8})", V.EXP2_SPLIT_PTX.value)]
    clamp, shift, shift_again, *coefs = values
    assert shift == shift_again
    return clamp, shift, coefs


def _fma(a, b, c):
    """fp32 fma: the product is exact in float64, the sum rounded there and again to fp32 (within an ulp of the
    hardware's single rounding)."""
    return (a.double() * b.double() + c.double()).float()


def emulate_poly(x: torch.Tensor) -> torch.Tensor:
    """`EXP2_SPLIT_PTX`'s second element, in float32 as the PTX computes it: c = max(x, -127); s = c + shift
    rounded down (the exact sum lies in [shift + floor(c), shift + floor(c) + 1), whose ends are fp32 integers:
    floor(c) + shift); f = s - shift; r = c - f (both exact); Horner by fmas; the bits of s shifted left by 23
    taken as an fp32 scale, and the product p · scale (a power of two, or 0, or inf: exact)."""
    clamp, shift, coefs = _ptx_constants()
    x = x.float()
    c = torch.clamp_min(x, clamp)
    s = torch.floor(c) + shift
    r = c - (s - shift)
    p = _fma(r, torch.full_like(r, coefs[0]), torch.full_like(r, coefs[1]))
    for coef in coefs[2:]:
        p = _fma(p, r, torch.full_like(r, coef))
    bits = (s.view(torch.int32).to(torch.int64) << 23) & 0xFFFFFFFF
    scale = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)
    return p * scale


def test_ptx_spells_the_documented_polynomial():
    clamp, shift, coefs = _ptx_constants()
    assert clamp == -127.0 and shift == V.EXP2_SHIFT == 1.5 * 2**23 + 127
    assert coefs == [torch.tensor(c, dtype=torch.float32).item() for c in reversed(V.EXP2_POLY)]


def test_polynomial_relative_error_over_every_exponent():
    """Max relative error against float64 over a dense grid of x in [-126, 0] and [0, 128) plus the integers and
    their neighbours (where floor changes): 2.7e-6, below fp16's unit roundoff (4.9e-4) by two orders."""
    grid = torch.cat([torch.linspace(-126.0, 0.0, 2_000_001), torch.linspace(0.0, 127.99, 1_000_001),
                      torch.linspace(-1.0, 0.0, 1_000_001)]).float()
    ints = torch.arange(-126, 128, dtype=torch.float32)
    edges = torch.cat([ints, torch.nextafter(ints, ints - 1), torch.nextafter(ints, ints + 1)])
    x = torch.cat([grid, edges[edges >= -126]])
    got = emulate_poly(x).double()
    exact = torch.exp2(x.double())
    rel = ((got - exact) / exact).abs()
    worst = rel.max().item()
    print(f"exp2_split polynomial: max relative error {worst:.3e} at x = {x[rel.argmax()].item():.7g}")
    assert worst < 3e-6
    assert torch.all(torch.isfinite(got))


def test_polynomial_is_exactly_zero_below_the_normal_range_and_inf_above():
    """A masked score (-inf) and anything below -126 weigh exactly 0, as ex2.approx.ftz (the other half) gives
    there: a row with no visible key keeps l = 0 and lse = -inf. 128 <= x < 129 overflows to inf."""
    low = torch.tensor([-math.inf, -1e30, -200.0, -127.5, -127.0, -126.5, -126.000008])
    got = emulate_poly(low)
    assert torch.all(got == 0) and not torch.any(torch.signbit(got))
    assert emulate_poly(torch.tensor([-126.0])).item() > 0
    assert torch.all(torch.isinf(emulate_poly(torch.tensor([128.0, 128.5]))))


def test_interpreter_falls_back_to_exp2():
    """Under the interpreter (no PTX) `exp2_split` is exp2."""
    import triton
    import triton.language as tl

    from flashtriton._env import INTERPRET

    if not INTERPRET:
        pytest.skip("the interpreter's fallback")

    @triton.jit
    def kernel(X, Y, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(Y + offs, V.exp2_split(tl.load(X + offs)))

    x = torch.tensor([-math.inf, -200.0, -10.5, -1.0, 0.0, 3.25, 100.0, -0.001])
    y = torch.empty_like(x)
    kernel[(1,)](x, y, 8)
    assert torch.equal(y, torch.exp2(x))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inline PTX: a CUDA GPU")
def test_exp2_split_on_the_gpu_is_its_emulation_on_half_the_elements():
    """On a GPU: every result within the polynomial's error of 2^x and exactly 0 below -126; half of them are the
    emulated polynomial's bit for bit (up to the emulation's fma, within an ulp), the other half MUFU's."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(X, Y, N: tl.constexpr):
        offs = tl.program_id(0) * N + tl.arange(0, N)
        tl.store(Y + offs, V.exp2_split(tl.load(X + offs)))

    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.tensor([-math.inf, -200.0, -126.5, -127.0] * 256), torch.rand(1 << 20, generator=gen) * -126.0,
                   torch.rand(1 << 16, generator=gen) * 127.0])  # a multiple of 1024 elements
    y = torch.empty_like(x, device="cuda")
    kernel[(x.numel() // 1024,)](x.cuda(), y, 1024)
    y = y.cpu()
    exact = torch.exp2(x.double())
    low = x < -126
    assert torch.all(y[low] == 0)
    rel = ((y[~low].double() - exact[~low]) / exact[~low]).abs()
    assert rel.max().item() < 3e-6
    emulated = emulate_poly(x)
    poly = (y - emulated).abs() <= emulated.abs() * 2.0**-23
    assert 0.45 < poly[~low].float().mean().item() < 0.55, "the polynomial and MUFU halves"
    assert ((y[~low & ~poly].double() - exact[~low & ~poly]) / exact[~low & ~poly]).abs().max().item() < 1e-6


def test_config_key_defaults_off_and_reaches_the_kernel():
    base = configs.gluon_fwd_config(128, 4096, 4096, True)
    assert "EXP2_SPLIT" not in base  # the tables leave it off
    shapes = ((2, 256, 4, 128), (2, 256, 4, 128), True, True)
    assert G.launch_parts(*shapes, base, 132)[2]["EXP2_SPLIT"] is False
    assert G.launch_parts(*shapes, dict(base, EXP2_SPLIT=True), 132)[2]["EXP2_SPLIT"] is True
    assert G.kernel_config(base) == dict(base, EXP2_SPLIT=False) and "EXP2_SPLIT" not in base
    with pytest.raises(ValueError, match="unknown keys \\['EXP2'\\]"):
        G.launch_parts(*shapes, dict(base, EXP2=True), 132)


def test_exp2_split_compiles_for_sm90():
    """The dispatched configs at D = 64 and 128, causal or not, and softcap, with EXP2_SPLIT on: the PTX keeps
    ex2.approx for half of p's exponentials (alpha's and the epilogue's stay whole) and has the polynomial's
    rounded add; off, the PTX has no polynomial. In the SASS the split halves MUFU.EX2 and adds no conversion
    (F2I / FRND / I2F run on the same unit as MUFU). In a fresh process (this one may run the interpreter)."""
    script = (
        "import re, subprocess, tempfile\n"
        "import triton.knobs\n"
        "from flashtriton import configs\n"
        "from flashtriton.kernels.forward_gluon_launch import compile_for_sm90\n"
        "from flashtriton.kernels.variant import Variant\n"
        "def sass_counts(cubin):\n"
        "    with tempfile.NamedTemporaryFile('wb', suffix='.cubin') as f:\n"
        "        f.write(cubin); f.flush()\n"
        "        sass = subprocess.run([triton.knobs.nvidia.cuobjdump.path, '-sass', f.name], capture_output=True,\n"
        "                              text=True, check=True).stdout\n"
        "    return (len(re.findall(r'MUFU\\.EX2', sass)), len(re.findall(r'\\b(?:F2I|FRND|I2F)\\b', sass)))\n"
        "for head_dim, causal, softcap, keys in ((64, False, 0.0, 16384), (64, True, 0.0, 4096),\n"
        "                                        (128, False, 0.0, 4096), (128, True, 0.0, 4096),\n"
        "                                        (128, True, 50.0, 4096), (128, True, 0.0, 16384)):\n"
        "    for on in (False, True):\n"
        "        config = dict(configs.gluon_fwd_config(head_dim, keys, keys, causal), EXP2_SPLIT=on)\n"
        "        variant = Variant.of(causal, True, softcap=softcap)\n"
        "        compiled = compile_for_sm90(head_dim, causal, config, variant=variant)\n"
        "        ptx = compiled.asm['ptx']\n"
        "        n = lambda pattern: len(re.findall(pattern, ptx))\n"
        "        mufu, conversions = sass_counts(compiled.asm['cubin'])\n"
        "        print('compiled', head_dim, causal, softcap, keys, on, n(r'ex2\\.approx'),\n"
        "              n(r'add\\.rm\\.ftz\\.f32'), n(r'fma\\.rn'), n(r'cvt\\.rmi|cvt\\.rzi'), mufu, conversions)\n"
    )
    rows = {}
    for line in compile_in_fresh_process(script).splitlines():
        if line.startswith("compiled"):
            _, d, causal, cap, keys, on, ex2, rounded_adds, fmas, cvts, mufu, conversions = line.split()
            rows[(d, causal, cap, keys, on)] = tuple(map(int, (ex2, rounded_adds, fmas, cvts, mufu, conversions)))
    assert len(rows) == 12
    for (d, causal, cap, keys, on), (ex2, rounded_adds, fmas, cvts, mufu, conversions) in rows.items():
        off = rows[(d, causal, cap, keys, "False")]
        where = f"D={d} causal={causal} softcap={cap} keys={keys} EXP2_SPLIT={on}"
        assert ex2 > 0 and cvts == 0, where
        if on == "True":
            # p's exponentials: half stay on MUFU, half take a rounded add and four fmas each
            assert rounded_adds > 0 and ex2 == off[0] - rounded_adds, where
            assert fmas == off[2] + 4 * rounded_adds, where
            assert mufu == off[4] - rounded_adds and conversions == off[5], where
        else:
            assert rounded_adds == 0, where


# ----------------------------------------------------------------------------------------------------------------
# On a Hopper GPU: the kernel with EXP2_SPLIT on against float64, on the shapes of test_forward_gluon (one token,
# odd lengths, Sq > Sk bottom-right with rows that see no key, GQA, several items per program)
# ----------------------------------------------------------------------------------------------------------------
_SPLIT_CONFIGS = {
    "base": dict(configs.forward.GLUON_BASE, EXP2_SPLIT=True),
    "short (overlap)": dict(configs.forward.GLUON_SHORT, EXP2_SPLIT=True),
    "three consumers (overlap)": dict(configs.forward.GLUON_THREE, EXP2_SPLIT=True),
}


@hopper_only
@pytest.mark.parametrize("name", list(_SPLIT_CONFIGS))
@pytest.mark.parametrize("causal,bottom_right", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("head_dim,dtype", [(128, torch.float16), (64, torch.bfloat16)])
def test_exp2_split_kernel_against_float64(name, causal, bottom_right, head_dim, dtype, device):
    config = _SPLIT_CONFIGS[name]
    for batch, seqlen_q, seqlen_k, heads_q, heads_kv in SHAPES:
        q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, device)
        out = torch.full_like(q, float("nan"))
        lse = torch.full((batch, heads_q, seqlen_q), float("nan"), dtype=torch.float32, device=device)
        G.launch_forward_gluon(q, k, v, out, lse, head_dim ** -0.5, causal, bottom_right, config)
        exact, exact_lse = attention_reference(q, k, v, None, causal, bottom_right, return_lse=True)
        where = f"{name}, shape {(batch, seqlen_q, seqlen_k, heads_q, heads_kv)}"
        assert_close_to_exact(out, torch_attention(q, k, v, None, causal, bottom_right), exact, dtype, where)
        seen = torch.isfinite(exact_lse)
        assert torch.equal(torch.isfinite(lse), seen), f"{where}: lse -inf exactly on rows that see no key"
        torch.testing.assert_close(lse[seen].double(), exact_lse[seen], atol=1e-3, rtol=1e-3)
        assert torch.all(out[~seen.transpose(1, 2)] == 0), where


@hopper_only
@pytest.mark.parametrize("variant_name", ["softcap", "causal alibi", "alibi", "all"])
@pytest.mark.parametrize("name", list(_SPLIT_CONFIGS))
@pytest.mark.parametrize("shape", [(2, 1000, 1000, 8, 2), (1, 700, 333, 4, 2)])
def test_exp2_split_kernel_variants(variant_name, name, shape, device):
    """Every exponent form of `_softmax_tile` through the split (softcap's folded cap, ALiBi's scaled scores and,
    causal in the overlapped loop, its shifted frame; windows and sinks), bf16 GQA, as test_gluon_kernel_variants
    judges the kernel without it."""
    from test_features import _torch_same_dtype

    causal, window, softcap, alibi, sinks = GLUON_VARIANTS[variant_name]
    batch, sq, sk, hq, hkv = shape
    q, k, v = make_qkv(batch, sq, sk, hq, hkv, 128, torch.bfloat16, device, seed=sq + sk)
    slopes = (0.5 ** torch.arange(1.0, hq + 1)).to(device) if alibi else None
    sink = torch.linspace(-2.0, 3.0, hq).to(device) if sinks else None
    variant = Variant(causal=causal, window=window, softcap=softcap, alibi_slopes=slopes, sinks=sink)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((batch, hq, sq), float("nan"), dtype=torch.float32, device=device)
    G.launch_forward_gluon(q, k, v, out, lse, 128 ** -0.5, causal, True, _SPLIT_CONFIGS[name], variant=variant.of(
        causal, True, window, softcap, alibi, sinks), alibi_slopes=slopes, learnable_sink=sink)
    exact, exact_lse = attention_reference(q, k, v, variant=variant, return_lse=True)
    assert_close_to_exact(out, _torch_same_dtype(q, k, v, variant, sink), exact, torch.bfloat16,
                          f"{name}, {variant_name}")
    seen = torch.isfinite(exact_lse)
    assert torch.equal(torch.isfinite(lse), seen), f"{name}, {variant_name}: lse -inf exactly where no key is seen"
    torch.testing.assert_close(lse[seen].double(), exact_lse[seen], atol=2e-3, rtol=2e-3)
