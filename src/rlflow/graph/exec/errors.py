"""A backend's failure on one node, as one line (used by every runner and by rlflow.graph.exec)."""

from __future__ import annotations

import re

from rlflow.errors import RLFlowError
from rlflow.graph.ir import Node


class NodeRunError(RLFlowError):
    """A backend failed on one node of a graph: one line naming the node, its op and the backend's message."""

    def __init__(self, node: Node | None, backend: str, message: str):
        self.node, self.backend = node, backend
        where = f" on node '{node.name}' ({node.op_type_name()})" if node is not None else ""
        super().__init__(f"{_BACKEND_LABEL.get(backend, backend)} failed{where}: {message}")


_BACKEND_LABEL = {"ort": "onnxruntime", "torch": "torch", "tf": "TensorFlow", "tf-xla": "TensorFlow (XLA)",
                  "jax": "JAX (XLA)"}
#: where onnxruntime's messages name the failing node (running; creating the session). TensorFlow's name its
#: own ops (MatMul_1), which may clash with the graph's node names: its failures are located with the torch
#: interpreter instead (run_error).
_NODE_PATTERNS = (r"Name:'([^']+)'", r"node with name '([^']+)'", r"in node \(([^)]+)\)", r"Node \(([^)]+)\)",
                  r"node name: ([^\s,)]+)")


def error_message(e: BaseException) -> str:
    """A backend's error as one line, without its wrapping (onnxruntime's status prefix, TensorFlow's trace)."""
    text = str(e).strip()
    m = re.search(r"Status Message: (.*)", text)
    if m:
        msg = m.group(1).strip()
    else:
        text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
        lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith(("File ", "[["))
                 and "defined at" not in ln and ln.strip() != "Graph execution error:"]
        msg = (lines[-1] if "{{node" in text else lines[0]) if lines else ""
    msg = msg or type(e).__name__
    return f"out of memory ({msg})" if isinstance(e, MemoryError) else msg
