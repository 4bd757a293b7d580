"""Variants with arguments: a normalisation or similarity given as a name, a class path or {class_path, init_args};
the built-ins' constants as their constructors' arguments, against their papers' formulas computed by hand here;
softmax1's sink logit on the SDPA path against the reference path; the block as plain data in a checkpoint; one
line for a bad argument; a sweep grid over an init_args field through the real parser."""

import functools
import itertools
import math
import sys
from pathlib import Path

import pytest
import torch
from jsonargparse import ArgumentParser
from torch import nn

from models.core import attend
from models.core.attention import AttentionConfig, MultiHeadAttention
from models.core.kv_cache import KVCache

B, L, D, H = 2, 6, 16, 4
ROOT = Path(__file__).resolve().parents[1]


class TopK(nn.Module):
    """A normalisation of one's own with two arguments: softmax(s / temperature) over each query's k largest."""

    def __init__(self, k: int = 2, temperature: float = 1.0):
        super().__init__()
        self.k, self.temperature = k, temperature

    def forward(self, scores, blocked):
        kth = scores.topk(min(self.k, scores.size(-1)), dim=-1).values[..., -1:]
        return (scores / self.temperature).masked_fill(scores < kth, float("-inf")).softmax(-1)


def _rows(scores: torch.Tensor, visible: torch.Tensor, formula) -> torch.Tensor:
    """``formula(s, n)`` on each query's visible scores s (n of them), in float64; zero elsewhere."""
    out = torch.zeros_like(scores, dtype=torch.float64)
    for index in itertools.product(*map(range, scores.shape[:-1])):
        keep = visible[index]
        if keep.any():
            out[index][keep] = formula(scores[index][keep].double(), int(keep.sum()))
    return out


def _softmax(s):
    return s.exp() / s.exp().sum()


# the papers' formulas with constants other than the defaults
HAND = {
    # Bondarenko et al. 2023: clip((ζ - γ)·softmax + γ, 0, 1) with γ = -α/n
    "clipped alpha": ({"alpha": 4.0}, lambda s, n: ((1 + 4.0 / n) * _softmax(s) - 4.0 / n).clamp(0, 1)),
    "clipped gamma zeta": (
        {"gamma": -0.1, "zeta": 1.3},
        lambda s, n: ((1.3 + 0.1) * _softmax(s) - 0.1).clamp(0, 1),
    ),
    # Ramapuram et al. 2025 with a fixed bias b in place of -log n: σ(s + b)
    "sigmoid bias": ({"bias": -1.5}, lambda s, n: 1 / (1 + torch.exp(-(s - 1.5)))),
    # Miller 2023 with a sink logit b: exp(s_j) / (exp(b) + Σ exp(s_k))
    "softmax1 sink": ({"sink_logit": 2.0}, lambda s, n: s.exp() / (math.exp(2.0) + s.exp().sum())),
}
CLASSES = {"clipped": attend.ClippedSoftmax, "sigmoid": attend.SigmoidAttention, "softmax1": attend.Softmax1}


@pytest.mark.parametrize("case", HAND)
def test_the_built_ins_constants_are_their_papers_constants(case):
    init_args, formula = HAND[case]
    path = f"models.core.attend.{CLASSES[case.split()[0]].__name__}"
    norm = AttentionConfig(normalization={"class_path": path, "init_args": init_args}).build("normalization")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, 8, generator=g) * 2 for _ in range(3))
    blocked = torch.rand(B, 1, L, L, generator=g) < 0.3
    blocked[0, 0, 2] = True  # a row that sees nothing
    _, weights, logits = attend.attention_reference(q, k, v, blocked, 0.5, normalization=norm)
    expected = _rows(logits, ~blocked.expand(B, H, L, L), formula)
    torch.testing.assert_close(weights.double(), expected, atol=1e-6, rtol=1e-5)
    assert (weights[0, :, 2] == 0).all()


def test_the_defaults_stay_the_papers():
    assert (attend.ClippedSoftmax().alpha, attend.ClippedSoftmax().gamma, attend.ClippedSoftmax().zeta) == (12, None, 1)
    assert attend.SigmoidAttention().bias is None and attend.Softmax1().sink_logit == 0.0


@pytest.mark.parametrize("sink_logit", [-1.5, 2.0])
@pytest.mark.parametrize("masks", ["none", "causal", "padded", "padded-causal", "float", "cached"])
def test_softmax1_with_a_sink_logit_keeps_sdpa_equal_to_the_reference(masks, sink_logit, monkeypatch):
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(attend.F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    torch.manual_seed(0)
    spec = {"class_path": "models.core.attend.Softmax1", "init_args": {"sink_logit": sink_logit}}
    layer = MultiHeadAttention(D, H, attention=AttentionConfig(normalization=spec))
    assert layer.fused and layer.normalization.sink_logit == sink_logit
    x = torch.randn(B, L, D, requires_grad=True)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[1, 4:] = True
    kw = {"is_causal": "causal" in masks or masks == "cached", "key_padding_mask": kpm if "padded" in masks else None}
    kw["attn_mask"] = torch.randn(L, L) if masks == "float" else None
    results = []
    for need_weights in (False, True):  # SDPA with the sink key / explicit weights
        if masks == "cached":
            cache = KVCache()
            out = torch.cat(
                [layer(x[:, t : t + 1], cache=cache, need_weights=need_weights, **kw)[0] for t in range(L)], 1
            )
        else:
            out = layer(x, need_weights=need_weights, **kw)[0]
        results.append((out, *torch.autograd.grad(out.pow(2).sum(), (x, *layer.parameters()))))
    assert calls  # the fast path ran
    for fast, reference in zip(*results):
        torch.testing.assert_close(fast, reference, atol=1e-5, rtol=1e-5)


def test_a_variant_is_held_as_plain_data_in_each_form():
    path = f"{__name__}.TopK"
    given = {"class_path": path, "init_args": {"k": 3, "temperature": 0.5}}
    assert AttentionConfig(normalization=given).normalization == given
    assert AttentionConfig(normalization=TopK).normalization == path  # a class given in Python
    assert AttentionConfig(normalization={"class_path": path}).normalization == path
    assert AttentionConfig(normalization=functools.partial(TopK, k=3, temperature=0.5)).normalization == given
    # jsonargparse (the CLI) instantiates {class_path, init_args} of a Callable type into a partial of the class
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(AttentionConfig, "attention")
    parsed = parser.instantiate(parser.parse_object({"attention": {"normalization": given}}))
    assert parsed.attention.normalization == given
    layers = [MultiHeadAttention(D, H, attention={"normalization": given}) for _ in range(2)]
    assert layers[0].normalization is not layers[1].normalization  # one instance a layer
    assert (layers[0].normalization.k, layers[0].normalization.temperature) == (3, 0.5)
    x = torch.randn(B, L, D)
    assert ((layers[0](x, need_weights=True)[1] > 0).sum(-1) == 3).all()


def test_a_checkpoint_with_init_args_reloads_its_variant(tmp_path):
    """The block in a checkpoint's hyper-parameters is plain data (as the CLI saves it); the model built from it has
    the normalisation with those values."""
    import pytorch_lightning as pl

    from models.vision.module import ImageClassifier

    block = {
        "normalization": {"class_path": "models.core.attend.ClippedSoftmax", "init_args": {"alpha": 4.0, "zeta": 1.1}}
    }
    size = dict(img_size=8, patch_size=2, in_chans=1, num_classes=10, embed_dim=16, depth=2, num_heads=2)
    model = ImageClassifier(**size, attention=block)
    path = tmp_path / "model.ckpt"
    hparams = dict(model.hparams)
    torch.save(
        {"state_dict": model.state_dict(), "hyper_parameters": hparams, "pytorch-lightning_version": pl.__version__},
        path,
    )
    loaded = ImageClassifier.load_from_checkpoint(path, weights_only=True)
    norms = [m.normalization for m in loaded.modules() if isinstance(m, MultiHeadAttention)]
    assert len(norms) == 2 and all(isinstance(n, attend.ClippedSoftmax) for n in norms)
    assert all((n.alpha, n.gamma, n.zeta) == (4.0, None, 1.1) for n in norms)
    assert loaded.hparams["attention"] == block


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            {"class_path": f"{__name__}.TopK", "init_args": {"kk": 8}},
            f"attention.normalization.init_args.kk: not an argument of {__name__}.TopK (it takes k, temperature); "
            "did you mean 'k'?",
        ),
        (
            {"class_path": "models.core.attend.ClippedSoftmax", "init_args": {"alpah": 4}},
            "attention.normalization.init_args.alpah: not an argument of models.core.attend.ClippedSoftmax (it takes "
            "alpha, gamma, zeta); did you mean 'alpha'?",
        ),
        (
            {"class_path": f"{__name__}.TopK", "init_args": {"k": "eight"}},
            f"attention.normalization='{__name__}.TopK' failed on a probe call: TypeError",
        ),
        (
            {"class_path": f"{__name__}.TopK", "init_arg": {}},
            "expected a name, a class path or {class_path, init_args}",
        ),
    ],
)
def test_bad_init_args_are_one_line_naming_the_argument_and_the_class(spec, message):
    with pytest.raises(ValueError) as error:
        AttentionConfig(normalization=spec)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.fixture
def own_module(tmp_path, monkeypatch):
    """`my_variants.TopK` in a file outside attnlab, importable from tmp_path."""
    (tmp_path / "my_variants.py").write_text(
        "from torch import nn\n\n\nclass TopK(nn.Module):\n"
        "    def __init__(self, k: int = 2, temperature: float = 1.0):\n"
        "        super().__init__()\n        self.k, self.temperature = k, temperature\n\n"
        "    def forward(self, scores, blocked):\n        return scores.softmax(-1)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(ROOT)
    yield tmp_path
    sys.modules.pop("my_variants", None)


def _printed_block(attnlab, *args) -> dict:
    import yaml

    code, out, err = attnlab("fit", "--config", "configs/vision/digits.yaml", *args, "--print_config")
    assert code == 0, err
    return yaml.safe_load(out)["model"]["init_args"]["attention"]


@pytest.mark.slow
def test_the_cli_takes_a_variant_with_arguments_in_each_form(attnlab, own_module):
    flag = "--model.init_args.attention.normalization"
    topk = {"class_path": "my_variants.TopK", "init_args": {"k": 8, "temperature": 2.0}}
    assert (
        _printed_block(attnlab, f"{flag}={{class_path: my_variants.TopK, init_args: {{k: 8, temperature: 2}}}}")[
            "normalization"
        ]
        == topk
    )
    nested = _printed_block(
        attnlab, f"{flag}=my_variants.TopK", f"{flag}.init_args.k=8", f"{flag}.init_args.temperature=2"
    )
    assert nested["normalization"] == topk
    yaml_file = own_module / "block.yaml"
    yaml_file.write_text(
        "model:\n  init_args:\n    attention:\n"
        "      normalization: {class_path: models.core.attend.ClippedSoftmax, init_args: {alpha: 4}}\n"
    )
    clipped = _printed_block(attnlab, "--config", str(yaml_file), f"{flag}.init_args.zeta=1.1")["normalization"]
    assert clipped == {
        "class_path": "models.core.attend.ClippedSoftmax",
        "init_args": {"alpha": 4.0, "gamma": None, "zeta": 1.1},
    }


@pytest.mark.slow
def test_a_sweep_grid_over_an_init_args_field_parses_and_reaches_each_run(own_module):
    """`attnlab sweep`'s check runs every grid value through the real parser; each run's arguments set k."""
    from experiments.sweep.file import SweepError
    from experiments.sweep.runs import _parse_error, check, load

    sweep_file = own_module / "sweep.yaml"
    sweep_file.write_text(
        "configs: [configs/vision/digits.yaml]\n"
        "overrides: {model.init_args.attention.normalization: {class_path: my_variants.TopK}}\n"
        "grid: {model.init_args.attention.normalization.init_args.k: [2, 8]}\n"
        "seeds: [0]\n"
    )
    sweep = load(sweep_file, root=str(own_module / "runs"))
    check(sweep)
    args = sweep.fit_args(sweep.runs()[1])
    assert "--model.init_args.attention.normalization.init_args.k=8" in args and _parse_error(args) is None
    sweep_file.write_text(sweep_file.read_text().replace("init_args.k:", "init_args.kk:"))
    with pytest.raises(SweepError, match="kk"):
        check(load(sweep_file, root=str(own_module / "runs")))


@pytest.mark.slow
@pytest.mark.parametrize(
    "given, expected",
    [
        (
            ["--model.init_args.attention.normalization={class_path: my_variants.TopK, init_args: {kk: 8}}"],
            "model.init_args.attention.normalization.init_args.kk: not an argument of my_variants.TopK (it takes k, "
            "temperature); did you mean 'k'?",
        ),
        (
            [
                "--model.init_args.attention.normalization=my_variants.TopK",
                "--model.init_args.attention.normalization.init_args.temprature=2",
            ],
            "model.init_args.attention.normalization.init_args.temprature: not an argument of my_variants.TopK (it "
            "takes k, temperature); did you mean 'temperature'?",
        ),
        (
            "normalization: {class_path: models.core.attend.ClippedSoftmax, init_args: {alpha: four}}",
            "model.init_args.attention.normalization.init_args.alpha: expected float, got 'four' "
            "(models.core.attend.ClippedSoftmax takes alpha: float = 12.0, gamma: float | None = None, zeta: float = 1.0)",
        ),
    ],
    ids=["dict", "nested", "yaml"],
)
def test_a_bad_argument_of_a_variant_is_one_line_from_the_cli(attnlab, own_module, given, expected):
    if isinstance(given, str):  # a YAML file's block
        (own_module / "block.yaml").write_text(f"model:\n  init_args:\n    attention:\n      {given}\n")
        given = ["--config", str(own_module / "block.yaml")]
    code, _, err = attnlab("fit", "--config", "configs/vision/digits.yaml", *given, "--print_config")
    lines = [line for line in err.splitlines() if line.startswith("attnlab: error:")]
    assert code == 2 and lines == [f"attnlab: error: {expected}"], err
