"""The sweep: its runs (config x grid cell x seed) and their `attnlab fit` commands, read from the sweep file, and
the check of every key and value with the real fit parser before any run starts."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from experiments.cli_checks import yaml_error
from experiments.runfolder import SweepStatus, cell_label, cli_flags, cli_value, legacy_cell_label, setting_names
from experiments.sweep.file import ConfigEntry, SweepError, SweepFile, parse


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


@dataclass(kw_only=True)
class Sweep(SweepFile):
    """The sweep file's keys, with each config's grid resolved, the root decided and the fit arguments after `--`."""

    file: Path
    configs: list[tuple[str, dict[str, list]]]  # (config, its grid: the sweep's keys, then its own)
    root: Path
    extra: list[str] = field(default_factory=list)

    def runs(self) -> list[Run]:
        """Seed by seed, every cell of every config within a seed: a sweep stopped part-way has every cell on the
        same seeds, so each cell's paired comparison with its reference already holds. A run keeps the folder it was
        begun in under `legacy_cell_label`."""
        cells = []
        for config, grid in self.configs:
            for cell in (dict(zip(grid, values)) for values in itertools.product(*grid.values())):
                cells.append((config, cell, cell_label(cell, grid), legacy_cell_label(cell)))
        begun = SweepStatus.read(self.root).runs
        runs = []
        for seed in self.seeds:
            for config, cell, label, legacy in cells:
                name, old = (f"{Path(config).stem}/{x}/seed={seed}" for x in (label, legacy))
                if old != name and (old in begun or (self.root / old).is_dir()):
                    name = old
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
            settings = {**run.cell, **self.overrides}
            names = setting_names(settings, {k: [v] for k, v in settings.items()}).values()
            tags = [name[:64] for leaves in names for name in leaves] + [f"seed={run.seed}"]
            wandb_args = {**dataclasses.asdict(self.wandb), "name": run.name, "group": self.name, "tags": tags}
            loggers = [
                {"class_path": "experiments.tracking.CSVLogger"},  # the run folder stays lightning_logs/version_0
                {"class_path": "experiments.tracking.WandbLogger", "init_args": wandb_args},
            ]
            args.append("--trainer.logger=" + json.dumps(loggers))
        return args + self.extra

    def env(self, run: Run) -> dict[str, str]:
        """The W&B job type: experiments.tracking.WandbLogger takes none, so it goes by the environment every process
        of the run inherits."""
        return {"WANDB_JOB_TYPE": run.cell_name[:64]} if self.wandb is not None else {}


def load(path: str | Path, root: str | None = None, extra: list[str] | None = None) -> Sweep:
    """Read and check the sweep file (its fit keys and values are checked by `check`)."""
    path = Path(path)
    try:
        spec = yaml.safe_load(path.read_text())
    except OSError as err:
        raise SweepError(f"{path}: cannot be read ({err.strerror})") from None
    except yaml.YAMLError as err:
        raise SweepError(yaml_error(path, err)) from None
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
    root = Path(root or spec.root or Path("runs/sweeps") / spec.name)
    sweep = Sweep(**{**vars(spec), "configs": configs, "root": root}, file=path, extra=list(extra or []))
    names = [run.name for run in sweep.runs()]
    if len(set(names)) < len(names):
        shared = max(names, key=names.count).rpartition("/")[0]
        raise SweepError(f"{path}: grid: two cells would share the run folder {shared!r}; give them values that differ")
    return sweep


def slurm_executor(sweep: Sweep, folder: Path):
    """submitit's executor with the sweep's ``slurm`` parameters (``cluster: local`` runs the jobs here)."""
    import submitit

    params = dict(sweep.slurm)
    cluster = params.pop("cluster", None)
    try:
        executor = submitit.AutoExecutor(folder=folder, cluster=cluster)
        executor.update_parameters(name=sweep.name, **params)
    except (AssertionError, NameError, ValueError, TypeError, RuntimeError) as err:
        raise SweepError(f"{sweep.file}: slurm: {str(err).strip().splitlines()[0]}") from None
    return executor


def _parse_error(args: list[str]) -> str | None:
    """The real `attnlab fit` parser on ``args`` (--print_config: nothing is instantiated); its error line or None."""
    from experiments.trainer_cli import CheckingCLI, main

    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            main([*args, "--print_config"], cli=CheckingCLI)
    except SystemExit as exit_:
        if exit_.code:
            lines = [line for line in err.getvalue().splitlines() if line.strip()]
            return (lines[-1] if lines else f"exit status {exit_.code}").removeprefix("attnlab: error: ")
    return None


def check(sweep: Sweep) -> None:
    """Every config with the overrides, then every grid value, through the real parser; the first error as one line."""
    if sweep.launcher == "slurm":
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
            raise SweepError(f"{sweep.file}: configs: {config}: {error.removeprefix(f'{config}: ')}")
        base = sweep.fit_args(Run("check", config, {}, sweep.seeds[0], sweep.root / "check"))
        if error := _parse_error(base):
            raise SweepError(f"{sweep.file}: overrides ({config}): {error}")
        for key, values in grid.items():
            for value in values:
                if error := _parse_error([*base, f"--{key}={cli_value(value)}"]):
                    raise SweepError(f"{sweep.file}: grid.{key}={cli_value(value)} ({config}): {error}")
