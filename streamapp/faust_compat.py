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

__all__ = ["commit_offsets", "committed_or_earliest", "event_context", "seek"]


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


async def seek(app: Any, topic: str, partition: int, offset: int) -> None:
    """Make the consumer read ``topic[partition]`` from ``offset`` again."""
    await app.consumer.seek(TP(topic, partition), offset)


async def commit_offsets(app: Any, offsets: dict[tuple[str, int], int]) -> bool:
    """Commit ``{(topic, partition): next offset}`` for the group, bypassing Faust's ack-based
    bookkeeping (see :mod:`streamapp.offsets`). Partitions no longer assigned are skipped by
    Faust's driver. Returns True when the broker accepted the commit."""
    if not offsets:
        return True
    ok: bool = await app.consumer._commit({TP(t, p): o for (t, p), o in offsets.items()})
    return ok
