"""Detection on the core: DETR, its matcher, criterion and box ops, backbone, query selection and denoising, COCO
evaluation, and the LightningModule `ObjectDetector`."""

# the classes configs name, as ``models.detection.<Class>``
from models.detection.detr import DETR
from models.detection.module import ObjectDetector

__all__ = ["DETR", "ObjectDetector"]
