"""Run the original graph, its A/A control and every method's optimised graph on every backend: check each one's
outputs against the original on onnxruntime, then compare their latencies under the measurement protocol
(:mod:`rlflow.evaluation.protocol`).

Order of work, one backend at a time:

1. **Check.** For each distinct graph (equal ``Graph.structural_hash``: two methods that found the same graph,
   or the A/A control, which is the original exported and imported again), build the backend's runner and run
   it once on the shared inputs (``make_inputs`` of the original, the configured seed). That first call compiles
   what the backend compiles (XLA), is where the peak memory is read on CUDA, and gives the outputs compared
   with the reference: the ORIGINAL graph run by onnxruntime on the CPU (:func:`rlflow.graph.exec.max_rel_diff`).
   The runner is then released (the protocol builds fresh ones). A backend known, from the graph alone, to have
   no lowering for one of its ops (:func:`unsupported_reason`) is reported ``unsupported`` with the op's name and
   left out of the timing; the rest go on. Any exception while a runner is built or run fails the stage
   (:class:`BackendFailure`): a crash is never recorded as a row.
2. An optimised graph whose difference exceeds the tolerance stops everything (:class:`OutputMismatch`): wrong
   results are never timed, let alone reported as speedups. The original itself (and so its A/A copy) differing
   on a backend is reported ``mismatch`` and goes on.
3. **Compare** (:func:`rlflow.evaluation.protocol.compare`): the original, the A/A control and the distinct
   method graphs, each in ``protocol.sessions`` freshly built runners, timed interleaved in randomised rounds
   within ``protocol.budget_s`` for every two graphs (:meth:`Protocol.for_graphs`: as many rounds as a check of
   one graph against the original); per graph the latency ratio to the original with its interval and verdict. Methods
   with the same graph share one estimate (their rows are equal); a method whose graph is the original's (it kept
   the original) shares the A/A control's, which is exactly that comparison. This keeps the number of runners
   built down: a TensorFlow runner of paper-size BERT takes 2-6 s to build, trace and call once on this 2-core machine. The A/A control's interval must contain 1.0;
   when it does not, every row of that backend is marked ``too_noisy``.

Memory. A runner can hold several copies of the weights (paper-size BERT on the CPU: onnxruntime about 1 GB per
session, TensorFlow with Grappler about 4.5 GB, XLA about 2 GB). The first runner checked (the original's) gives
the footprint (resident memory before building it and after its first run); when the graphs of a comparison
would not fit in :data:`MEMORY_FRACTION` of the available memory at once, the methods are split into several
comparisons, each with the original (the A/A control in the first); the original's latency is then over all its
sessions. Linux only (``/proc``); elsewhere everything is one comparison.

Latency: the median and interquartile range of all the graph's timed calls (wall clock of ``runner(feeds)``,
which returns host numpy arrays, so a GPU run is complete when it returns); the ratio and its interval are the
protocol's (mean over sessions of each session's median). Peak memory: CUDA only, for the backends that report it
(torch: ``torch.cuda`` allocator; tf: TensorFlow's ``GPU:0`` allocator) -- the peak during the first call.
"""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from rlflow.errors import RLFlowError
from rlflow.evaluation.protocol import AA, Estimate, Protocol, aa_copy, compare
from rlflow.graph.exec.numerics import strict_fp32
from rlflow.graph.ir import Graph


class OutputMismatch(RLFlowError):
    """An optimised graph computes something else than the original (beyond the tolerance). Exit status 1, so
    that a wrong result is told apart from bad input (2)."""

    exit_code = 1


class BackendFailure(RLFlowError):
    """A backend raised while building or running a graph's runner (not a limitation known in advance)."""


def unsupported_reason(graph: Graph, backend: str) -> str | None:
    """Why ``backend`` cannot run ``graph``, decided from the graph alone before anything runs (the tf backends:
    an op without a TF lowering; tf-xla: an opaque op; every backend but onnxruntime: an op of another domain,
    such as onnxruntime's com.microsoft contrib ops, which the others would call onnxruntime for node by node),
    naming the op; None if it should run."""
    if backend != "ort":
        contrib = sorted({f"{n.attrs['domain']}:{n.attrs['op_type']}" for n in graph.nodes
                          if n.op == "Opaque" and n.attrs.get("domain") not in ("", "ai.onnx")})
        if contrib:
            return f"op {contrib[0]} (another domain's op) runs only in onnxruntime"
    if backend in ("tf", "tf-xla"):
        from rlflow.graph.exec.tf_exec import unsupported_reason as tf_reason

        return tf_reason(graph, xla=backend == "tf-xla")
    if backend == "jax":
        from rlflow.graph.exec.jax_exec import unsupported_reason as jax_reason

        return jax_reason(graph)
    return None  # onnxruntime runs every node (opaque ones as imported); torch runs opaque nodes through it


@dataclass
class Measurement:
    """One (method, backend) run."""

    method: str
    backend: str
    status: str
    """``ok`` | ``mismatch`` (only ever the original: see the module docstring) | ``unsupported``."""
    device: str = ""
    """Where the runner actually ran (``cpu`` | ``cuda``): a CPU-only build (tensorflow-cpu, onnxruntime without
    the CUDA provider) runs on the CPU whatever was asked; empty until a runner was built."""
    device_note: str = ""
    """Why the runner ran elsewhere than the configured device (``no CUDA provider in this onnxruntime``)."""
    median_ms: float | None = None
    iqr_ms: float | None = None
    peak_memory_bytes: int | None = None
    max_rel_diff: float | None = None
    reason: str = ""
    """Why the backend has no lowering for the graph (``unsupported``; :func:`unsupported_reason`)."""
    times_ms: list[list[float]] | None = None
    """The timed calls, one list per session."""
    ratio: float | None = None
    """Latency over the original's on this backend under the protocol (< 1: faster); 1 for the original."""
    ci_low: float | None = None
    ci_high: float | None = None
    verdict: str = ""
    """``faster`` | ``slower`` | ``no detectable difference``; ``reference`` for the original; empty if not timed."""
    detectable: float | None = None
    """The smallest relative latency change the comparison could detect (80% power)."""
    too_noisy: bool = False
    """The backend's A/A control failed: its interval excludes 1.0, so no verdict of the backend is a finding."""
    estimate: Estimate | None = None

    def set_estimate(self, e: Estimate) -> None:
        self.estimate = e
        self.times_ms = e.times_ms
        self.median_ms, self.iqr_ms = e.median_ms, e.iqr_ms
        self.ratio, self.ci_low, self.ci_high, self.verdict, self.detectable = (e.ratio, e.ci_low, e.ci_high,
                                                                                e.verdict, e.detectable)


def _first_line(e: BaseException) -> str:
    """An exception as one line: an RLFlowError's message, else the type and the message's first line."""
    if isinstance(e, RLFlowError):
        return str(e)
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _gpu_memory(backend: str):
    """(current_bytes, reset_peak, peak_bytes) callables for a CUDA backend that can tell, else None."""
    if backend == "torch":
        import torch

        def current():
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated()

        return current, torch.cuda.reset_peak_memory_stats, torch.cuda.max_memory_allocated
    if backend in ("tf", "tf-xla"):
        from rlflow.graph.exec.tf_exec import _tf

        tf = _tf()
        if not tf.config.list_physical_devices("GPU"):
            return None
        exp = tf.config.experimental
        return (lambda: exp.get_memory_info("GPU:0")["current"], lambda: exp.reset_memory_stats("GPU:0"),
                lambda: exp.get_memory_info("GPU:0")["peak"])
    return None  # onnxruntime does not report its arena's peak


def runner_device(runner) -> tuple[str, str]:
    """(where the runner runs, ``cpu`` | ``cuda``; why that is not the device asked, or empty): the executors'
    own record (``ran_on``, ``device_note``)."""
    return runner.ran_on, runner.device_note


def first_run(graph: Graph, backend: str, device: str, feeds: dict, fresh=None) -> tuple[object, list, int | None]:
    """Build ``backend``'s runner for ``graph`` (through ``fresh``, a :class:`rlflow.graph.exec.FreshRunners`, when
    given) and run it once: (runner, outputs, peak bytes or None). TensorFlow runs this check without TF32
    (:func:`rlflow.graph.exec.tf_exec.exact_float32`)."""
    mem = _gpu_memory(backend) if device == "cuda" else None
    base = mem[0]() if mem else 0
    runner = new_runner(graph, backend, device, fresh)
    if mem:
        mem[1]()
    exact = strict_fp32()  # the outputs are checked at evaluate.tolerance: no TF32 on a GPU (torch; TensorFlow's own)
    if backend in ("tf", "tf-xla") and device == "cuda":
        from rlflow.graph.exec.tf_exec import exact_float32

        exact = exact_float32()
    with exact:
        outputs = runner(feeds)
    peak = int(mem[2]() - base) if mem else None
    return runner, outputs, peak


def check_interface(original: Graph, graph: Graph, what: str) -> None:
    """The optimised graph must take the original's inputs (names, types) and give as many outputs."""
    if list(graph.inputs) != list(original.inputs) or len(graph.outputs) != len(original.outputs):
        raise RLFlowError(f"{what}: inputs {list(graph.inputs)} and {len(graph.outputs)} output(s); the original "
                          f"has inputs {list(original.inputs)} and {len(original.outputs)} output(s)")
    for name in original.inputs:
        if graph.types[name] != original.types[name]:
            raise RLFlowError(f"{what}: input '{name}' is {graph.types[name]}, the original's is "
                              f"{original.types[name]}")


def reference_outputs(original: Graph, feeds: dict, what: str = "the original model") -> list[np.ndarray]:
    """The original graph's outputs under onnxruntime on the CPU: what every run is compared with."""
    from rlflow.graph.exec import get_runner

    try:
        return get_runner(original, "ort", "cpu")(feeds)
    except RLFlowError:
        raise
    except Exception as e:  # noqa: BLE001 -- onnxruntime's own errors; the reference must run
        raise RLFlowError(f"{what}: onnxruntime cannot run it: {_first_line(e)}") from None


#: the share of the available memory the runners of one batch may take (see the module docstring)
MEMORY_FRACTION = 0.5


def _rss_bytes() -> int | None:
    """This process's resident memory (Linux), else None."""
    try:
        import os

        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _available_bytes() -> int | None:
    """The memory the kernel says is available to new allocations (Linux ``MemAvailable``), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def batch_capacity(footprint: int | None) -> int | None:
    """How many more runners of ``footprint`` bytes fit in MEMORY_FRACTION of the available memory (at least 1);
    None (no limit) when either figure is unknown."""
    avail = _available_bytes()
    if footprint is None or avail is None:
        return None
    return max(1, int(MEMORY_FRACTION * avail) // max(footprint, 1 << 20))


def _release_memory() -> None:
    """Collect the released runners and hand freed heap back to the system (glibc keeps it otherwise)."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def new_runner(graph: Graph, backend: str, device: str, fresh=None):
    """A fresh runner of ``graph`` on ``backend`` (what the protocol builds for every session); ``fresh``: the
    backend run's :class:`rlflow.graph.exec.FreshRunners` (each graph exported once)."""
    from rlflow.graph.exec import get_runner

    return fresh(graph) if fresh is not None else get_runner(graph, backend, device)


def evaluate_graphs(graphs: Sequence[tuple[str, Graph]], backends: Sequence[str], device: str, protocol: Protocol,
                    *, seed: int = 0, tolerance: float = 1e-4, aa: bool = True, progress: bool = True,
                    log: Callable[[str], None] = print, clock: Callable[[], float] = time.perf_counter
                    ) -> list[Measurement]:
    """Measure every (method, graph) of ``graphs`` on every backend (see the module docstring). The first entry is
    the original graph, the reference; with ``aa``, its A/A control (:data:`AA`) is added right after it. Returns
    one :class:`Measurement` per (method, backend), method-major in that order. Raises :class:`OutputMismatch`
    (nothing timed after it) when an optimised graph's outputs differ from the original's by more than
    ``tolerance`` on any backend. ``clock`` times the protocol's rounds (seconds)."""
    from rlflow.graph.exec import make_inputs

    (orig_name, original), rest = graphs[0], list(graphs[1:])
    for method, g in rest:
        check_interface(original, g, f"{method}'s graph")
    if aa:
        rest.insert(0, (AA, aa_copy(original)))
    graphs = [(orig_name, original)] + rest
    feeds = make_inputs(original, seed)
    reference = reference_outputs(original, feeds)
    _release_memory()  # (the reference session's memory, before the first footprint is measured)
    hashes = {method: g.structural_hash() for method, g in graphs}
    results: dict[tuple[str, str], Measurement] = {}
    bar = _progress_bar(len(backends), progress)
    try:
        for backend in backends:
            bar.set_postfix_str(backend)
            t0 = time.perf_counter()
            run = _BackendRun(backend, device, feeds, reference, tolerance, seed, orig_name, hashes, results, log)
            try:
                for method, g in graphs:
                    run.check(method, g)
                n = run.compare(graphs, protocol, clock)
            finally:
                run.fresh.close()
            _release_memory()
            log(f"evaluate: {backend}: {n} of {len(graphs)} graphs checked and compared in "
                f"{time.perf_counter() - t0:.1f} s" + (f" ({run.comparisons} comparisons, to stay within the memory "
                                                        f"available)" if run.comparisons > 1 else "")
                + ("; TOO NOISY: the A/A control's interval excludes 1.0, no verdict on this backend is a finding"
                   if run.too_noisy else ""))
            bar.update(1)
    finally:
        bar.close()
    return [results[(method, b)] for method, _ in graphs for b in backends]


class _BackendRun:
    """One backend: each distinct graph checked once, then the protocol's comparisons; the measurements."""

    def __init__(self, backend, device, feeds, reference, tolerance, seed, orig_name, hashes, results, log):
        self.backend, self.device, self.feeds, self.reference = backend, device, feeds, reference
        self.tolerance, self.seed, self.orig_name, self.hashes = tolerance, seed, orig_name, hashes
        self.results, self.log = results, log
        self.checked: dict[str, tuple] = {}
        """structural hash -> (outputs, peak bytes, device) or (None, reason) when unsupported."""
        self.capacity: int | None = None
        """Runners that fit at once (None: no limit), from the first runner's footprint."""
        self.base_diff: float | None = None
        self.comparisons = 0
        self.too_noisy = False
        self.said_device = False
        """The warning that the backend runs on another device than asked was logged."""
        from rlflow.graph.exec import FreshRunners

        self.fresh = FreshRunners(backend, device)
        """Each graph exported once for this backend's check and sessions (closed when they are done)."""

    def check(self, method: str, graph: Graph) -> None:
        """Build and run the graph once (or reuse an equal graph's check) and compare its outputs."""
        from rlflow.graph.exec import max_rel_diff, output_tolerance

        m = self.results[(method, self.backend)] = Measurement(method, self.backend, "ok")
        h = self.hashes[method]
        if h not in self.checked:
            reason = unsupported_reason(graph, self.backend)
            if reason is not None:  # known before running: a row 'unsupported', the rest go on
                self.checked[h] = (None, reason)
            else:
                before = _rss_bytes()
                try:
                    runner, outputs, peak = first_run(graph, self.backend, self.device, self.feeds, self.fresh)
                except Exception as e:  # noqa: BLE001 -- a crash is a failure of the stage, never a row
                    raise BackendFailure(f"{method} on {self.backend} ({self.device}): the backend failed while "
                                         f"building or running the graph: {_first_line(e)}; nothing written") from e
                self.checked[h] = (outputs, peak, runner_device(runner))
                after = _rss_bytes()
                runner = None
                _release_memory()
                if self.capacity is None and before is not None and after is not None:
                    self.capacity = batch_capacity(after - before)
        entry = self.checked[h]
        if entry[0] is None:
            m.status, m.reason = "unsupported", entry[1]
            self.log(f"evaluate: {self.backend} cannot run the {method} graph: {m.reason} (row status 'unsupported')")
            return
        outputs, peak, (m.device, m.device_note) = entry
        m.peak_memory_bytes = peak if m.device == self.device else None  # a GPU allocator says nothing of a CPU run
        if m.device != self.device and not self.said_device:
            self.said_device = True
            self.log(f"evaluate: warning: {self.backend} runs on {m.device}, not {self.device}: "
                     f"{m.device_note or 'the backend chose so'} (its rows say device {m.device})")
        diffs = [max_rel_diff([a], [b]) for a, b in zip(self.reference, outputs)]
        diffs = [float("inf") if d != d else d for d in diffs]
        tols = [output_tolerance(graph.types[v].dtype, self.tolerance) for v in graph.outputs]
        m.max_rel_diff = diff = max(diffs, default=0.0)
        if method == self.orig_name:
            self.base_diff = diff
        over = [k for k, (d, t) in enumerate(zip(diffs, tols)) if not d <= t]
        if over:
            tol = tols[over[0]]
            if method not in (self.orig_name, AA):
                also = (f"; the original on {self.backend} differs by {self.base_diff:.3g}"
                        if self.base_diff is not None else "")
                raise OutputMismatch(
                    f"{method} on {self.backend}: the optimised graph's outputs differ from the original's on "
                    f"onnxruntime by {diff:.3g} (max relative difference; tolerance {tol:g} for "
                    f"{graph.types[graph.outputs[over[0]]].dtype}, evaluate.tolerance {self.tolerance:g}; "
                    f"inputs seed {self.seed}{also}); nothing written")
            m.status = "mismatch"
            if method == self.orig_name:
                self.log(f"evaluate: warning: the original graph on {self.backend} differs from onnxruntime by "
                         f"{diff:.3g} (tolerance {tol:g}); its row has status 'mismatch'")

    def compare(self, graphs: Sequence[tuple[str, Graph]], protocol: Protocol, clock: Callable[[], float]) -> int:
        """The protocol's comparisons of every runnable graph with the original; the number of graphs timed."""
        orig = self.results[(self.orig_name, self.backend)]
        if orig.status == "unsupported":
            return 0
        units, shared = [], {}  # distinct runnable graphs after the original; method -> the unit it shares
        first_of: dict[str, str] = {}
        if any(m == AA for m, _ in graphs):  # a method that kept the original graph IS an A/A comparison
            first_of[self.hashes[self.orig_name]] = AA
        for method, g in graphs[1:]:
            if self.results[(method, self.backend)].status == "unsupported":
                continue
            h = self.hashes[method]
            if method != AA and h in first_of:  # the A/A control always gets its own sessions
                shared[method] = first_of[h]
                continue
            if method != AA:
                first_of[h] = method
            units.append((method, g))
        if not units:
            return 0
        size = len(units) if self.capacity is None else max(1, self.capacity - 1)
        original = graphs[0][1]
        orig_times: list[list[float]] = []
        for k in range(0, len(units), size):
            group = units[k:k + size]
            self.comparisons += 1
            comp = compare([(self.orig_name, original)] + group, self.feeds, protocol.for_graphs(1 + len(group)),
                           lambda g: new_runner(g, self.backend, self.device, self.fresh), clock=clock)
            orig_times += comp[self.orig_name].times_ms
            self.too_noisy |= comp.too_noisy
            for method, _ in group:
                self.results[(method, self.backend)].set_estimate(comp[method])
        orig.set_estimate(Estimate(self.orig_name, orig_times, ratio=1.0))
        for method, unit in shared.items():
            self.results[(method, self.backend)].set_estimate(self.results[(unit, self.backend)].estimate)
        for (method, b), m in self.results.items():
            if b == self.backend:
                m.too_noisy = self.too_noisy
        return 1 + len(units) + len(shared)


class _NoBar:
    def update(self, n=1):
        pass

    def set_postfix_str(self, s):
        pass

    def close(self):
        pass


def _progress_bar(total: int, progress: bool):
    """A tqdm bar on stderr over the backends."""
    if not progress:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="evaluate", file=sys.stderr, mininterval=1.0, disable=None, unit="backend")
