"""How tests judge a result: error against float64, relative to torch's own error in the same dtype.

err(ours)  = max |ours  - exact|      exact = flashtriton.reference in float64
err(torch) = max |torch - exact|      torch = torch SDPA on the same low-precision inputs
pass iff err(ours) <= 2 * err(torch) + floor(dtype) * max|exact|
(FlagAttention's rule.) The floor covers the rounding of the output itself, which both share.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashtriton.reference import attention_reference, causal_mask

# Half an ulp at 1.0 of each dtype: the rounding every stored output carries.
FLOOR = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-22}


def torch_attention(q, k, v, softmax_scale=None, causal=False, bottom_right=True):
    """torch SDPA in the inputs' dtype, (B, S, H, D) in and out; bottom-right causal via a boolean mask."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
    mask = causal_mask(q.shape[1], k.shape[1], bottom_right, q.device) if causal else None
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=softmax_scale,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def assert_close_to_exact(ours, torch_result, exact, dtype, what="out"):
    """The rule above; rows where torch gives NaN (rows that see no key) are left to other checks."""
    ours, exact = ours.double(), exact.double()
    assert torch.isfinite(ours).all(), f"{what}: non-finite values"
    valid = torch.isfinite(torch_result.double())
    err_ours = (ours - exact).abs().max().item() if ours.numel() else 0.0
    err_torch = (torch_result.double() - exact).abs()[valid].max().item() if valid.any() else 0.0
    scale = max(exact.abs().max().item(), 1.0) if exact.numel() else 1.0
    bound = 2 * err_torch + FLOOR[dtype] * scale
    assert err_ours <= bound, f"{what}: error {err_ours:.3e} > 2 x torch's {err_torch:.3e} + floor = {bound:.3e}"
    return err_ours, err_torch
