"""The HLO suite (stage export_hlo_suite, rlflow.xla.suite): families split into training and held-out sets,
inference and training (forward + backward) forms, the manifest; on the tiny config (4 modules, seconds)."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

if importlib.util.find_spec("jax") is None or importlib.util.find_spec("xla_plugins.xla_cpu_pjrt") is None:
    pytest.skip("jax / xla-cpu-pjrt not installed", allow_module_level=True)

from rlflow.cli import main  # noqa: E402
from rlflow.errors import RLFlowError  # noqa: E402
from rlflow.pipeline.registry import REPO_ROOT  # noqa: E402
from rlflow.xla.hlo import histogram, parse  # noqa: E402
from rlflow.xla.suite import load_manifest, plan, split_paths  # noqa: E402

TINY = ["--config", str(REPO_ROOT / "config.yaml"), "--config", str(REPO_ROOT / "tests/configs/tiny.yaml")]


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    r = tmp_path_factory.mktemp("results")
    assert main(["export-hlo-suite", *TINY, "--out-dir", str(r / "suite"), "--manifest", str(r / "suite.json")]) == 0
    return r


def test_plan_splits_by_family_and_names_each_variant_and_form():
    modules = plan({"train_families": ["bert"], "heldout_families": ["vit"], "forms": ["inference", "training"],
                    "variants": {"bert": [{"layers": 2}, {"layers": 4, "seq": 16}], "gpt2": [{"layers": 1}]}})
    assert [m.name for m in modules] == ["bert-layers2-inference", "bert-layers2-training",
                                         "bert-layers4-seq16-inference", "bert-layers4-seq16-training",
                                         "vit-base-inference", "vit-base-training"]  # gpt2 is in neither split
    assert {m.family for m in modules if m.split == "train"} == {"bert"}
    assert {m.family for m in modules if m.split == "heldout"} == {"vit"}


@pytest.mark.parametrize("suite_cfg, message", [
    ({"train_families": ["bert"], "heldout_families": ["bert"]}, "in both"),
    ({"train_families": ["bert"], "heldout_families": ["nope"]}, "unknown zoo family 'nope'"),
    ({"train_families": ["bert"], "heldout_families": []}, "at least one family"),
    ({"train_families": ["bert"], "heldout_families": ["vit"], "forms": ["backward"]}, "unknown form"),
    ({"train_families": ["bert"], "heldout_families": ["vit"], "variants": {"bert": [{"layers": 2}] * 2}}, "twice"),
])
def test_bad_suites_are_one_line_errors(suite_cfg, message):
    with pytest.raises(RLFlowError, match=message) as err:
        plan(suite_cfg)
    assert "\n" not in str(err.value)


def test_the_manifest_names_families_and_module_counts(suite):
    doc = load_manifest(suite / "suite.json")
    assert doc["families"] == {"train": ["gpt2"], "heldout": ["vit"]}
    assert doc["counts"] == {"train": {"gpt2": 2}, "heldout": {"vit": 2}}
    assert doc["totals"] == {"train": 2, "heldout": 2}
    assert {(e["family"], e["form"]) for e in doc["modules"]} == {(f, form) for f in ("gpt2", "vit")
                                                                 for form in ("inference", "training")}
    assert all(e["sizes"]["layers"] == 1 for e in doc["modules"])
    assert [p.name for p in split_paths(suite / "suite.json", "heldout")] == ["vit-layers1-inference.hlo",
                                                                              "vit-layers1-training.hlo"]


def test_the_training_form_is_forward_and_backward(suite):
    doc = load_manifest(suite / "suite.json")
    by = {(e["family"], e["form"]): e for e in doc["modules"]}
    for family in ("gpt2", "vit"):
        inf, train = by[(family, "inference")], by[(family, "training")]
        assert train["ops"] > 1.5 * inf["ops"]  # the backward pass
        text = (suite / train["path"]).read_text()
        assert sum(histogram(parse(text)).values()) == train["ops"]
        # one gradient per weight: every parameter but the model's one input (token ids, images) has one
        header = text.partition("\n")[0]
        params, result = re.search(r"entry_computation_layout=\{\((.*)\)->\((.*)\)\}", header).groups()
        shape = r"[a-z]+\d*\["
        assert len(re.findall(shape, result)) == len(re.findall(shape, params)) - 1 > 1

def test_a_missing_module_file_is_a_one_line_error(suite, tmp_path):
    doc = json.loads((suite / "suite.json").read_text())
    (tmp_path / "suite.json").write_text(json.dumps(doc))
    with pytest.raises(RLFlowError, match="missing"):
        load_manifest(tmp_path / "suite.json")
    with pytest.raises(RLFlowError, match="no HLO suite manifest"):
        load_manifest(tmp_path / "none.json")


def test_an_agent_trains_on_the_suites_training_split(suite, capsys):
    small = [*TINY, "--set", "xla.train_on=suite", "--set", "xla.updates=1", "--set", "xla.steps_per_update=4",
             "--set", "xla.max_steps=2"]
    out = suite / "agent-plain.pt"
    assert main(["train-pass-agent", *small, "--variant", "plain", "--results-dir", str(suite),
                 "--manifest", str(suite / "suite.json"), "--out", str(out),
                 "--metrics", str(suite / "agent-plain.json")]) == 0
    metrics = json.loads((suite / "agent-plain.json").read_text())
    assert metrics["train_models"] == ["gpt2-layers1-inference", "gpt2-layers1-training"]  # no held-out family
    assert main(["train-pass-agent", *small, "--variant", "plain", "--results-dir", str(suite),
                 "--out", str(out), "--metrics", str(suite / "agent-plain.json")]) == 2
    assert "give --manifest" in capsys.readouterr().err


def test_the_agents_are_evaluated_on_every_held_out_module(suite, tmp_path):
    from types import SimpleNamespace

    from rlflow.report import passes
    from rlflow.xla.metric import geomean_ratio

    small = [*TINY, "--set", "xla.train_on=suite", "--set", "xla.updates=1", "--set", "xla.steps_per_update=4",
             "--set", "xla.max_steps=2", "--set", "xla.variants=[plain]", "--set", "xla.random_orders=1",
             "--set", "xla.greedy_steps=1", "--set", "xla.suite_time_budget_s=0.5",
             "--set", "xla.suite_select_budget_s=0.3", "--set", "timing.sessions=2"]
    agents = tmp_path / "xla"
    assert main(["train-pass-agent", *small, "--variant", "plain", "--results-dir", str(suite),
                 "--manifest", str(suite / "suite.json"), "--out", str(agents / "agent-plain.pt"),
                 "--metrics", str(agents / "agent-plain.json")]) == 0
    out = tmp_path / "xla-suite/passes.json"
    assert main(["evaluate-passes-suite", *small, "--manifest", str(suite / "suite.json"), "--agents-dir",
                 str(agents), "--out", str(out), "--csv", str(out.with_suffix(".csv"))]) == 0
    doc = json.loads(out.read_text())
    assert [m["model"] for m in doc["modules"]] == ["vit-layers1-inference", "vit-layers1-training"]
    assert all(m["held_out"] and m["train_models"] == ["gpt2"] for m in doc["modules"])
    for method in ("xla_default", "random", "greedy", "ppo-plain"):
        ratios = [next(x for x in m["methods"] if x["method"] == method)["ratio_vs_default"] for m in doc["modules"]]
        s = doc["summary"][method]
        assert s["geomean_ratio"] == pytest.approx(geomean_ratio(ratios))
        assert s["modules_with_ratio"] + s["no_ratio"] == 2
    for m in doc["modules"]:  # timed, the agent's module chosen by latency with the default a candidate
        ppo = next(x for x in m["methods"] if x["method"] == "ppo-plain")
        assert ppo["selection"]["chosen"] in ("xla_default", *(c["name"] for c in ppo["selection"]["candidates"]))
        assert m["runtime"]["aa"]["verdict"] and ppo["runtime"]["verdict"]
    verdicts = doc["summary"]["ppo-plain"]["verdicts"]
    assert sum(verdicts.values()) == 2 and "reference" not in verdicts
    rows = out.with_suffix(".csv").read_text().splitlines()
    assert rows[0].startswith("model,method,ops") and len(rows) == 1 + 2 * 4
    table = passes.suite_summary(tmp_path)
    assert "2 held-out modules" in table and "ppo-plain" in table
    assert "evaluate_passes_suite has not run" in passes.suite_summary(tmp_path / "none")
    _, _, body = passes.section(SimpleNamespace(results=tmp_path))  # the per-model section is not the suite's
    assert "has not run" in body


def test_training_modules_compile_for_timing(suite):
    from rlflow.evaluation.protocol import Protocol
    from rlflow.xla.timing import time_modules, timing_disabled
    from rlflow.xla.worker import discover_pipeline

    # the backward pass has scatters (the embedding's gradient) and dots with two contracting dimensions, which
    # XLA CPU emits only after the passes the timing compile keeps (rlflow.xla.timing.REQUIRED)
    doc = load_manifest(suite / "suite.json")
    text = next((suite / e["path"]).read_text() for e in doc["modules"] if e["name"] == "gpt2-layers1-training")
    r = time_modules([("a", text), ("b", text)], Protocol(sessions=2, warmup=1, budget_s=0.1, min_rounds=3),
                     timing_disabled(discover_pipeline()))
    assert r["max_rel_diff"]["b"] == 0.0


def test_an_agent_module_that_is_the_defaults_own_is_not_timed_again():
    from rlflow.config import load_config
    from rlflow.stages.passes_common import AA_NAME, time_methods

    class Timer:  # records what it is asked to time; every module as fast as the default
        def time(self, modules, protocol, disabled, seed):
            self.names = [n for n, _ in modules]
            est = {n: {"ratio": 1.0, "ci_low": None if n == "xla_default" else 0.99, "ci_high": None
                       if n == "xla_default" else 1.01, "verdict": "reference" if n == "xla_default" else
                       "no detectable difference", "detectable": 0.02, "median_ms": 2.0} for n in self.names}
            return {"estimates": est, "max_rel_diff": {n: 0.0 for n in self.names}, "rounds": 3, "seconds": 1.0}

    config = load_config([REPO_ROOT / "config.yaml"])
    methods = [{"method": "xla_default"}, {"method": "greedy"}, {"method": "ppo-plain"}]
    texts = {"xla_default": "HloModule d", "greedy": "HloModule g", "ppo-plain": "HloModule d"}
    timer = Timer()
    time_methods(config, timer, [], texts, methods, "m", 1.0, log=lambda line: None)
    assert timer.names == ["xla_default", AA_NAME, "greedy"]  # the agent's module is the default's
    ppo = methods[2]["runtime"]
    assert ppo["same_as"] == "xla_default" and ppo["ratio"] == 1.0 and ppo["verdict"] == "no detectable difference"
    assert "same_as" not in methods[1]["runtime"]
