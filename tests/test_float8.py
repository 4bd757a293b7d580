"""`Float8Training` puts in float8 the linear layers torchao can run (dims multiples of 16) and leaves the output
layers; with ``emulate`` (torchao's fp32 matmuls) it trains on the CPU and its checkpoints load into the model without
it; without a CUDA GPU of compute capability 8.9 it refuses the fit in one line. The oracles are torchao's own
``Float8Linear`` type, the model in full precision, and `ImageClassifier` without the callback."""

import copy
import importlib.util
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from builders import encoder_decoder
from conftest import TINY_TRUNK, TINY_VIT, config_args

from experiments.callbacks import Float8Training
from models.detection.module import ObjectDetector
from models.text.lm_module import LanguageModelModule
from models.vision.module import ImageClassifier

pytest.importorskip("torchao", reason="torchao is not installed: pip install -e '.[dev]' (or '.[fp8]')")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

CPU = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")))


def _vit(**kw) -> ImageClassifier:
    torch.manual_seed(0)
    return ImageClassifier(img_size=8, patch_size=2, in_chans=1, embed_dim=16, depth=1, num_heads=2, **kw)


def _float8(module) -> set[str]:
    return {name for name, m in module.model.named_modules() if isinstance(m, Float8Linear)}


def _converted(module, trainer=CPU, **kw):
    Float8Training(**kw).setup(trainer, module, "fit")
    return _float8(module)


def test_layers_of_dims_multiple_of_16_are_converted_the_others_and_the_heads_are_not():
    # 16 classes: the head's dims would do, it is left as an output layer; an MLP of 24 units: its two layers are not
    assert _converted(_vit(num_classes=16), emulate=True) == {
        "encoder.layers.0.self_attn.out_proj",
        "encoder.layers.0.linear1",
        "encoder.layers.0.linear2",
    }
    assert _converted(_vit(num_classes=16, mlp_ratio=1.5), emulate=True) == {"encoder.layers.0.self_attn.out_proj"}
    lm = LanguageModelModule(vocab_size=32, d_model=16, nhead=2, num_layers=1, max_positions=16)  # lm_head: 32 x 16
    assert _converted(lm, emulate=True) == {"blocks.layers.0.self_attn.out_proj", "blocks.layers.0.linear1"} | {
        "blocks.layers.0.linear2"
    }
    assert lm.model.lm_head.weight is lm.model.tok_embed.embedding.weight  # still tied
    detr = ObjectDetector(
        num_classes=15,  # class_embed 16 x 16 and bbox_embed's hidden layers 16 x 16: heads, left as they are
        backbone=TINY_TRUNK["name"],
        backbone_out_index=TINY_TRUNK["out_index"],
        backbone_norm=TINY_TRUNK["norm"],
        backbone_kwargs={k: TINY_TRUNK[k] for k in ("layers", "channels", "stem_width")},
        num_queries=4,
        **encoder_decoder(16, 2, 1),
    )
    assert {name.split(".")[0] for name in _converted(detr, emulate=True)} == {"transformer"}
    assert len(_float8(detr)) == 7  # encoder: out_proj, linear1, linear2; decoder: two out_proj, linear1, linear2


def test_the_conversion_keeps_the_parameters_and_their_names():
    module = _vit(num_classes=10)
    before = dict(module.state_dict(keep_vars=True))
    _converted(module, emulate=True)
    after = module.state_dict(keep_vars=True)
    assert after.keys() == before.keys()
    assert all(after[k] is v for k, v in before.items())  # the optimizer's and the checkpoint's tensors


def test_an_emulated_float8_step_rounds_like_float8_and_stays_near_full_precision():
    module = _vit(num_classes=10)
    full = copy.deepcopy(module)
    converted = Float8Training(emulate=True)
    converted.setup(CPU, module, "fit")
    images, labels = torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(1)), torch.arange(8)
    losses = []
    for model in (module, full):
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        losses.append(loss.detach())
    assert losses[0] != losses[1]  # e4m3 keeps 3 mantissa bits: the float8 path ran
    torch.testing.assert_close(losses[0], losses[1], rtol=0.05, atol=0)
    for name in converted.converted:
        grad, reference = (m.model.get_submodule(name).weight.grad.flatten() for m in (module, full))
        # e5m2 gradients keep 2 mantissa bits (up to 12.5% off each), e4m3 inputs and weights 3 (6.25%)
        assert F.cosine_similarity(grad, reference, dim=0) > 0.95, name


@pytest.mark.slow  # a fit of two batches through the CLI (2 s in-process)
def test_an_emulated_fit_on_the_cpu_trains_and_its_checkpoint_loads_into_the_model_without_float8(attnlab, tmp_path):
    code, _, err = attnlab(
        "fit",
        *config_args("configs/vision/digits.yaml", tmp_path, *TINY_VIT, "--config", "configs/trainer/fp8.yaml"),
        "--trainer.callbacks.emulate=true",
        "--trainer.max_epochs=1",
        "--trainer.limit_train_batches=2",
        "--trainer.limit_val_batches=1",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.log_every_n_steps=1",
    )
    assert code == 0, err
    path = next(tmp_path.rglob("last.ckpt"))
    assert torch.load(path, weights_only=True)["global_step"] == 2  # plain tensors only; two optimizer steps
    plain = ImageClassifier.load_from_checkpoint(path, weights_only=True)  # strict: the same keys and shapes
    assert not any(isinstance(m, Float8Linear) for m in plain.modules())


def test_without_a_gpu_of_compute_capability_8_9_the_fit_is_refused_in_one_line(attnlab, tmp_path):
    code, _, err = attnlab(
        "fit",
        *config_args("configs/vision/digits.yaml", tmp_path, "--trainer.fast_dev_run=true"),
        "--config",
        "configs/trainer/fp8.yaml",
    )
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        "attnlab: error: trainer.callbacks: Float8Training needs a CUDA GPU of compute capability 8.9 or newer (Ada, "
        "Hopper, Blackwell); this fit runs on the CPU: leave Float8Training out, or set its emulate: true to check the "
        "numerics (fp32 matmuls, slow) (ATTNLAB_DEBUG=1 shows the traceback)"
    )


def test_a_gpu_older_than_compute_capability_8_9_is_named_and_a_newer_one_converts(monkeypatch):
    gpu = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"runs on NVIDIA A100-SXM4-80GB, of compute capability 8\.0: leave"):
        _converted(_vit(num_classes=10), gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100's
    assert len(_converted(_vit(num_classes=10), gpu)) == 3


def test_without_torchao_the_callback_says_how_to_install_it(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find_spec(name, *a)
    )
    with pytest.raises(ValueError, match=r"^trainer.callbacks: Float8Training needs torchao; install it: pip install"):
        Float8Training()
