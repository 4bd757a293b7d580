"""What `attnlab` checks and says beyond jsonargparse and Lightning: a YAML file that does not parse (its
file:line:column), an option that is not one (the nearest that is), ``optimizer``/``lr_scheduler`` given to a model
that builds its own, and a fit that ran no validation. A check's ValueError text is the one line the CLI prints.
"""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from experiments.links import init_options

# the init arguments through which a model sets its optimizer and schedule (`models.optim`), where it has them
OPTIMIZER_OPTIONS = (
    "lr",
    "lr_backbone",
    "weight_decay",
    "betas",
    "eps",
    "layer_decay",
    "schedule",
    "warmup_steps",
    "warmup_epochs",
    "min_lr_ratio",
    "lr_drop_epoch",
)


def yaml_error(path: str | Path, err: yaml.YAMLError) -> str:
    """PyYAML's error -> ``path:line:column: not valid YAML: problem (context at line:column)``."""
    mark = getattr(err, "problem_mark", None)
    if mark is None:
        return f"{path}: not valid YAML: {err}"
    line = f"{path}:{mark.line + 1}:{mark.column + 1}: not valid YAML: {getattr(err, 'problem', None) or err}"
    context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
    return f"{line} ({context} at {start.line + 1}:{start.column + 1})" if context and start else line


def check_config_files(argv: Iterable[str]) -> None:
    """Parse every file named by ``--config``/``-c`` in ``argv`` as YAML (jsonargparse's error names no file)."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            path = arg.removeprefix("--config=")
        elif arg in ("--config", "-c") and i + 1 < len(argv):
            path = argv[i + 1]
        else:
            continue
        if Path(path).is_file():
            try:
                yaml.safe_load(Path(path).read_text())
            except yaml.YAMLError as err:
                raise ValueError(yaml_error(path, err)) from None


def nearest_option(message: str, parser: Any) -> str | None:
    """argparse's "unrecognized arguments: --trainer.max_epoch=1" -> the line naming the option of the jsonargparse
    ``parser`` nearest to it; None for another message or without a near option."""
    found = re.match(r"unrecognized arguments: --([\w.-]+)", message)
    close = difflib.get_close_matches(found.group(1), list(parser.get_defaults().keys()), n=1) if found else []
    if not close:
        return None
    return f"--{found.group(1)}: no such option; did you mean --{close[0]}? (options are never abbreviated)"


def check_own_optimizer(config: Any) -> None:
    """Refuse ``optimizer``/``lr_scheduler`` (a subcommand's parsed config) for a model whose
    ``configure_optimizers`` builds its own: LightningCLI would replace that silently."""
    given = [key for key in ("optimizer", "lr_scheduler") if config.get(key) is not None]
    class_path = (config.get("model") or {}).get("class_path")
    if not given or not class_path:
        return
    import pytorch_lightning as pl

    module, _, name = class_path.rpartition(".")
    model = getattr(importlib.import_module(module), name)
    if model.configure_optimizers is pl.LightningModule.configure_optimizers:
        return  # a model without its own: LightningCLI's optimizer is the one it gets
    keys = ", ".join(k for k in OPTIMIZER_OPTIONS if k in init_options(model)) or "its init arguments"
    chosen = config[given[0]].get("class_path", "")
    raise ValueError(
        f"{given[0]}={chosen}: {class_path} builds its own optimizer and learning-rate schedule (models/optim.py), "
        f"which this setting would replace; change its model.init_args instead: {keys}"
    )


def no_validation(trainer) -> str | None:
    """After a fit: the warning that it ran no validation, why, and where its weights are; None when it validated
    (a validation logs ``val/...`` metrics, as every attnlab model does)."""
    if any(key.startswith("val/") for key in trainer.callback_metrics):
        return None
    every, epochs = trainer.check_val_every_n_epoch, trainer.current_epoch
    if every and trainer.max_epochs is not None and 0 < trainer.max_epochs < every:
        why = f"trainer.check_val_every_n_epoch={every} > trainer.max_epochs={trainer.max_epochs}"
    elif every and epochs < every:
        why = f"it stopped after {epochs} epoch(s), before epoch {every} (trainer.check_val_every_n_epoch={every})"
    elif not trainer.limit_val_batches:
        why = f"trainer.limit_val_batches={trainer.limit_val_batches}"
    elif not sum(trainer.num_val_batches):
        why = "the data has no validation batches"
    else:
        why = f"it stopped at step {trainer.global_step}, before its first validation"
    from experiments.guards import last_checkpoint

    found = last_checkpoint(trainer)
    kept = f"its weights are in {found}" if found else "no checkpoint was written"
    return f"this fit ran no validation ({why}), so no best checkpoint was chosen; {kept}"
