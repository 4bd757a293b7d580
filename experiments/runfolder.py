"""The run folder's schema: ``summary.json`` (one run) and ``sweep.json`` (one sweep) as dataclasses with read and
write, metrics.csv cut back to a resumed step, the newest checkpoint below a folder, and a setting as it goes on the
`attnlab fit` command line.

A run folder (``<default_root_dir>/lightning_logs/version_N``) holds ``config.yaml``, ``hparams.yaml``, ``metrics.csv``,
``checkpoints/{best,last}*.ckpt``, ``attention.png``, ``summary.json`` and, when its attention block names classes
of one's own, ``attention_sources/`` (`experiments.provenance`); a sweep's root holds ``sweep.json``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import re
import socket
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from experiments.renames import renamed

SUMMARY = "summary.json"
SWEEP = "sweep.json"
METRICS = "metrics.csv"
HEARTBEAT_S = 60  # a running fit refreshes its summary's heartbeat at the first batch end this long after the last
STALE_S = 600  # a run on another host whose heartbeat is older than this shows as "stale"


def read_json(path: Path | None) -> dict[str, Any]:
    """The JSON object in ``path``; {} when there is no path, no file, or no readable JSON object in it."""
    try:
        data = json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json(path: Path, data: dict[str, Any] | list, indent: int | None = 1) -> None:
    """Write ``data`` whole: a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=indent))
    tmp.replace(path)


def drop_rows_from(path: Path, step: int) -> None:
    """Drop the rows of ``step`` and later from a metrics.csv (rewritten whole, as `write_json` does): those that a
    killed run logged after the checkpoint which a resumed run continues from at global step ``step``, and which the
    resumed run logs again. Lightning numbers a row by the optimizer steps taken before it."""
    if not path.is_file():
        return
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    kept = [row for row in rows if int(float(row.get("step") or 0)) < step]
    if len(kept) == len(rows):
        return
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=reader.fieldnames or [])
        writer.writeheader()
        writer.writerows(kept)
    tmp.replace(path)


def newest(paths) -> Path | None:
    """The most recently modified of ``paths`` that exist as files."""
    found = [Path(p) for p in paths if p and Path(p).is_file()]
    return max(found, key=lambda p: p.stat().st_mtime_ns) if found else None


def newest_checkpoint(root: str | Path, alias: str = "last") -> Path | None:
    """The newest ``<alias>*.ckpt`` in a ``checkpoints/`` folder anywhere below ``root`` (``last`` or ``best``)."""
    return newest(Path(root).glob(f"**/checkpoints/{alias}*.ckpt"))


def cli_value(value: Any) -> str:
    """A setting as `attnlab fit` takes it on the command line: strings as they are, the rest as JSON (JSON is YAML:
    true, null, [1, 2], {a: 1})."""
    return value if isinstance(value, str) else json.dumps(value)


def cli_flags(settings: dict[str, Any]) -> list[str]:
    """{"trainer.max_epochs": 3} -> ["--trainer.max_epochs=3"]."""
    return [f"--{key}={cli_value(value)}" for key, value in settings.items()]


def setting_leaves(key: str, value: Any) -> dict[str, Any]:
    """The fit keys a setting sets: a mapping (a block's fields, a class's ``class_path`` and ``init_args``) by its
    leaves, a ``class_path`` under the key of its class. {"model.init_args": {"attention": {"gate": "x"}}} ->
    {"model.init_args.attention.gate": "x"}."""
    if not isinstance(value, dict) or not value:
        return {key: value}
    out: dict[str, Any] = {}
    for name, inner in value.items():
        out.update(setting_leaves(key if name == "class_path" else f"{key}.{name}", inner))
    return out


def short_names(keys: list[str]) -> dict[str, str]:
    """Each fit key by its shortest tail (``init_args`` left out) that no other key ends in:
    model.init_args.attention.normalization.init_args.k -> k, or normalization.k beside a similarity's k."""
    parts = {key: [p for p in key.split(".") if p != "init_args"] for key in keys}
    out = {}
    for key, own in parts.items():
        others = [p for k, p in parts.items() if k != key]
        tails = (".".join(own[-n:]) for n in range(1, len(own) + 1))
        out[key] = next((t for t in tails if all(".".join(p[-t.count(".") - 1 :]) != t for p in others)), key)
    return out


def setting_text(value: Any) -> str:
    """A leaf value in a cell's name and in a folder's: as on the command line, a slash or a space as "_"."""
    return re.sub(r"[/\s]+", "_", cli_value(value))


def setting_names(cell: dict[str, Any], grid: dict[str, list]) -> dict[str, list[str]]:
    """Each setting of a cell as "name=value" of its leaves, named by `short_names` over every leaf that the grid's
    values set: {"model.init_args": {"attention": {"normalization": "clipped"}}} ->
    {"model.init_args": ["normalization=clipped"]}."""
    leaves = [leaf for key, values in grid.items() for value in values for leaf in setting_leaves(key, value)]
    leaves += [leaf for key, value in cell.items() for leaf in setting_leaves(key, value)]
    short = short_names(list(dict.fromkeys(leaves)))
    return {
        key: [f"{short[leaf]}={setting_text(v)}" for leaf, v in setting_leaves(key, value).items()]
        for key, value in cell.items()
    }


def cell_label(cell: dict[str, Any], grid: dict[str, list]) -> str:
    """A sweep cell's folder name and label: `setting_names` joined, "normalization=clipped,alpha=4"; "base" for
    none."""
    return ",".join(name for names in setting_names(cell, grid).values() for name in names) or "base"


def legacy_cell_label(cell: dict[str, Any]) -> str:
    """The folder name a sweep cell had before `cell_label`: each grid key by its last part (the full key when two
    end alike), a mapping as {key=value,...}; sweeps begun then keep their folders."""
    last = [k.rpartition(".")[2] for k in cell]
    short = {k: (s if last.count(s) == 1 else k) for k, s in zip(cell, last)}

    def text(value: Any) -> str:
        if isinstance(value, dict):
            return "{" + ",".join(f"{k}={text(v)}" for k, v in value.items()) + "}"
        return setting_text(value)

    return ",".join(f"{short[k]}={text(v)}" for k, v in cell.items()) or "base"


def split_extra(argv: list[str]) -> tuple[list[str], list[str]]:
    """``[own arguments] -- [extra attnlab fit arguments]`` -> (own, extra)."""
    if "--" not in argv:
        return list(argv), []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


class _Record:
    """A JSON object as a dataclass: known keys as fields, the others kept in ``extra`` and written back."""

    extra: dict[str, Any]

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        record = cls()
        record.update(**data)
        return record

    def update(self, **values: Any) -> None:
        """Set fields by name; other names go to ``extra``."""
        names = {f.name for f in dataclasses.fields(self)} - {"extra"}
        for key, value in values.items():
            if key in names:
                setattr(self, key, value)
            else:
                self.extra[key] = value

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set (not None), then ``extra``."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        return {**{k: v for k, v in out.items() if v is not None}, **self.extra}


@dataclass
class Summary(_Record):
    """``summary.json``: what a run was (model, data, size, hardware) and what it gave (best metric, attention
    statistics, throughput). ``status``: running, finished, failed or interrupted; `state` tells a running run from
    one whose process is gone."""

    status: str | None = None
    started: str | None = None
    pid: int | None = None  # the training process (rank 0), on ``host``
    host: str | None = None
    heartbeat: str | None = None  # UTC ISO time, refreshed while it trains (HEARTBEAT_S)
    experiment: str | None = None  # trainer.default_root_dir
    run_dir: str | None = None
    modality: str | None = None
    model: str | None = None
    hparams: dict[str, Any] | None = None
    attention_sources: list[dict[str, str]] | None = None  # experiments.provenance: files of one's own; [] for none
    dataset: str | None = None
    data: dict[str, Any] | None = None
    params: dict[str, int] | None = None  # {"total", "trainable"}
    trainer: dict[str, Any] | None = None
    hardware: dict[str, Any] | None = None
    versions: dict[str, str] | None = None
    wandb: list[dict[str, Any]] | None = None  # the run's W&B runs: {"id", "mode", "dir", ...}
    resumed_from: str | None = None
    finished: str | None = None
    train_time_s: float | None = None
    global_step: int | None = None
    epochs: int | None = None
    flops_per_sample: float | None = None
    throughput: dict[str, float | None] | None = None  # {"samples_per_s", "tokens_per_s"}
    grad_norm: dict[str, float | None] | None = None  # {"first", "mean"}
    best: dict[str, Any] | None = None  # {"monitor", "mode", "value", "checkpoint"}
    metrics: dict[str, float] | None = None
    attention: dict[str, Any] | None = (
        None  # {"init", "final"}: experiments.callbacks.attention_stats.attention_statistics
    )
    quantization: dict[str, Any] | None = None  # experiments.callbacks.W8A8: {"scheme", "layers", "val", "test" ...}
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path) -> Summary:
        """A run folder's summary (``path``: the file or its folder); an empty one when there is none."""
        path = Path(path)
        return cls.from_dict(renamed(read_json(path / SUMMARY if path.is_dir() else path)))

    def write(self, path: Path) -> None:
        write_json(Path(path), self.to_dict())

    def state(self) -> str | None:
        """``status`` as it stands now. A run that says running is "killed" when its process is gone (on this host:
        its pid no longer exists) and "stale" when, on another host, its heartbeat is older than STALE_S (killed,
        or cut off from this folder); without pid and heartbeat it stays running."""
        if self.status != "running" or self.pid is None:
            return self.status
        if self.host == socket.gethostname():
            return "running" if alive(self.pid) else "killed"
        try:
            age = (datetime.now(timezone.utc) - datetime.fromisoformat(self.heartbeat or "")).total_seconds()
        except (TypeError, ValueError):  # no heartbeat, or one without a time zone
            return self.status
        return "stale" if age > STALE_S else "running"


def now_utc() -> str:
    """The time as a heartbeat holds it: UTC, ISO 8601, to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def run_summary(folder: Path) -> Summary | None:
    """The newest summary.json of a run folder below ``folder`` (a run's trainer.default_root_dir); None without one."""
    path = newest(Path(folder).glob(f"lightning_logs/*/{SUMMARY}"))
    return Summary.read(path) if path else None


@dataclass
class SweepRun(_Record):
    """One run's entry in ``sweep.json``. ``status``: pending, running, done, failed or interrupted."""

    config: str | None = None  # the experiment YAML
    cell: dict[str, Any] = field(default_factory=dict)  # fit key -> value
    cell_name: str | None = None  # <config stem>/<key=value,...>
    seed: int | None = None
    folder: str | None = None  # trainer.default_root_dir of the run
    command: str | None = None
    status: str | None = None
    started: str | None = None
    finished: str | None = None
    returncode: int | None = None
    error: str | None = None  # the line that says why it failed
    gpu: str | None = None
    job_id: str | None = None  # submitit's
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class SweepStatus(_Record):
    """``<root>/sweep.json``: the sweep (its file, name, seeds and each config's grid) and every run by name."""

    file: str | None = None
    name: str | None = None
    launcher: str | None = None
    seeds: list[int] | None = None
    configs: dict[str, dict[str, Any]] | None = None  # config stem -> {"config": file, "grid": {key: values}}
    wandb_sweep: str | None = None  # entity/project/id of the W&B sweep
    runs: dict[str, SweepRun] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SweepStatus:
        status = super().from_dict(data)
        status.runs = {name: SweepRun.from_dict(entry) for name, entry in (status.runs or {}).items()}
        return status

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["runs"] = {name: run.to_dict() for name, run in self.runs.items()}
        return out

    @classmethod
    def read(cls, root: Path) -> SweepStatus:
        """The status of the sweep whose folder is ``root``; an empty one when it has none."""
        return cls.from_dict(renamed(read_json(Path(root) / SWEEP)))

    def write(self, root: Path) -> None:
        write_json(Path(root) / SWEEP, self.to_dict())

    def grid(self, run: SweepRun) -> dict[str, list]:
        """The grid of the run's experiment: its first values are the reference of a paired comparison."""
        return ((self.configs or {}).get(Path(run.config or "").stem) or {}).get("grid") or {}


def is_finished(folder: Path) -> bool:
    """A finished summary.json in a run folder below ``folder`` (a run's trainer.default_root_dir)."""
    return any(Summary.read(p).status == "finished" for p in Path(folder).glob(f"lightning_logs/*/{SUMMARY}"))
