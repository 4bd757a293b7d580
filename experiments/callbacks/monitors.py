"""Training monitors every experiment gets: throughput (`Throughput`) and the gradient norm (`GradientNorm`)."""

from __future__ import annotations

import time

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback

from experiments.callbacks.base import batch_size, shadowed
from models.core.attention import MultiHeadAttention


class Throughput(Callback):
    """Log training throughput over all devices: ``perf/samples_per_s`` and ``perf/tokens_per_s``, once per epoch.

    Wall-clock time over spans of training batches (data loading included, validation not); the first batch of an
    epoch and after a validation only starts a span (warm-up). Tokens are the positions, padding excluded, that
    enter the first attention layer of each Transformer stack (patches + [CLS] for the ViT, source + target tokens
    for translation, feature-map cells + object queries for DETR), summed on the device. ``fit_samples_per_s`` and
    ``fit_tokens_per_s`` hold the whole fit's figures for the run summary.
    """

    def __init__(self):
        self.fit_samples_per_s: float | None = None
        self.fit_tokens_per_s: float | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._active = stage == "fit" and not shadowed(trainer, self)
        self._fit = torch.zeros(3, dtype=torch.float64)  # samples, tokens, seconds
        self._logged = self._fit.clone()  # the totals at the last epoch's end
        # the span under way; its tokens, a tensor on the device while a span is counted and None otherwise, are all
        # that the entry layer's hook reads: under torch.compile (the `Compile` callback) the hook is traced into the
        # network's graph and what it reads guards that graph, so a span's clock there would recompile at every span
        self._samples, self._tokens, self._start = 0, None, None
        entry = _entry_attention(pl_module) if self._active else []
        self._handles = [m.register_forward_pre_hook(self._count, with_kwargs=True) for m in entry]

    def _count(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self._tokens is not None:  # a training batch after the span's first
            query = args[0] if args else kwargs["query"]
            padding = kwargs.get("key_padding_mask")
            same = padding is not None and padding.shape == query.shape[:2]
            tokens = padding.logical_not().sum() if same else query.shape[0] * query.shape[1]
            self._tokens = self._tokens + tokens  # on the device: no GPU sync here

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self._active:
            return
        if self._start is None:
            self._start = _device_done(pl_module)
            self._tokens = torch.zeros((), dtype=torch.int64, device=pl_module.device)
            return
        self._samples += batch_size(batch)

    def _end_span(self, pl_module: pl.LightningModule) -> None:
        """Add the span under way, if any, to the totals."""
        if self._start is not None:
            seconds = _device_done(pl_module) - self._start
            self._fit += torch.tensor([self._samples, float(self._tokens), seconds], dtype=torch.float64)
        self._samples, self._tokens, self._start = 0, None, None

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
        rates = self._global_rates(trainer, self._fit - self._logged)
        self._logged = self._fit.clone()
        if self._fit[2] > 0:  # an epoch of one batch measures nothing
            rates = dict(zip(("perf/samples_per_s", "perf/tokens_per_s"), rates.tolist()))
            pl_module.log_dict(rates, on_step=False, on_epoch=True, sync_dist=True)  # equal on every rank already

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            return
        self._end_span(pl_module)  # an epoch cut short (max_steps, interruption)
        rates = self._global_rates(trainer, self._fit)  # every rank: a collective
        if self._fit[2] > 0:
            self.fit_samples_per_s, self.fit_tokens_per_s = float(rates[0]), float(rates[1])

    def teardown(self, trainer, pl_module, stage: str) -> None:
        for handle in getattr(self, "_handles", []):
            handle.remove()
        self._handles = []


def _entry_attention(pl_module: pl.LightningModule) -> list[torch.nn.Module]:
    """The self-attention of the first layer of each Transformer stack (``*layers.0.self_attn``)."""
    layers = [(n, m) for n, m in pl_module.named_modules() if isinstance(m, MultiHeadAttention)]
    entry = [m for n, m in layers if n.endswith("layers.0.self_attn")]
    return entry or [m for _, m in layers[:1]]


def _device_done(pl_module: pl.LightningModule) -> float:
    """The wall-clock time once the device has finished the work queued so far (one wait for a GPU)."""
    if pl_module.device.type == "cuda":
        torch.cuda.synchronize(pl_module.device)
    return time.perf_counter()


class GradientNorm(Callback):
    """Log ``train/grad_norm``, the L2 norm of all gradients before clipping (after AMP unscaling), at each
    optimizer step; ``first`` (at initialisation) and ``mean`` (over the fit) go to the run summary: the
    gradient side of the √d argument."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._active = stage == "fit" and not shadowed(trainer, self)
        self._first: torch.Tensor | None = None
        self._sum, self._n = 0.0, 0

    @property
    def first(self) -> float | None:
        return None if getattr(self, "_first", None) is None else float(self._first)

    @property
    def mean(self) -> float | None:
        return float(self._sum) / self._n if getattr(self, "_n", 0) else None

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]  # as the strategy set them up
        if not self._active or not grads:
            return
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)  # one fused norm per device and dtype
        if self._first is None:
            self._first = norm
        self._sum, self._n = self._sum + norm, self._n + 1
        pl_module.log("train/grad_norm", norm, on_step=True, on_epoch=False)
