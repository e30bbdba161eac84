"""The graph IR: typed operators over named tensor values with static shapes.

A :class:`Graph` holds
- ``inputs``: the graph input value names, in order;
- ``outputs``: the graph output value names, in order;
- ``constants``: weights and other constant tensors (value name -> :class:`Constant`);
- ``nodes``: operators in a deterministic topological order;
- ``types``: the :class:`TensorType` of every value (inputs, constants and node outputs).

Nodes, types and constants are immutable, so :meth:`Graph.copy` is a cheap shallow copy: a rewrite builds a new
graph that shares every untouched node and weight with the old one.
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

from rlflow.errors import RLFlowError
from rlflow.graph.ops import COMMUTATIVE, OPS, infer_types
from rlflow.graph.types import TensorType


class Constant:
    """A constant tensor (weight). The array is treated as read-only; its content digest is computed once."""

    __slots__ = ("array", "_digest")

    def __init__(self, array: np.ndarray):
        arr = np.asarray(array)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)  # (never for 0-d arrays, which ascontiguousarray would make 1-d)
        self.array = arr.view()  # a read-only view: the caller's own array stays writeable
        self.array.flags.writeable = False
        self._digest: bytes | None = None

    @property
    def type(self) -> TensorType:
        return TensorType(tuple(int(d) for d in self.array.shape), str(self.array.dtype))

    @property
    def digest(self) -> bytes:
        if self._digest is None:
            h = hashlib.blake2b(digest_size=16)
            h.update(str(self.array.dtype).encode())
            h.update(repr(self.array.shape).encode())
            h.update(self.array.tobytes())
            self._digest = h.digest()
        return self._digest


def _canonical(v: Any) -> Any:
    if isinstance(v, float):
        return float(np.float32(v))
    if isinstance(v, (tuple, list)):
        return tuple(_canonical(x) for x in v)
    return v


@dataclass(frozen=True, slots=True)
class Node:
    """One operator application. ``attrs`` holds normalised, hashable attribute values (never mutated)."""

    name: str
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: Mapping[str, Any] = field(default_factory=dict)

    def op_type_name(self) -> str:
        """The ONNX op type (an opaque node reports the type it was imported with)."""
        return self.attrs["op_type"] if self.op == "Opaque" else self.op

    def attr_key(self) -> str:
        """A canonical text form of the attributes (for hashing and signatures). Floats are compared at float32
        precision, the precision of ONNX float attributes, so an export/import round trip keeps the key."""
        return repr(sorted((k, _canonical(v)) for k, v in self.attrs.items()))


class Graph:
    """A computation graph. Build one with :class:`rlflow.graph.builder.GraphBuilder` or ``load_onnx``."""

    __slots__ = ("name", "opset", "extra_opsets", "next_id", "inputs", "outputs", "nodes", "types", "constants", "_producer", "_consumers")

    def __init__(
        self,
        *,
        inputs: Iterable[str],
        outputs: Iterable[str],
        nodes: Iterable[Node],
        types: Mapping[str, TensorType],
        constants: Mapping[str, Constant] | None = None,
        name: str = "graph",
        opset: int = 18,
        extra_opsets: Mapping[str, int] | None = None,
    ):
        self.name = name
        self.opset = opset
        self.extra_opsets = dict(extra_opsets or {})  # opset versions of non-default domains (opaque nodes)
        self.next_id = 0  # counter for the names of nodes and values that rewrites create
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.nodes = list(nodes)
        self.types = dict(types)
        self.constants = dict(constants or {})
        self._producer: dict[str, int] | None = None
        self._consumers: dict[str, list[int]] | None = None

    # ------------------------------------------------------------------ basic views
    def copy(self) -> "Graph":
        """Shallow copy: new containers, shared (immutable) nodes, types and weights."""
        g = Graph(inputs=self.inputs, outputs=self.outputs, nodes=self.nodes, types=self.types,
                  constants=self.constants, name=self.name, opset=self.opset, extra_opsets=self.extra_opsets)
        g.next_id = self.next_id
        return g

    def __len__(self) -> int:
        return len(self.nodes)

    def __repr__(self) -> str:
        return f"Graph({self.name!r}, {len(self.nodes)} nodes, {len(self.constants)} constants, opset {self.opset})"

    def producer(self) -> dict[str, int]:
        """value name -> index of the node that produces it (inputs and constants are absent)."""
        if self._producer is None:
            self._producer = {v: i for i, n in enumerate(self.nodes) for v in n.outputs}
        return self._producer

    def consumers(self) -> dict[str, list[int]]:
        """value name -> indices of the nodes that read it, in node order."""
        if self._consumers is None:
            cons: dict[str, list[int]] = {}
            for i, n in enumerate(self.nodes):
                for v in n.inputs:
                    if v:
                        cons.setdefault(v, []).append(i)
            self._consumers = cons
        return self._consumers

    def op_counts(self) -> dict[str, int]:
        """Operator counts keyed by ONNX op type (opaque nodes by their own type; constants are not ops)."""
        counts: dict[str, int] = {}
        for n in self.nodes:
            key = OPS[n.op].onnx_type if n.op in OPS else n.op_type_name()
            counts[key] = counts.get(key, 0) + 1
        return dict(sorted(counts.items()))

    def opaque_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.op == "Opaque"]

    def num_params(self) -> int:
        return sum(int(c.array.size) for c in self.constants.values())

    # ------------------------------------------------------------------ order, hashing, validation
    def toposorted(self) -> "Graph":
        """The same graph with nodes in the canonical topological order: Kahn's algorithm, ties broken by the
        current node order, so the result is deterministic. A cycle is a one-line error naming a node on it."""
        producer = self.producer()
        indeg = [0] * len(self.nodes)
        users: list[list[int]] = [[] for _ in self.nodes]
        for i, n in enumerate(self.nodes):
            for v in n.inputs:
                j = producer.get(v)
                if j is not None:
                    indeg[i] += 1
                    users[j].append(i)
        ready = [i for i, d in enumerate(indeg) if d == 0]
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            i = heapq.heappop(ready)
            order.append(i)
            for k in users[i]:
                indeg[k] -= 1
                if indeg[k] == 0:
                    heapq.heappush(ready, k)
        if len(order) != len(self.nodes):
            stuck = [self.nodes[i] for i, d in enumerate(indeg) if d > 0]
            names = ", ".join(f"'{n.name}' ({n.op_type_name()})" for n in stuck[:3])
            raise RLFlowError(f"graph '{self.name}' has a cycle through node {names}")
        if order == list(range(len(self.nodes))):
            return self
        g = self.copy()
        g.nodes = [self.nodes[i] for i in order]
        return g

    def structural_hash(self, operand_order: bool = True) -> str:
        """A canonical hash of the computation: equal graphs hash equal whatever their node and value names.

        Inputs are identified by position and type, constants by content, nodes by op, attributes and the hashes
        of their inputs; the graph hash covers the output hashes in order. ``operand_order`` False: up to the
        operand order of commutative ops (their input hashes sorted)."""
        vh: dict[str, bytes] = {"": b"none"}
        for k, name in enumerate(self.inputs):
            vh[name] = hashlib.blake2b(f"in{k}:{self.types[name]}".encode(), digest_size=16).digest()
        for name, c in self.constants.items():
            vh[name] = c.digest
        for n in self.nodes:
            h = hashlib.blake2b(digest_size=16)
            h.update(n.op.encode())
            h.update(n.attr_key().encode())
            ins = [vh[v] for v in n.inputs]
            for d in (ins if operand_order or n.op not in COMMUTATIVE else sorted(ins)):
                h.update(d)
            base = h.digest()
            for k, out in enumerate(n.outputs):
                vh[out] = hashlib.blake2b(base + bytes([k]), digest_size=16).digest()
        h = hashlib.blake2b(digest_size=16)
        for v in self.outputs:
            h.update(vh[v])
        return h.hexdigest()

    def validate(self) -> None:
        """Raise RLFlowError unless: value names are unique, every node input is defined before use (which also
        rules out cycles), every output is defined, and every node's recorded output types equal its op's shape
        inference."""
        defined: set[str] = set()
        for v in list(self.inputs) + list(self.constants):
            if v in defined:
                raise RLFlowError(f"graph '{self.name}': value '{v}' is defined twice")
            if v not in self.types:
                raise RLFlowError(f"graph '{self.name}': value '{v}' has no type")
            defined.add(v)
        for n in self.nodes:
            for v in n.inputs:
                if v and v not in defined:
                    raise RLFlowError(f"node '{n.name}' ({n.op_type_name()}): input '{v}' is not defined before use")
            for v in n.outputs:
                if v in defined:
                    raise RLFlowError(f"node '{n.name}' ({n.op_type_name()}): output '{v}' is defined twice")
                defined.add(v)
            if n.op != "Opaque":
                got = infer_types(n, [self.types[v] for v in n.inputs if v])
                want = [self.types.get(v) for v in n.outputs]
                if got != want:
                    raise RLFlowError(f"node '{n.name}' ({n.op}): recorded output types {[str(t) for t in want]} "
                                      f"differ from inferred {[str(t) for t in got]}")
        for v in self.outputs:
            if v not in defined:
                raise RLFlowError(f"graph '{self.name}': output '{v}' is not defined")

