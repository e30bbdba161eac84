"""OpenXLA's CPU compiler through the PJRT C API of the ``xla-cpu-pjrt`` plugin (ctypes, no C++ build).

jaxlib accepts only MLIR modules, and its MLIR route changes an HLO module on the way in (reshapes dropped, ops
added), so it cannot feed a pass's output to the next pass faithfully. The plugin accepts an ``HloModuleProto``
(program format ``"hlo"``) and XLA's debug options as ``env_option_overrides`` of a ``CompileOptionsProto``: that
is all the pass worker needs. Only the few API entries used here are bound; their positions in ``PJRT_Api`` and
the argument structs follow ``include/pjrt_c_api.h`` shipped in the plugin (checked against its version at load).

Load this module only in the pass worker process: an XLA CHECK failure inside a compile aborts the process.
"""

from __future__ import annotations

import ctypes as C
import importlib.util
from pathlib import Path

from rlflow.errors import RLFlowError

# positions of the bound functions in PJRT_Api, after {struct_size, extension_start, PJRT_Api_Version}
_ERROR_DESTROY, _ERROR_MESSAGE, _PLUGIN_INITIALIZE, _CLIENT_CREATE, _CLIENT_COMPILE = 0, 1, 3, 10, 20
_LOADED_EXECUTABLE_DESTROY = 50
_HEADER = 8 + 8 + 24  # size_t struct_size, extension pointer, PJRT_Api_Version (size_t, pointer, int, int)
_ABI_MAJOR, _ABI_MINOR = 0, 81  # the header this binding was written against


class _Args(C.Structure):
    """Every PJRT argument struct starts with its size and an extension pointer."""

    def __init__(self, **kw):
        super().__init__(struct_size=C.sizeof(self), **kw)


def _struct(name: str, *fields: tuple[str, object]) -> type:
    return type(name, (_Args,), {"_fields_": [("struct_size", C.c_size_t), ("extension_start", C.c_void_p),
                                              *fields]})


_ErrorMessage = _struct("ErrorMessage", ("error", C.c_void_p), ("message", C.c_void_p), ("size", C.c_size_t))
_ErrorDestroy = _struct("ErrorDestroy", ("error", C.c_void_p))
_PluginInit = _struct("PluginInit")
_ClientCreate = _struct("ClientCreate", ("create_options", C.c_void_p), ("num_options", C.c_size_t),
                        ("kv_get", C.c_void_p), ("kv_get_arg", C.c_void_p), ("kv_put", C.c_void_p),
                        ("kv_put_arg", C.c_void_p), ("client", C.c_void_p), ("kv_try_get", C.c_void_p),
                        ("kv_try_get_arg", C.c_void_p))
_Program = _struct("Program", ("code", C.c_char_p), ("code_size", C.c_size_t), ("format", C.c_char_p),
                   ("format_size", C.c_size_t))
_Compile = _struct("Compile", ("client", C.c_void_p), ("program", C.POINTER(_Program)),
                   ("compile_options", C.c_char_p), ("compile_options_size", C.c_size_t),
                   ("executable", C.c_void_p))
_ExecutableDestroy = _struct("ExecutableDestroy", ("executable", C.c_void_p))


def plugin_path() -> Path:
    """The plugin's shared library (package ``xla-cpu-pjrt``)."""
    spec = importlib.util.find_spec("xla_plugins.xla_cpu_pjrt")
    if spec is None or not spec.submodule_search_locations:
        raise RLFlowError("package xla-cpu-pjrt is not installed (pip install -r envs/requirements.txt)")
    path = Path(list(spec.submodule_search_locations)[0]) / "xla_cpu_pjrt.so"
    if not path.exists():
        raise RLFlowError(f"{path}: missing from the xla-cpu-pjrt package")
    return path


class CpuCompiler:
    """One PJRT CPU client of the plugin. :meth:`compile` returns XLA's error message, or None on success."""

    def __init__(self, client: bool = True) -> None:
        """``client=False``: load and initialise the plugin only (no threads start); :meth:`create_client`
        before compiling (the pass worker forks a child per compile from a process that holds no client)."""
        self._lib = C.CDLL(str(plugin_path()))
        self._lib.GetPjrtApi.restype = C.c_void_p
        self._api = self._lib.GetPjrtApi()
        major = C.c_int.from_address(self._api + 16 + 16).value
        minor = C.c_int.from_address(self._api + 16 + 20).value
        if (major, minor) < (_ABI_MAJOR, _ABI_MINOR) or major != _ABI_MAJOR:
            raise RLFlowError(f"xla-cpu-pjrt: PJRT C API {major}.{minor}, this binding needs "
                              f"{_ABI_MAJOR}.{_ABI_MINOR}+")
        self._check(self._fn(_PLUGIN_INITIALIZE)(C.byref(_PluginInit())), "initialise the plugin")
        self._client = None
        if client:
            self.create_client()

    def create_client(self) -> None:
        create = _ClientCreate()
        self._check(self._fn(_CLIENT_CREATE)(C.byref(create)), "create a CPU client")
        self._client = create.client

    def _fn(self, index: int):
        address = C.c_void_p.from_address(self._api + _HEADER + 8 * index).value
        return C.CFUNCTYPE(C.c_void_p, C.c_void_p)(address)

    def _error(self, err) -> str | None:
        if not err:
            return None
        msg = _ErrorMessage(error=err)
        self._fn(_ERROR_MESSAGE)(C.byref(msg))
        text = C.string_at(msg.message, msg.size).decode(errors="replace")
        self._fn(_ERROR_DESTROY)(C.byref(_ErrorDestroy(error=err)))
        return text

    def _check(self, err, what: str) -> None:
        text = self._error(err)
        if text is not None:
            raise RLFlowError(f"xla-cpu-pjrt: cannot {what}: {text.splitlines()[0]}")

    def compile(self, module_proto: bytes, compile_options: bytes) -> str | None:
        """Compile a serialized HloModuleProto with a serialized CompileOptionsProto; free the executable."""
        program = _Program(code=module_proto, code_size=len(module_proto), format=b"hlo", format_size=3)
        args = _Compile(client=self._client, program=C.pointer(program), compile_options=compile_options,
                        compile_options_size=len(compile_options))
        error = self._error(self._fn(_CLIENT_COMPILE)(C.byref(args)))
        if args.executable:
            self._fn(_LOADED_EXECUTABLE_DESTROY)(C.byref(_ExecutableDestroy(executable=args.executable)))
        return error
