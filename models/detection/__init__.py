"""Detection on the core: DETR, its matcher, criterion and box ops, backbone, query selection and denoising, COCO
evaluation, and the LightningModule `ObjectDetector`."""

import importlib

# the classes configs name, as ``models.detection.<Class>``; each is imported when first asked for
_EXPORTS = {
    "ObjectDetector": "models.detection.module",
    "DETR": "models.detection.detr",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
