"""Discovery and cells: run folders -> loaded runs (summary, metrics, attention means) -> cells of seeds.

Runs that differ only in their seed form a cell: the runs of one cell of an `attnlab sweep` (read from the
sweep's ``sweep.json``), or else runs whose resolved ``config.yaml`` is the same but for ``seed_everything``
and the output folders.
"""

from __future__ import annotations

import csv
import json
import os
import re
from pathlib import Path
from typing import Any

import yaml

from experiments.runfolder import (
    SUMMARY,
    Summary,
    SweepRun,
    SweepStatus,
    cell_label,
    cli_value,
    newest,
    setting_names,
)

STATS = (
    ("entropy", "entropy (nats)"),
    ("distance", "distance"),
    ("special", "special share"),
    ("logit_var", "logit var"),
    ("max_weight", "max weight"),
    ("sink_mass", "sink mass"),
    ("sink_heads", "sink heads"),
    ("out_max", "max |x|"),
    ("out_kurtosis", "kurtosis"),
    ("w8a8", "W8A8 - fp32"),
)
SINKS = ("sink_mass", "sink_heads", "register_mass", "out_max", "out_kurtosis")  # reduced over the model when measured
BESIDE_THE_BLOCK = ("register_tokens", "init_values")  # the models' own fields that change what attention sees
IGNORED = ("seed_everything", "ckpt_path", "trainer.default_root_dir", "trainer.logger", "trainer.enable_progress_bar")
_SEED = re.compile(r"(^|/)seed[=_-]?\d+(?=/|$)")


def summarize(stats: dict[str, Any]) -> dict[str, float | None]:
    """Attention statistics of one run (`experiments.callbacks.attention_stats`) -> the mean over every layer and head of each, and the
    sinks and outliers as the run reduced them (`experiments.callbacks.sinks.model_summary`; None for a run from before them)."""
    out: dict[str, float | None] = {}
    for key in ("entropy", "max_weight", "saturated", "logit_var", "distance", "special"):
        values = [v for layer in stats.get("layers", []) if layer.get(key) is not None for v in layer[key]]
        out[key] = sum(values) / len(values) if values else None
    out.update({key: (stats.get("summary") or {}).get(key) for key in SINKS})
    return out


def w8a8_change(summary: Summary) -> float | None:
    """How the checkpoint monitor's metric moves when the final weights compute in simulated W8A8 (w8a8 - fp32 on the
    same validation batches, `experiments.callbacks.W8A8`); None for a run scored without it."""
    monitor = (summary.best or {}).get("monitor")
    scored = (summary.quantization or {}).get("val") or {}
    fp32, w8a8 = ((scored.get(key) or {}).get(monitor) for key in ("fp32", "w8a8"))
    return None if fp32 is None or w8a8 is None else w8a8 - fp32


def find_runs(paths: list[str]) -> list[Path]:
    """Run folders (holding summary.json) named by ``paths``; the newest finished run per experiment below a folder."""
    runs: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_file() and path.name == SUMMARY:
            path = path.parent
        if (path / SUMMARY).is_file():
            runs.append(path)
        elif path.is_dir():
            runs += _finished_below(raw, path)
        else:
            raise ValueError(f"{raw}: no such run folder")
    return list(dict.fromkeys(runs))


def _finished_below(raw: str, path: Path) -> list[Path]:
    """The newest finished run of each experiment below ``path``; an error that lists the runs that did not finish
    when none did."""
    finished: dict[Path, list[Path]] = {}  # experiment folder -> its finished runs' summaries
    unfinished: list[str] = []  # "<run folder> (<state>)"
    for summary in sorted(path.rglob(SUMMARY)):
        run, state = summary.parent, Summary.read(summary).state()
        if state == "finished":
            finished.setdefault(experiment_folder(run), []).append(summary)
        else:
            unfinished.append(f"{run.relative_to(path)} ({state or 'no status'})")
    if not finished and unfinished:
        more = f" and {len(unfinished) - 5} more" if len(unfinished) > 5 else ""
        raise ValueError(
            f"{raw}: no run below it finished: {', '.join(unfinished[:5])}{more}; "
            "continue one with `attnlab fit ... --ckpt_path last`, or name its folder to compare it as it is"
        )
    if not finished:
        raise ValueError(f"{raw}: no run (summary.json) below it; run `attnlab fit` first")
    return sorted((newest(summaries).parent for summaries in finished.values()), key=str)


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
                if key not in ("step", "epoch") and value not in ("", None):
                    series.setdefault(key, {})[step] = float(value)
    return {key: sorted(values.items()) for key, values in series.items()}


def train_loss(metrics: dict[str, list[tuple[int, float]]]) -> list[tuple[int, float]]:
    # train/loss_step: Lightning's name for the step values when a module logs the epoch mean too (on_epoch=True)
    return metrics.get("train/loss") or metrics.get("train/loss_step") or []


def _labels(experiments: list[Path]) -> list[str]:
    """Each experiment folder relative to their common parent (runs/vision/digits, runs/text/toy -> vision/digits, text/toy)."""
    paths = [p.resolve() for p in experiments]
    if len(set(paths)) == len(paths) > 1:
        common = Path(os.path.commonpath(paths))
        return [str(p.relative_to(common)) for p in paths]
    return ["/".join(p.parts[-2:]) for p in paths]


def experiment_folder(run: Path) -> Path:
    """The experiment folder (``trainer.default_root_dir``) of the run folder ``run`` as it lies now. Its summary's
    ``experiment`` names where the run was written: a folder copied from another machine or moved keeps that."""
    return run.parent.parent if run.parent.name == "lightning_logs" else run


def load_runs(run_dirs: list[Path]) -> list[dict[str, Any]]:
    runs = [_load_run(r) for r in run_dirs]
    for run, label in zip(runs, _labels([experiment_folder(Path(r["dir"])) for r in runs])):
        run["label"] = label
    return runs


def _load_run(run: Path) -> dict[str, Any]:
    summary = Summary.read(run / SUMMARY)
    hp = summary.hparams or {}
    attention = summary.attention or {}
    return {
        "dir": run,
        "summary": summary,
        "metrics": read_metrics(run),
        "similarity": (hp.get("attention") or {}).get(
            "similarity", hp.get("similarity")
        ),  # before the block: top level
        "attention_fields": attention_fields(hp),
        "positions": hp.get("positions"),
        "final": {**(summarize(attention["final"]) if attention.get("final") else {}), "w8a8": w8a8_change(summary)},
        "init": summarize(attention["init"]) if attention.get("init") else {},
    }


def attention_fields(hparams: dict[str, Any]) -> dict[str, Any]:
    """What a run's attention was: the fields of its attention block (a run from before the block: its top-level
    similarity), then `BESIDE_THE_BLOCK`, as its hyper-parameters hold them."""
    block = hparams.get("attention")
    fields = dict(block) if isinstance(block, dict) else {k: hparams[k] for k in ("similarity",) if k in hparams}
    return {**fields, **{k: hparams[k] for k in BESIDE_THE_BLOCK if k in hparams}}


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        elif not any(f"{prefix}{key}" == k or f"{prefix}{key}".startswith(k + ".") for k in IGNORED):
            out[f"{prefix}{key}"] = cli_value(value)
    return out


def _sweep_of(run_dir: Path) -> tuple[SweepStatus, str, SweepRun] | None:
    """(sweep.json, this run's name and entry) when the run folder lies below an `attnlab sweep` root."""
    here = run_dir.resolve()
    for parent in here.parents:
        status = SweepStatus.read(parent)
        if status.runs:
            # runs are found by name below the sweep's folder, wherever that folder was moved
            found = next(
                ((n, e) for n, e in status.runs.items() if (parent / n).resolve() in (here, *here.parents)), None
            )
            return (status, *found) if found else None
    return None


def _renamed(label: str, old: str, new: str) -> str:
    """A run's label with its sweep run name ``old`` (or as much of its end as the label shows) as ``new``."""
    parts, old_parts = label.split("/"), old.split("/")
    shown = next((n for n in range(len(old_parts), 0, -1) if parts[-n:] == old_parts[-n:]), 0)
    return "/".join(parts[: len(parts) - shown] + new.split("/")[-shown:]) if shown else label


def identify(run: dict[str, Any]) -> None:
    """Give a loaded run its seed, its cell's settings, label and names (`experiments.runfolder.setting_names`), its
    group and the group's reference values. A sweep's cell is named by its settings, whatever its folder's name."""
    found = _sweep_of(run["dir"])
    if found:
        status, name, entry = found
        grid = status.grid(entry) or {key: [value] for key, value in entry.cell.items()}
        cell = f"{Path(entry.config).stem}/{cell_label(entry.cell, grid)}"
        run.update(
            order=list(status.runs.values()).index(entry),
            seed=entry.seed,
            sweep=status.name,
            group=Path(entry.config).stem,
            cell=cell,
            label=_renamed(run["label"], name, f"{cell}/seed={entry.seed}"),
            settings={k: cli_value(v) for k, v in entry.cell.items()},
            values=dict(entry.cell),
            names=setting_names(entry.cell, grid),
            reference={k: cli_value(values[0]) for k, values in grid.items() if values},
        )
        return
    path = run["dir"] / "config.yaml"
    config = yaml.safe_load(path.read_text()) if path.is_file() else None
    config = config if isinstance(config, dict) else {"run": str(run["dir"])}  # without a config: a cell of its own
    settings = _flatten(config)
    run.update(
        order=None,
        seed=config.get("seed_everything"),
        sweep=None,
        group=run["summary"].modality or "-",
        cell=_SEED.sub("", run["label"]).strip("/") or run["label"],
        settings=settings,
        values=settings,
        names=None,  # by the keys that vary in its group: `group_cells`
        reference={},
    )


def one_per_seed(cell: dict[str, Any]) -> list[dict[str, Any]]:
    """The cell's runs but those of a seed that ran twice."""
    seeds = [r["seed"] for r in cell["runs"]]
    return [r for r in cell["runs"] if seeds.count(r["seed"]) == 1]


def by_seed(cell: dict[str, Any], key: str) -> dict[Any, float]:
    """seed -> the value of ``key`` of the cell's run with that seed: "best" (the checkpoint monitor's) or an
    attention statistic at the end (`STATS`); seeds that ran twice, or gave no value, left out."""
    runs = one_per_seed(cell)
    values = {r["seed"]: (r["summary"].best or {}).get("value") if key == "best" else r["final"].get(key) for r in runs}
    return {seed: value for seed, value in values.items() if value is not None}


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
        shared = {k: run[k] for k in ("group", "settings", "values", "names", "reference")}
        cell = cells.setdefault(key, {"label": label, **shared, "modality": run["summary"].modality or "-", "runs": []})
        cell["runs"].append(run)
        cell.setdefault("monitor", (run["summary"].best or {}).get("monitor"))
    out = list(cells.values())
    labels = [c["label"] for c in out]
    for cell in out:  # outside a sweep two cells may share a folder name: then each keeps its first run's full label
        if labels.count(cell["label"]) > 1:
            cell["label"] = cell["runs"][0]["label"]
    _name_varying(out)
    return out


def varying_keys(members: list[dict[str, Any]]) -> list[str]:
    """The settings whose value differs between the cells of one group."""
    return [k for k in members[0]["settings"] if len({c["settings"].get(k) for c in members}) > 1]


def _name_varying(cells: list[dict[str, Any]]) -> None:
    """Every cell gets `experiments.runfolder.setting_names` of each setting that varies in its group: a sweep's cells
    have those of its grid; the others' come from the values their group holds."""
    for group in dict.fromkeys(c["group"] for c in cells):
        members = [c for c in cells if c["group"] == group]
        keys = varying_keys(members)
        grid = {k: list(dict.fromkeys(c["settings"].get(k) for c in members)) for k in keys}
        for cell in members:
            cell["names"] = {**setting_names({k: cell["settings"].get(k) for k in keys}, grid), **(cell["names"] or {})}
