"""The dream environment: steps the world model only, masks from predicted counts, rewards from predicted
metrics, horizon, and PPO trained in it never touches the real environment."""

from __future__ import annotations

import pytest
import torch

from rlflow.env.dream import DreamEnv
from rlflow.env.rewards import make_reward
from rlflow.errors import RLFlowError
from rlflow.nn.mdnrnn import MDNRNN

Z, N, L = 6, 5, 4


def make_dream(num_envs=8, max_steps=5, reward="delta", temperature=1.0, seed=0):
    torch.manual_seed(seed)
    wm = MDNRNN(Z, N, L, hidden=16, gaussians=3)
    counts = torch.tensor([2.0, 0.0, 7.0, 1.0, 0.0])
    return DreamEnv(wm, torch.randn(Z), torch.tensor([10.0, 1e6, 1e5, 20.0]), counts, make_reward(reward),
                    max_steps=max_steps, max_locations=L, temperature=temperature, num_envs=num_envs,
                    generator=torch.Generator().manual_seed(seed))


def test_reset_masks_follow_the_start_counts():
    env = make_dream()
    obs = env.reset()
    assert obs["features"].shape == (8, Z + 16)
    assert obs["xfer_mask"][0].tolist() == [True, False, True, True, False, True]
    assert obs["location_count"][0].tolist() == [2, 0, 4, 1, 0, 1]  # counts capped at L; NO-OP one
    assert "location_mask" not in obs  # never built on the hot path
    xm, lm = env.masks()  # the dense form, on demand: prefixes of the counts
    assert torch.equal(xm, obs["xfer_mask"])
    assert lm[0].sum(-1).tolist() == [2, 0, 4, 1, 0, 1] and lm[0, 2].all() and lm[0, 0].tolist() == [1, 1, 0, 0]


def test_valid_follows_the_counts_and_policy_samples_are_always_valid():
    from rlflow.nn.policy import HierarchicalPolicy

    env = make_dream(num_envs=64, max_steps=6, seed=2)
    obs = env.reset()
    # a location at or past the rule's count is invalid (penalty), one before it is valid
    _, reward, _ = env.step_batch(torch.full((64,), 2), torch.full((64,), 3))  # rule 2: 7 matches, L = 4
    assert (reward != env.reward_fn.invalid_penalty).all()
    env.reset()
    _, reward, _ = env.step_batch(torch.zeros(64, dtype=torch.long), torch.full((64,), 2))  # rule 0: 2 locations
    assert (reward == env.reward_fn.invalid_penalty).all()
    pol = HierarchicalPolicy(Z + 16, N, L, hidden=16)
    gen = torch.Generator().manual_seed(0)
    obs = env.reset()
    for _ in range(30):
        xfer, loc, _, _ = pol.act(obs["features"], obs["xfer_mask"], obs["location_count"], generator=gen)
        assert obs["xfer_mask"][torch.arange(64), xfer].all()
        assert (loc < obs["location_count"][torch.arange(64), xfer]).all()
        obs, reward, _ = env.step_batch(xfer, loc)
        assert (reward != env.reward_fn.invalid_penalty).all()


def test_noop_ends_and_restarts_invalid_gets_penalty_horizon_truncates():
    env = make_dream(num_envs=3, max_steps=2, reward={"name": "delta", "invalid_penalty": -7})
    obs0 = env.reset()
    xfer = torch.tensor([N, 1, 0])  # NO-OP, a rule without a match, a valid rule
    loc = torch.tensor([0, 0, 1])
    obs, reward, done = env.step_batch(xfer, loc)
    assert done.tolist()[0] is True and reward[0] == 0
    assert reward[1] == -7 and torch.equal(obs["features"][1], obs0["features"][1])  # unchanged
    assert torch.equal(obs["features"][0], obs0["features"][0])  # restarted
    _, _, done = env.step_batch(torch.tensor([N, 1, 0]), torch.tensor([0, 0, 0]))
    assert done[1]  # copy 1 (two invalid actions) reached the horizon of 2 steps


def test_reward_is_the_reward_class_on_predicted_metrics():
    env = make_dream(num_envs=4, reward="normalised")
    env.reset()
    before = env.metrics.clone()
    _, reward, _ = env.step_batch(torch.tensor([0, 2, 3, 0]), torch.tensor([0, 3, 0, 1]))
    after = env.metrics  # copies that did not end keep the predicted metrics
    for b in range(4):
        if env.steps[b] == 1:
            want = (before[b, 0] - after[b, 0]) / before[b, 0] * 100
            assert reward[b].item() == pytest.approx(want.item(), rel=1e-4)


def test_e2e_reward_and_bad_temperature_are_refused():
    with pytest.raises(RLFlowError, match="real latency"):
        make_dream(reward="e2e")
    with pytest.raises(RLFlowError, match="temperature"):
        make_dream(temperature=0.0)


def test_temperature_changes_the_spread_of_imagined_latents():
    def spread(tau):
        env = make_dream(num_envs=256, temperature=tau, seed=3)
        env.reset()
        env.step_batch(torch.zeros(256, dtype=torch.long), torch.zeros(256, dtype=torch.long))
        return env.z.std(0).mean().item()

    assert spread(0.1) < spread(1.0) < spread(3.0)


def test_ppo_in_the_dream_never_touches_the_real_env(monkeypatch):
    from rlflow.agents.ppo import PPOConfig, train
    from rlflow.env.graph_rewrite import GraphRewriteEnv
    from rlflow.nn.policy import HierarchicalPolicy
    from rlflow.rewrite import matcher

    def boom(*a, **k):
        raise AssertionError("the dream called the real environment")

    monkeypatch.setattr(GraphRewriteEnv, "step", boom)
    monkeypatch.setattr(GraphRewriteEnv, "reset", boom)
    monkeypatch.setattr(matcher.MatchIndex, "apply", boom)
    monkeypatch.setattr(matcher, "find_matches", boom)
    env = make_dream(num_envs=4)
    pol = HierarchicalPolicy(Z + 16, N, L, hidden=16)
    train(env, pol, PPOConfig(steps_per_update=6, minibatch=8), updates=2, generator=torch.Generator().manual_seed(0))
    assert env.steps_taken == 2 * 6 * 4


def test_a_step_predicted_to_change_nothing_keeps_the_metrics_and_earns_nothing():
    """Zero-inflated deltas in the dream: where the world model says a move changes no metric (a cost-neutral
    rewrite), the metrics stay exactly as they were and the reward is 0, whatever the delta head says."""
    env = make_dream(num_envs=16, max_steps=5)
    with torch.no_grad():
        env.wm.delta_head.bias.fill_(-3.0)  # the delta head alone would predict a large saving
        env.wm.change_head.weight.zero_()
        env.wm.change_head.bias.fill_(-50.0)
    obs0 = env.reset()
    obs, reward, _ = env.step_batch(torch.full((16,), 2), torch.zeros(16, dtype=torch.long))  # a valid rule
    assert torch.equal(obs["metrics"], obs0["metrics"]) and (reward == 0).all()
    with torch.no_grad():
        env.wm.change_head.bias.fill_(50.0)  # now every move changes the metrics
    env.reset()
    obs, reward, _ = env.step_batch(torch.full((16,), 2), torch.zeros(16, dtype=torch.long))
    assert (obs["metrics"][:, 0] < obs0["metrics"][:, 0]).all() and (reward > 0).all()


def test_the_ensemble_disagreement_is_subtracted_from_the_dream_reward():
    """Members that disagree about a step's reward: the dream pays mean reward - penalty x their spread, and
    reports the mean spread; with penalty 0 the reward is the combined model's."""
    from rlflow.nn.mdnrnn import EnsembleMDNRNN

    def dream(penalty):
        torch.manual_seed(0)
        wm = EnsembleMDNRNN(3, z_dim=Z, n_xfers=N, max_locations=L, hidden=16, gaussians=2)
        with torch.no_grad():
            for k, m in enumerate(wm.members):
                m.delta_head.weight.zero_()
                m.delta_head.bias.fill_(-1.0 * k)  # member 0: no saving, 1 and 2: growing savings
                m.change_head.weight.zero_()
                m.change_head.bias.fill_(50.0)     # every member: the move changes the metrics
        counts = torch.tensor([2.0, 0.0, 7.0, 1.0, 0.0])
        return DreamEnv(wm, torch.randn(Z), torch.tensor([10.0, 1e6, 1e5, 20.0]), counts, make_reward("delta"),
                        max_steps=5, max_locations=L, num_envs=4, generator=torch.Generator().manual_seed(0),
                        disagreement_penalty=penalty)

    rewards = {}
    for penalty in (0.0, 1.0):
        env = dream(penalty)
        env.reset()
        _, rewards[penalty], _ = env.step_batch(torch.full((4,), 2), torch.zeros(4, dtype=torch.long))
        spread = env.mean_disagreement()
        assert spread is not None and spread > 0
    assert torch.allclose(rewards[1.0], rewards[0.0] - spread, atol=1e-5)
    with pytest.raises(RLFlowError, match="penalty"):
        dream(-1.0)


def test_a_used_up_rule_does_not_creep_back_through_small_predicted_changes():
    """The dream carries whole match counts. A count head that adds +0.2 to every rule at every step (a small
    bias) must not bring a used-up rule (count 0) back into the masks, however many steps it runs: carried as
    fractions, 0 -> 0.27 -> 0.47 -> 0.67 would offer it again at the third step (0.07 of it the smooth max's
    offset). A change of at least half a match still counts: +0.6 opens the rule at once."""
    for bias, opened_at in ((0.2, None), (0.6, 1)):
        env = make_dream(num_envs=4, max_steps=20)
        with torch.no_grad():
            env.wm.count_change_head.weight.zero_()
            env.wm.count_change_head.bias.fill_(bias)
            env.wm.done_head.weight.zero_()
            env.wm.done_head.bias.fill_(-50.0)  # never a predicted done
        obs = env.reset()
        assert not obs["xfer_mask"][:, 1].any()  # rule 1 starts used up
        first = None
        for step in range(1, 12):
            obs, _, _ = env.step_batch(torch.full((4,), 2), torch.zeros(4, dtype=torch.long))  # rule 2: 7 matches
            if first is None and obs["xfer_mask"][:, 1].all():
                first = step
            assert torch.equal(env.counts, env.counts.round())
        assert first == opened_at


def test_a_branched_episode_starts_from_a_real_state_with_its_step_and_lstm_state():
    """With ``branch`` 1 every copy starts from one of the given real states: its z, metrics, counts (so its
    masks), its LSTM state and its step, so the horizon counts from there (a state at step 4 of a 5-step horizon
    has one step left). With ``branch`` 0 the copies start from the first graph, as before."""
    from rlflow.env.dream import DreamStarts

    H = 16
    starts = DreamStarts(z=torch.arange(2 * Z, dtype=torch.float32).view(2, Z),
                         metrics=torch.tensor([[9.0, 1e6, 1e5, 19.0], [8.0, 1e6, 1e5, 18.0]], dtype=torch.float64),
                         counts=torch.tensor([[0.0, 3.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0]]),
                         steps=torch.tensor([4, 2]), h=torch.full((2, H), 0.5), c=torch.full((2, H), -0.5))
    env = make_dream(num_envs=32, max_steps=5)
    env.starts, env.branch = starts, 1.0
    obs = env.reset()
    first = (obs["features"][:, :Z] == starts.z[0]).all(-1)
    assert first.any() and (~first).any()  # both states drawn
    assert torch.equal(obs["features"][~first, :Z], starts.z[1].expand(int((~first).sum()), -1))
    assert obs["xfer_mask"][first].tolist()[0] == [False, True, False, False, True, True]
    assert obs["location_count"][first].tolist()[0] == [0, 3, 0, 0, 1, 1]
    assert torch.equal(obs["features"][:, Z:], torch.full((32, H), 0.5))  # the real steps' LSTM state
    assert torch.equal(env.hidden[1][0], torch.full((32, H), -0.5))
    assert torch.equal(env.metrics[first, 0], torch.full((int(first.sum()),), 9.0, dtype=torch.float64))
    assert env.steps[first].eq(4).all() and env.steps[~first].eq(2).all()
    with torch.no_grad():
        env.wm.done_head.bias.fill_(-50.0)  # no predicted done: only the horizon ends an episode
        env.wm.done_head.weight.zero_()
    xfer = torch.where(first, 1, 0)  # a rule each state has a match of
    _, _, done = env.step_batch(xfer, torch.zeros(32, dtype=torch.long))
    assert torch.equal(done, first)  # step 4 -> 5: the horizon; step 2 -> 3: not yet

    env = make_dream(num_envs=8, max_steps=5)
    obs = env.reset()
    assert torch.equal(obs["features"][:, :Z], env.start_z.expand(8, -1)) and env.steps.eq(0).all()
    with pytest.raises(RLFlowError, match="branch probability"):
        DreamEnv(env.wm, env.start_z, env.start_metrics, env.start_counts, make_reward("delta"), 5, L, branch=1.5,
                 starts=starts)
    with pytest.raises(RLFlowError, match="none were given"):
        DreamEnv(env.wm, env.start_z, env.start_metrics, env.start_counts, make_reward("delta"), 5, L, branch=0.5)
