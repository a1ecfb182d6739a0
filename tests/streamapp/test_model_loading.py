"""Loading a worker's models (streamapp.models.loading): the configured backend, ``auto`` through
the registry, and settings that refuse test-only backends unless a test registered them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError
from sklearn.datasets import load_digits

from engines import registry
from engines.exceptions import EngineLoadError
from engines.onnxruntime import OnnxRuntimeEngine
from streamapp.models import ModelRepository
from streamapp.models.loading import load_models
from streamapp.records import InferenceRequest, TensorPayload
from streamapp.settings import Settings


def _close(models: dict[str, Any]) -> None:
    for model in models.values():
        model.executor.engine.close()


def test_auto_serves_digits_with_a_real_backend_even_with_test_backends_registered(
    test_backends: dict[str, registry.Backend],
) -> None:
    models = load_models(Settings(backend="auto", max_batch_size=4))
    try:
        info = models["digits"].info
        assert info.backend == registry.auto_candidates()[0] == "onnxruntime"
        # It predicts: the first scikit-learn digit is a 0.
        digits = ModelRepository().get("digits")
        image = load_digits().images[0].astype(np.uint8)
        request = InferenceRequest("r", "d", 0, 1.7e9, "digits",
                                   tensor=TensorPayload("uint8", (8, 8), image.tobytes()))
        engine = models["digits"].executor.engine
        out = engine.infer({engine.inputs[0].name: digits.preprocess(request)[None]})
        assert digits.top_k(next(iter(out.values()))[0], 1)[0]["label"] == "0"
    finally:
        _close(models)


def test_auto_falls_through_to_the_next_backend_that_loads_the_model(
    isolated_registry: dict[str, registry.Backend],
) -> None:
    def plans_only(model_path: Path, **options: Any) -> OnnxRuntimeEngine:
        raise EngineLoadError(f"{model_path.name} is not a TensorRT plan")

    registry.register("tensorrt", plans_only)  # available, but cannot load an ONNX file
    models = load_models(Settings(backend="auto"))
    try:
        assert models["digits"].info.backend == "onnxruntime"
    finally:
        _close(models)
    with pytest.raises(EngineLoadError, match=r"model\.onnx is not a TensorRT plan"):
        load_models(Settings(backend="tensorrt"))


def test_settings_refuse_a_test_only_backend_that_no_test_registered(
    isolated_registry: dict[str, registry.Backend],
) -> None:
    isolated_registry.pop("faulty", None)
    with pytest.raises(ValidationError, match="unknown backend 'faulty'; use 'auto' or one of"):
        Settings(backend="faulty")


def test_settings_accept_a_test_backend_once_a_test_registered_it(
    test_backends: dict[str, registry.Backend],
) -> None:
    assert Settings(backend="faulty").backend == "faulty"
