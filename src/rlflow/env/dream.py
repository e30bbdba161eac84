"""The dream: a batched environment that steps the learned world model (MDN-RNN) on torch, never the real one.

State per copy: the latent z of the current (imagined) graph, the world model's LSTM state h, the graph's
predicted metrics and per-rule match counts, and the step. An action (rule, location) is fed with z and the
counts to the world model, which predicts the next z (a Gaussian mixture, sampled with temperature tau: mixture
logits divided by tau before the softmax, the spread scaled by sqrt(tau), as in World Models), whether the metrics change at all
(sampled: a step that changes nothing keeps the metrics exactly), the metric deltas, done, and the
next graph's match counts (as a change of the current ones: a rule whose matches are used up leaves the masks),
rounded to whole matches (the counts the world model was trained on are whole), from which the next masks follow. The reward is the configured reward class applied
to the metrics before and after (predicted), so a reward change needs no new world model. With an ensemble world
model (:class:`rlflow.nn.mdnrnn.EnsembleMDNRNN`) the members' disagreement about the step's reward (the standard
deviation of what each expects) times ``disagreement_penalty`` is subtracted from it: where the members disagree
the model is guessing, and the controller is not paid for exploiting a guess. The NO-OP (rule N)
ends the episode; so do a predicted done and the hard horizon ``max_steps``. Ended copies restart from the
original graph inside the same call, or, with ``starts`` (:class:`DreamStarts`) and probability ``branch``, from a
real graph of the world model's data, part way through its episode (its z, metrics, counts, step, and the LSTM
state after the real steps that led there): a dream from the first graph reaches few of the states a good
policy passes through (bert: the fold of the attention scale into a merged weight is possible only after the
merges, which the random rollouts seldom make), and a short branch from a real state compounds less model error.

The world model is passed in (anything with ``step``, ``sample_z``, ``metrics_after``, ``counts``,
``initial_hidden``: :class:`rlflow.nn.mdnrnn.MDNRNN`), so this module depends on no network code and holds no
reference to a real environment: it cannot call one.

Observation (tensors, batched): ``features`` [B, Z + H] = [z, h] (the controller's input), ``xfer_mask``
[B, N+1], ``location_count`` [B, N+1] (long: rule k's valid locations are 0 .. count_k - 1, count capped at
``max_locations``; the NO-OP has one), ``metrics`` [B, 4]. The dense location mask [B, N+1, L] is never built
on the hot path (the policy derives the chosen rule's row from the counts, see
:func:`rlflow.nn.policy.location_rows`); :meth:`DreamEnv.masks` gives it for inspection.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rlflow.cost import METRIC_NAMES
from rlflow.env.rewards import Reward
from rlflow.errors import RLFlowError


@dataclass
class DreamStarts:
    """Real states a dream episode may start from, S of them: z [S, Z], metrics [S, 4] (double), counts [S, N]
    (whole, capped at max_locations), steps [S] (long: how far into its real episode the state is) and the world
    model's LSTM state after the real steps that led there, h and c [S, H]."""
    z: torch.Tensor
    metrics: torch.Tensor
    counts: torch.Tensor
    steps: torch.Tensor
    h: torch.Tensor
    c: torch.Tensor

    def __len__(self) -> int:
        return len(self.z)


@torch.no_grad()
def data_starts(model, data: dict, max_steps: int) -> DreamStarts:
    """The real states of the world model's data (latents, :func:`rlflow.agents.world_model.load_latents`) that a
    dream episode may branch from (``model``: anything with ``step`` and ``initial_hidden``, as for DreamEnv):
    every graph of every episode after its first step and before its last (and before step ``max_steps``), with
    the world model's LSTM state after the real steps that led there. The LSTM takes the steps as the dream does:
    a step that moved the graph (a valid rule) advances it, an invalid one or the NO-OP keeps it."""
    E, T = data["actions"].shape[:2]
    L = int(data["max_locations"])
    lengths = torch.as_tensor(data["lengths"]).long()
    z = torch.as_tensor(data["z"], dtype=torch.float32)
    counts = torch.as_tensor(np.minimum(data["counts"], L), dtype=torch.float32)
    actions = torch.as_tensor(data["actions"]).long()
    moved = (torch.as_tensor(data["valid"]).bool() & (actions[..., 0] >= 0)
             & (actions[..., 0] < int(data["n_xfers"])))
    h, c = model.initial_hidden(E)
    hs, cs = [h[0]], [c[0]]
    for t in range(min(T, int(lengths.max()))):
        out = model.step(z[:, t], actions[:, t].clamp(min=0), counts[:, t], (h, c))
        m = moved[:, t][None, :, None]
        h, c = torch.where(m, out.hidden[0], h), torch.where(m, out.hidden[1], c)
        hs.append(h[0])
        cs.append(c[0])
    t_all = torch.arange(len(hs))
    keep = (t_all[None, :] >= 1) & (t_all[None, :] < lengths[:, None]) & (t_all[None, :] < max_steps)
    e, t = keep.nonzero(as_tuple=True)
    return DreamStarts(z[e, t], torch.as_tensor(data["metrics"], dtype=torch.float64)[e, t], counts[e, t], t,
                       torch.stack(hs, 1)[e, t], torch.stack(cs, 1)[e, t])


class DreamEnv:
    def __init__(self, world_model, start_z: torch.Tensor, start_metrics: torch.Tensor, start_counts: torch.Tensor,
                 reward: Reward, max_steps: int, max_locations: int, temperature: float = 1.0, num_envs: int = 16,
                 generator: torch.Generator | None = None, done_threshold: float = 0.5,
                 disagreement_penalty: float = 0.0, starts: DreamStarts | None = None, branch: float = 0.0):
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
        self._rows = torch.arange(num_envs)
        self._noop_count = torch.ones(num_envs, 1, dtype=torch.long)
        self._start_count = self._location_count(self.start_counts[None])[0]
        self._start_raw = self.start_counts.clamp(0, self.max_locations)
        self._zeros = torch.zeros(num_envs)
        self._penalty = torch.full((num_envs,), reward.invalid_penalty)
        self.steps_taken = 0  # dream transitions so far (for speed figures; never real interactions)
        if disagreement_penalty < 0:
            raise RLFlowError("the dream's disagreement penalty must be >= 0")
        self.disagreement_penalty = float(disagreement_penalty)
        self.disagreement_sum, self.disagreement_moves = 0.0, 0  # an ensemble's disagreement over the moves
        if not 0.0 <= branch <= 1.0:
            raise RLFlowError(f"the dream's branch probability must be in [0, 1], got {branch}")
        if branch > 0 and (starts is None or len(starts) == 0):
            raise RLFlowError("the dream cannot branch from real states: none were given")
        self.starts, self.branch = starts, float(branch)

    # ------------------------------------------------------------------ state
    def _location_count(self, counts: torch.Tensor) -> torch.Tensor:
        """Predicted counts [B, N] -> valid locations per rule [B, N+1] (rounded, capped at L; NO-OP: 1)."""
        n = torch.round(counts).clamp_(0, self.max_locations).long()
        return torch.cat([n, self._noop_count[: len(n)]], dim=1)

    def _restart(self, which: torch.Tensor) -> None:
        if not bool(which.any()):
            return
        w = which[:, None]
        self.z = torch.where(w, self.start_z, self.z)
        self.metrics = torch.where(w, self.start_metrics, self.metrics)
        self.location_count = torch.where(w, self._start_count, self.location_count)
        self.counts = torch.where(w, self._start_raw, self.counts)
        self.steps = self.steps.masked_fill(which, 0)
        h, c = self.hidden
        self.hidden = (h.masked_fill(w[None], 0.0), c.masked_fill(w[None], 0.0))
        if self.branch > 0:
            self._branch(which)

    def _branch(self, which: torch.Tensor) -> None:
        """Copies in ``which`` (just restarted from the first graph) start, with probability ``branch``, from a
        random real state of ``starts`` instead."""
        u = torch.rand(len(which), generator=self.generator)
        pick = which & (u < self.branch)
        if not bool(pick.any()):
            return
        rows = pick.nonzero().squeeze(-1)
        s = self.starts
        i = torch.randint(len(s), (len(rows),), generator=self.generator)
        self.z[rows] = s.z[i]
        self.metrics[rows] = s.metrics[i]
        self.counts[rows] = s.counts[i]
        self.location_count[rows] = self._location_count(s.counts[i])
        self.steps[rows] = s.steps[i]
        self.hidden[0][0, rows] = s.h[i]
        self.hidden[1][0, rows] = s.c[i]

    def masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """xfer mask [B, N+1] and the dense location mask [B, N+1, L] (for inspection and tests only)."""
        n = self.location_count
        return n > 0, self._loc_range[None, None, :] < n[..., None]

    def observation(self) -> dict[str, torch.Tensor]:
        return {"features": torch.cat([self.z, self.hidden[0][0]], dim=-1), "xfer_mask": self.location_count > 0,
                "location_count": self.location_count, "metrics": self.metrics}

    def reset(self) -> dict[str, torch.Tensor]:
        B = self.num_envs
        self.z = self.start_z.expand(B, -1).clone()
        self.metrics = self.start_metrics.expand(B, -1).clone()
        self.location_count = self._start_count.expand(B, -1).clone()
        self.counts = self._start_raw.expand(B, -1).clone()  # predicted counts, whole numbers [B, N]
        self.steps = torch.zeros(B, dtype=torch.long)
        self.hidden = self.wm.initial_hidden(B)
        if self.branch > 0:
            self._branch(torch.ones(B, dtype=torch.bool))
        return self.observation()

    # ------------------------------------------------------------------ stepping
    def _disagreement(self, out, prev: dict) -> torch.Tensor:
        """[B]: the standard deviation over an ensemble's members of the reward each expects for the step (its
        delta's reward weighted by its probability that the metrics change, the no-change reward otherwise)."""
        still = self.reward_fn(prev, prev, self.first).double()
        p = torch.sigmoid(out.member_changed.double())                              # [B, E]
        per = []
        for k in range(p.shape[-1]):
            after = self.wm.metrics_after(self.metrics, out.member_deltas[:, k].double())
            r = self.reward_fn(prev, {n: after[:, i] for i, n in enumerate(METRIC_NAMES)}, self.first).double()
            per.append(p[:, k] * r + (1 - p[:, k]) * still)
        return torch.stack(per, -1).std(-1).float()

    def mean_disagreement(self) -> float | None:
        """The mean disagreement over the moves so far (None without an ensemble or a move)."""
        return self.disagreement_sum / self.disagreement_moves if self.disagreement_moves else None

    @torch.no_grad()
    def step_batch(self, xfer: torch.Tensor, loc: torch.Tensor):
        """Actions xfer [B], loc [B] -> (next observation, reward [B], done [B])."""
        B = self.num_envs
        n_chosen = self.location_count[self._rows, xfer]                    # valid locations of the chosen rule
        valid = loc.clamp(0, self.max_locations - 1) < n_chosen
        noop = xfer == self.n_xfers
        move = valid & ~noop
        out = self.wm.step(self.z, torch.stack([xfer, loc], dim=-1), self.counts, self.hidden)
        z_next = self.wm.sample_z(out, self.temperature, self.generator)
        changed = torch.bernoulli(torch.sigmoid(out.changed), generator=self.generator).bool()
        metrics_next = self.wm.metrics_after(self.metrics, out.deltas.double(), changed)
        # whole matches, as the world model saw them in training: carrying fractions let a count at 0 creep up by
        # the smooth max's offset and the head's small bias, step after step, until a used-up merge was offered
        # again (a controller learned to wait 3-4 neutral steps for each phantom merge)
        raw_next = torch.round(self.wm.counts(out.log_counts)).clamp_(0, self.max_locations)
        count_next = self._location_count(raw_next)
        prev = {k: self.metrics[:, i] for i, k in enumerate(METRIC_NAMES)}
        cur = {k: metrics_next[:, i] for i, k in enumerate(METRIC_NAMES)}
        gain = self.reward_fn(prev, cur, self.first).float()
        if out.member_deltas is not None:
            spread = self._disagreement(out, prev)
            self.disagreement_sum += float(spread[move].sum())
            self.disagreement_moves += int(move.sum())
            gain = gain - self.disagreement_penalty * spread
        reward = torch.where(move, gain, self._zeros)
        reward = torch.where(valid, reward, self._penalty)
        # moved copies take the predicted next state; the others keep theirs (hidden included)
        m = move[:, None]
        self.z = torch.where(m, z_next, self.z)
        self.metrics = torch.where(m, metrics_next, self.metrics)
        self.location_count = torch.where(m, count_next, self.location_count)
        self.counts = torch.where(m, raw_next, self.counts)
        h, c = out.hidden
        self.hidden = (torch.where(m[None], h, self.hidden[0]), torch.where(m[None], c, self.hidden[1]))
        self.steps += 1
        predicted_done = move & (torch.sigmoid(out.done) > self.done_threshold)
        done = noop | predicted_done | (self.steps >= self.max_steps)
        self.steps_taken += B
        self._restart(done)
        return self.observation(), reward, done
