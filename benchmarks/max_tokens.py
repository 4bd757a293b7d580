"""Token-budget batches (`data.max_tokens`) against sentence-count batches (`data.batch_size`) on a translation
config's training split, data side only (no model runs): the padding share and the tokens and pairs of each step,
over the epochs' orders a fit draws (`ResumableSampler` around the loader's sampler, seed 0). Run by hand:

    python -m benchmarks.max_tokens [--config configs/text/multi30k_en_de_cpu.yaml] [--epochs 3] [--max-tokens N]

Without ``--max-tokens`` the budget is the batch_size recipe's mean padded tokens a step, so both recipes train on
as many tokens a step on average. Columns, per step: padded tokens (pairs × the longer side's padded width,
fairseq's measure, its mean and coefficient of variation), target tokens (the ones the loss averages over), pairs;
the padding share is over both sides' tensors (source B × S and target B × T).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import yaml

from datamodules.text.batching import LengthBucketSampler
from datamodules.text.parallel import ParallelTextDataModule
from datamodules.text.token_budget import MaxTokensSampler
from experiments.callbacks.interrupts import ResumableSampler


def training_set(config: str):
    """The training PairDataset of ``config``'s ParallelTextDataModule, and that DataModule's settings."""
    settings = yaml.safe_load(Path(config).read_text())["data"]["init_args"]
    dm = ParallelTextDataModule(**settings)
    dm.setup("fit")
    return dm.train_set, settings


def epochs_of(sampler, epochs: int, batch_size: int | None) -> list[list[int]]:
    """The batches of ``epochs`` epochs as a one-process fit draws them; ``batch_size``: the sampler yields indices,
    cut into batches of that many (the DataLoader's BatchSampler), None: it yields whole batches."""
    batches = []
    for epoch in range(epochs):
        resumable = ResumableSampler(sampler, seed=0)
        resumable.set_epoch(epoch)
        order = list(resumable)
        batches += [order[s : s + batch_size] for s in range(0, len(order), batch_size)] if batch_size else order
    return batches


def row(name: str, batches: list[list[int]], src: np.ndarray, tgt: np.ndarray, epochs: int) -> dict:
    """One recipe's figures; src, tgt (N,): each side's length as batched (BOS/EOS included)."""
    pairs = np.array([len(b) for b in batches])
    width = np.array([max(src[b].max(), tgt[b].max()) for b in batches])
    both = np.array([src[b].max() + tgt[b].max() for b in batches])
    real = sum(int(src[b].sum() + tgt[b].sum()) for b in batches)
    step = pairs * width  # (steps,) padded tokens, fairseq's measure
    return {
        "recipe": name,
        "batches/epoch": len(batches) // epochs,
        "padded tokens/step": f"{step.mean():.0f}",
        "CV": f"{step.std() / step.mean():.2f}",
        "max": int(step.max()),
        "target tokens/step": f"{(sum(int(tgt[b].sum()) for b in batches) - pairs.sum()) / len(batches):.0f}",
        "pairs/step": f"{pairs.mean():.1f} ({pairs.min()}-{pairs.max()})",
        "padding share": f"{1 - real / int((pairs * both).sum()):.1%}",
    }


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return "\n".join(lines + ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/text/multi30k_en_de_cpu.yaml")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=None, help="default: the batch_size recipe's mean")
    args = parser.parse_args(argv)
    dataset, settings = training_set(args.config)
    src, tgt, lengths, size = dataset.src_lengths(), dataset.tgt_lengths(), dataset.lengths(), settings["batch_size"]
    by_size = epochs_of(LengthBucketSampler(lengths, size), args.epochs, size)
    budget = args.max_tokens or round(float(np.mean([len(b) * lengths[b].max() for b in by_size])))
    rows = [row(f"batch_size={size}", by_size, src, tgt, args.epochs)]
    for cap in (None, size):
        name = f"max_tokens={budget}" + (f", batch_size={cap}" if cap else "")
        by_tokens = epochs_of(MaxTokensSampler(lengths, src, budget, cap), args.epochs, None)
        rows.append(row(name, by_tokens, src, tgt, args.epochs))
    print(f"{args.config}: {len(dataset)} training pairs, {args.epochs} epochs, seed 0\n")
    print(table(rows))


if __name__ == "__main__":
    main()
