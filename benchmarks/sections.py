"""The sections of `python -m benchmarks` that are more than a table of cases: padded batches, the
GPU-only figures (`GPU_PARTS`), the data pipeline, and the peer sections (a table of cases each, per torch.compile
setting); each returns its Markdown parts."""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

from benchmarks import fit_throughput, overhead, peers, scaling
from benchmarks.cases import GPU_DECODING, Case, cases, static_cache_case
from benchmarks.data_pipeline import data_pipeline_rows
from benchmarks.harness import Ratio, interleaved
from benchmarks.measure import attention_kernels, log, run_case
from benchmarks.report import SECTION_TITLES, comparison_table, fmt_rate, notes_list, scaling_table
from experiments.compare.tables import markdown_table
from models.core import attention

PADDED_LENGTHS, QUICK_PADDED_LENGTHS = (64, 256, 1024), (16, 32)


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
        tops = []
        for side, timing in timings.items():
            events = scaling.profile_step(bench.steps[side])
            rows.append(
                [
                    label,
                    side,
                    f"{timing.median * 1e3:,.2f}",
                    str(Ratio.of(timing, timings[reference])),
                    fmt_rate(bench.items, timing.median, bench.unit),
                    attention_kernels(events),
                ]
            )
            tops.append(f"  - {side}, the step's top operators by self time: {scaling.top_ops(events)}")
        checks += [f"- {label}: {bench.check}", *tops]
    header = ["case", "side", "ms", "time / reference [p25-p75]", "valid tokens/s", "attention kernels"]
    return (
        f"### Padded batches: our attention's padding paths ({'bf16 autocast' if s.amp else 'fp32'}; issue 28)\n\n"
        "Self-attention: D=256, 8 heads, B·L = 4096, lengths uniform in [L/2, L], forward + backward, against "
        "the same layer unmasked at the padded length ('no mask', the reference). Multi30k step: the model of "
        "configs/text/multi30k_en_de.yaml, 128 sentences of 8-32 tokens, against nn.Transformer (the reference); "
        "with dropout, varlen_attn (it has none) is not a side. The default path on CUDA: "
        f"`models.core.attention.PADDING_FREE['cuda'] = {attention.PADDING_FREE.get('cuda')!r}`.\n\n"
        + markdown_table(header, rows)
        + "\n\nChecks:\n"
        + "\n".join(checks)
    )


def mfu_part(s: peers.Settings, args: argparse.Namespace) -> str:
    """ViT-B/16's MFU at batch 256, ours eager, compiled, and compiled with float8 matmuls (torchao); SDPA on a
    fully blocked row. A rehearsal (``s.quick``): a toy ViT at batch 2, eager, float8 emulated."""
    batch = 2 if s.quick else 256
    rows = [scaling.vit_b16_mfu(s, compile_model=c, batch=batch) for c in ((False,) if s.quick else (False, True))]
    rows.append(scaling.vit_b16_float8_mfu(s, compile_model=not s.quick, batch=batch))
    return (
        "### ViT-B/16 training step, model FLOPs utilisation (fused AdamW)\n\n"
        + markdown_table(list(rows[0]), [list(r.values()) for r in rows])
        + "\n\nfloat8: `experiments.callbacks.Float8Training` (torchao's tensorwise recipe; emulated on the CPU), "
        "the MFU still of the bf16 peak.\n\n### SDPA on this device: a query row whose keys are all blocked "
        "(2 x 4 heads x L x 64)\n\n"
        + markdown_table(
            ["backend", "dtype", "L", "output of the empty row", "gradients"], scaling.empty_row_rows(s.device)
        )
    )


def decoding_part(s: peers.Settings, args: argparse.Namespace) -> str:
    """Beam 5 and greedy decoding on the static cache (CUDA graphs) against the dynamic cache."""
    outcomes = [run_case(static_cache_case(*shape, "gpu"), s, args) for shape in GPU_DECODING]
    return (
        f"### {SECTION_TITLES['gpu/decoding']}\n\n{comparison_table(outcomes)}\n\n"
        f"Checks and notes:\n{notes_list(outcomes)}"
    )


def detr_part(s: peers.Settings, args: argparse.Namespace) -> str:
    """DETR's training step against Hugging Face's, small and R50, with each step's share of Hungarian matching."""
    outcomes = [run_case(c, s, args) for c in cases(s.quick) if c.key in ("detr/small", "detr/r50")]
    return (
        "### DETR training step (set loss with auxiliary losses, AdamW) vs Hugging Face DetrForObjectDetection, with "
        f"the share of the step spent in Hungarian matching\n\n{comparison_table(outcomes)}\n\n"
        f"Checks and notes:\n{notes_list(outcomes)}"
    )


def overhead_part(s: peers.Settings, args: argparse.Namespace) -> str:
    """`attnlab fit` against a plain loop at ViT-S/16, bf16, batch 256 (`benchmarks.overhead`); a toy ViT on
    random 32 px images with ``s.quick``."""
    argv = ["--tasks", "vit_s16", "--device", s.device.type]
    if s.quick:
        toy = ("model.init_args.embed_dim=32", "model.init_args.depth=1", "model.init_args.num_heads=2")
        toy += ("data.init_args.img_size=32", "data.init_args.batch_size=8", "data.init_args.num_workers=0")
        argv += ["--repeats", "1", "--epochs", "1", "--batches", "3", *(f"--set={kv}" for kv in toy)]
    else:
        argv += ["--repeats", "1", "--epochs", "3", "--batches", "20", "--loops", "attnlab"]  # 1 run of ~45 s
    return "### Trainer overhead at ViT-S/16, bf16, batch 256\n\n" + overhead.overhead_report(
        overhead.parse_args(argv), argv
    )


def tokens_part(s: peers.Settings, args: argparse.Namespace) -> str:
    """Tokens/s of `attnlab fit`: Multi30k's recipe by batch_size, max_tokens and max_tokens + compile; the LM plain
    and with packed documents (`benchmarks.fit_throughput`; toy models and data with ``s.quick``)."""
    return fit_throughput.report(s.quick, "gpu" if s.device.type == "cuda" else "cpu")


# the GPU section's parts, in the order `--only gpu` runs them
GPU_PARTS = {
    "padding": padding_report,
    "decoding": decoding_part,
    "detr": detr_part,
    "overhead": overhead_part,
    "mfu": mfu_part,
    "tokens": tokens_part,
}


def gpu_parts(s: peers.Settings, args: argparse.Namespace, with_padding: bool) -> list[str]:
    """The parts of `GPU_PARTS` that ``args.gpu_parts`` names (the padding rows only ``with_padding``: else the
    padding section runs them on its own)."""
    parts = []
    for name in args.gpu_parts.split(","):
        if name != "padding" or with_padding:
            log(f"gpu: {name}")
            parts.append(GPU_PARTS[name](s, args))
    return parts


def data_part(s: peers.Settings, args: argparse.Namespace, skipped: list[str]) -> str:
    """Each of ``--data-configs``: its DataModule alone vs its training step vs the real fit; a config that
    does not exist is added to ``skipped``."""
    log("data pipeline")
    rows = []
    for config in args.data_configs.split(","):
        if not Path(config).is_file():
            skipped.append(f"data: {config} does not exist")
            continue
        rows += data_pipeline_rows(config, (0,) if s.quick else (0, 2), 3 if s.quick else 30, s.device)
    header = [
        "config",
        "num_workers",
        "loader alone",
        "step alone (batches in memory)",
        "fit (loader + step)",
        "model busy",
    ]
    return (
        "### Data pipeline: DataModule alone vs training step (samples/s, wall time)\n\n"
        + markdown_table(header, rows)
        + "\n\n'model busy' = fit rate / step rate: below 100% the model waits for data. Every DataModule takes "
        "`num_workers`, `persistent_workers` (default on) and `pin_memory` (default: on with CUDA)."
    )


def case_parts(
    section: str, variants: list[peers.Settings], base: peers.Settings, chosen: list[Case], args: argparse.Namespace
) -> list[str]:
    """A section of cases (``chosen``): one table per setting of ``variants`` (torch.compile off and on for
    vit and text), with the checks; scaling's table has a row per point and no checks."""
    parts = []
    for settings in variants if section in ("vit", "text") else [base]:
        outcomes = [
            run_case(c, settings, args, ("ours", "sdpa", "nn.MHA") if section == "attention" else ("ours",))
            for c in chosen
        ]
        title = SECTION_TITLES[section] + (" (torch.compile on)" if settings.compile and not base.compile else "")
        table = scaling_table(outcomes) if section == "scaling" else comparison_table(outcomes)
        notes = "" if section == "scaling" else f"\n\nChecks and notes:\n{notes_list(outcomes)}"
        parts.append(f"### {title}\n\n{table}{notes}")
    return parts
