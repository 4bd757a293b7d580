"""FLOPs counted as the run summary counts them (Lightning's ``measure_flops``, torch's counter with the formulas of
`experiments.flops`): SDPA's kernels on every device count QKᵀ and AV, so the built-in softmax and the same
arithmetic on the reference path cost the same, and both equal the count by hand."""

import pytest
import torch
import torch.nn.functional as F
from pytorch_lightning.utilities import measure_flops
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from experiments import flops
from models.core.attention import AttentionConfig, MultiHeadAttention

B, L, D, H = 3, 17, 64, 4
d = D // H


class PlainSoftmax(nn.Module):
    """softmax over the keys, as a class of one's own: the layer runs it on the reference path."""

    def forward(self, scores, blocked):
        return scores.softmax(-1)


def mha_flops_by_hand(lq: int, lk: int) -> int:
    """One sample through one layer: the q, k, v projections, QKᵀ, AV and the output projection (a multiply-add
    is 2 FLOPs)."""
    projections = 2 * lq * D * D + 2 * 2 * lk * D * D
    return projections + 2 * H * lq * lk * d + 2 * H * lq * lk * d + 2 * lq * D * D


@pytest.mark.parametrize("causal", [False, True])
def test_the_builtin_softmax_and_the_reference_path_count_the_same_flops_as_by_hand(causal):
    torch.manual_seed(0)
    x = torch.randn(B, L, D)
    counts = {}
    for name, normalization in (("softmax", "softmax"), ("reference", f"{__name__}.PlainSoftmax")):
        layer = MultiHeadAttention(D, H, attention=AttentionConfig(normalization=normalization))
        assert layer.fused == (name == "softmax")
        counts[name] = measure_flops(layer, lambda layer=layer: layer(x, is_causal=causal)) / B
    # causal masks are counted whole on both paths, as torch counts its CUDA kernels
    assert counts == {"softmax": mha_flops_by_hand(L, L), "reference": mha_flops_by_hand(L, L)}


def test_the_cpu_kernels_backward_counts_the_recomputed_scores_and_four_gradients():
    """FlashAttention-2's accounting (Dao 2023): the backward recomputes QKᵀ, then dV, dP, dQ and dK, 5 matmuls to
    the forward's 2."""
    q, k, v = (torch.randn(B, H, L, d, requires_grad=True) for _ in range(3))
    with FlopCounterMode(display=False) as counter:
        F.scaled_dot_product_attention(q, k, v).sum().backward()
    assert counter.get_total_flops() == (2 + 5) * 2 * B * H * L * L * d


def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, device="meta")


LQ, LK = 5, 7
q, k, v, out, lse = _meta(B, H, LQ, d), _meta(B, H, LK, d), _meta(B, H, LK, d), _meta(B, H, LQ, d), _meta(B, H, LQ)
OPS = {  # each op as its device calls it, on meta tensors (shapes only), and its matmuls
    "_scaled_dot_product_flash_attention_for_cpu": ((q, k, v), 2),
    "_scaled_dot_product_fused_attention_overrideable": ((q, k, v), 2),
    "_scaled_dot_product_attention_math_for_mps": ((q, k, v), 2),
    "_scaled_dot_product_flash_attention_for_cpu_backward": ((out, q, k, v, out, lse, 0.0, False), 5),
    "_scaled_dot_product_fused_attention_overrideable_backward": (
        (out, q, k, v, _meta(B, H, LQ, LK), [True] * 3 + [False], out, lse, None, None, LQ, LK, 0.0, False)
        + (_meta(()), _meta(())),
        5,
    ),
}


@pytest.mark.parametrize("name", OPS)
def test_each_registered_kernel_counts_its_matmuls(name):
    assert name in flops.FORWARD + flops.BACKWARD
    args, matmuls = OPS[name]
    with FlopCounterMode(display=False) as counter:
        getattr(torch.ops.aten, name)(*args)
    assert counter.get_total_flops() == matmuls * 2 * B * H * LQ * LK * d
