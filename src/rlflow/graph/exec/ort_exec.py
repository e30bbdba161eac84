"""onnxruntime backend: the graph exported to ONNX, run by an InferenceSession."""

from __future__ import annotations

import numpy as np

from rlflow.errors import RLFlowError
from rlflow.graph.ir import Graph


def quiet_options():
    """Session options without onnxruntime's own log lines on stderr: its errors come back as exceptions, which
    the commands report in one line naming the node (rlflow.graph.exec.backend_errors)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    return opts


class OrtRunner:
    def __init__(self, graph: Graph, device: str = "cpu", threads: int = 0, model_path: str | None = None):
        """A session of ``graph``; ``model_path``: ``graph`` already saved as an ONNX file (what
        :class:`rlflow.graph.exec.FreshRunners` passes), else it is exported here."""
        import onnxruntime as ort

        from rlflow.graph.onnx_io import ORT_MAX_OPSET, to_onnx

        if graph.opset > ORT_MAX_OPSET:
            raise RLFlowError(f"graph '{graph.name}' is opset {graph.opset}: onnxruntime {ort.__version__} runs "
                              f"opsets up to {ORT_MAX_OPSET} (run it on torch, jax or tf)")
        opts = quiet_options()
        # No busy-waiting of the intra-op threads after a run. With it (onnxruntime's default), a run that follows
        # another session's run competes with that session's spinning threads: on 2 cores, BERT took 174 ms after
        # another session and 140 ms after itself; without it, 129 ms either way. The evaluate stage alternates
        # sessions, so spinning would bias every comparison.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if threads:
            opts.intra_op_num_threads = threads
        has_cuda = "CUDAExecutionProvider" in ort.get_available_providers()
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" and has_cuda \
            else ["CPUExecutionProvider"]
        model = model_path if model_path is not None else to_onnx(graph).SerializeToString()
        self.session = ort.InferenceSession(model, opts, providers=providers)
        self.outputs = list(graph.outputs)
        self.providers = self.session.get_providers()
        """The providers the session actually has, first the one it runs on."""
        self.ran_on = "cuda" if self.providers[0] == "CUDAExecutionProvider" else "cpu"
        """Where the session runs: ``cuda`` | ``cpu``."""
        self.device_note = "" if self.ran_on == device else (
            f"no CUDA provider in this onnxruntime ({ort.__version__}; onnxruntime-gpu has it)" if not has_cuda
            else "onnxruntime could not start its CUDA provider")
        """Why the session runs elsewhere than ``device`` asked; empty when it runs there."""

    def __call__(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.session.run(self.outputs, feeds)

    def peak_memory_bytes(self) -> int | None:
        return None  # onnxruntime does not report its arena's peak through the Python API
