"""One causal self-attention layer at long context, forward + backward: extra peak memory and time of every
normalisation and position bias, on the full path (the (B, H, L, L) weights and the merged mask held whole: the code
before the chunked path, reproduced by an unbounded ``attention.memory_budget_mib``) and on the chunked path (the
default budget), each case in a fresh process (`benchmarks.harness`: VmHWM over the step, glibc's mmap threshold at
64 KiB; CPU time of the one step after a warm-up at L = 256).

    python -m benchmarks.long_context --lengths 1024 2048 4096 8192 16384 > runs/long_context.md
    python -m benchmarks.long_context --device cuda --lengths 8192 16384 32768   # the GPU rows (benchmarks.gpu_check)

D = 256, 8 heads, batch 1, one thread. The full path is skipped where its weights alone would pass ``--full-cap-gib``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
from torch import nn

from benchmarks.harness import REPO_ROOT, step_peak_mib
from models.core.attention import AttentionConfig, MultiHeadAttention
from models.core.position import ALiBi, T5RelativePositionBias

D, HEADS = 256, 8
FULL, CHUNKED = 1e9, AttentionConfig().memory_budget_mib  # MiB


class OwnSoftmax(nn.Module):
    """A normalisation of one's own: softmax written out, exp(s - max) / Σ exp(s - max), on the reference path."""

    def forward(self, scores, blocked):
        e = (scores - scores.amax(-1, keepdim=True)).exp()
        return e / e.sum(-1, keepdim=True)


VARIANTS = {
    "softmax (SDPA)": ({}, None),
    "sigmoid": (dict(normalization="sigmoid"), None),
    "clipped": (dict(normalization="clipped"), None),
    "a class of one's own": (dict(normalization=f"{__name__}.OwnSoftmax"), None),
    "ALiBi": ({}, "alibi"),
    "T5": ({}, "t5"),
    "window 256": (dict(window=256), None),
}


def _case(variant: str, length: int, budget: float, device: torch.device):
    block, bias = VARIANTS[variant]
    torch.manual_seed(0)
    mha = MultiHeadAttention(D, HEADS, attention=AttentionConfig(memory_budget_mib=budget, **block)).to(device)
    positions = {"alibi": ALiBi(HEADS), "t5": T5RelativePositionBias(HEADS, bidirectional=False)}.get(bias)
    positions = positions.to(device) if positions is not None else None

    def step(n: int = length) -> None:
        x = torch.randn(1, n, D, device=device, requires_grad=True)
        call = {"position_bias": positions.lazy(n, n)} if positions is not None else {}
        out, _ = mha(x, is_causal=True, **call)
        out.sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return step


def probe(variant: str, length: int, budget: float, device: str) -> dict:
    """In this process: one warm-up step at L = 256, then the step at ``length``: its extra peak and seconds."""
    step, dev = _case(variant, length, budget, torch.device(device)), torch.device(device)
    step(256)
    clock = time.perf_counter if dev.type == "cuda" else time.process_time
    start = clock()
    peak = step_peak_mib(step, dev)
    return {"peak_mib": peak, "seconds": clock() - start}


def _measured(variant: str, length: int, budget: float, device: str, in_process: bool) -> dict | None:
    """`probe` in a fresh process on the CPU (its resident set is the measure); in this one on a GPU, whose allocator
    counts its own peak, or where ``in_process`` (a rehearsal's toy sizes)."""
    if in_process:
        try:
            return probe(variant, length, budget, device)
        except torch.OutOfMemoryError:  # the full path past the GPU's memory
            torch.cuda.empty_cache()
            return None
    return in_fresh_process("benchmarks.long_context", variant, str(length), str(budget), device)


def in_fresh_process(module: str, *probe: str) -> dict | None:
    """``python -m MODULE --probe PROBE...`` on one thread with glibc's mmap threshold at 64 KiB: the JSON its last
    line prints, or None (and why, on standard error) when it fails."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", module, "--probe", *probe],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=3000,
    )
    if done.returncode != 0:
        print(f"{' '.join(probe)}: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cell(result: dict | None) -> str:
    return "-" if result is None else f"{result['peak_mib']:,.0f} MB / {result['seconds']:.2f} s"


def table(
    lengths: list[int], device: str, full_cap_gib: float, in_process: bool | None = None, variants=tuple(VARIANTS)
) -> str:
    """The markdown table: a row per variant and length, full path and chunked path side by side."""
    in_process = device != "cpu" if in_process is None else in_process
    rows = [
        "| variant | L | full path (before) | chunked path (after) | memory after / softmax |",
        "|---|---|---|---|---|",
    ]
    for length in lengths:
        softmax = None
        for variant in ("softmax (SDPA)", *(v for v in variants if v != "softmax (SDPA)")):
            weights_gib = HEADS * length * length * 4 / 2**30
            full = _measured(variant, length, FULL, device, in_process) if weights_gib <= full_cap_gib else None
            chunked = _measured(variant, length, CHUNKED, device, in_process)
            softmax = chunked if variant == "softmax (SDPA)" else softmax
            known = chunked and softmax and softmax["peak_mib"] > 0  # in-process on the CPU a reused heap shows 0
            ratio = f"{chunked['peak_mib'] / softmax['peak_mib']:.2f}x" if known else "-"
            rows.append(f"| {variant} | {length:,} | {_cell(full)} | {_cell(chunked)} | {ratio} |")
            print(rows[-1], file=sys.stderr, flush=True)
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--full-cap-gib", type=float, default=2.5, help="skip the full path above these weights")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), metavar="VARIANT")
    parser.add_argument("--probe", nargs=4, metavar=("VARIANT", "L", "BUDGET", "DEVICE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        torch.set_num_threads(1)
        variant, length, budget, device = args.probe
        print(json.dumps(probe(variant, int(length), float(budget), device)))
        return
    print(table(args.lengths, args.device, args.full_cap_gib, variants=args.variants))


if __name__ == "__main__":
    main()
