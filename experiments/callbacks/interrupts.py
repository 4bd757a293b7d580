"""Interrupt and resume: a run stopped by SIGKILL or SIGTERM continues with ``attnlab fit ... --ckpt_path last``
as if it had never stopped (docs/faults.md). Lightning restores weights, optimizer and loop progress, but a resumed
epoch takes its remaining batches from a fresh shuffle, the random streams restart from the seed, and SIGTERM
saves nothing: `ExactResume` closes the first two gaps, `LastCheckpoint` the third (both are in every run).
"""

from __future__ import annotations

import math
import os
import random
import shlex
import signal
import sys
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.warnings import PossibleUserWarning
from lightning_utilities.core.apply_func import apply_to_collection
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.utilities import rank_zero_warn
from pytorch_lightning.utilities.exceptions import SIGTERMException
from pytorch_lightning.utilities.model_helpers import is_overridden
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from experiments.callbacks.base import shadowed
from experiments.callbacks.guards import NonFiniteLoss
from experiments.checkpoints import follow_moved_folder
from experiments.lightning_compat import stop_as_on_sigterm, with_sampler
from experiments.runfolder import METRICS, drop_rows_from

SIGTERM_STATUS = 128 + signal.SIGTERM  # the shell's status for a process stopped by SIGTERM


class ResumableSampler(DistributedSampler):
    """One process's training order, a function of (seed, epoch) only, able to start an epoch part-way (`resume`).

    A ``RandomSampler`` becomes ``DistributedSampler``'s permutation of ``seed + epoch`` (which Lightning leaves in
    place); another sampler (length bucketing, say) runs under a torch RNG seeded so. A sampler of whole batches
    (token budgets) is shared out batch by batch: each process gets every k-th, the list padded with its first
    batches to a multiple of the processes (as ``DistributedSampler`` pads samples). ``generator``, seeded so too,
    seeds the DataLoader's workers.
    """

    def __init__(self, sampler: Sampler, num_replicas: int = 1, rank: int = 0, seed: int = 0):
        shuffles = (
            isinstance(sampler, RandomSampler)
            and not sampler.replacement
            and sampler.num_samples == len(sampler.data_source)
        )
        super().__init__(range(len(sampler)), num_replicas=num_replicas, rank=rank, shuffle=shuffles, seed=seed)
        self.inner = None if shuffles or isinstance(sampler, SequentialSampler) else sampler
        self.generator = torch.Generator()
        self._resume_epoch, self._skip = None, 0
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.generator.manual_seed(self.seed + epoch)

    def resume(self, epoch: int, skip: int) -> None:
        """Start the next pass at ``epoch``, leaving out its first ``skip`` samples (of this process)."""
        self.set_epoch(epoch)
        self._resume_epoch, self._skip = epoch, skip

    def __iter__(self):
        positions = list(super().__iter__())  # this process's share of range(len(sampler)), shuffled by (seed, epoch)
        if self._resume_epoch == self.epoch:
            positions = positions[self._skip :]
        self._resume_epoch = None
        if self.inner is None:
            return iter(positions)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + self.epoch)
            order = list(self.inner)
        return iter([order[p] for p in positions])


def rng_states() -> dict[str, Any]:
    """This process's torch (CPU, CUDA), numpy and Python random states in tensors and plain values (weights_only)."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    states = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos, "has_gauss": has_gauss, "gauss": gauss},
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    numpy = states["numpy"]
    np.random.set_state(
        ("MT19937", numpy["keys"].numpy().astype(np.uint32), numpy["pos"], numpy["has_gauss"], numpy["gauss"])
    )
    cuda = states.get("cuda")
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


class ExactResume(Callback):
    """Make a resumed fit continue exactly where the checkpoint left it: the training loader is rebuilt around a
    `ResumableSampler`, checkpoints hold the position in the epoch and every process's random states (restored
    before the first batch), every loader seeds its workers from its own generator, not the global RNG, and the
    CSV loggers' metrics.csv loses the rows logged after the checkpoint (`experiments.runfolder.drop_rows_from`), and
    a run folder moved whole keeps its best score (`experiments.checkpoints.follow_moved_folder`).
    Exact for what the training processes draw (dropout, augmentation with ``num_workers: 0``), not for workers;
    it warns when the number of processes changed, or (leaving the loader alone) when the training loader is
    neither a map-style DataLoader with a plain ``BatchSampler`` nor one without automatic batching
    (``batch_size=None``) whose sampler yields whole batches (`datamodules.text.token_budget`'s).
    """

    def __init__(self):
        self._resume: dict[str, Any] | None = None
        self._active, self._wrapped = False, []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._active = stage == "fit"  # Lightning refuses a second instance (its state would clash)
        if not self._active:
            return
        self._trainer = trainer
        # Lightning asks these attributes for the loaders (inside the context that lets it rebuild loaders)
        for hook, wrapper in (("train_dataloader", self._train_dataloader), ("val_dataloader", self._val_dataloaders)):
            source = next((s for s in (trainer.datamodule, pl_module) if is_overridden(hook, s)), None)
            if source is not None:
                setattr(source, hook, partial(wrapper, getattr(source, hook)))
                self._wrapped.append((source, hook))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for source, hook in self._wrapped:
            delattr(source, hook)  # the instance attribute: the class's method shows again
        self._wrapped = []

    def _train_dataloader(self, make: Callable[[], Any]) -> Any:
        loader = make()
        if (
            not isinstance(loader, DataLoader)
            or isinstance(loader.dataset, IterableDataset)
            # no batch_sampler: automatic batching is off, each item of the sampler is a whole batch
            or (loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler)
        ):
            rank_zero_warn(
                f"ExactResume: the training loader ({type(loader).__name__}) is not a DataLoader with a plain batch size; "
                "an epoch interrupted mid-way restarts its sample order on resume"
            )
            return loader
        kwargs = self._trainer.distributed_sampler_kwargs or {}
        sampler = ResumableSampler(loader.sampler, seed=int(os.environ.get("PL_GLOBAL_SEED", 0)), **kwargs)
        if self._resume is not None:
            per_batch = 1 if loader.batch_sampler is None else loader.batch_size  # sampler items a batch takes
            sampler.resume(self._resume["epoch"], self._resume["batches"] * per_batch)
        loader = with_sampler(loader, sampler)
        loader.generator = sampler.generator
        # Lightning warns that a mid-epoch resume with a loader lacking state_dict is unreliable; this one resumes exactly
        warnings.filterwarnings(
            "ignore", "You're resuming from a checkpoint that ended before the epoch ended", PossibleUserWarning
        )
        return loader

    def _val_dataloaders(self, make: Callable[[], Any]) -> Any:
        return apply_to_collection(make(), DataLoader, _with_own_generator)

    def state_dict(self) -> dict[str, Any]:
        if not self._active:
            return {}
        trainer = self._trainer
        batches = trainer.fit_loop.epoch_loop.batch_progress.current.ready  # batches of this epoch trained on
        epoch = max(trainer.fit_loop.epoch_progress.current.started - 1, 0)  # the epoch under way (or just finished)
        if batches >= trainer.num_training_batches:  # finished: a resumed run starts the next one
            epoch, batches = epoch + 1, 0
        mine = rng_states()
        states = [mine]
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            # every process saves its checkpoint together: gather onto the one that writes
            states = [None] * trainer.world_size
            torch.distributed.all_gather_object(states, mine)
        return {"epoch": epoch, "batches": batches, "world_size": trainer.world_size, "rng": states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = state or None

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        # before any callback loads its state: a run folder moved whole keeps its best score and checkpoint files
        states = checkpoint.get("callbacks") or {}
        for callback in trainer.checkpoint_callbacks:
            if trainer.ckpt_path and isinstance(states.get(callback.state_key), dict):
                follow_moved_folder(states[callback.state_key], callback.dirpath, trainer.ckpt_path)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after the loader started its epoch and before the first batch is fetched: from here on both runs draw alike
        if not self._active or not trainer.ckpt_path:
            return
        if trainer.is_global_zero:  # a resumed run appends to the metrics.csv it continues
            for logger in trainer.loggers:
                if isinstance(logger, CSVLogger):
                    drop_rows_from(Path(logger.log_dir) / METRICS, trainer.global_step)
        if self._resume is None:
            return
        if self._resume["world_size"] != trainer.world_size:
            rank_zero_warn(
                f"ExactResume: the checkpoint was written by {self._resume['world_size']} processes, this run has "
                f"{trainer.world_size}: the sample order and random streams after resuming differ from an uninterrupted run"
            )
        states = self._resume["rng"]
        set_rng_states(states[trainer.global_rank] if trainer.global_rank < len(states) else states[0])


def _with_own_generator(loader: DataLoader) -> DataLoader:
    loader.generator = loader.generator or torch.Generator()
    return loader


class LastCheckpoint(Callback):
    """Keep the run's ``last.ckpt`` (the first ModelCheckpoint's) fresh, so that ``--ckpt_path last`` loses
    little work: write it after every validation (ModelCheckpoint writes ``last`` only with a new best), and:

    Args:
        every_n_train_steps: every this many optimizer steps (None: not by steps).
        every_n_minutes: when this many minutes have passed since it was last written (None: not by time).
        on_sigterm: on SIGTERM, finish the current batch (and a validation under way), write it, print how to
            resume and exit with status 143 (without checkpoints: stop after the batch, save nothing, exit 143).
    Saves and stops come only after a batch that ends an optimizer step (a checkpoint holds no accumulated
    gradients), and not just before a validation (a resumed Lightning would skip it): the save after it serves.
    Under DDP the processes agree on the SIGTERM and the clock in `NonFiniteLoss`'s all-reduce of each step; on
    one device nothing is read back from the device.
    """

    def __init__(
        self, every_n_train_steps: int | None = None, every_n_minutes: float | None = None, on_sigterm: bool = True
    ):
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(f"LastCheckpoint: every_n_train_steps={every_n_train_steps} must be >= 1 (or null)")
        if every_n_minutes is not None and not every_n_minutes > 0:
            raise ValueError(f"LastCheckpoint: every_n_minutes={every_n_minutes} must be > 0 (or null)")
        self.every_n_train_steps, self.every_n_minutes = every_n_train_steps, every_n_minutes
        self.on_sigterm = on_sigterm
        self._sigterm = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._fit = stage == "fit" and not shadowed(trainer, self)
        # without a ModelCheckpoint (enable_checkpointing: false) the run asked for no checkpoints
        self._active = self._fit and not trainer.fast_dev_run and trainer.checkpoint_callback is not None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            return
        self._saved_step, self._saved_time = trainer.global_step, time.monotonic()
        if self.on_sigterm:
            # Lightning's handler raises on whichever process got the signal, also mid-validation, and runs a
            # collective inside the handler; it restores the previous handler when fit ends.
            self._sigterm = False
            signal.signal(signal.SIGTERM, lambda signum, frame: setattr(self, "_sigterm", True))
        self._guard = next((cb for cb in trainer.callbacks if isinstance(cb, NonFiniteLoss) and cb._active), None)
        if self._guard is not None:
            self._guard.watched = self._flags

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._active or _validation_follows(trainer, batch_idx):
            return  # on_validation_end agrees on SIGTERM and saves
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return  # mid-way through a gradient accumulation, which a checkpoint does not hold: wait for the step
        sigterm, time_due = self._agree(trainer)
        n = self.every_n_train_steps
        if sigterm:
            stop_as_on_sigterm(trainer)  # on every process at this batch
        elif time_due or (n is not None and trainer.global_step // n > self._saved_step // n):
            self.save(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active or trainer.state.fn != "fit" or trainer.sanity_checking:
            return
        if self._agree(trainer, fresh=True)[0] and not _fit_ends_after_this_validation(trainer):
            stop_as_on_sigterm(trainer)  # Lightning stops after the validation; on_exception saves
        else:
            self.save(trainer)

    def _flags(self) -> tuple[bool, bool]:
        """(SIGTERM received, time to save) on this process."""
        minutes_due = bool(self.every_n_minutes) and time.monotonic() - self._saved_time >= 60 * self.every_n_minutes
        return self._sigterm, minutes_due

    def _agree(self, trainer: pl.Trainer, fresh: bool = False) -> tuple[bool, bool]:
        """`_flags` on any process: the same answer on all of them. ``fresh``: ask now, not at this batch's step
        (after a validation, during which a SIGTERM may have come); the guard's all-reduce answers otherwise."""
        if not self.on_sigterm and not self.every_n_minutes:
            return False, False  # nothing to agree on: no collective
        if trainer.world_size == 1:
            return self._flags()
        agreed = None if fresh or self._guard is None else self._guard.agreed
        if agreed is None:
            flags = torch.tensor(self._flags(), dtype=torch.float32, device=trainer.strategy.root_device)
            agreed = trainer.strategy.reduce(flags, reduce_op="max").bool().tolist()
        return tuple(agreed)

    def save(self, trainer: pl.Trainer) -> Path:
        """Write the run's last checkpoint now (every process calls this together)."""
        ckpt = trainer.checkpoint_callback
        path = Path(ckpt.last_model_path or Path(ckpt.dirpath) / f"{ckpt.CHECKPOINT_NAME_LAST}{ckpt.FILE_EXTENSION}")
        if ckpt.save_last:
            ckpt.last_model_path = str(path)  # its own `last` saves overwrite this file instead of adding last-v1.ckpt
        trainer.save_checkpoint(path, weights_only=False)  # the whole state, to resume; unset, Lightning logs a line
        self._saved_step, self._saved_time = trainer.global_step, time.monotonic()
        return path

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not (getattr(self, "_fit", False) and self.on_sigterm and isinstance(exception, SIGTERMException)):
            return
        if self._active:
            said = f"saved {self.save(trainer)}; resume with `{resume_command()}`"
        else:  # Lightning's own handler stopped the run after the batch
            reason = "fast_dev_run" if trainer.fast_dev_run else "trainer.enable_checkpointing: false"
            said = f"nothing saved ({reason})"
        if trainer.is_global_zero:
            print(f"attnlab: SIGTERM at step {trainer.global_step}: {said}", file=sys.stderr, flush=True)
        exception.code = SIGTERM_STATUS  # Lightning re-raises this SystemExit: the process exits with it


def _validation_follows(trainer: pl.Trainer, batch_idx: int) -> bool:
    """Whether Lightning validates (or ends the epoch) right after this training batch."""
    if batch_idx + 1 >= trainer.num_training_batches:
        return True
    every = trainer.val_check_batch
    if not isinstance(every, (int, float)) or not math.isfinite(every):
        return False
    index = trainer.fit_loop.total_batch_idx if trainer.check_val_every_n_epoch is None else batch_idx
    return (index + 1) % int(every) == 0


def _fit_ends_after_this_validation(trainer: pl.Trainer) -> bool:
    if trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps:
        return True
    epoch_done = trainer.fit_loop.epoch_loop.batch_progress.current.ready >= trainer.num_training_batches
    return epoch_done and trainer.max_epochs not in (None, -1) and trainer.current_epoch + 1 >= trainer.max_epochs


def resume_command(argv: list[str] | None = None) -> str:
    """This process's ``attnlab fit`` command with ``--ckpt_path last`` in place of any checkpoint it named."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["fit"]:
        return "attnlab fit <the same arguments> --ckpt_path last"
    args, rest = [], iter(argv)
    for arg in rest:
        if arg == "--ckpt_path":
            next(rest, None)  # its value
        elif not arg.startswith("--ckpt_path="):
            args.append(arg)
    return shlex.join(["attnlab", *args, "--ckpt_path", "last"])
