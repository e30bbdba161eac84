"""HLO modules as text: parsing (jaxlib's own HLO parser), the opcode histogram and XLA's cost analysis.

The histogram counts every instruction of every computation by opcode over a fixed vocabulary (all opcodes of
the installed XLA, in its enum order), so observations of different modules line up. The op count is its sum
(the paper's "XLA operation count"). Cost features are XLA's own HloCostAnalysis of the module: flops,
transcendentals, bytes accessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rlflow.errors import RLFlowError

COST_FEATURES = ("flops", "transcendentals", "bytes accessed")
_SCHEDULED = re.compile(r",\s*is_scheduled=true")


def _hlo():
    from jax._src.lib import hlo  # jaxlib's HLO bindings (parser, module, opcodes)

    return hlo


def opcodes() -> tuple[str, ...]:
    """The opcode vocabulary of the installed XLA, in its enum order (``kAdd`` -> ``add``)."""
    return tuple(_opcode_name(op) for op in _hlo().HloOpcode.__members__.values())


def _opcode_name(op) -> str:
    name = _OPCODE_NAMES.get(op)
    if name is None:
        name = op.name[1:] if op.name.startswith("k") else op.name
        name = _OPCODE_NAMES[op] = re.sub(r"(?<!^)(?=[A-Z])", "-", name).lower()
    return name


_OPCODE_NAMES: dict = {}  # HloOpcode -> its name (one regex per opcode, not per instruction)


def strip_schedule(text: str) -> str:
    """The module without ``is_scheduled=true`` in its header: a scheduled module must keep its schedule, so
    passes that delete instructions crash on it."""
    head, sep, rest = text.partition("\n")
    return _SCHEDULED.sub("", head) + sep + rest


def parse(text: str, what: str = "HLO module"):
    """jaxlib's HloModule of HLO text; a one-line RLFlowError naming ``what`` when it does not parse."""
    try:
        return _hlo().hlo_module_from_text(strip_schedule(text))
    except Exception as exc:  # jaxlib raises its own XlaRuntimeError
        raise RLFlowError(f"{what}: not a valid HLO module: {str(exc).splitlines()[0] if str(exc) else exc}")


@dataclass
class HloStats:
    """What the env observes of a module: the opcode histogram and the cost features."""

    histogram: dict[str, int]
    cost: dict[str, float] = field(default_factory=dict)
    fingerprint: str = ""

    def to_dict(self) -> dict:
        return {"histogram": self.histogram, "cost": self.cost, "fingerprint": self.fingerprint}


def histogram(module) -> dict[str, int]:
    """Instructions of every computation of a parsed module, by opcode name."""
    counts: dict[str, int] = {}
    for comp in module.computations():
        for inst in comp.instructions():
            name = _opcode_name(inst.opcode)
            counts[name] = counts.get(name, 0) + 1
    return counts


def fingerprint(module) -> str:
    """A hash of the module's computations and instructions as text (metadata and the module header dropped,
    order-independent): a pass that changes nothing keeps it. One print of the whole module by XLA."""
    import hashlib

    options = _hlo().HloPrintOptions()
    options.print_metadata = False
    lines = [ln.strip() for ln in module.to_string(options).splitlines()
             if ln.strip() and not ln.startswith("HloModule")]
    return hashlib.sha1("\n".join(sorted(lines)).encode()).hexdigest()


def cost_analysis(module) -> dict[str, float]:
    """XLA's HloCostAnalysis (CPU client of jaxlib) of a parsed module: the :data:`COST_FEATURES`."""
    import jax
    from jax._src.lib import _jax

    raw = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
    return {k: float(raw.get(k, 0.0)) for k in COST_FEATURES}


def module_stats(module) -> HloStats:
    """Histogram, cost features and fingerprint of a parsed module."""
    return HloStats(histogram(module), cost_analysis(module), fingerprint(module))


def stats(text: str, what: str = "HLO module") -> HloStats:
    """Histogram, cost features and fingerprint of HLO text."""
    return module_stats(parse(text, what))
