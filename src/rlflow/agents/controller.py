"""RLFlow's controller in the real environment (trained only in the dream by rlflow.agents.driver: PPO with the
hierarchical masked heads on input [z, h]): run from the original graph, keeping the best graph seen: one
greedy episode, or (``episodes`` > 1, config ``controller.eval_episodes``) that one and sampled ones, the best
graph of all kept and every real step counted as an interaction.

In the real run, z is the encoder's embedding of the real graph and h the world model's LSTM state, advanced
with (z, action, the graph's match counts) after every step exactly as in the dream.

Planning (config ``controller.plan``): at every real step the world model also predicts, for each rewrite the
real graph offers, the runtime saving it expects (its probability that the metrics change times the relative
saving it predicts). When the policy's choice is expected to save less than ``controller.plan_min_saving`` and
another rewrite more, the controller takes the rewrite with the largest expected saving instead. A rule whose
planned step did not lower the real runtime is not planned again in that episode: the real environment's
answer corrects the model. The policy learnt in the dream what the world model's one-step rewards cannot show
(the cost-neutral steps of a chain); the plan takes the savings at the end of a chain that the dream, having
never predicted such a rewrite possible there, never taught the policy (issue K's three-step fold of the
attention scale). Planning uses no real interaction beyond the steps taken, and every step still counts.
"""

from __future__ import annotations

import torch

from rlflow.agents.real_env import encode, mask_tensors, run_episode, run_episodes


@torch.no_grad()
def run_in_real_env(policy, encoder, world_model, env, device: str = "cpu", greedy: bool = True, seed: int = 0,
                    episodes: int = 1, no_revisit: bool = False, plan_min_saving: float | None = None):
    """``episodes`` real episodes with the controller from the original graph (see
    :func:`rlflow.agents.real_env.run_episodes`: the first greedy unless ``greedy`` is False, the others sampled;
    the best episode, with ``steps`` counting the real steps of all of them; ``no_revisit``: see
    :func:`rlflow.agents.real_env.run_episode`; ``plan_min_saving``: plan with the world model, see the module
    docstring; None: the policy alone)."""
    return run_episodes(lambda g, gen: _controller_episode(policy, encoder, world_model, env, device, g, gen,
                                                           no_revisit, plan_min_saving), episodes, greedy, seed)


class ControllerActor:
    """The controller acting in a real environment, one episode after another: :meth:`reset` at the start of each,
    :meth:`act` on each observation, :meth:`observe` after each step (z from the encoder on the real graph, h the
    world model's LSTM state advanced with (z, action, counts), exactly as in the dream; the counts are the real
    graph's, capped at max_locations as in the world model's data). With ``plan_min_saving`` it plans one step
    with the world model (the module docstring)."""

    def __init__(self, policy, encoder, world_model, device: str, greedy: bool, generator: torch.Generator,
                 plan_min_saving: float | None = None):
        self.policy, self.encoder, self.wm = policy, encoder, world_model
        self.device, self.greedy, self.generator = device, greedy, generator
        self.plan_min_saving = plan_min_saving
        self.reset()

    def reset(self) -> None:
        self.hidden, self.z, self.counts, self._obs = self.wm.initial_hidden(1), None, None, None
        self.distrusted: set[int] = set()  # rules whose planned step did not lower the real runtime (this episode)
        self.planned: int | None = None    # the rule of the step just planned, until its outcome is seen
        self.planned_steps = 0

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
        chosen = int(xfer[0]), int(loc[0])
        if self.plan_min_saving is not None:
            return self._plan(obs, location_mask, chosen)
        return chosen

    def _plan(self, obs, location_mask: torch.Tensor, chosen: tuple[int, int]) -> tuple[int, int]:
        """``chosen`` unless another rewrite of the real graph is expected to save at least plan_min_saving of
        the runtime and ``chosen`` is not; then the one expected to save the most (rules distrusted this episode
        left out)."""
        self.planned = None
        pairs = location_mask[0, :-1].nonzero()                      # [P, 2] (rule, location), the NO-OP left out
        if len(pairs) == 0:
            return chosen
        saving = self.expected_saving(obs, pairs)                    # [P]
        own = (pairs[:, 0] == chosen[0]) & (pairs[:, 1] == chosen[1])
        if bool(own.any()) and float(saving[own][0]) >= self.plan_min_saving:
            return chosen
        if self.distrusted:
            trusted = torch.tensor([int(r) not in self.distrusted for r in pairs[:, 0]])
            saving = torch.where(trusted, saving, torch.zeros_like(saving))
        best = int(saving.argmax())
        if float(saving[best]) < self.plan_min_saving:
            return chosen
        self.planned, self.planned_steps = int(pairs[best, 0]), self.planned_steps + 1
        return int(pairs[best, 0]), int(pairs[best, 1])

    @torch.no_grad()
    def expected_saving(self, obs, pairs: torch.Tensor) -> torch.Tensor:
        """The runtime saving the world model expects, as a share of the real graph's runtime, for each of the
        rewrites ``pairs`` [P, 2] (rule, location) from the current state: [P]; its probability that the metrics
        change times 1 - predicted runtime / runtime (negative: it expects the runtime to rise)."""
        P = len(pairs)
        hidden = tuple(t.expand(-1, P, -1).contiguous() for t in self.hidden)
        out = self.wm.step(self.z.expand(P, -1), pairs, self.counts.expand(P, -1), hidden)
        metrics = torch.as_tensor(obs["global"], dtype=torch.float64).expand(P, -1)
        runtime = metrics[:, 0]
        after = self.wm.metrics_after(metrics, out.deltas.double())[:, 0]
        return (torch.sigmoid(out.changed.double()) * (1.0 - after / runtime)).float()

    @torch.no_grad()
    def observe(self, action, obs=None) -> None:
        """After the real step ``action``, which gave ``obs``: the world model's state advances; a planned step
        that did not lower the real runtime makes its rule distrusted for the rest of the episode."""
        if self.planned is not None and obs is not None and float(obs["global"][0]) >= float(self._obs["global"][0]):
            self.distrusted.add(self.planned)
        self.planned = None
        self.hidden = self.wm.step(self.z, torch.tensor([action]), self.counts, self.hidden).hidden


def _controller_episode(policy, encoder, world_model, env, device: str, greedy: bool, gen: torch.Generator,
                        no_revisit: bool = False, plan_min_saving: float | None = None) -> dict:
    """One real episode of the controller (:class:`ControllerActor`), with ``planned_steps`` (how many steps
    the plan chose) added."""
    actor = ControllerActor(policy, encoder, world_model, device, greedy, gen, plan_min_saving)
    run = run_episode(env, actor.act, lambda obs, action: actor.observe(action, obs), no_revisit)
    return {**run, "planned_steps": actor.planned_steps}
