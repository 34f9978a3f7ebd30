"""Integrations of flashtriton with other libraries.

- `flashtriton.integrations.transformers`: Hugging Face transformers' attention interface
  (`register()`, then `attn_implementation="flashtriton"`).
- `flashtriton.integrations.hf_alibi`: the ALiBi models whose bias never reaches that interface (BLOOM, MPT, Falcon
  with `alibi=True`): `patch_alibi_attention(model)` runs their attention layers on flashtriton's ALiBi kernels.

Each integration imports its library only when used, so flashtriton never requires them.
"""
