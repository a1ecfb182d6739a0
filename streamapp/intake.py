"""Direct intake: records of the source topics go from Faust's fetcher to the agents in lists.

With ``intake=faust`` every record takes Faust's per-event path: the fetcher's drain loop
awaits ``Service.wait_first`` per message (two futures, two tasks), the conductor takes a lock
and decodes it into an event, a flow-controlled queue hands it to the stream, the stream's
drainer applies its processors, and ``take_events`` collects the events again. On the 2-core
machine that path cost about a quarter of a saturated worker's event loop (py-spy, issue 17,
2026-12-03), and a Faust agent that only forwards records pays it too: it is most of the
yardstick's ~100 µs per record against 3–4 µs for a plain aiokafka relay.

With ``intake=direct`` (:func:`streamapp.faust_compat.install_direct_intake`) Faust's drain loop
hands the records of the request and retry topics, as fetched, to an :class:`IntakeBuffer` per
topic, once per fetched partition and no longer per record, without Faust's per-call tasks
when nothing has to wait; the agents take them from there (:meth:`IntakeBuffer.chunks`), the
lists of several partitions together when they waited together. Everything else stays
Faust's: the consumer group and rebalances, the fetcher and its thread, table changelogs and
recovery, flow control (a fetched list waits for ``app.flow_control`` and for the producer
buffer to ebb, as Faust's conductor waits per record; when the flow is suspended by a
rebalance, the list is dropped, as Faust drops a record then, and read again from the
committed offset), and back pressure (a full buffer stops the drain loop, so the fetcher stops
fetching). Offsets are committed by :mod:`streamapp.delivery` in both modes.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Iterable
from typing import Any

__all__ = ["DirectRecord", "IntakeBuffer"]


class DirectRecord:
    """One fetched record, doubling as the Faust event the tables need for a write
    (``event.message.topic/.partition/.key/.offset``; Faust keeps the current event through
    a weak reference).

    Attributes:
        topic / partition / offset / key / value: The record.
        timestamp: Its timestamp in seconds (Faust's ``Message.timestamp`` unit), or None.
    """

    __slots__ = ("__weakref__", "key", "offset", "partition", "timestamp", "topic", "value")

    def __init__(self, topic: str, partition: int, offset: int, key: bytes | None,
                 value: bytes | None, timestamp: float | None) -> None:
        self.topic, self.partition, self.offset = topic, partition, offset
        self.key, self.value, self.timestamp = key, value, timestamp

    @property
    def message(self) -> DirectRecord:
        return self

    def __repr__(self) -> str:  # never the value: it can be megabytes
        return f"<DirectRecord {self.topic}[{self.partition}]@{self.offset}>"


class IntakeBuffer:
    """The fetched records of one topic waiting for its agent: lists of
    :class:`DirectRecord`, each of one partition in offset order.

    Args:
        limit: Records it holds before :meth:`put` waits (back pressure on the drain loop).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.queued = 0  # records in the lists here, until the agent is done with them
        self.waiting = 0  # records of a put that waits for room
        self._lists: deque[list[DirectRecord]] = deque()
        self._nonempty = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()

    def empty(self) -> bool:
        """True when no fetched record waits here, in a :meth:`put` or in the agent's hands."""
        return self.queued == 0 and self.waiting == 0

    async def put(self, records: list[DirectRecord]) -> None:
        """Queue one partition's fetched records; waits while ``limit`` records are queued
        (a list larger than ``limit`` goes in alone)."""
        self.waiting += len(records)
        try:
            while self.queued >= self.limit:
                self._room.clear()
                await self._room.wait()
        finally:
            self.waiting -= len(records)  # a put cancelled (flow suspended) drops the list
        self.queued += len(records)
        self._lists.append(records)
        self._nonempty.set()

    def put_nowait(self, records: list[DirectRecord]) -> bool:
        """Queue one partition's fetched records if there is room (fewer than ``limit``
        queued); returns False, queueing nothing, when :meth:`put` would wait."""
        if self.queued >= self.limit:
            return False
        self.queued += len(records)
        self._lists.append(records)
        self._nonempty.set()
        return True

    def clear(self) -> int:
        """Drop every queued list (their partitions were revoked); returns how many records."""
        dropped = sum(len(r) for r in self._lists)
        self._lists.clear()
        self.queued -= dropped
        self._nonempty.clear()
        if self.queued < self.limit:
            self._room.set()
        return dropped

    async def chunks(self, stream: Any, max_: int) -> AsyncIterator[list[DirectRecord]]:
        """What waits, in chunks of at most ``max_`` records, as soon as it is there (no
        intake window: a fetched list is already a batch); ends when ``stream`` (the agent's
        Faust stream, the one it would have iterated) stops.

        A chunk is one fetched list, a slice of a list longer than ``max_``, or whole lists
        of several partitions that waited together and fit in ``max_``: each partition's
        records stay in offset order. Paced, a fetch brings a few records per partition,
        and the agent's cost per chunk (admission, back pressure) was paid per partition
        (issue 17). The agent waits on an :class:`asyncio.Event`, not through the stream's
        ``wait_for_stopped`` (Faust's ``wait_first``: four tasks a wait); one task per call
        wakes it when the stream stops.
        """
        lists = self._lists
        watcher = asyncio.ensure_future(self._wake_on_stop(stream))
        try:
            while not stream.should_stop:
                if not lists:
                    self._nonempty.clear()
                    await self._nonempty.wait()
                    continue
                records = lists.popleft()
                if lists and len(records) < max_ and len(records) + len(lists[0]) <= max_:
                    records = list(records)
                    while lists and len(records) + len(lists[0]) <= max_:
                        records += lists.popleft()
                for start in range(0, len(records), max_):
                    chunk = records[start:start + max_] if len(records) > max_ else records
                    yield chunk
                    # counted until the agent is done with it (FaustConsumer.settled)
                    self.queued -= len(chunk)
                    if self.queued < self.limit:
                        self._room.set()
        finally:
            watcher.cancel()

    async def _wake_on_stop(self, stream: Any) -> None:
        await stream.wait_for_stopped(asyncio.Event())  # never set: returns on the stop
        self._nonempty.set()


def direct_records(topic: str, partition: int, records: Iterable[Any]) -> list[DirectRecord]:
    """aiokafka ``ConsumerRecord`` s as :class:`DirectRecord` s (timestamps ms → s)."""
    return [DirectRecord(topic, partition, r.offset, r.key, r.value,
                         None if r.timestamp is None else r.timestamp / 1000.0)
            for r in records]
