"""The inference pipeline behind the request and retry agents, independent of Faust.

For each source record: decode and validate (bad input becomes a dead letter with a reason
code), pre-process into an engine input item, micro-batch (:mod:`streamapp.batching`), run the
batch on the model's executor, post-process, and produce the outcome:

* a **result** to the result topic;
* a **retry record** to the retry topic when inference failed with a retriable error (engine
  error, out of memory, timeout) and ``max_retries`` is not exhausted;
* a **dead letter** otherwise (bad input, non-retriable failure, retries exhausted).

When a whole batch fails, each of its requests is run again alone (all at once, as far as the
executor's in-flight bound allows), so one poison request costs each of its neighbours exactly
one extra engine run and the batch one run plus ``n`` single-request runs. Bisection in halves
needs fewer engine calls (``2·log2(n)``) but re-runs an innocent neighbour up to ``log2(n)``
times, one level after another, and every later batch waits behind it for its turn to emit
(issue 19: healthy p99 ×19 with 40 failing requests/s). A request that may fail again never
shares a batch with fresh requests: retries (``attempt > 0``) and the requests of a device one
of whose requests failed alone while its neighbours passed (for ``failure_quarantine_s``) run
in a lane of their own, each alone (:meth:`InferencePipeline.runs_alone`). Outcomes still leave
in read order, whichever lane a request ran in.

A model's metadata (``queue_policy``) or a request (``deadline``) may bound how old a request
may be when its batch would start; a **queue policy** is applied when a request is read and
again when its batch starts (the batcher's screen, :meth:`InferencePipeline.screen`): a request
past its max age gets an ``expired`` result without engine time, and with ``latest_frame`` the
older requests of a device in one batch get ``superseded`` results naming the newest, which
alone is inferred (docs/delivery.md). Requests without a policy are never looked at.

Outcomes are produced in the order records were read (per-device order), and a record is
acknowledged — its ``ack`` callback called — only once the broker acknowledged the outcome. The
caller (the Faust agent) turns acks into committed offsets (:mod:`streamapp.offsets`), so a crash
can duplicate but never lose a request.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import math
import time
import traceback
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from aiokafka.errors import (
    CorruptRecordException,
    InvalidTimestampError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
    UnsupportedForMessageFormatError,
)
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from engines.base import EngineInfo
from engines.exceptions import EngineError
from engines.executor import Executor
from engines.preprocess import EncodedImage
from streamapp.agents.observer import Outcome, OutcomeKind, PipelineObserver, SkippedKind
from streamapp.batching import BatchInfo, Completion, MicroBatcher
from streamapp.codecs import (
    MAX_ID_CHARS,
    check_key,
    decode_request,
    encode_dead_letter,
    encode_result,
)
from streamapp.exceptions import InternalError, InvalidRequestError, StreamAppError
from streamapp.logs import PerKeyThrottle
from streamapp.models import ModelConfig
from streamapp.models.decoding import ImageDecoder
from streamapp.record_batches import UndecodableBatchError, take_undecodable
from streamapp.records import DeadLetter, InferenceRequest, InferenceResult
from streamapp.retry import MemoryRetryStore, RetryRecord, RetryStore, backoff_s
from streamapp.settings import Settings
from streamapp.tasks import cancel_and_wait, wait_event

__all__ = [
    "BatchSink", "InferencePipeline", "LoadedModel", "PipelineStats", "Sink", "SourceMessage",
]

#: Errors that mean *this record* cannot be encoded or produced, whatever the producer's state.
_RECORD_ERRORS: tuple[type[BaseException], ...] = (
    MessageSizeTooLargeError, RecordListTooLargeError, RecordTooLargeError,
    CorruptRecordException, InvalidTimestampError, UnsupportedForMessageFormatError,
    ValueError, TypeError, OverflowError,
)

#: Longest error message kept in an ``unproducible_outcome`` dead letter (characters).
_SMALL_MESSAGE_CHARS = 400


def _record_error(exc: BaseException) -> BaseException | None:
    """The error in ``exc``'s cause chain that means *this record* can never be produced (Faust
    wraps aiokafka's errors in ``ProducerSendError``), or None (e.g. the producer is stopping:
    producing again later may work)."""
    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 8:
        if isinstance(current, _RECORD_ERRORS):
            return current
        current, seen = current.__cause__, seen + 1
    return None


def _type_name(error: BaseException) -> str:
    """The error type a dead letter names: the decoding error's for an undecodable batch (e.g.
    ``CorruptRecordException``), else the error's own."""
    return getattr(error, "error_type", None) or type(error).__name__


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."

log = logging.getLogger(__name__)

#: Most devices whose requests run alone at once (``failure_quarantine_s``); beyond it the one
#: quarantined longest ago is released first. Bounds the memory a flood of failing devices takes.
MAX_QUARANTINED_DEVICES = 10_000


@dataclass(slots=True)
class SourceMessage:
    """One record read from the request topic (or a due retry).

    Attributes:
        key / value: The request record's raw key and value (for a retry: the original ones).
        topic / partition / offset: Where this record was read (for a retry: the retry topic).
        ack: Marks the record finished (safe to commit); called at most once, after its
            outcome was acknowledged by the broker.
        received_at: ``time.monotonic()`` when it was read.
        event: The Faust event it came in, or None outside Faust.
        retry: The retry record when this is a retry, else None.
    """

    key: bytes | None
    value: bytes | None
    topic: str
    partition: int
    offset: int
    ack: Callable[[], Any]
    received_at: float = field(default_factory=time.monotonic)
    event: Any = None
    retry: RetryRecord | None = None

    def __repr__(self) -> str:  # never the whole value: it can be megabytes
        return (
            f"<{self.topic}[{self.partition}]@{self.offset} key={self.key!r:.40} "
            f"value={len(self.value or b'')} bytes>"
        )


class Sink(Protocol):
    """Where outcomes go: ``send`` hands a record to the producer and returns an awaitable that
    resolves once the broker acknowledged it (Faust's ``FutureMessage``, an asyncio future).

    A sink may also have ``send_many(records)`` (see :class:`BatchSink`): the pipeline then
    hands it every outcome that is ready at once.
    """

    async def send(self, topic: str, key: bytes | None, value: bytes) -> Awaitable[Any]: ...


class BatchSink(Sink, Protocol):
    """A sink that produces many records with one producer call per partition."""

    async def send_many(
        self, records: Sequence[tuple[str, bytes | None, bytes]]
    ) -> list[Awaitable[Any] | BaseException]:
        """Hand ``(topic, key, value)`` records to the producer, each partition's in the given
        order.

        Returns:
            Per record, in the given order: an awaitable that resolves once the broker
            acknowledged it (records sent in one record batch share it), or the exception that
            kept this record from being handed to the producer (e.g. a record error).

        Raises:
            Exception: The producer failed for every record (e.g. it is stopping).
        """
        ...


#: One outcome record ready to produce: the work it answers, topic, key, value, its outcome
#: and the batch the work ran in.
_Outgoing = tuple["_Work", str, "bytes | None", bytes, Outcome, "BatchInfo | None"]


class AckGuard(Protocol):
    """Confirms that what the broker acknowledged is where consumers will read it."""

    def acknowledged(self, topic: str, partition: int, offset: int | None) -> bool:
        """Whether an acknowledgement of ``topic[partition]`` at ``offset`` may count."""
        ...

    async def confirm(self) -> bool:
        """Whether every acknowledgement so far is confirmed (before held acks are applied)."""
        ...


@dataclass
class LoadedModel:
    """A model version ready to serve: its contract and the executor running its engine.

    Attributes:
        active: Batches that started on this version and have not finished (a version that
            was swapped out is closed once it reaches 0: :mod:`streamapp.models.swap`).
    """

    config: ModelConfig
    executor: Executor
    active: int = 0

    @property
    def info(self) -> EngineInfo:
        return self.executor.engine.info

    @property
    def version(self) -> str:
        return self.config.version


@dataclass(slots=True)
class _Work:
    source: SourceMessage
    request: InferenceRequest | None = field(default=None, repr=False)
    model: LoadedModel | None = field(default=None, repr=False)
    array: np.ndarray | EncodedImage | None = field(default=None, repr=False)
    #: An image being decoded off the event loop (:class:`ImageDecoder`); the batch awaits it.
    pending: asyncio.Future[np.ndarray | EncodedImage] | None = field(default=None, repr=False)
    #: The max age (ms) and where it came from (``"request"``/``"model"``) of a request under
    #: a queue policy; None without a max age.
    max_age: tuple[float, str] | None = None
    #: What the queue policy saw (result fields ``age_ms``, ``max_age_ms``, ...), set when it
    #: was applied; None for a request without a policy.
    policy: dict[str, Any] | None = None

    @property
    def attempt(self) -> int:
        return self.source.retry.attempt if self.source.retry is not None else 0


@dataclass(slots=True)
class _ItemResult:
    """What the engine gave one item: outputs, or the error of the smallest batch that failed."""

    outputs: dict[str, Any] | None = None
    error: BaseException | None = None
    infer_ms: float = 0.0
    #: ``"expired"`` or ``"superseded"``: a queue policy kept the request from the engine.
    skipped: SkippedKind | None = None
    #: ``time.monotonic()`` when the policy decided (for ``queue_ms`` of a skipped request).
    decided_at: float = 0.0


@dataclass
class PipelineStats:
    """Counters since start."""

    received: int = 0
    results: int = 0
    retries: int = 0
    dead_letters: dict[str, int] = field(default_factory=dict)
    produce_failures: int = 0
    #: Records finished although no outcome of theirs could be produced in any form (logged).
    unwritable: int = 0
    acked: int = 0
    #: Failed batches whose requests were run again, each alone (the metric's historic name).
    bisections: int = 0
    #: Outcomes not produced because their partition was revoked or reassigned after the
    #: record was read (its next reader answers it).
    stale_dropped: int = 0
    #: Requests a queue policy kept from the engine: past their max age, or superseded.
    expired: int = 0
    superseded: int = 0


class InferencePipeline:
    """Decode → validate → batch → infer (isolating failed batches) → produce, in read order.

    Args:
        settings: Topics, batching limits, retry policy, ``max_request_bytes``, ``top_k``.
        models: Loaded models by name (the request's ``model`` field).
        sink: Producer of results, retry records and dead letters.
        worker: Name put in results and dead letters.
        retry_store: Where attempt counters live; a dict when None.
        observers: Told about every outcome and batch (tables, metrics).
        highwater: ``(topic, partition) -> high watermark`` of the last fetch (None when not
            fetched): with it, a batch is held open for records already waiting in the broker
            (``max_batch_hold_ms``, :meth:`backlog`). None: batches close on the delay.
        ack_guard: Confirms acknowledgements (:class:`AckGuard`, e.g.
            :class:`streamapp.topology.TopicWatch`): one it refuses, or held acknowledgements
            it does not confirm at a state flush, leave their records uncommitted.
        current: Whether a record still belongs to its partition's current assignment
            (:meth:`streamapp.delivery.Delivery.current`); the outcomes of records that do not
            are dropped: the partition's next reader answers them (with exactly_once in its own
            transaction) and counts them in its device tables. The worker passes it in both
            delivery modes: with at_least_once, a result produced late by the old reader was
            answered twice while the device row it wrote after the handover was lost (table
            count one below the result topic, tests/integration/test_state_handover.py).
            None: every outcome is produced.
    """

    def __init__(
        self,
        settings: Settings,
        models: Mapping[str, LoadedModel],
        sink: Sink,
        *,
        worker: str,
        retry_store: RetryStore | None = None,
        observers: Sequence[PipelineObserver] = (),
        highwater: Callable[[str, int], int | None] | None = None,
        ack_guard: AckGuard | None = None,
        current: Callable[[SourceMessage], bool] | None = None,
    ) -> None:
        self.settings = settings
        self.current = current
        self.ack_guard = ack_guard
        #: Model name -> its current version: what a batch that starts now runs on.
        self.models = dict(models)
        #: Model name -> version -> every loaded version (the current one included); a request
        #: that pins a version runs on it (:meth:`swap` changes both maps between batches).
        self.loaded: dict[str, dict[str, LoadedModel]] = {
            name: {model.version: model} for name, model in self.models.items()
        }
        self.sink = sink
        self.worker = worker
        self.retry_store: RetryStore = retry_store or MemoryRetryStore()
        self.observers = list(observers)
        self.stats = PipelineStats()
        #: Dead-letter log lines: 10 per reason a minute, then a count (the DLQ has them all).
        self._letter_log = PerKeyThrottle()
        self._emitted_in_batch: dict[str, int] = {}
        self.images = ImageDecoder(
            settings.image_decode_threads, max_image_pixels=settings.max_image_pixels
        )
        for name, model in self.models.items():
            if settings.image_decode == "auto" and model.config.image is not None:
                why_not = self.images.use_engine(model.config, model.executor.engine)
                log.info("model %s: JPEG frames decoded %s", name,
                         "on the GPU" if why_not is None else f"on the CPU ({why_not})")
        #: Small dead letters being produced for records the broker refused (see _after_send).
        self._replacing: set[asyncio.Future[None]] = set()
        #: Acks of records whose outcome the broker has, held until the next state flush (so
        #: that a committed offset is never ahead of the device state its outcome updates).
        self._held_acks: list[Callable[[], Any]] = []
        self._flush_interval_s = float(getattr(settings, "state_flush_interval_ms", 0.0)) / 1e3
        self._hold_acks = self._flush_interval_s > 0 and any(
            getattr(o, "writes_state", False) for o in self.observers
        )
        self._flush_max_records = int(getattr(settings, "state_flush_max_records", 1024))
        #: Set when ``state_flush_max_records`` acks are held: the flush loop runs at once.
        self._flush_now = asyncio.Event()
        self._flush_lock = asyncio.Lock()
        self._flusher: asyncio.Task[None] | None = None
        #: Producer futures whose acknowledgement has not arrived yet (see wait_acknowledged).
        self._outstanding: set[Any] = set()
        #: (topic, partition) -> offset of the last record read (for the backlog estimate).
        self._last_read: dict[tuple[str, int], int] = {}
        self._highwater = highwater
        #: device_id -> ``time.monotonic()`` until which its requests run alone (oldest first).
        self._quarantine: dict[str, float] = {}
        hold_ms = float(getattr(settings, "max_batch_hold_ms", 0.0))
        self.batcher: MicroBatcher[_Work] = MicroBatcher(
            self._run_batch,
            emit_many=self._emit_many,
            max_batch_size=settings.max_batch_size,
            max_batch_delay_ms=settings.max_batch_delay_ms,
            max_inflight_batches=settings.max_inflight_batches,
            backlog=self.backlog if highwater is not None and hold_ms > 0 else None,
            max_batch_hold_ms=hold_ms,
            screen=self.screen,
        )

    async def start(self) -> None:
        await self.batcher.start()
        if self._flusher is None and self._flush_interval_s > 0:
            self._flusher = asyncio.create_task(self._flush_loop(), name="state-flush")

    async def stop(self, *, drain: bool = True) -> None:
        """Stop; with ``drain`` every record read so far is answered (and acked) first."""
        try:
            await self.batcher.stop(drain=drain)
            await cancel_and_wait(self._flusher)
            self._flusher = None
            await self.flush_state()
            self.images.close()
        finally:
            self._letter_log.flush(log, "dead letters")

    async def flush_state(self) -> None:
        """Write the device state of every outcome produced so far (observers' ``flush``: one
        row per device and table since the last flush), then acknowledge the records whose
        outcome the broker has. Runs every ``state_flush_interval_ms``, and before commits on
        revocation and shutdown."""
        # One flush at a time: a flush that found the acks already taken by one still writing
        # (the periodic flush, when a stop or a revocation flushes) must not return before
        # those acks are applied, or the commit that follows it misses them (one duplicate
        # after a clean restart, tests/integration/test_faults.py).
        async with self._flush_lock:
            acks, self._held_acks = self._held_acks, []
            try:
                for observer in self.observers:
                    try:
                        await observer.flush()
                    except Exception:
                        log.exception("observer %r failed to flush", observer)
            except asyncio.CancelledError:
                self._held_acks[:0] = acks  # not written: the next flush takes them again
                raise
            if acks and self.ack_guard is not None and not await self.ack_guard.confirm():
                self._held_acks[:0] = acks  # not confirmed: never committed
                return
            for ack in acks:
                ack()
            self.stats.acked += len(acks)

    async def wait_acknowledged(self) -> None:
        """Wait until the broker answered for every outcome handed to the producer so far and
        their callbacks ran (acks held for the next :meth:`flush_state`, or failures logged).

        ``producer.flush()`` returning is not enough: the futures' callbacks run after it, in
        later loop iterations. A gather over the futures completes only after the callbacks
        added before it ran (asyncio runs a future's callbacks in the order they were added).
        """
        if self._outstanding:
            await asyncio.gather(*list(self._outstanding), return_exceptions=True)

    def _track(self, future: Any) -> None:
        if future not in self._outstanding:
            self._outstanding.add(future)
            future.add_done_callback(self._outstanding.discard)

    async def _flush_loop(self) -> None:
        """Flush every ``state_flush_interval_ms``, or sooner when ``state_flush_max_records``
        acks are held (so that what a crash re-delivers stays bounded at any rate)."""
        while True:
            await wait_event(self._flush_now, self._flush_interval_s)
            self._flush_now.clear()
            await self.flush_state()
            self._letter_log.expire(log, "dead letters")

    # -- input ----------------------------------------------------------------------------------

    async def handle(self, message: SourceMessage) -> None:
        """Accept one record (see :meth:`handle_many`)."""
        await self.handle_many((message,))

    async def handle_many(self, messages: Sequence[SourceMessage]) -> None:
        """Accept records read together, in read order. Waits once, before the first, while too
        much is in flight (backpressure); then decodes and queues them all without awaiting.
        Never raises for bad input: it becomes a dead letter."""
        if not messages:
            return
        batcher = self.batcher
        await batcher.reserve()
        last_read = self._last_read
        for message in messages:
            last_read[(message.topic, message.partition)] = message.offset
            self.stats.received += 1
            work = _Work(message)
            undecodable = self._undecodable(message)
            if undecodable is not None:
                batcher.put_done_nowait(work, undecodable)
                continue
            try:
                request = work.request = decode_request(
                    message.value, max_request_bytes=self.settings.max_request_bytes
                )
                check_key(message.key, request)
                model = work.model = self._model(request.model, request.model_version)
                policed = request.deadline is not None or model.config.has_queue_policy
                if policed and self._expired_on_read(work, request, model):
                    continue  # not pre-processed: its expired result is queued in order
                if request.tensor is None and request.image is not None:
                    # Never decoded on the event loop: the batch awaits the result.
                    work.pending = self.images.submit(model.config, request)
                else:
                    work.array = model.config.preprocess(request)
            except InvalidRequestError as exc:
                batcher.put_done_nowait(work, exc)
                continue
            except Exception as exc:  # a bug of ours must not stop the partition: DLQ it, log it
                log.exception("internal error while decoding %s", message)
                batcher.put_done_nowait(work, InternalError(f"{type(exc).__name__}: {exc}"))
                continue
            batcher.put_nowait(
                work, key=(request.model, self.runs_alone(work), request.model_version),
                screened=policed,
            )

    def _expired_on_read(
        self, work: _Work, request: InferenceRequest, model: LoadedModel
    ) -> bool:
        """Note the max age of a request under a queue policy; when it is past it already,
        queue its ``expired`` result (in read order) and return True."""
        if request.deadline is not None:
            work.max_age = (request.deadline, "request")
        elif model.config.max_age_ms is not None:
            work.max_age = (model.config.max_age_ms, "model")
        else:
            return False
        now = time.monotonic()
        verdict = self._expiry(work, time.time(), now)
        if verdict is None:
            return False
        self.batcher.put_done_nowait(work, None, verdict)
        return True

    def runs_alone(self, work: _Work) -> bool:
        """Whether a decoded request goes to the lane whose requests each run alone: a retry
        (it failed before), or a request of a device under quarantine (see
        :meth:`_suspect`)."""
        if work.attempt > 0:
            return True
        if not self._quarantine:
            return False
        assert work.request is not None
        until = self._quarantine.get(work.request.device_id)
        if until is None:
            return False
        if until <= time.monotonic():
            del self._quarantine[work.request.device_id]
            return False
        return True

    def _suspect(self, work: _Work, *, isolated: bool) -> None:
        """A request failed alone: quarantine its device for ``failure_quarantine_s`` (its next
        requests run alone) when the failure was isolated — a neighbour of the same run passed,
        so it is this request, not the engine — or the device is quarantined already. At most
        :data:`MAX_QUARANTINED_DEVICES` devices; the oldest entry goes first."""
        seconds = float(getattr(self.settings, "failure_quarantine_s", 0.0))
        request = work.request
        if seconds <= 0 or request is None:
            return
        device = request.device_id
        if not isolated and device not in self._quarantine:
            return
        self._quarantine.pop(device, None)  # re-inserted last: the dict is oldest-first
        self._quarantine[device] = time.monotonic() + seconds
        while len(self._quarantine) > MAX_QUARANTINED_DEVICES:
            del self._quarantine[next(iter(self._quarantine))]

    def backlog(self) -> int:
        """Records waiting in the broker beyond the last one read, over the partitions read so
        far that are still fetched: the fetch high watermark minus the next offset to read
        (records Faust fetched but has not handed over yet count as waiting)."""
        highwater, waiting = self._highwater, 0
        if highwater is None:
            return 0
        for (topic, partition), offset in self._last_read.items():
            mark = highwater(topic, partition)
            if mark is not None and mark > offset + 1:
                waiting += mark - offset - 1
        return waiting

    async def reject(self, message: SourceMessage, error: InvalidRequestError) -> None:
        """Send a record that cannot be processed at all straight to the DLQ, in read order."""
        self.stats.received += 1
        await self.batcher.put_done(_Work(message), self._undecodable(message) or error)

    @staticmethod
    def _undecodable(message: SourceMessage) -> UndecodableBatchError | None:
        """The error of a stand-in for an offset of a record batch the consumer could not
        decode (:mod:`streamapp.record_batches`), or None for a real record."""
        if message.value is not None:
            return None
        batch = take_undecodable(message.topic, message.partition, message.offset)
        return None if batch is None else UndecodableBatchError(batch, message.offset)

    def _model(self, name: str, version: str | None = None) -> LoadedModel:
        """The version of model ``name`` a request runs on: ``version`` when it pins one,
        else the current one.

        Raises:
            InvalidRequestError: ``unknown_model`` or ``unknown_model_version``.
        """
        try:
            current = self.models[name]
        except KeyError:
            raise InvalidRequestError(
                "unknown_model",
                f"model {name!r} is not loaded by this worker; loaded: "
                f"{', '.join(sorted(self.models))}",
            ) from None
        if version is None or version == current.version:
            return current
        pinned = self.loaded.get(name, {}).get(version)
        if pinned is None:
            raise InvalidRequestError(
                "unknown_model_version",
                f"the request pins version {version!r} of model {name!r}, which this worker "
                f"has not loaded; loaded: {', '.join(self.loaded.get(name, {}))} (current "
                f"{current.version}); "
                + (f"load it with `streamapp models load {name} --version {version} --keep`, "
                   "or leave model_version out" if version.isascii() and version.isdigit()
                   else "versions are numbers (the model's version folders): leave "
                   "model_version out for the current one"),
            )
        return pinned

    def swap(self, name: str, model: LoadedModel, *, keep: bool = False) -> list[LoadedModel]:
        """Make ``model`` the current version of ``name`` for every batch that starts from now
        on; batches already started finish on the version they started with.

        Args:
            name: A model this pipeline serves.
            model: The version to serve (loaded, warmed up and checked by the caller).
            keep: Keep the previous version loaded for requests that pin it.

        Returns:
            The versions no longer loaded — the previous one (unless kept), and a kept one that
            ``model`` reloads — for the caller to close once their ``active`` count is 0.
        """
        previous = self.models.get(name)
        versions = self.loaded.setdefault(name, {})
        retired = []
        replaced = versions.get(model.version)
        if replaced is not None and replaced is not model and replaced is not previous:
            retired.append(replaced)
        self.models[name] = model
        versions[model.version] = model
        if previous is not None and previous is not model and (
                previous.version == model.version or not keep):
            if versions.get(previous.version) is previous:
                del versions[previous.version]
            retired.append(previous)
        return retired

    def unload(self, name: str, version: str) -> LoadedModel:
        """Stop serving a version that is not current (requests pinning it are dead-lettered
        as ``unknown_model_version`` from now on).

        Returns:
            The version, for the caller to close once its ``active`` count is 0.

        Raises:
            KeyError: The version is not loaded, or is the current one.
        """
        current = self.models.get(name)
        if current is not None and current.version == version:
            raise KeyError(f"version {version} of model {name!r} is the current one")
        return self.loaded.get(name, {}).pop(version)

    # -- queue policy ---------------------------------------------------------------------------

    def screen(self, key: Hashable, works: list[_Work]) -> list[_ItemResult | None] | None:
        """The queue policy of a batch that is about to start (the batcher's ``screen`` hook;
        only batches holding a request under a policy come here).

        A request past its max age (its ``deadline``, else the model's
        ``queue_policy.max_age_ms``) gets an ``expired`` verdict; then, for a model with
        ``queue_policy.latest_frame``, every request of a device but its newest (the last read)
        gets a ``superseded`` one. Ages are measured from when the request reached Kafka (see
        :meth:`_age_ms`).

        Args:
            key: The batch key ``(model name, runs alone, pinned version or None)``.
            works: The batch's requests in read order.

        Returns:
            Per request, None (infer it) or its verdict; None when every request runs.
        """
        assert isinstance(key, tuple)
        try:  # the version the batch will run on (docs/versions.md)
            model = self._model(str(key[0]), key[2])
        except InvalidRequestError:  # a pinned version unloaded since: _run_batch answers it
            model = self.models[str(key[0])]
        now_wall, now = time.time(), time.monotonic()
        verdicts: list[_ItemResult | None] = [None] * len(works)
        skipped = False
        for i, work in enumerate(works):
            if work.max_age is not None:
                verdicts[i] = self._expiry(work, now_wall, now)
                skipped = skipped or verdicts[i] is not None
            elif model.config.latest_frame:
                work.policy = {"age_ms": self._age_ms(work, now_wall, now)}
        if model.config.latest_frame:
            newest: dict[str, _Work] = {}
            for i in range(len(works) - 1, -1, -1):
                work = works[i]
                if verdicts[i] is not None or work.request is None:
                    continue
                latest = newest.get(work.request.device_id)
                if latest is None:
                    newest[work.request.device_id] = work
                    continue
                assert latest.request is not None and work.policy is not None
                work.policy["superseded_by"] = latest.request.request_id
                verdicts[i] = _ItemResult(skipped="superseded", decided_at=now)
                self.stats.superseded += 1
                skipped = True
        if not skipped:
            return None
        for work, verdict in zip(works, verdicts, strict=True):
            if verdict is not None and work.pending is not None:
                work.pending.cancel()  # an image still being decoded: nobody will use it
                work.pending = None
        return verdicts

    def _expiry(self, work: _Work, now_wall: float, now: float) -> _ItemResult | None:
        """Record the age of a request with a max age in ``work.policy``; its ``expired``
        verdict when it is older than that, else None."""
        assert work.max_age is not None
        limit_ms, source = work.max_age
        age_ms = self._age_ms(work, now_wall, now)
        work.policy = {"age_ms": age_ms, "max_age_ms": limit_ms, "max_age_from": source}
        if age_ms <= limit_ms:
            return None
        self.stats.expired += 1
        return _ItemResult(skipped="expired", decided_at=now)

    def _age_ms(self, work: _Work, now_wall: float, now: float) -> float:
        """How old a request is (ms, >= 0): the time since it reached Kafka, on the worker's
        wall clock against the record's timestamp (:meth:`_arrived`), and never less than the
        time since this worker read it (monotonic clock), so that a publisher whose clock is
        ahead cannot make a request look young once it has waited here."""
        source = work.source
        arrived = self._arrived(source, now_wall)
        return round(max(now_wall - arrived, now - source.received_at, 0.0) * 1000.0, 3)

    @staticmethod
    def _arrived(source: SourceMessage, now_wall: float) -> float:
        """When a request reached Kafka (epoch seconds): its record's timestamp (set by the
        producer, or by the broker with ``message.timestamp.type=LogAppendTime``); for a
        record without one, when this worker read it; for a retry, when its first attempt
        failed."""
        if source.retry is not None:
            return source.retry.first_failed_ts
        stamp = getattr(getattr(source.event, "message", None), "timestamp", None)
        if isinstance(stamp, int | float) and math.isfinite(stamp) and stamp > 0:
            return float(stamp)
        return now_wall - (time.monotonic() - source.received_at)

    # -- batches --------------------------------------------------------------------------------

    async def _run_batch(self, key: Hashable, batch: list[_Work]) -> Sequence[_ItemResult]:
        assert isinstance(key, tuple)  # (model name, runs alone, pinned version): handle_many
        try:
            # Resolved once, when the batch starts: a swap between batches never splits one.
            model = self._model(str(key[0]), key[2])
        except InvalidRequestError as exc:  # its pinned version was unloaded since decoding
            return [_ItemResult(error=exc) for _ in batch]
        model.active += 1
        try:
            return await self._run_batch_on(model, bool(key[1]), batch)
        finally:
            model.active -= 1

    async def _run_batch_on(
        self, model: LoadedModel, alone: bool, batch: list[_Work]
    ) -> Sequence[_ItemResult]:
        results: list[_ItemResult | None] = [None] * len(batch)
        runnable: list[int] = []
        seen: set[str] = set()
        for i, work in enumerate(batch):
            if work.pending is not None:
                results[i] = await self._decoded(work)
        for i, work in enumerate(batch):
            assert work.request is not None
            if results[i] is not None:
                continue
            request_id = work.request.request_id
            if request_id in seen:
                results[i] = _ItemResult(error=InvalidRequestError(
                    "duplicate_request_id",
                    f"request_id {request_id!r} appears twice in one batch; request ids must "
                    "be unique (the first one is answered)",
                ))
            else:
                seen.add(request_id)
                runnable.append(i)
        if runnable:
            works = [batch[i] for i in runnable]
            for work in works:
                work.model = model  # the version that answers (the result names it)
            outcomes = await (
                self._infer_each(model, works) if alone else self._infer_isolating(model, works)
            )
            for i, outcome in zip(runnable, outcomes, strict=True):
                results[i] = outcome
        return [r if r is not None else _ItemResult(error=RuntimeError("no result"))
                for r in results]

    async def _decoded(self, work: _Work) -> _ItemResult | None:
        """Await an image decoded off the loop; its failure as the item's result, else None."""
        assert work.pending is not None
        try:
            work.array = await work.pending
        except InvalidRequestError as exc:
            return _ItemResult(error=exc)
        except Exception as exc:
            log.error("internal error while decoding %s", work.source, exc_info=exc)
            return _ItemResult(error=InternalError(f"{type(exc).__name__}: {exc}"))
        finally:
            work.pending = None
        return None

    async def _infer(self, model: LoadedModel, works: list[_Work]) -> list[_ItemResult]:
        """Run ``works`` as one engine batch.

        Raises:
            EngineError: The engine failed the whole batch.
        """
        config = model.config
        items: list[Any] = []
        for work in works:
            assert work.array is not None
            items.append({config.input_name: work.array})
        started = time.perf_counter()
        outputs = await model.executor.run(items)
        infer_ms = (time.perf_counter() - started) * 1000.0
        probs = outputs[config.output_name]
        k = min(self.settings.top_k, len(config.labels))
        return [
            _ItemResult(outputs={"top_k": top}, infer_ms=infer_ms)
            for top in config.top_k_many(np.asarray(probs)[: len(works)], k)
        ]

    async def _infer_isolating(
        self, model: LoadedModel, works: list[_Work]
    ) -> list[_ItemResult]:
        """Run ``works`` as one batch; when the engine fails it, run each request alone once
        (:meth:`_infer_each`), so that each innocent neighbour costs one extra engine run."""
        try:
            return await self._infer(model, works)
        except EngineError as exc:
            if len(works) == 1:
                self._suspect(works[0], isolated=False)
                return [_ItemResult(error=exc)]
            self.stats.bisections += 1
            log.info(
                "a batch of %d failed (%s: %s); running each request alone to isolate the "
                "failing one(s)", len(works), type(exc).__name__, exc,
            )
            return await self._infer_each(model, works)

    async def _infer_each(self, model: LoadedModel, works: list[_Work]) -> list[_ItemResult]:
        """Run every request of ``works`` alone, concurrently (the executor's ``max_inflight``
        bounds how many run at once). A request that fails gets its own error, and its device
        is quarantined when a neighbour passed (:meth:`_suspect`)."""

        async def one(work: _Work) -> _ItemResult | EngineError:
            try:
                return (await self._infer(model, [work]))[0]
            except EngineError as exc:
                return exc

        answers = await asyncio.gather(*(one(work) for work in works))
        isolated = any(not isinstance(a, EngineError) for a in answers)
        results: list[_ItemResult] = []
        for work, answer in zip(works, answers, strict=True):
            if isinstance(answer, EngineError):
                self._suspect(work, isolated=isolated)
                results.append(_ItemResult(error=answer))
            else:
                results.append(answer)
        return results

    # -- output ---------------------------------------------------------------------------------

    async def _emit_many(self, completions: list[Completion[_Work]]) -> None:
        """Produce the outcomes of ``completions`` (in read order): one producer call per
        partition when the sink has ``send_many``, else one ``send`` per record."""
        if self.current is not None:
            kept = [c for c in completions if self.current(c.item.source)]
            self.stats.stale_dropped += len(completions) - len(kept)
            completions = kept
        outgoing: list[_Outgoing] = []
        for completion in completions:
            prepared = self._prepare(completion)
            if prepared is None:  # nothing can be produced for it: finished without a record
                work = completion.item
                self._finish_unwritable(work, work.source.retry)
            else:
                outgoing.append(prepared)
        if not outgoing:
            return
        send_many = getattr(self.sink, "send_many", None)
        if send_many is None:
            for entry in outgoing:
                await self._emit_alone(entry)
            if self._flush_interval_s <= 0:
                await self.flush_state()
            return
        try:
            handed = await send_many([(e[1], e[2], e[3]) for e in outgoing])
        except Exception as exc:
            # The producer itself failed (e.g. stopping): the records stay uncommitted and are
            # processed again by whoever reads their partitions next. Nothing is dead-lettered.
            self.stats.produce_failures += len(outgoing)
            log.error("cannot produce %d outcome(s), the first for %s (%s: %s); they will be "
                      "processed again", len(outgoing), outgoing[0][0].source,
                      type(exc).__name__, exc)
            return
        by_future: dict[int, tuple[Any, list[_Outgoing]]] = {}
        told: list[Outcome] = []
        for entry, result in zip(outgoing, handed, strict=True):
            if isinstance(result, BaseException):
                if _record_error(result) is None:
                    self.stats.produce_failures += 1
                    log.error("cannot produce to %s for %s (%s: %s); it will be processed "
                              "again", entry[1], entry[0].source, type(result).__name__, result)
                else:  # this record cannot be produced: the one-record path replaces it
                    await self._emit_alone(entry)
                continue
            self._sent(entry, told)
            group = by_future.get(id(result))
            if group is None:
                by_future[id(result)] = (result, [entry])
            else:
                group[1].append(entry)
        self._tell(told)
        for future, entries in by_future.values():
            future.add_done_callback(functools.partial(self._on_produced_many, entries))
            self._track(future)
        if self._flush_interval_s <= 0:
            await self.flush_state()  # no interval: device state after every emit

    def _prepare(self, completion: Completion[_Work]) -> _Outgoing | None:
        """The outcome record of a completion, already replaced by a small
        ``unproducible_outcome`` dead letter when it would be larger than
        :meth:`max_record_bytes`; None when not even that can be produced."""
        work = completion.item
        item: _ItemResult | None = completion.result
        error = completion.error
        if error is None and item is not None:
            error = item.error
        try:
            if error is None:
                assert item is not None
                topic, key, value, outcome = self._result(work, item, completion.batch)
            elif self._should_retry(work, error):
                topic, key, value, outcome = self._retry(work, error)
            else:
                topic, key, value, outcome = self._dead_letter(work, error)
        except _RECORD_ERRORS as exc:  # the outcome cannot be encoded (e.g. msgpack overflow)
            topic, key, value, outcome = self._unproducible(work, "outcome", b"", exc)
        problem = self._oversize(key, value)
        if problem is not None:
            if outcome.reason == "unproducible_outcome":
                log.error("cannot produce even the small dead letter of %s (%s: %s)",
                          work.source, type(problem).__name__, problem)
                return None
            topic, key, value, outcome = self._unproducible(work, topic, value, problem, outcome)
            if self._oversize(key, value) is not None:
                log.error("cannot produce even the small dead letter of %s", work.source)
                return None
        return work, topic, key, value, outcome, completion.batch

    def _sent(self, entry: _Outgoing, told: list[Outcome] | None = None) -> None:
        """An outcome was handed to the producer: finish its retry counter, tell observers (now,
        or with the others of ``told`` in :meth:`_tell`)."""
        work, _, _, _, outcome, batch = entry
        retry = work.source.retry
        if retry is not None and outcome.kind != "retry":
            self.retry_store.finish(retry.request_id, work.source.event)  # the request is done
        for observer in self.observers:
            if batch is not None and batch.batch_id not in self._emitted_in_batch:
                observer.on_batch(work.request.model if work.request else "", batch)
            if told is None:
                observer.on_outcome(outcome)
        if told is not None:
            told.append(outcome)
        if batch is not None:
            done = self._emitted_in_batch.get(batch.batch_id, 0) + 1
            if done < batch.size:
                self._emitted_in_batch[batch.batch_id] = done
            else:
                self._emitted_in_batch.pop(batch.batch_id, None)

    def _tell(self, outcomes: list[Outcome]) -> None:
        """Tell every observer about ``outcomes`` (``on_outcomes`` where it has one)."""
        if not outcomes:
            return
        for observer in self.observers:
            many = getattr(observer, "on_outcomes", None)
            if many is not None:
                many(outcomes)
            else:
                for outcome in outcomes:
                    observer.on_outcome(outcome)

    async def _emit_alone(self, entry: _Outgoing) -> None:
        """Produce one outcome through ``sink.send`` (the path that replaces a record the
        producer refuses by a small dead letter)."""
        work, topic, key, value, outcome, batch = entry
        try:
            sent = await self._send(work, topic, key, value, outcome)
        except Exception as exc:
            # The producer itself failed (e.g. stopping): the record stays uncommitted and is
            # processed again by whoever reads its partition next. Nothing is dead-lettered.
            self.stats.produce_failures += 1
            log.error("cannot produce to %s for %s (%s: %s); it will be processed again",
                      topic, work.source, type(exc).__name__, exc)
            return
        if sent is None:  # nothing can be produced for it: finished without an outcome record
            self._finish_unwritable(work, work.source.retry)
            return
        ack_future, topic, outcome = sent
        self._sent((work, topic, key, value, outcome, batch))
        self._after_send(ack_future, topic, work, outcome)

    def _on_produced_many(self, entries: list[_Outgoing], fut: Any) -> None:
        """The broker answered for a record batch of outcomes."""
        error = None if fut.cancelled() else fut.exception()
        if error is None:
            if not self._confirmed(fut.result()):
                return  # the records stay uncommitted
            for entry in entries:
                self._ack(entry[0].source)
            return
        if _record_error(error) is not None:
            # Refused for good (e.g. larger than the topic's max.message.bytes): each record
            # again on its own, where a refused one is replaced by a small dead letter.
            for work, topic, key, value, outcome, _ in entries:
                task = asyncio.ensure_future(self._resend_alone(work, topic, key, value, outcome))
                self._replacing.add(task)
                task.add_done_callback(self._replacing.discard)
            return
        self.stats.produce_failures += len(entries)
        first = entries[0][0].source
        log.error(
            "producing %d record(s) to %s for %s[%d]@%d... failed (%s): they stay uncommitted "
            "and are processed again after a restart", len(entries), entries[0][1],
            first.topic, first.partition, first.offset,
            "cancelled" if fut.cancelled() else error,
        )

    async def _resend_alone(
        self, work: _Work, topic: str, key: bytes | None, value: bytes, outcome: Outcome
    ) -> None:
        try:
            sent = await self._send(work, topic, key, value, outcome)
        except Exception as exc:
            self.stats.produce_failures += 1
            log.error("cannot produce to %s for %s (%s: %s); it will be processed again",
                      topic, work.source, type(exc).__name__, exc)
            return
        if sent is None:
            self._finish_unwritable(work, work.source.retry)
            return
        self._after_send(sent[0], sent[1], work, sent[2])

    def _confirmed(self, metadata: Any) -> bool:
        """Whether the broker's answer (a ``RecordMetadata``) may count as acknowledged."""
        if self.ack_guard is None:
            return True
        return self.ack_guard.acknowledged(
            str(getattr(metadata, "topic", "")), int(getattr(metadata, "partition", -1)),
            getattr(metadata, "offset", None),
        )

    def _ack(self, source: SourceMessage) -> None:
        """The broker has the outcome of ``source``: finish it now, or at the next state flush
        when an observer writes device state."""
        if self._hold_acks:
            self._held_acks.append(source.ack)
            if len(self._held_acks) >= self._flush_max_records:
                self._flush_now.set()
            return
        source.ack()
        self.stats.acked += 1

    def max_record_bytes(self) -> int:
        """The largest record this worker produces: ``max_produce_bytes`` (the producer's
        ``max_request_size``; topics' ``max.message.bytes`` should not be smaller)."""
        return int(getattr(self.settings, "max_produce_bytes", 1_000_000))

    def _oversize(self, key: bytes | None, value: bytes) -> BaseException | None:
        """A :class:`MessageSizeTooLargeError` when the record would be larger than
        :meth:`max_record_bytes` — the same upper-bound estimate aiokafka's producer checks
        (``DefaultRecordBatchBuilder.estimate_size_in_bytes``) — else None."""
        size = DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, [])
        limit = self.max_record_bytes()
        if size <= limit:
            return None
        return MessageSizeTooLargeError(
            f"the record would be {size} bytes (key {len(key or b'')} + value {len(value)} + "
            f"overhead), more than max_produce_bytes={limit}"
        )

    async def _send(
        self, work: _Work, topic: str, key: bytes | None, value: bytes, outcome: Outcome
    ) -> tuple[Any, str, Outcome] | None:
        """Hand an outcome record to the producer.

        A record that can never be produced — larger than :meth:`max_record_bytes` (checked
        before producing) or refused by the producer with a record error — is replaced by a
        small ``unproducible_outcome`` dead letter; when even that cannot be produced, returns
        None and the caller finishes the record without an outcome.

        Returns:
            ``(ack future, topic, outcome)`` of what was handed to the producer, or None.

        Raises:
            Exception: The producer failed for another reason (e.g. it is stopping).
        """
        while True:
            problem = self._oversize(key, value)
            if problem is None:
                try:
                    return await self.sink.send(topic, key, value), topic, outcome
                except Exception as exc:
                    problem = _record_error(exc)
                    if problem is None:
                        raise
            if outcome.reason == "unproducible_outcome":
                log.error("cannot produce even the small dead letter of %s (%s: %s)",
                          work.source, type(problem).__name__, problem)
                return None
            topic, key, value, outcome = self._unproducible(work, topic, value, problem, outcome)

    def _finish_unwritable(self, work: _Work, retry: RetryRecord | None) -> None:
        """Finish a record none of whose outcomes can be produced: it must not hold back its
        partition's commits for good. Logged at ERROR with its position and counted
        (``stats.unwritable``)."""
        source = work.source
        self.stats.unwritable += 1
        log.error(
            "no outcome of %s[%d]@%d (request %r) can be produced in any form; the record is "
            "marked finished without one so that its partition's commits go on",
            source.topic, source.partition, source.offset,
            _clip(work.request.request_id, 80) if work.request else None,
        )
        if retry is not None:
            self.retry_store.finish(retry.request_id, source.event)
        source.ack()
        self.stats.acked += 1

    def _after_send(self, ack_future: Any, topic: str, work: _Work, outcome: Outcome) -> None:
        source = work.source

        def on_produced(fut: Any) -> None:
            error = None if fut.cancelled() else fut.exception()
            if error is not None and _record_error(error) is not None:
                # The broker refused this record for good (e.g. larger than the topic's
                # max.message.bytes): answer with a small dead letter instead, or finish it.
                task = asyncio.ensure_future(self._replace_refused(work, topic, outcome, error))
                self._replacing.add(task)
                task.add_done_callback(self._replacing.discard)
                return
            if fut.cancelled() or error is not None:
                self.stats.produce_failures += 1
                log.error(
                    "producing to %s for %s[%d]@%d failed (%s): the record stays uncommitted "
                    "and is processed again after a restart",
                    topic, source.topic, source.partition, source.offset,
                    "cancelled" if fut.cancelled() else error,
                )
                return
            if self._confirmed(fut.result()):
                self._ack(source)

        add_done_callback = getattr(ack_future, "add_done_callback", None)
        if add_done_callback is None:
            raise TypeError(f"sink.send must return a future, got {type(ack_future).__name__}")
        add_done_callback(on_produced)
        self._track(ack_future)

    async def _replace_refused(
        self, work: _Work, topic: str, outcome: Outcome, error: BaseException
    ) -> None:
        """The broker refused an outcome record with a record error: produce the small dead
        letter in its place (acknowledging the source once the broker has it), or finish the
        record without an outcome when that is refused too or was the refused record."""
        retry = work.source.retry
        sent = None
        if outcome.reason != "unproducible_outcome":
            small = self._unproducible(work, topic, b"", error)
            try:
                sent = await self._send(work, *small)
            except Exception as exc:
                self.stats.produce_failures += 1
                log.error("cannot produce the dead letter of %s (%s: %s); it will be processed "
                          "again", work.source, type(exc).__name__, exc)
                return
        if sent is None:
            self._finish_unwritable(work, retry)
            return
        self._after_send(sent[0], sent[1], work, sent[2])

    def _unproducible(
        self, work: _Work, topic: str, value: bytes, error: BaseException,
        unsent: Outcome | None = None,
    ) -> tuple[str, bytes | None, bytes, Outcome]:
        """A small dead letter for an outcome that cannot be produced: reason
        ``unproducible_outcome``, the source position, ids cut to :data:`MAX_ID_CHARS` (those
        of ``unsent``, the outcome that could not be produced, where the request was not
        decoded), the original key cut and value left out (their sizes and sha256 kept in
        ``extra``)."""
        log.error(
            "cannot produce the outcome of %s to %s (%d bytes): %s: %s; sending a small dead "
            "letter instead", work.source, topic, len(value), type(error).__name__,
            _clip(str(error), _SMALL_MESSAGE_CHARS),
        )
        failure = InvalidRequestError(
            "unproducible_outcome",
            f"the {topic} record for this request could not be produced "
            f"({type(error).__name__}: {_clip(str(error), _SMALL_MESSAGE_CHARS)}); the original "
            "value is omitted",
            fields={} if unsent is None else {
                name: getattr(unsent, name) for name in ("request_id", "device_id", "seq", "model")
                if getattr(unsent, name) is not None
            },
        )
        return self._dead_letter(work, failure, small=True)

    def _should_retry(self, work: _Work, error: BaseException) -> bool:
        retriable = getattr(error, "retriable", False)
        return bool(retriable) and work.request is not None

    def _error_entry(self, work: _Work, error: BaseException) -> dict[str, Any]:
        return {
            "attempt": work.attempt,
            "reason": self._reason(work, error)[0],
            "type": _type_name(error),
            "message": str(error),
            "ts": time.time(),
        }

    def _reason(self, work: _Work, error: BaseException) -> tuple[str, str]:
        """``(reason, stage)`` of a failure."""
        if isinstance(error, UndecodableBatchError):
            return error.reason, "consume"
        if isinstance(error, InvalidRequestError):
            stage = "decode" if work.request is None else "validate"
            if error.reason == "duplicate_request_id":
                stage = "batch"
            return error.reason, stage
        if isinstance(error, EngineError):
            return error.reason if error.retriable else "inference_failed", "inference"
        if isinstance(error, StreamAppError):
            return error.reason, "inference"
        log.error(
            "internal error on %s[%d]@%d:\n%s",
            work.source.topic, work.source.partition, work.source.offset,
            "".join(traceback.format_exception(error)),
        )
        return "internal_error", "inference"

    def _outcome(
        self, kind: OutcomeKind, work: _Work, reason: str | None = None,
        result: InferenceResult | None = None, ids: Mapping[str, Any] | None = None,
    ) -> Outcome:
        """``ids``: the request's ids when it was not decoded (see :meth:`_ids`)."""
        top_k = result.outputs.get("top_k") if result is not None else None
        top = top_k[0] if top_k else None
        known: Mapping[str, Any] = ids if ids is not None else self._ids(work, None)
        return Outcome(
            kind=kind,
            device_id=known.get("device_id"),
            request_id=known.get("request_id"),
            seq=known.get("seq"),
            model=known.get("model"),
            reason=reason,
            label=top["label"] if top else None,
            score=top["score"] if top else None,
            e2e_ms=result.e2e_ms if result else None,
            queue_ms=result.queue_ms if result else None,
            infer_ms=result.infer_ms if result else None,
            attempt=work.attempt,
            ts=time.time(),
            partition=work.source.partition,
            event=work.source.event,
            batch_size=result.batch_size if result else None,
            clock_skew_ms=result.clock_skew_ms if result else None,
        )

    def _result(
        self, work: _Work, item: _ItemResult, batch: BatchInfo | None
    ) -> tuple[str, bytes | None, bytes, Outcome]:
        """The result record of an answered request, or of one a queue policy skipped
        (``item.skipped``: no batch, empty outputs)."""
        request, model = work.request, work.model
        assert request is not None and model is not None
        now = time.time()
        e2e_ms, skew_ms = self._e2e_ms(work, request, now)
        skipped = item.skipped
        if skipped is None:
            assert item.outputs is not None and batch is not None
            outputs, started_at = item.outputs, batch.started_at
            batch_id: str | None = f"{self.worker}/{batch.batch_id}"
            self.stats.results += 1
        else:
            outputs, started_at, batch_id = {}, item.decided_at, None
        batch_size = batch.size if batch is not None else 0
        queue_ms = round((started_at - work.source.received_at) * 1000.0, 3)
        infer_ms = round(item.infer_ms, 3)
        # InferenceResult(...).to_dict() written out: the same keys in the same order
        # (tests/streamapp/agents/test_pipeline_results.py holds them to it), without building
        # the dataclass and copying it into a dict for every result
        body: dict[str, Any] = {
            "request_id": request.request_id,
            "device_id": request.device_id,
            "seq": request.seq,
            "model": request.model,
            "engine": model.info.tag,
            "model_version": model.version,
            "outputs": outputs,
            "attempt": work.attempt,
            "queue_ms": queue_ms,
            "infer_ms": infer_ms,
            "e2e_ms": e2e_ms,
            "batch_id": batch_id,
            "batch_size": batch_size,
            "worker": self.worker,
            "ts": now,
            "clock_skew_ms": skew_ms,
            "outcome": skipped or "answered",
        }
        if work.policy is not None:
            body.update(work.policy)
        value = encode_result(body, self.settings.result_codec)
        top_k = outputs.get("top_k")
        top = top_k[0] if top_k else None
        source = work.source
        outcome = Outcome(
            kind=skipped or "result",
            device_id=request.device_id,
            request_id=request.request_id,
            seq=request.seq,
            model=request.model,
            reason=None,
            label=top["label"] if top else None,
            score=top["score"] if top else None,
            e2e_ms=e2e_ms,
            queue_ms=queue_ms,
            infer_ms=infer_ms,
            attempt=work.attempt,
            ts=time.time(),
            partition=source.partition,
            event=source.event,
            batch_size=batch_size,
            clock_skew_ms=skew_ms,
        )
        return self.settings.result_topic, request.device_id.encode(), value, outcome

    def _e2e_ms(
        self, work: _Work, request: InferenceRequest, now: float
    ) -> tuple[float, float | None]:
        """End-to-end latency of a result and the device clock's skew (docs/faults.md).

        The device's ``ts`` is trusted when it lies within ``max_clock_skew_s`` of the time the
        request reached Kafka: the request record's timestamp (set by the producer or the
        broker), or, for a record without one, when this worker read it; for a retry, when its
        first attempt failed. Otherwise the latency runs from that time, and the skew is
        reported.

        Returns:
            ``(e2e_ms, clock_skew_ms)``: milliseconds, ``e2e_ms >= 0``; ``clock_skew_ms`` is
            ``ts`` minus the reference time (positive: device clock ahead), or None when ``ts``
            was trusted.
        """
        arrived = self._arrived(work.source, now)
        skew = request.ts - arrived
        bound = float(getattr(self.settings, "max_clock_skew_s", 300.0))
        if abs(skew) <= bound:
            return round(max(now - request.ts, 0.0) * 1000.0, 3), None
        return round(max(now - arrived, 0.0) * 1000.0, 3), round(skew * 1000.0, 3)

    def _retry(
        self, work: _Work, error: BaseException
    ) -> tuple[str, bytes | None, bytes, Outcome]:
        request = work.request
        assert request is not None
        previous = work.source.retry
        errors = [*(previous.errors if previous else []), self._error_entry(work, error)]
        attempt = work.attempt + 1
        if attempt > self.settings.max_retries:
            return self._dead_letter(work, error, errors=errors, reason="retries_exhausted")
        record = RetryRecord(
            request_id=request.request_id,
            device_id=request.device_id,
            model=request.model,
            attempt=attempt,
            not_before=time.time() + backoff_s(
                attempt,
                base_ms=self.settings.retry_backoff_base_ms,
                max_ms=self.settings.retry_backoff_max_ms,
                jitter=self.settings.retry_jitter,
            ),
            errors=errors,
            first_failed_ts=previous.first_failed_ts if previous else errors[0]["ts"],
            source=previous.source if previous else self._source(work.source),
            key=previous.key if previous else work.source.key,
            value=previous.value if previous else (work.source.value or b""),
        )
        reason = errors[-1]["reason"]
        self.stats.retries += 1
        log.info(
            "retrying %s (attempt %d of %d) after %s",
            request.request_id, attempt, self.settings.max_retries, reason,
        )
        return (
            self.settings.retry_topic, request.request_id.encode(), record.encode(),
            self._outcome("retry", work, reason=reason),
        )

    @staticmethod
    def _source(source: SourceMessage) -> dict[str, Any]:
        return {"topic": source.topic, "partition": source.partition, "offset": source.offset}

    def _dead_letter(
        self, work: _Work, error: BaseException, errors: list[dict[str, Any]] | None = None,
        reason: str | None = None, small: bool = False,
    ) -> tuple[str, bytes | None, bytes, Outcome]:
        """The dead letter of a request, with every id that could be read (from the decoded
        request, else from what the rejected value held: ``InvalidRequestError.fields``).

        ``small``: the form for ``unproducible_outcome`` — value left out, key and ids cut,
        error messages clipped — so that it can be produced whatever the request held.
        """
        own_reason, stage = self._reason(work, error)
        reason = reason or own_reason
        previous = work.source.retry
        if errors is None:
            errors = [*(previous.errors if previous else []), self._error_entry(work, error)]
        self.stats.dead_letters[reason] = self.stats.dead_letters.get(reason, 0) + 1
        now = time.time()
        source = work.source
        if self._letter_log.allow(reason, log, "dead letters"):
            log.warning(
                "dead letter %s from %s[%d]@%d: %s",
                reason, source.topic, source.partition, source.offset,
                _clip(str(error), _SMALL_MESSAGE_CHARS),
            )
        ids = self._ids(work, error)
        original = previous.value if previous else (source.value or b"")
        key = previous.key if previous else source.key
        extra: dict[str, Any] = {}
        if isinstance(error, UndecodableBatchError):
            # The batch's bytes go into the letter of its first undecoded offset, so that an
            # operator can recover the records (docs/faults.md).
            extra["record_batch"] = error.batch.describe()
            original = error.batch_value() or b""
        if small or len(original) > self.settings.max_dead_letter_value_bytes:
            # base64 grows it by 4/3: a large original would not fit in one Kafka record
            extra["value_omitted"] = {
                "bytes": len(original), "sha256": hashlib.sha256(original).hexdigest(),
            }
            original = b""
        if "record_batch" in extra:
            extra["record_batch"]["bytes_in_value"] = bool(original)
        message, attempts = str(error), len(errors)
        if small:
            stage = "produce"
            if key is not None and len(key) > MAX_ID_CHARS:
                extra["key_omitted"] = {
                    "bytes": len(key), "sha256": hashlib.sha256(key).hexdigest(),
                }
                key = key[:MAX_ID_CHARS]
            cut = {name: len(v) for name, v in ids.items()
                   if isinstance(v, str) and len(v) > MAX_ID_CHARS}
            if cut:
                extra["ids_truncated"] = cut  # the original lengths, in characters
                ids = {n: v[:MAX_ID_CHARS] if isinstance(v, str) else v for n, v in ids.items()}
            message = _clip(message, _SMALL_MESSAGE_CHARS)
            errors = [{**e, "message": _clip(str(e.get("message", "")), _SMALL_MESSAGE_CHARS)}
                      for e in errors[-10:]]
        letter = DeadLetter(
            value=original,
            key=key,
            error={"reason": reason, "type": _type_name(error), "message": message,
                   "stage": stage},
            attempts=attempts,
            first_failed_ts=previous.first_failed_ts if previous else now,
            last_failed_ts=now,
            source=previous.source if previous else self._source(source),
            request_id=ids.get("request_id"),
            device_id=ids.get("device_id"),
            worker=self.worker,
            errors=errors,
            extra=extra,
        )
        return (
            self.settings.dlq_topic, letter.key, encode_dead_letter(letter),
            self._outcome("dead_letter", work, reason=reason, ids=ids),
        )

    @staticmethod
    def _ids(work: _Work, error: BaseException | None) -> dict[str, Any]:
        """``request_id``, ``device_id``, ``seq``, ``model`` of the decoded request, else
        whichever of them the rejected value held with the right type (``error.fields``)."""
        request = work.request
        if request is not None:
            return {"request_id": request.request_id, "device_id": request.device_id,
                    "seq": request.seq, "model": request.model}
        fields = getattr(error, "fields", None) or {}
        return {k: fields[k] for k in ("request_id", "device_id", "seq", "model") if k in fields}
