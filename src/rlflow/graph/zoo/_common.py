"""Shared helpers for the model zoo: seeded weight initialisation and example inputs.

Weights are drawn from one ``torch.Generator`` in module order, so the same seed always gives the
same model. Scales keep activations finite and non-degenerate through the full depth:

* Conv2d: N(0, 2 / fan_in) (Kaiming, for the ReLU networks); Linear: N(0, 1 / fan_in);
  biases U(-0.1, 0.1).
* BatchNorm: random (not identity) affine parameters and running statistics:
  weight U(0.5, 1.5), bias U(-0.1, 0.1), running_mean U(-0.1, 0.1), running_var U(0.5, 1.5).
* LayerNorm: weight U(0.5, 1.5), bias U(-0.1, 0.1). Embedding: N(0, 1).
* After that pass, each module's optional ``init_extra(init)`` method runs (in module order): it
  initialises anything else (class tokens, plain matmul weights) or overrides the generic draw
  (e.g. a smaller scale for a residual branch's last BatchNorm). A parameter nobody initialised is a
  programming error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    """A zoo entry: how to build the module and its example inputs, its sizes and its ONNX output name."""

    make: Callable[[dict], nn.Module]
    example_inputs: Callable[[dict, int], dict[str, torch.Tensor]]  # (sizes, seed) -> {input name: tensor}
    default_sizes: dict
    tiny_sizes: dict
    output_name: str


class Init:
    """Draws seeded random values into tensors and remembers which parameters it wrote."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.done: set[int] = set()

    @torch.no_grad()
    def normal(self, t: torch.Tensor, std: float, mean: float = 0.0) -> None:
        t.copy_(torch.randn(t.shape, generator=self.gen) * std + mean)
        self.done.add(id(t))

    @torch.no_grad()
    def uniform(self, t: torch.Tensor, low: float, high: float) -> None:
        t.copy_(torch.rand(t.shape, generator=self.gen) * (high - low) + low)
        self.done.add(id(t))


def init_weights(model: nn.Module, seed: int) -> None:
    """Overwrite every parameter (and BatchNorm running statistics) of ``model`` from ``seed``."""
    init = Init(seed)
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            fan_in = m.weight[0].numel()
            gain = 2.0 if isinstance(m, nn.Conv2d) else 1.0
            init.normal(m.weight, math.sqrt(gain / fan_in))
            if m.bias is not None:
                init.uniform(m.bias, -0.1, 0.1)
        elif isinstance(m, nn.BatchNorm2d):
            init.uniform(m.weight, 0.5, 1.5)
            init.uniform(m.bias, -0.1, 0.1)
            init.uniform(m.running_mean, -0.1, 0.1)
            init.uniform(m.running_var, 0.5, 1.5)
        elif isinstance(m, nn.LayerNorm):
            init.uniform(m.weight, 0.5, 1.5)
            init.uniform(m.bias, -0.1, 0.1)
        elif isinstance(m, nn.Embedding):
            init.normal(m.weight, 1.0)
    for m in model.modules():
        init_extra = getattr(m, "init_extra", None)
        if init_extra is not None:
            init_extra(init)
    missed = [n for n, p in model.named_parameters() if id(p) not in init.done]
    if missed:
        raise AssertionError(f"zoo model {type(model).__name__} left parameters uninitialised: {missed}")


def input_generator(seed: int) -> torch.Generator:
    """A generator for example inputs, independent of the one that drew the weights."""
    return torch.Generator().manual_seed(10_007 + seed)


def pixels_input(sizes: dict, seed: int) -> dict[str, torch.Tensor]:
    """``pixels``: float32 [batch, 3, image, image], standard normal."""
    shape = (sizes["batch"], 3, sizes["image"], sizes["image"])
    return {"pixels": torch.randn(shape, generator=input_generator(seed))}
