"""The model-free baseline: the same PPO and hierarchical heads as the controller, trained directly on real
environments, with the (trained, frozen) graph encoder's z of the real graph as input (the RLFlow paper's
model-free agent; X-RLflow's setting apart from the frozen encoder)."""

from __future__ import annotations

import torch

from rlflow.agents.ppo import PPOConfig, train
from rlflow.agents.real_env import RealVectorEnv, encode, run_episode, run_episodes
from rlflow.nn.policy import HierarchicalPolicy


def train_model_free(envs, encoder, cfg: PPOConfig, updates: int, z_dim: int, hidden: int = 128, seed: int = 0,
                     device: str = "cpu", on_update=None, policy: HierarchicalPolicy | None = None):
    """Train on the real environments ``envs``; returns (policy, the vector env with its interaction count)."""
    gen = torch.Generator().manual_seed(seed)
    venv = RealVectorEnv(envs, encoder, device)
    if policy is None:
        policy = HierarchicalPolicy(z_dim, envs[0].n_xfers, envs[0].max_locations, hidden)
    train(venv, policy, cfg, updates, gen, on_update)
    return policy, venv


@torch.no_grad()
def run_model_free(policy, encoder, env, device: str = "cpu", greedy: bool = True, seed: int = 0, episodes: int = 1):
    """``episodes`` real episodes with the trained policy from the original graph, exactly as the controller is
    evaluated (:func:`rlflow.agents.real_env.run_episodes`: the first greedy, the others sampled)."""

    def one_episode(greedy_: bool, gen: torch.Generator) -> dict:
        def choose(obs, xm, lm):
            xfer, loc, _, _ = policy.act(encode(encoder, [obs], device), xm, lm, generator=gen, greedy=greedy_)
            return int(xfer[0]), int(loc[0])

        return run_episode(env, choose)

    return run_episodes(one_episode, episodes, greedy, seed)
