"""Trainer overhead: the step time of `attnlab fit` (LightningCLI, Trainer, the default callbacks, the CSV
logger) against a plain PyTorch loop of the same model, data and optimizer.

    python -m benchmarks.overhead                       # ViT on the digits and the toy seq2seq, on the CPU
    python -m benchmarks.overhead --device cuda --repeats 5

The two loops run in one process, in alternating steps: after each training step of `attnlab fit`, a
callback (`Interleave`) runs one step of the plain loop on its own copy of the model, data and optimizer.
On a machine whose speed drifts by 10-40% from one second to the next (a shared VM), both loops then see
the same conditions, within a tenth of a second. The trainer's step is the time from the end of that
callback's hook to its next call (everything Lightning does for a batch: fetching it, the hooks of every
callback, the step, logging); the plain step is the time the callback spends in it: it takes a batch from
its own loader (the loading is paid alike) and trains on the trainer's batch (the same arithmetic, also where
batches differ in length and the trainer's loader orders them otherwise). Each run is one fit of ``--epochs``
+ 1 epochs of ``--batches`` batches, validation off; the first epoch and the first step of each epoch (warm-up, loader start, epoch-end work such as
checkpoints) are not counted. Step time is the total over the counted steps / their number, as
wall-clock time and as this process's CPU time, with one wait for the device at each boundary; the table
also gives the overhead in ms a step and the median and the quartiles of the per-step ratios. On a shared VM
both the step and the host's share of it drift from one hour to the next: compare runs of one sitting.

Each run is a process of its own: the two models' relative speed moves by up to a point from one process to
the next (memory layout; a process's runs agree within half a point), so repeats sample that too.

A second row per task, "Lightning alone", measures a bare `pl.Trainer` (no callback but `Interleave`, no
logger, no checkpoint) on the same module and data the same way: the part of the overhead that Lightning's
loop itself sets, which no callback of ours can remove. The runs of the two loops take turns.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F

from benchmarks.harness import bare_trainer
from experiments.compare.tables import markdown_table

TASKS = {
    "vit": "configs/vision/digits.yaml",
    "seq2seq": "configs/text/toy_en_de.yaml",
    "vit_s16": "configs/vision/vit_s16_random.yaml",  # ViT-S/16, bf16, batch 256: the GPU row
}


def _done(device: torch.device) -> tuple[float, float]:
    """(wall-clock, process CPU) seconds once the device has finished the work queued so far."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter(), time.process_time()


# the plain loop of the run under way (set by `interleaved_step_times`), and the step times measured
_PLAIN: PlainLoop | None = None
_TIMES: dict[str, list[tuple[float, float]]] = {}


class Interleave(pl.Callback):
    """Runs one plain step (`_PLAIN`) after each training step, and times both: (wall, CPU) per step into `_TIMES`."""

    def on_train_start(self, trainer, pl_module):
        _TIMES.update(trainer=[], plain=[])

    def on_train_epoch_start(self, trainer, pl_module):
        _PLAIN.new_epoch()
        self._mark = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        now = _done(pl_module.device)
        _PLAIN.step(batch)
        after = _done(pl_module.device)
        if trainer.current_epoch > 0 and self._mark is not None:
            _TIMES["trainer"].append((now[0] - self._mark[0], now[1] - self._mark[1]))
            _TIMES["plain"].append((after[0] - now[0], after[1] - now[1]))
        self._mark = after


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
        *(f"--{kv}" for kv in args.set),
    ]


def _build(
    config: str, args: argparse.Namespace, root: str
) -> tuple[pl.LightningModule, pl.LightningDataModule, pl.Trainer]:
    from experiments.trainer_cli import AttnlabCLI

    cli = AttnlabCLI(
        model_class=pl.LightningModule,
        datamodule_class=pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        run=False,
        save_config_callback=None,
        args=_common(config, args, root),
    )
    return cli.model, cli.datamodule, cli.trainer


def _lightning_alone(config: str, args: argparse.Namespace, root: str) -> None:
    """Fit the config's module and data with a bare `pl.Trainer`: no callback but `Interleave`, no logger, no
    checkpoint, and the config's logging interval, clipping, accumulation and precision."""
    module, data, configured = _build(config, args, root)
    bare_trainer(
        "gpu" if args.device == "cuda" else "cpu",
        root,
        max_epochs=args.epochs + 1,
        limit_train_batches=args.batches,
        callbacks=[Interleave()],
        log_every_n_steps=configured.log_every_n_steps,
        gradient_clip_val=configured.gradient_clip_val,
        accumulate_grad_batches=configured.accumulate_grad_batches,
        precision=configured.precision,
    ).fit(module, data)


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
    from models.text.seq2seq import label_smoothed_nll_loss, teacher_forcing

    hp = module.hparams
    optimizer = optim.adamw(module.model, hp.lr, hp.weight_decay, tuple(hp.betas), hp.eps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, optim.Schedule(hp.schedule, hp.warmup_steps, None))

    def loss(batch):
        decoder_input, labels = teacher_forcing(batch["tgt"])
        return label_smoothed_nll_loss(
            module.model(batch["src"], decoder_input), labels, hp.label_smoothing, hp.pad_id
        )[0]

    return optimizer, schedule, loss


class PlainLoop:
    """A hand-written loop on its own copy of the config's model, data and optimizer, one `step` at a time: fetch a
    batch, forward, loss, backward, (clipping), AdamW step, schedule step (on the trainer's batch: `step`)."""

    def __init__(self, config: str, args: argparse.Namespace):
        with tempfile.TemporaryDirectory() as root:
            self.module, data, trainer = _build(config, args, root)
        self.device = torch.device(args.device)
        self.module.to(self.device).train()
        data.setup("fit")
        self.loader = data.train_dataloader()
        self.optimizer, self.schedule, self.loss = (_vit if "vision" in config else _seq2seq)(self.module)
        self.clip = trainer.gradient_clip_val
        self.bf16 = str(trainer.precision) == "bf16-mixed"  # the trainer's autocast, as Lightning's plugin sets it
        self.new_epoch()

    def new_epoch(self) -> None:
        self.batches = iter(self.loader)

    def step(self, batch: Any) -> None:
        """One step on ``batch``, the trainer's own, so that both loops do the same arithmetic also where batches
        differ in length (the trainer's loader may order them otherwise: `ExactResume`); a batch is first taken from
        this loop's own loader and moved to the device, so that loading is paid as in the trainer."""
        from lightning_fabric.utilities.apply_func import move_data_to_device

        own = next(self.batches, None)
        if own is None:
            self.new_epoch()
            own = next(self.batches)
        move_data_to_device(own, self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            loss = self.loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip)
        self.optimizer.step()
        self.schedule.step()


LOOPS = {"attnlab": "`attnlab fit`", "lightning": "Lightning alone"}


def interleaved_step_times(
    config: str, args: argparse.Namespace, loop: str = "attnlab"
) -> dict[str, list[tuple[float, float]]]:
    """One fit of this config with a plain step after each of its steps: {"trainer": [...], "plain": [...]}, the
    (wall, CPU) seconds of each counted step. ``loop``: "attnlab" (`attnlab fit`, the CLI in this process) or
    "lightning" (a bare `pl.Trainer`, `_lightning_alone`: the floor that Lightning's loop sets)."""
    global _PLAIN
    from experiments.cli import main

    _PLAIN = PlainLoop(config, args)
    try:
        with tempfile.TemporaryDirectory() as root:
            if loop == "lightning":
                _lightning_alone(config, args, root)
            else:
                interleave = json.dumps({"class_path": f"{__name__}.Interleave"})
                main(["fit", *_common(config, args, root), f"--trainer.callbacks+={interleave}"])
    finally:
        _PLAIN = None
    return {kind: list(times) for kind, times in _TIMES.items()}


def _in_fresh_process(task: str, loop: str, args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    """`interleaved_step_times` of one task and loop in a new Python process: the two models' memory layout, which
    moves their relative speed by up to a point from one process to the next, is drawn anew for each run."""
    options = ["--device", args.device, "--epochs", str(args.epochs), "--batches", str(args.batches)]
    options += [f"--set={kv}" for kv in args.set]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.overhead", "--one", task, loop, *options, "--threads", str(args.threads)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the {loop} run of {task} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])  # the run's own output comes before


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=["vit", "seq2seq"])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each loop per task, each in its own process")
    parser.add_argument("--epochs", type=int, default=8, help="counted epochs per run (after one of warm-up)")
    parser.add_argument("--batches", type=int, default=20, help="training batches per epoch")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    parser.add_argument(
        "--loops",
        nargs="+",
        choices=list(LOOPS),
        default=list(LOOPS),
        help="attnlab: `attnlab fit`; lightning: a bare pl.Trainer on the same module and data (Lightning's floor)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config value for both loops, as `attnlab fit --KEY=VALUE` takes it (e.g. data.init_args.batch_size=64)",
    )
    parser.add_argument("--one", nargs=2, metavar=("TASK", "LOOP"), help=argparse.SUPPRESS)  # a run, in its process
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("WANDB_MODE", "disabled")
    warnings.filterwarnings("ignore", "LightningCLI's args parameter")  # this script's own options are in sys.argv
    if args.one:
        task, loop = args.one
        print(json.dumps(interleaved_step_times(TASKS[task], args, loop)))
        return
    print(overhead_report(args, sys.argv[1:] if argv is None else argv))


def overhead_report(args: argparse.Namespace, argv: list[str]) -> str:
    """The command, the machine and the table: each task's loops, each run in fresh processes."""
    loads, rows = [_load()], []
    for task in args.tasks:
        times = {loop: {"trainer": [], "plain": []} for loop in args.loops}
        for repeat in range(args.repeats):
            for loop in args.loops:  # in turn, so that a slow spell of the machine reaches each
                measured = _in_fresh_process(task, loop, args)
                for kind in ("trainer", "plain"):
                    times[loop][kind] += measured[kind]
                per_step = {kind: statistics.fmean(t[0] for t in m) * 1e3 for kind, m in measured.items()}
                print(
                    f"{task} {loop} repeat {repeat}: trainer {per_step['trainer']:.2f} ms, plain {per_step['plain']:.2f} ms, "
                    f"load {_load()}",
                    file=sys.stderr,
                    flush=True,
                )
        loads.append(_load())
        for loop in args.loops:
            for clock, name in enumerate(("wall-clock", "CPU")):
                trainer, plain = (statistics.fmean(t[clock] for t in times[loop][k]) for k in ("trainer", "plain"))
                ratios = [t[clock] / p[clock] - 1 for t, p in zip(times[loop]["trainer"], times[loop]["plain"])]
                low, median, high = statistics.quantiles(ratios, n=4)
                rows.append(
                    [
                        f"{task} ({TASKS[task]})",
                        LOOPS[loop],
                        name,
                        f"{trainer * 1e3:.2f}",
                        f"{plain * 1e3:.2f}",
                        f"{100 * (trainer - plain) / plain:+.1f} %",
                        f"{(trainer - plain) * 1e3:+.2f}",
                        f"{100 * median:+.1f} % ({100 * low:+.1f} .. {100 * high:+.1f})",
                    ]
                )
    device = (
        torch.cuda.get_device_name()
        if args.device == "cuda"
        else f"CPU ({platform.processor() or platform.machine()}, {args.threads} thread(s))"
    )
    lines = [
        f"Command: `python -m benchmarks.overhead {' '.join(argv)}`  ",
        f"Date: {datetime.date.today()}, torch {torch.__version__}, pytorch-lightning {pl.__version__}, device: {device}, "
        f"load average (1 min) before/after each task: {' -> '.join(loads)}  ",
        f"{args.repeats} runs of each loop of {args.epochs} counted epochs x {args.batches} batches (after 1 warm-up "
        "epoch), each against the plain loop in alternating steps; step time: the mean over the counted steps.\n",
    ]
    header = [
        "task",
        "loop",
        "time",
        "loop step (ms)",
        "plain loop step (ms)",
        "overhead",
        "overhead (ms)",
        "per-step ratio: median (quartiles)",
    ]
    return "\n".join(lines) + "\n" + markdown_table(header, rows)


if __name__ == "__main__":
    main()
    gc.freeze()  # the process ends: no garbage-collector passes over what it made (as in experiments.cli.main)
