"""Class-token attention, attention rollout (Abnar & Zuidema 2020), rendering, and the callback
that writes maps during validation and `attnlab predict`."""

import pytest
import torch
from builders import tiny_vit
from PIL import Image
from pytorch_lightning.loggers import WandbLogger

from benchmarks.harness import quiet_trainer
from datamodules.vision.classification import DigitsDataModule
from experiments.callbacks.attention_maps import AttentionMapLogger, attention_rollout, cls_attention, render_attention
from models.core.capture import capture_attention
from models.vision.module import ImageClassifier

CLS, P1, P3 = 0, 2, 4  # token indices: the class token, then patches 0..3 of a 2x2 grid


def _attending(targets: dict[int, int], tokens: int = 5, heads: int = 2) -> torch.Tensor:
    """(1, H, L, L) weights where query i attends only to targets.get(i, i)."""
    w = torch.zeros(1, heads, tokens, tokens)
    for i in range(tokens):
        w[0, :, i, targets.get(i, i)] = 1.0
    return w


def test_cls_attention_is_the_class_token_row_over_the_patch_grid():
    w = torch.softmax(torch.randn(2, 3, 5, 5), -1)
    maps = {"encoder.layers.0.self_attn": [torch.zeros_like(w), w]}  # the last call counts
    heads = cls_attention(maps)
    assert heads.shape == (2, 3, 2, 2)
    torch.testing.assert_close(heads.flatten(2), w[:, :, 0, 1:])


def test_rollout_adds_the_residual_and_multiplies_later_layers_on_the_left():
    first = _attending({CLS: P3})  # the class token reads patch 3, patches read themselves
    second = _attending({CLS: P1})
    rollout = attention_rollout({"a": [first], "b": [second]}).flatten(1)[0]  # (4,) over patches
    # A1 = (W1 + I)/2: cls -> 0.5 cls + 0.5 p3; A2: cls -> 0.5 cls + 0.5 p1; A2 @ A1: 0.25 cls + 0.5 p1 + 0.25 p3
    torch.testing.assert_close(rollout, torch.tensor([0.0, 0.5, 0.0, 0.25]))
    swapped = attention_rollout([second, first]).flatten(1)[0]
    torch.testing.assert_close(swapped, torch.tensor([0.0, 0.25, 0.0, 0.5]))


def test_rollout_of_self_attention_only_stays_on_the_class_token():
    rollout = attention_rollout([_attending({}), _attending({})])
    assert rollout.abs().max() == 0


def test_rollout_of_a_real_vit_is_a_distribution_over_patches_and_prefix():
    vit = tiny_vit(depth=3).eval()
    with capture_attention(vit) as maps:
        vit(torch.randn(2, 1, 8, 8))
    for token in ("cls", "mean"):
        rollout = attention_rollout(maps, token=token)
        assert rollout.shape == (2, 4, 4) and rollout.min() >= 0 and (rollout.sum((1, 2)) <= 1 + 1e-6).all()


def test_nothing_captured_or_a_non_square_grid_is_refused():
    with pytest.raises(ValueError, match="no attention weights were captured"):
        attention_rollout({"encoder.layers.0.self_attn": []})
    with pytest.raises(ValueError, match="3 patch tokens after 1 prefix token"):
        cls_attention([torch.rand(1, 1, 4, 4)])


def test_render_writes_a_png_with_one_panel_per_head(tmp_path):
    fig = render_attention(torch.randn(3, 16, 16), torch.rand(4, 4), torch.rand(3, 4, 4), "pred cat, label cat")
    fig.savefig(tmp_path / "a.png", dpi=50)
    assert len(fig.axes) == 2 + 3
    with Image.open(tmp_path / "a.png") as png:
        assert png.width > 3 * png.height  # a row of panels


def test_callback_writes_maps_at_validation_and_logs_them_to_wandb(tmp_path, monkeypatch):
    import wandb

    logged = []
    monkeypatch.setattr(
        WandbLogger, "log_image", lambda self, key, images, step=None, **kw: logged.append((key, images))
    )
    # WandbLogger(offline=True) sets WANDB_MODE for the whole process: set here, it is restored after the test
    monkeypatch.setenv("WANDB_MODE", "offline")
    module = ImageClassifier(num_classes=10, in_chans=1, img_size=8, patch_size=2, embed_dim=16, depth=2, num_heads=2)
    trainer = quiet_trainer(
        max_epochs=2,
        limit_train_batches=1,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
        logger=WandbLogger(save_dir=str(tmp_path), offline=True),
        callbacks=[AttentionMapLogger(num_images=3, every_n_epochs=2)],
    )
    try:
        trainer.fit(module, DigitsDataModule(batch_size=8))
    finally:
        wandb.finish()  # the run it started does not outlive the test
    epochs = sorted(p.name for p in tmp_path.glob("**/attention_maps/epoch_*"))
    assert epochs == ["epoch_0"]  # every 2nd epoch of 2
    assert len(list(tmp_path.glob("**/attention_maps/epoch_0/image_*.png"))) == 3
    assert [key for key, _ in logged] == ["val/attention_maps"] and len(logged[0][1]) == 3


@pytest.mark.slow
def test_predict_writes_maps_on_request_through_the_cli(attnlab, tmp_path):
    cfg = ("--config", "configs/vision/digits.yaml", f"--trainer.default_root_dir={tmp_path}")
    code, _, err = attnlab(
        "fit", *cfg, "--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1"
    )
    assert code == 0, err
    code, out, err = attnlab(
        "predict",
        *cfg,
        "--ckpt_path",
        "last",
        "--trainer.callbacks+=experiments.callbacks.AttentionMapLogger",
        "--trainer.callbacks.num_images=5",
    )
    assert code == 0, err
    assert "attention maps of 5 images written to" in err
    assert len(list(tmp_path.glob("**/attention_maps/predict/image_*.png"))) == 5
