"""eqsat-rl (rlflow.search.eqsat_rl): the family scheduler runs only the families chosen, under eqsat's budget;
the learned policy, random schedules and the tree search return graphs equal to the input, deterministically;
the REINFORCE gradient; `rlflow optimize --method eqsat-rl`; bad input in one line."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from rlflow.cost import AnalyticCost
from rlflow.errors import RLFlowError
from rlflow.graph.exec.check import check_equal
from rlflow.rewrite.builtin import builtin_rules
from rlflow.search.eqsat import Pattern, eqsat_search
import rlflow.search.eqsat_rl as eqsat_rl
from rlflow.rewrite.rule import PatternNode, Rule
from rlflow.search.eqsat_rl import (FAMILIES, N_FEATURES, N_GRAPH_FEATURES, RELEASED, EqsatBudget, LinearPolicy,
                                    TrainConfig, _fixed, action_families, action_mask, action_names,
                                    constant_rewards, eqsat_rl_search, family_of, fit_imitation, graph_features,
                                    imitation_grad, imitation_loss, is_reorder, present_families,
                                    random_schedule_search, reinforce_grad, reinforce_loss, run_schedule,
                                    train_policy, tree_search)
from test_eqsat import mm_add_graph, shared_input_graph

BUILTIN = [r for r, _ in builtin_rules()]
BUDGET = EqsatBudget(node_limit=2000, iter_limit=6, time_limit_s=30, ilp_time_limit_s=10)


def fixed(*actions):
    names = action_names()
    return lambda it, x, mask: names.index(actions[it]) if it < len(actions) else 0


def test_families_group_every_rule_and_the_graph_has_several():
    fams = {family_of(p) for p in map(Pattern, BUILTIN) if p.joined}
    assert fams <= set(FAMILIES) and {"multi", "conv"} <= fams
    present = present_families(shared_input_graph(), BUILTIN)
    assert {"multi", "conv"} <= present
    mask = action_mask(present)
    names = action_names()
    assert mask[0] and mask[names.index("only:conv")] and not mask[names.index("only:transpose")]


def test_reorders_are_the_rules_whose_target_has_the_sources_ops():
    def rule(src, dst):
        return Rule(id="r", name="r", src=tuple(PatternNode(op, ins, {}) for op, ins in src),
                    dst=tuple(PatternNode(op, ins, {}) for op, ins in dst), outputs=(("n1", "n1"),), origin="builtin")
    swap = rule([("Add", ("a", "b")), ("Add", ("n0", "c"))], [("Add", ("b", "c")), ("Add", ("a", "n0"))])
    fold = rule([("Mul", ("a", "s")), ("Mul", ("n0", "t"))], [("Mul", ("s", "t")), ("Mul", ("a", "n0")),
                                                               ("Identity", ("n1",))])
    assert is_reorder(swap) and not is_reorder(fold)
    # a rule with fewer (or other) ops on its target side is not one, however its inputs are wired
    assert not is_reorder(rule([("Add", ("a", "b")), ("Add", ("n0", "c"))], [("Add", ("a", "c"))]))
    fams = {p.rule.id: family_of(p) for p in map(Pattern, BUILTIN) if p.joined}
    assert {fams[r.id] == "reorder" for r in BUILTIN if r.id in fams and is_reorder(r) and not Pattern(r).multi} \
        <= {True}


def test_a_fixed_schedule_repeats_its_last_action():
    g, cost = shared_input_graph(), AnalyticCost("cpu")
    r, sched = run_schedule(g, BUILTIN, cost, _fixed(["no:conv"]), BUDGET)
    ran = r.stats["schedule"]
    k = ran.index("all")  # the forced `all` once no:conv changed nothing
    assert k >= 2 and set(ran[:k]) == {"no:conv"} and check_equal(g, r.graph) <= 1e-5
    # from then on the agent chooses between `all` and `stop` only: the fixed schedule's no:conv is not allowed
    assert sched.released and set(ran[k:]) == {"all"} and r.stop_reason == "saturated"
    late = [m for _, _, m in sched.decisions[k:]]
    assert late and all(set(np.array(action_names())[m]) == {"all", "stop"} for m in late)
    # the policy sees it: the released feature is 0 in the decisions before the fixpoint and 1 after it
    released = [x[RELEASED] for x, _, _ in sched.decisions]
    assert released == [0.0] * k + [1.0] * len(late)
    r0, _ = run_schedule(g, BUILTIN, cost, _fixed([]), BUDGET)
    assert set(r0.stats["schedule"]) == {"all"}


def test_training_starts_from_the_best_constant_schedule(monkeypatch):
    """With a scorer under which one action beats eqsat's schedule, the policy starts from (and keeps) it; with
    none better, it starts from eqsat's schedule."""
    g, cost = shared_input_graph(), AnalyticCost("cpu")
    names = action_names()
    present = present_families(g, BUILTIN)
    mask = action_mask(present)

    def scorer(best):
        def proxy(graph, rules, cost_model, choose, budget, ilp_s):
            a = choose(0, np.zeros(N_FEATURES), mask)
            return (1.0 if names[a] == best else 2.0), 1.0, type("S", (), {"decisions": []})()
        return proxy

    monkeypatch.setattr(eqsat_rl, "proxy_cost", scorer("no:conv"))
    rewards = constant_rewards({"g": g}, BUILTIN, lambda m, c: eqsat_rl.proxy_cost(g, BUILTIN, cost, c, BUDGET, 1),
                               lambda m, c, t: 2.0 - c)
    assert rewards["all"] == 0 and rewards["no:conv"] == 1.0 and "stop" not in rewards
    assert set(rewards) == {n for n, ok in zip(names, mask) if ok and n != "stop"}
    policy, _ = train_policy({"g": g}, BUILTIN, cost, BUDGET, TrainConfig(epochs=1))
    assert names[policy.greedy()(3, np.ones(N_FEATURES), mask)] == "no:conv"
    assert policy.info["constant_rewards"]["no:conv"] > 0 and policy.info["best_greedy_reward"] > 0
    monkeypatch.setattr(eqsat_rl, "proxy_cost", scorer("all"))  # nothing beats eqsat's schedule
    policy, _ = train_policy({"g": g}, BUILTIN, cost, BUDGET, TrainConfig(epochs=1))
    assert names[policy.greedy()(3, np.ones(N_FEATURES), mask)] == "all"
    # stopping at the fixpoint is scored too for the best constant schedules, and kept where it is better
    late_mask = np.array([n in ("all", "stop") for n in names])
    before, after = np.zeros(N_FEATURES), np.zeros(N_FEATURES)
    before[0] = after[0] = after[RELEASED] = 1.0  # (the constant feature; released)

    def late_scorer(costs, late_costs):
        def proxy(graph, rules, cost_model, choose, budget, ilp_s):
            a, late = names[choose(1, before, mask)], names[choose(5, after, late_mask)]
            c = late_costs.get(a, costs.get(a, 2.0)) if late == "stop" else costs.get(a, 2.0)
            return c, 1.0, type("S", (), {"decisions": []})()
        return proxy

    # the second-best constant schedule, stopping at its fixpoint, beats the best one
    monkeypatch.setattr(eqsat_rl, "proxy_cost", late_scorer({"no:conv": 1.0, "only:conv": 1.5}, {"only:conv": 0.2}))
    policy, _ = train_policy({"g": g}, BUILTIN, cost, BUDGET, TrainConfig(epochs=1))
    greedy = policy.greedy()
    assert names[greedy(3, before, mask)] == "only:conv"
    assert names[greedy(3, after, late_mask)] == "stop"
    rewards = policy.info["constant_rewards"]
    assert rewards["only:conv, then stop"] > rewards["no:conv"] > rewards["only:conv"]
    # it stops only once released: where its action is not allowed (a model without its families), `all` runs
    no_conv = mask & np.array([n != "only:conv" for n in names])
    assert names[greedy(3, before, no_conv)] == "all"
    monkeypatch.setattr(eqsat_rl, "proxy_cost", late_scorer({"no:conv": 1.0}, {}))  # stopping gains nothing
    policy, _ = train_policy({"g": g}, BUILTIN, cost, BUDGET, TrainConfig(epochs=1))
    assert names[policy.greedy()(3, after, late_mask)] == "all"
    # only the late_candidates best are scored stopping
    policy, _ = train_policy({"g": g}, BUILTIN, cost, BUDGET, TrainConfig(epochs=1, late_candidates=1))
    assert [k for k in policy.info["constant_rewards"] if k.endswith(", then stop")] == ["no:conv, then stop"]


def test_the_training_reward_weighs_time(monkeypatch):
    """At equal cost a schedule in half of eqsat's time earns time_weight / 2; with no weight on time it earns 0."""
    g, cost = shared_input_graph(), AnalyticCost("cpu")
    names = action_names()
    mask = action_mask(present_families(g, BUILTIN))

    def proxy(graph, rules, cost_model, choose, budget, ilp_s):
        a = choose(0, np.zeros(N_FEATURES), mask)
        return 1.0, (1.0 if names[a] == "no:conv" else 2.0), type("S", (), {"decisions": []})()

    monkeypatch.setattr(eqsat_rl, "proxy_cost", proxy)
    policy, _ = train_policy({"g": g}, BUILTIN, cost, BUDGET, TrainConfig(epochs=1, time_weight=0.02))
    assert policy.info["constant_rewards"]["no:conv"] == pytest.approx(0.01)
    assert names[policy.greedy()(3, np.ones(N_FEATURES), mask)] == "no:conv"
    policy, _ = train_policy({"g": g}, BUILTIN, cost, BUDGET, TrainConfig(epochs=1, time_weight=0.0))
    assert policy.info["constant_rewards"]["no:conv"] == 0 and policy.info["best_greedy_reward"] == 0
    # a costlier graph earns nothing for its speed

    def costlier(graph, rules, cost_model, choose, budget, ilp_s):
        a = choose(0, np.zeros(N_FEATURES), mask)
        return (1.01 if names[a] == "no:conv" else 1.0), (0.1 if names[a] == "no:conv" else 2.0), \
            type("S", (), {"decisions": []})()

    monkeypatch.setattr(eqsat_rl, "proxy_cost", costlier)
    policy, _ = train_policy({"g": g}, BUILTIN, cost, BUDGET, TrainConfig(epochs=1, time_weight=0.02))
    assert policy.info["constant_rewards"]["no:conv"] < 0


def test_scheduler_runs_only_the_chosen_families():
    g, cost = shared_input_graph(), AnalyticCost("cpu")
    r, sched = run_schedule(g, BUILTIN, cost, fixed("only:conv", "no:conv"), BUDGET)
    fam = {p.rule.id: family_of(p) for p in sched.runner.patterns}
    first, second = sched.runner.iterations[:2]
    assert first.rules_run and {fam[i] for i in first.rules_run} == {"conv"}
    assert second.rules_run and "conv" not in {fam[i] for i in second.rules_run}
    assert r.stats["schedule"][:2] == ["only:conv", "no:conv"]
    # an iteration of some families that changes nothing is followed by one of every family before stopping
    assert r.stats["schedule"][-1] == "all" and r.stop_reason == "saturated"
    assert check_equal(g, r.graph) <= 1e-5


def test_the_stop_action_ends_saturation_and_the_ilp_extracts_what_is_there():
    g, cost = shared_input_graph(), AnalyticCost("cpu")
    ref = eqsat_search(g, BUILTIN, cost, **replace(BUDGET, iter_limit=1).search_kwargs())
    r, sched = run_schedule(g, BUILTIN, cost, fixed("all", "stop"), BUDGET)
    assert r.stop_reason == "scheduler" and r.stats["schedule"] == ["all", "stop"] and r.stats["iterations"] == 1
    assert r.stats["egraph_nodes"] == ref.stats["egraph_nodes"] and r.final.runtime_ms == ref.final.runtime_ms
    assert [action_names()[a] for _, a, _ in sched.decisions] == ["all", "stop"]
    assert check_equal(g, r.graph) <= 1e-5
    # stopping before the first iteration (the input itself) is not an action
    with pytest.raises(RLFlowError, match="not one allowed here"):
        run_schedule(g, BUILTIN, cost, fixed("stop"), BUDGET)
    # in the tree search a stop ends its branch: no leaf runs an action after one
    t = tree_search(g, BUILTIN, cost, BUDGET, depth=3, simulations=12, seed=0)
    sched_t = t.stats["schedule"]
    assert "stop" not in sched_t[:-1] and check_equal(g, t.graph) <= 1e-5


def test_untrained_policy_is_eqsats_schedule():
    g, cost = shared_input_graph(), AnalyticCost("cpu")
    ref = eqsat_search(g, BUILTIN, cost, **BUDGET.search_kwargs())
    r = eqsat_rl_search(g, BUILTIN, cost, LinearPolicy.untrained(), BUDGET)
    assert set(r.stats["schedule"]) == {"all"} and r.method == "eqsat-rl"
    assert r.stats["egraph_nodes"] == ref.stats["egraph_nodes"] and r.final.runtime_ms == ref.final.runtime_ms
    assert r.final.runtime_ms < r.initial.runtime_ms and check_equal(g, r.graph) <= 1e-5


def test_budgets_are_respected():
    g, cost = shared_input_graph(), AnalyticCost("cpu")
    r = random_schedule_search(g, BUILTIN, cost, EqsatBudget(iter_limit=1), seed=0)
    assert r.stats["iterations"] == 1 and r.stop_reason == "iteration_limit"
    small = EqsatBudget(node_limit=40, iter_limit=6)  # (saturated: 413 e-nodes)
    for r in (random_schedule_search(g, BUILTIN, cost, small, seed=1),
              tree_search(g, BUILTIN, cost, small, depth=1, simulations=2)):
        assert r.stop_reason == "node_limit" and r.stats["egraph_nodes"] < 40 + 40
        assert check_equal(g, r.graph) <= 1e-5


def test_random_schedules_and_tree_search_are_deterministic_and_equal_to_the_input():
    g, cost = shared_input_graph(), AnalyticCost("cpu")
    a, b = (random_schedule_search(g, BUILTIN, cost, BUDGET, seed=3) for _ in range(2))
    assert a.stats["schedule"] == b.stats["schedule"] and a.final.runtime_ms == b.final.runtime_ms
    t1, t2 = (tree_search(g, BUILTIN, cost, BUDGET, depth=2, simulations=5, seed=1) for _ in range(2))
    assert t1.stats["schedule"] == t2.stats["schedule"] and t1.final.runtime_ms == t2.final.runtime_ms
    assert t1.method == "eqsat-mcts" and t1.stats["tree_simulations"] == 5
    ref = eqsat_search(g, BUILTIN, cost, **BUDGET.search_kwargs())
    assert t1.final.runtime_ms <= ref.final.runtime_ms  # eqsat's schedule is a leaf of the tree
    for r in (a, t1):
        assert check_equal(g, r.graph) <= 1e-5


@pytest.mark.parametrize("per_step", [False, True])
def test_reinforce_gradient_matches_finite_differences(per_step):
    rng = np.random.default_rng(0)
    A, D, T = len(action_names()), N_FEATURES, 3
    w, x = rng.normal(size=(A, D)), rng.normal(size=(T, D))
    acts = np.array([0, 5, 2])
    if per_step:  # a mask per step (T, A), as the scheduler's decisions keep them
        mask = np.ones((T, A), bool)
        mask[:, 3] = False
        mask[1, 4] = False
    else:
        mask = np.ones(A, bool)
        mask[3] = False
    grad = reinforce_grad(w, x, acts, mask, 0.7)
    num = np.zeros_like(w)
    for i in range(A):
        for j in range(D):
            d = np.zeros_like(w)
            d[i, j] = 1e-6
            num[i, j] = (reinforce_loss(w + d, x, acts, mask, 0.7) - reinforce_loss(w - d, x, acts, mask, 0.7)) / 2e-6
    assert np.allclose(grad, num, atol=1e-5) and not grad[3].any() and grad[4].any()  # (4: allowed at 2 steps)


def test_tiny_training_never_ends_below_eqsat_and_the_policy_round_trips(tmp_path):
    g, cost = shared_input_graph(), AnalyticCost("cpu")
    policy, history = train_policy({"shared": g}, BUILTIN, cost, BUDGET, TrainConfig(epochs=2, seed=0))
    assert len(history) == 2 and policy.info["best_greedy_reward"] >= 0 and policy.info["trained_on"] == ["shared"]
    ref = eqsat_search(g, BUILTIN, cost, **BUDGET.search_kwargs())
    r = eqsat_rl_search(g, BUILTIN, cost, policy, BUDGET)
    assert r.final.runtime_ms <= ref.final.runtime_ms and check_equal(g, r.graph) <= 1e-5
    policy.save(tmp_path / "p.json")
    again = LinearPolicy.load(tmp_path / "p.json")
    assert np.array_equal(again.weights, policy.weights)
    assert eqsat_rl_search(g, BUILTIN, cost, again, BUDGET).stats["schedule"] == r.stats["schedule"]


def test_training_takes_a_cost_model_per_model():
    g, cost = shared_input_graph(), AnalyticCost("cpu")
    one, _ = train_policy({"a": g}, BUILTIN, cost, BUDGET, TrainConfig(epochs=1, seed=0, time_weight=0))
    each, _ = train_policy({"a": g}, BUILTIN, {"a": cost}, BUDGET, TrainConfig(epochs=1, seed=0, time_weight=0))
    assert np.array_equal(one.weights, each.weights)
    with pytest.raises(RLFlowError, match="no cost model for a"):
        train_policy({"a": g}, BUILTIN, {"b": cost}, BUDGET, TrainConfig(epochs=1))


def test_bad_input_is_one_line(tmp_path):
    with pytest.raises(RLFlowError, match="node_limit >= 1"):
        EqsatBudget(node_limit=0)
    with pytest.raises(RLFlowError, match="unknown eqsat-rl action"):
        action_families("only:nothing")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(RLFlowError, match="not an eqsat-rl policy") as e:
        LinearPolicy.load(tmp_path / "bad.json")
    assert "\n" not in str(e.value)
    (tmp_path / "other.json").write_text('{"format": "rlflow.eqsat-rl-policy/3", "actions": ["all"], "weights": [[0]]}')
    with pytest.raises(RLFlowError, match="other actions or features"):
        LinearPolicy.load(tmp_path / "other.json")
    # policies of the previous formats (no released feature; no graph features) are refused with what to do
    for old in (1, 2):
        (tmp_path / "old.json").write_text(f'{{"format": "rlflow.eqsat-rl-policy/{old}", "weights": [[0]]}}')
        with pytest.raises(RLFlowError, match="older rlflow .*train it again"):
            LinearPolicy.load(tmp_path / "old.json")
    with pytest.raises(RLFlowError, match="no rules"):
        eqsat_rl_search(shared_input_graph(), [], AnalyticCost("cpu"), LinearPolicy.untrained(), BUDGET)
    with pytest.raises(RLFlowError, match="depth >= 1"):
        tree_search(shared_input_graph(), BUILTIN, AnalyticCost("cpu"), BUDGET, depth=0)


def test_optimize_method_eqsat_rl(tmp_path, capsys):
    import json

    from rlflow.cli import main
    from rlflow.graph.onnx_io import save_onnx
    from rlflow.rewrite.rule import rules_document

    g = shared_input_graph()
    src, rules = tmp_path / "m.onnx", tmp_path / "rules.json"
    save_onnx(g, src)
    rules.write_text(json.dumps(rules_document(BUILTIN, {})))
    common = [str(src), "--rules", str(rules), "--target", "analytic", "--set", "eqsat.iter_limit=6",
              "--no-progress", "--no-speed-check"]
    out, trace = tmp_path / "o.onnx", tmp_path / "t.json"
    assert main(["optimize", *common, "--out", str(out), "--method", "eqsat-rl", "--trace", str(trace),
                 "--set", "eqsat.rl_leaves=3"]) == 0
    doc = json.loads(trace.read_text())
    assert doc["method"] == "eqsat-mcts" and doc["config"]["eqsat.iter_limit"] == 6  # no policy: the tree search
    assert doc["config"]["eqsat.rl_leaves"] == 3 and doc["stats"]["tree_simulations"] == 3  # the leaves set
    assert doc["final"]["runtime_ms"] < doc["initial"]["runtime_ms"] and doc["max_rel_diff"] <= 1e-4
    assert "schedule (eqsat-mcts)" in capsys.readouterr().out
    LinearPolicy.untrained().save(tmp_path / "p.json")
    trace2 = tmp_path / "t2.json"
    assert main(["optimize", *common, "--out", str(tmp_path / "o2.onnx"), "--method", "eqsat-rl",
                 "--agent", str(tmp_path / "p.json"), "--trace", str(trace2)]) == 0
    doc2 = json.loads(trace2.read_text())
    assert doc2["method"] == "eqsat-rl" and set(doc2["stats"]["schedule"]) == {"all"}
    (tmp_path / "bad.json").write_text("[]")
    capsys.readouterr()
    assert main(["optimize", *common, "--out", str(tmp_path / "o3.onnx"), "--method", "eqsat-rl",
                 "--agent", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "not an eqsat-rl policy" in err and len(err.splitlines()) == 1 and not (tmp_path / "o3.onnx").exists()
    assert main(["optimize", *common, "--out", str(tmp_path / "o4.onnx"), "--method", "eqsat-rl",
                 "--budget", "5"]) == 2


def test_stage_search_eqsat_rl_runs_the_tree_search_with_the_eqsat_section(tmp_path, capsys):
    """The pipeline stage (rlflow search-eqsat-rl): eqsat's settings and eqsat.rl_leaves reach the tree search;
    its graph, checked equal to the input, and its trace; eqsat's own settings do not take the key."""
    import json

    from rlflow.cli import main
    from rlflow.graph.onnx_io import save_onnx
    from rlflow.rewrite.rule import rules_document
    from rlflow.stages.search_common import eqsat_settings

    g = shared_input_graph()
    src, rules = tmp_path / "m.onnx", tmp_path / "rules.json"
    save_onnx(g, src)
    rules.write_text(json.dumps(rules_document(BUILTIN, {})))
    out, trace = tmp_path / "eqsat_rl" / "model.onnx", tmp_path / "eqsat_rl" / "trace.json"
    assert main(["search-eqsat-rl", "--model", "m", "--onnx", str(src), "--rules", str(rules), "--out", str(out),
                 "--trace", str(trace), "--no-progress", "--set", "cost.target=analytic", "--set",
                 "eqsat.iter_limit=6", "--set", "eqsat.node_limit=2000", "--set", "eqsat.rl_leaves=2"]) == 0
    doc = json.loads(trace.read_text())
    assert doc["method"] == "eqsat-mcts" and doc["stats"]["tree_simulations"] == 2 and doc["max_rel_diff"] <= 1e-4
    assert {k: doc["config"][k] for k in ("eqsat.iter_limit", "eqsat.node_limit", "eqsat.rl_leaves")} == {
        "eqsat.iter_limit": 6, "eqsat.node_limit": 2000, "eqsat.rl_leaves": 2}
    assert doc["seconds"] >= doc["stats"]["tree_seconds"]  # the tree search is part of the optimisation time
    assert out.is_file() and "tree search 2 leaves" in capsys.readouterr().out
    from rlflow.config import load_config

    cfg = load_config(None, ["eqsat.rl_leaves=5"])  # the schema's defaults
    assert "rl_leaves" not in eqsat_settings(cfg) and eqsat_settings(cfg, "eqsat-rl")["rl_leaves"] == 5


# ------------------------------------------------------------------ the clock-free budget
CLOCK_FREE = EqsatBudget(node_limit=2000, iter_limit=6, time_limit_s=0, ilp_time_limit_s=0, ilp_node_limit=50)


def test_the_budget_carries_the_ilp_node_limit():
    assert CLOCK_FREE.search_kwargs()["ilp_node_limit"] == 50 and BUDGET.search_kwargs()["ilp_node_limit"] == 0
    assert CLOCK_FREE.clock_free and not BUDGET.clock_free
    assert not replace(CLOCK_FREE, ilp_node_limit=0).clock_free  # no clock, but nothing bounds the ILP
    assert not replace(CLOCK_FREE, time_limit_s=30).clock_free
    with pytest.raises(RLFlowError, match="ilp_node_limit >= 0") as e:
        EqsatBudget(ilp_node_limit=-1)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("budget, ilp_s, want", [
    (BUDGET, 3.0, (3.0, 0)),                                    # the proxy's clock is the shorter one
    (replace(BUDGET, ilp_time_limit_s=2.0), 3.0, (2.0, 0)),
    (replace(BUDGET, ilp_time_limit_s=0), 3.0, (3.0, 0)),       # no ILP clock: the proxy's (min(0, 3) was 0)
    (replace(BUDGET, ilp_node_limit=50), 3.0, (3.0, 50)),       # the node limit is kept
    (replace(BUDGET, ilp_time_limit_s=0, ilp_node_limit=50), 0, (0, 50)),  # ilp_s 0: no proxy clock either
    (CLOCK_FREE, 3.0, (0, 50)),                                 # clock-free: its own ILP, no clock
])
def test_the_proxy_ilp_is_the_shorter_one(monkeypatch, budget, ilp_s, want):
    from types import SimpleNamespace

    seen = []

    def run(graph, rules, cost, choose, b):
        seen.append(b)
        return SimpleNamespace(final=SimpleNamespace(runtime_ms=1.0), seconds=0.0), None

    monkeypatch.setattr(eqsat_rl, "run_schedule", run)
    eqsat_rl.proxy_cost(None, BUILTIN, None, _fixed([]), budget, ilp_s)
    assert (seen[0].ilp_time_limit_s, seen[0].ilp_node_limit) == want
    assert replace(seen[0], ilp_time_limit_s=budget.ilp_time_limit_s) == budget  # nothing else changes


def test_a_clock_free_budget_gives_eqsat_rl_the_same_graph_every_time():
    g, cost = shared_input_graph(), AnalyticCost("cpu")
    t1, t2 = (tree_search(g, BUILTIN, cost, CLOCK_FREE, depth=1, simulations=3, seed=2) for _ in range(2))
    assert t1.graph.structural_hash() == t2.graph.structural_hash() and t1.stats["schedule"] == t2.stats["schedule"]
    assert t1.settings["ilp_node_limit"] == 50 and t1.settings["ilp_time_limit_s"] == 0
    ref = eqsat_search(g, BUILTIN, cost, **CLOCK_FREE.search_kwargs())
    untrained = eqsat_rl_search(g, BUILTIN, cost, LinearPolicy.untrained(), CLOCK_FREE)
    assert untrained.graph.structural_hash() == ref.graph.structural_hash()  # (its schedule is eqsat's)


def test_graph_features_are_the_op_mix_and_the_policy_sees_them():
    """Each op group's share of the nodes, the other ops' share (together 1) and log10(nodes) / 4; the same in
    every decision of a run, at the end of the iteration's features."""
    g, h = shared_input_graph(), mm_add_graph()
    x, y = graph_features(g), graph_features(h)
    assert x.shape == (N_GRAPH_FEATURES,) and x[:-1].sum() == pytest.approx(1) and y[:-1].sum() == pytest.approx(1)
    assert x[0] == pytest.approx(2 / 7) and y[0] == 0 and y[1] == pytest.approx(1 / 3)  # conv; matmul
    assert x[-1] == pytest.approx(np.log10(7) / 4)
    _, sched = run_schedule(g, BUILTIN, AnalyticCost("cpu"), _fixed([]), BUDGET)
    assert sched.decisions and all(np.array_equal(d[0][-N_GRAPH_FEATURES:], x) for d in sched.decisions)
    assert all(d[0].shape == (N_FEATURES,) for d in sched.decisions)


def test_imitation_loss_and_gradient():
    """The loss is the mean cross-entropy plus l2 / 2 |W|^2; the gradient matches finite differences, and
    fit_imitation's greedy policy reproduces separable demonstrations, each allowed action only."""
    rng = np.random.default_rng(0)
    w, x = rng.standard_normal((5, 3)), rng.standard_normal((4, 3))
    acts, mask = np.array([0, 2, 2, 4]), np.ones((4, 5), bool)
    mask[1, 3] = False
    p = np.exp(x @ w.T) * mask
    p /= p.sum(1, keepdims=True)
    want = -np.log(p[np.arange(4), acts]).mean() + 0.5 * 0.1 * (w ** 2).sum()
    assert imitation_loss(w, x, acts, mask, 0.1) == pytest.approx(want)
    num = np.zeros_like(w)
    for i in range(5):
        for j in range(3):
            d = np.zeros_like(w)
            d[i, j] = 1e-6
            num[i, j] = (imitation_loss(w + d, x, acts, mask, 0.1) - imitation_loss(w - d, x, acts, mask, 0.1)) / 2e-6
    assert np.allclose(imitation_grad(w, x, acts, mask, 0.1), num, atol=1e-5)
    x = np.array([[1, 1, 0], [1, 0, 1], [1, 0.5, 0.5]])  # three op mixes, three different actions
    acts = np.array([1, 3, 0])
    mask = np.ones((3, 5), bool)
    mask[2, 1] = False
    w = fit_imitation(x, acts, mask)
    assert [int(np.argmax(softmax)) for softmax in eqsat_rl.softmax_masked(x @ w.T, mask)] == [1, 3, 0]
    # op mixes a few thousandths apart (two transformers' conv shares), with per-step features beside them
    x = np.array([[1, 0.1, 0.001], [1, 0.5, 0.001], [1, 0.1, 0.003], [1, 0.5, 0.003]])
    acts, mask = np.array([2, 4, 1, 4]), np.ones((4, 5), bool)
    w = fit_imitation(x, acts, mask)
    assert list(np.argmax(eqsat_rl.softmax_masked(x @ w.T, mask), axis=1)) == [2, 4, 1, 4]


def test_per_model_training_gives_each_model_its_own_schedule(monkeypatch):
    """With a scorer under which the two models' best schedules differ, the per-model policy picks each model's
    own on it (told apart by their op mixes), eqsat's schedule where nothing beats it, and records why."""
    g, h, cost = shared_input_graph(), mm_add_graph(), AnalyticCost("cpu")
    real = eqsat_rl.proxy_cost
    best = {id(g): "no:conv", id(h): "only:matmul"}

    def proxy(graph, rules, cost_model, choose, budget, ilp_s):
        _, t, sched = real(graph, rules, cost_model, choose, budget, ilp_s)
        ran = [a for a in sched.schedule if a not in ("all", "stop")]
        return (1.0 if ran and ran[0] == best[id(graph)] else 2.0), t, sched

    monkeypatch.setattr(eqsat_rl, "proxy_cost", proxy)
    config = TrainConfig(per_model=True, late_candidates=1, time_weight=0,
                         actions=("all", "no:conv", "only:matmul", "no:multi"))
    policy, history = train_policy({"g": g, "h": h}, BUILTIN, cost, BUDGET, config)
    info = policy.info["per_model"]
    assert history == [] and info["g"]["imitated"] == "no:conv" and info["h"]["imitated"] == "only:matmul"
    assert info["g"]["exact"] and info["h"]["exact"] and policy.info["best_greedy_reward"] > 0
    assert set(info["h"]["constant_rewards"]) == {"all", "only:matmul", "no:multi", "only:matmul, then stop"}
    for graph, want in ((g, "no:conv"), (h, "only:matmul")):
        assert run_schedule(graph, BUILTIN, cost, policy.greedy(), BUDGET)[0].stats["schedule"][0] == want
    ref, found = policy.info["_results"]["g"]
    assert found.stats["schedule"][0] == "no:conv" and set(ref.stats["schedule"]) == {"all"}
    best[id(h)] = "none"  # nothing beats eqsat on h: it keeps eqsat's schedule
    policy, _ = train_policy({"g": g, "h": h}, BUILTIN, cost, BUDGET, config)
    assert policy.info["per_model"]["h"]["imitated"] == "all" and policy.info["per_model"]["h"]["exact"]
    with pytest.raises(RLFlowError, match="unknown action"):
        train_policy({"g": g}, BUILTIN, cost, BUDGET, replace(config, actions=("only:foo",)))


def test_a_per_model_policy_replays_its_training_runs_exactly(tmp_path):
    """Clock-free, the policy's own run on a training model is the one it imitated (same schedule, same graph),
    also after a save and load (the in-memory results are not saved)."""
    g, h, cost = shared_input_graph(), mm_add_graph(), AnalyticCost("cpu")
    config = TrainConfig(per_model=True, late_candidates=1, actions=("all", "no:conv", "only:matmul", "no:reorder"))
    policy, _ = train_policy({"g": g, "h": h}, BUILTIN, cost, CLOCK_FREE, config)
    policy.save(tmp_path / "p.json")
    again = LinearPolicy.load(tmp_path / "p.json")
    assert "_results" not in again.info and again.info["per_model"] == policy.info["per_model"]
    demo = again.info["per_model"]["g"]["demonstration"]  # the imitated episode's decisions, kept for a refit
    assert demo and all(len(d["features"]) == N_FEATURES and d["action"] in d["allowed"] for d in demo)
    for m, graph in (("g", g), ("h", h)):
        kept = policy.info["_results"][m][1]
        r = eqsat_rl_search(graph, BUILTIN, cost, again, CLOCK_FREE)
        assert r.stats["schedule"] == kept.stats["schedule"] == policy.info["per_model"][m]["schedule"]
        assert r.graph.structural_hash() == kept.graph.structural_hash() and check_equal(graph, r.graph) <= 1e-5


def test_per_model_openers_score_an_action_once_then_eqsats_schedule(monkeypatch):
    """With ``openers``, "A once, then all" is scored per model too; where only it beats eqsat (as the tree
    search found on ort-cpu's gpt2) the policy imitates it exactly; without openers that model keeps eqsat's."""
    g, cost = shared_input_graph(), AnalyticCost("cpu")
    real = eqsat_rl.proxy_cost
    names = action_names()

    def proxy(graph, rules, cost_model, choose, budget, ilp_s):
        _, t, sched = real(graph, rules, cost_model, choose, budget, ilp_s)
        acts = [names[d[1]] for d in sched.decisions]
        opened = len(acts) >= 2 and acts[0] == "no:conv" and set(acts[1:]) == {"all"}
        return (1.0 if opened else 2.0), t, sched

    monkeypatch.setattr(eqsat_rl, "proxy_cost", proxy)
    config = TrainConfig(per_model=True, late_candidates=1, time_weight=0, actions=("all", "no:conv", "no:multi"))
    policy, _ = train_policy({"g": g}, BUILTIN, cost, BUDGET, config)
    assert policy.info["per_model"]["g"]["imitated"] == "all"
    policy, _ = train_policy({"g": g}, BUILTIN, cost, BUDGET, replace(config, openers=True))
    info = policy.info["per_model"]["g"]
    assert info["imitated"] == "no:conv once, then all" and info["exact"] and info["reward"] > 0
    assert {"no:conv once, then all", "no:multi once, then all"} <= set(info["constant_rewards"])
    schedule = run_schedule(g, BUILTIN, cost, policy.greedy(), BUDGET)[0].stats["schedule"]
    assert schedule[0] == "no:conv" and set(schedule[1:]) == {"all"}


def test_per_model_stop_after_ends_the_cheapest_schedules_early(monkeypatch):
    """With ``stop_after``, eqsat's schedule and the cheapest others are also scored ended after k iterations
    (where they ran longer); where only such a run beats eqsat (as "only:multi once, then all" ended after 4 does
    on ort-cpu's gpt2) the policy imitates it exactly; a k at or past a schedule's length is not scored."""
    g, cost = shared_input_graph(), AnalyticCost("cpu")
    real = eqsat_rl.proxy_cost

    def proxy(graph, rules, cost_model, choose, budget, ilp_s):
        _, t, sched = real(graph, rules, cost_model, choose, budget, ilp_s)
        s = sched.schedule
        if s == ["no:conv", "no:conv", "stop"]:
            return 1.0, t, sched
        return (1.5 if s[0] == "no:conv" and s[-1] != "stop" else 2.0), t, sched

    monkeypatch.setattr(eqsat_rl, "proxy_cost", proxy)
    config = TrainConfig(per_model=True, late_candidates=1, time_weight=0, actions=("all", "no:conv", "no:multi"),
                         stop_candidates=1)
    policy, _ = train_policy({"g": g}, BUILTIN, cost, BUDGET, config)
    assert policy.info["per_model"]["g"]["imitated"] == "no:conv"
    policy, _ = train_policy({"g": g}, BUILTIN, cost, BUDGET, replace(config, stop_after=(2, 3, 9)))
    info = policy.info["per_model"]["g"]
    assert info["imitated"] == "no:conv, stop after 2" and info["exact"] and info["reward"] > 0
    scored = set(info["constant_rewards"])
    assert {"all, stop after 2", "no:conv, stop after 2", "no:conv, stop after 3"} <= scored  # all ran 3: not 3
    assert not {"all, stop after 3", "no:conv, stop after 9", "no:multi, stop after 2"} & scored
    assert run_schedule(g, BUILTIN, cost, policy.greedy(), BUDGET)[0].stats["schedule"] == ["no:conv", "no:conv",
                                                                                             "stop"]
    with pytest.raises(RLFlowError, match="at least 1"):
        eqsat_rl.stop_after(_fixed([]), 0)
    with pytest.raises(RLFlowError, match="iteration counts >= 1"):
        train_policy({"g": g}, BUILTIN, cost, BUDGET, replace(config, stop_after=(0,)))
