"""The worker's lifecycle: load and warm up the models, start the pipeline, delivery and retry
scheduler when the first agent starts, drain and release them when the last one stops.

Which records are processed and committed is :mod:`streamapp.delivery`'s job; the wiring is in
:mod:`streamapp.app`.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import socket
from collections.abc import Sequence
from typing import Any, Protocol

from streamapp.agents.observer import PipelineObserver
from streamapp.agents.pipeline import (
    AckGuard,
    InferencePipeline,
    LoadedModel,
    Sink,
    SourceMessage,
)
from streamapp.delivery import Delivery
from streamapp.exceptions import InvalidRequestError
from streamapp.models.loading import load_models
from streamapp.models.swap import ModelSwapper, close_model, warm_up
from streamapp.retry import DelayScheduler, RetryRecord, RetryStore
from streamapp.settings import Settings
from streamapp.transactions import TransactionCommitter

__all__ = ["WorkerHost", "WorkerRuntime", "load_models"]

log = logging.getLogger(__name__)

#: Seconds a stopping worker waits for batches in flight to finish and be committed.
DRAIN_TIMEOUT_S = 10.0


def freeze_heap() -> None:
    """Collect, then move every object alive to the permanent generation (``gc.freeze``):
    later full collections scan only what was allocated since (the models, Faust and the
    worker's start-up state are never garbage). Safe to call again."""
    gc.collect()
    gc.freeze()


class WorkerHost(Protocol):
    """What the runtime needs from the app it runs in (Faust's, in a worker)."""

    async def flush(self) -> None:
        """Wait until the producer has sent everything buffered."""
        ...

    async def crash(self, exc: BaseException) -> None:
        """Stop the worker: it cannot serve."""
        ...


class WorkerRuntime:
    """Models, pipeline, delivery and retry scheduler of one worker.

    Started by the first agent that runs (both the request and the retry agent call
    :meth:`acquire`) and stopped when the last one ends.

    Args:
        settings: The worker's settings.
        delivery: Admission, gap filling and commits of the source partitions.
        host: Flushes the producer and crashes the app; None in tests without one.
        ack_guard: Confirms the broker's acknowledgements (:mod:`streamapp.topology`); None:
            every acknowledgement counts.
        transactions: With exactly_once, the committer of the worker's transactions: each
            commit first settles the pipeline (:meth:`_settle`).

    Attributes:
        ready: True once every model is loaded and a warm-up batch ran on each.
    """

    def __init__(
        self, settings: Settings, delivery: Delivery, host: WorkerHost | None = None,
        ack_guard: AckGuard | None = None,
        transactions: TransactionCommitter | None = None,
    ) -> None:
        self.settings = settings
        self.transactions = transactions
        self.ack_guard = ack_guard
        self.delivery = delivery
        self.worker = settings.worker_name or f"{socket.gethostname()}:{os.getpid()}"
        self.models: dict[str, LoadedModel] = {}
        self.pipeline: InferencePipeline | None = None
        self.ready = False
        self._host = host
        self._retry_store: RetryStore | None = None
        self._preloaded: dict[str, LoadedModel] | None = None
        self._users = 0
        self._lock = asyncio.Lock()
        self._scheduler: DelayScheduler | None = None
        #: Hot swap of model versions (``streamapp models load``, ``POST /models/...``).
        self.swapper = ModelSwapper(settings, lambda: self.pipeline)
        #: exactly_once: the latest due time scheduled per retry partition.
        self._last_due: dict[tuple[str, int], float] = {}

    async def acquire(
        self, sink: Sink, retry_store: RetryStore, observers: Sequence[PipelineObserver] = ()
    ) -> InferencePipeline:
        """Start everything on first use (load models, warm up, start loops); count users."""
        async with self._lock:
            self._users += 1
            if self.pipeline is None:
                try:
                    self.models = self._preloaded or load_models(self.settings)
                    self._preloaded = None
                    for model in self.models.values():
                        await warm_up(model)
                except Exception as exc:
                    # A worker that cannot serve must not hold partitions: stop it.
                    log.critical("cannot load the models, stopping the worker: %s", exc)
                    if self._host is not None:
                        await self._host.crash(exc)
                    raise
                pipeline = InferencePipeline(
                    self.settings, self.models, sink, worker=self.worker,
                    retry_store=retry_store, observers=observers,
                    highwater=getattr(self._host, "highwater", None),
                    ack_guard=self.ack_guard,
                    # both modes: an outcome of a record whose partition was revoked since
                    # it was read is not produced (its next reader answers it, and counts it
                    # in the device tables; the old reader's late row was lost, issue 17)
                    current=self.delivery.current,
                )
                if self.transactions is not None:
                    self.transactions.settle = functools.partial(self._settle, pipeline)
                await pipeline.start()
                self._retry_store = retry_store
                self._scheduler = DelayScheduler(pipeline.handle)
                self._scheduler.start()
                self.pipeline = pipeline
                self.delivery.start(
                    self.process_recovered, self._backpressured, pipeline.flush_state
                )
                if self.settings.gc_freeze:
                    freeze_heap()
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
            await self._drain(pipeline)
            await self.delivery.stop()  # commits what finished
            await pipeline.stop(drain=False)
            await self.swapper.close()
            for versions in pipeline.loaded.values():
                for model in versions.values():
                    await close_model(model)
            self.models = dict(pipeline.models)

    def preload(self) -> dict[str, LoadedModel]:
        """Load the models now, before the worker starts (so that a bad model, backend or
        device fails the start with one clear error instead of a crash loop).

        Returns:
            The loaded models by name (what the worker will serve).

        Raises:
            StreamAppError / EngineError: As :func:`load_models`.
        """
        self._preloaded = load_models(self.settings)
        return self._preloaded

    @staticmethod
    async def _settle(pipeline: InferencePipeline) -> None:
        """Before a transaction commits: every outcome produced so far acknowledged, its
        device state written and its record finished."""
        await pipeline.wait_acknowledged()
        await pipeline.flush_state()

    def _backpressured(self) -> bool:
        pipeline = self.pipeline
        return pipeline is None or pipeline.batcher.pending >= pipeline.batcher.max_pending

    async def process_recovered(self, message: SourceMessage) -> None:
        """Process a record that delivery read to fill a gap found while idle: a due retry
        goes to the retry scheduler, a request to the pipeline."""
        if message.topic == self.settings.retry_topic:
            if self._retry_store is not None:
                await self.schedule_retry(message, self._retry_store)
        elif self.pipeline is not None:
            await self.pipeline.handle(message)

    async def finish_for_shutdown(self) -> None:
        """On a clean stop, before the consumer goes: finish what is in flight (bounded by
        ``DRAIN_TIMEOUT_S``), wait for the broker's acks, and commit, so that the partitions'
        next owner does not process those records again."""
        if self.pipeline is not None:
            await self._drain(self.pipeline)
            await self.delivery.commit_now()

    async def _drain(self, pipeline: InferencePipeline) -> None:
        """Stop taking due retries, finish what is in flight and wait for the broker's acks
        (each bounded by ``DRAIN_TIMEOUT_S``)."""
        if self._scheduler is not None:
            await self._scheduler.stop()
        waiting_for = "the batches in flight"
        try:
            # asyncio.timeout, not wait_for: a cancellation is never lost (tasks.wait_event)
            async with asyncio.timeout(DRAIN_TIMEOUT_S):
                await pipeline.batcher.drain()
            if self._host is not None:
                waiting_for = "the producer's flush"
                async with asyncio.timeout(DRAIN_TIMEOUT_S):
                    await self._host.flush()
            waiting_for = "the broker's acknowledgements"
            async with asyncio.timeout(DRAIN_TIMEOUT_S):
                await pipeline.wait_acknowledged()
        except TimeoutError:
            log.warning("stopping with requests in flight (%s did not end within %.0f s); "
                        "they will be redelivered", waiting_for, DRAIN_TIMEOUT_S)
        except RuntimeError as exc:
            log.warning("stopping with requests in flight (%s: %s); they will be redelivered",
                        waiting_for, exc)
        # device state of everything answered, and the acks it held back (before the commit)
        await pipeline.flush_state()

    # -- retries ----------------------------------------------------------------------------------

    async def schedule_retry(self, source: SourceMessage, retry_store: RetryStore) -> None:
        """Take a record from the retry topic: count the attempt, run it when it is due."""
        assert self.pipeline is not None and self._scheduler is not None
        try:
            record = RetryRecord.decode(source.value)
        except InvalidRequestError as exc:
            await self.pipeline.reject(source, exc)
            return
        retry_store.record_attempt(record, source.event)
        source.key, source.value, source.retry = record.key, record.value, record
        due = record.not_before
        if self.transactions is not None:
            # exactly_once: a retry partition's records run (and so answer) in offset order,
            # or an answered record beyond the committable prefix would be answered again
            # after a crash. Due times are made monotonic per partition (a short wait).
            tp = (source.topic, source.partition)
            due = self._last_due[tp] = max(due, self._last_due.get(tp, due))
        await self._scheduler.add(due, source)

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
                for name, m in (self.pipeline.models if self.pipeline is not None
                                else self.models).items()
            },
        }
