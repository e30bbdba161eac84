"""The multi-model agent (stage train_multi_model, issue K): one encoder and one PPO policy for several models,
tested zero-shot on a held-out model beside greedy -- its loops on tiny models, and the stage end to end through
Snakemake (`snakemake multi`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_pipeline import copy_workflow, job_counts, sh, tool

from rlflow.agents.checkpoint import Checkpointer, load_agent
from rlflow.config import load_config
from rlflow.problem import load_problem

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def problems(tiny_zoo, rules_file):
    config = load_config([ROOT / "config.yaml", ROOT / "tests/configs/tiny.yaml"],
                         ["device=cpu", "cost.target=analytic", "env.max_locations=8"])
    return config, {m: load_problem(config, tiny_zoo[m], rules_file) for m in ("bert", "vit", "gpt2")}


def test_real_envs_take_the_problems_in_turn(problems):
    from rlflow.agents.driver import RealEnvs
    from rlflow.nn.encoder import GraphEncoder
    from rlflow.env.observation import MAX_RANK, NODE_FEATURES

    config, p = problems
    enc = GraphEncoder(NODE_FEATURES, MAX_RANK, hidden=8, layers=1, heads=1, z_dim=6, n_xfers=len(p["bert"].rules))
    world = RealEnvs([p["bert"], p["vit"]], enc, 3)
    assert [len(env.graph.nodes) for env in world.envs] == [len(p[m].graph.nodes) for m in ("bert", "vit", "bert")]
    assert len(p["bert"].graph.nodes) != len(p["vit"].graph.nodes)


def test_shared_encoder_and_policy_learn_from_every_model_and_resume(problems, tmp_path):
    """The encoder replays each model's rollouts in that model's environment (a step that does not reproduce its
    file is an error), PPO steps real environments of both models, and a run with more updates resumes the
    partial checkpoint instead of starting over."""
    from rlflow.agents.multi_model import train_shared_encoder, train_shared_policy
    from rlflow.agents.rollouts import FORMAT, collect, graph_arrays, rules_digest
    from rlflow.atomic import write_npz
    from rlflow.env import make_env
    from rlflow.errors import RLFlowError

    config, p = problems
    training = {m: p[m] for m in ("bert", "vit")}
    rollouts = {}
    stored = {}
    for i, (m, q) in enumerate(training.items()):
        env = make_env(config, q.graph, q.rules, q.cost, reward=False)
        packed: list = []
        rollouts[m] = {"format": FORMAT, "rules": rules_digest(q.rules),
                       "episodes": collect(env, 3, 0.1, i, graphs=packed),
                       "env": {"max_steps": env.max_steps, "max_locations": env.max_locations}}
        stored[m] = tmp_path / f"{m}.graphs.npz"
        write_npz(stored[m], graph_arrays(packed, rollouts[m]["episodes"]))
    torch.manual_seed(0)  # the encoder's initial weights
    result, episodes = train_shared_encoder(training, rollouts, config, 0, Checkpointer(tmp_path / "enc.pt", "fp"),
                                            log=lambda line: None)
    assert len(episodes) == 6 and episodes[:3] == rollouts["bert"]["episodes"] and result.metrics["graphs"]["encoded"] == sum(len(e["actions"]) + 1 for e in episodes)
    # from the stored graphs (one episode of each model replayed to check them): the same encoder and z
    lines: list[str] = []
    torch.manual_seed(0)
    from_files, _ = train_shared_encoder(training, rollouts, dict(config, encoder={**config["encoder"], "replay_check": 1}),
                                         0, Checkpointer(tmp_path / "enc-stored.pt", "fp"), log=lines.append,
                                         stored=stored)
    assert from_files.metrics["replay_check"]["replayed_episodes"] == 2 and "1 of them replayed" in lines[0]
    # equal up to the order of float sums: torch's two CPU threads made z differ by 1e-7 from run to run
    # under load (it was equal with one thread)
    assert from_files.metrics["train_loss"] == pytest.approx(result.metrics["train_loss"], rel=1e-5)
    np.testing.assert_allclose(from_files.latents["z"], result.latents["z"], rtol=1e-5, atol=1e-6)
    swapped = {"bert": rollouts["vit"], "vit": rollouts["bert"]}
    with pytest.raises(RLFlowError, match="the rollouts of bert"):
        train_shared_encoder(training, swapped, config, 0, Checkpointer(tmp_path / "enc2.pt", "fp"),
                             log=lambda line: None)

    encoder = result.model.eval()
    ckpt = Checkpointer(tmp_path / "agent.pt", "fp")
    one = dict(config, multi_model={**config["multi_model"], "updates": 1})
    _, _, curve1, steps1, _ = train_shared_policy(list(training.values()), encoder, one, 0, ckpt, log=lambda line: None)
    per_update = 2 * config["multi_model"]["steps_per_update"]  # one env per model, two models
    assert len(curve1) == 1 and steps1 == per_update
    lines = []
    policy, args, curve2, steps2, _ = train_shared_policy(list(training.values()), encoder, config, 0, ckpt,
                                                          log=lines.append)
    assert lines[0] == "resuming after update 1"
    assert len(curve2) == config["multi_model"]["updates"] == 2 and curve2[0] == curve1[0]
    assert steps2 == 2 * per_update and args["in_dim"] == encoder.config["z_dim"]


def test_snakemake_multi_trains_one_agent_and_tests_it_on_the_held_out_model(tmp_path):
    from rlflow.graph import load_onnx

    copy_workflow(tmp_path)
    snakemake = tool("snakemake")
    r = sh(snakemake, "multi", "--cores", "2", "--configfile", "tests/configs/tiny.yaml", cwd=tmp_path, timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    counts = job_counts(r.stdout + r.stderr)
    assert counts["train_multi_model"] == 1 and counts["merge_rollouts"] == 2  # bert and vit; gpt2 held out
    assert "train_encoder" not in counts  # the stage trains its own, shared encoder
    doc = json.loads((tmp_path / "results/multi/metrics.json").read_text())
    assert doc["format"] == "rlflow.multi-model/1"
    assert doc["train_models"] == ["bert", "vit"] and doc["heldout"] == ["gpt2"]
    rows = {r["model"]: r for r in doc["rows"]}
    assert set(rows) == {"bert", "vit", "gpt2"} and rows["gpt2"]["heldout"] and not rows["bert"]["heldout"]
    for row in rows.values():
        a = row["agents"]["multi_model"]
        assert 0 <= a["max_rel_diff"] <= 1e-4 and a["final_ms"] <= row["initial_ms"]
        assert row["beats_greedy"] == (a["improvement_pct"] > row["greedy_pct"])
    n = doc["real_interactions"]
    assert n["training"] == 2 * 4 * 2  # tiny: 2 updates x 2 envs (one per model) x 4 steps
    assert n["evaluation"] == sum(rows[m]["agents"]["multi_model"]["real_steps"] for m in ("bert", "vit"))
    assert n["total"] == n["rollouts"] + n["training"] + n["evaluation"] and n["rollouts"] > 0
    assert (tmp_path / "results/multi/live").is_dir() and not (tmp_path / "results/multi/agent.pt.partial").exists()
    # the page (stage report_multi): every model's row and the held-out model's verdict against greedy
    assert counts["report_multi"] == 1
    page = (tmp_path / "results/multi/report.html").read_text()
    word = "beats greedy" if rows["gpt2"]["beats_greedy"] else "does not beat greedy"
    assert "gpt2 (held out): the agent " in page and f": {word}</li>" in page
    assert all(f"<td>{m}</td>" in page for m in rows) and "data:image/svg+xml" in page

    # the checkpoint is an agent `rlflow optimize --method rlflow --agent` runs on any model
    agent = load_agent(tmp_path / "results/multi/agent.pt")
    assert agent.method == "model_free" and agent.info["models"] == ["bert", "vit"]
    out = tmp_path / "gpt2-opt.onnx"
    r = sh(tool("rlflow"), "optimize", tmp_path / "results/gpt2/model.onnx", "--method", "rlflow", "--agent",
           tmp_path / "results/multi/agent.pt", "--rules", tmp_path / "results/rules/rules.json", "--out", out,
           "--set", "timing.budget_s=1", "--set", "timing.sessions=2",
           cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(load_onnx(out).outputs) == len(load_onnx(tmp_path / "results/gpt2/model.onnx").outputs)

    # a model both trained on and held out: one line, non-zero exit, nothing written
    r = sh(tool("rlflow"), "train-multi-model", "--config", "config.yaml", "--config", "tests/configs/tiny.yaml",
           "--results-dir", "results", "--costs-root", "results/costs", "--rules", "results/rules/rules.json",
           "--out", "x/agent.pt", "--encoder", "x/encoder.pt", "--metrics", "x/m.json",
           "--set", "multi_model.heldout=[vit]", cwd=tmp_path)
    assert r.returncode != 0 and r.stderr.strip() == "rlflow: error: multi_model: vit both trained on and held out"
    assert not (tmp_path / "x").exists()


def test_report_multi_draws_the_metrics_and_refuses_other_files(tmp_path):
    from rlflow.errors import RLFlowError
    from rlflow.report.multi import load_multi, to_html, verdicts

    row = lambda m, held, ours, greedy: {"model": m, "heldout": held, "nodes": 10, "initial_ms": 2.0,  # noqa: E731
                                         "greedy_pct": greedy, "agents": {"multi_model": {
                                             "improvement_pct": ours, "vs_greedy": None, "final_ms": 1.9,
                                             "max_rel_diff": 0.0, "real_steps": 5, "seconds": 1.0}}}
    doc = {"format": "rlflow.multi-model/1", "train_models": ["bert"], "heldout": ["gpt2", "vit"],
           "cost_label": "simulated H100", "rows": [row("bert", False, 8.0, 5.0), row("gpt2", True, 0.8, 0.0),
                                                     row("vit", True, 1.0, 1.0)],
           "real_interactions": {"rollouts": 100, "training": 20, "evaluation": 15, "total": 135},
           "curve": [{"update": 1, "mean_reward": 0.1}, {"update": 2, "mean_reward": 0.2}]}
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps(doc))
    assert verdicts(load_multi(path)) == ["gpt2 (held out): the agent +0.80%, greedy +0.00%: beats greedy",
                                          "vit (held out): the agent +1.00%, greedy +1.00%: does not beat greedy"]
    page = to_html(doc)
    assert "Trained on bert; held out: gpt2, vit" in page and "135" in page and page.count("<tr>") == 6
    for text, why in (("[1, 2]", "not the metrics of train_multi_model"), ("{", "not a valid JSON document")):
        path.write_text(text)
        with pytest.raises(RLFlowError, match=why):
            load_multi(path)
    with pytest.raises(RLFlowError, match="run stage train_multi_model first"):
        load_multi(tmp_path / "absent.json")
