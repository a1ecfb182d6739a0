"""ONNX Runtime engine: runs an ``.onnx`` model with ``onnxruntime.InferenceSession``.

ONNX Runtime is the CPU default everywhere; the CUDA execution provider is used when it is asked
for and installed (``onnxruntime-gpu``). Every ONNX Runtime exception is translated into
:mod:`engines.exceptions` here, at the boundary, with ``raise ... from``.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as _ort_state

from engines.base import DYNAMIC, Engine, EngineInfo, TensorSpec
from engines.exceptions import (
    EngineClosedError,
    EngineLoadError,
    EngineRuntimeError,
    InputSpecError,
    OutOfMemoryError,
)

__all__ = ["BACKEND_NAME", "OnnxRuntimeEngine", "ProviderSpec", "read_opset_imports"]

logger = logging.getLogger(__name__)

BACKEND_NAME = "onnxruntime"

#: An execution provider: its name (``"CUDAExecutionProvider"`` or a short alias such as
#: ``"cuda"``), or ``(name, provider_options)`` as ``InferenceSession`` accepts,
#: e.g. ``("CUDAExecutionProvider", {"device_id": 1})``.
ProviderSpec = str | tuple[str, Mapping[str, Any]]

_CPU = "CPUExecutionProvider"
_CUDA = "CUDAExecutionProvider"

_PROVIDER_ALIASES = {
    "cpu": _CPU,
    "cuda": _CUDA,
    "tensorrt": "TensorrtExecutionProvider",
}

#: ONNX Runtime's type strings (``NodeArg.type``) for the element types numpy can hold.
_ORT_DTYPES: dict[str, np.dtype[Any]] = {
    f"tensor({ort_name})": np.dtype(np_name)
    for ort_name, np_name in [
        ("float", "float32"),
        ("float16", "float16"),
        ("double", "float64"),
        ("int8", "int8"),
        ("int16", "int16"),
        ("int32", "int32"),
        ("int64", "int64"),
        ("uint8", "uint8"),
        ("uint16", "uint16"),
        ("uint32", "uint32"),
        ("uint64", "uint64"),
        ("bool", "bool"),
    ]
}

_PRECISIONS = {np.dtype("float16"): "fp16", np.dtype("float64"): "fp64"}

#: Every exception class the ONNX Runtime binding defines (Fail, InvalidArgument, EPFail, ...).
_ORT_ERRORS: tuple[type[Exception], ...] = tuple(
    obj for obj in vars(_ort_state).values() if isinstance(obj, type) and issubclass(obj, Exception)
)

#: What ``InferenceSession()`` raises for a bad model or provider setting.
_LOAD_ERRORS: tuple[type[Exception], ...] = (*_ORT_ERRORS, RuntimeError, ValueError)

#: Lower-case fragments of ONNX Runtime / CUDA messages that mean "out of memory" (the BFC arena's
#: "Failed to allocate memory for requested buffer", CUDA error 2, cuBLAS/cuDNN alloc failures).
_OOM_MARKERS = (
    "out of memory",
    "failed to allocate memory",
    "bad_alloc",
    "bad allocation",
    "cudaerrormemoryallocation",
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",
)


class OnnxRuntimeEngine(Engine):
    """An ONNX model run by ONNX Runtime.

    IO specs come from the session: ONNX Runtime type strings (``"tensor(float)"``) become numpy
    dtypes, symbolic or unknown dimensions become ``-1`` (:data:`engines.base.DYNAMIC`). The first
    dimension of every input is the batch dimension. It should be dynamic; when a model was
    exported with a fixed first dimension (e.g. ``1``) it cannot batch, and ``max_batch_size`` is
    that fixed size whatever was asked for (and every batch must have exactly that size).
    ``info.precision`` is ``"fp16"`` when the first input is float16, ``"fp64"`` when it is
    float64, else ``"fp32"`` (an integer input normally feeds an fp32 graph).

    Thread safety: ``InferenceSession.run`` may be called from several threads at once (ONNX
    Runtime documents sessions as thread-safe for ``Run``), so one engine can be shared by the
    CPU executor's worker threads. :meth:`close` while a batch runs lets that batch finish.

    Args:
        model_path: The ``.onnx`` file.
        max_batch_size: Largest batch :meth:`infer` accepts (items). Ignored when the model has a
            fixed batch dimension (see above).
        intra_op_threads: Threads ONNX Runtime uses inside one operator (e.g. a GEMM); ``None``
            or ``0`` lets ONNX Runtime choose (one per physical core).
        inter_op_threads: Threads running independent graph nodes concurrently. ONNX Runtime
            only uses them in parallel execution mode, so a value above 1 switches the session
            to ``ORT_PARALLEL``; ``None`` keeps the sequential default.
        providers: Execution providers in order of preference, names or
            ``(name, options)`` pairs (see :data:`ProviderSpec`); ``None`` means CPU only.
            Providers not installed here are skipped with a logged warning, and the CPU provider
            is always appended as the fallback.

    Raises:
        EngineLoadError: The file is missing or unreadable, it is not a model ONNX Runtime can
            load, an option is invalid, a provider name is unknown, or an input has an element
            type numpy cannot hold or no batch dimension, or the model has no inputs.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        max_batch_size: int = 256,
        intra_op_threads: int | None = None,
        inter_op_threads: int | None = None,
        providers: Sequence[ProviderSpec] | None = None,
    ) -> None:
        path = Path(model_path)
        if max_batch_size < 1:
            raise EngineLoadError(f"max_batch_size must be at least 1, got {max_batch_size}")
        for option, value in (
            ("intra_op_threads", intra_op_threads),
            ("inter_op_threads", inter_op_threads),
        ):
            if value is not None and value < 0:
                raise EngineLoadError(
                    f"{option} must be 0 or more (0 or None: ONNX Runtime's default), got {value}"
                )
        if not path.is_file():
            raise EngineLoadError(
                f"ONNX model {str(path)!r} does not exist or is not a file; "
                "check the model path (relative paths resolve from the working directory "
                f"{os.getcwd()!r})"
            )
        sha256 = _sha256(path)

        options = ort.SessionOptions()
        if intra_op_threads is not None:
            options.intra_op_num_threads = intra_op_threads
        if inter_op_threads is not None:
            options.inter_op_num_threads = inter_op_threads
            if inter_op_threads > 1:
                options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
        names, provider_options = _resolve_providers(providers)
        try:
            session = ort.InferenceSession(
                str(path), options, providers=names, provider_options=provider_options
            )
        except _LOAD_ERRORS as exc:
            raise EngineLoadError(
                f"ONNX Runtime {ort.__version__} could not load {str(path)!r}: {_message(exc)}; "
                "check that it is a valid ONNX model (onnx.checker.check_model) whose opset "
                "this ONNX Runtime supports, or re-export it"
            ) from exc

        self._session: ort.InferenceSession | None = session
        self.inputs = tuple(_spec(arg, path) for arg in session.get_inputs())
        self.outputs = tuple(_spec(arg, path) for arg in session.get_outputs())
        self._output_names = [spec.name for spec in self.outputs]
        self._path = path
        max_batch = _batch_limit(self.inputs, max_batch_size, path)

        active = session.get_providers()
        try:
            opsets = read_opset_imports(path)
        except (ValueError, OSError):
            # ONNX Runtime also loads its own flatbuffer ".ort" format, which has no opset list.
            opsets = {}
        self.info = EngineInfo(
            backend=BACKEND_NAME,
            model_path=str(path),
            model_sha256=sha256,
            version=ort.__version__,
            device=_device(session, active),
            precision=_PRECISIONS.get(self.inputs[0].dtype, "fp32"),
            max_batch_size=max_batch,
            extra={"providers": list(active), "opsets": opsets},
        )

    def infer_impl(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run a validated batch with ``session.run``. See :meth:`Engine.infer`.

        Raises:
            InputSpecError: ONNX Runtime rejected the feeds (``InvalidArgument``).
            OutOfMemoryError: ONNX Runtime or CUDA ran out of memory (retriable).
            EngineRuntimeError: Any other ONNX Runtime failure (retriable).
        """
        session = self._session  # a local reference keeps a concurrent close() harmless
        if session is None:
            raise EngineClosedError("the engine is closed; load it again")
        try:
            results = session.run(None, dict(feeds))
        except MemoryError as exc:
            raise OutOfMemoryError(
                f"out of host memory running {self._path.name}; use smaller batches"
            ) from exc
        except _ORT_ERRORS as exc:
            raise _translate_run_error(exc, self._path) from exc
        return dict(zip(self._output_names, results, strict=True))

    def close_impl(self) -> None:
        # ONNX Runtime frees the session when the last reference goes; in-flight runs hold one.
        self._session = None


def _message(exc: Exception) -> str:
    """ONNX Runtime's message without its trailing period/newline, to append our own advice."""
    return str(exc).strip().rstrip(".")


def _translate_run_error(exc: Exception, path: Path) -> Exception:
    message = _message(exc)
    if any(marker in message.lower() for marker in _OOM_MARKERS):
        return OutOfMemoryError(
            f"ONNX Runtime ran out of memory running {path.name}: {message}; "
            "use smaller batches or fewer concurrent runs"
        )
    if isinstance(exc, _ort_state.InvalidArgument):
        return InputSpecError(
            f"ONNX Runtime rejected the inputs of {path.name}: {message}; check the feeds "
            "against engine.inputs"
        )
    return EngineRuntimeError(f"ONNX Runtime failed running {path.name}: {message}")


def _resolve_providers(
    providers: Sequence[ProviderSpec] | None,
) -> tuple[list[str], list[dict[str, Any]]]:
    """Provider names and options for ``InferenceSession``: known, installed, CPU last."""
    known = set(ort.get_all_providers())
    installed = set(ort.get_available_providers())
    names: list[str] = []
    options: list[dict[str, Any]] = []
    for entry in providers or ():
        name, opts = (entry, {}) if isinstance(entry, str) else (entry[0], dict(entry[1]))
        name = _PROVIDER_ALIASES.get(name.lower(), name)
        if name not in known:
            raise EngineLoadError(
                f"unknown ONNX Runtime execution provider {name!r}; use one of "
                f"{', '.join(sorted(_PROVIDER_ALIASES))} or a full name such as "
                f"{_CUDA!r} (installed here: {', '.join(sorted(installed))})"
            )
        if name not in installed:
            logger.warning(
                "ONNX Runtime execution provider %s is not installed here (installed: %s); "
                "skipping it. For CUDA install onnxruntime-gpu instead of onnxruntime.",
                name,
                ", ".join(sorted(installed)),
            )
            continue
        if name not in names:
            names.append(name)
            options.append(opts)
    if _CPU not in names:
        names.append(_CPU)
        options.append({})
    return names, options


def _spec(arg: Any, path: Path) -> TensorSpec:
    """TensorSpec from an ONNX Runtime ``NodeArg`` (``name``, ``type``, ``shape``)."""
    dtype = _ORT_DTYPES.get(arg.type)
    if dtype is None:
        raise EngineLoadError(
            f"tensor {arg.name!r} of {str(path)!r} has type {arg.type}, which this engine "
            f"does not support (supported: {', '.join(sorted(_ORT_DTYPES))}); re-export the "
            "model with numeric tensor inputs and outputs"
        )
    shape = tuple(d if isinstance(d, int) and d >= 0 else DYNAMIC for d in arg.shape or ())
    return TensorSpec(arg.name, dtype, shape)


def _batch_limit(inputs: Sequence[TensorSpec], requested: int, path: Path) -> int:
    """``requested``, or the fixed batch size when inputs have a fixed first dimension."""
    if not inputs:
        raise EngineLoadError(
            f"{str(path)!r} has no inputs, so there is nothing to batch; serve a model that "
            "takes its data as a batched input tensor"
        )
    fixed: set[int] = set()
    for spec in inputs:
        if not spec.shape:
            raise EngineLoadError(
                f"input {spec.name!r} of {str(path)!r} is a scalar, so the model cannot take "
                "a batch; re-export it with a leading batch dimension (torch.onnx.export "
                f"dynamic_axes={{{spec.name!r}: {{0: 'batch'}}}})"
            )
        if spec.shape[0] != DYNAMIC:
            fixed.add(spec.shape[0])
    if len(fixed) > 1:
        raise EngineLoadError(
            f"the inputs of {str(path)!r} have different fixed first dimensions "
            f"{sorted(fixed)}, so no batch fits all of them; re-export with a dynamic batch axis"
        )
    return fixed.pop() if fixed else requested


def _device(session: ort.InferenceSession, active: Sequence[str]) -> str:
    if _CUDA in active:
        device_id = session.get_provider_options().get(_CUDA, {}).get("device_id", "0")
        return f"cuda:{device_id}"
    return "cpu"


def _sha256(path: Path) -> str:
    try:
        with path.open("rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as exc:
        raise EngineLoadError(
            f"cannot read ONNX model {str(path)!r}: {exc.strerror}; check its permissions"
        ) from exc


def read_opset_imports(model_path: str | os.PathLike[str]) -> dict[str, int]:
    """Operator set versions an ONNX model imports, without loading the model.

    Reads only the top-level fields of the ``ModelProto`` protobuf and seeks over the rest (the
    graph and its weights), so it is cheap for large models and needs no ``onnx`` package.
    Field numbers are from onnx/onnx.proto: ``ModelProto.opset_import = 8``,
    ``OperatorSetIdProto.domain = 1``, ``OperatorSetIdProto.version = 2``.

    Args:
        model_path: The ``.onnx`` file.

    Returns:
        Version by domain; ``""`` is the default ``ai.onnx`` domain, e.g.
        ``{"": 17, "com.microsoft": 1}``.

    Raises:
        ValueError: The file is not a well-formed protobuf.
        OSError: The file cannot be read.
    """
    opsets: dict[str, int] = {}
    with open(model_path, "rb") as f:
        for field, value in _fields(f, read_payload_of=8):
            if field == 8 and isinstance(value, bytes):
                domain, version = "", 0
                for sub_field, sub_value in _fields(io.BytesIO(value), read_payload_of=None):
                    if sub_field == 1 and isinstance(sub_value, bytes):
                        domain = sub_value.decode("utf-8")
                    elif sub_field == 2 and isinstance(sub_value, int):
                        version = sub_value
                opsets[domain] = version
    return opsets


def _fields(f: BinaryIO, *, read_payload_of: int | None) -> list[tuple[int, int | bytes | None]]:
    """Protobuf fields of a message as ``(field_number, value)``.

    Length-delimited payloads are read only for field ``read_payload_of`` (all of them when it is
    None) and seeked over otherwise (value ``None``); varints are decoded.
    """
    fields: list[tuple[int, int | bytes | None]] = []
    while first := f.read(1):
        key = _varint(f, first[0])
        field, wire_type = key >> 3, key & 7
        if field == 0:
            raise ValueError("protobuf field number 0")
        value: int | bytes | None = None
        if wire_type == 0:
            value = _varint(f)
        elif wire_type in (1, 5):  # fixed64, fixed32
            _skip(f, 8 if wire_type == 1 else 4)
        elif wire_type == 2:
            length = _varint(f)
            if read_payload_of is None or field == read_payload_of:
                value = f.read(length)
                if len(value) != length:
                    raise ValueError("truncated protobuf field")
            else:
                _skip(f, length)
        else:
            raise ValueError(f"unsupported protobuf wire type {wire_type}")
        fields.append((field, value))
    return fields


def _skip(f: BinaryIO, n: int) -> None:
    target = f.tell() + n
    if target > f.seek(0, io.SEEK_END):  # seek() alone would happily move past the end
        raise ValueError("truncated protobuf field")
    f.seek(target)


def _varint(f: BinaryIO, first: int | None = None) -> int:
    """Decode a base-128 varint; ``first`` is its first byte when the caller already read it."""
    result = shift = 0
    byte = first
    while True:
        if byte is None:
            data = f.read(1)
            if not data:
                raise ValueError("truncated protobuf varint")
            byte = data[0]
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result
        shift += 7
        if shift > 63:
            raise ValueError("protobuf varint longer than 10 bytes")
        byte = None
