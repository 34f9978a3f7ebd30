"""Run flashtriton's public calls on CPU tensors with every kernel launch compiled for sm_90 instead of run.

Triton's interpreter, which the CPU tests use, runs code that Triton's compiler refuses (a jit function that returns
None, loop bounds of mixed int widths, ...): such a call passes every CPU test and fails on the first GPU. Here
each launch goes through Triton's own launch path up to the compiler — argument binding, specialization,
constexprs, `triton.compile` for a Hopper target with its bundled ptxas — and stops before the launch: nothing
is computed, so only the host code and the builds are exercised (outputs are garbage, and never read).

Run in a process of its own without TRITON_INTERPRET (tests/test_sm90_builds.py): it replaces Triton's active
driver with one that names an sm_90 target and patches `JITFunction.run` for the process.

    python tests/sm90_builds.py [CASE ...]      # every case, or the named ones; prints "built CASE: kernels"
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


class Sm90Driver:
    """What Triton's launch path asks the active driver for, answered for device 0, an sm_90 GPU."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


BUILT: list[str] = []  # kernel names, in launch order
_run = JITFunction.run


def _compile_only(self, *args, grid, warmup, **kwargs):
    """JITFunction.run up to the compiled kernel (Triton's `warmup`): bound, specialized, compiled, not run."""
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    assert kernel is not None and "ptx" in kernel.asm, self.fn.__name__
    BUILT.append(self.fn.__name__)


driver.set_active(Sm90Driver())
JITFunction.run = _compile_only

import flashtriton  # noqa: E402
from flashtriton import validation  # noqa: E402
from flashtriton.kernels import launch as launch_module  # noqa: E402

validation.INTERPRET = True  # CPU tensors pass the device check (nothing runs on them)
launch_module._hooks_installed = lambda: True  # every launch takes fn[grid](...): none is replayed from a kept kernel

H, HK, D = 4, 2, 64
F16 = torch.float16


def _t(*shape, dtype=F16, grad=False):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def dense_every_variant():
    """Forward and backward, causal GQA with a window, softcap, ALiBi and sinks together."""
    q, k, v = _t(2, 96, H, D, grad=True), _t(2, 80, HK, D, grad=True), _t(2, 80, HK, D, grad=True)
    sink = torch.zeros(H, requires_grad=True)
    out = flashtriton.flash_attn_func(q, k, v, causal=True, window_size=(40, 0), softcap=20.0,
                                      alibi_slopes=torch.rand(H), learnable_sink=sink)
    out.sum().backward()


def dense_dropout_separate_v():
    """Dropout, a V head dim of its own, bf16, non-causal, with the attention probabilities returned."""
    q, k, v = _t(1, 72, H, 64, dtype=torch.bfloat16, grad=True), _t(1, 72, H, 64, dtype=torch.bfloat16, grad=True), \
        _t(1, 72, H, 32, dtype=torch.bfloat16, grad=True)
    out = flashtriton.flash_attn_func(q, k, v, dropout_p=0.2)
    out.sum().backward()


def dense_fp32_odd_head_dim():
    q, k, v = (_t(1, 40, 2, 40, dtype=torch.float32, grad=True) for _ in range(3))
    flashtriton.flash_attn_func(q, k, v, causal=True).sum().backward()


def varlen_seqused_k():
    """Packed sequences whose keys are counted by seqused_k (no pages), forward."""
    cu = torch.tensor([0, 30, 64], dtype=torch.int32)
    q, kv = _t(64, H, D), _t(64, HK, D)
    flashtriton.flash_attn_varlen_func(q, kv, kv, cu, cu, 34, 34, causal=True,
                                       seqused_k=torch.tensor([20, 30], dtype=torch.int32))


def varlen_paged_prefill():
    """Queries of two sequences against a paged cache (block_table), with seqused_k."""
    cu_q = torch.tensor([0, 5, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 40, 90], dtype=torch.int32)
    pages = _t(8, 16, HK, D)
    table = torch.arange(8, dtype=torch.int32).reshape(2, 4)
    flashtriton.flash_attn_varlen_func(_t(12, H, D), pages, pages, cu_q, cu_k, 7, 50, causal=True,
                                       block_table=table, seqused_k=torch.tensor([40, 50], dtype=torch.int32),
                                       window_size=(30, 0), softcap=10.0)


def varlen_every_variant_backward():
    cu = torch.tensor([0, 17, 50], dtype=torch.int32)
    q, k, v = _t(50, H, D, grad=True), _t(50, HK, D, grad=True), _t(50, HK, D, grad=True)
    sink = torch.zeros(H, requires_grad=True)
    out = flashtriton.flash_attn_varlen_func(q, k, v, cu, cu, 33, 33, causal=True, window_size=(12, 0),
                                             softcap=5.0, alibi_slopes=torch.rand(H), learnable_sink=sink)
    out.sum().backward()


def kvcache_append_rotary_paged():
    """A decode step: paged cache, new k/v appended with rotary, every score variant."""
    pages = _t(16, 16, HK, D)
    table = torch.arange(16, dtype=torch.int32).reshape(2, 8)
    cos = torch.rand(128, 16, dtype=F16)
    flashtriton.flash_attn_with_kvcache(
        _t(2, 1, H, D), pages, pages.clone(), _t(2, 1, HK, D), _t(2, 1, HK, D), rotary_cos=cos, rotary_sin=cos,
        cache_seqlens=torch.tensor([30, 70], dtype=torch.int32), block_table=table, causal=True,
        window_size=(50, 0), softcap=8.0, alibi_slopes=torch.rand(H), learnable_sink=torch.zeros(H),
        return_softmax_lse=True)


def kvcache_leftpad_batch_idx():
    """A contiguous cache with cache_batch_idx and cache_leftpad, several queries, split-KV."""
    cache = _t(3, 128, HK, D)
    flashtriton.flash_attn_with_kvcache(
        _t(2, 3, H, D), cache, cache.clone(), _t(2, 3, HK, D), _t(2, 3, HK, D),
        cache_seqlens=torch.tensor([40, 90], dtype=torch.int32), cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32),
        cache_leftpad=torch.tensor([3, 10], dtype=torch.int32), causal=True, num_splits=3)


def combine():
    flashtriton.flash_attn_combine(torch.randn(3, 2, 33, H, D), torch.randn(3, 2, 33, H))


CASES = {f.__name__: f for f in (dense_every_variant, dense_dropout_separate_v, dense_fp32_odd_head_dim,
                                  varlen_seqused_k, varlen_paged_prefill, varlen_every_variant_backward,
                                  kvcache_append_rotary_paged, kvcache_leftpad_batch_idx, combine)}


def main(names: list[str]) -> int:
    failed = 0
    for name in names or list(CASES):
        BUILT.clear()
        try:
            CASES[name]()
        except Exception as e:  # report every case, fail at the end
            failed += 1
            print(f"FAILED {name}: {type(e).__name__}: {str(e)[-2000:]}", flush=True)
        else:
            print(f"built {name}: {', '.join(BUILT)}", flush=True)
    print(f"cases {len(names or CASES)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
