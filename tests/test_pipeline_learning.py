"""Issue D's stages end to end on the tiny config (Snakemake): encoder -> world model -> controller (dream) and
the model-free baseline, with their verified ONNX graphs, search-format traces and dvclive logs; a reward or
temperature change reruns only the agents' stages."""

from __future__ import annotations

import csv
import json

import pytest
from test_pipeline import copy_workflow, job_counts, sh, tool
from test_pipeline_search_env import override

from rlflow.cost import resolve_target
from rlflow.pipeline import registry

FOLDERS = {"controller": "results/bert/controller", "model_free": "results/bert/model_free"}
TARGETS = [f"{d}/{f}" for d in FOLDERS.values() for f in ("metrics.json", "trace.json", "model.onnx", "live")]
#: each training stage's dvclive folder, a curve it must hold and how many steps (tests/configs/tiny.yaml)
LOGS = {"results/bert/encoder/live": ("train/loss", 2), "results/bert/world_model/live": ("heldout/nll", 3),
        "results/bert/controller/live": ("dream/reward", 2), "results/bert/model_free/live": ("real/reward", 2)}
#: the keys of the search stages' traces (search_taso, search_greedy), which the evaluate stage and the report read
SEARCH_KEYS = {"format", "method", "model", "onnx", "rules", "num_rules", "device", "cost_model", "cost", "config",
               "settings", "initial", "final", "speedup", "steps", "rules_applied", "expansions",
               "candidates_generated", "candidates_kept", "stop_reason", "seconds", "ms_per_expansion", "stats",
               "max_rel_diff", "tolerance"}
#: the stages that run an agent (train_controller's code, model_free's): the only ones reading env.reward
AGENT_STAGES = {"train_controller", "train_model_free", "sweep_temperature", "sweep_reward", "train_multi_model",
                "train_controller_machine", "train_model_free_machine"}  # (the machine track's agents: machine.agents)


def test_only_the_agents_read_the_reward():
    for name, stage in registry.STAGES.items():
        reads = any(k.startswith("env.reward") for k in stage.params.values())
        assert reads == (name in AGENT_STAGES), name


def test_snakemake_tiny_learning_pipeline_and_partial_reruns(tmp_path):
    import onnx

    from rlflow.graph import load_onnx
    from rlflow.graph.exec.check import check_equal

    copy_workflow(tmp_path)
    snakemake = tool("snakemake")
    r = sh(snakemake, *TARGETS, "--cores", "2", "--configfile", "tests/configs/tiny.yaml", cwd=tmp_path, timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    counts = job_counts(r.stdout + r.stderr)
    assert counts["train_encoder"] == 1 and counts["train_world_model"] == 1
    assert counts["train_controller"] == 1 and counts["train_model_free"] == 1
    ctl = json.loads((tmp_path / FOLDERS["controller"] / "metrics.json").read_text())
    mf = json.loads((tmp_path / FOLDERS["model_free"] / "metrics.json").read_text())
    assert ctl["real_interactions"]["training"] == 0 and ctl["dream_steps"] == 2 * 4 * 4
    assert mf["real_interactions"]["training"] == 2 * 4 * 2
    for m in (ctl, mf):
        assert m["real"]["best"]["runtime_ms"] <= m["real"]["initial"]["runtime_ms"]
    wm = json.loads((tmp_path / "results/bert/world_model/metrics.json").read_text())
    assert wm  # held-out quality figures
    assert (tmp_path / "results/bert/world_model/loss.csv").read_text().startswith("epoch")

    # the agents' optimised graphs and traces, in the searches' format
    original = load_onnx(tmp_path / "results/bert/model.onnx")
    for method, folder in FOLDERS.items():
        trace = json.loads((tmp_path / folder / "trace.json").read_text())
        metrics = ctl if method == "controller" else mf
        assert trace["format"] == "rlflow.search-trace/2"
        assert trace["method"] == ("rlflow" if method == "controller" else "model_free")
        assert trace["model"] == "bert" and trace["onnx"] == "results/bert/model.onnx"
        assert trace["cost_model"] == resolve_target({"cost": {"target": "auto"}})  # config.yaml: auto
        assert trace["cost"]["cache"].startswith("results/costs/")
        assert trace["real_interactions"] == metrics["real_interactions"]
        assert trace["final"]["runtime_ms"] == pytest.approx(metrics["real"]["best"]["runtime_ms"])
        assert len(trace["steps"]) == trace["rules_applied"] and trace["seconds"] > 0
        assert trace["training_seconds"] > 0 and 0 <= trace["max_rel_diff"] <= trace["tolerance"]
        assert trace["final"]["runtime_ms"] <= trace["initial"]["runtime_ms"]
        onnx.checker.check_model(str(tmp_path / folder / "model.onnx"))
        assert check_equal(original, load_onnx(tmp_path / folder / "model.onnx")) <= 1e-4
        assert SEARCH_KEYS <= set(trace), SEARCH_KEYS - set(trace)  # what stage search_greedy writes, and more
        assert (tmp_path / folder / ("controller.pt" if method == "controller" else "model_free.pt")).is_file()

    # every training stage's dvclive curves
    for folder, (name, steps) in LOGS.items():
        path = tmp_path / folder / "plots" / "metrics" / f"{name}.tsv"
        rows = list(csv.DictReader(path.open(), delimiter="\t"))
        assert [int(row["step"]) for row in rows] == list(range(1, steps + 1)), folder
        assert json.loads((tmp_path / folder / "metrics.json").read_text())["step"] == steps
        assert not (tmp_path / folder / "dvc.yaml").exists()
    assert not (tmp_path / ".dvc").exists() and not (tmp_path / "dvc.yaml").exists()

    def dry(text: str) -> dict:
        r = sh(snakemake, *TARGETS, "-n", "--configfile", "tests/configs/tiny.yaml", override(tmp_path, "over", text),
               cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        return {} if "Nothing to be done" in r.stdout + r.stderr else job_counts(r.stdout)

    assert dry("{}") == {}
    assert dry("env: {reward: {alpha: 0.5}}") == {"train_controller": 1, "train_model_free": 1}
    assert dry("controller: {temperature: 0.75}") == {"train_controller": 1}

    # editing a library module reruns exactly the stages whose code imports it (the registry's import closure):
    # agents/checkpoint.py is what runs a trained agent (Agent.optimise), so both agent stages replan
    checkpoint = tmp_path / "src/rlflow/agents/checkpoint.py"
    checkpoint.write_text(checkpoint.read_text() + "\n# edited\n")
    planned = dry("{}")
    assert planned.get("train_controller") == 1 and planned.get("train_model_free") == 1, planned
    readers = {name for name, st in registry.STAGES.items() if "src/rlflow/agents/checkpoint.py" in st.code_files()}
    assert set(planned) <= readers | {"all"}, set(planned) - readers
