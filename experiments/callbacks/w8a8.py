"""Simulated W8A8 (Bondarenko et al. 2023, "Quantizable Transformers"): every linear layer computes with its weight and
its input rounded to 8 bits, with torch.ao.quantization's `FakeQuantize` and `MinMaxObserver`.

Per tensor, with min-max ranges (the paper's W8A8 setting):
    weights       qint8, symmetric: scale = max|w| / 127.5, zero point 0
    inputs        quint8, affine: scale = (max(x_max, 0) - min(x_min, 0)) / 255 over the calibration batches, the zero
                  point where 0 falls
    biases        kept in fp32 (an int8 matmul adds them in int32)
    the rest      embeddings, convolutions (ViT's patch embedding, DETR's backbone), norms and the attention's
                  softmax stay in fp32, as do the outputs of the linear layers; the final heads are quantised too
A linear layer is an ``nn.Linear`` (the MLPs, ``out_proj``, ``gate_proj``, the heads) or the packed ``in_proj`` of a
`MultiHeadAttention` (its weight, and its inputs: the query, the key and the value, each with its own range; a key or
value that is the query stays the same tensor, so self-attention keeps its one packed matmul).

    with w8a8(model) as layers:          # observers on, rounding off: the model computes in fp32
        for batch in calibration: model(batch)
        freeze(model)                    # ranges fixed, rounding on
        evaluate(model)
    # the model is as it was: parametrizations, hooks and quantizers removed
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.ao.quantization import (
    FakeQuantize,
    MinMaxObserver,
    disable_fake_quant,
    disable_observer,
    enable_fake_quant,
    enable_observer,
)
from torch.nn.utils import parametrize

from models.core.attention import MultiHeadAttention

WEIGHT = FakeQuantize.with_args(
    observer=MinMaxObserver, quant_min=-128, quant_max=127, dtype=torch.qint8, qscheme=torch.per_tensor_symmetric
)
INPUT = FakeQuantize.with_args(
    observer=MinMaxObserver, quant_min=0, quant_max=255, dtype=torch.quint8, qscheme=torch.per_tensor_affine
)
QKV = ("query", "key", "value")


def _quantize_input(module: nn.Linear, args: tuple) -> tuple:
    return (module.input_quantizer(args[0]), *args[1:])


def _quantize_qkv(module: MultiHeadAttention, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The inputs of the packed in_proj: query, key and value (positional or by name; key and value default to the
    query, as in `MultiHeadAttention.forward`)."""
    given = dict(zip(QKV, args)) | {name: kwargs.pop(name) for name in QKV if name in kwargs}
    query = given["query"]
    key = query if given.get("key") is None else given["key"]
    value = key if given.get("value") is None else given["value"]
    fq = module.input_quantizers
    q = fq["query"](query)
    k = q if key is query else fq["key"](key)
    v = k if value is key else q if value is query else fq["value"](value)
    return (q, k, v), kwargs  # the rest of forward's arguments are keywords


def linear_layers(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, the name of its weight) of every linear layer: each ``nn.Linear`` and each attention's in_proj."""
    layers = []
    for module in model.modules():
        if isinstance(module, nn.Linear):
            layers.append((module, "weight"))
        elif isinstance(module, MultiHeadAttention):
            layers.append((module, "in_proj_weight"))
    return layers


@contextmanager
def w8a8(model: nn.Module) -> Iterator[int]:
    """Fake-quantise every linear layer of ``model`` inside the block (module docstring); yields how many there are.
    It starts calibrating: observers on, rounding off."""
    layers = linear_layers(model)
    hooks = []
    for module, weight in layers:
        device = getattr(module, weight).device  # the quantizers' scale and zero point live beside the weight
        parametrize.register_parametrization(module, weight, WEIGHT().to(device))
        if isinstance(module, MultiHeadAttention):
            module.input_quantizers = nn.ModuleDict({name: INPUT() for name in QKV}).to(device)
            hooks.append(module.register_forward_pre_hook(_quantize_qkv, with_kwargs=True))
        else:
            module.input_quantizer = INPUT().to(device)
            hooks.append(module.register_forward_pre_hook(_quantize_input))
    model.apply(enable_observer)
    model.apply(disable_fake_quant)
    try:
        yield len(layers)
    finally:
        for hook in hooks:
            hook.remove()
        for module, weight in layers:
            parametrize.remove_parametrizations(module, weight, leave_parametrized=False)
            delattr(module, "input_quantizers" if isinstance(module, MultiHeadAttention) else "input_quantizer")


def freeze(model: nn.Module) -> None:
    """End the calibration inside `w8a8`: the ranges stay as observed, and weights and inputs are rounded."""
    model.apply(disable_observer)
    model.apply(enable_fake_quant)
