"""Build a TensorRT plan from ONNX (``engines build``), TensorRT 10+ API only.

Steps, as in NVIDIA's "Developer Guide → The Python API → Building an Engine":
``Builder(logger)`` → ``create_network(0)`` (explicit batch is the only mode in TensorRT 10) →
``OnnxParser.parse`` → ``create_builder_config`` (workspace via ``set_memory_pool_limit``,
``BuilderFlag.FP16``/``INT8``, optimization profiles, timing cache, progress monitor, INT8
entropy calibrator) → ``build_serialized_network`` → write the plan and its sidecar
(:mod:`engines.tensorrt.plan`). The removed pre-10 APIs (``build_engine``,
``max_workspace_size``, implicit batch) are not used.
"""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from engines import cuda
from engines.base import DYNAMIC, TensorSpec
from engines.exceptions import InputSpecError
from engines.tensorrt._api import is_standin, trt
from engines.tensorrt._logging import CapturingLogger, make_logger
from engines.tensorrt.engine import dims_tuple
from engines.tensorrt.exceptions import BuildError
from engines.tensorrt.plan import PlanMetadata, sha256_file

__all__ = [
    "ProgressPrinter",
    "ShapeRange",
    "build_plan",
    "load_calibration_data",
    "parse_shapes",
]

#: ``callback(phase, parent, step, num_steps)``; ``step`` is None at a phase's start and
#: ``num_steps`` at its end. Return False to cancel the build.
ProgressCallback = Callable[[str, str | None, int | None, int], bool | None]


@dataclass(frozen=True)
class ShapeRange:
    """Min/opt/max shape of one input in one optimization profile (batch dimension first)."""

    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    def as_dict(self) -> dict[str, list[int]]:
        return {"min": list(self.min), "opt": list(self.opt), "max": list(self.max)}


def _parse_dims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.lower().split("x"))


def parse_shapes(specs: Sequence[str]) -> list[dict[str, ShapeRange]]:
    """Parse ``--shapes`` values into optimization profiles.

    Each spec is ``NAME:MIN,OPT,MAX`` where a shape is ``1x3x224x224``, or just the batch size
    (``input:1,32,64``: the other dimensions are the model's). Naming an input a second time
    starts the next profile.

    Raises:
        InputSpecError: A spec does not parse.
    """
    profiles: list[dict[str, ShapeRange]] = []
    for spec in specs:
        try:
            name, ranges = spec.rsplit(":", 1)
            lo, mid, hi = (_parse_dims(part) for part in ranges.split(","))
        except ValueError:
            raise InputSpecError(
                f"cannot parse shapes {spec!r}; write NAME:MIN,OPT,MAX with shapes like "
                "1x3x224x224 or batch sizes (input:1,32,64)"
            ) from None
        for profile in profiles:
            if name not in profile:
                profile[name] = ShapeRange(lo, mid, hi)
                break
        else:
            profiles.append({name: ShapeRange(lo, mid, hi)})
    return profiles


def _complete(spec: TensorSpec, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A batch-only shape ``(64,)`` becomes ``(64, *item_shape)``."""
    if len(shape) == 1 and len(spec.shape) > 1:
        shape = (shape[0], *spec.item_shape)
    if len(shape) != len(spec.shape) or any(
        d != DYNAMIC and d != s for d, s in zip(spec.shape, shape, strict=True)
    ):
        raise InputSpecError(
            f"shape {list(shape)} does not fit input {spec.name!r} {list(spec.shape)}"
        )
    if any(d == DYNAMIC for d in spec.item_shape):
        raise InputSpecError(f"give full shapes for {spec.name!r}, it has dynamic item dims")
    return shape


def load_calibration_data(path: Path, inputs: Sequence[TensorSpec]) -> dict[str, np.ndarray]:
    """Sample inputs for INT8 calibration, ``dtype[N, *item_shape]`` per input name.

    Args:
        path: An ``.npz`` holding one array per input name (a single array of any name for a
            one-input model), or a directory of ``.npy`` files (one-input models only), each one
            item or a batch of items, stacked in file-name order.
        inputs: The network inputs.

    Raises:
        InputSpecError: Missing inputs, wrong item shapes, or no samples.
    """
    arrays: dict[str, np.ndarray] = {}
    if path.is_dir():
        if len(inputs) != 1:
            raise InputSpecError("a calibration directory works for one-input models; use .npz")
        spec = inputs[0]
        parts = []
        for file in sorted(path.glob("*.npy")):
            array = np.load(file, allow_pickle=False)
            parts.append(array[None] if array.shape == spec.item_shape else array)
        if not parts:
            raise InputSpecError(f"no .npy files in calibration directory {path}")
        arrays[spec.name] = np.concatenate(parts)
    else:
        with np.load(path, allow_pickle=False) as npz:
            names = list(npz.files)
            if len(inputs) == 1 and len(names) == 1:
                arrays[inputs[0].name] = npz[names[0]]
            else:
                for spec in inputs:
                    if spec.name not in npz.files:
                        raise InputSpecError(
                            f"calibration file {path} has no array {spec.name!r} (it has {names})"
                        )
                    arrays[spec.name] = npz[spec.name]
    counts = set()
    for spec in inputs:
        array = arrays[spec.name]
        if array.shape[1:] != spec.item_shape:
            raise InputSpecError(
                f"calibration data for {spec.name!r} has items of shape {list(array.shape[1:])}, "
                f"the model expects {list(spec.item_shape)}"
            )
        arrays[spec.name] = np.ascontiguousarray(array.astype(spec.dtype, copy=False))
        counts.add(array.shape[0])
    if len(counts) != 1 or 0 in counts:
        raise InputSpecError(f"calibration inputs have unequal or zero sample counts {counts}")
    return arrays


def _make_calibrator(
    data: Mapping[str, np.ndarray], batch_size: int, cache_path: Path | None
) -> Any:
    """An ``IInt8EntropyCalibrator2`` feeding ``data`` in batches of ``batch_size`` from device
    buffers, reading/writing the calibration cache at ``cache_path``. Call ``close()`` after
    the build."""

    class _EntropyCalibrator(trt.IInt8EntropyCalibrator2):  # type: ignore[misc]
        def __init__(self) -> None:
            trt.IInt8EntropyCalibrator2.__init__(self)
            self.offset = 0
            self.count = next(iter(data.values())).shape[0]
            self.buffers = {
                name: cuda.DeviceBuffer(batch_size * array[0].nbytes)
                for name, array in data.items()
            }

        def get_batch_size(self) -> int:
            return batch_size

        def get_batch(self, names: list[str]) -> list[int]:
            if self.offset + batch_size > self.count:
                return []  # TensorRT: [] or None ends calibration
            for name in names:
                chunk = data[name][self.offset : self.offset + batch_size]
                cuda.memcpy_htod(self.buffers[name].ptr, chunk)
            self.offset += batch_size
            return [self.buffers[name].ptr for name in names]

        def read_calibration_cache(self) -> bytes | None:  # type: ignore[override]
            if cache_path is not None and cache_path.exists():
                return cache_path.read_bytes()
            return None

        def write_calibration_cache(self, cache: Any) -> None:
            if cache_path is not None:
                cache_path.write_bytes(bytes(cache))

        def close(self) -> None:
            for buf in self.buffers.values():
                buf.close()

    return _EntropyCalibrator()


def _make_progress_monitor(callback: ProgressCallback) -> Any:
    class _Monitor(trt.IProgressMonitor):  # type: ignore[misc]
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.steps: dict[str, tuple[str | None, int]] = {}

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            self.steps[phase_name] = (parent_phase, num_steps)
            callback(phase_name, parent_phase, None, num_steps)

        def step_complete(self, phase_name: str, step: int) -> bool:
            parent, total = self.steps.get(phase_name, (None, 0))
            return callback(phase_name, parent, step + 1, total) is not False

        def phase_finish(self, phase_name: str) -> None:
            parent, total = self.steps.pop(phase_name, (None, 0))
            callback(phase_name, parent, total, total)

    return _Monitor()


class ProgressPrinter:
    """Progress display for ``engines build``: one line per phase, indented by nesting,
    updated in place on a terminal."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.depth: dict[str, int] = {}
        self.started: dict[str, float] = {}
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def __call__(self, phase: str, parent: str | None, step: int | None, total: int) -> bool:
        depth = self.depth.setdefault(phase, self.depth.get(parent or "", -1) + 1)
        indent = "  " * depth
        if step is None:
            self.started[phase] = time.monotonic()
            if self.tty:
                self.stream.write(f"{indent}{phase} ...\n")
        elif step >= total and phase in self.started:
            took = time.monotonic() - self.started.pop(phase)
            self.stream.write(f"{indent}{phase}: done ({total} steps, {took:.1f} s)\n")
        elif self.tty:
            self.stream.write(f"\r{indent}{phase}: {step}/{total}")
        self.stream.flush()
        return True


def _network_inputs(network: Any) -> list[TensorSpec]:
    specs = []
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        specs.append(
            TensorSpec(tensor.name, np.dtype(trt.nptype(tensor.dtype)), dims_tuple(tensor.shape))
        )
    return specs


def _parse_onnx(network: Any, logger: CapturingLogger, onnx_path: Path) -> None:
    parser = trt.OnnxParser(network, logger.trt_logger)
    if not parser.parse(onnx_path.read_bytes(), str(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise BuildError(
            f"TensorRT could not parse {onnx_path}: {'; '.join(errors) or logger.last_errors()}"
        )


def build_plan(
    onnx_path: Path,
    plan_path: Path,
    *,
    fp16: bool = False,
    int8: bool = False,
    profiles: Sequence[Mapping[str, ShapeRange]] | None = None,
    max_batch: int = 64,
    calibration_data: Path | None = None,
    calibration_cache: Path | None = None,
    calibration_batch_size: int = 8,
    timing_cache: Path | None = None,
    workspace_mib: int | None = None,
    progress: ProgressCallback | None = None,
    device: int = 0,
    build_command: str | None = None,
) -> PlanMetadata:
    """Build ``plan_path`` (and ``plan_path.json``) from ``onnx_path``.

    Args:
        onnx_path: The model.
        plan_path: Where to write the serialized plan.
        fp16: Allow FP16 kernels (``BuilderFlag.FP16``).
        int8: Allow INT8 kernels (``BuilderFlag.INT8``) with an entropy calibrator
            (``IInt8EntropyCalibrator2``) fed from ``calibration_data``; needs that or an
            existing ``calibration_cache``.
        profiles: Optimization profiles (see :func:`parse_shapes`). Default: one profile with
            batch 1 / ``max_batch`` / ``max_batch`` for inputs whose only dynamic dim is the batch.
        max_batch: Largest batch of the default profile.
        calibration_data: ``.npz`` or directory of ``.npy`` samples (see
            :func:`load_calibration_data`).
        calibration_cache: Calibration cache file: reused when it exists, written otherwise.
        calibration_batch_size: Samples per calibration batch.
        timing_cache: Timing cache file: loaded when it exists, written after the build (makes
            rebuilds of similar networks faster).
        workspace_mib: Builder workspace limit (``MemoryPoolType.WORKSPACE``), MiB.
        progress: Called as TensorRT reports build phases (``IProgressMonitor``).
        device: CUDA device to build for.
        build_command: Command line recorded in the sidecar (default: reconstructed).

    Returns:
        The sidecar's content.

    Raises:
        BuildError: Parsing, the shapes, calibration or TensorRT's build failed.
        InputSpecError: Bad shapes or calibration data.
        BackendUnavailableError: TensorRT or CUDA is missing.
    """
    if int8 and calibration_data is None and not (calibration_cache and calibration_cache.exists()):
        raise BuildError(
            "--int8 needs sample inputs (--calib DATA.npz or a directory of .npy files) or an "
            "existing --calib-cache"
        )
    cuda.set_device(device)
    gpu = cuda.device_info(device)
    logger = make_logger()
    builder = trt.Builder(logger.trt_logger)
    network = builder.create_network(0)
    _parse_onnx(network, logger, onnx_path)
    inputs = _network_inputs(network)

    config = builder.create_builder_config()
    if workspace_mib is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mib << 20)
    # Lets 'engines inspect' show per-layer precision on real TensorRT.
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    if fp16:
        if not builder.platform_has_fast_fp16:
            logger.messages.append((2, "this GPU has no fast FP16; building anyway"))
        config.set_flag(trt.BuilderFlag.FP16)

    resolved = _resolve_profiles(inputs, profiles, max_batch)
    for profile_shapes in resolved:
        profile = builder.create_optimization_profile()
        for name, rng in profile_shapes.items():
            profile.set_shape(
                name, trt.Dims(list(rng.min)), trt.Dims(list(rng.opt)), trt.Dims(list(rng.max))
            )
        if config.add_optimization_profile(profile) < 0:
            raise BuildError(
                f"TensorRT rejected optimization profile {profile_shapes}: {logger.last_errors()}"
            )

    cache_obj = None
    if timing_cache is not None:
        blob = timing_cache.read_bytes() if timing_cache.exists() else b""
        cache_obj = config.create_timing_cache(blob)
        config.set_timing_cache(cache_obj, False)

    calibrator = None
    if int8:
        config.set_flag(trt.BuilderFlag.INT8)
        data = (
            load_calibration_data(calibration_data, inputs)
            if calibration_data
            else {
                s.name: np.zeros((calibration_batch_size, *s.item_shape), s.dtype) for s in inputs
            }
        )
        calibrator = _make_calibrator(data, calibration_batch_size, calibration_cache)
        config.int8_calibrator = calibrator
        calib_profile = builder.create_optimization_profile()
        for spec in inputs:
            shape = trt.Dims([calibration_batch_size, *spec.item_shape])
            calib_profile.set_shape(spec.name, shape, shape, shape)
        config.set_calibration_profile(calib_profile)

    if progress is not None:
        config.progress_monitor = _make_progress_monitor(progress)

    started = time.monotonic()
    try:
        serialized = builder.build_serialized_network(network, config)
    finally:
        if calibrator is not None:
            calibrator.close()
    if serialized is None:
        raise BuildError(f"TensorRT could not build {onnx_path}: {logger.last_errors()}")
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    plan_path.write_bytes(bytes(serialized))
    if cache_obj is not None and timing_cache is not None:
        timing_cache.write_bytes(bytes(cache_obj.serialize()))

    precision = "+".join(p for p, on in (("int8", int8), ("fp16", fp16)) if on) or "fp32"
    meta = PlanMetadata(
        tensorrt_version=str(trt.__version__),
        gpu_name=gpu.name,
        compute_capability=f"{gpu.compute_capability[0]}.{gpu.compute_capability[1]}",
        precision=precision,
        profiles=[{n: r.as_dict() for n, r in p.items()} for p in resolved],
        onnx_sha256=sha256_file(onnx_path),
        onnx_path=str(onnx_path),
        plan_sha256=sha256_file(plan_path),
        build_command=build_command
        or _default_command(onnx_path, plan_path, fp16, int8, resolved, timing_cache),
        built_at=datetime.now(UTC).isoformat(timespec="seconds"),
        standin=is_standin(),
        extra={
            "build_seconds": round(time.monotonic() - started, 3),
            "workspace_mib": workspace_mib,
            "timing_cache": str(timing_cache) if timing_cache else None,
            "calibration_cache": str(calibration_cache) if calibration_cache else None,
            "builder_messages": [m for level, m in logger.messages if level <= 2][-20:],
            "timing_cache_stats": next(
                (m for _, m in reversed(logger.messages) if m.startswith("Timing cache")), None
            ),
        },
    )
    meta.write(plan_path)
    return meta


def _resolve_profiles(
    inputs: Sequence[TensorSpec],
    profiles: Sequence[Mapping[str, ShapeRange]] | None,
    max_batch: int,
) -> list[dict[str, ShapeRange]]:
    names = {s.name for s in inputs}
    if profiles:
        resolved = []
        for index, profile in enumerate(profiles):
            unknown = set(profile) - names
            if unknown:
                raise InputSpecError(
                    f"--shapes names {sorted(unknown)}, the model's inputs are {sorted(names)}"
                )
            entry = {}
            for spec in inputs:
                rng = profile.get(spec.name)
                if rng is None:
                    if any(d == DYNAMIC for d in spec.shape):
                        raise InputSpecError(
                            f"profile {index} has no shapes for dynamic input {spec.name!r} "
                            f"{list(spec.shape)}; add --shapes {spec.name}:MIN,OPT,MAX"
                        )
                    continue
                entry[spec.name] = ShapeRange(
                    _complete(spec, rng.min), _complete(spec, rng.opt), _complete(spec, rng.max)
                )
            resolved.append(entry)
        return resolved
    entry = {}
    for spec in inputs:
        if any(d == DYNAMIC for d in spec.item_shape):
            raise InputSpecError(
                f"input {spec.name!r} {list(spec.shape)} has dynamic dims besides the batch; "
                f"give --shapes {spec.name}:MIN,OPT,MAX"
            )
        if spec.shape and spec.shape[0] == DYNAMIC:
            entry[spec.name] = ShapeRange(
                (1, *spec.item_shape), (max_batch, *spec.item_shape), (max_batch, *spec.item_shape)
            )
    return [entry] if entry else []


def _default_command(
    onnx_path: Path,
    plan_path: Path,
    fp16: bool,
    int8: bool,
    profiles: Sequence[Mapping[str, ShapeRange]],
    timing_cache: Path | None,
) -> str:
    args = ["engines", "build", str(onnx_path), "-o", str(plan_path)]
    if fp16:
        args.append("--fp16")
    if int8:
        args += ["--int8", "--calib", "SAMPLES.npz"]
    for profile in profiles:
        for name, rng in profile.items():
            fmt = ",".join("x".join(map(str, s)) for s in (rng.min, rng.opt, rng.max))
            args += ["--shapes", f"{name}:{fmt}"]
    if timing_cache:
        args += ["--timing-cache", str(timing_cache)]
    return shlex.join(args)
