"""Images on the core: `PatchEmbed` and the `VisionTransformer`, weights from files and timm by name, and the
LightningModule `ImageClassifier`."""

import importlib

# the classes configs name, as ``models.vision.<Class>``; each is imported when first asked for
_EXPORTS = {
    "ImageClassifier": "models.vision.module",
    "VisionTransformer": "models.vision.vit",
    "PatchEmbed": "models.vision.vit",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
