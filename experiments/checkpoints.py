"""Whether a ``--ckpt_path`` checkpoint fits the config about to restore it, checked before anything is restored or
written: its LightningModule class and the data facts linked into the model (`experiments.links`), as Lightning
saved them in the checkpoint's ``hyper_parameters`` (the class as ``_class_path`` when the CLI built the model).
Each failure is a ValueError whose text is the one line the CLI prints.
"""

from __future__ import annotations

import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from experiments import renames
from experiments.links import LINKED_ATTRIBUTES
from experiments.runfolder import newest_checkpoint
from models.weights import unreadable


def saved_hyperparameters(path: str | Path, weights_only: bool = True) -> dict[str, Any]:
    """The ``hyper_parameters`` of the checkpoint ``path`` ({} when it has none). The tensors are memory-mapped, not
    read (torch's zip format; an older file is read whole). ``weights_only=False`` unpickles what the file names:
    only for a file the user trusts (``--weights_only false``)."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=weights_only, mmap=zipfile.is_zipfile(path))
    except (pickle.UnpicklingError, EOFError, RuntimeError) as err:
        raise unreadable(path, "ckpt_path", err) from None
    hparams = checkpoint.get("hyper_parameters") if isinstance(checkpoint, dict) else None
    return dict(hparams) if isinstance(hparams, dict) else {}


def check_fits(
    path: str | Path | None, class_path: str, facts: Mapping[str, Any] | None = None, weights_only: bool = True
) -> None:
    """Refuse the checkpoint ``path`` unless it holds a ``class_path`` (the config's ``model.class_path``) whose linked
    data facts equal those in ``facts`` (the model's hyper-parameters, linked from the config's data). A fact or class
    the checkpoint does not record is not compared; no path, or one that is not a local file, is not checked.

    Raises:
        ValueError: one line naming the checkpoint, what it holds and what the config builds.
    """
    if not path or not Path(path).is_file():
        return
    saved, facts = saved_hyperparameters(path, weights_only), facts or {}
    held = saved.get("_class_path") and renames.current(saved["_class_path"])  # a path from before the rooms too
    if held and held != renames.current(class_path):
        raise ValueError(f"--ckpt_path {path} holds a {held}; this config trains {class_path}")
    differ = [n for n in LINKED_ATTRIBUTES if n in saved and n in facts and saved[n] != facts[n]]
    if differ:
        run_config = Path(path).parent.parent / "config.yaml"  # <run folder>/checkpoints/<name>.ckpt
        source = run_config if run_config.is_file() else "the run that wrote it"
        raise ValueError(
            f"--ckpt_path {path} holds a {held or class_path} of {_listed(saved, differ)}; this config's data gives "
            f"{_listed(facts, differ)}: use the data settings of {source}"
        )


def _listed(values: Mapping[str, Any], names: list[str]) -> str:
    return ", ".join(f"{n}={values[n]}" for n in names)


def missing_alias(alias: str, root: Path) -> str:
    """Why ``--ckpt_path best|last`` found nothing under ``root``, and what to pass instead."""
    message = f"--ckpt_path {alias}: no '{alias}*.ckpt' under {root}/"
    last = newest_checkpoint(root, "last") if alias == "best" else None
    if last is not None:  # e.g. a fit that never validated: nothing chose a best checkpoint
        return f"{message}, but a last one is there: pass --ckpt_path last to use {last}"
    return f"{message}; run `attnlab fit` with this config first or pass a checkpoint file"


def follow_moved_folder(state: dict[str, Any], dirpath: str, resumed: str | Path) -> None:
    """A ModelCheckpoint's saved ``state``, as a fit that resumes from the checkpoint ``resumed`` and saves into
    ``dirpath`` should reload it. The state names the folder it was saved in; where that differs from ``dirpath``,
    Lightning reloads its best path only, and neither the best score nor the files it keeps: in a run folder moved
    or copied whole (a sweep's, to another disk) the resumed fit would write best-v1.ckpt beside best.ckpt, whatever
    its score, and report the best since the move. So: ``resumed`` lying in ``dirpath`` (the folder moved with its
    checkpoints), the state's paths move there too; ``resumed`` lying elsewhere (a file of another run), the best
    path, that run's file, is dropped."""
    old = state.get("dirpath")
    if not old or not dirpath or old == dirpath:
        return
    if Path(resumed).resolve().parent != Path(dirpath).resolve():
        state["best_model_path"] = ""
        return

    def moved(path: str | None) -> str | None:
        return str(Path(dirpath) / Path(path).relative_to(old)) if path and Path(path).is_relative_to(old) else path

    state["dirpath"] = dirpath
    for key in ("best_model_path", "kth_best_model_path", "last_model_path"):
        if key in state:
            state[key] = moved(state[key])
    state["best_k_models"] = {moved(path): score for path, score in (state.get("best_k_models") or {}).items()}
