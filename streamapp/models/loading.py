"""Loading a worker's models: each model of ``settings.models`` on its engine and executor.

The backend comes from ``settings.backend``; ``auto`` is resolved by the engine registry
(:func:`engines.registry.load_first`), the one place that defines it: the first available
backend that is not test-only and loads the model's file, in the order TensorRT, PyTorch CUDA,
ONNX Runtime. Each candidate gets the backend options of the model's metadata for that backend.
"""

from __future__ import annotations

import logging
from typing import Any

from engines.base import StreamEngine
from engines.executor import Executor, ThreadExecutor
from engines.registry import load_engine, load_first
from streamapp.agents.pipeline import LoadedModel
from streamapp.exceptions import ConfigError
from streamapp.models.check import engine_problems
from streamapp.models.repository import ModelConfig, ModelRepository
from streamapp.settings import Settings

__all__ = ["connect_models", "load_local_models", "load_models", "load_version"]

log = logging.getLogger(__name__)


def _make_executor(
    backend: str, model_path: str, settings: Settings, options: dict[str, Any] | None = None
) -> Executor:
    """A GPU executor on CUDA streams for engines that can enqueue on a stream (TensorRT, the
    PyTorch CUDA backend), else a thread executor (ONNX Runtime on CPU).

    Args:
        backend: A registered backend name (not ``auto``).
        model_path: The model's file.
        settings: ``max_batch_size``, ``max_inflight_batches``, ``cuda_streams``,
            ``cuda_inline_pack_kib`` and ``cuda_poll_ms`` are used.
        options: Backend options from the model's metadata (e.g. ``precision``).

    Raises:
        EngineError: The backend is unknown or unavailable, or the model failed to load.
    """
    engine = load_engine(
        backend, model_path, max_batch_size=settings.max_batch_size, **(options or {})
    )
    if isinstance(engine, StreamEngine):
        from engines.executor.cuda import CudaExecutor  # imports cuda-python

        depth = max(1, -(-settings.max_inflight_batches // settings.cuda_streams))
        return CudaExecutor(engine, streams=settings.cuda_streams, depth=depth,
                            max_batch=settings.max_batch_size,
                            inline_pack_bytes=settings.cuda_inline_pack_kib * 1024,
                            inline_poll_s=settings.cuda_poll_ms / 1000.0)
    return ThreadExecutor(engine, max_inflight=settings.max_inflight_batches)


def load_models(settings: Settings) -> dict[str, LoadedModel]:
    """Load every model in ``settings.models``: with ``settings.backend`` in this process, or,
    with ``gpu_executor=shared``, as clients of the executor server at
    ``gpu_server_socket`` (:func:`connect_models`).

    Returns:
        Model name → the loaded model (its config and the executor running its engine).

    Raises:
        ModelNotFoundError: A model is not in the repository.
        ConfigError: A model's engine does not fit its ``metadata.json`` (in-process only).
        EngineError: A backend is unknown/unavailable or a model failed to load (with ``auto``:
            no candidate loaded it; the message lists each one's error).
    """
    if settings.gpu_executor == "shared":
        return connect_models(settings)
    return load_local_models(settings)


def load_local_models(settings: Settings) -> dict[str, LoadedModel]:
    """Load every model in ``settings.models`` with ``settings.backend`` in this process
    (what a worker with ``gpu_executor=inprocess`` and the executor server do), and check
    that each engine takes what its metadata promises
    (:func:`~streamapp.models.check.engine_problems`).

    Raises:
        ConfigError: A model's engine does not fit its ``metadata.json`` (input name, dtype or
            shape, a fixed batch dimension, output not one score per label); the message lists
            each problem.
        As :func:`load_models` otherwise.
    """
    repo = ModelRepository(settings.models_dir)
    return {name: load_version(settings, repo.get(name)) for name in settings.models}


def load_version(settings: Settings, config: ModelConfig) -> LoadedModel:
    """Load one version of a model with ``settings.backend`` in this process (at start, and
    for a hot swap: :mod:`streamapp.models.swap`), and check that its engine takes what its
    metadata promises (:func:`~streamapp.models.check.engine_problems`).

    Raises:
        EngineError: The backend is unknown/unavailable or the file failed to load.
        ConfigError: The engine does not fit the version's ``metadata.json``; the message
            lists each problem.
    """

    def make(backend: str) -> Executor:
        return _make_executor(backend, str(config.path), settings,
                              config.engine_options(backend))

    executor = load_first(settings.backend, make)
    problems = engine_problems(config, executor.engine)
    if problems:
        executor.engine.close()
        raise ConfigError(
            f"model {config.name!r} ({config.path}) does not fit its metadata.json: "
            f"{'; '.join(problems)} (streamapp models check {config.path.parent} lists "
            "every problem; docs/models.md)"
        )
    log.info("loaded model %s v%s with %s", config.name, config.version,
             executor.engine.info.tag)
    return LoadedModel(config, executor)


def connect_models(settings: Settings) -> dict[str, LoadedModel]:
    """Every model in ``settings.models`` as a client of the executor server
    (:class:`engines.server.SharedExecutor`, ``max_inflight_batches`` slots each).

    Raises:
        ModelNotFoundError: A model is not in the repository.
        ExecutorUnavailableError: No server answers at the socket (the message says how to
            start one).
        InputSpecError: The server does not serve a model.
    """
    from engines.server import SharedExecutor
    from streamapp.gpu_server import server_socket

    repo = ModelRepository(settings.models_dir)
    path = server_socket(settings)
    loaded = {}
    for name in settings.models:
        config = repo.get(name)
        executor = SharedExecutor(path, name, max_inflight=settings.max_inflight_batches,
                                  wait_s=settings.gpu_server_wait_s)
        loaded[name] = LoadedModel(config, executor)
        log.info("model %s v%s served by the executor server at %s (%s)", name,
                 config.version, path, executor.engine.info.tag)
    return loaded
