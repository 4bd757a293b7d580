"""Tokens/s of `attnlab fit` by recipe: the figure its `Throughput` callback logs (``perf/tokens_per_s``: source and
target tokens, padding excluded, over wall time with data loading), as the Multi30k GPU recipe's 88k tokens/s was
measured (benchmarks/RESULTS.md). Each fit runs in this process for two epochs of a few batches, validation off; the
figure is its second epoch's, the first being warm-up (torch.compile's compilations, the loader's start).

- Translation, the model of configs/text/multi30k_en_de.yaml: 128 sentences a batch (the recipe's ``batch_size``)
  against ``data.max_tokens`` (as many pairs as fit the batch_size recipe's mean padded tokens a step, the rule of
  configs/text/multi30k_en_de_cpu_tokens.yaml), without and with configs/trainer/gpu.yaml (the `Compile` callback).
- Language model, configs/text/shakespeare_char.yaml: plain blocks against packed documents (``data.documents``,
  document masking) at the same block size.

The data is generated, on any machine: a GPU machine gets the working tree only, not ../shared/data. Pairs of
Multi30k's token lengths (`MULTI30K_LENGTHS`) whose tokens are words of a 10,000-word vocabulary (the recipe's
vocabulary size) under the word tokenizer, one token a word; for the LM, Tiny Shakespeare's size in paragraphs of its
mean length (the documents), of random lowercase words.
"""

from __future__ import annotations

import json
import tempfile
import textwrap
from pathlib import Path

import numpy as np

from benchmarks.max_tokens import epochs_of
from datamodules.text.batching import LengthBucketSampler
from datamodules.text.tokenizers import SPECIAL_TOKENS
from experiments.compare.tables import markdown_table

TRANSLATION, LM = "configs/text/multi30k_en_de.yaml", "configs/text/shakespeare_char.yaml"
# Multi30k's 29,000 training pairs under the recipe's BPE (10,000 shared): tokens of each side, BOS/EOS excluded, at
# the quantiles 0%, 5%, ..., 100% (mean 13.0 and 14.4; the sides' correlation 0.86)
MULTI30K_LENGTHS = {
    "en": (3, 7, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 15, 15, 16, 18, 19, 22, 47),
    "de": (3, 8, 9, 9, 10, 11, 11, 12, 12, 13, 13, 14, 15, 15, 16, 17, 18, 19, 21, 24, 51),
}
MULTI30K_PAIRS, TINY_SHAKESPEARE = 29_000, (1_115_394, 154)  # its characters, and the mean of its 7,222 paragraphs
# what a rehearsal on the CPU shrinks (the fits, the data and the models), and the batches of each epoch
QUICK_TRANSLATION = ("d_model=32", "nhead=2", "num_encoder_layers=1", "num_decoder_layers=1", "dim_feedforward=64")
QUICK_LM = ("d_model=32", "nhead=2", "num_layers=1", "max_positions=32")
BATCHES, QUICK_BATCHES = 40, 4


def write_pairs(folder: Path, pairs: int, seed: int = 0) -> np.ndarray:
    """``pairs`` training pairs (and 64 for validation) of Multi30k's token lengths in ``folder``'s train.en/de and
    val.en/de; both sides of a pair at one quantile (fully correlated lengths). Returns each training pair's length
    as batched (N,): its longer side with BOS/EOS (`PairDataset.lengths`)."""
    rng = np.random.default_rng(seed)
    words = np.array([f"w{i}" for i in range(10_000 - len(SPECIAL_TOKENS))])
    for split, n in (("val", 64), ("train", pairs)):
        at = rng.random(n) * 20  # (n,) each pair's quantile, in steps of 5%
        sides = {lang: np.interp(at, np.arange(21), q).round().astype(int) for lang, q in MULTI30K_LENGTHS.items()}
        for lang, lengths in sides.items():
            lines = (" ".join(rng.choice(words, size)) for size in lengths)
            (folder / f"{split}.{lang}").write_text("".join(f"{line}\n" for line in lines))
    return np.maximum(sides["en"], sides["de"]) + 2


def write_paragraphs(path: Path, chars: int, mean: int, seed: int = 0) -> None:
    """About ``chars`` characters of random lowercase words (a space after 5 letters on average) in lines of at most
    40, in paragraphs (the documents of `datamodules.text.documents`) of exponentially distributed lengths of mean
    ``mean`` characters, a blank line after each."""
    rng = np.random.default_rng(seed)
    alphabet, weights = np.array(list("abcdefghijklmnopqrstuvwxyz ")), np.array([1] * 26 + [6.5]) / 32.5
    paragraphs, total = [], 0
    while total < chars:
        text = "".join(rng.choice(alphabet, max(2, int(rng.exponential(mean))), p=weights))
        paragraphs.append(textwrap.fill(text, 40) + "\n\n")
        total += len(paragraphs[-1])
    path.write_text("".join(paragraphs))


def fit_figures(argv: list[str], root: Path) -> dict[str, float]:
    """`attnlab fit` of ``argv`` for two epochs of its ``limit_train_batches``, validation off, under ``root``:
    the last epoch's ``perf/tokens_per_s`` and ``perf/samples_per_s``, as its summary.json holds them."""
    from experiments.cli import main

    main(["fit", *argv, f"--trainer.default_root_dir={root}", "--trainer.max_epochs=2", "--trainer.max_steps=-1"])
    metrics = json.loads(next(root.rglob("summary.json")).read_text())["metrics"]
    return {"tokens/s": metrics["perf/tokens_per_s"], "samples/s": metrics["perf/samples_per_s"]}


def common(config: str, accelerator: str, batches: int, data: str) -> list[str]:
    """The flags of every fit: ``config`` on ``accelerator`` with the generated ``data`` (its DataModule's
    ``KEY=VALUE``), ``batches`` training batches an epoch and no validation."""
    return [
        "--config",
        config,
        f"--data.init_args.{data}",
        f"--trainer.accelerator={accelerator}",
        f"--trainer.limit_train_batches={batches}",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false",
    ]


def translation_recipes(folder: Path, quick: bool) -> dict[str, list[str]]:
    """The translation rows' recipes -> their flags on top of `TRANSLATION` with the generated pairs in ``folder``."""
    lengths = write_pairs(folder, 500 if quick else MULTI30K_PAIRS)
    size = 8 if quick else 128
    by_size = epochs_of(LengthBucketSampler(lengths, size), 1, size)
    budget = round(float(np.mean([len(b) * lengths[b].max() for b in by_size])))
    data = [
        "--data.init_args.tokenizer=word",
        f"--data.init_args.cache_dir={folder}/cache",
        f"--data.init_args.batch_size={size}",
    ]
    data += [f"--model.init_args.{kv}" for kv in QUICK_TRANSLATION] if quick else []
    tokens = ["--data.init_args.batch_size=null", f"--data.init_args.max_tokens={budget}"]
    # a rehearsal compiles with torch.compile's eager backend (a trace, no code generated: seconds, not minutes)
    compiled = (
        ['--trainer.callbacks+={"class_path": "experiments.callbacks.Compile", "init_args": {"backend": "eager"}}']
        if quick
        else ["--config", "configs/trainer/gpu.yaml"]
    )
    return {
        f"batch_size={size}": data,
        f"max_tokens={budget}": data + tokens,
        f"max_tokens={budget} + compile": data + tokens + compiled,
    }


def lm_recipes(folder: Path, quick: bool) -> dict[str, list[str]]:
    """The LM rows' recipes -> their flags on top of `LM` with the generated corpus in ``folder``."""
    chars, mean = (40_000, 154) if quick else TINY_SHAKESPEARE
    write_paragraphs(folder / "corpus.txt", chars, mean)
    data = [f"--data.init_args.cache_dir={folder}/cache"]
    if quick:
        data += ["--data.init_args.block_size=32", "--data.init_args.batch_size=8"]
        data += [f"--model.init_args.{kv}" for kv in QUICK_LM]
    block = 32 if quick else 256
    return {
        f"plain blocks of {block}": data,
        f"documents, blocks of {block}": data + ["--data.init_args.documents=true"],
    }


def rows(config: str, recipes: dict[str, list[str]], data: str, accelerator: str, batches: int) -> list[list[str]]:
    """One fit a recipe, each in its own run folder: recipe, tokens/s, samples/s, tokens/s against the first."""
    out, first = [], None
    for name, flags in recipes.items():
        with tempfile.TemporaryDirectory() as root:
            figures = fit_figures([*common(config, accelerator, batches, data), *flags], Path(root))
        first = first or figures["tokens/s"]
        rate, samples = figures["tokens/s"], figures["samples/s"]
        out.append([name, f"{rate:,.0f}", f"{samples:,.0f}", f"{rate / first:.2f}"])
    return out


def report(quick: bool, accelerator: str) -> str:
    """The translation and the LM tables, with how they were measured."""
    batches = QUICK_BATCHES if quick else BATCHES
    header = ["recipe", "tokens/s", "samples/s", "tokens/s vs the first row"]
    with tempfile.TemporaryDirectory() as data:
        folder = Path(data)
        translation = rows(TRANSLATION, translation_recipes(folder, quick), f"data_dir={folder}", accelerator, batches)
        lm = rows(LM, lm_recipes(folder, quick), f"path={folder}/corpus.txt", accelerator, batches)
    return (
        f"### Translation training, tokens/s of `attnlab fit` by batching ({TRANSLATION})\n\n"
        "Generated pairs of Multi30k's token lengths (a GPU machine gets the working tree, not ../shared/data), "
        f"word tokenizer of 10,000 words; the second of two epochs of {batches} batches, validation off, the recipe's "
        "bf16 autocast; compile: configs/trainer/gpu.yaml's `Compile` callback (its eager backend in a rehearsal). "
        "The recipe's own fit on Multi30k: 88k tokens/s at batch_size=128 on an H200 (benchmarks/RESULTS.md).\n\n"
        + markdown_table(header, translation)
        + f"\n\n### Language model training, tokens/s of `attnlab fit`, plain vs packed documents ({LM})\n\n"
        "A generated corpus of Tiny Shakespeare's size in paragraphs of its mean length (the documents); the second "
        f"of two epochs of {batches} batches, validation off; documents: `data.documents: true` (document masking).\n\n"
        + markdown_table(header, lm)
    )
