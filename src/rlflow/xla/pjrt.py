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
# running a compiled module (XlaRuntime)
_EVENT_DESTROY, _EVENT_AWAIT, _CLIENT_DEVICES, _BUFFER_FROM_HOST = 5, 8, 16, 22
_EXECUTABLE_DESTROY, _EXECUTABLE_NUM_OUTPUTS, _LOADED_GET_EXECUTABLE, _LOADED_EXECUTE = 40, 44, 51, 55
_BUFFER_DESTROY, _BUFFER_ELEMENT_TYPE, _BUFFER_DIMENSIONS, _BUFFER_TO_HOST = 58, 59, 60, 70
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
_Devices = _struct("Devices", ("client", C.c_void_p), ("devices", C.POINTER(C.c_void_p)), ("num_devices", C.c_size_t))
_FromHost = _struct("FromHost", ("client", C.c_void_p), ("data", C.c_void_p), ("type", C.c_int),
                    ("dims", C.POINTER(C.c_int64)), ("num_dims", C.c_size_t), ("byte_strides", C.c_void_p),
                    ("num_byte_strides", C.c_size_t), ("host_buffer_semantics", C.c_int), ("device", C.c_void_p),
                    ("memory", C.c_void_p), ("device_layout", C.c_void_p), ("done_with_host_buffer", C.c_void_p),
                    ("buffer", C.c_void_p))
_Event = _struct("Event", ("event", C.c_void_p))
_Buffer = _struct("Buffer", ("buffer", C.c_void_p))
_ElementType = _struct("ElementType", ("buffer", C.c_void_p), ("type", C.c_int))
_Dimensions = _struct("Dimensions", ("buffer", C.c_void_p), ("dims", C.POINTER(C.c_int64)), ("num_dims", C.c_size_t))
_ToHost = _struct("ToHost", ("src", C.c_void_p), ("host_layout", C.c_void_p), ("dst", C.c_void_p),
                  ("dst_size", C.c_size_t), ("event", C.c_void_p))
_GetExecutable = _struct("GetExecutable", ("loaded_executable", C.c_void_p), ("executable", C.c_void_p))
_NumOutputs = _struct("NumOutputs", ("executable", C.c_void_p), ("num_outputs", C.c_size_t))
_ExecuteOptions = _struct("ExecuteOptions", ("send_callbacks", C.c_void_p), ("recv_callbacks", C.c_void_p),
                          ("num_send_ops", C.c_size_t), ("num_recv_ops", C.c_size_t), ("launch_id", C.c_int),
                          ("non_donatable_input_indices", C.c_void_p), ("num_non_donatable_input_indices", C.c_size_t),
                          ("context", C.c_void_p), ("call_location", C.c_char_p), ("num_tasks", C.c_size_t),
                          ("task_ids", C.c_void_p), ("incarnation_ids", C.c_void_p))
_Execute = _struct("Execute", ("executable", C.c_void_p), ("options", C.POINTER(_ExecuteOptions)),
                   ("argument_lists", C.c_void_p), ("num_devices", C.c_size_t), ("num_args", C.c_size_t),
                   ("output_lists", C.c_void_p), ("device_complete_events", C.c_void_p),
                   ("execute_device", C.c_void_p))

#: numpy dtype name -> PJRT_Buffer_Type (the enum's order in pjrt_c_api.h)
BUFFER_TYPES = {"bool": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "uint8": 6, "uint16": 7, "uint32": 8,
                "uint64": 9, "float16": 10, "float32": 11, "float64": 12}


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


class XlaRuntime(CpuCompiler):
    """A CPU client that also runs what it compiles: :meth:`load` an executable, :meth:`upload` host arrays,
    :meth:`execute` (waits for the results; fetches them to numpy with ``fetch``), :meth:`release`."""

    def __init__(self) -> None:
        super().__init__()
        devices = _Devices(client=self._client)
        self._check(self._fn(_CLIENT_DEVICES)(C.byref(devices)), "list the CPU devices")
        if devices.num_devices < 1:
            raise RLFlowError("xla-cpu-pjrt: the CPU client has no device")
        self._device = devices.devices[0]

    def load(self, module_proto: bytes, compile_options: bytes) -> tuple[int, int]:
        """(loaded executable, its number of outputs) of a serialized HloModuleProto."""
        program = _Program(code=module_proto, code_size=len(module_proto), format=b"hlo", format_size=3)
        args = _Compile(client=self._client, program=C.pointer(program), compile_options=compile_options,
                        compile_options_size=len(compile_options))
        self._check(self._fn(_CLIENT_COMPILE)(C.byref(args)), "compile the module")
        get = _GetExecutable(loaded_executable=args.executable)
        self._check(self._fn(_LOADED_GET_EXECUTABLE)(C.byref(get)), "read the executable")
        n = _NumOutputs(executable=get.executable)
        self._check(self._fn(_EXECUTABLE_NUM_OUTPUTS)(C.byref(n)), "count the outputs")
        self._fn(_EXECUTABLE_DESTROY)(C.byref(_ExecutableDestroy(executable=get.executable)))
        return args.executable, int(n.num_outputs)

    def upload(self, array) -> int:
        """A device buffer holding a copy of the numpy ``array`` (copied during the call)."""
        import numpy as np

        array = np.ascontiguousarray(array)
        kind = BUFFER_TYPES.get(array.dtype.name)
        if kind is None:
            raise RLFlowError(f"xla-cpu-pjrt: no buffer type for {array.dtype}")
        dims = (C.c_int64 * max(array.ndim, 1))(*array.shape)
        args = _FromHost(client=self._client, data=array.ctypes.data, type=kind, dims=dims, num_dims=array.ndim,
                         host_buffer_semantics=0, device=self._device)
        self._check(self._fn(_BUFFER_FROM_HOST)(C.byref(args)), "copy an input to the device")
        if args.done_with_host_buffer:
            self._await(args.done_with_host_buffer)
        return args.buffer

    def _await(self, event) -> None:
        try:
            self._check(self._fn(_EVENT_AWAIT)(C.byref(_Event(event=event))), "wait for an event")
        finally:
            self._fn(_EVENT_DESTROY)(C.byref(_Event(event=event)))

    def release(self, buffer=None, executable=None) -> None:
        if buffer:
            self._fn(_BUFFER_DESTROY)(C.byref(_Buffer(buffer=buffer)))
        if executable:
            self._fn(_LOADED_EXECUTABLE_DESTROY)(C.byref(_ExecutableDestroy(executable=executable)))

    def execute(self, loaded: tuple[int, int], buffers: list[int], fetch: bool = False):
        """Run the executable on the device ``buffers`` and wait for it; the outputs as numpy arrays with
        ``fetch``, else None (the output buffers are released either way)."""
        executable, n_out = loaded
        arg_list = (C.c_void_p * max(len(buffers), 1))(*buffers)
        arg_lists = (C.c_void_p * 1)(C.cast(arg_list, C.c_void_p))
        out_list = (C.c_void_p * max(n_out, 1))()
        out_lists = (C.c_void_p * 1)(C.cast(out_list, C.c_void_p))
        events = (C.c_void_p * 1)()
        options = _ExecuteOptions()
        args = _Execute(executable=executable, options=C.pointer(options), argument_lists=C.addressof(arg_lists),
                        num_devices=1, num_args=len(buffers), output_lists=C.addressof(out_lists),
                        device_complete_events=C.addressof(events))
        self._check(self._fn(_LOADED_EXECUTE)(C.byref(args)), "run the module")
        try:
            if events[0]:
                self._await(events[0])
            return [self._to_numpy(out_list[i]) for i in range(n_out)] if fetch else None
        finally:
            for i in range(n_out):
                self.release(buffer=out_list[i])

    def _to_numpy(self, buffer):
        import numpy as np

        kind = _ElementType(buffer=buffer)
        self._check(self._fn(_BUFFER_ELEMENT_TYPE)(C.byref(kind)), "read an output's type")
        dims = _Dimensions(buffer=buffer)
        self._check(self._fn(_BUFFER_DIMENSIONS)(C.byref(dims)), "read an output's shape")
        dtype = {v: k for k, v in BUFFER_TYPES.items()}.get(kind.type)
        if dtype is None:
            raise RLFlowError(f"xla-cpu-pjrt: output of buffer type {kind.type} not supported")
        out = np.empty([dims.dims[i] for i in range(dims.num_dims)], dtype)
        args = _ToHost(src=buffer, dst=out.ctypes.data, dst_size=out.nbytes)
        self._check(self._fn(_BUFFER_TO_HOST)(C.byref(args)), "copy an output to the host")
        if args.event:
            self._await(args.event)
        return out
