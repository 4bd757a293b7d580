"""Random images at a real model's input size, for measuring speed where no dataset is at hand (a lent GPU
machine has none): `attnlab fit`'s overhead at ImageNet shapes without ImageNet.

A fixed pool of ``pool_size`` standard-normal images is drawn once from ``seed``; sample i is image
i mod ``pool_size`` with a random label, so a loader's cost is the copying a real loader's collate and
pinning pay for float images, and none of a decoder's. Nothing here is learnable: the loss measures nothing.
Linked to the model: ``num_classes``, ``in_chans``, ``img_size``. Batches: images (B, C, S, S) float32, labels (B,).
"""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from datamodules.loading import loader_settings


class RandomImages(Dataset):
    def __init__(self, pool: Tensor, labels: Tensor):
        self.pool, self.labels = pool, labels  # (P, C, S, S), (N,)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.pool[i % len(self.pool)], self.labels[i]


class RandomImagesDataModule(pl.LightningDataModule):
    def __init__(
        self,
        num_classes: int = 1000,
        img_size: int = 224,
        in_chans: int = 3,
        num_samples: int = 5120,
        pool_size: int = 256,
        batch_size: int = 256,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        persistent_workers: bool = True,
    ):
        super().__init__()
        for key, value in (("num_samples", num_samples), ("pool_size", pool_size), ("batch_size", batch_size)):
            if value < 1:
                raise ValueError(f"data.{key}={value} must be >= 1")
        self.save_hyperparameters()
        self.num_classes, self.img_size, self.in_chans = num_classes, img_size, in_chans
        self.loader_kwargs = loader_settings(num_workers, pin_memory, persistent_workers)

    def setup(self, stage: str | None = None) -> None:
        if hasattr(self, "dataset"):
            return
        hp = self.hparams
        g = torch.Generator().manual_seed(hp.seed)
        pool = torch.randn(min(hp.pool_size, hp.num_samples), hp.in_chans, hp.img_size, hp.img_size, generator=g)
        self.dataset = RandomImages(pool, torch.randint(0, hp.num_classes, (hp.num_samples,), generator=g))

    def _loader(self, shuffle: bool) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.hparams.batch_size, shuffle=shuffle, **self.loader_kwargs)

    def train_dataloader(self) -> DataLoader:
        return self._loader(shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(shuffle=False)
