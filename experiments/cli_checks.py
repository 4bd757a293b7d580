"""What `attnlab` checks and says beyond jsonargparse and Lightning: a YAML file that does not parse (its
file:line:column), an option or a block's field that is not one (the nearest that is, and the config file that holds
it), ``optimizer``/``lr_scheduler`` given to a model that builds its own, and a fit that ran no validation. A check's
ValueError text is the one line the CLI prints.
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


def config_files(argv: Iterable[str]) -> list[str]:
    """The files named by ``--config``/``-c`` in ``argv``."""
    argv = list(argv)
    return [
        arg.removeprefix("--config=") if arg.startswith("--config=") else argv[i + 1]
        for i, arg in enumerate(argv)
        if arg.startswith("--config=") or (arg in ("--config", "-c") and i + 1 < len(argv))
    ]


def check_config_files(argv: Iterable[str]) -> None:
    """Parse every file named by ``--config``/``-c`` in ``argv`` as YAML (jsonargparse's error names no file)."""
    for path in config_files(argv):
        if Path(path).is_file():
            try:
                yaml.safe_load(Path(path).read_text())
            except yaml.YAMLError as err:
                raise ValueError(yaml_error(path, err)) from None


def file_with_key(argv: Iterable[str], keys: list[str]) -> str | None:
    """The first ``--config`` file in ``argv`` whose YAML holds the nested ``keys`` (``trainer``, ``max_epoch``);
    a missing ``init_args`` level is skipped, as jsonargparse reads ``model: {class_path: ..., depth: 3}``."""
    for path in config_files(argv):
        try:
            content = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError):
            continue
        if _holds(content, keys):
            return path
    return None


def _holds(node: Any, keys: list[str]) -> bool:
    if not keys:
        return True
    if isinstance(node, list):  # trainer.callbacks: any of its entries
        return any(_holds(item, keys) for item in node)
    if not isinstance(node, dict):
        return False
    if keys[0] == "init_args" and "init_args" not in node:
        return _holds(node, keys[1:])
    return keys[0] in node and _holds(node[keys[0]], keys[1:])


# jsonargparse's words for a key of a config file that is not an option, with --print_config and without
_NOT_ACCEPTED = re.compile(
    r"Group '([\w.]+)' does not accept option '(\w+)'|Subcommand '\w+' does not accept option '([\w.]+)'"
)


def nearest_option(message: str, parser: Any, argv: Iterable[str] = ()) -> str | None:
    """argparse's "unrecognized arguments: --trainer.max_epoch=1" -> the line naming the option of the jsonargparse
    ``parser`` nearest to it; jsonargparse's "Group 'trainer' does not accept option 'max_epoch'" (a key of a
    ``--config`` file in ``argv``) -> the line naming the file and the nearest key; None for another message."""
    if found := _NOT_ACCEPTED.match(message):
        key = found.group(3) or f"{found.group(1)}.{found.group(2)}"
        close = difflib.get_close_matches(key, option_keys(parser, argv), n=1)
        line = f"{key} is not an option" + (f"; did you mean {close[0]}?" if close else "")
        file = file_with_key(argv, key.split("."))
        return f"{file}: {line}" if file else line
    found = re.match(r"unrecognized arguments: --([\w.-]+)", message)
    close = difflib.get_close_matches(found.group(1), list(parser.get_defaults().keys()), n=1) if found else []
    if not close:
        return None
    return f"--{found.group(1)}: no such option; did you mean --{close[0]}? (options are never abbreviated)"


def option_keys(parser: Any, argv: Iterable[str]) -> list[str]:
    """The keys of ``parser``, or of its subcommand named in ``argv``: ``trainer.max_epochs``, not
    ``fit.trainer.max_epochs``."""
    subcommands = getattr(parser, "subcommands_action", None)
    chosen = next((arg for arg in argv if subcommands and arg in subcommands.choices), None)
    return list((subcommands.choices[chosen] if chosen else parser).get_defaults().keys())


def unknown_option(option: str, class_path: str) -> tuple[str, str]:
    """An init option that ``class_path`` does not take -> (where it belongs below the class, the reason): a field of
    a block (``attention.normalisation``) is named among that block's fields, any other among the class's options."""
    options = accepted_options(class_path)
    block, _, field = option.rpartition(".")
    fields = list(
        dict.fromkeys(o.removeprefix(f"{block}.").split(".")[0] for o in options if o.startswith(f"{block}."))
    )
    if block and fields:
        close = difflib.get_close_matches(field, fields, n=1)
        guess = f"; did you mean {close[0]!r}?" if close else ""
        return (
            f"init_args.{block}",
            f"{field!r} is not a field of the {block} block{guess} (fields: {', '.join(fields)})",
        )
    # a key that moved into a block (model.similarity -> model.attention.similarity) is named exactly
    close = [o for o in options if o.endswith(f".{option}")] or difflib.get_close_matches(option, options, n=1)
    return "", f"{option!r} is not an option of {class_path}" + (f"; did you mean {close[0]!r}?" if close else "")


def model_class(class_path: str) -> type:
    """The class at ``class_path`` (a config's ``model.class_path``, which the parser has already imported)."""
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def accepted_options(class_path: str) -> list[str]:
    """The init options of the class at ``class_path`` (`init_options`); none when it does not import."""
    try:
        return init_options(model_class(class_path))
    except (ImportError, AttributeError, ValueError):
        return []


def internal_error(err: TypeError, class_paths: list[str]) -> str:
    """The line for a TypeError raised while the config's classes (``class_paths``) were built: jsonargparse had
    checked every setting against their signatures, so the fault is in code that calls a constructor: attnlab's, or
    that of a class of one's own."""
    own = [
        c for c in class_paths if not c.startswith(("models.", "datamodules.", "experiments.", "pytorch_lightning."))
    ]
    where = f"the code of {', '.join(own)}" if own else "attnlab, not in your settings"
    return (
        f"building {' and '.join(class_paths)} failed inside a constructor ({err}): the fault is in {where}; "
        "rerun with ATTNLAB_DEBUG=1 and report the traceback"
    )


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
    elif every and 0 < trainer.max_steps <= trainer.global_step:
        why = (
            f"trainer.max_steps={trainer.max_steps} ended it at step {trainer.global_step}, before epoch {every} was "
            f"over (trainer.check_val_every_n_epoch={every})"
        )
    elif every and epochs < every:
        why = f"it stopped after {epochs} epoch(s), before epoch {every} (trainer.check_val_every_n_epoch={every})"
    elif not trainer.limit_val_batches:
        why = f"trainer.limit_val_batches={trainer.limit_val_batches}"
    elif not sum(trainer.num_val_batches):
        why = "the data has no validation batches"
    else:
        why = f"it stopped at step {trainer.global_step}, before its first validation"
    from experiments.callbacks.guards import last_checkpoint

    found = last_checkpoint(trainer)
    kept = f"its weights are in {found}" if found else "no checkpoint was written"
    return f"this fit ran no validation ({why}), so no best checkpoint was chosen; {kept}"
