"""The shared attention core against torch.nn.MultiheadAttention and its own invariants."""

import itertools
import math

import pytest
import torch
from builders import encoder_decoder
from test_padding_free import cpu_varlen_attn
from torch import nn

from models.core import attend, attention, padding_free
from models.core.attention import SIMILARITIES, AttentionConfig, MultiHeadAttention
from models.core.capture import capture_attention
from models.core.kv_cache import KVCache
from models.core.masks import subsequent_mask
from models.core.position import ALiBi, RotaryEmbedding, T5RelativePositionBias

B, LQ, LK, D, H = 3, 5, 7, 16, 4


def _pair(similarity="scaled_dot"):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(D, H, batch_first=True)
    ours = MultiHeadAttention(D, H, attention=AttentionConfig(similarity=similarity))
    nn.init.normal_(ref.in_proj_bias)
    nn.init.normal_(ref.out_proj.bias)
    missing, unexpected = ours.load_state_dict(ref.state_dict(), strict=False)
    assert unexpected == [] and set(missing) <= {"general_weight"}
    return ref, ours


def _padding(lk=LK):
    kpm = torch.zeros(B, lk, dtype=torch.bool)
    kpm[0, -2:] = True
    kpm[2, -3:] = True
    return kpm


@pytest.mark.parametrize("cross,padded,causal", list(itertools.product([False, True], repeat=3)))
def test_matches_nn_multihead_attention(cross, padded, causal):
    ref, ours = _pair()
    lk = LK if cross else LQ
    q = torch.randn(B, LQ, D, requires_grad=True)
    kv = torch.randn(B, lk, D, requires_grad=True) if cross else q
    kpm = _padding(lk) if padded else None
    mask = torch.ones(LQ, lk, dtype=torch.bool).triu(1) if causal else None
    out_ref, w_ref = ref(q, kv, kv, key_padding_mask=kpm, attn_mask=mask, average_attn_weights=False)
    for need_weights in (False, True):
        out, w = ours(q, kv, kv, key_padding_mask=kpm, attn_mask=mask, need_weights=need_weights)
        torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
        if need_weights:
            torch.testing.assert_close(w, w_ref, atol=1e-5, rtol=1e-5)
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, [q, kv] if cross else [q], g)
        grads_ref = torch.autograd.grad(out_ref, [q, kv] if cross else [q], g, retain_graph=True)
        for a, b in zip(grads, grads_ref):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_is_causal_flag_equals_explicit_subsequent_mask():
    _, ours = _pair()
    x = torch.randn(B, LQ, D)
    torch.testing.assert_close(
        ours(x, is_causal=True)[0], ours(x, attn_mask=subsequent_mask(LQ))[0], atol=1e-6, rtol=1e-6
    )


MASKS = ["none", "causal", "padding", "bool", "float", "padding+causal"]


def _masks(kind, lq, lk):
    kw = {}
    if "causal" in kind:
        kw["is_causal"] = True
    if "padding" in kind:
        kw["key_padding_mask"] = _padding(lk)
    if kind == "bool":
        kw["attn_mask"] = torch.rand(B, lq, lk) > 0.7
    if kind == "float":
        kw["attn_mask"] = torch.randn(lq, lk)
    return kw


@pytest.mark.parametrize("similarity,kind", list(itertools.product(SIMILARITIES, MASKS)))
def test_fast_path_equals_reference_path(similarity, kind):
    _, ours = _pair(similarity)
    if similarity == "general":
        nn.init.normal_(ours.general_weight, std=0.3)
    x = torch.randn(B, LQ, D, requires_grad=True)
    kw = _masks(kind, LQ, LQ)
    fast, _ = ours(x, **kw)
    ref, w = ours(x, need_weights=True, **kw)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(fast)
    torch.testing.assert_close(
        torch.autograd.grad(fast, x, g)[0], torch.autograd.grad(ref, x, g)[0], atol=1e-5, rtol=1e-5
    )


def test_general_with_identity_equals_dot_and_dot_is_scaled_dot_times_sqrt_d():
    _, general = _pair("general")
    _, dot = _pair("dot")
    _, scaled = _pair("scaled_dot")
    with torch.no_grad():
        general.general_weight.copy_(torch.eye(D // H).repeat(H, 1, 1))
    x = torch.randn(B, LQ, D)
    torch.testing.assert_close(general(x, need_weights=True)[1], dot(x, need_weights=True)[1], atol=1e-6, rtol=1e-6)
    # dot's logits are exactly √d times scaled_dot's: check through log-softmax differences
    d = D // H
    w_dot, w_scaled = dot(x, need_weights=True)[1], scaled(x, need_weights=True)[1]
    log_ratio_dot = w_dot.log() - w_dot.log()[..., :1]
    log_ratio_scaled = w_scaled.log() - w_scaled.log()[..., :1]
    torch.testing.assert_close(log_ratio_dot, log_ratio_scaled * math.sqrt(d), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("native_safe_softmax", [True, False], ids=["sdpa-zeroes-rows", "own-fix"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_fully_masked_row_is_finite_forward_and_backward(need_weights, native_safe_softmax, monkeypatch):
    # the fast path trusts CPU SDPA's safe softmax when this torch has it, else fixes the rows itself (as on GPU)
    monkeypatch.setattr(attend, "_CPU_SDPA_SAFE", native_safe_softmax and attend.cpu_sdpa_zeroes_empty_rows())
    _, ours = _pair()
    x = torch.randn(B, LQ, D, requires_grad=True)
    mask = torch.zeros(LQ, LQ, dtype=torch.bool)
    mask[1] = True  # query 1 may attend to nothing
    out, w = ours(x, attn_mask=mask, need_weights=need_weights)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    # the empty row's attention output is zero, so only out_proj's bias remains
    torch.testing.assert_close(out[:, 1], ours.out_proj.bias.expand(B, D))
    if need_weights:
        assert (w[:, :, 1] == 0).all()
    kpm = torch.ones(B, LQ, dtype=torch.bool)  # every key padded: all rows empty
    assert torch.isfinite(ours(x, key_padding_mask=kpm, need_weights=need_weights)[0]).all()


@pytest.mark.parametrize("boolean", [True, False], ids=["bool-mask", "float-mask"])
def test_own_fix_for_empty_rows_equals_the_reference(boolean, monkeypatch):
    # the GPU's path (the core unblocks empty rows for SDPA, then zeroes them), taken on the CPU
    monkeypatch.setattr(attend, "_CPU_SDPA_SAFE", False)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g, requires_grad=True) for _ in range(3))
    blocked = torch.rand(2, 1, 5, 5, generator=g) < 0.4
    blocked[0, 0, 2] = True  # an empty row
    blocked[1] = True  # a sequence with every key blocked
    mask = blocked if boolean else torch.zeros(blocked.shape).masked_fill(blocked, float("-inf"))
    results = []
    for fn in (
        lambda: attend.attention_fast(q, k, v, mask, 0.5),
        lambda: attend.attention_reference(q, k, v, mask, 0.5)[0],
    ):
        out = fn()
        grads = torch.autograd.grad(out.pow(2).sum(), (q, k, v))
        results.append((out, *grads))
    for fast, ref in zip(*results):
        torch.testing.assert_close(fast, ref)
    assert (results[0][0][0, :, 2] == 0).all() and (results[0][0][1] == 0).all()


@pytest.mark.parametrize("similarity", SIMILARITIES)
def test_causality(similarity):
    _, ours = _pair(similarity)
    x = torch.randn(1, 10, D)
    base = ours(x, is_causal=True)[0]
    for t in range(9):
        y = x.clone()
        y[:, t + 1 :] = torch.randn_like(y[:, t + 1 :])
        torch.testing.assert_close(ours(y, is_causal=True)[0][:, : t + 1], base[:, : t + 1], atol=1e-6, rtol=1e-6)
        assert not torch.allclose(ours(y, is_causal=True)[0][:, t + 1 :], base[:, t + 1 :])


def test_weights_are_a_distribution_and_zero_on_masked_keys():
    _, ours = _pair()
    q, kv = torch.randn(B, LQ, D), torch.randn(B, LK, D)
    kpm = _padding()
    extra = torch.rand(B, LQ, LK) > 0.8
    extra[..., 0] = False  # keep one key open per row
    _, w = ours(q, kv, kv, key_padding_mask=kpm, attn_mask=extra, need_weights=True)
    assert (w >= 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(B, H, LQ))
    blocked = kpm[:, None, None, :] | extra[:, None]
    assert (w.masked_select(blocked.expand_as(w)) == 0).all()


def test_incremental_decoding_with_cache_equals_full_causal_pass():
    _, ours = _pair()
    x = torch.randn(B, 6, D)
    full = ours(x, is_causal=True)[0]
    cache = KVCache()
    steps = [ours(x[:, t : t + 1], is_causal=True, cache=cache)[0] for t in range(6)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_capture_attention_records_every_layer_without_editing_the_model():
    model = nn.Sequential()
    model.add_module("a", MultiHeadAttention(D, H))
    model.add_module("b", MultiHeadAttention(D, 2))
    x = torch.randn(B, LQ, D)
    with capture_attention(model) as maps:
        for m in model:
            x = m(x)[0]
    assert set(maps) == {"a", "b"}
    assert maps["a"][0].shape == (B, H, LQ, LQ) and maps["b"][0].shape == (B, 2, LQ, LQ)
    assert all(m._captured is None for m in model)  # switched back off after the block


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="similarity='cosine'.*scaled_dot"):
        MultiHeadAttention(D, H, attention=AttentionConfig(similarity="cosine"))
    with pytest.raises(ValueError, match="embed_dim=16 is not divisible by num_heads=3"):
        MultiHeadAttention(D, 3)


def test_every_model_starts_general_at_the_identity():
    """The docstring's promise: `general` begins equal to `dot` in every modality's model."""
    from models.detection.detr import DETRTransformer
    from models.text.lm import DecoderOnlyLM
    from models.text.seq2seq import Seq2SeqTransformer
    from models.vision.vit import VisionTransformer

    models = [
        Seq2SeqTransformer(20, 20, **encoder_decoder(16, 4, 1), attention=AttentionConfig(similarity="general")),
        DecoderOnlyLM(20, d_model=16, nhead=4, num_layers=1, attention=AttentionConfig(similarity="general")),
        VisionTransformer(
            img_size=8,
            patch_size=4,
            in_chans=1,
            num_classes=2,
            embed_dim=16,
            depth=1,
            num_heads=4,
            attention=AttentionConfig(similarity="general"),
        ),
        DETRTransformer(
            **encoder_decoder(16, 4, 1), dropout=0.1, activation="relu", attention=AttentionConfig(similarity="general")
        ),
    ]
    for model in models:
        weights = [m.general_weight for m in model.modules() if isinstance(m, MultiHeadAttention)]
        assert weights and all(torch.equal(w, torch.eye(4).repeat(4, 1, 1)) for w in weights), type(model).__name__


def test_query_rows_share_a_key_row_when_the_key_batch_is_smaller():
    """Beam search's layout: 2 query rows (beams) per memory row attend as if the memory were repeated."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2).eval()
    memory, query = torch.randn(3, 5, 16), torch.randn(6, 2, 16)
    kpm = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]], dtype=torch.bool)
    repeated, weights = mha(
        query, memory.repeat_interleave(2, 0), key_padding_mask=kpm.repeat_interleave(2, 0), need_weights=True
    )
    shared, shared_weights = mha(query, memory, key_padding_mask=kpm, need_weights=True)
    torch.testing.assert_close(shared, repeated)
    torch.testing.assert_close(shared_weights, weights)
    torch.testing.assert_close(mha(query, memory, key_padding_mask=kpm)[0], repeated)  # the fast path
    cache = KVCache(static=True)
    mha(query, memory, key_padding_mask=kpm, cache=cache)
    assert cache.k.shape[0] == 3  # keys/values kept once per memory row
    torch.testing.assert_close(mha(query, memory, key_padding_mask=kpm, cache=cache)[0], repeated)
    with pytest.raises(ValueError, match="query batch 5 is not a multiple of the key/value batch 3"):
        mha(torch.randn(5, 2, 16), memory)


def test_cache_reorder_follows_the_beams_and_keeps_a_static_cache_per_sentence():
    rows = torch.arange(4.0).view(4, 1, 1, 1)  # (B=4, H, L, d): row i holds i
    grown, static = (
        KVCache(rows.clone(), rows.clone() + 10),
        KVCache(rows[:2].clone(), rows[:2].clone() + 10, static=True),
    )
    k_before = static.k
    for cache in (grown, static):
        cache.reorder(torch.tensor([1, 1, 3, 2]), static_index=None)  # beams reordered within their sentences
    assert grown.k.flatten().tolist() == [1, 1, 3, 2] and grown.v.flatten().tolist() == [11, 11, 13, 12]
    assert static.k is k_before  # one row per sentence: untouched
    for cache in (grown, static):
        cache.reorder(torch.tensor([2, 3]), static_index=torch.tensor([1]))  # sentence 0 done: its rows leave
    assert (
        grown.k.flatten().tolist() == [3, 2]
        and static.k.flatten().tolist() == [1]
        and static.v.flatten().tolist() == [11]
    )
    KVCache().reorder(torch.tensor([0]), None)  # an empty cache (no step yet) has nothing to move


# positions inside attention and QK-norm: each option on both paths, alone and with every mask
OPTIONS = ["qk_layernorm", "qk_rmsnorm", "rope", "alibi", "t5", "rope+qk_layernorm+alibi"]


def _with_option(option, similarity="scaled_dot"):
    """A layer (with non-trivial norm and bias parameters) and the keyword arguments of a self-attention call."""
    qk_norm = "rmsnorm" if "rmsnorm" in option else "layernorm" if "layernorm" in option else None
    torch.manual_seed(1)
    mha = MultiHeadAttention(D, H, attention=AttentionConfig(similarity=similarity, qk_norm=qk_norm))
    for p in mha.parameters():
        if p.dim() == 1:
            nn.init.normal_(p, mean=0.5 if p.shape == (D // H,) else 0.0, std=0.3)
    kw = {}
    if "rope" in option:
        kw["rope"] = RotaryEmbedding(D // H)(LQ, start=3)
    if "alibi" in option:
        kw["position_bias"] = ALiBi(H)(LQ, LQ)
    if "t5" in option:
        t5 = T5RelativePositionBias(H, bidirectional=True, num_buckets=6, max_distance=8)
        nn.init.normal_(t5.relative_attention_bias.weight)
        kw["position_bias"] = t5(LQ, LQ)
    return mha, kw


@pytest.mark.parametrize("option,kind", list(itertools.product(OPTIONS, MASKS)))
def test_options_fast_path_equals_reference_path_with_gradients(option, kind):
    mha, kw = _with_option(option)
    x = torch.randn(B, LQ, D, requires_grad=True)
    params = [p for p in mha.parameters()]
    bias = kw.get("position_bias")
    if bias is not None:
        bias = kw["position_bias"] = bias.detach().requires_grad_()
    kw.update(_masks(kind, LQ, LQ))
    results = []
    for need_weights in (False, True):
        out = mha(x, need_weights=need_weights, **kw)[0]
        wrt = [x, *params] + ([bias] if bias is not None else [])
        results.append((out, *torch.autograd.grad(out.pow(2).sum(), wrt, allow_unused=True)))
    for fast, ref in zip(*results):
        if ref is None:
            assert fast is None
        else:
            torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("option,kind", list(itertools.product(OPTIONS, ["padding", "padding+causal"])))
@pytest.mark.parametrize("kernel", padding_free.KERNELS)
def test_options_padding_free_path_equals_reference_path_at_valid_rows(option, kind, kernel, monkeypatch):
    """The padding-free path forced on the CPU (tests/test_padding_free.py: "varlen" runs its stand-in for
    varlen_attn): outputs at the valid rows and gradients of a loss over them; with a position bias (ALiBi,
    T5) the layer keeps the masked path, which must agree as well."""
    monkeypatch.setattr(padding_free, "varlen_attn", cpu_varlen_attn)
    monkeypatch.setitem(attention.PADDING_FREE, "cpu", (kernel,))
    mha, kw = _with_option(option)
    kw.update(_masks(kind, LQ, LQ))
    valid = ~kw["key_padding_mask"]
    x = torch.randn(B, LQ, D, requires_grad=True)
    params = list(mha.parameters())
    results = []
    for need_weights in (False, True):
        out = mha(x, need_weights=need_weights, **kw)[0]
        loss = (out * valid[..., None]).pow(2).sum()
        results.append((out[valid], *torch.autograd.grad(loss, [x, *params], allow_unused=True)))
    for fast, ref in zip(*results):
        if ref is None:
            assert fast is None
        else:
            torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


def _queries_and_keys_by_hand(mha: MultiHeadAttention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Self-attention's q and k (B, H, L, d): in_proj's first D rows, then the next D, split into H heads of d."""
    q, k, _ = (x @ mha.in_proj_weight.T + mha.in_proj_bias).split(D, dim=-1)
    return tuple(t.view(B, -1, H, D // H).transpose(1, 2) for t in (q, k))


def _normalised_by_hand(t: torch.Tensor, norm: str, learned: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Over each head's d, with the parameters ``name``.weight (γ) and .bias (β): LayerNorm (t - mean) / √(var + ε)·γ
    + β, RMSNorm t / √(mean t² + ε)·γ; ε = 1e-6 (timm's)."""
    if norm == "layernorm":
        centred = t - t.mean(-1, keepdim=True)
        scaled = centred / (centred.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
        return scaled * learned[f"{name}.weight"] + learned[f"{name}.bias"]
    return t / (t.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * learned[f"{name}.weight"]


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("similarity", SIMILARITIES)
def test_qk_norm_normalises_each_head_of_queries_and_keys(similarity, norm):
    mha, _ = _with_option(f"qk_{norm}", similarity)
    x = torch.randn(B, LQ, D)
    with capture_attention(mha, scores=True) as maps:
        mha(x)
    learned = mha.state_dict()
    q, k = _queries_and_keys_by_hand(mha, x)
    q, k = _normalised_by_hand(q, norm, learned, "q_norm"), _normalised_by_hand(k, norm, learned, "k_norm")
    if similarity == "general":
        q = torch.einsum("bhld,hde->bhle", q, learned["general_weight"])
    scale = (D // H) ** -0.5 if similarity == "scaled_dot" else 1.0
    torch.testing.assert_close(maps[""][0].logits, q @ k.transpose(-2, -1) * scale)


def test_rope_and_position_bias_reach_the_logits_as_llama_rotates_and_where_the_bias_says():
    """The logits and weights against a hand computation: queries and keys rotated by Hugging Face Llama's
    ``apply_rotary_pos_emb`` at positions 3..7, q·k/√d, then the softmax over keys after an asymmetric bias is
    added at its (head, query, key)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    mha, _ = _with_option("rope")
    x, bias = torch.randn(B, LQ, D), torch.randn(H, LQ, LQ)
    with capture_attention(mha, scores=True) as maps:
        mha(x, rope=RotaryEmbedding(D // H)(LQ, start=3), position_bias=bias)
    q, k = _queries_and_keys_by_hand(mha, x)
    llama = LlamaRotaryEmbedding(LlamaConfig(hidden_size=D, num_attention_heads=H, rope_theta=10000.0))
    cos, sin = llama(q, torch.arange(3, 3 + LQ)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    logits = q @ k.transpose(-2, -1) / math.sqrt(D // H)  # (B, H, L, L), before the bias
    torch.testing.assert_close(maps[""][0].logits, logits)
    torch.testing.assert_close(maps[""][0].weights, (logits + bias).softmax(-1))


def test_rope_attention_depends_on_the_distance_between_positions_only():
    """q·k after rotating q to position i and k to j depends on j - i only: shifting every position leaves the
    layer's output as it was (rotating the keys alone would not)."""
    mha, _ = _with_option("rope+qk_layernorm")
    rope, x = RotaryEmbedding(D // H), torch.randn(B, LQ, D)
    out = mha(x, rope=rope(LQ))[0]
    torch.testing.assert_close(mha(x, rope=rope(LQ, start=11))[0], out, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(mha(x)[0], out, atol=1e-3)  # the rotation matters


def test_qk_norm_bounds_the_largest_logit_that_capture_records():
    """|q|, |k| = √d after a LayerNorm with unit scale, so |q·k/√d| <= √d however large the inputs."""
    torch.manual_seed(0)
    plain, normed = MultiHeadAttention(D, H), MultiHeadAttention(D, H, attention=AttentionConfig(qk_norm="layernorm"))
    normed.load_state_dict(plain.state_dict(), strict=False)
    x = 30 * torch.randn(B, LQ, D)
    largest = {}
    for name, mha in (("plain", plain), ("normed", normed)):
        with capture_attention(mha, scores=True) as maps:
            mha(x)
        largest[name] = maps[""][0].logits.max().item()
    assert largest["normed"] <= math.sqrt(D // H) + 1e-4 < largest["plain"]


def test_rope_cached_decoding_equals_the_full_causal_pass():
    mha, _ = _with_option("rope+qk_layernorm")
    rope = RotaryEmbedding(D // H)
    x = torch.randn(B, 7, D)
    full = mha(x, is_causal=True, rope=rope(7))[0]
    cache = KVCache()
    prefix = mha(x[:, :3], is_causal=True, cache=cache, rope=rope(3))[0]  # a prompt, then one token a step
    steps = [mha(x[:, t : t + 1], is_causal=True, cache=cache, rope=rope(1, start=t))[0] for t in range(3, 7)]
    torch.testing.assert_close(torch.cat([prefix, *steps], 1), full, atol=1e-5, rtol=1e-5)
    wrong = mha(x[:, :1], is_causal=True, cache=KVCache(cache.k[:, :, :6], cache.v[:, :, :6]), rope=rope(1))[0]
    assert not torch.allclose(wrong, full[:, 6:]), "the offset matters: position 0 instead of 6"


def test_alibi_cached_decoding_equals_the_full_causal_pass():
    mha, _ = _with_option("qk_rmsnorm")
    alibi = ALiBi(H)
    x = torch.randn(B, 6, D)
    full = mha(x, is_causal=True, position_bias=alibi(6, 6))[0]
    cache = KVCache()
    steps = [mha(x[:, t : t + 1], is_causal=True, cache=cache, position_bias=alibi(1, t + 1))[0] for t in range(6)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("native_safe_softmax", [True, False], ids=["sdpa-zeroes-rows", "own-fix"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_position_bias_keeps_fully_masked_rows_finite(need_weights, native_safe_softmax, monkeypatch):
    monkeypatch.setattr(attend, "_CPU_SDPA_SAFE", native_safe_softmax and attend.cpu_sdpa_zeroes_empty_rows())
    mha, kw = _with_option("t5")
    x = torch.randn(B, LQ, D, requires_grad=True)
    kpm = torch.zeros(B, LQ, dtype=torch.bool)
    kpm[1] = True  # every key of sequence 1 padded
    mask = torch.zeros(LQ, LQ, dtype=torch.bool)
    mask[2] = True  # query 2 sees nothing
    out, w = mha(x, attn_mask=mask, key_padding_mask=kpm, need_weights=need_weights, **kw)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    torch.testing.assert_close(out[:, 2], mha.out_proj.bias.expand(B, D))


def test_position_options_are_refused_with_their_names():
    with pytest.raises(ValueError, match="qk_norm='l2'.*layernorm or rmsnorm"):
        MultiHeadAttention(D, H, attention=AttentionConfig(qk_norm="l2"))
    mha = MultiHeadAttention(D, H)
    with pytest.raises(ValueError, match=r"position_bias has shape \(4, 5, 6\), expected \(heads, 5, 5\)"):
        mha(torch.randn(B, LQ, D), position_bias=torch.zeros(H, LQ, 6))
    cache = KVCache(static=True)
    mha(torch.randn(B, 1, D), torch.randn(B, LK, D), cache=cache)
    with pytest.raises(ValueError, match="static .*cache takes none"):
        mha(torch.randn(B, 1, D), torch.randn(B, LK, D), cache=cache, rope=RotaryEmbedding(D // H)(1))


# grouped-query attention: fewer key/value heads, each shared by a group of query heads


def _grouped_pair(kv_heads=2):
    """A grouped-query layer (H query heads on ``kv_heads``) and a multi-head layer with the same queries whose key
    and value heads are the grouped layer's, each repeated for its group of query heads."""
    torch.manual_seed(2)
    grouped = MultiHeadAttention(D, H, num_kv_heads=kv_heads)
    nn.init.normal_(grouped.in_proj_bias)
    nn.init.normal_(grouped.out_proj.bias)
    full = MultiHeadAttention(D, H)
    q, k, v = grouped.in_proj_weight.split([D, kv_heads * D // H, kv_heads * D // H])
    qb, kb, vb = grouped.in_proj_bias.split([D, kv_heads * D // H, kv_heads * D // H])

    def repeat(rows):  # (H_kv·d, ...) -> (H·d, ...): kv head j serves query heads j·g .. j·g + g - 1
        return rows.unflatten(0, (kv_heads, D // H)).repeat_interleave(H // kv_heads, 0).flatten(0, 1)

    with torch.no_grad():
        full.in_proj_weight.copy_(torch.cat([q, repeat(k), repeat(v)]))
        full.in_proj_bias.copy_(torch.cat([qb, repeat(kb), repeat(vb)]))
        full.out_proj.load_state_dict(grouped.out_proj.state_dict())
    return grouped, full


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("need_weights", [False, True])
def test_grouped_query_attention_equals_multi_head_with_each_kv_head_repeated(kind, need_weights):
    grouped, full = _grouped_pair()
    assert grouped.in_proj_weight.shape == (D + 2 * 2 * (D // H), D)  # q rows, then k, then v of 2 heads
    x = torch.randn(B, LQ, D)
    kw = _masks(kind, LQ, LQ)
    ours, weights = grouped(x, need_weights=need_weights, **kw)
    expected, expected_weights = full(x, need_weights=need_weights, **kw)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    if need_weights:
        torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=1e-6)


def test_grouped_query_cross_attention_and_a_shared_memory_equal_multi_head():
    grouped, full = _grouped_pair(kv_heads=1)  # multi-query attention
    x, memory, kpm = torch.randn(B, LQ, D), torch.randn(B, LK, D), _padding()
    torch.testing.assert_close(
        grouped(x, memory, key_padding_mask=kpm)[0], full(x, memory, key_padding_mask=kpm)[0], atol=1e-5, rtol=1e-5
    )
    one = memory[:1]  # one memory row for every query row (beams of one sentence)
    torch.testing.assert_close(grouped(x, one)[0], full(x, one)[0], atol=1e-5, rtol=1e-5)


def test_grouped_query_cache_holds_the_kv_heads_and_decodes_like_the_full_pass():
    grouped, _ = _grouped_pair()
    rope = RotaryEmbedding(D // H)
    x = torch.randn(B, 7, D)
    full = grouped(x, is_causal=True, rope=rope(7))[0]
    cache = KVCache()
    prefix = grouped(x[:, :3], is_causal=True, cache=cache, rope=rope(3))[0]
    steps = [grouped(x[:, t : t + 1], is_causal=True, cache=cache, rope=rope(1, start=t))[0] for t in range(3, 7)]
    torch.testing.assert_close(torch.cat([prefix, *steps], 1), full, atol=1e-5, rtol=1e-5)
    assert cache.k.shape == cache.v.shape == (B, 2, 7, D // H)


def test_num_kv_heads_equal_to_the_heads_keeps_the_packed_layout_and_a_bad_one_is_refused():
    assert MultiHeadAttention(D, H, num_kv_heads=H).in_proj_weight.shape == (3 * D, D)
    with pytest.raises(ValueError, match="num_kv_heads=3 does not divide num_heads=4"):
        MultiHeadAttention(D, H, num_kv_heads=3)
