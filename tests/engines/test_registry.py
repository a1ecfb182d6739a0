from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engines import registry
from engines.exceptions import (
    BackendUnavailableError,
    EngineError,
    EngineLoadError,
    UnknownBackendError,
)
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


def test_auto_never_resolves_to_a_test_only_backend(
    test_backends: dict[str, registry.Backend], onnx_model: Path
) -> None:
    assert {"fake", "faulty"} <= set(registry.available_backends())
    assert test_backends["fake"].test_only and test_backends["faulty"].test_only
    assert not {"fake", "faulty"} & set(registry.auto_candidates())
    assert registry.resolve_backend("auto") not in {"fake", "faulty"}
    with registry.load_engine("auto", onnx_model, max_batch_size=4) as engine:
        assert engine.info.backend not in {"fake", "faulty"}

    # Not even when they are the only backends that can run here.
    for name in list(test_backends):
        if not test_backends[name].test_only:
            registry.register(name, _fake_loader, is_available=lambda: False)
    with pytest.raises(BackendUnavailableError, match="no engine backend"):
        registry.resolve_backend("auto")
    with pytest.raises(BackendUnavailableError, match="no engine backend"):
        registry.load_engine("auto", onnx_model)


def test_auto_loads_with_the_next_candidate_when_one_cannot_load_the_file(
    isolated_registry: dict[str, registry.Backend],
) -> None:
    def plans_only(model_path: Path, **options: Any) -> FakeEngine:
        raise EngineLoadError(f"{model_path} is not a plan")

    isolated_registry.clear()
    registry.register("tensorrt", plans_only)
    registry.register("onnxruntime", _fake_loader)
    engine = registry.load_engine("auto", "model.onnx", seed=5)
    assert isinstance(engine, FakeEngine) and engine.info.extra["seed"] == 5

    registry.register("onnxruntime", plans_only)
    with pytest.raises(EngineLoadError) as info:
        registry.load_engine("auto", "model.onnx")
    assert "tensorrt: model.onnx is not a plan" in str(info.value)
    assert "onnxruntime: model.onnx is not a plan" in str(info.value)
    with pytest.raises(EngineLoadError, match="is not a plan"):  # a named backend: no fallback
        registry.load_engine("tensorrt", "model.onnx")


def test_a_plugin_module_from_the_environment_registers_backends(
    isolated_registry: dict[str, registry.Backend], monkeypatch: pytest.MonkeyPatch
) -> None:
    isolated_registry.pop("faulty", None)
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setenv(registry.PLUGINS_ENV, "engines.testing.faults")
    assert "faulty" in registry.registered_backends()
    assert registry.get_backend("faulty").test_only

    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setenv(registry.PLUGINS_ENV, "engines.nonexistent")
    with pytest.raises(UnknownBackendError, match=r"ENGINES_PLUGINS names 'engines\.nonexistent'"):
        registry.registered_backends()


def test_production_loads_never_import_the_test_code() -> None:
    # A fresh process with no ENGINES_* variables: what `streamapp worker` does to load models.
    script = (
        "import sys\n"
        "from engines.registry import available_backends, registered_backends\n"
        "from streamapp.models.loading import load_models\n"
        "from streamapp.settings import Settings\n"
        "models = load_models(Settings(backend='auto'))\n"
        "print(sorted(registered_backends()), models['digits'].info.backend)\n"
        "print(sorted(m for m in sys.modules if m.startswith('engines.testing')))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGINES_")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env=env, check=True)
    registered, imported = out.stdout.strip().split("\n")
    assert "faulty" not in registered and "fake" not in registered
    assert registered.split()[-1] in registry.auto_candidates()  # the backend that served digits
    assert imported == "[]"
