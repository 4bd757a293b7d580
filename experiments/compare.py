"""`attnlab compare RUN_DIR... [--out DIR] [--wandb ENTITY/PROJECT]`: one report across runs and modalities.

Each RUN_DIR is a run folder holding ``summary.json`` (written by `experiments.callbacks.RunSummary`),
or any folder above run folders (an experiment's ``default_root_dir``, or ``runs/`` itself): then the
newest finished run of every experiment below it is taken. The report (``report.md`` + PNG plots,
in ``--out``, default ``runs/compare/report``) has, per run, modality, dataset, parameters, FLOPs per
sample, throughput, the best value of the checkpoint monitor and attention statistics on the run's
fixed batch; plots of the training loss on a common axis (fraction of training, loss relative to its
first value) and of attention entropy and distance by layer, one panel per run. When runs of one
modality differ in the similarity function, a section measures what the √d scaling does: logit
variance and softmax saturation at initialisation and at the end, gradient norm, final metric.
``--wandb ENTITY/PROJECT`` (or just PROJECT) also logs the table and plots to a W&B run (offline
unless W&B is configured, like training runs).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

POSITION_KEYS = ("positions", "pos_embed", "pos_embed_type", "position_embedding", "pos_encoding", "positional_encoding")


def summarize(stats: dict[str, Any]) -> dict[str, float | None]:
    """Attention statistics of one run (`experiments.stats`) -> the mean over every layer and head of each."""
    out: dict[str, float | None] = {}
    for key in ("entropy", "max_weight", "saturated", "logit_var", "distance", "special"):
        values = [v for layer in stats.get("layers", []) if layer.get(key) is not None for v in layer[key]]
        out[key] = sum(values) / len(values) if values else None
    return out


def find_runs(paths: list[str]) -> list[Path]:
    """Run folders (holding summary.json) named by ``paths``; the newest finished run per experiment below a folder."""
    runs: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_file() and path.name == "summary.json":
            path = path.parent
        if (path / "summary.json").is_file():
            runs.append(path)
            continue
        if not path.is_dir():
            raise ValueError(f"{raw}: no such run folder")
        newest: dict[Path, tuple[float, Path]] = {}
        for summary in path.rglob("summary.json"):
            data = _load(summary)
            if data.get("status") != "finished":
                continue
            experiment = summary.parent.parent.parent if summary.parent.parent.name == "lightning_logs" else summary.parent
            stamp = summary.stat().st_mtime
            if experiment not in newest or stamp > newest[experiment][0]:
                newest[experiment] = (stamp, summary.parent)
        if not newest:
            raise ValueError(f"{raw}: no finished run (summary.json) below it; run `attnlab fit` first")
        runs += [run for _, run in sorted(newest.values(), key=lambda item: str(item[1]))]
    return list(dict.fromkeys(runs))


def _load(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def read_metrics(run: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.csv -> key -> [(step, value)] sorted by step; a resumed run's repeated steps keep the later row."""
    path = run / "metrics.csv"
    if not path.is_file():
        return {}
    series: dict[str, dict[int, float]] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            step = int(float(row.get("step") or 0))
            for key, value in row.items():
                if key in ("step", "epoch") or value in ("", None):
                    continue
                series.setdefault(key, {})[step] = float(value)
    return {key: sorted(values.items()) for key, values in series.items()}


def _position_kind(hparams: dict[str, Any]) -> str | None:
    return next((str(hparams[k]) for k in POSITION_KEYS if k in hparams), None)


def _labels(experiments: list[Path]) -> list[str]:
    """Each experiment folder relative to their common parent (runs/vision/digits, runs/text/toy -> vision/digits, text/toy)."""
    paths = [p.resolve() for p in experiments]
    if len(set(paths)) == len(paths) > 1:
        common = Path(os.path.commonpath(paths))
        return [str(p.relative_to(common)) for p in paths]
    return ["/".join(p.parts[-2:]) for p in paths]


def load_runs(run_dirs: list[Path]) -> list[dict[str, Any]]:
    runs = [load_run(r) for r in run_dirs]
    for run, label in zip(runs, _labels([Path(r["summary"].get("experiment") or r["dir"]) for r in runs])):
        run["label"] = label
    return runs


def load_run(run: Path) -> dict[str, Any]:
    summary = _load(run / "summary.json")
    hp = summary.get("hparams") or {}
    attention = summary.get("attention") or {}
    return {
        "dir": run,
        "label": str(run),
        "summary": summary,
        "metrics": read_metrics(run),
        "similarity": hp.get("similarity"),
        "positions": _position_kind(hp),
        "final": summarize(attention["final"]) if attention.get("final") else {},
        "init": summarize(attention["init"]) if attention.get("init") else {},
    }


def _num(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if abs(value) >= 1e9:
        return f"{value / 1e9:.2f} G"
    if abs(value) >= 1e6:
        return f"{value / 1e6:.2f} M"
    if abs(value) >= 1e4:
        return f"{value / 1e3:.1f} k"
    return f"{value:.{digits}g}"


def _best(summary: dict[str, Any]) -> str:
    best = summary.get("best") or {}
    return f"{best['monitor']} = {best['value']:.4g}" if best.get("value") is not None else "-"


def run_rows(runs: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    columns = ["run", "modality", "dataset", "similarity", "positions", "params", "FLOPs/sample", "samples/s", "tokens/s", "best",
               "entropy (nats)", "distance", "special share", "logit var", "max weight"]
    rows = []
    for r in runs:
        s, f = r["summary"], r["final"]
        unit = ((s.get("attention") or {}).get("final") or {}).get("unit", "")
        rows.append([
            r["label"], s.get("modality") or "-", s.get("dataset") or "-", r["similarity"] or "-", r["positions"] or "-",
            _num((s.get("params") or {}).get("total")), _num(s.get("flops_per_sample")),
            _num((s.get("throughput") or {}).get("samples_per_s")), _num((s.get("throughput") or {}).get("tokens_per_s")),
            _best(s), _num(f.get("entropy")), f"{_num(f.get('distance'))} {unit}" if f.get("distance") is not None else "-",
            _num(f.get("special")), _num(f.get("logit_var")), _num(f.get("max_weight")),
        ])
    return columns, rows


def scaling_rows(runs: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The √d section: runs of one modality that differ in similarity (all of them, sorted)."""
    columns = ["modality", "similarity", "positions", "run", "logit var init", "logit var end", "max weight init", "max weight end",
               "saturated init", "saturated end", "grad norm step 1", "grad norm mean", "best"]
    by_modality: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_modality.setdefault(r["summary"].get("modality") or "-", []).append(r)
    rows = []
    order = {"scaled_dot": 0, "dot": 1, "general": 2}
    for modality_, group in sorted(by_modality.items()):
        if len({r["similarity"] for r in group}) < 2:
            continue
        for r in sorted(group, key=lambda r: (order.get(r["similarity"], 9), str(r["positions"]), r["label"])):
            i, f, g = r["init"], r["final"], r["summary"].get("grad_norm") or {}
            rows.append([modality_, r["similarity"] or "-", r["positions"] or "-", r["label"], _num(i.get("logit_var")), _num(f.get("logit_var")),
                         _num(i.get("max_weight")), _num(f.get("max_weight")), _num(i.get("saturated")), _num(f.get("saturated")),
                         _num(g.get("first")), _num(g.get("mean")), _best(r["summary"])])
    return columns, rows


def markdown_table(columns: list[str], rows: list[list[str]]) -> str:
    cell = lambda v: str(v).replace("|", "\\|")  # noqa: E731
    return "\n".join(["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


def _train_loss(metrics: dict[str, list[tuple[int, float]]]) -> list[tuple[int, float]]:
    return metrics.get("train/loss_step") or metrics.get("train/loss") or metrics.get("train/loss_epoch") or []


def plot_losses(runs: list[dict[str, Any]], path: Path) -> None:
    """Training loss of every run against the fraction of its training, raw (log scale) and relative to its first value."""
    plt = _pyplot()
    fig, (raw, rel) = plt.subplots(1, 2, figsize=(11, 4))
    raw.set_prop_cycle(color=[plt.get_cmap("tab20")(i % 20) for i in range(len(runs))])
    rel.set_prop_cycle(color=[plt.get_cmap("tab20")(i % 20) for i in range(len(runs))])
    for r in runs:
        curve = _train_loss(r["metrics"])
        if not curve:
            continue
        last = max(step for step, _ in curve) or 1
        x = [step / last for step, _ in curve]
        y = [v for _, v in curve]
        raw.plot(x, y, label=r["label"])
        rel.plot(x, [v / y[0] for v in y] if y[0] else y, label=r["label"])
        val = r["metrics"].get("val/loss")
        if val:
            raw.plot([s / last for s, _ in val], [v for _, v in val], "o", ms=3, color=raw.lines[-1].get_color())
    raw.set(xlabel="fraction of training", ylabel="loss (train: line, val: dots)", yscale="log", title="loss")
    rel.set(xlabel="fraction of training", ylabel="train loss / first train loss", title="loss relative to its start")
    for ax in (raw, rel):
        ax.grid(alpha=0.3)
    rel.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_by_layer(runs: list[dict[str, Any]], key: str, ylabel: str, path: Path) -> bool:
    """One panel per run: ``key`` of each attention layer (mean over heads as a line, heads as dots)."""
    panels = [(r, ((r["summary"].get("attention") or {}).get("final") or {})) for r in runs]
    panels = [(r, a) for r, a in panels if any(layer.get(key) for layer in a.get("layers", []))]
    if not panels:
        return False
    plt = _pyplot()
    cols = min(len(panels), 4)
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (r, attention) in zip(axes.flat, panels):
        layers = [layer for layer in attention["layers"] if layer.get(key)]
        for kind, marker in (("self", "o"), ("cross", "s")):
            idx = [i for i, layer in enumerate(layers) if layer["kind"] == kind]
            if not idx:
                continue
            means = [sum(layers[i][key]) / len(layers[i][key]) for i in idx]
            ax.plot(idx, means, marker=marker, label=f"{kind}-attention (head mean)")
            for i in idx:
                ax.plot([i] * len(layers[i][key]), layers[i][key], ".", color="gray", alpha=0.5, ms=4)
        ax.set_xticks(range(len(layers)), [_short(layer["name"]) for layer in layers], rotation=60, fontsize=6)
        unit = f" ({attention.get('unit')})" if key == "distance" else ""
        ax.set(title=f"{r['label']}\n{r['summary'].get('modality')}", ylabel=ylabel + unit)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def _short(name: str) -> str:
    parts = name.split(".")
    stack = next((p for p in parts if p in ("encoder", "decoder", "blocks")), "")
    index = next((p for p in parts if p.isdigit()), "")
    kind = "x" if parts[-1] == "multihead_attn" else ""
    return f"{stack[:3]}{index}{kind}" or name


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def build_report(run_dirs: list[Path], out: Path, title: str = "attnlab: runs compared") -> dict[str, Any]:
    """Write report.md and its plots into ``out``; returns {"report", "table", "rows", "plots"}."""
    runs = load_runs(run_dirs)
    out.mkdir(parents=True, exist_ok=True)
    columns, rows = run_rows(runs)
    plots = {"loss": out / "loss_curves.png"}
    plot_losses(runs, plots["loss"])
    for key, ylabel in (("entropy", "attention entropy (nats)"), ("distance", "mean attention distance")):
        if plot_by_layer(runs, key, ylabel, out / f"attention_{key}.png"):
            plots[key] = out / f"attention_{key}.png"
    table = markdown_table(columns, rows)
    lines = [f"# {title}", "", "Attention statistics are means over layers and heads on each run's fixed batch at the end of training;",
             "distance is in tokens for text and in pixels for image patches and detection memory.", "", table, ""]
    scale_columns, scale = scaling_rows(runs)
    if scale:
        plots["scaling"] = out / "sqrt_d.png"
        plot_scaling(runs, plots["scaling"])
        lines += ["## What the √d scaling does", "",
                  "Logit variance: variance over the keys of q·k (×1/√d for scaled_dot) before softmax; max weight: mean largest",
                  "attention weight (1 = one-hot); saturated: share of queries whose largest weight exceeds 0.9; 'init' is measured",
                  "before the first update, 'end' after training, on the same fixed batch.", "", markdown_table(scale_columns, scale), "",
                  f"![√d]({plots['scaling'].name})", ""]
    lines += [f"![{name}]({path.name})" for name, path in plots.items() if name != "scaling"]
    lines += ["", "Runs: " + ", ".join(f"`{r['dir']}`" for r in runs), ""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    (out / "table.json").write_text(json.dumps({"columns": columns, "rows": rows, "scaling_columns": scale_columns, "scaling_rows": scale}, indent=1))
    return {"report": report, "table": table, "columns": columns, "rows": rows, "scaling": scale, "plots": plots}


def plot_scaling(runs: list[dict[str, Any]], path: Path) -> None:
    """Logit variance and max weight at initialisation, by similarity, one group per modality (log scale)."""
    plt = _pyplot()
    groups: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in runs:
        groups.setdefault(r["summary"].get("modality") or "-", {}).setdefault(r["similarity"] or "-", []).append(r)
    groups = {m: g for m, g in groups.items() if len(g) > 1}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    sims = [s for s in ("scaled_dot", "dot", "general") if any(s in by_sim for by_sim in groups.values())]
    width = 0.8 / len(sims)
    colors = {"scaled_dot": "tab:blue", "dot": "tab:orange", "general": "tab:green"}
    for ax, (key, stage, label) in zip(axes, (("logit_var", "init", "logit variance at init"), ("max_weight", "init", "max weight at init"),
                                               ("max_weight", "final", "max weight at the end"))):
        for j, sim in enumerate(sims):
            xs, ys = [], []
            for i, (_modality, by_sim) in enumerate(sorted(groups.items())):
                values = [r[stage].get(key) for r in by_sim.get(sim, []) if r[stage].get(key) is not None]
                if values:
                    xs.append(i + (j - (len(sims) - 1) / 2) * width)
                    ys.append(sum(values) / len(values))
            ax.bar(xs, ys, width, label=sim, color=colors[sim])
        ax.set_xticks(range(len(groups)), sorted(groups))
        ax.set(title=label, yscale="log" if key == "logit_var" else "linear")
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def log_to_wandb(target: str, result: dict[str, Any], out: Path) -> str:
    """The table and plots as a W&B run of job type "compare"; returns where it went."""
    import wandb

    from experiments.tracking import wandb_mode

    entity, _, project = target.rpartition("/")
    mode = wandb_mode()
    run = wandb.init(project=project, entity=entity or None, job_type="compare", dir=str(out), mode=mode, config={"runs": [str(r) for r in result["runs"]]})
    run.log({"compare/runs": wandb.Table(columns=result["columns"], data=result["rows"]),
             **{f"compare/{name}": wandb.Image(str(path)) for name, path in result["plots"].items()}})
    where = run.url if mode == "online" else str(Path(run.dir).parent)
    run.finish()
    return where


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attnlab compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders (with summary.json) or folders above them")
    parser.add_argument("--out", default="runs/compare/report", help="folder for report.md and the plots (default: %(default)s)")
    parser.add_argument("--wandb", metavar="ENTITY/PROJECT", help="also log the table and plots to this W&B project")
    parser.add_argument("--title", default="attnlab: runs compared")
    args = parser.parse_args(argv)
    try:
        runs = find_runs(args.runs)
    except ValueError as err:
        print(f"attnlab: error: {err}", file=sys.stderr)
        sys.exit(2)
    out = Path(args.out)
    result = build_report(runs, out, args.title)
    result["runs"] = runs
    print(result["table"])
    if result["scaling"]:
        print()
        print(markdown_table(*scaling_rows(load_runs(runs))))
    if args.wandb:
        print(f"attnlab: W&B: {log_to_wandb(args.wandb, result, out)}")
    print(f"attnlab: report written to {result['report']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
