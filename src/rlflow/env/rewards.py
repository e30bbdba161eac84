"""Reward functions of the rewrite environment: small classes computed from cost metrics.

A reward sees the metrics of the previous graph, the new graph and the episode's first graph (dicts with the
keys of :data:`rlflow.cost.METRIC_NAMES`, plus ``latency_ratio`` where the environment measured it), so the same
recorded trace can be re-scored with any reward later. An invalid action gets ``invalid_penalty`` instead.

    delta       RLFlow eq. 2:  RT_{t-1} - RT_t                                  (ms)
    weighted    RLFlow eq. 3:  alpha (RT_{t-1} - RT_t) + beta (M_{t-1} - M_t)   (ms, MB of memory access)
    normalised  X-RLflow:      (RT_{t-1} - RT_t) / RT_0 x 100                   (% of the original cost)
    e2e         X-RLflow's sparse reward: like normalised, on the real end-to-end latency, which the environment
                measures every ``every`` steps and at the end (in between the latency is unchanged: reward 0):
                (ratio_{t-1} - ratio_t) x 100, where ratio is the graph's latency over the episode's first
                graph's under the measurement protocol (rlflow.evaluation.protocol), and 1 wherever the protocol
                detects no difference: timing noise earns nothing
"""

from __future__ import annotations

from typing import Any, Mapping

from rlflow.errors import RLFlowError

Metrics = Mapping[str, float]


class Reward:
    """Base: ``reward(prev, cur, first)`` for a valid step, ``invalid_penalty`` for an invalid one."""

    name = "base"
    #: the environment must measure real latency (``latency_ratio``) every ``every`` steps for this reward
    needs_latency = False

    def __init__(self, invalid_penalty: float = -100.0):
        self.invalid_penalty = float(invalid_penalty)

    def __call__(self, prev: Metrics, cur: Metrics, first: Metrics) -> float:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


class DeltaReward(Reward):
    """RT_{t-1} - RT_t: the cost-model runtime saved by this step, in ms."""

    name = "delta"

    def __call__(self, prev, cur, first):
        return prev["runtime_ms"] - cur["runtime_ms"]


class WeightedReward(Reward):
    """alpha x runtime saved (ms) + beta x memory access saved (MB = 1e6 bytes)."""

    name = "weighted"

    def __init__(self, alpha: float = 0.8, beta: float = 0.2, invalid_penalty: float = -100.0):
        super().__init__(invalid_penalty)
        self.alpha, self.beta = float(alpha), float(beta)

    def __call__(self, prev, cur, first):
        return (self.alpha * (prev["runtime_ms"] - cur["runtime_ms"])
                + self.beta * (prev["bytes"] - cur["bytes"]) / 1e6)


class NormalisedReward(Reward):
    """Runtime saved as a percentage of the first graph's runtime."""

    name = "normalised"

    def __call__(self, prev, cur, first):
        return (prev["runtime_ms"] - cur["runtime_ms"]) / first["runtime_ms"] * 100.0


class EndToEndReward(Reward):
    """Measured latency saved as a percentage of the first graph's latency (sparse: measured every ``every``
    steps by the environment, with ``backend``): the change of ``latency_ratio`` (the graph's latency over the
    first graph's, 1 where the protocol detects no difference) x 100."""

    name = "e2e"
    needs_latency = True

    def __init__(self, every: int = 5, backend: str = "ort", invalid_penalty: float = -100.0):
        super().__init__(invalid_penalty)
        if every < 1:
            raise RLFlowError("e2e reward: every must be >= 1")
        self.every, self.backend = int(every), backend

    def __call__(self, prev, cur, first):
        return (prev["latency_ratio"] - cur["latency_ratio"]) / first["latency_ratio"] * 100.0


REWARDS = {cls.name: cls for cls in (DeltaReward, WeightedReward, NormalisedReward, EndToEndReward)}


def make_reward(spec: Mapping[str, Any] | str | Reward | None = None) -> Reward:
    """A reward from config (``env.reward``: name plus parameters; keys a reward does not use are ignored)."""
    if isinstance(spec, Reward):
        return spec
    if spec is None:
        spec = {"name": "weighted"}
    if isinstance(spec, str):
        spec = {"name": spec}
    name = spec.get("name", "weighted")
    penalty = spec.get("invalid_penalty", -100.0)
    if name == "delta":
        return DeltaReward(penalty)
    if name == "weighted":
        return WeightedReward(spec.get("alpha", 0.8), spec.get("beta", 0.2), penalty)
    if name == "normalised":
        return NormalisedReward(penalty)
    if name == "e2e":
        return EndToEndReward(spec.get("e2e_every", 5), spec.get("e2e_backend", "ort"), penalty)
    raise RLFlowError(f"unknown reward '{name}' (choose from {', '.join(REWARDS)})")
