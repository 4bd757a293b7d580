"""Speed and memory of every attnlab model against its best-known peer, measured side by side.

    python -m benchmarks                       # everything, appended to benchmarks/history/DATE-benchmark.md
    python -m benchmarks --only attention,vit  # some sections
    python -m benchmarks --quick --output -    # smallest shapes, print only (smoke test)

Run it from the repository root (``benchmarks`` is not part of the installed package).

Sections (``--only``):
    core       the core's attention function vs F.scaled_dot_product_attention on the same projected tensors
    attention  our MultiHeadAttention vs the minimal SDPA layer and nn.MultiheadAttention, L = 64, 256, 1024
    options    the attention block's options (softmax1, the gates, clipped, sigmoid) vs plain softmax, L = 64, 256, 1024
    vit        ViT training step vs timm's VisionTransformer (vit_tiny, vit_small shapes)
    text       translation training step vs the same model on torch.nn.Transformer (tokens/s)
    decoding   beam search (beam 5, 64 sentences) and greedy decoding with vs without the key/value cache; beam 5
               on the static cache vs the dynamic one (the multi30k_en_de model, 64 sentences)
    detr       DETR training step vs Hugging Face's DetrForObjectDetection (R50-sized and small);
               share of the step spent in Hungarian matching
    scaling    our step time, memory and attention share as sequence length / image size / queries grow
    data       each experiment config's DataModule alone vs its training step vs the real fit
    padding    padded batches by each of our attention's padding paths (masked SDPA, varlen_attn, NJT SDPA:
               `models.core.padding_free`) vs no mask, and in the Multi30k training step vs nn.Transformer: only with CUDA
    gpu        its parts (``--gpu-parts``): padding (the padding section's rows), decoding on the static cache
               with CUDA graphs vs the dynamic cache (beam 5 and greedy, 64 and 1014 sentences), detr (the DETR
               steps with the share of Hungarian matching), overhead (`attnlab fit` at ViT-S/16, bf16, batch 256),
               mfu (ViT-B/16 model FLOPs utilisation eager, compiled and in float8; SDPA on fully blocked rows) and
               tokens (`attnlab fit`'s tokens/s: Multi30k's recipe by batch_size, max_tokens and max_tokens +
               compile, the LM plain and with packed documents): with CUDA, or with --quick on the CPU as a
               rehearsal (toy sizes; `benchmarks.gpu_check --rehearse`)

Every comparison uses the same shapes, precision, optimiser (AdamW) and loss on both sides, and the
same weights where the layouts allow it; see `benchmarks.harness` for how time and memory
are measured. The report (a Markdown section with the exact command, the machine and the tables)
is printed and appended to ``--output``; the file is never overwritten. Figures that supersede those
in benchmarks/RESULTS.md (one current table per subject) replace them there by hand.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks import peers
from benchmarks.cases import cases
from benchmarks.harness import machine, step_peak_mib
from benchmarks.measure import log
from benchmarks.report import method_text
from benchmarks.sections import GPU_PARTS, case_parts, data_part, gpu_parts, padding_report
from experiments.cli import hub_offline_unless_asked
from experiments.compare.tables import markdown_table

SECTIONS = ("core", "attention", "options", "vit", "text", "decoding", "detr", "scaling", "data", "padding", "gpu")
DATA_CONFIGS = ("configs/vision/digits.yaml", "configs/text/toy_en_de.yaml", "configs/detection/shapes.yaml")


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
    p.add_argument("--gpu-parts", default=",".join(GPU_PARTS), help=f"the gpu section's parts: {', '.join(GPU_PARTS)}")
    p.add_argument("--data-configs", default=",".join(DATA_CONFIGS), help="experiment YAMLs for the data section")
    p.add_argument(
        "--output",
        default=f"benchmarks/history/{datetime.date.today():%Y-%m-%d}-benchmark.md",
        help="Markdown file the report is appended to ('-': print only; default: today's file in benchmarks/history/)",
    )
    p.add_argument("--memory-probe", nargs=2, metavar=("KEY", "SIDE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for flag, given, known in (("--only", args.only, SECTIONS), ("--gpu-parts", args.gpu_parts, tuple(GPU_PARTS))):
        unknown = set(given.split(",")) - set(known)
        if unknown:
            p.error(f"{flag}: unknown name(s) {', '.join(sorted(unknown))}; choose from {', '.join(known)}")
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
                "(models.core.attention.PADDING_FREE)",
                file=sys.stderr,
            )
            continue
        if section == "padding":
            parts.append(padding_report(base, args))
            continue
        if section == "gpu":
            if base.device.type != "cuda" and not base.quick:
                print(
                    "benchmark: gpu section skipped: no CUDA device (torch.cuda.is_available() is False) for ViT-B/16 "
                    "MFU, SDPA checks, CUDA-graph decoding and padded batches; varlen_attn and NJT SDPA's flash kernels are "
                    "CUDA's, and on the CPU the padding-free path is off (models.core.attention.PADDING_FREE); with --quick it "
                    "runs on the CPU at toy sizes, a rehearsal",
                    file=sys.stderr,
                )
                continue
            parts += gpu_parts(base, args, with_padding="padding" not in only)  # else its own section has run them
            continue
        if section == "data":
            parts.append(data_part(base, args, skipped))
            continue
        if section == "detr" and not _has_transformers():
            skipped.append(
                "detr vs Hugging Face: transformers is not installed (`pip install transformers`); ours is measured alone"
            )
        parts += case_parts(section, variants, base, [c for c in all_cases if c.section == section], args)
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
