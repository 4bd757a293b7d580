"""COCO-format detection data: the dataset, padding collate, and the DataModules' base (`datamodules.detection.coco_format` reads the file).

Layout: an images folder plus an instances JSON (``images``, ``annotations``, ``categories``).
Category ids (COCO's run 1..90 with gaps) map to contiguous labels 0..K-1 in id order and back
(``category_ids[label]``). Targets follow DETR: crowd boxes are left out of training (they stay in
the ground truth, where COCOeval ignores detections on them), boxes are clipped to the image and
those left without area are dropped (from the evaluation ground truth too, where nothing could
match them); images without boxes are kept. What was changed is counted in one warning per file.
Records that cannot be used (missing or unreadable image files, an image whose size differs from
its record, annotations of unknown images or categories, malformed or non-finite numbers, a file
that is not COCO) are refused with an error naming the file and the record.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path

import pytorch_lightning as pl
import torch
from pycocotools.coco import COCO
from pytorch_lightning.utilities import rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from datamodules.checks import check_train_batches, open_image
from datamodules.detection.coco_format import IMAGE_SUFFIXES, clip_box, load_coco
from datamodules.detection.transforms import eval_transforms, train_transforms
from datamodules.loading import loader_settings


class CocoDetection(Dataset):
    """Images of one split with their DETR targets.

    Args:
        images_dir: folder the ``file_name`` of each image record is relative to.
        coco: the checked annotations (`load_coco`); it is also the ground truth for COCOeval.
        image_ids: the images of this split (default: all).
        transforms: a `train_transforms` or `eval_transforms` pipeline.
        source: the annotation file, for messages.
    Items: image (3, H, W) normalised, target dict with ``boxes`` (N, 4) normalised cxcywh,
    ``labels`` (N,), ``area`` (N,), ``image_id`` (), ``orig_size`` and ``size`` (2,) as (h, w).
    Attributes for evaluation: ``coco``, ``category_ids`` (label -> category id), ``class_names``.
    """

    def __init__(
        self,
        images_dir: str | Path,
        coco: COCO,
        image_ids: Sequence[int] | None = None,
        transforms: Callable | None = None,
        source: str = "annotations",
    ):
        self.images_dir, self.coco, self.transforms, self.source = Path(images_dir), coco, transforms, source
        self.image_ids = sorted(coco.imgs) if image_ids is None else list(image_ids)
        self.category_ids = sorted(coco.cats)
        self.class_names = [coco.cats[c]["name"] for c in self.category_ids]
        missing = [
            i for i in self.image_ids if not self.image_path(i).is_file()
        ]  # found now; unreadable files only when read
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
        """Per image: (boxes (N, 4) absolute xyxy, labels (N,)), cleaned as the reference does
        (`coco_from_dict` has left out the boxes without area inside their image)."""
        label_of = {c: i for i, c in enumerate(self.category_ids)}
        counts = {"crowd": 0, "clipped": 0, "empty": 0}
        targets = {}
        for image_id in self.image_ids:
            img = self.coco.imgs[image_id]
            boxes, labels = [], []
            for ann in self.coco.imgToAnns.get(image_id, []):
                if ann.get("iscrowd", 0):
                    counts["crowd"] += 1
                    continue
                x, y, bw, bh = ann["bbox"]
                box = clip_box(ann["bbox"], img["width"], img["height"])
                counts["clipped"] += box != [x, y, x + bw, y + bh]
                boxes.append(box)
                labels.append(label_of[ann["category_id"]])
            counts["empty"] += not boxes
            targets[image_id] = (
                torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
                torch.tensor(labels, dtype=torch.int64),
            )
        notes = {
            "crowd": "crowd boxes left out of training (kept as ignore regions for evaluation)",
            "clipped": "boxes clipped to their image",
            "empty": "images without boxes (kept, all queries learn 'no object')",
        }
        if any(counts.values()):
            rank_zero_warn(f"{self.source}: " + "; ".join(f"{n} {notes[k]}" for k, n in counts.items() if n))
        return targets

    def __len__(self) -> int:
        return len(self.image_ids)

    def __getitem__(self, index: int) -> tuple[Tensor, dict[str, Tensor]]:
        image_id = self.image_ids[index]
        record, path = self.coco.imgs[image_id], self.image_path(image_id)
        image = open_image(path, "RGB")  # grayscale and palette images become 3-channel
        if image.size != (record["width"], record["height"]):  # the boxes are in the record's pixels
            raise ValueError(
                f"{path}: the image is {image.width}x{image.height} pixels but {self.source} records "
                f"{record['width']}x{record['height']} for image id {image_id}; fix the record or the file"
            )
        boxes, labels = self._targets[image_id]
        size = torch.tensor([image.height, image.width])
        target = {
            "boxes": boxes.clone(),
            "labels": labels.clone(),
            "area": (boxes[:, 2:] - boxes[:, :2]).prod(-1),
            "image_id": torch.tensor(image_id),
            "orig_size": size,
            "size": size,
        }
        if self.transforms is not None:
            image, target = self.transforms(image, target)
        return image, target


class ImageFolderDetection(Dataset):
    """Unlabelled images of a folder, for `attnlab predict`; image ids are positions in sorted order."""

    def __init__(
        self,
        folder: str | Path,
        category_ids: list[int],
        class_names: list[str],
        transforms: Callable,
        key: str = "data.predict_images",
    ):
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
        image = open_image(self.paths[index], "RGB")
        size = torch.tensor([image.height, image.width])
        empty = {
            "boxes": torch.zeros(0, 4),
            "labels": torch.zeros(0, dtype=torch.int64),
            "area": torch.zeros(0),
            "image_id": torch.tensor(index),
            "orig_size": size,
            "size": size,
        }
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
        self.save_hyperparameters()  # Lightning collects the arguments of the subclass's __init__ too
        if batch_size < 1:
            raise ValueError(f"data.batch_size={batch_size} must be >= 1")
        if not train_scales or min(train_scales) < 1 or val_size < 1:
            raise ValueError(
                f"data.train_scales={list(train_scales)} and data.val_size={val_size} must be positive sizes"
            )
        if crop and crop_size[0] > crop_size[1]:
            raise ValueError(f"data.crop_size={list(crop_size)} must be (min, max)")
        self.batch_size, self.predict_images = batch_size, predict_images
        self.loader_kwargs = loader_settings(num_workers, pin_memory, persistent_workers)
        self.train_transforms = train_transforms(
            train_scales, max_size, crop, crop_resize_scales, tuple(crop_size), hflip
        )
        self.eval_transforms = eval_transforms(val_size, max_size)
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
                self.datasets[stage] = ImageFolderDetection(
                    self.predict_images, self.category_ids, self.class_names, self.eval_transforms
                )
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
            self.dataset(stage),
            batch_size=self.batch_size,
            shuffle=stage == "train",
            drop_last=False,
            collate_fn=collate_detection,
            **self.loader_kwargs,
        )

    def train_dataloader(self) -> DataLoader:
        dataset = self.dataset("train")
        check_train_batches(len(dataset), self.batch_size, False, dataset.source)
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
        **kwargs,
    ):
        super().__init__(**kwargs)
        for key, folder in (("images", images), ("val_images", val_images), ("test_images", test_images)):
            if folder is not None and not Path(folder).is_dir():
                raise FileNotFoundError(f"data.{key}: {folder} is not a folder")
        for key, pair in (("val", (val_images, val_annotations)), ("test", (test_images, test_annotations))):
            if (pair[0] is None) != (pair[1] is None):
                raise ValueError(f"data.{key}_images and data.{key}_annotations must be given together")
        self.coco = {"train": load_coco(annotations)}
        self.category_ids = sorted(self.coco["train"].cats)
        self.class_names = [self.coco["train"].cats[c]["name"] for c in self.category_ids]
        self.files = {"train": (Path(images), annotations)}
        if val_annotations is None:  # validate on a held-out part of the training images
            self.train_ids, self.val_ids = split_image_ids(list(self.coco["train"].imgs), val_fraction, seed)
            self.coco["val"], self.files["val"] = self.coco["train"], self.files["train"]
        else:
            self.train_ids = self.val_ids = None
            self.coco["val"], self.files["val"] = (
                self._load_matching(val_annotations, "data.val_annotations"),
                (Path(val_images), val_annotations),
            )
        if test_annotations is not None:
            self.coco["test"], self.files["test"] = (
                self._load_matching(test_annotations, "data.test_annotations"),
                (Path(test_images), test_annotations),
            )

    def _load_matching(self, path: str, key: str) -> COCO:
        coco = load_coco(path, key)
        if sorted(coco.cats) != self.category_ids:
            raise ValueError(
                f"{key}: {path} has category ids {sorted(coco.cats)}, the training annotations {self.category_ids}"
            )
        return coco

    def _split(self, stage: str) -> tuple[Path, COCO, list[int] | None, str]:
        if stage == "test" and "test" not in self.coco:
            rank_zero_warn("data: no test_annotations given; `test` and `predict` use the validation split")
            stage = "val"
        images_dir, source = self.files[stage]
        ids = {"train": self.train_ids, "val": self.val_ids}.get(stage)
        return images_dir, self.coco[stage], ids, str(source)
