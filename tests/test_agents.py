"""The controller (trained in the dream, run in the real env) and the model-free baseline, end to end on a
tiny model with untrained networks: shapes, interaction counting, best-graph bookkeeping, validity."""

from __future__ import annotations

import pytest
import torch

from rlflow.agents.controller import run_in_real_env, train_in_dream
from rlflow.agents.model_free import run_model_free, train_model_free
from rlflow.agents.ppo import PPOConfig
from rlflow.cost import AnalyticCost, METRIC_NAMES
from rlflow.env import GraphRewriteEnv
from rlflow.env.observation import MAX_RANK, NODE_FEATURES
from rlflow.env.rewards import make_reward
from rlflow.graph import load_onnx
from rlflow.nn.encoder import GraphEncoder
from rlflow.nn.mdnrnn import MDNRNN
from rlflow.rewrite import load_rules


@pytest.fixture(scope="module")
def setting(tiny_zoo, rules_file):
    torch.manual_seed(0)
    rules = load_rules(rules_file)
    graph = load_onnx(tiny_zoo["bert"])
    make = lambda: GraphRewriteEnv(graph, rules, AnalyticCost("cpu"), reward={"name": "normalised"},  # noqa: E731
                                   max_steps=4, max_locations=8)
    encoder = GraphEncoder(NODE_FEATURES, MAX_RANK, hidden=8, layers=1, heads=1, z_dim=6, n_xfers=len(rules))
    wm = MDNRNN(6, len(rules), 8, hidden=12, gaussians=2)
    return make, encoder, wm, rules


def test_controller_trains_in_the_dream_and_runs_in_the_real_env(setting):
    make, encoder, wm, rules = setting
    env = make()
    obs, info = env.reset()
    from rlflow.agents.real_env import encode

    z0 = encode(encoder, [obs])[0]
    metrics0 = torch.tensor([info[k] for k in METRIC_NAMES])
    counts0 = torch.from_numpy(env.counts()).float()
    policy, dream = train_in_dream(wm, z0, metrics0, counts0, make_reward("normalised"), PPOConfig(steps_per_update=4,
                                   minibatch=8), updates=2, num_envs=3, max_steps=4, max_locations=8, temperature=1.5)
    assert dream.steps_taken == 2 * 4 * 3
    result = run_in_real_env(policy, encoder, wm, env)
    assert 1 <= result["steps"] <= 4 and len(result["metrics"]) == result["steps"] + 1
    assert result["best"]["runtime_ms"] <= result["initial"]["runtime_ms"]
    assert result["best_graph"].structural_hash() is not None


def test_model_free_counts_every_real_interaction(setting):
    make, encoder, wm, rules = setting
    policy, venv = train_model_free([make(), make()], encoder, PPOConfig(steps_per_update=3, minibatch=4), updates=2,
                                    z_dim=6)
    assert venv.interactions == 2 * 3 * 2
    result = run_model_free(policy, encoder, make())
    assert result["best"]["runtime_ms"] <= result["initial"]["runtime_ms"]
