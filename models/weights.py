"""Reading weights files safely: tensors and plain data only, never pickled code.

A ``.ckpt``/``.pth``/``.bin`` file is a pickle, and unpickling can run any code the file names
(``os.system`` through ``__reduce__``). ``torch.load(weights_only=True)`` refuses every object that
is not a tensor or plain data, before running anything; ``.safetensors`` holds tensors only by
construction. Every failure is one ValueError naming the setting and the file.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file


def load_weights_file(path: str | Path, key: str, map_location: Any = "cpu", safe_globals: Sequence[type] = ()) -> Any:
    """The contents of a local weights file (tensors, dicts, lists, numbers, strings).

    Args:
        path: a ``.safetensors`` file, or a ``torch.save`` file (``.ckpt``, ``.pth``, ``.bin``).
        key: the setting that named the file (``model.init_from``), for the error message.
        map_location: passed to ``torch.load``.
        safe_globals: plain-data classes also allowed (``argparse.Namespace``, which
            facebookresearch/detr's checkpoints hold as ``args``): their attributes are restored,
            no code named by the file runs.
    Raises:
        ValueError: the file holds pickled objects other than tensors and plain data (refused,
            nothing of it runs), or it is truncated or corrupt (see `unreadable`).
    """
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            return load_file(str(path))
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(path, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, EOFError, RuntimeError, SafetensorError) as err:
        raise unreadable(path, key, err) from None


def unreadable(path: str | Path, key: str, err: Exception) -> ValueError:
    """Why ``torch.load(path, weights_only=True)`` (or safetensors) failed, in one line naming ``key`` and the file."""
    if isinstance(err, pickle.UnpicklingError) and (
        found := re.search(r"GLOBAL ([\w.]+)", str(err))
    ):  # what it would have called
        return ValueError(
            f"{key}: {path} was refused: it holds pickled code or objects other than tensors ({found.group(1)}); "
            "attnlab never unpickles arbitrary objects: give a state dict of tensors, a .safetensors file "
            "or a checkpoint written by `attnlab fit`"
        )
    if isinstance(err, EOFError):
        reason = "it ends early"
    elif isinstance(err, pickle.UnpicklingError):
        reason = "no PyTorch weights format"
    else:  # torch's zip reader (RuntimeError), safetensors' header check
        reason = str(err).split(". ")[0].strip()
    return ValueError(
        f"{key}: {path} cannot be read as weights ({reason}): it is truncated, corrupt or not a weights file"
    )
