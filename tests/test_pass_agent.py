"""XLA pass-ordering agents and baselines on the env's tiny default module (real XLA passes)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

if importlib.util.find_spec("jax") is None or importlib.util.find_spec("xla_plugins.xla_cpu_pjrt") is None:
    pytest.skip("jax / xla-cpu-pjrt not installed", allow_module_level=True)

import torch  # noqa: E402

from rlflow.agents.pass_agent import (default_pipeline, geomean_ratio, greedy, load_pass_agent,  # noqa: E402
                                      random_orders, reduction_ratio, run_agent, train_ppo)
from rlflow.agents.ppo import PPOConfig  # noqa: E402
from rlflow.env.xla_pass_order import XlaPassOrderEnv  # noqa: E402
from rlflow.errors import RLFlowError  # noqa: E402


@pytest.fixture(scope="module")
def env():
    e = XlaPassOrderEnv(max_steps=3)
    yield e
    e.close()


def test_metric():
    assert reduction_ratio(100, 80, 90) == pytest.approx(2.0)
    assert reduction_ratio(100, 80, 100) is None
    assert geomean_ratio([2.0, 0.5, None]) == pytest.approx(1.0)
    assert geomean_ratio([2.0, 0.0]) == 0.0 and geomean_ratio([None]) is None


def test_baselines_reduce_ops(env):
    obs, info = env.reset(options={"module": 0})
    n0 = info["op_count"]
    d = default_pipeline(env, 0)
    assert d.ops < n0
    g = greedy(env, 0, max_steps=1)
    assert g.ops < n0 and len(g.passes) == 1
    r = random_orders(env, 0, 1, np.random.default_rng(0))
    assert 0 < r.ops <= n0


@pytest.mark.parametrize("variant", ["plain", "shaped_costvf"])
def test_ppo_trains_saves_and_runs(env, variant, tmp_path):
    cfg = PPOConfig(steps_per_update=6, minibatch=3, update_epochs=1)
    shaping = {"flops": 1.0, "transcendentals": 1.0}
    agent = train_ppo(env, variant, cfg, updates=1, seed=0, shaping=shaping)
    assert env.shaping == ({} if variant == "plain" else shaping)
    assert agent.returns and agent.policy.value_sees_cost == (variant == "shaped_costvf")
    torch.save(agent.state(), tmp_path / "agent.pt")
    loaded = load_pass_agent(tmp_path / "agent.pt")
    out = run_agent(env, loaded, 0)
    assert out.ops <= env.op_count(env.start) and out.text.startswith("HloModule")


def test_policy_never_picks_a_spent_pass(env):
    from rlflow.agents.pass_agent import PassPolicy
    from rlflow.xla.hlo import COST_FEATURES

    n_op, n_pass = len(env.opcodes), len(env.passes)
    torch.manual_seed(0)
    policy = PassPolicy(n_op, len(COST_FEATURES), n_pass + 1, hidden=8)
    obs = torch.rand(2, n_op + n_pass + 1 + len(COST_FEATURES))
    obs[:, n_op:n_op + n_pass] = 0.0
    obs[0, n_op:n_op + n_pass] = 1.0          # every pass spent: only stop is left
    obs[1, n_op + 3] = obs[1, n_op + 5] = 1.0  # passes 3 and 5 spent
    with torch.no_grad():
        dist, value = policy(obs)
    assert value.shape == (2,)
    assert dist.probs[0, -1] == pytest.approx(1.0)
    assert dist.probs[1, 3] == 0.0 and dist.probs[1, 5] == 0.0 and dist.probs[1, -1] > 0.0
    assert torch.isfinite(dist.entropy()).all()


def test_bad_variant_and_checkpoint(env, tmp_path):
    with pytest.raises(RLFlowError, match="unknown variant"):
        train_ppo(env, "nope", PPOConfig(), 1)
    torch.save({"kind": "other"}, tmp_path / "x.pt")
    with pytest.raises(RLFlowError, match="not an XLA pass agent"):
        load_pass_agent(tmp_path / "x.pt")
