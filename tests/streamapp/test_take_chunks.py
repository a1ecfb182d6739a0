"""take_chunks: the agents' intake (a chunk closes full or ``within`` after its first event; an
agent without events does not wake up)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import faust
import pytest

from streamapp.faust_compat import take_chunks


@pytest.fixture
async def channel() -> AsyncIterator[Any]:
    # No broker is contacted: an in-memory channel delivers Faust events to the stream.
    app = faust.App("test-take-chunks", broker="kafka://127.0.0.1:1", store="memory://",
                    loop=asyncio.get_running_loop())
    app.flow_control.resume()
    yield app.channel()
    # the stream looked up app.consumer, whose (never started) thread made an event loop
    consumer = getattr(app, "_consumer", None)
    if consumer is not None:
        consumer._thread.thread_loop.close()


class _Taker:
    """Runs ``take_chunks`` over a stream of ``channel`` and queues each chunk's values."""

    def __init__(self, channel: Any, max_: int, within_s: float) -> None:
        self.stream = channel.stream()
        self.waits = 0
        self.acked: list[Any] = []
        self.chunks: asyncio.Queue[list[Any]] = asyncio.Queue()
        wait_for_stopped, ack = self.stream.wait_for_stopped, self.stream.ack

        async def counting_wait(*args: Any, **kwargs: Any) -> Any:
            self.waits += 1
            return await wait_for_stopped(*args, **kwargs)

        async def recording_ack(event: Any) -> bool:
            self.acked.append(event.value)
            return bool(await ack(event))

        self.stream.wait_for_stopped = counting_wait
        self.stream.ack = recording_ack
        self.task = asyncio.ensure_future(self._run(max_, within_s))

    async def _run(self, max_: int, within_s: float) -> None:
        async for chunk in take_chunks(self.stream, max_, within_s):
            await self.chunks.put([event.value for event in chunk])

    async def next(self) -> list[Any]:
        return await asyncio.wait_for(self.chunks.get(), timeout=5)

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def test_a_chunk_closes_when_full_without_waiting_for_its_window(channel: Any) -> None:
    taker = _Taker(channel, max_=4, within_s=60.0)
    for i in range(6):
        await channel.send(value=i)

    # A 60 s window: only fullness can close the first chunk within next()'s 5 s.
    assert await taker.next() == [0, 1, 2, 3]
    await taker.stop()


async def test_a_partial_chunk_closes_its_window_after_its_first_event(channel: Any) -> None:
    taker = _Taker(channel, max_=64, within_s=0.05)
    await channel.send(value="a")
    await channel.send(value="b")

    assert await taker.next() == ["a", "b"]
    await channel.send(value="c")
    assert await taker.next() == ["c"]
    # The first chunk's events were acked once the consumer asked for the next chunk.
    assert taker.acked[:2] == ["a", "b"]
    await taker.stop()


async def test_an_agent_without_events_does_not_wake_up(channel: Any) -> None:
    """Faust's take_events(64, 2 ms) wakes up every 2 ms (about 100 waits in this 0.2 s, each
    two new tasks); take_chunks waits once, for the first event."""
    taker = _Taker(channel, max_=64, within_s=0.002)
    await asyncio.sleep(0.2)  # nothing to wait for: the point is that nothing happens

    assert taker.waits <= 1
    await channel.send(value=1)
    assert await taker.next() == [1]
    await taker.stop()
