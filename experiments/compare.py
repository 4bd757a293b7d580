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

Runs that differ only in their seed form a cell: the runs of one cell of an `attnlab sweep` (read from the
sweep's ``sweep.json``), or else runs whose resolved ``config.yaml`` is the same but for
``seed_everything`` and the output folders. Each cell gets a row with the mean over its seeds, n and the
half-width of the 95% t-interval (scipy.stats.t, n - 1 degrees of freedom) of the best metric and each
attention statistic, and each cell is compared with its reference over the seeds both ran (the mean
difference, its 95% t-interval and the p-value of a paired t-test, scipy.stats.ttest_rel). The reference
of a cell is the same cell with one setting at its first grid value (outside a sweep: the value in the
first cell), or the value ``--baseline KEY=VALUE`` names. A plot shows every seed's value and the
intervals.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml

POSITION_KEYS = (
    "positions",
    "pos_embed",
    "pos_embed_type",
    "position_embedding",
    "pos_encoding",
    "positional_encoding",
)


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
            experiment = (
                summary.parent.parent.parent if summary.parent.parent.name == "lightning_logs" else summary.parent
            )
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
    columns = [
        "run",
        "modality",
        "dataset",
        "similarity",
        "positions",
        "params",
        "FLOPs/sample",
        "samples/s",
        "tokens/s",
        "best",
        "entropy (nats)",
        "distance",
        "special share",
        "logit var",
        "max weight",
    ]
    rows = []
    for r in runs:
        s, f = r["summary"], r["final"]
        unit = ((s.get("attention") or {}).get("final") or {}).get("unit", "")
        rows.append(
            [
                r["label"],
                s.get("modality") or "-",
                s.get("dataset") or "-",
                r["similarity"] or "-",
                r["positions"] or "-",
                _num((s.get("params") or {}).get("total")),
                _num(s.get("flops_per_sample")),
                _num((s.get("throughput") or {}).get("samples_per_s")),
                _num((s.get("throughput") or {}).get("tokens_per_s")),
                _best(s),
                _num(f.get("entropy")),
                f"{_num(f.get('distance'))} {unit}" if f.get("distance") is not None else "-",
                _num(f.get("special")),
                _num(f.get("logit_var")),
                _num(f.get("max_weight")),
            ]
        )
    return columns, rows


def scaling_rows(runs: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The √d section: runs of one modality that differ in similarity (all of them, sorted)."""
    columns = [
        "modality",
        "similarity",
        "positions",
        "run",
        "logit var init",
        "logit var end",
        "max weight init",
        "max weight end",
        "saturated init",
        "saturated end",
        "grad norm step 1",
        "grad norm mean",
        "best",
    ]
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
            rows.append(
                [
                    modality_,
                    r["similarity"] or "-",
                    r["positions"] or "-",
                    r["label"],
                    _num(i.get("logit_var")),
                    _num(f.get("logit_var")),
                    _num(i.get("max_weight")),
                    _num(f.get("max_weight")),
                    _num(i.get("saturated")),
                    _num(f.get("saturated")),
                    _num(g.get("first")),
                    _num(g.get("mean")),
                    _best(r["summary"]),
                ]
            )
    return columns, rows


# ---- cells: runs that differ only in their seed, aggregated with 95% t-intervals

STATS = (
    ("entropy", "entropy (nats)"),
    ("distance", "distance"),
    ("special", "special share"),
    ("logit_var", "logit var"),
    ("max_weight", "max weight"),
)
IGNORED = ("seed_everything", "ckpt_path", "trainer.default_root_dir", "trainer.logger", "trainer.enable_progress_bar")
_SEED = re.compile(r"(^|/)seed[=_-]?\d+(?=/|$)")


def _setting(value: Any) -> str:
    """A setting as `attnlab sweep` writes it on the command line (JSON is YAML: true, null, [1, 2])."""
    return value if isinstance(value, str) else json.dumps(value)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        elif not any(f"{prefix}{key}" == k or f"{prefix}{key}".startswith(k + ".") for k in IGNORED):
            out[f"{prefix}{key}"] = _setting(value)
    return out


def _sweep_of(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(sweep.json, this run's entry) when the run folder lies below an `attnlab sweep` root."""
    here = run_dir.resolve()
    for parent in here.parents:
        status = _load(parent / "sweep.json")
        if status.get("runs"):
            # runs are found by name below the sweep's folder, wherever that folder was moved
            entry = next(
                (e for name, e in status["runs"].items() if (parent / name).resolve() in (here, *here.parents)), None
            )
            return (status, entry) if entry else None
    return None


def identify(run: dict[str, Any]) -> None:
    """Give a loaded run its seed, its cell's settings and label, its group and the group's reference values."""
    found = _sweep_of(run["dir"])
    if found:
        status, entry = found
        stem = Path(entry["config"]).stem
        grid = ((status.get("configs") or {}).get(stem) or {}).get("grid") or {}
        run.update(
            order=list(status["runs"].values()).index(entry),
            seed=entry["seed"],
            sweep=status.get("name"),
            group=stem,
            cell=entry["cell_name"],
            settings={k: _setting(v) for k, v in entry["cell"].items()},
            reference={k: _setting(values[0]) for k, values in grid.items() if values},
        )
        return
    config = (
        yaml.safe_load((run["dir"] / "config.yaml").read_text()) if (run["dir"] / "config.yaml").is_file() else None
    )
    config = config if isinstance(config, dict) else {"run": str(run["dir"])}  # without a config: a cell of its own
    run.update(
        order=None,
        seed=config.get("seed_everything"),
        sweep=None,
        group=run["summary"].get("modality") or "-",
        cell=_SEED.sub("", run["label"]).strip("/") or run["label"],
        settings=_flatten(config),
        reference={},
    )


def values_of(run: dict[str, Any]) -> dict[str, float | None]:
    """The best value of the checkpoint monitor and the attention statistics at the end (means over layers, heads)."""
    return {"best": (run["summary"].get("best") or {}).get("value"), **{key: run["final"].get(key) for key, _ in STATS}}


def group_cells(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs that differ only in the seed -> cells, in the order of their first run."""
    for run in runs:
        identify(run)
    several = len({r["sweep"] for r in runs if r["sweep"]}) > 1
    cells: dict[tuple, dict[str, Any]] = {}
    # a sweep's runs in its grid order
    for run in sorted(runs, key=lambda r: (r["sweep"] or "", -1 if r["order"] is None else r["order"])):
        key = (run["sweep"], run["group"], json.dumps(run["settings"], sort_keys=True))
        label = f"{run['sweep']}: {run['cell']}" if several and run["sweep"] else run["cell"]
        cell = cells.setdefault(
            key,
            {
                "label": label,
                "group": run["group"],
                "settings": run["settings"],
                "reference": run["reference"],
                "modality": run["summary"].get("modality") or "-",
                "runs": [],
            },
        )
        cell["runs"].append(run)
        best = run["summary"].get("best") or {}
        cell.setdefault("monitor", best.get("monitor"))
    out = list(cells.values())
    labels = [c["label"] for c in out]
    for cell in out:  # outside a sweep two cells may share a folder name: then each keeps its first run's full label
        if labels.count(cell["label"]) > 1:
            cell["label"] = cell["runs"][0]["label"]
    return out


def interval(values: list[float], confidence: float = 0.95) -> dict[str, float | int | None]:
    """Mean, n and the half-width of the t-interval over ``values`` (sample standard deviation, n - 1 degrees of
    freedom)."""
    from scipy import stats

    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return {"mean": mean, "n": n, "half": None, "low": None, "high": None}
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(stats.t.ppf((1 + confidence) / 2, n - 1)) * sd / math.sqrt(n)
    return {"mean": mean, "n": n, "half": half, "low": mean - half, "high": mean + half}


def paired(a: list[float], b: list[float]) -> dict[str, float | int | None]:
    """a - b over the same seeds: the mean difference with its 95% t-interval, and the paired t-test's p-value."""
    from scipy import stats

    diffs = [x - y for x, y in zip(a, b)]
    out = interval(diffs)
    constant = max(diffs) - min(diffs) <= 1e-12 * max(1.0, abs(out["mean"]))  # no spread: the t statistic is undefined
    out["p"] = float(stats.ttest_rel(a, b).pvalue) if len(a) > 1 and not constant else None
    return out


def _by_seed(cell: dict[str, Any], key: str) -> dict[Any, float]:
    seeds = [r["seed"] for r in cell["runs"]]
    return {
        r["seed"]: values_of(r)[key]
        for r in cell["runs"]
        if values_of(r)[key] is not None and seeds.count(r["seed"]) == 1
    }


def _pm(stat: dict[str, Any]) -> str:
    return _num(stat["mean"]) + (f" ± {_num(stat['half'])}" if stat["half"] is not None else "")


def cell_rows(cells: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    columns = ["cell", "modality", "n", "seeds", "best", *(label for _, label in STATS)]
    rows = []
    for cell in cells:
        row = [cell["label"], cell["modality"], str(len(cell["runs"])), ",".join(str(r["seed"]) for r in cell["runs"])]
        for key in ("best", *(k for k, _ in STATS)):
            values = list(_by_seed(cell, key).values())
            text = _pm(interval(values)) if values else "-"
            row.append(f"{cell['monitor']} = {text}" if key == "best" and values and cell.get("monitor") else text)
        rows.append(row)
    return columns, rows


def pairs(
    cells: list[dict[str, Any]], baseline: str | None = None
) -> list[tuple[dict[str, Any], dict[str, Any], str, list[str]]]:
    """(cell, reference cell, the key they differ in, the keys that vary in their group): each cell against the cell
    equal to it but for one key at its reference value (the first grid value; outside a sweep, the first cell's; or
    ``baseline`` KEY=VALUE)."""
    base_key, _, base_value = (baseline or "").partition("=")
    out = []
    for group in dict.fromkeys(c["group"] for c in cells):
        members = [c for c in cells if c["group"] == group]
        keys = [k for k in members[0]["settings"] if len({c["settings"].get(k) for c in members}) > 1]
        varying = keys
        reference = {k: members[0]["reference"].get(k, members[0]["settings"][k]) for k in keys}
        if baseline:
            keys = [k for k in keys if k == base_key or k.endswith("." + base_key)]
            reference = {k: base_value for k in keys}
        by_settings = {json.dumps(c["settings"], sort_keys=True): c for c in members}
        for key in keys:  # one key at a time: every cell that changes it, in the grid's order
            for cell in members:
                if cell["settings"].get(key) == reference[key]:
                    continue
                ref = by_settings.get(json.dumps({**cell["settings"], key: reference[key]}, sort_keys=True))
                if ref is not None:
                    out.append((cell, ref, key, varying))
    return out


def _comparison(cell: dict[str, Any], ref: dict[str, Any], key: str, varying: list[str]) -> str:
    """ "text, dot vs scaled_dot (positions=learned)": the group, the two values, the other settings that vary."""
    context = [f"{k.rpartition('.')[2]}={cell['settings'][k]}" for k in varying if k != key]
    return f"{cell['group']}, {cell['settings'][key]} vs {ref['settings'][key]}" + (
        f" ({', '.join(context)})" if context else ""
    )


def paired_rows(
    cells: list[dict[str, Any]], baseline: str | None = None
) -> tuple[list[str], list[list[str]], list[str]]:
    """The paired comparisons over common seeds, and one sentence per comparison of the best metric."""
    columns = ["comparison", "metric", "n", "difference", "95% CI", "p (paired t)"]
    rows, conclusions = [], []
    for cell, ref, key, varying in pairs(cells, baseline):
        name = _comparison(cell, ref, key, varying)
        for metric, label in (("best", cell.get("monitor") or "best"), *STATS):
            a, b = _by_seed(cell, metric), _by_seed(ref, metric)
            seeds = [s for s in a if s in b]
            if len(seeds) < 2:
                continue
            d = paired([a[s] for s in seeds], [b[s] for s in seeds])
            ci = f"{d['low']:.3g} to {d['high']:.3g}"
            p = "-" if d["p"] is None or math.isnan(d["p"]) else f"{d['p']:.2g}"
            rows.append([name, label, str(d["n"]), f"{d['mean']:+.3g}", ci, p])
            if metric == "best":
                conclusions.append(f"{name}: {d['mean']:+.3g} {label} (95% CI {ci}, n={d['n']}, paired t-test p={p})")
    return columns, rows, conclusions


def plot_cells(cells: list[dict[str, Any]], path: Path) -> None:
    """One row per group, one panel per measure: every seed's value (dots) and the mean with its 95% interval (bars)."""
    plt = _pyplot()
    groups = list(dict.fromkeys(c["group"] for c in cells))
    measures = [("best", "best")] + [(k, label) for k, label in STATS if any(_by_seed(c, k) for c in cells)]
    fig, axes = plt.subplots(
        len(groups), len(measures), figsize=(3.2 * len(measures), 3.4 * len(groups)), squeeze=False
    )
    for axes_row, group in zip(axes, groups):
        members = [c for c in cells if c["group"] == group]
        names = [c["label"].removeprefix(f"{group}/") for c in members]
        keys = ", ".join(re.findall(r"([\w.]+)=", names[0]))  # "similarity=dot,positions=learned": ticks "dot,learned"
        names = [re.sub(r"[\w.]+=", "", name) for name in names]
        for ax, (key, label) in zip(axes_row, measures):
            for x, cell in enumerate(members):
                values = list(_by_seed(cell, key).values())
                if not values:
                    continue
                jitter = [(i - (len(values) - 1) / 2) * 0.06 for i in range(len(values))]
                ax.plot(
                    [x + j for j in jitter],
                    values,
                    "o",
                    color="gray",
                    alpha=0.6,
                    ms=4,
                    label="a seed" if x == 0 else None,
                )
                stat = interval(values)
                ax.errorbar(
                    [x + 0.25],
                    [stat["mean"]],
                    yerr=[[stat["half"] or 0], [stat["half"] or 0]],
                    fmt="s",
                    color="tab:blue",
                    capsize=4,
                    label="mean, 95% CI" if x == 0 else None,
                )
            monitor = next((c.get("monitor") for c in members if c.get("monitor")), None)
            ax.set_title(f"{group}: {monitor or label}" if key == "best" else f"{group}: {label}", fontsize=9)
            ax.set_xticks(range(len(members)), names, rotation=30, ha="right", fontsize=7)
            ax.set_xlabel(keys, fontsize=7)
            ax.grid(alpha=0.3, axis="y")
        axes_row[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def markdown_table(columns: list[str], rows: list[list[str]]) -> str:
    cell = lambda v: str(v).replace("|", "\\|")  # noqa: E731
    return "\n".join(
        ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    )


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
    if rel.lines:
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
    for ax in axes.flat[len(panels) :]:
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
        ax.set(title=panel_title(r), ylabel=ylabel + unit)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def panel_title(run: dict[str, Any]) -> str:
    """The run's label, and its modality below when the label does not already say it (not "vision / vision")."""
    modality_ = run["summary"].get("modality")
    return run["label"] if not modality_ or modality_ in run["label"].split("/") else f"{run['label']}\n{modality_}"


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


def build_report(
    run_dirs: list[Path], out: Path, title: str = "attnlab: runs compared", baseline: str | None = None
) -> dict[str, Any]:
    """Write report.md and its plots into ``out``; returns {"report", "table", "rows", "plots", "cells", ...}."""
    runs = load_runs(run_dirs)
    out.mkdir(parents=True, exist_ok=True)
    columns, rows = run_rows(runs)
    plots = {"loss": out / "loss_curves.png"}
    plot_losses(runs, plots["loss"])
    for key, ylabel in (("entropy", "attention entropy (nats)"), ("distance", "mean attention distance")):
        if plot_by_layer(runs, key, ylabel, out / f"attention_{key}.png"):
            plots[key] = out / f"attention_{key}.png"
    table = markdown_table(columns, rows)
    lines = [
        f"# {title}",
        "",
        "Attention statistics are means over layers and heads on each run's fixed batch at the end of training;",
        "distance is in tokens for text and in pixels for image patches and detection memory.",
        "",
        table,
        "",
    ]
    scale_columns, scale = scaling_rows(runs)
    if scale:
        plots["scaling"] = out / "sqrt_d.png"
        plot_scaling(runs, plots["scaling"])
        lines += [
            "## What the √d scaling does",
            "",
            "Logit variance: variance over the keys of q·k (×1/√d for scaled_dot) before softmax; max weight: mean largest",
            "attention weight (1 = one-hot); saturated: share of queries whose largest weight exceeds 0.9; 'init' is measured",
            "before the first update, 'end' after training, on the same fixed batch.",
            "",
            markdown_table(scale_columns, scale),
            "",
            f"![√d]({plots['scaling'].name})",
            "",
        ]
    cells = group_cells(runs)
    cell_columns, cell_table, paired_columns, paired_table, conclusions = [], [], [], [], []
    if any(len(c["runs"]) > 1 for c in cells):
        cell_columns, cell_table = cell_rows(cells)
        paired_columns, paired_table, conclusions = paired_rows(cells, baseline)
        plots["seeds"] = out / "seeds.png"
        plot_cells(cells, plots["seeds"])
        lines += [
            "## Cells: mean over seeds with 95% confidence intervals",
            "",
            "A cell is one setting run with several seeds. `mean ± h`: the mean over the seeds and h,",
            "the half-width of the 95% t-interval (scipy.stats.t with n - 1 degrees of freedom and the",
            "sample standard deviation); n: the number of seeds.",
            "",
            markdown_table(cell_columns, cell_table),
            "",
            f"![seeds]({plots['seeds'].name})",
            "",
        ]
        if paired_table:
            lines += [
                "## Paired comparisons over the same seeds",
                "",
                "Each cell against its reference (the same settings with one key at its first grid value"
                + (f", here {baseline}" if baseline else "")
                + "), over the seeds both ran:",
                "the mean difference (cell - reference), its 95% t-interval and the p-value of a paired t-test",
                "(scipy.stats.ttest_rel).",
                "",
                *(f"- {line}" for line in conclusions),
                "",
                markdown_table(paired_columns, paired_table),
                "",
            ]
    lines += [f"![{name}]({path.name})" for name, path in plots.items() if name not in ("scaling", "seeds")]
    lines += ["", "Runs: " + ", ".join(f"`{r['dir']}`" for r in runs), ""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    (out / "table.json").write_text(
        json.dumps(
            {
                "columns": columns,
                "rows": rows,
                "scaling_columns": scale_columns,
                "scaling_rows": scale,
                "cell_columns": cell_columns,
                "cell_rows": cell_table,
                "paired_columns": paired_columns,
                "paired_rows": paired_table,
                "conclusions": conclusions,
            },
            indent=1,
        )
    )
    return {
        "report": report,
        "table": table,
        "columns": columns,
        "rows": rows,
        "scaling": scale,
        "plots": plots,
        "cell_columns": cell_columns,
        "cell_rows": cell_table,
        "paired_columns": paired_columns,
        "paired_rows": paired_table,
        "conclusions": conclusions,
    }


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
    for ax, (key, stage, label) in zip(
        axes,
        (
            ("logit_var", "init", "logit variance at init"),
            ("max_weight", "init", "max weight at init"),
            ("max_weight", "final", "max weight at the end"),
        ),
    ):
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


def print_result(result: dict[str, Any], runs: list[Path]) -> None:
    """The per-run table (and the √d section), or, when runs share cells, the cells and the paired comparisons."""
    if not result["cell_rows"]:
        print(result["table"])
        if result["scaling"]:
            print()
            print(markdown_table(*scaling_rows(load_runs(runs))))
        return
    print("Cells: mean ± half-width of the 95% t-interval over n seeds (scipy.stats.t)")
    print(markdown_table(result["cell_columns"], result["cell_rows"]))
    if result["conclusions"]:
        print()
        print("Paired over the same seeds (cell - reference; 95% t-interval, scipy.stats.ttest_rel):")
        print("\n".join(f"- {line}" for line in result["conclusions"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attnlab compare", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "runs", nargs="+", metavar="RUN_DIR", help="run folders (with summary.json) or folders above them"
    )
    parser.add_argument(
        "--out", default="runs/compare/report", help="folder for report.md and the plots (default: %(default)s)"
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
    if args.baseline is not None and "=" not in args.baseline:
        message = f"--baseline {args.baseline!r}: expected KEY=VALUE, e.g. similarity=scaled_dot"
        print(f"attnlab: error: {message}", file=sys.stderr)
        sys.exit(2)
    try:
        runs = find_runs(args.runs)
    except ValueError as err:
        print(f"attnlab: error: {err}", file=sys.stderr)
        sys.exit(2)
    out = Path(args.out)
    result = build_report(runs, out, args.title, args.baseline)
    result["runs"] = runs
    print_result(result, runs)
    if args.wandb:
        print(f"attnlab: W&B: {log_to_wandb(args.wandb, result, out)}")
    print(f"attnlab: report written to {result['report']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
