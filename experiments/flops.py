"""FLOP formulas for the scaled-dot-product attention kernels that torch's counter (`torch.utils.flop_counter`,
which Lightning's ``measure_flops`` uses) has none for, registered when this module is imported.

torch counts the CUDA kernels (flash, memory-efficient, cuDNN) as QKᵀ and AV, and the math fallback through its
matmuls, but counts 0 for the CPU's fused kernel, the one ``F.scaled_dot_product_attention`` runs on the CPU: a
built-in softmax then looked cheaper than the same arithmetic on the reference path by exactly QKᵀ and AV. These
ops get torch's own formulas for the CUDA kernels (causal masks counted whole, as there), so a count is the same
on every device and path.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten

FORWARD = (
    "_scaled_dot_product_flash_attention_for_cpu",  # (query, key, value, dropout_p, is_causal, ...)
    "_scaled_dot_product_fused_attention_overrideable",  # XPU and out-of-tree devices: (query, key, value, ...)
    "_scaled_dot_product_attention_math_for_mps",  # (query, key, value, ...)
)
BACKWARD = (
    "_scaled_dot_product_flash_attention_for_cpu_backward",  # (grad_out, query, key, value, ...)
    "_scaled_dot_product_fused_attention_overrideable_backward",  # (grad_out, query, key, value, ...)
)


def sdpa_forward_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """QKᵀ and AV of q (B, H, L, d), k and v (B, Hkv, S, d)."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def sdpa_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """The scores recomputed, then the gradients of AV and QKᵀ."""
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _register(names: tuple[str, ...], formula) -> None:
    for name in names:
        if not hasattr(aten, name):  # an op this torch does not have
            continue
        try:
            register_flop_formula(getattr(aten, name))(formula)
        except RuntimeError:  # "duplicate registrations": this torch (or an earlier import) counts it already
            pass


_register(FORWARD, sdpa_forward_flop)
_register(BACKWARD, sdpa_backward_flop)
