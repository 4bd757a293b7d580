"""COCO-format detection data: a checked reader, the dataset, padding collate, and the DataModules' base.

Layout: an images folder plus an instances JSON (``images``, ``annotations``, ``categories``).
Category ids (COCO's run 1..90 with gaps) map to contiguous labels 0..K-1 in id order and back
(``category_ids[label]``). Targets follow DETR: crowd boxes are left out of training (they stay in
the ground truth, where COCOeval ignores detections on them), boxes are clipped to the image and
those left without area are dropped; images without boxes are kept. What was changed is counted in
one warning. Records that cannot be used (missing image files, annotations of unknown images or
categories, malformed boxes, a file that is not COCO) are refused with an error naming the record.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import random
from pathlib import Path
from typing import Any, Callable, Sequence

import pytorch_lightning as pl
import torch
from PIL import Image
from pycocotools.coco import COCO
from pytorch_lightning.utilities import rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from datamodules.detection_transforms import make_transforms
from datamodules.loading import loader_settings

REQUIRED_KEYS = ("images", "annotations", "categories")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp")


def _quiet(fn: Callable, *args):
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress lines
        return fn(*args)


def coco_from_dict(data: dict[str, Any], source: str) -> COCO:
    """Check a COCO instances dict and index it with pycocotools; ``source`` names it in errors.

    Missing ``area`` (w·h) and ``iscrowd`` (0) are filled in, as COCOeval needs them.
    """
    if not isinstance(data, dict) or any(k not in data for k in REQUIRED_KEYS):
        found = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{source}: not a COCO instances file; it needs the keys {list(REQUIRED_KEYS)}, found {found}")
    images, categories = {}, {}
    for i, img in enumerate(data["images"]):
        if not isinstance(img, dict) or any(k not in img for k in ("id", "file_name", "width", "height")):
            raise ValueError(f"{source}: images[{i}] = {str(img)[:120]} lacks one of 'id', 'file_name', 'width', 'height'")
        if img["id"] in images:
            raise ValueError(f"{source}: images[{i}] repeats image id {img['id']}")
        images[img["id"]] = img
    for i, cat in enumerate(data["categories"]):
        if not isinstance(cat, dict) or "id" not in cat or "name" not in cat:
            raise ValueError(f"{source}: categories[{i}] = {str(cat)[:120]} lacks 'id' or 'name'")
        categories[cat["id"]] = cat
    if not categories:
        raise ValueError(f"{source}: the file has no categories")
    for i, ann in enumerate(data["annotations"]):
        ref = f"{source}: annotations[{i}] (id {ann.get('id') if isinstance(ann, dict) else '?'})"
        if not isinstance(ann, dict) or any(k not in ann for k in ("id", "image_id", "category_id", "bbox")):
            raise ValueError(f"{ref} lacks one of 'id', 'image_id', 'category_id', 'bbox'")
        if ann["image_id"] not in images:
            raise ValueError(f"{ref} refers to image id {ann['image_id']}, which is not in 'images'")
        if ann["category_id"] not in categories:
            raise ValueError(f"{ref} refers to category id {ann['category_id']}, which is not in 'categories' {sorted(categories)}")
        box = ann["bbox"]
        if not (isinstance(box, list) and len(box) == 4 and all(isinstance(v, (int, float)) and math.isfinite(v) for v in box)):
            raise ValueError(f"{ref} has bbox {box!r}; expected [x, y, width, height] (4 finite numbers)")
        ann.setdefault("area", float(box[2] * box[3]))
        ann.setdefault("iscrowd", 0)
    coco = COCO()
    coco.dataset = data
    _quiet(coco.createIndex)
    return coco


def load_coco(path: str | Path, key: str = "data.annotations") -> COCO:
    """Read and check an instances JSON (see `coco_from_dict`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{key}: {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{key}: {path} is not valid JSON ({err})") from err
    return coco_from_dict(data, str(path))


class CocoDetection(Dataset):
    """Images of one split with their DETR targets.

    Args:
        images_dir: folder the ``file_name`` of each image record is relative to.
        coco: the checked annotations (`load_coco`); it is also the ground truth for COCOeval.
        image_ids: the images of this split (default: all).
        transforms: a `make_transforms` pipeline.
        source: the annotation file, for messages.
    Items: image (3, H, W) normalised, target dict with ``boxes`` (N, 4) normalised cxcywh,
    ``labels`` (N,), ``area`` (N,), ``image_id`` (), ``orig_size`` and ``size`` (2,) as (h, w).
    Attributes for evaluation: ``coco``, ``category_ids`` (label -> category id), ``class_names``.
    """

    def __init__(self, images_dir: str | Path, coco: COCO, image_ids: Sequence[int] | None = None,
                 transforms: Callable | None = None, source: str = "annotations"):
        self.images_dir, self.coco, self.transforms, self.source = Path(images_dir), coco, transforms, source
        self.image_ids = sorted(coco.imgs) if image_ids is None else list(image_ids)
        self.category_ids = sorted(coco.cats)
        self.class_names = [coco.cats[c]["name"] for c in self.category_ids]
        missing = [i for i in self.image_ids if not self.image_path(i).is_file()]
        if missing:
            first = coco.imgs[missing[0]]
            raise FileNotFoundError(
                f"{source}: {len(missing)} of {len(self.image_ids)} images are missing under {self.images_dir}/, "
                f"e.g. image id {first['id']} file_name {first['file_name']!r}"
            )
        self._targets = self._build_targets()

    def image_path(self, image_id: int) -> Path:
        return self.images_dir / self.coco.imgs[image_id]["file_name"]

    def _build_targets(self) -> dict[int, tuple[Tensor, Tensor]]:
        """Per image: (boxes (N, 4) absolute xyxy, labels (N,)), cleaned as the reference does."""
        label_of = {c: i for i, c in enumerate(self.category_ids)}
        counts = {"crowd": 0, "clipped": 0, "dropped": 0, "empty": 0}
        targets = {}
        for image_id in self.image_ids:
            img = self.coco.imgs[image_id]
            w, h = img["width"], img["height"]
            boxes, labels = [], []
            for ann in self.coco.imgToAnns.get(image_id, []):
                if ann.get("iscrowd", 0):
                    counts["crowd"] += 1
                    continue
                x, y, bw, bh = ann["bbox"]
                box = [min(max(x, 0), w), min(max(y, 0), h), min(max(x + bw, 0), w), min(max(y + bh, 0), h)]
                if box[2] <= box[0] or box[3] <= box[1]:
                    counts["dropped"] += 1
                    continue
                counts["clipped"] += box != [x, y, x + bw, y + bh]
                boxes.append(box)
                labels.append(label_of[ann["category_id"]])
            counts["empty"] += not boxes
            targets[image_id] = (torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4), torch.tensor(labels, dtype=torch.int64))
        notes = {
            "crowd": "crowd boxes left out of training (kept as ignore regions for evaluation)",
            "clipped": "boxes clipped to their image",
            "dropped": "boxes dropped for zero size (after clipping)",
            "empty": "images without boxes (kept, all queries learn 'no object')",
        }
        if any(counts.values()):
            rank_zero_warn(f"{self.source}: " + "; ".join(f"{n} {notes[k]}" for k, n in counts.items() if n))
        return targets

    def __len__(self) -> int:
        return len(self.image_ids)

    def __getitem__(self, index: int) -> tuple[Tensor, dict[str, Tensor]]:
        image_id = self.image_ids[index]
        with Image.open(self.image_path(image_id)) as raw:
            image = raw.convert("RGB")  # grayscale and palette images become 3-channel
        boxes, labels = self._targets[image_id]
        size = torch.tensor([image.height, image.width])
        target = {"boxes": boxes.clone(), "labels": labels.clone(), "area": (boxes[:, 2:] - boxes[:, :2]).prod(-1),
                  "image_id": torch.tensor(image_id), "orig_size": size, "size": size}
        if self.transforms is not None:
            image, target = self.transforms(image, target)
        return image, target


class ImageFolderDetection(Dataset):
    """Unlabelled images of a folder, for `attnlab predict`; image ids are positions in sorted order."""

    def __init__(self, folder: str | Path, category_ids: list[int], class_names: list[str], transforms: Callable, key: str = "data.predict_images"):
        folder = Path(folder)
        if not folder.is_dir():
            raise FileNotFoundError(f"{key}: {folder} is not a folder")
        self.paths = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not self.paths:
            raise ValueError(f"{key}: {folder} holds no images ({', '.join(IMAGE_SUFFIXES)})")
        self.image_ids = list(range(len(self.paths)))
        self.category_ids, self.class_names, self.transforms, self.coco = category_ids, class_names, transforms, None

    def image_path(self, image_id: int) -> Path:
        return self.paths[image_id]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int):
        with Image.open(self.paths[index]) as raw:
            image = raw.convert("RGB")
        size = torch.tensor([image.height, image.width])
        empty = {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64), "area": torch.zeros(0),
                 "image_id": torch.tensor(index), "orig_size": size, "size": size}
        return self.transforms(image, empty)


def collate_detection(batch: list[tuple[Tensor, dict]]) -> tuple[Tensor, Tensor, list[dict[str, Tensor]]]:
    """Pad images to the largest of the batch. Returns images (B, 3, H, W), mask (B, H, W) True at
    padding, and the list of targets."""
    images, targets = zip(*batch)
    h = max(im.shape[1] for im in images)
    w = max(im.shape[2] for im in images)
    padded = images[0].new_zeros(len(images), 3, h, w)
    mask = torch.ones(len(images), h, w, dtype=torch.bool)
    for i, im in enumerate(images):
        padded[i, :, : im.shape[1], : im.shape[2]] = im
        mask[i, : im.shape[1], : im.shape[2]] = False
    return padded, mask, list(targets)


def split_image_ids(image_ids: Sequence[int], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """A seeded random (train, val) split of image ids; both non-empty."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"data.val_fraction={val_fraction} must be in (0, 1) when no validation annotations are given")
    ids = sorted(image_ids)
    random.Random(seed).shuffle(ids)
    n_val = max(1, round(len(ids) * val_fraction))
    if n_val >= len(ids):
        raise ValueError(f"data.val_fraction={val_fraction} leaves no training images out of {len(ids)}")
    return sorted(ids[n_val:]), sorted(ids[:n_val])


class DetectionDataModule(pl.LightningDataModule):
    """Base of the detection DataModules: DETR's transforms, padded batches, loaders.

    Subclasses set ``category_ids`` and ``class_names`` in ``__init__`` (``num_classes`` is linked to
    the model) and implement ``_split(stage)`` -> (images_dir, COCO, image_ids, source) for "train",
    "val" and "test".

    Transform args (DETR's defaults; small images need small ones): ``train_scales`` (shorter side
    choices), ``max_size`` (longer side cap), ``crop`` (the random-crop branch), ``crop_resize_scales``,
    ``crop_size`` (min, max side of the crop), ``val_size``, ``hflip``.
    ``predict_images``: a folder of images for `attnlab predict` (default: the test split).
    ``num_workers``, ``pin_memory``, ``persistent_workers``: loader settings (see `datamodules.loading`).
    Batches: images (B, 3, H, W), mask (B, H, W) True at padding, list of B target dicts.
    """

    category_ids: list[int]
    class_names: list[str]

    def __init__(
        self,
        batch_size: int = 2,
        num_workers: int = 2,
        train_scales: Sequence[int] = tuple(range(480, 801, 32)),
        max_size: int = 1333,
        crop: bool = True,
        crop_resize_scales: Sequence[int] = (400, 500, 600),
        crop_size: tuple[int, int] = (384, 600),
        val_size: int = 800,
        hflip: bool = True,
        predict_images: str | None = None,
        pin_memory: bool | None = None,
        persistent_workers: bool = True,
    ):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"data.batch_size={batch_size} must be >= 1")
        if not train_scales or min(train_scales) < 1 or val_size < 1:
            raise ValueError(f"data.train_scales={list(train_scales)} and data.val_size={val_size} must be positive sizes")
        if crop and crop_size[0] > crop_size[1]:
            raise ValueError(f"data.crop_size={list(crop_size)} must be (min, max)")
        self.batch_size, self.predict_images = batch_size, predict_images
        self.loader_kwargs = loader_settings(num_workers, pin_memory, persistent_workers)
        self.train_transforms = make_transforms(True, train_scales, max_size, crop, crop_resize_scales, tuple(crop_size), val_size, hflip)
        self.eval_transforms = make_transforms(False, val_size=val_size, max_size=max_size)
        self.datasets: dict[str, Dataset] = {}

    @property
    def num_classes(self) -> int:
        return len(self.category_ids)

    def _split(self, stage: str) -> tuple[Path, COCO, list[int], str]:
        raise NotImplementedError

    def dataset(self, stage: str) -> Dataset:
        """The dataset of "train", "val", "test" or "predict", built on first use."""
        if stage not in self.datasets:
            if stage == "predict" and self.predict_images is not None:
                self.datasets[stage] = ImageFolderDetection(self.predict_images, self.category_ids, self.class_names, self.eval_transforms)
            else:
                images_dir, coco, ids, source = self._split("test" if stage == "predict" else stage)
                transforms = self.train_transforms if stage == "train" else self.eval_transforms
                self.datasets[stage] = CocoDetection(images_dir, coco, ids, transforms, source)
        return self.datasets[stage]

    def setup(self, stage: str | None = None) -> None:
        needed = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("predict",)}
        for split in needed.get(stage, ("train", "val", "test")):
            self.dataset(split)

    def _loader(self, stage: str) -> DataLoader:
        return DataLoader(
            self.dataset(stage), batch_size=self.batch_size, shuffle=stage == "train", drop_last=False,
            collate_fn=collate_detection, **self.loader_kwargs,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("predict")


class CocoDataModule(DetectionDataModule):
    """COCO-format data: ``images`` folder + ``annotations`` instances JSON.

    Validation uses ``val_images``/``val_annotations`` when given, else a seeded ``val_fraction`` of
    the training images. Testing uses ``test_images``/``test_annotations`` when given, else the
    validation split (say so when reporting). Other args: see `DetectionDataModule`.
    """

    def __init__(
        self,
        images: str,
        annotations: str,
        val_images: str | None = None,
        val_annotations: str | None = None,
        test_images: str | None = None,
        test_annotations: str | None = None,
        val_fraction: float = 0.1,
        seed: int = 0,
        batch_size: int = 2,
        num_workers: int = 2,
        pin_memory: bool | None = None,
        persistent_workers: bool = True,
        train_scales: Sequence[int] = tuple(range(480, 801, 32)),
        max_size: int = 1333,
        crop: bool = True,
        crop_resize_scales: Sequence[int] = (400, 500, 600),
        crop_size: tuple[int, int] = (384, 600),
        val_size: int = 800,
        hflip: bool = True,
        predict_images: str | None = None,
    ):
        super().__init__(batch_size, num_workers, train_scales, max_size, crop, crop_resize_scales, crop_size, val_size, hflip, predict_images,
                         pin_memory, persistent_workers)
        for key, folder in (("images", images), ("val_images", val_images), ("test_images", test_images)):
            if folder is not None and not Path(folder).is_dir():
                raise FileNotFoundError(f"data.{key}: {folder} is not a folder")
        for key, pair in (("val", (val_images, val_annotations)), ("test", (test_images, test_annotations))):
            if (pair[0] is None) != (pair[1] is None):
                raise ValueError(f"data.{key}_images and data.{key}_annotations must be given together")
        self.save_hyperparameters()
        self.coco = {"train": load_coco(annotations)}
        self.category_ids = sorted(self.coco["train"].cats)
        self.class_names = [self.coco["train"].cats[c]["name"] for c in self.category_ids]
        self.files = {"train": (Path(images), annotations)}
        if val_annotations is None:  # validate on a held-out part of the training images
            self.train_ids, self.val_ids = split_image_ids(list(self.coco["train"].imgs), val_fraction, seed)
            self.coco["val"], self.files["val"] = self.coco["train"], self.files["train"]
        else:
            self.train_ids = self.val_ids = None
            self.coco["val"], self.files["val"] = self._load_matching(val_annotations, "data.val_annotations"), (Path(val_images), val_annotations)
        if test_annotations is not None:
            self.coco["test"], self.files["test"] = self._load_matching(test_annotations, "data.test_annotations"), (Path(test_images), test_annotations)

    def _load_matching(self, path: str, key: str) -> COCO:
        coco = load_coco(path, key)
        if sorted(coco.cats) != self.category_ids:
            raise ValueError(f"{key}: {path} has category ids {sorted(coco.cats)}, the training annotations {self.category_ids}")
        return coco

    def _split(self, stage: str) -> tuple[Path, COCO, list[int] | None, str]:
        if stage == "test" and "test" not in self.coco:
            rank_zero_warn("data: no test_annotations given; `test` and `predict` use the validation split")
            stage = "val"
        images_dir, source = self.files[stage]
        ids = {"train": self.train_ids, "val": self.val_ids}.get(stage)
        return images_dir, self.coco[stage], ids, str(source)
