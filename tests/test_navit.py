"""NaViT packing: images of several sizes in one sequence give what each image gives alone, and the ImageFolder
DataModule packs each image once within its pixel budget."""

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from builders import tiny_vit
from PIL import Image

from datamodules.vision.classification import ImageFolderDataModule
from datamodules.vision.packing import ImagePacking
from models.vision.module import ImageClassifier
from models.vision.vit import VisionTransformer

SIDES = (8, 12, 4, 8)  # patch 2: grids 4x4 (trained), 6x6, 2x2


def _vit(positions: str, class_token: bool, global_pool: str, register_tokens: int = 0) -> VisionTransformer:
    torch.manual_seed(0)
    block = dict(global_pool=global_pool, positions=positions, class_token=class_token, register_tokens=register_tokens)
    vit = tiny_vit(num_classes=5, mlp_ratio=2.0, **block)
    if positions == "learned":  # positions far from their start, so that resampling them matters
        torch.nn.init.normal_(vit.pos_embed, std=1.0)
    return vit


def _loss_and_grads(vit: VisionTransformer, logits: torch.Tensor, labels: torch.Tensor):
    vit.zero_grad()
    loss = F.cross_entropy(logits, labels)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in vit.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "positions, class_token, global_pool, registers",
    [
        ("learned", True, "token", 0),
        ("learned", False, "avg", 0),
        ("sincos2d", True, "token", 0),
        ("sincos2d", True, "avg", 2),
        ("rope_axial", True, "token", 1),
        ("rope_axial", False, "avg", 0),
        ("rope_mixed", True, "avg", 0),
    ],
)
def test_a_packed_batch_gives_each_images_own_logits_loss_and_gradients(positions, class_token, global_pool, registers):
    vit = _vit(positions, class_token, global_pool, registers)
    images = [torch.randn(1, side, side) for side in SIDES]  # float32, as the model trains
    labels = torch.tensor([0, 3, 1, 4])
    # the oracle: each image alone through the unpacked path at its own size
    alone = torch.cat([vit(image[None]) for image in images])
    loss_alone, grads_alone = _loss_and_grads(vit, alone, labels)
    packed = vit.forward_packed(images)
    loss_packed, grads_packed = _loss_and_grads(vit, packed, labels)
    assert packed.shape == (len(SIDES), 5)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss_packed, loss_alone, atol=1e-5, rtol=0)
    assert grads_packed.keys() == grads_alone.keys()
    for name, grad in grads_alone.items():
        torch.testing.assert_close(grads_packed[name], grad, atol=1e-5, rtol=0, msg=name)


def test_images_in_one_pack_do_not_see_each_other():
    vit = _vit("rope_axial", True, "token")
    images = [torch.randn(1, side, side) for side in SIDES]
    changed = [images[0] + 1.0, *images[1:]]
    before, after = vit.forward_packed(images), vit.forward_packed(changed)
    assert not torch.allclose(before[0], after[0])
    torch.testing.assert_close(before[1:], after[1:], atol=1e-6, rtol=0)


def test_relpos_packing_is_refused_in_one_line():
    vit = _vit("relpos", True, "token")
    with pytest.raises(ValueError, match="model.positions=relpos cannot pack images"):
        vit.forward_packed([torch.randn(1, 8, 8)])


def _write_tree(root, sides=(8, 16), per_class=4) -> dict[int, int]:
    """PNGs of two sizes under root/train/<class>/, each of one grey level; returns grey level -> class index."""
    classes, n = {}, 0
    for label, name in enumerate(("a", "b")):
        (root / "train" / name).mkdir(parents=True)
        for j in range(per_class):
            grey = 20 + 25 * n
            side = sides[j % len(sides)]
            Image.new("L", (side, side), color=grey).save(root / "train" / name / f"{j}.png")
            classes[grey], n = label, n + 1
    return classes


def test_packed_batches_hold_each_image_once_within_the_budget(tmp_path):
    classes = _write_tree(tmp_path)
    packing = ImagePacking(sizes=[8, 16], max_pixels=16 * 16 + 8 * 8)
    dm = ImageFolderDataModule(
        str(tmp_path), img_size=8, in_chans=1, val_fraction=0.25, cache_dir=None, packing=packing
    )
    dm.setup()
    seen, mean, std = [], dm.mean[0], dm.std[0]
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        for images, labels in loader:
            assert sum(image.shape[-1] * image.shape[-2] for image in images) <= packing.max_pixels
            assert all(image.shape[0] == 1 and image.shape[-1] == image.shape[-2] in (8, 16) for image in images)
            greys = [round(((image.mean() * std + mean) * 255).item()) for image in images]  # each image's identity
            assert [classes[g] for g in greys] == labels.tolist()
            seen += greys
    assert sorted(seen) == sorted(classes)  # every image once, across train and val
    sides = {image.shape[-1] for images, _ in dm.train_dataloader() for image in images}
    assert sides == {8, 16}  # resized to sides drawn from data.packing.sizes, not kept at one


def test_packing_options_that_cannot_work_are_one_line(tmp_path):
    with pytest.raises(ValueError, match="data.packing.max_pixels=100 cannot hold one image of side 16"):
        ImagePacking(sizes=[8, 16], max_pixels=100)
    _write_tree(tmp_path)
    with pytest.raises(ValueError, match="data.mixup mixes images of one size; unset it with data.packing"):
        ImageFolderDataModule(
            str(tmp_path), img_size=8, packing=ImagePacking([8], 64), mixup={"mixup_alpha": 0.8}, batch_size=2
        )


def test_eval_sizes_with_packed_batches_is_one_line():
    network = dict(img_size=8, in_chans=1, num_classes=2, patch_size=4, embed_dim=16, depth=1, num_heads=2)
    model = ImageClassifier(eval_sizes=[16], **network)
    with pytest.raises(ValueError, match="model.eval_sizes resizes batches of one image size"):
        model.validation_step(([torch.randn(1, 8, 8)], torch.tensor([0])), 0)


def test_image_classifier_trains_a_step_on_packed_batches(tmp_path):
    _write_tree(tmp_path)
    packing = ImagePacking(sizes=[8, 16], max_pixels=16 * 16 + 8 * 8)
    dm = ImageFolderDataModule(
        str(tmp_path), img_size=8, in_chans=1, val_fraction=0.25, cache_dir=None, packing=packing
    )
    model = ImageClassifier(
        img_size=8, in_chans=1, num_classes=2, patch_size=4, embed_dim=16, depth=1, num_heads=2, positions="rope_axial"
    )
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = pl.Trainer(
        fast_dev_run=1, accelerator="cpu", logger=False, enable_checkpointing=False, default_root_dir=tmp_path
    )
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 1
    assert any(not torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert torch.isfinite(torch.tensor(trainer.callback_metrics["val/loss"].item()))


def test_attnlab_fit_reads_data_packing_from_the_command_line(attnlab, tmp_path):
    _write_tree(tmp_path / "tree")
    code, _, err = attnlab(
        "fit",
        "--model=models.vision.ImageClassifier",
        *("--model.patch_size=4", "--model.embed_dim=16", "--model.depth=1", "--model.num_heads=2"),
        "--data=datamodules.vision.classification.ImageFolderDataModule",
        *(f"--data.root={tmp_path / 'tree'}", "--data.img_size=8", "--data.in_chans=1", "--data.cache_dir=null"),
        *("--data.val_fraction=0.25", "--data.packing={sizes: [8, 16], max_pixels: 320}"),
        *("--trainer.fast_dev_run=1", "--trainer.accelerator=cpu", f"--trainer.default_root_dir={tmp_path / 'run'}"),
    )
    assert code == 0, err
