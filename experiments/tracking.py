"""Experiment tracking: W&B that never blocks on the network, the run folder's loggers (`experiments.runfolder`;
offline W&B runs sit in ``<default_root_dir>/wandb/offline-run-*``), and resuming into the same run.
"""

from __future__ import annotations

import netrc
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from jsonargparse import Namespace
from pytorch_lightning.cli import SaveConfigCallback
from pytorch_lightning.loggers import CSVLogger as _CSVLogger
from pytorch_lightning.loggers import WandbLogger as _WandbLogger
from pytorch_lightning.loggers.csv_logs import ExperimentWriter

from experiments.lightning_compat import set_wandb_mode
from experiments.links import LINKED_ATTRIBUTES
from experiments.provenance import record_sources, yaml_comment
from experiments.runfolder import Summary, newest_checkpoint

Mode = Literal["online", "offline", "disabled"]


def wandb_mode(environ: dict[str, str] | None = None, netrc_file: str | None = None) -> Mode:
    """``WANDB_MODE`` when set; otherwise online when W&B credentials exist (``WANDB_API_KEY`` or an api.wandb.ai
    entry in ~/.netrc), else offline: a machine without an account never waits on the network."""
    environ = os.environ if environ is None else environ
    env = environ.get("WANDB_MODE", "").strip().lower()
    if env:
        return {"dryrun": "offline", "run": "online"}.get(env, env)  # wandb's older spellings
    if environ.get("WANDB_API_KEY"):
        return "online"
    path = netrc_file or environ.get("NETRC") or str(Path.home() / ".netrc")
    try:
        return "online" if netrc.netrc(path).authenticators("api.wandb.ai") else "offline"
    except (netrc.NetrcParseError, OSError):  # no file, or not one netrc reads
        return "offline"


class WandbLogger(_WandbLogger):
    """Lightning's WandbLogger with attnlab's defaults; its run config is the nested CLI config (`LoggedConfig`).

    Args:
        save_dir: where ``wandb/`` goes; default ``trainer.default_root_dir`` (filled in by `prepare`).
        mode: "online", "offline" or "disabled"; default from the environment (`wandb_mode`).
        id: the run to continue (filled in on ``fit --ckpt_path last``).
        log_model: upload checkpoints as artifacts (online only).
        init_timeout: seconds an online start may take before the run logs offline instead, saying so once
            on stderr (wandb's own default, 90 s, would hold a machine without network that long).
    """

    def __init__(
        self,
        project: str = "attnlab",
        entity: str | None = None,
        name: str | None = None,
        group: str | None = None,
        tags: list[str] | None = None,
        save_dir: str | None = None,
        mode: Mode | None = None,
        id: str | None = None,
        log_model: bool = False,
        init_timeout: float = 5.0,
    ):
        self.mode = mode or wandb_mode()
        if self.mode not in ("online", "offline", "disabled"):
            raise ValueError(
                f"trainer.logger: W&B mode={self.mode!r}; expected online, offline or disabled (WANDB_MODE)"
            )
        # mode goes straight to wandb.init: Lightning's offline=True would set WANDB_MODE for the whole process
        super().__init__(
            name=name,
            save_dir=save_dir or ".",
            project=project,
            id=id,
            log_model=log_model and self.mode == "online",  # artifacts need the server; offline keeps them locally
            entity=entity,
            group=group,
            tags=tags,
            mode=self.mode,
            settings={"init_timeout": init_timeout},
        )

    @property
    def experiment(self):
        """The W&B run, started on first use; offline when an online start fails (told once, on stderr)."""
        try:
            return super().experiment
        except Exception as err:  # wandb's CommError, AuthenticationError, UsageError, anything the start raises
            if self.mode != "online":
                raise
            cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        self.mode = "offline"
        set_wandb_mode(self, self.mode)  # for this logger only: WANDB_MODE stays as the user set it
        run = super().experiment
        folder = Path(run.dir).parent
        print(
            f"attnlab: W&B online run could not start ({cause}); logging offline to {folder}; upload it later with `wandb sync {folder}`",
            file=sys.stderr,
        )
        return run

    def log_hyperparams(self, params: Any) -> None:
        """Skipped: the nested CLI config (`LoggedConfig`) already holds every hyper-parameter."""


class CSVLogger(_CSVLogger):
    """Lightning's CSVLogger whose ``save_dir`` defaults to ``trainer.default_root_dir`` and which, given an
    existing ``version``, appends to that run's metrics.csv instead of deleting it."""

    def __init__(
        self,
        save_dir: str | None = None,
        name: str = "lightning_logs",
        version: int | str | None = None,
        flush_logs_every_n_steps: int = 100,
    ):
        super().__init__(
            save_dir=save_dir or ".", name=name, version=version, flush_logs_every_n_steps=flush_logs_every_n_steps
        )
        self.rows_restored = False

    @property
    def experiment(self) -> ExperimentWriter:
        # Lightning's writer deletes the folder's metrics.csv when it starts: the resumed run's rows are put back
        if self.rows_restored:
            return super().experiment
        path = Path(self.log_dir) / ExperimentWriter.NAME_METRICS_FILE
        rows = path.read_text() if path.is_file() else ""
        with warnings.catch_warnings():  # "Previous log files ... will be deleted": they are put back below
            warnings.filterwarnings("ignore", "Experiment logs directory .* exists and is not empty")
            writer = super().experiment
        self.rows_restored = True
        if rows and isinstance(writer, ExperimentWriter):  # rank 0's writer; the others get a dummy
            path.write_text(rows)
            writer.metrics_keys = rows.splitlines()[0].split(",")
        return writer


class LoggedConfig(SaveConfigCallback):
    """Save ``config.yaml`` in the run folder (as LightningCLI does) and log it to W&B loggers: the
    nested config, with the values linked from the DataModule filled in, plus the file itself. When the attention
    block names files of one's own (`experiments.provenance`), their paths and sha256 head the file as a comment and
    go to W&B as ``attention_sources``, and the files are copied into the run folder."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        # a collective under DDP: asked on every rank, not in save_config (rank 0 only)
        self.run_folder = trainer.log_dir
        super().setup(trainer, pl_module, stage)

    def save_config(self, trainer, pl_module, stage: str) -> None:
        path = Path(self.run_folder or trainer.default_root_dir) / self.config_filename
        written = self.save_to_log_dir and path.is_file()
        sources = record_sources(pl_module.hparams, path.parent if written else None)
        if sources and written:  # a YAML comment: the file stays a config that `attnlab fit --config` takes
            path.write_text(yaml_comment(sources) + path.read_text())
        loggers = [lg for lg in trainer.loggers if isinstance(lg, WandbLogger)]
        if not loggers:
            return
        config = yaml.safe_load(self.parser.dump(self.config, skip_none=False))
        if sources:
            config["attention_sources"] = sources
        init_args = (config.get("model") or {}).get("init_args")
        if isinstance(init_args, dict):
            init_args.update({k: pl_module.hparams[k] for k in LINKED_ATTRIBUTES if k in pl_module.hparams})
        for logger in loggers:
            logger.experiment.config.update(config, allow_val_change=True)
            if path.exists() and logger.mode != "disabled":
                logger.experiment.save(str(path), base_path=str(path.parent), policy="now")


def _is(entry: Any, *classes: type) -> bool:
    """Whether ``entry`` is a parsed trainer.logger entry (with init_args) of one of ``classes``."""
    names = {name for cls in classes for name in (f"{cls.__module__}.{cls.__qualname__}", cls.__qualname__)}
    return isinstance(entry, Namespace) and entry.get("class_path") in names and entry.get("init_args") is not None


def prepare(config: Namespace, subcommand: str | None) -> None:
    """Run on the parsed config before LightningCLI instantiates anything: this module's loggers without
    ``save_dir`` get ``trainer.default_root_dir``, and ``fit --ckpt_path last`` resumes the newest ``last*.ckpt``
    under the root into the same run folder and W&B run (or starts a new run, saying so, when there is none:
    the same command serves a first start and a requeued job)."""
    cfg = config.get(subcommand) if subcommand else config
    if not isinstance(cfg, Namespace) or not isinstance(cfg.get("trainer"), Namespace):
        return
    root = cfg.trainer.get("default_root_dir") or os.getcwd()
    loggers = cfg.trainer.get("logger")
    ours = [lg for lg in (loggers if isinstance(loggers, list) else [loggers]) if _is(lg, WandbLogger, CSVLogger)]
    for entry in ours:
        entry.init_args.save_dir = entry.init_args.get("save_dir") or str(root)
    if subcommand == "fit" and cfg.get("ckpt_path") == "last":
        _resume_last(cfg, Path(root), ours)


def _resume_last(cfg: Namespace, root: Path, ours: list[Namespace]) -> None:
    ckpt = newest_checkpoint(root, "last")
    if ckpt is None:
        print(f"attnlab: no 'last*.ckpt' under {root}/: starting a new run", file=sys.stderr)
        cfg.ckpt_path = None
        return
    cfg.ckpt_path = str(ckpt)
    print(f"attnlab: resuming from {ckpt}", file=sys.stderr)
    run_dir = ckpt.parent.parent
    if ckpt.parent.name != "checkpoints":
        return
    logger = cfg.trainer.get("logger")
    if logger is None or logger is True:  # Lightning's default logger, pinned to the resumed run's folder
        cfg.trainer.logger = Namespace(
            class_path=f"{CSVLogger.__module__}.CSVLogger",
            init_args=Namespace(save_dir=str(run_dir.parent.parent), name=run_dir.parent.name, version=run_dir.name),
        )
        return
    runs = Summary.read(run_dir).wandb or []
    for entry in ours:
        args = entry.init_args
        if _is(entry, CSVLogger) and args.get("version") is None and Path(args.save_dir) / args.name == run_dir.parent:
            args.version = run_dir.name
        elif _is(entry, WandbLogger) and not args.get("id"):
            args.id = next((run["id"] for run in runs if run.get("id") and run.get("mode") != "disabled"), None)


def default_callbacks() -> list:
    """The callbacks every experiment gets without listing them: monitors, the run summary, the guards, interrupt
    safety and the learning rate's time budget and log."""
    from experiments.callbacks import GradientNorm, RunSummary, Throughput
    from experiments.callbacks.guards import NonFiniteLoss
    from experiments.callbacks.interrupts import ExactResume, LastCheckpoint
    from experiments.callbacks.time_budget import LearningRateLog, TimeBudget

    return [
        Throughput(),
        GradientNorm(),
        RunSummary(),
        NonFiniteLoss(),
        ExactResume(),
        LastCheckpoint(),
        TimeBudget(),
        LearningRateLog(),
    ]
