"""Why a class path (``module.Class``) does not import, said so that a user can act on it."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def missing_module(name: str) -> str:
    """The line for Python's ``No module named 'NAME'``: where ./NAME.py (or the folder ./NAME/) is in the working
    directory, the module is there but not on the import path, as when `attnlab` runs beside a researcher's file
    without ``PYTHONPATH``."""
    top = name.split(".")[0]
    if importlib.util.find_spec(top) is None:
        for here, shown in ((Path(f"{top}.py"), f"./{top}.py"), (Path(top), f"./{top}/")):
            if here.exists():
                return (
                    f"module {top!r} is not importable, but {shown} is in the working directory: "
                    "run with PYTHONPATH=. (or install it)"
                )
    return f"No module named {name!r}"
