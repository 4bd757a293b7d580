"""Image-classification data: the embedded digits, torchvision's folders read in place, ImageFolder trees with cached
file lists, and random images for speed runs."""

import importlib

# the classes configs name, as ``datamodules.vision.<Class>``; each is imported when first asked for
_EXPORTS = {
    "DigitsDataModule": "datamodules.vision.classification",
    "ImageDataModule": "datamodules.vision.classification",
    "TorchvisionDataModule": "datamodules.vision.classification",
    "RandomImagesDataModule": "datamodules.vision.random_images",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
