"""The attention block, `AttentionConfig`: what every model takes as ``attention:`` and hands to every
`models.core.attention.MultiHeadAttention`, and the checks of a researcher's own classes in it.

A variant (``similarity``, ``normalization``, ``kernel``) is given in one of three forms, as jsonargparse takes a
class everywhere else, on the command line, in YAML and in a sweep grid::

    normalization: softmax                                   # a built-in, by name
    normalization: my_attention.ReluNorm                     # a class of one's own, by path (module.Class)
    normalization: {class_path: my_attention.TopK, init_args: {k: 8}}        # a class with its arguments
    normalization: {class_path: models.core.attend.ClippedSoftmax, init_args: {alpha: 4}}   # a built-in's constants

    --model.init_args.attention.normalization='{class_path: my_attention.TopK, init_args: {k: 8}}'
    --model.init_args.attention.normalization.init_args.k=8    # after a class_path given as {class_path: ...}
    grid: {model.init_args.attention.normalization.init_args.k: [2, 4, 8]}   # a sweep over k

The built-ins' classes and their constants are in `models.core.attend` (`ClippedSoftmax`: alpha, gamma, zeta;
`SigmoidAttention`: bias; `Softmax1`: sink_logit); the command line and YAML also take such a class by its name alone
(``{class_path: ClippedSoftmax, ...}``, jsonargparse's lookup among the nn.Module classes) and record its path. The
block holds plain data, as YAML, ``config.yaml`` and a checkpoint's hyper-parameters do: a name or a class path, or
``{class_path, init_args}`` (a class given in Python is held as its path; the CLI writes a class path as
``{class_path: ...}``). Each layer builds its own instances, so a variant's parameters are per layer and in the
checkpoint.

``kernel``, a class of one's own in the same forms, replaces the whole attention map of every layer
(`models.core.attend.attention_own_kernel` says what it takes and returns); its ``__init__`` receives the layer's
``num_heads``, ``head_dim`` and attention-weight ``dropout`` when it names them, so its parameters exist when the
model is built. It keeps the projections, QK-norm, rotary positions, KV caches, grouped-query heads and the gate
around it; it is refused beside a normalisation or similarity other than the default (the kernel computes both), with
a position bias (`models.core.attend`), and wherever attention weights are recorded (`capture_attention`) if it returns
none.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, Protocol

import torch
from torch import Tensor, nn

from models.core.attend import NORMALIZATIONS, kernel_output

SIMILARITIES = ("scaled_dot", "dot", "general")
QKNorm = Literal["layernorm", "rmsnorm"]
Gate = Literal["headwise", "elementwise"]
QK_NORMS = {"layernorm": nn.LayerNorm, "rmsnorm": nn.RMSNorm}
Spec = str | dict  # a name or class path, or {class_path, init_args}


class KernelClass(Protocol):
    """A kernel class as the CLI takes it: the core builds it with the layer's sizes (those its ``__init__`` names)."""

    def __call__(self, *, num_heads: int, head_dim: int, dropout: float) -> nn.Module: ...


CORE_ARGUMENTS = ("num_heads", "head_dim", "dropout")  # what the core gives a kernel's __init__ (KernelClass)


def _path(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def plain(key: str, value: Any) -> Any:
    """A variant as the block holds it: a name or class path, or ``{class_path, init_args}``. The CLI instantiates
    ``{class_path, init_args}`` (a ``Callable`` type to jsonargparse) into a partial of the class with its arguments;
    a class given in Python becomes its path."""
    if isinstance(value, partial):
        cls = next((a for a in (value.func, *value.args) if inspect.isclass(a)), value.func)
        value = {"class_path": cls, "init_args": value.keywords}
    if isinstance(value, Mapping):
        path, init_args = value.get("class_path"), dict(value.get("init_args") or {})
        if set(value) - {"class_path", "init_args"} or not (isinstance(path, str) or inspect.isclass(path)):
            raise ValueError(
                f"attention.{key}={dict(value)!r}: expected a name, a class path or {{class_path, init_args}}"
            )
        path = _path(path) if inspect.isclass(path) else path
        return {"class_path": path, "init_args": init_args} if init_args else path
    return _path(value) if inspect.isclass(value) or inspect.isfunction(value) else value


def class_path(spec: Spec) -> str:
    """The name or class path of a variant as the block holds it."""
    return spec["class_path"] if isinstance(spec, dict) else spec


def init_args(spec: Spec) -> dict[str, Any]:
    return dict(spec.get("init_args") or {}) if isinstance(spec, dict) else {}


def resolve_class(key: str, spec: Spec, builtins: tuple[str, ...]) -> type:
    """The class a variant names: a built-in's, or the one at its path (module.Class); one line when there is none."""
    path = class_path(spec)
    if key == "normalization" and path in NORMALIZATIONS:
        return NORMALIZATIONS[path]
    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError) as error:
        cls, why = None, f"{type(error).__name__}: {error}"
    else:
        why = "no such class" if module else "no module named"
    if not (inspect.isclass(cls) and issubclass(cls, nn.Module)):
        choices = f"neither one of {', '.join(builtins)} nor" if builtins else "not"
        raise ValueError(
            f"attention.{key}={path!r} is {choices} the class path of an nn.Module (module.Class, importable from "
            f"here: {why})"
        )
    return cls


def check_init_args(key: str, cls: type, given: dict[str, Any], core: tuple[str, ...] = ()) -> None:
    """One line for an argument that ``cls.__init__`` does not take (or that the core gives), with the nearest."""
    params = inspect.signature(cls).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    accepted = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in core]
    for name in given:
        if name in core:
            raise ValueError(f"attention.{key}.init_args.{name}: set by the attention layer itself; leave it out")
        if name not in accepted:
            close = difflib.get_close_matches(name, accepted, n=1)
            raise ValueError(
                f"attention.{key}.init_args.{name}: not an argument of {_path(cls)} (it takes "
                f"{', '.join(accepted) or 'none'})" + (f"; did you mean {close[0]!r}?" if close else "")
            )


def _probe(key: str, spec: Spec, module: nn.Module, probe: tuple[Tensor | None, ...]) -> None:
    """Call ``module`` on ``probe``: its output must have the logits' shape (1, 1, 2, 3)."""
    try:
        out = module(*probe)
    except Exception as error:  # noqa: BLE001 - any failure of a user's class is reported as one line
        raise ValueError(
            f"attention.{key}={class_path(spec)!r} failed on a probe call: {type(error).__name__}: {error}"
        ) from None
    if not isinstance(out, Tensor) or out.shape != (1, 1, 2, 3):
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(
            f"attention.{key}={class_path(spec)!r} returned {got} where the logits are (1, 1, 2, 3) (B, H, Lq, Lk); "
            "it must return that shape"
        )


def _instance(key: str, spec: Spec, cls: type, **core: Any) -> nn.Module:
    try:
        return cls(**init_args(spec), **core)
    except Exception as error:  # noqa: BLE001 - a wrong value in init_args, as the class itself says
        given = f" with init_args {init_args(spec)}" if init_args(spec) else ""
        raise ValueError(f"attention.{key}={class_path(spec)!r}{given}: {type(error).__name__}: {error}") from None


@dataclass(frozen=True)
class AttentionConfig:
    """The attention block: every model takes it as ``attention:`` and passes it to every `MultiHeadAttention`.

    Args:
        similarity: "scaled_dot", "dot", "general", or a class of your own (module docstring; `models.core.attention`).
        qk_norm: null, "layernorm" or "rmsnorm" on each head's queries and keys.
        normalization: over the keys: "softmax", "softmax1", "clipped", "sigmoid", or a class, a built-in's with
            its constants or your own (module docstring; `models.core.attend`).
        gate: null, "headwise" or "elementwise": a sigmoid gate on each head's output (`models.core.attention`).
        kernel: null, or a class of your own that computes each head's output from q, k, v and the mask in place of
            similarity and normalisation (module docstring).
        window: null, or sliding-window attention (Beltagy et al. 2020; Mistral): each query sees the ``window``
            keys up to itself in causal attention (i - window < j <= i), those closer than ``window`` otherwise
            (|i - j| < window); see `models.core.masks`.
        memory_budget_mib: the fp32 scores (B, H, Lq, Lk) of one call larger than this are computed a block of
            query rows at a time, each block recomputed in the backward (`models.core.chunked`): exact, with memory
            O(rows · Lk) per head. 4 MiB keeps one causal layer at L = 8,192 within 1.5x the memory of SDPA on the CPU
            (benchmarks/RESULTS.md, "Long context"); a GPU with memory to spare runs fewer, larger blocks at 256.
    """

    similarity: Literal["scaled_dot", "dot", "general"] | Callable[[], nn.Module] = "scaled_dot"
    qk_norm: QKNorm | None = None
    normalization: Literal["softmax", "softmax1", "clipped", "sigmoid"] | Callable[[], nn.Module] = "softmax"
    gate: Gate | None = None
    kernel: KernelClass | None = None
    window: int | None = None
    memory_budget_mib: float = 4.0

    def __post_init__(self):
        for key in ("similarity", "normalization", "kernel"):
            object.__setattr__(self, key, plain(key, getattr(self, key)))
        if self.similarity not in SIMILARITIES:
            probe = (torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 3, 4))
            _probe("similarity", self.similarity, self.build("similarity"), probe)
        if not isinstance(self.normalization, str) or self.normalization not in NORMALIZATIONS:
            _probe("normalization", self.normalization, self.build("normalization"), (torch.zeros(1, 1, 2, 3), None))
        if self.kernel is not None:
            self._check_kernel()
        if self.qk_norm is not None and self.qk_norm not in QK_NORMS:
            raise ValueError(f"attention.qk_norm={self.qk_norm!r} is not known; choose null, {' or '.join(QK_NORMS)}")
        if self.gate not in (None, "headwise", "elementwise"):
            raise ValueError(f"attention.gate={self.gate!r} is not known; choose null, headwise or elementwise")
        if self.window is not None and (isinstance(self.window, bool) or self.window < 1):
            raise ValueError(f"attention.window={self.window!r}: give the keys a query sees (>= 1), or null for all")
        if not self.memory_budget_mib > 0:
            raise ValueError(f"attention.memory_budget_mib={self.memory_budget_mib!r} must be > 0 (MiB of scores)")

    def _check_kernel(self) -> None:
        check_init_args("kernel", resolve_class("kernel", self.kernel, ()), init_args(self.kernel), CORE_ARGUMENTS)
        defaults = {"similarity": "scaled_dot", "normalization": "softmax"}
        replaced = [f"{key}={getattr(self, key)!r}" for key, name in defaults.items() if getattr(self, key) != name]
        if replaced:
            raise ValueError(
                f"attention.kernel={class_path(self.kernel)} computes the whole attention map; leave similarity and "
                f"normalization at scaled_dot and softmax, not {' and '.join(replaced)}"
            )

    def build(self, key: str) -> nn.Module:
        """A fresh instance of the normalisation (``key="normalization"``) or of one's own similarity."""
        spec = getattr(self, key)
        cls = resolve_class(key, spec, SIMILARITIES if key == "similarity" else tuple(NORMALIZATIONS))
        check_init_args(key, cls, init_args(spec))
        return _instance(key, spec, cls)

    def build_kernel(self, num_heads: int, head_dim: int, dropout: float) -> tuple[nn.Module, bool]:
        """A fresh instance of ``kernel`` for a layer of these sizes, and whether it returns weights (a probe call
        on zeros: q (1, H, 2, d), k and v (1, H, 3, d), no mask)."""
        cls, name = resolve_class("kernel", self.kernel, ()), class_path(self.kernel)
        sizes = dict(num_heads=num_heads, head_dim=head_dim, dropout=dropout)
        taken = inspect.signature(cls).parameters
        kernel = _instance("kernel", self.kernel, cls, **{k: v for k, v in sizes.items() if k in taken})
        q, kv = torch.zeros(1, num_heads, 2, head_dim), torch.zeros(1, num_heads, 3, head_dim)
        was_training = kernel.training
        try:
            with torch.no_grad():
                out = kernel.eval()(q, kv, kv, None)
        except Exception as error:  # noqa: BLE001 - any failure of a user's class is reported as one line
            raise ValueError(
                f"attention.kernel={name} failed on a probe call (q (1, {num_heads}, 2, {head_dim}), k and v "
                f"(1, {num_heads}, 3, {head_dim}), blocked None): {type(error).__name__}: {error}"
            ) from None
        kernel.train(was_training)
        return kernel, kernel_output(out, q, kv.size(2), name)[1] is not None


DEFAULT_ATTENTION = AttentionConfig()  # frozen: one instance serves as every model's default
