"""Host arithmetic and device queries the launchers share; no tuning rule lives here (those are in `configs`).

Everything here runs on each call's host path, so it stays cheap: plain integer arithmetic, and device queries
answered once per device.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of a CUDA device, looked up once per device (it is on every call's path)."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def cdiv(a: int, b: int) -> int:
    """Ceiling division on the host. (`triton.cdiv` is a constexpr function: ~3 us per host call.)"""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1), on the host, like `triton.next_power_of_2` but cheap."""
    return 1 << max(int(n) - 1, 0).bit_length()


def padded_head_dim(head_dim: int) -> int:
    """Head dims are padded inside the kernels to a power of two of at least 16 (tl.dot's minimum)."""
    return max(16, next_power_of_2(head_dim))


def gluon_tile_width(head_dim: int) -> int:
    """The head dim a Hopper Gluon kernel's tiles span: D rounded up to 64, 128 or 256 (tensor shapes are powers of
    two, and a TMA box reaching past a narrower head loads its missing columns as zeros)."""
    return 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256
