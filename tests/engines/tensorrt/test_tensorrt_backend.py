"""``engines build`` and the TensorRT runtime, against the stand-in (not real TensorRT)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from typer.testing import CliRunner

from engines import load_engine
from engines.cli import app
from engines.exceptions import EngineLoadError, InputSpecError, PlanMismatchError
from engines.executor.cuda import CudaExecutor
from engines.tensorrt.builder import build_plan, parse_shapes
from engines.tensorrt.engine import TensorRTEngine
from engines.tensorrt.exceptions import BuildError
from engines.tensorrt.plan import PlanMetadata, sha256_file, sidecar_path
from engines.testing import fake_trt


def _x(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((n, 1, 8, 8), dtype=np.float32)


def _reference(model: Path, x: np.ndarray) -> np.ndarray:
    """ONNX Runtime's output. The IR version is capped at 10: an onnx newer than the
    onnxruntime (as on the GPU machine's image) writes IR versions it cannot load."""
    proto = onnx.load(str(model))
    proto.ir_version = min(proto.ir_version, 10)
    session = ort.InferenceSession(proto.SerializeToString())
    return np.asarray(session.run(["probs"], {"input": x})[0])


def test_build_writes_plan_and_sidecar_and_the_plan_predicts_like_onnxruntime(
    onnx_model: Path, tmp_path: Path
) -> None:
    plan = tmp_path / "model.plan"
    meta = build_plan(onnx_model, plan, max_batch=32)
    side = json.loads(sidecar_path(plan).read_text())
    assert side["tensorrt_version"] == fake_trt.__version__
    assert side["gpu_name"].startswith("Stand-in CUDA device")
    assert side["compute_capability"] == "9.0"
    assert side["precision"] == "fp32"
    assert side["onnx_sha256"] == sha256_file(onnx_model)
    assert side["profiles"] == [
        {"input": {"min": [1, 1, 8, 8], "opt": [32, 1, 8, 8], "max": [32, 1, 8, 8]}}
    ]
    assert side["standin"] is True
    assert meta.build_command.startswith("engines build")
    x = _x(20)
    with load_engine("tensorrt", plan) as engine:
        assert engine.max_batch_size == 32
        assert [s.name for s in engine.inputs] == ["input"]
        assert engine.outputs[0].shape == (-1, 10)
        out = engine.infer({"input": x})["probs"]
        with pytest.raises(InputSpecError, match="maximum 32"):
            engine.infer({"input": _x(33)})
    np.testing.assert_allclose(out, _reference(onnx_model, x), rtol=1e-5, atol=1e-6)


def test_each_batch_runs_on_the_profile_that_fits_it(onnx_model: Path, tmp_path: Path) -> None:
    plan = tmp_path / "two.plan"
    build_plan(onnx_model, plan, profiles=parse_shapes(["input:1,4,8", "input:9,32,64"]))
    with load_engine("tensorrt", plan) as engine:
        assert isinstance(engine, TensorRTEngine)
        assert [(p.min_batch, p.max_batch) for p in engine.profiles] == [(1, 8), (9, 64)]
        assert engine.select_profile(8).index == 0
        assert engine.select_profile(9).index == 1
        x = _x(64)

        async def run() -> list[np.ndarray]:
            async with CudaExecutor(engine, streams=2) as ex:
                sizes = [1, 64, 8, 9, 3, 40]
                return await asyncio.gather(
                    *(ex.run([{"input": row} for row in x[:n]]) for n in sizes)
                )

        outs = asyncio.run(run())
    reference = _reference(onnx_model, x)
    for out, n in zip(outs, [1, 64, 8, 9, 3, 40], strict=True):
        np.testing.assert_allclose(out["probs"], reference[:n], rtol=1e-5, atol=1e-6)


def test_fp16_plan_is_close_to_fp32(onnx_model: Path, tmp_path: Path) -> None:
    plan = tmp_path / "fp16.plan"
    assert build_plan(onnx_model, plan, fp16=True).precision == "fp16"
    x = _x(16)
    with load_engine("tensorrt", plan) as engine:
        assert engine.info.precision == "fp16"
        out = engine.infer({"input": x})["probs"]
    np.testing.assert_allclose(out, _reference(onnx_model, x), atol=2e-2)


def test_int8_calibrates_from_samples_then_reuses_the_cache(
    onnx_model: Path, tmp_path: Path
) -> None:
    samples = tmp_path / "calib.npz"
    np.savez(samples, input=_x(40))
    cache = tmp_path / "calib.cache"
    meta = build_plan(
        onnx_model,
        tmp_path / "a.plan",
        int8=True,
        calibration_data=samples,
        calibration_cache=cache,
        calibration_batch_size=8,
    )
    assert meta.precision == "int8"
    assert json.loads(cache.read_bytes()[8:])["batches"] == 5  # 40 samples / 8
    # The cache alone is enough now.
    build_plan(onnx_model, tmp_path / "b.plan", int8=True, calibration_cache=cache)
    with pytest.raises(BuildError, match="--calib"):
        build_plan(onnx_model, tmp_path / "c.plan", int8=True)
    directory = tmp_path / "samples"
    directory.mkdir()
    for i, item in enumerate(_x(3)):
        np.save(directory / f"{i}.npy", item)
    build_plan(
        onnx_model,
        tmp_path / "d.plan",
        int8=True,
        calibration_data=directory,
        calibration_batch_size=1,
    )


def test_timing_cache_is_written_and_reused(onnx_model: Path, tmp_path: Path) -> None:
    cache = tmp_path / "timing.cache"
    first = build_plan(onnx_model, tmp_path / "a.plan", timing_cache=cache)
    assert cache.exists()
    second = build_plan(onnx_model, tmp_path / "b.plan", timing_cache=cache)
    assert first.extra["timing_cache_stats"] == "Timing cache: 0 hits, 4 misses"
    assert second.extra["timing_cache_stats"] == "Timing cache: 4 hits, 0 misses"


def test_progress_is_reported_and_can_cancel_the_build(onnx_model: Path, tmp_path: Path) -> None:
    phases: list[tuple[str, int | None]] = []

    def progress(phase: str, parent: str | None, step: int | None, total: int) -> bool:
        phases.append((phase, step))
        return True

    build_plan(onnx_model, tmp_path / "a.plan", progress=progress)
    assert ("Building engine", None) in phases
    with pytest.raises(BuildError, match="cancelled"):
        build_plan(onnx_model, tmp_path / "b.plan", progress=lambda *a: False)


def test_build_errors_say_what_is_wrong(onnx_model: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not onnx")
    with pytest.raises(BuildError, match="could not parse"):
        build_plan(bad, tmp_path / "x.plan")
    with pytest.raises(InputSpecError, match=r"inputs are \[.input.\]"):
        build_plan(onnx_model, tmp_path / "x.plan", profiles=parse_shapes(["image:1,2,4"]))
    with pytest.raises(InputSpecError, match="does not fit"):
        build_plan(onnx_model, tmp_path / "x.plan", profiles=parse_shapes(["input:1x3,2x3,4x3"]))
    with pytest.raises(InputSpecError, match="cannot parse"):
        parse_shapes(["input:1,2"])


def _built(onnx_model: Path, tmp_path: Path) -> Path:
    plan = tmp_path / "model.plan"
    build_plan(onnx_model, plan)
    return plan


def test_plan_for_another_gpu_is_refused_with_the_rebuild_command(
    onnx_model: Path, tmp_path: Path
) -> None:
    plan = _built(onnx_model, tmp_path)
    side = json.loads(sidecar_path(plan).read_text())
    sidecar_path(plan).write_text(
        json.dumps(dict(side, gpu_name="NVIDIA A10", compute_capability="8.6"))
    )
    with pytest.raises(PlanMismatchError) as info:
        load_engine("tensorrt", plan)
    message = str(info.value)
    assert "built for NVIDIA A10 (compute capability 8.6)" in message
    assert "rebuild it on this machine: engines build" in message
    assert not info.value.retriable


def test_plan_from_another_tensorrt_version_is_refused(onnx_model: Path, tmp_path: Path) -> None:
    plan = _built(onnx_model, tmp_path)
    side = json.loads(sidecar_path(plan).read_text())
    sidecar_path(plan).write_text(json.dumps(dict(side, tensorrt_version="10.0.1")))
    with pytest.raises(PlanMismatchError, match=r"TensorRT 10\.0\.1 built it"):
        load_engine("tensorrt", plan)


def test_missing_sidecar_changed_plan_and_corrupt_plan(onnx_model: Path, tmp_path: Path) -> None:
    plan = _built(onnx_model, tmp_path)
    plan.write_bytes(plan.read_bytes() + b"x")
    with pytest.raises(EngineLoadError, match="does not match its sidecar"):
        load_engine("tensorrt", plan)
    sidecar_path(plan).unlink()
    with pytest.raises(EngineLoadError, match="no metadata sidecar"):
        load_engine("tensorrt", plan)
    plan.write_bytes(b"garbage")
    with pytest.raises(EngineLoadError, match=r"could not deserialize.*magicTag"):
        load_engine("tensorrt", plan, check_sidecar=False)
    with pytest.raises(EngineLoadError, match="Build one first"):
        load_engine("tensorrt", onnx_model)


def test_standin_follows_tensorrt_error_behaviour(onnx_model: Path, tmp_path: Path) -> None:
    """What the backend relies on: False/None returns and logged errors, as TensorRT does."""
    trt = fake_trt
    logged: list[str] = []

    class Log(trt.ILogger):
        def log(self, severity: trt.ILogger.Severity, msg: str) -> None:
            logged.append(msg)

    logger = Log()
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    assert trt.OnnxParser(network, logger).parse(onnx_model.read_bytes())
    config = builder.create_builder_config()
    assert builder.build_serialized_network(network, config) is None  # dynamic, no profile
    assert "no optimization profile" in logged[-1]
    profile = builder.create_optimization_profile()
    with pytest.raises(RuntimeError, match="inconsistent"):
        profile.set_shape(
            "input", trt.Dims([4, 1, 8, 8]), trt.Dims([2, 1, 8, 8]), trt.Dims([8, 1, 8, 8])
        )
    profile.set_shape(
        "input", trt.Dims([1, 1, 8, 8]), trt.Dims([4, 1, 8, 8]), trt.Dims([8, 1, 8, 8])
    )
    assert config.add_optimization_profile(profile) == 0
    plan = builder.build_serialized_network(network, config)
    assert plan is not None
    engine = trt.Runtime(logger).deserialize_cuda_engine(plan)
    assert engine is not None
    assert engine.num_io_tensors == 2
    assert engine.get_tensor_mode("input") == trt.TensorIOMode.INPUT
    assert engine.get_tensor_shape("input") == (-1, 1, 8, 8)
    context = engine.create_execution_context()
    assert not context.set_input_shape("input", (9, 1, 8, 8))
    assert "does not satisfy any optimization profile" in logged[-1]
    assert not context.set_input_shape("probs", (1, 10))
    assert not context.set_optimization_profile_async(1, 0)
    assert context.set_input_shape("input", (2, 1, 8, 8))
    assert context.get_tensor_shape("probs") == (2, 10)
    assert not context.set_tensor_address("nope", 1)
    assert not context.execute_async_v3(0)  # no addresses
    assert "Address is not set" in logged[-1]


def test_cli_build_and_inspect(onnx_model: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    plan = tmp_path / "cli.plan"
    result = runner.invoke(
        app, ["build", str(onnx_model), "-o", str(plan), "--fp16", "--shapes", "input:1,8,16"]
    )
    assert result.exit_code == 0, result.output
    assert "fp16" in result.output and "[stand-in]" in result.output
    result = runner.invoke(app, ["inspect", str(plan)])
    assert result.exit_code == 0, result.output
    assert "0: input  min [1, 1, 8, 8]  opt [8, 1, 8, 8]  max [16, 1, 8, 8]" in result.output
    assert "probs  float32  [batch, 10]" in result.output
    assert "standin: True" in result.output
    meta = PlanMetadata.read(plan)
    assert meta.build_command.startswith("engines build")
    result = runner.invoke(app, ["build", str(onnx_model), "-o", str(plan), "--int8"])
    assert result.exit_code == 1
    assert "error: --int8 needs sample inputs" in result.output
