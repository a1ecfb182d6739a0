from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engines import registry
from engines.exceptions import BackendUnavailableError, EngineError, UnknownBackendError
from engines.testing import FakeEngine


def _constant(value: bool) -> Callable[[], bool]:
    return lambda: value


def _fake_loader(model_path: Path, **options: Any) -> FakeEngine:
    return FakeEngine(model_path=str(model_path), **options)


@pytest.mark.parametrize("call", [registry.get_backend, registry.resolve_backend])
def test_unknown_backend_error_lists_registered_names(
    isolated_registry: dict[str, registry.Backend], call: Any
) -> None:
    registry.register("dummy", _fake_loader)
    with pytest.raises(UnknownBackendError) as info:
        call("tensorrtt")
    message = str(info.value)
    assert "'tensorrtt'" in message
    assert "dummy" in message and "onnxruntime" in message
    assert isinstance(info.value, LookupError)
    assert not info.value.retriable


def test_load_engine_with_unknown_backend(tmp_path: Path) -> None:
    with pytest.raises(UnknownBackendError, match="'nope'"):
        registry.load_engine("nope", tmp_path / "model.onnx")


def test_builtin_onnxruntime_is_registered() -> None:
    names = registry.registered_backends()
    assert "onnxruntime" in names
    assert names == sorted(names)
    assert registry.get_backend("onnxruntime").description


def test_register_then_load(isolated_registry: dict[str, registry.Backend]) -> None:
    backend = registry.register("dummy", _fake_loader, description="a test backend")
    assert registry.get_backend("dummy") is backend
    assert registry.resolve_backend("dummy") == "dummy"
    engine = registry.load_engine("dummy", "some/model.bin", seed=3, max_batch_size=4)
    assert isinstance(engine, FakeEngine)
    assert engine.info.model_path == str(Path("some/model.bin"))
    assert engine.info.extra["seed"] == 3
    assert engine.max_batch_size == 4


def test_register_replaces_a_backend_of_the_same_name(
    isolated_registry: dict[str, registry.Backend],
) -> None:
    registry.register("dummy", _fake_loader, description="first")
    registry.register("dummy", _fake_loader, description="second")
    assert registry.get_backend("dummy").description == "second"
    assert registry.registered_backends().count("dummy") == 1


def test_available_backends_follow_auto_order_then_names(
    isolated_registry: dict[str, registry.Backend],
) -> None:
    isolated_registry.clear()
    for name, available in [
        ("zeta", True),
        ("onnxruntime", True),
        ("alpha", True),
        ("tensorrt", False),
        ("torch", True),
        ("offline", False),
    ]:
        registry.register(name, _fake_loader, is_available=_constant(available))
    assert registry.available_backends() == ["torch", "onnxruntime", "alpha", "zeta"]
    assert registry.resolve_backend("auto") == "torch"
    assert registry.registered_backends() == [
        "alpha",
        "offline",
        "onnxruntime",
        "tensorrt",
        "torch",
        "zeta",
    ]


def test_auto_falls_back_to_backends_outside_auto_order(
    isolated_registry: dict[str, registry.Backend],
) -> None:
    isolated_registry.clear()
    registry.register("onnxruntime", _fake_loader, is_available=lambda: False)
    registry.register("custom", _fake_loader)
    assert registry.resolve_backend("auto") == "custom"
    assert isinstance(registry.load_engine("auto", "x"), FakeEngine)


def test_nothing_available(isolated_registry: dict[str, registry.Backend]) -> None:
    isolated_registry.clear()
    registry.register("onnxruntime", _fake_loader, is_available=lambda: False)
    with pytest.raises(BackendUnavailableError, match="no engine backend"):
        registry.resolve_backend("auto")


def test_loading_an_unavailable_backend_says_what_is_available(
    isolated_registry: dict[str, registry.Backend],
) -> None:
    registry.register("tensorrt", _fake_loader, is_available=lambda: False)
    with pytest.raises(BackendUnavailableError) as info:
        registry.load_engine("tensorrt", "model.plan")
    assert "'tensorrt'" in str(info.value)
    assert "onnxruntime" in str(info.value)
    assert isinstance(info.value, EngineError)
