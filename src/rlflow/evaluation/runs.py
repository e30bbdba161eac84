"""Run the original graph and every method's optimised graph on every backend: check each one's outputs against
the original on onnxruntime, then time them interleaved.

Order of work, one backend at a time:

1. for each graph: build the backend's runner and run it once on the shared inputs (``make_inputs`` of the
   original, the configured seed). That first call compiles what the backend compiles (XLA), is where the peak
   memory is read on CUDA, and gives the outputs compared with the reference: the ORIGINAL graph run by
   onnxruntime on the CPU (:func:`rlflow.graph.exec.max_rel_diff`). A backend that is known, from the graph
   alone and before anything runs, to have no lowering for one of its ops (:func:`unsupported_reason`: an op
   without a TF lowering; tf-xla and an opaque op) is reported ``unsupported`` with the op's name and left out
   of the timing; the rest go on. Any exception while a runner is built or run is a failure of the stage
   (:class:`BackendFailure`, naming the method, backend and cause): a crash is never recorded as a row. Graphs that are the same computation (equal ``Graph.structural_hash``, e.g. two
   methods that found the same graph, or one that kept the original) share one runner: built once, timed once
   per method in every round, so their rows differ only by noise.
2. an optimised graph whose difference exceeds the tolerance stops everything (:class:`OutputMismatch`): wrong
   results are never timed, let alone reported as speedups. The original itself differing on a backend (the
   backend disagrees with onnxruntime) is reported ``mismatch`` and goes on; any optimised graph on that backend
   will then fail the check as well.
3. warm-up: ``warmup`` rounds, each calling every runner once; then ``repeats`` timed rounds, each timing every
   runner once, the order rotated by one each round so that every graph runs in every position equally often:
   machine noise and cache effects hit every method alike.

Memory. A runner can hold several copies of the weights (measured on paper-size BERT, 436 MB of weights, on the
CPU: onnxruntime about 1 GB per session, TensorFlow with Grappler about 4.5 GB, XLA about 2 GB), so five of them at
once can exhaust a machine. The first runner built for a backend (normally the original's) gives the footprint
(the process's resident memory before building it and after its first run); the methods' runners are then built
in batches that fit in :data:`MEMORY_FRACTION` of the memory available at that moment. The original's runner stays
alive and is timed, interleaved, with every batch (its latency is over all its timed calls); each batch's runners
are released before the next is built. When every method fits (the usual case) there is one batch, and every graph
is timed against every other. Linux only (``/proc``); elsewhere everything is one batch.

Latency: median and interquartile range of the timed calls (wall clock of ``runner(feeds)``, which returns host
numpy arrays, so a GPU run is complete when it returns). Peak memory: CUDA only, for the backends that report
it (torch: ``torch.cuda`` allocator; tf: TensorFlow's ``GPU:0`` allocator) -- the peak during the first call,
counted from before the runner was built (the graph's weights on the device plus its transient tensors).
onnxruntime and every CPU backend report none.
"""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from rlflow.errors import RLFlowError
from rlflow.graph.ir import Graph


class OutputMismatch(RLFlowError):
    """An optimised graph computes something else than the original (beyond the tolerance). Exit status 1, so
    that a wrong result is told apart from bad input (2)."""

    exit_code = 1


class BackendFailure(RLFlowError):
    """A backend raised while building or running a graph's runner (not a limitation known in advance)."""


def unsupported_reason(graph: Graph, backend: str) -> str | None:
    """Why ``backend`` cannot run ``graph``, decided from the graph alone before anything runs (the tf backends:
    an op without a TF lowering; tf-xla: an opaque op), naming the op; None if it should run."""
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
    median_ms: float | None = None
    iqr_ms: float | None = None
    peak_memory_bytes: int | None = None
    max_rel_diff: float | None = None
    reason: str = ""
    """Why the backend has no lowering for the graph (``unsupported``; :func:`unsupported_reason`)."""
    times_ms: list[float] | None = None


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


def runner_device(runner) -> str:
    """``cuda`` if the runner runs on the GPU, else ``cpu`` (the executors' own attributes)."""
    session = getattr(runner, "session", None)  # onnxruntime
    if session is not None:
        return "cuda" if session.get_providers()[0] == "CUDAExecutionProvider" else "cpu"
    dev = getattr(runner, "device", "cpu")  # torch.device, or TensorFlow's "/GPU:0" | "/CPU:0"
    return "cuda" if str(getattr(dev, "type", dev)).lower().lstrip("/").startswith(("cuda", "gpu")) else "cpu"


def first_run(graph: Graph, backend: str, device: str, feeds: dict) -> tuple[object, list, int | None]:
    """Build ``backend``'s runner for ``graph`` and run it once: (runner, outputs, peak bytes or None)."""
    from rlflow.graph.exec import get_runner

    mem = _gpu_memory(backend) if device == "cuda" else None
    base = mem[0]() if mem else 0
    runner = get_runner(graph, backend, device)
    if mem:
        mem[1]()
    outputs = runner(feeds)
    peak = int(mem[2]() - base) if mem else None
    return runner, outputs, peak


def _rotated(items: Sequence, k: int) -> list:
    k %= max(1, len(items))
    return list(items[k:]) + list(items[:k])


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


def evaluate_graphs(graphs: Sequence[tuple[str, Graph]], backends: Sequence[str], device: str, *, seed: int = 0,
                    warmup: int = 5, repeats: int = 20, tolerance: float = 1e-4, progress: bool = True,
                    log: Callable[[str], None] = print) -> list[Measurement]:
    """Measure every (method, graph) of ``graphs`` on every backend (see the module docstring). The first entry is
    the original graph, the reference. Returns one :class:`Measurement` per (method, backend), method-major in the
    given orders. Raises :class:`OutputMismatch` (nothing timed after it) when an optimised graph's outputs differ
    from the original's by more than ``tolerance`` on any backend."""
    from rlflow.graph.exec import make_inputs

    if repeats < 1 or warmup < 0:
        raise RLFlowError("run.repeats must be >= 1 and run.warmup >= 0")
    (orig_name, original), rest = graphs[0], list(graphs[1:])
    for method, g in rest:
        check_interface(original, g, f"{method}'s graph")
    feeds = make_inputs(original, seed)
    reference = reference_outputs(original, feeds)
    _release_memory()  # (the reference session's memory, before the first footprint is measured)
    hashes = {method: g.structural_hash() for method, g in graphs}
    results: dict[tuple[str, str], Measurement] = {}
    bar = _progress_bar(len(graphs) * len(backends), progress)
    try:
        for backend in backends:
            bar.set_postfix_str(backend)
            run = _BackendRun(backend, device, feeds, reference, tolerance, seed, orig_name, hashes, results, bar,
                              1.0 / (1 + warmup + repeats), log)
            t0 = time.perf_counter()
            anchor = run.build(orig_name, original)
            anchor_runs = [(orig_name, anchor)] if anchor is not None else []
            batches, i = 0, 0
            while batches == 0 or i < len(rest):
                batch, fresh = [], 0
                while i < len(rest) and (run.capacity is None or fresh < run.capacity
                                         or hashes[rest[i][0]] in run.built):  # a shared runner costs nothing
                    method, g = rest[i]
                    i += 1
                    fresh += hashes[method] not in run.built
                    runner = run.build(method, g)
                    if runner is not None:
                        batch.append((method, runner))
                run.time_interleaved(anchor_runs + batch, warmup, repeats, first_batch=batches == 0)
                batches += 1
                batch = runner = None
                run.drop_all_but(hashes[orig_name] if anchor is not None else None)
                _release_memory()
            ok = run.finish()
            anchor = anchor_runs = None
            run = None
            _release_memory()
            log(f"evaluate: {backend}: {ok} of {len(graphs)} graphs checked and timed in "
                f"{time.perf_counter() - t0:.1f} s" + (f" ({batches} batches, to stay within the memory available)"
                                                        if batches > 1 else ""))
    finally:
        bar.close()
    return [results[(method, b)] for method, _ in graphs for b in backends]


class _BackendRun:
    """One backend's runners: built (shared between equal graphs), checked, timed; the samples per method."""

    def __init__(self, backend, device, feeds, reference, tolerance, seed, orig_name, hashes, results, bar, step, log):
        self.backend, self.device, self.feeds, self.reference = backend, device, feeds, reference
        self.tolerance, self.seed, self.orig_name, self.hashes = tolerance, seed, orig_name, hashes
        self.results, self.bar, self.step, self.log = results, bar, step, log
        self.built: dict[str, tuple] = {}
        """structural hash -> (runner, outputs, peak bytes, device) or (None, reason) for the runners alive now."""
        self.capacity: int | None = None
        """Fresh runners per batch (None: no limit), from the first runner's footprint."""
        self.measured = False
        self.base_diff: float | None = None
        self.times: dict[str, list[float]] = {}

    def build(self, method: str, graph: Graph):
        """The method's runner (built, or shared with an equal graph's), checked; None if unsupported."""
        from rlflow.graph.exec import max_rel_diff

        m = self.results[(method, self.backend)] = Measurement(method, self.backend, "ok")
        h = self.hashes[method]
        if h not in self.built:
            reason = unsupported_reason(graph, self.backend)
            if reason is not None:  # known before running: a row 'unsupported', the rest go on
                self.built[h] = (None, reason)
                return self._unsupported(m, method)
            before = _rss_bytes()
            try:
                runner, outputs, peak = first_run(graph, self.backend, self.device, self.feeds)
            except Exception as e:  # noqa: BLE001 -- a crash is a failure of the stage, never a row
                raise BackendFailure(f"{method} on {self.backend} ({self.device}): the backend failed while building "
                                     f"or running the graph: {_first_line(e)}; nothing written") from e
            self.built[h] = (runner, outputs, peak, runner_device(runner))
            after = _rss_bytes()
            if not self.measured:
                self.measured = True
                self.capacity = batch_capacity(None if before is None or after is None else after - before)
        entry = self.built[h]
        if entry[0] is None:
            return self._unsupported(m, method)
        runner, outputs, peak, m.device = entry
        m.peak_memory_bytes = peak if m.device == self.device else None  # a GPU allocator says nothing of a CPU run
        diff = max_rel_diff(self.reference, outputs)
        m.max_rel_diff = diff = float("inf") if diff != diff else diff
        if method == self.orig_name:
            self.base_diff = diff
        if not diff <= self.tolerance:
            if method != self.orig_name:
                also = (f"; the original on {self.backend} differs by {self.base_diff:.3g}"
                        if self.base_diff is not None else "")
                raise OutputMismatch(
                    f"{method} on {self.backend}: the optimised graph's outputs differ from the original's on "
                    f"onnxruntime by {diff:.3g} (max relative difference; evaluate.tolerance {self.tolerance:g}, "
                    f"inputs seed {self.seed}{also}); nothing written")
            m.status = "mismatch"
            self.log(f"evaluate: warning: the original graph on {self.backend} differs from onnxruntime by "
                     f"{diff:.3g} (tolerance {self.tolerance:g}); its row has status 'mismatch'")
        self.times.setdefault(method, [])
        self.bar.update(self.step)
        return runner

    def _unsupported(self, m: Measurement, method: str) -> None:
        m.status, m.reason = "unsupported", self.built[self.hashes[method]][1]
        self.log(f"evaluate: {self.backend} cannot run the {method} graph: {m.reason} (row status 'unsupported')")
        self.bar.update(1.0)
        return None

    def drop_all_but(self, keep: str | None) -> None:
        """Release every runner but the one of hash ``keep`` (the original's)."""
        self.built = {h: e for h, e in self.built.items() if h == keep}

    def time_interleaved(self, runners: list, warmup: int, repeats: int, first_batch: bool) -> None:
        """``warmup`` rounds, then ``repeats`` timed rounds over ``runners``, rotated each round. The original's
        calls move the progress bar in the first batch only (it is timed again with every later batch)."""
        counted = sum(1 for method, _ in runners if first_batch or method != self.orig_name)
        for w in range(warmup):
            for _, runner in _rotated(runners, w):
                runner(self.feeds)
            self.bar.update(self.step * counted)
        for k in range(repeats):
            for method, runner in _rotated(runners, k):
                t0 = time.perf_counter()
                runner(self.feeds)
                self.times[method].append((time.perf_counter() - t0) * 1e3)
            self.bar.update(self.step * counted)

    def finish(self) -> int:
        """Latency statistics into the measurements; the number of graphs timed."""
        for method, ts in self.times.items():
            q1, med, q3 = np.percentile(ts, [25, 50, 75])
            m = self.results[(method, self.backend)]
            m.median_ms, m.iqr_ms, m.times_ms = float(med), float(q3 - q1), ts
        self.built = {}
        return len(self.times)


class _NoBar:
    def update(self, n=1):
        pass

    def set_postfix_str(self, s):
        pass

    def close(self):
        pass


def _progress_bar(total: int, progress: bool):
    """A tqdm bar on stderr over the (method, backend) runs (fractions while a backend's runs are interleaved)."""
    if not progress:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="evaluate", file=sys.stderr, mininterval=1.0, disable=None,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total} (method, backend) runs "
                           "[{elapsed}<{remaining}{postfix}]")
