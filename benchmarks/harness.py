"""Measuring for `python -m benchmarks`: interleaved timing, peak memory in a fresh process, the
machine's description, a bare Trainer (and the quiet one it is built on, which the tests use).

Timing. Every side of a comparison runs in the same process, interleaved (A B, B A, A B, ...: the
order alternates so that neither side always runs right after the other), after warm-up steps;
each sample is one or more steps (as many as make a sample last ``min_sample_s``). A comparison
reports the median time of each side, the ratio of the medians, and the spread as the 25th-75th
percentiles of the per-round ratios (round i: side A's sample i over side B's sample i, taken
seconds apart, so the load of the machine mostly cancels). On the CPU the clock is the process's
CPU time (`time.process_time`): on a machine shared with other jobs it leaves out the time the
process waits for a core, which wall time does not; the wall-clock ratio is reported beside it.
On a GPU the clock is wall time after `torch.cuda.synchronize`.

Peak memory. CPU: the step runs in a fresh Python process (``python -m benchmarks
--memory-probe KEY SIDE``) that builds the case, runs warm-up steps (so gradients and optimiser
state exist), resets the kernel's resident-set high-water mark (``/proc/self/clear_refs``), runs
one step and reports VmHWM minus the resident set before the step: the memory the step itself
needs on top of the weights, gradients and optimiser state it keeps. glibc's mmap threshold is
fixed at 64 KiB (``MALLOC_MMAP_THRESHOLD_``) so freed tensors return to the system at once and the
resident set follows the live tensors. GPU: ``torch.cuda.max_memory_allocated`` over the step
minus the memory allocated before it.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import pytorch_lightning as pl

Step = Callable[[], object]
REPO_ROOT = Path(__file__).resolve().parents[1]  # `python -m benchmarks` runs from here: it is not installed


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device) -> Callable[[], float]:
    """The timer: process CPU time on the CPU (robust to a shared machine), wall time on a GPU."""
    return time.perf_counter if device.type == "cuda" else time.process_time


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolated quantile of ``values`` (q in [0, 1])."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Timing:
    """Samples of one side, in seconds per step: ``cpu`` from the case's clock, ``wall`` from the wall clock."""

    cpu: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.cpu)

    @property
    def wall_median(self) -> float:
        return statistics.median(self.wall)


@dataclass
class Ratio:
    """side A / side B: ratio of the medians, the 25th-75th percentiles of the per-round ratios, and
    the ratio of the wall-clock medians."""

    median: float
    p25: float
    p75: float
    wall: float

    @classmethod
    def of(cls, a: Timing, b: Timing) -> Ratio:
        rounds = [x / y for x, y in zip(a.cpu, b.cpu)]
        return cls(a.median / b.median, quantile(rounds, 0.25), quantile(rounds, 0.75), a.wall_median / b.wall_median)

    def __str__(self) -> str:
        return f"{self.median:.2f} [{self.p25:.2f}-{self.p75:.2f}]"


def _steps_per_sample(step: Step, device: torch.device, min_sample_s: float) -> int:
    synchronize(device)
    tick = clock(device)
    start = tick()
    step()
    synchronize(device)
    once = max(tick() - start, 1e-6)
    return max(1, round(min_sample_s / once))


def interleaved(
    steps: dict[str, Step], device: torch.device, *, repeats: int, warmup: int, min_sample_s: float
) -> dict[str, Timing]:
    """Time every side of ``steps`` in alternating order; returns side -> Timing (seconds per step)."""
    names = list(steps)
    for name in names:
        for _ in range(warmup):
            steps[name]()
    numbers = {name: _steps_per_sample(steps[name], device, min_sample_s) for name in names}
    tick = clock(device)
    result = {name: Timing() for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            synchronize(device)
            wall, start = time.perf_counter(), tick()
            for _ in range(numbers[name]):
                steps[name]()
            synchronize(device)
            result[name].cpu.append((tick() - start) / numbers[name])
            result[name].wall.append((time.perf_counter() - wall) / numbers[name])
    return result


# ----------------------------------------------------------------------------- memory


def _proc_status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field_name}")


def step_peak_mib(step: Step, device: torch.device) -> float:
    """Memory one call of ``step`` needs above what was resident before it, in MiB (see the module doc)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    before = _proc_status_kib("VmRSS")
    step()
    return (_proc_status_kib("VmHWM") - before) / 1024


def measure_in_subprocess(key: str, side: str, argv: list[str], timeout_s: float = 900) -> float | None:
    """Run ``--memory-probe KEY SIDE`` in a fresh interpreter; its last stdout line is JSON with ``peak_mib``.

    Returns None (and prints why to stderr) when the probe fails, so one failing case does not end a run.
    """
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, "-m", "benchmarks", "--memory-probe", key, side, *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s, cwd=REPO_ROOT)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        print(
            f"memory probe {key}/{side} failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:] or ''}",
            file=sys.stderr,
        )
        return None
    return float(json.loads(lines[-1])["peak_mib"])


# ----------------------------------------------------------------------------- the machine


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine(device: torch.device) -> dict[str, str]:
    """What the figures were measured on: hardware, software versions, threads, load."""
    info = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU: {cpu_model()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": str(torch.get_num_threads()),
        "load average at start": " ".join(f"{x:.1f}" for x in os.getloadavg()),
    }
    for package in ("timm", "transformers"):
        try:
            info[package] = __import__(package).__version__
        except ImportError:
            info[package] = "not installed"
    return info


def quiet_trainer(**options: Any) -> pl.Trainer:
    """A `pl.Trainer` that logs, saves and prints nothing of its own (no logger, checkpoint, progress bar or model
    summary); ``options`` add to these or replace them. The base of `bare_trainer`, and the tests' Trainer."""
    import pytorch_lightning as pl

    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return pl.Trainer(**quiet | options)


def bare_trainer(accelerator: str, root: str, **options: Any) -> pl.Trainer:
    """A `quiet_trainer` on one device that adds nothing of its own to a step (no validation either), so that what
    is timed is the loop and ``options`` (``max_steps``, callbacks)."""
    return quiet_trainer(
        accelerator=accelerator,
        devices=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=root,
        **options,
    )
