"""RLFlow's controller in the real environment (trained only in the dream by rlflow.agents.driver: PPO with the
hierarchical masked heads on input [z, h]): run from the original graph, keeping the best graph seen: one
greedy episode, or (``episodes`` > 1, config ``controller.eval_episodes``) that one and sampled ones, the best
graph of all kept and every real step counted as an interaction.

In the real run, z is the encoder's embedding of the real graph and h the world model's LSTM state, advanced
with (z, action, the graph's match counts) after every step exactly as in the dream.
"""

from __future__ import annotations

import torch

from rlflow.agents.real_env import encode, mask_tensors, run_episode, run_episodes


@torch.no_grad()
def run_in_real_env(policy, encoder, world_model, env, device: str = "cpu", greedy: bool = True, seed: int = 0,
                    episodes: int = 1, no_revisit: bool = False):
    """``episodes`` real episodes with the controller from the original graph (see
    :func:`rlflow.agents.real_env.run_episodes`: the first greedy unless ``greedy`` is False, the others sampled;
    the best episode, with ``steps`` counting the real steps of all of them; ``no_revisit``: see
    :func:`rlflow.agents.real_env.run_episode`)."""
    return run_episodes(lambda g, gen: _controller_episode(policy, encoder, world_model, env, device, g, gen,
                                                           no_revisit), episodes, greedy, seed)


class ControllerActor:
    """The controller acting in a real environment, one episode after another: :meth:`reset` at the start of each,
    :meth:`act` on each observation, :meth:`observe` after each step (z from the encoder on the real graph, h the
    world model's LSTM state advanced with (z, action, counts), exactly as in the dream; the counts are the real
    graph's, capped at max_locations as in the world model's data)."""

    def __init__(self, policy, encoder, world_model, device: str, greedy: bool, generator: torch.Generator):
        self.policy, self.encoder, self.wm = policy, encoder, world_model
        self.device, self.greedy, self.generator = device, greedy, generator
        self.reset()

    def reset(self) -> None:
        self.hidden, self.z, self.counts, self._obs = self.wm.initial_hidden(1), None, None, None

    @torch.no_grad()
    def act(self, obs, xfer_mask: torch.Tensor | None = None, location_mask: torch.Tensor | None = None
            ) -> tuple[int, int]:
        """The action on the real graph ``obs``, chosen among those the masks allow (default: the graph's own;
        an episode that never revisits a graph passes narrower ones). The world model always gets the graph's
        own counts."""
        if obs is not self._obs:  # a second choice on the same graph reuses its z
            self._obs, self.z = obs, encode(self.encoder, [obs], self.device)
            self.counts = mask_tensors([obs])[1][:, :-1].sum(-1).float()  # [1, N]: valid locations, no NO-OP
        if xfer_mask is None or location_mask is None:
            xfer_mask, location_mask = mask_tensors([obs])
        x = torch.cat([self.z, self.hidden[0][0]], dim=-1)
        xfer, loc, _, _ = self.policy.act(x, xfer_mask, location_mask, generator=self.generator, greedy=self.greedy)
        return int(xfer[0]), int(loc[0])

    @torch.no_grad()
    def observe(self, action) -> None:
        self.hidden = self.wm.step(self.z, torch.tensor([action]), self.counts, self.hidden).hidden


def _controller_episode(policy, encoder, world_model, env, device: str, greedy: bool, gen: torch.Generator,
                        no_revisit: bool = False) -> dict:
    """One real episode of the controller (:class:`ControllerActor`)."""
    actor = ControllerActor(policy, encoder, world_model, device, greedy, gen)
    return run_episode(env, actor.act, lambda obs, action: actor.observe(action), no_revisit)
