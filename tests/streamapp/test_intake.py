"""IntakeBuffer: what the direct intake hands the agents (streamapp/intake.py)."""

from __future__ import annotations

import asyncio
import weakref
from types import SimpleNamespace
from typing import Any

from streamapp.intake import DirectRecord, IntakeBuffer, direct_records


class _Stream:
    """The agent's stream as chunks() uses it: should_stop and wait_for_stopped."""

    def __init__(self) -> None:
        self.stopped = asyncio.Event()

    @property
    def should_stop(self) -> bool:
        return self.stopped.is_set()

    async def wait_for_stopped(self, event: asyncio.Event) -> None:
        waits = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(self.stopped.wait())]
        _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()


def _records(partition: int, first: int, n: int) -> list[DirectRecord]:
    fetched = [SimpleNamespace(offset=o, key=b"cam-1", value=b"v%d" % o,
                               timestamp=1_700_000_000_123) for o in range(first, first + n)]
    return direct_records("requests", partition, fetched)


class _Agent:
    """Takes chunks one at a time: each next() hands over the next chunk (offsets)."""

    def __init__(self, buffer: IntakeBuffer, max_: int) -> None:
        self.stream = _Stream()
        self._chunks = buffer.chunks(self.stream, max_)

    async def next(self) -> list[tuple[int, int]]:
        chunk = await asyncio.wait_for(self._chunks.__anext__(), timeout=5)
        return [(r.partition, r.offset) for r in chunk]


def test_a_direct_record_is_its_own_event_message() -> None:
    record = _records(3, 41, 1)[0]

    assert record.message is record  # what the tables' event_context reads
    assert (record.topic, record.partition, record.offset, record.key) == (
        "requests", 3, 41, b"cam-1")
    assert record.timestamp == 1_700_000_000.123  # ms → s, Faust's Message.timestamp unit
    assert weakref.ref(record)() is record  # Faust holds the current event through a weakref
    assert "v41" not in repr(record)


async def test_chunks_are_at_most_max_records_of_one_partition_in_offset_order() -> None:
    buffer = IntakeBuffer(limit=1000)
    agent = _Agent(buffer, max_=64)
    await buffer.put(_records(0, 0, 150))
    await buffer.put(_records(1, 7, 3))

    assert await agent.next() == [(0, o) for o in range(64)]
    assert await agent.next() == [(0, o) for o in range(64, 128)]
    assert await agent.next() == [(0, o) for o in range(128, 150)]
    assert await agent.next() == [(1, 7), (1, 8), (1, 9)]


async def test_lists_of_several_partitions_that_waited_together_come_as_one_chunk() -> None:
    """Paced, a fetch brings a few records per partition: the agent takes what waits in one
    chunk of at most ``max_``, each partition's records in offset order (issue 17)."""
    buffer = IntakeBuffer(limit=1000)
    agent = _Agent(buffer, max_=8)
    await buffer.put(_records(0, 10, 3))
    await buffer.put(_records(1, 20, 2))
    await buffer.put(_records(0, 13, 2))
    await buffer.put(_records(2, 0, 4))  # 3 + 2 + 2 + 4 > 8: the next chunk

    assert await agent.next() == [(0, 10), (0, 11), (0, 12), (1, 20), (1, 21), (0, 13), (0, 14)]
    assert await agent.next() == [(2, 0), (2, 1), (2, 2), (2, 3)]
    assert buffer.put_nowait(_records(3, 5, 1))
    assert await agent.next() == [(3, 5)]


async def test_put_nowait_queues_nothing_when_put_would_wait() -> None:
    buffer = IntakeBuffer(limit=4)
    assert buffer.put_nowait(_records(0, 0, 6))  # room for one list: a long one goes in alone
    assert not buffer.put_nowait(_records(1, 0, 1))
    assert (buffer.queued, buffer.waiting) == (6, 0)

    agent = _Agent(buffer, max_=64)
    assert await agent.next() == [(0, o) for o in range(6)]
    later = asyncio.ensure_future(agent.next())  # done with it: room again
    await asyncio.wait_for(_until(lambda: buffer.queued == 0), timeout=5)
    assert buffer.put_nowait(_records(1, 0, 1))
    assert await asyncio.wait_for(later, timeout=5) == [(1, 0)]


async def test_fetched_records_count_until_the_agent_is_done_with_them() -> None:
    """FaustConsumer.settled reads empty(): the gap sweeper must not take records the agent
    holds for records the consumer skipped."""
    buffer = IntakeBuffer(limit=1000)
    agent = _Agent(buffer, max_=64)
    assert buffer.empty()
    await buffer.put(_records(0, 0, 2))
    assert not buffer.empty()

    await agent.next()  # the agent holds the chunk
    assert not buffer.empty()
    later = asyncio.ensure_future(agent.next())  # ... and asks for the next one: done with it
    await asyncio.wait_for(_until(buffer.empty), timeout=5)
    later.cancel()


async def test_a_full_buffer_holds_the_next_list_until_the_agent_takes_room() -> None:
    buffer = IntakeBuffer(limit=10)
    agent = _Agent(buffer, max_=64)
    await buffer.put(_records(0, 0, 25))  # larger than the limit: goes in alone
    blocked = asyncio.ensure_future(buffer.put(_records(1, 0, 25)))
    await asyncio.sleep(0)
    assert not blocked.done() and buffer.waiting == 25

    assert await agent.next() == [(0, o) for o in range(25)]
    # the agent asks for more: the first list is done, the second goes in and comes out
    assert await agent.next() == [(1, o) for o in range(25)]
    assert blocked.done()


async def test_clear_drops_what_waits_and_lets_a_waiting_put_in() -> None:
    buffer = IntakeBuffer(limit=10)
    agent = _Agent(buffer, max_=64)
    await buffer.put(_records(0, 0, 12))
    blocked = asyncio.ensure_future(buffer.put(_records(1, 0, 3)))
    await asyncio.sleep(0)

    assert buffer.clear() == 12  # partitions revoked: their next owner reads them
    await asyncio.wait_for(blocked, timeout=5)
    assert await agent.next() == [(1, 0), (1, 1), (1, 2)]


async def test_a_cancelled_put_leaves_nothing_counted() -> None:
    """The drain loop drops a list when a rebalance suspends the flow (as Faust drops a
    record then): the buffer must not count it as waiting."""
    buffer = IntakeBuffer(limit=1)
    await buffer.put(_records(0, 0, 1))
    blocked = asyncio.ensure_future(buffer.put(_records(1, 0, 5)))
    await asyncio.sleep(0)
    blocked.cancel()
    await asyncio.gather(blocked, return_exceptions=True)

    assert (buffer.queued, buffer.waiting) == (1, 0)


async def test_chunks_end_when_the_agent_stream_stops() -> None:
    buffer = IntakeBuffer(limit=10)
    stream = _Stream()
    taken: list[Any] = []

    async def agent() -> None:
        async for chunk in buffer.chunks(stream, 8):
            taken.append(chunk)

    task = asyncio.ensure_future(agent())
    await asyncio.sleep(0)
    stream.stopped.set()
    await asyncio.wait_for(task, timeout=5)  # ended, not cancelled
    assert taken == []


async def _until(condition: Any) -> None:
    while not condition():
        await asyncio.sleep(0.001)
