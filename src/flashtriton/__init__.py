"""flashtriton: exact attention (FlashAttention-2) in Triton for PyTorch on Ampere and Hopper GPUs.

    import flashtriton
    out = flashtriton.flash_attn_func(q, k, v, causal=True)             # (B, S, H, D), flash-attn's API
    out = flashtriton.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, S, D), torch's API
    out = flashtriton.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k)  # packed
    out = flashtriton.flash_attn_qkvpacked_func(qkv, causal=True)       # qkv (B, S, 3, H, D), no copy
    out = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens)  # decoding
    out, lse = flashtriton.flash_attn_combine(out_partial, lse_partial)  # merge split results (FA3's)
    out = flashtriton.parallel.ring_attention(q, k, v, causal=True)       # a sequence sharded over a group

On a machine without a GPU, set TRITON_INTERPRET=1 before importing to run the kernels on CPU tensors
through Triton's interpreter (slow; for testing).
"""

from . import parallel
from ._version import __version__
from .combine import flash_attn_combine
from .interface import flash_attn_func, flash_attn_varlen_func, scaled_dot_product_attention
from .kvcache import flash_attn_with_kvcache
from .packed import (
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from .reference import attention_bytes, attention_flops, attention_reference

__all__ = [
    "__version__",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
    "flash_attn_combine",
    "scaled_dot_product_attention",
    "attention_reference",
    "attention_flops",
    "attention_bytes",
]
