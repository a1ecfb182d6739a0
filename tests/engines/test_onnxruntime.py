from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from engines import registry
from engines.base import TensorSpec
from engines.exceptions import (
    EngineClosedError,
    EngineError,
    EngineLoadError,
    EngineRuntimeError,
    InputSpecError,
    OutOfMemoryError,
)
from engines.onnxruntime import OnnxRuntimeEngine, read_opset_imports

from .conftest import ModelFactory


def _batch(batch: int, shape: tuple[int, ...] = (1, 8, 8), seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, *shape)).astype(np.float32)


def _save(
    path: Path,
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
    initializers: Sequence[onnx.TensorProto] = (),
    opsets: dict[str, int] | None = None,
) -> Path:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    imports = [helper.make_opsetid(d, v) for d, v in (opsets or {"": 17}).items()]
    onnx.save(helper.make_model(graph, opset_imports=imports), path)
    return path


@pytest.mark.parametrize("batch", [1, 7, 64])
def test_outputs_equal_a_direct_session(onnx_model: Path, batch: int) -> None:
    x = _batch(batch)
    direct = ort.InferenceSession(str(onnx_model), providers=["CPUExecutionProvider"])
    (expected,) = direct.run(None, {"input": x})

    with OnnxRuntimeEngine(onnx_model) as engine:
        outputs = engine.infer({"input": x})

    assert list(outputs) == ["probs"]
    assert outputs["probs"].dtype == np.float32
    assert outputs["probs"].shape == (batch, 10)
    np.testing.assert_array_equal(outputs["probs"], expected)
    np.testing.assert_allclose(outputs["probs"].sum(axis=1), 1.0, rtol=1e-5)


def test_specs_and_info(onnx_model: Path) -> None:
    with OnnxRuntimeEngine(onnx_model) as engine:
        assert engine.inputs == (TensorSpec("input", np.dtype("float32"), (-1, 1, 8, 8)),)
        assert engine.outputs == (TensorSpec("probs", np.dtype("float32"), (-1, 10)),)
        info = engine.info
    assert info.backend == "onnxruntime"
    assert info.model_path == str(onnx_model)
    assert info.model_sha256 == hashlib.sha256(onnx_model.read_bytes()).hexdigest()
    assert info.version == ort.__version__
    assert info.device == "cpu"
    assert info.precision == "fp32"
    assert info.max_batch_size == engine.max_batch_size == 256
    assert info.extra["providers"] == ["CPUExecutionProvider"]
    assert info.extra["opsets"] == {"": 17}
    assert info.tag == f"onnxruntime-{ort.__version__}:{info.model_sha256[:8]}"


def test_fp16_model_reports_fp16(make_onnx_model: ModelFactory) -> None:
    path = make_onnx_model(dtype=TensorProto.FLOAT16)
    with OnnxRuntimeEngine(path) as engine:
        assert engine.inputs[0].dtype == np.float16
        assert engine.info.precision == "fp16"
        out = engine.infer({"input": _batch(3).astype(np.float16)})
    assert out["probs"].dtype == np.float16
    assert out["probs"].shape == (3, 10)


def test_fixed_batch_dimension_caps_max_batch(make_onnx_model: ModelFactory) -> None:
    path = make_onnx_model(batch_dim=4)
    with OnnxRuntimeEngine(path, max_batch_size=256) as engine:
        assert engine.inputs[0].shape == (4, 1, 8, 8)
        assert engine.max_batch_size == 4
        assert engine.infer({"input": _batch(4)})["probs"].shape == (4, 10)
        with pytest.raises(InputSpecError, match="'input'"):
            engine.infer({"input": _batch(2)})


def test_symbolic_and_unknown_dims_become_dynamic(tmp_path: Path) -> None:
    path = _save(
        tmp_path / "identity.onnx",
        [helper.make_node("Identity", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.INT64, ["n", "height", 3])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, None)],
    )
    with OnnxRuntimeEngine(path) as engine:
        assert engine.inputs == (TensorSpec("x", np.dtype("int64"), (-1, -1, 3)),)
        assert engine.outputs[0].dtype == np.int64
        x = np.arange(2 * 5 * 3, dtype=np.int64).reshape(2, 5, 3)
        np.testing.assert_array_equal(engine.infer({"x": x})["y"], x)


@pytest.mark.parametrize(
    ("array", "fragment"),
    [
        pytest.param(_batch(2).astype(np.float64), "dtype float64", id="dtype"),
        pytest.param(_batch(2, (1, 8, 9)), "shape (2, 1, 8, 9)", id="shape"),
        pytest.param(_batch(2, (8, 8)), "rank 4", id="rank"),
        pytest.param(_batch(17), "batch 17", id="batch-over-max"),
    ],
)
def test_bad_inputs_raise_input_spec_error_naming_the_input(
    onnx_model: Path, array: np.ndarray, fragment: str
) -> None:
    with OnnxRuntimeEngine(onnx_model, max_batch_size=16) as engine:
        with pytest.raises(InputSpecError, match="'input'") as info:
            engine.infer({"input": array})
    assert fragment in str(info.value)
    assert not info.value.retriable


def test_max_batch_size_is_accepted_exactly(onnx_model: Path) -> None:
    with OnnxRuntimeEngine(onnx_model, max_batch_size=16) as engine:
        assert engine.infer({"input": _batch(16)})["probs"].shape == (16, 10)


@pytest.mark.parametrize("kind", ["missing", "directory", "garbage", "not-a-model"])
def test_load_failures_raise_engine_load_error_with_the_path(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "model.onnx"
    if kind == "directory":
        path.mkdir()
    elif kind == "garbage":
        path.write_bytes(b"\x00\xffnot protobuf at all")
    elif kind == "not-a-model":
        path.write_bytes(b"")
    with pytest.raises(EngineLoadError) as info:
        OnnxRuntimeEngine(path)
    assert str(path) in str(info.value)
    assert not info.value.retriable


def test_scalar_input_cannot_batch(tmp_path: Path) -> None:
    path = _save(
        tmp_path / "scalar.onnx",
        [helper.make_node("Identity", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
    )
    with pytest.raises(EngineLoadError, match=r"'x'.*scalar"):
        OnnxRuntimeEngine(path)


def test_model_without_inputs_cannot_batch(tmp_path: Path) -> None:
    value = helper.make_tensor("value", TensorProto.FLOAT, [1, 2], [1.0, 2.0])
    path = _save(
        tmp_path / "constant.onnx",
        [helper.make_node("Constant", [], ["y"], value=value)],
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
    )
    with pytest.raises(EngineLoadError, match="no inputs"):
        OnnxRuntimeEngine(path)


@pytest.mark.parametrize(
    "options",
    [{"max_batch_size": 0}, {"intra_op_threads": -1}, {"providers": ["NoSuchExecutionProvider"]}],
)
def test_invalid_options_raise_engine_load_error(onnx_model: Path, options: dict) -> None:
    with pytest.raises(EngineLoadError):
        OnnxRuntimeEngine(onnx_model, **options)


@pytest.mark.parametrize(
    "options", [{"intra_op_threads": 1}, {"intra_op_threads": 2, "inter_op_threads": 2}]
)
def test_thread_options_give_the_same_outputs(onnx_model: Path, options: dict) -> None:
    x = _batch(8)
    with OnnxRuntimeEngine(onnx_model) as default, OnnxRuntimeEngine(onnx_model, **options) as e:
        np.testing.assert_allclose(
            e.infer({"input": x})["probs"], default.infer({"input": x})["probs"], rtol=1e-6
        )


@pytest.mark.skipif(
    "CUDAExecutionProvider" in ort.get_available_providers(), reason="CUDA EP is installed here"
)
def test_requested_but_absent_cuda_falls_back_to_cpu(
    onnx_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="engines.onnxruntime.runner"):
        engine = OnnxRuntimeEngine(onnx_model, providers=["cuda"])
    assert engine.info.device == "cpu"
    assert engine.info.extra["providers"] == ["CPUExecutionProvider"]
    assert "CUDAExecutionProvider is not installed" in caplog.text
    assert engine.infer({"input": _batch(2)})["probs"].shape == (2, 10)


@pytest.mark.gpu
@pytest.mark.skipif(
    "CUDAExecutionProvider" not in ort.get_available_providers(),
    reason="needs onnxruntime-gpu with the CUDA execution provider",
)
def test_cuda_provider_matches_cpu(onnx_model: Path) -> None:
    x = _batch(32)
    with (
        OnnxRuntimeEngine(onnx_model, providers=[("cuda", {"device_id": 0})]) as gpu,
        OnnxRuntimeEngine(onnx_model) as cpu,
    ):
        assert gpu.info.device == "cuda:0"
        assert gpu.info.extra["providers"][0] == "CUDAExecutionProvider"
        np.testing.assert_allclose(
            gpu.infer({"input": x})["probs"], cpu.infer({"input": x})["probs"], atol=1e-5
        )


def test_closed_engine_raises(onnx_model: Path) -> None:
    engine = OnnxRuntimeEngine(onnx_model)
    with engine:
        engine.infer({"input": _batch(1)})
    assert engine.closed
    engine.close()  # idempotent
    with pytest.raises(EngineClosedError):
        engine.infer({"input": _batch(1)})


def test_runtime_failure_is_translated(tmp_path: Path) -> None:
    # Reshape [batch, 4] -> [-1, 3] only works when batch * 4 is a multiple of 3.
    path = _save(
        tmp_path / "reshape.onnx",
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", 3])],
        [helper.make_tensor("shape", TensorProto.INT64, [2], [-1, 3])],
    )
    with OnnxRuntimeEngine(path) as engine:
        assert engine.infer({"x": np.ones((3, 4), np.float32)})["y"].shape == (4, 3)
        with pytest.raises(EngineRuntimeError, match=r"reshape\.onnx") as info:
            engine.infer({"x": np.ones((1, 4), np.float32)})
    assert info.value.retriable
    assert isinstance(info.value.__cause__, ort_state.Fail)


@pytest.mark.parametrize(
    ("ort_error", "expected", "retriable"),
    [
        (ort_state.InvalidArgument("Unexpected input data type"), InputSpecError, False),
        (ort_state.Fail("Non-zero status code returned"), EngineRuntimeError, True),
        (ort_state.RuntimeException("kernel failed"), EngineRuntimeError, True),
        (ort_state.EPFail("CUDA failure 2: out of memory"), OutOfMemoryError, True),
        (
            ort_state.RuntimeException("Failed to allocate memory for requested buffer of size 8"),
            OutOfMemoryError,
            True,
        ),
        (MemoryError(), OutOfMemoryError, True),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else None,
)
def test_run_errors_are_translated(
    onnx_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    ort_error: Exception,
    expected: type[EngineError],
    retriable: bool,
) -> None:
    engine = OnnxRuntimeEngine(onnx_model)

    def failing_run(*args: object, **kwargs: object) -> None:
        raise ort_error

    monkeypatch.setattr(engine._session, "run", failing_run)
    with pytest.raises(EngineError) as info:
        engine.infer({"input": _batch(2)})
    assert type(info.value) is expected
    assert info.value.retriable is retriable
    assert info.value.__cause__ is ort_error


def test_concurrent_runs_from_threads_match_sequential(onnx_model: Path) -> None:
    batches = [_batch(b, seed=b) for b in range(1, 33)]
    with OnnxRuntimeEngine(onnx_model) as engine:
        expected = [engine.infer({"input": x})["probs"] for x in batches]
        with ThreadPoolExecutor(max_workers=8) as pool:
            got = list(pool.map(lambda x: engine.infer({"input": x})["probs"], batches))
    for want, have in zip(expected, got, strict=True):
        np.testing.assert_array_equal(have, want)


def test_load_engine_auto_picks_onnxruntime(onnx_model: Path) -> None:
    preferred = registry.AUTO_ORDER[: registry.AUTO_ORDER.index("onnxruntime")]
    ahead = [name for name in registry.available_backends() if name in preferred]
    if ahead:
        pytest.skip(f"auto prefers {ahead[0]} on this machine")
    with registry.load_engine("auto", onnx_model, max_batch_size=8) as engine:
        assert isinstance(engine, OnnxRuntimeEngine)
        assert engine.info.backend == "onnxruntime"
        assert engine.max_batch_size == 8


def test_read_opset_imports_matches_onnx(tmp_path: Path) -> None:
    # A large initializer before the opset list exercises skipping over the graph.
    big = np.zeros(300_000, np.float32)
    path = _save(
        tmp_path / "opsets.onnx",
        [helper.make_node("Identity", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 300_000])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 300_000])],
        [helper.make_tensor("unused", TensorProto.FLOAT, big.shape, big)],
        opsets={"": 21, "com.microsoft": 1, "ai.onnx.ml": 3},
    )
    model = onnx.load(path)
    assert read_opset_imports(path) == {o.domain: o.version for o in model.opset_import}
    assert read_opset_imports(path) == {"": 21, "com.microsoft": 1, "ai.onnx.ml": 3}


@pytest.mark.parametrize("cut", [1, 100, -3])
def test_read_opset_imports_rejects_truncated_files(
    onnx_model: Path, tmp_path: Path, cut: int
) -> None:
    data = onnx_model.read_bytes()
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(data[:cut])
    with pytest.raises(ValueError, match="truncated"):
        read_opset_imports(truncated)
