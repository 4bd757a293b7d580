"""`attnlab` runs in processes of their own that start in a fraction of a second
(`from processes import CLIProcess, torchrun`).

Each process is forked from one interpreter per pytest worker that has imported Lightning, the models and the
callbacks once (multiprocessing's forkserver, preloaded): a new `python -m experiments.cli` spends about 6 s of CPU
on those imports before it trains, 13 s for a run on two processes. The forkserver has run no torch operation, so
its children start with no thread pool (a fork of a process that ran OpenMP code hangs in its first parallel
region). A child gets its own environment, working folder, `sys.argv` and standard streams, and ends as a process
does: its exit handlers run, and its exit status is the CLI's, or minus the signal that killed it.

`torchrun` starts the ranks of a distributed run as torchrun does (one process per rank, rank and rendezvous in the
environment): Lightning's `TorchElasticEnvironment` reads them and starts no process of its own.
"""

import atexit
import multiprocessing
import os
import signal
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# sys.argv[0] of a process that the `attnlab` script started (installed beside this Python by `make install`):
# Lightning's DDP launcher starts the other ranks of `--trainer.devices=N` as `python SCRIPT ARGS`
SCRIPT = str(Path(sys.executable).with_name("attnlab"))
PRELOAD = [
    "experiments.trainer_cli",
    "experiments.callbacks.attention_maps",
    "experiments.callbacks",
    "experiments.callbacks.detection",
    "experiments.callbacks.text",
    "models.detection.module",
    "models.text.translation_module",
    "models.vision.module",
    "datamodules.detection.shapes",
    "datamodules.text.parallel",
    "datamodules.vision.classification",
]


def _cli(args: list[str], env: dict[str, str], out: str, err: str) -> None:
    """The child: `attnlab ARGS` in ``env``, run from the repository root, as the `attnlab` script would start it."""
    import torch

    from experiments.cli import main

    os.environ.clear()
    os.environ.update(env)
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.chdir(ROOT)
    for fd, path in ((1, out), (2, err)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    # a new process reads OMP_NUM_THREADS when torch loads; this one loaded torch before it had its environment
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    sys.argv = [SCRIPT, *args]
    try:
        main(args)
    finally:  # what a process runs at its exit and multiprocessing's children skip: W&B finishes its run there
        atexit._run_exitfuncs()


class CLIProcess:
    """`attnlab ARGS` in a process of its own, in ``env`` (the whole environment, as `subprocess` takes it); its
    standard output and error go to ``folder``/{name}.out and .err."""

    def __init__(self, args: list[str], env: dict[str, str], folder: Path, name: str = "attnlab"):
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)  # read when the worker's forkserver starts, once
        folder.mkdir(parents=True, exist_ok=True)
        self.out, self.err = folder / f"{name}.out", folder / f"{name}.err"
        self.process = context.Process(target=_cli, args=(list(args), dict(env), str(self.out), str(self.err)))
        self.process.start()
        self.pid = self.process.pid

    def wait(self, timeout: float) -> int:
        """The exit status (-N: killed by signal N); on a timeout, SIGKILL and raise TimeoutError."""
        self.process.join(timeout)
        if self.process.exitcode is None:
            self.kill()
            raise TimeoutError(f"{self.err.stem} ran past {timeout} s")
        return self.process.exitcode

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.process.join()

    def poll(self) -> int | None:
        return self.process.exitcode

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def stderr(self) -> str:
        return self.err.read_text()


def torchrun(args: list[str], env: dict[str, str], folder: Path, nprocs: int = 2) -> list[CLIProcess]:
    """`torchrun --nproc-per-node NPROCS -m experiments.cli ARGS` on this machine: rank r's output is
    ``folder``/rank{r}.out and .err. The rendezvous port is a free one, chosen now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = []
    for rank in range(nprocs):
        torchrun_env = dict(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE=str(nprocs),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(nprocs),
            GROUP_RANK="0",
        )
        ranks.append(CLIProcess(args, {**env, **torchrun_env}, folder, name=f"rank{rank}"))
    return ranks


def wait_all(ranks: list[CLIProcess], timeout: float, grace: float = 30) -> list[int]:
    """Every rank's exit status (-N: killed by signal N). As under torchrun, once a rank has failed the others get
    ``grace`` seconds to end, and are killed after: a rank whose peer is gone waits in its next collective until
    gloo's 30-minute timeout. Ranks still running after ``timeout`` with none failed (a hang) are all killed and
    TimeoutError is raised."""
    deadline, failed = time.monotonic() + timeout, False
    while any(rank.poll() is None for rank in ranks):
        if not failed and any(rank.poll() for rank in ranks):  # a status other than None (running) or 0
            failed, deadline = True, min(deadline, time.monotonic() + grace)
        if time.monotonic() > deadline:
            running = [rank for rank in ranks if rank.poll() is None]
            for rank in running:
                rank.kill()
            if not failed:
                raise TimeoutError(f"{', '.join(r.err.stem for r in running)} still running after {timeout} s")
        time.sleep(0.05)
    return [rank.poll() for rank in ranks]
