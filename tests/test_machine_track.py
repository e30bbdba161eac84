"""The machine track (docs/pipeline-tracks.md): taso, greedy and eqsat again for this machine's own target, and
onnxruntime's offline transformer optimizer as a baseline; in the registry and both pipelines. Its run through
Snakemake and evaluate is checked on the end-to-end run: tests/test_pipeline_e2e.py."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import yaml
from test_pipeline import CONFIG, REPO, TINY, job_counts, rlflow, sh, tool

from rlflow.config import load_config
from rlflow.pipeline import registry

MACHINE_STAGES = ("measure_costs_machine", "search_taso_machine", "search_greedy_machine", "search_eqsat_machine",
                  "search_ortopt")


# -- the registry, dvc.yaml and the Snakemake plan ------------------------------------------------------------
def test_machine_stages_run_the_configured_stages_code_with_the_machine_target():
    for base in registry.MACHINE_TRACK:
        st, orig = registry.stage(f"{base}_machine"), registry.stage(base)
        assert st.code_name == base and st.args == orig.args
        fixed = {"measure_costs": registry.MACHINE_COSTS_SETS, "search_taso": registry.MACHINE_SEARCH_SETS,
                 "search_greedy": registry.MACHINE_SEARCH_SETS}.get(base, ())
        assert st.sets == (("cost.target", "machine"), *fixed)
        assert "cost.target" not in st.params.values()  # the pipeline's target must not override it
        assert set(st.params.values()) == set(orig.params.values()) - {key for key, _ in st.sets}
        for k, path in st.outputs.items():
            assert path == orig.outputs[k].replace("results/{model}/", "results/{model}/machine/") \
                or (base == "measure_costs" and path == registry.MACHINE_COSTS), (st.name, path)
        if "costs" in st.inputs:
            assert st.inputs["costs"] == registry.MACHINE_COSTS
    ortopt = registry.stage("search_ortopt")
    assert ortopt.sets == (("cost.target", "machine"),) and ortopt.inputs["costs"] == registry.MACHINE_COSTS
    evaluate = registry.stage("evaluate")
    for method, folder in registry.MACHINE_METHODS.items():
        assert evaluate.inputs[f"{method}_onnx"] == f"results/{{model}}/{folder}/model.onnx"
        makers = [s.name for s in registry.STAGES.values() if evaluate.inputs[f"{method}_onnx"] in s.outputs.values()]
        assert len(makers) == 1 and makers[0] in MACHINE_STAGES, (method, makers)


def test_dvc_yaml_has_the_machine_track_and_evaluate_reads_its_graphs():
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    for name in MACHINE_STAGES:
        do = stages[name]["do"]
        assert stages[name]["foreach"] == "${models}"
        assert "--set cost.target=machine" in do["cmd"], do["cmd"]
        assert "cost.target" not in do["params"][0]["config.yaml"]
    assert "results/costs/${device}/machine/${item}.json" in stages["search_taso_machine"]["do"]["deps"]
    assert stages["measure_costs_machine"]["do"]["outs"] == ["results/costs/${device}/machine/${item}.json"]
    evaluate = stages["evaluate"]["do"]
    for method, folder in registry.MACHINE_METHODS.items():
        flag = "--" + method.replace("_", "-")
        assert f"{flag} results/${{item}}/{folder}/model.onnx" in evaluate["cmd"]
        assert f"results/${{item}}/{folder}/trace.json" in evaluate["deps"]


def test_snakemake_plans_the_machine_track_before_evaluate():
    r = sh(tool("snakemake"), "results/bert/evaluation.csv", "-n", "-F", "-p", "--configfile", TINY)
    assert r.returncode == 0, r.stdout + r.stderr
    counts = job_counts(r.stdout)
    assert all(counts.get(name) == 1 for name in MACHINE_STAGES), counts
    device = load_config([CONFIG, TINY])["device"]
    costs = registry.fill(registry.MACHINE_COSTS, device=device, model="bert")
    assert (f"rlflow search-taso --model bert --onnx results/bert/model.onnx --rules results/rules/rules.json "
            f"--costs {costs} --out results/bert/machine/taso/model.onnx") in r.stdout
    shells = [line.removeprefix("Shell command: ") for line in r.stdout.splitlines()
              if line.startswith(("rlflow ", "Shell command: rlflow "))]
    for cmd in ("measure-costs", "search-taso", "search-greedy", "search-eqsat", "search-ortopt"):
        machine = [s for s in shells if s.startswith(f"rlflow {cmd} ") and "/machine/" in s]
        assert len(machine) == 1 and "--set cost.target=machine" in machine[0], (cmd, machine)
    (costs_job,) = [s for s in shells if s.startswith("rlflow measure-costs ") and "/machine/" in s]
    assert "--set cost.learn_graphs=1 --set cost.explore_steps=0 >" in costs_job
    (evaluate,) = [s for s in shells if s.startswith("rlflow evaluate ")]
    assert "--ort-optimizer results/bert/machine/ort_optimizer/model.onnx" in evaluate
    assert "--eqsat-machine-trace results/bert/machine/eqsat/trace.json" in evaluate


# -- onnxruntime's optimizer as a method ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from rlflow.graph import zoo

    folder = tmp_path_factory.mktemp("machine-track-zoo")
    paths = {}
    for name in ("bert", "taso-bert", "gpt2", "squeezenet"):
        paths[name] = folder / f"{name}.onnx"
        zoo.export_model(name, paths[name], zoo.TINY_SIZES[name])
    return paths


def _optimise(path, name):
    from rlflow.cost import AnalyticCost
    from rlflow.graph import load_onnx, zoo
    from rlflow.search.ort_optimizer import model_type, ort_optimizer

    original = load_onnx(path)
    sizes = zoo.TINY_SIZES[name]
    return original, ort_optimizer(original, path, model_type(name), AnalyticCost("cpu"), sizes.get("heads", 0),
                                   sizes.get("hidden", 0))


def test_ort_optimizer_fuses_bert_finds_nothing_in_taso_bert_and_skips_a_cnn(tiny_models):
    from rlflow.graph.exec.check import check_equal

    original, r = _optimise(tiny_models["bert"], "bert")
    assert r.stats["contrib_ops"] == {"com.microsoft:SkipLayerNormalization": 4, "com.microsoft:Gelu": 2}
    assert r.nodes_after < r.nodes_before and check_equal(original, r.graph, seed=0) <= 1e-4
    original, r = _optimise(tiny_models["taso-bert"], "taso-bert")
    assert r.stats["contrib_ops"] == {} and r.stop_reason == "found nothing to fuse"
    assert r.graph.structural_hash() == original.structural_hash()
    original, r = _optimise(tiny_models["squeezenet"], "squeezenet")
    assert r.graph is original and r.settings["model_type"] is None


def test_contrib_ops_survive_the_ir_round_trip_and_run_on_onnxruntime_only(tiny_models, tmp_path):
    """gpt2's SkipLayerNormalization leaves optional outputs out before the one it uses: the IR keeps the used
    output in its position (without that, the re-exported graph did not even load in onnxruntime)."""
    from rlflow.evaluation.runs import unsupported_reason
    from rlflow.graph import load_onnx, save_onnx
    from rlflow.graph.exec.check import check_equal

    original, r = _optimise(tiny_models["gpt2"], "gpt2")
    assert Counter(r.stats["contrib_ops"]) == {"com.microsoft:SkipLayerNormalization": 4, "com.microsoft:FastGelu": 2}
    assert any("output_slots" in n.attrs for n in r.graph.nodes)
    save_onnx(r.graph, tmp_path / "opt.onnx")
    again = load_onnx(tmp_path / "opt.onnx")
    assert again.structural_hash() == r.graph.structural_hash()
    assert check_equal(original, again, seed=0) <= 1e-4
    assert unsupported_reason(again, "ort") is None and unsupported_reason(original, "torch") is None
    for backend in ("torch", "tf"):
        assert "runs only in onnxruntime" in unsupported_reason(again, backend)


def test_rlflow_optimize_runs_the_ort_optimizer_without_rules(tiny_models, tmp_path):
    out = tmp_path / "opt.onnx"
    r = rlflow("optimize", tiny_models["bert"], "--out", out, "--method", "ort-optimizer", "--no-speed-check",
               "--json", cwd=tmp_path)  # no results/rules/rules.json here: the optimizer needs none
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["method"] == "ort_optimizer" and doc["rules"] is None
    assert doc["stats"]["contrib_ops"] == {"com.microsoft:SkipLayerNormalization": 4, "com.microsoft:Gelu": 2}
    from rlflow.graph import load_onnx

    assert sum(n.op == "Opaque" for n in load_onnx(out).nodes) == 6
