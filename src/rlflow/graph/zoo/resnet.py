"""ResNet-18, ResNet-50 and ResNeXt-50 (32x4d), torchvision-equivalent architectures.

Architecture facts:

* Stem: 7x7 conv stride 2 (64 channels), BatchNorm, ReLU, 3x3 max pool stride 2.
* Four stages with 64, 128, 256, 512 base channels (``base_channels`` scales them: c, 2c, 4c, 8c);
  stages 2-4 downsample by stride 2 in their first block; projection shortcut (1x1 conv stride s
  + BatchNorm) whenever the shape changes.
* ResNet-18: basic blocks (3x3 conv, BN, ReLU, 3x3 conv, BN, + shortcut, ReLU), [2, 2, 2, 2] blocks.
* ResNet-50: bottleneck blocks (1x1 reduce, 3x3 with the stride, 1x1 expand x4, BN after each,
  + shortcut, ReLU), [3, 4, 6, 3] blocks.
* ResNeXt-50 32x4d: the ResNet-50 bottleneck with a grouped 3x3 conv, groups 32, 4 channels per group
  per 64 base channels (inner width = base * width_per_group / 64 * groups, i.e. 2x ResNet-50's).
* Global average pool, fully connected layer to 1000 classes.

The last BatchNorm of each residual branch gets a smaller random scale (weight U(0.2, 0.5)), in the
spirit of torchvision's ``zero_init_residual``, so the activation scale grows only mildly with depth.

Input ``pixels`` float32 [batch, 3, image, image]; output ``logits`` float32 [batch, classes].
"""

from __future__ import annotations

import torch
from torch import nn

from rlflow.errors import RLFlowError

from ._common import Init, ModelSpec, pixels_input

_IMAGE = {"image": 224, "batch": 1, "classes": 1000, "base_channels": 64}
_TINY_IMAGE = {"image": 32, "batch": 1, "classes": 10, "base_channels": 8}

DEFAULT_SIZES = {
    "resnet18": dict(_IMAGE),
    "resnet50": dict(_IMAGE),
    "resnext50": dict(_IMAGE, groups=32, width_per_group=4),
}
TINY_SIZES = {
    "resnet18": dict(_TINY_IMAGE),
    "resnet50": dict(_TINY_IMAGE),
    "resnext50": dict(_TINY_IMAGE, base_channels=16, groups=4, width_per_group=8),
}
OUTPUT_NAME = "logits"


def conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1) -> list[nn.Module]:
    return [
        nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
    ]


class ResidualBlock(nn.Module):
    """relu(residual(x) + shortcut(x)); subclasses build ``residual`` (ending in BatchNorm) and ``shortcut``."""

    residual: nn.Sequential
    shortcut: nn.Module

    def init_extra(self, init: Init) -> None:
        init.uniform(self.residual[-1].weight, 0.2, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.residual(x) + self.shortcut(x))


class BasicBlock(ResidualBlock):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int, groups: int = 1, width_per_group: int = 64):
        super().__init__()
        self.residual = nn.Sequential(
            *conv_bn(cin, planes, 3, stride), nn.ReLU(), *conv_bn(planes, planes, 3)
        )
        self.shortcut = shortcut(cin, planes, stride)


class Bottleneck(ResidualBlock):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int, groups: int = 1, width_per_group: int = 64):
        super().__init__()
        width = planes * width_per_group // 64 * groups
        out = planes * self.expansion
        self.residual = nn.Sequential(
            *conv_bn(cin, width, 1),
            nn.ReLU(),
            *conv_bn(width, width, 3, stride, groups),
            nn.ReLU(),
            *conv_bn(width, out, 1),
        )
        self.shortcut = shortcut(cin, out, stride)


def shortcut(cin: int, cout: int, stride: int) -> nn.Module:
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(*conv_bn(cin, cout, 1, stride))


class ResNet(nn.Module):
    """Stem, four stages of residual blocks, global average pool, fc."""

    def __init__(self, block: type, depths: list[int], s: dict, groups: int = 1, width_per_group: int = 64):
        super().__init__()
        base = s["base_channels"]
        if block is Bottleneck and base * width_per_group // 64 * groups < 1:
            raise RLFlowError(
                f"resnet: base_channels {base} x width_per_group {width_per_group} / 64 x groups {groups} "
                "gives no channels"
            )
        self.stem = nn.Sequential(*conv_bn(3, base, 7, 2), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1))
        blocks = []
        cin = base
        for stage, depth in enumerate(depths):
            planes = base * 2**stage
            for i in range(depth):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(block(cin, planes, stride, groups, width_per_group))
                cin = planes * block.expansion
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, s["classes"])

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(pixels))
        return self.fc(torch.flatten(self.pool(x), 1))


def make_resnet18(s: dict) -> nn.Module:
    return ResNet(BasicBlock, [2, 2, 2, 2], s)


def make_resnet50(s: dict) -> nn.Module:
    return ResNet(Bottleneck, [3, 4, 6, 3], s)


def make_resnext50(s: dict) -> nn.Module:
    return ResNet(Bottleneck, [3, 4, 6, 3], s, groups=s["groups"], width_per_group=s["width_per_group"])


MODELS = {
    name: ModelSpec(make, pixels_input, DEFAULT_SIZES[name], TINY_SIZES[name], OUTPUT_NAME)
    for name, make in (
        ("resnet18", make_resnet18),
        ("resnet50", make_resnet50),
        ("resnext50", make_resnext50),
    )
}
