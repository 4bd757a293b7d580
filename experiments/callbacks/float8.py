"""`Float8Training`: the network's linear layers trained with float8 matmuls (torchao), opt-in for GPU runs."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Literal

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn
from torch import nn

# The output layers of attnlab's networks (ViT, LM, translation, DETR and its encoder proposals): logits and boxes
# rounded to float8 cost accuracy for little time, so torchao's recipes (and torchtitan) keep the last layer as it is.
HEADS = ("head", "lm_head", "generator", "class_embed", "bbox_embed", "proposals")

Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]


class Float8Training(Callback):
    """Train the ``nn.Linear`` layers of the LightningModule's ``model`` with float8 matmuls: torchao's
    ``convert_to_float8_training`` (dynamic scaling, e4m3 inputs and weights; Micikevicius et al. 2022), converted in
    place when a fit starts. The parameters stay the same tensors in the trainer's precision, so the optimizer, the
    state-dict keys and the checkpoints are those of the model without it; validation in the fit runs in float8 too,
    `attnlab validate`/`test`/`predict` in the trainer's precision.

    Converted: each nn.Linear whose in- and out-features are multiples of 16 (the float8 matmul's requirement), except
    the output layers (``skip``). Attention's q/k/v projection is a packed parameter (``in_proj_weight``, as in
    nn.MultiheadAttention), not an nn.Linear, and stays as it is: of a layer's projections with an MLP 4 times wider
    (3d² + d² + 8d² multiply-adds a token), out_proj and the MLP, 9 of 12, run in float8.

    Needs torchao (``pip install 'attnlab[fp8]'``) and a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper,
    Blackwell); compose it with configs/trainer/gpu.yaml, whose torch.compile fuses the float8 casts into the
    neighbouring kernels, as torchao advises (configs/trainer/fp8.yaml).

    Args:
        recipe: torchao's recipe: ``tensorwise`` (one scale per tensor: the fastest), ``rowwise`` (one per row, scales
            rounded to powers of 2: more accurate), ``rowwise_with_gw_hp`` (rowwise, the weight gradient in high
            precision: the most accurate).
        emulate: the same casts with fp32 matmuls, on any device (a CPU too): for checking the numerics, not for
            speed.
        skip: names of layers (and the layers inside them) left as they are; None: `HEADS`, the output layers.
    """

    def __init__(self, recipe: Recipe = "tensorwise", emulate: bool = False, skip: list[str] | None = None):
        if importlib.util.find_spec("torchao") is None:
            raise ValueError("trainer.callbacks: Float8Training needs torchao; install it: pip install 'attnlab[fp8]'")
        self.recipe, self.emulate = recipe, emulate
        self.skip = tuple(HEADS if skip is None else skip)
        self.converted: list[str] = []  # the names of the layers in float8, after setup

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        model = getattr(pl_module, "model", None)
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"trainer.callbacks: Float8Training converts the LightningModule's network, its `model`; "
                f"{type(pl_module).__name__} has none"
            )
        refusal = _refusal(trainer.strategy.root_device, self.emulate)
        if refusal:
            raise ValueError(refusal)
        self._convert(model)

    def _convert(self, model: nn.Module) -> None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(self.recipe)
        if self.emulate:
            config = dataclasses.replace(config, emulate=True)
        linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
        self.converted = [name for name in linears if self._converts(model.get_submodule(name), name)]
        convert_to_float8_training(model, module_filter_fn=self._converts, config=config)
        if not self.converted:
            rank_zero_warn(
                f"Float8Training: no linear layer of {type(model).__name__} has in- and out-features that are "
                f"multiples of 16 outside {', '.join(self.skip)}; the fit runs without float8"
            )
        else:
            rank_zero_info(f"Float8Training: {len(self.converted)} of {len(linears)} linear layers in float8")

    def _converts(self, layer: nn.Module, name: str) -> bool:
        """torchao's ``module_filter_fn``: whether the nn.Linear ``layer``, ``name`` in the network, goes to float8."""
        if any(name == s or name.startswith(f"{s}.") for s in self.skip):
            return False
        return layer.in_features % 16 == 0 and layer.out_features % 16 == 0


def _refusal(device: torch.device, emulate: bool) -> str | None:
    """Why a fit on ``device`` cannot run torchao's float8 matmuls (None: it can)."""
    if emulate:
        return None
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) >= (8, 9):
            return None
        found = f"{torch.cuda.get_device_name(device)}, of compute capability {major}.{minor}"
    else:
        found = f"the {device.type.upper()}"
    return (
        "trainer.callbacks: Float8Training needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper, "
        f"Blackwell); this fit runs on {found}: leave Float8Training out, or set its emulate: true to check the "
        "numerics (fp32 matmuls, slow)"
    )
