"""Registers (Darcet et al. 2024) and StreamingLLM's sink tokens in the ViT, DETR and the text models: in the
attention's keys, out of the outputs, heads and losses, without positions (the LM's sinks take the first ones), and
named by each model's ``register_keys()``."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from builders import SMALL, padded_batch, tiny_seq2seq, tiny_vit
from conftest import TINY_TRUNK

from datamodules.text.tokenizers import BOS_ID, EOS_ID, PAD_ID
from experiments.callbacks.attention_maps import AttentionMapLogger
from models.core.capture import capture_attention
from models.core.position import RotaryEmbedding2D, Rotation
from models.core.registers import unplaced
from models.detection.backbone import Backbone
from models.detection.detr import DETR, DETRTransformer
from models.text.decoding import beam_search, greedy_decode
from models.text.lm import DecoderOnlyLM
from models.vision.module import ImageClassifier

V = 24
IDS = dict(bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID)


def _key_counts(model, *inputs) -> dict[str, int]:
    """Each attention layer of ``model`` -> the number of keys it attended to, run on ``inputs``."""
    with torch.no_grad(), capture_attention(model) as maps:
        model(*inputs)
    return {name: calls[0].shape[-1] for name, calls in maps.items()}


def _moved_keys(model, reg_token: torch.Tensor, layer: str, *inputs) -> list[int]:
    """The key positions of self-attention ``layer`` whose logits move, for the queries that are no registers,
    when the registers ``reg_token`` change. In a stack's first layer these are the registers' keys and no
    others: every other key there is computed from the input alone."""
    runs = []
    for shift in (0.0, 1.0):
        with torch.no_grad():
            reg_token.add_(shift * torch.randn_like(reg_token))  # random: a norm would undo a constant
            with capture_attention(model, scores=True) as maps:
                model(*inputs)
        runs.append(maps[layer][0].logits)  # (B, H, L, L)
    keys = range(runs[0].shape[-1])
    queries = sorted(set(keys) - set(keys[model.register_keys()[layer]]))
    moved = (runs[1] - runs[0])[:, :, queries].abs().amax(dim=(0, 1, 2)) > 0  # (Lk,)
    return moved.nonzero().flatten().tolist()


def _slice_of(model, layer: str, keys: int) -> list[int]:
    return list(range(keys))[model.register_keys()[layer]]


# ----------------------------------------------------------------------------- the shared helpers


def test_unplaced_positions_give_the_inserted_tokens_no_rotation_and_no_bias():
    bias = torch.arange(9.0).view(1, 3, 3)
    rotation = Rotation(torch.full((3, 2), 0.5), torch.full((3, 2), 0.25))
    out = unplaced({"rope": [rotation], "position_bias": bias}, at=1, n=2)
    expected = torch.tensor(
        [[0.0, 0, 0, 1, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0], [3, 0, 0, 4, 5], [6, 0, 0, 7, 8]]
    )  # rows/columns 1 and 2 are the new tokens'
    torch.testing.assert_close(out["position_bias"], expected[None])
    torch.testing.assert_close(out["rope"][0].cos[:, 0], torch.tensor([0.5, 1, 1, 0.5, 0.5]))
    torch.testing.assert_close(out["rope"][0].sin[:, 0], torch.tensor([0.25, 0, 0, 0.25, 0.25]))


# ----------------------------------------------------------------------------- ViT


def test_vit_registers_are_keys_of_every_layer_and_never_an_output():
    vit = tiny_vit(register_tokens=3).eval()
    images = torch.randn(2, 1, 8, 8)
    assert vit(images).shape == (2, 10)
    assert vit.forward_features(images).shape == (2, 1 + 3 + 16, 16)  # [class, 3 registers, 16 patches]
    counts = _key_counts(vit, images)
    assert set(vit.register_keys()) == set(counts) and set(counts.values()) == {20}
    assert all(_slice_of(vit, name, 20) == [1, 2, 3] for name in counts)
    assert _moved_keys(vit, vit.reg_token, "encoder.layers.0.self_attn", images) == [1, 2, 3]
    assert tiny_vit().register_keys() == {}


@pytest.mark.parametrize("positions", ["learned", "sincos2d", "rope_axial", "rope_mixed", "relpos"])
@pytest.mark.parametrize("global_pool", ["token", "avg"])
def test_vit_registers_have_no_position_so_swapping_two_changes_nothing(positions, global_pool):
    vit = tiny_vit(embed_dim=16, register_tokens=2, positions=positions, global_pool=global_pool).eval()
    images = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        vit.reg_token.normal_()
        before = vit(images)
        vit.reg_token.copy_(vit.reg_token.flip(1))
        torch.testing.assert_close(vit(images), before, atol=1e-5, rtol=1e-5)
        vit.reg_token.normal_()
        assert not torch.allclose(vit(images), before, atol=1e-4)  # yet they count


def test_vit_without_class_token_pools_the_patches_after_the_registers():
    vit = tiny_vit(register_tokens=2, class_token=False, global_pool="avg").eval()
    assert vit.cls_token is None and vit.num_prefix_tokens == 2
    assert vit.forward_features(torch.randn(1, 1, 8, 8)).shape == (1, 2 + 16, 16)
    assert _slice_of(vit, "encoder.layers.0.self_attn", 18) == [0, 1]


def test_vit_attention_maps_are_drawn_over_the_patches_after_the_registers(tmp_path):
    module = ImageClassifier(
        num_classes=10, in_chans=1, img_size=8, patch_size=2, embed_dim=16, depth=2, num_heads=2, register_tokens=3
    ).eval()
    trainer = SimpleNamespace(model=module, is_global_zero=True, datamodule=None, log_dir=str(tmp_path))
    maps = AttentionMapLogger()
    maps.setup(trainer, module, "validate")
    paths = maps.render(trainer, module, torch.randn(2, 1, 8, 8), None, "predict")
    assert len(paths) == 2 and all(Path(p).stat().st_size for p in paths)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(register_tokens=-1), r"^model.register_tokens=-1 must be a whole number >= 0 \(0: no registers\)$"),
        (dict(class_token=False), r"^model.class_token=false leaves nothing for model.global_pool=token to read"),
    ],
)
def test_vit_register_options_that_make_no_sense_are_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_vit(**kwargs)


# ----------------------------------------------------------------------------- DETR


def _detr(**kwargs) -> DETR:
    torch.manual_seed(0)
    size = dict(d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=64, dropout=0.0)
    return DETR(Backbone(**TINY_TRUNK), 3, 5, **size, register_tokens=2, **kwargs).eval()


@pytest.mark.parametrize("encoder_positions", ["sine", "rope_axial"])
def test_detr_registers_join_the_memory_not_the_predictions(encoder_positions):
    model = _detr(encoder_positions=encoder_positions)
    images = torch.randn(2, 3, 64, 48)  # a 4x3 feature map
    memory, mask, pos, cells = model.encode(images)
    assert memory.shape == (2, 12 + 2, 32) and mask.shape == (2, 14) and pos.shape == (2, 14, 32)
    assert not mask[:, -2:].any() and pos[:, -2:].eq(0).all() and cells.shape == (2, 12, 4)
    out = model(images)
    assert out["pred_logits"].shape == (2, 5, 4) and out["pred_boxes"].shape == (2, 5, 4)
    counts = _key_counts(model, images)
    readers = {name for name, keys in counts.items() if keys == 14}
    assert set(model.register_keys()) == readers and len(readers) == 4  # 2 encoder layers, 2 cross-attentions
    assert all(_slice_of(model, name, 14) == [12, 13] for name in readers)
    layer = "transformer.encoder.layers.0.self_attn"
    assert _moved_keys(model, model.transformer.reg_token, layer, images) == [12, 13]


def test_detr_query_selection_proposes_cells_only():
    """The registers' memory reaches the decoder's cross-attention, never the proposals."""
    model = _detr(query_type="encoder")
    with torch.no_grad():
        memory, mask, pos, cells = model.encode(torch.randn(2, 3, 64, 48))
        out = model.decode(memory, mask, pos, cells)
        other = model.decode(torch.cat([memory[:, :12], torch.randn(2, 2, 32)], dim=1), mask, pos, cells)
    assert out["enc_outputs"]["pred_logits"].shape == (2, 12, 4) and out["enc_outputs"]["padding"].shape == (2, 12)
    for key in ("pred_logits", "pred_boxes", "padding"):
        assert torch.equal(other["enc_outputs"][key], out["enc_outputs"][key])
    assert not torch.allclose(other["pred_logits"], out["pred_logits"])


@pytest.mark.parametrize("mode", ["axial", "mixed"])
def test_detr_registers_read_padded_and_unpadded_images_alike(mode):
    """Registers are appended after the cells without position and never masked: padding the image at the bottom
    and right moves no cell and no register."""
    torch.manual_seed(0)
    transformer = DETRTransformer(24, 3, 2, 1, 48, 0.0, "relu", register_tokens=2).eval()
    with torch.no_grad():
        transformer.reg_token.normal_()
    rope = RotaryEmbedding2D(8, 3, mode, depth=2)
    src, pos = torch.randn(1, 24, 3, 4), torch.randn(1, 24, 3, 4)
    padded, padded_pos = torch.randn(1, 24, 5, 6), torch.randn(1, 24, 5, 6)  # garbage in the padding
    padded[..., :3, :4], padded_pos[..., :3, :4] = src, pos
    mask = torch.ones(1, 5, 6, dtype=torch.bool)
    mask[:, :3, :4] = False
    for rotation in (None, rope):
        alone = transformer.encode(src, mask[:, :3, :4], pos, rotation and rotation((3, 4)))[0]
        memory = transformer.encode(padded, mask, padded_pos, rotation and rotation((5, 6)))[0]
        cells = memory[:, :30].view(1, 5, 6, 24)[:, :3, :4].reshape(1, 12, 24)
        torch.testing.assert_close(torch.cat([cells, memory[:, 30:]], dim=1), alone, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- decoder-only LM: sinks


def _lm(positions: str = "learned", register_tokens: int = 2, vocab: int = V, max_positions: int = 10) -> DecoderOnlyLM:
    torch.manual_seed(3)
    lm = DecoderOnlyLM(
        vocab,
        d_model=16,
        nhead=2,
        num_layers=2,
        dropout=0.0,
        max_positions=max_positions,
        positions=positions,
        register_tokens=register_tokens,
    )
    return lm.eval()


@pytest.mark.parametrize("positions", ["learned", "sinusoidal", "rope", "alibi", "t5"])
def test_sinks_are_learned_tokens_read_first(positions):
    """StreamingLLM's sink: the LM with N sinks equals the plain LM (same weights) reading N extra tokens first
    whose embeddings are the sinks. Inside attention the sinks come first; added positions stay the tokens'
    own (the plain LM's learned table: N zero rows, then the sinks LM's table). The sinks' logits are dropped."""
    sinks = _lm(positions)
    added = positions in ("learned", "sinusoidal")
    plain = _lm("learned" if added else positions, register_tokens=0, vocab=V + 2, max_positions=12)
    state = {k: v for k, v in sinks.state_dict().items() if k != "reg_token"}
    state["tok_embed.embedding.weight"] = torch.cat([state["tok_embed.embedding.weight"], sinks.reg_token[0]])
    state["lm_head.weight"] = state["tok_embed.embedding.weight"]
    if added:
        table = sinks.pos.weight if positions == "learned" else sinks.pos(10)  # (10, D)
        state["pos.weight"] = torch.cat([torch.zeros(2, 16), table])
    plain.load_state_dict(state)
    tokens = padded_batch(V, [6, 6])
    with torch.no_grad():
        expected = plain(torch.cat([torch.tensor([[V, V + 1]] * 2), tokens], dim=1))[:, 2:, :V]
        torch.testing.assert_close(sinks(tokens), expected, atol=1e-5, rtol=1e-5)


def test_sinks_are_keys_of_every_block_and_never_a_logit():
    lm = _lm()
    tokens = padded_batch(V, [5, 5])
    assert lm(tokens).shape == (2, 5, V)
    counts = _key_counts(lm, tokens)
    assert set(lm.register_keys()) == set(counts) and set(counts.values()) == {7}
    assert all(_slice_of(lm, name, 7) == [0, 1] for name in counts)
    assert _moved_keys(lm, lm.reg_token, "blocks.layers.0.self_attn", tokens) == [0, 1]


@pytest.mark.parametrize("positions", ["learned", "rope", "alibi", "t5"])
def test_sinks_are_prefilled_once_then_each_cached_step_equals_the_whole_sequence(positions):
    lm = _lm(positions)
    tokens = padded_batch(V, [7, 7])
    cache = lm.init_cache()
    with torch.no_grad():
        steps = [lm(tokens[:, :3], cache, 0)] + [lm(tokens[:, t : t + 1], cache, t) for t in range(3, 7)]
        torch.testing.assert_close(torch.cat(steps, dim=1), lm(tokens), atol=1e-5, rtol=1e-5)
    assert cache[0].k.shape[2] == 2 + 7  # the sinks' keys, once


@pytest.mark.parametrize("positions", ["learned", "rope"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generation_with_sinks_and_cache_equals_without_even_past_the_context(positions, cache):
    lm = _lm(positions, max_positions=8)  # 2 sinks and a window of 8 tokens
    prompt = padded_batch(V, [3, 3])
    fast = lm.generate(prompt, 12, temperature=0, cache=cache)  # 15 tokens > 8: the window slides
    slow = lm.generate(prompt, 12, temperature=0, use_cache=False)
    assert fast.shape == (2, 15) and torch.equal(fast, slow)


# ----------------------------------------------------------------------------- encoder-decoder


def _seq2seq(positions: str = "sinusoidal") -> torch.nn.Module:
    model = tiny_seq2seq(V, d_model=24, nhead=3, positions=positions, register_tokens=2, seed=11)
    with torch.no_grad():
        model.reg_token.normal_()
    return model


def test_seq2seq_registers_join_the_memory_and_pad_keys_stay_blocked():
    model = _seq2seq()
    src, tgt = padded_batch(V, [5, 3]), padded_batch(V, [4, 4], seed=2)
    assert model.encode(src).shape == (2, 5 + 2, 24) and model(src, tgt).shape == (2, 4, V)
    with torch.no_grad(), capture_attention(model) as maps:
        model(src, tgt)
    readers = {name for name, calls in maps.items() if calls[0].shape[-1] == 7}
    assert set(model.register_keys()) == readers and len(readers) == SMALL["num_encoder_layers"] * 2
    cross = maps["decoder.layers.0.multihead_attn"][0]  # (B, H, T, S + 2)
    assert cross[1, :, :, 3:5].eq(0).all() and cross[1, :, :, 5:].gt(0).all()  # PAD blocked, registers seen
    assert all(_slice_of(model, name, 7) == [5, 6] for name in readers)
    assert _moved_keys(model, model.reg_token, "encoder.layers.0.self_attn", src, tgt) == [5, 6]


@pytest.mark.parametrize("positions", ["sinusoidal", "rope", "alibi", "t5"])
def test_seq2seq_registers_have_no_position_so_padding_changes_no_translation(positions):
    """The registers follow the padding in a padded batch and the words alone: without positions, both read alike."""
    model = _seq2seq(positions)
    src = padded_batch(V, [6, 3], seed=12)
    batched, _ = beam_search(model, src, max_len=7, beam_size=2, **IDS)
    alone, _ = beam_search(model, src[1:2, :3], max_len=7, beam_size=2, **IDS)
    assert torch.equal(batched[1, : alone.size(1)], alone[0])
    cached, scores = greedy_decode(model, src, max_len=9, **IDS)
    uncached, uncached_scores = greedy_decode(model, src, max_len=9, use_cache=False, **IDS)
    assert torch.equal(cached, uncached)
    torch.testing.assert_close(scores, uncached_scores)
    memory, memory_alone = model.encode(src), model.encode(src[1:2, :3])
    torch.testing.assert_close(memory[1:, 6:], memory_alone[:, 3:], atol=1e-5, rtol=1e-5)
