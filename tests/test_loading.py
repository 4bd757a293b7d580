"""Every DataModule takes the same loader settings: num_workers, pin_memory, persistent_workers."""

import inspect

import pytest
import torch

from datamodules.coco import CocoDataModule
from datamodules.synthetic import ShapesDataModule
from datamodules.text import ParallelTextDataModule, TextCorpusDataModule
from datamodules.vision import DigitsDataModule, ImageFolderDataModule, TorchvisionDataModule
from datamodules.voc import VocDataModule

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


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_every_datamodule_takes_the_loader_settings(cls):
    params = inspect.signature(cls).parameters
    assert params["pin_memory"].default is None
    assert params["persistent_workers"].default is True
    assert "num_workers" in params


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
