"""`RunSummary`: the run folder's ``summary.json``, what `attnlab compare` reads."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import socket
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.utilities import measure_flops, rank_zero_warn
from pytorch_lightning.utilities.exceptions import SIGTERMException

import experiments.flops  # noqa: F401  (registers the SDPA formulas that measure_flops lacks on the CPU)
from experiments.callbacks import attention_stats as summary_stats
from experiments.callbacks.base import batch_size, shadowed
from experiments.callbacks.monitors import GradientNorm, Throughput
from experiments.provenance import record_sources
from experiments.runfolder import HEARTBEAT_S, now_utc, read_json, write_json
from models.core.capture import capture_attention, kernel_without_weights
from models.distributed import full_weights


class RunSummary(Callback):
    """Write ``summary.json`` (`experiments.runfolder.Summary`) into the run folder: at fit start (``status:
    running``, with the process id, host and a heartbeat refreshed at the first batch end HEARTBEAT_S after the
    last, so that a reader tells a killed run from a running one) and again when training ends (``finished``) or
    fails.

    FLOPs per sample, the attention statistics at initialisation and at the end (their model summary logged as
    ``attention/sink_mass``, ``attention/out_max`` ...), and ``attention.png`` (each layer's head-mean attention on
    the first sample, logged to W&B as ``val/attention``) are measured on the fixed
    batch: the inputs of the model's first call in the fit (the sanity check's first validation batch, or the
    first training batch without one). The statistics take the whole batch at any length, a block of query rows at a
    time where its weights are large (`experiments.callbacks.attention_stats`); ``attention.png`` is left out (one
    warning, ``attention.left_out``) where the first sample's whole weights would pass ``CAPTURE_MIB``. Every process
    runs these forward passes (FSDP); only rank 0 writes. A model whose kernel of one's own returns no weights gets
    neither (one warning; ``attention.left_out`` says why).
    """

    def __init__(self, filename: str = "summary.json", attention_figure: bool = True):
        self.filename, self.attention_figure = filename, attention_figure
        self.path: Path | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._active = stage == "fit" and not trainer.fast_dev_run and not shadowed(trainer, self)
        if not self._active:
            return
        log_dir = trainer.log_dir or trainer.default_root_dir  # collective under DDP: every rank asks
        self.path = Path(log_dir) / self.filename
        self._model = getattr(pl_module, "model", None)
        self._inputs = summary_stats.FirstCall(self._model) if isinstance(self._model, torch.nn.Module) else None
        self._no_weights = kernel_without_weights(pl_module)  # then no statistics, no attention.png
        self._figure_left_out: str | None = None  # why attention.png is left out, where it is
        if self._no_weights:
            rank_zero_warn(f"attention statistics and attention.png left out: {self._no_weights}")
        self._start, self._init_stats = time.perf_counter(), None
        self._summary = {"status": "running", "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        self._summary.update(pid=os.getpid(), host=socket.gethostname(), heartbeat=now_utc())
        self._beat = time.monotonic()
        self._previous, self._resumed = read_json(self.path), None  # a resumed run's folder already has one
        if trainer.is_global_zero:
            self._summary.update(self._describe(trainer, pl_module))
            write_json(self.path, self._summary)

    def _describe(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        dm = trainer.datamodule
        params = sum(p.numel() for p in pl_module.parameters())
        trainable = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        return {
            "experiment": str(trainer.default_root_dir),
            "run_dir": str(self.path.parent),
            "modality": summary_stats.modality(self._model) if self._model is not None else None,
            "model": f"{type(pl_module).__module__}.{type(pl_module).__qualname__}",
            "hparams": _jsonable(dict(pl_module.hparams)),
            "attention_sources": record_sources(pl_module.hparams, self.path.parent),
            "dataset": type(dm).__name__ if dm is not None else None,
            "data": _jsonable(dict(dm.hparams)) if dm is not None else {},
            "params": {"total": params, "trainable": trainable},
            "trainer": {
                "devices": trainer.num_devices,
                "num_nodes": trainer.num_nodes,
                "world_size": trainer.world_size,
                "strategy": type(trainer.strategy).__name__,
                "precision": str(trainer.precision),
                "accumulate_grad_batches": trainer.accumulate_grad_batches,
                "max_epochs": trainer.max_epochs,
            },
            "hardware": _hardware(trainer),
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "pytorch_lightning": pl.__version__,
            },
            "wandb": _wandb_runs(trainer),
        }

    def _measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any] | None:
        """The attention statistics on the fixed batch; a forward pass on every process (FSDP)."""
        if self._inputs is None or self._inputs.args is None or self._no_weights:
            return None
        try:
            with full_weights(trainer.model):
                data = trainer.datamodule  # the text DataModules name their special tokens
                special_ids = tuple(int(getattr(data, k)) for k in ("bos_id", "eos_id") if hasattr(data, k))
                return summary_stats.attention_statistics(
                    self._model, self._inputs.args, self._inputs.kwargs, special_ids
                )
        except Exception as err:  # statistics must never cost a finished training run
            rank_zero_warn(f"attention statistics failed: {err!r}")
            return None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            return
        self._resumed = self._previous if trainer.ckpt_path else None  # the checkpoint is restored by now
        if self._resumed is None:
            self._init_stats = self._measure(trainer, pl_module)  # the weights are still the initial ones
        elif trainer.is_global_zero:
            self._summary.update(
                resumed_from=str(trainer.ckpt_path), started=self._resumed.get("started", self._summary["started"])
            )
            write_json(self.path, self._summary)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._heartbeat(trainer)

    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._heartbeat(trainer)

    def _heartbeat(self, trainer: pl.Trainer) -> None:
        if self._active and trainer.is_global_zero and time.monotonic() - self._beat >= HEARTBEAT_S:
            self._summary["heartbeat"], self._beat = now_utc(), time.monotonic()
            write_json(self.path, self._summary)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        # without a sanity check the fixed batch is the first training batch: measure before the first update
        if self._active and self._init_stats is None and trainer.global_step == 0 and not trainer.ckpt_path:
            self._init_stats = self._measure(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            return
        final = self._measure(trainer, pl_module)
        flops = self._flops_per_sample(trainer)
        figure = self._figure_maps(trainer) if self.attention_figure and final is not None else None
        if not trainer.is_global_zero:
            return
        throughput = next((cb for cb in trainer.callbacks if isinstance(cb, Throughput)), None)
        grad = next((cb for cb in trainer.callbacks if isinstance(cb, GradientNorm)), None)
        ckpt = trainer.checkpoint_callback
        best = None
        if ckpt is not None and getattr(ckpt, "monitor", None):
            value = None if ckpt.best_model_score is None else float(ckpt.best_model_score)
            best = dict(monitor=ckpt.monitor, mode=ckpt.mode, value=value, checkpoint=ckpt.best_model_path or None)
        previous = self._resumed or {}
        self._summary.update(
            status="finished",
            finished=time.strftime("%Y-%m-%dT%H:%M:%S"),
            train_time_s=previous.get("train_time_s", 0.0) + time.perf_counter() - self._start,
            global_step=trainer.global_step,
            epochs=trainer.current_epoch,
            flops_per_sample=flops,
            throughput={
                "samples_per_s": getattr(throughput, "fit_samples_per_s", None),
                "tokens_per_s": getattr(throughput, "fit_tokens_per_s", None),
            },
            grad_norm={"first": getattr(grad, "first", None), "mean": getattr(grad, "mean", None)},
            best=best,
            metrics={
                k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1
            },  # tensors, as Lightning keeps them
        )
        # a resumed run keeps its first start's
        init = self._init_stats or (previous.get("attention") or {}).get("init")
        self._summary["attention"] = {"init": init, "final": final}
        if self._no_weights or self._figure_left_out:
            self._summary["attention"]["left_out"] = self._no_weights or self._figure_left_out
        write_json(self.path, self._summary)
        if final is not None:  # the model's sinks and outliers, as scalars every logger takes (W&B, metrics.csv)
            values = {f"attention/{k}": v for k, v in final["summary"].items() if v is not None}
            for logger in trainer.loggers:
                logger.log_metrics(values, step=trainer.global_step)
        if figure is not None:
            self._log_figure(trainer, *figure)
        for run in self._summary.get("wandb") or []:
            if run.get("mode") == "offline" and run.get("dir"):
                print(f"attnlab: W&B run saved offline in {run['dir']}; upload it with `wandb sync {run['dir']}`")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if getattr(self, "_active", False) and trainer.is_global_zero:
            stopped = isinstance(exception, (KeyboardInterrupt, SIGTERMException))  # Ctrl-C, or a scheduler's SIGTERM
            self._summary.update(status="interrupted" if stopped else "failed", error=repr(exception)[:500])
            write_json(self.path, self._summary)

    def _forward(self, trainer: pl.Trainer, args: tuple | None = None, kwargs: dict | None = None) -> None:
        """The model in eval mode on the fixed batch (or on ``args``, ``kwargs``); a forward pass on every process
        (FSDP)."""
        was_training = self._model.training
        self._model.eval()
        try:
            with full_weights(trainer.model):
                self._model(
                    *(self._inputs.args if args is None else args),
                    **(self._inputs.kwargs if kwargs is None else kwargs),
                )
        finally:
            self._model.train(was_training)

    def _figure_maps(self, trainer: pl.Trainer) -> tuple[dict[str, torch.Tensor], tuple[int, int] | None] | None:
        """Each layer's head-mean attention (Lq, Lk) on the fixed batch's first sample and DETR's feature-map size;
        None, with the reason in ``attention.left_out``, where that sample's whole weights would pass CAPTURE_MIB."""
        with full_weights(trainer.model):
            inputs = summary_stats.figure_inputs(self._model, self._inputs.args, self._inputs.kwargs)
        if isinstance(inputs, str):
            self._figure_left_out = inputs
            rank_zero_warn(inputs)
            return None
        with torch.no_grad(), capture_attention(self._model) as maps, summary_stats.feature_sizes(self._model) as hw:
            self._forward(trainer, *inputs)
        return {name: calls[0][0].mean(0).cpu() for name, calls in maps.items() if calls}, hw[0] if hw else None

    def _flops_per_sample(self, trainer: pl.Trainer) -> float | None:
        if self._inputs is None or self._inputs.args is None:
            return None
        n = batch_size(self._inputs.args)
        try:  # with autograd on: FlopCounterMode's module tracker fails under no_grad on some models (DETR)
            flops = measure_flops(self._model, lambda: self._forward(trainer))
        except Exception as err:
            rank_zero_warn(f"FLOP counting failed: {err!r}")
            return None
        return flops / n if n else None

    def _log_figure(
        self, trainer: pl.Trainer, maps: dict[str, torch.Tensor], feature_hw: tuple[int, int] | None
    ) -> None:
        """``attention.png`` (`attention_figure`) of ``maps``, logged to W&B as ``val/attention``."""
        from experiments.callbacks.attention_figure import attention_figure, token_sides  # matplotlib: when drawing

        sides = token_sides(self._model, self._inputs.args, feature_hw, trainer.datamodule)
        path = self.path.parent / "attention.png"
        attention_figure(maps, *sides).savefig(path, dpi=100)
        for logger in trainer.loggers:
            if hasattr(logger, "log_image"):
                logger.log_image(key="val/attention", images=[str(path)], step=trainer.global_step)


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` as JSON holds them (a dataclass as its fields, what it cannot as its str), less LightningCLI's
    ``_class_path``, ``_instantiator``."""

    def fallback(value: Any) -> Any:
        return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else str(value)

    return json.loads(json.dumps({k: v for k, v in values.items() if not k.startswith("_")}, default=fallback))


def _hardware(trainer: pl.Trainer) -> dict[str, Any]:
    device = trainer.strategy.root_device
    info: dict[str, Any] = {
        "accelerator": device.type,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gb=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return info


def _wandb_runs(trainer: pl.Trainer) -> list[dict[str, Any]]:
    """Id, mode and folder of each W&B logger's run (starts the run: rank 0 only)."""
    runs = []
    for logger in trainer.loggers:
        if type(logger).__name__ != "WandbLogger" or not hasattr(logger, "experiment"):
            continue
        run = logger.experiment
        disabled, offline = getattr(run, "disabled", False), getattr(run, "offline", False)
        mode = "disabled" if disabled else "offline" if offline else "online"
        folder = str(Path(run.dir).parent) if getattr(run, "dir", None) and mode != "disabled" else None
        url = getattr(run, "url", None) if mode == "online" else None
        runs.append(
            {**{k: getattr(run, k, None) for k in ("id", "project", "entity")}, "mode": mode, "dir": folder, "url": url}
        )
    return runs
