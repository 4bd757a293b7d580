"""Interrupt and resume (issue #8): a fit killed mid-epoch (SIGKILL) or stopped by SIGTERM continues with
`attnlab fit --ckpt_path last` to the same step count, the same training batches and the same weights as
an uninterrupted run of the same seed.

A test-only callback kills the process, signals it or waits for the test's SIGTERM at a chosen step, so the point
of interruption is exact, not a matter of timing. Runs killed (SIGKILL) or run under DDP are processes of their own
(`processes`: DDP's two ranks started as torchrun starts them); the others, the uninterrupted references and the
resumed runs go through the same CLI in this process (one import, one thread) to keep the file quick: a SIGTERM this
process sends itself meets the handlers a fit's process has, and the fit's exit status is its SystemExit.
"""

import csv
import json
import os
import re
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from builders import CallCounter
from processes import CLIProcess, torchrun, wait_all
from torch.utils.data import DistributedSampler, RandomSampler, Sampler

from experiments.callbacks.interrupts import SIGTERM_STATUS, LastCheckpoint, ResumableSampler, resume_command
from experiments.cli import main
from experiments.runfolder import Summary

ROOT = Path(__file__).resolve().parents[1]
STEPS = 15  # 3 epochs of 5 batches
# A 1-layer ViT on the digits with dropout and drop-path on, so a resumed run must restore the random
# streams too; last.ckpt is refreshed every 3 steps (mid-epoch) and after every validation. ExactResume is
# not listed: every run has it (experiments.tracking.default_callbacks), and these tests prove the default.
TINY = [
    "--config",
    "configs/vision/digits.yaml",
    "--trainer.accelerator=cpu",
    "--trainer.max_epochs=3",
    "--trainer.limit_train_batches=5",
    "--trainer.limit_val_batches=2",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.logger=false",
    "--model.init_args.depth=1",
    "--model.init_args.embed_dim=16",
    "--model.init_args.num_heads=2",
]
EVERY_3_STEPS = (
    "--trainer.callbacks+={class_path: experiments.callbacks.LastCheckpoint, init_args: {every_n_train_steps: 3}}"
)


class BatchLog(pl.Callback):
    """Append each training batch's fit (an id per run of the CLI), step and labels to a JSON-lines file: the sample
    order training saw."""

    def __init__(self, path: str):
        self.path, self.fit = path, uuid.uuid4().hex

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        with open(self.path, "a") as f:
            f.write(json.dumps({"fit": self.fit, "step": trainer.global_step, "labels": batch[1].tolist()}) + "\n")


class KillAt(pl.Callback):
    """SIGKILL this process at the end of the batch that reaches ``step``."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class AwaitSigterm(pl.Callback):
    """At the end of the batch that reaches ``step``, create ``ready`` and wait (a minute at most) for a SIGTERM;
    under DDP only rank 0 waits (the other processes run on into their next collective)."""

    def __init__(self, step: int, ready: str):
        self.step, self.ready = step, ready

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.step or trainer.global_rank != 0:
            return
        arrived, handler = [], signal.getsignal(signal.SIGTERM)

        def note(signum, frame):  # after the handler in place (attnlab's): it still sees the signal
            arrived.append(signum)
            handler(signum, frame)

        signal.signal(signal.SIGTERM, note)
        Path(self.ready).touch()
        deadline = time.monotonic() + 60
        while not arrived and time.monotonic() < deadline:
            time.sleep(0.01)


def probe(cls: type, **init_args) -> str:
    return f"--trainer.callbacks+={json.dumps({'class_path': f'{__name__}.{cls.__name__}', 'init_args': init_args})}"


def fit_args(root: Path, *args: str, last: str = EVERY_3_STEPS) -> list[str]:
    """The `attnlab` arguments of a tiny fit in the run folder ``root`` that logs its batches, then ``args``."""
    return [
        "fit",
        *TINY,
        last,
        f"--trainer.default_root_dir={root}",
        probe(BatchLog, path=str(root / "batches.jsonl")),
        *args,
    ]


def fit_in_process(root: Path, *args: str) -> None:
    main(fit_args(root, *args))


def stopped_in_process(capsys, root: Path, *args: str) -> str:
    """`fit_in_process` of a run that a SIGTERM stops, with the argv its own process would have (the resume command
    it prints is made from it): its exit status must be 143. Returns what it wrote on stderr."""
    argv = fit_args(root, *args)
    with pytest.MonkeyPatch.context() as patch, pytest.raises(SystemExit) as exit_:
        patch.setattr(sys, "argv", ["attnlab", *argv])
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == SIGTERM_STATUS == 143, err[-3000:]
    return err


ENV = {
    "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),  # the probes below: test_interrupts.KillAt
    "WANDB_MODE": "disabled",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
}


def start_fit(root: Path, *args: str, last: str = EVERY_3_STEPS) -> CLIProcess:
    """`fit_args` in a process of its own (its output in ``root``.parent/logs)."""
    return CLIProcess(fit_args(root, *args, last=last), {**os.environ, **ENV}, root.parent / "logs")


def start_ddp_fit(root: Path, *args: str, last: str = EVERY_3_STEPS) -> list[CLIProcess]:
    """`fit_args` on two processes with DDP, started as torchrun starts them."""
    return torchrun(fit_args(root, *DDP, *args, last=last), {**os.environ, **ENV}, root.parent / "logs")


def stderr(processes: list[CLIProcess]) -> str:
    return "".join(p.stderr() for p in processes)


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def batch_log(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "batches.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("uninterrupted")
    fit_in_process(root)
    return root


def assert_continues_exactly(run: Path, reference: Path, checkpoint_step: int, folder: Path | None = None) -> None:
    """The interrupted-then-resumed run ``run`` trained the same batches to the same weights as the reference;
    ``folder`` holds its checkpoints and summary (default: ``run``, a run without a logger)."""
    folder = folder or run
    log = batch_log(run)
    resumed = [r["step"] for r in log if r["fit"] != log[0]["fit"]]
    assert resumed == list(range(checkpoint_step, STEPS))  # the resumed fit continued at the checkpoint's step
    trained = {r["step"]: r["labels"] for r in log}  # a step trained again after the resume keeps its second batch
    assert trained == {r["step"]: r["labels"] for r in batch_log(reference)}  # the rest of the epoch, not a new shuffle

    ours, theirs = load(folder / "checkpoints" / "last.ckpt"), load(reference / "checkpoints" / "last.ckpt")
    assert ours["global_step"] == theirs["global_step"] == STEPS
    # Bitwise equal on this CPU; 1e-6 leaves room for a BLAS whose kernels depend on memory alignment, while
    # a resume that trains on other samples or other dropout masks lands ~1e-2 away (plain Lightning here).
    worst = max((ours["state_dict"][k] - theirs["state_dict"][k]).abs().max().item() for k in theirs["state_dict"])
    assert worst <= 1e-6
    ours, theirs = (json.loads((root / "summary.json").read_text()) for root in (folder, reference))
    assert ours["status"] == "finished" and ours["global_step"] == STEPS
    for key in ("val/loss", "val/acc"):
        assert ours["metrics"][key] == pytest.approx(theirs["metrics"][key], abs=1e-6)


# metrics.csv written at every step
LOGGED = (
    "--trainer.logger={class_path: experiments.tracking.CSVLogger, init_args: {flush_logs_every_n_steps: 1}}",
    "--trainer.log_every_n_steps=1",
)


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Path:
    """A run of the CLI in its own process, SIGKILLed at step 8 (`LOGGED`): each test below resumes a copy of it."""
    run = tmp_path_factory.mktemp("killed") / "run"
    job = start_fit(run, *LOGGED, probe(KillAt, step=8))
    assert job.wait(timeout=300) == -signal.SIGKILL, job.stderr()[-3000:]
    return run


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_matches_an_uninterrupted_run(killed, reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(killed, run)
    folder = run / "lightning_logs" / "version_0"
    saved = load(folder / "checkpoints" / "last.ckpt")
    batches = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]
    assert (
        saved["global_step"] == 6 and saved["epoch"] == 1 and batches["ready"] == 1
    )  # one batch into the second epoch

    fit_in_process(run, *LOGGED, "--ckpt_path", "last")
    assert_continues_exactly(run, reference, checkpoint_step=6, folder=folder)


@pytest.mark.slow
def test_a_killed_run_reads_as_killed_and_its_resume_logs_each_step_once(killed, tmp_path):
    """Killed at step 8 with metrics.csv written at every step: the row of step 6 came after last.ckpt (step 6);
    the summary says killed, and once resumed metrics.csv holds each step's row once."""
    run = tmp_path / "run"
    shutil.copytree(killed, run)
    folder = run / "lightning_logs" / "version_0"
    assert load(folder / "checkpoints" / "last.ckpt")["global_step"] == 6
    assert [step for step, _ in logged_steps(folder, "train/loss")] == list(range(7))  # 6 came after the checkpoint
    assert Summary.read(folder).status == "running" and Summary.read(folder).state() == "killed"

    fit_in_process(run, *LOGGED, "--ckpt_path", "last")
    assert [step for step, _ in logged_steps(folder, "train/loss")] == list(range(STEPS))
    assert [epoch for _, epoch in logged_steps(folder, "val/loss")] == [0, 1, 2]
    assert Summary.read(folder).state() == "finished"


def logged_steps(folder: Path, key: str) -> list[tuple[int, int]]:
    """(step, epoch) of each metrics.csv row that holds ``key``."""
    rows = csv.DictReader((folder / "metrics.csv").open(newline=""))
    return [(int(r["step"]), int(r["epoch"])) for r in rows if r.get(key)]


@pytest.mark.slow
def test_sigterm_saves_last_checkpoint_exits_143_and_resume_matches(reference, tmp_path, capsys):
    run = tmp_path / "run"
    # with loader workers (persistent ones, which draw their seed once per process): the result must not change
    workers = "--data.init_args.num_workers=2"
    err = stopped_in_process(capsys, run, workers, probe(SigtermAt, batch=7))
    assert "Traceback" not in err
    said = re.search(
        r"^attnlab: SIGTERM at step (\d+): saved (\S+); resume with `attnlab fit (.*) --ckpt_path last`$", err, re.M
    )
    assert said, err[-3000:]
    step = int(said.group(1))
    assert step == 8  # the signal came in step 7's batch (the 8th): stopped after it
    assert (
        Path(said.group(2)) == run / "checkpoints" / "last.ckpt"
        and load(run / "checkpoints" / "last.ckpt")["global_step"] == step
    )
    assert f"--trainer.default_root_dir={run}" in said.group(3)
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"

    fit_in_process(run, workers, "--ckpt_path", "last")
    assert_continues_exactly(run, reference, checkpoint_step=step)


DDP = ("--trainer.strategy=ddp", "--trainer.devices=2", "--data.init_args.batch_size=32")


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory) -> Path:
    """An uninterrupted two-process run of 2 epochs (10 steps), shared by the DDP tests: the weights a stopped and
    resumed DDP run must reach, the checkpoint a one-process resume starts from, and rank 0's count of collectives
    per batch (collectives.json). Its LastCheckpoint saves by the clock (every 30 minutes: never here), so that
    the time-to-save flag is agreed on at every step and no save adds a barrier to a step's count."""
    root = tmp_path_factory.mktemp("ddp_uninterrupted")
    by_time = (
        "--trainer.callbacks+={class_path: experiments.callbacks.LastCheckpoint, init_args: {every_n_minutes: 30}}"
    )
    ranks = start_ddp_fit(
        root, "--trainer.max_epochs=2", probe(Collectives, path=str(root / "collectives.json")), last=by_time
    )
    assert wait_all(ranks, timeout=180) == [0, 0], stderr(ranks)[-3000:]
    return root


@pytest.mark.slow
def test_sigterm_to_one_ddp_process_stops_both_at_the_same_batch_and_resumes_to_the_uninterrupted_weights(
    ddp_reference, tmp_path
):
    """Two CPU processes (gloo) and a SIGTERM to rank 0 only, at step 2 of 10: rank 1 learns of it from the
    per-batch all-reduce, both save together and exit (Lightning alone raises on rank 0 and leaves rank 1 in its
    next collective: a gloo error or, with a checkpoint saved on the exception, a hang). `--ckpt_path last` under
    DDP again: the same 10 steps end at the weights and validation metrics of a DDP run that never stopped (each
    process's random state and its share of the epoch's order come back)."""
    run = tmp_path / "run"
    ready = run / "ready"
    ranks = start_ddp_fit(run, "--trainer.max_epochs=2", probe(AwaitSigterm, step=2, ready=str(ready)))
    while not ready.exists() and all(rank.poll() is None for rank in ranks):
        time.sleep(0.05)
    ranks[0].send_signal(signal.SIGTERM)
    codes = wait_all(ranks, timeout=120)  # a rank left hanging fails here
    err = stderr(ranks)
    assert codes == [SIGTERM_STATUS] * 2, err[-3000:]
    assert "Traceback" not in err and len(re.findall("^attnlab: SIGTERM at step", err, re.M)) == 1, err[-3000:]
    saved = load(run / "checkpoints" / "last.ckpt")
    assert (
        saved["global_step"] in (2, 3) and len(saved["callbacks"]["ExactResume"]["rng"]) == 2
    )  # both processes' random states

    resumed = start_ddp_fit(run, "--trainer.max_epochs=2", "--ckpt_path", "last")
    assert wait_all(resumed, timeout=180) == [0, 0], stderr(resumed)[-3000:]
    ours, theirs = load(run / "checkpoints" / "last.ckpt"), load(ddp_reference / "checkpoints" / "last.ckpt")
    assert ours["global_step"] == theirs["global_step"] == 10
    assert (
        max((ours["state_dict"][k] - theirs["state_dict"][k]).abs().max().item() for k in theirs["state_dict"]) <= 1e-6
    )
    ours, theirs = (json.loads((root / "summary.json").read_text())["metrics"] for root in (run, ddp_reference))
    for key in ("val/loss", "val/acc"):
        assert ours[key] == pytest.approx(theirs[key], abs=1e-6)


class PoisonOnRank(pl.Callback):
    """Make one process's training batch NaN at ``step``: its loss is NaN, the other process's is finite."""

    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            batch[0].fill_(float("nan"))


@pytest.mark.slow
def test_a_nan_loss_on_one_ddp_process_stops_both_and_keeps_the_last_checkpoint(tmp_path):
    """Rank 1 alone sees a NaN loss at step 4: both processes stop before backward (the guard's all-reduced
    flag; a process stopping alone would leave the other waiting in the gradient all-reduce), each says why
    in a line of its own, and last.ckpt stays the one of step 3."""
    run = tmp_path / "run"
    ranks = start_ddp_fit(run, "--trainer.max_epochs=1", probe(PoisonOnRank, rank=1, step=4))
    codes = wait_all(ranks, timeout=120)  # a process left waiting would fail here
    err = stderr(ranks)
    assert codes == [2, 2], err[-3000:]
    stops = re.findall(
        r"^attnlab: error: training stopped at global step 4 \(epoch 0\): (.*?); the weights were not updated",
        err,
        re.M,
    )
    assert "Traceback" not in err and sorted(stops) == [
        "a non-finite loss on another process",
        "non-finite loss (train/loss=nan) on process 1 of 2",
    ], err[-3000:]
    saved = load(run / "checkpoints" / "last.ckpt")
    assert saved["global_step"] == 3 and all(
        v.isfinite().all() for v in saved["state_dict"].values() if v.is_floating_point()
    )


class Collectives(CallCounter):
    """Count calls to torch.distributed's collectives from one training batch's end to the next; rank 0 writes the
    counts. Lightning's own per-batch ``broadcast`` of rank 0's SIGTERM flag is not counted: it is not the guards'."""

    NAMES = (
        "all_reduce",
        "all_gather",
        "all_gather_object",
        "broadcast_object_list",
        "barrier",
        "reduce",
        "reduce_scatter",
    )

    def __init__(self, path: str):
        self.path, self.per_batch = path, []
        self.count(torch.distributed, self.NAMES)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.per_batch.append(self.calls)
        self.calls = 0

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps(self.per_batch))


@pytest.mark.slow
def test_ddp_processes_agree_in_one_collective_per_optimizer_step(ddp_reference):
    """Two processes: the NaN guard's flag and LastCheckpoint's SIGTERM and time-to-save flags travel in one all-reduce
    per step, and on one device the guards make none."""
    per_batch = json.loads((ddp_reference / "collectives.json").read_text())
    # batch 0's count holds the fit's setup, batch 5's the validation and the epoch change before it
    assert len(per_batch) == 10 and per_batch[1:5] == per_batch[6:] == [1, 1, 1, 1]


class GlobalRandomOrder(Sampler):
    """A sampler that draws its order from the global torch RNG (as length bucketing does)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter(torch.randperm(self.n).tolist())


@pytest.mark.parametrize("replicas", [1, 2])
def test_resumable_sampler_order_depends_on_seed_and_epoch_and_resumes_part_way(replicas):
    data = range(10)

    def order(sampler: Sampler, epoch: int, rank: int = 0) -> list[int]:
        resumable = ResumableSampler(sampler, num_replicas=replicas, rank=rank, seed=3)
        resumable.set_epoch(epoch)
        torch.rand(7)  # whatever else drew from the global RNG does not matter
        return list(resumable)

    epoch1 = [order(RandomSampler(data), 1, rank) for rank in range(replicas)]
    assert sorted(sum(epoch1, [])) == list(data)  # the processes share the data, each sample once
    assert (
        epoch1 == [order(RandomSampler(data), 1, rank) for rank in range(replicas)]
        and order(RandomSampler(data), 2) != epoch1[0]
    )
    distributed = DistributedSampler(data, num_replicas=replicas, rank=0, seed=3)
    distributed.set_epoch(1)
    assert epoch1[0] == list(distributed)  # the order Lightning gives multi-process runs

    resumed = ResumableSampler(RandomSampler(data), num_replicas=replicas, rank=0, seed=3)
    resumed.resume(1, skip=2)
    resumed.set_epoch(1)  # Lightning sets the epoch again before iterating
    assert list(resumed) == epoch1[0][2:]
    resumed.set_epoch(2)
    assert list(resumed) == order(RandomSampler(data), 2)  # only the interrupted epoch is shortened

    assert order(GlobalRandomOrder(10), 1) == order(GlobalRandomOrder(10), 1) != order(GlobalRandomOrder(10), 2)
    before = torch.get_rng_state()
    list(ResumableSampler(GlobalRandomOrder(10), num_replicas=replicas, seed=3))
    assert torch.equal(torch.get_rng_state(), before)  # iterating leaves the global RNG (dropout's) untouched


class LastSavedStep(pl.Callback):
    """Append, at each training batch's start, the step that ``last.ckpt`` holds (null: no file yet)."""

    def __init__(self, path: str):
        self.path = path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        last = Path(trainer.checkpoint_callback.dirpath) / "last.ckpt"
        with open(self.path, "a") as f:
            f.write(json.dumps(load(last)["global_step"] if last.exists() else None) + "\n")


@pytest.mark.parametrize(
    "accumulate, seen_at_batch_starts, final",
    [
        # after every batch but an epoch's last, whose save waits for the validation after it (steps 5 and 10)
        (1, [None, 1, 2, 3, 4, 5, 6, 7, 8, 9], 10),
        # only after batches that end an optimizer step (the 2nd and 4th of an epoch; the 5th steps and validates)
        (2, [None, None, 1, 1, 2, 3, 3, 4, 4, 5], 6),
    ],
)
def test_every_n_minutes_refreshes_last_checkpoint_between_validations(
    tmp_path, accumulate, seen_at_batch_starts, final
):
    seen = tmp_path / "seen.jsonl"
    main(
        [
            "fit",
            *TINY,
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.max_epochs=2",
            f"--trainer.accumulate_grad_batches={accumulate}",
            probe(LastSavedStep, path=str(seen)),
            "--trainer.callbacks+={class_path: experiments.callbacks.LastCheckpoint, init_args: {every_n_minutes: 1.0e-9}}",
        ]
    )
    assert [json.loads(line) for line in seen.read_text().splitlines()] == seen_at_batch_starts
    assert load(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == final


def test_resume_command_replaces_the_checkpoint_argument():
    assert (
        resume_command(["fit", "--config", "a b.yaml", "--ckpt_path", "x.ckpt"])
        == "attnlab fit --config 'a b.yaml' --ckpt_path last"
    )
    assert (
        resume_command(["fit", "--ckpt_path=best", "--trainer.max_epochs=3"])
        == "attnlab fit --trainer.max_epochs=3 --ckpt_path last"
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [({"every_n_train_steps": 0}, "every_n_train_steps=0"), ({"every_n_minutes": -1}, "every_n_minutes=-1")],
)
def test_last_checkpoint_refuses_bad_intervals(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LastCheckpoint(**kwargs)


class SigtermAt(pl.Callback):
    """Send this process a SIGTERM at the start of training batch ``batch`` of the fit (counted across epochs)."""

    def __init__(self, batch: int):
        self.batch = batch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.fit_loop.total_batch_idx == self.batch:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
def test_sigterm_under_gradient_accumulation_finishes_the_optimizer_step_then_resumes(tmp_path, capsys):
    """Steps of 3 batches and a SIGTERM during batch 3, the first of the second step: batches 4 and 5 still
    train, the step ends (global step 2), last.ckpt holds it with no half-accumulated step, status 143; the
    resumed run trains batches 6-8 and ends at the weights of a run that never stopped."""
    accumulate = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=9", "--trainer.accumulate_grad_batches=3"]
    run, reference = tmp_path / "run", tmp_path / "reference"
    err = stopped_in_process(capsys, run, *accumulate, probe(SigtermAt, batch=3))
    last = run / "checkpoints" / "last.ckpt"
    assert re.search(rf"^attnlab: SIGTERM at step 2: saved {re.escape(str(last))}; resume with", err, re.M), err[-3000:]
    assert [r["step"] for r in batch_log(run)] == [0, 0, 0, 1, 1, 1]  # signalled in batch 3: batches 4, 5 end the step
    saved = load(last)
    batches = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]
    assert saved["global_step"] == 2 and batches["ready"] == 6  # no batch of a step left half-accumulated

    fit_in_process(run, *accumulate, "--ckpt_path", "last")
    fit_in_process(reference, *accumulate)
    log = batch_log(run)
    assert [r["step"] for r in log if r["fit"] != log[0]["fit"]] == [2, 2, 2]
    assert [r["labels"] for r in log] == [r["labels"] for r in batch_log(reference)]
    ours, theirs = load(last), load(reference / "checkpoints" / "last.ckpt")
    assert ours["global_step"] == theirs["global_step"] == 3
    assert max((ours["state_dict"][k] - v).abs().max().item() for k, v in theirs["state_dict"].items()) <= 1e-6


@pytest.mark.slow
def test_sigterm_without_checkpointing_stops_after_the_batch_and_saves_nothing(tmp_path, capsys):
    """`trainer.enable_checkpointing: false` (and so no ModelCheckpoint, which the config lists): the run stops
    after the batch the signal came in, writes no checkpoint file, and still exits with status 143."""
    run = tmp_path / "run"
    err = stopped_in_process(
        capsys,
        run,
        "--trainer.enable_checkpointing=false",
        "--trainer.callbacks=[]",
        probe(BatchLog, path=str(run / "batches.jsonl")),
        probe(SigtermAt, batch=1),
    )
    said = "attnlab: SIGTERM at step 2: nothing saved (trainer.enable_checkpointing: false)"
    assert "Traceback" not in err and said in err, err[-3000:]
    assert [r["step"] for r in batch_log(run)] == [0, 1]
    assert not [p for p in run.rglob("*") if "ckpt" in p.name]  # neither a checkpoint nor a partial one
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"


@pytest.mark.slow
def test_resuming_with_another_number_of_processes_warns(ddp_reference, tmp_path):
    """A last.ckpt written by two DDP processes, resumed by one: the run goes on, and says that its sample order
    and random draws will differ from an uninterrupted run."""
    run = tmp_path / "run"
    shutil.copytree(ddp_reference, run)
    assert load(run / "checkpoints" / "last.ckpt")["callbacks"]["ExactResume"]["world_size"] == 2
    warning = (
        "checkpoint was written by 2 processes, this run has 1: "
        "the sample order and random streams after resuming differ"
    )
    with pytest.warns(UserWarning, match=warning):
        fit_in_process(run, "--data.init_args.batch_size=32", "--trainer.max_epochs=3", "--ckpt_path", "last")
    assert load(run / "checkpoints" / "last.ckpt")["global_step"] == 15
