"""The rewrite environment rlflow/GraphRewrite-v0, its rewards, the random agent and the rollout files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import rlflow.env  # noqa: F401  (registers the env id)
from rlflow.agents.random_agent import RandomAgent
from rlflow.agents.rollouts import collect, replay
from rlflow.cost import AnalyticCost
from rlflow.env import ENV_ID, GraphRewriteEnv, make_reward
from rlflow.env.rewards import DeltaReward, EndToEndReward, NormalisedReward, WeightedReward
from rlflow.errors import RLFlowError
from rlflow.graph import load_onnx
from rlflow.rewrite import load_rules
from rlflow.rewrite.matcher import find_matches


@pytest.fixture(scope="module")
def bert(tiny_zoo):
    return load_onnx(tiny_zoo["bert"])


@pytest.fixture(scope="module")
def rules(rules_file):
    return load_rules(rules_file)


def make(graph, rules, **kw):
    kw.setdefault("reward", {"name": "delta"})
    return GraphRewriteEnv(graph, rules, AnalyticCost("cpu"), **kw)


def random_actions(env, n, seed=0):
    """n valid rewriting actions (no NO-OP) from a fresh episode, recorded while stepping."""
    agent = RandomAgent(0.0, np.random.default_rng(seed))
    obs, _ = env.reset()
    actions = []
    for _ in range(n):
        a = agent.act(obs["xfer_mask"], obs["location_mask"])
        if a[0] == env.noop:
            break
        obs, *_ = env.step(a)
        actions.append(a)
    return actions


# ------------------------------------------------------------------------------------------------ rewards
PREV = {"runtime_ms": 10.0, "flops": 100.0, "bytes": 5e6, "launches": 7, "latency_ratio": 0.5}
CUR = {"runtime_ms": 9.0, "flops": 100.0, "bytes": 3e6, "launches": 6, "latency_ratio": 0.375}
FIRST = {"runtime_ms": 20.0, "flops": 100.0, "bytes": 6e6, "launches": 9, "latency_ratio": 1.0}


def test_delta_reward():
    assert DeltaReward()(PREV, CUR, FIRST) == pytest.approx(1.0)
    assert DeltaReward()(CUR, PREV, FIRST) == pytest.approx(-1.0)


def test_weighted_reward():
    # 0.8 x (10 - 9) ms + 0.2 x (5e6 - 3e6) bytes / 1e6 = 0.8 + 0.4
    assert WeightedReward(0.8, 0.2)(PREV, CUR, FIRST) == pytest.approx(1.2)
    assert WeightedReward(1.0, 0.0)(PREV, CUR, FIRST) == pytest.approx(1.0)


def test_normalised_reward():
    assert NormalisedReward()(PREV, CUR, FIRST) == pytest.approx(5.0)  # 1 ms of 20 ms = 5 %


def test_e2e_reward():
    assert EndToEndReward(every=5)(PREV, CUR, FIRST) == pytest.approx(12.5)  # 0.5 -> 0.375 of the first latency


def test_make_reward_from_config():
    r = make_reward({"name": "weighted", "alpha": 0.5, "beta": 0.5, "invalid_penalty": -7})
    assert isinstance(r, WeightedReward) and (r.alpha, r.beta, r.invalid_penalty) == (0.5, 0.5, -7.0)
    assert make_reward({"name": "e2e", "e2e_every": 3}).every == 3
    with pytest.raises(RLFlowError, match="unknown reward"):
        make_reward({"name": "nope"})


# ------------------------------------------------------------------------------------------------ the env
def test_env_checker_passes(bert, rules):
    env = make(bert, rules, max_steps=5, max_locations=16)
    check_env(env, skip_render_check=True)
    env = gym.make(ENV_ID, graph=bert, rules=rules, cost_model=AnalyticCost("cpu"), max_steps=5, max_locations=16)
    check_env(env.unwrapped, skip_render_check=True)


# ------------------------------------------------------------------------------------------------ registration


def _python(code: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only what the installed package provides
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("env_id", [ENV_ID, f"rlflow.env:{ENV_ID}"])
def test_gym_make_with_no_arguments_and_no_import_passes_the_env_checker(tmp_path, env_id):
    """The installed package, a fresh interpreter outside the repository, nothing but gymnasium imported: the
    plain id (registered by the installed rlflow-gymnasium.pth hook) and the module-prefixed one both give a
    working default env that Gymnasium's checker accepts."""
    code = ("import sys; assert 'rlflow.env' not in sys.modules; "
            "import gymnasium as gym; from gymnasium.utils.env_checker import check_env; "
            f"check_env(gym.make({env_id!r}).unwrapped); print('checked')")
    r = _python(code, tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "checked", r.stderr[-2000:]


def test_start_up_hook_imports_nothing_but_itself_until_gymnasium_is_imported(tmp_path):
    """What the .pth costs a Python process that never uses gymnasium: the hook module, no gymnasium, no env."""
    code = ("import sys; print(sorted(m for m in sys.modules if m.startswith(('rlflow', 'gymnasium'))))")
    r = _python(code, tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "['rlflow', 'rlflow._gym_hook']", (r.stdout, r.stderr[-2000:])


def test_hook_registers_at_once_when_gymnasium_is_already_imported():
    from gymnasium.envs.registration import registry

    from rlflow import _gym_hook

    spec = registry.pop(ENV_ID)
    try:
        _gym_hook.install()
        assert registry[ENV_ID].entry_point == spec.entry_point
    finally:
        registry[ENV_ID] = spec


def test_the_declared_entry_point_registers_the_env(tmp_path):
    """pyproject's `gymnasium.envs` entry point (what Gymnasium 0.26-0.29 call at import) registers the id."""
    code = ("import gymnasium as gym; from importlib.metadata import entry_points; "
            "(ep,) = [e for e in entry_points(group='gymnasium.envs') if e.name == 'rlflow']; "
            "assert ep.value == 'rlflow.env:register_envs', ep.value; "
            "ep.load()(); "
            f"print(gym.spec({ENV_ID!r}).entry_point)")
    r = _python(code, tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "rlflow.env.graph_rewrite:GraphRewriteEnv"


def test_default_env_is_the_tiny_bert_with_the_builtin_rules(tiny_zoo):
    from rlflow.cost.model import AnalyticCost as Analytic
    from rlflow.env.graph_rewrite import DEFAULT_GRAPH
    from rlflow.rewrite.builtin import builtin_rules

    env = gym.make(ENV_ID).unwrapped
    builtin = [r for r, _ in builtin_rules()]
    assert [r.id for r in env.rules] == [r.id for r in builtin] and env.n_xfers == len(builtin) == 60
    # the shipped graph is the zoo's tiny BERT as the exporter makes it now
    shipped, fresh = load_onnx(DEFAULT_GRAPH), load_onnx(tiny_zoo["bert"])
    assert shipped.structural_hash() == fresh.structural_hash() and env.graph.structural_hash() == fresh.structural_hash()
    assert type(env.cost) is Analytic
    obs, info = env.reset(seed=0)
    assert info["counts"].sum() > 0 and obs["xfer_mask"][:-1].any()  # builtin rules match: there is work to do
    xfer = int(np.flatnonzero(obs["xfer_mask"][:-1])[0])
    _, _, _, _, info = env.step((xfer, 0))
    assert info["valid"] and info["rule"] == builtin[xfer].id


def test_masks_match_find_matches(bert, rules):
    env = make(bert, rules, max_locations=4)
    actions = random_actions(env, 6, seed=1)
    assert len(actions) == 6
    obs, _ = env.reset()
    for a in [None, *actions]:
        if a is not None:
            obs, _, _, _, info = env.step(a)
        expect = np.array([len(find_matches(env.graph, r)) for r in rules])
        assert np.array_equal(env.counts(), expect)
        assert np.array_equal(obs["xfer_mask"][:-1], (expect > 0).astype(np.int8)) and obs["xfer_mask"][-1] == 1
        rows = obs["location_mask"][:-1]
        assert np.array_equal(rows.sum(axis=1), np.minimum(expect, 4))
        assert all(rows[k, :min(c, 4)].all() for k, c in enumerate(expect))  # the first locations, in order
        assert obs["location_mask"][-1].tolist() == [1, 0, 0, 0]


def test_step_applies_the_chosen_match_and_reports_metrics(bert, rules):
    from rlflow.rewrite.matcher import apply

    env = make(bert, rules)
    obs, info = env.reset()
    k = int(np.flatnonzero(obs["xfer_mask"][:-1])[0])
    want = apply(bert, find_matches(bert, rules[k])[0])
    obs, reward, terminated, truncated, info = env.step((k, 0))
    assert env.graph.structural_hash() == want.structural_hash()
    m = AnalyticCost("cpu").graph_metrics(want)
    assert info["runtime_ms"] == pytest.approx(m.runtime_ms) and info["flops"] == m.flops
    assert info["valid"] and info["rule"] == rules[k].id and not terminated and not truncated
    assert reward == pytest.approx(env.initial_metrics["runtime_ms"] - m.runtime_ms)
    assert obs["global"][0] == pytest.approx(m.runtime_ms)
    g = obs["graph"]
    n_values = len(want.inputs) + len(want.constants) + len(want.nodes)
    assert g.nodes.shape[0] == n_values and g.edge_links.shape == (g.edges.shape[0], 2)
    assert g.edge_links.max() < n_values


def test_invalid_actions_get_the_penalty_and_leave_the_graph(bert, rules):
    env = make(bert, rules, reward={"name": "delta", "invalid_penalty": -42}, max_locations=8)
    obs, _ = env.reset()
    before = env.graph.structural_hash()
    unmatched = int(np.flatnonzero(obs["xfer_mask"][:-1] == 0)[0])
    matched = int(np.flatnonzero(obs["xfer_mask"][:-1])[0])
    past = int(obs["location_mask"][matched].sum())  # one past its last location
    for action in [(unmatched, 0), (matched, past)] if past < 8 else [(unmatched, 0)]:
        obs, reward, terminated, truncated, info = env.step(action)
        assert reward == -42 and not info["valid"] and not terminated
        assert env.graph.structural_hash() == before
        assert info["runtime_ms"] == env.initial_metrics["runtime_ms"]


def test_noop_ends_the_episode_and_max_steps_truncates(bert, rules):
    env = make(bert, rules, max_steps=3)
    env.reset()
    _, reward, terminated, truncated, info = env.step((env.noop, 0))
    assert terminated and not truncated and reward == 0 and info["noop"]
    env.reset()
    actions = random_actions(env, 3)
    assert len(actions) == 3
    env.reset()
    flags = [env.step(a)[2:4] for a in actions]
    assert flags == [(False, False), (False, False), (False, True)]


def test_peek_names_the_next_graph_counts_one_look_and_the_step_reuses_it(bert, rules):
    """peek gives the hash of the graph a step would give without moving; each look is a counted interaction,
    and a step that takes the rewrite just looked at is not counted again (a different one is)."""
    env = make(bert, rules)
    obs, _ = env.reset()
    first, *others = [(int(k), 0) for k in np.flatnonzero(obs["xfer_mask"][:-1])]
    before, start = env.graph.structural_hash(), env.total_steps
    looked = env.peek(first)
    # another rewrite that gives another graph (two rules can give the same one)
    other = make(bert, rules)
    for second in others:
        other.reset()
        other.step(second)
        if other.graph.structural_hash() != looked:
            break
    assert env.graph.structural_hash() == before and env.steps == 0 and env.total_steps == start + 1
    env.step(first)
    assert env.graph.structural_hash() == looked and env.total_steps == start + 1
    # a look at one rewrite, then a step of another: both count; the step applies its own rewrite
    env.reset()
    env.peek(first)
    env.step(second)
    want = make(bert, rules)
    want.reset()
    want.step(second)
    assert env.graph.structural_hash() == want.graph.structural_hash() != looked
    assert env.total_steps == start + 3
    # the NO-OP and an invalid action give no graph and count nothing; a reset forgets a look
    unmatched = int(np.flatnonzero(obs["xfer_mask"][:-1] == 0)[0])
    n = env.total_steps
    assert env.peek((env.noop, 0)) is None and env.peek((unmatched, 0)) is None and env.total_steps == n
    env.reset()
    env.peek(first)
    env.reset()
    env.step(first)
    assert env.total_steps == n + 2


def test_same_actions_same_graph_and_metrics(bert, rules):
    a, b = make(bert, rules), make(bert, rules)
    actions = random_actions(a, 12, seed=3)
    assert len(actions) == 12
    for env in (a, b):  # b is a fresh instance; a replays after a reset
        env.reset()
        trace = []
        for act in actions:
            _, r, *_, info = env.step(act)
            trace.append((r, info["runtime_ms"], info["bytes"], tuple(info["counts"])))
        env.trace, env.hash = trace, env.graph.structural_hash()
    assert a.trace == b.trace and a.hash == b.hash


def test_vector_env(bert, rules):
    envs = gym.make_vec(ENV_ID, num_envs=2, vectorization_mode="sync", graph=bert, rules=rules,
                        cost_model=AnalyticCost("cpu"), max_steps=4, max_locations=8)
    obs, info = envs.reset(seed=0)
    assert obs["xfer_mask"].shape == (2, len(rules) + 1)
    assert obs["location_mask"].shape == (2, len(rules) + 1, 8)
    assert len(obs["graph"]) == 2
    k = int(np.flatnonzero(obs["xfer_mask"][0, :-1])[0])
    obs, reward, terminated, truncated, info = envs.step(np.array([[k, 0], [len(rules), 0]]))
    assert terminated.tolist() == [False, True]
    assert info["valid"].tolist() == [True, True]
    envs.close()


def test_e2e_reward_measures_every_n_steps_with_the_protocol(bert, rules):
    """The e2e reward's latency comes from the measurement protocol (a fake runner: every rewritten graph runs
    10% faster than the first, on a fake clock); measured every e2e_every steps, 1 where no difference."""
    from rlflow.evaluation.protocol import Protocol, latency_meter

    clock = {"now": 0.0}
    first_hash = bert.structural_hash()

    def make_runner(g):
        ms = 10.0 if g.structural_hash() == first_hash else 9.0

        def run(feeds):
            clock["now"] += ms * (1 + 0.01 * np.sin(clock["now"] * 1e4)) / 1e3

        return run

    p = Protocol(sessions=3, warmup=0, budget_s=0.5)
    meter = latency_meter(p, "ort", "cpu", make_runner=make_runner, clock=lambda: clock["now"])
    env = make(bert, rules, reward={"name": "e2e", "e2e_every": 2}, latency_meter=meter)
    actions = random_actions(make(bert, rules), 3, seed=4)
    obs, info = env.reset()
    assert info["latency_ratio"] == 1.0
    _, r1, *_, i1 = env.step(actions[0])
    assert r1 == 0.0 and i1["latency_ratio"] == 1.0             # not measured at step 1
    _, r2, *_, i2 = env.step(actions[1])
    assert i2["latency_ratio"] == pytest.approx(0.9, rel=0.01)   # measured at step 2: faster
    assert r2 == pytest.approx((1.0 - i2["latency_ratio"]) * 100)
    with pytest.raises(RLFlowError, match="latency_meter"):
        make(bert, rules, reward={"name": "e2e"})


# ------------------------------------------------------------------------------------------------ rollouts
def test_rollouts_replay_to_the_same_graphs(bert, rules):
    env = make(bert, rules, max_steps=6)
    eps = collect(env, 4, stop_prob=0.1, seed=[0, 1])
    assert len(eps) == 4 and all(e["done"][-1] and not any(e["done"][:-1]) for e in eps)
    assert eps == collect(make(bert, rules, max_steps=6), 4, stop_prob=0.1, seed=[0, 1])  # seeded
    cost = AnalyticCost("cpu")
    for e in eps:
        assert len(e["metrics"]) == len(e["counts"]) == len(e["actions"]) + 1
        graphs = list(replay(env, e["actions"]))
        for g, m, c in zip(graphs, e["metrics"], e["counts"]):
            assert list(cost.graph_metrics(g).as_tuple()) == pytest.approx(m)
            assert [[k, n] for k, n in enumerate(len(find_matches(g, r)) for r in rules) if n] == c
        assert graphs[-1].structural_hash() == e["final_hash"]


def test_rollout_stages_end_to_end(tiny_zoo, rules_file, tmp_path, root):
    from rlflow.cli import main

    base = ["--config", str(root / "config.yaml"), "--set", "cost.model=analytic", "--set", "rollouts.episodes=3",
            "--set", "env.max_steps=4"]
    for k in (0, 1):
        assert main(["rollouts", *base, "--model", "bert", "--shard", str(k), "--onnx", str(tiny_zoo["bert"]),
                     "--rules", str(rules_file), "--out", str(tmp_path / f"shard-{k}.json"), "--no-progress"]) == 0
    shards = [json.loads((tmp_path / f"shard-{k}.json").read_text()) for k in (0, 1)]
    assert shards[0]["episodes"] != shards[1]["episodes"]  # shards are seeded apart
    out = tmp_path / "rollouts.json"
    assert main(["merge-rollouts", *base, "--set", "rollouts.shards=[0,1]", "--model", "bert",
                 "--shards-dir", str(tmp_path), "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert merged["stats"]["episodes"] == 6 and merged["shards"] == [0, 1]
    assert merged["episodes"] == shards[0]["episodes"] + shards[1]["episodes"]
    assert merged["format"] == "rlflow.rollouts/1" and merged["rules"]["count"] == len(load_rules(rules_file))
    # a missing shard is a one-line error and no output
    out2 = tmp_path / "again.json"
    assert main(["merge-rollouts", *base, "--set", "rollouts.shards=[0,1,2]", "--model", "bert",
                 "--shards-dir", str(tmp_path), "--out", str(out2)]) == 2
    assert not out2.exists()


def test_rollout_stages_store_and_join_the_graphs(tiny_zoo, rules_file, tmp_path, root, capsys):
    """collect-rollouts --graphs stores every step's graph, as the environment observed it; merge-rollouts
    --graphs joins the shards' files in shard order, and refuses a shard's file that belongs to other episodes."""
    import shutil

    from rlflow.agents.rollouts import read_graphs, unpack_graphs
    from rlflow.cli import main

    base = ["--config", str(root / "config.yaml"), "--set", "cost.model=analytic", "--set", "rollouts.episodes=3",
            "--set", "env.max_steps=4"]
    for k in (0, 1):
        assert main(["rollouts", *base, "--model", "bert", "--shard", str(k), "--onnx", str(tiny_zoo["bert"]),
                     "--rules", str(rules_file), "--out", str(tmp_path / f"shard-{k}.json"),
                     "--graphs", str(tmp_path / f"shard-{k}.graphs.npz"), "--no-progress"]) == 0
    shard = json.loads((tmp_path / "shard-0.json").read_text())
    env = make(load_onnx(tiny_zoo["bert"]), load_rules(rules_file), max_steps=4)
    for ep, seq in zip(shard["episodes"], unpack_graphs(read_graphs(tmp_path / "shard-0.graphs.npz"),
                                                        shard["episodes"], "shard-0")):
        obs, _ = env.reset()
        observed = [obs["graph"]] + [env.step(a)[0]["graph"] for a in ep["actions"]]
        assert len(seq) == len(observed) == len(ep["actions"]) + 1
        for want, got in zip(observed, seq):
            for name in ("nodes", "edges", "edge_links"):
                np.testing.assert_array_equal(getattr(want, name), getattr(got, name), err_msg=name)
    merge = ["merge-rollouts", *base, "--set", "rollouts.shards=[0,1]", "--model", "bert", "--shards-dir",
             str(tmp_path), "--out", str(tmp_path / "rollouts.json"), "--graphs", str(tmp_path / "rollouts.graphs.npz")]
    assert main(merge) == 0
    merged = json.loads((tmp_path / "rollouts.json").read_text())
    joined, parts = read_graphs(tmp_path / "rollouts.graphs.npz"), [read_graphs(tmp_path / f"shard-{k}.graphs.npz")
                                                                    for k in (0, 1)]
    for name in ("graph_nodes", "graph_edges", "node_type", "node_runtime", "edges", "edge_links"):
        np.testing.assert_array_equal(joined[name], np.concatenate([p[name] for p in parts]), err_msg=name)
    assert len(list(unpack_graphs(joined, merged["episodes"], "merged"))) == 6
    # shard 1's graphs file replaced by shard 0's: one line naming it, and neither output
    for name in ("rollouts.json", "rollouts.graphs.npz"):
        (tmp_path / name).unlink()
    shutil.copy(tmp_path / "shard-0.graphs.npz", tmp_path / "shard-1.graphs.npz")
    capsys.readouterr()
    assert main(merge) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"rlflow: error: {tmp_path / 'shard-1.graphs.npz'}: stored for other episodes than the rollouts "
                   "file's; collect the rollouts again"], err
    assert not (tmp_path / "rollouts.json").exists() and not (tmp_path / "rollouts.graphs.npz").exists()
