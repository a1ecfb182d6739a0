"""Request/reply over the result and dead-letter topics: one consumer, shared by every request a
client awaits, hands each result or dead letter to the request it answers.

A result is matched by its ``request_id``. A dead letter is matched by its ``request_id`` too,
or, when the worker could not read one (a value too large to parse, for example), by its
``source`` — the topic, partition and offset the request was published at, which the producer's
acknowledgement gives. The consumer has no group and commits nothing; it starts at the end of
each partition as of :meth:`ReplyWaiter.start`, which is before any awaited request is
published, so no answer is missed (an end offset from ListOffsets can only be short of the real
end on the embedded broker, never past it — docs/broker.md — and records from before are
skipped by their ids).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from streamapp.codecs import decode_dead_letter, decode_result
from streamapp.exceptions import BrokerError, InternalError, SecurityError
from streamapp.kafka import describe_error, partitions_of, start_or_close
from streamapp.records import DeadLetter

log = logging.getLogger(__name__)

__all__ = ["Reply", "ReplyWaiter"]

#: Dead letters without a readable request id kept for a request whose acknowledgement (and so
#: offset) has not reached the client yet: a worker may answer before the ack is processed.
_MAX_UNCLAIMED = 1024
_Source = tuple[str, int, int]


@dataclass(frozen=True, slots=True)
class Reply:
    """The answer to one request: its result, or its dead letter.

    Attributes:
        request_id: The request's id.
        result: The result record as the worker wrote it (docs/records.md: ``outputs``,
            ``engine``, ``e2e_ms`` ...), or None when the request was dead-lettered.
        dead_letter: The dead letter (``error["reason"]`` is a reason code of docs/records.md),
            or None when there is a result.
        round_trip_ms: Milliseconds from handing the request to the producer to reading the
            answer.
    """

    request_id: str
    result: dict[str, Any] | None
    dead_letter: DeadLetter | None
    round_trip_ms: float

    @property
    def ok(self) -> bool:
        """True when the request has a result."""
        return self.result is not None

    @property
    def reason(self) -> str | None:
        """The dead letter's reason code (``"bad_shape"``, ...), or None for a result."""
        return None if self.dead_letter is None else self.dead_letter.error.get("reason")

    @property
    def top_k(self) -> list[dict[str, Any]]:
        """``[{label, score}, ...]``, best first (empty for a dead letter or a model that
        answers with named tensors)."""
        outputs = (self.result or {}).get("outputs") or {}
        top = outputs.get("top_k") if isinstance(outputs, dict) else None
        return list(top) if isinstance(top, list) else []

    @property
    def label(self) -> str | None:
        """The best label, or None (see :attr:`top_k`)."""
        return str(self.top_k[0]["label"]) if self.top_k else None

    @property
    def score(self) -> float | None:
        """The best label's score, 0..1, or None (see :attr:`top_k`)."""
        return float(self.top_k[0]["score"]) if self.top_k else None


@dataclass
class _Pending:
    future: asyncio.Future[Reply]
    sent_at: float  # time.monotonic()


class ReplyWaiter:
    """Reads the result and dead-letter topics and resolves the futures of awaited requests.

    Call :meth:`start` before publishing the first awaited request, :meth:`expect` before
    publishing each one, :meth:`published` once its offset is known, and :meth:`stop` at the end.

    Args:
        bootstrap_servers: ``host:port[,host:port]``.
        result_topic / dlq_topic: The worker's topics (``settings.result_topic`` ...).
        security: aiokafka security options (:func:`streamapp.kafka.kafka_security_options`).

    Attributes:
        skipped: Records of the two topics that could not be decoded (left out, counted).
    """

    def __init__(
        self, bootstrap_servers: str, result_topic: str, dlq_topic: str, *,
        security: Mapping[str, Any] | None = None,
    ) -> None:
        self.result_topic, self.dlq_topic = result_topic, dlq_topic
        self.skipped = 0
        #: the SASL user, if any: a topic it may not describe looks absent
        self._user = str((security or {}).get("sasl_plain_username") or "")
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap_servers, group_id=None, enable_auto_commit=False,
            # the embedded broker holds an empty fetch for the whole wait: keep it short, it
            # is added to every answer's latency
            fetch_max_wait_ms=20,
            # with processing_guarantee=exactly_once, never an outcome of an aborted transaction
            isolation_level="read_committed", **(security or {}),
        )
        self._pending: dict[str, _Pending] = {}
        self._by_source: dict[_Source, str] = {}
        self._source_of: dict[str, _Source] = {}
        self._unclaimed: OrderedDict[_Source, DeadLetter] = OrderedDict()
        self._task: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None

    async def start(self) -> None:
        """Start the consumer at the current end of both topics.

        Raises:
            BrokerError: A topic does not exist (no worker created it yet), or the broker did
                not answer.
            SecurityError: The same with a SASL user: the topic may exist but the user may
                not describe it (an ACL is missing).
        """
        try:
            await start_or_close(self._consumer)
        except KafkaError as exc:
            raise BrokerError(f"cannot read the answers: {describe_error(exc)}") from exc
        try:
            partitions = []
            for topic in (self.result_topic, self.dlq_topic):
                try:
                    numbers = await partitions_of(self._consumer, topic)
                except RuntimeError:
                    user = self._user
                    raise (SecurityError if user else BrokerError)(
                        f"topic {topic!r} does not exist: start a worker (streamapp worker), "
                        "which creates it, or check the broker and the topic prefix "
                        "(STREAMAPP_TOPIC_PREFIX)" + (
                            f"; or the broker denied user {user!r} access to it (a topic the "
                            "user may not describe looks absent): replies need Read and "
                            "Describe on the result and DLQ topics (docs/deployment.md)"
                            if user else "")
                    ) from None
                partitions += [TopicPartition(topic, p) for p in sorted(numbers)]
            self._consumer.assign(partitions)
            ends = await self._consumer.end_offsets(partitions)
            for tp in partitions:
                self._consumer.seek(tp, ends[tp])
        except BaseException:
            await self._consumer.stop()
            raise
        self._task = asyncio.create_task(self._run(), name="streamapp-replies")

    def expect(self, request_id: str) -> asyncio.Future[Reply]:
        """Register a request about to be published; its future gets the :class:`Reply`.

        Raises:
            ValueError: A request with this id is awaited already.
            BrokerError: The reader stopped (the broker failed); the message says why.
        """
        if self._failure is not None:
            raise BrokerError(f"the answers can no longer be read: {self._failure}")
        if request_id in self._pending:
            raise ValueError(f"request_id {request_id!r} is awaited already; give each request "
                             "its own id")
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = _Pending(future, time.monotonic())
        return future

    def published(self, request_id: str, topic: str, partition: int, offset: int) -> None:
        """Record where an awaited request was stored (for dead letters without an id)."""
        if request_id not in self._pending:
            return
        source = (topic, partition, offset)
        letter = self._unclaimed.pop(source, None)
        if letter is not None:
            self._resolve(request_id, None, letter)
        else:
            self._by_source[source] = request_id
            self._source_of[request_id] = source

    def _drop_source(self, request_id: str) -> None:
        source = self._source_of.pop(request_id, None)
        if source is not None:
            self._by_source.pop(source, None)

    def forget(self, request_id: str) -> None:
        """Stop waiting for a request (after a timeout or a failed publish)."""
        pending = self._pending.pop(request_id, None)
        if pending is not None and not pending.future.done():
            pending.future.cancel()
        self._drop_source(request_id)

    async def stop(self) -> None:
        """Stop reading; requests still awaited get a BrokerError."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._fail_all(BrokerError("the client was closed before the answer arrived"))
        await self._consumer.stop()

    # -- the reading task ------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            while True:
                batches = await self._consumer.getmany(timeout_ms=200)
                for tp, records in batches.items():
                    for record in records:
                        if tp.topic == self.result_topic:
                            self._on_result(record.value)
                        else:
                            self._on_dead_letter(record.value)
        except KafkaError as exc:
            self._failure = exc
            self._fail_all(BrokerError(f"reading the answers failed: {describe_error(exc)}"))
        except Exception as exc:  # a bug here must not leave every caller waiting to time out
            log.exception("reading the answers failed")
            self._failure = exc
            self._fail_all(InternalError(f"reading the answers failed: {exc!r}"))

    def _on_result(self, value: bytes | None) -> None:
        try:
            body = decode_result(value or b"")
            request_id = body.get("request_id") if isinstance(body, dict) else None
        except Exception:  # msgpack and json raise several types; not a result of ours
            self.skipped += 1
            return
        if isinstance(request_id, str) and request_id in self._pending:
            self._resolve(request_id, body, None)

    def _on_dead_letter(self, value: bytes | None) -> None:
        try:
            letter = decode_dead_letter(value or b"")
        except Exception:  # not a dead letter of ours (json, base64, a field missing)
            self.skipped += 1
            return
        if letter.request_id in self._pending:
            self._resolve(letter.request_id, None, letter)
            return
        src = letter.source or {}
        try:
            source = (str(src["topic"]), int(src["partition"]), int(src["offset"]))
        except (KeyError, TypeError, ValueError):
            return
        request_id = self._by_source.get(source)
        if request_id is not None:
            self._resolve(request_id, None, letter)
        elif letter.request_id is None and self._pending:
            self._unclaimed[source] = letter
            while len(self._unclaimed) > _MAX_UNCLAIMED:
                self._unclaimed.popitem(last=False)

    def _resolve(self, request_id: str, result: dict[str, Any] | None,
                 letter: DeadLetter | None) -> None:
        pending = self._pending.pop(request_id)
        self._drop_source(request_id)
        if not pending.future.done():
            elapsed_ms = (time.monotonic() - pending.sent_at) * 1000.0
            pending.future.set_result(Reply(request_id, result, letter, elapsed_ms))

    def _fail_all(self, error: BaseException) -> None:
        for pending in self._pending.values():
            if not pending.future.done():
                pending.future.set_exception(error)
        self._pending.clear()
        self._by_source.clear()
        self._source_of.clear()
