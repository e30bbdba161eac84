"""Executors: run a graph end to end on a backend and time it.

Backends: ``ort`` (onnxruntime on the exported ONNX; CUDA provider when device is cuda), ``torch`` (the IR
interpreted with the ops' torch reference semantics), ``tf`` (a ``tf.function`` built op by op, Grappler on)
and ``tf-xla`` (the same with ``jit_compile=True``), ``jax`` (the IR lowered op by op into ``jax.jit``, XLA CPU).
Every runner is a callable ``feeds -> list of outputs``
(numpy arrays, in the graph's output order).
"""

from __future__ import annotations

import os
import re
import sys
import time
from contextlib import contextmanager
from typing import Callable

import numpy as np

from rlflow.errors import RLFlowError
from rlflow.graph.exec.errors import _NODE_PATTERNS, NodeRunError, error_message
from rlflow.graph.ir import Graph, Node

BACKENDS = ("ort", "torch", "tf", "tf-xla", "jax")

Runner = Callable[[dict[str, np.ndarray]], list[np.ndarray]]


def make_inputs(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs for ``graph``: floats ~ N(0, 1); integer inputs in the valid index range of the Gather
    that reads them (e.g. token ids below the vocabulary size), else in [0, 2); booleans uniform."""
    check_memory(graph)
    rng = np.random.default_rng(seed)
    feeds = {}
    cons = graph.consumers()
    for name in graph.inputs:
        t = graph.types[name]
        if t.dtype.startswith("float"):
            feeds[name] = rng.standard_normal(t.shape).astype(t.dtype)
        elif t.dtype == "bool":
            feeds[name] = rng.integers(0, 2, t.shape).astype(bool)
        else:
            bound = 2
            limits = [graph.types[graph.nodes[i].inputs[0]].shape[graph.nodes[i].attrs["axis"]]
                      for i in cons.get(name, []) if graph.nodes[i].op == "Gather" and graph.nodes[i].inputs[1] == name]
            if limits:
                bound = min(limits)
            feeds[name] = rng.integers(0, bound, t.shape).astype(t.dtype)
    return feeds


def get_runner(graph: Graph, backend: str, device: str = "cpu") -> Runner:
    if backend == "ort":
        from rlflow.graph.exec.ort_exec import OrtRunner

        return OrtRunner(graph, device)
    if backend == "torch":
        from rlflow.graph.exec.torch_exec import TorchRunner

        return TorchRunner(graph, device)
    if backend in ("tf", "tf-xla"):
        from rlflow.graph.exec.tf_exec import TFRunner

        return TFRunner(graph, device, xla=backend == "tf-xla")
    if backend == "jax":
        from rlflow.graph.exec.jax_exec import JaxRunner

        return JaxRunner(graph, device)
    raise RLFlowError(f"unknown backend '{backend}' (choose from {', '.join(BACKENDS)})")


class FreshRunners:
    """Fresh runners of a few graphs on one backend, many times each (the measurement protocol builds one per graph
    and session). For onnxruntime each graph is exported to an ONNX file once, in a temporary folder, and every
    session is built from that file: exporting and serialising paper-size BERT took 1.2 s of a 1.8 s session
    build, 40 times per evaluate run. The graphs must not change while this lives; :meth:`close` (or the end of
    a ``with`` block) removes the files."""

    def __init__(self, backend: str, device: str = "cpu"):
        self.backend, self.device = backend, device
        self._files: dict[int, tuple[Graph, str]] = {}  # id(graph) -> (graph, its ONNX file); the graph is held
        self._dir = None                                # so that its id is not reused

    def __call__(self, graph: Graph) -> Runner:
        if self.backend != "ort":
            return get_runner(graph, self.backend, self.device)
        from rlflow.graph.exec.ort_exec import OrtRunner

        hit = self._files.get(id(graph))
        if hit is None:
            import tempfile
            from pathlib import Path

            from rlflow.graph.onnx_io import to_onnx

            if self._dir is None:
                self._dir = tempfile.TemporaryDirectory(prefix="rlflow-runners-")
            path = str(Path(self._dir.name) / f"{len(self._files)}.onnx")
            Path(path).write_bytes(to_onnx(graph).SerializeToString())
            hit = self._files[id(graph)] = (graph, path)
        return OrtRunner(graph, self.device, model_path=hit[1])

    def close(self) -> None:
        self._files.clear()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> "FreshRunners":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def time_runner(runner: Runner, feeds: dict[str, np.ndarray], warmup: int = 5, repeats: int = 20) -> dict:
    """Latency of ``runner(feeds)``: ``warmup`` untimed calls, then ``repeats`` timed ones.
    Returns median and interquartile range in milliseconds, and the runner's peak memory where it can tell."""
    if repeats < 1:
        raise RLFlowError("repeats must be >= 1")
    for _ in range(warmup):
        runner(feeds)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner(feeds)
        times.append((time.perf_counter() - t0) * 1e3)
    q1, med, q3 = np.percentile(times, [25, 50, 75])
    peak = getattr(runner, "peak_memory_bytes", lambda: None)()
    return {"median_ms": float(med), "iqr_ms": float(q3 - q1), "min_ms": float(min(times)), "repeats": repeats,
            "warmup": warmup, "peak_memory_bytes": peak}


def max_rel_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """The project's output-equality measure: over all outputs, max |a - b| / max(1, max |a|), taken over the
    finite entries of ``a`` (each output on its own finite scale), or ``inf`` where the outputs cannot be equal:
    their shapes differ, or their NaN and infinite entries differ in position or value (NaN matches NaN, +inf
    matches +inf only). So [1, 2] vs [1, NaN] is inf, NaN vs NaN is 0, and [1, inf] vs [5, inf] is 4."""
    worst = 0.0
    for x, y in zip(a, b):
        x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if x64.shape != y64.shape:
            return float("inf")
        odd = ~np.isfinite(x64)
        if not np.array_equal(odd, ~np.isfinite(y64)):
            return float("inf")  # NaN or +-inf in one output where the other is finite
        if odd.any():
            if not np.array_equal(x64[odd], y64[odd], equal_nan=True):
                return float("inf")  # NaN vs inf, or inf vs -inf
            x64, y64 = x64[~odd], y64[~odd]
        if x64.size == 0:
            continue
        scale = max(1.0, float(np.max(np.abs(x64))))
        worst = max(worst, float(np.max(np.abs(x64 - y64))) / scale)
    return worst


#: the least tolerance an output check allows an output of a low-precision type (relative, as max_rel_diff): its
#: rounding alone moves a rewritten graph's outputs by about this much (float16 keeps 11 significant bits,
#: bfloat16 8)
DTYPE_TOLERANCE = {"float16": 1e-2, "bfloat16": 5e-2}


def output_tolerance(dtype: str, tol: float) -> float:
    """The tolerance of an output check of an output of ``dtype``, given the configured ``tol`` (float32's):
    ``tol``, or :data:`DTYPE_TOLERANCE`'s figure where that is larger."""
    return max(tol, DTYPE_TOLERANCE.get(dtype, 0.0))


# ------------------------------------------------------------------------------------ memory and run errors
#: a run needing more than this much memory is announced with a one-line note on stderr (see check_memory)
NOTE_BYTES = 1 << 30


def memory_needed(graph: Graph) -> int:
    """Bytes of memory one run of ``graph`` needs, at least: its weights and inputs, plus the largest set of
    intermediate tensors alive at once when each is freed after its last use (the nodes in graph order)."""
    keep = set(graph.inputs) | set(graph.outputs) | set(graph.constants)
    last_use: dict[str, int] = {}
    for i, n in enumerate(graph.nodes):
        for v in n.inputs:
            last_use[v] = i
    live = sum(graph.types[v].nbytes for v in graph.inputs)
    peak = live
    for i, n in enumerate(graph.nodes):
        live += sum(graph.types[v].nbytes for v in n.outputs)
        peak = max(peak, live)
        live -= sum(graph.types[v].nbytes for v in set(n.inputs) | set(n.outputs)
                    if v and v not in keep and last_use.get(v, -1) <= i)
    return peak + sum(c.type.nbytes for c in graph.constants.values())


def available_memory() -> int:
    """Bytes of memory this machine has available now (free plus reclaimable)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _size(n: int) -> str:
    for unit, k in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k:
            return f"{n / (1 << k):.1f} {unit}"
    return f"{n} bytes"


def check_memory(graph: Graph, what: str | None = None, note: bool = False) -> int:
    """Refuse, with one line naming the largest input and its size, a graph whose run needs more memory
    (:func:`memory_needed`) than the machine has available; with ``note``, also say in one line on stderr when
    the run needs more than :data:`NOTE_BYTES` (it will be slow). ``what`` names the model (default: its graph
    name). Returns the bytes needed."""
    need = memory_needed(graph)
    if need <= NOTE_BYTES:
        return need
    what = what or f"graph '{graph.name}'"
    sizes = {v: graph.types[v].nbytes for n in graph.nodes for v in n.outputs}
    sizes.update((v, graph.types[v].nbytes) for v in graph.inputs)
    big_in = max(graph.inputs, key=sizes.__getitem__, default=None)
    big = max(sizes, key=sizes.__getitem__, default=None)
    about = [f"input '{big_in}' {graph.types[big_in]} is {_size(sizes[big_in])}"] if big_in is not None else []
    if big is not None and big != big_in and sizes[big] > 2 * sizes.get(big_in, 0):
        about.append(f"tensor '{big}' {graph.types[big]} is {_size(sizes[big])}")
    about_text = f" ({'; '.join(about)})" if about else ""
    have = available_memory()
    if need > have:
        raise RLFlowError(f"{what}: running the model needs about {_size(need)} of memory, more than the "
                          f"{_size(have)} available{about_text}")
    if note:
        print(f"rlflow: note: {what}: running the model needs about {_size(need)} of memory{about_text}; "
              "expect it to be slow", file=sys.stderr)
    return need


def _node_named(graph: Graph, name: str) -> Node | None:
    """The graph's node called ``name``, or whose name the exported helper node ``name`` extends (gelu_erf)."""
    best = None
    for n in graph.nodes:
        if name == n.name:
            return n
        if name.startswith(n.name + "_") and (best is None or len(n.name) > len(best.name)):
            best = n
    return best


def run_error(graph: Graph, backend: str, e: BaseException, feeds: dict[str, np.ndarray] | None = None
              ) -> NodeRunError:
    """``e``, raised by ``backend`` building or running ``graph``, as a one-line error naming the node. When the
    backend's message names no node of the graph, the graph is run on the torch interpreter node by node (with
    ``feeds``) to find the one that fails."""
    if isinstance(e, NodeRunError):
        return e
    text, msg = str(e), error_message(e)
    for pat in _NODE_PATTERNS:
        m = re.search(pat, text)
        node = _node_named(graph, m.group(1)) if m else None
        if node is not None:
            return NodeRunError(node, backend, msg)
    if feeds is not None and backend != "torch" and not isinstance(e, MemoryError):
        try:
            get_runner(graph, "torch")(feeds)
        except NodeRunError as found:
            return NodeRunError(found.node, backend, msg)
        except Exception:  # noqa: BLE001 -- only a way to find the node; the backend's message is the error
            pass
    return NodeRunError(None, backend, msg)


@contextmanager
def backend_errors(graph: Graph, backend: str, feeds: dict[str, np.ndarray] | None = None, what: str | None = None):
    """Inside this block, any error of ``backend`` building or running ``graph`` becomes a one-line RLFlowError,
    prefixed with ``what`` (e.g. the file), naming the node that failed (see :func:`run_error`)."""
    prefix = f"{what}: " if what else ""
    try:
        yield
    except NodeRunError as e:
        raise RLFlowError(f"{prefix}{e}") from None
    except RLFlowError:
        raise
    except Exception as e:  # noqa: BLE001 -- onnxruntime, torch and TensorFlow raise their own types
        raise RLFlowError(f"{prefix}{run_error(graph, backend, e, feeds)}") from None


def run_model(graph: Graph, backend: str, feeds: dict[str, np.ndarray], device: str = "cpu",
              what: str | None = None) -> list[np.ndarray]:
    """Build ``backend``'s runner for ``graph`` and run it once on ``feeds``, errors as in :func:`backend_errors`."""
    with backend_errors(graph, backend, feeds, what):
        return get_runner(graph, backend, device)(feeds)
