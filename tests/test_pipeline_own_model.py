"""A user's own ONNX model through the whole tiny pipeline: config.yaml names it (``models: [mlp]``,
``zoo.mlp: {onnx: models/mlp.onnx, input_shapes: ...}``), `snakemake` (rule all) builds its report, DVC records
the run; a reward change reruns the same stages under Snakemake and DVC (`dvc repro` for real: this run is the
smallest), and a changed file reruns its export and what depends on it, under Snakemake and DVC alike.

The model is hand-made ONNX (tests/onnx_models.py: two MatMuls on one input, which the rules merge) with a
dynamic batch dimension, so the export stage must fix it from ``input_shapes``. Its own test file, so that
pytest-xdist runs it beside the bert end-to-end run (tests/test_pipeline_e2e.py)."""

from __future__ import annotations

import csv

import onnx
import pytest
import yaml
from onnx_models import shared_input_mlp
from test_pipeline import CONFIG, TINY, dvc_repo_rule_all, job_counts, sh, tool
from test_pipeline_e2e import REWARD_STAGES, ran_dvc_stages

from rlflow.config import load_config


@pytest.fixture(scope="module")
def own_repo(tmp_path_factory):
    """A copy of the workflow (a git repository with this repo's dvc.yaml and DVC config) whose config.yaml is
    the tiny config building only the own model; `snakemake` (rule all) run once."""
    root = tmp_path_factory.mktemp("own")
    (root / "models").mkdir()
    onnx.save(shared_input_mlp(batch="batch"), root / "models" / "mlp.onnx")
    cfg = load_config([CONFIG, TINY])
    cfg["models"] = ["mlp"]
    cfg["zoo"]["mlp"] = {"onnx": "models/mlp.onnx", "input_shapes": {"x": [4, 64]}}
    # what bert's e2e run covers already (the sweeps, every backend) is left out: minutes of CI
    cfg["sweeps"] = {"temperatures": [], "rewards": []}
    cfg["evaluate"]["backends"] = ["ort"]
    return root, dvc_repo_rule_all(root, cfg)


def test_rule_all_builds_an_own_models_report(own_repo):
    root, log = own_repo
    counts = job_counts(log)
    for stage in ("export_model", "evaluate", "report", "summary", "search_eqsat", "train_controller"):
        assert counts.get(stage, 0) >= 1, counts
    model = onnx.load(str(root / "results/mlp/model.onnx"))
    assert [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim] == [4, 64]
    html = (root / "results/mlp/report.html").read_text()
    assert html.lstrip().lower().startswith("<!doctype html") and "mlp" in html
    with open(root / "results/mlp/evaluation.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["method"] for r in rows} >= {"original", "taso", "greedy", "eqsat", "model_free", "rlflow"}
    assert all(r["status"] in ("ok", "unsupported") for r in rows)
    assert all(float(r["max_rel_diff"]) <= 1e-4 for r in rows if r["status"] == "ok")
    assert "dvc: done" in log, log[-3000:]
    r = sh(tool("dvc"), "status", cwd=root)
    assert r.returncode == 0 and "up to date" in r.stdout, r.stdout + r.stderr


def test_a_reward_change_reruns_the_same_stages_in_snakemake_and_dvc(own_repo):
    """What Snakemake plans after a reward change is what `dvc repro` then runs: the stages the reward reaches
    (this config has no sweeps)."""
    root, _ = own_repo
    cfg = yaml.safe_load((root / "config.yaml").read_text())
    cfg["env"]["reward"]["alpha"] = 0.5
    (root / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    r = sh(tool("snakemake"), "-n", cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    planned = job_counts(r.stdout)
    planned.pop("all", None)
    assert set(planned) == REWARD_STAGES - {"sweep_temperature", "sweep_reward"}, planned
    r = sh(tool("dvc"), "repro", cwd=root, timeout=1200)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-5000:]
    assert ran_dvc_stages(r.stdout) == set(planned), r.stdout


def test_a_changed_own_model_reruns_its_export_in_snakemake_and_dvc(own_repo):
    root, _ = own_repo
    changed = shared_input_mlp(batch="batch")
    changed.graph.initializer[0].raw_data = bytes(reversed(changed.graph.initializer[0].raw_data))
    onnx.save(changed, root / "models" / "mlp.onnx")
    r = sh(tool("snakemake"), "-n", cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    planned = job_counts(r.stdout)
    assert planned.get("export_model") == 1 and planned.get("report") == 1, planned
    r = sh(tool("dvc"), "status", cwd=root)
    assert r.returncode == 0 and "export_model@mlp" in r.stdout and "changed deps" in r.stdout, r.stdout


def test_a_model_that_is_neither_zoo_nor_own_is_one_line(own_repo):
    root, _ = own_repo
    cfg = yaml.safe_load((root / "config.yaml").read_text())
    cfg["models"] = ["mlp", "nosuch"]
    (root / "bad.yaml").write_text(yaml.safe_dump({"models": cfg["models"]}))
    r = sh(tool("snakemake"), "-n", "--configfile", "bad.yaml", cwd=root)
    assert r.returncode != 0 and "'nosuch' is neither a zoo model" in r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
