"""What a worker holds besides Faust: loaded models, the pipeline, offsets and retries."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engines.base import StreamEngine
from engines.exceptions import BackendUnavailableError, EngineLoadError
from engines.executor import Executor, ThreadExecutor
from engines.registry import available_backends, load_engine, resolve_backend
from streamapp.agents.observer import PipelineObserver
from streamapp.agents.pipeline import InferencePipeline, LoadedModel, Sink, SourceMessage
from streamapp.exceptions import InvalidRequestError
from streamapp.faust_compat import StandInEvent
from streamapp.models import ModelRepository
from streamapp.offsets import TP, OffsetTracker
from streamapp.retry import DelayScheduler, RetryRecord, RetryStore
from streamapp.settings import Settings

__all__ = ["Admitted", "FaustSink", "WorkerRuntime", "load_models"]

log = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class Admitted:
    """A record to process: its ``ack`` marks it finished for the offset tracker."""

    ack: Callable[[], None]
    offset: int
    key: bytes | None
    value: bytes | None


#: Seconds without any record read after which the consumer's position is compared with what was
#: read, to find records skipped at the end of a partition.
GAP_IDLE_S = 2.0

#: Seconds a stopping worker waits for batches in flight to finish and be committed.
DRAIN_TIMEOUT_S = 10.0


def _make_executor(
    backend: str, model_path: str, settings: Settings, options: dict[str, Any] | None = None
) -> Executor:
    """A GPU executor on CUDA streams for engines that can enqueue on a stream (TensorRT, the
    PyTorch CUDA backend), else a thread executor (ONNX Runtime on CPU). ``options``: backend
    options from the model's metadata (e.g. ``precision``)."""
    engine = load_engine(
        backend, model_path, max_batch_size=settings.max_batch_size, **(options or {})
    )
    if isinstance(engine, StreamEngine):
        from engines.executor.cuda import CudaExecutor  # imports cuda-python

        depth = max(1, -(-settings.max_inflight_batches // settings.cuda_streams))
        return CudaExecutor(engine, streams=settings.cuda_streams, depth=depth,
                            max_batch=settings.max_batch_size)
    return ThreadExecutor(engine, max_inflight=settings.max_inflight_batches)


def load_models(settings: Settings) -> dict[str, LoadedModel]:
    """Load every model in ``settings.models`` with the configured backend.

    Raises:
        ModelNotFoundError: A model is not in the repository.
        EngineError: A backend is unknown/unavailable or a model failed to load.
    """
    repo = ModelRepository(settings.models_dir)
    # "auto": the first available backend (TensorRT, PyTorch CUDA, ONNX Runtime) that loads the
    # model's file; e.g. TensorRT loads plans only, so an ONNX model falls through to the next.
    candidates = (
        available_backends() if settings.backend == "auto"
        else [resolve_backend(settings.backend)]
    )
    if not candidates:
        raise BackendUnavailableError("no engine backend is available on this machine")
    loaded = {}
    for name in settings.models:
        config = repo.get(name)
        failures: list[str] = []
        for backend in candidates:
            try:
                executor = _make_executor(
                    backend, str(config.path), settings, config.engine_options(backend)
                )
            except EngineLoadError as exc:
                if len(candidates) == 1:
                    raise
                failures.append(f"{backend}: {exc}")
                log.info("auto: %s cannot load %s (%s); trying the next backend",
                         backend, config.path.name, exc)
                continue
            break
        else:
            raise EngineLoadError(
                f"no available backend could load model {name!r}: " + "; ".join(failures)
            )
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
        read_range: ``async (topic, partition, start, end) -> [(offset, key, value)]`` reads
            records the consumer skipped (a gap), directly from the broker.

    Attributes:
        ready: True once every model is loaded and a warm-up batch ran on each.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        start_offset: Callable[[str, int], Awaitable[int]],
        commit: Callable[[dict[TP, int]], Awaitable[bool]],
        read_range: Callable[
            [str, int, int, int], Awaitable[list[tuple[int, bytes | None, bytes | None]]]
        ],
        flush: Callable[[], Awaitable[Any]] | None = None,
        on_fatal: Callable[[BaseException], Awaitable[Any]] | None = None,
        position: Callable[[str, int], Awaitable[int | None]] | None = None,
    ) -> None:
        self.settings = settings
        self.worker = settings.worker_name or f"{socket.gethostname()}:{os.getpid()}"
        self.models: dict[str, LoadedModel] = {}
        self.pipeline: InferencePipeline | None = None
        self.tracker = OffsetTracker(start_offset)
        self.ready = False
        self._commit = commit
        self._read_range = read_range
        self._position = position
        #: Assigned source partitions, as told by :meth:`on_assigned`; None: not told (tests),
        #: then every record is admitted.
        self._assigned: set[TP] | None = None
        self._process: Callable[[SourceMessage], Awaitable[None]] | None = None
        self._tp_locks: dict[TP, asyncio.Lock] = {}
        self._last_admit_at = 0.0
        self._last_rebalance_at = 0.0
        self._flush = flush
        self._on_fatal = on_fatal
        self._preloaded: dict[str, LoadedModel] | None = None
        self._users = 0
        self._lock = asyncio.Lock()
        self._commit_task: asyncio.Task[None] | None = None
        self._sweep_task: asyncio.Task[None] | None = None
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
                try:
                    self.models = self._preloaded or load_models(self.settings)
                    self._preloaded = None
                    for name, model in self.models.items():
                        await self._warm_up(name, model)
                except Exception as exc:
                    # A worker that cannot serve must not hold partitions: stop it.
                    log.critical("cannot load the models, stopping the worker: %s", exc)
                    if self._on_fatal is not None:
                        await self._on_fatal(exc)
                    raise
                pipeline = InferencePipeline(
                    self.settings, self.models, sink, worker=self.worker,
                    retry_store=retry_store, observers=observers,
                )
                await pipeline.start()
                self._scheduler = DelayScheduler(pipeline.handle)
                self._scheduler.start()
                self._commit_task = asyncio.create_task(self._commit_loop(), name="commits")
                self._sweep_task = asyncio.create_task(self._sweep_loop(), name="gap-sweeper")
                self._last_admit_at = time.monotonic()
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
            await self._drain(pipeline)
            for task in (self._sweep_task, self._commit_task):
                if task is not None:
                    task.cancel()
                    try:
                        await task
                    except asyncio.CancelledError:
                        pass
            await self.commit_now()
            await pipeline.stop(drain=False)
            for model in self.models.values():
                await model.executor.close()
                model.executor.engine.close()

    def preload(self) -> None:
        """Load the models now, before the worker starts (so that a bad model, backend or
        device fails the start with one clear error instead of a crash loop).

        Raises:
            StreamAppError / EngineError: As :func:`load_models`.
        """
        self._preloaded = load_models(self.settings)

    async def _warm_up(self, name: str, model: LoadedModel) -> None:
        config = model.config
        item = {config.input_name: np.zeros(config.item_shape, dtype=config.input_dtype)}
        outputs = await model.executor.run([item])
        if config.output_name not in outputs:
            raise RuntimeError(f"warm-up of {name!r} returned no {config.output_name!r} output")

    # -- offsets ----------------------------------------------------------------------------------

    async def admit(
        self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None
    ) -> list[Admitted]:
        """Check a record just read against the tracker.

        Returns:
            The records to process now, in offset order, each with its ``ack`` callback: the
            record itself; nothing when it was already read; or, when the consumer skipped
            records before it (a gap), those records — read directly from the broker — followed
            by this one.
        """
        self._last_admit_at = time.monotonic()
        if self._assigned is not None and (topic, partition) not in self._assigned:
            # Fetched before its partition was revoked and delivered late: its new owner
            # processes it. Tracking it here would leave stale state behind.
            return []
        async with self._lock_for((topic, partition)):
            decision, epoch = await self.tracker.on_read(topic, partition, offset)
            if decision == "drop":
                return []
            admitted: list[Admitted] = []
            if decision == "gap":
                admitted += await self._read_gap(topic, partition, offset)
                decision, epoch = await self.tracker.on_read(topic, partition, offset)
            if decision == "accept":
                admitted.append(
                    Admitted(self._acker(topic, partition, offset, epoch), offset, key, value)
                )
            return admitted

    async def _read_gap(self, topic: str, partition: int, end: int) -> list[Admitted]:
        """Read and accept the records from the partition's next expected offset up to ``end``."""
        state = self.tracker.state((topic, partition))
        assert state is not None
        begin = state.next_offset
        missing = await self._read_range(topic, partition, begin, end)
        # Offsets the reader passed without a record: below ``deleted_before`` deleted by
        # retention (lost); above it transaction markers or aborted records (nothing lost).
        # A reader that cannot tell (no ``deleted_before``) reports every such offset as lost.
        deleted_before = getattr(missing, "deleted_before", None)
        lost = deleted_before is None
        if deleted_before is not None:
            self.tracker.skip_to(topic, partition, deleted_before)
        admitted = []
        for o, k, v in missing:
            self.tracker.skip_to(topic, partition, o, lost=lost)
            decision, epoch = await self.tracker.on_read(topic, partition, o)
            if decision == "accept":
                admitted.append(Admitted(self._acker(topic, partition, o, epoch), o, k, v))
        state = self.tracker.state((topic, partition))
        if state is not None and state.next_offset < end:
            self.tracker.skip_to(topic, partition, end, lost=lost)
        if admitted:
            log.warning(
                "%s[%d]: the consumer skipped %d records between offsets %d and %d; read them "
                "directly so that none is lost", topic, partition, len(admitted), begin, end - 1,
            )
        return admitted

    def set_processor(self, process: Callable[[SourceMessage], Awaitable[None]]) -> None:
        """How records recovered by :meth:`sweep_gaps` are processed (by topic: the pipeline,
        or the retry scheduler)."""
        self._process = process

    def _lock_for(self, tp: TP) -> asyncio.Lock:
        lock = self._tp_locks.get(tp)
        if lock is None:
            lock = self._tp_locks[tp] = asyncio.Lock()
        return lock

    async def sweep_gaps(self) -> int:
        """Find records the consumer skipped at the *end* of a partition, where no later record
        arrives to reveal the gap, and process them.

        Only when no record was admitted for ``GAP_IDLE_S`` and the pipeline is not applying
        backpressure: then nothing is waiting in Faust's buffers, and a consumer position beyond
        the next expected offset means skipped records.

        Returns:
            How many records were recovered.
        """
        if self._position is None or self._assigned is None or self._process is None:
            return 0
        now = time.monotonic()
        if now - max(self._last_admit_at, self._last_rebalance_at) < GAP_IDLE_S:
            return 0  # records may still be in Faust's buffers, or partitions moving
        pipeline = self.pipeline
        if pipeline is None or pipeline.batcher.pending >= pipeline.batcher.max_pending:
            return 0
        recovered = 0
        for tp in sorted(self._assigned):
            position = await self._position(*tp)
            if position is None:
                continue
            async with self._lock_for(tp):
                if tp not in self._assigned:  # revoked meanwhile
                    continue
                state = await self.tracker.ensure(*tp)
                if position <= state.next_offset:
                    continue
                log.debug(
                    "%s[%d]: the consumer is at offset %d but only %d were read: reading the "
                    "offsets between (skipped records, or transaction markers)", tp[0], tp[1],
                    position, state.next_offset,
                )
                self.tracker.gaps_total += 1
                admitted = await self._read_gap(tp[0], tp[1], position)
                for a in admitted:
                    await self._process(SourceMessage(
                        key=a.key, value=a.value, topic=tp[0], partition=tp[1],
                        offset=a.offset, ack=a.ack,
                        event=StandInEvent(tp[0], tp[1], a.key, a.offset),
                    ))
                recovered += len(admitted)
        return recovered

    def _acker(self, topic: str, partition: int, offset: int, epoch: int) -> Callable[[], None]:
        tracker = self.tracker
        return lambda: tracker.done(topic, partition, offset, epoch)

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

    async def _sweep_loop(self) -> None:
        # its own task: a sweep that recovers many records must not hold up commits
        while True:
            await asyncio.sleep(GAP_IDLE_S / 2)
            try:
                await self.sweep_gaps()
            except Exception:
                log.exception("looking for skipped records failed; will try again")

    async def finish_for_shutdown(self) -> None:
        """On a clean stop, before the consumer goes: finish what is in flight (bounded by
        ``DRAIN_TIMEOUT_S``), wait for the broker's acks, and commit, so that the partitions'
        next owner does not process those records again."""
        if self.pipeline is not None:
            await self._drain(self.pipeline)
            await self.commit_now()

    async def _drain(self, pipeline: InferencePipeline) -> None:
        """Stop taking due retries, finish what is in flight and wait for the broker's acks
        (each bounded by ``DRAIN_TIMEOUT_S``)."""
        if self._scheduler is not None:
            await self._scheduler.stop()
        try:
            await asyncio.wait_for(pipeline.batcher.drain(), DRAIN_TIMEOUT_S)
            if self._flush is not None:
                await asyncio.wait_for(self._flush(), DRAIN_TIMEOUT_S)
        except (TimeoutError, RuntimeError) as exc:
            log.warning("stopping with requests in flight (%s); they will be redelivered", exc)

    def on_assigned(self, assigned: set[TP]) -> None:
        """Partitions were (re)assigned: from now on only records of ``assigned`` are admitted,
        and the state of any other partition is dropped."""
        self._last_rebalance_at = time.monotonic()
        self._assigned = set(assigned)
        self.tracker.forget(tp for tp in self.tracker.assigned() if tp not in self._assigned)

    async def on_revoked(self, revoked: set[TP]) -> None:
        """Before partitions go to another worker: commit what finished, forget the rest."""
        self._last_rebalance_at = time.monotonic()
        if self._assigned is not None:
            self._assigned -= revoked
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
