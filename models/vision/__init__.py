"""Images on the core: `PatchEmbed` and the `VisionTransformer`, weights from files and timm by name, and the
LightningModule `ImageClassifier`."""

# the classes configs name, as ``models.vision.<Class>``
from models.vision.module import ImageClassifier
from models.vision.vit import PatchEmbed, VisionTransformer

__all__ = ["ImageClassifier", "PatchEmbed", "VisionTransformer"]
