"""`flash_attn.bert_padding` for the test shim: flash-attn 2.7's padding helpers, written here in plain torch.

unpad_input keeps the tokens a (batch, seqlen) mask marks and returns (tokens, indices, cu_seqlens, max_seqlen,
seqused) as flash-attn >= 2.7 does; pad_input puts packed tokens back at their indices, zeros elsewhere. Both are
differentiable through torch's indexing."""

import torch
import torch.nn.functional as F


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x[indices] along the first axis."""
    return x[indices]


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """hidden_states (batch, seqlen, ...), attention_mask (batch, seqlen) bool/int; unused_mask: tokens kept in
    the packed layout but not counted in seqused. Returns (tokens (nnz, ...), indices (nnz,) into batch*seqlen,
    cu_seqlens (batch + 1,) int32, max_seqlen int, seqused (batch,) int32)."""
    keep = attention_mask.bool() if unused_mask is None else (attention_mask.bool() | unused_mask.bool())
    seqlens = keep.sum(dim=-1, dtype=torch.int32)
    seqused = attention_mask.bool().sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    tokens = hidden_states.reshape(-1, *hidden_states.shape[2:])[indices]
    return tokens, indices, cu_seqlens, int(seqlens.max().item()), seqused


def pad_input(hidden_states, indices, batch, seqlen):
    """hidden_states (nnz, ...) back to (batch, seqlen, ...), zeros where no token is."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out = out.index_put((indices,), hidden_states)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
