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
    max_parallel: 1                          # local and wandb: runs (agents) at once, one GPU each when there are GPUs;
                                             #   local on the CPU: OMP_NUM_THREADS = cores // max_parallel each
    slurm: {timeout_min: 240, gpus_per_node: 1, slurm_partition: gpu}  # submitit's parameters; cluster: local runs here
    wandb: {project: attnlab, entity: null}  # log to W&B: group = sweep name, job type = cell, tags = settings
    report: {title: null, scaling: false}    # the report's title (default: attnlab: sweep <name>); scaling: print
                                             #   the √d table with the cells (report.md has it anyway)

One run per (config x grid cell x seed), ``ROOT/<config stem>/<key=value,...>/seed=<s>``: ``attnlab fit ...
--ckpt_path last`` in a subprocess (output in its ``sweep.log``), so running the sweep again resumes the
unfinished runs. The W&B launcher's agents call ``attnlab sweep FILE --agent --run=NAME``: each run's settings
reach `attnlab fit`, and so every DDP process, as command-line arguments.
"""

from experiments.sweep.launch import error_line, wandb_sweep_config
from experiments.sweep.main import main
from experiments.sweep.runs import load
from experiments.sweep.status import plan, record, update

__all__ = ["error_line", "load", "main", "plan", "record", "update", "wandb_sweep_config"]
