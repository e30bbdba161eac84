"""SqueezeNet 1.1.

Architecture facts: 3x3 conv stride 2 (64 channels) + ReLU, then fire modules interleaved with
3x3 stride-2 max pools in ceil mode (pool, fire2, fire3, pool, fire4, fire5, pool, fire6..fire9).
A fire module is a 1x1 squeeze conv + ReLU feeding a 1x1 and a 3x3 (padding 1) expand conv, each + ReLU,
concatenated on channels. Squeeze widths 16, 16, 32, 32, 48, 48, 64, 64, expand widths 4x the squeeze
width per branch. Classifier: (dropout, identity at inference) 1x1 conv to the classes, ReLU, global
average pool. No BatchNorm. ``base_channels`` (16) is the first squeeze width; everything scales with it.

Input ``pixels`` float32 [batch, 3, image, image]; output ``logits`` float32 [batch, classes].
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import ModelSpec, pixels_input

DEFAULT_SIZES = {"image": 224, "batch": 1, "classes": 1000, "base_channels": 16}
TINY_SIZES = {"image": 32, "batch": 1, "classes": 10, "base_channels": 4}
OUTPUT_NAME = "logits"


class Fire(nn.Module):
    def __init__(self, cin: int, squeeze: int, expand: int):
        super().__init__()
        self.squeeze = nn.Conv2d(cin, squeeze, 1)
        self.expand1x1 = nn.Conv2d(squeeze, expand, 1)
        self.expand3x3 = nn.Conv2d(squeeze, expand, 3, padding=1)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.squeeze(x))
        return torch.cat([self.relu(self.expand1x1(x)), self.relu(self.expand3x3(x))], dim=1)


class SqueezeNet(nn.Module):
    """SqueezeNet 1.1: conv stem, eight fire modules, conv classifier, global average pool."""

    def __init__(self, s: dict):
        super().__init__()
        b = s["base_channels"]

        def pool() -> nn.Module:
            return nn.MaxPool2d(3, stride=2, ceil_mode=True)

        self.features = nn.Sequential(
            nn.Conv2d(3, 4 * b, 3, stride=2),
            nn.ReLU(),
            pool(),
            Fire(4 * b, b, 4 * b),
            Fire(8 * b, b, 4 * b),
            pool(),
            Fire(8 * b, 2 * b, 8 * b),
            Fire(16 * b, 2 * b, 8 * b),
            pool(),
            Fire(16 * b, 3 * b, 12 * b),
            Fire(24 * b, 3 * b, 12 * b),
            Fire(24 * b, 4 * b, 16 * b),
            Fire(32 * b, 4 * b, 16 * b),
        )
        self.classifier = nn.Sequential(nn.Conv2d(32 * b, s["classes"], 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.classifier(self.features(pixels)), 1)


MODELS = {"squeezenet": ModelSpec(SqueezeNet, pixels_input, DEFAULT_SIZES, TINY_SIZES, OUTPUT_NAME)}
