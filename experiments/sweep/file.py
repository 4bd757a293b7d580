"""The sweep file: a dataclass parsed by jsonargparse (types, unknown keys), then what types cannot say (distinct
seeds, non-empty grids); every error one line that names the key and the value."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args

from jsonargparse import ArgumentParser
from jsonargparse.typing import PositiveInt


class SweepError(ValueError):
    """A bad sweep file: one line naming the file and the key."""


@dataclass
class ConfigEntry:
    """An experiment with grid keys of its own: ``{config: FILE, grid: {KEY: [...]}}``."""

    config: str
    grid: dict[str, list] = field(default_factory=dict)


@dataclass
class WandbSettings:
    project: str = "attnlab"
    entity: str | None = None


@dataclass
class ReportSettings:
    title: str | None = None  # default: "attnlab: sweep <name>"
    scaling: bool = False  # print the √d table beside the cells too (report.md has it whenever similarities differ)


Launcher = Literal["local", "slurm", "wandb"]


@dataclass(kw_only=True)
class SweepFile:
    """The keys of a sweep file (the module docstring of `experiments.sweep` shows one); values of ``grid`` and
    ``overrides`` stay as YAML gave them (a string "1e-3" is not made a number)."""

    name: str | None = None  # default: the file's stem
    configs: list[str | ConfigEntry]
    grid: dict[str, list] = field(default_factory=dict)
    seeds: list[int]
    overrides: dict[str, Any] = field(default_factory=dict)
    root: str | None = None  # default: runs/sweeps/<name>
    launcher: Launcher = "local"
    max_parallel: PositiveInt = 1
    slurm: dict[str, Any] = field(default_factory=dict)  # submitit's parameters
    wandb: WandbSettings | None = None
    report: ReportSettings | None = None


EXPECTED = {  # what a key takes, in the words of the error line
    "configs": "one or more experiment YAML files",
    "seeds": "distinct integers",
    "name": "a word for the sweep's folder and W&B group",
    "grid": "a mapping of fit keys to lists of values",
    "overrides": "a mapping of fit keys to values",
    "root": "a folder",
    "max_parallel": "a positive integer",
    "slurm": "a mapping of submitit parameters",
    "wandb": "a mapping with project and entity",
    "report": "a mapping with title and scaling",
}
_PARSER = ArgumentParser(exit_on_error=False)
_PARSER.add_class_arguments(SweepFile, "sweep")


def parse(path: Path, spec: Any) -> SweepFile:
    """The YAML mapping ``spec`` of the sweep file ``path`` -> a checked SweepFile; SweepError names the key."""
    if not isinstance(spec, dict):
        raise SweepError(
            f"{path}: a sweep file is a mapping (name, configs, grid, seeds, ...), got {type(spec).__name__}"
        )
    if isinstance(spec.get("configs"), (str, dict)):  # one experiment
        spec = {**spec, "configs": [spec["configs"]]}
    try:
        sweep = _PARSER.instantiate(
            _PARSER.parse_object({"sweep": copy.deepcopy(spec)})
        ).sweep  # it edits what it reads
    except Exception as err:  # jsonargparse's ArgumentError: several lines; ours names the key and the value
        raise SweepError(f"{path}: {_explain(str(err), spec)}") from None
    if not sweep.seeds:
        raise SweepError(f"{path}: seeds: expected a non-empty list of integers, got []")
    if len(set(sweep.seeds)) != len(sweep.seeds):
        raise SweepError(f"{path}: seeds: expected distinct integers, got {sweep.seeds!r}")
    # free-form values as YAML gave them: jsonargparse would read the string "1e-3" as a number
    for key in ("grid", "overrides", "slurm"):
        setattr(sweep, key, spec.get(key) or {})
    sweep.name = spec.get("name", path.stem)
    if not sweep.name or "/" in sweep.name:
        raise SweepError(f"{path}: name: expected {EXPECTED['name']}, got {sweep.name!r}")
    if where := _bad_grid(sweep.grid):
        raise SweepError(f"{path}: grid{where}")
    for entry, raw in zip(sweep.configs, spec["configs"]):
        if isinstance(entry, ConfigEntry):
            entry.grid = raw.get("grid") or {}
            if where := _bad_grid(entry.grid):
                raise SweepError(f"{path}: configs[{entry.config}].grid{where}")
    if not sweep.configs:
        raise SweepError(f"{path}: configs: expected {EXPECTED['configs']}, got []")
    if sweep.wandb is None and sweep.launcher == "wandb":
        sweep.wandb = WandbSettings()
    sweep.report = sweep.report or ReportSettings()
    return sweep


def _explain(error: str, spec: dict[str, Any]) -> str:
    """jsonargparse's error -> "KEY: expected ..., got VALUE" (the first bad element of a list)."""
    if found := re.search(r"^Group 'sweep' does not accept option '(\w+)'", error):
        return f"{found[1]}: not a sweep key; expected one of {', '.join(f.name for f in fields(SweepFile))}"
    if found := re.search(r"required: sweep\.(\w+)", error):
        key = found[1]
        return f"{key}: expected {'a non-empty list of integers' if key == 'seeds' else EXPECTED[key]}, got None"
    found = re.search(r'Parser key "sweep\.(\w+)"', error)
    key = found[1] if found else next(iter(spec))
    value = spec.get(key)
    if key == "seeds" and not isinstance(value, list):
        return f"seeds: expected a non-empty list of integers, got {value!r}"
    if key == "launcher":
        return f"launcher: {value!r} is not a launcher; expected one of {', '.join(get_args(Launcher))}"
    if key == "configs" and isinstance(value, list):  # parse made one experiment a list
        for entry in value:
            if isinstance(entry, dict) and ("config" not in entry or set(entry) - {"config", "grid"}):
                return f"configs: an entry is a file or {{config: FILE, grid: {{...}}}}, got {entry!r}"
            if isinstance(entry, dict) and (where := _bad_grid(entry.get("grid") or {})):
                return f"configs[{entry['config']}].grid{where}"
    if key == "grid" and (where := _bad_grid(value)):
        return f"grid{where}"
    got = re.search(r"Got value: (.*)", error)
    if isinstance(value, list) and got:  # jsonargparse prints the element it rejected
        value = next((v for v in value if str(v) == got[1].strip()), value)
    return f"{key}: expected {EXPECTED.get(key, 'another value')}, got {value!r}"


def _bad_grid(grid: Any) -> str | None:
    """What is wrong with a grid, after its name (": expected ..." or ".KEY: expected ..."); None when nothing."""
    if not isinstance(grid, dict):
        return f": expected {EXPECTED['grid']}, got {grid!r}"
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            return f".{key}: expected a non-empty list of values, got {values!r}"
    return None
