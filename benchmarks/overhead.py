"""Trainer overhead: the step time of `attnlab fit` (LightningCLI, Trainer, the default callbacks, the CSV
logger) against a plain PyTorch loop of the same model, data and optimizer.

    python -m benchmarks.overhead                       # ViT on the digits and the toy seq2seq, on the CPU
    python -m benchmarks.overhead --device cuda --repeats 7

Each repeat runs both loops, in alternating order, for ``--epochs`` + 1 epochs of ``--batches`` batches
with validation off. The first epoch is warm-up; in each later epoch the time from the end of its first
batch to the end of its last (one wait for the device at each end) is the measured span, so loader
starts and epoch-end work (checkpoints) fall outside it. Step time = measured time / measured steps,
as wall-clock time and as this process's CPU time (on a CPU shared with other jobs the CPU time is the
steadier figure: waiting for a core is not counted); the table gives the median over repeats and the
overhead (trainer - plain) / plain of those medians.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F

TASKS = {
    "vit": "configs/vision/digits.yaml",
    "seq2seq": "configs/text/toy_en_de.yaml",
}


def _done(device: torch.device) -> tuple[float, float]:
    """(wall-clock, process CPU) seconds once the device has finished the work queued so far."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter(), time.process_time()


class SpanClock(pl.Callback):
    """Times the trainer's epochs after the first, from the end of their first batch to the end of their last,
    and writes (seconds, steps) to ``output``."""

    def __init__(self, output: str):
        self.output, self.seconds, self.steps, self._start = output, [0.0, 0.0], 0, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch == 0:
            return
        if batch_idx == 0:
            self._start = _done(pl_module.device)
        elif batch_idx + 1 == trainer.num_training_batches:
            self.seconds = [
                total + end - start for total, end, start in zip(self.seconds, _done(pl_module.device), self._start)
            ]
            self.steps += batch_idx

    def on_train_end(self, trainer, pl_module):
        Path(self.output).write_text(json.dumps({"seconds": self.seconds, "steps": self.steps}))


def _common(config: str, args: argparse.Namespace, root: str) -> list[str]:
    accelerator = "gpu" if args.device == "cuda" else "cpu"
    return [
        "--config",
        config,
        f"--trainer.default_root_dir={root}",
        f"--trainer.accelerator={accelerator}",
        "--trainer.devices=1",
        f"--trainer.max_epochs={args.epochs + 1}",
        f"--trainer.limit_train_batches={args.batches}",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
    ]


def trainer_step_time(config: str, args: argparse.Namespace) -> list[float]:
    """(wall-clock, CPU) seconds per step of `attnlab fit` with this config (the CLI in this process)."""
    from experiments.cli import main

    with tempfile.TemporaryDirectory() as root:
        output = Path(root) / "clock.json"
        clock = json.dumps({"class_path": f"{__name__}.SpanClock", "init_args": {"output": str(output)}})
        main(["fit", *_common(config, args, root), f"--trainer.callbacks+={clock}"])
        measured = json.loads(output.read_text())
    return [seconds / measured["steps"] for seconds in measured["seconds"]]


def _build(config: str, args: argparse.Namespace, root: str) -> tuple[pl.LightningModule, pl.LightningDataModule]:
    from experiments.cli import AttnlabCLI

    cli = AttnlabCLI(
        model_class=pl.LightningModule,
        datamodule_class=pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        run=False,
        save_config_callback=None,
        args=_common(config, args, root),
    )
    return cli.model, cli.datamodule


def _vit(module: pl.LightningModule) -> tuple[torch.optim.Optimizer, Any, Callable[[Any], torch.Tensor]]:
    """AdamW over the module's parameter groups with its warm-up cosine schedule, and the cross-entropy loss."""
    from models import optim

    hp = module.hparams
    optimizer = optim.adamw(module.model, hp.lr, hp.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, optim.Schedule("cosine", 10, 1000, hp.min_lr_ratio))

    def loss(batch):
        images, labels = batch
        return F.cross_entropy(module.model(images), labels, label_smoothing=hp.label_smoothing)

    return optimizer, schedule, loss


def _seq2seq(module: pl.LightningModule) -> tuple[torch.optim.Optimizer, Any, Callable[[Any], torch.Tensor]]:
    """The module's own AdamW and inverse-square-root schedule, and the label-smoothed loss under teacher forcing."""
    from models import optim
    from models.text import label_smoothed_nll_loss, teacher_forcing

    hp = module.hparams
    optimizer = optim.adamw(module.model, hp.lr, hp.weight_decay, tuple(hp.betas), hp.eps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, optim.Schedule(hp.schedule, hp.warmup_steps, None))

    def loss(batch):
        decoder_input, labels = teacher_forcing(batch["tgt"])
        return label_smoothed_nll_loss(
            module.model(batch["src"], decoder_input), labels, hp.label_smoothing, hp.pad_id
        )[0]

    return optimizer, schedule, loss


def plain_step_time(config: str, args: argparse.Namespace) -> list[float]:
    """(wall-clock, CPU) seconds per step of a hand-written loop: forward, loss, backward, (clipping), AdamW step, schedule step."""
    from lightning_fabric.utilities.apply_func import move_data_to_device

    with tempfile.TemporaryDirectory() as root:
        module, data = _build(config, args, root)
    pl.seed_everything(0, verbose=False)
    device = torch.device(args.device)
    module.to(device).train()
    data.setup("fit")
    loader = data.train_dataloader()
    optimizer, schedule, loss_of = (_vit if "vision" in config else _seq2seq)(module)
    clip = 1.0 if "text" in config else None  # the toy config's trainer.gradient_clip_val
    seconds, steps = [0.0, 0.0], 0
    for epoch in range(args.epochs + 1):
        start = None
        for i, batch in enumerate(loader):
            if i == args.batches:
                break
            loss = loss_of(move_data_to_device(batch, device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
            optimizer.step()
            schedule.step()
            if epoch == 0:
                continue
            if i == 0:
                start = _done(device)
            elif i + 1 == min(args.batches, len(loader)):
                seconds = [total + end - begin for total, end, begin in zip(seconds, _done(device), start)]
                steps += i
    return [total / steps for total in seconds]


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=["vit", "seq2seq"])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3, help="measured epochs per run (after one of warm-up)")
    parser.add_argument("--batches", type=int, default=20, help="training batches per epoch")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("WANDB_MODE", "disabled")
    warnings.filterwarnings("ignore", "LightningCLI's args parameter")  # this script's own options are in sys.argv
    loads, rows = [_load()], []
    for task in args.tasks:
        times: dict[str, list[list[float]]] = {"trainer": [], "plain": []}
        for repeat in range(args.repeats):
            order = ("trainer", "plain") if repeat % 2 == 0 else ("plain", "trainer")
            for kind in order:
                times[kind].append((trainer_step_time if kind == "trainer" else plain_step_time)(TASKS[task], args))
            print(
                f"{task} repeat {repeat}: trainer {times['trainer'][-1][0] * 1e3:.2f} ms, plain {times['plain'][-1][0] * 1e3:.2f} ms "
                f"(CPU {times['trainer'][-1][1] * 1e3:.2f} / {times['plain'][-1][1] * 1e3:.2f}), load {_load()}",
                file=sys.stderr,
                flush=True,
            )
        loads.append(_load())
        for clock, name in enumerate(("wall-clock", "CPU")):
            trainer = statistics.median(t[clock] for t in times["trainer"])
            plain = statistics.median(t[clock] for t in times["plain"])
            pairs = [(t[clock] - p[clock]) / p[clock] for t, p in zip(times["trainer"], times["plain"])]
            rows.append(
                f"| {task} ({TASKS[task]}) | {name} | {trainer * 1e3:.2f} | {plain * 1e3:.2f} | {100 * (trainer - plain) / plain:+.1f} % | "
                f"{100 * min(pairs):+.1f} .. {100 * max(pairs):+.1f} % |"
            )
    device = (
        torch.cuda.get_device_name()
        if args.device == "cuda"
        else f"CPU ({platform.processor() or platform.machine()}, {args.threads} thread(s))"
    )
    print(f"Command: `python -m benchmarks.overhead {' '.join(argv if argv is not None else sys.argv[1:])}`  ")
    print(
        f"Date: {datetime.date.today()}, torch {torch.__version__}, pytorch-lightning {pl.__version__}, device: {device}, "
        f"load average (1 min) before/after each task: {' -> '.join(loads)}  "
    )
    print(
        f"{args.repeats} interleaved repeats of {args.epochs} measured epochs x {args.batches} batches (1 warm-up epoch); "
        "step time is the median over repeats.\n"
    )
    print("| task | time | `attnlab fit` step (ms) | plain loop step (ms) | Trainer overhead | per-repeat range |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
