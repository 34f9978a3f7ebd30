"""Test shim: `import flash_attn` resolves to flashtriton (harness only; not part of flashtriton).

Re-exports flashtriton's flash-attn 2 API under flash-attn's module names so that flash-attn 2's own
tests/test_flash_attn.py runs unchanged against flashtriton.
"""

from flashtriton import (  # noqa: F401
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__version__ = "2.7.4"  # flash-attn 2 version whose API the shim claims; flashtriton.__version__ is its own

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
