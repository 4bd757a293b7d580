"""Guards that keep a run's files whole when something goes wrong, and say what went wrong in one line.

- `NonFiniteLoss` (on in every run): stops training at the first NaN/inf loss, before it reaches the
  weights, and refuses to write a checkpoint whose weights are not finite; the last good checkpoint stays.
- `SafeCheckpointIO` (installed by the CLI): checkpoints are written beside their target and renamed
  into place, so a full disk or a killed process leaves the previous file whole; they are read as
  tensors and plain data only (`models.weights`), so a checkpoint holding pickled code is refused.
- `check_output_folders`: before a fit starts, every folder it will write is created and written
  to, and the disk must have room for its checkpoints.

A `RunError`'s text is the one line the CLI prints after ``attnlab: error:``.
"""
from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch import Tensor

from models.weights import load_weights_file

# room left beside the checkpoints for metrics, configs, attention figures and W&B files
LOG_MARGIN_BYTES = 64 * 2**20


class RunError(RuntimeError):
    """A fault that ends a run; the message names what happened, the files involved and what to do."""


class NonFiniteLoss(Callback):
    """Stop training at the first non-finite loss, before backward, so the weights never see it.

    The error names the global step, the epoch and the logged loss terms that are NaN/inf (DETR's
    ``train/loss_ce``, ``train/loss_bbox``, ``train/loss_giou``; ``train/loss`` for the ViT and the
    text models). A checkpoint whose weights are not finite (an overflowing gradient that left the
    loss finite) is refused, so the last checkpoint on disk is always a good one.

    Cost per step: one scalar read of the loss (on a GPU a host sync, which `GradientNorm` already
    pays every step); under DDP one all-reduce of a flag, so that every process stops together.
    """

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        value = loss.item()
        stop = not math.isfinite(value)
        if trainer.world_size > 1:  # a process that stopped alone would leave the others waiting in backward
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if not stop:
            return
        if math.isfinite(value):
            what = "a non-finite loss on another process"
        else:
            bad = {name: term for name, term in _logged_terms(trainer).items() if not math.isfinite(term)}
            what = f"non-finite loss ({', '.join(f'{name}={term}' for name, term in bad.items()) or f'loss={value}'})"
            if trainer.world_size > 1:
                what += f" on process {trainer.global_rank} of {trainer.world_size}"
        raise _stopped(trainer, f"{what}; the weights were not updated with it")

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        weights = {k: v for k, v in checkpoint.get("state_dict", {}).items() if isinstance(v, Tensor) and v.is_floating_point()}
        if not weights or torch.stack([v.isfinite().all() for v in weights.values()]).all():
            return
        name = next(k for k, v in weights.items() if not v.isfinite().all())
        raise _stopped(trainer, f"the weights became non-finite ({name}) while the loss was finite, e.g. an overflowing gradient; "
                                "that checkpoint was not written")


def _logged_terms(trainer: pl.Trainer) -> dict[str, float]:
    """The scalars ``training_step`` logged at this step. Lightning keeps them in a private result collection
    until the batch ends; read defensively: without it the error names the loss alone."""
    terms = {}
    for metric in (getattr(trainer, "_results", None) or {}).values():
        value, meta = getattr(metric, "_forward_cache", None), getattr(metric, "meta", None)
        if getattr(meta, "fx", None) == "training_step" and isinstance(value, Tensor) and value.numel() == 1:
            terms[meta.name] = value.item()
    return terms


def _stopped(trainer: pl.Trainer, what: str) -> RunError:
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            callback.save_on_exception = False  # its on_exception would write this failed state over last.ckpt
    checkpoint = last_checkpoint(trainer)
    kept = f"the last good checkpoint {checkpoint} was kept" if checkpoint else "no checkpoint had been saved yet"
    return RunError(f"training stopped at global step {trainer.global_step} (epoch {trainer.current_epoch}): {what}; {kept} "
                    "(a lower model.lr or trainer.gradient_clip_val may help)")


def last_checkpoint(trainer: pl.Trainer) -> Path | None:
    """The newest checkpoint file this fit's ModelCheckpoints wrote (last or best), if any."""
    paths = {Path(p) for cb in trainer.checkpoint_callbacks for p in (getattr(cb, "last_model_path", ""), getattr(cb, "best_model_path", "")) if p}
    found = [p for p in paths if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime_ns) if found else None


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO, with whole files and safe reading.

    Saving writes ``.<name>.tmp`` beside the target and renames it into place (``os.replace``, atomic
    on one filesystem). Lightning's own save renames from the system temp folder, which on another
    filesystem becomes a copy into the target: a full disk or a kill in the middle truncates it.
    Loading reads tensors and plain data only, unless the caller passes ``weights_only=False``.
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

    def load_checkpoint(self, path: str | Path, map_location: Any = lambda storage, loc: storage, weights_only: bool | None = None) -> dict[str, Any]:
        if weights_only is False or "://" in str(path) or not Path(path).is_file():
            return super().load_checkpoint(path, map_location, weights_only)
        return load_weights_file(path, "ckpt_path", map_location)


def install_safe_checkpoint_io(trainer: pl.Trainer) -> None:
    """Use `SafeCheckpointIO` where the trainer would use Lightning's default (a configured plugin stays)."""
    if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
        trainer.strategy.checkpoint_io = SafeCheckpointIO()


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


def checkpoint_bytes(model: torch.nn.Module) -> int:
    """About the size of one training checkpoint: the state dict plus AdamW's two moments per trainable parameter."""
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values() if isinstance(t, Tensor))
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return state + 2 * trainable


def check_output_folders(trainer: pl.Trainer, model: torch.nn.Module, resuming: bool = False) -> None:
    """Before a fit: create and write to every folder it will write, and check its checkpoint folders have room.

    Room: every checkpoint the ModelCheckpoints keep (top-k and last), one more while a checkpoint is
    rewritten beside the previous one, and `LOG_MARGIN_BYTES`; a resumed run already holds the files it keeps.
    Raises RunError naming the folder, the setting it comes from and the numbers.
    """
    for folder, setting in _output_folders(trainer).items():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / f".attnlab-write-test-{os.getpid()}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as err:
            raise RunError(f"{setting}: cannot write to {folder} ({err.strerror}: {err.filename}); choose a folder you can write to") from None
    callbacks = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
    if not callbacks:
        return
    one = checkpoint_bytes(model)
    kept = 0 if resuming else sum(_files_kept(cb) for cb in callbacks)
    needed = (kept + 1) * one + LOG_MARGIN_BYTES
    for folder in {_checkpoint_folder(trainer, cb) for cb in callbacks}:
        free = shutil.disk_usage(folder).free
        if free < needed:
            raise RunError(f"{folder} has {_size(free)} free, but this fit needs about {_size(needed)}: {kept + 1} checkpoints of "
                           f"{_size(one)} (weights and AdamW's two moments) and {_size(LOG_MARGIN_BYTES)} for logs; "
                           "free space or choose another trainer.default_root_dir")


def _files_kept(callback: ModelCheckpoint) -> int:
    top_k = 1 if callback.save_top_k < 0 else callback.save_top_k  # -1 keeps them all: at least one
    return top_k + bool(callback.save_last)


def _output_folders(trainer: pl.Trainer) -> dict[Path, str]:
    """Local folder -> the setting that names it."""
    folders = {trainer.default_root_dir: "trainer.default_root_dir"}
    for logger in trainer.loggers:
        folders.setdefault(logger.save_dir, f"trainer.logger ({type(logger).__name__}) save_dir")
    for callback in trainer.checkpoint_callbacks:
        folders.setdefault(getattr(callback, "dirpath", None), "ModelCheckpoint dirpath")
    return {Path(f): setting for f, setting in folders.items() if f and "://" not in str(f)}


def _checkpoint_folder(trainer: pl.Trainer, callback: ModelCheckpoint) -> Path:
    """Where ``callback`` will write: its dirpath, else below the first logger's folder, else the root (as Lightning resolves it)."""
    if callback.dirpath:
        return Path(callback.dirpath)
    return Path(trainer.loggers[0].save_dir or trainer.default_root_dir) if trainer.loggers else Path(trainer.default_root_dir)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
