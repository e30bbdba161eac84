"""The graph floor: IR, operator registry, ONNX import/export, model zoo and executors.

Nothing here imports from the floors above (rewrite, cost, search, env, nn, agents, stages, pipeline).
"""

from rlflow.graph.builder import GraphBuilder
from rlflow.graph.ir import Constant, Graph, Node, TensorType
from rlflow.graph.onnx_io import load_onnx, save_onnx, to_onnx
from rlflow.graph.ops import OPS

__all__ = ["Constant", "Graph", "GraphBuilder", "Node", "OPS", "TensorType", "load_onnx", "save_onnx", "to_onnx"]
