"""Issue C's pipeline stages (measure_costs, search_taso, search_greedy, collect_rollouts, merge_rollouts):
what reruns when which config key changes (Snakemake and DVC), and a tiny end-to-end Snakemake run."""

from __future__ import annotations

import json

import yaml

from test_pipeline import REPO, TINY, copy_workflow, job_counts, sh, tool

from rlflow.pipeline import registry

ROLLOUT_TARGET = "results/bert/rollouts.json"
SEARCH_TARGETS = ["results/bert/taso/model.onnx", "results/bert/greedy/model.onnx"]


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
    for k in (0, 1):
        assert f"Running stage 'collect_rollouts@bert-{k}'" in r.stdout
    assert "--costs results/costs/auto/bert.json --out results/bert/rollouts/shard-1.json" in r.stdout


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


def test_snakemake_tiny_end_to_end_and_partial_reruns(tmp_path):
    copy_workflow(tmp_path)
    snakemake = tool("snakemake")
    targets = [ROLLOUT_TARGET, *SEARCH_TARGETS]
    r = sh(snakemake, *targets, "--cores", "2", "--configfile", "tests/configs/tiny.yaml", cwd=tmp_path, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert job_counts(r.stdout + r.stderr) == {"export_model": 1, "generate_rules": 1, "measure_costs": 1, "search_taso": 1,
                                    "search_greedy": 1, "collect_rollouts": 2, "merge_rollouts": 1}
    merged = json.loads((tmp_path / ROLLOUT_TARGET).read_text())
    assert merged["stats"]["episodes"] == 6 and merged["shards"] == [0, 1]
    costs = json.loads((tmp_path / "results/costs/auto/bert.json").read_text())
    # cost.target auto: sim-h100 on a CPU box (the cache holds the calibration only), cuda on a GPU box
    assert costs["device"] in ("cpu", "cuda") and costs["calibration"]["ort"]["gemm_flops_per_s"] > 0
    assert costs["target"] == ("cuda" if costs["device"] == "cuda" else "sim-h100")
    for method in ("taso", "greedy"):
        trace = json.loads((tmp_path / f"results/bert/{method}/trace.json").read_text())
        assert trace["max_rel_diff"] <= 1e-4

    def dry(text: str = "{}") -> dict:
        r = sh(snakemake, *targets, "-n", "--configfile", "tests/configs/tiny.yaml", override(tmp_path, "over", text),
               cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        return {} if "Nothing to be done" in r.stdout + r.stderr else job_counts(r.stdout)

    assert dry() == {}
    assert dry("env: {reward: {alpha: 0.5, name: delta}}") == {}  # no stage of this issue reads the reward
    assert dry("env: {max_steps: 7}") == {"collect_rollouts": 2, "merge_rollouts": 1}
    assert dry("search: {alpha: 1.0}") == {"search_taso": 1}
    assert dry("rollouts: {shards: [0, 1, 2]}") == {"collect_rollouts": 1, "merge_rollouts": 1}
