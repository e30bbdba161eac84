"""ViT-Base/16 image classifier.

Architecture facts: 224x224 image cut into 16x16 patches by a stride-16 Conv2d (196 patches),
hidden 768, a learned class token prepended and a learned position embedding (197 positions) added,
12 pre-LayerNorm encoder blocks (x + MSA(LN(x)); x + MLP(LN(x)), 12 heads, MLP 3072 with exact GELU),
final LayerNorm, linear head (1000 classes) on the class token. LayerNorm eps 1e-6.

Input ``pixels`` float32 [batch, 3, image, image]; output ``logits`` float32 [batch, classes].
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from rlflow.errors import RLFlowError

from ._common import Init, ModelSpec, pixels_input

DEFAULT_SIZES = {
    "image": 224,
    "patch": 16,
    "layers": 12,
    "hidden": 768,
    "heads": 12,
    "mlp": 3072,
    "batch": 1,
    "classes": 1000,
}
TINY_SIZES = {
    "image": 32,
    "patch": 8,
    "layers": 2,
    "hidden": 32,
    "heads": 2,
    "mlp": 64,
    "batch": 1,
    "classes": 10,
}
OUTPUT_NAME = "logits"
LN_EPS = 1e-6


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.head_size = hidden // heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        return x.view(batch, tokens, self.heads, self.head_size).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, hidden = x.shape
        q = self.split_heads(self.query(x))
        k = self.split_heads(self.key(x))
        v = self.split_heads(self.value(x))
        probs = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_size), dim=-1)
        context = torch.matmul(probs, v).transpose(1, 2).reshape(batch, tokens, hidden)
        return self.out(context)


class Block(nn.Module):
    def __init__(self, s: dict):
        super().__init__()
        self.norm1 = nn.LayerNorm(s["hidden"], eps=LN_EPS)
        self.attention = Attention(s["hidden"], s["heads"])
        self.norm2 = nn.LayerNorm(s["hidden"], eps=LN_EPS)
        self.fc1 = nn.Linear(s["hidden"], s["mlp"])
        self.fc2 = nn.Linear(s["mlp"], s["hidden"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="none"))


class ViT(nn.Module):
    """Vision Transformer: patch embedding, class token, position embedding, pre-LN blocks, head."""

    def __init__(self, s: dict):
        super().__init__()
        if s["image"] % s["patch"]:
            raise RLFlowError(f"vit: image {s['image']} is not divisible by patch {s['patch']}")
        if s["hidden"] % s["heads"]:
            raise RLFlowError(f"vit: hidden {s['hidden']} is not divisible by heads {s['heads']}")
        patches = (s["image"] // s["patch"]) ** 2
        self.patch_embedding = nn.Conv2d(3, s["hidden"], kernel_size=s["patch"], stride=s["patch"])
        self.class_token = nn.Parameter(torch.zeros(1, 1, s["hidden"]))
        self.position_embedding = nn.Parameter(torch.zeros(1, patches + 1, s["hidden"]))
        self.blocks = nn.ModuleList(Block(s) for _ in range(s["layers"]))
        self.norm = nn.LayerNorm(s["hidden"], eps=LN_EPS)
        self.head = nn.Linear(s["hidden"], s["classes"])

    def init_extra(self, init: Init) -> None:
        init.normal(self.class_token, 1.0)
        init.normal(self.position_embedding, 1.0)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [batch, patches, hidden]
        cls = self.class_token.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + self.position_embedding
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


MODELS = {"vit": ModelSpec(ViT, pixels_input, DEFAULT_SIZES, TINY_SIZES, OUTPUT_NAME)}
