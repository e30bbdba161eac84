"""PPO (CleanRL-style, readable top to bottom) for the hierarchical masked policy of :mod:`rlflow.nn.policy`:
advantages by GAE, the clipped objective J = L_clip + c1 L_vf + c2 L_entropy (as a loss to minimise:
-L_clip + c1 x value error - c2 x entropy), and the collect/update loop over any batched environment that gives
tensors (:class:`VectorEnv`: the dream environment, or real environments behind the graph encoder).

Shapes: T = steps of a rollout, B = samples in a minibatch (or environments of a vector).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch


def gae(rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor, last_value: torch.Tensor,
        gamma: float = 0.99, lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over one trajectory buffer.

    rewards [T], values [T] (V(s_t)), dones [T] (1 where the episode ended AT step t, so s_{t+1} is a new
    episode's first state), last_value [] (V of the state after the last step; ignored if dones[-1]).
    Returns (advantages [T], returns [T] = advantages + values). Any trailing axes are independent
    trajectories: [T, B] with last_value [B] computes B of them at once."""
    T = rewards.shape[0]
    adv = torch.zeros_like(rewards)
    running = torch.zeros((), dtype=rewards.dtype)
    for t in range(T - 1, -1, -1):
        next_value = last_value if t == T - 1 else values[t + 1]
        nonterminal = 1.0 - dones[t].to(rewards.dtype)
        delta = rewards[t] + gamma * next_value * nonterminal - values[t]
        running = delta + gamma * lam * nonterminal * running
        adv[t] = running
    return adv, adv + values


def ppo_loss(new_logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, values: torch.Tensor,
             returns: torch.Tensor, entropy: torch.Tensor, clip: float = 0.2, c1: float = 0.5,
             c2: float = 0.01) -> tuple[torch.Tensor, dict[str, float]]:
    """The PPO loss of a minibatch: all arguments [B]. Returns (scalar loss, parts for logging)."""
    ratio = (new_logp - old_logp).exp()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip, 1.0 + clip) * advantages
    l_clip = torch.minimum(unclipped, clipped).mean()
    l_vf = ((values - returns) ** 2).mean()
    l_ent = entropy.mean()
    loss = -l_clip + c1 * l_vf - c2 * l_ent
    return loss, {"clip": float(l_clip.detach()), "value": float(l_vf.detach()), "entropy": float(l_ent.detach()),
                  "clip_fraction": float(((ratio - 1.0).abs() > clip).float().mean())}


# ============================================================================================ the training loop


#: keys of config.yaml's ``ppo`` section that shape the policy network (HierarchicalPolicy), not PPO
POLICY_KEYS = ("hidden", "count_features")


@dataclass
class PPOConfig:
    """PPO hyperparameters (defaults: X-RLflow's)."""

    lr: float = 5e-4
    """Adam learning rate."""
    gamma: float = 0.99
    """Discount factor."""
    gae_lambda: float = 0.95
    """GAE's lambda."""
    clip: float = 0.2
    """Ratio clipping of L_clip."""
    c1: float = 0.5
    """Weight of the value loss."""
    c2: float = 0.01
    """Weight of the entropy bonus."""
    update_epochs: int = 4
    """Passes over each batch of experience."""
    minibatch: int = 16
    """Samples per gradient step."""
    steps_per_update: int = 128
    """Environment steps (per environment of the vector) collected before each update."""
    max_grad_norm: float = 0.5
    """Gradient-norm clipping."""

    @classmethod
    def from_config(cls, ppo: dict, steps_per_update: int, **overrides) -> "PPOConfig":
        """From config.yaml's ``ppo`` section (its ``hidden`` and ``count_features`` shape the policy, not PPO)
        and a stage's budget; ``overrides`` (e.g. the controller's ``minibatch``) replace single fields; None values
        are ignored."""
        fields = {k: v for k, v in ppo.items() if k not in POLICY_KEYS}
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields, steps_per_update=steps_per_update)


class VectorEnv(Protocol):
    """What PPO needs of an environment: B copies stepped together, observations already as tensors
    (``features`` [B, D], ``xfer_mask`` [B, N1], and the locations as either ``location_mask`` [B, N1, L] or
    ``location_count`` [B, N1], see :mod:`rlflow.nn.policy`) and ``step_batch(xfer, loc) -> (obs, reward [B],
    done [B])``; an episode that ends is reset inside ``step_batch`` (its next observation is the new episode's
    first)."""

    num_envs: int

    def reset(self) -> dict[str, torch.Tensor]: ...

    def step_batch(self, xfer: torch.Tensor, loc: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor,
                                                                    torch.Tensor]: ...


def locations(obs: dict) -> torch.Tensor:
    """An observation's locations: the counts [B, N1] where the environment gives them (the dream), else the
    dense mask [B, N1, L]."""
    return obs["location_count"] if "location_count" in obs else obs["location_mask"]


def collect(venv: VectorEnv, policy, obs: dict, steps: int, generator: torch.Generator | None = None):
    """``steps`` steps of every environment: a dict of tensors [steps, B, ...], and the last observation.
    ``locations`` holds what the environment gave (counts or dense masks)."""
    buf = {k: [] for k in ("features", "xfer_mask", "locations", "xfer", "loc", "logp", "value", "reward",
                           "done")}
    for _ in range(steps):
        xfer, loc, logp, value = policy.act(obs["features"], obs["xfer_mask"], locations(obs), generator)
        buf["features"].append(obs["features"])
        buf["xfer_mask"].append(obs["xfer_mask"])
        buf["locations"].append(locations(obs))
        nxt, reward, done = venv.step_batch(xfer, loc)
        for k, v in (("xfer", xfer), ("loc", loc), ("logp", logp), ("value", value), ("reward", reward),
                     ("done", done)):
            buf[k].append(v)
        obs = nxt
    return {k: torch.stack(v) for k, v in buf.items()}, obs


def update(policy, optimizer, batch: dict, last_value: torch.Tensor, cfg: PPOConfig,
           generator: torch.Generator | None = None) -> dict[str, float]:
    """GAE per environment, then ``update_epochs`` passes of clipped-PPO minibatch steps."""
    T, B = batch["reward"].shape
    # gae is elementwise over trailing axes: all B environments at once ([T, B], last_value [B])
    adv, ret = gae(batch["reward"].float(), batch["value"].float(), batch["done"].float(), last_value.float(),
                   cfg.gamma, cfg.gae_lambda)
    flat = {k: v.reshape(T * B, *v.shape[2:]) for k, v in batch.items()}
    adv, ret = adv.reshape(-1), ret.reshape(-1)
    logs: dict[str, float] = {}
    for _ in range(cfg.update_epochs):
        order = torch.randperm(T * B, generator=generator)
        for start in range(0, T * B, cfg.minibatch):
            idx = order[start:start + cfg.minibatch]
            a = adv[idx]
            if len(idx) > 1:
                a = (a - a.mean()) / (a.std() + 1e-8)
            logp, entropy, value = policy.evaluate(flat["features"][idx], flat["xfer"][idx], flat["loc"][idx],
                                                   flat["xfer_mask"][idx], flat["locations"][idx])
            loss, logs = ppo_loss(logp, flat["logp"][idx], a, value, ret[idx], entropy, cfg.clip, cfg.c1, cfg.c2)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
            optimizer.step()
    return logs


def train(venv: VectorEnv, policy, cfg: PPOConfig, updates: int, generator: torch.Generator | None = None,
          on_update: Callable[[int, dict], None] | None = None) -> None:
    """``updates`` rounds of collect + update. ``on_update(k, logs)`` after each (logging, checkpoints)."""
    optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    obs = venv.reset()
    for k in range(updates):
        batch, obs = collect(venv, policy, obs, cfg.steps_per_update, generator)
        with torch.no_grad():
            last_value = policy.value(obs["features"], locations(obs))
        logs = update(policy, optimizer, batch, last_value, cfg, generator)
        logs["mean_reward"] = float(batch["reward"].float().mean())
        if on_update is not None:
            on_update(k, logs)
