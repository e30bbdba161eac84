"""The XLA pass-ordering stages (export_hlo, train_pass_agent, evaluate_passes), their report section and
summary line, and `rlflow passes`, on a tiny ResNet-18 with tiny budgets (real XLA passes)."""

from __future__ import annotations

import importlib.util
import json
import re
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("jax") is None or importlib.util.find_spec("xla_plugins.xla_cpu_pjrt") is None:
    pytest.skip("jax / xla-cpu-pjrt not installed", allow_module_level=True)

from rlflow.cli import main  # noqa: E402
from rlflow.pipeline.registry import REPO_ROOT  # noqa: E402

TINY = ["--config", str(REPO_ROOT / "config.yaml"), "--config", str(REPO_ROOT / "tests/configs/tiny.yaml"),
        "--set", "xla.updates=1", "--set", "xla.steps_per_update=4", "--set", "xla.max_steps=3",
        "--set", "xla.train_on=models", "--set", "xla.train_models=[resnet18]", "--set", "xla.variants=[plain]", "--set", "xla.random_orders=1",
        "--set", "xla.greedy_steps=1", "--set", "xla.time_budget_s=1", "--set", "timing.sessions=2",
        "--set", "xla.select_budget_s=0.5"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    r = tmp_path_factory.mktemp("results")
    m = r / "resnet18"
    assert main(["export-model", *TINY, "--model", "resnet18", "--out", str(m / "model.onnx")]) == 0
    assert main(["export-hlo", *TINY, "--model", "resnet18", "--onnx", str(m / "model.onnx"),
                 "--out", str(m / "xla/module.hlo")]) == 0
    assert main(["train-pass-agent", *TINY, "--variant", "plain", "--results-dir", str(r),
                 "--out", str(r / "xla/agent-plain.pt"), "--metrics", str(r / "xla/agent-plain.json")]) == 0
    assert main(["evaluate-passes", *TINY, "--model", "resnet18", "--hlo", str(m / "xla/module.hlo"),
                 "--agents-dir", str(r / "xla"), "--out", str(m / "xla/passes.json"),
                 "--csv", str(m / "xla/passes.csv")]) == 0
    return r


def test_stages_write_op_counts_and_the_papers_ratio(results):
    text = (results / "resnet18/xla/module.hlo").read_text()
    assert text.startswith("HloModule") and "{...}" not in text
    train = json.loads((results / "xla/agent-plain.json").read_text())
    assert train["variant"] == "plain" and train["env_steps"] == 4 and train["train_models"] == ["resnet18"]
    assert 1 <= train["xla_compiles"] <= 4  # a step the env has seen costs no compile
    doc = json.loads((results / "resnet18/xla/passes.json").read_text())
    methods = {m["method"]: m for m in doc["methods"]}
    assert set(methods) == {"xla_default", "random", "greedy", "ppo-plain"}
    assert doc["held_out"] is False and doc["initial_ops"] > methods["xla_default"]["ops"]
    assert methods["xla_default"]["ratio_vs_default"] == 1.0
    g = methods["greedy"]
    assert g["ratio_vs_default"] == pytest.approx((doc["initial_ops"] - g["ops"]) /
                                                  (doc["initial_ops"] - methods["xla_default"]["ops"]))
    assert g["ops"] < doc["initial_ops"]  # one greedy step always finds a reducing pass on this module
    rows = (results / "resnet18/xla/passes.csv").read_text().splitlines()
    assert rows[0].startswith("model,method,ops") and len(rows) == 5


def test_modules_are_timed_on_xla_cpu_against_the_default_pipelines(results):
    doc = json.loads((results / "resnet18/xla/passes.json").read_text())
    rt = doc["runtime"]
    assert rt["backend"] == "xla-cpu" and rt["reference"] == "xla_default" and "algsimp" in rt["disabled_passes"]
    assert rt["aa"]["ci_low"] <= 1.0 <= rt["aa"]["ci_high"] or rt["too_noisy"]
    methods = {m["method"]: m for m in doc["methods"]}
    assert "runtime" not in methods["random"]  # a mean over orders: no module of its own
    assert methods["xla_default"]["runtime"]["verdict"] == "reference"
    for name in ("greedy", "ppo-plain"):
        r = methods[name]["runtime"]
        assert r["verdict"] in ("faster", "slower", "no detectable difference") and r["median_ms"] > 0
        assert r["max_rel_diff"] <= 1e-4
    header = (results / "resnet18/xla/passes.csv").read_text().splitlines()[0]
    assert header.endswith("runtime_ratio,runtime_ci_low,runtime_ci_high,runtime_verdict,max_rel_diff,latency_choice")


def test_the_agents_final_module_is_chosen_by_latency_with_the_default_a_candidate(results):
    doc = json.loads((results / "resnet18/xla/passes.json").read_text())
    ppo = next(m for m in doc["methods"] if m["method"] == "ppo-plain")
    sel = ppo["selection"]
    names = [c["name"] for c in sel["candidates"]]
    assert "best+default" in names and set(names) <= {"best", "last", "best+default"}
    assert sel["chosen"] in ("xla_default", *names)
    timed = [c for c in sel["candidates"] if "verdict" in c]
    if sel["chosen"] == "xla_default":  # no candidate was called faster than the default
        assert all(c["verdict"] != "faster" or c["max_rel_diff"] > 1e-4 for c in timed)
    else:
        chosen = next(c for c in timed if c["name"] == sel["chosen"])
        assert chosen["verdict"] == "faster" and chosen["ratio"] == min(c["ratio"] for c in timed
                                                                       if c["verdict"] == "faster")
    rows = (results / "resnet18/xla/passes.csv").read_text().splitlines()
    assert any(r.startswith("resnet18,ppo-plain,") and r.endswith("," + sel["chosen"]) for r in rows)


def test_report_section_and_summary_line(results, tmp_path):
    from rlflow.report import passes

    _, _, body = passes.section(SimpleNamespace(results=results / "resnet18"))
    assert "ppo-plain" in body and "xla_default" in body
    assert "latency vs XLA default" in body and "A/A control" in body
    _, _, absent = passes.section(SimpleNamespace(results=tmp_path / "bert"))
    assert "evaluate_passes has not run" in absent
    line = passes.summary_line(results, ["resnet18", "bert"])
    doc = json.loads((results / "resnet18/xla/passes.json").read_text())
    greedy = next(m for m in doc["methods"] if m["method"] == "greedy")["ratio_vs_default"]
    assert f"greedy {greedy:.3f}" in line and "1 models: resnet18" in line
    assert "no model has" in passes.summary_line(tmp_path, ["bert"])


def test_rlflow_passes(results, tmp_path, capsys):
    out = tmp_path / "o.hlo"
    m = results / "resnet18/model.onnx"
    assert main(["passes", str(m), "--agent", str(results / "xla/agent-plain.pt"), "--out", str(out),
                 "--max-steps", "2"]) == 0
    from rlflow.xla.hlo import histogram, parse

    ops = sum(histogram(parse(out.read_text())).values())
    assert f"-> {ops} HLO ops" in capsys.readouterr().out
    from rlflow.agents.pass_agent import load_pass_agent

    assert load_pass_agent(results / "xla/agent-plain.pt").max_steps == 3  # the training horizon (xla.max_steps)
    assert main(["passes", str(m), "--agent", str(results / "xla/agent-plain.pt"), "--out", str(out)]) == 0
    ran = re.search(r"\((\d+) passes", capsys.readouterr().out)
    assert ran and int(ran[1]) <= 3  # by default, at most the training horizon's passes
    assert main(["passes", str(m), "--agent", str(m), "--out", str(tmp_path / "x.hlo")]) == 2
    assert "not a pass agent checkpoint" in capsys.readouterr().err
    assert main(["passes", str(tmp_path / "none.onnx"), "--agent", str(m), "--out", str(tmp_path / "x.hlo")]) == 2
    assert not (tmp_path / "x.hlo").exists()


def test_registry_variants_are_the_agents():
    from rlflow.agents.pass_agent import VARIANTS
    from rlflow.pipeline.registry import pass_variants

    assert pass_variants() == VARIANTS
