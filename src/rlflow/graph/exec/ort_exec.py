"""onnxruntime backend: the graph exported to ONNX, run by an InferenceSession."""

from __future__ import annotations

import numpy as np

from rlflow.graph.ir import Graph


class OrtRunner:
    def __init__(self, graph: Graph, device: str = "cpu", threads: int = 0):
        import onnxruntime as ort

        from rlflow.graph.onnx_io import to_onnx

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if threads:
            opts.intra_op_num_threads = threads
        providers = ["CPUExecutionProvider"]
        if device == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        self.session = ort.InferenceSession(to_onnx(graph).SerializeToString(), opts, providers=providers)
        self.outputs = list(graph.outputs)

    def __call__(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.session.run(self.outputs, feeds)

    def peak_memory_bytes(self) -> int | None:
        return None  # onnxruntime does not report its arena's peak through the Python API
