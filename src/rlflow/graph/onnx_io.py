"""ONNX import and export.

``load_onnx(path, input_shapes=None) -> Graph``
    1. read and check the file (missing, not ONNX, truncated, cyclic, unsupported opset or dtype, an initializer
       whose dims or data size do not add up: one-line errors);
    2. make every input shape static (``input_shapes`` fills dynamic dimensions; otherwise a clear error);
    3. fold constant subgraphs (Shape/Gather/Concat/ConstantOfShape/Expand/Where/Equal/... feeding Reshape and
       friends) to fixed point, with ONNX shape inference (``data_prop=True``) between rounds;
    4. translate each node to an IR op with normalised attributes (the op's ``from_onnx`` in the op registry);
       anything the registry does not cover, or covers only with other attributes, becomes an ``Opaque`` node with
       its shapes from ONNX shape inference. A translated node whose shapes the op's shape inference rejects (a
       Conv whose group does not divide the channels, say, which ONNX's checks let through) is an error.
    5. from opset 23 (ONNX's ``Attention``), attention masks in the form the fused-attention rules match
       (:func:`rlflow.graph.fold.canonical_attention`: GPT-2's multiplicative 0/1 mask ``s * B - 1e10 * (1 - B)``
       made additive, Hugging Face's ``Where(IsNaN(p), 0, p)`` guard after the softmax dropped where the values
       prove it idle); below it the graph is what the file says.

``save_onnx(graph, path)`` writes the graph at its own opset, valid under ``onnx.checker`` (full check), atomically.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from rlflow.atomic import atomic_path
from rlflow.errors import RLFlowError
from rlflow.graph.fold import canonical_attention, drop_unused_constants
from rlflow.graph.ir import Constant, Graph, Node, TensorType
from rlflow.graph.ops import ONNX_IMPORTS, OPS, OnnxNode, ShapeError, Unsupported, infer_types
from rlflow.graph.ops.attention import ATTENTION_OPSET

#: the default-domain opsets the importer reads: 13 up to the newest the installed onnx defines. An op whose
#: definition changed after 20 changed only in the element types it allows (int4, float8, float4, int2 ...), which
#: the importer refuses anyway, or in ways its ``from_onnx`` checks (Cast 24's ``round_mode`` applies to float8
#: only; Attention 24's ``nonpad_kv_seqlen`` input and 25's window attributes keep such a node opaque)
MIN_OPSET, MAX_OPSET = 13, onnx.defs.onnx_opset_version()
#: the newest IR version and opset onnxruntime reads (1.31: IR 13 and opset 26, ONNX's newest released one; it
#: refuses opsets 27-28 as "under development"; a test checks both against the installed onnxruntime)
ORT_MAX_IR_VERSION, ORT_MAX_OPSET = 13, 26


def ir_version(opset: int) -> int:
    """The IR version a model of ``opset`` is written with: the one of the onnx release that introduced the opset
    (``onnx.helper.VERSION_TABLE``), at least 8 (what opsets up to 18 have always been written with) and at most
    :data:`ORT_MAX_IR_VERSION`, so onnxruntime reads every file (opset 28 comes with IR 14 in onnx 1.23)."""
    found = [ir for _, ir, ops, *_ in helper.VERSION_TABLE if ops == opset]
    return max(8, min(min(found, default=ORT_MAX_IR_VERSION), ORT_MAX_IR_VERSION))

_DTYPES = {
    TensorProto.FLOAT: "float32", TensorProto.DOUBLE: "float64", TensorProto.FLOAT16: "float16",
    TensorProto.INT64: "int64", TensorProto.INT32: "int32", TensorProto.INT8: "int8", TensorProto.UINT8: "uint8",
    TensorProto.BOOL: "bool",
}
_ONNX_DTYPE = {v: k for k, v in _DTYPES.items()}
#: constant folding never creates a tensor larger than this (elements) from non-weight inputs
_FOLD_LIMIT = 1 << 22
#: ops that must never be folded even with constant inputs
_NO_FOLD = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}


# ======================================================================================== reading and checking
# ---------------------------------------------------------------- protobuf wire format (large weights, no copies)
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


def _len_field(number: int, length: int) -> bytes:
    """Protobuf tag and length of a length-delimited field."""
    return _varint(number << 3 | 2) + _varint(length)


# protobuf field numbers (onnx.proto): ModelProto.graph, GraphProto.initializer, TensorProto.raw_data
_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_RAW_DATA = 7, 5, 9
_PROTOBUF_LIMIT = 2**31 - 1


def _varint_at(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _scan(buf: bytes, start: int, end: int):
    """Yield (field number, tag offset, value start, value end) for the protobuf fields in buf[start:end]."""
    pos = start
    while pos < end:
        tag = pos
        key, pos = _varint_at(buf, pos)
        wire = key & 7
        if wire == 0:
            _, nxt = _varint_at(buf, pos)
        elif wire == 1:
            nxt = pos + 8
        elif wire == 2:
            n, pos = _varint_at(buf, pos)
            nxt = pos + n
        elif wire == 5:
            nxt = pos + 4
        else:
            raise ValueError("unsupported wire type")
        if nxt > end:
            raise ValueError("truncated field")
        yield key >> 3, tag, pos, nxt
        pos = nxt


def _split_large_weights(data: bytes, min_bytes: int = 1 << 16) -> tuple[bytes, dict[str, np.ndarray]]:
    """Cut the raw data of large initializers out of a serialized ModelProto. Returns the remaining bytes (for
    protobuf to parse: each such initializer keeps its name, type and dims) and zero-copy numpy views of the cut
    data by initializer name. Anything unusual is left in place for protobuf."""
    graphs = [(tag, a, b) for num, tag, a, b in _scan(data, 0, len(data)) if num == _MODEL_GRAPH]
    if len(graphs) != 1:
        return data, {}
    gtag, ga, gb = graphs[0]
    views: dict[str, np.ndarray] = {}
    parts, last = [], ga
    for num, tag, a, b in _scan(data, ga, gb):
        if num != _GRAPH_INITIALIZER or b - a < min_bytes:
            continue
        fields = list(_scan(data, a, b))
        raw = [(ra, rb) for n, _, ra, rb in fields if n == _TENSOR_RAW_DATA]
        if len(raw) != 1:
            continue
        header = TensorProto()
        header.ParseFromString(b"".join(data[t:fb] for n, t, _, fb in fields if n != _TENSOR_RAW_DATA))
        dtype, shape = _DTYPES.get(header.data_type), tuple(int(d) for d in header.dims)
        (ra, rb), count = raw[0], math.prod(shape)
        if dtype is None or min(shape, default=0) < 0 or header.data_location == TensorProto.EXTERNAL or count * np.dtype(dtype).itemsize != rb - ra:
            continue
        views[header.name] = np.frombuffer(data, dtype=dtype, count=count, offset=ra).reshape(shape)
        head = header.SerializeToString()
        parts += [data[last:tag], _len_field(_GRAPH_INITIALIZER, len(head)), head]
        last = b
    if not views:
        return data, {}
    parts.append(data[last:gb])
    graph_bytes = b"".join(parts)
    return data[:gtag] + _len_field(_MODEL_GRAPH, len(graph_bytes)) + graph_bytes + data[gb:], views


#: how errors name a model given as bytes
IN_MEMORY = "the model"


def _read_model(path: str | os.PathLike | bytes) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Parse the file (or the bytes of one); large weights come back separately as zero-copy numpy views of the
    file's bytes."""
    if isinstance(path, (bytes, bytearray)):
        p, data = Path("."), bytes(path)
    else:
        p = Path(path)
        if not p.exists():
            raise RLFlowError(f"{p}: no such file")
        if not p.is_file():
            raise RLFlowError(f"{p}: not a file")
        data = p.read_bytes()
    folder = p.parent
    if isinstance(path, (bytes, bytearray)):
        p = IN_MEMORY
    if not data:
        raise RLFlowError(f"{p}: empty file, not an ONNX model")
    model = onnx.ModelProto()
    try:
        rest, views = _split_large_weights(data)
    except (ValueError, IndexError):
        rest, views = data, {}  # malformed wire data: let protobuf report it below
    try:
        model.ParseFromString(rest)
    except Exception:
        raise RLFlowError(f"{p}: not an ONNX model (protobuf parse failed; truncated or another format)") from None
    if not model.graph.node and not model.graph.output:
        raise RLFlowError(f"{p}: not an ONNX model (no graph)")
    if not model.graph.output:
        raise RLFlowError(f"{p}: the graph has no outputs, so there is nothing to compute")
    if model.graph.initializer and any(t.data_location == TensorProto.EXTERNAL for t in model.graph.initializer):
        try:
            onnx.load_external_data_for_model(model, str(folder))
        except Exception as e:
            raise RLFlowError(f"{p}: cannot load external weight data ({_first_line(e)})") from None
    return model, views


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _opset_of(model: onnx.ModelProto, path: Any) -> tuple[int, dict[str, int]]:
    default, extra = None, {}
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            default = imp.version
        else:
            extra[imp.domain] = imp.version
    if default is None:
        raise RLFlowError(f"{path}: the model imports no default ONNX opset")
    if not MIN_OPSET <= default <= MAX_OPSET:
        raise RLFlowError(f"{path}: opset {default} is not supported (supported: {MIN_OPSET}-{MAX_OPSET}); "
                          f"re-export with opset_version={MAX_OPSET if default > MAX_OPSET else MIN_OPSET}")
    return default, extra


def _sort_or_cycle(model: onnx.ModelProto, path: Any) -> None:
    """Topologically sort the nodes in place (ONNX requires it); a cycle is an error naming a node on it."""
    g = model.graph
    nodes = list(g.node)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    _check_defined(g, producer, path)
    if all(producer.get(v, -1) < i for i, n in enumerate(nodes) for v in n.input):
        return  # already in topological order
    indeg = [0] * len(nodes)
    users: list[list[int]] = [[] for _ in nodes]
    for i, n in enumerate(nodes):
        for v in set(n.input):
            j = producer.get(v)
            if j is not None:
                indeg[i] += 1
                users[j].append(i)
    order = [i for i, d in enumerate(indeg) if d == 0]
    k = 0
    while k < len(order):
        for u in users[order[k]]:
            indeg[u] -= 1
            if indeg[u] == 0:
                order.append(u)
        k += 1
    if len(order) != len(nodes):
        stuck = nodes[next(i for i, d in enumerate(indeg) if d > 0)]
        raise RLFlowError(f"{path}: the graph has a cycle through node '{stuck.name or '(unnamed)'}' ({stuck.op_type})")
    del g.node[:]
    g.node.extend(nodes[i] for i in order)


def _check_defined(g: onnx.GraphProto, producer: dict[str, int], path: Any) -> None:
    """Every value a node reads, and every graph output, must be a graph input, an initializer or a node's output
    (else a deleted initializer or node: named here, where ONNX's checker would say the graph is not sorted)."""
    defined = set(producer) | {i.name for i in g.input} | {t.name for t in g.initializer} | {
        t.values.name for t in g.sparse_initializer}
    for k, n in enumerate(g.node):
        for v in n.input:
            if v and v not in defined:
                raise RLFlowError(f"{path}: node '{n.name or f'#{k}'}' ({n.op_type}) reads '{v}', which no node, "
                                  "graph input or initializer defines (a deleted initializer or node?)")
    for o in g.output:
        if o.name not in defined:
            raise RLFlowError(f"{path}: graph output '{o.name}' is not produced by any node, graph input or "
                              "initializer")


def _weightless(model: onnx.ModelProto, limit: int = 4096) -> onnx.ModelProto:
    """A copy of ``model`` whose initializers above ``limit`` elements are typed graph inputs without data, so the
    checker and shape inference do not serialise hundreds of MB of weights (their sizes are checked on reading)."""
    g = model.graph
    m = onnx.ModelProto()
    m.ir_version = model.ir_version
    m.opset_import.extend(model.opset_import)
    m.functions.extend(model.functions)
    mg = m.graph
    mg.name = g.name
    mg.node.extend(g.node)
    mg.output.extend(g.output)
    mg.value_info.extend(g.value_info)
    large = {t.name for t in g.initializer if int(np.prod(t.dims)) > limit}
    mg.input.extend(i for i in g.input if i.name not in large)
    for t in g.initializer:
        if t.name in large:
            mg.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        else:
            mg.initializer.append(t)
    return m


#: the most elements an initializer may declare (2^40: 4 TiB of float32; a product beyond it is a corrupt shape)
_MAX_ELEMENTS = 1 << 40


def _check_initializer(t: TensorProto, cut_out: bool, path: Any) -> None:
    """An initializer's dims and data agree before anything uses them: no negative dimension, an element count
    that fits in memory arithmetic (no int64 overflow), and as much data as the shape needs (raw bytes, or
    values in the typed field). ``cut_out``: its raw data was cut out by :func:`_split_large_weights`, which
    checked its size already. One-line RLFlowError naming the tensor otherwise."""
    shape = tuple(int(d) for d in t.dims)
    where = f"{path}: initializer '{t.name}'"
    if any(d < 0 for d in shape):
        raise RLFlowError(f"{where} declares a negative dimension, shape {list(shape)}")
    count = math.prod(shape)
    if count > _MAX_ELEMENTS:
        raise RLFlowError(f"{where} declares shape {list(shape)}: {count} elements, more than any tensor can hold "
                          "(a corrupt shape)")
    if cut_out or t.data_location == TensorProto.EXTERNAL:
        return  # external data is checked once loaded (onnxruntime and _to_array read its bytes)
    if t.HasField("raw_data"):
        have, need, unit = len(t.raw_data), count * np.dtype(_DTYPES[t.data_type]).itemsize, "bytes"
    else:
        have, need, unit = len(getattr(t, helper.tensor_dtype_to_field(t.data_type))), count, "values"
    if have != need:
        raise RLFlowError(f"{where} holds {have} {unit} of data, but its shape {list(shape)} needs {need}")


def _to_array(t: TensorProto) -> np.ndarray:
    """A weight as numpy; raw little-endian data is wrapped without a second copy."""
    if t.data_location != TensorProto.EXTERNAL and t.HasField("raw_data") and t.data_type in _DTYPES:
        dtype = np.dtype(_DTYPES[t.data_type])
        shape = tuple(int(d) for d in t.dims)
        raw = t.raw_data
        if len(raw) != int(np.prod(shape)) * dtype.itemsize:
            raise RLFlowError(f"initializer '{t.name}' holds {len(raw)} bytes, its shape {shape} needs "
                              f"{int(np.prod(shape)) * dtype.itemsize}")
        return np.frombuffer(raw, dtype=dtype).reshape(shape)
    return numpy_helper.to_array(t)


def _dtype(elem_type: int, what: str, path: Any) -> str:
    if elem_type not in _DTYPES:
        name = TensorProto.DataType.Name(elem_type) if elem_type in TensorProto.DataType.values() else str(elem_type)
        raise RLFlowError(f"{path}: {what} has unsupported element type {name}")
    return _DTYPES[elem_type]


def _parse_input_shapes(spec: Mapping[str, Any] | list[str] | None) -> dict[str, tuple[int, ...]]:
    """``{"x": (1, 128)}`` or CLI strings ``["x=1x128"]`` -> ``{"x": (1, 128)}``."""
    if not spec:
        return {}
    if isinstance(spec, Mapping):
        return {k: tuple(int(d) for d in v) for k, v in spec.items()}
    out = {}
    for item in spec:
        name, sep, dims = item.partition("=")
        try:
            shape = tuple(int(d) for d in dims.lower().split("x")) if dims else ()
            if not sep or any(d <= 0 for d in shape):
                raise ValueError
        except ValueError:
            raise RLFlowError(f"--input-shape '{item}' must look like name=1x128 (positive dimensions)") from None
        out[name] = shape
    return out


def _make_inputs_static(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]], path: Any) -> None:
    init_names = {t.name for t in model.graph.initializer}
    real_inputs = [i for i in model.graph.input if i.name not in init_names]
    unknown = set(shapes) - {i.name for i in real_inputs}
    if unknown:
        raise RLFlowError(f"{path}: --input-shape names unknown input '{sorted(unknown)[0]}' "
                          f"(inputs: {', '.join(i.name for i in real_inputs)})")
    for inp in real_inputs:
        tt = inp.type.tensor_type
        if not inp.type.HasField("tensor_type"):
            raise RLFlowError(f"{path}: input '{inp.name}' is not a tensor")
        _dtype(tt.elem_type, f"input '{inp.name}'", path)
        if inp.name in shapes:
            want = shapes[inp.name]
            if tt.HasField("shape") and len(tt.shape.dim) != len(want):
                raise RLFlowError(f"{path}: --input-shape {inp.name} has rank {len(want)}, the model says "
                                  f"rank {len(tt.shape.dim)}")
            for d, (dim, w) in enumerate(zip(tt.shape.dim, want)):
                if dim.HasField("dim_value") and dim.dim_value > 0 and dim.dim_value != w:
                    raise RLFlowError(f"{path}: --input-shape {inp.name} dimension {d} is {w}, the model fixes it "
                                      f"to {dim.dim_value}")
            tt.shape.Clear()
            for w in want:
                tt.shape.dim.add().dim_value = w
            continue
        if not tt.HasField("shape"):
            raise RLFlowError(f"{path}: input '{inp.name}' has no shape; pass --input-shape {inp.name}=DxD...")
        for d, dim in enumerate(tt.shape.dim):
            if not dim.HasField("dim_value") or dim.dim_value <= 0:
                fix = f"pass --input-shape {inp.name}=" + "x".join(
                    str(x.dim_value) if x.HasField("dim_value") and x.dim_value > 0 else "N" for x in tt.shape.dim)
                if dim.HasField("dim_value"):
                    raise RLFlowError(f"{path}: input '{inp.name}' dimension {d} is {dim.dim_value}, not a size "
                                      f"rlflow can run (sizes are >= 1); {fix} with N >= 1")
                raise RLFlowError(f"{path}: input '{inp.name}' has dynamic dimension {d} ('{dim.dim_param or '?'}'); "
                                  + fix)


# ======================================================================================== constant folding
def _skeleton_for_inference(model: onnx.ModelProto, consts: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of the model without large weight data (weights become typed inputs), so shape inference is cheap.
    Small constants (<= 4096 elements) stay, so data propagation still sees shape tensors."""
    g = model.graph
    small, large_inputs = [], []
    for name, arr in consts.items():
        if arr.size <= 4096:
            small.append(numpy_helper.from_array(arr, name))
        else:
            large_inputs.append(helper.make_tensor_value_info(name, _ONNX_DTYPE.get(str(arr.dtype), TensorProto.FLOAT),
                                                              list(arr.shape)))
    init_names = {t.name for t in g.initializer}
    inputs = [i for i in g.input if i.name not in init_names and i.name not in consts]
    # ONNX cannot infer the outputs of another domain's ops (onnxruntime's com.microsoft fusions): keep the types
    # the file declares for them, so such a node imports as an opaque node
    custom = {o for n in g.node if n.domain not in ("", "ai.onnx") for o in n.output}
    declared = [vi for vi in g.value_info if vi.name in custom]
    graph = helper.make_graph(list(g.node), g.name or "graph", inputs + large_inputs, list(g.output), small,
                              value_info=declared)
    m = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    for f in model.functions:
        m.functions.append(f)
    return m


def _infer(model: onnx.ModelProto, consts: dict[str, np.ndarray], path: Any) -> dict[str, onnx.TypeProto]:
    skel = _skeleton_for_inference(model, consts)
    try:
        inferred = onnx.shape_inference.infer_shapes(skel, check_type=True, strict_mode=True, data_prop=True)
    except Exception as e:
        raise RLFlowError(f"{path}: ONNX shape inference failed: {_first_line(e)}") from None
    g = inferred.graph
    return {vi.name: vi.type for vi in list(g.value_info) + list(g.input) + list(g.output)}


def _static_shape(tp: onnx.TypeProto | None) -> tuple[int, ...] | None:
    if tp is None or not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return None
    dims = []
    for d in tp.tensor_type.shape.dim:
        if not d.HasField("dim_value") or d.dim_value < 0:
            return None
        dims.append(d.dim_value)
    return tuple(dims)


def _eval_node(node: onnx.NodeProto, values: list[np.ndarray | None], opset: list) -> list[np.ndarray]:
    """Evaluate one node on constant inputs with ONNX's reference evaluator (used only for constant folding)."""
    from onnx.reference import ReferenceEvaluator

    names = [f"i{k}" if v is not None else "" for k, v in enumerate(values)]
    n = helper.make_node(node.op_type, names, [f"o{k}" for k in range(len(node.output))], domain=node.domain)
    n.attribute.extend(node.attribute)
    feeds = {nm: v for nm, v in zip(names, values) if nm}
    inputs = [helper.make_tensor_value_info(k, _ONNX_DTYPE.get(str(v.dtype), TensorProto.FLOAT), list(v.shape))
              for k, v in feeds.items()]
    outputs = [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in n.output]
    model = helper.make_model(helper.make_graph([n], "fold", inputs, outputs), opset_imports=opset)
    return [np.asarray(o) for o in ReferenceEvaluator(model, verbose=0).run(None, feeds)]


def _fold_constants(model: onnx.ModelProto, path: Any, weights: dict[str, np.ndarray]
                    ) -> tuple[dict[str, np.ndarray], dict[str, onnx.TypeProto]]:
    """Fold every node whose inputs are all constant (and every Shape/Size of a static tensor) into a constant,
    repeating shape inference until nothing changes. Returns the constants and the final inferred types.
    Folded nodes are removed from ``model``."""
    g = model.graph
    consts: dict[str, np.ndarray] = {}
    for t in g.initializer:
        _dtype(t.data_type, f"initializer '{t.name}'", path)
        if t.name in weights:
            consts[t.name] = weights[t.name]
            continue
        try:
            consts[t.name] = _to_array(t)
        except RLFlowError as e:
            raise RLFlowError(f"{path}: {e}") from None
    opset = list(model.opset_import)
    types: dict[str, onnx.TypeProto] = {}
    for _round in range(8):
        types = _infer(model, consts, path)
        keep, changed = [], False
        for node in g.node:
            folded = _try_fold(node, consts, types, opset)
            if folded is None:
                keep.append(node)
                continue
            for name, arr in zip(node.output, folded):
                if name:
                    consts[name] = arr
            changed = True
        if not changed:
            break
        del g.node[:]
        g.node.extend(keep)
    return consts, types


def _try_fold(node, consts, types, opset) -> list[np.ndarray] | None:
    op = node.op_type
    if node.domain not in ("", "ai.onnx") or op in _NO_FOLD:
        return None
    if op == "Constant":
        return [numpy_helper.to_array(helper.get_attribute_value(node.attribute[0]))
                if node.attribute[0].name == "value" else _eval_node(node, [], opset)[0]]
    if op in ("Shape", "Size"):
        shape = _static_shape(types.get(node.input[0]))
        if shape is None:
            return None
        if op == "Size":
            return [np.array(int(np.prod(shape)), dtype=np.int64)]
        a = {at.name: helper.get_attribute_value(at) for at in node.attribute}
        start, end = a.get("start", 0), a.get("end", len(shape))
        return [np.array(shape[slice(start, end)], dtype=np.int64)]
    ins = [consts.get(v) if v else None for v in node.input]
    if any(v and consts.get(v) is None for v in node.input):
        return None
    out_shapes = [_static_shape(types.get(o)) for o in node.output]
    if any(s is not None and int(np.prod(s)) > _FOLD_LIMIT for s in out_shapes):
        return None
    try:
        outs = _eval_node(node, ins, opset)
    except Exception:
        return None  # leave it in the graph; it is translated (or kept opaque) like any other node
    # the reference evaluator may widen types (e.g. float64 from Python scalars): keep ONNX's inferred dtype
    for k, name in enumerate(node.output[:len(outs)]):
        tp = types.get(name)
        if tp is not None and tp.tensor_type.elem_type in _DTYPES:
            outs[k] = outs[k].astype(_DTYPES[tp.tensor_type.elem_type], copy=False)
    return outs


# ======================================================================================== ONNX node -> IR node
def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out


def _translate(node: onnx.NodeProto, in_types: list[TensorType | None], out_types: list[TensorType], consts,
               opset: int) -> tuple[str, tuple[str, ...], dict[str, Any]]:
    """(IR op, IR inputs, normalised attrs) for an ONNX node, from the ``from_onnx`` of the op that imports its
    type (see :mod:`rlflow.graph.ops`), or raise Unsupported."""
    op = ONNX_IMPORTS.get(node.op_type)
    if node.domain not in ("", "ai.onnx") or op is None:
        raise Unsupported
    ins = tuple(node.input)
    while ins and not ins[-1]:
        ins = ins[:-1]
    return op.from_onnx(OnnxNode(node.op_type, _attrs(node), ins, len(node.output), in_types, out_types, consts,
                                 opset))


def _onnx_to_ir(model: onnx.ModelProto, consts: dict[str, np.ndarray], types: dict[str, onnx.TypeProto],
                path: Any) -> Graph:
    g = model.graph
    opset, extra = _opset_of(model, path)
    ir_types: dict[str, TensorType] = {}
    constants = {name: Constant(arr) for name, arr in consts.items()}
    for name, c in constants.items():
        ir_types[name] = c.type

    inputs = []
    for inp in g.input:
        if inp.name in consts:
            continue
        tt = inp.type.tensor_type
        ir_types[inp.name] = TensorType(tuple(d.dim_value for d in tt.shape.dim),
                                        _dtype(tt.elem_type, f"input '{inp.name}'", path))
        inputs.append(inp.name)

    def onnx_type(v: str, node: onnx.NodeProto) -> TensorType:
        tp = types.get(v)
        shape = _static_shape(tp)
        if shape is None:
            raise RLFlowError(f"{path}: node '{node.name or '(unnamed)'}' ({node.op_type}): the shape of output '{v}' "
                              f"cannot be inferred statically")
        return TensorType(shape, _dtype(tp.tensor_type.elem_type, f"value '{v}'", path))

    nodes: list[Node] = []
    used_names: set[str] = set()
    for k, node in enumerate(g.node):
        name = node.name or f"{node.op_type}_{k}"
        while name in used_names:
            name = f"{name}_{k}"
        used_names.add(name)
        in_types = [ir_types.get(v) if v else None for v in node.input]
        for v, t in zip(node.input, in_types):
            if v and t is None:
                raise RLFlowError(f"{path}: node '{name}' ({node.op_type}) reads '{v}', which nothing defines")
        want = [onnx_type(v, node) for v in node.output if v]
        try:
            ir_op, ir_ins, attrs = _translate(node, in_types, want, consts, opset)
        except (Unsupported, KeyError, TypeError, ValueError, IndexError):
            ir_op, ir_ins, attrs = _opaque(node)
        else:
            try:  # the op's shape inference rejects inconsistent shapes ONNX's checks let through
                got = infer_types(Node(name, ir_op, ir_ins, tuple(node.output), attrs), [ir_types[v] for v in ir_ins])
            except ShapeError as e:
                raise RLFlowError(f"{path}: {e}") from None
            if got != want or "" in node.output:
                ir_op, ir_ins, attrs = _opaque(node)  # e.g. ONNX semantics our op does not model for these attributes
        for v, t in zip([o for o in node.output if o], want):
            ir_types[v] = t
        nodes.append(Node(name, ir_op, tuple(ir_ins), tuple(o for o in node.output if o), attrs))

    outputs = [o.name for o in g.output]
    for o in outputs:
        if o not in ir_types:
            raise RLFlowError(f"{path}: graph output '{o}' is not produced by any node")
    graph = Graph(inputs=inputs, outputs=outputs, nodes=nodes, types=ir_types, constants=constants,
                  name=g.name or "graph", opset=opset, extra_opsets=extra)
    return drop_unused_constants(graph)


def single_node_model(graph: Graph, node: Node) -> onnx.ModelProto:
    """An ONNX model computing just ``node`` of ``graph`` (the executors run opaque nodes this way)."""
    e = _Emitter(graph)
    _emit(e, node)

    def vi(v: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(v, _ONNX_DTYPE[graph.types[v].dtype], list(graph.types[v].shape))

    g = helper.make_graph(e.nodes, node.name, [vi(v) for v in node.inputs if v], [vi(v) for v in node.outputs],
                          e.inits)
    imports = [helper.make_opsetid("", graph.opset)] + [helper.make_opsetid(d, v)
                                                        for d, v in sorted(graph.extra_opsets.items())]
    return helper.make_model(g, opset_imports=imports, ir_version=ir_version(graph.opset))


def _opaque(node: onnx.NodeProto) -> tuple[str, tuple[str, ...], dict[str, Any]]:
    attrs = {"op_type": node.op_type, "domain": node.domain,
             "attributes": tuple(a.SerializeToString() for a in node.attribute)}
    if "" in node.output:  # an optional output left out before a used one: the used ones' positions
        attrs["output_slots"] = tuple(k for k, v in enumerate(node.output) if v)
    return "Opaque", tuple(node.input), attrs


def load_onnx(path: str | os.PathLike | bytes, input_shapes: Mapping[str, Any] | list[str] | None = None) -> Graph:
    """Import an ONNX file (or the bytes of one) as a static IR graph (see the module docstring). Errors are
    one-line RLFlowErrors."""
    model, weights = _read_model(path)
    if isinstance(path, (bytes, bytearray)):
        path = IN_MEMORY
    _opset_of(model, path)
    _sort_or_cycle(model, path)
    for i in model.graph.input:
        _dtype(i.type.tensor_type.elem_type, f"input '{i.name}'", path)
    for t in model.graph.initializer:
        _dtype(t.data_type, f"initializer '{t.name}'", path)
        _check_initializer(t, t.name in weights, path)
    for o in model.graph.output:
        _dtype(o.type.tensor_type.elem_type, f"output '{o.name}'", path)
    try:
        onnx.checker.check_model(_weightless(model))
    except Exception as e:
        raise RLFlowError(f"{path}: invalid ONNX model: {_first_line(e)}") from None
    _make_inputs_static(model, _parse_input_shapes(input_shapes), path)
    consts, types = _fold_constants(model, path, weights)
    graph = _onnx_to_ir(model, consts, types, path)
    if graph.opset >= ATTENTION_OPSET:  # where ONNX has Attention: masks in the form its rules match
        graph = canonical_attention(graph)
    graph.validate()
    return graph


# ======================================================================================== IR -> ONNX
class _Emitter:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []
        # the names the exported graph holds: a fresh name never takes one. Not ``graph.types``: it also keeps the
        # types of values that are gone (an imported shape initializer folded into its Reshape), and avoiding those
        # renamed an IR round trip's helper initializers (``node_view_shape`` -> ``node_view_shape_1``)
        self.used = {*graph.inputs, *graph.constants, *(v for n in graph.nodes for v in n.outputs)}

    def fresh(self, base: str) -> str:
        name, k = base, 0
        while name in self.used:
            k += 1
            name = f"{base}_{k}"
        self.used.add(name)
        return name

    def const(self, base: str, value: Any, dtype=np.int64) -> str:
        name = self.fresh(base)
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def node(self, op: str, ins, outs, name: str, **attrs) -> None:
        """Append an ONNX node (renamed if its name is taken). A list attribute may be empty (a 0-D Transpose's
        perm), which ONNX's helper cannot type by itself: it is INTS."""
        node = helper.make_node(op, list(ins), list(outs), name=self.fresh(name) if name in self.used else name)
        for k, v in sorted(attrs.items()):
            empty = isinstance(v, (list, tuple)) and not v
            node.attribute.append(helper.make_attribute(k, v, attr_type=onnx.AttributeProto.INTS if empty else None))
        self.nodes.append(node)


def _emit(e: _Emitter, n: Node) -> None:
    """Append ``n`` as ONNX nodes: an opaque node as it was imported, an IR op through its OpDef's ``to_onnx``."""
    if n.op == "Opaque":
        a = n.attrs
        outs = list(n.outputs)
        if "output_slots" in a:  # the ONNX node's outputs, the unused optional ones as ''
            outs = [""] * (max(a["output_slots"]) + 1)
            for k, v in zip(a["output_slots"], n.outputs):
                outs[k] = v
        node = helper.make_node(a["op_type"], list(n.inputs), outs, name=n.name, domain=a["domain"] or None)
        for blob in a["attributes"]:
            at = onnx.AttributeProto()
            at.ParseFromString(blob)
            node.attribute.append(at)
        e.nodes.append(node)
    elif n.op in OPS:
        OPS[n.op].to_onnx(e, n)
    else:
        raise RLFlowError(f"node '{n.name}': cannot export op '{n.op}'")


def to_onnx(graph: Graph, weights: bool = True) -> onnx.ModelProto:
    """Build an ONNX model of ``graph`` at the graph's opset. With ``weights=False`` the graph's constants are
    left out (``save_onnx`` streams them to the file itself)."""
    e = _Emitter(graph)
    for n in graph.nodes:
        _emit(e, n)

    def vi(v: str) -> onnx.ValueInfoProto:
        t = graph.types[v]
        return helper.make_tensor_value_info(v, _ONNX_DTYPE[t.dtype], list(t.shape))

    model = onnx.ModelProto()
    model.ir_version = ir_version(graph.opset)
    model.producer_name = "rlflow"
    model.opset_import.append(helper.make_opsetid("", graph.opset))
    model.opset_import.extend(helper.make_opsetid(d, v) for d, v in sorted(graph.extra_opsets.items()))
    g = model.graph
    g.name = graph.name
    g.node.extend(e.nodes)
    g.input.extend(vi(v) for v in graph.inputs)
    g.output.extend(vi(v) for v in graph.outputs)
    g.initializer.extend(e.inits)
    # the types of another domain's ops' outputs, which ONNX shape inference cannot derive (see the importer)
    g.value_info.extend(vi(v) for n in graph.nodes if n.op == "Opaque" and n.attrs.get("domain") not in ("", "ai.onnx")
                        for v in n.outputs if v not in graph.outputs)
    for name, c in (graph.constants.items() if weights else ()):
        t = g.initializer.add()
        t.name = name
        t.data_type = _ONNX_DTYPE[str(c.array.dtype)]
        t.dims.extend(c.array.shape)
        t.raw_data = c.array.tobytes()
    return model




def set_io_shapes(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int | str | None] | None]) -> None:
    """Write ``shapes`` on the model's inputs and outputs they name: each dimension a size, a symbol (a dynamic
    dimension) or None (unknown); None for the whole shape: rank unknown. The static shapes of intermediate values
    are dropped (they need not hold at other sizes); their element types stay."""
    for vi in [*model.graph.input, *model.graph.output]:
        if vi.name not in shapes:
            continue
        tt = vi.type.tensor_type
        tt.ClearField("shape")
        if shapes[vi.name] is None:
            continue
        tt.shape.SetInParent()  # a rank-0 shape is an empty shape, not a missing one
        for d in shapes[vi.name]:
            dim = tt.shape.dim.add()
            if isinstance(d, str):
                dim.dim_param = d
            elif d is not None:
                dim.dim_value = d
    for vi in model.graph.value_info:
        vi.type.tensor_type.ClearField("shape")


def save_onnx(graph: Graph, path: str | os.PathLike, check: bool = True) -> None:
    """Write ``graph`` as one standard ONNX file (weights embedded), atomically. ``check`` runs the full ONNX
    checker (with shape inference) on the model's structure; the weights' sizes are right by construction.

    The weights are streamed from their numpy buffers into the file (protobuf allows a message's fields in any
    order, and repeated fields to arrive in pieces): no 400 MB intermediate copies for BERT-sized models."""
    model = to_onnx(graph, weights=False)
    if check:
        try:
            onnx.checker.check_model(_weightless(_with_weight_types(model, graph)), full_check=True)
        except Exception as e:
            raise RLFlowError(f"exported model for graph '{graph.name}' fails the ONNX checker: {_first_line(e)}"
                              ) from None
    pieces: list[bytes | memoryview] = []
    for name, c in graph.constants.items():
        header = TensorProto(name=name, data_type=_ONNX_DTYPE[str(c.array.dtype)], dims=c.array.shape)
        head = header.SerializeToString()
        raw = memoryview(np.ascontiguousarray(c.array).reshape(-1).view(np.uint8))
        inner = head + _len_field(_TENSOR_RAW_DATA, raw.nbytes)
        pieces += [_len_field(_GRAPH_INITIALIZER, len(inner) + raw.nbytes) + inner, raw]
    graph_head = model.graph.SerializeToString()
    graph_len = len(graph_head) + sum(len(p) if isinstance(p, bytes) else p.nbytes for p in pieces)
    model.ClearField("graph")
    model_head = model.SerializeToString() + _len_field(_MODEL_GRAPH, graph_len) + graph_head
    if len(model_head) + graph_len > _PROTOBUF_LIMIT:
        raise RLFlowError(f"graph '{graph.name}' is over 2 GiB, the limit of a single-file ONNX model")
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(model_head)
        for p in pieces:
            f.write(p)


def _with_weight_types(model: onnx.ModelProto, graph: Graph) -> onnx.ModelProto:
    """``model`` (built without weights) plus the weights as typed inputs, for checking."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.graph.input.extend(helper.make_tensor_value_info(k, _ONNX_DTYPE[str(c.array.dtype)], list(c.array.shape))
                         for k, c in graph.constants.items())
    return m
