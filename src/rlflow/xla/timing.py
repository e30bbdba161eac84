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
its process, and the caller gets a one-line error instead. The process persists (:class:`TimingWorker`): one PJRT
client, and every compiled module cached by its fingerprint, so the runtime reward's episode end costs the
compile of the episode's module (none when an earlier episode reached the same module) and a short timing, not a
fresh process and a compile of every module.
"""

from __future__ import annotations

import re
import select
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
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
#: not supported"; in training modules, the backward pass: "Non-simplified HLO Scatter is not supported" (an XLA
#: abort), "HLO opcode `select-and-scatter` is not supported", "Dot with multiple contracting dimensions is not
#: implemented"). Each rewrites only the ops the backend cannot emit.
REQUIRED = ("flatten-call-graph", "gather_simplifier", "scatter_simplifier", "select_and_scatter_expander",
            "dot_decomposer")


class _Runner:
    """One compiled module with fresh arguments on the device (one protocol session); calling it runs the
    module once. The compiled module is the timer's (cached); the arguments are this runner's."""

    def __init__(self, runtime, loaded, inputs: list[np.ndarray]):
        self.runtime, self.loaded, self.buffers = runtime, loaded, []
        self.buffers = [runtime.upload(a) for a in inputs]

    def __call__(self, feeds=None, fetch: bool = False):
        return self.runtime.execute(self.loaded, self.buffers, fetch)

    def __del__(self):
        for b in self.buffers:
            self.runtime.release(buffer=b)
        self.buffers = []


class _Timer:
    """The timing process's state: one PJRT client, and the compiled modules by (fingerprint, compile options),
    the least recently used dropped beyond ``cache_size`` after each request."""

    def __init__(self, cache_size: int) -> None:
        from rlflow.xla.pjrt import XlaRuntime

        self.runtime, self.cache_size = XlaRuntime(), cache_size
        self.compiled: OrderedDict[tuple[str, bytes], tuple[int, int]] = OrderedDict()
        self.diffs: dict[tuple, float] = {}  # (reference key, module key, seed) -> output difference (checked once)
        self.screens: dict[tuple, float] = {}  # (reference key, module key, seed) -> one-call latency ratio

    def executable(self, text: str, name: str, options: bytes) -> tuple[tuple[int, int], bool, tuple]:
        """The loaded executable of module ``text``, whether it was compiled now (False: from the cache) and its
        cache key."""
        from rlflow.xla import hlo

        module = hlo.parse(text, name)
        key = (hlo.fingerprint(module), options)
        if key in self.compiled:
            self.compiled.move_to_end(key)
            return self.compiled[key], False, key
        loaded = self.runtime.load(module.as_serialized_hlo_module_proto(), options)
        self.compiled[key] = loaded
        return loaded, True, key

    def trim(self) -> None:
        while len(self.compiled) > self.cache_size:
            _, loaded = self.compiled.popitem(last=False)
            self.runtime.release(executable=loaded[0])

    def time(self, request: dict) -> dict:
        """Compile (or find) every module, check its outputs against the first's, and time with the protocol."""
        from rlflow.evaluation.protocol import REFERENCE, SLOWER, Protocol, compare
        from rlflow.graph.exec import max_rel_diff
        from rlflow.xla.worker import _compile_options

        t0 = time.perf_counter()
        options = _compile_options({"xla_disable_hlo_passes": ",".join(request["disabled"])})
        modules: list[tuple[str, str]] = request["modules"]
        inputs = module_inputs(modules[0][1], request.get("seed", 0))
        loaded, keys, compiled = {}, {}, 0
        for name, text in modules:
            loaded[name], new, keys[name] = self.executable(text, name, options)
            compiled += new
        compile_s = time.perf_counter() - t0
        ref, seed = modules[0][0], request.get("seed", 0)
        unchecked = [n for n, _ in modules if (keys[ref], keys[n], seed) not in self.diffs]
        if unchecked:  # each module once: its outputs against the reference's (a pair checked before: known)
            if len(self.diffs) > 100 * self.cache_size:
                self.diffs.clear()
            reference = _Runner(self.runtime, loaded[ref], inputs)(fetch=True)
            for name in unchecked:
                outputs = _Runner(self.runtime, loaded[name], inputs)(fetch=True)
                self.diffs[(keys[ref], keys[name], seed)] = \
                    max_rel_diff(reference, outputs) if len(outputs) == len(reference) else float("inf")
        diffs = {n: self.diffs[(keys[ref], keys[n], seed)] for n, _ in modules}
        screened = {}
        if request.get("screen"):
            for name, _ in modules[1:]:
                ratio = self.screen(loaded[ref], loaded[name], inputs, (keys[ref], keys[name], seed))
                if ratio > request["screen"]:
                    screened[name] = ratio
        timed = [(n, n) for n, _ in modules if n not in screened]
        estimates, rounds, seconds = {}, [], 0.0
        if len(timed) > 1:
            result = compare(timed, {}, Protocol(**request["protocol"]),
                             lambda name: _Runner(self.runtime, loaded[name], inputs))
            rounds, seconds = result.rounds, result.seconds
            estimates = {n: {"times_ms": e.times_ms, "ratio": e.ratio, "ci_low": e.ci_low, "ci_high": e.ci_high,
                             "verdict": e.verdict, "detectable": e.detectable, "median_ms": e.median_ms}
                         for n, e in result.estimates.items()}
        else:
            estimates[ref] = {"times_ms": [], "ratio": 1.0, "ci_low": None, "ci_high": None,
                              "verdict": REFERENCE, "detectable": None, "median_ms": None}
        for name, ratio in screened.items():  # one call each: far slower than the screen, not timed further
            estimates[name] = {"times_ms": [], "ratio": ratio, "ci_low": ratio, "ci_high": ratio,
                               "verdict": SLOWER, "detectable": None, "median_ms": None, "screened": True}
        self.trim()
        return {"status": "ok", "max_rel_diff": diffs, "seconds": seconds, "rounds": rounds,
                "compiled": compiled, "cached": len(modules) - compiled, "compile_s": compile_s,
                "screened": sorted(screened), "estimates": estimates}

    def screen(self, reference, loaded, inputs, key) -> float:
        """One call of each module (the reference first), after a warm-up call of each: the latency ratio,
        measured once per (reference, module, seed)."""
        if key not in self.screens:
            if len(self.screens) > 100 * self.cache_size:
                self.screens.clear()
            runners = [_Runner(self.runtime, reference, inputs), _Runner(self.runtime, loaded, inputs)]
            seconds = []
            for run in runners:
                run()
            for run in runners:
                t0 = time.perf_counter()
                run()
                seconds.append(time.perf_counter() - t0)
            self.screens[key] = seconds[1] / max(seconds[0], 1e-9)
        return self.screens[key]


class TimingWorker:
    """The persistent timing process (``python -m rlflow.xla.timing``): one PJRT client for all requests, each
    module compiled once (cached by its fingerprint and the compile options, ``cache_size`` kept), so timing a
    module again costs only the timing. Started on first use; a death (an XLA CHECK failure) or a request running
    past ``timeout_s`` is a one-line RLFlowError, and the next request starts a fresh process."""

    def __init__(self, cache_size: int = 64, timeout_s: float = 3600.0):
        self.cache_size, self.timeout_s = cache_size, timeout_s
        self._proc: subprocess.Popen | None = None
        self._stderr = None
        self.requests = 0

    def _start(self) -> None:
        from rlflow.xla.worker import _child_env

        self._stderr = tempfile.TemporaryFile()  # a file, not a pipe: a long-lived child's log cannot block it
        self._proc = subprocess.Popen([sys.executable, "-m", "rlflow.xla.timing", str(self.cache_size)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                      env=_child_env())

    def _stderr_tail(self) -> str:
        if self._stderr is None:
            return "?"
        self._stderr.seek(0)
        lines = [ln for ln in self._stderr.read().decode(errors="replace").splitlines() if ln.strip()]
        return lines[-1][:300] if lines else "?"

    def time(self, modules: Sequence[tuple[str, str]], protocol, disabled: list[str], seed: int = 0,
             screen: float | None = None) -> dict:
        """:func:`time_modules`'s result, from this process. ``screen`` (a ratio > 1): a module whose one call
        (after a warm-up call) takes more than ``screen`` times the reference's is not timed with the protocol;
        its estimate is that one-call ratio (``screened``: true; verdict slower; its interval the ratio itself)."""
        import dataclasses

        from rlflow.xla.worker import _recv, _send

        if screen is not None and not screen > 1:
            raise RLFlowError(f"XLA CPU timing: screen must be a latency ratio above 1, got {screen}")
        request = {"modules": list(modules), "disabled": list(disabled), "seed": seed, "screen": screen,
                   "protocol": {f.name: getattr(protocol, f.name) for f in dataclasses.fields(protocol)}}
        if self._proc is None or self._proc.poll() is not None:
            self.close()
            self._start()
        assert self._proc is not None and self._proc.stdin is not None and self._proc.stdout is not None
        try:
            _send(self._proc.stdin, request)
            ready, _, _ = select.select([self._proc.stdout], [], [], self.timeout_s)
            if not ready:
                raise TimeoutError
            reply = _recv(self._proc.stdout)
        except TimeoutError:
            self.close()
            raise RLFlowError(f"XLA CPU timing: no answer in {self.timeout_s:.0f} s")
        except (EOFError, BrokenPipeError, OSError):
            self._proc.kill()
            status = self._proc.wait()
            tail = self._stderr_tail()
            self.close()
            raise RLFlowError(f"XLA CPU timing died (status {status}): {tail}")
        self.requests += 1
        if reply.get("status") != "ok":
            raise RLFlowError(f"XLA CPU timing: {reply.get('message', '?')}")
        return reply

    def close(self) -> None:
        """End the process (its stdin closed, it exits; killed if it does not within 10 s)."""
        if self._proc is not None:
            if self._proc.stdin is not None:
                try:
                    self._proc.stdin.close()
                except OSError:
                    pass
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            if self._proc.stdout is not None:
                self._proc.stdout.close()
        if self._stderr is not None:
            self._stderr.close()
        self._proc, self._stderr = None, None

    def __enter__(self) -> "TimingWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def time_modules(modules: Sequence[tuple[str, str]], protocol, disabled: list[str], seed: int = 0,
                 timeout_s: float = 3600.0) -> dict:
    """Time HLO modules (``(name, text)``, the first the reference) on XLA's CPU compiler with ``protocol``
    (:class:`rlflow.evaluation.protocol.Protocol`), compiled with ``disabled`` passes off (:func:`timing_disabled`),
    in a timing process of its own (:class:`TimingWorker` keeps one for many requests).
    Returns ``{"estimates": {name: {ratio, ci_low, ci_high, verdict, detectable, median_ms, times_ms}},
    "max_rel_diff": {name: largest relative output difference from the reference}, "rounds", "seconds",
    "compiled", "cached", "compile_s"}``."""
    with TimingWorker(timeout_s=timeout_s) as worker:
        return worker.time(modules, protocol, disabled, seed)


def choose_by_latency(worker: TimingWorker, default_text: str, candidates: Sequence[tuple[str, str]], protocol,
                      disabled: list[str], seed: int = 0, tolerance: float = 1e-4) -> dict:
    """The final choice among candidate modules (``(name, text)``) by measured latency: XLA's default pipeline's
    module is always a candidate (the reference, ``xla_default``); every candidate is timed against it with
    ``protocol`` and the chosen one is the fastest (lowest ratio) of those called faster, with the default's
    outputs; none: the default. So the choice is never a module the protocol did not call faster.
    Returns ``{"chosen": name, "candidates": {name: {ratio, ci_low, ci_high, verdict, max_rel_diff}}}``."""
    from rlflow.evaluation.protocol import FASTER

    others = [(n, t) for n, t in candidates if t != default_text]
    if not others:
        return {"chosen": "xla_default", "candidates": {}}
    result = worker.time([("xla_default", default_text), *others], protocol, disabled, seed)
    found = {}
    for name, _ in others:
        est = result["estimates"][name]
        found[name] = {**{k: est[k] for k in ("ratio", "ci_low", "ci_high", "verdict")},
                       "max_rel_diff": result["max_rel_diff"][name]}
    faster = [n for n, e in found.items() if e["verdict"] == FASTER and e["max_rel_diff"] <= tolerance]
    chosen = min(faster, key=lambda n: found[n]["ratio"]) if faster else "xla_default"
    return {"chosen": chosen, "candidates": found}


def _serve(cache_size: int) -> None:
    """The timing process: requests until stdin closes."""
    from rlflow.xla.worker import _recv, _send

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write to the channel
    timer = _Timer(cache_size)
    while True:
        try:
            request = _recv(stdin)
        except EOFError:
            return
        try:
            reply = timer.time(request)
        except RLFlowError as exc:
            reply = {"status": "error", "message": str(exc)}
        _send(stdout, reply)


if __name__ == "__main__":
    _serve(int(sys.argv[1]) if len(sys.argv) > 1 else 64)
