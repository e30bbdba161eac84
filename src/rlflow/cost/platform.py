"""The platform of a run: the cost target the searches and agents optimise, resolved once from the config, and
the executor that can verify its graphs on this machine.

    platform = resolve_platform(config)        # Platform(target='sim-h100', label='simulated H100', device='cuda',
    platform.as_dict()                         #          backend=None, verifiable=False) on a CPU box

===============  ==========  ===============================================================================
target           device      backend that verifies it (names of ``rlflow.graph.exec``)
===============  ==========  ===============================================================================
``ort-cpu``      cpu         ``ort`` (onnxruntime on the CPU)
``torch-eager``  cpu         ``torch`` on the CPU
``analytic``     the run's   ``torch`` on the config's ``device`` (cuda on a GPU box, else cpu)
``cuda``         cuda        ``torch`` on the GPU where torch sees one, else none
``sim-*``        cuda        ``torch`` on the GPU where torch sees one, else none (a simulated GPU, CPU box)
===============  ==========  ===============================================================================

A target whose device this machine lacks is **not verifiable** here (``backend`` None): its graphs are study
results, kept as found and labelled so, never gated on another device. The gate (``timing.check_backend``), the
e2e reward (``env.reward.e2e_backend``) and evaluate's primary backend say ``auto`` by default: the platform's
backend (:func:`chosen_backend`); a backend named in the config wins.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Mapping

from rlflow.cost.targets import has_gpu, resolve_target

#: what every figure of a target is called (the cost classes' ``label``)
LABELS = {
    "ort-cpu": "onnxruntime CPU (kernels timed)",
    "torch-eager": "torch eager (measured per op)",
    "cuda": "CUDA (measured per op with CUDA events)",
    "analytic": "analytic roofline",
}
#: what the metadata and logs say of a graph whose target cannot be verified on this machine
NOT_VERIFIABLE = "simulated target: not verifiable on this machine"


@dataclass(frozen=True)
class Platform:
    """One run's resolved platform (never ``auto`` or ``machine``)."""

    target: str
    """The resolved cost target (:data:`rlflow.cost.targets.TARGETS`)."""
    label: str
    """The target's human label (``simulated H100``)."""
    device: str
    """Where the target's runtime lives: ``cpu`` | ``cuda``."""
    backend: str | None
    """The executor that verifies the target's graphs on this machine (``ort`` | ``torch``, on :attr:`device`);
    None where this machine lacks the device (sim-h100 on a CPU box)."""
    verifiable: bool
    """``backend is not None``."""

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """``sim-h100 (simulated H100), verified on torch/cuda`` | ``..., simulated target: not verifiable ...``."""
        how = f"verified on {self.backend}/{self.device}" if self.verifiable else NOT_VERIFIABLE
        return f"{self.target} ({self.label}), {how}"


def target_label(target: str) -> str:
    return f"simulated {target[4:].upper()}" if target.startswith("sim-") else LABELS[target]


def resolve_platform(config: Mapping, target: str | None = None) -> Platform:
    """The platform of ``config`` (its ``cost.target``, or ``target`` when given: a target or ``auto``/``machine``)."""
    from rlflow.config import resolve_device

    t = resolve_target(config, target)
    if t in ("ort-cpu", "torch-eager"):
        device = "cpu"
    elif t == "analytic":
        device = resolve_device(dict(config))
    else:  # cuda, sim-*
        device = "cuda"
    present = device == "cpu" or has_gpu()
    backend = None if not present else ("ort" if t == "ort-cpu" else "torch")
    return Platform(t, target_label(t), device, backend, backend is not None)


def chosen_backend(value: str | None, platform: Platform) -> tuple[str, str] | None:
    """(backend, device) of a backend setting (``timing.check_backend``, ``env.reward.e2e_backend``, ``evaluate``'s
    primary): ``auto`` (or unset) follows the platform -- None when it is not verifiable here; a named backend wins
    and runs on the platform's device where this machine has it, else on the CPU."""
    if value in (None, "auto"):
        return (platform.backend, platform.device) if platform.verifiable else None
    return value, platform.device if platform.verifiable else "cpu"
