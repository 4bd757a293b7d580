"""Measuring one case of `python -m benchmarks`: its sides timed interleaved, the attention kernels and share
from the profiler, peak memory (in a fresh process on the CPU), and the checks its builder recorded."""

from __future__ import annotations

import argparse
import collections
import sys
import time
from dataclasses import dataclass, field

from benchmarks import peers, scaling
from benchmarks.cases import Case
from benchmarks.harness import Timing, interleaved, measure_in_subprocess, step_peak_mib

# the variable-length kernels the padding-free path calls without SDPA -> (SDPA's kernel that calls the same op
# inside, short name): the op ran padding-free when it ran more often than that SDPA kernel
VARLEN_KERNELS = {
    "aten::_flash_attention_forward": ("aten::_scaled_dot_product_flash_attention", "flash varlen"),
    "aten::_efficient_attention_forward": ("aten::_scaled_dot_product_efficient_attention", "memory-efficient varlen"),
    "aten::_cudnn_attention_forward": ("aten::_scaled_dot_product_cudnn_attention", "cuDNN varlen"),
}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def attention_kernels(events: list) -> str:
    """Which attention kernels a profiled step ran: SDPA's (`scaling.sdpa_kernels`) and the padding-free path's."""
    counts = collections.Counter(e.key for e in events)
    names = [name for key, name in scaling.SDPA_KERNELS.items() if key in counts]
    names += [name for key, (sdpa, name) in VARLEN_KERNELS.items() if counts.get(key, 0) > counts.get(sdpa, 0)]
    return ", ".join(names) or "none"


def probe_argv(args: argparse.Namespace, s: peers.Settings) -> list[str]:
    """The flags a memory probe needs to rebuild the same case."""
    return (["--quick"] if s.quick else []) + [
        "--threads",
        str(args.threads),
        "--device",
        s.device.type,
        "--amp",
        "on" if s.amp else "off",
        "--channels-last",
        "on" if s.channels_last else "off",
        "--compile",
        "on" if s.compile else "off",
    ]


@dataclass
class Outcome:
    case: Case
    bench: peers.Bench
    timings: dict[str, Timing]
    memory: dict[str, float | None]
    kernels: dict[str, str]
    notes: list[str]
    shares: dict[str, float] = field(default_factory=dict)
    extra_figures: dict[str, dict[str, str]] = field(default_factory=dict)


def run_case(
    case: Case, s: peers.Settings, args: argparse.Namespace, profile_sides: tuple[str, ...] = ("ours",)
) -> Outcome:
    log(f"{case.key}: building")
    bench = case.build(s)
    repeats = bench.repeats or args.repeats
    if not case.targets:
        repeats = max(2, repeats // 2)  # scaling: many sides (points), fewer rounds suffice
    log(f"{case.key}: timing {', '.join(bench.steps)} x {repeats}")
    timings = interleaved(
        bench.steps, s.device, repeats=repeats, warmup=args.warmup, min_sample_s=0.01 if s.quick else 0.2
    )
    notes = [bench.check] if bench.check else []
    extra_figures = {side: extra() for side, extra in bench.extra.items()}
    for side, figures in extra_figures.items():
        notes += [f"{side}: {k} {v}" for k, v in figures.items()]
    kernels, shares = {}, {}
    if case.section != "decoding":
        for side in [p for p in profile_sides if p in bench.steps] if case.targets else bench.steps:
            events = scaling.profile_step(bench.steps[side])
            kernels[side] = attention_kernels(events)
            shares[side] = scaling.attention_share(events)
        if (
            s.device.type == "cuda" and "ours" in bench.steps and not s.compile
        ):  # under sdpa_kernel a compiled step recompiles
            notes.append("ours, SDPA kernels allowed one at a time: " + scaling.verify_gpu_kernels(bench.steps["ours"]))
    memory: dict[str, float | None] = {}
    if args.memory:
        for side in bench.steps:
            log(f"{case.key}: peak memory of {side}")
            # CUDA's allocator counts exactly what a step allocates, other sides' tensors aside: no fresh process needed
            memory[side] = (
                step_peak_mib(bench.steps[side], s.device)
                if s.device.type == "cuda"
                else measure_in_subprocess(case.key, side, probe_argv(args, s))
            )
    bench.steps, bench.extra = {}, {}  # free the models before the next case
    return Outcome(case, bench, timings, memory, kernels, notes, shares, extra_figures)
