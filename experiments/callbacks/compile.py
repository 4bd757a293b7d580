"""`Compile`: ``torch.compile`` the model before fitting."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback


class Compile(Callback):
    """``torch.compile`` the LightningModule's ``model`` in place (state-dict keys unchanged) before fitting: the
    network's forward and backward. The loss, metrics and logging around it stay eager; DETR's loss could not be one
    graph anyway, its Hungarian matching runs scipy on the host (tests/test_compile_steps.py).

    Worth it on GPUs for long runs (configs/trainer/gpu.yaml); on CPU the first steps pay 25-40 s of compilation for
    no steady gain.

    Args:
        mode: ``torch.compile``'s: None (inductor's default), ``reduce-overhead`` (CUDA graphs:
            configs/trainer/gpu_cudagraphs.yaml), ``max-autotune``.
        fullgraph: a graph break is an error instead of a split graph (every attnlab network is one graph:
            tests/test_compile.py; an attention class of one's own may not be).
        dynamic: ``torch.compile``'s: None marks the sizes that change dynamic after their first change.
        backend: ``torch.compile``'s; ``eager`` traces the graph and runs it unchanged (no code generated: seconds).
    """

    def __init__(
        self, mode: str | None = None, fullgraph: bool = False, dynamic: bool | None = None, backend: str = "inductor"
    ):
        self.mode, self.fullgraph, self.dynamic, self.backend = mode, fullgraph, dynamic, backend

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and isinstance(getattr(pl_module, "model", None), torch.nn.Module):
            pl_module.model.compile(
                mode=self.mode, fullgraph=self.fullgraph, dynamic=self.dynamic, backend=self.backend
            )
