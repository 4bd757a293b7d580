"""Pascal VOC XML detection data (JPEGImages/, Annotations/, ImageSets/Main/<split>.txt), read as COCO.

Each split is converted in memory to a COCO instances dict and read by the same `CocoDetection` as
COCO data, so training, COCOeval and prediction are identical. VOC corners are 1-based and
inclusive: a box (xmin, ymin, xmax, ymax) becomes COCO [xmin - 1, ymin - 1, xmax - xmin + 1,
ymax - ymin + 1] (as detectron2 converts VOC). Boxes whose corners span nothing (xmax <= xmin or
ymax <= ymin: BCCD marks two cells by a point) or that lie outside the image are left out and
counted by `coco_from_dict`; ``difficult`` objects
become crowd regions (ignored in training and evaluation, as VOC's own metric ignores them).
A file that cannot be read (not UTF-8, not XML, a missing tag, a value that is not a finite
number) is an error naming the file, the object and the tag.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

from pycocotools.coco import COCO
from pytorch_lightning.utilities import rank_zero_warn

from datamodules.checks import read_lines
from datamodules.detection.coco import DetectionDataModule
from datamodules.detection.coco_format import coco_from_dict


def _text(node: ET.Element, path: str, source: str) -> str:
    found = node.find(path)
    if found is None or found.text is None:
        raise ValueError(f"{source}: <{path}> is missing")
    return found.text.strip()


def _number(node: ET.Element, path: str, source: str) -> float:
    text = _text(node, path, source)
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"{source}: <{path}> is {text!r}; expected a finite number")
    return value


def read_voc_split(root: Path, split: str, class_names: Sequence[str] | None = None) -> tuple[dict, list[str]]:
    """Convert ``root/ImageSets/Main/<split>.txt`` and its XML files to a COCO dict.

    ``class_names`` fixes the label order (category id = position + 1); by default it is the sorted
    names found in the split. Returns (COCO dict, class names).
    """
    split_file = root / "ImageSets" / "Main" / f"{split}.txt"
    if not split_file.is_file():
        raise FileNotFoundError(
            f"data.root: {split_file} does not exist (expected the VOC layout JPEGImages/, Annotations/, ImageSets/Main/)"
        )
    names = [line.split()[0] for line in read_lines(split_file, "data.root") if line.strip()]
    if not names:
        raise ValueError(f"{split_file}: lists no images; expected one image name (without extension) per line")
    records = []
    for name in names:
        xml_path = root / "Annotations" / f"{name}.xml"
        if not xml_path.is_file():
            raise FileNotFoundError(f"{split_file}: image {name!r} has no annotation file {xml_path}")
        try:
            tree = ET.parse(xml_path).getroot()
        except ET.ParseError as err:
            raise ValueError(f"{xml_path}: not valid XML ({err})") from err
        objects = []
        for i, obj in enumerate(tree.findall("object")):
            where = f"{xml_path}: object {i}"
            corners = [_number(obj, f"bndbox/{k}", where) for k in ("xmin", "ymin", "xmax", "ymax")]
            difficult = obj.find("difficult")
            objects.append(
                (_text(obj, "name", where), corners, difficult is not None and (difficult.text or "0").strip() == "1")
            )
        size = tuple(_number(tree, f"size/{k}", str(xml_path)) for k in ("width", "height"))
        if min(size) <= 0:
            raise ValueError(
                f"{xml_path}: <size> is {size[0]:g}x{size[1]:g}; expected a positive width and height in pixels"
            )
        records.append((name, tree.findtext("filename", f"{name}.jpg").strip(), size, objects))
    if class_names is None:
        class_names = sorted({obj[0] for _, _, _, objects in records for obj in objects})
    category_of = {c: i + 1 for i, c in enumerate(class_names)}
    images, annotations = [], []
    for image_id, (name, file_name, (width, height), objects) in enumerate(records, start=1):
        images.append({"id": image_id, "file_name": file_name, "width": int(width), "height": int(height)})
        for obj_name, (x0, y0, x1, y1), difficult in objects:
            if obj_name not in category_of:
                raise ValueError(
                    f"{root / 'Annotations' / name}.xml: class {obj_name!r} is not one of data.class_names {list(class_names)}"
                )
            w, h = (x1 - x0 + 1 if x1 > x0 else 0), (y1 - y0 + 1 if y1 > y0 else 0)  # a point is no object
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": category_of[obj_name],
                    "bbox": [x0 - 1, y0 - 1, w, h],
                    "area": w * h,
                    "iscrowd": int(difficult),
                }
            )
    categories = [{"id": i + 1, "name": c} for i, c in enumerate(class_names)]
    return {"images": images, "annotations": annotations, "categories": categories}, list(class_names)


class VocDataModule(DetectionDataModule):
    """Pascal VOC layout under ``root``; splits named by ImageSets/Main/<name>.txt.

    Args:
        root: the folder holding JPEGImages/, Annotations/, ImageSets/.
        train_split, val_split: split file names. test_split: one more, or None to test on val.
        class_names: label order (default: sorted names of the training split).
        Others: see `DetectionDataModule`.
    """

    def __init__(
        self,
        root: str,
        train_split: str = "train",
        val_split: str = "val",
        test_split: str | None = None,
        class_names: list[str] | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.root = Path(root)
        if not (self.root / "JPEGImages").is_dir():
            raise FileNotFoundError(
                f"data.root: {self.root}/JPEGImages is not a folder (expected the VOC layout JPEGImages/, Annotations/, ImageSets/Main/)"
            )
        self.splits = {"train": train_split, "val": val_split, "test": test_split}
        train, self.class_names = read_voc_split(self.root, train_split, class_names)
        self.category_ids = list(range(1, len(self.class_names) + 1))
        self.coco: dict[str, COCO] = {"train": coco_from_dict(train, self._source("train"))}

    def _source(self, stage: str) -> str:
        return str(self.root / "ImageSets" / "Main" / f"{self.splits[stage]}.txt")

    def _split(self, stage: str) -> tuple[Path, COCO, None, str]:
        if stage == "test" and self.splits["test"] is None:
            rank_zero_warn("data.test_split is not set; `test` and `predict` use the validation split")
            stage = "val"
        if stage not in self.coco:
            data, _ = read_voc_split(self.root, self.splits[stage], self.class_names)
            self.coco[stage] = coco_from_dict(data, self._source(stage))
        return self.root / "JPEGImages", self.coco[stage], None, self._source(stage)
