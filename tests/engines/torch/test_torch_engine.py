"""The torch backend's CPU-testable parts: ONNX normalisation for onnx2torch, IO specs, options,
``infer`` on a CPU device. Stream execution and CUDA graphs run in tests/engines/gpu."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from engines.exceptions import EngineLoadError
from engines.torch import is_available
from engines.torch.engine import load, normalize_for_onnx2torch, onnx_io_specs


def _conv_model() -> onnx.ModelProto:
    """Conv with its weight from a Constant node and its bias through an Identity of an
    initializer: the two forms onnx2torch 1.5.15 cannot convert."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    bias = np.zeros(4, np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["w"], value=numpy_helper.from_array(weight)),
            helper.make_node("Identity", ["bias0"], ["b"]),
            helper.make_node("Conv", ["input", "w", "b"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 4, 6, 6])],
        [numpy_helper.from_array(bias, "bias0")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def test_normalisation_keeps_the_computation() -> None:
    model = _conv_model()
    x = np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(np.float32)
    before = ort.InferenceSession(model.SerializeToString()).run(None, {"input": x})[0]
    normalized = normalize_for_onnx2torch(model)
    assert [n.op_type for n in normalized.graph.node] == ["Conv"]
    assert list(normalized.graph.node[0].input) == ["input", "w", "bias0"]
    after = ort.InferenceSession(normalized.SerializeToString()).run(None, {"input": x})[0]
    np.testing.assert_array_equal(before, after)


def test_io_specs_come_from_the_graph(onnx_model: Path) -> None:
    inputs, outputs = onnx_io_specs(onnx.load(str(onnx_model)))
    assert [(s.name, str(s.dtype), s.shape) for s in inputs] == [
        ("input", "float32", (-1, 1, 8, 8))
    ]
    assert [(s.name, s.shape) for s in outputs] == [("probs", (-1, 10))]


def test_loader_refuses_unknown_options_and_non_onnx_files(tmp_path: Path) -> None:
    with pytest.raises(EngineLoadError, match="unknown torch backend options"):
        load(tmp_path / "m.onnx", colour="blue")
    with pytest.raises(EngineLoadError, match=r"loads \.onnx models"):
        load(tmp_path / "m.plan")


def test_not_available_without_cuda() -> None:
    from engines import cuda

    if cuda.is_available():
        pytest.skip("a GPU is present")
    assert not is_available()


def test_infer_on_cpu_matches_onnxruntime(onnx_model: Path) -> None:
    pytest.importorskip("onnx2torch", reason="onnx2torch is only in the GPU environment")
    engine = load(onnx_model, device="cpu", max_batch_size=8)
    x = np.random.default_rng(0).random((5, 1, 8, 8), dtype=np.float32)
    out = engine.infer({"input": x})["probs"]
    reference = ort.InferenceSession(str(onnx_model)).run(None, {"input": x})[0]
    np.testing.assert_allclose(out, reference, rtol=1e-5, atol=1e-6)


def test_cuda_graph_buckets_cover_every_batch_size() -> None:
    from engines.torch.engine import graph_batch_sizes

    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert graph_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert graph_batch_sizes(1) == [1]
    for max_batch in (1, 7, 48, 64):
        sizes = graph_batch_sizes(max_batch)
        assert all(any(b >= n for b in sizes) for n in range(1, max_batch + 1))
        assert max(sizes) == max_batch
