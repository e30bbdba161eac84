"""TASO's canonical substitutions are in the rules file the pipeline makes, and they work on real graphs.

The rules file is the one the pipeline's own stage (``rlflow generate-rules``) makes with the default config
(the ``rules_file`` fixture in conftest.py): TASO's 3-operator enumeration plus the builtin rules. Enlarge-merge
and pooling-as-conv are TASO's hand-written transforms: builtin rules, which the stage adds.

For each canonical substitution a small graph holding its source pattern is built; some rule of the file
(generated or builtin) must match exactly the expected nodes, and applying it (then folding the weight-only ops,
as a search does) must give the expected op counts and a graph whose onnxruntime and torch outputs equal the
original's. A canonical substitution that no rule provides FAILS the test (it is never skipped): the message
names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

from rlflow.graph.builder import GraphBuilder
from rlflow.graph.fold import fold_constants
from rlflow.graph.ir import Graph
from rlflow.rewrite.rule import load_rules

CONV = dict(strides=(1, 1), group=1, activation="none")


def _w(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng([seed, *shape]).standard_normal(shape).astype(np.float32)


@dataclass(frozen=True)
class Case:
    build: Callable[[], Graph]     # the graph; the nodes the match must cover are named m0, m1, ...
    counts: dict                   # op counts after applying the rule and folding weight-only ops
    check: Callable[[Graph], bool] | None = None   # more about the result's structure


def _pattern_nodes(g: Graph) -> set[str]:
    return {n.name for n in g.nodes if n.name.startswith("m") and n.name[1:].isdigit()}


def _node_reading(g: Graph, op: str) -> list:
    return [n for n in g.nodes if n.op == op]


# ------------------------------------------------------------------------------------------------ the graphs
def matmul_merge() -> Graph:
    b = GraphBuilder("matmul-merge")
    x = b.input("x", (3, 8))
    y0 = b.op("MatMul", [x, b.const("w0", _w(8, 6))], name="m0")
    y1 = b.op("MatMul", [x, b.const("w1", _w(8, 5))], name="m1")
    return b.build([y0, y1])


def conv_merge() -> Graph:
    b = GraphBuilder("conv-merge")
    x = b.input("x", (1, 3, 6, 6))
    y0 = b.op("Conv", [x, b.const("w0", _w(5, 3, 3, 3))], pads=(1, 1, 1, 1), name="m0", **CONV)
    y1 = b.op("Conv", [x, b.const("w1", _w(4, 3, 3, 3))], pads=(1, 1, 1, 1), name="m1", **CONV)
    return b.build([y0, y1])


def conv_relu() -> Graph:
    b = GraphBuilder("conv-relu")
    x = b.input("x", (1, 3, 6, 6))
    y = b.op("Conv", [x, b.const("w", _w(4, 3, 3, 3))], pads=(1, 1, 1, 1), name="m0", **CONV)
    return b.build([b.op("Relu", [y], name="m1")])


def conv_add() -> Graph:
    b = GraphBuilder("conv-add")
    x1, x2 = b.input("x1", (1, 3, 6, 6)), b.input("x2", (1, 2, 6, 6))
    y1 = b.op("Conv", [x1, b.const("w1", _w(4, 3, 3, 3))], pads=(1, 1, 1, 1), name="m0", **CONV)
    y2 = b.op("Conv", [x2, b.const("w2", _w(4, 2, 3, 3))], pads=(1, 1, 1, 1), name="m1", **CONV)
    return b.build([b.op("Add", [y1, y2], name="m2")])


def matmul_assoc() -> Graph:
    b = GraphBuilder("matmul-assoc")
    x = b.input("x", (3, 8))
    y = b.op("MatMul", [x, b.const("w0", _w(8, 6))], name="m0")
    return b.build([b.op("MatMul", [y, b.const("w1", _w(6, 5))], name="m1")])


def transpose_matmul() -> Graph:
    b = GraphBuilder("transpose-matmul")
    x = b.input("x", (3, 8))
    y = b.op("MatMul", [x, b.const("w", _w(8, 5))], name="m0")
    return b.build([b.op("Transpose", [y], perm=(1, 0), name="m1")])


def distributivity(shared_first: bool = True) -> Callable[[], Graph]:
    """a*x + a*y, or x*a + a*y: the matcher binds a commutative op's operands in either order, so one rule does
    both (TASO needed a commutativity rewrite first)."""
    def build() -> Graph:
        b = GraphBuilder("mul-add-distributivity")
        a, x, y = b.input("a", (3, 4)), b.input("x", (3, 4)), b.input("y", (3, 4))
        first = b.op("Mul", [a, x] if shared_first else [x, a], name="m0")
        return b.build([b.op("Add", [first, b.op("Mul", [a, y], name="m1")], name="m2")])
    return build


def add_assoc() -> Graph:
    b = GraphBuilder("add-assoc")
    x, y, z = b.input("x", (3, 4)), b.input("y", (3, 4)), b.input("z", (3, 4))
    return b.build([b.op("Add", [b.op("Add", [x, y], name="m0"), z], name="m1")])


def split_concat() -> Graph:
    b = GraphBuilder("split-concat")
    x, y = b.input("x", (2, 3)), b.input("y", (2, 5))
    c = b.op("Concat", [x, y], axis=1, name="m0")
    s0, s1 = b.op("Split", [c], n_outputs=2, axis=1, split=(3, 5), name="m1")
    return b.build([b.op("Relu", [s0]), b.op("Relu", [s1])])


def enlarge_merge(small: tuple[int, int]) -> Callable[[], Graph]:
    def build() -> Graph:
        b = GraphBuilder(f"enlarge-{small[0]}x{small[1]}")
        x = b.input("x", (1, 3, 6, 6))
        y0 = b.op("Conv", [x, b.const("w0", _w(5, 3, 3, 3))], pads=(1, 1, 1, 1), name="m0", **CONV)
        kh, kw = small
        y1 = b.op("Conv", [x, b.const("w1", _w(4, 3, kh, kw))], pads=(kh // 2, kw // 2, kh // 2, kw // 2),
                  name="m1", **CONV)
        return b.build([y0, y1])
    return build


def avgpool_conv() -> Graph:
    b = GraphBuilder("avgpool-conv")
    x = b.input("x", (1, 3, 6, 6))
    return b.build([b.op("AveragePool", [x], kernel=(3, 3), strides=(1, 1), pads=(1, 1, 1, 1), ceil_mode=0,
                         count_include_pad=1, name="m0")])


def _inner_add_reads(g: Graph, names: set[str]) -> bool:
    """Some Add of ``g`` reads exactly the graph values ``names`` (associativity regrouped the operands)."""
    return any(n.op == "Add" and set(n.inputs) == names for n in g.nodes)


CASES: dict[str, Case] = {
    "matmul-merge (two MatMuls sharing an input)": Case(matmul_merge, {"MatMul": 1, "Split": 1}),
    "conv-merge (two Convs sharing an input, equal parameters)": Case(conv_merge, {"Conv": 1, "Split": 1}),
    "conv-relu fusion": Case(conv_relu, {"Conv": 1},
                             lambda g: _node_reading(g, "Conv")[0].attrs["activation"] == "relu"),
    "add of two convs -> conv of concatenated inputs and weights": Case(conv_add, {"Concat": 1, "Conv": 1}),
    "matmul associativity": Case(matmul_assoc, {"MatMul": 1}),
    "transpose of a matmul -> matmul of transposes": Case(
        transpose_matmul, {"MatMul": 1, "Transpose": 1},
        lambda g: _node_reading(g, "MatMul")[0].inputs[1] == _node_reading(g, "Transpose")[0].outputs[0]),
    "distributivity of Mul over Add": Case(distributivity(), {"Add": 1, "Mul": 1}),
    "distributivity, the shared factor on either side": Case(distributivity(shared_first=False), {"Add": 1, "Mul": 1}),
    "add associativity": Case(add_assoc, {"Add": 2},
                              lambda g: _inner_add_reads(g, {"y", "z"}) or _inner_add_reads(g, {"x", "z"})),
    "split of a concat -> its inputs": Case(split_concat, {"Relu": 2},
                                            lambda g: sorted(n.inputs[0] for n in g.nodes) == ["x", "y"]),
    "1x1 kernel enlarged to 3x3, merged with a 3x3 conv": Case(enlarge_merge((1, 1)), {"Conv": 1, "Split": 1}),
    "1x3 kernel enlarged to 3x3, merged with a 3x3 conv": Case(enlarge_merge((1, 3)), {"Conv": 1, "Split": 1}),
    "average pooling as a conv with the pooling kernel": Case(avgpool_conv, {"Conv": 1}),
}


# ------------------------------------------------------------------------------------------------ the test
@pytest.fixture(scope="module")
def rules(rules_file):
    rules = load_rules(rules_file)
    assert {r.origin for r in rules} == {"generated", "builtin"}
    return rules


def _outputs_equal(g0: Graph, g1: Graph) -> float:
    from rlflow.graph.exec import get_runner, make_inputs, max_rel_diff

    feeds = make_inputs(g0, seed=3)
    want = get_runner(g0, "ort")(feeds)
    return max(max_rel_diff(want, get_runner(g1, "ort")(feeds)), max_rel_diff(want, get_runner(g1, "torch")(feeds)))


def providers(rules, case: Case) -> list[tuple[str, Graph]]:
    """(rule id, rewritten and folded graph) for every match of every rule that performs the substitution."""
    from rlflow.rewrite.matcher import apply, find_matches

    g = case.build()
    place = _pattern_nodes(g)
    out = []
    for rule in rules:
        for m in find_matches(g, rule):
            if set(m.nodes) != place:
                continue
            try:
                new = fold_constants(apply(g, m))
            except Exception as e:  # a match the matcher accepted must apply: name the rule
                raise AssertionError(f"applying rule '{rule.id}' at {m.nodes} failed: {e!r}") from e
            if new.op_counts() == case.counts and (case.check is None or case.check(new)):
                out.append((rule.id, new))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_canonical_substitution(rules, name):
    case = CASES[name]
    found = providers(rules, case)
    assert found, f"canonical substitution '{name}' is absent from the rules file ({len(rules)} rules)"
    g0 = case.build()
    for rid, new in found:
        assert _outputs_equal(g0, new) < 1e-5, (name, rid)
