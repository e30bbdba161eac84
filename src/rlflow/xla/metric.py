"""The XLA pass-ordering paper's metric (torch-free, so the report can use it): per graph, the ratio of a
method's op-count reduction to XLA's default pipeline's, and their geometric mean over graphs."""

from __future__ import annotations

import math
from typing import Sequence


def reduction_ratio(initial: float, method: float, default: float) -> float | None:
    """(initial - method) / (initial - default); None where XLA's default reduces nothing."""
    if initial - default <= 0:
        return None
    return (initial - method) / (initial - default)


def geomean_ratio(ratios: Sequence[float | None]) -> float | None:
    """The paper's metric: the geometric mean of the per-graph ratios (graphs with no defined ratio left out; a
    ratio <= 0 — no reduction, or more ops — makes the mean 0)."""
    defined = [r for r in ratios if r is not None]
    if not defined:
        return None
    if min(defined) <= 0:
        return 0.0
    return math.exp(sum(math.log(r) for r in defined) / len(defined))
