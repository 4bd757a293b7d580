"""The sweep's status file, ``ROOT/sweep.json`` (`experiments.runfolder.SweepStatus`), updated under a lock by
whichever process runs a run, and the plan it gives: which runs are done, which resume, which are new."""

from __future__ import annotations

import contextlib
import fcntl
import shlex
from pathlib import Path
from typing import Any

from experiments.runfolder import SWEEP, SweepRun, SweepStatus, is_finished, newest_checkpoint, run_summary
from experiments.sweep.file import SweepError
from experiments.sweep.runs import Run, Sweep


@contextlib.contextmanager
def lock(path: Path, wait: bool = True):
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise SweepError(f"{path.parent}: another `attnlab sweep` is running this sweep") from None
        yield  # closing the file releases the lock


@contextlib.contextmanager
def edit(root: Path):
    """The status file to change, written back whole at the end, under the lock."""
    with lock(root / f"{SWEEP}.lock"):
        status = SweepStatus.read(root)
        yield status
        status.write(root)


def update(root: Path, run: str | None = None, /, **fields: Any) -> None:
    """Merge ``fields`` into run ``run`` of the status file (into the sweep's own entries when run is None)."""
    with edit(root) as status:
        (status.runs.setdefault(run, SweepRun()) if run else status).update(**fields)


def record(sweep: Sweep) -> None:
    """Write the sweep and every run (new ones as pending) into the status file."""
    with edit(sweep.root) as status:
        status.update(
            file=str(sweep.file),
            name=sweep.name,
            launcher=sweep.launcher,
            seeds=sweep.seeds,
            configs={Path(c).stem: {"config": c, "grid": g} for c, g in sweep.configs},
        )
        for run in sweep.runs():
            status.runs.setdefault(run.name, SweepRun(status="pending")).update(
                config=run.config,
                cell=run.cell,
                cell_name=run.cell_name,
                seed=run.seed,
                folder=str(run.folder),
                command=shlex.join(sweep.command(run)),
            )


def plan(sweep: Sweep) -> list[tuple[Run, str]]:
    """(run, what happens): "done" (skipped), "resume from <last.ckpt>" or "new"."""
    known = SweepStatus.read(sweep.root).runs
    out = []
    for run in sweep.runs():
        if (run.name in known and known[run.name].status == "done") or is_finished(run.folder):
            out.append((run, "done"))
            continue
        last = newest_checkpoint(run.folder, "last")
        out.append((run, f"resume from {last}" if last else "new"))
    return out


def states(sweep: Sweep) -> list[tuple[Run, str]]:
    """(run, its state): pending, done, failed or interrupted as the status file has it; a run it calls running is
    what its run folder's summary.json says now (running, or killed or stale when its process is gone:
    `experiments.runfolder.Summary.state`)."""
    known = SweepStatus.read(sweep.root).runs
    out = []
    for run in sweep.runs():
        state = (known.get(run.name) or SweepRun()).status or "pending"
        summary = run_summary(run.folder) if state == "running" else None
        if state != "done" and is_finished(run.folder):
            state = "done"
        elif summary is not None:
            state = summary.state() or state
        out.append((run, state))
    return out
