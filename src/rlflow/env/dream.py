"""The dream: a batched environment that steps the learned world model (MDN-RNN) on torch, never the real one.

State per copy: the latent z of the current (imagined) graph, the world model's LSTM state h, the graph's
predicted metrics and per-rule match counts, and the step. An action (rule, location) is fed with z to the
world model, which predicts the next z (a Gaussian mixture, sampled with temperature tau: mixture logits divided
by tau before the softmax, the spread scaled by sqrt(tau), as in World Models), the metric deltas, done, and the
next graph's match counts, from which the next masks follow. The reward is the configured reward class applied
to the metrics before and after (predicted), so a reward change needs no new world model. The NO-OP (rule N)
ends the episode; so do a predicted done and the hard horizon ``max_steps``. Ended copies restart from the
original graph inside the same call.

The world model is passed in (anything with ``step``, ``sample_z``, ``metrics_after``, ``counts``,
``initial_hidden``: :class:`rlflow.nn.mdnrnn.MDNRNN`), so this module depends on no network code and holds no
reference to a real environment: it cannot call one.

Observation (tensors, batched): ``features`` [B, Z + H] = [z, h] (the controller's input), ``xfer_mask``
[B, N+1], ``location_mask`` [B, N+1, L], ``metrics`` [B, 4].
"""

from __future__ import annotations

import torch

from rlflow.cost import METRIC_NAMES
from rlflow.env.rewards import Reward
from rlflow.errors import RLFlowError


class DreamEnv:
    def __init__(self, world_model, start_z: torch.Tensor, start_metrics: torch.Tensor, start_counts: torch.Tensor,
                 reward: Reward, max_steps: int, max_locations: int, temperature: float = 1.0, num_envs: int = 16,
                 generator: torch.Generator | None = None, done_threshold: float = 0.5):
        if reward.needs_latency:
            raise RLFlowError(f"reward '{reward.name}' needs real latency measurements: it cannot be used in the dream")
        if temperature <= 0:
            raise RLFlowError("the dream's temperature must be > 0")
        self.wm = world_model
        self.num_envs, self.max_steps, self.max_locations = num_envs, int(max_steps), int(max_locations)
        self.reward_fn, self.temperature, self.generator = reward, float(temperature), generator
        self.done_threshold = done_threshold
        self.n_xfers = int(start_counts.shape[-1])
        self.start_z = start_z.float()
        self.start_metrics = start_metrics.double()
        self.start_counts = start_counts.float()
        self.first = {k: self.start_metrics[i].expand(num_envs) for i, k in enumerate(METRIC_NAMES)}
        self._loc_range = torch.arange(self.max_locations)
        self.steps_taken = 0  # dream transitions so far (for speed figures; never real interactions)

    # ------------------------------------------------------------------ state
    def _restart(self, which: torch.Tensor) -> None:
        n = int(which.sum())
        if n == 0:
            return
        self.z[which] = self.start_z
        self.metrics[which] = self.start_metrics
        self.counts[which] = self.start_counts
        self.steps[which] = 0
        h, c = self.hidden
        h[:, which] = 0.0
        c[:, which] = 0.0

    def masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """xfer mask [B, N+1] and location mask [B, N+1, L] from the predicted counts (NO-OP: location 0)."""
        n = torch.round(self.counts).clamp(0, self.max_locations)
        n = torch.cat([n, torch.ones(self.num_envs, 1)], dim=1)
        return n > 0, self._loc_range[None, None, :] < n[..., None]

    def observation(self) -> dict[str, torch.Tensor]:
        xfer_mask, location_mask = self.masks()
        return {"features": torch.cat([self.z, self.hidden[0][0]], dim=-1), "xfer_mask": xfer_mask,
                "location_mask": location_mask, "metrics": self.metrics}

    def reset(self) -> dict[str, torch.Tensor]:
        B = self.num_envs
        self.z = self.start_z.expand(B, -1).clone()
        self.metrics = self.start_metrics.expand(B, -1).clone()
        self.counts = self.start_counts.expand(B, -1).clone()
        self.steps = torch.zeros(B, dtype=torch.long)
        self.hidden = self.wm.initial_hidden(B)
        return self.observation()

    # ------------------------------------------------------------------ stepping
    @torch.no_grad()
    def step_batch(self, xfer: torch.Tensor, loc: torch.Tensor):
        """Actions xfer [B], loc [B] -> (next observation, reward [B], done [B])."""
        B = self.num_envs
        xfer_mask, location_mask = self.masks()
        valid = xfer_mask[torch.arange(B), xfer] & location_mask[torch.arange(B), xfer, loc.clamp(0, self.max_locations - 1)]
        noop = xfer == self.n_xfers
        move = valid & ~noop
        out = self.wm.step(self.z, torch.stack([xfer, loc], dim=-1), self.hidden)
        z_next = self.wm.sample_z(out, self.temperature, self.generator)
        metrics_next = self.wm.metrics_after(self.metrics.float(), out.deltas).double()
        counts_next = self.wm.counts(out.log_counts)
        prev = {k: self.metrics[:, i] for i, k in enumerate(METRIC_NAMES)}
        cur = {k: metrics_next[:, i] for i, k in enumerate(METRIC_NAMES)}
        reward = torch.where(move, self.reward_fn(prev, cur, self.first).float(), torch.zeros(B))
        reward = torch.where(valid, reward, torch.full((B,), self.reward_fn.invalid_penalty))
        # moved copies take the predicted next state; the others keep theirs (hidden included)
        m = move[:, None]
        self.z = torch.where(m, z_next, self.z)
        self.metrics = torch.where(m, metrics_next, self.metrics)
        self.counts = torch.where(m, counts_next, self.counts)
        h, c = out.hidden
        self.hidden = (torch.where(m[None], h, self.hidden[0]), torch.where(m[None], c, self.hidden[1]))
        self.steps += 1
        predicted_done = move & (torch.sigmoid(out.done) > self.done_threshold)
        done = noop | predicted_done | (self.steps >= self.max_steps)
        self.steps_taken += B
        self._restart(done)
        return self.observation(), reward, done
