"""Stage generalise: variants parsed from config, each agent's improvement and the share of it kept per variant."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from rlflow.config import load_config
from rlflow.errors import RLFlowError
from rlflow.agents.zero_shot import parse_variant, variant_label, zero_shot


@pytest.mark.parametrize("text, want", [
    ("seq=64", ("bert", {"seq": 64})),
    ("seq=64,batch=8", ("bert", {"seq": 64, "batch": 8})),
    ("vit:image=224", ("vit", {"image": 224})),
    ("taso-bert:seq=16", ("taso-bert", {"seq": 16})),
])
def test_parse_variant(text, want):
    assert parse_variant(text, "bert") == want


@pytest.mark.parametrize("text", ["seq", "seq=", "seq=6.4", "=64", "seq=64,", "vit:", "Seq=64"])
def test_parse_variant_rejects_malformed_text_in_one_line(text):
    with pytest.raises(RLFlowError, match=r"expected \[MODEL:\]KEY=INT"):
        parse_variant(text, "bert")


def test_variant_labels():
    assert variant_label("bert", {}, "bert") == "bert (trained)"
    assert variant_label("vit", {}, "bert") == "vit (other model)"
    assert variant_label("bert", {"seq": 16, "batch": 2}, "bert") == "bert seq=16,batch=2"


class ScaledAgent:
    """A stand-in agent whose improvement is ``pct`` percent of the initial cost per 100 graph nodes."""

    def __init__(self, pct_per_100_nodes: float, returns=None):
        self.pct, self.returns = pct_per_100_nodes, returns

    def optimise(self, graph, rules, cost, device="cpu"):
        pct = self.pct * len(graph.nodes) / 100
        times = SimpleNamespace(initial=SimpleNamespace(runtime_ms=10.0),
                                final=SimpleNamespace(runtime_ms=10.0 * (1 - pct / 100)),
                                graph=self.returns if self.returns is not None else graph, expansions=3)
        return times, None


def test_zero_shot_exports_each_variant_and_divides_by_the_trained_improvement(root, tiny_zoo):
    from rlflow.cost import make_cost_model
    from rlflow.graph import load_onnx

    config = load_config([root / "config.yaml", root / "tests/configs/tiny.yaml"], ["cost.target=sim-h100"])
    graph = load_onnx(tiny_zoo["bert"])
    lines = []
    rows = zero_shot({"model_free": ScaledAgent(2.0), "rlflow": ScaledAgent(0.0)}, "bert", graph,
                     [parse_variant("batch=2", "bert"), parse_variant("taso-bert:seq=4", "bert")], [],
                     make_cost_model(config, "cpu"), config, log=lines.append)
    assert [r["graph"] for r in rows] == ["bert (trained)", "bert batch=2", "taso-bert seq=4"]
    assert rows[0]["trained"] and not rows[1]["trained"] and rows[2]["model"] == "taso-bert"
    assert rows[0]["nodes"] == len(graph.nodes)
    for r in rows:
        mf = r["agents"]["model_free"]
        assert mf["improvement_pct"] == pytest.approx(2.0 * r["nodes"] / 100)
        assert mf["kept"] == pytest.approx(r["nodes"] / rows[0]["nodes"])
        assert r["agents"]["rlflow"]["kept"] is None  # no improvement on the trained shape: nothing to keep
        assert r["greedy_pct"] == 0.0 and mf["vs_greedy"] is None  # no rules: greedy finds nothing
        assert mf["max_rel_diff"] == 0.0 and mf["real_steps"] == 3  # its graph was checked against the original
    assert len(lines) == 3 and "kept n/a" in lines[0]


def test_zero_shot_graph_that_computes_something_else_fails_the_stage(root, tiny_zoo):
    """Every agent graph of a zero-shot run is checked equal to its original (evaluate.tolerance), as evaluate
    checks the written ones."""
    from rlflow.cost import make_cost_model
    from rlflow.graph import load_onnx

    config = load_config([root / "config.yaml", root / "tests/configs/tiny.yaml"], ["cost.target=sim-h100"])
    wrong = load_onnx(tiny_zoo["bert"])
    graph = load_onnx(tiny_zoo["bert"])
    from rlflow.graph.ir import Constant

    name = max(wrong.constants, key=lambda k: wrong.constants[k].array.size)  # a weight matrix
    w = wrong.constants[name].array
    wrong.constants[name] = Constant(w + np.random.default_rng(0).normal(size=w.shape).astype(w.dtype))
    with pytest.raises(RLFlowError, match="model_free's zero-shot graph"):
        zero_shot({"model_free": ScaledAgent(1.0, returns=wrong)}, "bert", graph, [], [],
                  make_cost_model(config, "cpu"), config, log=lambda _: None)


def test_zero_shot_unbuildable_variant_is_a_one_line_error(root, tiny_zoo):
    from rlflow.cost import make_cost_model
    from rlflow.graph import load_onnx

    config = load_config([root / "config.yaml", root / "tests/configs/tiny.yaml"], ["cost.target=sim-h100"])
    with pytest.raises(RLFlowError, match="generalise variant bert heads=3: cannot export"):
        zero_shot({"model_free": ScaledAgent(1.0)}, "bert", load_onnx(tiny_zoo["bert"]),
                  [parse_variant("heads=3", "bert")], [], make_cost_model(config, "cpu"), config, log=lambda _: None)


def _without_seconds(rows):
    return [{**r, "agents": {m: {k: v for k, v in a.items() if k != "seconds"} for m, a in r["agents"].items()}}
            for r in rows]


def test_zero_shot_scores_the_variants_in_parallel_with_the_same_rows_and_takes_a_known_trained_row(root, tiny_zoo):
    """workers=2 runs the variants in two spawned processes: the rows (and their order) are those of one process.
    A trained row given (from the agent stages' traces) is used as it is: the trained shape is not run again."""
    from rlflow.cost import make_cost_model
    from rlflow.graph import load_onnx

    config = load_config([root / "config.yaml", root / "tests/configs/tiny.yaml"], ["cost.target=sim-h100"])
    graph, cost = load_onnx(tiny_zoo["bert"]), make_cost_model(config, "cpu")
    agents = {"model_free": ScaledAgent(2.0), "rlflow": ScaledAgent(1.0)}
    variants = [parse_variant("batch=2", "bert"), parse_variant("taso-bert:seq=4", "bert")]
    one = zero_shot(agents, "bert", graph, variants, [], cost, config, log=lambda _: None)
    lines = []
    two = zero_shot(agents, "bert", graph, variants, [], cost, config, log=lines.append, workers=2)
    assert _without_seconds(two) == _without_seconds(one) and len(lines) == 3
    assert [r["graph"] for r in two] == ["bert (trained)", "bert batch=2", "taso-bert seq=4"]

    known = {**one[0], "agents": {m: {**a, "improvement_pct": 2 * a["improvement_pct"]} for m, a in one[0]["agents"].items()}}
    known = {k: v for k, v in known.items() if k not in ("graph", "model", "sizes", "trained")}
    rows = zero_shot(agents, "bert", graph, variants, [], cost, config, log=lambda _: None, trained=known)
    assert rows[0]["agents"] == known["agents"] and rows[0]["trained"]
    for r, r1 in zip(rows[1:], one[1:]):  # kept is against the given trained row: half of what it was
        assert r["agents"]["model_free"]["kept"] == pytest.approx(r1["agents"]["model_free"]["kept"] / 2)


def _trace(graph, cost, final_ms, path="t.json", nodes=None, initial_ms=None, steps=7):
    from rlflow.evaluation.traces import COST_KEYS, TraceSummary

    m = cost.graph_metrics(graph)
    initial = {k: float(getattr(m, k)) if k != "nodes" else float(len(graph.nodes)) for k in COST_KEYS}
    if nodes is not None:
        initial["nodes"] = float(nodes)
    if initial_ms is not None:
        initial["runtime_ms"] = initial_ms
    final = {**initial, "runtime_ms": final_ms}
    return TraceSummary(path=path, method=None, initial=initial, final=initial, rules_applied=3, optimisation_s=1.5,
                        training_s=None, real_interactions=None, speed_check="kept original", searched=final,
                        expansions=steps, max_rel_diff=1e-7)


def test_trained_row_is_read_from_the_agent_stages_traces_and_refuses_a_trace_of_another_graph(root, tiny_zoo):
    from rlflow.agents.zero_shot import trained_row
    from rlflow.cost import make_cost_model
    from rlflow.graph import load_onnx

    config = load_config([root / "config.yaml", root / "tests/configs/tiny.yaml"], ["cost.target=sim-h100"])
    graph, cost = load_onnx(tiny_zoo["bert"]), make_cost_model(config, "cpu")
    ms = cost.graph_metrics(graph).runtime_ms
    row = trained_row(graph, cost, {"model_free": _trace(graph, cost, 0.9 * ms), "rlflow": _trace(graph, cost, ms)},
                      _trace(graph, cost, 0.95 * ms))
    mf, rl = row["agents"]["model_free"], row["agents"]["rlflow"]
    # the graph each agent found, not what the never-slower check kept (the traces say "kept original")
    assert mf["improvement_pct"] == pytest.approx(10.0) and mf["final_ms"] == pytest.approx(0.9 * ms)
    assert mf["kept"] == 1.0 and rl["kept"] is None and rl["improvement_pct"] == pytest.approx(0.0)
    assert row["greedy_pct"] == pytest.approx(5.0) and mf["vs_greedy"] == pytest.approx(2.0)
    assert mf["real_steps"] == 7 and mf["seconds"] == 1.5 and mf["max_rel_diff"] == 1e-7
    assert row["nodes"] == len(graph.nodes) and row["initial_ms"] == pytest.approx(ms) and row["from_traces"]
    for bad in (_trace(graph, cost, ms, "other.json", nodes=len(graph.nodes) + 1),
                _trace(graph, cost, ms, "other.json", initial_ms=1.01 * ms)):
        with pytest.raises(RLFlowError, match=r"^other.json: its graph starts at .* another model or cost model$"):
            trained_row(graph, cost, {"model_free": _trace(graph, cost, ms)}, bad)


def test_generalise_stage_wants_all_three_traces_or_none(tmp_path, capsys):
    from rlflow.cli import main

    code = main(["generalise", "--model", "bert", "--onnx", str(tmp_path / "m.onnx"), "--rules", str(tmp_path / "r.json"),
                 "--model-free", str(tmp_path / "a.pt"), "--controller", str(tmp_path / "b.pt"),
                 "--greedy-trace", str(tmp_path / "g.json"), "--out", str(tmp_path / "o.json")])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1 and "give all three traces" in err
    assert not (tmp_path / "o.json").exists()


def test_a_zero_shot_worker_runs_torch_on_one_thread_whatever_omp_num_threads_says(monkeypatch):
    """Snakemake sets OMP_NUM_THREADS to the job's cores; two workers with that many threads each stall."""
    import torch

    from rlflow.agents import zero_shot as zs

    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    try:
        torch.set_num_threads(2)
        zs._start_worker({"model": "bert"})
        assert torch.get_num_threads() == 1 and zs._JOB["model"] == "bert"
    finally:
        zs._JOB.clear()
        torch.set_num_threads(before)
