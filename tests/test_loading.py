"""Every DataModule takes the same loader settings: num_workers, pin_memory, persistent_workers."""

import pytest
import torch
from jsonargparse import ArgumentParser

from datamodules.detection.coco import CocoDataModule
from datamodules.detection.shapes import ShapesDataModule
from datamodules.detection.voc import VocDataModule
from datamodules.text.corpus import TextCorpusDataModule
from datamodules.text.parallel import ParallelTextDataModule
from datamodules.vision.classification import DigitsDataModule, ImageFolderDataModule, TorchvisionDataModule

ALL = [
    DigitsDataModule,
    TorchvisionDataModule,
    ImageFolderDataModule,
    ParallelTextDataModule,
    TextCorpusDataModule,
    CocoDataModule,
    VocDataModule,
    ShapesDataModule,
]


def config_keys(cls) -> dict:
    """The init arguments a config sets, with their defaults, as LightningCLI (jsonargparse) sees them:
    those of the class and those it hands to its base with ``**kwargs``."""
    parser = ArgumentParser()
    parser.add_class_arguments(cls, "data")
    return vars(parser.get_defaults()["data"])


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_every_datamodule_takes_the_loader_settings(cls):
    keys = config_keys(cls)
    assert keys["pin_memory"] is None
    assert keys["persistent_workers"] is True
    assert "num_workers" in keys


def test_settings_reach_the_loaders(tmp_path):
    dm = DigitsDataModule(pin_memory=True, num_workers=0)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert loader.pin_memory is True and loader.persistent_workers is False  # no workers: nothing to keep alive
    assert DigitsDataModule().loader_kwargs["pin_memory"] == torch.cuda.is_available()
    corpus = TextCorpusDataModule(
        cache_dir=str(tmp_path), block_size=8, pin_memory=False, num_workers=1, persistent_workers=False
    )
    corpus.setup("fit")
    loader = corpus.train_dataloader()
    assert (loader.pin_memory, loader.num_workers, loader.persistent_workers) == (False, 1, False)
    shapes = ShapesDataModule(str(tmp_path / "shapes"), num_train=2, num_val=1, num_test=1, num_workers=1)
    assert shapes.loader_kwargs["persistent_workers"] is True


@pytest.mark.parametrize(
    "make", [lambda: DigitsDataModule(num_workers=-1), lambda: ParallelTextDataModule(num_workers=-2)]
)
def test_negative_workers_are_refused_at_construction(make):
    with pytest.raises(ValueError, match="data.num_workers=-"):
        make()


def test_keys_handed_to_the_base_keep_their_order_and_defaults():
    """`--print_config` shows the keys a subclass hands on with ``**kwargs`` where they were, with their defaults."""
    shared = dict(
        num_workers=0,
        pin_memory=None,
        persistent_workers=True,
        val_fraction=0.1,
        seed=0,
        train_subset=None,
        augment=None,
        mixup=None,
        mean=None,
        std=None,
        packing=None,
    )
    keys = config_keys(TorchvisionDataModule)
    assert keys == dict(name="FashionMNIST", root="../shared/data", img_size=None, batch_size=128, **shared)
    assert list(keys) == ["name", "root", "img_size", "batch_size", *shared]
    keys = config_keys(ImageFolderDataModule)
    assert keys == dict(root=None, img_size=224, in_chans=3, batch_size=64, cache_dir="runs/data", **shared)
    detr = dict(
        batch_size=2,
        num_workers=2,
        pin_memory=None,
        persistent_workers=True,
        train_scales=tuple(range(480, 801, 32)),
        max_size=1333,
        crop=True,
        crop_resize_scales=(400, 500, 600),
        crop_size=(384, 600),
        val_size=800,
        hflip=True,
        predict_images=None,
    )
    keys = config_keys(CocoDataModule)
    assert list(keys)[:8] == ["images", "annotations", "val_images", "val_annotations"] + [
        "test_images",
        "test_annotations",
        "val_fraction",
        "seed",
    ]
    assert {k: keys[k] for k in detr} == detr
    assert {k: config_keys(VocDataModule)[k] for k in detr} == detr
    shapes = config_keys(ShapesDataModule)
    assert (shapes["batch_size"], shapes["train_scales"], shapes["crop"], shapes["hflip"]) == (16, (64,), False, True)


def test_hparams_hold_the_keys_handed_to_the_base(tmp_path):
    """Lightning saves the DataModule's arguments in checkpoints; those handed on with ``**kwargs`` count too."""
    shapes = ShapesDataModule(str(tmp_path), num_train=1, num_val=1, num_test=1, hflip=False)
    assert set(config_keys(ShapesDataModule)) == set(shapes.hparams)
    assert (shapes.hparams.hflip, shapes.hparams.batch_size, shapes.hparams.pin_memory) == (False, 16, None)
