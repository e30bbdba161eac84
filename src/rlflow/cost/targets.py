"""Cost targets: which runtime the searches and agents optimise (config ``cost.target``, ``--target``).

=============  =================================================================================================
``ort-cpu``    onnxruntime on this CPU: its fusions learned, its kernels timed (:mod:`rlflow.cost.ort_cpu`)
``torch-eager``each op a torch eager call on the CPU, timed and cached (the old ``cost.model: measured``)
``cuda``       each op timed on the GPU with CUDA events, 8 warm-up and 32 timed runs (TASO's cost function)
``sim-v100``   a simulated GPU from its spec sheet (:mod:`rlflow.cost.simgpu`); also ``sim-a100``, ``sim-h100``
``sim-h200``   a GPU calibrated from its own whole-model runs (:mod:`rlflow.cost.gpu_calibrated`)
``analytic``   the roofline per op of the device's calibration (else the config's ``cost.peak``)
``auto``       the pipeline's default: on a GPU box its calibrated target (else ``cuda``), else ``sim-h100``
``machine``    the runtime of the machine: ``cuda`` on a GPU box, else ``ort-cpu`` (``rlflow optimize``)
=============  =================================================================================================
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from rlflow.cost.model import AnalyticCost, CostModel, MeasuredCost, read_cache
from rlflow.cost.platform import (CALIBRATED, CHOICES, OLD_MODELS, TARGETS, check_cache, has_gpu,  # noqa: F401
                                  resolve_platform, resolve_target)
from rlflow.errors import RLFlowError

#: targets that time something on this machine (measure_costs fills their table)
MEASURED = ("ort-cpu", "torch-eager", "cuda")


def gpu_spec(config: Mapping, gpu: str) -> dict:
    from rlflow.config import get

    specs = (config.get("cost") or {}).get("gpus") or get({}, "cost.gpus")
    if gpu not in specs:
        raise RLFlowError(f"config key cost.gpus.{gpu}: no spec figures for the simulated {gpu.upper()}")
    return dict(specs[gpu])


def make_cost_model(config: Mapping, device: str, costs_path: str | Path | None = None,
                    kind: str | None = None) -> CostModel:
    """The cost model of the target ``kind`` (else the config's ``cost.target``) on ``device`` (cpu|cuda);
    ``costs_path`` is the cost cache of `rlflow measure-costs` (tables and calibration), if any: one made for
    another platform (:mod:`rlflow.cost.platform`: a CPU box's cache on a GPU box), or before caches recorded
    theirs, is refused in one line."""
    from rlflow.cost import calibration as cal

    target = resolve_target(config, kind)
    if costs_path is not None:
        check_cache(costs_path, resolve_platform(config, target))
    cost = dict(config.get("cost") or {})
    warmup, repeats = cost.get("warmup", 8), cost.get("repeats", 32)
    if target in CALIBRATED:
        from rlflow.cost.gpu_calibrated import calibrated_cost

        return calibrated_cost(target[4:])
    if target.startswith("sim-"):
        from rlflow.cost.simgpu import SimGpuCost

        return SimGpuCost(target[4:], gpu_spec(config, target[4:]))
    if target == "cuda":
        if not has_gpu():
            raise RLFlowError("cost target 'cuda' needs a CUDA GPU and torch sees none (sim-h100 simulates one)")
        device = "cuda"
    elif device == "cuda" and target in ("ort-cpu", "torch-eager"):
        device = "cpu"  # CPU targets time on the CPU whatever the torch device
    peak = (cost.get("peak") or {}).get(device)
    data = read_cache(costs_path, device) if costs_path is not None else None
    cals = cal.read(costs_path) if data is not None else {}
    if target == "analytic":
        c = cals.get("ort")
        return AnalyticCost(device, c.as_peak() if c is not None and device == "cpu" else peak)
    if target in ("torch-eager", "cuda"):
        return MeasuredCost(device, peak, (data or {}).get("ops"), warmup, repeats,
                            hardware=(data or {}).get("hardware"))
    from rlflow.cost.ort_cpu import OrtCpuCost

    data = data or {}
    return OrtCpuCost(peak, cals.get("ort"), data.get("kernels"), data.get("fusion"), warmup, repeats,
                      hardware=data.get("hardware"), layout=data.get("layout"), context=data.get("context"),
                      reorder=data.get("reorder"))
