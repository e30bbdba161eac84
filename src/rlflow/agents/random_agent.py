"""The random agent of the rollouts: with probability ``stop_prob`` (or when no rule matches) the NO-OP, else a
rule chosen uniformly among those with a match, then a location chosen uniformly among that rule's matches
(within the action space's ``max_locations``)."""

from __future__ import annotations

import numpy as np


class RandomAgent:
    def __init__(self, stop_prob: float, rng: np.random.Generator):
        if not 0.0 <= stop_prob <= 1.0:
            raise ValueError("stop_prob must be in [0, 1]")
        self.stop_prob = stop_prob
        self.rng = rng

    def act(self, xfer_mask: np.ndarray, location_mask: np.ndarray) -> tuple[int, int]:
        """An action ``(xfer, location)`` valid under the masks ((N+1,) and (N+1, L); index N is the NO-OP)."""
        noop = len(xfer_mask) - 1
        valid = np.flatnonzero(xfer_mask[:noop])
        if len(valid) == 0 or self.rng.random() < self.stop_prob:
            return noop, 0
        xfer = int(valid[self.rng.integers(len(valid))])
        return xfer, int(self.rng.integers(int(location_mask[xfer].sum())))
