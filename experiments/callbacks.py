"""Callbacks shared by every experiment."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import BasePredictionWriter, Callback
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn
from pytorch_lightning.utilities.exceptions import SIGTERMException

from experiments import stats as summary_stats
from models.attention import capture_attention
from models.distributed import full_weights


def _rows(output: dict[str, Any]) -> list[dict[str, Any]]:
    """Turn one batch of ``predict_step`` output (a dict of equal-length tensors/lists) into per-sample rows."""
    columns = {k: (v.tolist() if isinstance(v, torch.Tensor) else list(v)) for k, v in output.items()}
    n = len(next(iter(columns.values()), []))
    return [{k: v[i] for k, v in columns.items()} for i in range(n)]


class PredictionWriter(BasePredictionWriter):
    """Write every sample that ``predict_step`` returns as one JSON line.

    Args:
        output: file to write; relative paths are placed under ``trainer.default_root_dir``.
    Under DDP each rank writes ``<output>.rank<N>``.
    """

    def __init__(self, output: str = "predictions.jsonl"):
        super().__init__(write_interval="batch")
        self.output = output
        self._file = None

    def _path(self, trainer: pl.Trainer) -> Path:
        path = Path(self.output)
        if not path.is_absolute():
            path = Path(trainer.default_root_dir) / path
        return path.with_name(f"{path.name}.rank{trainer.global_rank}") if trainer.world_size > 1 else path

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        path = self._path(trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("w")

    def write_on_batch_end(
        self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx
    ) -> None:
        for row in _rows(prediction):
            self._file.write(json.dumps(row) + "\n")

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        path = self._path(trainer)
        self._file.close()
        print(f"attnlab: predictions written to {path}", file=sys.stderr)  # stdout carries the predictions


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        found = _first_tensor(value)
        if found is not None:
            return found
    return None


def batch_size(batch: Any) -> int:
    """Samples in a batch: the length of its first tensor (images, token ids, dataset indices)."""
    first = _first_tensor(batch)
    return int(first.shape[0]) if first is not None and first.dim() else 0


def _shadowed(trainer: pl.Trainer, callback: Callback) -> bool:
    """True when an earlier callback of the same class exists: a default-on callback yields to one a config lists."""
    for other in trainer.callbacks:
        if other is callback:
            return False
        if type(other) is type(callback):
            return True
    return False


class Throughput(Callback):
    """Log training throughput over all devices: ``perf/samples_per_s`` and ``perf/tokens_per_s``, once per epoch.

    Time is wall-clock over spans of training batches (data loading included), timed without waiting
    for the device at every step: a span ends, after one wait for the device, at each logging step
    (``trainer.log_every_n_steps``), before a validation and at an epoch's end; the first batch of
    every epoch and the first after a validation only start a span (warm-up, loader start), and
    validation is left out. Tokens are the positions, padding excluded, that enter the first attention
    layer of each Transformer stack: patches + [CLS] for the ViT, source + target tokens for
    translation, feature-map cells + object queries for DETR; they are summed on the device and read
    when a span ends. ``fit_samples_per_s`` / ``fit_tokens_per_s`` hold the whole fit's figures for
    the run summary.
    """

    def __init__(self):
        self.fit_samples_per_s: float | None = None
        self.fit_tokens_per_s: float | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._active = stage == "fit" and not _shadowed(trainer, self)
        self._epoch = torch.zeros(3, dtype=torch.float64)  # samples, tokens, seconds (this epoch)
        self._fit = torch.zeros(3, dtype=torch.float64)
        self._samples, self._tokens, self._counting, self._start = 0, 0, False, None  # the span under way
        self._handles = []
        if self._active:
            self._handles = [
                m.register_forward_pre_hook(self._count, with_kwargs=True) for m in _entry_attention(pl_module)
            ]

    def _count(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self._counting:
            query = args[0] if args else kwargs["query"]
            padding = kwargs.get("key_padding_mask")
            same = padding is not None and padding.shape == query.shape[:2]
            self._tokens = self._tokens + (
                padding.logical_not().sum() if same else query.shape[0] * query.shape[1]
            )  # no GPU sync here

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._counting = self._active and self._start is not None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self._active:
            return
        self._counting = False
        if self._start is None:
            self._start = _device_done(pl_module)
            return
        self._samples += batch_size(batch)
        if trainer._logger_connector.should_update_logs:  # Lightning reads the logged metrics back now too
            self._start = self._end_span(pl_module)

    def _end_span(self, pl_module: pl.LightningModule) -> float | None:
        """Add the span under way to the epoch's totals; returns when it ended (None: no span was under way)."""
        if self._start is None:
            return None
        now = _device_done(pl_module)
        self._epoch += torch.tensor([self._samples, float(self._tokens), now - self._start], dtype=torch.float64)
        self._samples, self._tokens, self._start = 0, 0, None
        return now

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._samples, self._tokens, self._start = 0, 0, None

    def on_validation_start(self, trainer, pl_module) -> None:
        if getattr(self, "_active", False):
            self._end_span(pl_module)

    def _global_rates(self, trainer: pl.Trainer, totals: torch.Tensor) -> torch.Tensor:
        """Per-process rates summed over processes: (samples/s, tokens/s)."""
        rates = totals[:2] / totals[2] if totals[2] > 0 else torch.zeros(2, dtype=torch.float64)
        return trainer.strategy.reduce(rates.float().to(trainer.strategy.root_device), reduce_op="sum").cpu()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            return
        self._end_span(pl_module)
        rates = self._global_rates(trainer, self._epoch.clone())
        self._fit += self._epoch
        self._epoch.zero_()
        if self._fit[2] > 0:  # an epoch of one batch measures nothing
            pl_module.log_dict(
                {"perf/samples_per_s": float(rates[0]), "perf/tokens_per_s": float(rates[1])},
                on_step=False,
                on_epoch=True,
            )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            return
        self._end_span(pl_module)
        self._fit += self._epoch  # an epoch cut short (max_steps, interruption)
        rates = self._global_rates(trainer, self._fit)  # every rank: a collective
        if self._fit[2] > 0:
            self.fit_samples_per_s, self.fit_tokens_per_s = float(rates[0]), float(rates[1])

    def teardown(self, trainer, pl_module, stage: str) -> None:
        for handle in getattr(self, "_handles", []):
            handle.remove()
        self._handles = []


def _entry_attention(pl_module: pl.LightningModule) -> list[torch.nn.Module]:
    """The self-attention of the first layer of each Transformer stack (``*layers.0.self_attn``)."""
    from models.attention import MultiHeadAttention

    layers = [(n, m) for n, m in pl_module.named_modules() if isinstance(m, MultiHeadAttention)]
    entry = [m for n, m in layers if n.endswith("layers.0.self_attn")]
    return entry or [m for _, m in layers[:1]]


def _device_done(pl_module: pl.LightningModule) -> float:
    """The wall-clock time once the device has finished the work queued so far (one wait for a GPU)."""
    if pl_module.device.type == "cuda":
        torch.cuda.synchronize(pl_module.device)
    return time.perf_counter()


class GradientNorm(Callback):
    """Log ``train/grad_norm``, the L2 norm of all gradients before clipping (after AMP unscaling), at the
    steps Lightning logs (every ``trainer.log_every_n_steps``); measured also at the fit's first step.

    Keeps ``first`` (the norm at the first step, i.e. at initialisation) and ``mean`` (over the measured
    steps) for the run summary: the gradient side of the √d argument. The norms stay on the device until
    those are read, and until the logging step's end, where Lightning reads its own logged values too. The
    norm goes to the loggers directly, at Lightning's step number, as Lightning's ``LearningRateMonitor``
    writes the learning rate: ``LightningModule.log`` costs about 2,000 Python calls here (it moves its
    result entry to the value's device field by field), so ``train/grad_norm`` is not in
    ``trainer.callback_metrics`` and a ModelCheckpoint cannot monitor it.
    """

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._active = stage == "fit" and not _shadowed(trainer, self)
        self._first: torch.Tensor | None = None
        self._sum, self._n = 0.0, 0
        self._to_log: torch.Tensor | None = None

    @property
    def first(self) -> float | None:
        return None if getattr(self, "_first", None) is None else float(self._first)

    @property
    def mean(self) -> float | None:
        return float(self._sum) / self._n if getattr(self, "_n", 0) else None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._parameters = list(pl_module.parameters())  # as the strategy has set them up (FSDP shards them)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        logging = trainer._logger_connector.should_update_logs
        if not self._active or not (self._first is None or logging):
            return
        grads = [p.grad for p in self._parameters if p.grad is not None]
        if not grads:
            return
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)  # one fused norm per device and dtype
        if self._first is None:
            self._first = norm
        self._sum, self._n = self._sum + norm, self._n + 1
        self._to_log = norm if logging else None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        if self._to_log is None:
            return
        metrics, self._to_log = {"train/grad_norm": float(self._to_log)}, None
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.fit_loop.epoch_loop._batches_that_stepped)


class RunSummary(Callback):
    """Write ``summary.json`` into the run folder (``trainer.log_dir``): what `attnlab compare` reads.

    Written at fit start (``status: running``) and again when training ends (``finished``) or fails:
    modality, dataset, model class and hyper-parameters, parameters, FLOPs per sample (one forward pass,
    counted by ``torch.utils.flop_counter``), throughput (from `Throughput`), gradient norms (from
    `GradientNorm`), the best value of the ModelCheckpoint monitor, the last value of every logged
    metric, attention statistics at initialisation and at the end (`experiments.stats`, on the
    fixed batch: the inputs of the model's first call in the fit, i.e. the first validation batch of
    the sanity check, or the first training batch when the sanity check is off), hardware and versions.
    Also saves ``attention.png`` (each layer's head-mean attention on the first sample) and logs it
    to image-capable loggers (W&B) as ``val/attention``. Every process runs the measuring forward passes
    on its own fixed batch, which FSDP needs (`models.distributed.full_weights`); only rank 0 writes.
    """

    def __init__(self, filename: str = "summary.json", attention_figure: bool = True):
        self.filename, self.attention_figure = filename, attention_figure
        self.path: Path | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._active = stage == "fit" and not trainer.fast_dev_run and not _shadowed(trainer, self)
        if not self._active:
            return
        log_dir = trainer.log_dir or trainer.default_root_dir  # collective under DDP: every rank asks
        self.path = Path(log_dir) / self.filename
        self._model = getattr(pl_module, "model", None)
        self._inputs = summary_stats.FirstCall(self._model) if isinstance(self._model, torch.nn.Module) else None
        self._start, self._init_stats = time.perf_counter(), None
        self._summary = {"status": "running", "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        self._previous, self._resumed = _read_json(self.path), None  # a resumed run's folder already has one
        if trainer.is_global_zero:
            self._summary.update(self._describe(trainer, pl_module))
            self._write()

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
            "versions": _versions(),
            "wandb": _wandb_runs(trainer),
        }

    def _special_ids(self, pl_module: pl.LightningModule) -> tuple[int, ...]:
        return tuple(int(pl_module.hparams[k]) for k in ("bos_id", "eos_id") if k in pl_module.hparams)

    def _measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any] | None:
        """The attention statistics on the fixed batch; a forward pass on every process (FSDP)."""
        if self._inputs is None or self._inputs.args is None:
            return None
        try:
            with full_weights(trainer.model):
                return summary_stats.attention_statistics(
                    self._model, self._inputs.args, self._inputs.kwargs, self._special_ids(pl_module)
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
            self._write()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        # without a sanity check the fixed batch is the first training batch: measure before the first update
        if self._active and self._init_stats is None and trainer.global_step == 0 and not trainer.ckpt_path:
            self._init_stats = self._measure(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            return
        final = self._measure(trainer, pl_module)
        flops = self._flops_per_sample(trainer)
        figure = self._attention_maps(trainer) if self.attention_figure and final is not None else None
        if not trainer.is_global_zero:
            return
        throughput = next((cb for cb in trainer.callbacks if isinstance(cb, Throughput)), None)
        grad = next((cb for cb in trainer.callbacks if isinstance(cb, GradientNorm)), None)
        ckpt = trainer.checkpoint_callback
        best = None
        if ckpt is not None and getattr(ckpt, "monitor", None):
            score = ckpt.best_model_score
            best = {
                "monitor": ckpt.monitor,
                "mode": ckpt.mode,
                "value": None if score is None else float(score),
                "checkpoint": ckpt.best_model_path or None,
            }
        previous = self._resumed or {}
        previous_time = previous.get("train_time_s", 0.0)
        self._summary.update(
            status="finished",
            finished=time.strftime("%Y-%m-%dT%H:%M:%S"),
            train_time_s=previous_time + time.perf_counter() - self._start,
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
                k: float(v)
                for k, v in trainer.callback_metrics.items()
                if isinstance(v, torch.Tensor) and v.numel() == 1
            },
        )
        init = self._init_stats or (previous.get("attention") or {}).get(
            "init"
        )  # a resumed run keeps its first start's
        self._summary["attention"] = {"init": init, "final": final}
        self._write()
        if figure is not None:
            self._log_figure(trainer, figure)
        for run in self._summary.get("wandb") or []:
            if run.get("mode") == "offline" and run.get("dir"):
                print(f"attnlab: W&B run saved offline in {run['dir']}; upload it with `wandb sync {run['dir']}`")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if getattr(self, "_active", False) and trainer.is_global_zero:
            stopped = isinstance(exception, (KeyboardInterrupt, SIGTERMException))  # Ctrl-C, or a scheduler's SIGTERM
            self._summary.update(status="interrupted" if stopped else "failed", error=repr(exception)[:500])
            self._write()

    def _flops_per_sample(self, trainer: pl.Trainer) -> float | None:
        """FLOPs of one forward pass per sample of the fixed batch; a forward pass on every process (FSDP)."""
        from torch.utils.flop_counter import FlopCounterMode

        if self._inputs is None or self._inputs.args is None:
            return None
        n = batch_size(self._inputs.args)
        was_training = self._model.training
        self._model.eval()
        try:  # with autograd on: FlopCounterMode's module tracker fails under no_grad on some models (DETR)
            with full_weights(trainer.model), FlopCounterMode(display=False) as counter:
                self._model(*self._inputs.args, **self._inputs.kwargs)
        except Exception as err:
            rank_zero_warn(f"FLOP counting failed: {err!r}")
            return None
        finally:
            self._model.train(was_training)
        return counter.get_total_flops() / n if n else None

    def _attention_maps(self, trainer: pl.Trainer) -> dict[str, torch.Tensor]:
        """Each layer's head-mean attention (Lq, Lk) on the first sample of the fixed batch; a forward pass on every process (FSDP)."""
        with torch.no_grad(), full_weights(trainer.model), capture_attention(self._model) as maps:
            was_training = self._model.training
            self._model.eval()
            try:
                self._model(*self._inputs.args, **self._inputs.kwargs)
            finally:
                self._model.train(was_training)
        return {name: calls[0][0].mean(0).cpu() for name, calls in maps.items() if calls}

    def _log_figure(self, trainer: pl.Trainer, maps: dict[str, torch.Tensor]) -> None:
        path = self.path.parent / "attention.png"
        plot_attention_maps(maps, path)
        for logger in trainer.loggers:
            if hasattr(logger, "log_image"):
                logger.log_image(key="val/attention", images=[str(path)], step=trainer.global_step)

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._summary, indent=1))
        tmp.replace(self.path)


def plot_attention_maps(maps: dict[str, torch.Tensor], path: Path, columns: int = 4) -> None:
    """One heat map per layer: ``maps`` name -> (Lq, Lk) weights (e.g. the head mean of one sample)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(maps)
    cols = min(columns, len(names)) or 1
    rows = max(1, -(-len(names) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 3 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, name in zip(axes.flat, names):
        ax.imshow(maps[name].float().numpy(), cmap="viridis", aspect="auto", interpolation="nearest")
        ax.set_title(name, fontsize=7)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        ax.axis("on")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _read_json(path: Path | None) -> dict[str, Any]:
    try:
        return json.loads(path.read_text()) if path is not None and path.exists() else {}
    except (OSError, ValueError):
        return {}


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in values.items():
        if key.startswith("_"):  # LightningCLI's bookkeeping (_class_path, _instantiator)
            continue
        try:
            json.dumps(value)
            out[key] = value
        except TypeError:
            out[key] = str(value)
    return out


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


def _versions() -> dict[str, str]:
    import pytorch_lightning

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pytorch_lightning": pytorch_lightning.__version__,
    }


def _wandb_runs(trainer: pl.Trainer) -> list[dict[str, Any]]:
    """Id, mode and folder of each W&B logger's run (starts the run: rank 0 only)."""
    runs = []
    for logger in trainer.loggers:
        if type(logger).__name__ != "WandbLogger" or not hasattr(logger, "experiment"):
            continue
        run = logger.experiment
        mode = (
            "disabled" if getattr(run, "disabled", False) else "offline" if getattr(run, "offline", False) else "online"
        )
        runs.append(
            {
                "id": getattr(run, "id", None),
                "project": getattr(run, "project", None),
                "entity": getattr(run, "entity", None),
                "mode": mode,
                "dir": str(Path(run.dir).parent) if getattr(run, "dir", None) and mode != "disabled" else None,
                "url": getattr(run, "url", None) if mode == "online" else None,
            }
        )
    return runs


class LearningRateScaling(Callback):
    """Scale the configured learning rate(s) with the global batch size.

    ``data.batch_size`` is per device and the experiment's ``lr`` is the one tuned on one device, so the
    global batch is ``batch_size × devices × num_nodes × accumulate_grad_batches`` and each optimizer's
    learning rate (and its scheduler's base) is multiplied by ``k = devices × num_nodes × accumulation``
    (``rule: linear``, Goyal et al. 2017), by √k (``sqrt``, usual for Adam) or left alone (``none``).
    A resumed run keeps the learning rates its checkpoint restored.
    """

    def __init__(self, rule: Literal["linear", "sqrt", "none"] = "linear"):
        if rule not in ("linear", "sqrt", "none"):
            raise ValueError(f"LearningRateScaling: rule={rule!r}; expected linear, sqrt or none")
        self.rule = rule
        self.factor = 1.0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        k = trainer.world_size * trainer.accumulate_grad_batches
        self.factor = {"linear": float(k), "sqrt": k**0.5, "none": 1.0}[self.rule]
        if self.factor == 1.0 or trainer.ckpt_path:
            return
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] *= self.factor
                if "initial_lr" in group:
                    group["initial_lr"] *= self.factor
        for config in trainer.lr_scheduler_configs:
            if hasattr(config.scheduler, "base_lrs"):
                config.scheduler.base_lrs = [lr * self.factor for lr in config.scheduler.base_lrs]
        rank_zero_info(
            f"attnlab: learning rate × {self.factor:g} ({self.rule} in {k} = devices × nodes × accumulation)"
        )


class Compile(Callback):
    """``torch.compile`` the LightningModule's ``model`` in place (state-dict keys unchanged) before fitting.

    Worth it on GPUs for long runs; on CPU the first steps pay 25-40 s of compilation for no steady gain.
    """

    def __init__(self, mode: str | None = None, fullgraph: bool = False, dynamic: bool | None = None):
        self.mode, self.fullgraph, self.dynamic = mode, fullgraph, dynamic

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and isinstance(getattr(pl_module, "model", None), torch.nn.Module):
            pl_module.model.compile(mode=self.mode, fullgraph=self.fullgraph, dynamic=self.dynamic)
