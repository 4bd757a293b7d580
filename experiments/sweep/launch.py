"""Launchers: each run is `attnlab fit` in a subprocess (`spawn`), here (local, up to max_parallel at once), as a
submitit job (SLURM) or as a W&B agent's run; each records the run's state in the status file as it ends."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from experiments.sweep.file import SweepError
from experiments.sweep.runs import Run, Sweep, slurm_executor
from experiments.sweep.status import plan, update

LOG = "sweep.log"
INTERRUPTED = 143  # what attnlab fit exits with after SIGTERM (last.ckpt saved)


def spawn(command: list[str], env: dict[str, str], log: Path, own_session: bool = False) -> subprocess.Popen:
    """Start ``command`` with ``env`` added to this environment, its output appended to ``log``. ``own_session``: a
    Ctrl-C in the terminal reaches this process only, which stops the child as it chooses (SIGTERM: a fit saves last.ckpt)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as out:
        out.write(f"\n$ {shlex.join(command)}\n")
        out.flush()
        env = {**os.environ, **env}
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=own_session)


def error_line(log: Path, code: int) -> str:
    """The line that says why a run stopped: attnlab's own error, else the exception that ended the traceback."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        lines = []
    own = [line for line in lines if line.startswith("attnlab: error:")]
    raised = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", line)]
    if own or raised:
        return (own or raised)[-1]
    return f"exit status {code}" + (f": {lines[-1]}" if lines else "")


def execute(command: list[str], folder: str, env: dict[str, str]) -> int:
    """Run one `attnlab fit` to its end (a SLURM job's or a W&B agent's work); its exit status."""
    return spawn(command, env, Path(folder) / LOG).wait()


def _ended(sweep: Sweep, run: Run, code: int, error: str | None = None) -> str:
    """Record how the run ended; ``error``: why, when its log cannot say (default: the log's `error_line`)."""
    error = error or (error_line(run.folder / LOG, code) if code else None)
    state = "done" if code == 0 else "interrupted" if code in (INTERRUPTED, -signal.SIGTERM) else "failed"
    update(
        sweep.root, run.name, status=state, returncode=code, error=error, finished=time.strftime("%Y-%m-%dT%H:%M:%S")
    )
    print(f"attnlab: sweep: {run.name} {state}" + (f": {error}" if state == "failed" else ""), flush=True)
    return state


def _started(sweep: Sweep, run: Run, how: str, **fields: Any) -> None:
    update(sweep.root, run.name, status="running", error=None, started=time.strftime("%Y-%m-%dT%H:%M:%S"), **fields)
    print(f"attnlab: sweep: {run.name} started ({how})", flush=True)


def _gpus() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g for g in visible.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def cpu_threads(max_parallel: int) -> dict[str, str]:
    """On the CPU, runs at once share its cores as torchrun's processes do: each gets OMP_NUM_THREADS = cores //
    max_parallel (at least 1), unless the environment sets it. Otherwise each run's torch takes every core, and the
    runs slow each other down."""
    if max_parallel == 1 or "OMP_NUM_THREADS" in os.environ:
        return {}
    affinity = getattr(os, "sched_getaffinity", None)  # Linux only; elsewhere every core counts
    cores = len(affinity(0)) if affinity else os.cpu_count() or 1
    return {"OMP_NUM_THREADS": str(max(1, cores // max_parallel))}


def launch_local(sweep: Sweep, todo: list[tuple[Run, str]]) -> int:
    """Up to max_parallel runs at once (one GPU each when there are GPUs, else a share of the cores each);
    SIGTERM or Ctrl-C stops them all cleanly."""
    gpus = _gpus()
    free: list[str | None] = gpus[: sweep.max_parallel] if gpus else [None] * sweep.max_parallel
    threads = {} if gpus else cpu_threads(sweep.max_parallel)
    queue, running = list(todo), {}
    stop: list[int] = []

    def interrupt(signum, frame):
        stop.append(signum)
        for proc, _, _ in running.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)

    handlers = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while queue or running:
            while queue and free and not stop:
                run, how = queue.pop(0)
                gpu = free.pop(0)
                env = {**threads, **sweep.env(run), **({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {})}
                proc = spawn(sweep.command(run), env, run.folder / LOG, own_session=True)
                running[run.name] = (proc, run, gpu)
                if stop:  # the signal came while the run started, before the handler could reach it
                    os.killpg(proc.pid, signal.SIGTERM)
                _started(sweep, run, how, gpu=gpu)
            time.sleep(0.2)
            for name, (proc, run, gpu) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[name]
                free.append(gpu)
                _ended(sweep, run, INTERRUPTED if stop and proc.returncode else proc.returncode)
            if stop and not running:
                break
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    if stop:
        print(f"attnlab: sweep stopped by signal {stop[0]}; run it again to resume", file=sys.stderr)
        return 128 + stop[0]
    return 0


def launch_slurm(sweep: Sweep, todo: list[tuple[Run, str]]) -> int:
    """One submitit job per run (an array job on SLURM); waits for them and records each as it ends."""
    import submitit

    executor = slurm_executor(sweep, sweep.root / "submitit")
    with executor.batch():
        jobs = [executor.submit(execute, sweep.command(run), str(run.folder), sweep.env(run)) for run, _ in todo]
    by_job = {}
    for (run, how), job in zip(todo, jobs):
        _started(sweep, run, how, job_id=str(job.job_id))
        by_job[str(job.job_id)] = run
    for job in submitit.helpers.as_completed(jobs, poll_frequency=1):
        run = by_job[str(job.job_id)]
        try:
            code, error = job.result(), None
        except Exception as err:  # the job itself failed (node failure, time limit): submitit's last line says why
            code, error = 1, str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        _ended(sweep, run, code, error)
    return 0


def wandb_sweep_config(sweep: Sweep, todo: list[tuple[Run, str]]) -> dict[str, Any]:
    """A W&B grid sweep over the names of the runs still to do; its agents call back `attnlab sweep ... --agent`."""
    attnlab = ["${env}", sys.executable, "-m", "experiments.cli"]  # W&B puts the environment in ${env}
    agent = ["sweep", str(sweep.file), "--root", str(sweep.root), "--agent", "${args}"]  # ${args}: --run=NAME
    return {
        "name": sweep.name,
        "method": "grid",
        "parameters": {"run": {"values": [run.name for run, _ in todo]}},
        "command": [*attnlab, *agent, *(["--", *sweep.extra] if sweep.extra else [])],
    }


def launch_wandb(sweep: Sweep, todo: list[tuple[Run, str]]) -> int:
    import wandb

    project, entity = sweep.wandb.project, sweep.wandb.entity
    sweep_id = wandb.sweep(wandb_sweep_config(sweep, todo), project=project, entity=entity)
    path = "/".join(p for p in (entity, project, sweep_id) if p)
    update(sweep.root, wandb_sweep=path)
    print(f"attnlab: W&B sweep {path}; more agents: `wandb agent {path}` on other machines", flush=True)
    gpus = _gpus()
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "wandb", "agent", path],
            env={**os.environ, **({"CUDA_VISIBLE_DEVICES": gpus[i]} if gpus else {})},
        )
        for i in range(min(sweep.max_parallel, len(gpus) or sweep.max_parallel, len(todo)))
    ]
    return max(agent.wait() for agent in agents)


def run_agent(sweep: Sweep, name: str) -> int:
    """What a W&B agent runs: one run of the sweep, by name, with its settings as `attnlab fit` arguments."""
    runs = {run.name: (run, how) for run, how in plan(sweep)}
    if name not in runs:
        raise SweepError(f"{sweep.file}: --run: {name!r} is not a run of this sweep")
    run, how = runs[name]
    if how == "done":
        print(f"attnlab: sweep: {name} is done, skipped")
        return 0
    _started(sweep, run, how)
    code = execute(sweep.command(run), str(run.folder), sweep.env(run))
    _ended(sweep, run, code)
    return code


LAUNCH = {"local": launch_local, "slurm": launch_slurm, "wandb": launch_wandb}
