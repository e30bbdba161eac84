"""The whole pipeline end to end on the tiny config, the way a user runs it: `snakemake` (rule all) builds
bert's report and the summary, records the run in dvc.lock (onsuccess), after which `dvc status` is clean and
`dvc repro` reruns nothing; a reward change reruns exactly the same stages under Snakemake and DVC; `dvc push`
then `dvc pull` restores deleted results.

This is CI's tiny end-to-end run (a few minutes). The copy's config.yaml IS the tiny config (not merged with
--configfile), because DVC reads its params from config.yaml only."""

from __future__ import annotations

import csv
import hashlib
import json
import re
import shutil

import pytest
import yaml
from test_pipeline import CONFIG, TINY, dvc_repo_rule_all, job_counts, sh, tool

from rlflow.config import load_config

#: the stages a reward parameter reaches (the sweeps are train_controller runs; summary reads evaluate's output)
REWARD_STAGES = {"train_controller", "train_model_free", "sweep_temperature", "sweep_reward", "generalise", "evaluate",
                 "report", "summary"}


def ran_dvc_stages(output: str) -> set[str]:
    """The stages `dvc repro` ran, without their @item suffix."""
    return {name.split("@")[0] for name in re.findall(r"Running stage '([^']+)'", output)}


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_repo(tmp_path_factory):
    """A copy of the workflow whose config.yaml is the tiny config with one temperature and one reward sweep,
    a git repository (DVC needs one) with this repo's dvc.yaml and DVC config; `snakemake` (rule all) run once."""
    root = tmp_path_factory.mktemp("repo")
    cfg = load_config([CONFIG, TINY])
    cfg["sweeps"] = {"temperatures": [0.5], "rewards": ["delta"]}
    return root, dvc_repo_rule_all(root, cfg)


def test_rule_all_builds_the_report_and_the_summary(tiny_repo):
    root, log = tiny_repo
    counts = job_counts(log)
    for stage in ("generalise", "evaluate", "report", "summary", "sweep_temperature", "sweep_reward"):
        assert counts.get(stage) == 1, counts
    html = (root / "results/bert/report.html").read_text()
    assert html.lstrip().lower().startswith("<!doctype html") and "</html>" in html
    assert not re.search(r"""(src|href)=["']https?://""", html), "the report must not load anything"
    assert (root / "results/summary.html").is_file() and (root / "results/summary.csv").is_file()
    with open(root / "results/bert/evaluation.csv") as f:
        rows = list(csv.DictReader(f))
    pairs = {(r["method"], r["backend"]) for r in rows}
    assert pairs == {(m, b) for m in ("original", "original-aa", "taso", "greedy", "eqsat", "model_free", "rlflow",
                                      "taso_machine", "greedy_machine", "eqsat_machine", "ort_optimizer")
                     for b in ("ort", "torch", "tf")}  # config.yaml's quick default backends; the machine track
    status = {(r["method"], r["backend"]): r["status"] for r in rows}  # onnxruntime's contrib ops: only it runs them
    assert [status["ort_optimizer", b] for b in ("ort", "torch", "tf")] == ["ok", "unsupported", "unsupported"]
    assert '<section id="egraph">' in html and "stage search_eqsat has not run" not in html  # eqsat's e-graph figures
    gen = json.loads((root / "results/bert/generalise.json").read_text())  # tiny.yaml: bert seq=4 and seq=16
    assert [r["graph"] for r in gen["rows"]] == ["bert (trained)", "bert seq=4", "bert seq=16"]
    assert all(set(r["agents"]) == {"model_free", "rlflow"} for r in gen["rows"])
    assert "bert seq=16" in html and "stage generalise has not run" not in html
    assert_trained_row_is_the_agents_own_run(root, gen["rows"][0])
    assert all(r["status"] in ("ok", "unsupported") for r in rows)
    assert all(float(r["max_rel_diff"]) <= 1e-4 for r in rows if r["status"] == "ok")
    for r in rows:  # every timed row has its ratio to the original with an interval and a verdict
        if r["status"] == "ok" and r["method"] != "original":
            assert float(r["ci_low"]) <= float(r["ratio"]) <= float(r["ci_high"])
            assert r["verdict"] in ("faster", "slower", "no detectable difference") and r["too_noisy"] in ("True", "False")
    with open(root / "results/summary.csv") as f:
        assert "best_backend" not in f.readline()


def assert_trained_row_is_the_agents_own_run(root, row):
    """generalise reads the trained shape's figures from the agent stages' traces; running the trained agents
    again on the model (what it did before) gives the same figures."""
    from rlflow.agents.checkpoint import load_agent
    from rlflow.agents.zero_shot import score_graph
    from rlflow.problem import load_problem

    cfg = load_config([root / "config.yaml"])
    res = root / "results"
    p = load_problem(cfg, res / "bert/model.onnx", res / "rules/rules.json", res / f"costs/{cfg['device']}/bert.json")
    agents = {"model_free": load_agent(res / "bert/model_free/model_free.pt"),
              "rlflow": load_agent(res / "bert/controller/controller.pt")}
    again = score_graph(agents, p.graph, p.rules, p.cost, cfg)
    assert row["from_traces"] and row["greedy_pct"] == pytest.approx(again["greedy_pct"], rel=1e-9, abs=1e-12)
    for m, a in again["agents"].items():
        for k in ("improvement_pct", "final_ms", "real_steps"):
            assert row["agents"][m][k] == pytest.approx(a[k], rel=1e-9, abs=1e-12), (m, k)


def test_snakemake_run_is_recorded_in_dvc(tiny_repo):
    root, log = tiny_repo
    assert "dvc: done" in log, log[-3000:]
    r = sh(tool("snakemake"), "-n", cwd=root)  # recording it touched nothing Snakemake looks at
    assert r.returncode == 0 and "Nothing to be done" in r.stdout + r.stderr, r.stdout + r.stderr
    dvc = tool("dvc")
    r = sh(dvc, "status", cwd=root)
    assert r.returncode == 0 and "up to date" in r.stdout, r.stdout + r.stderr
    r = sh(dvc, "repro", cwd=root, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert ran_dvc_stages(r.stdout) == set(), r.stdout


def test_a_reward_change_reruns_the_same_stages_in_snakemake_and_dvc(tiny_repo):
    root, _ = tiny_repo
    cfg = yaml.safe_load((root / "config.yaml").read_text())
    cfg["env"]["reward"]["alpha"] = 0.5
    (root / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    r = sh(tool("snakemake"), "-n", cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    planned = job_counts(r.stdout)
    planned.pop("all", None)
    assert set(planned) == REWARD_STAGES, planned
    r = sh(tool("dvc"), "repro", cwd=root, timeout=1200)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-5000:]
    assert ran_dvc_stages(r.stdout) == REWARD_STAGES, r.stdout


def test_dvc_push_then_pull_restores_deleted_results(tiny_repo):
    root, _ = tiny_repo
    dvc = tool("dvc")
    r = sh(dvc, "push", cwd=root, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    report = root / "results/bert/report.html"
    before = digest(report)
    shutil.rmtree(root / "results" / "bert")
    shutil.rmtree(root / ".dvc" / "cache")
    r = sh(dvc, "pull", cwd=root, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert digest(report) == before
    r = sh(dvc, "status", cwd=root)
    assert "up to date" in r.stdout, r.stdout + r.stderr
