"""Loading a worker's models: each model of ``settings.models`` on its engine and executor.

A model is served at the first version of :func:`~streamapp.models.verify.start_order`
(``NAME/current``, else the highest, then the others from the highest down) that loads and
passes the checks of ``streamapp models load``: a warm-up batch and the samples its metadata
declares (:func:`~streamapp.models.verify.start_version`). A version that fails is logged and
skipped; when none passes, the worker does not start.

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
from streamapp.models.verify import close_model, run_blocking, start_version
from streamapp.settings import Settings

__all__ = [
    "connect_models",
    "load_local_models",
    "load_models",
    "load_version",
    "start_local_models",
]

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
    ``gpu_server_socket`` (:func:`connect_models`). Blocks (also when called on an event
    loop: the checks run on a loop of their own, :func:`~streamapp.models.verify.run_blocking`).

    Returns:
        Model name → the loaded model (its config and the executor running its engine).

    Raises:
        ModelNotFoundError: A model is not in the repository.
        ConfigError: No version of a model passes the checks (in-process only; a model with
            one version to try: its engine does not fit its ``metadata.json``, or it fails its
            warm-up batch or declared samples).
        EngineError: A backend is unknown/unavailable or a model failed to load (with ``auto``:
            no candidate loaded it; the message lists each one's error).
    """
    if settings.gpu_executor == "shared":
        return connect_models(settings)
    return load_local_models(settings)


def load_local_models(settings: Settings, *, fallback: bool = True) -> dict[str, LoadedModel]:
    """Load every model in ``settings.models`` with ``settings.backend`` in this process
    (what a worker with ``gpu_executor=inprocess`` and the executor server do): each at the
    first version that passes the checks of ``streamapp models load`` (module docstring).
    Blocks: the checks run on an event loop of their own, in a thread of their own.

    Args:
        settings: The worker's settings.
        fallback: Try the other versions of a model whose first version fails (False: the
            executor server, whose workers pick the version from the repository themselves).

    Raises:
        ConfigError: A model's engine does not fit its ``metadata.json`` (input name, dtype or
            shape, a fixed batch dimension, output not one score per label; the message lists
            each problem), or a version fails its warm-up batch or samples, and no other
            version passes.
        As :func:`load_models` otherwise.
    """
    return run_blocking(lambda: start_local_models(settings, fallback=fallback))


async def start_local_models(settings: Settings, *,
                             fallback: bool = True) -> dict[str, LoadedModel]:
    """:func:`load_local_models` on the running event loop."""
    repo = ModelRepository(settings.models_dir)

    def loader(config: ModelConfig) -> LoadedModel:
        return load_version(settings, config)

    loaded: dict[str, LoadedModel] = {}
    try:
        for name in settings.models:
            loaded[name] = await start_version(repo, name, loader, fallback=fallback)
    except BaseException:
        for model in loaded.values():  # a worker that cannot serve every model serves none
            await close_model(model)
        raise
    return loaded


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
