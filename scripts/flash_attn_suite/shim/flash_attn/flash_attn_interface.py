"""Test shim for `flash_attn.flash_attn_interface` -> flashtriton (harness only).

Names flash-attn 2 has here that flashtriton does not provide raise NotImplementedError on access
(see _MISSING); anything else unknown raises AttributeError as usual.
"""

from . import *  # noqa: F401,F403 (the package's flash_attn_* functions)
from flashtriton.flash_attn_interface import (  # noqa: F401
    _flash_attn_backward,
    _flash_attn_forward,
    _flash_attn_varlen_backward,
    _flash_attn_varlen_forward,
    _get_block_size_n,
)


def maybe_contiguous(x):
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def round_multiple(x, m):
    return (x + m - 1) // m * m


# flash-attn 2 names flashtriton does not provide (the test file imports none of them).
_MISSING = (
    "_get_block_size",  # flash-attn < 2.4's helper (older test files); _get_block_size_n replaces it
    "_wrapped_flash_attn_forward",
    "_wrapped_flash_attn_backward",
    "_wrapped_flash_attn_varlen_forward",
    "_wrapped_flash_attn_varlen_backward",
    "FlashAttnFunc",
    "FlashAttnQKVPackedFunc",
    "FlashAttnKVPackedFunc",
    "FlashAttnVarlenFunc",
    "FlashAttnVarlenQKVPackedFunc",
    "FlashAttnVarlenKVPackedFunc",
    "flash_attn_unpadded_func",
    "flash_attn_unpadded_qkvpacked_func",
    "flash_attn_unpadded_kvpacked_func",
)


def __getattr__(name):
    if name in _MISSING:
        raise NotImplementedError(
            f"flash_attn.flash_attn_interface.{name} is not provided by flashtriton (test shim)"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
