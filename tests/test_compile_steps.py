"""Each model's training step (``training_step`` on one batch: forward and loss, Lightning's logging stubbed) compiles
with ``fullgraph=True``, so a graph break anywhere in it is an error, and gives the loss and gradients of the same
module run eagerly (fp32), so a wrong lowering is a different number.

Backends, by their time on a shared 2-core CPU (measured 2026-12-02, fresh caches): inductor generates and compiles C++,
25-35 s for the tiny LM's forward and 10 s more for its backward, 12-50 s for each other model's forward; aot_eager
(dynamo's graph and AOTAutograd's forward and backward graphs, run by the eager kernels) 1.5-3 s for the ViT,
translation and LM steps. Dynamo finds graph breaks whatever the backend: those three compile with aot_eager (loss and
gradients), the LM's also with inductor (its loss). The file takes 50-60 s: inductor 30-35 s of it, DETR's test 11-22 s.

DETR's step is not one graph, by design: the Hungarian matching solves each image's assignment with scipy's
``linear_sum_assignment`` on the host (`models.detection.matcher.HungarianMatcher._assign`), a C function dynamo
cannot trace. Its test pins that this is the only break, and compiles with fullgraph=True what
`experiments.callbacks.Compile` compiles: the network."""

import copy

import pytest
import torch
import torch._dynamo as dynamo
from builders import encoder_decoder, padded_batch
from conftest import tiny_detector

from datamodules.text.tokenizers import PAD_ID
from experiments.callbacks import Compile
from models.detection.module import ObjectDetector
from models.text.lm_module import LanguageModelModule
from models.text.translation_module import TranslationModule
from models.vision.module import ImageClassifier

pytestmark = pytest.mark.slow  # dynamo and AOTAutograd trace each step: 1.5-22 s apiece, inductor 35 s


def _vit():
    module = ImageClassifier(img_size=8, patch_size=2, in_chans=1, num_classes=10, embed_dim=16, depth=1, num_heads=2)
    return module, (torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,)))


def _translation():
    module = TranslationModule(
        src_vocab_size=30, tgt_vocab_size=30, pad_id=PAD_ID, **encoder_decoder(16, 2, 1), dropout=0.0
    )
    src, tgt = padded_batch(30, [7, 4]), padded_batch(30, [6, 3], seed=2)  # padding: the masks are in the graph
    return module, {"src": src, "tgt": tgt, "tgt_tokens": int(tgt[:, 1:].ne(PAD_ID).sum())}


def _lm():
    module = LanguageModelModule(vocab_size=30, d_model=16, nhead=2, num_layers=2, dropout=0.0, max_positions=16)
    tokens = torch.randint(0, 30, (2, 11))
    return module, {"input": tokens[:, :-1], "target": tokens[:, 1:]}


def _detr():
    module = ObjectDetector(**tiny_detector(**encoder_decoder(16, 2, 1), dropout=0.0))
    mask = torch.zeros(2, 32, 32, dtype=torch.bool)
    mask[1, :, 24:] = True  # the second image padded on the right
    boxes = torch.tensor([[0.5, 0.5, 0.2, 0.3], [0.3, 0.3, 0.1, 0.1], [0.4, 0.6, 0.2, 0.2]])  # (cx, cy, w, h)
    targets = [{"labels": torch.tensor([0, 2]), "boxes": boxes[:2]}, {"labels": torch.tensor([1]), "boxes": boxes[2:]}]
    return module, (torch.randn(2, 3, 32, 32), mask, targets)


def _twins(build, monkeypatch):
    """Two copies of one freshly built module in training mode, whose ``log`` and ``log_dict`` (the trainer's
    bookkeeping, which needs a trainer) do nothing, and a batch."""
    torch.manual_seed(0)
    module, batch = build()
    module.train()
    twins = module, copy.deepcopy(module)
    for twin in twins:
        monkeypatch.setattr(twin, "log", lambda *args, **kwargs: None)
        monkeypatch.setattr(twin, "log_dict", lambda *args, **kwargs: None)
    dynamo.reset()  # no graph of an earlier test is reused or counted against the recompilation limit
    return twins, batch


def _loss_and_gradients(module, step, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = step(batch)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in module.named_parameters() if p.grad is not None}


def _assert_same(got: tuple, expected: tuple) -> None:
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-6)
    assert got[1].keys() == expected[1].keys()
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("build", [_vit, _translation, _lm], ids=["vit", "translation", "lm"])
def test_a_training_step_compiles_as_one_graph_with_eagers_loss_and_gradients(build, monkeypatch):
    (eager, compiled), batch = _twins(build, monkeypatch)
    step = torch.compile(lambda b: compiled.training_step(b, 0), backend="aot_eager", fullgraph=True)
    got = _loss_and_gradients(compiled, step, batch)
    _assert_same(got, _loss_and_gradients(eager, lambda b: eager.training_step(b, 0), batch))


def test_the_lm_step_compiled_by_inductor_gives_eagers_loss(monkeypatch):
    (eager, compiled), batch = _twins(_lm, monkeypatch)
    step = torch.compile(lambda b: compiled.training_step(b, 0), backend="inductor", fullgraph=True)
    got = step(batch)  # the training graph's forward: inductor compiles the backward at the first backward(), 10 s
    torch.testing.assert_close(got.detach(), eager.training_step(batch, 0).detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace the builtin `scipy")
def test_the_detr_step_breaks_only_at_the_hungarian_assignment_and_its_network_is_one_graph(monkeypatch):
    (eager, compiled), batch = _twins(_detr, monkeypatch)
    explanation = dynamo.explain(lambda b: eager.training_step(b, 0))(batch)
    breaks = {(str(b.reason).splitlines()[0], b.user_stack[-1].name) for b in explanation.break_reasons}
    assert breaks == {("Attempted to call function marked as skipped", "_assign")}, breaks
    assert all("linear_sum_assignment" in str(b.reason) for b in explanation.break_reasons)
    dynamo.reset()
    Compile(fullgraph=True, backend="aot_eager").setup(None, compiled, "fit")
    got = _loss_and_gradients(compiled, lambda b: compiled.training_step(b, 0), batch)
    _assert_same(got, _loss_and_gradients(eager, lambda b: eager.training_step(b, 0), batch))
