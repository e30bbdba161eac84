"""The whole pipeline end to end on the tiny config, the way a user runs it: `snakemake` (rule all) builds
bert's report and the summary, records the run in dvc.lock (onsuccess), after which `dvc status` is clean and
`dvc repro` reruns nothing; a reward change replans exactly the same stages under Snakemake and DVC; `dvc push`
then `dvc pull` restores deleted results.

This is CI's tiny end-to-end run (a few minutes). The copy's config.yaml IS the tiny config (not merged with
--configfile), because DVC reads its params from config.yaml only."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import shutil

import pytest
import yaml
from test_pipeline import CONFIG, TINY, dvc_repo_rule_all, job_counts, sh, tool

from rlflow.config import load_config
from rlflow.pipeline import registry

#: the stages a reward parameter reaches (the sweeps are train_controller runs; summary reads evaluate's output)
REWARD_STAGES = {"train_controller", "train_model_free", "sweep_temperature", "sweep_reward", "generalise", "evaluate",
                 "report", "summary"}
ROLLOUTS = "results/bert/rollouts.json"
AGENT_FOLDERS = {"controller": "results/bert/controller", "model_free": "results/bert/model_free"}
#: each training stage's dvclive folder, a curve it must hold and how many steps (tests/configs/tiny.yaml)
TRAINING_CURVES = {"results/bert/encoder/live": ("train/loss", 2), "results/bert/world_model/live": ("heldout/nll", 3),
                   "results/bert/controller/live": ("dream/reward", 2),
                   "results/bert/model_free/live": ("real/reward", 2)}
#: the keys of the search stages' traces (search_taso, search_greedy), which the evaluate stage and the report read
SEARCH_KEYS = {"format", "method", "model", "onnx", "rules", "num_rules", "device", "cost_model", "cost", "config",
               "settings", "initial", "final", "speedup", "steps", "rules_applied", "expansions",
               "candidates_generated", "candidates_kept", "stop_reason", "seconds", "ms_per_expansion", "stats",
               "max_rel_diff", "tolerance"}


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
    for stage in ("generalise", "evaluate", "report", "summary", "sweep_temperature", "sweep_reward", "search_eqsat",
                  "search_eqsat_rl"):
        assert counts.get(stage) == 1, counts
    html = (root / "results/bert/report.html").read_text()
    assert html.lstrip().lower().startswith("<!doctype html") and "</html>" in html
    assert not re.search(r"""(src|href)=["']https?://""", html), "the report must not load anything"
    assert (root / "results/summary.html").is_file() and (root / "results/summary.csv").is_file()
    with open(root / "results/bert/evaluation.csv") as f:
        rows = list(csv.DictReader(f))
    pairs = {(r["method"], r["backend"]) for r in rows}
    assert pairs == {(m, b) for m in ("original", "original-aa", "taso", "greedy", "eqsat", "eqsat_rl", "model_free",
                                      "rlflow", "taso_machine", "greedy_machine", "eqsat_machine", "ort_optimizer")
                     for b in ("ort", "torch", "tf")}  # config.yaml's quick default backends; the machine track
    status = {(r["method"], r["backend"]): r["status"] for r in rows}  # onnxruntime's contrib ops: only it runs them
    assert [status["ort_optimizer", b] for b in ("ort", "torch", "tf")] == ["ok", "unsupported", "unsupported"]
    assert '<section id="egraph">' in html and "stage search_eqsat has not run" not in html  # eqsat's e-graph figures
    assert "stage search_eqsat_rl has not run" not in html and "eqsat-rl (tree search)" in html  # and eqsat-rl's
    erl = json.loads((root / "results/bert/eqsat_rl/trace.json").read_text())
    assert erl["method"] == "eqsat-mcts" and erl["stats"]["tree_simulations"] <= 2  # tiny.yaml: eqsat.rl_leaves 2
    assert (root / "results/logs/search_eqsat_rl/bert.log").is_file()
    assert (root / "results/benchmarks/search_eqsat_rl/bert.tsv").is_file()
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


def dry_run(root, targets, override: str = "{}") -> dict:
    """The jobs `snakemake -n` plans for ``targets`` with ``override`` (a config merged over config.yaml; the
    command line's --config cannot set nested integers); {} when nothing is to be done."""
    (root / "over.yaml").write_text(override)
    r = sh(tool("snakemake"), *targets, "-n", "--configfile", "over.yaml", cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    return {} if "Nothing to be done" in r.stdout + r.stderr else job_counts(r.stdout)


def test_searches_and_rollouts_and_what_reruns_them(tiny_repo):
    """measure_costs, search_taso, search_greedy, collect_rollouts, merge_rollouts: their outputs, and which
    config keys rerun which of them (no one of them reads the reward)."""
    root, _ = tiny_repo
    merged = json.loads((root / ROLLOUTS).read_text())
    assert merged["stats"]["episodes"] == 6 and merged["shards"] == [0, 1]  # tiny.yaml: two shards of 3
    costs = json.loads((root / "results/costs/auto/bert.json").read_text())
    # cost.target auto: sim-h100 on a CPU box (the cache holds the calibration only), cuda on a GPU box
    assert costs["device"] in ("cpu", "cuda") and costs["calibration"]["ort"]["gemm_flops_per_s"] > 0
    assert costs["target"] == ("cuda" if costs["device"] == "cuda" else "sim-h100")
    for method in ("taso", "greedy"):
        trace = json.loads((root / f"results/bert/{method}/trace.json").read_text())
        assert trace["max_rel_diff"] <= 1e-4
    targets = [ROLLOUTS, "results/bert/taso/model.onnx", "results/bert/greedy/model.onnx"]
    assert dry_run(root, targets) == {}
    assert dry_run(root, targets, "env: {reward: {alpha: 0.5, name: delta}}") == {}
    assert dry_run(root, targets, "env: {max_steps: 7}") == {"collect_rollouts": 2, "merge_rollouts": 1}
    assert dry_run(root, targets, "search: {alpha: 1.0}") == {"search_taso": 1}
    assert dry_run(root, targets, "rollouts: {shards: [0, 1, 2]}") == {"collect_rollouts": 1, "merge_rollouts": 1}
    eqsat = ["results/bert/eqsat/model.onnx", "results/bert/eqsat_rl/model.onnx"]  # one eqsat section, two stages
    assert dry_run(root, eqsat, "eqsat: {rl_leaves: 3}") == {"search_eqsat_rl": 1}
    assert dry_run(root, eqsat, "eqsat: {node_limit: 4000}") == {"search_eqsat": 1, "search_eqsat_rl": 1}


def test_agents_write_verified_graphs_traces_and_curves(tiny_repo):
    """encoder -> world model -> controller (in the dream) and the model-free baseline: their verified ONNX
    graphs, search-format traces and dvclive curves; a reward or temperature change replans only the agents."""
    import onnx

    from rlflow.cost import resolve_target
    from rlflow.graph import load_onnx
    from rlflow.graph.exec.check import check_equal

    root, _ = tiny_repo
    ctl = json.loads((root / AGENT_FOLDERS["controller"] / "metrics.json").read_text())
    mf = json.loads((root / AGENT_FOLDERS["model_free"] / "metrics.json").read_text())
    assert ctl["real_interactions"]["training"] == 0 and ctl["dream_steps"] == 2 * 4 * 4  # tiny.yaml's budgets
    assert mf["real_interactions"]["training"] == 2 * 4 * 2
    for m in (ctl, mf):
        assert m["real"]["best"]["runtime_ms"] <= m["real"]["initial"]["runtime_ms"]
    assert json.loads((root / "results/bert/world_model/metrics.json").read_text())  # held-out quality figures
    assert (root / "results/bert/world_model/loss.csv").read_text().startswith("epoch")
    original = load_onnx(root / "results/bert/model.onnx")
    for method, folder in AGENT_FOLDERS.items():
        trace = json.loads((root / folder / "trace.json").read_text())
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
        onnx.checker.check_model(str(root / folder / "model.onnx"))
        assert check_equal(original, load_onnx(root / folder / "model.onnx")) <= 1e-4
        assert SEARCH_KEYS <= set(trace), SEARCH_KEYS - set(trace)  # what stage search_greedy writes, and more
        assert (root / folder / ("controller.pt" if method == "controller" else "model_free.pt")).is_file()
    for folder, (name, steps) in TRAINING_CURVES.items():
        rows = list(csv.DictReader((root / folder / "plots" / "metrics" / f"{name}.tsv").open(), delimiter="\t"))
        assert [int(row["step"]) for row in rows] == list(range(1, steps + 1)), folder
        assert json.loads((root / folder / "metrics.json").read_text())["step"] == steps
        assert not (root / folder / "dvc.yaml").exists()  # dvclive writes no pipeline of its own
    targets = [f"{d}/{f}" for d in AGENT_FOLDERS.values() for f in ("metrics.json", "trace.json", "model.onnx")]
    assert dry_run(root, targets, "env: {reward: {alpha: 0.5}}") == {"train_controller": 1, "train_model_free": 1}
    assert dry_run(root, targets, "controller: {temperature: 0.75}") == {"train_controller": 1}

    # editing a library module replans exactly the stages whose code imports it (the registry's import closure):
    # agents/checkpoint.py is what runs a trained agent (Agent.optimise), so both agent stages replan. The edit is
    # then undone, content and time, so the run stays up to date for the tests after this one.
    checkpoint = root / "src/rlflow/agents/checkpoint.py"
    text, before = checkpoint.read_text(), checkpoint.stat()
    checkpoint.write_text(text + "\n# edited\n")
    try:
        planned = dry_run(root, targets)
    finally:
        checkpoint.write_text(text)
        os.utime(checkpoint, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert planned.get("train_controller") == 1 and planned.get("train_model_free") == 1, planned
    readers = {name for name, st in registry.STAGES.items() if "src/rlflow/agents/checkpoint.py" in st.code_files()}
    assert set(planned) <= readers | {"all"}, set(planned) - readers
    assert dry_run(root, targets) == {}


def test_machine_track_is_made_for_the_machine_target_and_evaluated(tiny_repo):
    """taso, greedy and eqsat again for this machine's own target (gated on that target's backend), and
    onnxruntime's transformer optimizer, whose graph only onnxruntime runs."""
    from rlflow.cost.targets import resolve_target

    root, _ = tiny_repo
    machine = resolve_target({"cost": {"target": "machine"}})
    taso = json.loads((root / "results/bert/machine/taso/trace.json").read_text())
    assert taso["config"]["cost.target"] == machine and taso["platform"]["target"] == machine
    assert taso["speed_check"]["backend"] == ("ort" if machine == "ort-cpu" else "torch")
    ortopt = json.loads((root / "results/bert/machine/ort_optimizer/trace.json").read_text())
    assert ortopt["platform"]["target"] == machine and ortopt["stats"]["contrib_ops"]
    cfg = load_config([root / "config.yaml"])
    cache = root / registry.fill(registry.MACHINE_COSTS, device=cfg["device"], model="bert")
    assert json.loads(cache.read_text())["target"] == machine
    with open(root / "results/bert/evaluation.csv") as f:
        rows = {(r["method"], r["backend"]): r for r in csv.DictReader(f)}
    ort = rows["ort_optimizer", "ort"]
    assert ort["status"] == "ok" and ort["same_as_original"] == "False"
    assert float(ort["ci_low"]) <= float(ort["ratio"]) <= float(ort["ci_high"])
    assert rows["taso_machine", "ort"]["status"] == "ok"
    assert "runs only in onnxruntime" in (root / "results/logs/evaluate/bert.log").read_text()


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


def test_a_reward_change_replans_the_same_stages_in_snakemake_and_dvc(tiny_repo):
    """Snakemake plans exactly the stages a reward parameter reaches; DVC sees the same ones changed directly
    (the rest follow from their outputs). The config is then put back, so the run stays up to date for the tests
    after this one. That `dvc repro` then reruns exactly these stages is checked on the own model's (smaller)
    run: tests/test_pipeline_own_model.py."""
    root, _ = tiny_repo
    path = root / "config.yaml"
    text, before = path.read_text(), path.stat()
    cfg = yaml.safe_load(text)
    cfg["env"]["reward"]["alpha"] = 0.5
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    try:
        snake = sh(tool("snakemake"), "-n", cwd=root)
        dvc = sh(tool("dvc"), "status", "--json", cwd=root)
    finally:
        path.write_text(text)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert snake.returncode == 0, snake.stdout + snake.stderr
    planned = job_counts(snake.stdout)
    planned.pop("all", None)
    assert set(planned) == REWARD_STAGES, planned
    assert dvc.returncode == 0, dvc.stdout + dvc.stderr
    changed = {name.split("@")[0] for name in json.loads(dvc.stdout)}
    assert {"train_controller", "train_model_free", "sweep_temperature", "sweep_reward"} <= changed <= REWARD_STAGES


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
