"""The crash-isolated pass worker: XLA runs in a child process, and a crash there is an invalid action.

An XLA CHECK failure aborts the whole process, so every compile runs in ``python -m rlflow.xla.worker``, which
reads requests from stdin and answers on stdout (length-prefixed pickles). :class:`PassWorker` (the parent side)
starts it, restarts it after it dies, and turns a death or a timeout into a ``crash`` result.

One pass step (:func:`_run_pass`, in the child): the module (``is_scheduled=true`` stripped) goes to XLA's CPU
compiler through the PJRT plugin with ``xla_disable_hlo_passes`` = every pass XLA knows except the chosen one
and the nested pipelines it runs in (:func:`rlflow.xla.passes.disabled_for`), ``xla_dump_to`` a fresh folder
and ``xla_cpu_parallel_codegen_split_count=0``, which makes code generation fail at once after the HLO passes.
XLA has by then dumped the module after the passes (``*cpu_after_optimizations.txt``): the step's result. A
result with the input's fingerprint is reported ``unchanged``.
"""

from __future__ import annotations

import os
import pickle
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlflow.errors import RLFlowError

# ------------------------------------------------------------------------------------------------ wire format


def _send(stream, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _read_exact(stream, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = stream.read(n - got)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(stream):
    (n,) = struct.unpack("<Q", _read_exact(stream, 8))
    return pickle.loads(_read_exact(stream, n))


# ------------------------------------------------------------------------------------------------ child side


def _compile_options(overrides: dict[str, object]) -> bytes:
    from jax._src.lib import xla_client

    options = xla_client.CompileOptions()
    options.env_option_overrides = [(k, v) for k, v in overrides.items()]
    return options.SerializeAsString()


def _after_optimizations(folder: Path) -> str | None:
    found = sorted(folder.glob("*cpu_after_optimizations.txt"))
    return found[-1].read_text() if found else None


def _run_pass(compiler, text: str, disabled: list[str]) -> dict:
    from rlflow.xla import hlo

    module = hlo.parse(text)
    before = hlo.fingerprint(module)
    folder = Path(tempfile.mkdtemp(prefix="rlflow-xla-"))
    try:
        error = compiler.compile(module.as_serialized_hlo_module_proto(), _compile_options({
            "xla_disable_hlo_passes": ",".join(disabled), "xla_dump_to": str(folder), "xla_dump_hlo_as_text": True,
            "xla_cpu_parallel_codegen_split_count": 0}))
        out = _after_optimizations(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if out is None:
        return {"status": "error", "message": (error or "XLA dumped no module").splitlines()[0]}
    out = hlo.strip_schedule(out)
    stats = hlo.stats(out)
    return {"status": "unchanged" if stats.fingerprint == before else "ok", "text": out, "stats": stats.to_dict()}


def _reference(compiler, text: str) -> dict:
    """XLA's own full compile of the module, dumping after every pass that changes it: the module just before
    its first target-specific pass (``layout-assignment``)."""
    from rlflow.xla import hlo
    from rlflow.xla.passes import FIRST_TARGET_SPECIFIC

    module = hlo.parse(text)
    folder = Path(tempfile.mkdtemp(prefix="rlflow-xla-"))
    try:
        compiler.compile(module.as_serialized_hlo_module_proto(), _compile_options({
            "xla_dump_to": str(folder), "xla_dump_hlo_as_text": True, "xla_dump_hlo_pass_re": ".*"}))
        dumps = sorted(p for p in folder.glob("module_*.txt") if p.name.count(".") >= 4 and ".after_" in p.name)
        dumps.sort(key=lambda p: int(p.name.split(".")[2]))
        before = None
        for p in dumps:
            if f".after_{FIRST_TARGET_SPECIFIC}." in p.name:
                break
            before = p
        if before is None:
            return {"status": "error", "message": f"XLA dumped no module before {FIRST_TARGET_SPECIFIC}"}
        out = hlo.strip_schedule(before.read_text())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"status": "ok", "text": out, "stats": hlo.stats(out).to_dict()}


def _serve() -> None:
    from rlflow.xla import hlo
    from rlflow.xla.pjrt import CpuCompiler

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write to the channel
    compiler = CpuCompiler()
    _send(stdout, {"status": "ready", "pid": os.getpid()})
    while True:
        try:
            request = _recv(stdin)
        except EOFError:
            return
        kind = request["kind"]
        try:
            if kind == "pass":
                reply = _run_pass(compiler, request["text"], request["disabled"])
            elif kind == "stats":
                reply = {"status": "ok", "stats": hlo.stats(request["text"]).to_dict()}
            elif kind == "reference":
                reply = _reference(compiler, request["text"])
            elif kind == "crash":  # tests: an abort like an XLA CHECK failure
                os.abort()
            else:
                reply = {"status": "error", "message": f"unknown request {kind!r}"}
        except RLFlowError as exc:
            reply = {"status": "error", "message": str(exc)}
        _send(stdout, reply)


def _discover_log() -> None:
    """Compile a small transformer-like module with XLA's defaults (pass-pipeline logging is switched on by the
    parent's environment); print the module's name on stdout."""
    import jax
    import jax.numpy as jnp

    from rlflow.xla.pjrt import CpuCompiler
    from rlflow.xla import hlo

    def block(x, w):
        h = jnp.tanh(x @ w) + 1.0
        return jax.nn.softmax(h.reshape(2, -1) * 2.0, axis=-1).sum()

    text = jax.jit(block).lower(jnp.ones((4, 4)), jnp.ones((4, 4))).compiler_ir("hlo").as_hlo_text()
    module = hlo.parse(text)
    CpuCompiler().compile(module.as_serialized_hlo_module_proto(), _compile_options({}))
    print(module.name, flush=True)


# ------------------------------------------------------------------------------------------------ parent side


class WorkerCrash(Exception):
    """The worker died (or ran past its time) during a request."""


@dataclass
class StepResult:
    """One pass step: ``status`` ok | unchanged | crash | error (both last: an invalid action)."""

    status: str
    text: str | None = None
    stats: dict = field(default_factory=dict)
    message: str = ""
    seconds: float = 0.0

    @property
    def valid(self) -> bool:
        return self.status in ("ok", "unchanged")


def _child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["JAX_PLATFORMS"] = "cpu"
    env.update(extra or {})
    return env


class PassWorker:
    """The parent's handle on the worker process (started on first use, restarted after a crash)."""

    def __init__(self, timeout_s: float = 120.0):
        self.timeout_s = timeout_s
        self.crashes = 0
        self._proc: subprocess.Popen | None = None
        self._stderr = None

    def _start(self) -> None:
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen([sys.executable, "-m", "rlflow.xla.worker"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._stderr, env=_child_env())
        hello = self._receive(self.timeout_s)
        if hello.get("status") != "ready":
            raise RLFlowError(f"XLA pass worker failed to start: {hello}")

    def _stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        lines = [ln for ln in self._stderr.read().decode(errors="replace").splitlines() if ln.strip()]
        return lines[-1][:300] if lines else ""

    def _receive(self, timeout: float):
        assert self._proc is not None and self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        if not ready:
            raise WorkerCrash(f"no answer in {timeout:.0f} s")
        try:
            return _recv(self._proc.stdout)
        except (EOFError, pickle.UnpicklingError, struct.error):
            self._proc.wait()
            raise WorkerCrash(f"worker exited with status {self._proc.returncode}: {self._stderr_tail()}")

    def request(self, kind: str, **payload) -> dict:
        """One request; a dead or silent worker is killed, restarted on the next request, and reported as a
        ``crash`` reply."""
        if self._proc is None or self._proc.poll() is not None:
            try:
                self._start()
            except WorkerCrash as exc:
                self.close()
                raise RLFlowError(f"XLA pass worker failed to start: {exc}")
        try:
            assert self._proc is not None and self._proc.stdin is not None
            _send(self._proc.stdin, {"kind": kind, **payload})
            return self._receive(self.timeout_s)
        except (WorkerCrash, BrokenPipeError, OSError) as exc:
            self.crashes += 1
            self.close()
            return {"status": "crash", "message": str(exc)}

    def run_pass(self, text: str, disabled: list[str]) -> StepResult:
        t0 = time.perf_counter()
        reply = self.request("pass", text=text, disabled=disabled)
        return StepResult(reply["status"], reply.get("text"), reply.get("stats", {}), reply.get("message", ""),
                          time.perf_counter() - t0)

    def stats(self, text: str) -> dict:
        reply = self.request("stats", text=text)
        if reply["status"] != "ok":
            raise RLFlowError(f"HLO module: {reply.get('message', reply['status'])}")
        return reply["stats"]

    def reference(self, text: str) -> StepResult:
        """XLA's own compile: the module just before its target-specific passes."""
        reply = self.request("reference", text=text)
        return StepResult(reply["status"], reply.get("text"), reply.get("stats", {}), reply.get("message", ""))

    def kill(self) -> None:
        """Kill the worker process now (as a crash would)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def close(self) -> None:
        self.kill()
        if self._proc is not None:
            for s in (self._proc.stdin, self._proc.stdout):
                if s is not None:
                    s.close()
        if self._stderr is not None:
            self._stderr.close()
        self._proc, self._stderr = None, None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def discover_pipeline():
    """XLA's CPU pass pipeline, read from XLA's own pass-pipeline log of one compile (cached per process)."""
    global _PIPELINE
    if _PIPELINE is None:
        from rlflow.xla.passes import parse_log

        env = _child_env({"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "hlo_pass_pipeline=2"})
        proc = subprocess.run([sys.executable, "-m", "rlflow.xla.worker", "--discover"], capture_output=True,
                              text=True, env=env, timeout=600)
        if proc.returncode != 0 or not proc.stdout.strip():
            raise RLFlowError(f"XLA pass discovery failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        _PIPELINE = parse_log(proc.stderr, proc.stdout.strip().splitlines()[-1])
        if not _PIPELINE.target_independent:
            raise RLFlowError("XLA pass discovery: no pass found in XLA's log (is TF_CPP_VMODULE honoured?)")
    return _PIPELINE


_PIPELINE = None


if __name__ == "__main__":
    if sys.argv[1:] == ["--discover"]:
        _discover_log()
    else:
        _serve()
