"""Attention sinks and the outliers they come with, per attention layer.

Softmax must put its weight somewhere, so heads that have nothing to read dump it on one token, the sink (Xiao et al.
2023; Gu et al. 2025), and to make near-zero updates networks grow outlier activations (Bondarenko et al. 2023).
Per layer, from the weights (B, H, Lq, Lk) of one call and the queries that count (padding left out), each a mean
over query rows, so added up from a call's row blocks as exactly (`sink_sums`, `sink_means`):
    sink_mass      per head, the mean over queries of the weight on the first key (BOS, [CLS], the first memory cell)
    sink_heads     Sink^ε_1 (Gu et al. 2025): the share of heads whose sink_mass exceeds ε = 0.3
    register_mass  per head, the mean over queries of the weight on the model's register tokens (Darcet et al. 2024),
                   None where the layer has none. A model names them with ``register_keys() -> {layer name: slice of
                   key positions}`` (names as its ``named_modules()`` gives them); a layer absent there has none
From the layer's output (B, Lq, D), as Bondarenko et al.'s code measures "the output of an attention layer": each
sequence's valid rows and features flattened to one sample, then the mean over the sequences of
    out_max        max |x| (the ∞-norm)
    out_kurtosis   Pearson's kurtosis m4 / m2² (3 for a normal; scipy.stats.kurtosis(fisher=False)); their code divides
                   by the Bessel-corrected variance instead, smaller by ((n-1)/n)² for n values
`model_summary` reduces a model's layers: the mean sink and register mass over layers, Sink^ε_1 over all heads of all
layers, the largest out_max and the mean out_kurtosis (Bondarenko et al.'s "max inf. norm" and "avg. kurtosis").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

from models.core.attention import MultiHeadAttention

SINK_EPSILON = 0.3  # Gu et al. 2025's ε: a head whose mean weight on the first key exceeds it is a sink head


def register_keys(model: nn.Module) -> dict[str, slice]:
    """The model's register key positions per attention layer name (`register_keys()`), {} when it has none."""
    declared = model.register_keys() if callable(getattr(model, "register_keys", None)) else {}
    layers = {name for name, m in model.named_modules() if isinstance(m, MultiHeadAttention)}
    for name, keys in declared.items():
        if name not in layers or not isinstance(keys, slice):
            raise ValueError(
                f"{type(model).__name__}.register_keys(): {name!r}: {keys!r}: expected the name of one of its attention "
                f"layers ({', '.join(sorted(layers)) or 'none'}) mapped to a slice of key positions"
            )
    return declared


def sink_stats(weights: Tensor, blocked: Tensor, valid_q: Tensor, registers: slice | None) -> dict[str, Any]:
    """sink_mass, sink_heads and register_mass of one layer. weights (B, H, Lq, Lk); blocked broadcastable to them;
    valid_q (B, Lq). A query counts when it is valid and may see a key."""
    rows = (valid_q[:, None, :] & ~blocked.all(-1)).expand(weights.shape[:3])  # (B, H, Lq)
    return sink_means(sink_sums(weights.float(), rows, registers), rows.sum((0, 2)))


def sink_sums(p: Tensor, rows: Tensor, registers: slice | None) -> dict[str, Tensor | None]:
    """Per head (H,), the sums over the counted query rows (rows (B, H, Lq), of weights p (B, H, Lq, Lk) of a whole
    call or a block of its rows) of the weight on the first key and on the registers (None without registers)."""
    return {
        "sink_mass": (p[..., 0] * rows).sum((0, 2)),
        "register_mass": None if registers is None else (p[..., registers].sum(-1) * rows).sum((0, 2)),
    }


def sink_means(sums: dict[str, Tensor | None], counted: Tensor) -> dict[str, Any]:
    """sink_mass, sink_heads and register_mass from `sink_sums` added up over a call and its counted rows (H,)."""
    n = counted.clamp(min=1)
    sink, register = sums["sink_mass"] / n, sums["register_mass"]
    return {
        "sink_mass": sink.tolist(),
        "sink_heads": (sink > SINK_EPSILON).float().mean().item(),
        "register_mass": None if register is None else (register / n).tolist(),
    }


def output_outliers(out: Tensor, valid_q: Tensor) -> dict[str, float | None]:
    """out_max and out_kurtosis of one layer's output (B, Lq, D) over its valid query rows valid_q (B, Lq); None
    when no sequence has a valid row (or, for the kurtosis, one that varies)."""
    padded = ~valid_q[..., None]  # (B, Lq, 1)
    x = out.detach().float().masked_fill(padded, 0.0)
    n = valid_q.sum(1) * x.shape[-1]  # (B,) values per sequence
    top = x.abs().amax((1, 2))
    mean = x.sum((1, 2)) / n.clamp(min=1)
    squares = (x - mean[:, None, None]).masked_fill(padded, 0.0).square()
    m2, m4 = squares.sum((1, 2)) / n.clamp(min=1), squares.square().sum((1, 2)) / n.clamp(min=1)
    varies = m2 > 0
    return {
        "out_max": top[n > 0].mean().item() if (n > 0).any() else None,
        "out_kurtosis": (m4[varies] / m2[varies] ** 2).mean().item() if varies.any() else None,
    }


@contextmanager
def attention_outputs(model: nn.Module) -> Iterator[dict[str, Tensor]]:
    """Inside the block, record each `MultiHeadAttention`'s output (B, Lq, D) of its first call, by module name."""
    outputs: dict[str, Tensor] = {}

    def record(name: str):
        def hook(module: nn.Module, args: tuple, out: Tensor | tuple) -> None:  # returns None: the output stays
            outputs.setdefault(name, (out[0] if isinstance(out, tuple) else out).detach())

        return hook

    handles = [
        m.register_forward_hook(record(name)) for name, m in model.named_modules() if isinstance(m, MultiHeadAttention)
    ]
    try:
        yield outputs
    finally:
        for h in handles:
            h.remove()


def model_summary(layers: list[dict[str, Any]]) -> dict[str, float | None]:
    """The model's sink_mass, sink_heads, register_mass, out_max and out_kurtosis over its layers (module docstring)."""

    def values(key: str) -> list:
        return [layer[key] for layer in layers if layer.get(key) is not None]

    def mean(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    heads = [h for sink in values("sink_mass") for h in sink]
    return {
        "sink_mass": mean([mean(sink) for sink in values("sink_mass")]),
        "sink_heads": mean([float(h > SINK_EPSILON) for h in heads]),
        "register_mass": mean([mean(r) for r in values("register_mass")]),
        "out_max": max(values("out_max"), default=None),
        "out_kurtosis": mean(values("out_kurtosis")),
    }
