"""RLFlow's controller: PPO with the hierarchical masked heads, trained only in the dream (the world model),
on input [z, h]; then run in the real environment from the original graph, keeping the best graph seen: one
greedy episode, or (``episodes`` > 1, config ``controller.eval_episodes``) that one and sampled ones, the best
graph of all kept and every real step counted as an interaction.

In the real run, z is the encoder's embedding of the real graph and h the world model's LSTM state, advanced
with (z, action) after every step exactly as in the dream.
"""

from __future__ import annotations

import torch

from rlflow.agents.ppo import PPOConfig, train
from rlflow.agents.real_env import encode, run_episode, run_episodes
from rlflow.env.dream import DreamEnv
from rlflow.nn.policy import HierarchicalPolicy


def train_in_dream(world_model, start_z, start_metrics, start_counts, reward, cfg: PPOConfig, updates: int,
                   num_envs: int, max_steps: int, max_locations: int, temperature: float, hidden: int = 128,
                   seed: int = 0, on_update=None, policy: HierarchicalPolicy | None = None):
    """Train (or continue training ``policy``) in the dream; returns (policy, dream env)."""
    gen = torch.Generator().manual_seed(seed)
    dream = DreamEnv(world_model, start_z, start_metrics, start_counts, reward, max_steps, max_locations,
                     temperature, num_envs, generator=gen)
    if policy is None:
        policy = HierarchicalPolicy(start_z.shape[-1] + world_model.hidden_size, dream.n_xfers, max_locations,
                                    hidden)
    world_model.eval()
    train(dream, policy, cfg, updates, gen, on_update)
    return policy, dream


@torch.no_grad()
def run_in_real_env(policy, encoder, world_model, env, device: str = "cpu", greedy: bool = True, seed: int = 0,
                    episodes: int = 1):
    """``episodes`` real episodes with the controller from the original graph (see
    :func:`rlflow.agents.real_env.run_episodes`: the first greedy unless ``greedy`` is False, the others sampled;
    the best episode, with ``steps`` counting the real steps of all of them)."""
    return run_episodes(lambda g, gen: _controller_episode(policy, encoder, world_model, env, device, g, gen),
                        episodes, greedy, seed)


def _controller_episode(policy, encoder, world_model, env, device: str, greedy: bool, gen: torch.Generator) -> dict:
    """One real episode: z from the encoder on the real graph, h the world model's LSTM state advanced with
    (z, action) after every step exactly as in the dream."""
    state = {"hidden": world_model.initial_hidden(1), "z": None}

    def choose(obs, xm, lm):
        state["z"] = encode(encoder, [obs], device)
        x = torch.cat([state["z"], state["hidden"][0][0]], dim=-1)
        xfer, loc, _, _ = policy.act(x, xm, lm, generator=gen, greedy=greedy)
        return int(xfer[0]), int(loc[0])

    def after_step(obs, action):
        out = world_model.step(state["z"], torch.tensor([action]), state["hidden"])
        state["hidden"] = out.hidden

    return run_episode(env, choose, after_step)
