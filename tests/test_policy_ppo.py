"""The hierarchical masked policy and PPO's pure parts (GAE, clipped loss)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlflow.agents.ppo import gae, ppo_loss
from rlflow.nn.mdnrnn import MDNRNN
from rlflow.nn.policy import HierarchicalPolicy, location_rows, masked_entropy


def random_masks(gen, B, N1, L):
    counts = torch.randint(0, L + 3, (B, N1), generator=gen) * (torch.rand(B, N1, generator=gen) < 0.3)
    counts[:, -1] = 1  # the NO-OP: one location
    loc = (torch.arange(L)[None, None, :] < counts.clamp(max=L)[..., None])
    return counts > 0, loc


def test_masked_sampling_never_picks_an_invalid_action():
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    pol = HierarchicalPolicy(in_dim=8, n_xfers=12, max_locations=5)
    for _ in range(50):
        xm, lm = random_masks(gen, 64, 13, 5)
        x = torch.randn(64, 8, generator=gen) * 5
        xfer, loc, logp, value = pol.act(x, xm, lm, generator=gen)
        assert xm[torch.arange(64), xfer].all()
        assert lm[torch.arange(64), xfer, loc].all()
        assert torch.isfinite(logp).all() and value.shape == (64,)
        g_xfer, g_loc, _, _ = pol.act(x, xm, lm, greedy=True)
        assert xm[torch.arange(64), g_xfer].all() and lm[torch.arange(64), g_xfer, g_loc].all()


def test_location_counts_are_the_dense_masks_prefix_form():
    """The dream gives counts [B, N1] instead of dense masks: same rows, same sampling, same log-probabilities."""
    gen = torch.Generator().manual_seed(2)
    xm, lm = random_masks(gen, 64, 13, 5)
    counts = lm.sum(-1)                                   # random_masks builds prefix rows, like the envs
    for k in range(13):
        xfer = torch.full((64,), k)
        assert torch.equal(location_rows(counts, xfer, 5), lm[:, k])
    with pytest.raises(TypeError):
        location_rows(counts.float(), xfer, 5)
    torch.manual_seed(0)
    pol = HierarchicalPolicy(in_dim=8, n_xfers=12, max_locations=5)
    x = torch.randn(64, 8, generator=gen) * 5
    for _ in range(30):
        xfer, loc, logp, _ = pol.act(x, xm, counts, generator=gen)
        assert xm[torch.arange(64), xfer].all() and lm[torch.arange(64), xfer, loc].all()
        assert (loc < counts[torch.arange(64), xfer]).all()
        for form in (counts, lm):
            logp2, ent, _ = pol.evaluate(x, xfer, loc, xm, form)
            assert torch.allclose(logp, logp2, atol=1e-6)
    g1 = pol.act(x, xm, counts, greedy=True)
    g2 = pol.act(x, xm, lm, greedy=True)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_evaluate_matches_act_log_probability():
    gen = torch.Generator().manual_seed(1)
    pol = HierarchicalPolicy(in_dim=4, n_xfers=6, max_locations=3)
    xm, lm = random_masks(gen, 16, 7, 3)
    x = torch.randn(16, 4, generator=gen)
    xfer, loc, logp, _ = pol.act(x, xm, lm, generator=gen)
    logp2, ent, _ = pol.evaluate(x, xfer, loc, xm, lm)
    assert torch.allclose(logp, logp2, atol=1e-6)
    assert (ent >= -1e-6).all()


def test_masked_entropy_ignores_masked_entries():
    logits = torch.tensor([[0.0, 0.0, 5.0, -3.0]])
    mask = torch.tensor([[True, True, False, False]])
    assert masked_entropy(logits, mask).item() == pytest.approx(torch.log(torch.tensor(2.0)).item())


def test_gae_hand_computed():
    r = torch.tensor([1.0, 0.0, 2.0])
    v = torch.tensor([0.5, 0.2, 0.1])
    d = torch.tensor([0.0, 1.0, 0.0])
    adv, ret = gae(r, v, d, last_value=torch.tensor(0.3), gamma=0.9, lam=0.8)
    # t=2: 2 + 0.9*0.3 - 0.1 = 2.17 ; t=1 (episode ends): 0 - 0.2 = -0.2 ; t=0: 1 + 0.9*0.2 - 0.5 + 0.72*(-0.2)
    assert adv.tolist() == pytest.approx([0.68 - 0.144, -0.2, 2.17])
    assert torch.allclose(ret, adv + v)


def test_ppo_loss_clips_the_ratio():
    adv = torch.tensor([1.0, -1.0])
    old = torch.zeros(2)
    zero = torch.zeros(2)
    # ratio e^1 > 1.2 with positive advantage: clipped to 1.2; with negative advantage: min picks e^1 * -1
    loss, parts = ppo_loss(torch.ones(2), old, adv, zero, zero, zero, clip=0.2, c1=0.0, c2=0.0)
    assert parts["clip"] == pytest.approx((1.2 - torch.e) / 2, rel=1e-6)
    assert loss.item() == pytest.approx(-parts["clip"])
    assert parts["clip_fraction"] == 1.0


class MaskedBandit:
    """B copies of a one-step task: 4 rules + NO-OP, 3 locations; rule 2 at location 1 pays 1, other valid
    actions 0; rule 0 and (rule 3, location 2) are masked out. Every step ends the episode."""

    def __init__(self, num_envs: int):
        self.num_envs = num_envs
        xm = torch.tensor([False, True, True, True, True])
        lm = torch.ones(5, 3, dtype=torch.bool)
        lm[0] = False
        lm[3, 2] = False
        lm[4, 1:] = False
        self.obs = {"features": torch.ones(num_envs, 2), "xfer_mask": xm.repeat(num_envs, 1),
                    "location_mask": lm.repeat(num_envs, 1, 1)}

    def reset(self):
        return self.obs

    def step_batch(self, xfer, loc):
        assert self.obs["location_mask"][0][xfer, loc].all()  # never an invalid action
        reward = ((xfer == 2) & (loc == 1)).float()
        return self.obs, reward, torch.ones(self.num_envs, dtype=torch.bool)


def test_ppo_learns_the_best_valid_action():
    from rlflow.agents.ppo import PPOConfig, train

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    env = MaskedBandit(8)
    pol = HierarchicalPolicy(in_dim=2, n_xfers=4, max_locations=3, hidden=32)
    cfg = PPOConfig(lr=3e-3, steps_per_update=8, minibatch=16, c2=0.0)
    train(env, pol, cfg, updates=40, generator=gen)
    xfer, loc, _, _ = pol.act(env.obs["features"], env.obs["xfer_mask"], env.obs["location_mask"], greedy=True)
    assert xfer.tolist() == [2] * 8 and loc.tolist() == [1] * 8


class FakeRewriteEnv:
    """A stand-in real environment for the controller's evaluation: 3 rules + NO-OP, 2 locations each; rule 0
    lowers the runtime by 1, rule 1 raises it by 1, rule 2 leaves it; horizon 4. The 'graph' is the action
    history, so the best graph names the actions that reached it. It counts its steps in ``total_steps``, as the real
    environment does."""

    def __init__(self):
        self.xm = np.ones(4, np.int8)
        self.lm = np.ones((4, 2), np.int8)
        self.lm[3, 1] = 0
        self.total_steps = 0

    def _obs(self):
        return {"xfer_mask": self.xm, "location_mask": self.lm}

    def _info(self):
        return {"runtime_ms": self.runtime, "flops": 1.0, "bytes": 1.0, "launches": 1.0}

    def reset(self):
        self.runtime, self.graph, self.t = 10.0, (), 0
        return self._obs(), self._info()

    def step(self, action):
        self.total_steps += 1
        self.t += 1
        xfer, _ = action
        if xfer < 3:
            self.runtime += (-1.0, 1.0, 0.0)[xfer]
            self.graph = self.graph + (tuple(action),)
        return self._obs(), 0.0, xfer == 3, self.t >= 4, self._info()


def test_controller_evaluation_keeps_the_best_of_several_episodes_and_counts_every_real_step(monkeypatch):
    from rlflow.agents import controller

    monkeypatch.setattr(controller, "encode", lambda encoder, obs, device="cpu": torch.zeros(len(obs), 3))
    torch.manual_seed(0)
    wm = MDNRNN(3, 3, 2, hidden=5, gaussians=2)
    pol = HierarchicalPolicy(in_dim=3 + 5, n_xfers=3, max_locations=2, hidden=8)
    env = FakeRewriteEnv()
    one = controller.run_in_real_env(pol, None, wm, env)
    assert one["episodes"] == 1 and one["steps"] == env.total_steps
    env.total_steps = 0
    many = controller.run_in_real_env(pol, None, wm, env, episodes=6, seed=3)
    assert many["steps"] == env.total_steps == sum(many["episode_steps"]) and len(many["episode_steps"]) == 6
    assert many["episode_steps"][0] == one["steps"] and many["episode_best_runtime_ms"][0] == one["best"]["runtime_ms"]
    best = many["best"]["runtime_ms"]
    assert best == min(many["episode_best_runtime_ms"]) <= one["best"]["runtime_ms"]
    assert many["best_episode"] == many["episode_best_runtime_ms"].index(best)
    # the returned actions are the best episode's: replaying them up to best_step gives its best graph
    assert many["best_graph"] == tuple(tuple(a) for a in many["actions"][:many["best_step"]] if a[0] < 3)
    assert 10.0 - best == sum(1 for a in many["actions"][:many["best_step"]] if a[0] == 0) - \
        sum(1 for a in many["actions"][:many["best_step"]] if a[0] == 1)
    with pytest.raises(ValueError):
        controller.run_in_real_env(pol, None, wm, env, episodes=0)


def test_ppo_config_from_config_with_the_controllers_overrides():
    from rlflow.agents.ppo import PPOConfig

    ppo = {"lr": 0.001, "minibatch": 16, "hidden": 64}
    assert PPOConfig.from_config(ppo, 32).minibatch == 16
    cfg = PPOConfig.from_config(ppo, 32, minibatch=64, c2=None)
    assert (cfg.minibatch, cfg.lr, cfg.steps_per_update, cfg.c2) == (64, 0.001, 32, PPOConfig.c2)


def test_count_features_are_the_same_from_masks_and_counts_and_carry_what_z_does_not():
    """ppo.count_features: the networks also read log1p(valid locations per rule), from the real env's dense
    masks or the dream's counts alike; a value that depends only on those counts (the graph embedding the same
    for every state) is learnable with them and not without."""
    from rlflow.agents.ppo import PPOConfig

    gen = torch.Generator().manual_seed(3)
    xm, lm = random_masks(gen, 64, 13, 5)
    counts = lm.sum(-1)
    torch.manual_seed(0)
    pol = HierarchicalPolicy(in_dim=8, n_xfers=12, max_locations=5, count_features=True)
    x = torch.randn(64, 8, generator=gen)
    g1, g2 = pol.act(x, xm, counts, greedy=True), pol.act(x, xm, lm, greedy=True)
    assert all(torch.allclose(a.float(), b.float()) for a, b in zip(g1, g2))
    assert torch.allclose(pol.value(x, counts), pol.value(x, lm)) and torch.allclose(g1[3], pol.value(x, lm))
    with pytest.raises(ValueError, match="location count"):
        pol.value(x)
    assert PPOConfig.from_config({"hidden": 64, "count_features": True, "lr": 0.001}, 32).lr == 0.001

    same_z = torch.zeros(64, 8)
    target = torch.log1p(counts[:, 3].float()) - torch.log1p(counts[:, 7].float())  # e.g. fusions left - merges
    errors = {}
    for with_counts in (True, False):
        torch.manual_seed(0)
        p = HierarchicalPolicy(in_dim=8, n_xfers=12, max_locations=5, count_features=with_counts)
        opt = torch.optim.Adam(p.parameters(), lr=0.01)
        for _ in range(300):
            loss = ((p.value(same_z, counts) - target) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        errors[with_counts] = float(loss)
    assert errors[True] < 0.05 * float(target.var()) and errors[False] > 0.5 * float(target.var()), errors


class PlanningEnv(FakeRewriteEnv):
    """FakeRewriteEnv with the real graph's metrics in the observation (``global``), as the real environment gives
    them."""

    def _obs(self):
        return {**super()._obs(), "global": np.array([self.runtime, 1.0, 1.0, 1.0])}


class TableWorldModel:
    """A world model whose one-step predictions are a table per rule: the change of log1p(runtime) and the logit
    that the metrics change at all (rule 3 is the NO-OP)."""

    n_xfers = 3

    def __init__(self, log_change, changed_logit):
        self.log_change, self.changed_logit = torch.tensor(log_change), torch.tensor(changed_logit)

    def initial_hidden(self, batch):
        return torch.zeros(1, batch, 2), torch.zeros(1, batch, 2)

    def step(self, z, actions, counts, hidden):
        from types import SimpleNamespace

        rule = actions[..., 0].clamp(max=2)
        deltas = torch.zeros(len(rule), 4)
        deltas[:, 0] = self.log_change[rule]
        return SimpleNamespace(deltas=deltas, changed=self.changed_logit[rule], hidden=hidden)

    def metrics_after(self, metrics, deltas, changed=None):
        return torch.expm1(torch.log1p(metrics) + deltas)


class AlwaysPolicy:
    """A policy that always picks ``rule`` at location 0."""

    def __init__(self, rule):
        self.rule = rule

    def act(self, x, xfer_mask, location_mask, generator=None, greedy=True):
        return torch.tensor([self.rule]), torch.tensor([0]), None, None


def test_controller_plans_the_step_its_world_model_expects_to_save_and_distrusts_a_wrong_prediction(monkeypatch):
    """controller.plan: the world model predicts savings for rules 0 and 1 (1 the larger; in truth rule 1 raises
    the runtime) and none for rule 2, the policy's choice. Planning takes rule 1 once, sees the runtime rise,
    distrusts it, then takes rule 0, which pays; without planning the policy's neutral steps change nothing."""
    from rlflow.agents import controller

    monkeypatch.setattr(controller, "encode", lambda encoder, obs, device="cpu": torch.zeros(len(obs), 3))
    wm = TableWorldModel([-0.05, -0.10, 0.0], [5.0, 5.0, -5.0])
    alone = controller.run_in_real_env(AlwaysPolicy(2), None, wm, PlanningEnv())
    assert alone["best"]["runtime_ms"] == 10.0 and alone["planned_steps"] == 0
    planned = controller.run_in_real_env(AlwaysPolicy(2), None, wm, PlanningEnv(), plan_min_saving=1e-3)
    assert [a[0] for a in planned["actions"]] == [1, 0, 0, 0] and planned["planned_steps"] == 4
    assert planned["best"]["runtime_ms"] == 8.0 and planned["steps"] == 4
    # a saving below plan_min_saving is not planned (exp(-0.05) on log1p(10): about 4.7% of the runtime)
    assert controller.run_in_real_env(AlwaysPolicy(2), None, wm, PlanningEnv(), plan_min_saving=0.2)[
        "planned_steps"] == 0


def test_controller_keeps_its_own_choice_when_the_world_model_expects_it_to_save(monkeypatch):
    from rlflow.agents import controller

    monkeypatch.setattr(controller, "encode", lambda encoder, obs, device="cpu": torch.zeros(len(obs), 3))
    wm = TableWorldModel([-0.05, -0.10, 0.0], [5.0, 5.0, -5.0])
    run = controller.run_in_real_env(AlwaysPolicy(0), None, wm, PlanningEnv(), plan_min_saving=1e-3)
    assert [a[0] for a in run["actions"]] == [0, 0, 0, 0] and run["planned_steps"] == 0
    assert run["best"]["runtime_ms"] == 6.0
