"""Context parallelism over torch.distributed: attention over a sequence sharded across the ranks of a group.

    from flashtriton import parallel
    q, k, v = (parallel.shard(t, group, layout="zigzag") for t in (q, k, v))   # (B, S / world, H, D) each
    out = parallel.ring_attention(q, k, v, causal=True, group=group)          # K/V passed round the ring
    out = parallel.ulysses_attention(q, k, v, causal=True, group=group, layout="zigzag")  # all-to-all over heads
    full = parallel.unshard(out, group, layout="zigzag")                       # (B, S, H, D) on every rank

NCCL moves CUDA tensors, gloo CPU ones (`TRITON_INTERPRET=1`: the kernels on the CPU, for tests). Both calls are
collective, differentiable and deterministic given the world size; bad input raises on every rank (one small
all_gather compares the ranks' arguments first); a rank that never arrives makes the others raise after the
process group's timeout. The per-chunk pieces are `flashtriton.chunked`'s.
"""

from .layout import LAYOUTS, segments, shard, unshard
from .ring import ring_attention
from .ulysses import ulysses_attention

__all__ = ["ring_attention", "ulysses_attention", "shard", "unshard", "segments", "LAYOUTS"]
