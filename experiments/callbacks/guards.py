"""Guards that keep a run's files whole when something goes wrong, and say what went wrong in one line:
`NonFiniteLoss` (every run), `SafeCheckpointIO` (installed by the CLI) and `check_output_folders` (before a fit).
A `RunError`'s text is the one line the CLI prints after ``attnlab: error:``.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch import Tensor

from experiments.callbacks.base import shadowed
from experiments.lightning_compat import batch_ends_optimizer_step, logged_step_values
from experiments.runfolder import newest
from models.weights import load_weights_file

# room left beside the checkpoints for metrics, configs, attention figures and W&B files
LOG_MARGIN_BYTES = 64 * 2**20


class RunError(RuntimeError):
    """A fault that ends a run; the message names what happened, the files involved and what to do."""


class NonFiniteLoss(Callback):
    """Stop training at the first non-finite loss; the weights are never updated with it.

    No per-step wait for the device: each loss goes into a sticky flag on the device, which a ``fused=True``
    optimizer reads as AMP's ``found_inf`` to skip its whole step; any other gets zero gradients (its momentum may
    still move the weights until the stop). The host reads the flag at logging steps, before a validation or a
    checkpoint, at an epoch's and the fit's end and after `MOST_UNCHECKED` batches, and names the first bad batch.
    Under DDP the flag joins one all-reduce per optimizer step, before backward, so that every process stops at
    the same step. A checkpoint of non-finite weights is refused: the last one on disk is always good.
    """

    def __init__(self):
        self._active = False
        # host flags another callback (LastCheckpoint) adds to the all-reduce under DDP, and their maximum over
        # the processes during the batch under way (None when no all-reduce ran in it)
        self.watched: Callable[[], tuple[bool, ...]] = lambda: ()
        self.agreed: tuple[bool, ...] | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._active = stage == "fit" and not shadowed(trainer, self)
        # 1.0 from the first non-finite loss on (float: optimizers read it as found_inf)
        self._bad = torch.zeros((), device=trainer.strategy.root_device)
        self._unchecked = []  # (global step, epoch, loss, logged loss terms) of each batch since the last check

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.agreed = None

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if not self._active:
            return
        loss = loss.detach()
        terms = logged_step_values(trainer) or {"loss": loss}
        self._unchecked.append((trainer.global_step, trainer.current_epoch, loss, terms))
        torch.maximum(self._bad, loss.isfinite().logical_not(), out=self._bad)
        if trainer.world_size > 1:
            if batch_ends_optimizer_step(trainer):
                self._agree(trainer)
        elif len(self._unchecked) >= MOST_UNCHECKED:
            self._check(trainer)

    def _agree(self, trainer: pl.Trainer) -> None:
        """The step's one collective: [this process's flag, then max over processes of: the flag, each watched flag]."""
        watched = torch.tensor(self.watched(), dtype=self._bad.dtype, device=self._bad.device)
        packed = torch.cat([self._bad.expand(2), watched])
        torch.distributed.all_reduce(packed[1:], op=torch.distributed.ReduceOp.MAX)
        mine, anyone, *flags = packed.tolist()
        self.agreed = tuple(flag > 0 for flag in flags)
        if anyone:
            raise self._error(trainer, here=mine > 0)
        self._unchecked = []

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if not self._active or trainer.world_size > 1:  # under DDP a bad loss stopped every process before backward
            return
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            optimizer.found_inf = self._bad  # fused optimizers skip the update on the device (GradScaler's protocol)
            return
        skip = self._bad.bool()
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.masked_fill_(skip, 0.0)

    def _check(self, trainer: pl.Trainer) -> None:
        # a wait for the device; under DDP the step's all-reduce stops every process together instead
        if not self._active or trainer.world_size > 1:
            return
        if self._bad.item():
            raise self._error(trainer, here=True)
        self._unchecked = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step % trainer.log_every_n_steps == 0:  # a logging step
            self._check(trainer)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._check(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check(trainer)

    on_train_end = on_train_epoch_end

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._check(trainer)
        weights = {
            k: v for k, v in checkpoint.get("state_dict", {}).items() if isinstance(v, Tensor) and v.is_floating_point()
        }
        if not weights or torch.stack([v.isfinite().all() for v in weights.values()]).all():
            return
        name = next(k for k, v in weights.items() if not v.isfinite().all())
        raise _stopped(
            trainer,
            f"the weights became non-finite ({name}) while the loss was finite, e.g. an overflowing gradient; "
            "that checkpoint was not written",
        )

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for optimizer in trainer.optimizers:
            if getattr(optimizer, "found_inf", None) is self._bad:
                del optimizer.found_inf

    def _error(self, trainer: pl.Trainer, here: bool) -> RunError:
        # names the first batch since the last check whose loss is not finite (not ``here``: the batch under way)
        losses = torch.stack([loss.float() for _, _, loss, _ in self._unchecked]).tolist()
        first = next((i for i, loss in enumerate(losses) if not math.isfinite(loss)), -1)
        step, epoch, _, logged = self._unchecked[first]
        if not here:
            what = "a non-finite loss on another process"
        else:
            terms = torch.stack([t.float() for t in logged.values()]).tolist()
            bad = ", ".join(f"{name}={term}" for name, term in zip(logged, terms) if not math.isfinite(term))
            what = f"non-finite loss ({bad or 'loss=nan'})"
            if trainer.world_size > 1:
                what += f" on process {trainer.global_rank} of {trainer.world_size}"
        return _stopped(trainer, f"{what}; the weights were not updated with it", step, epoch)


# a check (a read of the flag) at the latest after this many batches: the references kept stay few
MOST_UNCHECKED = 1000


def _stopped(trainer: pl.Trainer, what: str, step: int | None = None, epoch: int | None = None) -> RunError:
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            callback.save_on_exception = False  # its on_exception would write this failed state over last.ckpt
    checkpoint = last_checkpoint(trainer)
    kept = f"the last good checkpoint {checkpoint} was kept" if checkpoint else "no checkpoint had been saved yet"
    step = trainer.global_step if step is None else step
    epoch = trainer.current_epoch if epoch is None else epoch
    return RunError(
        f"training stopped at global step {step} (epoch {epoch}): {what}; {kept} "
        "(a lower model.lr or trainer.gradient_clip_val may help)"
    )


def last_checkpoint(trainer: pl.Trainer) -> Path | None:
    """The newest checkpoint file this fit's ModelCheckpoints wrote (last or best), if any."""
    return newest(
        p
        for cb in trainer.checkpoint_callbacks
        for p in (getattr(cb, "last_model_path", ""), getattr(cb, "best_model_path", ""))
    )


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO, writing whole files and reading tensors only.

    Saving writes ``.<name>.tmp`` beside the target and renames it into place (Lightning's own moves a file from
    the system temp folder: across filesystems a copy, which a full disk or a kill truncates). Loading reads
    tensors and plain data only (`models.weights`), refusing pickled code, unless given ``weights_only=False``.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.tmp")
        try:
            torch.save(checkpoint, partial)
            os.replace(partial, path)
        except BaseException as err:
            partial.unlink(missing_ok=True)
            if isinstance(err, OSError) and err.filename is None:  # a failed write on an open file names no file
                raise OSError(err.errno, err.strerror, str(path)) from err
            raise

    def load_checkpoint(
        self, path: str | Path, map_location: Any = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if weights_only is False or "://" in str(path) or not Path(path).is_file():
            return super().load_checkpoint(path, map_location, weights_only)
        return load_weights_file(path, "ckpt_path", map_location)


def disk_full_message(err: OSError, trainer: pl.Trainer) -> str:
    """The CLI's line for ENOSPC/EDQUOT during a run: what could not be written, and what is still whole."""
    checkpoint = last_checkpoint(trainer)
    if checkpoint is None:
        kept = "no checkpoint had been saved yet"
    elif isinstance(trainer.strategy.checkpoint_io, SafeCheckpointIO):
        kept = f"the previous checkpoint {checkpoint} is intact (checkpoints are renamed into place only once complete)"
    else:
        kept = f"the last checkpoint written is {checkpoint}"
    return f"no space left on the disk while writing {err.filename or 'a file of the run'}; {kept}; free space, then resume with --ckpt_path last"


def check_output_folders(trainer: pl.Trainer, model: torch.nn.Module, resuming: bool = False) -> None:
    """Before a fit: create and write to every folder it will write, and check its checkpoint folders have room
    for every checkpoint the ModelCheckpoints keep (top-k and last; a resumed run holds them already), one more
    while a checkpoint is rewritten beside the previous one, and `LOG_MARGIN_BYTES`."""
    folders = {trainer.default_root_dir: "trainer.default_root_dir"}  # folder -> the setting that names it
    for logger in trainer.loggers:
        folders.setdefault(logger.save_dir, f"trainer.logger ({type(logger).__name__}) save_dir")
    for callback in trainer.checkpoint_callbacks:
        folders.setdefault(getattr(callback, "dirpath", None), "ModelCheckpoint dirpath")
    for folder, setting in ((Path(f), s) for f, s in folders.items() if f and "://" not in str(f)):  # local ones
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=folder).close()  # a file can be made there
        except OSError as err:
            raise RunError(
                f"{setting}: cannot write to {folder} ({err.strerror}: {err.filename}); choose a folder you can write to"
            ) from None
    callbacks = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
    if not callbacks:
        return
    # one training checkpoint: about the state dict plus AdamW's two moments per trainable parameter
    one = sum(t.numel() * t.element_size() for t in model.state_dict().values() if isinstance(t, Tensor))
    one += 2 * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    # top-k (-1 keeps them all: at least one) and last
    kept = 0 if resuming else sum((cb.save_top_k if cb.save_top_k >= 0 else 1) + bool(cb.save_last) for cb in callbacks)
    needed = (kept + 1) * one + LOG_MARGIN_BYTES
    # each writes in its dirpath, else below the first logger's folder, else the root (as Lightning resolves it)
    logs = trainer.loggers and trainer.loggers[0].save_dir
    for folder in {Path(cb.dirpath or logs or trainer.default_root_dir) for cb in callbacks}:
        free = shutil.disk_usage(folder).free
        if free < needed:
            raise RunError(
                f"{folder} has {_size(free)} free, but this fit needs about {_size(needed)}: {kept + 1} checkpoints of "
                f"{_size(one)} (weights and AdamW's two moments) and {_size(LOG_MARGIN_BYTES)} for logs; "
                "free space or choose another trainer.default_root_dir"
            )


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
