"""`attnlab fit|validate|test|predict`: LightningCLI over every model and DataModule of the suite (`attnlab fit --config
configs/vision/digits.yaml`). Configs name the classes (``model.class_path``, ``data.class_path``); the DataModule's
facts a model needs are linked (`experiments.links`); a user's bad input is one line (`condense_error`).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import sys
from pathlib import Path
from typing import ClassVar

import pytorch_lightning as pl
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI

from experiments import checkpoints, cli_checks, renames, tracking
from experiments.callbacks import guards
from experiments.links import LINKED_ATTRIBUTES, links_not_taken
from experiments.runfolder import newest_checkpoint
from experiments.subcommands import DESCRIPTION, TOOLS, TRAINER
from experiments.variant_errors import variant_error
from models.class_paths import missing_module

_NOISE = re.compile(
    r"Does not validate against any of the Union subtypes|^Subtypes:|^Errors:|NoneType|^Given value type:|^tip:|^Expected a path but"
)


# Our own ValueErrors start with the key they concern ("trainer.logger: ...", "data.root=...: ...")
_OWN_ERROR = re.compile(r"^(trainer|model|data)(\.\w+)*(=\S*)?: ")

# jsonargparse's three ways of saying that a class takes no such option (a flag, a key in YAML or a dict)
_UNKNOWN = re.compile(
    r"Option '([^']+)' is not accepted|unrecognized arguments: --([\w.]+)|Group '([\w.]+)' does not accept option '(\w+)'"
)


def condense_error(message: str, argv: list[str] | tuple[str, ...] = ()) -> str:
    """jsonargparse's nested Union report -> one line naming the key, the value and what is allowed; a key that is
    not an option names the ``--config`` file of ``argv`` that holds it."""
    if line := variant_error(message):  # an attention variant's init_args: the block's own line
        return line
    keys, reasons, value, class_path = [], [], None, None
    for raw in message.splitlines():
        line = raw.strip().lstrip("- ").strip()
        if _OWN_ERROR.match(line):  # raised by our own code, naming its key: the rest is jsonargparse's wrapping
            return line
        if not line or _NOISE.search(line):
            continue
        if m := re.match(r'Parser key "([^"]+)":\s*(.*)', line):
            keys.append(m.group(1))
            line = m.group(2)
        elif m := re.match(r"Problem with given class_path '([^']+)':", line):
            class_path = m.group(1)
            continue
        elif m := re.match(r"Given value: (.*)", line):
            if value is None or not m.group(1).startswith(("Namespace(", "NestedArg(")):
                value = m.group(1)  # the value itself, not the object of options around it
            continue
        if line:
            reasons.append(line)
    reason = "; ".join(dict.fromkeys(reasons)) or message.strip()
    if class_path and len(keys) > 1:
        keys.insert(1, "init_args")
    if class_path and (m := _UNKNOWN.search(reason)):
        return _not_an_option(keys, class_path, m.group(1) or m.group(2) or f"{m.group(3)}.{m.group(4)}", argv)
    reason = re.sub(r"<class '(?:[\w.]+\.)?(\w+)'>", r"\1", reason)
    reason = re.sub(r"Expected a typing\.Literal\[(.*?)\]", r"expected one of \1", reason)
    reason = re.sub(r"Expected a (\w+)", r"expected \1", reason)
    reason = re.sub(r"Type .*? expects a function or a callable class: ", "", reason)
    reason = re.sub(r"No module named '([\w.]+)'", lambda m: missing_module(m.group(1)), reason)
    shown = value is not None and not value.startswith(("Namespace(", "NestedArg("))
    shown = shown and not re.search(rf"\b{re.escape(value)}\b", reason)
    if shown and "Got value" not in reason and "not importable" not in reason:
        reason = f"{reason}, got {value!r}"
    return f"{'.'.join(keys)}: {reason}" if keys else reason


def _not_an_option(keys: list[str], class_path: str, option: str, argv: list[str] | tuple[str, ...]) -> str:
    """``model: 'depthh' is not an option of ...``, ``FILE: model.init_args.attention: 'normalisation' is not a field
    of the attention block ...`` for the ``option`` that the class at ``class_path`` (under ``keys``) does not take."""
    below, reason = cli_checks.unknown_option(option, class_path)
    line = f"{'.'.join([*keys, below] if below else keys)}: {reason}"
    file = cli_checks.file_with_key(argv, [*".".join(keys).split("."), "init_args", *option.split(".")])
    return f"{file}: {line}" if file else line


class AttnlabParser(LightningArgumentParser):
    # the command line being parsed (`AttnlabCLI.parse_arguments`): its --config files name where a bad key is
    argv: ClassVar[list[str]] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)  # --trainer.max_epoch is no --trainer.max_epochs

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:
            return super().error(message, ex)
        _fail(cli_checks.nearest_option(message, self, self.argv) or condense_error(message, self.argv))

    def format_help(self) -> str:
        """The help without ``--optimizer``/``--lr_scheduler`` and torch's every optimizer and schedule: each attnlab
        model builds its own and refuses them (`cli_checks.check_own_optimizer`); they stay parsed for a model of
        one's own without ``configure_optimizers``, and in its saved config."""
        hidden = [action for action in self._actions if action.dest.split(".")[0] in ("optimizer", "lr_scheduler")]
        shown = [action.help for action in hidden]
        for action in hidden:
            action.help = argparse.SUPPRESS
        try:
            return super().format_help()
        finally:
            for action, text in zip(hidden, shown):
                action.help = text

    def add_subcommands(self, *args, **kwargs):
        self.subcommands_action = super().add_subcommands(*args, **kwargs)  # AttnlabCLI lists TOOLS in it
        return self.subcommands_action


class AttnlabCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        for name in LINKED_ATTRIBUTES:
            parser.link_arguments(f"data.{name}", f"model.init_args.{name}", apply_on="instantiate")
        parser.add_argument(
            "--weights_only",
            type=bool | None,
            default=True,
            help="Read --ckpt_path as tensors and plain data, never as code (false: trust the file).",
        )

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        # weights_only is attnlab's own argument (default true, see add_arguments_to_parser), handed on by `run`
        return {name: skip | {"weights_only"} for name, skip in LightningCLI.subcommands().items()}

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict, subparser_kwargs: dict) -> None:
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        if not (add_subcommands and isinstance(self.parser, AttnlabParser)):
            return  # run=False (benchmarks.overhead): no subcommands
        for name, (_, summary) in TOOLS.items():  # named in usage and errors; experiments.cli runs them itself
            self.parser.subcommands_action.add_subcommand(name, AttnlabParser(description=summary), help=summary)

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        AttnlabParser.argv = sys.argv[1:] if args is None else args if isinstance(args, list) else []
        with _one_line():
            cli_checks.check_config_files(AttnlabParser.argv)
        super().parse_arguments(parser, args)
        # LightningCLI applies the --ckpt_path file's hyper-parameters next, its class too: a file it would refuse,
        # or one of another model, is one line now
        subcommand = self.config.get("subcommand")
        if subcommand:
            cfg = self.config[subcommand]
            with _one_line():
                cli_checks.check_own_optimizer(cfg)
                checkpoints.check_fits(cfg.get("ckpt_path"), cfg.model.class_path)

    def before_instantiate_classes(self) -> None:
        tracking.prepare(self.config, self.subcommand)  # logger folders; `fit --ckpt_path last` resumes the run
        if self.subcommand:  # a --ckpt_path file's hyper-parameters, now in the config (those of older files too)
            for path in sorted(renames.rename_class_paths(self.config[self.subcommand])):
                print(f"attnlab: note: {path} is {renames.current(path)} now", file=sys.stderr)
            model = self.config[self.subcommand].model
            for name in links_not_taken(cli_checks.model_class(model.class_path)) & set(model.get("dict_kwargs") or {}):
                del model.dict_kwargs[name]

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, FileNotFoundError) as err:  # a user's bad value, raised where it entered
            if isinstance(err.__cause__, TypeError):  # a constructor's call inside our code, not a setting
                cfg = self.config[self.subcommand] if self.subcommand else self.config
                built = [cfg[key].class_path for key in ("model", "data") if cfg.get(key)]
                _fail(cli_checks.internal_error(err.__cause__, built), traceback_when_debugging=True)
            _fail(condense_error(str(err)))
        for name in links_not_taken(type(self.model)):  # saved: exactly the model's own init arguments
            self.model.hparams.pop(name, None)
        if type(self.trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default; a plugin stays
            self.trainer.strategy.checkpoint_io = guards.SafeCheckpointIO()  # whole files, read as tensors only
        if self.subcommand:
            self.resolve_saved_checkpoint()
        if self.subcommand is None:  # built with run=False (benchmarks.overhead): no ckpt_path to check
            return
        cfg, class_path = self.config_init[self.subcommand], self.config[self.subcommand].model.class_path
        with _one_line():  # also a `best` or `last` found just now, and the data facts linked into the model
            checkpoints.check_fits(cfg.get("ckpt_path"), class_path, self.model.hparams, cfg.weights_only is not False)

    def run(self, **kwargs) -> None:
        """LightningCLI runs a subcommand through the method of its name: the Trainer's, with its errors as lines."""
        with self.reported_errors():
            getattr(self.trainer, self.subcommand)(
                **kwargs, weights_only=self.config_init[self.subcommand].weights_only
            )

    fit = validate = test = predict = run

    @contextlib.contextmanager
    def reported_errors(self):
        # setup() and checkpoint loading also meet user input (files, a vocabulary that does not match)
        try:
            yield
        except (ValueError, FileNotFoundError) as err:
            _fail(f"{condense_error(str(err))} (ATTNLAB_DEBUG=1 shows the traceback)", traceback_when_debugging=True)
        except guards.RunError as err:  # a guard stopped the run and says why
            _fail(err, traceback_when_debugging=True)
        except OSError as err:
            if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            _fail(guards.disk_full_message(err, self.trainer), traceback_when_debugging=True)

    def before_fit(self) -> None:
        # an unwritable folder or a full disk is found now, not at the first checkpoint an epoch later
        with self.reported_errors():
            guards.check_output_folders(
                self.trainer, self.model, resuming=bool(self.config_init["fit"].get("ckpt_path"))
            )

    def resolve_saved_checkpoint(self) -> None:
        """`--ckpt_path best|last` in a fresh process: the newest such checkpoint of this experiment. Lightning's
        own `best` is the best of the fit in this process only; `fit --ckpt_path best` continues from that file in a
        run folder of its own (`last` was resolved before, by `tracking.prepare`, to continue its run folder)."""
        cfg = self.config_init[self.subcommand]
        alias = cfg.get("ckpt_path")
        if alias not in ("best", "last"):
            return
        root = Path(self.trainer.default_root_dir)
        found = newest_checkpoint(root, alias)
        if found is None:
            _fail(checkpoints.missing_alias(alias, root))
        cfg["ckpt_path"] = str(found)
        print(f"attnlab: using checkpoint {found}", file=sys.stderr)

    def after_fit(self) -> None:
        if self.trainer.is_global_zero and (warning := cli_checks.no_validation(self.trainer)):
            print(f"attnlab: warning: {warning}", file=sys.stderr)
        best = self.trainer.checkpoint_callback
        if best is None or not best.best_model_path:
            return
        if best.best_model_score is None:  # no monitor: the checkpoint is the latest one
            print(f"attnlab: checkpoint {best.best_model_path}")
        else:
            print(f"attnlab: best {best.monitor}={float(best.best_model_score):.4f}, checkpoint {best.best_model_path}")


class CheckingCLI(AttnlabCLI):
    """`AttnlabCLI` for ``--print_config`` only, which exits once the arguments are parsed: its parser, two thirds of
    a check's time, is built once per process and reused by every check (`attnlab sweep` checks each grid value).
    A run must build its own: LightningCLI binds the instantiators it adds to the parser to the run."""

    built: ClassVar[AttnlabParser | None] = None

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict, subparser_kwargs: dict) -> None:
        if CheckingCLI.built is None:
            super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
            CheckingCLI.built = self.parser
        self.parser = CheckingCLI.built


def _fail(err: object, traceback_when_debugging: bool = False) -> None:
    if traceback_when_debugging and os.environ.get("ATTNLAB_DEBUG"):
        raise  # called in an except clause: the exception it handles, with its traceback
    sys.stderr.write(f"attnlab: error: {err}\n")  # one write: the processes of a DDP run share stderr
    sys.stderr.flush()
    sys.exit(2)


@contextlib.contextmanager
def _one_line():
    """A ValueError raised inside (a check of the user's input) ends the command as its one line."""
    try:
        yield
    except ValueError as err:
        _fail(err, traceback_when_debugging=True)


def _null_as_dict(argv: list[str]) -> list[str]:
    """``--model.init_args.attention.qk_norm=null`` as ``--model.init_args.attention={qk_norm: null}``: jsonargparse
    4.x does not read ``null`` for a field of a block (a dataclass) inside a subclass's ``init_args``, while the dict
    form sets that one field and keeps the others."""
    out = []
    for arg in argv:
        key, _, value = arg.partition("=")
        parts = key.split(".")
        if value == "null" and parts[0] == "--model" and len(parts) == 4 and parts[1] == "init_args":
            arg = f"{'.'.join(parts[:3])}={{{parts[3]}: null}}"
        out.append(arg)
    return out


def _subcommand_first(argv: list[str]) -> list[str]:
    """``attnlab -c FILE fit ...`` as ``attnlab fit -c FILE ...``, as the user means it. LightningCLI reads a config
    given before the subcommand as sections for the subcommands (``fit: {trainer: ...}``): such a file stays there."""
    at = next((i for i, arg in enumerate(argv) if arg in TRAINER), 0)
    if not at or any(cli_checks.file_with_key(argv[:at], [name]) for name in TRAINER):
        return argv
    return [argv[at], *argv[:at], *argv[at + 1 :]]


def main(args: list[str] | None = None, cli: type[AttnlabCLI] = AttnlabCLI) -> None:
    """Parse ``args`` (default: the command line) and run the Trainer's subcommand."""
    argv = _null_as_dict(_subcommand_first(sys.argv[1:] if args is None else list(args)))
    if args is None:  # LightningCLI reads sys.argv itself (and warns when given args from the command line)
        sys.argv[1:] = argv
    else:
        args = argv
    cli(
        model_class=pl.LightningModule,
        datamodule_class=pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_class=AttnlabParser,
        # our descriptions for `attnlab fit --help` and the others, not the first lines of the Trainer's docstrings
        parser_kwargs={"description": DESCRIPTION, **{name: {"description": line} for name, line in TRAINER.items()}},
        save_config_kwargs={"overwrite": True},
        save_config_callback=tracking.LoggedConfig,  # config.yaml in the run folder, and nested in W&B
        # progress bars only where someone watches; the run folder's metrics.csv is the default log (Lightning's
        # would be TensorBoard when installed); summary.json holds the parameter counts and FLOPs
        trainer_defaults={
            "enable_progress_bar": sys.stderr.isatty(),
            "enable_model_summary": False,
            "logger": {"class_path": "experiments.tracking.CSVLogger"},
            "callbacks": tracking.default_callbacks(),
        },
        args=args,
    )
