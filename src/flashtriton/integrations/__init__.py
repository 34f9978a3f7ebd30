"""Integrations of flashtriton with other libraries.

- `flashtriton.integrations.transformers`: Hugging Face transformers' attention interface
  (`register()`, then `attn_implementation="flashtriton"`).

Each integration imports its library only when used, so flashtriton never requires them.
"""
