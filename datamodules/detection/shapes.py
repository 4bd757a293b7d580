"""The embedded detection default: simple shapes written as a real COCO dataset (JSON + PNG).

Each image has a plain background and 1..``max_objects`` solid circles, squares and triangles
(3 classes) of random size that do not overlap, in a random colour (``palette="random"``: only the
shape tells the class) or a colour from the class's own family (``palette="by_class"``: reddish
circles, greenish squares, bluish triangles, so shape and colour both tell it). The files are generated once,
deterministically from the seed, under ``data_dir`` and read back by the same `CocoDetection` as
real COCO data, so `make demo` and the tests need no download.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from PIL import Image, ImageDraw
from pycocotools.coco import COCO

from datamodules.detection.coco import DetectionDataModule
from datamodules.detection.coco_format import load_coco

SHAPES = ("circle", "square", "triangle")
Palette = Literal["random", "by_class"]


def _colour(rng: random.Random, away_from: tuple[int, ...], family: int | None) -> tuple[int, int, int]:
    """A random colour that differs clearly from the background; with ``family`` = c, channel c dominates."""
    while True:
        c = [rng.randrange(256) for _ in range(3)]
        if family is not None:
            c = [rng.randrange(180, 256) if i == family else rng.randrange(0, 90) for i in range(3)]
        if sum(abs(a - b) for a, b in zip(c, away_from)) > 200:
            return tuple(c)


def _draw_image(
    rng: random.Random, size: int, max_objects: int, min_side: int, max_side: int, palette: str
) -> tuple[Image.Image, list[tuple[int, list[int]]]]:
    """One image and its objects as (category index, [x, y, w, h]) with tight pixel boxes."""
    background = tuple(rng.randrange(256) for _ in range(3)) if palette == "random" else (rng.randrange(256),) * 3
    image = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    objects: list[tuple[int, list[int]]] = []
    for _ in range(rng.randint(1, max_objects)):
        for _attempt in range(50):  # rejection sampling for a free spot with a 2-pixel gap
            side = rng.randint(min_side, max_side)
            x, y = rng.randint(0, size - side), rng.randint(0, size - side)
            if all(
                x + side + 2 <= bx or bx + bw + 2 <= x or y + side + 2 <= by or by + bh + 2 <= y
                for _, (bx, by, bw, bh) in objects
            ):
                break
        else:
            continue
        shape = rng.randrange(len(SHAPES))
        fill, x1, y1 = (
            _colour(rng, background, shape if palette == "by_class" else None),
            x + side - 1,
            y + side - 1,
        )  # PIL corners are inclusive
        if SHAPES[shape] == "circle":
            draw.ellipse([x, y, x1, y1], fill=fill)
        elif SHAPES[shape] == "square":
            draw.rectangle([x, y, x1, y1], fill=fill)
        else:
            draw.polygon([(x, y1), (x1, y1), ((x + x1) / 2, y)], fill=fill)
        objects.append((shape, [x, y, side, side]))
    return image, objects


def generate_shapes(
    root: str | Path,
    split: str,
    num_images: int,
    *,
    image_size: int,
    max_objects: int,
    min_side: int,
    max_side: int,
    seed: int,
    palette: Palette,
) -> Path:
    """Write ``root/<split>/images/*.png`` and ``root/annotations/instances_<split>.json`` (COCO);
    the parameters are `ShapesDataModule`'s, whose defaults are the usual ones.

    Nothing is rewritten when the JSON already records the same parameters. The JSON is written
    last and atomically, so a present JSON means a complete split. Returns the JSON path.
    """
    root = Path(root)
    params = {
        "split": split,
        "num_images": num_images,
        "image_size": image_size,
        "max_objects": max_objects,
        "min_side": min_side,
        "max_side": max_side,
        "seed": seed,
        "palette": palette,
        "shapes": list(SHAPES),
    }
    ann_path = root / "annotations" / f"instances_{split}.json"
    if ann_path.is_file():
        try:
            recorded = json.loads(ann_path.read_text())
        except ValueError:  # not JSON or not UTF-8: a damaged cache, written anew below
            recorded = None
        if (
            isinstance(recorded, dict)
            and isinstance(recorded.get("info"), dict)
            and recorded["info"].get("params") == params
        ):
            return ann_path
    if not 8 <= min_side <= max_side <= image_size:
        raise ValueError(
            f"data: shape sides min_side={min_side}, max_side={max_side} must satisfy 8 <= min <= max <= image_size={image_size}"
        )
    if palette not in ("random", "by_class"):
        raise ValueError(f"data.palette={palette!r} is not known; choose 'random' or 'by_class'")
    image_dir = root / split / "images"
    image_dir.mkdir(parents=True, exist_ok=True)
    ann_path.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"shapes-{split}-{seed}")
    images, annotations = [], []
    for image_id in range(1, num_images + 1):
        image, objects = _draw_image(rng, image_size, max_objects, min_side, max_side, palette)
        file_name = f"{image_id:06d}.png"
        image.save(image_dir / file_name)
        images.append({"id": image_id, "file_name": file_name, "width": image_size, "height": image_size})
        for shape, box in objects:
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": shape + 1,
                    "bbox": box,
                    "area": box[2] * box[3],
                    "iscrowd": 0,
                }
            )
    data = {
        "info": {"description": "attnlab synthetic shapes", "params": params},
        "licenses": [],
        "images": images,
        "annotations": annotations,
        "categories": [{"id": i + 1, "name": n, "supercategory": "shape"} for i, n in enumerate(SHAPES)],
    }
    tmp = ann_path.with_name(f"{ann_path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(ann_path)
    return ann_path


class ShapesDataModule(DetectionDataModule):
    """Generated shapes in COCO format: 3 classes (circle, square, triangle), train/val/test splits.

    Args:
        data_dir: where the dataset is written on first use (and reused after).
        num_train, num_val, num_test: images per split.
        image_size: side of the square images; min_side, max_side: side range of a shape.
        max_objects: objects per image are drawn from 1..max_objects.
        palette: "by_class" (colour family per class) or "random" (only the shape tells the class).
        seed: generation seed (each split has its own stream).
        Others: see `DetectionDataModule`; the defaults here suit 96-pixel images.
    """

    category_ids = [1, 2, 3]
    class_names = list(SHAPES)

    def __init__(
        self,
        data_dir: str = "runs/data/shapes",
        num_train: int = 2000,
        num_val: int = 200,
        num_test: int = 200,
        image_size: int = 64,
        min_side: int = 10,
        max_side: int = 22,
        max_objects: int = 4,
        palette: Palette = "by_class",
        seed: int = 0,
        batch_size: int = 16,
        num_workers: int = 0,
        train_scales: Sequence[int] = (64,),
        max_size: int = 64,
        crop: bool = False,
        crop_resize_scales: Sequence[int] = (64,),
        crop_size: tuple[int, int] = (48, 64),
        val_size: int = 64,
        **kwargs,
    ):
        super().__init__(
            batch_size, num_workers, train_scales, max_size, crop, crop_resize_scales, crop_size, val_size, **kwargs
        )
        if min(num_train, num_val, num_test) < 1:
            raise ValueError(f"data: num_train={num_train}, num_val={num_val}, num_test={num_test} must all be >= 1")
        if not 8 <= min_side <= max_side <= image_size:
            raise ValueError(
                f"data: min_side={min_side}, max_side={max_side} must satisfy 8 <= min_side <= max_side <= image_size={image_size}"
            )
        if palette not in ("random", "by_class"):
            raise ValueError(f"data.palette={palette!r} is not known; choose 'random' or 'by_class'")
        self.data_dir = Path(data_dir)
        self.sizes = {"train": num_train, "val": num_val, "test": num_test}

    def _generate(self, split: str) -> Path:
        hp = self.hparams
        params = {k: hp[k] for k in ("image_size", "max_objects", "min_side", "max_side", "seed", "palette")}
        return generate_shapes(self.data_dir, split, self.sizes[split], **params)

    def prepare_data(self) -> None:
        for split in self.sizes:
            self._generate(split)

    def _split(self, stage: str) -> tuple[Path, COCO, None, str]:
        ann_path = self._generate(stage)  # a no-op after prepare_data; generates when used without a Trainer
        return self.data_dir / stage / "images", load_coco(ann_path), None, str(ann_path)
