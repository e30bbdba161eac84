"""Inception-v3 at inference (no auxiliary classifier), 299x299 input.

Architecture facts (channel counts at ``width`` 1.0; every conv is conv (no bias) + BatchNorm
(eps 1e-3) + ReLU):

* Stem: 3x3/2 32, 3x3 32, 3x3 pad 1 64, 3x3/2 max pool, 1x1 80, 3x3 192, 3x3/2 max pool (35x35x192).
* 3x Inception A (35x35; pool features 32, 64, 64): 1x1 64 | 1x1 48 -> 5x5 64 |
  1x1 64 -> 3x3 96 -> 3x3 96 | 3x3 avg pool -> 1x1 pool features.
* Inception B (grid reduction to 17x17): 3x3/2 384 | 1x1 64 -> 3x3 96 -> 3x3/2 96 | 3x3/2 max pool.
* 4x Inception C (17x17, 7x7 factorised into 1x7 and 7x1; c7 = 128, 160, 160, 192): 1x1 192 |
  1x1 c7 -> 1x7 c7 -> 7x1 192 | 1x1 c7 -> 7x1 c7 -> 1x7 c7 -> 7x1 c7 -> 1x7 192 | avg pool -> 1x1 192.
* Inception D (grid reduction to 8x8): 1x1 192 -> 3x3/2 320 | 1x1 192 -> 1x7 192 -> 7x1 192 -> 3x3/2 192 |
  3x3/2 max pool.
* 2x Inception E (8x8, 3x3 split into parallel 1x3 and 3x1): 1x1 320 | 1x1 384 -> (1x3 384, 3x1 384) |
  1x1 448 -> 3x3 384 -> (1x3 384, 3x1 384) | avg pool -> 1x1 192; 2048 channels out.
* Global average pool, (dropout: identity at inference), fc to 1000 classes.

``width`` multiplies every channel count (tiny versions). The smallest image the strided layers
allow is 75x75.

Input ``pixels`` float32 [batch, 3, image, image]; output ``logits`` float32 [batch, classes].
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from rlflow.errors import RLFlowError

from ._common import ModelSpec, pixels_input

DEFAULT_SIZES = {"image": 299, "batch": 1, "classes": 1000, "width": 1.0}
TINY_SIZES = {"image": 75, "batch": 1, "classes": 10, "width": 0.125}
OUTPUT_NAME = "logits"
MIN_IMAGE = 75


class ConvBN(nn.Module):
    def __init__(self, cin: int, cout: int, kernel, stride: int = 1, padding=0):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)
        self.out_channels = cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


def chain(cin: int, *specs) -> nn.Sequential:
    """A sequence of ConvBN from (cout, kernel[, stride[, padding]]) tuples."""
    layers = []
    for spec in specs:
        layers.append(ConvBN(cin, *spec))
        cin = spec[0]
    return nn.Sequential(*layers)


def avg_pool(x: torch.Tensor) -> torch.Tensor:
    return F.avg_pool2d(x, 3, stride=1, padding=1)


class InceptionA(nn.Module):
    def __init__(self, cin: int, c, pool_features: int):
        super().__init__()
        self.branch1x1 = chain(cin, (c(64), 1))
        self.branch5x5 = chain(cin, (c(48), 1), (c(64), 5, 1, 2))
        self.branch3x3dbl = chain(cin, (c(64), 1), (c(96), 3, 1, 1), (c(96), 3, 1, 1))
        self.branch_pool = chain(cin, (c(pool_features), 1))
        self.out_channels = c(64) + c(64) + c(96) + c(pool_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(
            [self.branch1x1(x), self.branch5x5(x), self.branch3x3dbl(x), self.branch_pool(avg_pool(x))], 1
        )


class InceptionB(nn.Module):
    def __init__(self, cin: int, c):
        super().__init__()
        self.branch3x3 = chain(cin, (c(384), 3, 2))
        self.branch3x3dbl = chain(cin, (c(64), 1), (c(96), 3, 1, 1), (c(96), 3, 2))
        self.out_channels = c(384) + c(96) + cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch3x3(x), self.branch3x3dbl(x), F.max_pool2d(x, 3, stride=2)], 1)


class InceptionC(nn.Module):
    def __init__(self, cin: int, c, c7: int):
        super().__init__()
        c7 = c(c7)
        row, col = ((1, 7), 1, (0, 3)), ((7, 1), 1, (3, 0))
        self.branch1x1 = chain(cin, (c(192), 1))
        self.branch7x7 = chain(cin, (c7, 1), (c7, *row), (c(192), *col))
        self.branch7x7dbl = chain(cin, (c7, 1), (c7, *col), (c7, *row), (c7, *col), (c(192), *row))
        self.branch_pool = chain(cin, (c(192), 1))
        self.out_channels = 4 * c(192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(
            [self.branch1x1(x), self.branch7x7(x), self.branch7x7dbl(x), self.branch_pool(avg_pool(x))], 1
        )


class InceptionD(nn.Module):
    def __init__(self, cin: int, c):
        super().__init__()
        self.branch3x3 = chain(cin, (c(192), 1), (c(320), 3, 2))
        self.branch7x7x3 = chain(
            cin, (c(192), 1), (c(192), (1, 7), 1, (0, 3)), (c(192), (7, 1), 1, (3, 0)), (c(192), 3, 2)
        )
        self.out_channels = c(320) + c(192) + cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch3x3(x), self.branch7x7x3(x), F.max_pool2d(x, 3, stride=2)], 1)


class InceptionE(nn.Module):
    def __init__(self, cin: int, c):
        super().__init__()
        self.branch1x1 = chain(cin, (c(320), 1))
        self.branch3x3 = chain(cin, (c(384), 1))
        self.branch3x3_row = ConvBN(c(384), c(384), (1, 3), padding=(0, 1))
        self.branch3x3_col = ConvBN(c(384), c(384), (3, 1), padding=(1, 0))
        self.branch3x3dbl = chain(cin, (c(448), 1), (c(384), 3, 1, 1))
        self.branch3x3dbl_row = ConvBN(c(384), c(384), (1, 3), padding=(0, 1))
        self.branch3x3dbl_col = ConvBN(c(384), c(384), (3, 1), padding=(1, 0))
        self.branch_pool = chain(cin, (c(192), 1))
        self.out_channels = c(320) + 4 * c(384) + c(192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.branch3x3(x)
        b = self.branch3x3dbl(x)
        return torch.cat(
            [
                self.branch1x1(x),
                self.branch3x3_row(a),
                self.branch3x3_col(a),
                self.branch3x3dbl_row(b),
                self.branch3x3dbl_col(b),
                self.branch_pool(avg_pool(x)),
            ],
            1,
        )


class InceptionV3(nn.Module):
    """Inception-v3 inference graph: stem, 3xA, B, 4xC, D, 2xE, average pool, fc."""

    def __init__(self, s: dict):
        super().__init__()
        if s["image"] < MIN_IMAGE:
            raise RLFlowError(f"inceptionv3: image {s['image']} is below the minimum {MIN_IMAGE}")
        width = s["width"]

        def c(n: int) -> int:
            return max(1, round(n * width))

        self.stem = nn.Sequential(
            chain(3, (c(32), 3, 2), (c(32), 3), (c(64), 3, 1, 1)),
            nn.MaxPool2d(3, stride=2),
            chain(c(64), (c(80), 1), (c(192), 3)),
            nn.MaxPool2d(3, stride=2),
        )
        blocks: list[nn.Module] = []

        def add(block: nn.Module) -> int:
            blocks.append(block)
            return block.out_channels

        cin = add(InceptionA(c(192), c, pool_features=32))
        cin = add(InceptionA(cin, c, pool_features=64))
        cin = add(InceptionA(cin, c, pool_features=64))
        cin = add(InceptionB(cin, c))
        for c7 in (128, 160, 160, 192):
            cin = add(InceptionC(cin, c, c7))
        cin = add(InceptionD(cin, c))
        cin = add(InceptionE(cin, c))
        cin = add(InceptionE(cin, c))
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, s["classes"])

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(pixels))
        return self.fc(torch.flatten(self.pool(x), 1))


MODELS = {"inceptionv3": ModelSpec(InceptionV3, pixels_input, DEFAULT_SIZES, TINY_SIZES, OUTPUT_NAME)}
