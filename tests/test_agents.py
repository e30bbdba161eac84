"""The controller (trained in the dream, run in the real env) and the model-free baseline, end to end on a
tiny model with untrained networks: shapes, interaction counting, best-graph bookkeeping, validity."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rlflow.cost import AnalyticCost
from rlflow.env import GraphRewriteEnv
from rlflow.env.observation import MAX_RANK, NODE_FEATURES
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


def test_real_vector_env_steps_are_counted_by_the_environments(setting):
    """The model-free agent's training world: every step of every copy is one real interaction, counted by the
    env (GraphRewriteEnv.total_steps, which rlflow.agents.driver sums), across episode resets."""
    from rlflow.agents.real_env import RealVectorEnv

    make, encoder, wm, rules = setting
    envs = [make(), make()]
    venv = RealVectorEnv(envs, encoder)
    obs = venv.reset()
    assert obs["features"].shape == (2, 6)
    for _ in range(7):  # max_steps=4: both copies end an episode and restart on the way
        xfer = torch.full((2,), envs[0].n_xfers)  # NO-OP ends an episode
        _, rewards, dones = venv.step_batch(xfer, torch.zeros(2, dtype=torch.long))
        assert dones.all()
    assert [e.total_steps for e in envs] == [7, 7] and all(e.steps == 0 for e in envs)


# ------------------------------------------------------------------ logging (dvclive) and episode statistics
class _CountingEnv:
    """A VectorEnv of 2 copies: copy 0 ends its episodes every 2 steps, copy 1 every 3; reward = 1 per step."""

    num_envs = 2

    def __init__(self):
        self.t = 0

    def reset(self):
        return {}

    def step_batch(self, xfer, loc):
        self.t += 1
        done = torch.tensor([self.t % 2 == 0, self.t % 3 == 0])
        return {}, torch.ones(2), done


def test_episode_stats_records_finished_episodes():
    from rlflow.agents.logging import EpisodeStats

    venv = EpisodeStats(_CountingEnv())
    venv.reset()
    for _ in range(6):
        venv.step_batch(None, None)
    stats = venv.pop()
    # copy 0: episodes ending at steps 2, 4, 6 (length 2); copy 1: at 3, 6 (length 3)
    assert stats == {"episodes": 5, "episode_return": (3 * 2 + 2 * 3) / 5, "episode_length": (3 * 2 + 2 * 3) / 5}
    assert venv.pop() == {"episodes": 0}
    venv.step_batch(None, None)
    assert venv.pop() == {"episodes": 0} and venv.t == 7  # attributes pass through


def _tsv(path):
    lines = path.read_text().splitlines()
    return [line.split("\t") for line in lines]


def test_training_log_writes_dvclive_curves_without_touching_the_repository(tmp_path, monkeypatch):
    import subprocess

    from rlflow.agents.logging import TrainingLog

    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    monkeypatch.chdir(repo)  # dvclive's default would `dvc init` a git repository without DVC
    folder = repo / "out" / "live"
    with TrainingLog(folder, params={"encoder": {"epochs": 3}, "seed": 0}) as live:
        assert live.replay([{"epoch": 1, "loss": 2.0, "seconds": 9.0}, {"epoch": 2, "loss": 1.5}], "epoch",
                           {"loss": "train/loss"}) == 2
        live.log(3, {"train/loss": torch.tensor(1.0), "heldout/loss": float("nan"), "lr": np.float32(0.5)})
        live.summary({"final/err": 0.25, "final/none": None})
    assert _tsv(folder / "plots/metrics/train/loss.tsv") == [["step", "loss"], ["1", "2.0"], ["2", "1.5"],
                                                             ["3", "1.0"]]
    assert _tsv(folder / "plots/metrics/lr.tsv") == [["step", "lr"], ["3", "0.5"]]
    assert not (folder / "plots/metrics/heldout").exists()  # NaN is left out
    assert not (folder / "plots/metrics/seconds.tsv").exists()  # not named: left out
    summary = json.loads((folder / "metrics.json").read_text())
    assert summary == {"train": {"loss": 1.0}, "lr": 0.5, "step": 3, "final": {"err": 0.25}}
    assert "epochs: 3" in (folder / "params.yaml").read_text()
    assert sorted(p.name for p in repo.iterdir()) == [".git", "out"]  # no .dvc, dvc.yaml, .gitignore
    assert not (folder / "dvc.yaml").exists()
    status = subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=repo, capture_output=True, text=True)
    assert status.stdout.strip() == "?? out/"

    # a new run in the same folder starts the curves over (a resumed run replays its saved rows first)
    with TrainingLog(folder) as live:
        live.log(1, {"train/loss": 3.0})
    assert _tsv(folder / "plots/metrics/train/loss.tsv") == [["step", "loss"], ["1", "3.0"]]
    assert not (folder / "plots/metrics/lr.tsv").exists() and not (folder / "params.yaml").exists()


def test_training_log_without_a_folder_logs_nothing(tmp_path, monkeypatch):
    from rlflow.agents.logging import TrainingLog

    monkeypatch.chdir(tmp_path)
    with TrainingLog(None, params={"a": 1}) as live:
        live.log(1, {"x": 1.0})
        live.summary({"y": 2.0})
    assert list(tmp_path.iterdir()) == []


def test_training_log_refuses_a_file(tmp_path):
    from rlflow.agents.logging import TrainingLog
    from rlflow.errors import RLFlowError

    (tmp_path / "f").write_text("x")
    with pytest.raises(RLFlowError, match="is a file"):
        TrainingLog(tmp_path / "f")


# ------------------------------------------------------------------ an agent's run as a search result
def test_search_result_replays_the_run_up_to_its_best_step(setting):
    """An agent that takes greedy search's rewrites, then one that does not lower the cost, then the NO-OP: its
    result is greedy's trace, exactly, and stops at the best step."""
    from rlflow.agents.real_env import run_episode, search_result
    from rlflow.errors import RLFlowError
    from rlflow.search.common import finish
    from rlflow.search.greedy import greedy_search

    make, encoder, wm, rules = setting
    env = make()
    cost, graph = env.cost, env.initial_index.graph
    greedy = greedy_search(graph, rules, cost)
    by_id = {r.id: k for k, r in enumerate(rules)}
    plan = [(by_id[s.rule_id], s.location) for s in greedy.trace][:3]
    assert plan, "greedy finds nothing on tiny bert"

    def choose(obs, xm, lm):
        t = env.steps
        if t < len(plan):
            return plan[t]
        if t == len(plan):  # a rewrite that does not lower the cost (the best step stays before it)
            for k in range(env.n_xfers):
                if xm[0, k] and k not in {p[0] for p in plan}:
                    return k, 0
        return env.n_xfers, 0

    run = run_episode(env, choose)
    assert run["best_step"] == len(plan) and run["steps"] >= len(plan) + 1
    folded, final = finish(run["best_graph"], cost)
    result = search_result("rlflow", graph, rules, cost, run, folded, final, 0.5, settings={"max_steps": 4})
    assert [s.to_json() for s in result.trace] == [s.to_json() for s in greedy.trace[:len(plan)]]
    assert result.final.runtime_ms == pytest.approx(run["best"]["runtime_ms"])
    assert result.expansions == run["steps"] and result.seconds == 0.5 and result.kept == len(plan)
    doc = result.to_json(model="m")
    assert doc["format"] == "rlflow.search-trace/2" and doc["method"] == "rlflow" and doc["speedup"] > 1
    assert doc["stats"]["best_step"] == len(plan) and doc["settings"] == {"max_steps": 4}

    # a run that does not replay to its best graph is refused
    bad = dict(run, best_graph=graph)
    with pytest.raises(RLFlowError, match="did not give its best graph"):
        search_result("rlflow", graph, rules, cost, bad, folded, final, 0.5)


def test_an_episode_that_never_revisits_turns_down_the_step_back_and_counts_it(setting):
    """mul-associativity at location 0, taken twice, gives the graph back (the commutative matcher binds the
    regrouped product at location 0 again, the other way round, and regroups it as it was). An agent that always
    wants it goes back and forth; with ``no_revisit`` the step back is looked at, turned down (a counted
    interaction) and the agent chooses again among the rest, so no graph repeats. An agent that keeps asking for a
    seen graph ends the episode (NO-OP) after REVISIT_TRIES looks."""
    from rlflow.agents.real_env import REVISIT_TRIES, run_episode

    make, encoder, wm, rules = setting
    k = next(i for i, r in enumerate(rules) if r.id == "b-mul-assoc")

    def choose(obs, xm, lm):  # (k, 0) while the masks allow it, else the first allowed action
        if lm[0, k, 0]:
            return k, 0
        first = int(torch.nonzero(xm[0, :-1])[0])
        return first, int(torch.nonzero(lm[0, first])[0])

    for no_revisit in (False, True):
        env = make()
        hashes = [env.initial_index.graph.structural_hash()]
        start = env.total_steps
        run = run_episode(env, choose, lambda obs, action: hashes.append(env.graph.structural_hash()), no_revisit)
        assert len(run["actions"]) == 4 and run["steps"] == env.total_steps - start
        if no_revisit:
            assert len(set(hashes)) == len(hashes) == 5
            assert run["turned_down"] >= 1 and run["steps"] == 4 + run["turned_down"]
        else:
            assert hashes[0] == hashes[2] == hashes[4] != hashes[1] and run["turned_down"] == 0
            assert run["steps"] == 4

    env = make()
    stubborn = run_episode(env, lambda obs, xm, lm: (k, 0), no_revisit=True)
    assert stubborn["actions"] == [[k, 0], [env.n_xfers, 0]]
    assert stubborn["turned_down"] == REVISIT_TRIES and stubborn["steps"] == 2 + REVISIT_TRIES


# ------------------------------------------------------------------ agent checkpoints
def test_agent_checkpoint_round_trip_and_rule_check(setting, tmp_path):
    from rlflow.agents.checkpoint import Agent, load_agent, rules_fingerprint
    from rlflow.errors import RLFlowError
    from rlflow.nn.policy import HierarchicalPolicy

    make, encoder, wm, rules = setting
    args = {"in_dim": 6 + 12, "n_xfers": len(rules), "max_locations": 8, "hidden": 16}
    policy = HierarchicalPolicy(**args)
    agent = Agent("rlflow", policy, args, encoder, rules_fingerprint(rules),
                  {"max_steps": 4, "max_locations": 8, "episodes": 3}, world_model=wm, config={"seed": 0})
    path = tmp_path / "a.pt"
    torch.save(agent.payload(), path)
    back = load_agent(path)
    assert back.method == "rlflow" and back.env == {"max_steps": 4, "max_locations": 8, "episodes": 3,
                                                    "no_revisit": False, "plan_min_saving": None}
    agent.env["no_revisit"], agent.env["plan_min_saving"] = True, 0.01
    torch.save(agent.payload(), path)
    back = load_agent(path)  # compared below with the original, which now turns revisits down and plans too
    assert back.env["no_revisit"] is True and back.env["plan_min_saving"] == 0.01
    x = torch.randn(3, args["in_dim"])
    for a, b in ((policy, back.policy),):
        torch.testing.assert_close(a.trunk(x), b.trunk(x))
    for k, v in encoder.state_dict().items():
        torch.testing.assert_close(back.encoder.state_dict()[k], v)
    for k, v in wm.state_dict().items():
        torch.testing.assert_close(back.world_model.state_dict()[k], v)
    # the loaded agent runs like the original
    r1, _ = agent.optimise(make().initial_index.graph, rules, AnalyticCost("cpu"))
    r2, _ = back.optimise(make().initial_index.graph, rules, AnalyticCost("cpu"))
    assert [s.to_json() for s in r1.trace] == [s.to_json() for s in r2.trace] and r1.expansions == r2.expansions
    # every real step of the 3 episodes, and each look at a revisit that was turned down
    assert r1.stats["episodes"] == 3 and 3 <= r1.expansions <= 3 * 4 + r1.stats["revisits_turned_down"]

    back.check_rules(rules)
    with pytest.raises(RLFlowError, match=f"trained with {len(rules)} rules, the rules file has {len(rules) - 1}"):
        back.check_rules(rules[:-1])
    with pytest.raises(RLFlowError, match="other rules"):
        back.check_rules(rules[::-1])
    with pytest.raises(ValueError):
        Agent("model_free", policy, args, encoder, rules_fingerprint(rules), {"max_steps": 4, "max_locations": 8},
              world_model=wm)
    # a policy that does not fit the encoder and world model is a damaged checkpoint
    data = agent.payload()
    data["policy"]["args"] = dict(args, in_dim=7)
    data["policy"]["state_dict"] = HierarchicalPolicy(**data["policy"]["args"]).state_dict()
    torch.save(data, path)
    with pytest.raises(RLFlowError, match="damaged agent checkpoint: the policy reads 7 features"):
        load_agent(path)


def test_world_model_stage_logs_whole_curves_after_a_resume(tmp_path, monkeypatch):
    """Killed after epoch 1's checkpoint, resumed: the logs folder holds epochs 1..3 once each, epoch 1's values
    those of the first run (replayed from the checkpoint), the same as the loss.csv."""
    import csv

    import rlflow.agents.world_model as wmod
    from rlflow.cli import main
    from test_world_model import synthetic_latents

    lat = synthetic_latents(tmp_path / "l.npz", episodes=12)
    out = tmp_path / "wm"
    argv = ["train-world-model", "--set", "world_model.hidden=16", "--set", "world_model.gaussians=2",
            "--set", "world_model.batch_size=8", "--set", "world_model.epochs=3", "--set", "device=cpu",
            "--model", "toy", "--latents", str(lat), "--out", str(out / "world_model.pt"), "--metrics",
            str(out / "metrics.json"), "--curve", str(out / "loss.csv"), "--logs", str(out / "live"), "--no-progress"]
    real = wmod.mean_losses
    calls = {"n": 0}

    def dying(*a, **k):  # epoch 2's held-out evaluation is killed (epoch 1 is checkpointed and logged)
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(wmod, "mean_losses", dying)
    assert main(argv) == 130
    first = _tsv(out / "live/plots/metrics/train/loss.tsv")
    assert [r[0] for r in first] == ["step", "1"]
    monkeypatch.setattr(wmod, "mean_losses", real)
    assert main(argv) == 0
    logged = _tsv(out / "live/plots/metrics/train/loss.tsv")
    assert [r[0] for r in logged] == ["step", "1", "2", "3"] and logged[1] == first[1]
    rows = list(csv.DictReader((out / "loss.csv").open()))
    assert [float(r[1]) for r in logged[1:]] == pytest.approx([float(r["train_loss"]) for r in rows], rel=1e-5)
    held = _tsv(out / "live/plots/metrics/heldout/nll.tsv")
    assert [r[0] for r in held] == ["step", "1", "2", "3"]
    assert json.loads((out / "live/metrics.json").read_text())["step"] == 3
