"""Where a run's attention came from: the files of the researcher's own classes in its attention block.

A block's ``similarity``, ``normalization`` or ``kernel`` given as a class path (or ``{class_path, init_args}``)
whose module is a file outside attnlab's packages and outside installed packages is a file of one's own. A run
records each such file's path and sha256 in ``summary.json`` (``attention_sources``) and as a comment at the top of
``config.yaml``, and copies it into ``<run folder>/attention_sources/<module>.py``, so that a later edit of the file
can be traced; `attnlab compare` says when the runs of one cell used different contents.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import sysconfig
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FIELDS = ("similarity", "normalization", "kernel")  # the block's fields that take a class
FOLDER = "attention_sources"
_ROOT = Path(__file__).resolve().parents[1]
_PACKAGES = tuple(_ROOT / name for name in ("models", "datamodules", "experiments"))


def _get(obj: Any, key: str) -> Any:
    """``obj[key]`` of a mapping, ``obj.key`` of a dataclass or a jsonargparse Namespace; None when absent."""
    return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)


def class_path(value: Any) -> str | None:
    """The class path of one field's value: a path string, ``{class_path, init_args}``, a class, a partial of a
    class (what the CLI builds from init_args); None for a built-in name (no dot) or no value."""
    if isinstance(value, functools.partial):
        value = value.func
    if inspect.isclass(value):
        return f"{value.__module__}.{value.__qualname__}"
    if value is not None and not isinstance(value, str):
        return class_path(_get(value, "class_path"))
    return value if isinstance(value, str) and "." in value else None


def class_paths(block: Any) -> dict[str, str]:
    """Field -> class path of each field of an attention block that names a class: the block as `AttentionConfig`,
    as a dict (hyper-parameters read back, YAML) or as a Namespace."""
    paths = {field: class_path(_get(block, field)) for field in FIELDS} if block is not None else {}
    return {field: path for field, path in paths.items() if path}


def _resolve(path: str) -> type | None:
    """The class at ``path`` (module.Class or module.Outer.Inner); None when no prefix of it imports."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name, None)
        return obj if inspect.isclass(obj) else None
    return None


def _own_file(cls: type) -> Path | None:
    """The file that defines ``cls`` when it is one of one's own: not in attnlab's packages, the standard library or
    an installed package."""
    try:
        file = Path(inspect.getfile(cls)).resolve()
    except (TypeError, OSError):  # defined in C, or with no file
        return None
    installed = {Path(sysconfig.get_paths()[key]).resolve() for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    if any(file.is_relative_to(folder) for folder in (*_PACKAGES, *installed)):
        return None
    return None if {"site-packages", "dist-packages"} & set(file.parts) else file


def record_sources(hparams: Mapping[str, Any], run_dir: Path | None = None) -> list[dict[str, str]]:
    """The files of one's own behind the model's attention block (``hparams["attention"]``): one entry a field,
    {"field", "class_path", "path", "sha256", "copy"}; [] for built-ins. With ``run_dir``, each file is copied to
    ``run_dir/<copy>`` from the bytes that were hashed."""
    sources = []
    for field, path in class_paths(hparams.get("attention")).items():
        cls = _resolve(path)
        file = _own_file(cls) if cls is not None else None
        if file is None or not file.is_file():
            continue
        data = file.read_bytes()
        copy = f"{FOLDER}/{cls.__module__}{file.suffix}"
        if run_dir is not None:
            (Path(run_dir) / FOLDER).mkdir(parents=True, exist_ok=True)
            (Path(run_dir) / copy).write_bytes(data)
        sha256 = hashlib.sha256(data).hexdigest()
        sources.append({"field": field, "class_path": path, "path": str(file), "sha256": sha256, "copy": copy})
    return sources


def yaml_comment(sources: list[dict[str, str]]) -> str:
    """The lines that head ``config.yaml`` when the run's attention has files of its own ("" without)."""
    if not sources:
        return ""
    lines = [f"# attention sources (as this run started; copies in {FOLDER}/ beside this file):"]
    lines += [f"#   {s['field']}: {s['class_path']} from {s['path']} sha256={s['sha256']}" for s in sources]
    return "\n".join(lines) + "\n"
