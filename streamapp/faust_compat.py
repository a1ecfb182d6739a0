"""The few places where streamapp reaches into Faust internals, kept in one module.

faust-streaming is pinned (0.15.3); each helper says what it relies on and why there is no
public API for it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from faust.streams import _current_event
from faust.types import TP

__all__ = [
    "StandInEvent",
    "commit_offsets",
    "committed_or_earliest",
    "event_context",
    "set_fetch_max_wait",
    "set_read_committed",
]


@contextmanager
def event_context(event: Any) -> Iterator[None]:
    """Make ``event`` Faust's *current event* inside the block.

    Faust tables find the partition of a write (changelog and RocksDB store) from the current
    event, which Faust only sets while an agent iterates its stream. The pipeline writes tables
    after a batch finished, outside that iteration, so it sets the event the row belongs to.
    """
    token = _current_event.set(weakref.ref(event) if event is not None else None)
    try:
        yield
    finally:
        _current_event.reset(token)


async def committed_or_earliest(app: Any, topic: str, partition: int) -> int:
    """The group's committed offset of a partition, or its log start when none was committed.

    Uses the aiokafka consumer that Faust runs in its consumer thread (Faust exposes no call
    for a committed offset).
    """
    from aiokafka import TopicPartition

    thread = app.consumer._thread
    consumer = thread._ensure_consumer()
    committed = await thread.call_thread(consumer.committed, TopicPartition(topic, partition))
    if committed is not None and committed >= 0:
        return int(committed)
    earliest = await app.consumer.earliest_offsets(TP(topic, partition))
    return int(next(iter(earliest.values()), 0) or 0)


async def commit_offsets(app: Any, offsets: dict[tuple[str, int], int]) -> bool:
    """Commit ``{(topic, partition): next offset}`` for the group, bypassing Faust's ack-based
    bookkeeping (see :mod:`streamapp.offsets`). Partitions no longer assigned are skipped by
    Faust's driver. Returns True when the broker accepted the commit."""
    assigned = app.consumer.assignment()
    # Only partitions still assigned: Faust's driver filters too, but hands aiokafka an empty
    # dict when none is left, and aiokafka's ValueError then crashes Faust's consumer.
    tps = {TP(t, p): o for (t, p), o in offsets.items() if TP(t, p) in assigned}
    if not tps:
        return False
    ok: bool = await app.consumer._commit(tps)
    return ok


def set_fetch_max_wait(app: Any, ms: float) -> bool:
    """Set how long the worker's fetch requests wait for data (aiokafka ``fetch_max_wait_ms``).

    Faust 0.15.3 creates its consumer with a fixed ``fetch_max_wait_ms=1500``. Kafka answers a
    fetch as soon as data arrives, but the embedded broker holds it for the whole wait when the
    partition was empty, so at light load every request waited up to 1.5 s. aiokafka reads the
    value from its fetcher on every request, so changing it there takes effect at once.

    Returns:
        True when the consumer existed and was changed.
    """
    consumer = getattr(getattr(app.consumer, "_thread", None), "_consumer", None)
    fetcher = getattr(consumer, "_fetcher", None)
    if fetcher is None or not hasattr(fetcher, "_fetch_max_wait_ms"):
        return False
    fetcher._fetch_max_wait_ms = int(ms)
    return True


def set_read_committed(app: Any) -> bool:
    """Make the worker's consumer read committed records only (``isolation_level``
    ``read_committed``): records of aborted transactions are never handed out, and records of
    open transactions only once committed.

    Faust 0.15.3 sets read_committed only with ``processing_guarantee="exactly_once"`` (which
    needs transactions, absent on the embedded broker). aiokafka's fetcher reads the level on
    every fetch request and response, so setting it there takes effect from the next fetch;
    call it on every assignment, before the partitions are fetched.

    Returns:
        True when the consumer existed and was changed.
    """
    from aiokafka.consumer.fetcher import READ_COMMITTED

    consumer = getattr(getattr(app.consumer, "_thread", None), "_consumer", None)
    fetcher = getattr(consumer, "_fetcher", None)
    if fetcher is None or not hasattr(fetcher, "_isolation_level"):
        return False
    fetcher._isolation_level = READ_COMMITTED
    return True


class _StandInMessage:
    __slots__ = ("key", "offset", "partition", "topic")

    def __init__(self, topic: str, partition: int, key: bytes | None, offset: int) -> None:
        self.topic = topic
        self.partition = partition
        self.key = key
        self.offset = offset


class StandInEvent:
    """Just enough of a Faust event for a table write (``message.topic``, ``.partition``,
    ``.key``, ``.offset``), for records that did not arrive as a Faust event of their own:
    those read to fill a consumer gap, and outcomes written for another partition's key.
    Weak-referenceable, as Faust keeps the current event through a weakref."""

    __slots__ = ("__weakref__", "message")

    def __init__(self, topic: str, partition: int, key: bytes | None, offset: int = -1) -> None:
        self.message = _StandInMessage(topic, partition, key, offset)
