"""Every model's forward traces as ONE graph under torch.compile's frontend (dynamo), checked with
`torch._dynamo.explain` (tracing only, no code generation: seconds on a CPU). A tensor read on the host
inside forward (``int(t.max())``, ``.item()``, ``if t.any()``) splits the graph and, on a GPU, waits for
the device at every call; the seq2seq model's position check did both until it checked Python ints."""

import pytest
import torch
import torch._dynamo as dynamo
from builders import encoder_decoder
from conftest import TINY_TRUNK

from models.core.attention import MultiHeadAttention
from models.detection.backbone import Backbone
from models.detection.detr import DETR
from models.text.lm import DecoderOnlyLM
from models.text.seq2seq import Seq2SeqTransformer
from models.vision.vit import VisionTransformer

pytestmark = pytest.mark.slow  # dynamo traces each model: 3-11 s apiece on a shared 2-core CPU


def _padded(batch: int, length: int) -> torch.Tensor:
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[1, length // 2 :] = True
    return mask


def _vit():
    return VisionTransformer(
        img_size=16, patch_size=4, in_chans=3, num_classes=5, embed_dim=16, depth=2, num_heads=2
    ), (torch.randn(2, 3, 16, 16),)


def _seq2seq():
    model = Seq2SeqTransformer(30, 30, **encoder_decoder(16, 2, 1), pad_id=0)
    src, tgt = torch.randint(1, 30, (2, 7)), torch.randint(1, 30, (2, 5))
    src[1, 4:] = 0  # padding: the masks are part of the graph
    return model, (src, tgt)


def _gpt():
    return DecoderOnlyLM(30, d_model=16, nhead=2, num_layers=2, dim_feedforward=32, max_positions=16), (
        torch.randint(0, 30, (2, 9)),
    )


def _detr():
    trunk = Backbone(**TINY_TRUNK)
    mask = torch.zeros(2, 32, 32, dtype=torch.bool)
    mask[1, :, 24:] = True
    return DETR(
        trunk,
        num_classes=3,
        num_queries=4,
        **encoder_decoder(16, 2, 1, decoder_layers=2),
    ), (torch.randn(2, 3, 32, 32), mask)


class _PaddedAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = MultiHeadAttention(16, 2)

    def forward(self, x, mask):
        return self.attn(x, key_padding_mask=mask)[0]


def _attention():
    return _PaddedAttention(), (torch.randn(2, 6, 16), _padded(2, 6))


@pytest.mark.parametrize(
    "build", [_attention, _vit, _seq2seq, _gpt, _detr], ids=["attention", "vit", "seq2seq", "gpt", "detr"]
)
def test_forward_is_one_graph(build):
    model, inputs = build()
    model.train()
    dynamo.reset()
    explanation = dynamo.explain(model)(*inputs)
    reasons = [str(b.reason).splitlines()[0] for b in explanation.break_reasons]
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, reasons
