"""The subcommands of `attnlab` and their one-line descriptions, in a module that imports nothing: `attnlab --help`
(`experiments.cli`) lists them without starting Lightning, and LightningCLI's parser (`experiments.trainer_cli`) shows
the same lines."""

DESCRIPTION = "attnlab: train, evaluate and compare Transformers for text, vision and detection."

# LightningCLI's subcommands, the Trainer's methods of these names
TRAINER = {
    "fit": "Train a config's model on its data; `--ckpt_path last` resumes the newest run.",
    "validate": "One pass over the validation set with a checkpoint (`--ckpt_path best|last|FILE`).",
    "test": "One pass over the test set with a checkpoint (`--ckpt_path best|last|FILE`).",
    "predict": "Predictions of a checkpoint on the config's predict data (`--ckpt_path best|last|FILE`).",
}

# Subcommands that are not Lightning's: name -> (module whose main(argv) runs it, one line for --help)
TOOLS = {
    "compare": ("experiments.compare", "One report across runs and modalities: report.md and plots."),
    "sweep": ("experiments.sweep", "Grids x seeds of fit runs: local, SLURM (submitit) or W&B sweeps; resumable."),
}
