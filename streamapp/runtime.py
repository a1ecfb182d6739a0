"""What a worker holds besides Faust: loaded models, their executors, and the pipeline."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Awaitable
from typing import Any

import numpy as np

from engines.executor import Executor, ThreadExecutor
from engines.registry import load_engine, resolve_backend
from streamapp.agents.pipeline import InferencePipeline, LoadedModel, Sink
from streamapp.models import ModelRepository
from streamapp.settings import Settings

__all__ = ["WorkerRuntime", "load_models"]

log = logging.getLogger(__name__)


def _make_executor(backend: str, model_path: str, settings: Settings) -> Executor:
    engine = load_engine(backend, model_path, max_batch_size=settings.max_batch_size)
    return ThreadExecutor(engine, max_inflight=settings.max_inflight_batches)


def load_models(settings: Settings) -> dict[str, LoadedModel]:
    """Load every model in ``settings.models`` with the configured backend.

    Raises:
        ModelNotFoundError: A model is not in the repository.
        EngineError: A backend is unknown/unavailable or a model failed to load.
    """
    repo = ModelRepository(settings.models_dir)
    backend = resolve_backend(settings.backend)
    loaded = {}
    for name in settings.models:
        config = repo.get(name)
        executor = _make_executor(backend, str(config.path), settings)
        loaded[name] = LoadedModel(config, executor)
        log.info("loaded model %s v%s with %s", name, config.version, executor.engine.info.tag)
    return loaded


class WorkerRuntime:
    """Models + pipeline of one worker, started lazily inside the worker's event loop.

    Attributes:
        ready: True once every model is loaded and a warm-up batch ran on each.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.worker = settings.worker_name or f"{socket.gethostname()}:{os.getpid()}"
        self.models: dict[str, LoadedModel] = {}
        self.pipeline: InferencePipeline | None = None
        self.ready = False

    async def start(self, sink: Sink) -> InferencePipeline:
        """Load models, warm them up, and start the pipeline (idempotent)."""
        if self.pipeline is not None:
            return self.pipeline
        self.models = load_models(self.settings)
        for name, model in self.models.items():
            await self._warm_up(name, model)
        self.pipeline = InferencePipeline(self.settings, self.models, sink, worker=self.worker)
        await self.pipeline.start()
        self.ready = True
        return self.pipeline

    async def _warm_up(self, name: str, model: LoadedModel) -> None:
        config = model.config
        item = {config.input_name: np.zeros(config.item_shape, dtype=config.input_dtype)}
        outputs = await model.executor.run([item])
        if config.output_name not in outputs:
            raise RuntimeError(f"warm-up of {name!r} returned no {config.output_name!r} output")

    async def stop(self) -> None:
        self.ready = False
        if self.pipeline is not None:
            await self.pipeline.stop(drain=False)
        for model in self.models.values():
            await model.executor.close()
            model.executor.engine.close()

    def describe(self) -> dict[str, Any]:
        """Engines and counters, for ``/engines`` and ``/ready``."""
        return {
            "worker": self.worker,
            "ready": self.ready,
            "engines": {
                name: {
                    "backend": m.info.backend,
                    "tag": m.info.tag,
                    "device": m.info.device,
                    "precision": m.info.precision,
                    "max_batch_size": m.info.max_batch_size,
                    "model_version": m.config.version,
                }
                for name, m in self.models.items()
            },
        }


class FaustSink:
    """:class:`Sink` over Faust topics (keys and values are raw bytes)."""

    def __init__(self, topics: dict[str, Any]) -> None:
        self._topics = topics

    async def send(self, topic: str, key: bytes | None, value: bytes) -> Awaitable[Any]:
        fut: Awaitable[Any] = await self._topics[topic].send(key=key, value=value)
        return fut
