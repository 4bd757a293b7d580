"""Detection data: COCO files (read and checked), Pascal VOC read as COCO, the embedded shapes, DETR's transforms."""

import importlib

# the classes configs name, as ``datamodules.detection.<Class>``; each is imported when first asked for
_EXPORTS = {
    "DetectionDataModule": "datamodules.detection.coco",
    "CocoDataModule": "datamodules.detection.coco",
    "VocDataModule": "datamodules.detection.voc",
    "ShapesDataModule": "datamodules.detection.shapes",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
