"""Image-classification DataModules.

`DigitsDataModule`: scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes),
the embedded default that needs no download.
"""
from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset, random_split


def split_lengths(n: int, val_fraction: float, test_fraction: float = 0.0) -> list[int]:
    """Sizes of (train, val[, test]) for ``n`` samples; fractions must leave a non-empty train split."""
    for key, f in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not 0 <= f < 1:
            raise ValueError(f"data.{key}={f} must be in [0, 1)")
    n_val, n_test = round(n * val_fraction), round(n * test_fraction)
    if n - n_val - n_test < 1:
        raise ValueError(f"data.val_fraction={val_fraction} and data.test_fraction={test_fraction} leave no training samples out of {n}")
    return [n - n_val - n_test, n_val] + ([n_test] if test_fraction else [])


class DigitsDataModule(pl.LightningDataModule):
    """scikit-learn's digits, split train/val/test with a fixed seed, standardised with train statistics.

    Linked to the model: ``num_classes`` = 10, ``in_chans`` = 1, ``img_size`` = 8.
    Batches: images (B, 1, 8, 8) float, labels (B,) long.
    """

    num_classes, in_chans, img_size = 10, 1, 8

    def __init__(self, batch_size: int = 64, val_fraction: float = 0.15, test_fraction: float = 0.15, seed: int = 0, num_workers: int = 0):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"data.batch_size={batch_size} must be >= 1")
        self.save_hyperparameters()
        split_lengths(1797, val_fraction, test_fraction)  # refuse bad fractions before training

    def setup(self, stage: str | None = None) -> None:
        if hasattr(self, "train_set"):
            return
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
        labels = torch.tensor(digits.target, dtype=torch.long)
        hp = self.hparams
        lengths = split_lengths(len(labels), hp.val_fraction, hp.test_fraction)
        parts = random_split(range(len(labels)), lengths, generator=torch.Generator().manual_seed(hp.seed))
        idx = [torch.tensor(p.indices) for p in parts] + [torch.tensor([], dtype=torch.long)] * (3 - len(parts))
        mean, std = images[idx[0]].mean(), images[idx[0]].std()
        images = (images - mean) / std
        self.train_set, self.val_set, self.test_set = (TensorDataset(images[i], labels[i]) for i in idx)

    def _loader(self, dataset, shuffle: bool) -> DataLoader:
        hp = self.hparams
        return DataLoader(dataset, batch_size=hp.batch_size, shuffle=shuffle, num_workers=hp.num_workers, persistent_workers=hp.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)
