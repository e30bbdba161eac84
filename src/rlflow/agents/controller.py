"""RLFlow's controller in the real environment (trained only in the dream by rlflow.agents.driver: PPO with the
hierarchical masked heads on input [z, h]): run from the original graph, keeping the best graph seen: one
greedy episode, or (``episodes`` > 1, config ``controller.eval_episodes``) that one and sampled ones, the best
graph of all kept and every real step counted as an interaction.

In the real run, z is the encoder's embedding of the real graph and h the world model's LSTM state, advanced
with (z, action) after every step exactly as in the dream.
"""

from __future__ import annotations

import torch

from rlflow.agents.real_env import encode, run_episode, run_episodes


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
