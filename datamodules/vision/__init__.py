"""Image-classification data: the embedded digits, torchvision's folders read in place, ImageFolder trees with cached
file lists, and random images for speed runs."""

# the classes configs name, as ``datamodules.vision.<Class>``
from datamodules.vision.classification import DigitsDataModule, ImageDataModule, TorchvisionDataModule
from datamodules.vision.random_images import RandomImagesDataModule

__all__ = ["DigitsDataModule", "ImageDataModule", "RandomImagesDataModule", "TorchvisionDataModule"]
