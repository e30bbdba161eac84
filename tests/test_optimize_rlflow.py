"""The trained agents as optimisers: the train_controller and train_model_free stages' verified ONNX, trace and
dvclive outputs, their self-contained checkpoints, and `rlflow optimize --method rlflow --agent CKPT` on the
model they were trained on and on another model; its one-line errors.

A module fixture runs the real learning chain in-process on tiny bert (tiny config, analytic costs): rules,
rollouts, encoder, world model, controller, model-free (about 30 s)."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from rlflow.agents.logging import TrainingLog
from rlflow.cli import main
from rlflow.errors import RLFlowError

TINY_ARGS = ["--set", "cost.model=analytic", "--set", "device=cpu"]


def _cfg(root: Path) -> list[str]:
    return ["--config", str(root / "config.yaml"), "--config", str(root / "tests/configs/tiny.yaml"), *TINY_ARGS]


def _run(argv: list[str]) -> None:
    assert main(argv) == 0, argv


def _agent_args(root, d: Path, which: str, out: Path, *extra: str) -> list[str]:
    problem = ["--model", "bert", "--onnx", str(d / "bert.onnx"), "--rules", str(d / "rules.json"), "--no-progress"]
    if which == "controller":
        return ["train-controller", *_cfg(root), *problem, "--encoder", str(d / "enc/encoder.pt"),
                "--latents", str(d / "enc/latents.npz"), "--world-model", str(d / "wm/world_model.pt"),
                "--out", str(out / "controller.pt"), "--metrics", str(out / "metrics.json"),
                "--optimised", str(out / "model.onnx"), "--trace", str(out / "trace.json"), "--logs",
                str(out / "live"), *extra]
    return ["train-model-free", *_cfg(root), *problem, "--encoder", str(d / "enc/encoder.pt"),
            "--out", str(out / "model_free.pt"), "--metrics", str(out / "metrics.json"),
            "--optimised", str(out / "model.onnx"), "--trace", str(out / "trace.json"), "--logs", str(out / "live"),
            *extra]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, root):
    """Tiny bert, tiny rules, rollouts, encoder, world model, controller and model-free agent (stage CLIs)."""
    from rlflow.graph import zoo

    d = tmp_path_factory.mktemp("agents")
    cfg = _cfg(root)
    zoo.export_model("bert", d / "bert.onnx", zoo.TINY_SIZES["bert"])
    _run(["generate-rules", *cfg, "--out", str(d / "rules.json"), "--no-progress"])
    problem = ["--model", "bert", "--onnx", str(d / "bert.onnx"), "--rules", str(d / "rules.json"), "--no-progress"]
    for k in (0, 1):
        _run(["collect-rollouts", *cfg, *problem, "--shard", str(k), "--out", str(d / f"shards/shard-{k}.json")])
    _run(["merge-rollouts", *cfg, "--model", "bert", "--shards-dir", str(d / "shards"), "--out",
          str(d / "rollouts.json")])
    _run(["train-encoder", *cfg, *problem, "--rollouts", str(d / "rollouts.json"), "--out", str(d / "enc/encoder.pt"),
          "--latents", str(d / "enc/latents.npz"), "--metrics", str(d / "enc/metrics.json"), "--logs",
          str(d / "enc/live")])
    _run(["train-world-model", *cfg, "--model", "bert", "--latents", str(d / "enc/latents.npz"),
          "--out", str(d / "wm/world_model.pt"), "--metrics", str(d / "wm/metrics.json"),
          "--curve", str(d / "wm/loss.csv"), "--logs", str(d / "wm/live"), "--no-progress"])
    # on tiny data the world model learns no location masks (held-out recall 0), so the dream offers only the NO-OP
    # and the controller's heads stay as initialised: its real episodes are samples of them, and 8 of them (the
    # first greedy) find tiny bert's improving rewrite where 2 may not; the same for the model-free agent, whose
    # tiny.yaml budget (2 updates of 8 steps) leaves it near its initial policy among 112 rules: 16 episodes, since
    # one (rule, location) of its 36 lowers the cost (add-associativity at the embeddings' sum)
    for stage, out in (("controller", "ctl"), ("model_free", "mf")):
        _run(_agent_args(root, d, stage, d / out, "--set", f"{stage}.eval_episodes={EVAL_EPISODES[out]}"))
    return d


#: the fixture's controller.eval_episodes and model_free.eval_episodes, by checkpoint folder
EVAL_EPISODES = {"ctl": 8, "mf": 16}


def _tsv(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f, delimiter="\t"))


# ------------------------------------------------------------------ the stages' outputs
@pytest.mark.parametrize("which, method", [("ctl", "rlflow"), ("mf", "model_free")])
def test_stage_writes_a_verified_graph_and_a_search_format_trace(trained, which, method):
    from rlflow.cost import AnalyticCost
    from rlflow.graph import load_onnx
    from rlflow.graph.exec import get_runner, make_inputs, max_rel_diff
    from rlflow.graph.fold import fold_constants
    from rlflow.rewrite.matcher import MatchIndex
    from rlflow.rewrite.rule import load_rules

    d = trained
    trace = json.loads((d / which / "trace.json").read_text())
    metrics = json.loads((d / which / "metrics.json").read_text())
    # the searches' keys, with the same meaning
    for key in ("format", "method", "model", "onnx", "rules", "num_rules", "device", "cost_model", "cost", "config",
                "settings", "initial", "final", "speedup", "steps", "rules_applied", "expansions",
                "candidates_generated", "candidates_kept", "stop_reason", "seconds", "ms_per_expansion", "stats",
                "max_rel_diff", "tolerance", "training_seconds", "real_interactions"):
        assert key in trace, key
    assert trace["format"] == "rlflow.search-trace/2" and trace["method"] == method and trace["model"] == "bert"
    assert trace["device"] == "cpu" and trace["cost_model"] == "analytic" and trace["tolerance"] == 1e-4
    assert 0 <= trace["max_rel_diff"] <= 1e-4
    assert trace["seconds"] > 0 and trace["training_seconds"] > 0
    ri = trace["real_interactions"]
    assert ri == metrics["real_interactions"]
    assert ri["evaluation"] == metrics["real"]["steps"] == trace["expansions"] >= 1
    # one definition for both agents: the rollouts the encoder (and world model) learned from, training, the run
    assert set(ri) == {"rollouts", "training", "evaluation", "total"}
    rollouts = json.loads((d / "rollouts.json").read_text())["episodes"]
    assert ri["rollouts"] == sum(len(e["actions"]) for e in rollouts) > 0
    assert ri["rollouts"] == int(np.load(d / "enc/latents.npz")["lengths"].sum())
    assert ri["training"] == (0 if method == "rlflow" else 2 * 2 * 4)  # the dream: none; else updates x envs x steps
    assert ri["total"] == sum(v for k, v in ri.items() if k != "total")
    assert len(trace["steps"]) == trace["rules_applied"] <= metrics["real"]["best_step"]

    # the trace replays on the original graph to the written graph, with the metrics it states
    graph, rules = load_onnx(d / "bert.onnx"), load_rules(d / "rules.json")
    cost = AnalyticCost("cpu")
    assert trace["initial"]["runtime_ms"] == pytest.approx(cost.graph_metrics(graph).runtime_ms)
    assert trace["initial"]["nodes"] == len(graph.nodes)
    index = MatchIndex(graph, rules)
    by_id = {r.id: k for k, r in enumerate(rules)}
    for step in trace["steps"]:
        k = by_id[step["rule_id"]]
        m = index.matches[k][step["location"]]
        assert list(m.nodes) == step["nodes"] and rules[k].name == step["rule_name"]
        index = index.apply(k, step["location"])
        assert step["metrics"]["runtime_ms"] == pytest.approx(cost.graph_metrics(index.graph).runtime_ms)
    found = fold_constants(index.graph)
    assert trace["final"]["runtime_ms"] == pytest.approx(cost.graph_metrics(found).runtime_ms)
    assert trace["final"]["runtime_ms"] <= trace["initial"]["runtime_ms"]
    assert trace["final"]["runtime_ms"] == pytest.approx(metrics["real"]["best"]["runtime_ms"])
    assert trace["final"]["nodes"] == len(found.nodes)
    # the never-slower check (the protocol on the platform's backend: the analytic target on the CPU -> torch): the
    # file is the found graph only if it was called faster
    check = trace["speed_check"]
    assert check == metrics["speed_check"] and check["backend"] == "torch" and check["line"]
    assert trace["platform"] == metrics["platform"] == {"target": "analytic", "label": "analytic roofline",
                                                         "device": "cpu", "backend": "torch", "verifiable": True}
    optimised = load_onnx(d / which / "model.onnx")
    kept = found if check["kept"] == "optimised" else graph
    assert check["kept"] == "original" or check["verdict"] == "faster"
    assert optimised.structural_hash() == kept.structural_hash()
    # and computes what the original computes (onnxruntime, on the files as written)
    onnx.checker.check_model(str(d / which / "model.onnx"))
    feeds = make_inputs(graph, 3)
    want = get_runner(graph, "ort", "cpu")(feeds)
    got = get_runner(optimised, "ort", "cpu")(feeds)
    assert max_rel_diff(want, got) <= 1e-4


@pytest.mark.parametrize("which, names, rows", [
    ("enc/live", ["train/loss", "train/loss_metrics", "train/loss_counts", "heldout/loss"], 2),   # encoder.epochs
    ("wm/live", ["train/loss", "train/nll", "train/change_bce", "heldout/nll", "heldout/count_mse", "lr"], 3),
    ("ctl/live", ["dream/reward", "dream/episode_length", "dream/episode_return", "dream/disagreement",
                  "loss/value", "loss/clip"], 2),  # the tiny config trains a 2-member world model
    ("mf/live", ["real/reward", "real/interactions", "loss/entropy"], 2),
])
def test_training_stages_log_their_curves_with_dvclive(trained, which, names, rows):
    folder = trained / which
    summary = json.loads((folder / "metrics.json").read_text())
    assert summary["step"] == rows
    for name in names:
        table = _tsv(folder / "plots" / "metrics" / f"{name}.tsv")
        assert [int(r["step"]) for r in table] == list(range(1, rows + 1)), name
        values = [float(r[name.split("/")[-1]]) for r in table]
        assert all(np.isfinite(values)), name
    assert (folder / "params.yaml").is_file()
    assert not (folder / "dvc.yaml").exists() and not (folder / "report.html").exists()


def test_curves_match_the_stages_own_records(trained):
    d = trained
    enc = json.loads((d / "enc/metrics.json").read_text())
    logged = [float(r["loss"]) for r in _tsv(d / "enc/live/plots/metrics/train/loss.tsv")]
    assert logged == pytest.approx(enc["train_loss"])
    wm_rows = list(csv.DictReader((d / "wm/loss.csv").open()))
    logged = [float(r["nll"]) for r in _tsv(d / "wm/live/plots/metrics/heldout/nll.tsv")]
    assert logged == pytest.approx([float(r["heldout_nll"]) for r in wm_rows], rel=1e-5)
    mf = json.loads((d / "mf/metrics.json").read_text())
    logged = [float(r["reward"]) for r in _tsv(d / "mf/live/plots/metrics/real/reward.tsv")]
    assert logged == pytest.approx([row["mean_reward"] for row in mf["curve"]])
    assert [int(float(r["interactions"])) for r in _tsv(d / "mf/live/plots/metrics/real/interactions.tsv")] == [8, 16]
    ctl = json.loads((d / "ctl/metrics.json").read_text())
    lengths = [float(r["episode_length"]) for r in _tsv(d / "ctl/live/plots/metrics/dream/episode_length.tsv")]
    assert all(1 <= x <= 5 for x in lengths)  # env.max_steps = 5 in the tiny config
    assert ctl["dream_steps"] == 2 * 4 * 4


def _kill_at_update(monkeypatch, n: int):
    """Make the ``n``-th logged training update raise KeyboardInterrupt (a kill); returns the real logger."""
    real = TrainingLog.log_row
    calls = {"n": 0}

    def dying(self, row, *a, **k):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        return real(self, row, *a, **k)

    monkeypatch.setattr(TrainingLog, "log_row", dying)
    return real


def test_model_free_stage_resumes_after_a_kill_with_whole_curves(trained, root, tmp_path, monkeypatch, capsys):
    out = tmp_path / "mf"
    argv = _agent_args(root, trained, "model_free", out, "--set", "model_free.updates=3")
    real = _kill_at_update(monkeypatch, 2)  # update 2 is killed after update 1's partial checkpoint was saved
    assert main(argv) == 130
    assert (out / "model_free.pt.partial").is_file() and not (out / "model_free.pt").exists()
    assert not (out / "model.onnx").exists() and not (out / "trace.json").exists()
    monkeypatch.setattr(TrainingLog, "log_row", real)
    capsys.readouterr()
    assert main(argv) == 0
    assert "resuming after update 1" in capsys.readouterr().out
    assert [int(r["step"]) for r in _tsv(out / "live/plots/metrics/real/reward.tsv")] == [1, 2, 3]
    assert [int(float(r["interactions"])) for r in _tsv(out / "live/plots/metrics/real/interactions.tsv")] == \
        [8, 16, 24]
    trace = json.loads((out / "trace.json").read_text())
    assert trace["real_interactions"]["training"] == 24
    assert not (out / "model_free.pt.partial").exists()


def test_iterated_model_based_training_counts_its_real_steps_and_resumes(trained, root, tmp_path, monkeypatch,
                                                                          capsys):
    """controller.iterations=2: after update 2 of 4 the controller runs real episodes, the world model is trained
    again on the rollouts plus those steps, and PPO goes on in its dream; the steps are counted as training
    interactions, and a run killed after the refit resumes without refitting again. With branch_starts the
    dream after the refit also starts from the collected episodes' graphs, in the resumed run too."""
    from rlflow.agents.checkpoint import load_agent
    from rlflow.agents.world_model import load_world_model
    from rlflow.env.dream import DreamEnv

    starts = []
    real_init = DreamEnv.__init__

    def spy(self, *args, **kwargs):
        starts.append(kwargs["starts"])
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(DreamEnv, "__init__", spy)
    out = tmp_path / "ctl"
    argv = _agent_args(root, trained, "controller", out, "--set", "controller.updates=4", "--set",
                       "controller.iterations=2", "--set", "controller.collect_episodes=2", "--set",
                       "controller.branch_starts=0.5")
    real = _kill_at_update(monkeypatch, 3)  # killed at update 3, after the refit that followed update 2
    assert main(argv) == 130
    first = capsys.readouterr().out
    assert "world model refitted after updates 2" in first and "iteration 1: 2 real episodes" in first
    monkeypatch.setattr(TrainingLog, "log_row", real)
    assert main(argv) == 0
    second = capsys.readouterr().out
    assert "resuming after update 2" in second and "iteration 1:" not in second  # not refitted again
    metrics = json.loads((out / "metrics.json").read_text())
    (it,) = metrics["iterations"]
    assert it["iteration"] == 1 and it["real_episodes"] == 2 and it["real_steps"] >= 2
    assert it["heldout_reward_rmse"]["weighted"] is not None
    trace = json.loads((out / "trace.json").read_text())
    assert trace["real_interactions"]["training"] == it["real_steps"] == metrics["real_interactions"]["training"]
    assert [int(r["step"]) for r in _tsv(out / "live/plots/metrics/dream/reward.tsv")] == [1, 2, 3, 4]
    first, refit, resumed = starts  # the rollouts' graphs; with the collected ones; the same after the resume
    assert len(refit) == len(resumed) == len(first) + it["real_steps"] - 2  # each episode but its first graph
    assert torch.equal(refit.z, resumed.z)
    assert torch.equal(refit.z[:len(first)], first.z)
    refitted = load_agent(out / "controller.pt").world_model
    given = load_world_model(trained / "wm/world_model.pt")
    assert not all(torch.equal(a, b) for a, b in zip(refitted.state_dict().values(), given.state_dict().values()))


def test_the_controller_stage_branches_its_dream_from_the_rollouts_real_graphs(trained, root, tmp_path, monkeypatch):
    """controller.branch_starts reaches the dream, which gets every rollout graph part way through its episode as
    a start (within the horizon); 0 (the default) gives it none."""
    from rlflow.agents.world_model import load_latents
    from rlflow.env.dream import DreamEnv

    seen = []
    real_init = DreamEnv.__init__

    def spy(self, *args, **kwargs):
        seen.append((kwargs.get("branch"), kwargs.get("starts")))
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(DreamEnv, "__init__", spy)
    lengths = load_latents(trained / "enc/latents.npz")["lengths"]
    for branch in (0.5, 0.0):
        _run(_agent_args(root, trained, "controller", tmp_path / str(branch), "--set", "controller.updates=1",
                         "--set", f"controller.branch_starts={branch}"))
    (b, starts), (b0, none) = seen
    assert b == 0.5 and len(starts) == int((np.minimum(lengths, 5) - 1).clip(0).sum())  # tiny.yaml: horizon 5
    assert b0 == 0.0 and none is None


# ------------------------------------------------------------------ self-contained checkpoints
@pytest.mark.parametrize("name, method", [("ctl/controller.pt", "rlflow"), ("mf/model_free.pt", "model_free")])
def test_agent_checkpoint_is_self_contained(trained, name, method):
    from rlflow.agents.checkpoint import AGENT_KINDS, load_agent, rules_fingerprint
    from rlflow.rewrite.rule import load_rules

    data = torch.load(trained / name, weights_only=True)
    assert data["kind"] == AGENT_KINDS[method]
    assert {"policy", "encoder", "rules", "env", "config"} <= set(data)
    assert ("world_model" in data) == (method == "rlflow")
    assert data["rules"] == rules_fingerprint(load_rules(trained / "rules.json"))
    episodes = EVAL_EPISODES[name.split("/")[0]]
    n = len(load_rules(trained / "rules.json"))  # the tiny config's generated rules plus every builtin rule
    plan = 0.0001 if method == "rlflow" else None  # the controller plans with its world model (controller.plan)
    assert data["rules"]["count"] == n and data["env"] == {"max_steps": 5, "max_locations": 200, "episodes": episodes,
                                                    "no_revisit": False, "plan_min_saving": plan}
    agent = load_agent(trained / name)
    assert agent.method == method and agent.policy_args["n_xfers"] == n


# ------------------------------------------------------------------ rlflow optimize --method rlflow
@pytest.mark.parametrize("which, ckpt", [("ctl", "controller.pt"), ("mf", "model_free.pt")])
def test_optimize_with_an_agent_repeats_the_stages_run(trained, which, ckpt, tmp_path, capsys):
    """The checkpoint alone (no encoder, world model or latents files) reproduces the stage's real run."""
    import shutil

    d = trained
    agent = tmp_path / ckpt
    shutil.copy2(d / which / ckpt, agent)  # alone, away from the files it was trained from
    out, trace = tmp_path / "opt.onnx", tmp_path / "trace.json"
    code = main(["optimize", str(d / "bert.onnx"), "--out", str(out), "--method", "rlflow", "--agent", str(agent),
                 "--rules", str(d / "rules.json"), "--cost-model", "analytic", "--trace", str(trace),
                 "--no-progress", "--no-speed-check"])
    assert code == 0
    text = capsys.readouterr().out
    assert "wrote" in text and str(out) in text
    mine, stage = json.loads(trace.read_text()), json.loads((d / which / "trace.json").read_text())
    assert mine["format"] == "rlflow.search-trace/2"
    assert mine["method"] == ("rlflow" if which == "ctl" else "model_free")
    assert mine["agent"] == str(agent) and mine["agent_trained_on"] == "bert"
    assert mine["steps"] == stage["steps"] and mine["final"] == stage["final"] and mine["initial"] == stage["initial"]
    assert mine["real_interactions"]["evaluation"] == stage["real_interactions"]["evaluation"]
    assert "speed_check" not in mine  # --no-speed-check
    if stage["speed_check"]["kept"] == "optimised":  # else the stage wrote the original (its never-slower check)
        assert onnx.load(out).SerializeToString() == onnx.load(d / which / "model.onnx").SerializeToString()


def _forced_agent(trained, tmp_path, favour: str | None, location: int | None = None) -> Path:
    """The model-free checkpoint with its rule head overridden: always the rule named ``favour`` where it
    matches (the NO-OP never before the horizon), or (None) the NO-OP right away; with ``location``, its
    location head too: always that location where it is valid."""
    from rlflow.rewrite.rule import load_rules

    data = torch.load(trained / "mf/model_free.pt", weights_only=True)
    sd = data["policy"]["state_dict"]
    n = data["rules"]["count"]
    sd["xfer_head.weight"].zero_()
    bias = torch.zeros(n + 1)
    if favour is None:
        bias[n] = 100.0
    else:
        bias[n] = -100.0
        names = [r.name for r in load_rules(trained / "rules.json")]
        bias[names.index(favour)] = 100.0
    sd["xfer_head.bias"].copy_(bias)
    if location is not None:
        sd["loc_head.2.weight"].zero_()
        sd["loc_head.2.bias"].zero_()
        sd["loc_head.2.bias"][location] = 100.0
    path = tmp_path / f"forced-{favour}.pt"
    torch.save(data, path)
    return path


def test_an_agent_that_applies_rewrites_writes_them_all_in_order(trained, tmp_path):
    from rlflow.cost import AnalyticCost
    from rlflow.graph import load_onnx

    # add-associativity at location 0, (e0 + e1) + e2 -> e0 + (e1 + e2) on tiny bert's three embeddings, puts two
    # constants side by side: the one rewrite that lowers its analytic cost in one step
    fav = "add-associativity"
    agent = _forced_agent(trained, tmp_path, fav, location=0)
    out, trace = tmp_path / "opt.onnx", tmp_path / "trace.json"
    assert main(["optimize", str(trained / "bert.onnx"), "--out", str(out), "--method", "rlflow", "--agent", str(agent),
                 "--rules", str(trained / "rules.json"), "--cost-model", "analytic", "--trace", str(trace),
                 "--no-progress", "--no-speed-check"]) == 0
    doc = json.loads(trace.read_text())
    names = [s["rule_name"] for s in doc["steps"]]
    assert doc["rules_applied"] == len(names) >= 1 and names[0] == fav
    k = names.count(fav)
    assert names[:k] == [fav] * k  # while it matches, the favoured rule is taken
    costs = [doc["initial"]["runtime_ms"]] + [s["cost_ms"] for s in doc["steps"]]
    assert costs[-1] < costs[0] and doc["speedup"] > 1
    assert doc["final"]["runtime_ms"] == pytest.approx(AnalyticCost("cpu").graph_metrics(load_onnx(out)).runtime_ms)
    assert doc["max_rel_diff"] <= 1e-4


def test_an_agent_that_finds_nothing_writes_the_original(trained, tmp_path):
    from rlflow.graph import load_onnx

    agent = _forced_agent(trained, tmp_path, None)
    out, trace = tmp_path / "opt.onnx", tmp_path / "trace.json"
    assert main(["optimize", str(trained / "bert.onnx"), "--out", str(out), "--method", "rlflow", "--agent", str(agent),
                 "--rules", str(trained / "rules.json"), "--cost-model", "analytic", "--trace", str(trace),
                 "--no-progress", "--no-speed-check"]) == 0
    doc = json.loads(trace.read_text())
    assert doc["steps"] == [] and doc["rules_applied"] == 0 and doc["stop_reason"] == "noop"
    # one real step (the NO-OP) in each of the model-free agent's episodes
    assert doc["expansions"] == EVAL_EPISODES["mf"] and doc["speedup"] == 1.0 and doc["final"] == doc["initial"]
    assert load_onnx(out).structural_hash() == load_onnx(trained / "bert.onnx").structural_hash()


@pytest.mark.parametrize("ckpt", ["ctl/controller.pt", "mf/model_free.pt"])
def test_optimize_runs_an_agent_on_another_model(trained, ckpt, tmp_path, capsys):
    """The agent is not tied to the model it was trained on: any graph, the same rules."""
    from rlflow.graph import zoo

    src = tmp_path / "vit.onnx"
    zoo.export_model("vit", src, zoo.TINY_SIZES["vit"])
    out = tmp_path / "vit.opt.onnx"
    code = main(["optimize", str(src), "--out", str(out), "--method", "rlflow", "--agent", str(trained / ckpt),
                 "--rules", str(trained / "rules.json"), "--cost-model", "analytic", "--json", "--no-progress",
                 "--no-speed-check"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["out"] == str(out) and doc["max_rel_diff"] <= 1e-4 and out.is_file()
    episodes = EVAL_EPISODES[ckpt.split("/")[0]]
    assert doc["final"]["runtime_ms"] <= doc["initial"]["runtime_ms"] and 1 <= doc["expansions"] <= 5 * episodes
    assert doc["stats"]["episodes"] == episodes


def _rules_variant(trained, tmp_path, how: str) -> Path:
    doc = json.loads((trained / "rules.json").read_text())
    if how == "fewer":
        doc["rules"] = doc["rules"][:-1]
    else:  # the same rules in another order
        doc["rules"] = doc["rules"][::-1]
    path = tmp_path / f"rules-{how}.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("case", ["missing", "corrupt", "truncated", "encoder", "world_model", "partial", "old",
                                  "fewer_rules", "reordered_rules", "no_agent", "agent_with_taso",
                                  "agent_with_greedy", "search_option"])
def test_optimize_rlflow_errors_are_one_line_and_write_nothing(trained, tmp_path, capsys, case):
    from rlflow.rewrite.rule import load_rules

    d = trained
    agent, rules = d / "ctl/controller.pt", d / "rules.json"
    n_rules = len(load_rules(rules))
    method, extra = "rlflow", []
    want = {"missing": "no such checkpoint", "corrupt": "not a readable checkpoint",
            "truncated": "not a readable checkpoint", "encoder": "an encoder checkpoint",
            "world_model": "a world-model checkpoint", "partial": "partial checkpoint",
            "old": "older rlflow", "fewer_rules": f"trained with {n_rules} rules", "reordered_rules": "other rules",
            "no_agent": "needs --agent", "agent_with_taso": "--agent", "agent_with_greedy": "--agent",
            "search_option": "--budget"}[case]
    if case == "missing":
        agent = tmp_path / "none.pt"
    elif case == "corrupt":
        agent = tmp_path / "bad.pt"
        agent.write_bytes(b"not a checkpoint at all")
    elif case == "truncated":
        agent = tmp_path / "cut.pt"
        agent.write_bytes((d / "ctl/controller.pt").read_bytes()[:2000])
    elif case == "encoder":
        agent = d / "enc/encoder.pt"
    elif case == "world_model":
        agent = d / "wm/world_model.pt"
    elif case == "partial":
        agent = tmp_path / "controller.pt.partial"
        torch.save({"policy": {}, "updates": 1, "curve": [], "fingerprint": "x"}, agent)
    elif case == "old":
        agent = tmp_path / "old.pt"
        data = torch.load(d / "ctl/controller.pt", weights_only=True)
        torch.save({"kind": "rlflow.controller/1", "policy": data["policy"]["state_dict"], "config": {}}, agent)
    elif case in ("fewer_rules", "reordered_rules"):
        rules = _rules_variant(d, tmp_path, case.split("_")[0])
    elif case == "no_agent":
        agent = None
    elif case.startswith("agent_with_"):
        method = case.removeprefix("agent_with_")
    elif case == "search_option":
        extra = ["--budget", "10"]
    out, trace = tmp_path / "out.onnx", tmp_path / "trace.json"
    argv = ["optimize", str(d / "bert.onnx"), "--out", str(out), "--method", method, "--rules", str(rules),
            "--cost-model", "analytic", "--trace", str(trace), "--no-progress", *extra]
    if agent is not None:
        argv += ["--agent", str(agent)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("rlflow: error: ") and want in err, err
    if case == "fewer_rules":
        assert f"has {n_rules - 1}" in err
    assert not out.exists() and not trace.exists()


def _drop_policy_weight(data: dict) -> None:
    del data["policy"]["state_dict"]["trunk.0.weight"]


def _older_op_list(data: dict) -> None:  # an encoder reading two node features fewer (two IR ops added since)
    data["encoder"]["config"]["node_features"] -= 2
    sd = data["encoder"]["state_dict"]
    sd["node_in.weight"] = sd["node_in.weight"][:, 2:]


@pytest.mark.parametrize("damage, words", [(_drop_policy_weight, ["damaged agent checkpoint"]),
                                           (_older_op_list, ["node features", "train it again"])])
def test_a_damaged_or_older_agent_checkpoint_is_one_line(trained, tmp_path, capsys, damage, words):
    """A checkpoint missing a weight, or one whose encoder was trained on another list of IR op types, is refused
    in one line naming the cause (not run into a shape error), and nothing is written."""
    data = torch.load(trained / "ctl/controller.pt", weights_only=True)
    damage(data)
    agent = tmp_path / "agent.pt"
    torch.save(data, agent)
    out = tmp_path / "out.onnx"
    assert main(["optimize", str(trained / "bert.onnx"), "--out", str(out), "--method", "rlflow", "--agent", str(agent),
                 "--rules", str(trained / "rules.json"), "--cost-model", "analytic", "--no-progress",
                 "--no-speed-check"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(w in err for w in words) and not out.exists()


def test_an_encoder_trained_on_another_op_list_is_one_line_naming_the_file(trained, tmp_path):
    from rlflow.agents.checkpoint import load_encoder

    data = torch.load(trained / "enc/encoder.pt", weights_only=True)
    data["encoder_config"]["node_features"] += 1
    path = tmp_path / "encoder.pt"
    torch.save(data, path)
    want = f"^{re.escape(str(path))}: an encoder checkpoint of another rlflow version.*train it again"
    with pytest.raises(RLFlowError, match=want):
        load_encoder(path)


def test_optimize_help_explains_the_agent(capsys):
    with pytest.raises(SystemExit) as e:
        main(["optimize", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for word in ("rlflow", "--agent", "controller.pt", "model_free.pt", "train_controller", "rule set"):
        assert word in text, word


# ------------------------------------------------------------------ the one agent driver: what both stages run
@pytest.mark.parametrize("which", ["controller", "model_free"])
def test_real_interactions_are_the_real_envs_own_steps(trained, root, tmp_path, monkeypatch, which):
    """Every GraphRewriteEnv.step the stage takes is counted once (training + evaluation), and the rollouts are
    the encoder's rollout steps: the same definition for both agents."""
    from rlflow.env.graph_rewrite import GraphRewriteEnv

    calls = {"n": 0}
    real_step = GraphRewriteEnv.step

    def counting(self, action):
        calls["n"] += 1
        return real_step(self, action)

    monkeypatch.setattr(GraphRewriteEnv, "step", counting)
    _run(_agent_args(root, trained, which, tmp_path / which))
    ri = json.loads((tmp_path / which / "trace.json").read_text())["real_interactions"]
    assert ri["training"] + ri["evaluation"] == calls["n"] > 0
    assert ri["training"] == (0 if which == "controller" else 2 * 2 * 4)
    assert ri["rollouts"] == torch.load(trained / "enc/encoder.pt", weights_only=True)["rollout_steps"] > 0


@pytest.mark.parametrize("which", ["ctl", "mf"])
def test_trained_agent_finds_a_cheaper_graph_than_the_original(trained, which):
    """Tiny bert has improving rewrites (greedy search finds them); both trained agents' best graphs are strictly
    cheaper than the original, and the written trace says so."""
    metrics = json.loads((trained / which / "metrics.json").read_text())
    trace = json.loads((trained / which / "trace.json").read_text())
    assert metrics["real"]["best"]["runtime_ms"] < metrics["real"]["initial"]["runtime_ms"]
    assert trace["final"]["runtime_ms"] < trace["initial"]["runtime_ms"] and trace["rules_applied"] >= 1


@pytest.mark.parametrize("which", ["ctl", "mf"])
def test_the_stage_says_where_its_time_went(trained, which):
    """metrics.json splits the stage's seconds into setup, training, the real-env optimisation and the checks
    (a GPU box verifies what a CPU box cannot: its stage times are compared phase by phase)."""
    metrics = json.loads((trained / which / "metrics.json").read_text())
    phases = metrics["phase_seconds"]
    assert set(phases) == {"setup", "training", "optimisation", "checks"} and min(phases.values()) > 0
    assert sum(phases.values()) <= metrics["seconds"]
    assert phases["training"] == pytest.approx(metrics["training_seconds"], rel=0.05, abs=0.05)


# ------------------------------------------------------------------ evaluation over policy snapshots
def test_snapshot_updates_spread_over_training():
    from rlflow.agents.driver import snapshot_updates

    assert snapshot_updates(100, 8) == {12, 25, 38, 50, 62, 75, 88, 100}
    assert snapshot_updates(4, 2) == {2, 4}
    assert snapshot_updates(2, 8) == {1, 2}  # fewer updates than episodes: one snapshot per update
    assert max(snapshot_updates(7, 3)) == 7  # the last is the final policy


def test_best_run_keeps_the_fastest_episode_and_counts_every_step():
    from rlflow.agents.real_env import best_run

    runs = [{"best": {"runtime_ms": 2.0}, "steps": 5, "best_step": 1},
            {"best": {"runtime_ms": 1.5}, "steps": 7, "best_step": 3, "turned_down": 2},
            {"best": {"runtime_ms": 1.5}, "steps": 4, "best_step": 2}]
    r = best_run(runs)
    assert r["best_episode"] == 1 and r["best_step"] == 3  # the earliest of the two fastest
    assert r["steps"] == 16 and r["turned_down"] == 2 and r["episodes"] == 3
    assert r["episode_steps"] == [5, 7, 4] and r["episode_best_runtime_ms"] == [2.0, 1.5, 1.5]
    with pytest.raises(ValueError):
        best_run([])


@pytest.mark.parametrize("which, ckpt", [("controller", "controller.pt"), ("model_free", "model_free.pt")])
def test_snapshot_evaluation_keeps_the_best_snapshot(trained, root, tmp_path, monkeypatch, capsys, which, ckpt):
    """eval_policies=snapshots (4 updates, eval_episodes 2): the policy after updates 2 and 4 each run one greedy
    episode, every step counted; the checkpoint holds the snapshot whose episode found the best graph, and
    `rlflow optimize` with it repeats that episode (greedy, once)."""
    from rlflow.agents.checkpoint import Agent, load_agent

    seen = []
    real_optimise = Agent.optimise

    def spy(self, *args, snapshots=None, **kwargs):
        seen.append([{k: v.clone() for k, v in s.items()} for s in snapshots or []])
        return real_optimise(self, *args, snapshots=snapshots, **kwargs)

    monkeypatch.setattr(Agent, "optimise", spy)
    out = tmp_path / which
    _run(_agent_args(root, trained, which, out, "--set", f"{which}.updates=4", "--set", f"{which}.eval_episodes=2",
                     "--set", f"{which}.eval_policies=snapshots"))
    (snaps,) = seen
    assert len(snaps) == 2 and not all(torch.equal(snaps[0][k], snaps[1][k]) for k in snaps[0])
    real = json.loads((out / "metrics.json").read_text())["real"]
    trace = json.loads((out / "trace.json").read_text())
    assert real["snapshots"] == [2, 4] and real["snapshot_kept"] in (2, 4)
    kept = real["snapshots"].index(real["snapshot_kept"])
    best = real["snapshot_best_runtime_ms"]
    assert min(best) == best[kept] == real["best"]["runtime_ms"]
    assert trace["stats"]["episodes"] == 2 and trace["stats"]["best_episode"] == kept
    assert trace["settings"]["snapshots"] == 2 and trace["real_interactions"]["evaluation"] == real["steps"]
    assert real["steps"] <= 2 * (5 + 1)  # two episodes of tiny.yaml's horizon 5 (and the NO-OP)
    agent = load_agent(out / ckpt)
    assert agent.env["episodes"] == 1
    assert all(torch.equal(v, snaps[kept][k]) for k, v in agent.policy.state_dict().items())

    monkeypatch.setattr(Agent, "optimise", real_optimise)
    mine = tmp_path / "trace.json"
    assert main(["optimize", str(trained / "bert.onnx"), "--out", str(tmp_path / "opt.onnx"), "--method", "rlflow",
                 "--agent", str(out / ckpt), "--rules", str(trained / "rules.json"), "--cost-model", "analytic",
                 "--trace", str(mine), "--no-progress", "--no-speed-check"]) == 0
    mine = json.loads(mine.read_text())
    assert mine["steps"] == trace["steps"] and mine["final"] == trace["final"]
    assert mine["real_interactions"]["evaluation"] <= trace["real_interactions"]["evaluation"]


@pytest.mark.parametrize("good_first", [True, False])
def test_optimise_over_snapshots_keeps_the_one_that_finds_the_better_graph(trained, tmp_path, good_first):
    """Two snapshots, one that makes tiny bert's improving rewrite and one that stops at once: whichever order
    they come in, the improving one's graph is the result, the policy is left holding it, and both episodes'
    steps are counted."""
    from rlflow.agents.checkpoint import load_agent
    from rlflow.cost import AnalyticCost
    from rlflow.graph import load_onnx
    from rlflow.rewrite.rule import load_rules

    good = load_agent(_forced_agent(trained, tmp_path, "add-associativity", location=0)).policy.state_dict()
    stop = load_agent(_forced_agent(trained, tmp_path, None)).policy.state_dict()
    snaps = [good, stop] if good_first else [stop, good]
    agent = load_agent(trained / "mf/model_free.pt")
    graph, cost = load_onnx(trained / "bert.onnx"), AnalyticCost("cpu")
    result, run = agent.optimise(graph, load_rules(trained / "rules.json"), cost, snapshots=snaps)
    kept = 0 if good_first else 1
    assert run["best_episode"] == kept and run["episodes"] == 2
    assert result.final.runtime_ms < result.initial.runtime_ms and result.trace[0].rule_name == "add-associativity"
    assert run["steps"] == sum(run["episode_steps"]) and run["episode_steps"][1 - kept] == 1  # the NO-OP alone
    assert result.settings["snapshots"] == 2 and result.settings["snapshot_kept"] == kept
    assert all(torch.equal(v, snaps[kept][k]) for k, v in agent.policy.state_dict().items())


def test_snapshots_from_before_a_refit_of_the_world_model_are_dropped(trained, root, tmp_path):
    """controller.iterations=2 refits the world model after update 2 of 4: the snapshots after updates 1 and 2
    read h from the old world model, so only those after updates 3 and 4 run their real episodes."""
    out = tmp_path / "ctl"
    _run(_agent_args(root, trained, "controller", out, "--set", "controller.updates=4", "--set",
                     "controller.iterations=2", "--set", "controller.collect_episodes=1", "--set",
                     "controller.eval_episodes=4", "--set", "controller.eval_policies=snapshots"))
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["iterations"]) == 1 and metrics["real"]["snapshots"] == [3, 4]
    assert json.loads((out / "trace.json").read_text())["stats"]["episodes"] == 2
