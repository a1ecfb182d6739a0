"""What a worker holds besides Faust: loaded models, the pipeline, offsets and retries."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from engines.executor import Executor, ThreadExecutor
from engines.registry import load_engine, resolve_backend
from streamapp.agents.observer import PipelineObserver
from streamapp.agents.pipeline import InferencePipeline, LoadedModel, Sink, SourceMessage
from streamapp.exceptions import InvalidRequestError
from streamapp.models import ModelRepository
from streamapp.offsets import TP, OffsetTracker
from streamapp.retry import DelayScheduler, RetryRecord, RetryStore
from streamapp.settings import Settings

__all__ = ["FaustSink", "WorkerRuntime", "load_models"]

log = logging.getLogger(__name__)

#: Seconds a stopping worker waits for batches in flight to finish and be committed.
DRAIN_TIMEOUT_S = 10.0


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
    """Models, pipeline, offset tracker, commit loop and retry scheduler of one worker.

    Started by the first agent that runs (both the request and the retry agent call
    :meth:`acquire`) and stopped when the last one ends.

    Args:
        settings: The worker's settings.
        start_offset: ``async (topic, partition) -> offset`` where a newly assigned partition
            starts (the committed offset).
        commit: ``async ({(topic, partition): offset}) -> ok`` commits offsets for the group.
        seek: ``async (topic, partition, offset)`` re-positions the consumer after a gap.

    Attributes:
        ready: True once every model is loaded and a warm-up batch ran on each.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        start_offset: Callable[[str, int], Awaitable[int]],
        commit: Callable[[dict[TP, int]], Awaitable[bool]],
        seek: Callable[[str, int, int], Awaitable[None]],
        flush: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        self.settings = settings
        self.worker = settings.worker_name or f"{socket.gethostname()}:{os.getpid()}"
        self.models: dict[str, LoadedModel] = {}
        self.pipeline: InferencePipeline | None = None
        self.tracker = OffsetTracker(start_offset)
        self.ready = False
        self._commit = commit
        self._seek = seek
        self._flush = flush
        self._users = 0
        self._lock = asyncio.Lock()
        self._commit_task: asyncio.Task[None] | None = None
        self._scheduler: DelayScheduler | None = None
        self.commits = 0

    # -- lifecycle --------------------------------------------------------------------------------

    async def acquire(
        self, sink: Sink, retry_store: RetryStore, observers: Sequence[PipelineObserver] = ()
    ) -> InferencePipeline:
        """Start everything on first use (load models, warm up, start loops); count users."""
        async with self._lock:
            self._users += 1
            if self.pipeline is None:
                self.models = load_models(self.settings)
                for name, model in self.models.items():
                    await self._warm_up(name, model)
                pipeline = InferencePipeline(
                    self.settings, self.models, sink, worker=self.worker,
                    retry_store=retry_store, observers=observers,
                )
                await pipeline.start()
                self._scheduler = DelayScheduler(pipeline.handle)
                self._scheduler.start()
                self._commit_task = asyncio.create_task(self._commit_loop(), name="commits")
                self.pipeline = pipeline
                self.ready = True
            return self.pipeline

    async def release(self) -> None:
        """One user is done; the last one drains, commits and releases everything."""
        async with self._lock:
            self._users -= 1
            if self._users > 0 or self.pipeline is None:
                return
            self.ready = False
            pipeline, self.pipeline = self.pipeline, None
            if self._scheduler is not None:
                await self._scheduler.stop()
            try:
                await asyncio.wait_for(pipeline.batcher.drain(), DRAIN_TIMEOUT_S)
                if self._flush is not None:  # wait for the broker's acks of what was produced
                    await asyncio.wait_for(self._flush(), DRAIN_TIMEOUT_S)
            except (TimeoutError, RuntimeError) as exc:
                log.warning("stopping with requests in flight (%s); they will be redelivered", exc)
            if self._commit_task is not None:
                self._commit_task.cancel()
                try:
                    await self._commit_task
                except asyncio.CancelledError:
                    pass
            await self.commit_now()
            await pipeline.stop(drain=False)
            for model in self.models.values():
                await model.executor.close()
                model.executor.engine.close()

    async def _warm_up(self, name: str, model: LoadedModel) -> None:
        config = model.config
        item = {config.input_name: np.zeros(config.item_shape, dtype=config.input_dtype)}
        outputs = await model.executor.run([item])
        if config.output_name not in outputs:
            raise RuntimeError(f"warm-up of {name!r} returned no {config.output_name!r} output")

    # -- offsets ----------------------------------------------------------------------------------

    async def accept(self, topic: str, partition: int, offset: int) -> Callable[[], None] | None:
        """Check a record just read against the tracker.

        Returns:
            Its ``ack`` callback when it must be processed, None when it must be skipped (already
            read, or a gap was found and the consumer was sought back).
        """
        decision, epoch = await self.tracker.on_read(topic, partition, offset)
        if decision == "accept":
            tracker = self.tracker
            return lambda: tracker.done(topic, partition, offset, epoch)
        if decision == "seek":
            state = self.tracker.state((topic, partition))
            if state is not None:
                await self._seek(topic, partition, state.next_offset)
        return None

    async def commit_now(self, only: set[TP] | None = None) -> None:
        """Commit every partition's finished prefix (or only those in ``only``)."""
        offsets = self.tracker.committable()
        if only is not None:
            offsets = {tp: o for tp, o in offsets.items() if tp in only}
        if not offsets:
            return
        try:
            if await self._commit(offsets):
                self.tracker.mark_committed(offsets)
                self.commits += 1
        except Exception:
            log.exception("committing %s failed; will retry", offsets)

    async def _commit_loop(self) -> None:
        interval = self.settings.commit_interval_ms / 1000.0
        while True:
            await asyncio.sleep(interval)
            await self.commit_now()

    async def on_revoked(self, revoked: set[TP]) -> None:
        """Before partitions go to another worker: commit what finished, forget the rest."""
        await self.commit_now(only=revoked)
        self.tracker.forget(revoked)

    # -- retries ----------------------------------------------------------------------------------

    async def schedule_retry(
        self, record_value: bytes | None, source: SourceMessage, retry_store: RetryStore
    ) -> None:
        """Take a record from the retry topic: count the attempt, run it when it is due."""
        assert self.pipeline is not None and self._scheduler is not None
        try:
            record = RetryRecord.decode(record_value)
        except InvalidRequestError as exc:
            await self.pipeline.reject(source, exc)
            return
        retry_store.record_attempt(record, source.event)
        source.key, source.value, source.retry = record.key, record.value, record
        await self._scheduler.add(record.not_before, source)

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
