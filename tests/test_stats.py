"""experiments.callbacks.attention_stats: the statistics against a hand computation, and against an oracle that re-derives each layer's
logits and blocked mask from its inputs (as experiments/callbacks/attention_stats.py did before the core reported them) and computes the
statistics query by query in plain Python (`hand_layer_stats`), sharing no code with the module's own."""

import math

import numpy as np
import pytest
import scipy.stats
import torch
from builders import encoder_decoder, tiny_vit
from conftest import TINY_TRUNK
from torch import nn

from experiments.callbacks.attention_stats import (
    SATURATION,
    Sequence,
    _means,
    _row_sums,
    _sequences,
    attention_statistics,
)
from models.core.attention import AttentionConfig, AttentionScores, MultiHeadAttention
from models.core.capture import capture_attention
from models.core.masks import merge_masks
from models.detection.backbone import Backbone
from models.detection.detr import DETR
from models.text.lm import DecoderOnlyLM
from models.text.seq2seq import Seq2SeqTransformer
from models.vision.vit import VisionTransformer


def rescored_statistics(model: nn.Module, args: tuple, special_ids: tuple[int, ...] = ()) -> list[dict]:
    """The statistics as experiments/callbacks/attention_stats.py computed them until the core reported its scores: the logits re-derived
    from each layer's recorded inputs (projection, `general` map, scale) and the masks rebuilt with `merge_masks`."""
    from experiments.callbacks import attention_stats as stats

    kind = stats.modality(model)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, MultiHeadAttention)}
    calls, outputs, feature_hw = {}, {}, []
    handles = [
        m.register_forward_pre_hook(
            lambda m, a, kw, name=name: calls.setdefault(name, (a, kw)) and None, with_kwargs=True
        )
        for name, m in layers.items()
    ] + [
        m.register_forward_hook(lambda m, a, out, name=name: [outputs.setdefault(name, out[0].detach())] and None)
        for name, m in layers.items()
    ]
    if kind == "detection":
        handles.append(model.backbone.register_forward_hook(lambda m, a, out: feature_hw.append(tuple(out.shape[-2:]))))
    model.eval()
    with torch.no_grad(), capture_attention(model) as maps:
        model(*args)
    for h in handles:
        h.remove()
    enc, dec = stats._sequences(kind, model, args, feature_hw[0] if feature_hw else None, special_ids)
    out = []
    for name, m in layers.items():
        (a, kw), weights = calls[name], maps[name][0]
        query = a[0] if a else kw["query"]
        key = a[1] if len(a) > 1 else kw.get("key")
        key = query if key is None else key
        value = a[2] if len(a) > 2 else kw.get("value")
        value = key if value is None else value
        with torch.no_grad():
            q, k, _ = m._project(query, key, value)
            if m.similarity == "general":
                q = torch.einsum("bhld,hde->bhle", q, m.general_weight)
            logits = (q @ k.transpose(-2, -1)) * m.scale
        b, _, lq, lk = logits.shape
        mask = merge_masks(
            b,
            lq,
            lk,
            attn_mask=kw.get("attn_mask"),
            key_padding_mask=kw.get("key_padding_mask"),
            is_causal=kw.get("is_causal", False),
            device=logits.device,
            dtype=logits.dtype,
        )
        blocked = (
            torch.zeros(1, 1, lq, lk, dtype=torch.bool)
            if mask is None
            else mask
            if mask.dtype == torch.bool
            else torch.isneginf(mask)
        )
        # the queries that count are those the layer's own self-attention does not pad: a cross-attention's queries
        # are its decoder layer's tokens, whose padding mask that layer's self_attn was given
        cross = name.endswith("multihead_attn")
        own = name.removesuffix("multihead_attn") + "self_attn" if cross else name
        padded = calls[own][1].get("key_padding_mask")
        valid_q = torch.ones(b, lq, dtype=torch.bool) if padded is None else ~padded
        if cross:
            q_seq, k_seq = dec, enc
        else:
            q_seq = k_seq = dec if "decoder" in name.split(".") and dec is not None else enc
        if q_seq is not None and q_seq.positions is not None and len(q_seq.positions) != lq:
            q_seq = None
        if k_seq is not None and k_seq.positions is not None and len(k_seq.positions) != lk:
            k_seq = None
        out.append(
            {
                "name": name,
                "kind": "cross" if cross else "self",
                "heads": m.num_heads,
                **hand_layer_stats(weights, logits, blocked, valid_q, q_seq, k_seq),
                **scipy_output_stats(outputs[name], valid_q),
            }
        )
    return out


def scipy_output_stats(out: torch.Tensor, valid_q: torch.Tensor) -> dict[str, float | None]:
    """Bondarenko et al.'s outlier measures of an attention output (B, Lq, D) with numpy and scipy: per sequence, its
    valid rows flattened: max |x| and Pearson's kurtosis (scipy.stats.kurtosis, fisher=False); the mean over sequences."""
    x, keep = out.double().numpy(), valid_q.numpy()
    samples = [x[b][keep[b]].ravel() for b in range(len(x)) if keep[b].any()]
    varying = [s for s in samples if s.var() > 0]  # a constant sequence has no kurtosis (scipy: nan)
    return {
        "out_max": float(np.mean([np.abs(s).max() for s in samples])) if samples else None,
        "out_kurtosis": float(np.mean([scipy.stats.kurtosis(s, fisher=False) for s in varying])) if varying else None,
    }


def hand_layer_stats(
    weights: torch.Tensor,
    logits: torch.Tensor,
    blocked: torch.Tensor,
    valid_q: torch.Tensor,
    q_seq: Sequence | None,
    k_seq: Sequence | None,
) -> dict[str, list[float] | None]:
    """The module docstring's definitions, one query at a time: per head, the mean over the queries that count (not
    padding, at least one open key) of each quantity. weights/logits (B, H, Lq, Lk)."""
    b_, h_, lq, lk = weights.shape
    p_all, z_all = weights.float().tolist(), logits.float().tolist()
    shut, valid = blocked.expand(b_, h_, lq, lk).tolist(), valid_q.tolist()
    q_pos = q_seq.positions.tolist() if q_seq is not None and q_seq.positions is not None else None
    k_pos = k_seq.positions.tolist() if k_seq is not None and k_seq.positions is not None else None
    special = k_seq.special.tolist() if k_seq is not None and k_seq.special is not None else None

    def average(values: list[float]) -> float:
        return sum(values) / len(values) if values else 0.0

    out = {key: [] for key in ("entropy", "max_weight", "saturated", "logit_var", "distance", "special", "sink_mass")}
    for h in range(h_):
        rows, distances = [], []
        for b in range(b_):
            for i in range(lq):
                open_keys = [j for j in range(lk) if not shut[b][h][i][j]]
                if not valid[b][i] or not open_keys:
                    continue
                p = p_all[b][h][i]
                z = [z_all[b][h][i][j] for j in open_keys]
                mean_z = sum(z) / len(z)
                rows.append(
                    {
                        "entropy": -sum(x * math.log(x) for x in p if x > 0),
                        "max_weight": max(p),
                        "saturated": float(max(p) > SATURATION),
                        "logit_var": sum((v - mean_z) ** 2 for v in z) / len(z),
                        "special": sum(p[j] for j in range(lk) if special[b][j]) if special is not None else 0.0,
                        "sink_mass": p[0],
                    }
                )
                if q_pos is None or k_pos is None or any(math.isnan(c) for c in q_pos[i]):
                    continue
                placed = [j for j in range(lk) if not any(math.isnan(c) for c in k_pos[j])]
                mass = sum(p[j] for j in placed)
                if mass > 0:
                    distances.append(sum(p[j] * math.dist(q_pos[i], k_pos[j]) for j in placed) / mass)
        for key in ("entropy", "max_weight", "saturated", "logit_var", "special", "sink_mass"):
            out[key].append(average([row[key] for row in rows]))
        out["distance"].append(average(distances))
    if q_pos is None or k_pos is None:
        out["distance"] = None
    if special is None:
        out["special"] = None
    out["sink_heads"] = sum(m > 0.3 for m in out["sink_mass"]) / h_  # Gu et al.'s ε
    out["register_mass"] = None  # these models have no registers
    return out


def _layer_stats(weights, logits, blocked, valid_q, q_seq, k_seq):
    """The module's statistics of one whole call: its sums over the call as one block, divided by the counts."""
    return _means(_row_sums(AttentionScores(weights, logits, blocked), valid_q, q_seq, k_seq))


def test_statistics_of_a_known_attention_matrix():
    """Two queries over three keys, the third blocked; every expected value worked out on paper."""
    weights = torch.tensor([[[[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]]])  # (B=1, H=1, Lq=2, Lk=3)
    logits = torch.tensor([[[[1.0, 3.0, -50.0], [2.0, 2.0, -50.0]]]])
    blocked = torch.tensor([False, False, True])
    queries = Sequence(torch.tensor([[0.0], [1.0]]), None)  # at positions 0 and 1
    keys = Sequence(torch.tensor([[0.0], [1.0], [2.0]]), torch.tensor([[True, False, False]]))  # key 0 is special
    for oracle in (_layer_stats, hand_layer_stats):
        stats = oracle(weights, logits, blocked, torch.tensor([[True, True]]), queries, keys)
        assert stats["entropy"] == pytest.approx([math.log(2) / 2])  # ln 2 for the even split, 0 for the one-hot
        assert stats["max_weight"] == pytest.approx([0.75]) and stats["saturated"] == pytest.approx([0.5])
        assert stats["logit_var"] == pytest.approx([0.5])  # var(1, 3) = 1, var(2, 2) = 0
        assert stats["distance"] == pytest.approx([0.75])  # query 0: 0.5 x 1 away; query 1: all on key 0, 1 away
        assert stats["special"] == pytest.approx([0.75])  # 0.5 and 1.0 on key 0


def _cases():
    torch.manual_seed(0)
    src = torch.tensor([[1, 5, 6, 7, 2], [1, 8, 2, 0, 0]])
    tgt = torch.tensor([[1, 9, 4, 2], [1, 3, 0, 0]])
    for similarity in ("scaled_dot", "general"):
        s2s = Seq2SeqTransformer(
            12, 12, **encoder_decoder(16, 2), attention=AttentionConfig(similarity=similarity), pad_id=0
        )
        if similarity == "general":  # away from the identity, so that the map counts
            for m in s2s.modules():
                if isinstance(m, MultiHeadAttention):
                    nn.init.normal_(m.general_weight)
        yield f"seq2seq-{similarity}", s2s, (src, tgt), (1, 2)
    yield "lm", DecoderOnlyLM(12, d_model=16, nhead=2, num_layers=2), (torch.randint(0, 12, (2, 6)),), ()
    vit = tiny_vit(num_classes=3)
    yield "vit", vit, (torch.randn(2, 1, 8, 8),), ()
    stem = VisionTransformer(8, 1, 1, 3, 16, 2, 2, stem_channels=(4, 8))  # 8 -> 4 -> 2: a 2x2 grid of 4-pixel cells
    yield "vit-stem", stem.eval(), (torch.randn(2, 1, 8, 8),), ()
    detr = DETR(Backbone(**TINY_TRUNK), 3, 4, **encoder_decoder(16, 2, 1))
    mask = torch.zeros(2, 64, 64, dtype=torch.bool)
    mask[1, :, 40:] = True  # the second image is padded on the right
    yield "detr", detr, (torch.randn(2, 3, 64, 64), mask), ()


@pytest.mark.parametrize("name,model,args,special", list(_cases()), ids=lambda c: c if isinstance(c, str) else "")
def test_statistics_equal_those_computed_from_rescored_inputs(name, model, args, special):
    expected = rescored_statistics(model, args, special)
    got = attention_statistics(model, args, special_ids=special)["layers"]
    assert [layer["name"] for layer in got] == [layer["name"] for layer in expected] and len(got) >= 2
    for g, e in zip(got, expected):
        assert g.keys() == e.keys()
        for key, value in e.items():
            if isinstance(value, (list, float)):
                assert g[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (g["name"], key)
            else:
                assert g[key] == value, (g["name"], key)
    assert any(layer["logit_var"][0] > 0 for layer in got)


def _entropy(p: list[float]) -> float:
    return -sum(x * math.log(x) for x in p if x > 0)


def test_statistics_of_one_head_equal_a_hand_computation():
    """One head of width 1, identity projections: logits are q·k/√1 = x_i·x_j, written out below by hand."""
    m = MultiHeadAttention(1, 1, bias=False)
    with torch.no_grad():
        m.in_proj_weight.fill_(1.0)
        m.out_proj.weight.fill_(1.0)
    x = torch.tensor([[[1.0], [3.0], [0.0]]])  # (B=1, L=3, D=1); the third token is padding
    kpm = torch.tensor([[False, False, True]])
    with capture_attention(m, scores=True) as maps:
        m(x, key_padding_mask=kpm)
    weights, logits, blocked = maps[""][0].weights, maps[""][0].logits, maps[""][0].blocked
    logit_rows = [[1.0, 3.0], [3.0, 9.0]]  # queries 0 and 1 over the two open keys
    assert logits[0, 0, :2, :2].tolist() == logit_rows
    assert blocked.expand(1, 1, 3, 3)[0, 0].tolist() == [[False, False, True]] * 3
    probs = [[math.exp(a) / sum(math.exp(b) for b in row) for a in row] for row in logit_rows]
    positions = torch.arange(3, dtype=torch.float32)[:, None]
    seq = Sequence(positions, torch.tensor([[True, False, False]]))  # token 0 is special (BOS)
    stats = _layer_stats(weights, logits, blocked, ~kpm, seq, seq)
    assert stats["entropy"] == pytest.approx([(_entropy(probs[0]) + _entropy(probs[1])) / 2], rel=1e-6)
    assert stats["max_weight"] == pytest.approx([(max(probs[0]) + max(probs[1])) / 2], rel=1e-6)
    assert max(probs[0]) < 0.9 < max(probs[1])  # 0.88 and 0.998
    assert stats["saturated"] == pytest.approx([0.5])

    def variance(row):
        return sum((a - sum(row) / len(row)) ** 2 for a in row) / len(row)

    assert stats["logit_var"] == pytest.approx([(variance(logit_rows[0]) + variance(logit_rows[1])) / 2], rel=1e-6)
    # query 0 sits at 0 and looks 1 away with weight probs[0][1]; query 1 at 1 looks 1 away with probs[1][0]
    assert stats["distance"] == pytest.approx([(probs[0][1] + probs[1][0]) / 2], rel=1e-6)
    assert stats["special"] == pytest.approx([(probs[0][0] + probs[1][0]) / 2], rel=1e-6)


def test_vision_positions_are_the_centres_of_the_patch_grid_cells_in_pixels():
    stem = VisionTransformer(
        img_size=8, patch_size=1, in_chans=1, embed_dim=16, depth=1, num_heads=2, stem_channels=(4, 8)
    )
    for vit, centres in (
        (VisionTransformer(img_size=8, patch_size=4, in_chans=1, embed_dim=16, depth=1, num_heads=2), (2.0, 6.0)),
        (stem, (2.0, 6.0)),
    ):
        seq, _ = _sequences("vision", vit, (torch.zeros(1, 1, 8, 8),), None, ())
        assert seq.positions[0].isnan().all()  # [CLS]
        assert seq.positions[1:].tolist() == [[r, c] for r in centres for c in centres]


def test_the_figure_takes_the_first_sample_or_says_why_when_its_weights_would_not_fit(monkeypatch):
    """attention.png draws the first sample's whole weights: left out, with the reason, where they would pass
    CAPTURE_MIB (the statistics are measured in row blocks at any length: tests/test_stats_blocks.py)."""
    from experiments.callbacks import attention_stats

    torch.manual_seed(0)
    lm = DecoderOnlyLM(11, d_model=16, nhead=2, num_layers=3, max_positions=32)
    tokens = torch.randint(11, (4, 32))
    per_sample = 3 * 2 * 32 * 32 * 4 / 2**20  # 3 layers x 2 heads x 32 x 32 fp32 weights
    assert attention_stats.captured_mib(lm, (tokens,), {}) == pytest.approx(4 * per_sample)
    monkeypatch.setattr(attention_stats, "CAPTURE_MIB", 2 * per_sample)
    (args, kwargs) = attention_stats.figure_inputs(lm, (tokens,), {})
    assert torch.equal(args[0], tokens[:1]) and kwargs == {}
    monkeypatch.setattr(attention_stats, "CAPTURE_MIB", per_sample / 2)
    why = attention_stats.figure_inputs(lm, (tokens,), {})
    assert why.startswith(
        "attention.png left out: the attention weights of the fixed batch's first sample would take 0 MiB, more than "
        "the 0 MiB"
    )
    assert lm.training  # left as it was
