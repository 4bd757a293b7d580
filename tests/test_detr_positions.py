"""DETR's encoder with 2D RoPE over the feature-map cells (instead of the 2D sine encoding) and QK-norm."""

import pytest
import torch
from builders import encoder_decoder
from conftest import TINY_TRUNK

from models.core.attention import AttentionConfig, MultiHeadAttention
from models.core.position import RotaryEmbedding2D
from models.detection.backbone import Backbone
from models.detection.detr import DETR, DETRTransformer


@pytest.mark.parametrize("mode", ["axial", "mixed"])
def test_rope_encoder_reads_padded_and_unpadded_images_alike(mode):
    """Cells are counted from the top-left, so padding at the bottom and right moves none, and padded keys stay blocked."""
    torch.manual_seed(0)
    transformer = DETRTransformer(24, 3, 2, 1, 48, 0.0, "relu", attention=AttentionConfig(qk_norm="layernorm")).eval()
    rope = RotaryEmbedding2D(8, 3, mode, depth=2)
    src = torch.randn(1, 24, 3, 4)
    padded = torch.randn(1, 24, 5, 6)  # garbage in the padding
    padded[..., :3, :4] = src
    mask = torch.ones(1, 5, 6, dtype=torch.bool)
    mask[:, :3, :4] = False
    pos = torch.zeros(1, 24, 3, 4)
    alone = transformer.encode(src, torch.zeros(1, 3, 4, dtype=torch.bool), pos, rope((3, 4)))[0]
    memory = transformer.encode(padded, mask, torch.zeros(1, 24, 5, 6), rope((5, 6)))[0]
    torch.testing.assert_close(memory.view(1, 5, 6, 24)[:, :3, :4].reshape(1, 12, 24), alone, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(transformer.encode(src, mask[:, :3, :4], pos)[0], alone)  # the rotation counts


def test_detr_with_rope_encoder_and_qk_norm_runs_and_refuses_bad_values():
    torch.manual_seed(0)
    model = DETR(
        Backbone(**TINY_TRUNK),
        3,
        4,
        **encoder_decoder(24, 3),
        dropout=0.0,
        attention=AttentionConfig(qk_norm="rmsnorm"),
        encoder_positions="rope_mixed",
    ).eval()
    assert all(m.qk_norm == "rmsnorm" for m in model.modules() if isinstance(m, MultiHeadAttention))
    assert "encoder_rope.freqs" in model.no_weight_decay()
    images, mask = torch.randn(2, 3, 64, 48), torch.zeros(2, 64, 48, dtype=torch.bool)
    mask[1, 40:] = True
    out = model(images, mask)
    assert out["pred_boxes"].shape == (2, 4, 4) and torch.isfinite(out["pred_logits"]).all()
    with torch.no_grad():
        model.encoder_rope.freqs.mul_(2)
    assert not torch.allclose(model(images, mask)["pred_logits"], out["pred_logits"])
    with pytest.raises(ValueError, match="model.encoder_positions='alibi' is not known; choose sine, rope_axial"):
        DETR(Backbone(**TINY_TRUNK), 3, 4, d_model=24, nhead=3, encoder_positions="alibi")
    with pytest.raises(
        ValueError, match=r"model.encoder_positions=rope_axial needs a head size divisible by 4, .* = 6"
    ):
        DETR(Backbone(**TINY_TRUNK), 3, 4, d_model=24, nhead=4, encoder_positions="rope_axial")
