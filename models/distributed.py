"""What code run on every process of a distributed run needs: every process's results, and the full
weights of a sharded model for a forward pass outside the training loop.

Both are collectives: every process must call them, the same number of times, or the run hangs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch.distributed as dist
from torch import nn


def gather_objects(obj: Any) -> list[Any]:
    """``obj`` of every process, in rank order (``[obj]`` outside a distributed run); picklable objects only."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


@contextmanager
def full_weights(model: nn.Module) -> Iterator[None]:
    """Inside the block, ``model``'s submodules may be called directly, as when training on one device.

    Under FSDP (``model`` is the strategy's wrapped model, e.g. ``trainer.model``) the weights are
    sharded between the steps, and each process holds a slice of each; the block gathers them whole,
    for reading (``summon_full_params``, ``writeback=False``). Every process must enter the block and
    run the same forward passes in it: a pass on one process alone could wait forever for the others
    in a nested FSDP unit. Elsewhere (one device, DDP) the block does nothing.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    sharded = isinstance(model, FullyShardedDataParallel) or any(
        isinstance(m, FullyShardedDataParallel) for m in model.modules()
    )
    with FullyShardedDataParallel.summon_full_params(model, writeback=False) if sharded else nullcontext():
        yield


def clip_gradients(module, optimizer, gradient_clip_val: float | None, gradient_clip_algorithm: str | None) -> None:
    """A LightningModule's ``configure_gradient_clipping``: Lightning's clipping, with two cases it refuses.

    Under FSDP, by norm: FSDP's own norm, over every process's shards. With a fused optimizer under mixed
    precision: Lightning refuses because such an optimizer unscales inside its step; the gradients are unscaled
    here first (only with fp16's scaler; bf16 has none), then clipped, and the scaler's step skips the unscaling.
    Lightning calls it at every optimizer step, also without clipping: then it returns at once.
    """
    if not gradient_clip_val:
        return
    from pytorch_lightning.plugins.precision import Precision
    from pytorch_lightning.utilities import GradClipAlgorithmType
    from torch.distributed.fsdp import FullyShardedDataParallel

    model, precision = module.trainer.model, module.trainer.precision_plugin
    if gradient_clip_algorithm in (None, "norm") and isinstance(model, FullyShardedDataParallel):
        model.clip_grad_norm_(gradient_clip_val)
    elif getattr(optimizer, "_step_supports_amp_scaling", False) and hasattr(precision, "scaler"):
        if precision.scaler is not None:
            precision.scaler.unscale_(optimizer)
        algorithm = GradClipAlgorithmType(gradient_clip_algorithm or "norm")
        Precision.clip_gradients(precision, optimizer, gradient_clip_val, algorithm)
    else:
        module.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
