# ruff: noqa: E501 - error messages imitate TensorRT's long one-line messages
"""An in-repo stand-in for the TensorRT 10 Python API, computing with numpy.

**This is not TensorRT and nothing here has run on real TensorRT.** TensorRT cannot be installed
on the machines this project is developed and tested on, so the TensorRT backend
(:mod:`engines.tensorrt`) is type-checked against the ``tensorrt-stubs`` package and exercised
against this module, which follows the real API's class, method and attribute names, argument
order, return conventions and error behaviour for the subset the backend uses:

- builder: ``Builder(logger)``, ``create_network(flags)``, ``OnnxParser(network, logger)`` with
  ``parse``/``num_errors``/``get_error``, ``create_builder_config``, ``set_memory_pool_limit``,
  ``set_flag(BuilderFlag.FP16 | INT8)``, ``int8_calibrator`` (an ``IInt8EntropyCalibrator2``
  subclass is driven as TensorRT drives it: ``read_calibration_cache``, ``get_batch_size``,
  ``get_batch`` until it returns None, ``write_calibration_cache``), optimization profiles
  (``create_optimization_profile``, ``set_shape``, ``add_optimization_profile``,
  ``set_calibration_profile``), the timing cache (``create_timing_cache``, ``set_timing_cache``,
  ``serialize``), ``progress_monitor`` (an ``IProgressMonitor`` can cancel the build),
  ``build_serialized_network`` (returns None and logs an error on failure);
- runtime: ``Runtime(logger).deserialize_cuda_engine`` (None plus a logged error for a corrupt
  plan or one from another version), ``num_io_tensors``, ``get_tensor_name/mode/dtype/shape``,
  ``num_optimization_profiles``, ``get_tensor_profile_shape``, ``create_execution_context``,
  ``set_optimization_profile_async``, ``set_input_shape`` (False outside the active profile),
  ``set_tensor_address``, ``execute_async_v3`` (False when a shape or an address is missing).

Error *messages* imitate TensorRT's ("Error Code 3: API Usage Error (...)") but are not copies.

What differs: the "plan" is this module's own format (a JSON header plus the ONNX model) and
loads only here; layers are evaluated by ``onnx.reference.ReferenceEvaluator`` (numpy), not by
CUDA kernels; FP16 is emulated by rounding inputs and outputs through float16, INT8 only records
the calibration ranges; ``execute_async_v3`` reads and writes device memory through
:mod:`engines.cuda` in stream order (asynchronously on the CUDA stand-in, after a stream
synchronisation on a real GPU). Device memory pointers therefore come from ``engines.cuda``.
"""

from __future__ import annotations

import enum
import hashlib
import json
import struct
import sys
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

#: Marks this module as the stand-in.
IS_STANDIN = True
#: API level followed (TensorRT 10.13); the suffix keeps stand-in plans from passing for real.
__version__ = "10.13.0.35+standin"

_PLAN_MAGIC = b"FTRTPLAN"
_CACHE_MAGIC = b"FTRTTC01"
_CALIB_MAGIC = b"FTRTCAL1"


# ----------------------------------------------------------------------------------------------
# Enums and small types


class DataType(enum.IntEnum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    FP8 = 6
    BF16 = 7
    INT64 = 8
    INT4 = 9


_NP = {
    DataType.FLOAT: np.float32,
    DataType.HALF: np.float16,
    DataType.INT8: np.int8,
    DataType.INT32: np.int32,
    DataType.BOOL: np.bool_,
    DataType.UINT8: np.uint8,
    DataType.INT64: np.int64,
}
_FROM_ONNX = {
    1: DataType.FLOAT,
    10: DataType.HALF,
    3: DataType.INT8,
    6: DataType.INT32,
    9: DataType.BOOL,
    2: DataType.UINT8,
    7: DataType.INT64,
    16: DataType.BF16,
}


def nptype(trt_type: DataType) -> type:
    """The numpy type of a TensorRT ``DataType`` (``TypeError`` for types numpy lacks)."""
    try:
        return _NP[DataType(trt_type)]
    except KeyError:
        raise TypeError(
            f"Could not resolve TensorRT datatype to an equivalent numpy datatype. {trt_type}"
        ) from None


def volume(iterable: Iterable[int]) -> int:
    out = 1
    for d in iterable:
        out *= d
    return out


class TensorIOMode(enum.IntEnum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class BuilderFlag(enum.IntEnum):
    FP16 = 0
    INT8 = 1
    DEBUG = 2
    GPU_FALLBACK = 3
    REFIT = 4
    DISABLE_TIMING_CACHE = 5
    TF32 = 6
    SPARSE_WEIGHTS = 7
    OBEY_PRECISION_CONSTRAINTS = 9
    PREFER_PRECISION_CONSTRAINTS = 10
    FP8 = 15
    ERROR_ON_TIMING_CACHE_MISS = 16
    BF16 = 17


class MemoryPoolType(enum.IntEnum):
    WORKSPACE = 0
    DLA_MANAGED_SRAM = 1
    DLA_LOCAL_DRAM = 2
    DLA_GLOBAL_DRAM = 3
    TACTIC_DRAM = 4
    TACTIC_SHARED_MEMORY = 5


class NetworkDefinitionCreationFlag(enum.IntEnum):
    EXPLICIT_BATCH = 0
    STRONGLY_TYPED = 1


class ProfilingVerbosity(enum.IntEnum):
    LAYER_NAMES_ONLY = 0
    NONE = 1
    DETAILED = 2


class LayerInformationFormat(enum.IntEnum):
    ONELINE = 0
    JSON = 1


class CalibrationAlgoType(enum.IntEnum):
    LEGACY_CALIBRATION = 0
    ENTROPY_CALIBRATION = 1
    ENTROPY_CALIBRATION_2 = 2
    MINMAX_CALIBRATION = 3


class ErrorCode(enum.IntEnum):
    SUCCESS = 0
    INTERNAL_ERROR = 1
    MEM_ALLOC_FAILED = 2
    MODEL_DESERIALIZE_FAILED = 3
    INVALID_VALUE = 4
    INVALID_GRAPH = 5
    INVALID_NODE = 6
    UNSUPPORTED_GRAPH = 7
    UNSUPPORTED_NODE = 8


class Dims:
    """Tensor dimensions; -1 marks a dynamic one. Compares equal to tuples and lists."""

    MAX_DIMS = 8

    def __init__(self, shape: Iterable[int] = ()) -> None:
        self._dims = [int(d) for d in shape]

    def __len__(self) -> int:
        return len(self._dims)

    def __getitem__(self, index: int) -> int:
        return self._dims[index]

    def __iter__(self) -> Any:
        return iter(self._dims)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Dims):
            return self._dims == other._dims
        if isinstance(other, (list, tuple)):
            return self._dims == [int(d) for d in other]
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            "("
            + ", ".join(str(d) for d in self._dims)
            + ("," if len(self._dims) == 1 else "")
            + ")"
        )


def _dims(shape: Any) -> Dims:
    return shape if isinstance(shape, Dims) else Dims(shape)


# ----------------------------------------------------------------------------------------------
# Logging


class ILogger:
    class Severity(enum.IntEnum):
        INTERNAL_ERROR = 0
        ERROR = 1
        WARNING = 2
        INFO = 3
        VERBOSE = 4

    INTERNAL_ERROR = Severity.INTERNAL_ERROR
    ERROR = Severity.ERROR
    WARNING = Severity.WARNING
    INFO = Severity.INFO
    VERBOSE = Severity.VERBOSE

    def __init__(self) -> None:
        pass

    def log(self, severity: ILogger.Severity, msg: str) -> None:
        raise NotImplementedError


class Logger(ILogger):
    """Prints messages at ``min_severity`` or more severe to stderr, as TensorRT's does."""

    def __init__(self, min_severity: ILogger.Severity = ILogger.Severity.WARNING) -> None:
        super().__init__()
        self.min_severity = min_severity

    def log(self, severity: ILogger.Severity, msg: str) -> None:
        if severity <= self.min_severity:
            tag = "FEWIV"[int(severity)]
            print(f"[TRT] [{tag}] {msg}", file=sys.stderr)


def _log(logger: ILogger, severity: ILogger.Severity, msg: str) -> None:
    logger.log(severity, msg)


def _error(logger: ILogger, msg: str) -> None:
    _log(logger, ILogger.Severity.ERROR, msg)


class IHostMemory(bytes):
    """Serialized data (a plan, a timing cache); supports the buffer protocol like the real one."""

    @property
    def nbytes(self) -> int:
        return len(self)

    @property
    def dtype(self) -> DataType:
        return DataType.UINT8


# ----------------------------------------------------------------------------------------------
# Network and parser


class ITensor:
    def __init__(self, name: str, dtype: DataType, shape: Sequence[int], *, is_input: bool) -> None:
        self.name = name
        self.dtype = dtype
        self.shape = Dims(shape)
        self.is_network_input = is_input
        self.is_network_output = not is_input


class INetworkDefinition:
    def __init__(self, builder: Builder, flags: int) -> None:
        self.builder = builder
        self.flags = flags
        self.name = "network"
        self._inputs: list[ITensor] = []
        self._outputs: list[ITensor] = []
        self._model: Any = None
        self._model_bytes = b""

    @property
    def num_inputs(self) -> int:
        return len(self._inputs)

    @property
    def num_outputs(self) -> int:
        return len(self._outputs)

    @property
    def num_layers(self) -> int:
        return len(self._model.graph.node) if self._model is not None else 0

    @property
    def has_implicit_batch_dimension(self) -> bool:
        return False

    def get_input(self, index: int) -> ITensor:
        return self._inputs[index]

    def get_output(self, index: int) -> ITensor:
        return self._outputs[index]


class ParserError:
    def __init__(
        self, code: ErrorCode, desc: str, node: int = -1, node_name: str = "", op: str = ""
    ) -> None:
        self._code, self._desc, self._node, self._name, self._op = code, desc, node, node_name, op

    def code(self) -> ErrorCode:
        return self._code

    def desc(self) -> str:
        return self._desc

    def node(self) -> int:
        return self._node

    def node_name(self) -> str:
        return self._name

    def node_operator(self) -> str:
        return self._op

    def file(self) -> str:
        return "fake_trt.py"

    def func(self) -> str:
        return "parse"

    def line(self) -> int:
        return 0

    def __str__(self) -> str:
        where = (
            f"In node {self._node} with name: {self._name} and operator: {self._op} "
            if self._node >= 0
            else ""
        )
        return f"{where}({self._code.name}): {self._desc}"


class OnnxParser:
    def __init__(self, network: INetworkDefinition, logger: ILogger) -> None:
        self.network = network
        self.logger = logger
        self.flags = 0
        self._errors: list[ParserError] = []

    @property
    def num_errors(self) -> int:
        return len(self._errors)

    def get_error(self, index: int) -> ParserError:
        return self._errors[index]

    def clear_errors(self) -> None:
        self._errors.clear()

    def parse_from_file(self, model: str) -> bool:
        try:
            with open(model, "rb") as f:
                data = f.read()
        except OSError as exc:
            self._errors.append(
                ParserError(
                    ErrorCode.MODEL_DESERIALIZE_FAILED, f"Failed to open file: {model} ({exc})"
                )
            )
            return False
        return self.parse(data, model)

    def parse(self, model: Any, path: str | None = None) -> bool:
        import onnx
        from onnx.reference import ReferenceEvaluator

        data = bytes(model)
        try:
            proto = onnx.load_model_from_string(data)
        except Exception as exc:
            self._errors.append(
                ParserError(
                    ErrorCode.MODEL_DESERIALIZE_FAILED, f"Failed to parse ONNX model: {exc}"
                )
            )
            _error(self.logger, "ModelImporter.cpp: Failed to parse ONNX model from file")
            return False
        for index, node in enumerate(proto.graph.node):
            if node.domain not in ("", "ai.onnx"):
                self._errors.append(
                    ParserError(
                        ErrorCode.UNSUPPORTED_NODE,
                        f"No importer registered for op: {node.op_type}",
                        index,
                        node.name,
                        node.op_type,
                    )
                )
        if self._errors:
            return False
        try:
            ReferenceEvaluator(proto)
        except Exception as exc:
            self._errors.append(ParserError(ErrorCode.UNSUPPORTED_NODE, str(exc)))
            return False
        initializers = {init.name for init in proto.graph.initializer}
        net = self.network
        net._model, net._model_bytes = proto, data
        net._inputs = [
            _tensor(v, is_input=True) for v in proto.graph.input if v.name not in initializers
        ]
        net._outputs = [_tensor(v, is_input=False) for v in proto.graph.output]
        return True


def _tensor(value: Any, *, is_input: bool) -> ITensor:
    ttype = value.type.tensor_type
    shape = [d.dim_value if d.HasField("dim_value") else -1 for d in ttype.shape.dim]
    dtype = _FROM_ONNX.get(ttype.elem_type, DataType.FLOAT)
    return ITensor(value.name, dtype, shape, is_input=is_input)


# ----------------------------------------------------------------------------------------------
# Builder configuration


class IOptimizationProfile:
    def __init__(self) -> None:
        self._shapes: dict[str, tuple[Dims, Dims, Dims]] = {}
        self.extra_memory_target = 1.0

    def set_shape(self, input: str, min: Any, opt: Any, max: Any) -> None:
        lo, mid, hi = _dims(min), _dims(opt), _dims(max)
        if not (len(lo) == len(mid) == len(hi)):
            raise RuntimeError("Shape provided for min is inconsistent with other shapes.")
        for a, b, c in zip(lo, mid, hi, strict=True):
            if a < 0:
                raise RuntimeError("Shape provided for min is inconsistent with other shapes.")
            if not a <= b:
                raise RuntimeError("Shape provided for opt is inconsistent with other shapes.")
            if not b <= c:
                raise RuntimeError("Shape provided for max is inconsistent with other shapes.")
        self._shapes[input] = (lo, mid, hi)

    def get_shape(self, input: str) -> list[Dims]:
        return list(self._shapes.get(input, ()))

    def __bool__(self) -> bool:
        return bool(self._shapes)


class ITimingCache:
    def __init__(self, entries: dict[str, float] | None = None) -> None:
        self._entries: dict[str, float] = dict(entries or {})

    def serialize(self) -> IHostMemory:
        return IHostMemory(_CACHE_MAGIC + json.dumps(self._entries, sort_keys=True).encode())

    def combine(self, input_cache: ITimingCache, ignore_mismatch: bool) -> bool:
        self._entries.update(input_cache._entries)
        return True

    def reset(self) -> bool:
        self._entries.clear()
        return True


class IInt8Calibrator:
    def __init__(self) -> None:
        pass

    def get_algorithm(self) -> CalibrationAlgoType:
        return CalibrationAlgoType.ENTROPY_CALIBRATION_2

    def get_batch_size(self) -> int:
        raise NotImplementedError

    def get_batch(self, names: list[str]) -> list[int] | None:
        raise NotImplementedError

    def read_calibration_cache(self) -> Any:
        return None

    def write_calibration_cache(self, cache: Any) -> None:
        pass


class IInt8EntropyCalibrator2(IInt8Calibrator):
    pass


class IProgressMonitor:
    def __init__(self) -> None:
        pass

    def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
        pass

    def step_complete(self, phase_name: str, step: int) -> bool:
        return True

    def phase_finish(self, phase_name: str) -> None:
        pass


class IBuilderConfig:
    def __init__(self, builder: Builder) -> None:
        self._builder = builder
        self.flags = 0
        self._pools: dict[MemoryPoolType, int] = {}
        self._profiles: list[IOptimizationProfile] = []
        self._calibration_profile: IOptimizationProfile | None = None
        self._timing_cache: ITimingCache | None = None
        self.int8_calibrator: IInt8Calibrator | None = None
        self.progress_monitor: IProgressMonitor | None = None
        self.profiling_verbosity = ProfilingVerbosity.LAYER_NAMES_ONLY
        self.builder_optimization_level = 3
        self.avg_timing_iterations = 1
        self.max_aux_streams = -1

    def set_flag(self, flag: BuilderFlag) -> None:
        self.flags |= 1 << int(flag)

    def clear_flag(self, flag: BuilderFlag) -> None:
        self.flags &= ~(1 << int(flag))

    def get_flag(self, flag: BuilderFlag) -> bool:
        return bool(self.flags & (1 << int(flag)))

    def set_memory_pool_limit(self, pool: MemoryPoolType, pool_size: int) -> None:
        if pool_size < 0:
            raise ValueError("pool_size must be >= 0")
        self._pools[MemoryPoolType(pool)] = int(pool_size)

    def get_memory_pool_limit(self, pool: MemoryPoolType) -> int:
        return self._pools.get(MemoryPoolType(pool), 1 << 40)

    def add_optimization_profile(self, profile: IOptimizationProfile) -> int:
        if not profile:
            _error(
                self._builder.logger,
                "Error Code 3: API Usage Error (Parameter check failed, condition: profile.isValid())",
            )
            return -1
        self._profiles.append(profile)
        return len(self._profiles) - 1

    @property
    def num_optimization_profiles(self) -> int:
        return len(self._profiles)

    def set_calibration_profile(self, profile: IOptimizationProfile) -> bool:
        if not profile:
            return False
        self._calibration_profile = profile
        return True

    def get_calibration_profile(self) -> IOptimizationProfile | None:
        return self._calibration_profile

    def create_timing_cache(self, serialized_timing_cache: Any) -> ITimingCache:
        data = bytes(serialized_timing_cache)
        if not data:
            return ITimingCache()
        if not data.startswith(_CACHE_MAGIC):
            _log(
                self._builder.logger,
                ILogger.Severity.WARNING,
                "The timing cache is invalid or was created by another TensorRT version; ignoring it",
            )
            return ITimingCache()
        return ITimingCache(json.loads(data[len(_CACHE_MAGIC) :]))

    def set_timing_cache(self, cache: ITimingCache, ignore_mismatch: bool) -> bool:
        self._timing_cache = cache
        return True

    def get_timing_cache(self) -> ITimingCache | None:
        return self._timing_cache


# ----------------------------------------------------------------------------------------------
# Builder


class Builder:
    def __init__(self, logger: ILogger) -> None:
        self.logger = logger
        self.max_threads = 1
        _check_cuda(logger)

    def __enter__(self) -> Builder:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    @property
    def platform_has_fast_fp16(self) -> bool:
        return True

    @property
    def platform_has_fast_int8(self) -> bool:
        return True

    @property
    def platform_has_tf32(self) -> bool:
        return True

    def create_network(self, flags: int = 0) -> INetworkDefinition:
        if flags & (1 << int(NetworkDefinitionCreationFlag.EXPLICIT_BATCH)):
            _log(
                self.logger,
                ILogger.Severity.WARNING,
                "NetworkDefinitionCreationFlag::kEXPLICIT_BATCH is deprecated and has no effect",
            )
        return INetworkDefinition(self, flags)

    def create_builder_config(self) -> IBuilderConfig:
        return IBuilderConfig(self)

    def create_optimization_profile(self) -> IOptimizationProfile:
        return IOptimizationProfile()

    def build_serialized_network(
        self, network: INetworkDefinition, config: IBuilderConfig
    ) -> IHostMemory | None:
        try:
            return _Build(self, network, config).run()
        except _BuildFailed:
            return None


class _BuildFailed(Exception):
    pass


class _Build:
    """One ``build_serialized_network`` call."""

    def __init__(
        self, builder: Builder, network: INetworkDefinition, config: IBuilderConfig
    ) -> None:
        self.builder, self.network, self.config = builder, network, config
        self.logger = builder.logger
        self.monitor = config.progress_monitor

    def fail(self, msg: str) -> None:
        _error(self.logger, msg)
        raise _BuildFailed(msg)

    def step(self, phase: str, parent: str | None, steps: int) -> Any:
        monitor = self.monitor
        builder = self

        class _Phase:
            def __enter__(self) -> _Phase:
                if monitor is not None:
                    monitor.phase_start(phase, parent, steps)
                return self

            def done(self, index: int) -> None:
                if monitor is not None and not monitor.step_complete(phase, index):
                    builder.fail(
                        "Error Code 9: API Usage Error (Build was cancelled by the progress monitor.)"
                    )

            def __exit__(self, *exc: object) -> None:
                if monitor is not None:
                    monitor.phase_finish(phase)

        return _Phase()

    def run(self) -> IHostMemory:
        net, config = self.network, self.config
        if net._model is None or net.num_outputs == 0:
            self.fail("Error Code 4: API Usage Error (Network must have at least one output.)")
        dynamic = [t.name for t in net._inputs if any(d < 0 for d in t.shape)]
        profiles = config._profiles
        if dynamic and not profiles:
            self.fail(
                "Error Code 4: API Usage Error (Network has dynamic or shape inputs, but no optimization profile has been defined.)"
            )
        serial_profiles: list[dict[str, list[list[int]]]] = []
        for index, profile in enumerate(profiles):
            entry: dict[str, list[list[int]]] = {}
            for tensor in net._inputs:
                shapes = profile._shapes.get(tensor.name)
                if shapes is None:
                    self.fail(
                        f"Error Code 4: API Usage Error (Optimization profile {index}: dimensions for input tensor {tensor.name} are not set.)"
                    )
                    return IHostMemory()
                for which, dims in zip(("min", "opt", "max"), shapes, strict=True):
                    if len(dims) != len(tensor.shape) or any(
                        n >= 0 and n != d for n, d in zip(tensor.shape, dims, strict=True)
                    ):
                        self.fail(
                            f"Error Code 4: API Usage Error (Optimization profile {index}: {which} dimensions {dims} of input {tensor.name} do not match the network input dimensions {tensor.shape}.)"
                        )
                entry[tensor.name] = [list(d) for d in shapes]
            serial_profiles.append(entry)
        if not profiles:  # a fully static network gets one implicit profile
            serial_profiles.append({t.name: [list(t.shape)] * 3 for t in net._inputs})

        fp16 = config.get_flag(BuilderFlag.FP16)
        int8 = config.get_flag(BuilderFlag.INT8)
        calibration = None
        with self.step("Building engine", None, 3) as top:
            if int8:
                calibration = self.calibrate(serial_profiles)
            top.done(0)
            hits, misses = self.time_layers(fp16, int8)
            top.done(1)
            _log(self.logger, ILogger.Severity.INFO, f"Timing cache: {hits} hits, {misses} misses")
            header = {
                "trt_version": __version__,
                "name": net.name,
                "inputs": [
                    {"name": t.name, "dtype": int(t.dtype), "shape": list(t.shape)}
                    for t in net._inputs
                ],
                "outputs": [
                    {"name": t.name, "dtype": int(t.dtype), "shape": list(t.shape)}
                    for t in net._outputs
                ],
                "profiles": serial_profiles,
                "fp16": fp16,
                "int8": int8,
                "calibration": calibration,
                "workspace": config.get_memory_pool_limit(MemoryPoolType.WORKSPACE),
                "num_layers": net.num_layers,
            }
            top.done(2)
        return IHostMemory(_pack_plan(header, net._model_bytes))

    def time_layers(self, fp16: bool, int8: bool) -> tuple[int, int]:
        """Pretend to time one tactic per layer, through the timing cache."""
        cache = self.config._timing_cache
        if cache is None or self.config.get_flag(BuilderFlag.DISABLE_TIMING_CACHE):
            cache = ITimingCache()
        hits = misses = 0
        precision = "int8" if int8 else "fp16" if fp16 else "fp32"
        nodes = list(self.network._model.graph.node)
        with self.step("Timing layers", "Building engine", max(1, len(nodes))) as phase:
            for index, node in enumerate(nodes):
                key = hashlib.sha256(
                    f"{node.op_type}|{precision}|{node.SerializeToString().hex()[:256]}".encode()
                ).hexdigest()[:32]
                if key in cache._entries:
                    hits += 1
                else:
                    if self.config.get_flag(BuilderFlag.ERROR_ON_TIMING_CACHE_MISS):
                        self.fail(f"Error Code 4: timing cache miss for layer {node.name or index}")
                    misses += 1
                    cache._entries[key] = 0.01
                phase.done(index)
        return hits, misses

    def calibrate(self, profiles: list[dict[str, list[list[int]]]]) -> dict[str, Any]:
        calibrator = self.config.int8_calibrator
        if calibrator is None:
            self.fail(
                "Error Code 2: Internal Error (Calibrator is not being used and dynamic ranges are not set for all network tensors; provide an IInt8Calibrator.)"
            )
            return {}
        cached = calibrator.read_calibration_cache()
        if cached:
            data = bytes(cached)
            if data.startswith(_CALIB_MAGIC):
                _log(
                    self.logger,
                    ILogger.Severity.INFO,
                    "Using the calibration cache; skipping calibration",
                )
                return dict(json.loads(data[len(_CALIB_MAGIC) :]), source="cache")
            _log(
                self.logger,
                ILogger.Severity.WARNING,
                "The calibration cache is invalid; recalibrating",
            )
        from engines import cuda

        profile = self.config.get_calibration_profile()
        shapes = (
            {name: list(dims[1]) for name, dims in profile._shapes.items()}
            if profile
            else {name: s[1] for name, s in profiles[0].items()}
        )
        names = [t.name for t in self.network._inputs]
        dtypes = {t.name: nptype(t.dtype) for t in self.network._inputs}
        ranges = {name: 0.0 for name in names}
        batches = 0
        batch_size = calibrator.get_batch_size()
        with self.step("Calibration", "Building engine", 1):
            while True:
                pointers = calibrator.get_batch(names)
                if not pointers:
                    break
                for name, ptr in zip(names, pointers, strict=True):
                    array = cuda.memcpy_dtoh(np.empty(shapes[name], dtypes[name]), int(ptr))
                    ranges[name] = max(ranges[name], float(np.abs(array).max(initial=0.0)))
                batches += 1
        if batches == 0:
            self.fail(
                "Error Code 2: Internal Error (Calibration failure occurred with no scaling factors detected.)"
            )
        result = {"batches": batches, "batch_size": batch_size, "input_ranges": ranges}
        calibrator.write_calibration_cache(IHostMemory(_CALIB_MAGIC + json.dumps(result).encode()))
        return dict(result, source="calibrated")


def _pack_plan(header: dict[str, Any], model: bytes) -> bytes:
    blob = json.dumps(header).encode()
    return _PLAN_MAGIC + struct.pack("<Q", len(blob)) + blob + model


def _check_cuda(logger: ILogger) -> None:
    from engines import cuda

    if not cuda.is_available():
        _error(
            logger,
            "Error Code 6: CUDA initialization failure with error: 100 (no CUDA-capable device is detected)",
        )
        raise TypeError("pybind11::init(): factory function returned nullptr")


# ----------------------------------------------------------------------------------------------
# Runtime


class Runtime:
    def __init__(self, logger: ILogger) -> None:
        self.logger = logger
        _check_cuda(logger)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def deserialize_cuda_engine(self, serialized_engine: Any) -> ICudaEngine | None:
        data = bytes(serialized_engine)
        if not data.startswith(_PLAN_MAGIC) or len(data) < len(_PLAN_MAGIC) + 8:
            _error(
                self.logger,
                "Error Code 1: Serialization (Serialization assertion plan->header.magicTag == rt::kPLAN_MAGIC_TAG failed.)",
            )
            return None
        (size,) = struct.unpack("<Q", data[len(_PLAN_MAGIC) : len(_PLAN_MAGIC) + 8])
        start = len(_PLAN_MAGIC) + 8
        try:
            header = json.loads(data[start : start + size])
        except ValueError:
            _error(
                self.logger,
                "Error Code 1: Serialization (Serialization assertion failed: corrupt plan header.)",
            )
            return None
        if header.get("trt_version") != __version__:
            _error(
                self.logger,
                "Error Code 6: API Usage Error (The engine plan file is not compatible with this version of TensorRT, "
                f"expecting library version {__version__} got {header.get('trt_version')}, please rebuild.)",
            )
            return None
        return ICudaEngine(header, data[start + size :], data, self.logger)


class EngineInspector:
    def __init__(self, engine: ICudaEngine) -> None:
        self.engine = engine
        self.execution_context: IExecutionContext | None = None

    def get_engine_information(self, format: LayerInformationFormat) -> str:
        import onnx

        model = onnx.load_model_from_string(self.engine._model_bytes)
        precision = (
            "Int8"
            if self.engine._header["int8"]
            else "Half"
            if self.engine._header["fp16"]
            else "Float"
        )
        layers = [
            {"Name": n.name or f"{n.op_type}_{i}", "LayerType": n.op_type, "Precision": precision}
            for i, n in enumerate(model.graph.node)
        ]
        if format == LayerInformationFormat.JSON:
            return json.dumps({"Layers": layers, "Bindings": [t["name"] for t in self.engine._io]})
        return "\n".join(f"{layer['Name']} [{layer['LayerType']}] {precision}" for layer in layers)


class ICudaEngine:
    def __init__(
        self, header: dict[str, Any], model_bytes: bytes, plan: bytes, logger: ILogger
    ) -> None:
        self._header = header
        self._model_bytes = model_bytes
        self._plan = plan
        self._logger = logger
        self._io = [dict(t, mode=TensorIOMode.INPUT) for t in header["inputs"]] + [
            dict(t, mode=TensorIOMode.OUTPUT) for t in header["outputs"]
        ]
        self._by_name = {t["name"]: t for t in self._io}
        self._evaluator: Any = None
        self._eval_lock = threading.Lock()
        self.name = header.get("name", "")

    def __getitem__(self, index: int) -> str:
        return self.get_tensor_name(index)

    @property
    def num_io_tensors(self) -> int:
        return len(self._io)

    @property
    def num_optimization_profiles(self) -> int:
        return len(self._header["profiles"])

    @property
    def num_layers(self) -> int:
        return int(self._header["num_layers"])

    @property
    def device_memory_size(self) -> int:
        return 0

    @property
    def has_implicit_batch_dimension(self) -> bool:
        return False

    def get_tensor_name(self, index: int) -> str:
        return str(self._io[index]["name"])

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        tensor = self._by_name.get(name)
        return TensorIOMode(tensor["mode"]) if tensor else TensorIOMode.NONE

    def get_tensor_dtype(self, name: str) -> DataType:
        tensor = self._by_name.get(name)
        if tensor is None:
            _error(
                self._logger,
                f"Error Code 3: API Usage Error (Parameter check failed, condition: tensor {name} exists.)",
            )
            return DataType.FLOAT
        return DataType(tensor["dtype"])

    def get_tensor_shape(self, name: str) -> Dims:
        tensor = self._by_name.get(name)
        if tensor is None:
            _error(
                self._logger,
                f"Error Code 3: API Usage Error (Parameter check failed, condition: tensor {name} exists.)",
            )
            return Dims()
        return Dims(tensor["shape"])

    def get_tensor_profile_shape(self, name: str, profile_index: int) -> list[Dims]:
        profiles = self._header["profiles"]
        if not 0 <= profile_index < len(profiles) or name not in profiles[profile_index]:
            _error(
                self._logger,
                f"Error Code 3: API Usage Error (Parameter check failed: {name} is not an input of profile {profile_index}.)",
            )
            return [Dims(), Dims(), Dims()]
        return [Dims(d) for d in profiles[profile_index][name]]

    def create_execution_context(self, strategy: Any = None) -> IExecutionContext:
        return IExecutionContext(self)

    def create_engine_inspector(self) -> EngineInspector:
        return EngineInspector(self)

    def serialize(self) -> IHostMemory:
        return IHostMemory(self._plan)

    def _evaluate(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from onnx.reference import ReferenceEvaluator

        with self._eval_lock:
            if self._evaluator is None:
                self._evaluator = ReferenceEvaluator(self._model_bytes)
            names = [t["name"] for t in self._header["outputs"]]
            results = self._evaluator.run(names, feeds)
        return dict(zip(names, results, strict=True))


class IExecutionContext:
    def __init__(self, engine: ICudaEngine) -> None:
        self.engine = engine
        self.name = ""
        self.debug_sync = False
        self._profile = 0
        self._shapes: dict[str, list[int]] = {}
        self._addresses: dict[str, int] = {}

    def __enter__(self) -> IExecutionContext:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    @property
    def active_optimization_profile(self) -> int:
        return self._profile

    def set_optimization_profile_async(self, profile_index: int, stream_handle: int) -> bool:
        if not 0 <= profile_index < self.engine.num_optimization_profiles:
            _error(
                self.engine._logger,
                f"Error Code 3: API Usage Error (Parameter check failed, condition: profileIndex >= 0 && profileIndex < mEngine.getNbOptimizationProfiles(). profileIndex {profile_index})",
            )
            return False
        if profile_index != self._profile:
            self._shapes.clear()  # shapes must be set again after a switch
        self._profile = profile_index
        return True

    def set_input_shape(self, name: str, shape: Any) -> bool:
        engine = self.engine
        if engine.get_tensor_mode(name) != TensorIOMode.INPUT:
            _error(
                engine._logger,
                f"Error Code 3: API Usage Error (Parameter check failed, condition: mEngine.tensorIsInput(tensorName). {name} is not an input tensor.)",
            )
            return False
        dims = [int(d) for d in shape]
        declared = engine._by_name[name]["shape"]
        lo, _, hi = engine._header["profiles"][self._profile][name]
        if len(dims) != len(declared) or any(
            d < lo_d or d > hi_d for d, lo_d, hi_d in zip(dims, lo, hi, strict=True)
        ):
            _error(
                engine._logger,
                f"Error Code 3: API Usage Error (Parameter check failed, condition: satisfyProfile. Set dimension {dims} for tensor {name} does not satisfy any optimization profile. Supplied dimensions are {dims} but must be within {lo} and {hi} for profile {self._profile}.)",
            )
            return False
        self._shapes[name] = dims
        return True

    def get_tensor_shape(self, name: str) -> Dims:
        engine = self.engine
        mode = engine.get_tensor_mode(name)
        if mode == TensorIOMode.INPUT:
            return Dims(self._shapes.get(name, engine._by_name[name]["shape"]))
        if mode == TensorIOMode.OUTPUT:
            declared = list(engine._by_name[name]["shape"])
            if declared and declared[0] < 0 and self._shapes:
                declared[0] = next(iter(self._shapes.values()))[0]
            return Dims(declared)
        return Dims()

    @property
    def all_binding_shapes_specified(self) -> bool:
        return all(t["name"] in self._shapes for t in self.engine._header["inputs"])

    def infer_shapes(self) -> list[str]:
        return [t["name"] for t in self.engine._header["inputs"] if t["name"] not in self._shapes]

    def set_tensor_address(self, name: str, memory: int) -> bool:
        if self.engine.get_tensor_mode(name) == TensorIOMode.NONE:
            _error(
                self.engine._logger,
                f"Error Code 3: API Usage Error (Parameter check failed, condition: tensor {name} is an IO tensor of the engine.)",
            )
            return False
        self._addresses[name] = int(memory)
        return True

    def get_tensor_address(self, name: str) -> int:
        return self._addresses.get(name, 0)

    def execute_async_v3(self, stream_handle: int) -> bool:
        engine = self.engine
        for tensor in engine._header["inputs"]:
            if tensor["name"] not in self._shapes:
                _error(
                    engine._logger,
                    f"Error Code 3: API Usage Error (Parameter check failed, condition: inputDimensionSpecified. Input shape of {tensor['name']} is not set; call setInputShape before enqueueV3.)",
                )
                return False
        for tensor in engine._io:
            if not self._addresses.get(tensor["name"]):
                _error(
                    engine._logger,
                    f"Error Code 3: API Usage Error (Address is not set for {'input' if tensor['mode'] == TensorIOMode.INPUT else 'output'} tensor {tensor['name']}. Call setInputTensorAddress or setTensorAddress before enqueue/execute.)",
                )
                return False
        from engines import cuda

        shapes = {n: list(s) for n, s in self._shapes.items()}
        addresses = dict(self._addresses)
        fp16 = bool(engine._header["fp16"])
        batch = next(iter(shapes.values()))[0]

        def run() -> None:
            feeds = {}
            for tensor in engine._header["inputs"]:
                name = tensor["name"]
                array: np.ndarray = np.empty(shapes[name], dtype=nptype(DataType(tensor["dtype"])))
                cuda.memcpy_dtoh(array, addresses[name])
                if fp16 and array.dtype == np.float32:
                    array = array.astype(np.float16).astype(np.float32)
                feeds[name] = array
            results = engine._evaluate(feeds)
            for tensor in engine._header["outputs"]:
                name = tensor["name"]
                out: np.ndarray = np.asarray(results[name]).astype(
                    nptype(DataType(tensor["dtype"])), copy=False
                )
                if fp16 and out.dtype == np.float32:
                    out = out.astype(np.float16).astype(np.float32)
                expected = [batch if d < 0 and i == 0 else d for i, d in enumerate(tensor["shape"])]
                if list(out.shape) != expected and all(d >= 0 for d in expected):
                    raise RuntimeError(f"output {name} has shape {out.shape}, expected {expected}")
                cuda.memcpy_htod(addresses[name], np.ascontiguousarray(out))

        cuda.stream_host_call(stream_handle, run)
        return True
