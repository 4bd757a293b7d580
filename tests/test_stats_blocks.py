"""The attention statistics a block of query rows at a time (`capture_attention(block_mib=...)`): blocks of 7 rows or
fewer give the statistics of the whole weights, against the hand oracle of tests/test_stats.py, for a causal LM, a
translation model (causal, padding, cross-attention), a ViT (class token) and DETR (padding mask, cross-attention);
the model's output is the same; and a long-context call never makes a tensor of the (B, H, L, L) weights' size."""

import pytest
import torch
from builders import encoder_decoder, tiny_vit
from conftest import TINY_TRUNK
from test_chunked_attention import LargestOutput
from test_stats import rescored_statistics

from experiments.callbacks import attention_stats
from experiments.callbacks.attention_stats import attention_statistics
from models.core.capture import capture_attention
from models.core.chunked import scores_mib
from models.detection.backbone import Backbone
from models.detection.detr import DETR
from models.text.lm import DecoderOnlyLM
from models.text.seq2seq import Seq2SeqTransformer

WHOLE = 1e6  # MiB: every call one block


def _cases():
    torch.manual_seed(0)
    yield "lm", DecoderOnlyLM(12, d_model=16, nhead=2, num_layers=2), (torch.randint(1, 12, (2, 30)),), ()
    src, tgt = torch.randint(3, 12, (2, 19)), torch.randint(3, 12, (2, 17))
    src[:, 0] = tgt[:, 0] = 1
    src[1, 11:], tgt[1, 9:] = 0, 0  # the second pair is padded
    s2s = Seq2SeqTransformer(12, 12, **encoder_decoder(16, 2), pad_id=0)
    yield "seq2seq", s2s, (src, tgt), (1, 2)
    yield "vit", tiny_vit(num_classes=3), (torch.randn(2, 1, 8, 8),), ()  # [CLS] and 16 patches
    detr = DETR(Backbone(**TINY_TRUNK), 3, 9, **encoder_decoder(16, 2, 1))  # 9 object queries
    mask = torch.zeros(2, 96, 80, dtype=torch.bool)
    mask[1, :, 48:] = True  # a 6x5 feature map; the second image is padded on the right
    yield "detr", detr, (torch.randn(2, 3, 96, 80), mask), ()


def _seven_rows(model, args) -> float:
    """A budget whose blocks hold 7 query rows of the layer with the fewest keys, fewer of the others."""
    with torch.no_grad(), capture_attention(model.eval()) as maps:
        model(*args)
    b, h, _, lk = min((calls[0].shape for calls in maps.values()), key=lambda shape: shape[-1])
    return scores_mib(b, h, 7, lk)


class CountedSums(attention_stats.LayerSums):
    """`LayerSums` that counts each layer's blocks."""

    blocks: dict[str, int] = {}

    def __call__(self, name, scores):
        CountedSums.blocks[name] = CountedSums.blocks.get(name, 0) + 1
        super().__call__(name, scores)


def _assert_equal(got: list[dict], expected: list[dict], rel: float) -> None:
    assert [g["name"] for g in got] == [e["name"] for e in expected] and len(got) >= 2
    for g, e in zip(got, expected):
        assert g.keys() == e.keys()
        for key, value in e.items():
            if isinstance(value, (list, float)):
                assert g[key] == pytest.approx(value, rel=rel, abs=1e-6), (g["name"], key)
            else:
                assert g[key] == value, (g["name"], key)


@pytest.mark.parametrize("name,model,args,special", list(_cases()), ids=lambda c: c if isinstance(c, str) else "")
def test_statistics_in_row_blocks_equal_those_of_the_whole_weights(name, model, args, special, monkeypatch):
    budget = _seven_rows(model, args)
    whole = attention_statistics(model, args, special_ids=special, block_mib=WHOLE)
    monkeypatch.setattr(attention_stats, "LayerSums", CountedSums)
    CountedSums.blocks = {}
    blocks = attention_statistics(model, args, special_ids=special, block_mib=budget)
    assert all(n >= 2 for n in CountedSums.blocks.values()), CountedSums.blocks  # every layer in blocks
    _assert_equal(blocks["layers"], whole["layers"], rel=1e-5)
    _assert_equal(blocks["layers"], rescored_statistics(model, args, special), rel=1e-5)
    for key, value in whole["summary"].items():
        assert blocks["summary"][key] == (value if value is None else pytest.approx(value, rel=1e-5)), key


@pytest.mark.parametrize("name,model,args,special", list(_cases()), ids=lambda c: c if isinstance(c, str) else "")
def test_a_model_recorded_in_row_blocks_gives_the_same_output(name, model, args, special):
    with torch.no_grad():
        alone = model.eval()(*args)
        with capture_attention(model, scores=True, block_mib=_seven_rows(model, args), consume=lambda *_: None):
            blocked = model(*args)
    for a, b in zip(*(x.values() if isinstance(x, dict) else [x] for x in (alone, blocked))):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_the_statistics_of_a_long_context_never_make_a_tensor_of_the_weights_size():
    """A causal LM over 1,024 tokens, 2 heads: the weights of one call are 2·1024² elements; blocks of 0.5 MiB hold 64
    query rows. Measured whole, the same statistics make them (the check sees what it must)."""
    torch.manual_seed(0)
    length, heads = 1024, 2
    lm = DecoderOnlyLM(12, d_model=16, nhead=heads, num_layers=2, max_positions=length)
    tokens = torch.randint(12, (1, length))
    with LargestOutput() as seen:
        stats = attention_statistics(lm, (tokens,), block_mib=0.5)
    assert seen.largest <= heads * 64 * length
    assert all(v is not None for layer in stats["layers"] for v in (layer["entropy"], layer["sink_mass"]))
    with LargestOutput() as whole:
        attention_statistics(lm, (tokens,), block_mib=WHOLE)
    assert whole.largest >= heads * length * length
