"""What the text LightningModules share: their schedule's names, the checks a checkpoint meets, and AdamW."""

from __future__ import annotations

from typing import Literal

import pytorch_lightning as pl
from torch import nn

from models import optim
from models.text.decoding import CACHE_KINDS

Schedule = Literal["inverse_sqrt", "cosine"]


def check_vocabulary(checkpoint: dict, current: dict, names: tuple[str, ...]) -> None:
    """Refuse a checkpoint whose vocabulary facts differ from the data's, before torch meets a shape mismatch.
    A fact missing on either side (a network default never written into the hyper-parameters) is not compared."""
    saved = checkpoint.get("hyper_parameters", {})
    diffs = [
        f"{n}={saved[n]} in the checkpoint but {current[n]} from the data"
        for n in names
        if n in saved and n in current and saved[n] != current[n]
    ]
    if diffs:
        raise ValueError(
            f"the checkpoint's vocabulary does not match the data's tokenizer ({'; '.join(diffs)}): use the tokenizer settings "
            "of the run that made the checkpoint, or set data.tokenizer_dir to that run's folder"
        )


def check_cache(cache: str) -> None:
    if cache not in CACHE_KINDS:
        raise ValueError(f"model.cache={cache!r} is not known; choose one of {', '.join(CACHE_KINDS)}")


def configure_adamw(module: pl.LightningModule, model: nn.Module) -> dict:
    """AdamW with weight decay on matrices only, and the chosen schedule stepped per optimizer step."""
    hp = module.hparams
    optimizer = optim.adamw(model, hp.lr, hp.weight_decay, tuple(hp.betas), hp.eps)
    return {
        "optimizer": optimizer,
        "lr_scheduler": optim.schedule(
            optimizer, module.trainer, hp.schedule, hp.warmup_steps, min_ratio=hp.min_lr_ratio
        ),
    }
