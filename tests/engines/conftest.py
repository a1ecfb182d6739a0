"""Fixtures for the engines tests: small ONNX models built in the test."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

#: Builds a model file: ``make_onnx_model(name, batch_dim=..., dtype=...) -> path``.
ModelFactory = Callable[..., Path]


def build_classifier(
    path: Path,
    *,
    batch_dim: str | int = "batch",
    dtype: int = TensorProto.FLOAT,
    item_shape: tuple[int, ...] = (1, 8, 8),
    classes: int = 10,
    seed: int = 0,
) -> Path:
    """Flatten -> MatMul -> Add -> Softmax: ``input`` dtype[batch, *item_shape] -> ``probs``
    dtype[batch, classes], with seeded random weights; ``batch_dim`` an int fixes the batch."""
    features = int(np.prod(item_shape))
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((features, classes)).astype(np_dtype)
    bias = rng.standard_normal(classes).astype(np_dtype)
    graph = helper.make_graph(
        [
            helper.make_node("Flatten", ["input"], ["flat"], axis=1),
            helper.make_node("MatMul", ["flat", "weight"], ["logits"]),
            helper.make_node("Add", ["logits", "bias"], ["shifted"]),
            helper.make_node("Softmax", ["shifted"], ["probs"], axis=-1),
        ],
        "classifier",
        [helper.make_tensor_value_info("input", dtype, [batch_dim, *item_shape])],
        [helper.make_tensor_value_info("probs", dtype, [batch_dim, classes])],
        [
            helper.make_tensor("weight", dtype, weight.shape, weight.ravel()),
            helper.make_tensor("bias", dtype, bias.shape, bias),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


@pytest.fixture
def make_onnx_model(tmp_path: Path) -> ModelFactory:
    """Factory for classifier models in ``tmp_path``; keyword arguments as build_classifier."""

    def make(name: str = "model.onnx", **kwargs: object) -> Path:
        return build_classifier(tmp_path / name, **kwargs)  # type: ignore[arg-type]

    return make


@pytest.fixture
def onnx_model(make_onnx_model: ModelFactory) -> Path:
    """``input`` float32[batch, 1, 8, 8] -> ``probs`` float32[batch, 10], opset 17."""
    return make_onnx_model()

