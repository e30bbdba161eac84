"""PPO's pure parts (CleanRL-style, readable top to bottom): advantages by GAE and the clipped objective
J = L_clip + c1 L_vf + c2 L_entropy (as a loss to minimise: -L_clip + c1 x value error - c2 x entropy).

Shapes: T = steps of a rollout, B = samples in a minibatch.
"""

from __future__ import annotations

import torch


def gae(rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor, last_value: torch.Tensor,
        gamma: float = 0.99, lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over one trajectory buffer.

    rewards [T], values [T] (V(s_t)), dones [T] (1 where the episode ended AT step t, so s_{t+1} is a new
    episode's first state), last_value [] (V of the state after the last step; ignored if dones[-1]).
    Returns (advantages [T], returns [T] = advantages + values)."""
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
    return loss, {"clip": float(l_clip), "value": float(l_vf), "entropy": float(l_ent),
                  "clip_fraction": float(((ratio - 1.0).abs() > clip).float().mean())}
