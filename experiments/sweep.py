"""`attnlab sweep FILE.yaml [--dry-run] [--root DIR] [-- extra fit arguments]`: grids x seeds of `attnlab fit`.

A sweep file (see configs/sweeps/)::

    name: digits_similarity                  # default: the file's stem
    configs: [configs/vision/digits.yaml]    # one or more experiments; an entry may add grid keys of its own:
                                             #   {config: configs/compare/text.yaml, grid: {KEY: [...]}}
    grid:                                    # any `attnlab fit` key -> the values to try
      model.init_args.similarity: [scaled_dot, dot]
    seeds: [0, 1]                            # --seed_everything of each run
    overrides: {trainer.max_epochs: 5}       # applied to every run
    root: runs/sweeps/digits_similarity      # the default
    launcher: local                          # local | slurm | wandb
    max_parallel: 1                          # local and wandb: runs (agents) at once, one GPU each when there are GPUs
    slurm: {timeout_min: 240, gpus_per_node: 1, slurm_partition: gpu}  # submitit's parameters; cluster: local runs here
    wandb: {project: attnlab, entity: null}  # log to W&B: group = sweep name, job type = cell, tags = settings

One run per (config x grid cell x seed), named ``<config stem>/<key=value,...>/seed=<s>`` (keys by their last
part), trained by ``python -m experiments.cli fit --config C --seed_everything S --trainer.default_root_dir
ROOT/NAME --ckpt_path last <overrides> <cell> <extra>`` in a subprocess (its output in ``ROOT/NAME/sweep.log``).
``ROOT/sweep.json`` records each run: pending, running, done, failed (with the error line) or interrupted.
Running the sweep again skips finished runs and resumes the others from their ``last.ckpt`` (``--ckpt_path
last`` starts a run that has none); a finished run is never started again. Every key and value is checked
with the real parser before any run starts. The W&B launcher creates a W&B sweep over the run names whose
agents call ``attnlab sweep FILE --agent --run=NAME``: each run's settings reach `attnlab fit`, and so every
DDP process, as command-line arguments. Compare the runs with ``attnlab compare ROOT``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

KEYS = ("name", "configs", "grid", "seeds", "overrides", "root", "launcher", "max_parallel", "slurm", "wandb")
LAUNCHERS = ("local", "slurm", "wandb")
STATUS = "sweep.json"
LOG = "sweep.log"
INTERRUPTED = 143  # what attnlab fit exits with after SIGTERM (last.ckpt saved)


class SweepError(ValueError):
    """A bad sweep file: one line naming the file and the key."""


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
    wandb: dict[str, Any] | None = None
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
            *_flags(self.overrides),
            *_flags(run.cell),
        ]  # the cell's values win over overrides
        if self.wandb is not None:
            args.append("--trainer.logger=" + json.dumps(self._loggers(run)))
        return args + self.extra

    def _loggers(self, run: Run) -> list[dict[str, Any]]:
        settings = {**run.cell, **self.overrides}
        short = _short_keys(list(settings))
        tags = [f"{short[k]}={_folder_value(v)}"[:64] for k, v in settings.items()] + [f"seed={run.seed}"]
        wandb_args = {
            "project": self.wandb.get("project", "attnlab"),
            "entity": self.wandb.get("entity"),
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


def cli_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)  # JSON is YAML: true, null, [1, 2], {a: 1}


def _folder_value(value: Any) -> str:
    return re.sub(r"[/\s]+", "_", cli_value(value))


def _flags(settings: dict[str, Any]) -> list[str]:
    return [f"--{key}={cli_value(value)}" for key, value in settings.items()]


def load(path: str | Path, root: str | None = None, extra: list[str] | None = None) -> Sweep:
    """Read and check the sweep file's structure (the keys and values are checked by `check`)."""
    path = Path(path)
    try:
        spec = yaml.safe_load(path.read_text())
    except OSError as err:
        raise SweepError(f"{path}: cannot be read ({err.strerror})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise SweepError(f"{path}: not a YAML file{where}: {getattr(err, 'problem', None) or err}") from None
    if not isinstance(spec, dict):
        raise SweepError(
            f"{path}: a sweep file is a mapping (name, configs, grid, seeds, ...), got {type(spec).__name__}"
        )
    for key in spec:
        if key not in KEYS:
            raise SweepError(f"{path}: {key}: not a sweep key; expected one of {', '.join(KEYS)}")
    name = spec.get("name", path.stem)
    if not isinstance(name, str) or not name or "/" in name:
        raise SweepError(f"{path}: name: expected a word for the sweep's folder and W&B group, got {name!r}")
    grid = _grid(path, "grid", spec.get("grid") or {})
    configs = _configs(path, spec.get("configs"), grid)
    seeds = spec.get("seeds")
    if not isinstance(seeds, list) or not seeds:
        raise SweepError(f"{path}: seeds: expected a non-empty list of integers, got {seeds!r}")
    bad = [s for s in seeds if not isinstance(s, int) or isinstance(s, bool)]
    if bad or len(set(seeds)) != len(seeds):
        raise SweepError(f"{path}: seeds: expected distinct integers, got {bad[0] if bad else seeds!r}")
    overrides = spec.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise SweepError(f"{path}: overrides: expected a mapping of fit keys to values, got {overrides!r}")
    launcher = spec.get("launcher", "local")
    if launcher not in LAUNCHERS:
        raise SweepError(f"{path}: launcher: {launcher!r} is not a launcher; expected one of {', '.join(LAUNCHERS)}")
    max_parallel = spec.get("max_parallel", 1)
    if not isinstance(max_parallel, int) or isinstance(max_parallel, bool) or max_parallel < 1:
        raise SweepError(f"{path}: max_parallel: expected a positive integer, got {max_parallel!r}")
    slurm = spec.get("slurm") or {}
    if not isinstance(slurm, dict):
        raise SweepError(f"{path}: slurm: expected a mapping of submitit parameters, got {slurm!r}")
    wandb = spec.get("wandb", {} if launcher == "wandb" else None)
    if wandb is not None and (not isinstance(wandb, dict) or set(wandb) - {"project", "entity"}):
        raise SweepError(f"{path}: wandb: expected a mapping with project and entity, got {wandb!r}")
    root_dir = Path(root or spec.get("root") or Path("runs/sweeps") / name)
    return Sweep(
        path, name, configs, seeds, overrides, root_dir, launcher, max_parallel, slurm, wandb, list(extra or [])
    )


def _grid(path: Path, where: str, grid: Any) -> dict[str, list]:
    if not isinstance(grid, dict):
        raise SweepError(f"{path}: {where}: expected a mapping of fit keys to lists of values, got {grid!r}")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise SweepError(f"{path}: {where}.{key}: expected a non-empty list of values, got {values!r}")
    return {str(k): v for k, v in grid.items()}


def _configs(path: Path, entries: Any, grid: dict[str, list]) -> list[tuple[str, dict[str, list]]]:
    entries = [entries] if isinstance(entries, (str, dict)) else entries
    if not isinstance(entries, list) or not entries:
        raise SweepError(f"{path}: configs: expected one or more experiment YAML files, got {entries!r}")
    configs = []
    for entry in entries:
        own = {}
        if isinstance(entry, dict):
            if set(entry) - {"config", "grid"} or "config" not in entry:
                raise SweepError(
                    f"{path}: configs: an entry is a file or {{config: FILE, grid: {{...}}}}, got {entry!r}"
                )
            entry, own = entry["config"], _grid(path, f"configs[{entry['config']}].grid", entry.get("grid") or {})
        if not isinstance(entry, str) or not Path(entry).is_file():
            raise SweepError(f"{path}: configs: {entry!r} is not a file (paths are relative to the current folder)")
        configs.append((entry, {**grid, **own}))
    stems = [Path(c).stem for c, _ in configs]
    if len(set(stems)) != len(stems):
        raise SweepError(
            f"{path}: configs: two experiments share the name {max(stems, key=stems.count)!r}; "
            "runs are named by the file's stem"
        )
    return configs


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
        with (
            tempfile.TemporaryDirectory() as folder
        ):  # submitit makes its folder: none in the sweep's before a run starts
            _executor(sweep, Path(folder))
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


# ---- the status file: ROOT/sweep.json, updated under a lock by whichever process runs a run


@contextlib.contextmanager
def _lock(path: Path, wait: bool = True):
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise SweepError(f"{path.parent}: another `attnlab sweep` is running this sweep") from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_status(root: Path) -> dict[str, Any]:
    try:
        return json.loads((root / STATUS).read_text())
    except (OSError, ValueError):
        return {}


def update(root: Path, run: str | None = None, /, **fields: Any) -> None:
    """Merge ``fields`` into run ``run`` of the status file (into the sweep's own entries when run is None)."""
    with _lock(root / f"{STATUS}.lock"):
        status = read_status(root)
        target = status.setdefault("runs", {}).setdefault(run, {}) if run else status
        target.update(fields)
        tmp = root / f"{STATUS}.tmp"
        tmp.write_text(json.dumps(status, indent=1))
        tmp.replace(root / STATUS)


def record(sweep: Sweep) -> None:
    """Write the sweep and every run (new ones as pending) into the status file."""
    update(
        sweep.root,
        file=str(sweep.file),
        name=sweep.name,
        launcher=sweep.launcher,
        seeds=sweep.seeds,
        configs={Path(c).stem: {"config": c, "grid": g} for c, g in sweep.configs},
    )
    status = read_status(sweep.root).get("runs", {})
    for run in sweep.runs():
        entry = {
            "config": run.config,
            "cell": run.cell,
            "cell_name": run.cell_name,
            "seed": run.seed,
            "folder": str(run.folder),
            "command": shlex.join(sweep.command(run)),
        }
        update(sweep.root, run.name, **entry, **({} if run.name in status else {"status": "pending"}))


def finished(folder: Path) -> bool:
    """A finished summary.json below the run folder (RunSummary writes it when training ends)."""
    for path in folder.glob("lightning_logs/*/summary.json"):
        try:
            if json.loads(path.read_text()).get("status") == "finished":
                return True
        except (OSError, ValueError):
            continue
    return False


def plan(sweep: Sweep) -> list[tuple[Run, str]]:
    """(run, what happens): "done" (skipped), "resume from <last.ckpt>" or "new"."""
    status = read_status(sweep.root).get("runs", {})
    out = []
    for run in sweep.runs():
        if status.get(run.name, {}).get("status") == "done" or finished(run.folder):
            out.append((run, "done"))
            continue
        last = sorted(run.folder.glob("**/checkpoints/last*.ckpt"), key=os.path.getmtime)
        out.append((run, f"resume from {last[-1]}" if last else "new"))
    return out


# ---- running one run: a subprocess of the real CLI


def error_line(log: Path, code: int) -> str:
    """The line that says why a run stopped: attnlab's own error, else the exception that ended the traceback."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        lines = []
    for line in reversed(lines):
        if line.startswith("attnlab: error:"):
            return line
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", line):
            return line
    return f"exit status {code}" + (f": {lines[-1]}" if lines else "")


def start(sweep: Sweep, run: Run, gpu: str | None = None) -> subprocess.Popen:
    run.folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **sweep.env(run), **({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {})}
    with (run.folder / LOG).open("a") as log:
        log.write(f"\n$ {shlex.join(sweep.command(run))}\n")
        log.flush()
        # its own session: a Ctrl-C reaches the sweep, which stops every run with SIGTERM (they save last.ckpt)
        return subprocess.Popen(
            sweep.command(run), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def execute(command: list[str], folder: str, env: dict[str, str]) -> tuple[int, str | None]:
    """Run one `attnlab fit` to its end (a SLURM job's or a W&B agent's work): (exit status, error line or None)."""
    folder_ = Path(folder)
    folder_.mkdir(parents=True, exist_ok=True)
    with (folder_ / LOG).open("a") as log:
        log.write(f"\n$ {shlex.join(command)}\n")
        log.flush()
        code = subprocess.run(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}, check=False
        ).returncode
    return code, None if code == 0 else error_line(folder_ / LOG, code)


def _ended(sweep: Sweep, run: Run, code: int, error: str | None) -> str:
    state = "done" if code == 0 else "interrupted" if code in (INTERRUPTED, -signal.SIGTERM) else "failed"
    update(
        sweep.root, run.name, status=state, returncode=code, error=error, finished=time.strftime("%Y-%m-%dT%H:%M:%S")
    )
    print(f"attnlab: sweep: {run.name} {state}" + (f": {error}" if state == "failed" else ""), flush=True)
    return state


def _started(sweep: Sweep, run: Run, how: str, **fields: Any) -> None:
    update(sweep.root, run.name, status="running", error=None, started=time.strftime("%Y-%m-%dT%H:%M:%S"), **fields)
    print(f"attnlab: sweep: {run.name} started ({how})", flush=True)


# ---- launchers


def _gpus() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g for g in visible.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def launch_local(sweep: Sweep, todo: list[tuple[Run, str]]) -> int:
    """Up to max_parallel runs at once (one GPU each when there are GPUs); SIGTERM or Ctrl-C stops them all cleanly."""
    gpus = _gpus()
    free: list[str | None] = gpus[: sweep.max_parallel] if gpus else [None] * sweep.max_parallel
    queue, running = list(todo), {}
    stop: list[int] = []

    def interrupt(signum, frame):
        stop.append(signum)
        for proc, _, _ in running.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)

    handlers = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while queue or running:
            while queue and free and not stop:
                run, how = queue.pop(0)
                gpu = free.pop(0)
                running[run.name] = (start(sweep, run, gpu), run, gpu)
                _started(sweep, run, how, gpu=gpu)
            time.sleep(0.2)
            for name, (proc, run, gpu) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[name]
                free.append(gpu)
                code = proc.returncode
                _ended(
                    sweep,
                    run,
                    INTERRUPTED if stop and code else code,
                    None if code == 0 else error_line(run.folder / LOG, code),
                )
            if stop and not running:
                break
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    if stop:
        print(f"attnlab: sweep stopped by signal {stop[0]}; run it again to resume", file=sys.stderr)
        return 128 + stop[0]
    return 0


def _executor(sweep: Sweep, folder: Path):
    import submitit

    params = dict(sweep.slurm)
    cluster = params.pop("cluster", None)
    try:
        executor = submitit.AutoExecutor(folder=folder, cluster=cluster)
        executor.update_parameters(name=sweep.name, **params)
    except (AssertionError, NameError, ValueError, TypeError, RuntimeError) as err:
        raise SweepError(f"{sweep.file}: slurm: {str(err).strip().splitlines()[0]}") from None
    return executor


def launch_slurm(sweep: Sweep, todo: list[tuple[Run, str]]) -> int:
    """One submitit job per run (an array job on SLURM); waits for them and records each as it ends."""
    import submitit

    executor = _executor(sweep, sweep.root / "submitit")
    with executor.batch():
        jobs = [executor.submit(execute, sweep.command(run), str(run.folder), sweep.env(run)) for run, _ in todo]
    by_job = {}
    for (run, how), job in zip(todo, jobs):
        _started(sweep, run, how, job_id=str(job.job_id))
        by_job[str(job.job_id)] = run
    for job in submitit.helpers.as_completed(jobs, poll_frequency=1):
        run = by_job[str(job.job_id)]
        try:
            code, error = job.result()
        except Exception as err:  # the job itself failed (node failure, time limit): submitit's last line says why
            code, error = 1, str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        _ended(sweep, run, code, error)
    return 0


def wandb_sweep_config(sweep: Sweep, todo: list[tuple[Run, str]]) -> dict[str, Any]:
    """A W&B grid sweep over the names of the runs still to do; its agents call back `attnlab sweep ... --agent`."""
    command = [
        "${env}",
        sys.executable,
        "-m",
        "experiments.sweep",
        str(sweep.file),
        "--root",
        str(sweep.root),
        "--agent",
        "${args}",
    ]
    return {
        "name": sweep.name,
        "method": "grid",
        "parameters": {"run": {"values": [run.name for run, _ in todo]}},
        "command": command + (["--", *sweep.extra] if sweep.extra else []),
    }


def launch_wandb(sweep: Sweep, todo: list[tuple[Run, str]]) -> int:
    import wandb

    project, entity = sweep.wandb.get("project", "attnlab"), sweep.wandb.get("entity")
    sweep_id = wandb.sweep(wandb_sweep_config(sweep, todo), project=project, entity=entity)
    path = "/".join(p for p in (entity, project, sweep_id) if p)
    update(sweep.root, wandb_sweep=path)
    print(f"attnlab: W&B sweep {path}; more agents: `wandb agent {path}` on other machines", flush=True)
    gpus = _gpus()
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "wandb", "agent", path],
            env={**os.environ, **({"CUDA_VISIBLE_DEVICES": gpus[i]} if gpus else {})},
        )
        for i in range(min(sweep.max_parallel, len(gpus) or sweep.max_parallel, len(todo)))
    ]
    return max(agent.wait() for agent in agents)


def run_agent(sweep: Sweep, name: str) -> int:
    """What a W&B agent runs: one run of the sweep, by name, with its settings as `attnlab fit` arguments."""
    runs = {run.name: (run, how) for run, how in plan(sweep)}
    if name not in runs:
        raise SweepError(f"{sweep.file}: --run: {name!r} is not a run of this sweep")
    run, how = runs[name]
    if how == "done":
        print(f"attnlab: sweep: {name} is done, skipped")
        return 0
    _started(sweep, run, how)
    code, error = execute(sweep.command(run), str(run.folder), sweep.env(run))
    _ended(sweep, run, code, error)
    return code


LAUNCH = {"local": launch_local, "slurm": launch_slurm, "wandb": launch_wandb}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra: list[str] = []
    if "--" in argv:
        argv, extra = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    parser = argparse.ArgumentParser(prog="attnlab sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("file", metavar="FILE.yaml", help="the sweep file (see configs/sweeps/)")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and their commands; start nothing")
    parser.add_argument("--root", help="the sweep's folder (default: the file's root, or runs/sweeps/<name>)")
    parser.add_argument("--no-report", action="store_true", help="skip the cells table and report at the end")
    parser.add_argument("--agent", action="store_true", help=argparse.SUPPRESS)  # a W&B agent's call: one run
    parser.add_argument("--run", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        sweep = load(args.file, args.root, extra)
        if not args.agent:
            check(sweep)
        code = run_agent(sweep, args.run or "") if args.agent else _sweep(sweep, args.dry_run)
        if not (args.agent or args.dry_run or args.no_report):
            report(sweep)
    except SweepError as err:
        print(f"attnlab: error: {err}", file=sys.stderr)
        sys.exit(2)
    if code:
        sys.exit(code)  # `python -m experiments.cli sweep` drops main's return value
    return 0


def report(sweep: Sweep) -> None:
    """The cells of the finished runs (mean ± 95% CI, n) and the paired comparisons, as `attnlab compare` gives
    them; the report goes to ``<root>/report``."""
    from experiments.compare import build_report, find_runs, print_result

    runs = [r for r in find_runs([str(sweep.root)]) if (r / "summary.json").is_file()]
    if runs:
        result = build_report(runs, sweep.root / "report", f"attnlab: sweep {sweep.name}")
        print_result(result, runs)
        print(f"attnlab: report written to {result['report']}")


def _sweep(sweep: Sweep, dry_run: bool) -> int:
    steps = plan(sweep)
    todo = [(run, how) for run, how in steps if how != "done"]
    if dry_run:
        for run, how in steps:
            print(f"{run.name}: {'done, skipped' if how == 'done' else how}")
            if how != "done":
                env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sweep.env(run).items())
                print(f"  {env + ' ' if env else ''}{shlex.join(sweep.command(run))}")
        print(
            f"attnlab: sweep {sweep.name}: {len(steps)} runs, {len(todo)} to run ({sweep.launcher}); "
            "nothing started (--dry-run)"
        )
        return 0
    with _lock(sweep.root / "sweep.lock", wait=False):
        record(sweep)
        for run, how in steps:
            if how == "done":
                update(sweep.root, run.name, status="done")
                print(f"attnlab: sweep: {run.name} is done, skipped")
        code = LAUNCH[sweep.launcher](sweep, todo) if todo else 0
    runs = read_status(sweep.root).get("runs", {})
    counts = {
        s: sum(1 for r in steps if runs.get(r[0].name, {}).get("status") == s)
        for s in ("done", "failed", "interrupted")
    }
    print(
        f"attnlab: sweep {sweep.name}: {counts['done']} done, {counts['failed']} failed, "
        f"{counts['interrupted']} interrupted of "
        f"{len(steps)}; status in {sweep.root / STATUS}; compare with `attnlab compare {sweep.root}`"
    )
    return code or (1 if counts["failed"] else 0)


if __name__ == "__main__":
    sys.exit(main())
