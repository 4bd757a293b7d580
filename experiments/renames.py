"""Class paths from before the rooms of `models/`, `datamodules/` and `experiments/callbacks/`, as the configs,
checkpoints, run folders and sweep folders written then name them (``models.text_module.LanguageModelModule``).

`MOVED` is the one table: each old module, and the modules that hold its names now, the one configs name first.
`install` lets Python import an old module name as a view onto those (so jsonargparse, a checkpoint's
``_class_path`` and a sweep's configs resolve an old ``class_path`` unchanged); `current` is a path's name today,
from the table alone (the run-folder readers compare settings without importing a model).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Any

_CORE = ("attention", "attend", "attention_config", "position", "transformer", "padding_free", "kv_cache", "registers")
_DETECTION = ("matcher", "criterion", "box_ops", "backbone", "denoising", "query_selection", "coco_eval")
_TEXT_DATA = ("base", "batching", "prepare", "sources", "tokenizers")
_CALLBACKS = ("text_callbacks", "detection_callbacks", "attention_maps", "guards", "interrupts", "schedule")

MOVED: dict[str, tuple[str, ...]] = {
    **{f"models.{name}": (f"models.core.{name}",) for name in _CORE},
    "models.attention": ("models.core.attention", "models.core.capture"),
    "models.text_module": ("models.text", "models.text.training"),
    "models.decoding": ("models.text.decoding",),
    "models.hf_text": ("models.text.hf",),
    "models.vit": ("models.vision", "models.vision.vit", "models.vision.pretrained"),
    "models.vit_timm": ("models.vision.timm_names",),
    "models.vit_module": ("models.vision",),
    "models.detr": ("models.detection", "models.detection.detr"),
    "models.detr_init": ("models.detection.pretrained",),
    "models.detr_module": ("models.detection",),
    **{f"models.{name}": (f"models.detection.{name}",) for name in _DETECTION},
    **{f"datamodules.text_{name}": (f"datamodules.text.{name}",) for name in _TEXT_DATA},
    "datamodules.toy_text": ("datamodules.text.toy",),
    "datamodules.token_store": ("datamodules.text.token_store",),
    "datamodules.arrow_sources": ("datamodules.text.arrow_sources",),
    "datamodules.vision_files": ("datamodules.vision.files",),
    "datamodules.image_lists": ("datamodules.vision.image_lists",),
    "datamodules.random_images": ("datamodules.vision", "datamodules.vision.random_images"),
    "datamodules.coco": ("datamodules.detection", "datamodules.detection.coco", "datamodules.detection.coco_format"),
    "datamodules.voc": ("datamodules.detection", "datamodules.detection.voc"),
    "datamodules.synthetic": ("datamodules.detection", "datamodules.detection.shapes"),
    "datamodules.detection_transforms": ("datamodules.detection.transforms",),
    **{f"experiments.{name}": ("experiments.callbacks",) for name in _CALLBACKS},
    "experiments.schedule": ("experiments.callbacks", "experiments.callbacks.time_budget"),
    "experiments.sinks": ("experiments.callbacks.sinks",),
    "experiments.quantization": ("experiments.callbacks.w8a8",),
    "experiments.stats": ("experiments.callbacks.attention_stats",),
}


def current(path: str) -> str:
    """The name of the class (or function) at the dotted ``path`` today: ``models.text_module.TranslationModule`` ->
    ``models.text.TranslationModule``; a path that did not move, unchanged."""
    module, _, name = path.rpartition(".")
    return f"{MOVED[module][0]}.{name}" if module in MOVED else path


def renamed(value: Any) -> Any:
    """``value`` (a run folder's JSON: settings, hyper-parameters, a sweep's grid) with every class path it holds as
    `current` names it, so runs written before the rooms compare with the runs of today."""
    if isinstance(value, str):
        return current(value)
    if isinstance(value, dict):
        return {key: renamed(inner) for key, inner in value.items()}
    if isinstance(value, list):
        return [renamed(inner) for inner in value]
    return value


def rename_class_paths(config: Any, notes: set[str] | None = None) -> set[str]:
    """Every ``class_path`` in a parsed config (jsonargparse's Namespace, whose ``items()`` are its leaves by dotted
    key, with lists and mappings inside) as `current` names it, in place, so that a run records one name per class;
    returns the old paths it renamed."""
    notes = set() if notes is None else notes
    items = config.items() if hasattr(config, "items") else enumerate(config) if isinstance(config, list) else ()
    for key, value in list(items):
        if isinstance(value, str) and str(key).rpartition(".")[2] == "class_path" and current(value) != value:
            config[key] = current(value)
            notes.add(value)
        elif not isinstance(value, str):
            rename_class_paths(value, notes)
    return notes


class _OldModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module name of `MOVED` as a module whose attributes are looked up where they live now. It is
    asked last (after the real files), so it never hides a module that exists."""

    def find_spec(self, fullname: str, path, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec):
        return None

    def exec_module(self, module: ModuleType) -> None:
        homes = MOVED[module.__name__]

        def moved(name: str):
            for home in homes:
                if (found := getattr(importlib.import_module(home), name, None)) is not None:
                    return found
            raise AttributeError(f"{module.__name__}.{name} is not in {' or '.join(homes)}, where that module moved")

        module.__getattr__ = moved
        module.__all__ = []  # `from old import *` names nothing


def install() -> None:
    """Let the old module names import (once per process)."""
    if not any(isinstance(finder, _OldModules) for finder in sys.meta_path):
        sys.meta_path.append(_OldModules())
