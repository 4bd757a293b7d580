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

from experiments.sweep.file import SweepError, SweepFile
from experiments.sweep.launch import error_line, execute, spawn, wandb_sweep_config
from experiments.sweep.main import main, no_run_finished, report
from experiments.sweep.runs import Run, Sweep, check, load
from experiments.sweep.status import plan, record, update

__all__ = [
    "Run",
    "Sweep",
    "SweepError",
    "SweepFile",
    "check",
    "error_line",
    "execute",
    "load",
    "main",
    "no_run_finished",
    "plan",
    "record",
    "report",
    "spawn",
    "update",
    "wandb_sweep_config",
]
