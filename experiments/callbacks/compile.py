"""`Compile`: ``torch.compile`` the model before fitting."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback


class Compile(Callback):
    """``torch.compile`` the LightningModule's ``model`` in place (state-dict keys unchanged) before fitting.

    Worth it on GPUs for long runs; on CPU the first steps pay 25-40 s of compilation for no steady gain.
    """

    def __init__(self, mode: str | None = None, fullgraph: bool = False, dynamic: bool | None = None):
        self.mode, self.fullgraph, self.dynamic = mode, fullgraph, dynamic

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and isinstance(getattr(pl_module, "model", None), torch.nn.Module):
            pl_module.model.compile(mode=self.mode, fullgraph=self.fullgraph, dynamic=self.dynamic)
