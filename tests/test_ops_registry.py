"""The op registry: every op is one OpDef with all its facets, no other module keeps a per-op table, shape
inference rejects inconsistent models at import, and no rlflow modules import each other in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from rlflow.errors import RLFlowError
from rlflow.graph.onnx_io import load_onnx
from rlflow.graph.ops import ONNX_IMPORTS, OPS, OpDef

SRC = Path(__file__).resolve().parents[1] / "src"


# ------------------------------------------------------------------------------------------------ facets
@pytest.mark.parametrize("name", sorted(OPS))
def test_every_opdef_has_all_its_facets(name):
    d = OPS[name]
    assert isinstance(d, OpDef) and d.name == name
    assert isinstance(d.attrs, tuple) and all(isinstance(a, str) for a in d.attrs)
    for facet in ("infer", "compute", "flops", "to_onnx", "tf", "input_ranks"):
        assert callable(getattr(d, facet)), f"{name} has no {facet}"
    assert d.jax is None or callable(d.jax)
    assert d.tf_layout in ("ir", "nhwc", "any")
    assert all(isinstance(i, int) for i in d.positive_inputs)
    if d.from_onnx is None:  # only TASO's helpers are never imported: they export as another ONNX op
        assert d.onnx_type != name and not d.onnx_types
    else:
        assert callable(d.from_onnx) and name in d.onnx_types
        assert all(ONNX_IMPORTS[t] is d for t in d.onnx_types)


def _per_op_tables(path: Path) -> list[str]:
    """Per-op knowledge in ``path``: a dict, set, list or tuple display naming two or more IR ops, or a comparison
    with an IR op's name (``n.op == "Conv"``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Dict):
            items, least = node.keys, 2
        elif isinstance(node, (ast.Set, ast.Tuple, ast.List)):
            items, least = node.elts, 2
        elif isinstance(node, ast.Compare):
            items, least = [node.left, *node.comparators], 1
        else:
            continue
        named = sorted({c.value for c in items if isinstance(c, ast.Constant) and c.value in OPS})
        if len(named) >= least:
            found.append(f"{path.name}:{node.lineno}: {named}")
    return found


@pytest.mark.parametrize("module", ["graph/onnx_io.py", "graph/exec/tf_exec.py", "rewrite/verify.py"])
def test_no_per_op_tables_outside_the_registry(module):
    assert _per_op_tables(SRC / "rlflow" / module) == []


def test_the_table_finder_finds_tables(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('T = {"Conv": 1, "Relu": 2}\nif op == "Conv":\n    pass\n'
                 'S = {"x", "Relu"}\nif k == "axis":\n    pass\n')
    assert [t.split(": ", 1)[1] for t in _per_op_tables(f)] == ["['Conv', 'Relu']", "['Conv']"]


# ------------------------------------------------------------------------------------------------ shape checks
def _vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _w(name, shape):
    return numpy_helper.from_array(np.ones(shape, np.float32), name)


def _save(tmp_path, node, x_shape, y_shape, weights):
    g = helper.make_graph([node], "bad", [_vi("x", x_shape)], [_vi("y", y_shape)], [_w(k, s) for k, s in weights])
    path = tmp_path / f"{node.name}.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=8), str(path))
    return path


# ONNX's checker and shape inference accept each of these; onnxruntime fails when it runs them.
BAD = {
    "conv_group": (helper.make_node("Conv", ["x", "w"], ["y"], name="conv_g", group=3), [1, 4, 8, 8], [1, 6, 6, 6],
                   [("w", [6, 2, 3, 3])], "node 'conv_g' (Conv): channels do not match"),
    "conv_weight_5d": (helper.make_node("Conv", ["x", "w"], ["y"], name="conv5", kernel_shape=[3, 3]), [1, 4, 8, 8],
                       [1, 6, 6, 6], [("w", [6, 4, 3, 3, 1])],
                       "node 'conv5' (Conv): Conv2D needs 4-D input and weight"),
    "conv_bias": (helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv_b"), [1, 4, 8, 8], [1, 6, 6, 6],
                  [("w", [6, 4, 3, 3]), ("b", [5])], "node 'conv_b' (Conv): bias shape (5,) != (6,)"),
    "layernorm_scale": (helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], name="ln"), [2, 256],
                        [2, 256], [("s", [256, 1]), ("b", [256])],
                        "node 'ln' (LayerNormalization): scale shape (256, 1) does not broadcast to (2, 256)"),
    "gemm_bias": (helper.make_node("Gemm", ["x", "w", "c"], ["y"], name="gemm"), [2, 4], [2, 6],
                  [("w", [4, 6]), ("c", [3, 6])], "node 'gemm' (Gemm): C shape (3, 6) does not broadcast to (2, 6)"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_inconsistent_shapes_are_a_one_line_error_at_import(case, tmp_path):
    node, x, y, weights, message = BAD[case]
    path = _save(tmp_path, node, x, y, weights)
    with pytest.raises(RLFlowError) as err:
        load_onnx(path)
    text = str(err.value)
    assert "\n" not in text and text.startswith(str(path)) and message in text, text


def test_matmul_weight_with_an_extra_dimension(tmp_path):
    """A MatMul weight with an extra trailing dimension: ONNX's inference catches it when the inner sizes differ;
    a batch dimension that broadcasts is a valid model (and imports as a MatMul)."""
    node = helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")
    with pytest.raises(RLFlowError, match="node name: mm.*Incompatible dimensions") as err:
        load_onnx(_save(tmp_path, node, [2, 4], [4, 2, 1], [("w", [4, 6, 1])]))
    assert "\n" not in str(err.value)
    g = load_onnx(_save(tmp_path, node, [2, 4], [1, 2, 6], [("w", [1, 4, 6])]))
    assert [n.op for n in g.nodes] == ["MatMul"]


def test_layernorm_scale_that_broadcasts_is_fine(tmp_path):
    node = helper.make_node("LayerNormalization", ["x", "s"], ["y"], name="ln")
    g = load_onnx(_save(tmp_path, node, [2, 3, 4], [2, 3, 4], [("s", [1, 4])]))
    assert [n.op for n in g.nodes] == ["LayerNormalization"]


def test_pow_to_an_integer_power_stays_opaque(tmp_path):
    """ONNX's Pow may raise a float to an int64 power: a valid model the IR's Pow does not model, kept opaque."""
    e = numpy_helper.from_array(np.array(2, np.int64), "e")
    g = helper.make_graph([helper.make_node("Pow", ["x", "e"], ["y"], name="pow")], "pow", [_vi("x", [2, 3])],
                          [_vi("y", [2, 3])], [e])
    path = tmp_path / "pow.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=8), str(path))
    assert [n.op_type_name() for n in load_onnx(path).opaque_nodes()] == ["Pow"]


# ------------------------------------------------------------------------------------------------ import cycles
def _module_graph() -> dict[str, set[str]]:
    """rlflow module -> the rlflow modules it imports (anywhere in it, function bodies included; not under
    ``if TYPE_CHECKING``). ``from pkg import name`` counts as importing ``pkg.name`` when that is a module."""
    files = {}
    for p in sorted((SRC / "rlflow").rglob("*.py")):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        found: set[str] = set()
        stack = [ast.parse(path.read_text())]
        while stack:
            for node in ast.iter_child_nodes(stack.pop()):
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                    stack.extend(node.orelse)
                    continue
                if isinstance(node, ast.Import):
                    found.update(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                        base = ".".join(anchor + ([base] if base else []))
                    found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names)
                stack.append(node)
        graph[mod] = {m for m in found if m in files and m != mod}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (a list of modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycles():
    graph = _module_graph()
    assert "rlflow.graph.ops" in graph["rlflow.graph.ir"]  # the parser sees imports
    assert "rlflow.rewrite.verify" in graph["rlflow.rewrite.generator"]  # ... function-level ones too
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
