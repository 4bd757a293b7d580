"""Positional encodings and encoder/decoder layers against their formulas and torch.nn."""

import math

import pytest
import torch
from torch import nn

from models.core.attention import AttentionConfig
from models.core.kv_cache import KVCache
from models.core.position import (
    LearnedPositionalEncoding,
    PositionEmbeddingSine2D,
    SinusoidalPositionalEncoding,
    sinusoidal_encoding,
)
from models.core.transformer import (
    DecoderLayerCache,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)
from models.text.lm import DecoderOnlyLM

D, H, FF = 16, 4, 32


def test_sinusoidal_values_equal_the_formula():
    pe = sinusoidal_encoding(50, D)
    for pos in (0, 1, 7, 49):
        for i in range(D // 2):
            angle = pos / 10000 ** (2 * i / D)
            assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


@pytest.mark.parametrize("k", [1, 3, 10])
def test_relative_position_is_one_linear_map_per_offset(k):
    pe = sinusoidal_encoding(200, D).double()
    t_k = torch.zeros(D, D, dtype=torch.float64)  # block-diagonal rotation by k * frequency
    for i in range(D // 2):
        w = k / 10000 ** (2 * i / D)
        t_k[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = torch.tensor(
            [[math.cos(w), -math.sin(w)], [math.sin(w), math.cos(w)]]
        )
    # the same T_k maps PE(pos) to PE(pos + k) for every position
    torch.testing.assert_close(pe[: 200 - k] @ t_k, pe[k:], atol=1e-6, rtol=0)


def test_1d_encodings_index_positions_and_learned_ones_refuse_overflow():
    sin, learned = SinusoidalPositionalEncoding(D, max_len=8), LearnedPositionalEncoding(D, max_len=8)
    assert sin(3, start=5).shape == learned(3, start=5).shape == (3, D)
    torch.testing.assert_close(sin(3, start=5), sinusoidal_encoding(8, D)[5:8])
    torch.testing.assert_close(learned(3, start=5), learned.weight[5:8])
    torch.testing.assert_close(sin(3, start=6), sinusoidal_encoding(9, D)[6:9])  # sines beyond the table
    with pytest.raises(ValueError, match=r"position 8 exceeds max_positions=8 .*raise model.max_positions"):
        learned(3, start=6)


def test_2d_sine_encoding_ignores_padding():
    enc = PositionEmbeddingSine2D(num_pos_feats=8)
    mask = torch.zeros(2, 5, 6, dtype=torch.bool)
    mask[1, :, 4:] = True  # image 1 is 5x4, padded to 5x6
    mask[1, 3:, :] = True
    pos = enc(mask)
    assert pos.shape == (2, 16, 5, 6)
    small = enc(torch.zeros(1, 3, 4, dtype=torch.bool))
    torch.testing.assert_close(pos[1, :, :3, :4], small[0])  # padding does not shift the encoding
    assert pos[0, 0, 0, 0].item() == pytest.approx(math.sin(2 * math.pi / 5), abs=1e-5)  # y=1 of 5 scaled to 2π


def _copy(ours: nn.Module, ref: nn.Module) -> None:
    missing, unexpected = ours.load_state_dict(ref.state_dict(), strict=True)
    assert not missing and not unexpected


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_matches_torch(norm_first, activation):
    torch.manual_seed(0)
    ref = nn.TransformerEncoderLayer(
        D, H, FF, dropout=0.0, activation=activation, norm_first=norm_first, batch_first=True
    ).eval()
    ours = TransformerEncoderLayer(D, H, FF, dropout=0.0, activation=activation, norm_first=norm_first).eval()
    _copy(ours, ref)
    x = torch.randn(3, 6, D)
    kpm = torch.zeros(3, 6, dtype=torch.bool)
    kpm[1, 4:] = True
    mask = nn.Transformer.generate_square_subsequent_mask(6)
    torch.testing.assert_close(
        ours(x, src_key_padding_mask=kpm), ref(x, src_key_padding_mask=kpm), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(ours(x, src_mask=mask), ref(x, src_mask=mask), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_matches_torch(norm_first):
    torch.manual_seed(0)
    ref = nn.TransformerDecoderLayer(D, H, FF, dropout=0.0, norm_first=norm_first, batch_first=True).eval()
    ours = TransformerDecoderLayer(D, H, FF, dropout=0.0, norm_first=norm_first).eval()
    _copy(ours, ref)
    tgt, mem = torch.randn(3, 5, D), torch.randn(3, 7, D)
    mkpm = torch.zeros(3, 7, dtype=torch.bool)
    mkpm[2, 5:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    expected = ref(tgt, mem, tgt_mask=causal, memory_key_padding_mask=mkpm)
    torch.testing.assert_close(
        ours(tgt, mem, tgt_is_causal=True, memory_key_padding_mask=mkpm), expected, atol=1e-5, rtol=1e-5
    )


# LayerScale (Touvron et al. 2021, CaiT): each residual branch multiplied by a learned gamma (D,)


def _layer(decoder: bool, norm_first: bool, init_values: float | None = None) -> nn.Module:
    torch.manual_seed(0)
    layer = TransformerDecoderLayer if decoder else TransformerEncoderLayer
    return layer(D, H, FF, dropout=0.0, norm_first=norm_first, init_values=init_values).eval()


def _run(layer: nn.Module, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
    return layer(x, memory, tgt_is_causal=True) if isinstance(layer, TransformerDecoderLayer) else layer(x)


@pytest.mark.parametrize("decoder", [False, True])
def test_layer_scale_of_zero_makes_a_pre_norm_layer_the_identity(decoder):
    x, memory = torch.randn(2, 5, D), torch.randn(2, 7, D)
    torch.testing.assert_close(_run(_layer(decoder, True, init_values=0.0), x, memory), x, rtol=0, atol=0)
    assert not torch.allclose(_run(_layer(decoder, True), x, memory), x)  # without it the branches add to x


@pytest.mark.parametrize("decoder", [False, True])
@pytest.mark.parametrize("norm_first", [False, True])
def test_layer_scale_multiplies_each_branch_by_its_own_gamma(decoder, norm_first):
    """gamma ⊙ (W h + b) = (diag(gamma) W) h + gamma ⊙ b: the layer with LayerScale equals the plain layer whose
    branches' last projections are scaled, row by row, by their gammas (each branch a different one)."""
    scaled, plain = _layer(decoder, norm_first, init_values=1.0), _layer(decoder, norm_first)
    plain.load_state_dict({k: v for k, v in scaled.state_dict().items() if not k.endswith(".gamma")})
    last = {"ls1": "self_attn.out_proj", "ls2": "multihead_attn.out_proj" if decoder else "linear2"}
    last |= {"ls3": "linear2"} if decoder else {}
    assert {n for n, _ in scaled.named_parameters() if n.endswith("gamma")} == {f"{ls}.gamma" for ls in last}
    with torch.no_grad():
        for ls, projection in last.items():
            gamma = torch.rand(D) + 0.5
            scaled.get_submodule(ls).gamma.copy_(gamma)
            linear = plain.get_submodule(projection)
            linear.weight.mul_(gamma[:, None])
            linear.bias.mul_(gamma)
    x, memory = torch.randn(2, 5, D), torch.randn(2, 7, D)
    torch.testing.assert_close(_run(scaled, x, memory), _run(plain, x, memory), atol=1e-5, rtol=1e-5)


def test_stacks_match_torch_stacks():
    torch.manual_seed(0)
    ref_enc = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(D, H, FF, 0.0, batch_first=True), 2, enable_nested_tensor=False
    ).eval()
    ours_enc = TransformerEncoder(2, D, H, dim_feedforward=FF, dropout=0.0).eval()
    _copy(ours_enc, ref_enc)
    ref_dec = nn.TransformerDecoder(
        nn.TransformerDecoderLayer(D, H, FF, 0.0, batch_first=True), 2, norm=nn.LayerNorm(D)
    ).eval()
    ours_dec = TransformerDecoder(2, D, H, final_norm=True, dim_feedforward=FF, dropout=0.0).eval()
    _copy(ours_dec, ref_dec)
    src, tgt = torch.randn(2, 7, D), torch.randn(2, 4, D)
    mem = ours_enc(src)
    torch.testing.assert_close(mem, ref_enc(src), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_dec(tgt, mem), ref_dec(tgt, mem), atol=1e-5, rtol=1e-5)


def test_positions_go_to_queries_and_keys_only():
    torch.manual_seed(0)
    layer = TransformerEncoderLayer(D, H, FF, dropout=0.0).eval()
    x, pos = torch.randn(2, 6, D), torch.randn(2, 6, D)
    attn = layer.self_attn
    expected_sa = attn(x + pos, x + pos, x)[0]
    expected = layer.norm2(layer.norm1(x + expected_sa) + layer._ff(layer.norm1(x + expected_sa)))
    torch.testing.assert_close(layer(x, pos=pos), expected, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(layer(x, pos=pos), layer(x + pos))


def test_decoder_returns_every_layer_and_decodes_incrementally():
    torch.manual_seed(0)
    dec = TransformerDecoder(3, D, H, final_norm=True, return_intermediate=True, dim_feedforward=FF, dropout=0.0).eval()
    tgt, mem = torch.randn(2, 5, D), torch.randn(2, 7, D)
    out = dec(tgt, mem, tgt_is_causal=True)
    assert out.shape == (3, 2, 5, D)
    dec.return_intermediate = False
    cache = [DecoderLayerCache() for _ in dec.layers]
    steps = [dec(tgt[:, t : t + 1], mem, tgt_is_causal=True, cache=cache) for t in range(5)]
    torch.testing.assert_close(torch.cat(steps, 1), out[-1], atol=1e-5, rtol=1e-5)
    enc = TransformerEncoder(2, D, H, final_norm=True, norm_first=True, dim_feedforward=FF, dropout=0.0).eval()
    full = enc(tgt, is_causal=True)
    cache = [KVCache() for _ in enc.layers]
    torch.testing.assert_close(
        torch.cat([enc(tgt[:, t : t + 1], is_causal=True, cache=cache) for t in range(5)], 1),
        full,
        atol=1e-5,
        rtol=1e-5,
    )


def test_stacks_hand_one_rope_or_bias_to_every_layer_or_one_per_layer():
    from models.core.position import RotaryEmbedding

    torch.manual_seed(0)
    enc = TransformerEncoder(
        2, 12, 3, dim_feedforward=FF, dropout=0.0, attention=AttentionConfig(qk_norm="rmsnorm")
    ).eval()
    dec = TransformerDecoder(2, 12, 3, dim_feedforward=FF, dropout=0.0).eval()
    x, memory = torch.randn(2, 5, 12), torch.randn(2, 4, 12)
    biases = [torch.randn(3, 5, 5), torch.randn(3, 5, 5)]
    rope = RotaryEmbedding(4)(5)
    by_hand = enc.layers[1](enc.layers[0](x, position_bias=biases[0]), position_bias=biases[1])
    torch.testing.assert_close(enc(x, position_bias=biases), by_hand)
    by_hand = enc.layers[1](enc.layers[0](x, rope=rope), rope=rope)
    torch.testing.assert_close(enc(x, rope=rope), by_hand)
    assert not torch.allclose(enc(x, rope=rope), enc(x))
    by_hand = dec.layers[1](
        dec.layers[0](x, memory, rope=rope, tgt_is_causal=True), memory, rope=rope, tgt_is_causal=True
    )
    torch.testing.assert_close(dec(x, memory, rope=rope, tgt_is_causal=True), by_hand)
    assert not torch.allclose(dec(x, memory, rope=rope), dec(x, memory))


# Llama's options: RMSNorm, SwiGLU, no biases, grouped-query attention


def test_llama_layer_is_pre_rmsnorm_swiglu_without_biases():
    torch.manual_seed(0)
    options = dict(activation="swiglu", norm="rmsnorm", bias=False, num_kv_heads=2, norm_first=True, dropout=0.0)
    layer = TransformerEncoderLayer(D, H, FF, **options).eval()
    shapes = {name: tuple(p.shape) for name, p in layer.named_parameters()}
    assert shapes == {
        "self_attn.in_proj_weight": (D + 2 * 2 * (D // H), D),
        "self_attn.out_proj.weight": (D, D),
        "linear1.weight": (2 * FF, D),  # the gate's rows, then the up projection's
        "linear2.weight": (D, FF),
        "norm1.weight": (D,),
        "norm2.weight": (D,),
    }
    for p in layer.parameters():
        nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.3)
    x = torch.randn(2, 5, D)

    def rms(v, w):  # Zhang & Sennrich 2019, with nn.RMSNorm's ε here
        return v * (v.pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt() * w

    h = x + layer.self_attn(rms(x, layer.norm1.weight), is_causal=True)[0]
    gate, up = layer.linear1.weight.chunk(2)
    ff = layer.linear2(nn.functional.silu(rms(h, layer.norm2.weight) @ gate.T) * (rms(h, layer.norm2.weight) @ up.T))
    torch.testing.assert_close(layer(x, is_causal=True), h + ff, atol=1e-5, rtol=1e-5)
    stack = TransformerEncoder(2, D, H, final_norm=True, dim_feedforward=FF, **options)
    assert isinstance(stack.norm, nn.RMSNorm) and isinstance(stack.layers[1].norm2, nn.RMSNorm)
    decoder_layer = TransformerDecoderLayer(D, H, FF, **options)
    assert decoder_layer.multihead_attn.in_proj_bias is None and isinstance(decoder_layer.norm3, nn.RMSNorm)


def test_defaults_keep_layernorm_biases_and_the_plain_mlp():
    layer = TransformerEncoderLayer(D, H, FF)
    assert isinstance(layer.norm1, nn.LayerNorm) and layer.linear1.weight.shape == (FF, D)
    assert layer.linear1.bias is not None and layer.self_attn.in_proj_weight.shape == (3 * D, D)


def test_an_unknown_norm_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="norm='batchnorm' is not known; choose one of layernorm, rmsnorm"):
        TransformerEncoderLayer(D, H, FF, norm="batchnorm")


def test_a_language_model_refuses_kv_heads_that_do_not_divide_the_heads():
    with pytest.raises(ValueError, match=r"model.num_kv_heads=4 does not divide model.nhead=6; choose a divisor of 6"):
        DecoderOnlyLM(vocab_size=11, d_model=24, nhead=6, num_layers=1, num_kv_heads=4)
    lm = DecoderOnlyLM(vocab_size=11, d_model=24, nhead=6, num_layers=1, num_kv_heads=3, positions="rope")
    assert lm.blocks.layers[0].self_attn.in_proj_weight.shape == (24 + 2 * 3 * 4, 24)
