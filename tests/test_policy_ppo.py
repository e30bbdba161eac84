"""The hierarchical masked policy and PPO's pure parts (GAE, clipped loss)."""

from __future__ import annotations

import pytest
import torch

from rlflow.agents.ppo import gae, ppo_loss
from rlflow.nn.policy import HierarchicalPolicy, masked_entropy


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
