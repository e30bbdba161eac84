"""The crash-isolated pass worker: XLA runs in a child process, and a crash there is an invalid action.

An XLA CHECK failure aborts the whole process, so every compile runs in ``python -m rlflow.xla.worker``, which
reads requests from stdin and answers on stdout (length-prefixed pickles). :class:`PassWorker` (the parent side)
starts it, restarts it after it dies, and turns a death or a timeout into a ``crash`` result.

One pass step (:meth:`_Worker.run_pass`, in the child): the module (``is_scheduled=true`` stripped) goes to XLA's CPU
compiler through the PJRT plugin with ``xla_disable_hlo_passes`` = every pass XLA knows except the chosen one
and the nested pipelines it runs in (:func:`rlflow.xla.passes.disabled_for`), ``xla_dump_to`` a fresh folder
and ``xla_cpu_parallel_codegen_split_count=0``, which makes code generation fail after the HLO passes. XLA has
by then dumped the module after the passes (``*cpu_after_optimizations.txt``): the step's result. A result with
the input's fingerprint is reported ``unchanged``.

Code generation can still take most of a step (on BERT, kernel emission runs ~150 ms after the dump, once the
call graph is flat), so each compile runs in a process forked from the worker (:func:`_compile`), which is
killed as soon as XLA has written the module after the passes. The worker itself never creates a PJRT client
(whose threads would make forking unsafe); each fork creates its own. An XLA abort inside a fork is a ``crash``
reply; the worker lives on.
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
import weakref
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


#: XLA writes this dump right after the module after its passes: once it exists, that module is complete
_DUMPED_AFTER = "cpu_after_optimizations-buffer-assignment.txt"


class CompileCrash(Exception):
    """The compiling fork died (an XLA CHECK failure aborts it)."""


def _dumped(folder: Path) -> bool:
    return any(e.name.endswith(_DUMPED_AFTER) for e in os.scandir(folder))


def _compile(compiler, proto: bytes, options: bytes, folder: Path | None = None) -> tuple[str | None, float]:
    """Compile in a forked process (its own PJRT client): (XLA's error message or None, the fork's CPU seconds).
    With ``folder`` (the compile's ``xla_dump_to``), the fork is killed as soon as XLA has dumped the module
    after its passes, and the message is None; without it, the compile runs to its end. Raises
    :class:`CompileCrash` when the fork dies first."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the fork: compile, send the error message, leave without running the worker's cleanup
        code = 0
        try:
            os.close(read)
            compiler.create_client()
            os.write(write, (compiler.compile(proto, options) or "").encode())
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    try:
        delay = 2e-4
        while True:
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                break
            if folder is not None and _dumped(folder):
                os.kill(pid, 9)
                usage = os.wait4(pid, 0)[2]
                return None, usage.ru_utime + usage.ru_stime
            time.sleep(delay)
            delay = min(2 * delay, 2e-3)
        message = os.read(read, 1 << 20).decode(errors="replace")
    finally:
        os.close(read)
    if os.WIFSIGNALED(status) or os.WEXITSTATUS(status) != 0:
        how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"status {os.WEXITSTATUS(status)}"
        raise CompileCrash(f"XLA's compile died ({how})")
    return message or None, usage.ru_utime + usage.ru_stime


def _scratch_root() -> str | None:
    """Where dump folders go: memory-backed /dev/shm when there is one (XLA writes 4-5 files a step)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@dataclass
class _Module:
    """A module the worker has seen: serialized proto (the compiler's input) and its stats."""

    proto: bytes
    stats: object  # rlflow.xla.hlo.HloStats


class _Worker:
    """The child's state: the compiler, one scratch dump folder (emptied after each compile), the compile
    options of each pass (serialized once) and the last modules seen, by their text: a step's output is the
    next step's input, so it is parsed, fingerprinted and serialized once, not again on the next step."""

    CACHE = 64

    def __init__(self, compiler, folder: Path) -> None:
        self.compiler, self.folder = compiler, folder
        self._options: dict[tuple[str, ...], bytes] = {}
        self._modules: dict[str, _Module] = {}

    def module(self, text: str) -> _Module:
        from rlflow.xla import hlo

        found = self._modules.pop(text, None)  # re-inserted: the dict's order is least recently used first
        if found is None:
            parsed = hlo.parse(text)
            found = _Module(parsed.as_serialized_hlo_module_proto(), hlo.module_stats(parsed))
        self._modules[text] = found
        while len(self._modules) > self.CACHE:
            self._modules.pop(next(iter(self._modules)))
        return found

    def _clear(self) -> None:
        for entry in os.scandir(self.folder):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)

    def run_pass(self, text: str, disabled: list[str]) -> dict:
        from rlflow.xla import hlo

        t0 = time.process_time()
        before = self.module(text)
        key = tuple(disabled)
        if key not in self._options:
            self._options[key] = _compile_options({
                "xla_disable_hlo_passes": ",".join(disabled), "xla_dump_to": str(self.folder),
                "xla_dump_hlo_as_text": True, "xla_dump_large_constants": True,
                "xla_cpu_parallel_codegen_split_count": 0})
        t1 = time.process_time()
        try:
            error, compile_s = _compile(self.compiler, before.proto, self._options[key], self.folder)
            t2 = time.process_time()
            out = _after_optimizations(self.folder)
        finally:
            self._clear()
        if out is None:
            return {"status": "error", "message": (error or "XLA dumped no module").splitlines()[0]}
        out = hlo.strip_schedule(out)
        after = self.module(out)
        cpu = {"compile_ms": compile_s * 1e3, "other_ms": (t1 - t0 + time.process_time() - t2) * 1e3}
        return {"status": "unchanged" if after.stats.fingerprint == before.stats.fingerprint else "ok",
                "text": out, "stats": after.stats.to_dict(), "cpu": cpu}

def _reference(compiler, text: str) -> dict:
    """XLA's own full compile of the module, dumping after every pass that changes it: the module just before
    its first target-specific pass (``layout-assignment``)."""
    from rlflow.xla import hlo
    from rlflow.xla.passes import FIRST_TARGET_SPECIFIC

    module = hlo.parse(text)
    folder = Path(tempfile.mkdtemp(prefix="rlflow-xla-"))
    try:
        _compile(compiler, module.as_serialized_hlo_module_proto(), _compile_options({
            "xla_dump_to": str(folder), "xla_dump_hlo_as_text": True, "xla_dump_large_constants": True,
            "xla_dump_hlo_pass_re": ".*"}), folder)  # stopped after the HLO passes: no code generation
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


def _serve(folder: Path) -> None:
    """Answer requests until stdin closes; ``folder``: the scratch dump folder (the parent's, which removes it
    even when XLA aborts this process)."""
    from rlflow.xla.pjrt import CpuCompiler

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write to the channel
    worker = _Worker(CpuCompiler(client=False), folder)
    _send(stdout, {"status": "ready", "pid": os.getpid()})
    while True:
        try:
            request = _recv(stdin)
        except EOFError:
            return
        kind = request["kind"]
        try:
            if kind == "pass":
                reply = worker.run_pass(request["text"], request["disabled"])
            elif kind == "stats":
                reply = {"status": "ok", "stats": worker.module(request["text"]).stats.to_dict()}
            elif kind == "reference":
                reply = _reference(worker.compiler, request["text"])
            elif kind == "crash":  # tests: an abort like an XLA CHECK failure
                os.abort()
            else:
                reply = {"status": "error", "message": f"unknown request {kind!r}"}
        except RLFlowError as exc:
            reply = {"status": "error", "message": str(exc)}
        except CompileCrash as exc:
            reply = {"status": "crash", "message": str(exc)}
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
    cpu: dict = field(default_factory=dict)
    """CPU time (all threads): ``compile_ms`` of the compiling fork, ``other_ms`` of the worker (the rest)"""

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
        self._scratch: str | None = None

    def _start(self) -> None:
        self._stderr = tempfile.TemporaryFile()
        self._scratch = tempfile.mkdtemp(prefix="rlflow-xla-", dir=_scratch_root())
        weakref.finalize(self, shutil.rmtree, self._scratch, True)  # also when never closed (at exit)
        self._proc = subprocess.Popen([sys.executable, "-m", "rlflow.xla.worker", self._scratch],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                      env=_child_env())
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
            reply = self._receive(self.timeout_s)
            if reply.get("status") == "crash":  # XLA died in the worker's compiling fork; the worker lives on
                self.crashes += 1
            return reply
        except (WorkerCrash, BrokenPipeError, OSError) as exc:
            self.crashes += 1
            self.close()
            return {"status": "crash", "message": str(exc)}

    def run_pass(self, text: str, disabled: list[str]) -> StepResult:
        t0 = time.perf_counter()
        reply = self.request("pass", text=text, disabled=disabled)
        return StepResult(reply["status"], reply.get("text"), reply.get("stats", {}), reply.get("message", ""),
                          time.perf_counter() - t0, reply.get("cpu", {}))

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
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
        self._proc, self._stderr, self._scratch = None, None, None

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
        _serve(Path(sys.argv[1]))
