"""DETR's CNN backbone: a timm ResNet trunk (``features_only``) that returns one feature map.

The reference freezes BatchNorm (statistics and affine terms come from ImageNet pre-training and
batches of 2 images are too small to estimate them) and trains only layer2-layer4 at a 10x lower
learning rate. ImageNet weights come from a local file (``model.backbone_weights``) or, online,
from timm's hub and cache (``model.backbone_pretrained``); otherwise the trunk starts random.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import timm
from huggingface_hub.errors import LocalEntryNotFoundError
from timm.layers import freeze_batch_norm_2d
from torch import Tensor, nn

from models.weights import load_checked, read_state, resolve

BackboneNorm = Literal["frozen_bn", "bn"]
# ResNet stages from the top; ``trainable_layers=k`` trains the first k of them (torchvision's convention)
_RESNET_STAGES = ("layer4", "layer3", "layer2", "layer1", ("conv1", "bn1"))


def load_backbone_weights(body: nn.Module, path: str | Path) -> None:
    """Load a local state dict (a torchvision/timm ResNet checkpoint, optionally under "model" or
    "state_dict") into the trunk; the classifier (``fc.*``) and stages the trunk cut off are ignored."""
    key = "model.backbone_weights"
    expected = "this local file is never downloaded; model.backbone_pretrained=true fetches timm's weights when online"
    state = read_state(resolve(str(path), key, expected, hub_files=None), key)  # a file holding code is refused
    own = body.state_dict()
    load_checked(
        body,
        {k: v for k, v in state.items() if k in own},  # a whole classifier: the trunk is its first stages
        f"{key}: {path}",
        "trunk",
        "is it a checkpoint of this architecture?",
    )


class Backbone(nn.Module):
    """A timm CNN trunk returning the feature map of one stage (`models.detection.detr.build_detr` holds the
    reference's settings as its defaults).

    Args:
        name: timm model name ("resnet50", the reference; "resnet18", ...).
        out_index: which stage's output (timm ``out_indices``): 4 = layer4, stride 32 (reference);
            3 = layer3, stride 16, for small images.
        norm: "frozen_bn" (reference: fixed statistics and affine terms) or "bn" (trainable
            BatchNorm, for training from scratch where there are no statistics to freeze).
        trainable_layers: how many ResNet stages, from the top, are trained (reference 3:
            layer2-4; 5 = all, 0 = frozen trunk).
        weights: path to a local state dict, loaded before BatchNorm is frozen.
        pretrained: timm's default ImageNet weights for ``name``, through timm's hub and cache (the
            Hugging Face cache): downloaded once when online, read from the cache offline.
        **timm_kwargs: passed to ``timm.create_model`` (e.g. ``layers``, ``channels``, ``stem_width``
            for a narrower ResNet).
    Shapes: images (B, 3, H, W) -> features (B, num_channels, H / stride, W / stride).
    """

    def __init__(
        self,
        name: str,
        out_index: int,
        norm: BackboneNorm,
        trainable_layers: int,
        weights: str | None = None,
        pretrained: bool = False,
        **timm_kwargs: Any,
    ):
        super().__init__()
        if norm not in ("frozen_bn", "bn"):
            raise ValueError(f"model.backbone_norm={norm!r} is not known; choose 'frozen_bn' or 'bn'")
        if not 0 <= trainable_layers <= len(_RESNET_STAGES):
            raise ValueError(f"model.trainable_backbone_layers={trainable_layers} must be in 0..{len(_RESNET_STAGES)}")
        if pretrained and weights is not None:
            raise ValueError(
                f"model.backbone_pretrained=true and model.backbone_weights={weights}: give one source of trunk weights"
            )
        try:
            body = timm.create_model(
                name, pretrained=pretrained, features_only=True, out_indices=(out_index,), **timm_kwargs
            )
        except LocalEntryNotFoundError:
            raise ValueError(
                f"model.backbone_pretrained=true: timm's weights for {name!r} are not in the Hugging Face cache and the hub "
                "cannot be reached (offline); give a local file instead: model.backbone_weights=PATH"
            ) from None
        except (RuntimeError, IndexError) as err:
            raise ValueError(f"model.backbone={name!r} with out_index={out_index}: {err}") from err
        if weights is not None:
            load_backbone_weights(body, weights)
        self.body = freeze_batch_norm_2d(body) if norm == "frozen_bn" else body
        self.num_channels = self.body.feature_info.channels()[-1]
        self.stride = self.body.feature_info.reduction()[-1]
        trainable = tuple(
            p for stage in _RESNET_STAGES[:trainable_layers] for p in ((stage,) if isinstance(stage, str) else stage)
        )
        for pname, p in self.body.named_parameters():
            p.requires_grad_(trainable_layers == len(_RESNET_STAGES) or pname.startswith(trainable))

    def forward(self, images: Tensor) -> Tensor:
        return self.body(images)[-1]
