"""A bad argument of an attention variant, as jsonargparse reports it, -> the one line `models.core.attention_config` says
for it: ``model.init_args.attention.normalization.init_args.kk: not an argument of my_attention.TopK (it takes k,
temperature); did you mean 'k'?``, or for a value of the wrong type the argument, what it takes and the class's
signature. jsonargparse checks ``{class_path, init_args}`` against the class itself and names only the option."""

from __future__ import annotations

import importlib
import inspect
import re

from models.core.attention_config import CORE_ARGUMENTS, check_init_args

_FIELD = re.compile(r'Parser key "((?:[\w.]+\.)?attention\.(similarity|normalization|kernel))":')
_OUTER = re.compile(r'^Parser key "(\w+)":')
_CLASS = re.compile(r"callable class: .*?Got value: Namespace\(class_path='([\w.]+)'", re.S)
_UNKNOWN = re.compile(r"callable class: Option '(\w+)' is not accepted")
_WRONG_TYPE = re.compile(r'callable class: Parser key "(\w+)":\s*Expected (?:a )?(.+?)\. Got value: (.*?)\. Got value')


def variant_error(message: str) -> str | None:
    """jsonargparse's ``message`` -> the line naming the variant's argument; None for any other message."""
    field, found = _FIELD.search(message), _CLASS.search(message)
    if field is None or found is None:
        return None
    outer = _OUTER.match(message.strip())
    key = field.group(1) if outer is None else f"{outer.group(1)}.init_args.{field.group(1)}"
    module, _, name = found.group(1).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    core = CORE_ARGUMENTS if field.group(2) == "kernel" else ()
    if unknown := _UNKNOWN.search(message):
        try:
            check_init_args(field.group(2), cls, {unknown.group(1): None}, core)
        except ValueError as error:  # "attention.KEY.init_args.NAME: ..."
            return f"{key}{str(error).removeprefix(f'attention.{field.group(2)}')}"
        return None
    if wrong := _WRONG_TYPE.search(message):
        expected = re.sub(r"<class '(?:[\w.]+\.)?(\w+)'>", r"\1", wrong.group(2))
        params = [  # a postponed annotation prints quoted: "k: 'int' = 2"
            str(p).replace(f"'{p.annotation}'", p.annotation) if isinstance(p.annotation, str) else str(p)
            for n, p in inspect.signature(cls).parameters.items()
            if n not in core
        ]
        return (
            f"{key}.init_args.{wrong.group(1)}: expected {expected}, got {wrong.group(3)!r} "
            f"({found.group(1)} takes {', '.join(params)})"
        )
    return None
