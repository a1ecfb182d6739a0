"""Backend registry: backends register a loader under a name; callers ask by name.

Adding a backend never edits a chain of ``if``s: a backend module calls :func:`register` at import
time and :data:`BACKEND_MODULES` lists the modules to import. ``auto`` resolves to the first
available backend in :data:`AUTO_ORDER` (TensorRT, then the PyTorch CUDA fallback, then ONNX
Runtime on CPU).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.base import Engine
from engines.exceptions import BackendUnavailableError, UnknownBackendError

__all__ = [
    "AUTO_ORDER",
    "Backend",
    "available_backends",
    "get_backend",
    "load_engine",
    "register",
    "registered_backends",
    "resolve_backend",
]

#: Loader signature: ``loader(model_path, **options) -> Engine``.
Loader = Callable[..., Engine]


@dataclass(frozen=True)
class Backend:
    """A registered backend.

    Attributes:
        name: Registry key (``"onnxruntime"``, ``"tensorrt"``, ...).
        loader: Builds an :class:`Engine` from a model path and backend options.
        is_available: Cheap check (no model load) that the backend can run on this machine.
        description: One line for ``engines backends``.
        test_only: A backend for tests (e.g. the fault injector): ``auto`` never picks it.
    """

    name: str
    loader: Loader
    is_available: Callable[[], bool]
    description: str = ""
    test_only: bool = False


_REGISTRY: dict[str, Backend] = {}

#: Modules that register backends when imported. A missing optional dependency must not make the
#: import fail; the backend then reports ``is_available() == False``.
BACKEND_MODULES: tuple[str, ...] = (
    "engines.onnxruntime",
    "engines.tensorrt",
    "engines.torch",
    # Test-only: the fault-injecting wrapper ("faulty"), so worker processes can be told to use
    # it; never chosen by "auto".
    "engines.testing",
)

#: Order tried by ``auto``.
AUTO_ORDER: tuple[str, ...] = ("tensorrt", "torch", "onnxruntime")

_loaded = False


def register(
    name: str,
    loader: Loader,
    *,
    is_available: Callable[[], bool] = lambda: True,
    description: str = "",
    test_only: bool = False,
) -> Backend:
    """Register a backend under ``name`` (replacing any earlier one of that name); a
    ``test_only`` backend is never chosen by ``auto``."""
    backend = Backend(name, loader, is_available, description, test_only)
    _REGISTRY[name] = backend
    return backend


def _load_builtin() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in BACKEND_MODULES:
        importlib.import_module(module)


def registered_backends() -> list[str]:
    """Names of all registered backends, available here or not."""
    _load_builtin()
    return sorted(_REGISTRY)


def available_backends() -> list[str]:
    """Names of the registered backends that can run on this machine, in ``auto`` order first."""
    _load_builtin()
    ordered = [n for n in AUTO_ORDER if n in _REGISTRY]
    ordered += sorted(n for n in _REGISTRY if n not in AUTO_ORDER)
    return [n for n in ordered if _REGISTRY[n].is_available()]


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``.

    Raises:
        UnknownBackendError: No backend has that name.
    """
    _load_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownBackendError(
            f"unknown backend {name!r}; registered backends: {', '.join(sorted(_REGISTRY))} "
            "(or 'auto')"
        ) from None


def resolve_backend(name: str) -> str:
    """Resolve ``"auto"`` to the first available backend; check any other name exists.

    Raises:
        UnknownBackendError: ``name`` is neither ``auto`` nor registered.
        BackendUnavailableError: ``auto`` found no available backend.
    """
    if name != "auto":
        return get_backend(name).name
    available = [n for n in available_backends() if not _REGISTRY[n].test_only]
    for candidate in AUTO_ORDER:
        if candidate in available:
            return candidate
    if available:
        return available[0]
    raise BackendUnavailableError("no engine backend is available on this machine")


def load_engine(backend: str, model_path: str | Path, **options: Any) -> Engine:
    """Load a model with the named backend (``"auto"`` allowed).

    Args:
        backend: Registry name or ``"auto"``.
        model_path: ONNX file or serialized plan, as the backend expects.
        **options: Backend options (e.g. ``max_batch_size``, ``intra_op_threads``).

    Raises:
        UnknownBackendError: No such backend.
        BackendUnavailableError: The backend cannot run here.
        EngineLoadError: The model could not be loaded.
    """
    entry = get_backend(resolve_backend(backend))
    if not entry.is_available():
        raise BackendUnavailableError(
            f"backend {entry.name!r} is not available on this machine; available: "
            f"{', '.join(available_backends()) or 'none'}"
        )
    return entry.loader(Path(model_path), **options)
