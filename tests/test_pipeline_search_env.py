"""The search and rollout stages (measure_costs, search_taso, search_greedy, collect_rollouts, merge_rollouts) in
the registry, dvc.yaml and Snakemake's plan, and who reads the reward (only the agents' stages). Their run on the tiny config, and what reruns when which config key
changes, is checked on the end-to-end run: tests/test_pipeline_e2e.py."""

from __future__ import annotations

import yaml

from test_pipeline import REPO, job_counts, sh, tool

from rlflow.pipeline import registry

ROLLOUT_TARGET = "results/bert/rollouts.json"
SEARCH_TARGETS = ["results/bert/taso/model.onnx", "results/bert/greedy/model.onnx"]


#: the stages that run an agent (train_controller's code, model_free's): the only ones reading env.reward
AGENT_STAGES = {"train_controller", "train_model_free", "sweep_temperature", "sweep_reward", "train_multi_model",
                "train_controller_machine", "train_model_free_machine"}  # (the machine track's agents: machine.agents)


def test_only_the_agents_read_the_reward():
    for name, stage in registry.STAGES.items():
        reads = any(k.startswith("env.reward") for k in stage.params.values())
        assert reads == (name in AGENT_STAGES), name


def test_rollouts_read_env_and_cost_keys_but_no_reward_key():
    keys = set(registry.stage("collect_rollouts").params.values())
    assert {"env.max_steps", "env.max_locations", "cost.target", "rollouts.episodes"} <= keys
    assert not any(k.startswith("env.reward") for k in keys)
    for name in ("measure_costs", "search_taso", "search_greedy", "merge_rollouts"):
        assert not any(k.startswith("env.reward") for k in registry.stage(name).params.values()), name


def test_dvc_matrix_over_models_and_shards():
    doc = yaml.safe_load((REPO / "dvc.yaml").read_text())
    st = doc["stages"]["collect_rollouts"]
    assert st["matrix"] == {"model": "${models}", "shard": "${rollouts.shards}"}
    assert st["outs"] == ["results/${item.model}/rollouts/shard-${item.shard}.json",
                          "results/${item.model}/rollouts/shard-${item.shard}.graphs.npz"]
    assert doc["stages"]["merge_rollouts"]["do"]["deps"][-1] == "results/${item}/rollouts"
    assert "results/costs/${device}/${item}.json" in doc["stages"]["search_taso"]["do"]["deps"]
    r = sh(tool("dvc"), "repro", "--dry", "--force", "merge_rollouts")
    assert r.returncode == 0, r.stderr
    shards = yaml.safe_load((REPO / "config.yaml").read_text())["rollouts"]["shards"]
    for k in shards:  # one stage per shard of config.yaml (the matrix reads the param, asserted above)
        assert f"Running stage 'collect_rollouts@bert-{k}'" in r.stdout
    assert r.stdout.count("Running stage 'collect_rollouts@") == len(shards)
    assert f"--costs results/costs/auto/bert.json --out results/bert/rollouts/shard-{shards[-1]}.json" in r.stdout


def override(folder, name: str, text: str) -> str:
    """A config file merged over the others (Snakemake's --config cannot set nested integers)."""
    path = folder / f"{name}.yaml"
    path.write_text(text)
    return str(path)


def test_snakemake_dry_run_fans_out_the_shards(tmp_path):
    r = sh(tool("snakemake"), "-n", "-F", ROLLOUT_TARGET, "--configfile",
           override(tmp_path, "three", "rollouts: {shards: [0, 1, 2], episodes: 5}"))
    assert r.returncode == 0, r.stdout + r.stderr
    counts = job_counts(r.stdout)
    assert counts["collect_rollouts"] == 3 and counts["merge_rollouts"] == 1 and counts["measure_costs"] == 1
