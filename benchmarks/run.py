"""Speed and memory of every attnlab model against its best-known peer, measured side by side.

    python -m benchmarks                       # everything, appended to benchmarks/history/DATE-benchmark.md
    python -m benchmarks --only attention,vit  # some sections
    python -m benchmarks --quick --output -    # smallest shapes, print only (smoke test)

Run it from the repository root (``benchmarks`` is not part of the installed package).

Sections (``--only``):
    core       the core's attention function vs F.scaled_dot_product_attention on the same projected tensors
    attention  our MultiHeadAttention vs the minimal SDPA layer and nn.MultiheadAttention, L = 64, 256, 1024
    vit        ViT training step vs timm's VisionTransformer (vit_tiny, vit_small shapes)
    text       translation training step vs the same model on torch.nn.Transformer (tokens/s)
    decoding   beam search (beam 5, 64 sentences) and greedy decoding with vs without the key/value cache; beam 5
               on the static cache vs the dynamic one (the multi30k_en_de model, 64 sentences)
    detr       DETR training step vs Hugging Face's DetrForObjectDetection (R50-sized and small);
               share of the step spent in Hungarian matching
    scaling    our step time, memory and attention share as sequence length / image size / queries grow
    data       each experiment config's DataModule alone vs its training step vs the real fit
    padding    padded batches by each of our attention's padding paths (masked SDPA, varlen_attn, NJT SDPA:
               `models.padding_free`) vs no mask, and in the Multi30k training step vs nn.Transformer: only with CUDA
    gpu        ViT-B/16 model FLOPs utilisation (bf16), SDPA kernel checks, decoding on the static cache with
               CUDA graphs vs the dynamic cache (beam 5 and greedy, 64 and 1014 sentences), and the padding rows:
               only with CUDA

Every comparison uses the same shapes, precision, optimiser (AdamW) and loss on both sides, and the
same weights where the layouts allow it; see `benchmarks.harness` for how time and memory
are measured. The report (a Markdown section with the exact command, the machine and the tables)
is printed and appended to ``--output``; the file is never overwritten. Figures that supersede those
in benchmarks/RESULTS.md (one current table per subject) replace them there by hand.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch

from benchmarks import peers, scaling
from benchmarks.harness import Ratio, Timing, interleaved, machine, markdown_table, measure_in_subprocess, step_peak_mib
from experiments.cli import hub_offline_unless_asked
from models import attention

SECTIONS = ("core", "attention", "vit", "text", "decoding", "detr", "scaling", "data", "padding", "gpu")
PADDED_LENGTHS, QUICK_PADDED_LENGTHS = (64, 256, 1024), (16, 32)
# the variable-length kernels the padding-free path calls without SDPA -> (SDPA's kernel that calls the same op
# inside, short name): the op ran padding-free when it ran more often than that SDPA kernel
VARLEN_KERNELS = {
    "aten::_flash_attention_forward": ("aten::_scaled_dot_product_flash_attention", "flash varlen"),
    "aten::_efficient_attention_forward": ("aten::_scaled_dot_product_efficient_attention", "memory-efficient varlen"),
    "aten::_cudnn_attention_forward": ("aten::_scaled_dot_product_cudnn_attention", "cuDNN varlen"),
}
DATA_CONFIGS = ("configs/vision/digits.yaml", "configs/text/toy_en_de.yaml", "configs/detection/shapes.yaml")


@dataclass(frozen=True)
class Case:
    """One benchmark row group. ``targets``: peer side -> the largest acceptable ratio ours/peer of
    step time (None: no target, reported only). A case without targets measures ours alone."""

    key: str
    section: str
    label: str
    build: Callable[[peers.Settings], peers.Bench]
    targets: dict[str, float | None] = field(default_factory=dict)


def cases(quick: bool) -> list[Case]:
    """Every case, in report order; keys are stable so a memory probe in a fresh process finds its case."""
    out = []
    for length in (16, 32) if quick else (64, 256, 1024):
        for masked in (False, True):
            out.append(
                Case(
                    f"core/L={length}/{'padded' if masked else 'full'}",
                    "core",
                    f"L={length}" + (", key padding" if masked else ""),
                    partial(peers.core_bench, length, masked),
                    {"sdpa": 1.05},
                )
            )
            out.append(
                Case(
                    f"attention/L={length}/{'padded' if masked else 'full'}",
                    "attention",
                    f"L={length}" + (", key padding" if masked else ""),
                    partial(peers.attention_bench, length, masked),
                    {"sdpa": 1.05, "nn.MHA": 1.0},
                )
            )
    for name in ("vit_tiny", "vit_small"):
        out.append(Case(f"vit/{name}", "vit", name, partial(peers.vit_bench, name), {"timm": 1.0}))
    out.append(
        Case(
            "vit/vit_dispatch",
            "vit",
            "vit_dispatch (tiny tensors)",
            partial(peers.vit_bench, "vit_dispatch", batch=2),
            {"timm": 1.0},
        )
    )
    for size in ("small", "base"):
        out.append(
            Case(f"text/{size}", "text", f"seq2seq {size}", partial(peers.seq2seq_bench, size), {"nn.Transformer": 1.0})
        )
    out.append(
        Case(
            "decoding/beam", "decoding", "beam search, beam 5", partial(peers.decoding_bench, "beam"), {"no cache": 0.2}
        )
    )
    out.append(
        Case("decoding/greedy", "decoding", "greedy", partial(peers.decoding_bench, "greedy"), {"no cache": None})
    )
    out.append(static_cache_case("beam", 64))
    for size in ("small", "r50"):
        out.append(Case(f"detr/{size}", "detr", f"DETR {size}", partial(peers.detr_bench, size), {"HF DETR": 1.0}))
    for shape in peers.MATCHING_SHAPES:
        out.append(
            Case(
                f"detr/matching/{shape}",
                "detr",
                f"matching, {shape}",
                partial(peers.matching_bench, shape),
                {"HF matcher": 1.0},
            )
        )
    out.append(Case("scaling/text", "scaling", "text", scaling.text_scaling_bench))
    out.append(Case("scaling/vit", "scaling", "ViT tiny", scaling.vit_scaling_bench))
    out.append(Case("scaling/detr", "scaling", "DETR small", scaling.detr_scaling_bench))
    return out


def static_cache_case(search: str, sentences: int, prefix: str = "decoding") -> Case:
    """Decoding on the static cache (a CUDA graph per step on CUDA) vs the dynamic cache, Multi30k-shaped; a
    decoding case (timed without profiling) also where the gpu section runs it."""
    label = f"{'beam 5' if search == 'beam' else 'greedy'}, {sentences} sentences, static cache"
    return Case(
        f"{prefix}/static_cache/{search}/{sentences}",
        "decoding",
        label,
        partial(peers.static_cache_bench, search, sentences),
        {"dynamic cache": None},
    )


# `--only gpu`: the CUDA-graph rows, at the sizes of Multi30k's validation (64 sentences, the whole val set)
GPU_DECODING = (("beam", 64), ("beam", 1014), ("greedy", 1014))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--only", default=",".join(s for s in SECTIONS), help=f"comma-separated sections: {', '.join(SECTIONS)}"
    )
    p.add_argument("--quick", action="store_true", help="smallest shapes, few repeats: a smoke test, not a measurement")
    p.add_argument("--repeats", type=int, help="timed samples per side (default 10; 2 with --quick)")
    p.add_argument("--warmup", type=int, help="untimed steps per side first (default 2; 1 with --quick)")
    p.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (default 1: fairest on a shared machine)"
    )
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--amp", choices=("auto", "on", "off"), default="auto", help="bf16 autocast (auto: on with CUDA)")
    p.add_argument(
        "--compile",
        choices=("auto", "on", "off", "both"),
        default="auto",
        help="torch.compile both sides (auto: both = off and on with CUDA, off on CPU)",
    )
    p.add_argument(
        "--channels-last",
        choices=("auto", "on", "off"),
        default="auto",
        help="DETR backbones and images channels-last (auto: on with CUDA)",
    )
    p.add_argument(
        "--no-memory", dest="memory", action="store_false", help="skip peak-memory probes (each runs a fresh process)"
    )
    p.add_argument("--data-configs", default=",".join(DATA_CONFIGS), help="experiment YAMLs for the data section")
    p.add_argument(
        "--output",
        default=f"benchmarks/history/{datetime.date.today():%Y-%m-%d}-benchmark.md",
        help="Markdown file the report is appended to ('-': print only; default: today's file in benchmarks/history/)",
    )
    p.add_argument("--memory-probe", nargs=2, metavar=("KEY", "SIDE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = set(args.only.split(",")) - set(SECTIONS)
    if unknown:
        p.error(f"--only: unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    args.repeats = args.repeats or (2 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    return args


def settings_of(args: argparse.Namespace) -> peers.Settings:
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if args.device == "cuda" and not cuda:
        raise SystemExit("benchmark: --device cuda but torch.cuda.is_available() is False")
    on = lambda flag: flag == "on" or (flag == "auto" and cuda)  # noqa: E731
    return peers.Settings(
        quick=args.quick,
        device=torch.device("cuda" if cuda else "cpu"),
        amp=on(args.amp),
        compile=args.compile == "on",
        channels_last=on(args.channels_last),
    )


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


def memory_probe(args: argparse.Namespace) -> None:
    """Child process: build one case, warm one side up, print the step's peak memory as JSON."""
    key, side = args.memory_probe
    s = settings_of(args)
    case = next(c for c in cases(s.quick) if c.key == key)
    bench = case.build(s)
    step = bench.steps[side]
    for _ in range(1 if bench.inference else 2):
        step()
    print(json.dumps({"key": key, "side": side, "peak_mib": step_peak_mib(step, s.device)}))


# ----------------------------------------------------------------------------- running the cases


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


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


def attention_kernels(events: list) -> str:
    """Which attention kernels a profiled step ran: SDPA's (`scaling.sdpa_kernels`) and the padding-free path's."""
    counts = collections.Counter(e.key for e in events)
    names = [name for key, name in scaling.SDPA_KERNELS.items() if key in counts]
    names += [name for key, (sdpa, name) in VARLEN_KERNELS.items() if counts.get(key, 0) > counts.get(sdpa, 0)]
    return ", ".join(names) or "none"


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


def padding_report(s: peers.Settings, args: argparse.Namespace) -> str:
    """Issue 28's rows: padded self-attention by each padding path against the same layer without a mask, and
    the Multi30k-shaped training step by each path against nn.Transformer, on the same padded batches."""
    benches = [
        (f"self-attention, L={n}", "no mask", partial(peers.padded_attention_bench, n))
        for n in (QUICK_PADDED_LENGTHS if s.quick else PADDED_LENGTHS)
    ] + [(f"Multi30k step, dropout {p}", "nn.Transformer", partial(peers.padded_seq2seq_bench, p)) for p in (0.3, 0.0)]
    rows, checks = [], []
    for label, reference, build in benches:
        log(f"gpu: padded batches, {label}")
        bench = build(s)
        timings = interleaved(
            bench.steps, s.device, repeats=args.repeats, warmup=args.warmup, min_sample_s=0.01 if s.quick else 0.2
        )
        for side, timing in timings.items():
            rows.append(
                [
                    label,
                    side,
                    f"{timing.median * 1e3:,.2f}",
                    str(Ratio.of(timing, timings[reference])),
                    fmt_rate(bench.items, timing.median, bench.unit),
                    attention_kernels(scaling.profile_step(bench.steps[side])),
                ]
            )
        checks.append(f"- {label}: {bench.check}")
    header = ["case", "side", "ms", "time / reference [p25-p75]", "valid tokens/s", "attention kernels"]
    return (
        f"### Padded batches: our attention's padding paths ({'bf16 autocast' if s.amp else 'fp32'}; issue 28)\n\n"
        "Self-attention: D=256, 8 heads, B·L = 4096, lengths uniform in [L/2, L], forward + backward, against "
        "the same layer unmasked at the padded length ('no mask', the reference). Multi30k step: the model of "
        "configs/text/multi30k_en_de.yaml, 128 sentences of 8-32 tokens, against nn.Transformer (the reference); "
        "with dropout, varlen_attn (it has none) is not a side. The default path on CUDA: "
        f"`models.attention.PADDING_FREE['cuda'] = {attention.PADDING_FREE.get('cuda')!r}`.\n\n"
        + markdown_table(header, rows)
        + "\n\nChecks:\n"
        + "\n".join(checks)
    )


# ----------------------------------------------------------------------------- the report

SECTION_TITLES = {
    "core": "Shared attention core, function level: merge_masks + attention_fast vs F.scaled_dot_product_attention on the same "
    "projected (B, 8, L, 32) tensors, forward + backward (B·L = 4096)",
    "attention": "Shared attention core: self-attention forward + backward (D=256, 8 heads, B·L = 4096 tokens)",
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


def run(args: argparse.Namespace) -> str:
    torch.set_num_threads(args.threads)
    hub_offline_unless_asked()
    base = settings_of(args)
    only = args.only.split(",")
    started, wall_start = datetime.datetime.now(), time.perf_counter()
    info = machine(base.device)
    parts: list[str] = []
    skipped: list[str] = []
    variants = [base]
    if args.compile == "both" or (args.compile == "auto" and base.device.type == "cuda"):
        variants.append(replace(base, compile=True))
    elif args.compile == "auto":
        skipped.append(
            "torch.compile: not measured on the CPU (compiling every model on a shared 2-core machine takes minutes; "
            "`--compile on` forces it); with CUDA the ViT and text rows run with it off and on"
        )
    if base.device.type == "cpu":
        skipped.append(
            "bf16 autocast, flash / memory-efficient SDPA kernels on a GPU, channels-last DETR backbone, ViT-B/16 MFU: "
            "no CUDA device here; the same command runs them on a GPU (they are on by default there)"
        )
    all_cases = cases(base.quick)
    for section in [x for x in SECTIONS if x in only]:
        if section == "padding" and base.device.type != "cuda":
            print(
                "benchmark: padding section skipped: no CUDA device (torch.cuda.is_available() is False); "
                "varlen_attn and NJT SDPA's flash kernels are CUDA's, and on the CPU the padding-free path is off "
                "(models.attention.PADDING_FREE)",
                file=sys.stderr,
            )
            continue
        if section == "padding":
            parts.append(padding_report(base, args))
            continue
        if section == "gpu":
            if base.device.type != "cuda":
                print(
                    "benchmark: gpu section skipped: no CUDA device (torch.cuda.is_available() is False) for ViT-B/16 "
                    "MFU, SDPA checks, CUDA-graph decoding and padded batches; varlen_attn and NJT SDPA's flash kernels are "
                    "CUDA's, and on the CPU the padding-free path is off (models.attention.PADDING_FREE)",
                    file=sys.stderr,
                )
                continue
            log("gpu: ViT-B/16 MFU")
            rows = [scaling.vit_b16_mfu(base, compile_model=c, batch=b) for c in (False, True) for b in (64, 256)]
            rows += [
                scaling.vit_b16_mfu(base, compile_model=True, batch=256, side="timm"),
                scaling.vit_b16_mfu(base, compile_model=True, batch=256, precision="bf16 weights"),
            ]
            parts.append(
                "### ViT-B/16 training step, model FLOPs utilisation (fused AdamW)\n\n"
                + markdown_table(list(rows[0]), [list(r.values()) for r in rows])
            )
            parts.append(
                "### SDPA on this GPU: a query row whose keys are all blocked (2 x 4 heads x L x 64)\n\n"
                + markdown_table(
                    ["backend", "dtype", "L", "output of the empty row", "gradients"],
                    scaling.empty_row_rows(base.device),
                )
            )
            log("gpu: decoding on the static cache with CUDA graphs")
            outcomes = [run_case(static_cache_case(*shape, "gpu"), base, args) for shape in GPU_DECODING]
            parts.append(
                f"### {SECTION_TITLES['gpu/decoding']}\n\n{comparison_table(outcomes)}\n\n"
                f"Checks and notes:\n{notes_list(outcomes)}"
            )
            if "padding" not in only:  # else its own section has run them
                parts.append(padding_report(base, args))
            continue
        if section == "data":
            log("data pipeline")
            rows = []
            for config in args.data_configs.split(","):
                if not Path(config).is_file():
                    skipped.append(f"data: {config} does not exist")
                    continue
                rows += scaling.data_pipeline_rows(
                    config, (0,) if base.quick else (0, 2), 3 if base.quick else 30, base.device
                )
            parts.append(
                "### Data pipeline: DataModule alone vs training step (samples/s, wall time)\n\n"
                + markdown_table(
                    [
                        "config",
                        "num_workers",
                        "loader alone",
                        "step alone (batches in memory)",
                        "fit (loader + step)",
                        "model busy",
                    ],
                    rows,
                )
                + "\n\n'model busy' = fit rate / step rate: below 100% the model waits for data. Every DataModule takes "
                "`num_workers`, `persistent_workers` (default on) and `pin_memory` (default: on with CUDA)."
            )
            continue
        for settings in variants if section in ("vit", "text") else [base]:
            chosen = [c for c in all_cases if c.section == section]
            if section == "detr" and not _has_transformers():
                skipped.append(
                    "detr vs Hugging Face: transformers is not installed (`pip install transformers`); ours is measured alone"
                )
            outcomes = [
                run_case(c, settings, args, ("ours", "sdpa", "nn.MHA") if section == "attention" else ("ours",))
                for c in chosen
            ]
            title = SECTION_TITLES[section] + (" (torch.compile on)" if settings.compile and not base.compile else "")
            table = scaling_table(outcomes) if section == "scaling" else comparison_table(outcomes)
            notes = "" if section == "scaling" else f"\n\nChecks and notes:\n{notes_list(outcomes)}"
            parts.append(f"### {title}\n\n{table}{notes}")
    wall = time.perf_counter() - wall_start
    info["load average at end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    command = "python -m benchmarks " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if args.argv is None else args.argv)
    )
    header = [
        f"## Performance against peers (issue #7), {started:%Y-%m-%d %H:%M}"
        + (" [--quick: smoke test, not a measurement]" if base.quick else ""),
        "",
        f"Command: `{command.strip()}` (wall time {wall / 60:.1f} min)",
        "",
        markdown_table(["machine", ""], [[k, v] for k, v in info.items()]),
        "",
        method_text(args, base),
    ]
    if skipped:
        header += ["", "Not measured here:"] + [f"- {x}" for x in skipped]
    return "\n".join(header) + "\n\n" + "\n\n".join(parts) + "\n"


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.argv = argv
    if args.memory_probe:
        torch.set_num_threads(args.threads)
        memory_probe(args)
        return
    report = run(args)
    print(report)
    if args.output != "-":
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        with open(args.output, "a") as f:  # append: other sections of the file belong to others
            f.write("\n" + report)
        log(f"appended to {args.output}")


if __name__ == "__main__":
    main()
