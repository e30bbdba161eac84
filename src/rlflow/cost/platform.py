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

from rlflow.config import cuda_available
from rlflow.cost.gpu_calibrated import calibrated_gpus, gpu_of_device
from rlflow.errors import RLFlowError

#: GPUs calibrated from their own whole-model runs (rlflow/cost/gpus/<gpu>.json): targets ``sim-<gpu>``
CALIBRATED = tuple(f"sim-{g}" for g in calibrated_gpus())
#: targets with their own cost class
TARGETS = ("ort-cpu", "torch-eager", "cuda", "sim-v100", "sim-a100", "sim-h100", *CALIBRATED, "analytic")
#: what ``cost.target`` may say: a target, or a rule that picks one on the machine
CHOICES = ("auto", "machine", *TARGETS)
#: the old ``cost.model`` values and the targets they became
OLD_MODELS = {"measured": "torch-eager", "analytic": "analytic"}
def has_gpu() -> bool:
    return cuda_available()


def resolve_target(config: Mapping, target: str | None = None) -> str:
    """The concrete target: ``target`` if given, else the config's ``cost.target`` (or the old ``cost.model``,
    which wins when set: ``measured`` is ``torch-eager``); ``auto`` and ``machine`` are decided here."""
    cost = config.get("cost") or {}
    if target is None:
        old = cost.get("model")
        target = OLD_MODELS.get(old, old) if old is not None else cost.get("target", "machine")
    target = OLD_MODELS.get(target, target) if target in ("measured",) else target
    if target not in CHOICES:
        raise RLFlowError(f"unknown cost target '{target}' (choose from {', '.join(CHOICES)}; the old "
                          "cost.model values: measured = torch-eager, analytic)")
    if target == "auto":
        return gpu_target() if has_gpu() else "sim-h100"
    if target == "machine":
        return "cuda" if has_gpu() else "ort-cpu"
    return target


def gpu_target() -> str:
    """This GPU box's ``auto`` target: its GPU's calibrated target where a calibration file was measured on a GPU of
    this name, else ``cuda``."""
    import torch

    gpu = gpu_of_device(torch.cuda.get_device_name())
    return f"sim-{gpu}" if gpu else "cuda"


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
    if target in CALIBRATED:
        return f"calibrated {target[4:].upper()}"
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


def backend_setting(config: Mapping, key: str, platform: Platform) -> tuple[str, str] | None:
    """:func:`chosen_backend` of the config key ``key`` (dotted: ``timing.check_backend``)."""
    from rlflow.config import get

    return chosen_backend(get(dict(config), key), platform)


#: what a cost cache's refusal tells the user to run
REMAKE_COSTS = ("rlflow measure-costs --config config.yaml --model M --onnx M.onnx --rules rules.json --out CACHE "
                "(in the pipeline: `dvc repro --force measure_costs` or `snakemake --forcerun measure_costs`)")


def check_cache(path, platform: Platform, remake: str = REMAKE_COSTS) -> None:
    """Refuse (one line) a cost cache at ``path`` made for another platform, or made before caches recorded the
    platform; a missing file passes (nothing is read from it)."""
    import json
    from pathlib import Path


    p = Path(path)
    if not p.is_file():
        return
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        return  # the cache readers name the damage
    if not isinstance(data, dict):
        return
    made = data.get("platform")
    if made is None:
        raise RLFlowError(f"{p}: a cost cache made before caches recorded their platform; remake it: {remake}")
    if made != platform.as_dict():
        raise RLFlowError(f"{p}: a cost cache made for {_short(made)}, this run's platform is "
                          f"{_short(platform.as_dict())}; remake it: {remake}")


def _short(d: Mapping) -> str:
    how = f"verified on {d.get('backend')}/{d.get('device')}" if d.get("verifiable") else "not verifiable there"
    return f"target {d.get('target')} ({how})"


def record_in_cache(path, platform: Platform) -> None:
    """Add the platform record to the cost cache at ``path`` (atomically; the other sections kept)."""
    import json
    from pathlib import Path

    from rlflow.atomic import write_text

    p = Path(path)
    data = json.loads(p.read_text())
    data["platform"] = platform.as_dict()
    write_text(p, json.dumps(data, indent=1) + "\n")


def resolved_reward(config: Mapping, platform: Platform) -> dict:
    """The config's env.reward with ``e2e_backend: auto`` replaced by the backend it resolves to (kept ``auto``
    where the platform is not verifiable: only the e2e reward measures, and its meter refuses that)."""
    from rlflow.config import get

    spec = dict(get(dict(config), "env.reward"))
    chosen = backend_setting(config, "env.reward.e2e_backend", platform)
    if chosen is not None:
        spec["e2e_backend"] = chosen[0]
    return spec
