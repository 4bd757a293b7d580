"""The kernel hook (``attention.kernel``): softmax attention written out by hand as a kernel of one's own equals the
built-in attention under every model, cache and decoding search, with its weights recorded; the refusals are one
line; differential attention (docs/examples/diff_attention.py, Ye et al. 2024) against the paper's formula computed
by hand, and trained a step through the real CLI in every modality."""

import functools
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from builders import padded_batch, tiny_seq2seq, tiny_vit
from test_detr import tiny_detr
from torch import nn

from datamodules.text.tokenizers import BOS_ID, EOS_ID, PAD_ID
from experiments.callbacks import AttentionSinks, MaxAttentionLogit
from experiments.callbacks.attention_maps import AttentionMapLogger
from models.core.attention import AttentionConfig, MultiHeadAttention
from models.core.capture import capture_attention, kernel_without_weights
from models.text.decoding import beam_search, greedy_decode
from models.text.lm import DecoderOnlyLM

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "diff_attention.py"
V, D, H = 30, 16, 4
IDS = dict(bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID)


def _softmax_by_hand(q, k, blocked):
    """softmax(q kᵀ / √d) over the keys a query may see; all-zero rows where it sees none."""
    logits = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if blocked is None:
        return logits.softmax(-1)
    empty = blocked.all(-1, keepdim=True)
    return logits.masked_fill(blocked, float("-inf")).masked_fill(empty, 0.0).softmax(-1).masked_fill(blocked, 0.0)


class SoftmaxKernel(nn.Module):
    """The built-in attention as a kernel of one's own, returning its weights."""

    def forward(self, q, k, v, blocked):
        weights = _softmax_by_hand(q, k, blocked)
        return weights @ v, weights


class WeightlessKernel(nn.Module):
    """The same, returning the output alone; its ``__init__`` takes the sizes the layer gives."""

    def __init__(self, num_heads: int, head_dim: int, dropout: float = 0.0):
        super().__init__()
        self.sizes = (num_heads, head_dim, dropout)

    def forward(self, q, k, v, blocked):
        return _softmax_by_hand(q, k, blocked) @ v


OWN = AttentionConfig(kernel=f"{__name__}.SoftmaxKernel")
WEIGHTLESS = AttentionConfig(kernel=f"{__name__}.WeightlessKernel")


def _twin(build, attention: AttentionConfig):
    """The model ``build(attention=...)`` makes with the kernel, and with the built-in attention and the same
    weights (the test kernels have none of their own)."""
    torch.manual_seed(0)
    builtin = build(attention=AttentionConfig())
    torch.manual_seed(1)
    own = build(attention=attention)
    own.load_state_dict(builtin.state_dict())
    return own.eval(), builtin.eval()


def _lm(**kw):
    return DecoderOnlyLM(V, d_model=D, nhead=H, num_layers=2, dropout=0.0, max_positions=32, **kw)


@pytest.mark.parametrize("attention", [OWN, WEIGHTLESS], ids=["weights", "no weights"])
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("masks", ["none", "causal", "padded", "bool"])
def test_a_kernel_receives_the_layers_heads_and_mask(attention, cross, masks):
    own, builtin = _twin(lambda attention: MultiHeadAttention(D, H, attention=attention, num_kv_heads=2), attention)
    x, memory = torch.randn(3, 5, D), torch.randn(3, 7, D)
    kv = memory if cross else x
    kpm = torch.zeros(3, kv.size(1), dtype=torch.bool)
    kpm[1, 3:], kpm[2] = True, True  # padding, and a sequence with every key blocked
    kw = {"is_causal": masks == "causal" and not cross, "key_padding_mask": kpm if masks == "padded" else None}
    kw["attn_mask"] = torch.rand(5, kv.size(1)) > 0.6 if masks == "bool" else None
    torch.testing.assert_close(own(x, kv, kv, **kw)[0], builtin(x, kv, kv, **kw)[0], atol=1e-5, rtol=1e-5)
    if attention is OWN:
        torch.testing.assert_close(
            own(x, kv, kv, need_weights=True, **kw)[1], builtin(x, kv, kv, need_weights=True, **kw)[1]
        )
    else:
        assert own.kernel.sizes == (H, D // H, 0.0)


@pytest.mark.parametrize("positions", ["sinusoidal", "rope"])
def test_a_kernel_translates_as_the_built_in_on_both_caches_greedy_and_beam(positions):
    own, builtin = _twin(lambda attention: tiny_seq2seq(V, positions=positions, attention=attention), WEIGHTLESS)
    src, tgt = padded_batch(V, [7, 3, 5]), padded_batch(V, [4, 6, 2], seed=2)
    torch.testing.assert_close(own(src, tgt), builtin(src, tgt), atol=1e-5, rtol=1e-5)
    for search, kw in ((greedy_decode, {}), (beam_search, {"beam_size": 3})):  # beams share one memory row
        for cache in ("dynamic", "static"):
            tokens, scores = search(own, src, max_len=8, cache=cache, **IDS, **kw)
            expected, expected_scores = search(builtin, src, max_len=8, cache=cache, **IDS, **kw)
            assert torch.equal(tokens, expected), (search.__name__, cache)
            torch.testing.assert_close(scores, expected_scores, atol=1e-5, rtol=1e-5)


def test_a_kernel_runs_the_language_model_the_vit_and_detr_as_the_built_in():
    own, builtin = _twin(lambda attention: _lm(positions="rope", num_kv_heads=2, attention=attention), WEIGHTLESS)
    prompt = padded_batch(V, [3, 3], seed=5)
    for cache in ("dynamic", "static"):
        generated = own.generate(prompt, 6, temperature=0, cache=cache)
        assert torch.equal(generated, builtin.generate(prompt, 6, temperature=0, cache=cache))
    own, builtin = _twin(lambda attention: tiny_vit(attention=attention, register_tokens=2), WEIGHTLESS)
    images = torch.randn(2, 1, 8, 8)
    torch.testing.assert_close(own(images), builtin(images), atol=1e-5, rtol=1e-5)
    own, builtin = _twin(lambda attention: tiny_detr(attention=attention), WEIGHTLESS)
    images, mask = torch.randn(2, 3, 64, 48), torch.zeros(2, 64, 48, dtype=torch.bool)
    mask[1, :, 32:] = True
    out, expected = own(images, mask), builtin(images, mask)
    for key in ("pred_logits", "pred_boxes"):
        torch.testing.assert_close(out[key], expected[key], atol=1e-5, rtol=1e-5)


def test_capture_records_a_kernels_weights_and_logits_as_the_built_ins():
    own, builtin = _twin(lambda attention: tiny_seq2seq(V, attention=attention), OWN)
    src, tgt = padded_batch(V, [7, 3, 5]), padded_batch(V, [4, 6, 2], seed=2)
    calls = []
    for model in (own, builtin):
        with capture_attention(model, scores=True) as maps:
            model(src, tgt)
        calls.append(maps)
    assert calls[0].keys() == calls[1].keys()
    for name in calls[0]:
        (ours,), (theirs,) = calls[0][name], calls[1][name]
        for field in ("weights", "logits", "blocked"):
            torch.testing.assert_close(getattr(ours, field), getattr(theirs, field), atol=1e-5, rtol=1e-5)


def test_a_kernel_without_weights_is_refused_where_weights_are_read_and_nowhere_else():
    model = tiny_vit(attention=WEIGHTLESS)
    why = kernel_without_weights(model)
    assert why.startswith(f"attention.kernel={__name__}.WeightlessKernel returns no attention weights")
    assert kernel_without_weights(tiny_vit(attention=OWN)) is None and kernel_without_weights(tiny_vit()) is None
    with pytest.raises(ValueError, match="returns no attention weights"), capture_attention(model):
        pass
    with pytest.raises(ValueError, match="returns no attention weights"):
        model.encoder.layers[0].self_attn(torch.randn(1, 3, 16), need_weights=True)
    for callback in (MaxAttentionLogit(), AttentionSinks(), AttentionMapLogger()):  # an explicit request, at setup
        with pytest.raises(ValueError) as error:
            callback.setup(None, model, "fit")
        assert str(error.value) == f"trainer.callbacks: {type(callback).__name__} reads attention weights; {why}"
    model(torch.randn(2, 1, 8, 8))  # without a capture it runs


class WrongShape(nn.Module):
    def forward(self, q, k, v, blocked):
        return q.mean(-1)


@pytest.mark.parametrize(
    "build, message",
    [
        (
            lambda: _lm(positions="alibi", attention=WEIGHTLESS)(padded_batch(V, [3, 3])),
            f"attention.kernel={__name__}.WeightlessKernel takes boolean masks only; this model gives it a position "
            "bias (ALiBi, T5, relative positions)",
        ),
        (
            lambda: AttentionConfig(kernel=f"{__name__}.SoftmaxKernel", normalization="sigmoid"),
            f"attention.kernel={__name__}.SoftmaxKernel computes the whole attention map; leave similarity and "
            "normalization at scaled_dot and softmax, not normalization='sigmoid'",
        ),
        (
            lambda: AttentionConfig(
                kernel={"class_path": f"{__name__}.WeightlessKernel", "init_args": {"head_dim": 3}}
            ),
            "attention.kernel.init_args.head_dim: set by the attention layer itself; leave it out",
        ),
        (
            lambda: AttentionConfig(kernel={"class_path": f"{__name__}.WeightlessKernel", "init_args": {"dropuot": 0}}),
            f"attention.kernel.init_args.dropuot: not an argument of {__name__}.WeightlessKernel (it takes none)",
        ),
        (
            lambda: MultiHeadAttention(D, H, attention=AttentionConfig(kernel=f"{__name__}.WrongShape")),
            f"attention.kernel={__name__}.WrongShape returned (1, 4, 2); expected out (1, 4, 2, 4) (B, H, Lq, d)",
        ),
        (
            lambda: AttentionConfig(kernel="torch.nn.Nowhere"),
            "attention.kernel='torch.nn.Nowhere' is not the class path of an nn.Module",
        ),
    ],
)
def test_a_kernel_is_refused_in_one_line_where_it_cannot_run(build, message):
    with pytest.raises(ValueError) as error:
        build()
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.fixture
def diff_attention(tmp_path, monkeypatch):
    """docs/examples/diff_attention.py as a researcher's file: copied into tmp_path, which goes on sys.path."""
    shutil.copy(EXAMPLE, tmp_path / "diff_attention.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    import diff_attention

    yield diff_attention
    sys.modules.pop("diff_attention", None)


def _diff_by_hand(kernel, q, k, v, blocked):
    """Ye et al. 2024, one head and one query at a time in float64, over the keys the query may see."""
    lam = math.exp((kernel.lambda_q1 @ kernel.lambda_k1).item()) - math.exp(
        (kernel.lambda_q2 @ kernel.lambda_k2).item()
    )
    lam += kernel.lambda_init
    half = q.size(-1) // 2
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, h, i in ((b, h, i) for b in range(q.size(0)) for h in range(q.size(1)) for i in range(q.size(2))):
        keep = ~blocked[b, 0, i]
        if not keep.any():
            continue
        qi, kk, vv = q[b, h, i].double(), k[b, h][keep].double(), v[b, h][keep].double()
        first = torch.softmax(kk[:, :half] @ qi[:half] / math.sqrt(half), 0)
        second = torch.softmax(kk[:, half:] @ qi[half:] / math.sqrt(half), 0)
        o = (first - lam * second) @ vv
        out[b, h, i] = o / torch.sqrt(o.pow(2).mean() + 1e-5) * kernel.norm.weight.double() * (1 - kernel.lambda_init)
    return out


def test_differential_attention_is_the_papers_formula(diff_attention):
    torch.manual_seed(0)
    kernel = diff_attention.DiffAttention(num_heads=2, head_dim=8, lambda_init=0.3)
    nn.init.normal_(kernel.norm.weight)
    assert kernel.lambda_q1.shape == (4,) and abs(kernel.lambda_full().item() - 0.3) < 0.2  # λq·λk ≈ 0 at the start
    q, k, v = (torch.randn(2, 2, 5, 8, requires_grad=True) for _ in range(3))
    blocked = torch.rand(2, 1, 5, 5) < 0.4
    blocked[0, 0, 3], blocked[1, 0, 0] = True, False  # a row that sees nothing, one that sees everything
    out = kernel(q, k, v, blocked)
    torch.testing.assert_close(out.double(), _diff_by_hand(kernel, q, k, v, blocked), atol=1e-5, rtol=1e-4)
    first, second = kernel.maps(q, k, blocked)
    assert (first.masked_select(blocked) == 0).all() and (second.masked_select(blocked) == 0).all()
    assert (out[0, :, 3] == 0).all()
    grads = torch.autograd.grad(out.pow(2).sum(), (q, k, v, *kernel.parameters()))
    assert all(torch.isfinite(g).all() for g in grads)
    unmasked = _diff_by_hand(kernel, q, k, v, torch.zeros_like(blocked))
    torch.testing.assert_close(kernel(q, k, v, None).double(), unmasked, atol=1e-5, rtol=1e-4)


def test_differential_attention_parameters_are_per_layer_and_load(diff_attention):
    attention = AttentionConfig(
        kernel={"class_path": "diff_attention.DiffAttention", "init_args": {"lambda_init": 0.5}}
    )
    vit = tiny_vit(attention=attention, embed_dim=32, num_heads=4)
    kernels = [m.kernel for m in vit.modules() if isinstance(m, MultiHeadAttention)]
    assert len(kernels) == 2 and kernels[0] is not kernels[1] and kernels[0].lambda_init == 0.5
    assert {"encoder.layers.0.self_attn.kernel.lambda_q1", "encoder.layers.1.self_attn.kernel.norm.weight"} <= set(
        vit.state_dict()
    )
    again = tiny_vit(attention=attention, embed_dim=32, num_heads=4)
    again.load_state_dict(vit.state_dict())
    torch.testing.assert_close(again.encoder.layers[1].self_attn.kernel.lambda_k2, kernels[1].lambda_k2)


MODALITIES = {
    "vision": ["--config", "configs/vision/digits.yaml", "--model.init_args.embed_dim=32"],
    "translation": ["--config", "configs/text/toy_en_de.yaml", "--model.init_args.d_model=32"],
    "language model": [
        "--config",
        "configs/text/shakespeare_char_cpu.yaml",
        "--model.init_args.d_model=32",
        "--model.init_args.num_layers=2",
        "--model.init_args.max_positions=32",
        "--data.init_args.block_size=32",
        "--data.init_args.batch_size=4",
        "--model.init_args.max_new_tokens=8",
        "--trainer.precision=32-true",
    ],
    "detection": ["--config", "configs/detection/shapes.yaml"],
}


@pytest.mark.slow
@pytest.mark.parametrize("modality", MODALITIES)
def test_differential_attention_from_a_file_of_ones_own_trains_a_step_in_every_modality(
    modality, diff_attention, attnlab, tmp_path, monkeypatch
):
    """A kernel class in a file outside attnlab trains one step, then validates (greedy and beam decoding, samples,
    detection drawings) in each model; λ's parameters are in the checkpoint, changed by the step; summary.json says
    why the attention statistics are left out."""
    built = []  # each layer's kernel, with its λ parameters as initialised
    init = diff_attention.DiffAttention.__init__

    @functools.wraps(init)  # the signature that jsonargparse reads
    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append((self, {n: p.detach().clone() for n, p in self.named_parameters() if n.startswith("lambda_")}))

    monkeypatch.setattr(diff_attention.DiffAttention, "__init__", recording_init)
    monkeypatch.chdir(ROOT)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question.\n" * 40)
    data = [f"--data.init_args.path={corpus}"] if modality == "language model" else []
    with pytest.warns(UserWarning, match="attention statistics and attention.png left out") as warned:
        code, _, err = attnlab(
            "fit",
            *MODALITIES[modality],
            *data,
            "--model.init_args.attention.kernel={class_path: diff_attention.DiffAttention, init_args: {lambda_init: 0.5}}",
            "--trainer.max_steps=1",
            "--trainer.check_val_every_n_epoch=1",
            "--trainer.val_check_interval=1",
            "--trainer.limit_val_batches=1",
            "--trainer.num_sanity_val_steps=0",
            f"--trainer.default_root_dir={tmp_path / 'run'}",
        )
    assert code == 0, err
    (checkpoint,) = (tmp_path / "run").rglob("last.ckpt")
    assert list((tmp_path / "run").rglob("best.ckpt"))  # it validated
    if modality == "detection":  # DetectionImages drew the detections, without attention panels
        assert list((tmp_path / "run").rglob("val_images/*.png"))
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    saved = [v for k, v in state.items() if ".kernel.lambda_" in k]
    trained = [p.detach() for kernel, _ in built for n, p in kernel.named_parameters() if n.startswith("lambda_")]
    assert len(built) >= 2 and len(saved) == len(trained) == 4 * len(built)
    assert all(any(torch.equal(s, t) for t in trained) for s in saved)  # the checkpoint holds the trained λ
    unchanged = [
        i
        for i, (kernel, start) in enumerate(built)
        if any(torch.equal(kernel.get_parameter(n), p) for n, p in start.items())
    ]
    # DETR's first decoder self-attention (built third) attends over its values tgt = 0: no output, no gradient
    assert unchanged == ([2] if modality == "detection" else [])
    (summary,) = (tmp_path / "run").rglob("summary.json")
    attention = json.loads(summary.read_text())["attention"]
    assert attention["init"] is None and "DiffAttention returns no attention weights" in attention["left_out"]
    assert len([w for w in warned if "attention statistics" in str(w.message)]) == 1  # one line, once
