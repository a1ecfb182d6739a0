"""Backend registry: backends register a loader under a name; callers ask by name.

Adding a backend never edits a chain of ``if``s: a backend module calls :func:`register` at import
time and :data:`BACKEND_MODULES` lists the modules to import. Modules named in the environment
variable :data:`PLUGINS_ENV` are imported too and their ``register_backends()`` called (how a
worker process started by a test gets the test-only backends; production never sets it).

``auto`` is defined here and only here (:func:`auto_candidates`, :func:`load_first`): the
available backends that are not ``test_only``, in :data:`AUTO_ORDER` (TensorRT, then the PyTorch
CUDA fallback, then ONNX Runtime on CPU), then any other such backend by name; the first one that
loads the model wins.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from engines.base import Engine
from engines.exceptions import (
    BackendUnavailableError,
    EngineLoadError,
    UnknownBackendError,
)

__all__ = [
    "AUTO",
    "AUTO_ORDER",
    "PLUGINS_ENV",
    "Backend",
    "auto_candidates",
    "available_backends",
    "get_backend",
    "load_engine",
    "load_first",
    "register",
    "registered_backends",
    "resolve_backend",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The name that asks the registry to choose.
AUTO = "auto"

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
)

#: Environment variable: comma-separated modules imported after :data:`BACKEND_MODULES`, each
#: providing ``register_backends()``. Tests set ``engines.testing.faults`` for worker processes
#: that must run the fault-injecting backend; nothing in production sets it.
PLUGINS_ENV = "ENGINES_PLUGINS"

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
    for name in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
        try:
            hook = importlib.import_module(name).register_backends
        except (ImportError, AttributeError) as exc:
            _loaded = False
            raise UnknownBackendError(
                f"{PLUGINS_ENV} names {name!r}, which is not an importable module with a "
                f"register_backends() function ({exc}); fix or unset {PLUGINS_ENV}"
            ) from None
        hook()


def registered_backends() -> list[str]:
    """Names of all registered backends, available here or not."""
    _load_builtin()
    return sorted(_REGISTRY)


def available_backends() -> list[str]:
    """Names of the registered backends that can run on this machine, in ``auto`` order first
    (test-only ones included: see :func:`auto_candidates` for what ``auto`` may pick)."""
    _load_builtin()
    ordered = [n for n in AUTO_ORDER if n in _REGISTRY]
    ordered += sorted(n for n in _REGISTRY if n not in AUTO_ORDER)
    return [n for n in ordered if _REGISTRY[n].is_available()]


def auto_candidates() -> list[str]:
    """What ``auto`` tries, in order: the available backends that are not ``test_only``.

    Raises:
        BackendUnavailableError: No such backend can run here.
    """
    candidates = [n for n in available_backends() if not _REGISTRY[n].test_only]
    if not candidates:
        raise BackendUnavailableError("no engine backend is available on this machine")
    return candidates


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
            f"(or {AUTO!r})"
        ) from None


def resolve_backend(name: str) -> str:
    """The backend ``name`` stands for: ``auto``'s first candidate (:func:`auto_candidates`),
    or ``name`` itself once checked to be registered. Says nothing about whether a model loads:
    :func:`load_first` falls through to the next candidate when it does not.

    Raises:
        UnknownBackendError: ``name`` is neither ``auto`` nor registered.
        BackendUnavailableError: ``auto`` found no available backend.
    """
    if name != AUTO:
        return get_backend(name).name
    return auto_candidates()[0]


def load_first(name: str, load: Callable[[str], T]) -> T:
    """Call ``load(backend)`` for the backend ``name`` stands for and return its result.

    For ``auto``, the candidates of :func:`auto_candidates` are tried in order and the first whose
    ``load`` does not raise :class:`EngineLoadError` wins (e.g. TensorRT loads plans only, so an
    ONNX model falls through to the next backend). For any other name, ``load`` is called once.

    Args:
        name: Registry name or ``"auto"``.
        load: Loads the model with one backend, e.g. ``lambda b: load_engine(b, path)``.

    Raises:
        UnknownBackendError: No such backend.
        BackendUnavailableError: ``auto`` found no available backend.
        EngineLoadError: The named backend failed, or every ``auto`` candidate did (the message
            lists each one's error).
    """
    if name != AUTO:
        return load(get_backend(name).name)
    failures: list[str] = []
    for backend in auto_candidates():
        try:
            return load(backend)
        except EngineLoadError as exc:
            failures.append(f"{backend}: {exc}")
            log.info("auto: %s cannot load the model (%s); trying the next backend", backend, exc)
    raise EngineLoadError("no available backend could load the model: " + "; ".join(failures))


def load_engine(backend: str, model_path: str | Path, **options: Any) -> Engine:
    """Load a model with the named backend (``"auto"``: the first candidate that loads it).

    Args:
        backend: Registry name or ``"auto"``.
        model_path: ONNX file or serialized plan, as the backend expects.
        **options: Backend options (e.g. ``max_batch_size``, ``intra_op_threads``).

    Raises:
        UnknownBackendError: No such backend.
        BackendUnavailableError: The backend cannot run here.
        EngineLoadError: The model could not be loaded.
    """
    return load_first(backend, lambda name: _load_with(name, Path(model_path), options))


def _load_with(name: str, model_path: Path, options: dict[str, Any]) -> Engine:
    entry = get_backend(name)
    if not entry.is_available():
        raise BackendUnavailableError(
            f"backend {entry.name!r} is not available on this machine; available: "
            f"{', '.join(available_backends()) or 'none'}"
        )
    return entry.loader(model_path, **options)
