"""Delivery: which source record is processed, when it counts as finished, what is committed.

One module for the worker's delivery guarantee (at least once, no record skipped, per-partition
read order), talking to the Kafka consumer only through the small :class:`Consumer` protocol
(implemented for Faust once, by :class:`streamapp.faust_compat.FaustConsumer`):

* **admission** — every record the agent reads goes through :meth:`Delivery.admit`: records of
  partitions no longer assigned are dropped, the :class:`~streamapp.offsets.OffsetTracker`
  decides accept / drop (already read) / gap (records skipped by the consumer), one partition at
  a time (a lock per partition);
* **gap filling** — records the consumer skipped are read directly from the broker and handed
  out first; :meth:`Delivery.sweep_gaps` finds those skipped at the *end* of a partition, where no
  later record reveals the gap;
* **acknowledgement** — each :class:`~streamapp.agents.pipeline.SourceMessage` handed out carries
  its ``ack``, which marks the record finished once its outcome is on the broker;
* **commits** — every ``commit_interval_ms`` (and on revocation and shutdown) the finished prefix
  of each partition is committed.

Why streamapp commits itself instead of letting Faust do it: see :mod:`streamapp.offsets`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from streamapp.agents.pipeline import SourceMessage
from streamapp.faust_compat import StandInEvent
from streamapp.offsets import TP, OffsetTracker, PartitionState
from streamapp.tasks import cancel_and_wait

__all__ = [
    "GAP_IDLE_S", "STABLE_OFFSET_TRIES", "STABLE_OFFSET_WAIT_S", "Consumer", "Delivery",
    "DeliveryStats", "Record", "Transactions",
]

log = logging.getLogger(__name__)

#: Seconds without any record read after which the consumer's position is compared with what was
#: read, to find records skipped at the end of a partition.
GAP_IDLE_S = 2.0
#: With exactly_once, how often a gap at the start of an assignment re-reads the committed
#: offset, and how long it waits between reads (s): the previous owner's transaction markers
#: are normally written within milliseconds of its commit (Delivery._skip_committed_meanwhile).
STABLE_OFFSET_TRIES = 5
STABLE_OFFSET_WAIT_S = 0.1

#: ``(offset, key, value)`` of a record read directly from a partition.
Record = tuple[int, bytes | None, bytes | None]


class Transactions(Protocol):
    """Commits source offsets in the transaction of their outcomes
    (:class:`streamapp.transactions.TransactionCommitter`)."""

    async def commit(self, committable: Callable[[], Mapping[TP, int]]) -> Mapping[TP, int]:
        """Commit the open transaction with the offsets ``committable()`` gives once every
        outcome so far settled; returns those committed (empty: none, or it failed)."""
        ...


class Consumer(Protocol):
    """What delivery needs from the group's consumer (Faust's, in a worker)."""

    async def committed_or_earliest(self, topic: str, partition: int) -> int:
        """The group's committed offset of the partition, else its log start."""
        ...

    async def commit(self, offsets: Mapping[TP, int]) -> bool:
        """Commit ``{(topic, partition): next offset}`` for the group; True when accepted."""
        ...

    def settled(self, topic: str) -> bool:
        """Whether the consumer surely holds no record of ``topic`` that it fetched and has not
        handed to the agent yet (False while it may: then its position runs ahead of what the
        agent was handed without any record being skipped)."""
        ...

    async def position(self, topic: str, partition: int) -> int | None:
        """The consumer's fetch position of the partition (None: unknown)."""
        ...

    async def read_range(self, topic: str, partition: int, start: int, end: int) -> list[Record]:
        """Records ``start <= offset < end`` read directly from the broker, in offset order
        (fewer when some no longer exist)."""
        ...


@dataclass
class DeliveryStats:
    """Counters since start (exported in ``/metrics``).

    Attributes:
        commits: Commits the broker accepted.
        commit_failures: Commits that raised (retried at the next interval).
        gap_reads: Times records the consumer skipped were read directly from the broker
            (at admission, or by the idle sweep).
        gap_records: Records those reads handed out.
        sweep_skips: Sweeps that did not look because the consumer may still have held fetched
            records in its buffers, or the pipeline applied backpressure.
        committed_meanwhile: Gaps at the start of an assignment that the group's committed
            offset, read again, covered (the previous owner committed after the first read).
    """

    commits: int = 0
    commit_failures: int = 0
    gap_reads: int = 0
    gap_records: int = 0
    sweep_skips: int = 0
    committed_meanwhile: int = 0


class Delivery:
    """Admission, gap filling, acknowledgement and commits of one worker's source partitions.

    Args:
        consumer: The group's consumer.
        commit_interval_s: Seconds between periodic commits.
        gap_idle_s: Seconds without any admitted record before :meth:`sweep_gaps` compares
            positions (default :data:`GAP_IDLE_S`).
        transactions: With ``processing_guarantee="exactly_once"``: offsets are committed in
            the transaction of the outcomes (:mod:`streamapp.transactions`), always for every
            partition at once (a transaction commits all or nothing).
    """

    def __init__(
        self, consumer: Consumer, *, commit_interval_s: float, gap_idle_s: float = GAP_IDLE_S,
        transactions: Transactions | None = None,
    ) -> None:
        self.consumer = consumer
        #: Commits offsets inside a transaction with the outcomes (exactly_once), else None:
        #: the consumer commits them.
        self.transactions = transactions
        self.tracker = OffsetTracker(consumer.committed_or_earliest)
        self.stats = DeliveryStats()
        self.commit_interval_s = commit_interval_s
        self.gap_idle_s = gap_idle_s
        #: Assigned source partitions, as told by :meth:`on_assigned`; None: not told (tests),
        #: then every record is admitted.
        self._assigned: set[TP] | None = None
        self._tp_locks: dict[TP, asyncio.Lock] = {}
        self._last_admit_at = 0.0
        self._last_rebalance_at = 0.0
        self._last_unsettled_at = 0.0
        #: Consumer position of each partition at the previous sweep.
        self._positions: dict[TP, int] = {}
        self._process: Callable[[SourceMessage], Awaitable[None]] | None = None
        self._busy: Callable[[], bool] = lambda: False
        self._flush: Callable[[], Awaitable[None]] | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle --------------------------------------------------------------------------------

    def start(
        self, process: Callable[[SourceMessage], Awaitable[None]], busy: Callable[[], bool],
        flush: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Start the commit loop and the gap sweeper.

        Args:
            process: How records recovered by :meth:`sweep_gaps` are processed.
            busy: True while the pipeline applies backpressure (records may then wait in the
                consumer's buffers, so the sweeper must not read them).
            flush: Finishes every record whose outcome the broker has (the pipeline's state
                flush); awaited before the commit on revocation, so that a partition's next
                owner does not process them again.
        """
        self._process, self._busy, self._flush = process, busy, flush
        self._last_admit_at = time.monotonic()
        self._tasks = [
            asyncio.create_task(self._commit_loop(), name="commits"),
            # its own task: a sweep that recovers many records must not hold up commits
            asyncio.create_task(self._sweep_loop(), name="gap-sweeper"),
        ]

    async def stop(self) -> None:
        """Stop both loops and commit what finished."""
        await cancel_and_wait(*self._tasks)
        self._tasks = []
        await self.commit_now()

    # -- admission --------------------------------------------------------------------------------

    async def admit(
        self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
        event: Any = None,
    ) -> list[SourceMessage]:
        """Check a record just read against the tracker.

        Args:
            topic / partition / offset / key / value: The record.
            event: The Faust event it came in (tables write in its context).

        Returns:
            The records to process now, in offset order: the record itself; nothing when it was
            already read or its partition is no longer assigned; or, when the consumer skipped
            records before it (a gap), those records — read directly from the broker, each with
            an event of its own — followed by this one.
        """
        self._last_admit_at = time.monotonic()
        tp = (topic, partition)
        if self._assigned is not None and tp not in self._assigned:
            # Fetched before its partition was revoked and delivered late: its new owner
            # processes it. Tracking it here would leave stale state behind.
            return []
        lock = self._tp_locks.get(tp)
        if lock is None or not lock.locked():
            # The common case, decided without waiting: the partition's next record.
            state = self.tracker.try_accept(tp, offset)
            if state is not None:
                return [self._message(state, topic, partition, offset, key, value, event)]
        async with self._lock_for(tp):
            decision, _ = await self.tracker.on_read(topic, partition, offset)
            if decision == "drop":
                return []
            admitted: list[SourceMessage] = []
            if decision == "gap":
                admitted += await self._read_gap(topic, partition, offset)
                decision, _ = await self.tracker.on_read(topic, partition, offset)
            state = self.tracker.state(tp)
            if decision == "accept" and state is not None:
                admitted.append(
                    self._message(state, topic, partition, offset, key, value, event)
                )
            return admitted

    async def admit_many(
        self, records: Sequence[tuple[str, int, int, bytes | None, bytes | None, Any]]
    ) -> list[SourceMessage]:
        """:meth:`admit` for records read together: ``(topic, partition, offset, key, value,
        event)`` each, in read order. A partition's next record is accepted without awaiting.

        Returns:
            The records to process now, in read order (see :meth:`admit`).
        """
        admitted: list[SourceMessage] = []
        assigned, locks, tracker = self._assigned, self._tp_locks, self.tracker
        for topic, partition, offset, key, value, event in records:
            tp = (topic, partition)
            if assigned is not None and tp not in assigned:
                continue  # revoked meanwhile: its new owner processes it (see admit)
            lock = locks.get(tp)
            if lock is None or not lock.locked():
                state = tracker.try_accept(tp, offset)
                if state is not None:
                    admitted.append(
                        self._message(state, topic, partition, offset, key, value, event)
                    )
                    continue
            admitted += await self.admit(topic, partition, offset, key, value, event)
        self._last_admit_at = time.monotonic()
        return admitted

    @staticmethod
    def _message(
        state: PartitionState, topic: str, partition: int, offset: int, key: bytes | None,
        value: bytes | None, event: Any = None,
    ) -> SourceMessage:
        """The one place a :class:`SourceMessage` is built for an admitted record.

        Its ``ack`` goes straight to the partition's state of this assignment: after a
        revocation that state is dropped, so a late ack cannot move a newer commit.
        """
        return SourceMessage(
            key=key, value=value, topic=topic, partition=partition, offset=offset,
            ack=functools.partial(state.finish, offset),
            event=event if event is not None else StandInEvent(topic, partition, key, offset),
        )

    async def _read_gap(self, topic: str, partition: int, end: int) -> list[SourceMessage]:
        """Read and accept the records from the partition's next expected offset up to ``end``."""
        state = self.tracker.state((topic, partition))
        assert state is not None
        if state.next_offset == state.committed:
            await self._skip_committed_meanwhile(topic, partition, state, end)
        begin = state.next_offset
        if begin >= end:
            return []
        missing = await self.consumer.read_range(topic, partition, begin, end)
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
            decision, _ = await self.tracker.on_read(topic, partition, o)
            current = self.tracker.state((topic, partition))
            if decision == "accept" and current is not None:
                admitted.append(self._message(current, topic, partition, o, k, v))
        state = self.tracker.state((topic, partition))
        if state is not None and state.next_offset < end:
            self.tracker.skip_to(topic, partition, end, lost=lost)
        self.stats.gap_reads += 1
        self.stats.gap_records += len(admitted)
        if admitted:
            log.warning(
                "%s[%d]: the consumer skipped %d records between offsets %d and %d; read them "
                "directly so that none is lost", topic, partition, len(admitted), begin, end - 1,
            )
        return admitted

    async def _skip_committed_meanwhile(
        self, topic: str, partition: int, state: PartitionState, end: int
    ) -> None:
        """Before reading a gap at the start of an assignment (nothing read past the committed
        offset yet): read the group's committed offset again and move past what it covers.

        The consumer can start past the committed offset this assignment began from when the
        partition's previous owner committed after that offset was read. With exactly_once the
        previous owner's offsets become visible only when its transaction's markers are written,
        after its EndTxn returned: Kafka answers an OffsetFetch without ``require_stable``
        (KIP-447; aiokafka sends OffsetFetch v3 at most) with the older offset meanwhile, and
        the records between were answered a second time (1–3 duplicates in some runs of
        tests/kafka/test_exactly_once.py). So with exactly_once it asks up to
        ``STABLE_OFFSET_TRIES`` times, ``STABLE_OFFSET_WAIT_S`` apart, while the answer is below
        ``end`` (the offset the consumer fetched from). Records below the new committed offset
        were finished by the previous owner: skipping them loses nothing.
        """
        begin = state.next_offset
        tries = STABLE_OFFSET_TRIES if self.transactions is not None else 1
        committed = begin
        for attempt in range(tries):
            if attempt:
                await asyncio.sleep(STABLE_OFFSET_WAIT_S)
            try:
                committed = await self.consumer.committed_or_earliest(topic, partition)
            except Exception as exc:  # the gap is read as before
                log.warning("%s[%d]: cannot read the committed offset again (%s: %s)",
                            topic, partition, type(exc).__name__, exc)
                return
            if committed >= end:
                break
        current = self.tracker.state((topic, partition))
        if current is not state or state.next_offset != begin or committed <= begin:
            return  # revoked, reassigned or read meanwhile, or nothing newer was committed
        committed = min(committed, end)
        self.tracker.skip_to(topic, partition, committed, lost=False)
        self.stats.committed_meanwhile += 1
        log.info("%s[%d]: offsets %d..%d were committed by the partition's previous owner after "
                 "this assignment read its committed offset; not read again", topic, partition,
                 begin, committed - 1)

    def _lock_for(self, tp: TP) -> asyncio.Lock:
        lock = self._tp_locks.get(tp)
        if lock is None:
            lock = self._tp_locks[tp] = asyncio.Lock()
        return lock

    # -- gaps at the end of a partition -----------------------------------------------------------

    async def sweep_gaps(self) -> int:
        """Find records the consumer skipped at the *end* of a partition, where no later record
        arrives to reveal the gap, and process them.

        Only when, for ``gap_idle_s``, no record was admitted, no rebalance happened, the
        pipeline applied no backpressure and the consumer said at every sweep that it held no
        fetched record in its buffers (:meth:`Consumer.settled`), and only for a partition whose
        position did not move since the previous sweep. With a backlog the consumer's position
        runs far ahead of what the agent was handed; reading those records directly read them a
        second time (the second copy is dropped as already read, but the direct read costs a
        consumer and thousands of records processed from the sweeper's task).

        Returns:
            How many records were recovered.
        """
        if self._assigned is None or self._process is None:
            return 0
        now = time.monotonic()
        assigned = sorted(self._assigned)
        if self._busy() or not all(self.consumer.settled(t) for t in {tp[0] for tp in assigned}):
            self._last_unsettled_at = now
            self.stats.sweep_skips += 1
            return 0
        quiet_since = max(self._last_admit_at, self._last_rebalance_at, self._last_unsettled_at)
        if now - quiet_since < self.gap_idle_s:
            return 0
        recovered = 0
        for tp in assigned:
            position = await self.consumer.position(*tp)
            previous = self._positions.get(tp)
            if position is None:
                continue
            self._positions[tp] = position
            if position != previous:
                continue  # it just fetched: wait one more sweep
            async with self._lock_for(tp):
                if tp not in self._assigned or not self.consumer.settled(tp[0]):
                    continue  # revoked or busy meanwhile
                state = await self.tracker.ensure(*tp)
                if position <= state.next_offset:
                    continue
                # DEBUG: the offsets between may hold no data (transaction markers, aborted
                # records); _read_gap logs a warning once the direct read found records there.
                log.debug(
                    "%s[%d]: the consumer is at offset %d but only %d were read: reading the "
                    "offsets between", tp[0], tp[1], position, state.next_offset,
                )
                admitted = await self._read_gap(tp[0], tp[1], position)
                for message in admitted:
                    await self._process(message)
                recovered += len(admitted)
        return recovered

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.gap_idle_s / 2)
            try:
                await self.sweep_gaps()
            except Exception:
                log.exception("looking for skipped records failed; will try again")

    # -- commits and rebalances -------------------------------------------------------------------

    async def commit_now(self, only: set[TP] | None = None) -> None:
        """Commit every partition's finished prefix (or only those in ``only``; in a
        transaction always every partition's)."""
        if self.transactions is not None:
            committed = await self.transactions.commit(self.tracker.committable)
            if committed:
                self.tracker.mark_committed(dict(committed))
                self.stats.commits += 1
            return
        offsets = self.tracker.committable()
        if only is not None:
            offsets = {tp: o for tp, o in offsets.items() if tp in only}
        if not offsets:
            return
        try:
            if await self.consumer.commit(offsets):  # False: none of them is still assigned
                self.tracker.mark_committed(offsets)
                self.stats.commits += 1
        except Exception:
            self.stats.commit_failures += 1
            log.exception("committing %s failed; will retry", offsets)

    async def _commit_loop(self) -> None:
        while True:
            await asyncio.sleep(self.commit_interval_s)
            await self.commit_now()

    def current(self, message: SourceMessage) -> bool:
        """Whether ``message`` was admitted in its partition's current assignment (False once
        the partition was revoked or reassigned since, or its revocation has begun: its
        outcome must not be produced, the partition's next reader answers it)."""
        assigned = self._assigned
        if assigned is not None and (message.topic, message.partition) not in assigned:
            # revocation under way (on_revoked forgets the partition's state only after its
            # commit): a row written for it now would reach the changelog after the next owner
            # restored it
            return False
        owner = getattr(message.ack, "func", None)
        return getattr(owner, "__self__", None) is self.tracker.state(
            (message.topic, message.partition))

    def on_assigned(self, assigned: Iterable[TP]) -> None:
        """Partitions were (re)assigned: from now on only records of ``assigned`` are admitted,
        and the state of any other partition is dropped."""
        self._last_rebalance_at = time.monotonic()
        self._assigned = set(assigned)
        self._positions.clear()
        self.tracker.forget(tp for tp in self.tracker.assigned() if tp not in self._assigned)

    async def on_revoked(self, revoked: set[TP]) -> None:
        """Before partitions go to another worker: commit what finished, forget the rest."""
        self._last_rebalance_at = time.monotonic()
        if self._assigned is not None:
            self._assigned -= revoked
        if self._flush is not None:
            try:
                await self._flush()
            except Exception:
                log.exception("finishing records before the revocation's commit failed")
        await self.commit_now(only=revoked)
        self.tracker.forget(revoked)
