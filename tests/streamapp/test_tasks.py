"""streamapp.tasks: waits that never lose a cancellation (the stop of a worker's loops)."""

from __future__ import annotations

import asyncio

import pytest

from streamapp.tasks import cancel_and_wait, wait_event


async def test_wait_event_says_whether_the_event_was_set() -> None:
    event = asyncio.Event()
    assert await wait_event(event, 0.001) is False
    asyncio.get_running_loop().call_soon(event.set)
    assert await wait_event(event, 5.0) is True
    assert await wait_event(event, 0) is True  # already set: no wait at all


async def test_a_loop_on_wait_event_stops_when_cancelled_as_its_event_is_set() -> None:
    # The race that hung a worker's stop (its state-flush loop): the event is set and the
    # task cancelled in one loop iteration. asyncio.wait_for on Python 3.11 returns normally
    # there (CPython gh-86296), so a `while True` around it went on forever.
    rounds = 0

    async def loop(event: asyncio.Event) -> None:
        nonlocal rounds
        while True:
            await wait_event(event, 10.0)
            event.clear()
            rounds += 1

    for _ in range(20):
        event = asyncio.Event()
        task = asyncio.create_task(loop(event))
        await asyncio.sleep(0)  # the loop is waiting
        event.set()
        task.cancel()
        async with asyncio.timeout(5):
            await cancel_and_wait(task)
        assert task.cancelled()
    assert rounds <= 20


async def test_wait_event_raises_the_callers_cancellation_at_its_timeout() -> None:
    event = asyncio.Event()
    task = asyncio.create_task(wait_event(event, 0.01))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_cancel_and_wait_passes_the_callers_own_cancellation_on() -> None:
    release = asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await release.wait()  # cleans up for a while before it ends
            raise

    task = asyncio.create_task(slow_to_stop())
    await asyncio.sleep(0)
    with pytest.raises(TimeoutError):  # the caller's own time limit still applies
        async with asyncio.timeout(0.05):
            await cancel_and_wait(task)
    release.set()
    await cancel_and_wait(task)  # the task's own CancelledError is swallowed
    assert task.cancelled()
