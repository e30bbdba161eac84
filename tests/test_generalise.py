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
