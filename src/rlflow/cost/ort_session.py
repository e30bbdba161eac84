"""onnxruntime sessions as the evaluation makes them (CPU provider, no spinning threads, ``ORT_LEVEL``), and
profiled runs of one: what the ``ort-cpu`` target and the device calibration both time with."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

#: onnxruntime's optimisation level in the evaluation (the InferenceSession default)
ORT_LEVEL = "ORT_ENABLE_ALL"


def session(model_bytes: bytes, threads: int, optimized_path: str | None = None, profile_prefix: str | None = None):
    import onnxruntime as ort

    from rlflow.graph.exec.ort_exec import quiet_options

    opts = quiet_options()
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as the evaluation's OrtRunner
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, ORT_LEVEL)
    if threads:
        opts.intra_op_num_threads = threads
    if optimized_path:
        opts.optimized_model_filepath = optimized_path
    if profile_prefix:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile_prefix
    return ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])


def profiled_runs(model: bytes, feeds: dict, warmup: int, repeats: int, threads: int, optimized: bool = False
                  ) -> tuple[list[dict], list[float], object]:
    """One fresh onnxruntime session of ``model`` run ``warmup + repeats`` times under its profiler: (the
    kernel-time events of its nodes, the start times of its runs in order, and with ``optimized`` the session's
    own optimised model (onnx ModelProto), else None)."""
    import onnx

    with tempfile.TemporaryDirectory() as tmp:
        opt = str(Path(tmp) / "opt.onnx") if optimized else None
        s = session(model, threads, optimized_path=opt, profile_prefix=str(Path(tmp) / "p"))
        for _ in range(warmup + repeats):
            s.run(None, feeds)
        events = json.loads(Path(s.end_profiling()).read_text())
        opt_model = onnx.load(opt, load_external_data=False) if opt else None
    starts = sorted(e["ts"] for e in events if e.get("name") == "model_run")
    return ([e for e in events if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time")],
            starts, opt_model)
