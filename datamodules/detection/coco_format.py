"""The COCO instances format, read and checked: an instances JSON (``images``, ``annotations``, ``categories``) as a
pycocotools `COCO`, with every record that cannot be used (annotations of unknown images or categories, malformed or
non-finite numbers, a file that is not COCO) refused with an error naming the file and the record.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pycocotools.coco import COCO
from pytorch_lightning.utilities import rank_zero_warn

REQUIRED_KEYS = ("images", "annotations", "categories")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp")


def _quiet(fn: Callable, *args):
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress lines
        return fn(*args)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A finite int or float: not JSON's NaN or Infinity, a boolean, or an integer too large for a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def clip_box(bbox: Sequence[float], width: float, height: float) -> list[float]:
    """COCO [x, y, w, h] -> [x0, y0, x1, y1] clipped to a width x height image; no area left means
    x1 <= x0 or y1 <= y0."""
    x, y, w, h = bbox
    return [min(max(x, 0), width), min(max(y, 0), height), min(max(x + w, 0), width), min(max(y + h, 0), height)]


def _records(data: dict, key: str, source: str, required: Sequence[str]) -> list[dict]:
    """``data[key]``, a list of dicts that each hold the ``required`` keys, with integer ids."""
    if not isinstance(data[key], list):
        raise ValueError(f"{source}: '{key}' must be a list, found {type(data[key]).__name__}")
    for i, record in enumerate(data[key]):
        if not isinstance(record, dict) or any(k not in record for k in required):
            raise ValueError(
                f"{source}: {key}[{i}] = {str(record)[:120]} lacks one of {', '.join(map(repr, required))}"
            )
        if not _is_int(record["id"]):
            raise ValueError(f"{source}: {key}[{i}] has id {record['id']!r}; ids must be integers")
    return data[key]


def coco_from_dict(data: dict[str, Any], source: str) -> COCO:
    """Check a COCO instances dict and index it with pycocotools; ``source`` names it in errors.

    A record that cannot be used is an error naming it (missing keys, wrong types, non-finite or
    non-positive sizes, references to unknown images or categories, repeated ids). Annotations
    without area inside their image (zero or negative width or height, or outside the image) are
    left out of training and of the evaluation ground truth, where no detection could match them;
    one warning counts them. Missing ``area`` (w·h) and ``iscrowd`` (0) are filled in, as COCOeval
    needs them.
    """
    if not isinstance(data, dict) or any(k not in data for k in REQUIRED_KEYS):
        found = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{source}: not a COCO instances file; it needs the keys {list(REQUIRED_KEYS)}, found {found}")
    images, categories = {}, {}
    for i, img in enumerate(_records(data, "images", source, ("id", "file_name", "width", "height"))):
        ref = f"{source}: images[{i}] (id {img['id']})"
        if img["id"] in images:
            raise ValueError(f"{ref} repeats an image id")
        if not isinstance(img["file_name"], str) or not img["file_name"]:
            raise ValueError(f"{ref} has file_name {img['file_name']!r}; expected a file name")
        if not all(_is_number(img[k]) and img[k] > 0 for k in ("width", "height")):
            raise ValueError(
                f"{ref} has width {img['width']!r} and height {img['height']!r}; expected positive numbers of pixels"
            )
        images[img["id"]] = img
    if not images:
        raise ValueError(f"{source}: the file lists no images")
    for i, cat in enumerate(_records(data, "categories", source, ("id", "name"))):
        if cat["id"] in categories:
            raise ValueError(f"{source}: categories[{i}] repeats category id {cat['id']}")
        categories[cat["id"]] = cat
    if not categories:
        raise ValueError(f"{source}: the file has no categories")
    first_index, kept, without_area = {}, [], []
    for i, ann in enumerate(_records(data, "annotations", source, ("id", "image_id", "category_id", "bbox"))):
        ref = f"{source}: annotations[{i}] (id {ann['id']})"
        if ann["id"] in first_index:
            raise ValueError(f"{ref} repeats the id of annotations[{first_index[ann['id']]}]")
        first_index[ann["id"]] = i
        if not _is_int(ann["image_id"]) or ann["image_id"] not in images:
            raise ValueError(f"{ref} refers to image id {ann['image_id']!r}, which is not in 'images'")
        if not _is_int(ann["category_id"]) or ann["category_id"] not in categories:
            raise ValueError(
                f"{ref} refers to category id {ann['category_id']!r}, which is not in 'categories' {sorted(categories)}"
            )
        box = ann["bbox"]
        if not (isinstance(box, list) and len(box) == 4 and all(map(_is_number, box))):
            raise ValueError(f"{ref} has bbox {box!r}; expected [x, y, width, height] (4 finite numbers)")
        if "area" in ann and not (_is_number(ann["area"]) and ann["area"] >= 0):
            raise ValueError(f"{ref} has area {ann['area']!r}; expected a finite number >= 0")
        if ann.get("iscrowd", 0) not in (0, 1):
            raise ValueError(f"{ref} has iscrowd {ann['iscrowd']!r}; expected 0 or 1")
        ann.setdefault("area", float(box[2]) * float(box[3]))
        ann.setdefault("iscrowd", 0)
        # in float32, as training sees the box: a size that rounds to 0 there has no area either
        x0, y0, x1, y1 = np.float32(clip_box(box, images[ann["image_id"]]["width"], images[ann["image_id"]]["height"]))
        if x1 > x0 and y1 > y0:
            kept.append(ann)
        else:
            without_area.append(ann["id"])
    if without_area:
        rank_zero_warn(
            f"{source}: left out {len(without_area)} annotations without area inside their image (zero or negative "
            f"width or height, or outside the image; e.g. annotation id {without_area[0]}): no detection could match them"
        )
    coco = COCO()
    coco.dataset = dict(data, annotations=kept)
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
