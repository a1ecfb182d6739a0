"""The TensorRT runtime backend: load a plan, run it synchronously or enqueued on a stream.

TensorRT 10+ API only: ``Runtime.deserialize_cuda_engine``, the name-based IO tensor API
(``num_io_tensors``, ``get_tensor_name/mode/dtype/shape``, ``get_tensor_profile_shape``), one
``IExecutionContext`` per CUDA stream, and per batch ``set_optimization_profile_async`` (when the
batch needs another profile), ``set_input_shape``, ``set_tensor_address`` for every IO tensor and
``execute_async_v3``. The bindings-based ``execute_async_v2`` API was removed in TensorRT 10.

Tested against :mod:`engines.testing.fake_trt` only; it has not run on real TensorRT.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from engines import cuda
from engines.base import DYNAMIC, EngineInfo, StreamContext, StreamEngine, TensorSpec
from engines.cuda.runner import StreamRunner
from engines.exceptions import (
    EngineClosedError,
    EngineLoadError,
    EngineRuntimeError,
    OutOfMemoryError,
)
from engines.tensorrt._api import is_standin, trt
from engines.tensorrt._logging import CapturingLogger, make_logger
from engines.tensorrt.plan import PlanMetadata, sha256_file

__all__ = ["Profile", "TensorRTEngine", "load"]


class Profile:
    """One optimization profile: input name → (min, opt, max) shapes, and its batch range."""

    def __init__(self, index: int, shapes: dict[str, tuple[tuple[int, ...], ...]]) -> None:
        self.index = index
        self.shapes = shapes
        mins = [s[0][0] for s in shapes.values() if s[0]]
        maxs = [s[2][0] for s in shapes.values() if s[2]]
        self.min_batch = max(mins) if mins else 1
        self.max_batch = min(maxs) if maxs else 1

    def fits(self, batch: int) -> bool:
        return self.min_batch <= batch <= self.max_batch

    def as_dict(self) -> dict[str, dict[str, list[int]]]:
        return {
            name: {"min": list(lo), "opt": list(mid), "max": list(hi)}
            for name, (lo, mid, hi) in self.shapes.items()
        }


class _TrtStreamContext(StreamContext):
    """An ``IExecutionContext`` bound to one stream and the executor's buffers for it."""

    def __init__(self, engine: TensorRTEngine, stream: int, addresses: Mapping[str, int]) -> None:
        self.engine = engine
        self.stream = stream
        self.addresses = dict(addresses)
        self.profile: int | None = None
        self.context: Any = engine.cuda_engine.create_execution_context()
        if self.context is None:
            raise OutOfMemoryError(
                f"TensorRT could not create an execution context: "
                f"{engine.logger.last_errors()}; free GPU memory or use fewer streams"
            )

    def enqueue(self, batch_size: int) -> None:
        engine, ctx = self.engine, self.context
        profile = engine.select_profile(batch_size)
        if profile.index != self.profile:
            if not ctx.set_optimization_profile_async(profile.index, self.stream):
                raise EngineRuntimeError(
                    f"set_optimization_profile_async({profile.index}) failed: "
                    f"{engine.logger.last_errors()}"
                )
            self.profile = profile.index
        for spec in engine.inputs:
            if not ctx.set_input_shape(spec.name, (batch_size, *spec.item_shape)):
                raise EngineRuntimeError(
                    f"set_input_shape({spec.name!r}, batch {batch_size}) failed: "
                    f"{engine.logger.last_errors()}"
                )
        for name, ptr in self.addresses.items():
            if not ctx.set_tensor_address(name, ptr):
                raise EngineRuntimeError(
                    f"set_tensor_address({name!r}) failed: {engine.logger.last_errors()}"
                )
        if not ctx.execute_async_v3(self.stream):
            raise EngineRuntimeError(f"execute_async_v3 failed: {engine.logger.last_errors()}")

    def close(self) -> None:
        self.context = None  # TensorRT frees the context when the last reference goes


def dims_tuple(dims: Any) -> tuple[int, ...]:
    """A ``trt.Dims`` as a tuple (Dims supports ``len`` and indexing, not ``iter``, in stubs)."""
    return tuple(int(dims[i]) for i in range(len(dims)))


def _np_dtype(trt_dtype: Any) -> np.dtype[Any]:
    return np.dtype(trt.nptype(trt_dtype))


class TensorRTEngine(StreamEngine):
    """A deserialized TensorRT plan.

    Args:
        plan_path: The ``.plan`` file, with its ``.plan.json`` sidecar beside it.
        device: CUDA device ordinal.
        check_sidecar: Refuse a plan whose sidecar names another GPU or TensorRT version
            (default). Turn off only to inspect foreign plans.

    Raises:
        EngineLoadError: The file or sidecar is missing, or TensorRT cannot deserialize it.
        PlanMismatchError: The plan was built for another GPU or TensorRT version.
        BackendUnavailableError: TensorRT or CUDA is missing.
    """

    def __init__(self, plan_path: Path, *, device: int = 0, check_sidecar: bool = True) -> None:
        self.plan_path = Path(plan_path)
        if not self.plan_path.is_file():
            raise EngineLoadError(f"no plan file at {self.plan_path}")
        self.device = device
        cuda.set_device(device)
        gpu = cuda.device_info(device)
        self.metadata: PlanMetadata | None = None
        if check_sidecar:
            self.metadata = PlanMetadata.read(self.plan_path)
            self.metadata.check_runs_here(
                self.plan_path,
                tensorrt_version=str(trt.__version__),
                gpu_name=gpu.name,
                compute_capability=f"{gpu.compute_capability[0]}.{gpu.compute_capability[1]}",
            )
        self.logger: CapturingLogger = make_logger()
        self.runtime: trt.Runtime | None = trt.Runtime(self.logger.trt_logger)
        engine = self.runtime.deserialize_cuda_engine(self.plan_path.read_bytes())
        if engine is None:
            raise EngineLoadError(
                f"TensorRT could not deserialize {self.plan_path}: {self.logger.last_errors()}; "
                "rebuild it on this machine with 'engines build'"
            )
        self._cuda_engine: trt.ICudaEngine | None = engine

        inputs, outputs = [], []
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            spec = TensorSpec(
                name,
                _np_dtype(engine.get_tensor_dtype(name)),
                dims_tuple(engine.get_tensor_shape(name)),
            )
            mode = engine.get_tensor_mode(name)
            if mode == trt.TensorIOMode.INPUT:
                inputs.append(spec)
            elif mode == trt.TensorIOMode.OUTPUT:
                outputs.append(spec)
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.profiles = [
            Profile(
                p,
                {
                    spec.name: tuple(
                        dims_tuple(d) for d in engine.get_tensor_profile_shape(spec.name, p)
                    )
                    for spec in self.inputs
                    if any(d == DYNAMIC for d in spec.shape)
                },
            )
            for p in range(engine.num_optimization_profiles)
        ]
        max_batch = max((p.max_batch for p in self.profiles), default=1)
        static = [s.shape[0] for s in self.inputs if s.shape and s.shape[0] != DYNAMIC]
        if static:
            max_batch = static[0]
        precision = self.metadata.precision if self.metadata else "unknown"
        self.info = EngineInfo(
            backend="tensorrt",
            model_path=str(self.plan_path),
            model_sha256=sha256_file(self.plan_path),
            version=str(trt.__version__),
            device=f"cuda:{device} ({gpu.name})",
            precision=precision,
            max_batch_size=max_batch,
            extra={
                "profiles": [p.as_dict() for p in self.profiles],
                "standin": is_standin(),
                "onnx_sha256": self.metadata.onnx_sha256 if self.metadata else None,
            },
        )
        self._runner: StreamRunner | None = None
        self._runner_lock = threading.Lock()

    @property
    def cuda_engine(self) -> trt.ICudaEngine:
        """The deserialized ``ICudaEngine``.

        Raises:
            EngineClosedError: The engine was closed.
        """
        if self._cuda_engine is None:
            raise EngineClosedError("the TensorRT engine is closed; load it again")
        return self._cuda_engine

    def select_profile(self, batch: int) -> Profile:
        """The profile for a batch: among those whose batch range holds it, the one with the
        smallest max batch (its kernels were tuned closest to this size).

        Raises:
            EngineRuntimeError: No profile holds ``batch`` (the executor validates first).
        """
        fitting = [p for p in self.profiles if p.fits(batch)]
        if not fitting:
            if not self.profiles:  # fully static network: profile 0 is implicit
                return Profile(0, {})
            raise EngineRuntimeError(
                f"no optimization profile of {self.plan_path} accepts batch {batch}; profiles: "
                f"{[(p.min_batch, p.max_batch) for p in self.profiles]}"
            )
        return min(fitting, key=lambda p: (p.max_batch, p.index))

    def bind_stream(self, stream: int, addresses: Mapping[str, int]) -> StreamContext:
        self.check_addresses(addresses)
        return _TrtStreamContext(self, stream, addresses)

    def infer_impl(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self._runner_lock:
            if self._runner is None:
                self._runner = StreamRunner(self, device=self.device)
        return self._runner.run(feeds)

    def close_impl(self) -> None:
        if self._runner is not None:
            self._runner.close()
            self._runner = None
        self._cuda_engine = None
        self.runtime = None


def load(model_path: Path, **options: Any) -> TensorRTEngine:
    """Registry loader: ``load_engine("tensorrt", "model.plan", device=0)``."""
    path = Path(model_path)
    if path.suffix.lower() == ".onnx":
        raise EngineLoadError(
            f"{path} is an ONNX model; the TensorRT backend loads plans. Build one first: "
            f"engines build {path} -o {path.with_suffix('.plan')} --fp16"
        )
    known = {"device", "check_sidecar"}
    unknown = set(options) - known - {"max_batch_size"}
    if unknown:
        raise EngineLoadError(
            f"unknown TensorRT backend options {sorted(unknown)}; known: {sorted(known)}"
        )
    return TensorRTEngine(
        path,
        device=int(options.get("device", 0)),
        check_sidecar=bool(options.get("check_sidecar", True)),
    )
