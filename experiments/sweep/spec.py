"""The sweep file: a dataclass parsed by jsonargparse (types and unknown keys), then what types cannot say
(distinct seeds, files that exist, non-empty grids); its runs and their `attnlab fit` commands; and the check of
every key and value with the real fit parser before any run starts."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
import sys
import tempfile
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from jsonargparse import ArgumentParser
from jsonargparse.typing import PositiveInt

from experiments.runfolder import cli_flags, cli_value


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


KEYS = tuple(f.name for f in fields(SweepFile))
LAUNCHERS = get_args(Launcher)
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
    sweep.grid, sweep.overrides, sweep.slurm = (
        spec.get("grid") or {},
        spec.get("overrides") or {},
        spec.get("slurm") or {},
    )
    for entry, raw in zip(sweep.configs, spec["configs"]):
        if isinstance(entry, ConfigEntry):
            entry.grid = raw.get("grid") or {}
    sweep.name = spec.get("name", path.stem)
    if not sweep.name or "/" in sweep.name:
        raise SweepError(f"{path}: name: expected {EXPECTED['name']}, got {sweep.name!r}")
    _nonempty(path, "grid", sweep.grid)
    for entry in sweep.configs:
        if isinstance(entry, ConfigEntry):
            _nonempty(path, f"configs[{entry.config}].grid", entry.grid)
    if not sweep.configs:
        raise SweepError(f"{path}: configs: expected {EXPECTED['configs']}, got []")
    if sweep.wandb is None and sweep.launcher == "wandb":
        sweep.wandb = WandbSettings()
    return sweep


def _nonempty(path: Path, where: str, grid: dict[str, list]) -> None:
    for key, values in grid.items():
        if not values:
            raise SweepError(f"{path}: {where}.{key}: expected a non-empty list of values, got {values!r}")


def _explain(error: str, spec: dict[str, Any]) -> str:
    """jsonargparse's error -> "KEY: expected ..., got VALUE" (the first bad element of a list)."""
    if found := re.search(r"^Group 'sweep' does not accept option '(\w+)'", error):
        return f"{found[1]}: not a sweep key; expected one of {', '.join(KEYS)}"
    if found := re.search(r"required: sweep\.(\w+)", error):
        key = found[1]
        return f"{key}: expected {'a non-empty list of integers' if key == 'seeds' else EXPECTED[key]}, got None"
    found = re.search(r'Parser key "sweep\.(\w+)"', error)
    key = found[1] if found else next(iter(spec))
    value = spec.get(key)
    if key == "seeds" and not isinstance(value, list):
        return f"seeds: expected a non-empty list of integers, got {value!r}"
    if key == "launcher":
        return f"launcher: {value!r} is not a launcher; expected one of {', '.join(LAUNCHERS)}"
    if key in ("grid", "configs"):
        entries = [value] if isinstance(value, (str, dict)) and key == "configs" else value
        if key == "configs" and isinstance(entries, list):
            for entry in entries:
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
    if not isinstance(grid, dict):
        return f": expected {EXPECTED['grid']}, got {grid!r}"
    for key, values in grid.items():
        if not isinstance(values, list):
            return f".{key}: expected a non-empty list of values, got {values!r}"
    return None


@dataclass(frozen=True)
class Run:
    name: str  # <config stem>/<key=value,...>/seed=<s>
    config: str
    cell: dict[str, Any]  # fit key -> value, in grid order
    seed: int
    folder: Path  # trainer.default_root_dir of the run

    @property
    def cell_name(self) -> str:
        return self.name.rpartition("/")[0]


@dataclass
class Sweep:
    file: Path
    name: str
    configs: list[tuple[str, dict[str, list]]]  # (config, its grid: the sweep's keys, then its own)
    seeds: list[int]
    overrides: dict[str, Any]
    root: Path
    launcher: str = "local"
    max_parallel: int = 1
    slurm: dict[str, Any] = field(default_factory=dict)
    wandb: WandbSettings | None = None
    extra: list[str] = field(default_factory=list)  # fit arguments given after `--`

    def runs(self) -> list[Run]:
        runs = []
        for config, grid in self.configs:
            short = _short_keys(list(grid))
            for cell in _product(grid):
                label = ",".join(f"{short[k]}={_folder_value(v)}" for k, v in cell.items()) or "base"
                for seed in self.seeds:
                    name = f"{Path(config).stem}/{label}/seed={seed}"
                    runs.append(Run(name, config, cell, seed, self.root / name))
        return runs

    def command(self, run: Run) -> list[str]:
        return [sys.executable, "-m", "experiments.cli", *self.fit_args(run)]

    def fit_args(self, run: Run) -> list[str]:
        args = [
            "fit",
            "--config",
            run.config,
            "--seed_everything",
            str(run.seed),
            "--trainer.default_root_dir",
            str(run.folder),
            "--ckpt_path",
            "last",
            *cli_flags(self.overrides),
            *cli_flags(run.cell),
        ]  # the cell's values win over overrides
        if self.wandb is not None:
            args.append("--trainer.logger=" + json.dumps(self._loggers(run)))
        return args + self.extra

    def _loggers(self, run: Run) -> list[dict[str, Any]]:
        settings = {**run.cell, **self.overrides}
        short = _short_keys(list(settings))
        tags = [f"{short[k]}={_folder_value(v)}"[:64] for k, v in settings.items()] + [f"seed={run.seed}"]
        wandb_args = {
            "project": self.wandb.project,
            "entity": self.wandb.entity,
            "name": run.name,
            "group": self.name,
            "tags": tags,
        }
        return [
            {"class_path": "experiments.tracking.CSVLogger"},  # the run folder stays lightning_logs/version_0
            {"class_path": "experiments.tracking.WandbLogger", "init_args": wandb_args},
        ]

    def env(self, run: Run) -> dict[str, str]:
        """The W&B job type: experiments.tracking.WandbLogger takes none, so it goes by the environment every process
        of the run inherits."""
        return {"WANDB_JOB_TYPE": run.cell_name[:64]} if self.wandb is not None else {}


def _product(grid: dict[str, list]) -> list[dict[str, Any]]:
    cells: list[dict[str, Any]] = [{}]
    for key, values in grid.items():
        cells = [{**cell, key: value} for cell in cells for value in values]
    return cells


def _short_keys(keys: list[str]) -> dict[str, str]:
    """model.init_args.similarity -> similarity, unless two keys end alike (then both keep their full name)."""
    last = [k.rpartition(".")[2] for k in keys]
    return {k: (s if last.count(s) == 1 else k) for k, s in zip(keys, last)}


def _folder_value(value: Any) -> str:
    return re.sub(r"[/\s]+", "_", cli_value(value))


def load(path: str | Path, root: str | None = None, extra: list[str] | None = None) -> Sweep:
    """Read and check the sweep file (its fit keys and values are checked by `check`)."""
    path = Path(path)
    try:
        spec = yaml.safe_load(path.read_text())
    except OSError as err:
        raise SweepError(f"{path}: cannot be read ({err.strerror})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise SweepError(f"{path}: not a YAML file{where}: {getattr(err, 'problem', None) or err}") from None
    spec = parse(path, spec)
    configs = []
    for entry in spec.configs:
        config, own = (entry.config, entry.grid) if isinstance(entry, ConfigEntry) else (entry, {})
        if not Path(config).is_file():
            raise SweepError(f"{path}: configs: {config!r} is not a file (paths are relative to the current folder)")
        configs.append((config, {**{str(k): v for k, v in spec.grid.items()}, **own}))
    stems = [Path(c).stem for c, _ in configs]
    if len(set(stems)) != len(stems):
        raise SweepError(
            f"{path}: configs: two experiments share the name {max(stems, key=stems.count)!r}; "
            "runs are named by the file's stem"
        )
    root_dir = Path(root or spec.root or Path("runs/sweeps") / spec.name)
    return Sweep(
        path,
        spec.name,
        configs,
        spec.seeds,
        spec.overrides,
        root_dir,
        spec.launcher,
        spec.max_parallel,
        spec.slurm,
        spec.wandb,
        list(extra or []),
    )


def _parse_error(args: list[str]) -> str | None:
    """The real `attnlab fit` parser on ``args`` (--print_config: nothing is instantiated); its error line or None."""
    from experiments.cli import main as attnlab

    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            attnlab([*args, "--print_config"])
    except SystemExit as exit_:
        if exit_.code:
            lines = [line for line in err.getvalue().splitlines() if line.strip()]
            return (lines[-1] if lines else f"exit status {exit_.code}").removeprefix("attnlab: error: ")
    return None


def check(sweep: Sweep) -> None:
    """Every config with the overrides, then every grid value, through the real parser; the first error as one line."""
    if sweep.launcher == "slurm":
        from experiments.sweep.launch import slurm_executor

        with tempfile.TemporaryDirectory() as folder:  # submitit makes its folder: none in the sweep's before a run
            slurm_executor(sweep, Path(folder))
    if sweep.launcher == "wandb":
        from experiments.tracking import wandb_mode

        if (mode := wandb_mode()) != "online":
            raise SweepError(
                f"{sweep.file}: launcher: wandb needs W&B online (wandb login or WANDB_API_KEY); W&B mode is {mode}"
            )
    for config, grid in sweep.configs:
        if error := _parse_error(["fit", "--config", config]):
            raise SweepError(f"{sweep.file}: configs: {config}: {error}")
        base = sweep.fit_args(Run("check", config, {}, sweep.seeds[0], sweep.root / "check"))
        if error := _parse_error(base):
            raise SweepError(f"{sweep.file}: overrides ({config}): {error}")
        for key, values in grid.items():
            for value in values:
                if error := _parse_error([*base, f"--{key}={cli_value(value)}"]):
                    raise SweepError(f"{sweep.file}: grid.{key}={cli_value(value)} ({config}): {error}")
