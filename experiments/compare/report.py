"""`attnlab compare RUN_DIR... [--out DIR] [--baseline KEY=VALUE] [--wandb ENTITY/PROJECT]`: one report across runs
and modalities.

Each RUN_DIR is a run folder or a folder above run folders (`runs.find_runs`). ``report.md`` and its plots go to
``--out`` (the sections as `experiments.compare` lists them); ``--wandb ENTITY/PROJECT`` (or PROJECT) logs the
tables and plots to a W&B run too (offline unless W&B is configured, like training runs).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from experiments.compare.curves import (
    reference_point,
    sensitivities,
    suffixed_metrics,
    suffixed_series,
    swept_keys,
    swept_series,
)
from experiments.compare.plots import (
    growth_figure,
    layer_figure,
    loss_figure,
    plot_against,
    plot_scaling,
    save,
    seeds_figure,
)
from experiments.compare.runs import find_runs, group_cells, load_runs
from experiments.compare.sources import changed_sources
from experiments.compare.stats import BaselineError, check_baseline
from experiments.compare.tables import (
    axis_pairs,
    cell_rows,
    markdown_table,
    paired_rows,
    run_rows,
    scaling_rows,
    sensitivity_rows,
    series_table,
    small_n_note,
)

# report.md's own words: what each section shows, before its table and plot
RUNS = """Attention statistics are means over layers and heads on each run's fixed batch at the end of training;
distance is in tokens for text and in pixels for image patches and detection memory. Sink mass: the mean weight on
the first key (BOS, [CLS], the first memory cell); sink heads: the share of heads whose sink mass exceeds 0.3
(Sink^ε_1, Gu et al. 2025); max |x|: the largest over layers of an attention layer's output ∞-norm, and kurtosis:
the mean over layers of its Pearson kurtosis (3 for a normal), each per sequence, padding left out, averaged over
the batch (Bondarenko et al. 2023). W8A8 - fp32: how the checkpoint monitor's metric moves when every linear layer of
the final weights computes with its weight and input rounded to 8 bits, on the same validation batches
(experiments.callbacks.W8A8; Bondarenko et al.'s per-tensor W8A8)."""
SCALING = """## What the √d scaling does

Logit variance: variance over the keys of q·k (×1/√d for scaled_dot) before softmax; max weight: mean largest
attention weight (1 = one-hot); saturated: share of queries whose largest weight exceeds 0.9; 'init' is measured
before the first update, 'end' after training, on the same fixed batch."""
CELLS = """## Cells: mean over seeds with 95% confidence intervals

A cell is one setting run with several seeds. `mean ± h`: the mean over the seeds and h,
the half-width of the 95% t-interval (scipy.stats.t with n - 1 degrees of freedom and the
sample standard deviation); n: the number of seeds."""
PAIRED = """## Paired comparisons over the same seeds

Each cell against its reference (the same settings with one key at its first grid value{here}), over the seeds both ran:
the mean difference (cell - reference), its 95% t-interval and the p-value of a paired t-test
(scipy.stats.ttest_rel)."""
# (plot name, file, the sentence before it) of the section on sinks and outliers
SINK_FIGURES = (
    (
        "sink_mass",
        "attention_sink_mass.png",
        "Sink mass of each attention layer at the end of training: per cell, the mean over its seeds of the heads' mean "
        "weight on the first key (line); each head of each seed is a dot.",
    ),
    (
        "out_max",
        "attention_out_max.png",
        "Max |x| of each attention layer's output at the end of training: per cell, the mean over its seeds (line); "
        "each seed is a dot.",
    ),
    (
        "growth",
        "sink_growth.png",
        "Sink mass and the attention layers' largest max |x| on the training batches as training goes on: per cell, "
        "the mean over its seeds (line) and their minimum to maximum (band).",
    ),
    (
        "cls_maps",
        "cls_maps.png",
        "The last layer's [CLS] attention to the patches, averaged over heads, of the best checkpoint of each cell's "
        "first seed on the first validation images (one per column), each map scaled to its own maximum: where the "
        "class token reads with and without registers (Darcet et al. 2024 find high-norm artifact patches in the "
        "background without them).",
    ),
)
AXIS_PAIRS = """Each point against {point} in the same series, paired over the seeds that ran both: the mean difference
of the final {measure}, its 95% t-interval and the p-value of a paired t-test (scipy.stats.ttest_rel)."""
LR_SENSITIVITY = """### Learning-rate sensitivity (Wortsman et al. 2023)

Per seed, the mean over the learning rates of the final val/loss capped at the first training loss, minus
the best final val/loss over the rates (a diverged run counts as the first loss); mean ± the half-width
of the 95% t-interval over the seeds that ran every rate. Then each series against the first of its group, paired
over the seeds both ran: the mean difference, its 95% t-interval and the p-value of a paired t-test."""


def _section(*parts: str) -> list[str]:
    """Parts of report.md (text, a table, a plot), each followed by an empty line."""
    return [line for part in parts for line in (part, "")]


def build_report(
    run_dirs: list[Path], out: Path, title: str = "attnlab: runs compared", baseline: str | None = None
) -> dict[str, Any]:
    """Write report.md and its plots into ``out``; returns {"report", "table", "rows", "plots", "cells", ...}."""
    runs = load_runs(run_dirs)
    cells = group_cells(runs)  # one colour per cell in every plot
    if baseline:
        check_baseline(cells, baseline)
    out.mkdir(parents=True, exist_ok=True)
    columns, rows = run_rows(runs)
    plots = {"loss": out / "loss_curves.png"}
    save(loss_figure(cells), plots["loss"])
    for key, ylabel in (("entropy", "attention entropy (nats)"), ("distance", "mean attention distance")):
        if fig := layer_figure(cells, key, ylabel):
            plots[key] = out / f"attention_{key}.png"
            save(fig, plots[key])
    table = markdown_table(columns, rows)
    lines = _section(f"# {title}", RUNS, table)
    for line in changed_sources(cells):  # a file of one's own edited between the runs of one cell
        print(f"attnlab: warning: {line}", file=sys.stderr)
        lines += _section(f"**Warning:** {line}")
    scale_columns, scale = scaling_rows(runs)
    if scale:
        plots["scaling"] = out / "sqrt_d.png"
        plot_scaling(runs, plots["scaling"])
        lines += _section(SCALING, markdown_table(scale_columns, scale), f"![√d]({plots['scaling'].name})")
    cell_lines, cell_tables = seeds_section(cells, out, plots, baseline)
    lines += cell_lines
    against_lines, sensitivity, sensitivity_pairs = against_numbers(cells, out, plots, baseline)
    lines += against_lines + sinks_and_outliers(cells, out, plots)
    lines += [f"![{name}]({plots[name].name})" for name in ("loss", "entropy", "distance") if name in plots]
    lines += ["", "Runs: " + ", ".join(f"`{r['dir']}`" for r in runs), ""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    tables = {
        "columns": columns,
        "rows": rows,
        "scaling_columns": scale_columns,
        "scaling_rows": scale,
        **cell_tables,
        "lr_sensitivity": sensitivity,
        "lr_sensitivity_pairs": sensitivity_pairs,
    }
    (out / "table.json").write_text(json.dumps(tables, indent=1))
    return {**tables, "report": report, "table": table, "scaling": scale, "plots": plots, "runs": run_dirs}


def seeds_section(
    cells: list[dict[str, Any]], out: Path, plots: dict[str, Path], baseline: str | None
) -> tuple[list[str], dict[str, Any]]:
    """When a cell has several seeds: the cells' table (with the small-n note), the seeds figure and the paired
    comparisons. Returns the lines and the tables (empty ones when every cell has one seed)."""
    tables: dict[str, Any] = {
        k: [] for k in ("cell_columns", "cell_rows", "paired_columns", "paired_rows", "conclusions")
    }
    tables["small_n"] = None
    if not any(len(c["runs"]) > 1 for c in cells):
        return [], tables
    tables["cell_columns"], tables["cell_rows"] = cell_rows(cells)
    tables["paired_columns"], tables["paired_rows"], tables["conclusions"] = paired_rows(cells, baseline)
    tables["small_n"] = note = small_n_note(cells)
    plots["seeds"] = out / "seeds.png"
    save(seeds_figure(cells), plots["seeds"])
    lines = _section(
        CELLS, markdown_table(tables["cell_columns"], tables["cell_rows"]), *([f"\\{note}"] if note else [])
    )
    lines += _section(f"![seeds]({plots['seeds'].name})")
    if tables["paired_rows"]:
        lines += _section(
            PAIRED.format(here=f", here {baseline}" if baseline else ""),
            "\n".join(f"- {line}" for line in tables["conclusions"]),
            markdown_table(tables["paired_columns"], tables["paired_rows"]),
        )
    return lines, tables


def against_numbers(
    cells: list[dict[str, Any]], out: Path, plots: dict[str, Path], baseline: str | None = None
) -> tuple[list[str], list[list[str]], list[list[str]]]:
    """The section "against the swept numbers" (`experiments.compare.curves`): per group and numeric setting, the
    final val/loss (or the monitor) and ``train/max_attn_logit`` when logged, each point paired with the reference
    point, and the LR sensitivity of a learning rate; per ``@``-suffixed metric, the metric against its number.
    Returns the lines, the sensitivity rows and the paired sensitivity rows."""
    lines, sensitivity, pairs = [], [], []
    for key in swept_keys(cells):
        for group in dict.fromkeys(c["group"] for c in cells):
            members = [c for c in cells if c["group"] == group and key in c["settings"]]
            if not members:
                continue
            lines += _axis(members, key, out, plots, baseline)
            if key.rsplit(".", 1)[-1] == "lr" and all("val/loss" in r["metrics"] for c in members for r in c["runs"]):
                rows, against = sensitivity_rows(sensitivities(swept_series(members, key, "val/loss"), "val/loss"))
                sensitivity, pairs = sensitivity + rows, pairs + against
    if sensitivity:
        columns = ["comparison", "n", "difference", "95% CI", "p (paired t)"]
        tables = [markdown_table(["series", "seeds", "LR sensitivity"], sensitivity)]
        tables += [markdown_table(columns, pairs)] if pairs else []
        lines += _section(LR_SENSITIVITY, *tables)
    for base, keys in suffixed_metrics(cells).items():
        metric, unit = base.split("@")
        slug = re.sub(r"\W+", "_", f"{metric}_at_{unit}")
        plots[f"against/{slug}"] = path = out / f"{slug}.png"
        series = suffixed_series(cells, keys)
        plot_against(series, f"evaluated at ({unit})", metric, path)
        points = ", ".join(k.split("@")[1] for k in keys)
        lines += _section(f"### {metric} at {points}", f"![{slug}]({path.name})", series_table(series, unit))
    return (["## Against the swept numbers", "", *lines] if lines else []), sensitivity, pairs


def _axis(
    members: list[dict[str, Any]], key: str, out: Path, plots: dict[str, Path], baseline: str | None
) -> list[str]:
    """A group's metrics against the numeric setting ``key``: per metric a plot (log x when the values span 10x or
    more), its table, and each point against the reference point paired over the seeds."""
    name, group = key.rsplit(".", 1)[-1], members[0]["group"]
    runs = [r for c in members for r in c["runs"]]
    xs = [float(c["settings"][key]) for c in members]
    log_x = min(xs) > 0 and max(xs) >= 10 * min(xs)
    metric = "val/loss" if all("val/loss" in r["metrics"] for r in runs) else members[0].get("monitor")
    logits = ["train/max_attn_logit"] if any("train/max_attn_logit" in r["metrics"] for r in runs) else []
    x_ref = reference_point(members, key, baseline)
    lines = []
    for measure in [metric, *logits]:
        slug = re.sub(r"\W+", "_", f"{group}_{measure}_against_{name}")
        plots[f"against/{slug}"] = path = out / f"{slug}.png"
        series = swept_series(members, key, measure)
        plot_against(series, key, f"final {measure}", path, log_x)
        lines += _section(
            f"### {group}: final {measure} against {key}", f"![{slug}]({path.name})", series_table(series)
        )
        if rows := axis_pairs(series, x_ref):
            columns = ["series", name, "n", f"difference vs {name}={x_ref:g}", "95% CI", "p (paired t)"]
            lines += _section(
                AXIS_PAIRS.format(measure=measure, point=f"{name}={x_ref:g}"), markdown_table(columns, rows)
            )
    return lines


def sinks_and_outliers(cells: list[dict[str, Any]], out: Path, plots: dict[str, Path]) -> list[str]:
    """The section on sinks and outliers: each of `SINK_FIGURES` the runs have data for, with its sentence. The [CLS]
    maps need each cell's checkpoint and data: without them the section says why they are left out."""
    figures = {
        "sink_mass": layer_figure(cells, "sink_mass", "sink mass"),
        "out_max": layer_figure(cells, "out_max", "max |x| of the attention output"),
        "growth": growth_figure(cells),
    }
    missing = None
    vision = [c for c in cells if c["modality"] == "vision"]
    if any((c["runs"][0]["summary"].hparams or {}).get("register_tokens") for c in vision):
        from experiments.compare.cls_maps import registers_figure  # torch and the models: for these runs only

        try:
            figures["cls_maps"] = registers_figure(vision)
        except (OSError, ValueError) as err:
            missing = f"The [CLS] attention maps are left out: {err}"
            print(f"attnlab: {missing}", file=sys.stderr)
    lines = []
    for name, file, sentence in SINK_FIGURES:
        if figures.get(name) is not None:
            plots[name] = out / file
            save(figures[name], plots[name])
            lines += _section(sentence, f"![{name}]({file})")
    lines += [missing, ""] if missing else []
    return ["## Attention sinks and outliers", "", *lines] if lines else []


def log_to_wandb(target: str, result: dict[str, Any], out: Path) -> str:
    """The table and plots as a W&B run of job type "compare"; returns where it went."""
    import wandb

    from experiments.tracking import wandb_mode

    entity, _, project = target.rpartition("/")
    mode = wandb_mode()
    run = wandb.init(
        project=project,
        entity=entity or None,
        job_type="compare",
        dir=str(out),
        mode=mode,
        config={"runs": [str(r) for r in result["runs"]]},
    )
    tables = {"compare/runs": wandb.Table(columns=result["columns"], data=result["rows"])}
    if result["cell_rows"]:
        tables["compare/cells"] = wandb.Table(columns=result["cell_columns"], data=result["cell_rows"])
    if result["paired_rows"]:
        tables["compare/paired"] = wandb.Table(columns=result["paired_columns"], data=result["paired_rows"])
    run.log({**tables, **{f"compare/{name}": wandb.Image(str(path)) for name, path in result["plots"].items()}})
    where = run.url if mode == "online" else str(Path(run.dir).parent)
    run.finish()
    return where


def print_result(result: dict[str, Any], scaling: bool = False) -> None:
    """The per-run table and the √d section, or, when runs share cells, the cells and the paired comparisons
    (``scaling``: and the √d section)."""
    if not result["cell_rows"]:
        print(result["table"])
    else:
        print("Cells: mean ± half-width of the 95% t-interval over n seeds (scipy.stats.t)")
        print(markdown_table(result["cell_columns"], result["cell_rows"]))
        if result["small_n"]:
            print(result["small_n"])
    if result["conclusions"]:
        print("\nPaired over the same seeds (cell - reference; 95% t-interval, scipy.stats.ttest_rel):")
        print("\n".join(f"- {line}" for line in result["conclusions"]))
    if result["scaling"] and (scaling or not result["cell_rows"]):
        print("\n" + markdown_table(result["scaling_columns"], result["scaling"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attnlab compare", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument(
        "runs", nargs="+", metavar="RUN_DIR", help="run folders (with summary.json) or folders above them"
    )
    parser.add_argument(
        "--out",
        "--output",
        default="runs/compare/report",
        help="folder for report.md and the plots (default: %(default)s)",
    )
    parser.add_argument("--wandb", metavar="ENTITY/PROJECT", help="also log the table and plots to this W&B project")
    parser.add_argument("--title", default="attnlab: runs compared")
    parser.add_argument(
        "--baseline",
        metavar="KEY=VALUE",
        help="compare each cell with the one where KEY (e.g. similarity) is VALUE "
        "(default: each key's first grid value)",
    )
    args = parser.parse_args(argv)
    try:
        if args.baseline is not None and "=" not in args.baseline:
            raise ValueError(f"--baseline {args.baseline!r}: expected KEY=VALUE, e.g. similarity=scaled_dot")
        runs = find_runs(args.runs)
    except ValueError as err:
        print(f"attnlab: error: {err}", file=sys.stderr)
        sys.exit(2)
    out = Path(args.out)
    try:
        result = build_report(runs, out, args.title, args.baseline)
    except BaselineError as err:
        print(f"attnlab: error: {err}", file=sys.stderr)
        sys.exit(2)
    print_result(result)
    if args.wandb:
        print(f"attnlab: W&B: {log_to_wandb(args.wandb, result, out)}")
    print(f"attnlab: report written to {result['report']}")
    return 0
