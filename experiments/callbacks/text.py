"""What a text run shows people, as tables in the logger: sample translations with the sacreBLEU signatures, and
text the language model writes."""

from __future__ import annotations

from pathlib import Path

import pytorch_lightning as pl
import torch

from experiments.compare.tables import markdown_table
from models.distributed import full_weights


def log_table(trainer: pl.Trainer, key: str, columns: list[str], rows: list[list[str]]) -> None:
    """A small table of text for people, from rank 0: W&B table, TensorBoard text, or the Markdown file
    ``<log dir>/<key with _ for />.md``, appended to at each call."""
    logger = trainer.logger
    if logger is None or not rows or not trainer.is_global_zero:
        return
    markdown = markdown_table(columns, [[c.replace("\n", " ") for c in r] for r in rows])
    if hasattr(logger, "log_text"):  # WandbLogger
        logger.log_text(key=key, columns=columns, data=rows, step=trainer.global_step)
    elif hasattr(logger.experiment, "add_text"):  # TensorBoard
        logger.experiment.add_text(key, markdown, trainer.global_step)
    elif logger.log_dir:
        path = Path(logger.log_dir) / (key.replace("/", "_") + ".md")
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(f"\n### epoch {trainer.current_epoch}, step {trainer.global_step}\n\n{markdown}\n")


class TranslationSamples(pl.Callback):
    """After each validation and test of a `models.text.TranslationModule`: the first ``num_samples``
    translations (in dataset order) as the table ``val|test/samples``; the sacreBLEU signatures printed and logged
    as ``val|test/sacrebleu_signature`` at the first validation and at each test; at a test, the samples printed
    too. Nothing during the sanity check.
    """

    def __init__(self, num_samples: int = 5):
        self.num_samples = num_samples
        self._signature_shown = False

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._show(trainer, pl_module, "val")

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._show(trainer, pl_module, "test")

    def _show(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.sanity_checking:
            return
        samples = [list(row) for row in pl_module.translations[: self.num_samples]]
        log_table(trainer, f"{stage}/samples", ["source", "reference", "hypothesis"], samples)
        if stage == "test" or not self._signature_shown:
            self._signature_shown = True
            signatures = pl_module.sacrebleu_signatures
            pl_module.print(f"sacreBLEU signatures: {signatures['BLEU']} | {signatures['chrF']}")
            rows = [[k, v] for k, v in signatures.items()]
            log_table(trainer, f"{stage}/sacrebleu_signature", ["metric", "signature"], rows)
        if stage == "test":
            pl_module.print("\n".join(f"  {src}\n  -> {hyp}\n  (ref {ref})" for src, ref, hyp in samples))


class LanguageModelSamples(pl.Callback):
    """After each validation (not the sanity check, not ``fast_dev_run``), ``tokens`` tokens written by a
    `models.text.LanguageModelModule` after a newline (its ``temperature`` and ``top_k``), logged as the
    table ``val/samples`` (step, sample). Every process generates, which FSDP needs; rank 0 logs.
    """

    def __init__(self, tokens: int = 200):
        if tokens < 1:
            raise ValueError(f"LanguageModelSamples: tokens={tokens} must be >= 1 (leave the callback out for none)")
        self.tokens = tokens

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.fast_dev_run:
            return
        ids = trainer.datamodule.tokenizer.encode("\n", add_special_tokens=False).ids
        start = torch.full((1, 1), ids[0] if ids else 0, dtype=torch.long, device=pl_module.device)
        with full_weights(trainer.model):
            text = pl_module.complete(start, self.tokens)
        log_table(trainer, "val/samples", ["step", "sample"], [[str(trainer.global_step), text]])
