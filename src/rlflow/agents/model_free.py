"""The model-free baseline in the real environment: the same PPO and hierarchical heads as the controller,
trained directly on real environments by rlflow.agents.driver, with the (trained, frozen) graph encoder's z of
the real graph as input (the RLFlow paper's model-free agent; X-RLflow's setting apart from the frozen
encoder)."""

from __future__ import annotations

import torch

from rlflow.agents.real_env import encode, run_episode, run_episodes


@torch.no_grad()
def run_model_free(policy, encoder, env, device: str = "cpu", greedy: bool = True, seed: int = 0, episodes: int = 1,
                   no_revisit: bool = False):
    """``episodes`` real episodes with the trained policy from the original graph, exactly as the controller is
    evaluated (:func:`rlflow.agents.real_env.run_episodes`: the first greedy, the others sampled; ``no_revisit``:
    see :func:`rlflow.agents.real_env.run_episode`)."""

    def one_episode(greedy_: bool, gen: torch.Generator) -> dict:
        z = {}  # a second choice on the same graph reuses its z

        def choose(obs, xm, lm):
            if z.get("obs") is not obs:
                z.update(obs=obs, z=encode(encoder, [obs], device))
            xfer, loc, _, _ = policy.act(z["z"], xm, lm, generator=gen, greedy=greedy_)
            return int(xfer[0]), int(loc[0])

        return run_episode(env, choose, no_revisit=no_revisit)

    return run_episodes(one_episode, episodes, greedy, seed)
