"""DETR's joint image + target transforms (facebookresearch/detr ``datasets/transforms.py``).

A sample is (PIL image, target) with target["boxes"] (N, 4) absolute xyxy pixels, "labels" (N,),
"area" (N,), "size" (2,) = (h, w). `Normalize` ends every pipeline: the image
becomes a normalised tensor and the boxes normalised cxcywh, what DETR predicts.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch
import torchvision.transforms.functional as TF
from PIL import Image
from torch import Tensor

Target = dict[str, Tensor]
Sample = tuple[Image.Image, Target]
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def crop(image: Image.Image, target: Target, region: tuple[int, int, int, int]) -> Sample:
    """Crop to (top, left, height, width); boxes are clipped and those cut away entirely are dropped."""
    top, left, h, w = region
    image = TF.crop(image, top, left, h, w)
    target = dict(target, size=torch.tensor([h, w]))
    boxes = target["boxes"] - torch.as_tensor([left, top, left, top], dtype=torch.float32)
    boxes = torch.min(boxes.reshape(-1, 2, 2), torch.as_tensor([w, h], dtype=torch.float32)).clamp(
        min=0
    )  # (N, 2 corners, 2)
    keep = torch.all(boxes[:, 1, :] > boxes[:, 0, :], dim=1)  # a box that lost all its area is gone
    target["boxes"] = boxes.reshape(-1, 4)
    target["area"] = (boxes[:, 1, :] - boxes[:, 0, :]).prod(dim=1)
    for field in ("boxes", "labels", "area"):
        target[field] = target[field][keep]
    return image, target


def hflip(image: Image.Image, target: Target) -> Sample:
    w = image.width
    boxes = target["boxes"][:, [2, 1, 0, 3]] * torch.as_tensor([-1, 1, -1, 1]) + torch.as_tensor([w, 0, w, 0])
    return TF.hflip(image), dict(target, boxes=boxes)


def size_with_aspect_ratio(image_size: tuple[int, int], size: int, max_size: int | None) -> tuple[int, int]:
    """(h, w) with the shorter side = ``size``, unless the longer side would exceed ``max_size``."""
    w, h = image_size
    if max_size is not None:
        short, long = float(min(w, h)), float(max(w, h))
        if long / short * size > max_size:
            size = int(round(max_size * short / long))
    if (w <= h and w == size) or (h <= w and h == size):
        return h, w
    if w < h:
        return int(size * h / w), size
    return size, int(size * w / h)


def resize(image: Image.Image, target: Target, size: int, max_size: int | None) -> Sample:
    h, w = size_with_aspect_ratio(image.size, size, max_size)
    resized = TF.resize(image, [h, w])
    ratio_w, ratio_h = resized.width / image.width, resized.height / image.height
    target = dict(target, size=torch.tensor([h, w]))
    target["boxes"] = target["boxes"] * torch.as_tensor([ratio_w, ratio_h, ratio_w, ratio_h])
    target["area"] = target["area"] * (ratio_w * ratio_h)
    return resized, target


class Compose:
    def __init__(self, transforms: Sequence[Callable[[Image.Image, Target], Sample]]):
        self.transforms = list(transforms)

    def __call__(self, image, target):
        for t in self.transforms:
            image, target = t(image, target)
        return image, target


class RandomHorizontalFlip:
    def __init__(self, p: float = 0.5):
        self.p = p

    def __call__(self, image, target):
        return hflip(image, target) if random.random() < self.p else (image, target)


class RandomResize:
    """Resize the shorter side to a size drawn from ``sizes``, the longer side at most ``max_size``."""

    def __init__(self, sizes: Sequence[int], max_size: int | None = None):
        self.sizes, self.max_size = list(sizes), max_size

    def __call__(self, image, target):
        return resize(image, target, random.choice(self.sizes), self.max_size)


class RandomSizeCrop:
    """Crop a random region whose sides lie in [min_size, max_size] (and within the image)."""

    def __init__(self, min_size: int, max_size: int):
        self.min_size, self.max_size = min_size, max_size

    def __call__(self, image, target):
        w = random.randint(min(image.width, self.min_size), min(image.width, self.max_size))
        h = random.randint(min(image.height, self.min_size), min(image.height, self.max_size))
        top, left = random.randint(0, image.height - h), random.randint(0, image.width - w)
        return crop(image, target, (top, left, h, w))


class RandomSelect:
    """Apply ``first`` with probability p, else ``second``."""

    def __init__(self, first, second, p: float = 0.5):
        self.first, self.second, self.p = first, second, p

    def __call__(self, image, target):
        return self.first(image, target) if random.random() < self.p else self.second(image, target)


class Normalize:
    """PIL image -> normalised (3, H, W) tensor; xyxy pixel boxes -> cxcywh in [0, 1]."""

    def __init__(self, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD):
        self.mean, self.std = list(mean), list(std)

    def __call__(self, image, target):
        tensor = TF.normalize(TF.to_tensor(image), self.mean, self.std)
        h, w = tensor.shape[-2:]
        x0, y0, x1, y1 = target["boxes"].unbind(-1)
        boxes = torch.stack(((x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0), dim=-1) / torch.tensor(
            [w, h, w, h], dtype=torch.float32
        )
        return tensor, dict(target, boxes=boxes)


def eval_transforms(val_size: int, max_size: int) -> Compose:
    """DETR's evaluation pipeline: shorter side ``val_size``, longer side <= ``max_size``."""
    return Compose([RandomResize([val_size], max_size), Normalize()])


def train_transforms(
    scales: Sequence[int],
    max_size: int,
    crop: bool,
    crop_resize_scales: Sequence[int],
    crop_size: tuple[int, int],
    hflip: bool,
) -> Compose:
    """DETR's COCO training pipeline: horizontal flip, then with probability 0.5 either a
    multi-scale resize (shorter side in ``scales``, longer side <= ``max_size``) or a resize to
    ``crop_resize_scales``, a random crop of side ``crop_size`` and the multi-scale resize.
    The reference's values are the defaults of `datamodules.detection.DetectionDataModule`.
    """
    multi_scale = RandomResize(scales, max_size)
    steps = [RandomHorizontalFlip()] if hflip else []
    if crop:
        steps.append(
            RandomSelect(
                multi_scale, Compose([RandomResize(crop_resize_scales), RandomSizeCrop(*crop_size), multi_scale])
            )
        )
    else:
        steps.append(multi_scale)
    return Compose(steps + [Normalize()])
