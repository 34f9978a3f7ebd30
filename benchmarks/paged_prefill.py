"""Paged varlen prefill against the dense varlen call on the same tokens (issue 28's bar: within 10 %).

A batch of sequences, each with some keys already cached and some new tokens: `flash_attn_varlen_func(q, k_pages,
v_pages, cu_seqlens_q, cu_seqlens_k, ..., block_table=..., seqused_k=...)` reads the keys through a block table
from a page pool (pages handed out in a random order, as a server's allocator leaves them), the dense call reads
the same keys packed contiguously (`cu_seqlens_k` over cached + new keys). Both are causal, aligned bottom-right per
sequence (the new tokens are the last rows of their sequence). Shape: 64 sequences, new tokens uniform in
1 … 4096, cached tokens uniform in 0 … 8192, 32 query heads over 8 kv heads, D=128, bf16, pages of 16, 64 and
256 keys (`--pages`).

Each call is first checked against the float64 reference on the first sequences (and the two against each
other on all), then both are timed in `--rounds` rounds of rotating order after 100 ms of warmup
(`bench_core.time_in_rounds`: `triton.testing.do_bench`, median, L2 flushed). TFLOP/s over the visible area
(4·D·Hq per visible score); the table gives paged / dense per page size, the bar last; `--out DIR` writes
DIR/paged_prefill.json with the GPU, torch, triton and git sha. On a CPU (interpreter) `--quick` runs a small shape to exercise the script.

    python benchmarks/paged_prefill.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

import flashtriton
from flashtriton.reference import attention_reference
from flashtriton.tools import bench_core as C
from flashtriton.tools.bench_measure import launched_kernels

BAR = 0.90  # paged >= 0.9 x dense


def make_case(n_seqs, max_new, max_cached, heads_q, heads_kv, head_dim, page_size, dtype, device, seed):
    """(q, k_pages, v_pages, block_table, cu_q, cu_k_pages, seqused_k, k_dense, v_dense, cu_k_dense, lengths)."""
    gen = torch.Generator().manual_seed(seed)
    new = torch.randint(1, max_new + 1, (n_seqs,), generator=gen)
    cached = torch.randint(0, max_cached + 1, (n_seqs,), generator=gen)
    keys = new + cached
    pages_per_seq = (keys + page_size - 1) // page_size
    max_pages = int(pages_per_seq.max())
    n_pages = int(pages_per_seq.sum())
    order = torch.randperm(n_pages, generator=gen)  # page p of the pool holds which sequence's which keys
    block_table = torch.full((n_seqs, max_pages), -1, dtype=torch.int32)
    dev_gen = torch.Generator(device=device).manual_seed(seed)  # the tensors drawn where they live (fast on a GPU)
    k_pages = torch.randn(n_pages, page_size, heads_kv, head_dim, generator=dev_gen, device=device).to(dtype)
    v_pages = torch.randn(n_pages, page_size, heads_kv, head_dim, generator=dev_gen, device=device).to(dtype)
    order_dev = order.to(device)
    k_dense, v_dense, at = [], [], 0
    for b in range(n_seqs):
        n = int(pages_per_seq[b])
        pages = order_dev[at:at + n]
        block_table[b, :n] = order[at:at + n].int()
        at += n
        length = int(keys[b])
        k_dense.append(k_pages[pages].reshape(-1, heads_kv, head_dim)[:length])
        v_dense.append(v_pages[pages].reshape(-1, heads_kv, head_dim)[:length])
    q = torch.randn(int(new.sum()), heads_q, head_dim, generator=dev_gen, device=device).to(dtype)
    zero = torch.zeros(1, dtype=torch.int64)
    cu_q = torch.cat([zero, new.cumsum(0)]).int()
    cu_k_dense = torch.cat([zero, keys.cumsum(0)]).int()
    # the paged call's cu_seqlens_k counts each sequence's page capacity; seqused_k its keys
    cu_k_pages = torch.cat([zero, (pages_per_seq * page_size).cumsum(0)]).int()
    to = dict(device=device)
    return dict(q=q, k_pages=k_pages, v_pages=v_pages, block_table=block_table.to(**to),
                cu_q=cu_q.to(**to), cu_k_pages=cu_k_pages.to(**to), seqused_k=keys.int().to(**to),
                k_dense=torch.cat(k_dense), v_dense=torch.cat(v_dense),
                cu_k_dense=cu_k_dense.to(**to), new=new.tolist(), keys=keys.tolist(), page_size=page_size,
                max_new=int(new.max()), max_keys=int(keys.max()), max_capacity=max_pages * page_size)


def paged_call(c):
    return lambda: flashtriton.flash_attn_varlen_func(
        c["q"], c["k_pages"], c["v_pages"], c["cu_q"], c["cu_k_pages"], c["max_new"], c["max_capacity"],
        causal=True, block_table=c["block_table"], seqused_k=c["seqused_k"])


def dense_call(c):
    return lambda: flashtriton.flash_attn_varlen_func(
        c["q"], c["k_dense"], c["v_dense"], c["cu_q"], c["cu_k_dense"], c["max_new"], c["max_keys"], causal=True)


def visible_flops(c, heads_q, head_dim) -> float:
    """4·D·Hq per visible score: new token i of a sequence with Sk keys and Sq new ones sees Sk - Sq + i + 1."""
    scores = sum(sq * (sk - sq) + sq * (sq + 1) // 2 for sq, sk in zip(c["new"], c["keys"]))
    return 4.0 * head_dim * heads_q * scores


def check(c, out_paged, out_dense, dtype, n_ref: int = 2) -> dict:
    """The paged call against the dense one on every token, and both against float64 on the first sequences
    (error over torch's own error in the dtype: `bench_core.compare`)."""
    diff = (out_paged.float() - out_dense.float()).abs().max().item()
    worst = 0.0
    for b in range(min(n_ref, len(c["new"]))):
        q0, q1 = int(c["cu_q"][b]), int(c["cu_q"][b + 1])
        k0, k1 = int(c["cu_k_dense"][b]), int(c["cu_k_dense"][b + 1])
        q, k, v = (t[None] for t in (c["q"][q0:q1], c["k_dense"][k0:k1], c["v_dense"][k0:k1]))
        ref = attention_reference(q.double(), k.double(), v.double(), causal=True)
        low = attention_reference(q, k, v, causal=True)  # torch in the dtype: its own error
        err = (out_paged[q0:q1].double() - ref[0]).abs().max().item()
        own = (low[0].double() - ref[0]).abs().max().item()
        worst = max(worst, err / max(own, 1e-6))
        if err > 2 * own + 1e-3:
            raise AssertionError(f"paged prefill, sequence {b}: error {err:.3g} against float64, torch's {own:.3g}")
    if diff > 2e-2:
        raise AssertionError(f"paged and dense calls differ by {diff:.3g}")
    return dict(paged_vs_dense_max_diff=diff, worst_error_over_torch=worst)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", default="16,64,256", help="comma list of page sizes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a small shape (the interpreter's)")
    parser.add_argument("--out", default=None, help="write paged_prefill.json here")
    parser.add_argument("--tiles-of-one-page", action="store_true",
                        help="pages smaller than a key tile in tiles of one page (configs.GLUON_PAGED_FWD), not "
                             "gathered into whole tiles: the A/B of the gather")
    args = parser.parse_args()
    if args.tiles_of_one_page:
        from flashtriton.configs import forward as configs_forward

        configs_forward.GATHER_PAGES = False
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float16  # (bf16 dots are wrong in the interpreter)
    if args.quick:
        shape = dict(n_seqs=3, max_new=40, max_cached=50, heads_q=4, heads_kv=2, head_dim=32)
    else:
        shape = dict(n_seqs=64, max_new=4096, max_cached=8192, heads_q=32, heads_kv=8, head_dim=128)
    env = C.environment()
    rows = []
    for page_size in C.parse_int_list(args.pages, "--pages"):
        c = make_case(**shape, page_size=page_size, dtype=dtype, device=device, seed=args.seed)
        calls = {"paged": paged_call(c), "dense": dense_call(c)}
        checked = check(c, calls["paged"](), calls["dense"](), dtype)
        kernels = {name: launched_kernels(fn) for name, fn in calls.items()}
        times = C.time_in_rounds(calls, args.rounds, rep=3 if args.quick else 100)
        flops = visible_flops(c, shape["heads_q"], shape["head_dim"])
        ms = {name: statistics.median(t) for name, t in times.items()}
        ratio = statistics.median(d / p for p, d in zip(times["paged"], times["dense"]))  # each round's pair
        rows.append(dict(env, page_size=page_size, **shape, gathered=not args.tiles_of_one_page, dtype=str(dtype).split(".")[-1],
                         tokens_new=sum(c["new"]), keys=sum(c["keys"]), ms=ms,
                         tflops={n: C.tflops(flops, m) for n, m in ms.items()}, paged_over_dense=ratio,
                         kernels=kernels, **checked))
        print(f"page {page_size}: paged {ms['paged']:.3f} ms, dense {ms['dense']:.3f} ms, paged/dense {ratio:.3f}",
              flush=True)
    print(f"\npaged varlen prefill ({env['gpu']}, {env['git_sha']}): {shape['n_seqs']} sequences, new 1..{shape['max_new']},"
          f" cached 0..{shape['max_cached']}, Hq {shape['heads_q']} / Hkv {shape['heads_kv']}, D={shape['head_dim']}, "
          f"{rows[0]['dtype']}, causal; TFLOP/s over the visible area")
    print("| page | paged | dense | paged / dense | bar | kernels (paged; dense) |")
    print("|---:|---:|---:|---:|---:|---|")
    for row in rows:
        verdict = "PASS" if row["paged_over_dense"] >= BAR else "FAIL"
        t = row["tflops"]
        print(f"| {row['page_size']} | {t['paged']:.1f} | {t['dense']:.1f} | {row['paged_over_dense']:.3f} | "
              f"{verdict} (>= {BAR}) | {', '.join(row['kernels']['paged'] or [])}; "
              f"{', '.join(row['kernels']['dense'] or [])} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "paged_prefill.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
