"""XLA CPU runtime of HLO modules, timed with the project's measurement protocol (issue G).

The pass-ordering paper times the module each method produced on XLA's CPU compiler, with no further
target-independent optimisation. So every module is compiled through the ``xla-cpu-pjrt`` plugin with the
target-independent passes an agent chooses from switched off (:func:`timing_disabled`: all of them except those
code generation needs, :data:`REQUIRED`), while XLA's legalisation passes, layout assignment, fusion and code
generation run as usual. The modules then run on the same inputs (random, seeded; integers in [0, 2) so that
they are valid indices), each in :func:`rlflow.evaluation.protocol.compare`'s sessions and rounds, the first
module the reference. The outputs of
every module are also compared with the reference's (:func:`rlflow.graph.exec.max_rel_diff`, the project's
measure): a method's module must compute the same.

Not timed: the unoptimised module. With no target-independent pass at all, XLA CPU runs it far slower (paper-size
BERT: 48 s a call against 0.14 s after XLA's pipeline), so its time says nothing about pass orders.

The compiles and runs happen in a child process (``python -m rlflow.xla.timing``): an XLA CHECK failure aborts
its process, and the caller gets a one-line error instead.
"""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Sequence

import numpy as np

from rlflow.errors import RLFlowError

_LAYOUT = re.compile(r"entry_computation_layout=\{\((?P<params>.*?)\)->")
_SHAPE = re.compile(r"(?P<type>pred|[suf]\d+|bf16)\[(?P<dims>[\d,]*)\]")
_DTYPES = {"pred": "bool", "s8": "int8", "s16": "int16", "s32": "int32", "s64": "int64", "u8": "uint8",
           "u16": "uint16", "u32": "uint32", "u64": "uint64", "f16": "float16", "f32": "float32",
           "f64": "float64"}


def parameter_shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(numpy dtype name, shape) of each parameter of the module's entry computation, from its header."""
    m = _LAYOUT.search(text.partition("\n")[0])
    if m is None:
        raise RLFlowError("HLO module: no entry_computation_layout in its header")
    out = []
    for s in _SHAPE.finditer(m["params"]):
        if s["type"] not in _DTYPES:
            raise RLFlowError(f"HLO module: parameter type {s['type']} not supported for timing")
        out.append((_DTYPES[s["type"]], tuple(int(d) for d in s["dims"].split(",") if d)))
    return out


def module_inputs(text: str, seed: int = 0) -> list[np.ndarray]:
    """Seeded random arguments for the module: floats N(0, 0.1), integers in [0, 2), booleans."""
    rng = np.random.default_rng(seed)
    out = []
    for dtype, shape in parameter_shapes(text):
        if dtype == "bool":
            out.append(rng.integers(0, 2, shape).astype(bool))
        elif dtype.startswith(("int", "uint")):
            out.append(rng.integers(0, 2, shape).astype(dtype))
        else:
            out.append((0.1 * rng.standard_normal(shape)).astype(dtype))
    return out


def timing_disabled(pipeline) -> list[str]:
    """``xla_disable_hlo_passes`` of the timing compile: every pass an agent chooses from, except those code
    generation needs (:data:`REQUIRED`). A name switches a pass off wherever it runs, so ``algsimp``, ``cse``
    and ``dce`` are also off after layout assignment: every module is compiled the same way, and none is
    optimised again by the passes whose order is being compared."""
    from rlflow.xla.passes import action_passes

    return sorted(set(action_passes(pipeline)) - set(REQUIRED))


#: action passes the CPU backend needs before code generation, so they run in the timing compile too: without
#: them the compile fails ("Call graph must be flattened before copy insertion", "Non-simplified HLO Gather is
#: not supported")
REQUIRED = ("flatten-call-graph", "gather_simplifier")


class _Runner:
    """One compiled module with its arguments on the device; calling it runs the module once."""

    def __init__(self, runtime, proto: bytes, options: bytes, inputs: list[np.ndarray]):
        self.runtime, self.loaded, self.buffers = runtime, None, []
        self.loaded = runtime.load(proto, options)
        self.buffers = [runtime.upload(a) for a in inputs]

    def __call__(self, feeds=None, fetch: bool = False):
        return self.runtime.execute(self.loaded, self.buffers, fetch)

    def __del__(self):
        for b in self.buffers:
            self.runtime.release(buffer=b)
        if self.loaded is not None:
            self.runtime.release(executable=self.loaded[0])
        self.buffers, self.loaded = [], None


def _time(request: dict) -> dict:
    """The child's work: compile, check outputs against the first module, and time with the protocol."""
    from rlflow.evaluation.protocol import Protocol, compare
    from rlflow.graph.exec import max_rel_diff
    from rlflow.xla import hlo
    from rlflow.xla.pjrt import XlaRuntime
    from rlflow.xla.worker import _compile_options

    runtime = XlaRuntime()
    options = _compile_options({"xla_disable_hlo_passes": ",".join(request["disabled"])})
    modules: list[tuple[str, str]] = request["modules"]
    inputs = module_inputs(modules[0][1], request.get("seed", 0))
    protos = {name: hlo.parse(text, name).as_serialized_hlo_module_proto() for name, text in modules}
    reference = None
    diffs = {}
    for name, _ in modules:  # each module once: its outputs against the reference's
        outputs = _Runner(runtime, protos[name], options, inputs)(fetch=True)
        if reference is None:
            reference = outputs
        diffs[name] = max_rel_diff(reference, outputs) if len(outputs) == len(reference) else float("inf")
    protocol = Protocol(**request["protocol"])
    result = compare([(name, name) for name, _ in modules], {}, protocol,
                     lambda name: _Runner(runtime, protos[name], options, inputs))
    return {"status": "ok", "max_rel_diff": diffs, "seconds": result.seconds, "rounds": result.rounds,
            "estimates": {n: {"times_ms": e.times_ms, "ratio": e.ratio, "ci_low": e.ci_low, "ci_high": e.ci_high,
                              "verdict": e.verdict, "detectable": e.detectable, "median_ms": e.median_ms}
                          for n, e in result.estimates.items()}}


def time_modules(modules: Sequence[tuple[str, str]], protocol, disabled: list[str], seed: int = 0,
                 timeout_s: float = 3600.0) -> dict:
    """Time HLO modules (``(name, text)``, the first the reference) on XLA's CPU compiler with ``protocol``
    (:class:`rlflow.evaluation.protocol.Protocol`), compiled with ``disabled`` passes off (:func:`timing_disabled`).
    Returns ``{"estimates": {name: {ratio, ci_low, ci_high, verdict, detectable, median_ms, times_ms}},
    "max_rel_diff": {name: largest relative output difference from the reference}, "rounds", "seconds"}``."""
    import dataclasses

    from rlflow.xla.worker import _child_env, _recv, _send

    request = {"modules": list(modules), "disabled": list(disabled), "seed": seed,
               "protocol": {f.name: getattr(protocol, f.name) for f in dataclasses.fields(protocol)}}
    proc = subprocess.Popen([sys.executable, "-m", "rlflow.xla.timing"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_child_env())
    try:
        _send(proc.stdin, request)
        proc.stdin.close()
        reply = _recv(proc.stdout)
    except (EOFError, BrokenPipeError, OSError):
        proc.kill()
        proc.wait()
        tail = [ln for ln in proc.stderr.read().decode(errors="replace").splitlines() if ln.strip()]
        raise RLFlowError(f"XLA CPU timing died (status {proc.returncode}): {tail[-1][:300] if tail else '?'}")
    finally:
        try:
            proc.wait(timeout=timeout_s)
        finally:
            for s in (proc.stdout, proc.stderr):
                s.close()
    if reply.get("status") != "ok":
        raise RLFlowError(f"XLA CPU timing: {reply.get('message', '?')}")
    return reply


def _serve() -> None:
    from rlflow.xla.worker import _recv, _send

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write to the channel
    request = _recv(stdin)
    try:
        reply = _time(request)
    except RLFlowError as exc:
        reply = {"status": "error", "message": str(exc)}
    _send(stdout, reply)


if __name__ == "__main__":
    _serve()
