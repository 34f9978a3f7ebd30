"""The attention probabilities of a dropout call, as flash-attn 2 returns them (`return_attn_probs=True`).

flash-attn's tests (and code written against them) read a dropout call's keep-mask and its probabilities from the
third output, S_dmask: (batch, nheads, seqlen_q rounded up to 128, seqlen_k rounded up to 128), in q's dtype, the
probability of key j for query i before normalisation — exp(score - m), m the running maximum of the key blocks
of `BLOCK_N` keys walked from the last block to the first (flash-attn 2's order) — negated where dropout drops it.
Their helpers normalise it back with `_get_block_size_n` (flash_attn_interface) and keep the mask as
`S_dmask >= 0`.

flashtriton's kernels never form the probabilities: `dropout_probs` rebuilds them after the call, in torch, from
the inputs and the call's (seed, offset) (`testing.dropout_mask`, the kernels' own generator), so that the mask is
exactly the one the kernels used. It materialises (B, H, Sq, Sk) fp32 scores: for tests and small shapes, as
flash-attn's own S_dmask is.
"""

from __future__ import annotations

import torch

from .kernels.variant import Variant
from .reference import masked_scores

BLOCK_N = 128  # the key blocks of the running maximum (what `_get_block_size_n` returns)
ROUND = 128  # S_dmask's rows and keys are rounded up to a multiple of this, as flash-attn 2's


def _round(n: int) -> int:
    return (n + ROUND - 1) // ROUND * ROUND


def _unnormalised(scores: torch.Tensor) -> torch.Tensor:
    """exp(scores - m) with m, per row, the maximum over the key blocks from this block to the last (0 where m is
    -inf: a row that sees no key from there on)."""
    blocks = scores.split(BLOCK_N, dim=-1)
    block_max = torch.stack([b.amax(dim=-1) for b in blocks], dim=-1)
    suffix_max = torch.cummax(block_max.flip(-1), dim=-1).values.flip(-1)
    parts = []
    for j, b in enumerate(blocks):
        m = suffix_max[..., j:j + 1]
        parts.append(torch.where(torch.isinf(m), torch.zeros_like(b), torch.exp(b - m)))
    return torch.cat(parts, dim=-1)


def dropout_probs(q, k, rng_state, softmax_scale: float, causal: bool, window_size, softcap: float, alibi_slopes,
                  dropout_p: float, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: int = 0,
                  max_seqlen_k: int = 0) -> torch.Tensor:
    """S_dmask of a dropout call (module docstring): dense q (B, Sq, Hq, D), k (B, Sk, Hkv, D); varlen q (total_q,
    Hq, D), k (total_k, Hkv, D) with cu_seqlens (sequence b's rows and keys counted from its start, in row b).
    Every other argument is the call's, bottom-right aligned."""
    from .testing import dropout_mask  # (testing builds on this package's kernels)

    if cu_seqlens_q is None:
        batch, seqlen_q, heads, _ = q.shape
        seqlen_k = k.shape[1]
        spans = [((b, b + 1), None, None) for b in range(batch)]
    else:
        batch, heads = cu_seqlens_q.numel() - 1, q.shape[1]
        seqlen_q, seqlen_k = max_seqlen_q, max_seqlen_k
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        spans = [(None, (cq[b], cq[b + 1]), (ck[b], ck[b + 1])) for b in range(batch)]
    keep = dropout_mask(rng_state, batch, heads, seqlen_q, seqlen_k, dropout_p, device=q.device)
    out = torch.zeros((batch, heads, _round(seqlen_q), _round(seqlen_k)), dtype=q.dtype, device=q.device)
    for b, (rows, qs, ks) in enumerate(spans):
        alibi = alibi_slopes
        if alibi is not None and alibi.dim() == 2:
            alibi = alibi[b]
        variant = Variant(causal=causal, window=tuple(window_size), softcap=float(softcap), alibi_slopes=alibi)
        if qs is None:
            qb, kb = q[b:b + 1], k[b:b + 1]
        else:
            qb, kb = q[None, qs[0]:qs[1]], k[None, ks[0]:ks[1]]
        n_q, n_k = qb.shape[1], kb.shape[1]
        if n_q == 0 or n_k == 0:  # an empty sequence (or one without keys): its rows of S_dmask stay 0
            continue
        probs = _unnormalised(masked_scores(qb, kb, variant, softmax_scale, torch.float32))[0]  # (H, n_q, n_k)
        signed = torch.where(keep[b, :, :n_q, :n_k], probs, -probs)
        out[b, :, :n_q, :n_k] = signed.to(q.dtype)
    return out
