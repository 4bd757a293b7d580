"""Detection data: COCO files (read and checked), Pascal VOC read as COCO, the embedded shapes, DETR's transforms."""

# the classes configs name, as ``datamodules.detection.<Class>``
from datamodules.detection.coco import CocoDataModule, DetectionDataModule
from datamodules.detection.shapes import ShapesDataModule
from datamodules.detection.voc import VocDataModule

__all__ = ["CocoDataModule", "DetectionDataModule", "ShapesDataModule", "VocDataModule"]
