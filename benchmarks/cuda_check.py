"""The CUDA check that torch's optimizers make at every step, with Lightning's NVML-based check and as `attnlab`
sets it up (`experiments.cli.drop_nvml_check_without_a_driver`).

    python -m benchmarks.cuda_check                     # ViT on the digits, plain training steps, the CPU

torch's optimizers ask ``torch.accelerator.current_accelerator(check_available=True)`` at every ``step()`` (their
CUDA-graph capture health check). Lightning sets ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` at import, and on a machine
without an NVIDIA driver that made each asking try to load NVML, fail, and then ask the CUDA runtime. Both
variants run in this one process, in turns, on the plain loop of `benchmarks.overhead` (the digits ViT's model,
data and fused AdamW); the check is timed inside real training steps, where its caches are cold.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import torch

from benchmarks.overhead import TASKS, PlainLoop

VARIANT = "PYTORCH_NVML_BASED_CUDA_CHECK"


def timed_checks(loop: PlainLoop, steps: int) -> list[float]:
    """Seconds of each optimizer step's CUDA check over ``steps`` training steps of ``loop``."""
    times, check = [], torch.optim.Optimizer._accelerator_graph_capture_health_check

    def timed(optimizer):
        start = time.perf_counter()
        check(optimizer)
        times.append(time.perf_counter() - start)

    torch.optim.Optimizer._accelerator_graph_capture_health_check = timed
    try:
        for _ in range(steps):
            batch = next(loop.batches, None)
            if batch is None:
                loop.new_epoch()
                batch = next(loop.batches)
            loop.step(batch)
    finally:
        torch.optim.Optimizer._accelerator_graph_capture_health_check = check
    return times


def main(argv: list[str] | None = None) -> None:
    from experiments.cli import drop_nvml_check_without_a_driver

    parser = argparse.ArgumentParser(prog="python -m benchmarks.cuda_check", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4, help="turns of each variant")
    parser.add_argument("--steps", type=int, default=100, help="training steps a turn (the first 10 not counted)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    loop = PlainLoop(TASKS["vit"], argparse.Namespace(device="cpu", epochs=1, batches=20))
    lightning = os.environ.get(VARIANT)  # as Lightning's import left it
    times: dict[str, list[float]] = {"Lightning's (NVML first)": [], "attnlab's": []}
    try:
        for _ in range(args.repeats):
            for name in times:
                if lightning is None:
                    os.environ.pop(VARIANT, None)
                else:
                    os.environ[VARIANT] = lightning
                if name == "attnlab's":
                    drop_nvml_check_without_a_driver()
                    kept = os.environ.get(VARIANT)
                times[name] += timed_checks(loop, args.steps)[10:]
    finally:
        if lightning is not None:
            os.environ[VARIANT] = lightning
    command = " ".join(["python -m benchmarks.cuda_check", *(argv if argv is not None else sys.argv[1:])])
    print(f"Command: `{command}`  ")
    print(
        f"Date: {datetime.date.today()}, torch {torch.__version__}, CPU ({platform.machine()}, {args.threads} "
        f"thread(s)), load average (1 min) {os.getloadavg()[0]:.2f}; after attnlab's set-up {VARIANT}="
        f"{kept or 'unset'}  \n"
    )
    print("| CUDA check | optimizer steps | mean (us) | median (us) |")
    print("|---|---|---|---|")
    for name, measured in times.items():
        print(
            f"| {name} | {len(measured)} | {statistics.fmean(measured) * 1e6:.1f} | {statistics.median(measured) * 1e6:.1f} |"
        )


if __name__ == "__main__":
    main()
