"""Exactly-once processing (``processing_guarantee="exactly_once"``, Apache Kafka only).

One Kafka transaction per commit interval, not per record: the outcomes of every batch emitted
in the interval (results, dead letters, retry records), the table changelog records written by
the state flush, and the source offsets of the records those outcomes answer are committed
together, or not at all. Consumers reading with ``isolation_level=read_committed`` then see
each request's outcome exactly once, whatever crashes, restarts and rebalances happen.

**Why our own transaction and not Faust's** (``faust.App(processing_guarantee="exactly_once")``):
Faust 0.15.3 implements EOS v1 (KIP-98): one transactional producer *per source partition*
(transactional id ``{app}-{group}-{tp}``), and every record it produces is routed to the
producer of the partition of the event it came from. Our batches mix partitions (a batch of 32
holds records of every partition), so one batch would need as many producers, transactions and
commits as partitions; and Faust commits offsets from its own ack bookkeeping, which we turned
off because it commits offsets of records nobody processed (:mod:`streamapp.offsets`). Instead
the one aiokafka producer Faust already runs — the producer our batch sink writes through and
Faust's tables write their changelogs through — is made transactional (EOS v2, KIP-447): a
transactional id per worker *instance* (stable across restarts in place, so a restarted worker
fences its previous incarnation and aborts its open transaction), and the source offsets are
added with the consumer group's generation, member id and group instance id (TxnOffsetCommit
v3), so a worker that lost its partitions in a rebalance cannot commit for them any more
(``ILLEGAL_GENERATION`` / ``FENCED_INSTANCE_ID``). aiokafka 0.14 sends TxnOffsetCommit v0 only
(no group metadata): :class:`GroupTxnOffsetCommitHandler` adds v3.

**One commit** (:meth:`TransactionCommitter.commit`): with new outcomes held back (the sink's
lock), wait until the broker acknowledged every outcome produced so far, flush the device state
(changelog records; it also applies the held acks, so every record whose outcome is in this
transaction is finished), flush Faust's producer buffer, close the send gate (a changelog write
from the retry agent waits), add the finished prefix of every source partition, commit, begin
the next transaction, open the gate. Outcomes are emitted in read order per partition, so the
records whose outcomes are in a transaction form a prefix of each partition, and that prefix is
what the transaction commits.

**Failures.** A commit that fails, or a producer that was fenced, stops the worker (the
transaction is aborted; a restarted worker reads again from the committed offsets and restores
its tables from the committed changelog): the tables' local state already holds the aborted
transaction's writes, and a worker cannot take them back.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka.errors import IllegalGenerationError, UnknownMemberIdError
from aiokafka.producer import sender as aiokafka_sender
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import (
    CompactArray,
    CompactString,
    Int16,
    Int32,
    Int64,
    Schema,
    TaggedFields,
)
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from streamapp.exceptions import BrokerError, ConfigError
from streamapp.offsets import TP
from streamapp.settings import TRANSACTION_TIMEOUT_MS, Settings

__all__ = [
    "TRANSACTION_TIMEOUT_MS",
    "GroupMetadata",
    "LockedSink",
    "SendGate",
    "TransactionCommitter",
    "TransactionStats",
    "check_guarantee",
    "transactional_id",
    "use_group_metadata",
]

log = logging.getLogger(__name__)

# TRANSACTION_TIMEOUT_MS (defined in streamapp.settings, which bounds commit_interval_ms by
# it): how long the broker keeps the open transaction of a worker that died before it aborts it.


def check_guarantee(settings: Settings) -> None:
    """Refuse ``processing_guarantee="exactly_once"`` where it cannot hold.

    Raises:
        ConfigError: exactly_once on the embedded broker (``broker_kind`` ``"embedded"``,
            decided: call after :func:`streamapp.kafka.resolve_broker_kind`), which has no
            transactions.
    """
    if settings.processing_guarantee == "exactly_once" and settings.broker_kind == "embedded":
        raise ConfigError(
            "processing_guarantee=exactly_once needs Apache Kafka: the embedded broker (Tansu) "
            "has no transactions; use --broker with an Apache Kafka (`streamapp broker "
            "--kafka`) or processing_guarantee=at_least_once"
        )


def transactional_id(settings: Settings) -> str:
    """The transactional id of this worker instance: ``<app_id>-eos-<instance>``.

    The instance is the group instance id, else the worker name, else this host's name and a
    hash of the data directory (one worker per data dir: :mod:`streamapp.datadir`), so that a
    worker restarted in place gets the same id and fences the one before it.
    """
    instance = settings.group_instance_id or settings.worker_name
    if not instance:
        where = os.path.realpath(settings.data_dir)
        instance = f"{socket.gethostname()}-{hashlib.sha256(where.encode()).hexdigest()[:12]}"
    return f"{settings.app_id}-eos-{instance}"


# -- TxnOffsetCommit v3 (KIP-447: the consumer group's metadata fences zombies) ------------------

class TxnOffsetCommitResponse_v3(Response):
    API_KEY = 28
    API_VERSION = 3
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        ("errors", CompactArray(
            ("topic", CompactString("utf-8")),
            ("partition_errors", CompactArray(
                ("partition", Int32), ("error_code", Int16), ("tags", TaggedFields),
            )),
            ("tags", TaggedFields),
        )),
        ("tags", TaggedFields),
    )


class TxnOffsetCommitRequest_v3(RequestStruct):
    FLEXIBLE_VERSION = True
    API_KEY = 28
    API_VERSION = 3
    RESPONSE_TYPE = TxnOffsetCommitResponse_v3
    SCHEMA = Schema(
        ("transactional_id", CompactString("utf-8")),
        ("group_id", CompactString("utf-8")),
        ("producer_id", Int64),
        ("producer_epoch", Int16),
        ("generation_id", Int32),
        ("member_id", CompactString("utf-8")),
        ("group_instance_id", CompactString("utf-8")),
        ("topics", CompactArray(
            ("topic", CompactString("utf-8")),
            ("partitions", CompactArray(
                ("partition", Int32),
                ("offset", Int64),
                ("leader_epoch", Int32),
                ("metadata", CompactString("utf-8")),
                ("tags", TaggedFields),
            )),
            ("tags", TaggedFields),
        )),
        ("tags", TaggedFields),
    )


@dataclass(frozen=True)
class GroupMetadata:
    """The consumer's group membership, as KIP-447 adds it to a transaction's offsets.

    Attributes:
        generation_id: The group generation of the current assignment (-1: unknown).
        member_id: The member id the coordinator gave this consumer.
        group_instance_id: The static member id, or None.
    """

    generation_id: int
    member_id: str
    group_instance_id: str | None


class GroupTxnOffsetCommit(Request[TxnOffsetCommitRequest_v3]):
    API_KEY = 28

    def __init__(self, txn: Any, group_id: str, group: GroupMetadata,
                 topics: list[tuple[str, list[tuple[int, int, int, str, dict[int, bytes]]]]]
                 ) -> None:
        self._args = (txn.transactional_id, group_id, txn.producer_id, txn.producer_epoch,
                      group.generation_id, group.member_id, group.group_instance_id)
        self._topics = topics

    def build(self, request_struct_class: type[TxnOffsetCommitRequest_v3]
              ) -> TxnOffsetCommitRequest_v3:
        return request_struct_class(*self._args, [(t, p, {}) for t, p in self._topics], {})


class GroupTxnOffsetCommitHandler(aiokafka_sender.TxnOffsetCommitHandler):  # type: ignore[misc]
    """aiokafka's TxnOffsetCommit handler sending v3, with the group metadata of
    :attr:`metadata` (read when the request is built). The response's errors are handled as
    aiokafka does; ``ILLEGAL_GENERATION``, ``UNKNOWN_MEMBER_ID`` and ``FENCED_INSTANCE_ID``
    raise (the transaction fails: this worker is no longer the partitions' owner)."""

    metadata: Callable[[], GroupMetadata] | None = None

    def create_request(self) -> Any:
        if self.metadata is None:
            return super().create_request()
        topics: dict[str, list[tuple[int, int, int, str, dict[int, bytes]]]] = {}
        for tp, offset in sorted(self._offsets.items()):
            topics.setdefault(tp.topic, []).append(
                (tp.partition, offset.offset, -1, offset.metadata, {}))
        return GroupTxnOffsetCommit(
            self._sender._txn_manager, self._group_id, self.metadata(), list(topics.items()))

    def handle_response(self, resp: Any) -> Any:
        if getattr(resp, "API_VERSION", 0) >= 3:
            resp = _Errors([(t, [(p, e) for p, e, _ in parts]) for t, parts, _ in resp.errors])
        return super().handle_response(resp)


@dataclass
class _Errors:
    errors: list[tuple[str, list[tuple[int, int]]]]


def use_group_metadata(sender: Any, metadata: Callable[[], GroupMetadata]) -> None:
    """Make ``sender`` (an aiokafka producer's ``_sender``) add offsets to transactions with
    TxnOffsetCommit v3 and the group metadata ``metadata()`` returns (KIP-447)."""
    handler = type("BoundTxnOffsetCommitHandler", (GroupTxnOffsetCommitHandler,),
                   {"metadata": staticmethod(metadata)})

    async def do_txn_offset_commit(offsets: Any, group_id: str) -> None:
        if not offsets:
            return
        node_id = await sender._find_coordinator(aiokafka_sender.CoordinationType.GROUP,
                                                 group_id)
        await handler(sender, offsets, group_id).do(node_id)

    sender._do_txn_offset_commit = do_txn_offset_commit


# -- the send gate and the commit ------------------------------------------------------------------

class SendGate:
    """Holds sends while a transaction commits: aiokafka refuses a send outside a transaction
    (between the commit and the next begin), and a record sent while the commit runs must go
    to the next transaction, not fail."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._sending = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def wrap(self, send: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        """``send`` (an aiokafka producer's ``send`` or ``send_batch``) waiting for the gate."""

        async def gated(*args: Any, **kwargs: Any) -> Any:
            while not self._open.is_set():
                await self._open.wait()
            self._sending += 1
            self._idle.clear()
            try:
                return await send(*args, **kwargs)
            finally:
                self._sending -= 1
                if not self._sending:
                    self._idle.set()

        return gated

    async def close(self) -> None:
        """Stop new sends and wait until those under way were handed to the producer."""
        self._open.clear()
        await self._idle.wait()

    def open(self) -> None:
        self._open.set()


@dataclass
class TransactionStats:
    """Counters since start (``/metrics``).

    Attributes:
        commits: Transactions committed with offsets or records in them.
        empty: Intervals with nothing to commit (no transaction work).
        failures: Commits that failed (the worker stops after one).
        commit_seconds: Seconds spent in commits, in total.
    """

    commits: int = 0
    empty: int = 0
    failures: int = 0
    commit_seconds: float = 0.0


class TransactionCommitter:
    """Commits one interval's outcomes, changelog writes and source offsets in one transaction.

    Args:
        producer: The transactional aiokafka producer, once started (:meth:`on_started`: its
            producer id initialised, which fenced any previous instance of this transactional
            id, and its first transaction begun); None before.
        gate: The gate every send of ``producer`` waits at (:meth:`SendGate.wrap`).
        group_id: The consumer group whose offsets are committed.
        outputs_lock: Held by the sink while it hands outcomes to the producer.
        settle: Waits until every outcome produced so far is acknowledged and flushes the
            device state (which applies the held acks): the pipeline's ``wait_acknowledged``
            then ``flush_state``. None until the pipeline runs.
        flush_buffer: Hands Faust's buffered changelog records to the producer.
        crash: Stops the worker (a failed commit).
    """

    def __init__(
        self, producer: Any, gate: SendGate, *, group_id: str, outputs_lock: asyncio.Lock,
        flush_buffer: Callable[[], Awaitable[None]],
        crash: Callable[[BaseException], Awaitable[None]],
    ) -> None:
        self.producer = producer
        self.gate = gate
        self.group_id = group_id
        self.outputs_lock = outputs_lock
        self.settle: Callable[[], Awaitable[None]] | None = None
        self.flush_buffer = flush_buffer
        self.crash = crash
        self.stats = TransactionStats()
        self._lock = asyncio.Lock()
        self.failed: BaseException | None = None
        #: Set once the producer started and its first transaction began.
        self.started = asyncio.Event()

    def on_started(self, producer: Any) -> None:
        """The transactional producer started and began its first transaction."""
        self.producer = producer
        self.started.set()

    async def commit(self, committable: Callable[[], Mapping[TP, int]]) -> Mapping[TP, int]:
        """Commit the open transaction with the offsets ``committable()`` gives once the
        interval's outcomes settled, and begin the next one.

        Returns:
            The offsets committed (``{(topic, partition): next offset}``; empty when the
            transaction failed).

        Raises:
            Nothing: a failure is logged and stops the worker (:attr:`failed` is set).
        """
        if self.failed is not None or self.producer is None:
            return {}
        async with self._lock, self.outputs_lock:
            started = time.perf_counter()
            try:
                if self.settle is not None:
                    await self.settle()
                await self.flush_buffer()
                await self.gate.close()
                try:
                    offsets = dict(committable())
                    txn = self.producer._txn_manager
                    if not offsets and txn.is_empty_transaction():
                        self.stats.empty += 1
                        return {}
                    if offsets:
                        await self.producer.send_offsets_to_transaction(
                            {TopicPartition(t, p): OffsetAndMetadata(o, "")
                             for (t, p), o in offsets.items()}, self.group_id)
                    await self.producer.commit_transaction()
                    await self.producer.begin_transaction()
                finally:
                    self.gate.open()
            except Exception as exc:
                self.stats.failures += 1
                self.failed = exc
                await self._fail(exc)
                return {}
            self.stats.commits += 1
            self.stats.commit_seconds += time.perf_counter() - started
            return offsets

    async def _fail(self, exc: BaseException) -> None:
        fenced = isinstance(exc, IllegalGenerationError | UnknownMemberIdError) or \
            type(exc).__name__ in ("ProducerFenced", "FencedInstanceIdError")
        why = ("another worker took this worker's partitions or transactional id (fenced)"
               if fenced else "the transaction could not be committed")
        log.critical(
            "exactly_once: %s (%s: %s); aborting it and stopping the worker: a restart reads "
            "again from the committed offsets and restores the tables from the committed "
            "changelogs", why, type(exc).__name__, exc,
        )
        try:
            if not fenced:
                await self.producer.abort_transaction()
        except Exception as abort_error:
            log.warning("aborting the transaction failed too (%s); the broker aborts it "
                        "when its transaction.timeout.ms passes", abort_error)
        await self.crash(BrokerError(f"exactly_once: {why}: {type(exc).__name__}: {exc}"))


class LockedSink:
    """A :class:`~streamapp.agents.pipeline.BatchSink` whose records are handed to the
    producer under ``lock`` (held by :meth:`TransactionCommitter.commit` from the settling of
    an interval's outcomes to the next transaction's begin), so that no outcome joins a
    transaction after its records' offsets were chosen.

    Args:
        sink: The sink that produces (:class:`streamapp.faust_compat.FaustSink`).
        lock: The committer's ``outputs_lock``.
    """

    def __init__(self, sink: Any, lock: asyncio.Lock) -> None:
        self.sink = sink
        self.lock = lock

    async def send(self, topic: str, key: bytes | None, value: bytes) -> Awaitable[Any]:
        async with self.lock:
            sent: Awaitable[Any] = await self.sink.send(topic, key, value)
            return sent

    async def send_many(
        self, records: Sequence[tuple[str, bytes | None, bytes]]
    ) -> list[Awaitable[Any] | BaseException]:
        async with self.lock:
            sent: list[Awaitable[Any] | BaseException] = await self.sink.send_many(records)
            return sent
