"""Batches of images of several sizes, packed by a pixel budget (NaViT, Dehghani et al. 2023, "Patch n' Pack").

`ImagePacking` is the ``data.packing`` option of the image DataModules. Each image is resized (timm's transforms:
short side, centre crop) to a side drawn once per image, with the data's seed, from ``sizes`` (NaViT's resolution
sampling, square here), and images are put into a batch in the sampler's order until the next would pass
``max_pixels``. A batch is (a list of N images (C, s_i, s_i), labels (N,)), which the ViT packs into one sequence
(`models.vision.packing`). The budget is in pixels so that the data needs no model setting: a model of patch size p
sees at most ``max_pixels / p²`` patch tokens (plus each image's class token and registers) a step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.data import Dataset, Sampler


@dataclass
class ImagePacking:
    """``data.packing``: ``sizes`` the square sides images are resized to (each a multiple of the model's patch size),
    ``max_pixels`` the budget of a batch (sum of s_i² over its images; at least the largest size's)."""

    sizes: list[int]
    max_pixels: int

    def __post_init__(self) -> None:
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError(f"data.packing.sizes={self.sizes} must list image sides >= 1")
        if self.max_pixels < max(self.sizes) ** 2:
            raise ValueError(
                f"data.packing.max_pixels={self.max_pixels} cannot hold one image of side {max(self.sizes)}; "
                f"give at least {max(self.sizes) ** 2}"
            )

    def draw_sides(self, n: int, seed: int) -> list[int]:
        """The side of each of ``n`` images, drawn uniformly from ``sizes`` with ``seed``."""
        picks = torch.randint(len(self.sizes), (n,), generator=torch.Generator().manual_seed(seed))
        return [self.sizes[i] for i in picks.tolist()]


class SizedImages(Dataset):
    """The samples ``indices`` of a (PIL image, label) source, sample i through ``transforms[sides[i]]``."""

    def __init__(self, source: Dataset, indices: Sequence[int], transforms: dict[int, Callable], sides: list[int]):
        self.source, self.indices, self.transforms, self.sides = source, list(indices), transforms, sides

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        image, label = self.source[self.indices[i]]
        return self.transforms[self.sides[i]](image), label


class EpochOrder(Sampler[int]):
    """0..n-1, shuffled anew each epoch (``set_epoch``, which Lightning calls) with ``seed`` + epoch, or in order."""

    def __init__(self, n: int, shuffle: bool, seed: int):
        self.n, self.shuffle, self.seed, self.epoch = n, shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(self.n))
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist())


class PackedBatches(Sampler[list[int]]):
    """Batches of the indices of ``sampler``, in its order, each holding images until the next would pass
    ``max_pixels`` (``areas``: each image's pixels)."""

    def __init__(self, sampler: EpochOrder, areas: list[int], max_pixels: int):
        self.sampler, self.areas, self.max_pixels = sampler, areas, max_pixels

    def __iter__(self) -> Iterator[list[int]]:
        batch, used = [], 0
        for i in self.sampler:
            if batch and used + self.areas[i] > self.max_pixels:
                yield batch
                batch, used = [], 0
            batch.append(i)
            used += self.areas[i]
        if batch:
            yield batch

    def __len__(self) -> int:
        return sum(1 for _ in self)


def collate_packed(samples: list[tuple[Tensor, int]]) -> tuple[list[Tensor], Tensor]:
    """Samples -> (the images (C, s_i, s_i) as a list, labels (N,))."""
    return [image for image, _ in samples], torch.tensor([label for _, label in samples])


def packed_loader_kwargs(
    packing: ImagePacking,
    source: Dataset,
    indices: Sequence[int],
    transforms: dict[int, Callable],
    shuffle: bool,
    seed: int,
) -> dict:
    """The `DataLoader` arguments (dataset, batch sampler, collate) of the samples ``indices`` of ``source`` packed."""
    sides = packing.draw_sides(len(indices), seed)
    dataset = SizedImages(source, indices, transforms, sides)
    batches = PackedBatches(EpochOrder(len(sides), shuffle, seed), [s * s for s in sides], packing.max_pixels)
    return {"dataset": dataset, "batch_sampler": batches, "collate_fn": collate_packed}
