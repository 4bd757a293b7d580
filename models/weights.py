"""One path for foreign weights: where they are, reading them safely, checking that they fit.

    resolve (a path, or a hub name through huggingface_hub's cache) -> read_state (tensors only, unwrapped)
    -> the family's rename (``timm_to_attnlab`` in `models.vision.timm_names`; ``hf_to_attnlab`` in `models.detection.pretrained` and
    ``convert_official_state_dict`` in `models.detection.detr`;
    ``gpt2_to_attnlab``/``marian_to_attnlab``/``llama_to_attnlab`` in `models.text.hf`) -> load_checked (every tensor, or one error)

A ``.ckpt``/``.pth``/``.bin`` file is a pickle, and unpickling can run any code the file names
(``os.system`` through ``__reduce__``). ``torch.load(weights_only=True)`` refuses every object that
is not a tensor or plain data, before running anything; ``.safetensors`` holds tensors only by
construction. Every failure is one error naming the setting and the file.
"""

from __future__ import annotations

import json
import pickle
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor, nn


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


# ----------------------------------------------------------------------------- where the weights are

WEIGHT_SUFFIXES = (".ckpt", ".pth", ".pt", ".bin", ".safetensors")
_HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+")  # "owner/name", as the Hugging Face hub names repositories
# a save_pretrained folder's weights: one file, or shards listed by an index; safetensors first
FOLDER_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def resolve(name: str, key: str, expected: str, hub_files: Sequence[str] | None) -> Path:
    """The local file or folder that ``name`` names: a path as it is, or a Hugging Face hub name ("owner/name")
    as the folder of its snapshot in huggingface_hub's cache, downloaded into it only when online.

    Offline is what huggingface_hub itself obeys, ``huggingface_hub.constants.HF_HUB_OFFLINE``: it reads the
    environment variable once, at its import (which importing pytorch_lightning does), so a program that turns
    the hub off later must set the constant too.

    Args:
        name: the setting's value.
        key: the setting (``model.init_from``), for the messages.
        expected: what the setting accepts, for the message when ``name`` is neither a path nor a hub name.
        hub_files: files of the repository besides its weights (``allow_patterns``); None: local paths only.
    Raises:
        FileNotFoundError: no such path, and ``name`` is no hub name (or hub names are not accepted).
        ValueError: a hub name that offline is not in the cache, or that the hub does not know.
    """
    path = Path(name).expanduser()
    if path.exists():
        return path
    if hub_files is None or not _HUB_NAME.fullmatch(name) or name.endswith(WEIGHT_SUFFIXES):
        raise FileNotFoundError(f"{key}: {path} does not exist ({expected})")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(name, allow_patterns=[*hub_files, "model*.safetensors", "*.index.json"]))
        if not any(folder.glob("model*.safetensors")):  # older repositories hold pytorch_model.bin only
            folder = Path(snapshot_download(name, allow_patterns=[*hub_files, "pytorch_model*.bin", "*.index.json"]))
    except LocalEntryNotFoundError as err:
        why = (
            "offline (HF_HUB_OFFLINE=1) the Hugging Face cache does not hold it; set HF_HUB_OFFLINE=0 to download it"
            if constants.HF_HUB_OFFLINE
            else f"the Hugging Face cache does not hold it and the hub cannot be reached ({str(err).splitlines()[0]})"
        )
        raise ValueError(
            f"{key}={name}: not a local path, and {why}, or give a local folder instead "
            f"(where online: `hf download {name} --local-dir DIR`, then {key}=DIR)"
        ) from None
    except (HfHubHTTPError, HFValidationError) as err:
        raise ValueError(
            f"{key}={name}: neither a local path nor a Hugging Face hub repository ({str(err).splitlines()[0]})"
        ) from None
    return folder


# ----------------------------------------------------------------------------- reading, checking, loading


def read_state(path: Path, key: str, safe_globals: Sequence[type] = ()) -> dict[str, Tensor]:
    """The state dict a weights file or a ``save_pretrained`` folder holds, tensors only.

    A file's state dict may sit under ``"state_dict"`` (Lightning) and/or ``"model"`` (facebookresearch/detr,
    torchvision references); a ``module.`` prefix (saved from a DDP-wrapped model) is removed. A folder holds
    one of `FOLDER_WEIGHTS`, or shards listed by an index.
    """
    if path.is_dir():
        found = next((path / name for name in FOLDER_WEIGHTS if (path / name).is_file()), None)
        if found is None:
            raise FileNotFoundError(f"{key}: {path} holds no weights ({', '.join(FOLDER_WEIGHTS[::2])})")
        if found.name.endswith(".index.json"):
            shards = sorted(set(json.loads(found.read_text())["weight_map"].values()))
            return {k: v for shard in shards for k, v in load_weights_file(path / shard, key).items()}
        path = found
    state = load_weights_file(path, key, safe_globals=safe_globals)
    for wrapper in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    if not isinstance(state, dict) or not state or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(f"{key}: {path} does not hold a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}


def network_state(state: dict[str, Tensor], attribute: str = "model") -> dict[str, Tensor]:
    """The network's tensors of an `attnlab fit` checkpoint (the LightningModule's state dict: the network is its
    ``model``; other tensors, a criterion's buffers, are not the network's); any other state dict as it is."""
    prefix = f"{attribute}."
    if not any(k.startswith(prefix) for k in state):
        return state
    return {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}


def load_checked(model: nn.Module, state: dict[str, Tensor], source: str, what: str, hint: str = "") -> None:
    """Load ``state`` (the model's key names) into ``model``, every tensor of it, or raise one ValueError.

    A matrix the model ties (embeddings = output projection) is given once and fills all its names. BatchNorm's
    ``num_batches_tracked`` counters may be absent or extra (files of frozen trunks lack them; frozen BatchNorm
    has none). The error names ``source``, the first tensor of another shape, the missing and the unexpected keys.

    Args:
        source: what was read (``model.init_from=DIR``), the start of the message.
        what: the model (``ViT``, ``DETR``): "... does not fit this {what}".
        hint: what to do, the end of the message.
    """
    state, own = dict(state), model.state_dict()
    tied: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(p), []).append(name)
    for names in tied.values():
        if given := next((n for n in names if n in state), None):
            for name in names:
                state.setdefault(name, state[given])
    counters = {k for k in own if k.endswith("num_batches_tracked")}
    state = {k: v for k, v in state.items() if k in own or not k.endswith("num_batches_tracked")}
    state.update({k: own[k] for k in counters if k not in state})
    missing, unexpected = [k for k in own if k not in state], [k for k in state if k not in own]
    wrong = [k for k in state if k in own and state[k].shape != own[k].shape]
    if missing or unexpected or wrong:
        parts = (
            [
                f"{wrong[0]} is {tuple(own[wrong[0]].shape)} in the model and {tuple(state[wrong[0]].shape)} in the file"
                + (f" ({len(wrong)} tensors of another shape)" if len(wrong) > 1 else "")
            ]
            if wrong
            else []
        )
        for label, keys in (("the file lacks", missing), ("the model lacks", unexpected)):
            if keys:
                parts.append(f"{label} {keys[:3]}" + (f" ({len(keys)} in all)" if len(keys) > 3 else ""))
        raise ValueError(f"{source} does not fit this {what}: {'; '.join(parts)}" + (f"; {hint}" if hint else ""))
    model.load_state_dict(state)
