"""A BERT fine-tuning step with attention dropout (issue 29): flashtriton against sdpa on the same weights.

BertForSequenceClassification from transformers' default BertConfig (BERT-base: 12 layers, 12 heads of 64,
attention and hidden dropout 0.1), random weights, a padded batch of random tokens (each row 1/2 … all of
`--seqlen` long) with random labels, in train mode. For each seed s, `torch.manual_seed(s)` then one step
(the loss and its backward) with attn_implementation="flashtriton", and again with "sdpa". The libraries draw
different dropout masks from the same seed, so the step's loss is compared in expectation: the mean over seeds of
the paired difference, in standard errors (|z| < 4 passes), and the spread of the losses over seeds (the
dropout's noise: the ratio of the two standard deviations). In eval mode (no dropout) the two models' losses
must agree as the dropout-free call does (`--eval-atol`). On a GPU the step runs under bf16 autocast and is timed
(median of `--rep` steps after warmup, each synchronised) for both. `--attention-dropout` / `--hidden-dropout` set
other probabilities (hidden 0: the spread over seeds is the attention dropout's alone).

    python benchmarks/bert_dropout.py --out DIR                       # BERT-base, 32 x 128 tokens, 32 seeds
    TRITON_INTERPRET=1 python benchmarks/bert_dropout.py --config tiny  # a 2-layer BERT on the CPU
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import time

import torch

from flashtriton._env import INTERPRET

TINY = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64)


def build(config: str, device, **overrides):
    """(flashtriton model, sdpa model) with the same random weights, on `device`, in train mode; `overrides`:
    BertConfig fields (the dropout probabilities)."""
    import transformers

    from flashtriton.integrations import transformers as ft_hf

    ft_hf.register()
    cfg = transformers.BertConfig(**{**(TINY if config == "tiny" else {}), **overrides}, num_labels=2)
    torch.manual_seed(0)
    auto = transformers.AutoModelForSequenceClassification
    ours = auto.from_config(copy.deepcopy(cfg), attn_implementation="flashtriton")
    ref = auto.from_config(copy.deepcopy(cfg), attn_implementation="sdpa")
    ref.load_state_dict(ours.state_dict())
    return ours.to(device).train(), ref.to(device).train()


def make_batch(vocab_size: int, batch: int, seqlen: int, device, seed: int = 1):
    """Random tokens right-padded to `seqlen` (row lengths uniform in seqlen / 2 … seqlen), random labels."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seqlen // 2, seqlen + 1, (batch,), generator=g)
    mask = (torch.arange(seqlen)[None, :] < lengths[:, None]).long()
    ids = torch.randint(1, vocab_size, (batch, seqlen), generator=g).masked_fill(mask == 0, 0)
    labels = torch.randint(0, 2, (batch,), generator=g)
    return ids.to(device), mask.to(device), labels.to(device)


def step(model, ids, mask, labels, autocast: bool) -> float:
    """One training step's loss (forward and backward; the gradients are dropped)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.item()


def seeded_losses(models, ids, mask, labels, seeds: int, autocast: bool) -> list[list[float]]:
    """Each model's step loss for seeds 0 … seeds - 1 (the same seeds for every model)."""
    losses = [[] for _ in models]
    for s in range(seeds):
        for model, out in zip(models, losses):
            torch.manual_seed(s)
            out.append(step(model, ids, mask, labels, autocast))
    return losses


def compare(ours: list[float], ref: list[float]) -> dict:
    """The paired difference's mean in standard errors (z) and the two spreads over seeds."""
    diff = [a - b for a, b in zip(ours, ref)]
    se = statistics.stdev(diff) / math.sqrt(len(diff))
    return dict(mean_ours=statistics.fmean(ours), mean_sdpa=statistics.fmean(ref), std_ours=statistics.stdev(ours),
                std_sdpa=statistics.stdev(ref), mean_diff=statistics.fmean(diff), se_diff=se,
                z=statistics.fmean(diff) / se if se > 0 else math.inf)


def eval_losses(models, ids, mask, labels, autocast: bool) -> list[float]:
    out = []
    for model in models:
        model.eval()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out.append(model(input_ids=ids, attention_mask=mask, labels=labels).loss.item())
        model.train()
    return out


def time_steps(model, ids, mask, labels, rep: int) -> float:
    """Median milliseconds of a synchronised training step (bf16 autocast), after rep // 2 warmup steps."""
    for _ in range(max(rep // 2, 1)):
        step(model, ids, mask, labels, True)
    times = []
    for _ in range(rep):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(model, ids, mask, labels, True)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(config: str = "base", seeds: int = 32, batch: int = 32, seqlen: int = 128, rep: int = 20,
        **overrides) -> dict:
    """The comparison's numbers (`report` prints them); rep = 0: no timing; `overrides`: BertConfig fields."""
    device = "cpu" if INTERPRET else "cuda"
    autocast = device == "cuda"
    models = build(config, device, **overrides)
    ids, mask, labels = make_batch(models[0].config.vocab_size, batch, seqlen, device)
    result = dict(config=config, batch=batch, seqlen=seqlen, seeds=seeds, device=device,
                  dtype="bf16 autocast" if autocast else "fp32",
                  attention_dropout=models[0].config.attention_probs_dropout_prob,
                  hidden_dropout=models[0].config.hidden_dropout_prob)
    result["eval_ours"], result["eval_sdpa"] = eval_losses(models, ids, mask, labels, autocast)
    result.update(compare(*seeded_losses(models, ids, mask, labels, seeds, autocast)))
    if device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    if device == "cuda" and rep:
        result["ms_ours"], result["ms_sdpa"] = (time_steps(m, ids, mask, labels, rep) for m in models)
    return result


def verdicts(r: dict, eval_atol: float) -> dict:
    """The comparison's three checks: eval losses equal (to eval_atol), train losses' means equal in
    expectation (|z| < 4), and the dropout's noise alike (the spreads' ratio within 0.5 … 2)."""
    return dict(eval=abs(r["eval_ours"] - r["eval_sdpa"]) <= eval_atol, mean=abs(r["z"]) < 4,
                spread=0.5 <= r["std_ours"] / r["std_sdpa"] <= 2)


def _pf(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def report(r: dict, eval_atol: float) -> list[str]:
    lines = [f"BERT ({r['config']}) fine-tuning step, {r['batch']} x {r['seqlen']} tokens (right-padded), "
             f"{r['dtype']}, attention dropout {r['attention_dropout']}, hidden {r['hidden_dropout']}, "
             f"{r['seeds']} seeds" + (f", {r['gpu']}" if "gpu" in r else ""),
             f"eval loss (no dropout): flashtriton {r['eval_ours']:.6f}, sdpa {r['eval_sdpa']:.6f}",
             f"train loss over seeds: flashtriton {r['mean_ours']:.5f} ± {r['std_ours']:.5f}, "
             f"sdpa {r['mean_sdpa']:.5f} ± {r['std_sdpa']:.5f} (mean ± std)",
             f"paired difference {r['mean_diff']:+.5f} ± {r['se_diff']:.5f} (se): z = {r['z']:+.2f}"]
    if "ms_ours" in r:
        lines.append(f"step time (median): flashtriton {r['ms_ours']:.2f} ms, sdpa {r['ms_sdpa']:.2f} ms "
                     f"({r['ms_sdpa'] / r['ms_ours']:.2f}x)")
    v = verdicts(r, eval_atol)
    lines.append(f"eval losses within {eval_atol}: {_pf(v['eval'])}; |z| < 4: {_pf(v['mean'])}; spread ratio "
                 f"{r['std_ours'] / r['std_sdpa']:.2f} (0.5 … 2: {_pf(v['spread'])})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=("base", "tiny"), default="base")
    parser.add_argument("--seeds", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--rep", type=int, default=20)
    parser.add_argument("--attention-dropout", type=float, default=None, help="default: the config's (0.1)")
    parser.add_argument("--hidden-dropout", type=float, default=None, help="default: the config's (0.1)")
    parser.add_argument("--eval-atol", type=float, default=None,
                        help="default 2e-2 under bf16 autocast, 1e-4 in fp32")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.config == "tiny" and args.seqlen == 128:
        args.seqlen, args.batch = 16, 4
    overrides = {name: value for name, value in (("attention_probs_dropout_prob", args.attention_dropout),
                                                 ("hidden_dropout_prob", args.hidden_dropout)) if value is not None}
    r = run(args.config, args.seeds, args.batch, args.seqlen, args.rep, **overrides)
    eval_atol = args.eval_atol if args.eval_atol is not None else (2e-2 if r["device"] == "cuda" else 1e-4)
    lines = report(r, eval_atol)
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bert_dropout.json"), "w") as f:
            json.dump(dict(r, eval_atol=eval_atol, torch=torch.__version__,
                           git_sha=os.environ.get("FLASHTRITON_GIT_SHA")), f, indent=1)
        with open(os.path.join(args.out, "bert_dropout.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
