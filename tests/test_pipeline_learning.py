"""Issue D's stages end to end on the tiny config (Snakemake): encoder -> world model -> controller (dream) and
the model-free baseline; a reward or temperature change reruns only the agents' stages."""

from __future__ import annotations

import json

from test_pipeline import copy_workflow, job_counts, sh, tool
from test_pipeline_search_env import override

from rlflow.pipeline import registry

TARGETS = ["results/bert/controller/metrics.json", "results/bert/model_free/metrics.json"]


def test_only_the_agents_read_the_reward():
    for name, stage in registry.STAGES.items():
        reads = any(k.startswith("env.reward") for k in stage.params.values())
        assert reads == (name in ("train_controller", "train_model_free")), name


def test_snakemake_tiny_learning_pipeline_and_partial_reruns(tmp_path):
    copy_workflow(tmp_path)
    snakemake = tool("snakemake")
    r = sh(snakemake, *TARGETS, "--cores", "2", "--configfile", "tests/configs/tiny.yaml", cwd=tmp_path, timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    counts = job_counts(r.stdout + r.stderr)
    assert counts["train_encoder"] == 1 and counts["train_world_model"] == 1
    assert counts["train_controller"] == 1 and counts["train_model_free"] == 1
    ctl = json.loads((tmp_path / TARGETS[0]).read_text())
    mf = json.loads((tmp_path / TARGETS[1]).read_text())
    assert ctl["real_interactions"]["training"] == 0 and ctl["dream_steps"] == 2 * 4 * 4
    assert mf["real_interactions"]["training"] == 2 * 4 * 2
    for m in (ctl, mf):
        assert m["real"]["best"]["runtime_ms"] <= m["real"]["initial"]["runtime_ms"]
    wm = json.loads((tmp_path / "results/bert/world_model/metrics.json").read_text())
    assert wm  # held-out quality figures
    assert (tmp_path / "results/bert/world_model/loss.csv").read_text().startswith("epoch")

    def dry(text: str) -> dict:
        r = sh(snakemake, *TARGETS, "-n", "--configfile", "tests/configs/tiny.yaml", override(tmp_path, "over", text),
               cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        return {} if "Nothing to be done" in r.stdout + r.stderr else job_counts(r.stdout)

    assert dry("{}") == {}
    assert dry("env: {reward: {alpha: 0.5}}") == {"train_controller": 1, "train_model_free": 1}
    assert dry("controller: {temperature: 0.75}") == {"train_controller": 1}
