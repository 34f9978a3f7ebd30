"""The dropout mask's row counts against a binomial's variance, and its key-lag correlations (p = 0.5, through the
interpreter): TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/2026-12-07-cpu/bert-dropout/mask_row_variance.py"""
import math

import torch

from flashtriton import testing

p, n = 0.5, 256
rows = []
for seed in range(4):
    mask = testing.dropout_mask((1000 + seed * 7919, seed), 4, 4, n, n, p, device="cpu").double()
    rows.append(mask.sum(-1).flatten())
    if seed == 0:
        centred = (mask - p).reshape(-1, n)
        beyond = [(lag, round(r, 4)) for lag in range(1, 64)
                  for r in [(centred[:, :-lag] * centred[:, lag:]).mean().item() / (p * (1 - p))]
                  if abs(r) > 3 / math.sqrt(centred[:, lag:].numel())]
        print(f"key lags 1..63 with |correlation| above 3 sigma: {beyond or 'none'}")
rows = torch.cat(rows)
print(f"{rows.numel()} rows of {n} keys: kept-count variance / binomial's = "
      f"{rows.var().item() / (n * p * (1 - p)):.4f} (standard error {math.sqrt(2 / rows.numel()):.4f})")
