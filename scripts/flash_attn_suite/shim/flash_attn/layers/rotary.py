"""`flash_attn.layers.rotary` for the test shim: apply_rotary_emb in plain torch with flash-attn 2's signature (the
test's reference for rotary; independent of flashtriton's own rotary). The module's other names raise
NotImplementedError."""

import torch


def _rotate_half(x, interleaved):
    """(-x2, x1) over the pairs: column halves, or even and odd columns when interleaved."""
    if interleaved:
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((-odd, even), dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rotate(x, cos, sin, interleaved):
    """x (..., s, h, d) in fp32, cos / sin (..., s, rotary_dim / 2) fp32 on x's positions."""
    ro_dim = cos.shape[-1] * 2
    widen = (lambda t: t.repeat_interleave(2, dim=-1)) if interleaved else (lambda t: torch.cat((t, t), dim=-1))
    cos, sin = widen(cos).unsqueeze(-2), widen(sin).unsqueeze(-2)
    xr = x[..., :ro_dim]
    return torch.cat([xr * cos + _rotate_half(xr, interleaved) * sin, x[..., ro_dim:]], dim=-1)


def apply_rotary_emb(
    x,
    cos,
    sin,
    interleaved=False,
    inplace=False,
    seqlen_offsets=0,
    cu_seqlens=None,
    max_seqlen=None,
):
    """The test's reference rotary embedding, with flash-attn 2's signature: x (batch, seqlen, heads, dim), or
    (total, heads, dim) with cu_seqlens / max_seqlen; cos, sin (seqlen_ro, rotary_dim / 2); the first rotary_dim
    columns rotated (interleaved: pairs of even and odd columns, else the two halves), position s of a sequence
    at s + seqlen_offsets (an int or a (batch,) tensor). Computed in fp32 and rounded to x's dtype; positions
    past the table are left as they are, as flash-attn's kernel leaves them."""
    seqlen_ro, rotary_dim_half = cos.shape
    assert sin.shape == cos.shape
    rotary_dim = 2 * rotary_dim_half
    headdim = x.shape[-1]
    assert rotary_dim <= headdim, "rotary_dim must be <= headdim"
    assert cos.dtype == sin.dtype, f"cos and sin must have the same dtype, got {cos.dtype} and {sin.dtype}"
    assert x.dtype == cos.dtype, f"Input and cos/sin must have the same dtype, got {x.dtype} and {cos.dtype}"
    cos32, sin32 = cos.float(), sin.float()
    device = x.device

    if cu_seqlens is None:
        batch, seqlen = x.shape[0], x.shape[1]
        pos = torch.arange(seqlen, device=device)[None, :]  # (1, s)
        if isinstance(seqlen_offsets, torch.Tensor):
            assert seqlen_offsets.shape == (batch,)
            assert seqlen_offsets.dtype in [torch.int32, torch.int64]
            pos = pos + seqlen_offsets.to(device=device, dtype=torch.long)[:, None]
        else:
            assert seqlen_offsets + seqlen <= seqlen_ro, "seqlen_offsets + seqlen must be <= seqlen_ro"
            pos = pos + int(seqlen_offsets)
        pos = pos.expand(batch, seqlen)
    else:
        assert max_seqlen is not None, "If cu_seqlens is passed in, then max_seqlen must be passed"
        total = x.shape[0]
        batch = cu_seqlens.shape[0] - 1
        cu = cu_seqlens.to(device=device, dtype=torch.long)
        lens = cu[1:] - cu[:-1]
        seq_id = torch.repeat_interleave(torch.arange(batch, device=device), lens, output_size=total)
        pos = torch.arange(total, device=device) - cu[:-1][seq_id]
        if isinstance(seqlen_offsets, torch.Tensor):
            assert seqlen_offsets.shape == (batch,)
            pos = pos + seqlen_offsets.to(device=device, dtype=torch.long)[seq_id]
        else:
            pos = pos + int(seqlen_offsets)

    # Positions past the cos/sin table: flash-attn's kernel loads cos=1, sin=0 there (no rotation).
    valid = pos < seqlen_ro
    idx = pos.clamp(max=seqlen_ro - 1)
    c = torch.where(valid[..., None], cos32[idx], torch.ones((), device=device))
    s = torch.where(valid[..., None], sin32[idx], torch.zeros((), device=device))
    out = _rotate(x.float(), c, s, interleaved).to(x.dtype)
    if inplace:
        x.copy_(out)
        return x
    return out


class _Missing:
    def __init__(self, name):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"flash_attn.layers.rotary.{self._name} is not provided by the test shim")


ApplyRotaryEmb = _Missing("ApplyRotaryEmb")
ApplyRotaryEmbQKV_ = _Missing("ApplyRotaryEmbQKV_")
ApplyRotaryEmbKV_ = _Missing("ApplyRotaryEmbKV_")
apply_rotary_emb_qkv_ = _Missing("apply_rotary_emb_qkv_")
apply_rotary_emb_kv_ = _Missing("apply_rotary_emb_kv_")
apply_rotary_emb_func = apply_rotary_emb
RotaryEmbedding = _Missing("RotaryEmbedding")
