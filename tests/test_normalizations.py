"""The attention block's normalisations and output gate against their papers' formulas, computed by hand here;
their fast paths against the reference path; KV-cached decoding; the padding-free path; a class of one's own."""

import itertools
import json
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from models.core import attend, attention
from models.core.attention import AttentionConfig, MultiHeadAttention
from models.core.kv_cache import KVCache

B, L, D, H = 2, 6, 16, 4
NORMALIZATIONS = ["softmax", "softmax1", "clipped", "sigmoid"]
GATES = [None, "headwise", "elementwise"]
ROOT = Path(__file__).resolve().parents[1]


def _by_hand(name: str, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """The papers' formulas over the visible keys of each row, one row at a time, in float64."""
    out = torch.zeros_like(scores, dtype=torch.float64)
    for index in itertools.product(*map(range, scores.shape[:-1])):
        keep = visible[index]
        s, n = scores[index][keep].double(), int(keep.sum())  # n: the keys this query may see
        if not keep.any():
            continue
        if name == "softmax":
            w = s.exp() / s.exp().sum()
        elif name == "softmax1":  # Miller 2023: exp(x_i) / (1 + Σ_j exp(x_j))
            w = s.exp() / (1 + s.exp().sum())
        elif name == "clipped":  # Bondarenko et al. 2023, ζ = 1, γ = -α/T with α = 12 and T = n
            gamma = -12.0 / n
            w = ((1 - gamma) * s.exp() / s.exp().sum() + gamma).clamp(0, 1)
        else:  # Ramapuram et al. 2025: σ(x - log n)
            w = 1 / (1 + torch.exp(-(s - math.log(n))))
        out[index][keep] = w
    return out


@pytest.mark.parametrize("name", NORMALIZATIONS)
def test_each_normalization_is_its_papers_formula(name):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, 8, generator=g) * 2 for _ in range(3))
    blocked = torch.rand(B, 1, L, L, generator=g) < 0.3
    blocked[0, 0, 2] = True  # a row that sees nothing
    norm = attention.AttentionConfig(normalization=name).build("normalization")
    _, weights, logits = attend.attention_reference(q, k, v, blocked, 0.5, normalization=norm)
    expected = _by_hand(name, logits, ~blocked.expand(B, H, L, L))
    torch.testing.assert_close(weights.double(), expected, atol=1e-6, rtol=1e-5)
    assert (weights[0, :, 2] == 0).all()


def test_softmax1_puts_weight_nowhere_and_clipped_reaches_exact_zeros():
    scores = torch.tensor([[[[-30.0, -30.0, -30.0]]]])  # every key far below the implicit zero logit
    assert attend.Softmax1()(scores, None).sum() < 1e-12  # softmax would give 1/3 each
    scores = torch.tensor([[[[0.0, 0.0, 10.0]]]])
    clipped = attend.ClippedSoftmax()(scores, None)  # γ = -12/3: a softmax weight below 4/5 clips to exactly 0
    assert clipped[..., :2].eq(0).all() and clipped.grad_fn is None
    torch.testing.assert_close(clipped[..., 2], 5 * scores.softmax(-1)[..., 2] - 4)  # ζ = 1: no exact one


@pytest.mark.parametrize("name", NORMALIZATIONS)
def test_a_fully_masked_row_gives_zeros_never_nan(name):
    layer = MultiHeadAttention(D, H, attention=AttentionConfig(normalization=name))
    x = torch.randn(B, L, D, requires_grad=True)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[1] = True  # every key of sequence 1 padded
    for need_weights in (False, True):
        out, _ = layer(x, key_padding_mask=kpm, need_weights=need_weights)
        (grad,) = torch.autograd.grad(out.sum(), x)
        assert torch.isfinite(out).all() and torch.isfinite(grad).all()
        torch.testing.assert_close(out[1], layer.out_proj.bias.expand(L, D))  # a zero attention output


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("masks", ["none", "causal", "padded", "padded-causal"])
def test_softmax1_and_the_gate_on_sdpa_equal_the_reference_path(masks, gate):
    torch.manual_seed(0)
    layer = MultiHeadAttention(D, H, attention=AttentionConfig(normalization="softmax1", gate=gate))
    x = torch.randn(B, L, D, requires_grad=True)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[1, 4:] = True
    kw = {"is_causal": "causal" in masks, "key_padding_mask": kpm if "padded" in masks else None}
    results = []
    for need_weights in (False, True):  # SDPA with a zero key / explicit weights
        out = layer(x, need_weights=need_weights, **kw)[0]
        results.append((out, *torch.autograd.grad(out.pow(2).sum(), (x, *layer.parameters()))))
    for fast, reference in zip(*results):
        torch.testing.assert_close(fast, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
def test_the_gate_multiplies_each_heads_output_before_out_proj(gate):
    """Qiu et al.'s G1: out_proj(Y ⊙ σ(x W_g + b_g)), Y the concatenated heads' outputs, from the plain layer
    with an identity out_proj; headwise: one gate per head, repeated over its d channels."""
    torch.manual_seed(0)
    gated = MultiHeadAttention(D, H, attention=AttentionConfig(gate=gate))
    nn.init.normal_(gated.gate_proj.weight)
    plain = MultiHeadAttention(D, H)
    plain.load_state_dict({k: v for k, v in gated.state_dict().items() if not k.startswith("gate_proj")})
    nn.init.eye_(plain.out_proj.weight)
    nn.init.zeros_(plain.out_proj.bias)
    x = torch.randn(B, L, D)
    heads = plain(x, is_causal=True)[0]  # (B, L, D): Y
    g = torch.sigmoid(x @ gated.gate_proj.weight.T + gated.gate_proj.bias)  # (B, L, H) or (B, L, D)
    g = g.repeat_interleave(D // H, dim=-1) if gate == "headwise" else g
    expected = (heads * g) @ gated.out_proj.weight.T + gated.out_proj.bias
    torch.testing.assert_close(gated(x, is_causal=True)[0], expected, atol=1e-5, rtol=1e-5)


def test_the_gate_starts_at_bondarenko_et_als_initial_value():
    layer = MultiHeadAttention(D, H, attention=AttentionConfig(gate="headwise"))
    torch.testing.assert_close(torch.sigmoid(layer.gate_proj.bias), torch.full((H,), 0.25))


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("name", NORMALIZATIONS)
def test_kv_cached_decoding_equals_uncached(name, gate):
    torch.manual_seed(0)
    layer = MultiHeadAttention(D, H, attention=AttentionConfig(normalization=name, gate=gate)).eval()
    x = torch.randn(B, L, D)
    full = layer(x, is_causal=True)[0]
    cache = KVCache()
    steps = [layer(x[:, t : t + 1], is_causal=True, cache=cache)[0] for t in range(L)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("name", NORMALIZATIONS)
def test_the_padding_free_path_is_taken_by_softmax_alone(name, gate, monkeypatch):
    calls = []
    original = attention.attention_padding_free
    monkeypatch.setattr(attention, "attention_padding_free", lambda *a, **k: calls.append(1) or original(*a, **k))
    monkeypatch.setitem(attention.PADDING_FREE, "cpu", ("nested",))
    torch.manual_seed(0)
    layer = MultiHeadAttention(D, H, attention=AttentionConfig(normalization=name, gate=gate))
    x = torch.randn(B, L, D)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[1, 3:] = True
    out = layer(x, key_padding_mask=kpm)[0]
    assert len(calls) == (name == "softmax")  # softmax1's zero key, clipped and sigmoid: the masked kernels
    reference = layer(x, key_padding_mask=kpm, need_weights=True)[0]
    torch.testing.assert_close(out[~kpm], reference[~kpm], atol=1e-5, rtol=1e-5)


class TopTwo(nn.Module):
    """A normalisation of one's own: softmax over each query's two largest scores."""

    def forward(self, scores, blocked):
        kth = scores.topk(min(2, scores.size(-1)), dim=-1).values[..., -1:]
        return scores.masked_fill(scores < kth, float("-inf")).softmax(-1)


class Cosine(nn.Module):
    """A similarity of one's own: 10·cos(q, k)."""

    def forward(self, q, k):
        return 10 * nn.functional.normalize(q, dim=-1) @ nn.functional.normalize(k, dim=-1).transpose(-2, -1)


def test_a_class_path_of_ones_own_runs_on_the_reference_path():
    torch.manual_seed(0)
    path = f"{__name__}.TopTwo"
    layer = MultiHeadAttention(D, H, attention=AttentionConfig(normalization=path, similarity=f"{__name__}.Cosine"))
    assert not layer.fused
    x = torch.randn(B, L, D)
    out, weights = layer(x, need_weights=True)
    assert ((weights > 0).sum(-1) == 2).all()  # two keys a query
    torch.testing.assert_close(layer(x)[0], out)
    q, k, _ = layer._project(x, x, x)
    cos = nn.functional.normalize(q, dim=-1) @ nn.functional.normalize(k, dim=-1).transpose(-2, -1)
    top = (10 * cos).topk(2, dim=-1).indices
    assert (weights.gather(-1, top) > 0).all()


class WrongShape(nn.Module):
    def forward(self, scores, blocked):
        return scores.mean(-1)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"normalization": "softmax2"}, "attention.normalization='softmax2' is neither one of softmax, softmax1"),
        ({"normalization": f"{__name__}.Nowhere"}, "has no attribute 'Nowhere'"),
        ({"normalization": f"{__name__}.WrongShape"}, "returned (1, 1, 2) where the logits are (1, 1, 2, 3)"),
        (
            {"similarity": "torch.nn.Identity"},
            "attention.similarity='torch.nn.Identity' failed on a probe call: TypeError",
        ),
        ({"gate": "perhead"}, "attention.gate='perhead' is not known; choose null, headwise or elementwise"),
    ],
)
def test_bad_blocks_are_one_line_naming_the_key(fields, message):
    with pytest.raises(ValueError) as error:
        AttentionConfig(**fields)
    assert message in str(error.value) and "\n" not in str(error.value)


README = Path(__file__).resolve().parents[1] / "README.md"
# the README's own example file: the tests train what the README shows
OWN_MODULE = re.search(r"```python\n# my_attention.py\n(.*?)```", README.read_text(), re.S)[1]
MODALITIES = {
    "vision": ["--config", "configs/vision/digits.yaml"],
    "translation": ["--config", "configs/text/toy_en_de.yaml"],
    "language model": ["--config", "configs/text/shakespeare_char_cpu.yaml", "--data.init_args.block_size=32"],
    "detection": ["--config", "configs/detection/shapes_two_stage.yaml"],
}


@pytest.mark.slow
@pytest.mark.parametrize("modality", MODALITIES)
def test_a_normalization_of_ones_own_from_yaml_trains_in_every_modality(modality, attnlab, tmp_path, monkeypatch):
    """The README's example: a class in the researcher's own file, named in the YAML, trains a step of each model
    (with the gate), and the run folder's summary says which normalisation ran."""
    (tmp_path / "my_attention.py").write_text(OWN_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(ROOT)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question.\n" * 40)
    block = tmp_path / "attention.yaml"
    block.write_text(
        "model:\n  init_args:\n    attention:\n      normalization: {class_path: my_attention.TopK, init_args: {k: 4}}\n"
    )
    args = (
        [*MODALITIES[modality], f"--data.init_args.path={corpus}"]
        if modality == "language model"
        else MODALITIES[modality]
    )
    code, _, err = attnlab(
        "fit",
        *args,
        "--config",
        str(block),
        "--model.init_args.attention.gate=elementwise",
        "--trainer.max_steps=1",
        "--trainer.limit_val_batches=1",
        "--trainer.num_sanity_val_steps=0",
        f"--trainer.default_root_dir={tmp_path / 'run'}",
    )
    assert code == 0, err
    (summary,) = (tmp_path / "run").rglob("summary.json")
    attention = json.loads(summary.read_text())["hparams"]["attention"]
    # held as jsonargparse holds any class: {class_path, init_args}, every argument of the constructor
    topk = {"class_path": "my_attention.TopK", "init_args": {"k": 4, "temperature": 1.0}}
    assert attention["normalization"] == topk and attention["gate"] == "elementwise"
