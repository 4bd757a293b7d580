"""The Markdown of `python -m benchmarks`: the comparison and scaling tables, the checks, each section's
title and the method paragraph."""

from __future__ import annotations

import argparse

from benchmarks import peers
from benchmarks.harness import Ratio
from benchmarks.measure import Outcome
from experiments.compare.tables import markdown_table

SECTION_TITLES = {
    "core": "Shared attention core, function level: merge_masks + attention_fast vs F.scaled_dot_product_attention on the same "
    "projected (B, 8, L, 32) tensors, forward + backward (B·L = 4096)",
    "attention": "Shared attention core: self-attention forward + backward (D=256, 8 heads, B·L = 4096 tokens)",
    "options": "The attention block's options vs plain softmax in the same layer: self-attention forward + backward "
    "(D=256, 8 heads, B·L = 4096 tokens, no mask)",
    "vit": "ViT training step (AdamW) vs timm: timm's shapes (batch 8, 224 px), and the same depth on tiny tensors",
    "text": "Seq2seq training step (random sentences of 16-40 tokens, label smoothing, AdamW) vs torch.nn.Transformer",
    "decoding": "Decoding 64 sentences (d=256, 3+3 layers, vocabulary 8000, 32 tokens, random weights): key/value cache vs none; "
    "static cache vs dynamic (the multi30k_en_de model: d=256, 4+4 layers, vocabulary 10000, max_len 1.5·|source| + 10)",
    "gpu/decoding": "Decoding on the static cache, each step one CUDA graph, vs the dynamic cache (the multi30k_en_de model, "
    "random weights, sources of 6-30 tokens, max_len 1.5·|source| + 10; sentences/s)",
    "detr": "DETR training step (set loss with auxiliary losses, AdamW) vs Hugging Face DetrForObjectDetection, and the "
    "Hungarian matching of one step (every decoder layer) vs Hugging Face's matcher",
    "scaling": "Scaling of our training step",
}


def method_text(args: argparse.Namespace, s: peers.Settings) -> str:
    clock = "process CPU time" if s.device.type == "cpu" else "wall time after torch.cuda.synchronize"
    return (
        f"Method: the sides of a row run in one process, interleaved (A B, B A, ...), after {args.warmup} warm-up steps each; "
        f"{args.repeats} samples per side (3 for decoding, half for scaling points), each sample at least "
        f"{0.01 if s.quick else 0.2} s of steps; clock: {clock}. 'ours ms' and 'peer ms' are medians; the ratio is the ratio of "
        "the medians, with the 25th-75th percentiles of the per-round ratios; 'met': yes when the ratio meets the target, "
        "'within noise' when the 25th percentile does, no otherwise. Peak memory: the extra memory one step needs above what "
        + (
            "is resident before it (VmHWM after resetting it, minus VmRSS), in a fresh process per side, after warm-up steps; "
            if s.device.type == "cpu"
            else "is allocated before it (torch.cuda.max_memory_allocated after resetting it), in the same process after the timed steps; "
        )
        + "'memory met': ours <= peer (+2% + 1 MiB). Precision: "
        + ("bf16 autocast" if s.amp else "fp32")
        + f"; torch.compile {'on' if s.compile else 'off'}; channels-last DETR backbone {'on' if s.channels_last else 'off'}."
    )


def verdict(ratio: Ratio, target: float | None) -> str:
    """yes: the ratio of medians meets the target; no: even the 25th percentile of the per-round ratios
    misses it; within noise: between the two."""
    if target is None:
        return "-"
    if ratio.median <= target:
        return "yes"
    return "no" if ratio.p25 > target else "within noise"


def fmt_rate(items: int, seconds: float, unit: str) -> str:
    return f"{items / seconds:,.0f} {unit}/s" if items else "-"


def fmt_mib(value: float | None) -> str:
    return "-" if value is None else f"{max(value, 0.0):,.0f}"


def comparison_table(outcomes: list[Outcome]) -> str:
    header = [
        "case",
        "peer",
        "ours ms",
        "peer ms",
        "time ours/peer [p25-p75]",
        "wall-clock ratio",
        "target",
        "met",
        "ours throughput",
        "peer throughput",
        "ours MiB",
        "peer MiB",
        "memory met",
        "SDPA kernel (ours)",
    ]
    rows = []
    for o in outcomes:
        ours = o.timings["ours"]
        for peer, target in o.case.targets.items():
            if peer not in o.timings:
                continue
            theirs, ratio = o.timings[peer], Ratio.of(ours, o.timings[peer])
            mem_ours, mem_peer = o.memory.get("ours"), o.memory.get(peer)
            mem_met = (
                "-" if mem_ours is None or mem_peer is None else ("yes" if mem_ours <= mem_peer * 1.02 + 1 else "no")
            )
            rows.append(
                [
                    o.case.label,
                    peer,
                    f"{ours.median * 1e3:,.1f}",
                    f"{theirs.median * 1e3:,.1f}",
                    str(ratio),
                    f"{ratio.wall:.2f}",
                    "-" if target is None else f"<= {target:g}",
                    verdict(ratio, target),
                    fmt_rate(o.bench.items, ours.median, o.bench.unit),
                    fmt_rate(o.bench.items, theirs.median, o.bench.unit),
                    fmt_mib(mem_ours),
                    fmt_mib(mem_peer),
                    mem_met,
                    o.kernels.get("ours", "-"),
                ]
            )
    return markdown_table(header, rows)


def scaling_table(outcomes: list[Outcome]) -> str:
    header = ["model", "point", "shape", "step ms", "throughput", "peak MiB", "attention share", "SDPA kernel", "notes"]
    rows = []
    for o in outcomes:
        for side, timing in o.timings.items():
            t = timing.median
            extra = [f"{k} {v}" for k, v in o.extra_figures.get(side, {}).items()]
            rows.append(
                [
                    o.case.label,
                    side,
                    o.bench.side_info.get(side, "-"),
                    f"{t * 1e3:,.1f}",
                    fmt_rate(o.bench.items, t, o.bench.unit),
                    fmt_mib(o.memory.get(side)),
                    f"{100 * o.shares[side]:.0f}%" if side in o.shares else "-",
                    o.kernels.get(side, "-"),
                    "; ".join(extra) or "-",
                ]
            )
    return markdown_table(header, rows)


def notes_list(outcomes: list[Outcome]) -> str:
    lines = []
    for o in outcomes:
        extra = [n for n in o.notes] + [f"{side} SDPA kernel: {k}" for side, k in o.kernels.items() if side != "ours"]
        if extra:
            lines.append(f"- {o.case.label}: " + "; ".join(extra))
    return "\n".join(lines)
