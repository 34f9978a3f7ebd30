"""Random calls of flash_attn_func and flash_attn_varlen_func (forward and backward, every variant together),
flash_attn_with_kvcache (paged or not, appends, cache_batch_idx, the variants) and scaled_dot_product_attention
(inputs of 3 to 5 dims, GQA, is_causal, causal and band masks, key-padding masks of every form it takes) against
float64: a search for
inputs the test suite's grid misses.

    TRITON_INTERPRET=1 .venv/bin/python scripts/fuzz.py --seconds 600       # CPU (fp32 and fp16)
    .venv/bin/python scripts/fuzz.py --seconds 300 --device cuda            # a GPU (fp16 and bf16 too)
    .venv/bin/python scripts/fuzz.py --device cuda --gluon-bwd-everywhere   # small cases on the Gluon backward
    TRITON_INTERPRET=1 .venv/bin/python scripts/fuzz.py --pad-head-dims     # head dims padded as on Hopper

Each case draws shapes (GQA / MQA, Sq != Sk, head dims 1..256 with a V head dim of its own, empty sequences),
causal, a window (its unbounded sides spelled -1 or None), softcap, ALiBi ((H,) or (B, H)), sinks, dropout (the reference on the call's recovered mask) and a
softmax scale; judges out, lse and the gradients
as tests/accuracy.py does (against torch's own error in the dtype); prints every failure with the seed that
reproduces it (`--seed N --cases 1`), and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
import traceback

if "--device" not in sys.argv or "cpu" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import flashtriton  # noqa: E402
from flashtriton import testing  # noqa: E402
from flashtriton.kernels.variant import Variant  # noqa: E402
from flashtriton.reference import attention_reference  # noqa: E402

FLOOR = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-20}


def draw(rng: random.Random, device: str) -> dict:
    hkv = rng.choice([1, 1, 2, 3])
    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])
    d = rng.choice([8, 16, 24, 40, 64, 80, 96, 128, 1, 3, 59])
    case = dict(
        batch=rng.randint(1, 3), sq=rng.choice([1, 2, 7, 16, 33, 64, 100]), sk=rng.choice([1, 5, 16, 31, 64, 129]),
        hq=hkv * rng.choice([1, 2, 4]), hkv=hkv, d=d, dv=rng.choice([d, d, 16, 32]), dtype=rng.choice(dtypes),
        causal=rng.random() < 0.5, varlen=rng.random() < 0.4,
        window=(rng.choice([-1, -1, 0, 3, 20]), rng.choice([-1, -1, 0, 5])),
        softcap=rng.choice([0.0, 0.0, 0.0, 5.0, 30.0]), alibi=rng.choice([None, None, "h", "bh"]),
        sink=rng.random() < 0.3, scale=rng.choice([None, None, 0.3, -0.2, 1.7]),
        dropout=rng.choice([0.0, 0.0, 0.0, 0.1, 0.4]),
    )
    if case["causal"]:
        case["window"] = (case["window"][0], 0)
    case["none_window"] = rng.random() < 0.25  # the call spells unbounded sides None (FlashAttention-4's way)
    return case


def call_window(case: dict) -> tuple:
    """The call's window_size: the case's, its unbounded sides as None where the case says so."""
    return tuple(None if case.get("none_window") and side == -1 else side for side in case["window"])


def dense_reference(q, k, v, case, slopes, sinks, dtype, keep=None):
    """(out, lse) of one (B, S, H, D) call in `dtype`; q, k, v leaves of that dtype; keep: the call's dropout
    keep-mask (B, H, Sq, Sk), or None."""
    variant = Variant(causal=case["causal"], window=case["window"], softcap=case["softcap"], alibi_slopes=slopes,
                      sinks=sinks)
    return attention_reference(q, k, v, case["scale"], dtype=dtype, return_lse=True, variant=variant,
                               dropout_mask=keep, dropout_p=case["dropout"] if keep is not None else None)


def run_case(case: dict, seed: int, device: str) -> None:
    gen = torch.Generator().manual_seed(seed)
    dt = case["dtype"]
    b, sq, sk, hq, hkv, d, dv = (case[n] for n in ("batch", "sq", "sk", "hq", "hkv", "d", "dv"))

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dt)

    if case["varlen"]:
        lens_q = [random.Random(seed + i).choice([0, 1, sq, max(1, sq // 2)]) for i in range(b)]
        lens_k = [random.Random(seed + 10 + i).choice([0, 1, sk, max(1, sk // 3)]) for i in range(b)]
        q, dout = rand(sum(lens_q), hq, d), rand(sum(lens_q), hq, dv)
        k, v = rand(sum(lens_k), hkv, d), rand(sum(lens_k), hkv, dv)
    else:
        lens_q, lens_k = [sq] * b, [sk] * b
        q, dout = rand(b, sq, hq, d), rand(b, sq, hq, dv)
        k, v = rand(b, sk, hkv, d), rand(b, sk, hkv, dv)
    slopes = None
    if case["alibi"] == "h":
        slopes = (torch.rand(hq, generator=gen) * 0.5).to(device)
    elif case["alibi"] == "bh":
        slopes = (torch.rand(b, hq, generator=gen) * 0.5).to(device)
    sinks = (torch.randn(hq, generator=gen)).to(device) if case["sink"] else None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sinks.clone().requires_grad_()] if case["sink"] else [])
    kwargs = dict(softmax_scale=case["scale"], causal=case["causal"], window_size=call_window(case),
                  softcap=case["softcap"], alibi_slopes=slopes, return_attn_probs=True,
                  learnable_sink=leaves[3] if case["sink"] else None, dropout_p=case["dropout"])
    with testing.record_dropout() as calls:
        if case["varlen"]:
            cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=device)
            cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=device)
            out, lse, _ = flashtriton.flash_attn_varlen_func(*leaves[:3], cu_q, cu_k, max(lens_q), max(lens_k),
                                                             **kwargs)
        else:
            out, lse, _ = flashtriton.flash_attn_func(*leaves[:3], **kwargs)
    keep = None  # the keep-mask the call drew: (B, Hq, longest Sq, longest Sk), sequence i's [i, :, :lq, :lk]
    if case["dropout"] > 0:
        keep = testing.dropout_mask(calls[0], b, hq, max(lens_q), max(lens_k), case["dropout"], device="cpu")
    (out.float() * dout.float()).sum().backward()
    got = [out, *(t.grad for t in leaves)]

    # the references: float64 and the inputs' dtype, per sequence
    results = {}
    for ref_dtype in (torch.float64, dt if dt != torch.float32 else torch.float32):
        ref_leaves = [t.detach().to(ref_dtype).requires_grad_() for t in (q, k, v)]
        ref_sinks = sinks.detach().double().requires_grad_() if case["sink"] else None
        outs, lses, loss = [], [], 0
        oq = ok = 0
        for i in range(b):
            sl = (lambda t, o, n: t[o:o + n][None]) if case["varlen"] else (lambda t, o, n, i=i: t[i:i + 1])
            qs = sl(ref_leaves[0], oq, lens_q[i])
            ks, vs = sl(ref_leaves[1], ok, lens_k[i]), sl(ref_leaves[2], ok, lens_k[i])
            sl_slopes = None if slopes is None else (slopes[i] if slopes.dim() == 2 else slopes)
            sl_keep = None if keep is None else keep[i:i + 1, :, :lens_q[i], :lens_k[i]].to(qs.device)
            o, ls = dense_reference(qs, ks, vs, case, sl_slopes, ref_sinks, ref_dtype, sl_keep)
            do = sl(dout.to(ref_dtype), oq, lens_q[i])
            loss = loss + (o * do).sum()
            outs.append(o[0] if case["varlen"] else o)
            lses.append(ls[0] if case["varlen"] else ls)
            oq, ok = oq + lens_q[i], ok + lens_k[i]
        loss.backward()
        grads = [t.grad for t in ref_leaves] + ([ref_sinks.grad] if case["sink"] else [])
        ref_out = torch.cat(outs, 0)
        ref_lse = torch.cat(lses, 1 if case["varlen"] else 0)
        results[ref_dtype] = [ref_out, *grads], ref_lse
    (exact, exact_lse), (low, _) = results[torch.float64], results[dt if dt != torch.float32 else torch.float32]
    names = ["out", "dq", "dk", "dv", "dsink"]
    judge(names, got, exact, low, dt, device, q, k, v, dout, case["scale"])
    fin = torch.isfinite(exact_lse)
    if not torch.equal(torch.isfinite(lse), fin.to(lse.device)):
        raise AssertionError("lse: -inf where the reference has a finite value, or the reverse")
    if fin.any() and (lse[fin].double() - exact_lse[fin]).abs().max().item() > 1e-2 + 1e-3 * exact_lse[fin].abs().max():
        raise AssertionError("lse: error")


def judge(names, got, exact, low, dt, device, q, k, v, dout, softmax_scale) -> None:
    """Each result in `got` against the float64 one (`exact`) within twice the error of the same computation in
    the inputs' dtype (`low`, torch's) plus a floor; raises AssertionError naming the first that is not."""
    d, dv = q.shape[-1], v.shape[-1]
    # The backward's dS = P (dP - rowsum(dO O)) cancels where a row sees one key (exactly 0 in the reference's
    # algebra): allow rounding of the size of its terms, |dP| |k| |scale| (dq), |dP| |q| |scale| (dk).
    mag = lambda t: t.abs().max().item() if t.numel() else 0.0  # noqa: E731
    s_eff = abs(softmax_scale if softmax_scale is not None else d ** -0.5)
    dp = mag(dout) * mag(v) * math.sqrt(dv)
    cancel = {"dq": dp * mag(k) * s_eff * math.sqrt(d), "dk": dp * mag(q) * s_eff * math.sqrt(d)}
    # fp32 under the interpreter: numpy's matmul sums Q Kᵀ in another order than K Qᵀ (the dK/dV kernel's), so the
    # backward's P differs from the forward's (whose lse it divides by) by the scores' rounding, ~2^-24 · sqrt(d) ·
    # |q| |k| · scale relative (measured ~1.2x that at d=128; on a GPU, Triton's fp32 dots are FMA chains over d in
    # one order either way).
    # Four times that, in units of the floor's 8 · 2^-20:
    recompute = mag(q) * mag(k) * math.sqrt(d) * s_eff / 32 if (dt == torch.float32 and device == "cpu") else 0.0
    for name, g, ex, lo in zip(names, got, exact, low):
        g, ex, lo = g.double(), ex.double(), lo.double()
        if not torch.isfinite(g).all():
            raise AssertionError(f"{name}: non-finite values")
        err = (g - ex).abs().max().item() if g.numel() else 0.0
        err_lo = (lo - ex).abs().max().item() if g.numel() else 0.0
        scale = max(ex.abs().max().item(), 1.0) if ex.numel() else 1.0
        size = scale * max(1.0, recompute) if name != "out" else scale
        bound = 2 * err_lo + 8 * FLOOR[dt] * max(size, cancel.get(name, 0.0))
        if not err <= bound:  # (a NaN error fails too)
            raise AssertionError(f"{name}: error {err:.3e} > bound {bound:.3e} (torch's {err_lo:.3e})")


def run_sdpa_case(case: dict, seed: int, device: str) -> None:
    """scaled_dot_product_attention in torch's layout (..., H, S, D): 3, 4 or 5 dims, enable_gqa, is_causal, a
    causal or band mask, or a key-padding mask (bool or 0 / -inf; (..., 1, 1, Sk), expanded over the queries, or
    (Sk,)), against torch's own SDPA in float64 and in the inputs' dtype, forward and gradients (rows that see no
    key: 0, as torch's math backend gives them)."""
    rng = random.Random(seed * 7 + 1)
    gen = torch.Generator().manual_seed(seed)
    dt = case["dtype"]
    b, sq, sk, hq, hkv, d, dv = (case[n] for n in ("batch", "sq", "sk", "hq", "hkv", "d", "dv"))
    lead = rng.choice([(b,), (b,), (), (b, 2)])

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dt)

    q, dout = rand(*lead, hq, sq, d), rand(*lead, hq, sq, dv)
    k, v = rand(*lead, hkv, sk, d), rand(*lead, hkv, sk, dv)
    causal, mask = case["causal"], None
    if not causal and rng.random() < 0.3:  # a causal mask (torch's tril) or a band about the bottom-right diagonal
        rows = torch.arange(sq)[:, None] + (0 if rng.random() < 0.5 else sk - sq)
        keys = torch.arange(sk)[None, :]
        left, right = rng.choice([None, 0, 3, 20]), rng.choice([None, 0, 0, 5])
        mask = (keys >= rows - (left if left is not None else sk)) & (keys <= rows + (right if right is not None else sk))
        mask = mask.to(device)
        if rng.random() < 0.4:
            mask = torch.zeros(mask.shape, dtype=dt, device=device).masked_fill(~mask, float("-inf"))
    elif not causal and rng.random() < 0.7:
        form = rng.choice(["keys", "rows", "expanded", "one"])
        keep = torch.rand(*lead, sk, generator=gen) < rng.choice([0.2, 0.7, 1.0])
        if form == "one" or not lead:
            keep = keep.reshape(-1, sk)[0]
        elif form == "rows":
            keep = keep[..., None, None, :]
        elif form == "expanded":
            keep = keep[..., None, None, :].expand(*lead, 1, sq, sk)
        else:
            keep = keep[..., None, None, :].expand(*lead, hq, 1, sk)
        mask = keep.to(device)
        if rng.random() < 0.4:
            mask = torch.zeros(mask.shape, dtype=dt, device=device).masked_fill(~mask, float("-inf"))

    def grads(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        ref_mask, is_causal = (mask.to(dtype) if mask is not None and mask.is_floating_point() else mask), causal
        if fn is not flashtriton.scaled_dot_product_attention:
            if ref_mask is not None and ref_mask.dim() == 1:
                ref_mask = ref_mask[None]  # (Sk,) as (1, Sk): torch's math backend indexes the mask's dim -2
            if causal:  # torch's own is_causal gives NaN with a negative scale (2.13's math backend): its mask
                ref_mask, is_causal = torch.ones(sq, sk, dtype=torch.bool, device=device).tril(), False
        out = fn(*leaves, attn_mask=ref_mask, is_causal=is_causal, scale=case["scale"], enable_gqa=hq != hkv)
        return [out, *torch.autograd.grad(out, leaves, dout.to(dtype))]

    got = grads(flashtriton.scaled_dot_product_attention, dt)
    exact = [torch.nan_to_num(t) for t in grads(torch.nn.functional.scaled_dot_product_attention, torch.float64)]
    low = [torch.nan_to_num(t) for t in grads(torch.nn.functional.scaled_dot_product_attention, dt)]
    for name, g, ex in zip(("out", "dq", "dk", "dv"), got, exact):
        if g.shape != ex.shape:
            raise AssertionError(f"{name}: shape {tuple(g.shape)}, torch's {tuple(ex.shape)}")
    judge(("out", "dq", "dk", "dv"), got, exact, low, dt, device, q, k, v, dout, case["scale"])


def run_decode_case(case: dict, seed: int, device: str) -> None:
    """flash_attn_with_kvcache: a contiguous or paged cache, cache_batch_idx, appended keys, the variants; the
    cache after the call and out / lse against float64 over each sequence's logical keys."""
    from flashtriton import flash_attn_with_kvcache

    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    dt = case["dtype"]
    b, hq, hkv, d = case["batch"], case["hq"], case["hkv"], case["d"]
    sq, new = rng.choice([1, 1, 2, 4]), rng.choice([0, 0, 1, 3])
    capacity = rng.choice([16, 40, 100, 300])
    page = rng.choice([None, None, 16, 32, 64])  # (decoding takes pages of a multiple of 16 keys)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dt)

    block_table = batch_idx = None
    if page is not None:
        per = -(-capacity // page)
        capacity = per * page
        pages = b * per + 2
        block_table = torch.randperm(pages, generator=gen)[:b * per].reshape(b, per).to(device=device,
                                                                                        dtype=torch.int32)
        k_cache, v_cache = rand(pages, page, hkv, d), rand(pages, page, hkv, d)
    else:
        rows = b + rng.choice([0, 2])
        k_cache, v_cache = rand(rows, capacity, hkv, d), rand(rows, capacity, hkv, d)
        if rows > b or rng.random() < 0.5:
            batch_idx = torch.randperm(rows, generator=gen)[:b].to(device=device, dtype=torch.int32)
    seqlens = [rng.randint(0, capacity - new) for _ in range(b)]
    q = rand(b, sq, hq, d)
    k, v = (rand(b, new, hkv, d), rand(b, new, hkv, d)) if new else (None, None)
    slopes = None
    if case["alibi"] == "h":
        slopes = (torch.rand(hq, generator=gen) * 0.5).to(device)
    elif case["alibi"] == "bh":
        slopes = (torch.rand(b, hq, generator=gen) * 0.5).to(device)
    sinks = torch.randn(hq, generator=gen).to(device) if case["sink"] else None

    def logical(cache):  # (B, capacity, Hkv, D) of each sequence, in key order
        if block_table is not None:
            return cache[block_table.long()].flatten(1, 2)
        return cache[batch_idx.long() if batch_idx is not None else torch.arange(b, device=cache.device)]

    want_k, want_v = logical(k_cache).clone(), logical(v_cache).clone()
    for i in range(b):
        if new:
            want_k[i, seqlens[i]:seqlens[i] + new], want_v[i, seqlens[i]:seqlens[i] + new] = k[i], v[i]
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=device),
        cache_batch_idx=batch_idx, block_table=block_table, softmax_scale=case["scale"], causal=case["causal"],
        window_size=call_window(case), softcap=case["softcap"], alibi_slopes=slopes, num_splits=rng.choice([0, 1, 3]),
        return_softmax_lse=True, learnable_sink=sinks)
    got_k, got_v = logical(k_cache), logical(v_cache)
    for i in range(b):
        n = seqlens[i] + new
        if not (torch.equal(got_k[i, :n], want_k[i, :n]) and torch.equal(got_v[i, :n], want_v[i, :n])):
            raise AssertionError(f"cache of sequence {i}: not what the append should leave")
        variant = Variant(causal=case["causal"], window=case["window"], softcap=case["softcap"],
                          alibi_slopes=None if slopes is None else (slopes[i] if slopes.dim() == 2 else slopes),
                          sinks=sinks)
        args = (q[i:i + 1], want_k[i:i + 1, :n], want_v[i:i + 1, :n], case["scale"])
        ex, ex_lse = attention_reference(*args, dtype=torch.float64, return_lse=True, variant=variant)
        lo = attention_reference(*args, dtype=dt if dt != torch.float32 else torch.float32, variant=variant)
        err, err_lo = (out[i:i + 1].double() - ex).abs().max().item(), (lo.double() - ex).abs().max().item()
        bound = 2 * err_lo + 8 * FLOOR[dt] * max(ex.abs().max().item(), 1.0)
        if not torch.isfinite(out[i]).all() or err > bound:
            raise AssertionError(f"out of sequence {i} ({n} keys): error {err:.3e} > bound {bound:.3e}")
        fin = torch.isfinite(ex_lse)
        if not torch.equal(torch.isfinite(lse[i:i + 1]), fin):
            raise AssertionError(f"lse of sequence {i}: -inf rows differ")
        if fin.any() and (lse[i:i + 1][fin].double() - ex_lse[fin]).abs().max().item() > 1e-2:
            raise AssertionError(f"lse of sequence {i}: error")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--cases", type=int, default=10**9)
    ap.add_argument("--seed", type=int, default=None, help="first case's seed (default: from the clock)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--decode", type=float, default=0.3, help="the share of flash_attn_with_kvcache cases")
    ap.add_argument("--sdpa", type=float, default=0.15, help="the share of scaled_dot_product_attention cases")
    ap.add_argument("--gluon-bwd-everywhere", action="store_true",
                    help="the Gluon backward at every size (no minimum of work or keys), so that the small cases "
                         "reach it on Hopper")
    ap.add_argument("--pad-head-dims", action="store_true",
                    help="pad every head dim the Gluon kernels do not take (ops.PAD_HEAD_DIMS 'always'), so that "
                         "the padded path runs on the CPU too")
    args = ap.parse_args()
    if args.pad_head_dims:
        from flashtriton import ops

        ops.PAD_HEAD_DIMS = "always"
    if args.gluon_bwd_everywhere:
        from flashtriton.configs import backward as configs_backward

        configs_backward.GLUON_BWD_MIN_FLOPS = configs_backward.GLUON_BWD_D64_MIN_KEYS = 0
    seed = args.seed if args.seed is not None else int(time.time()) % 10**6
    end = time.monotonic() + args.seconds
    failures = n = 0
    while time.monotonic() < end and n < args.cases:
        case = draw(random.Random(seed), args.device)
        draw_kind = random.Random(-seed).random()
        kind = "decode" if draw_kind < args.decode else "sdpa" if draw_kind < args.decode + args.sdpa else "dense"
        case["kind"] = kind
        try:
            {"decode": run_decode_case, "sdpa": run_sdpa_case, "dense": run_case}[kind](case, seed, args.device)
        except NotImplementedError as e:
            print(f"seed {seed}: refused ({e})", flush=True)
        except Exception:  # report every failure with its seed, go on
            failures += 1
            print(f"FAILED seed {seed}: {case}\n{traceback.format_exc(limit=3)}", flush=True)
        n += 1
        seed += 1
    print(f"{n} cases, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
