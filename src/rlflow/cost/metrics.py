"""Cost metrics of a graph: estimated runtime, flops, bytes of memory access and kernel launches.

Every consumer (the search, the environment, rewards, rollouts, the world model) reads metrics by these names,
so a recorded trace can be re-scored later with any reward function.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

#: metric names, in the order of :meth:`Metrics.as_tuple` (and of every metric vector in rollout files)
METRIC_NAMES = ("runtime_ms", "flops", "bytes", "launches")


@dataclass(frozen=True)
class Metrics:
    """Summed over the graph's nodes (weight-only nodes count nothing: they are folded before running)."""

    runtime_ms: float = 0.0
    """Estimated runtime, the sum of per-op estimates (TASO's cost)."""
    flops: float = 0.0
    """Floating-point operations of one forward pass."""
    bytes: float = 0.0
    """Bytes read and written by all ops (memory access)."""
    launches: float = 0.0
    """Kernels launched (views such as Reshape launch none)."""

    def __add__(self, other: "Metrics") -> "Metrics":
        return Metrics(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple())))

    def __sub__(self, other: "Metrics") -> "Metrics":
        return Metrics(*(a - b for a, b in zip(self.as_tuple(), other.as_tuple())))

    def as_tuple(self) -> tuple[float, float, float, float]:
        return (self.runtime_ms, self.flops, self.bytes, self.launches)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


#: the searches compare costs as integers in units of QUANTUM ms: sums are exact, so a graph's cost does not
#: depend on the order in which rewrites (and their cost deltas) reached it, and a rewrite that swaps equal-cost
#: nodes leaves the cost exactly unchanged
QUANTUM_MS = 1e-9


def quantize(runtime_ms: float) -> int:
    return round(runtime_ms / QUANTUM_MS)
