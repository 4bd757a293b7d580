"""The `attnlab` command: `attnlab fit|validate|test|predict` (LightningCLI, `experiments.trainer_cli`) and the `TOOLS`
`attnlab compare` and `attnlab sweep`. Each subcommand imports what it needs when it runs: `attnlab --help` and the
tools start without Lightning, torch or the models.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import os
import sys
import warnings

import huggingface_hub.constants

from experiments.subcommands import DESCRIPTION, TOOLS, TRAINER


def quiet_lightning_notes() -> None:
    """Leave out what concerns neither the run nor the user: Lightning's advertisement of its cloud logger, torch's
    deprecation of Lightning's own use of ``LeafSpec``, and ModelCheckpoint's note that a checkpoint tested or resumed
    into a new version folder lacks its top-k bookkeeping (`attnlab test --ckpt_path best` needs only the weights)."""
    logging.getLogger("pytorch_lightning.utilities.rank_zero").addFilter(
        lambda record: "litlogger" not in record.getMessage()
    )
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    warnings.filterwarnings("ignore", message=r"The dirpath has changed from")


def hub_offline_unless_asked() -> None:
    """Nothing downloads at run time unless the user sets ``HF_HUB_OFFLINE``. huggingface_hub reads the variable when
    this module imports it, before this runs: its constant, which every hub call reads, is set too."""
    if "HF_HUB_OFFLINE" not in os.environ:
        os.environ["HF_HUB_OFFLINE"] = "1"
        huggingface_hub.constants.HF_HUB_OFFLINE = True


def asks_for_help(argv: list[str]) -> bool:
    """`attnlab --help`: -h or --help before any subcommand (after one, it is that subcommand's help)."""
    for arg in argv:
        if arg in TRAINER or arg in TOOLS:
            return False
        if arg in ("-h", "--help"):
            return True
    return False


def print_help() -> None:
    """Every subcommand with its line, as LightningCLI's parser would list them, without building that parser: it
    imports Lightning, torch and every model (seconds) to show the options of each subcommand."""
    parser = argparse.ArgumentParser(
        prog="attnlab", description=DESCRIPTION, epilog="`attnlab SUBCOMMAND --help` shows its options."
    )
    parser.add_argument(
        "-c",
        "--config",
        help="A config file (yaml or json) for the subcommand: `attnlab -c FILE fit` is `attnlab fit -c FILE`.",
    )
    subcommands = parser.add_subparsers(title="subcommands", metavar="{" + ",".join([*TRAINER, *TOOLS]) + "}")
    for name, line in [*TRAINER.items(), *((name, line) for name, (_, line) in TOOLS.items())]:
        subcommands.add_parser(name, help=line)
    parser.print_help()


def main(args: list[str] | None = None) -> None:
    """`attnlab ARGS`; without ``args``, the process's own command line, and the process ends with it: everything
    it made is then frozen out of the garbage collector, whose passes over the 600,000 objects a run leaves while the
    interpreter shuts down would add 1.3 s to every command that trained (the OS frees that memory at once)."""
    try:
        run(args)
    finally:
        if args is None:
            gc.freeze()


def run(args: list[str] | None) -> None:
    hub_offline_unless_asked()
    quiet_lightning_notes()
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] and argv[0] in TOOLS:
        return importlib.import_module(TOOLS[argv[0]][0]).main(argv[1:])
    if asks_for_help(argv):
        return print_help()
    from experiments.trainer_cli import main as trainer_main

    trainer_main(args)


if __name__ == "__main__":
    main()
