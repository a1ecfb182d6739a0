"""MicroBatcher: closes on size and on delay (fake clock), keeps put order, bounds in-flight."""

from __future__ import annotations

import asyncio
import gc
import heapq
import itertools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import pytest

from streamapp import batching
from streamapp.batching import Completion, MicroBatcher


class FakeClock:
    """A monotonic clock that only moves when a test calls :meth:`advance`."""

    def __init__(self) -> None:
        self.now = 0.0
        self._timers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._ids = itertools.count()

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._timers, (self.now + seconds, next(self._ids), fut))
        await fut

    def advance(self, seconds: float) -> None:
        self.now += seconds
        while self._timers and self._timers[0][0] <= self.now + 1e-12:
            _, _, fut = heapq.heappop(self._timers)
            if not fut.done():
                fut.set_result(None)


async def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Yield to the event loop until ``condition()`` holds (fails the test after the timeout)."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0)


async def settle() -> None:
    """Let every runnable task run until the loop has nothing ready (no wall-clock wait)."""
    for _ in range(50):
        await asyncio.sleep(0)


class Recorder:
    """run_batch / emit pair that records what the batcher did."""

    def __init__(self) -> None:
        self.batches: list[tuple[Hashable, list[Any]]] = []
        self.emitted: list[Completion[Any]] = []
        self.gates: dict[int, asyncio.Event] = {}
        self.gated = False
        self.fail_keys: set[Hashable] = set()

    async def run_batch(self, key: Hashable, items: list[Any]) -> Sequence[Any]:
        index = len(self.batches)
        self.batches.append((key, list(items)))
        if self.gated:
            gate = self.gates.setdefault(index, asyncio.Event())
            await gate.wait()
        if key in self.fail_keys:
            raise RuntimeError(f"batch {index} failed")
        return [f"r{item}" for item in items]

    def release(self, index: int) -> None:
        self.gates.setdefault(index, asyncio.Event()).set()

    async def emit(self, completion: Completion[Any]) -> None:
        self.emitted.append(completion)


def make(rec: Recorder, clock: FakeClock, **kw: Any) -> MicroBatcher[Any]:
    opts: dict[str, Any] = {
        "max_batch_size": 4,
        "max_batch_delay_ms": 50.0,
        "max_inflight_batches": 2,
    }
    opts.update(kw)
    return MicroBatcher(rec.run_batch, rec.emit, clock=clock, sleep=clock.sleep, **opts)


async def test_closes_on_size_without_waiting_for_the_delay() -> None:
    rec, clock = Recorder(), FakeClock()
    async with make(rec, clock, max_batch_delay_ms=10_000) as batcher:
        for i in range(8):
            await batcher.put(i)
        await wait_for(lambda: len(rec.emitted) == 8)
        assert [items for _, items in rec.batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert batcher.stats.closed_by_size == 2
        assert batcher.stats.closed_by_delay == 0
        assert clock.now == 0.0


async def test_batches_closed_by_size_leave_no_garbage_for_the_cyclic_collector() -> None:
    """A batch closed by size cancels its delay timer; the timer's CancelledError holds the
    frame that holds the batch, so a batch that still held its timer made a reference cycle,
    and every item of it waited for the cyclic collector (whose pauses reached 100 ms in a
    worker, issue 17). Freed by reference counting, nothing of it is left for ``gc``."""
    rec = Recorder()
    gc.collect()
    gc.disable()
    try:
        gc.set_debug(gc.DEBUG_SAVEALL)
        async with MicroBatcher(rec.run_batch, rec.emit, max_batch_size=4,
                                max_batch_delay_ms=10_000, max_inflight_batches=2) as batcher:
            for i in range(40):
                await batcher.put(i)
            await wait_for(lambda: len(rec.emitted) == 40)
        assert batcher.stats.closed_by_size == 10
        rec.emitted.clear()
        gc.collect()
        left = [type(o).__name__ for o in gc.garbage
                if isinstance(o, batching._Batch | batching._Slot | Completion)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == []


async def test_closes_on_delay_measured_from_the_first_item() -> None:
    rec, clock = Recorder(), FakeClock()
    async with make(rec, clock, max_batch_size=10, max_batch_delay_ms=50) as batcher:
        await batcher.put("a")
        clock.advance(0.030)
        await batcher.put("b")
        clock.advance(0.019)
        await settle()
        assert rec.batches == []  # 49 ms after the first item: still open
        clock.advance(0.001)
        await wait_for(lambda: len(rec.emitted) == 2)
        assert rec.batches == [(None, ["a", "b"])]
        assert batcher.stats.closed_by_delay == 1
        info = rec.emitted[0].batch
        assert info is not None and info.closed_by == "delay"
        assert info.closed_at - info.opened_at == pytest.approx(0.050)


async def test_emits_in_put_order_when_a_later_batch_finishes_first() -> None:
    rec, clock = Recorder(), FakeClock()
    rec.gated = True
    async with make(rec, clock, max_batch_size=2) as batcher:
        for i in range(4):
            await batcher.put(i)
        await wait_for(lambda: len(rec.batches) == 2)
        rec.release(1)  # second batch finishes first
        await settle()
        assert rec.emitted == []  # held back: item 0 is not done yet
        rec.release(0)
        await wait_for(lambda: len(rec.emitted) == 4)
        assert [c.item for c in rec.emitted] == [0, 1, 2, 3]
        assert [c.result for c in rec.emitted] == ["r0", "r1", "r2", "r3"]


async def test_rejected_items_keep_their_place_in_the_order() -> None:
    rec, clock = Recorder(), FakeClock()
    async with make(rec, clock, max_batch_size=3) as batcher:
        await batcher.put(0)
        await batcher.put_done("bad", ValueError("bad input"))
        await batcher.put(1)
        await batcher.put(2)
        await wait_for(lambda: len(rec.emitted) == 4)
        assert [c.item for c in rec.emitted] == [0, "bad", 1, 2]
        assert isinstance(rec.emitted[1].error, ValueError)
        assert rec.emitted[1].batch is None
        assert rec.batches == [(None, [0, 1, 2])]


async def test_bounds_batches_in_flight_and_applies_backpressure() -> None:
    rec, clock = Recorder(), FakeClock()
    rec.gated = True
    batcher = make(rec, clock, max_batch_size=2, max_inflight_batches=2)
    assert batcher.max_pending == 6  # two batches running + one being assembled
    await batcher.start()
    for i in range(6):
        await batcher.put(i)
    await settle()
    assert len(rec.batches) == 2  # third closed batch waits for a slot
    assert batcher.inflight == 2
    blocked = asyncio.create_task(batcher.put(6))
    await settle()
    assert not blocked.done()  # pending == max_pending: the consumer must stop reading
    assert batcher.pending == 6
    rec.release(0)
    await wait_for(lambda: blocked.done())
    await wait_for(lambda: len(rec.batches) == 3)
    for i in range(1, 4):
        rec.release(i)
    clock.advance(1.0)
    await batcher.stop()
    assert batcher.stats.max_inflight_seen == 2
    assert batcher.stats.max_pending_seen == 6
    assert [c.item for c in rec.emitted] == list(range(7))


async def test_failed_batch_fails_each_of_its_items_only() -> None:
    rec, clock = Recorder(), FakeClock()
    rec.fail_keys = {"bad-model"}
    async with make(rec, clock, max_batch_size=2) as batcher:
        await batcher.put(0, key="good")
        await batcher.put(1, key="bad-model")
        await batcher.put(2, key="good")
        await batcher.put(3, key="bad-model")
        await wait_for(lambda: len(rec.emitted) == 4)
    outcomes = {c.item: (c.result, type(c.error).__name__) for c in rec.emitted}
    assert outcomes == {
        0: ("r0", "NoneType"),
        1: (None, "RuntimeError"),
        2: ("r2", "NoneType"),
        3: (None, "RuntimeError"),
    }
    assert sorted(items for _, items in rec.batches) == [[0, 2], [1, 3]]  # keys never mix


async def test_stop_drains_open_batches() -> None:
    rec, clock = Recorder(), FakeClock()
    batcher = make(rec, clock, max_batch_size=100, max_batch_delay_ms=10_000)
    await batcher.start()
    for i in range(5):
        await batcher.put(i)
    await batcher.stop()
    assert [c.item for c in rec.emitted] == [0, 1, 2, 3, 4]
    assert batcher.stats.closed_by_flush == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_batch_delay_ms": -1}, "max_batch_delay_ms"),
        ({"max_inflight_batches": 0}, "max_inflight_batches"),
        ({"max_pending": 1}, "max_pending"),
    ],
)
def test_rejects_bad_limits(kwargs: dict[str, Any], message: str) -> None:
    rec, clock = Recorder(), FakeClock()
    with pytest.raises(ValueError, match=message):
        make(rec, clock, **kwargs)


async def test_a_due_batch_keeps_filling_while_every_slot_is_busy() -> None:
    rec, clock = Recorder(), FakeClock()
    rec.gated = True
    async with make(rec, clock, max_batch_size=4, max_batch_delay_ms=50,
                    max_inflight_batches=1) as batcher:
        for i in range(4):
            await batcher.put(i)  # closes full and runs: the only slot is busy
        await wait_for(lambda: len(rec.batches) == 1)
        await batcher.put(4)
        clock.advance(0.060)  # the delay of the batch holding 4 passes
        await settle()
        assert len(rec.batches) == 1  # no slot: it keeps filling instead of closing with 1
        await batcher.put(5)
        await batcher.put(6)
        rec.release(0)  # the slot frees: the due batch closes with what it has
        await wait_for(lambda: len(rec.batches) == 2)
        assert rec.batches[1] == (None, [4, 5, 6])
        rec.release(1)
        await wait_for(lambda: len(rec.emitted) == 7)
        assert rec.emitted[4].batch is not None and rec.emitted[4].batch.closed_by == "delay"


async def test_a_due_batch_that_fills_while_slots_are_busy_closes_by_size() -> None:
    rec, clock = Recorder(), FakeClock()
    rec.gated = True
    async with make(rec, clock, max_batch_size=3, max_batch_delay_ms=50,
                    max_inflight_batches=1) as batcher:
        for i in range(3):
            await batcher.put(i)
        await wait_for(lambda: len(rec.batches) == 1)
        await batcher.put(3)
        clock.advance(0.100)
        await settle()
        await batcher.put(4)
        await batcher.put(5)
        rec.release(0)
        await wait_for(lambda: len(rec.batches) == 2)
        assert rec.batches[1] == (None, [3, 4, 5])
        rec.release(1)
        await wait_for(lambda: len(rec.emitted) == 6)
        assert batcher.stats.closed_by_size == 2 and batcher.stats.closed_by_delay == 0


async def test_a_batch_is_held_for_a_backlog_that_would_fill_it_then_closes_full() -> None:
    rec, clock = Recorder(), FakeClock()
    waiting = [6]  # records waiting upstream (e.g. beyond the last offset read)
    async with make(rec, clock, max_batch_size=4, max_batch_delay_ms=5,
                    max_batch_hold_ms=20, backlog=lambda: waiting[0]) as batcher:
        await batcher.put(0)
        clock.advance(0.010)  # past the 5 ms delay, an idle engine: held for the backlog
        await settle()
        assert rec.batches == []
        for i in (1, 2, 3):
            waiting[0] -= 1
            await batcher.put(i)
        await wait_for(lambda: len(rec.batches) == 1)
        assert rec.batches[0] == (None, [0, 1, 2, 3])
        assert batcher.stats.closed_by_size == 1 and batcher.stats.closed_by_delay == 0


async def test_a_held_batch_closes_at_the_hold_limit_or_when_the_backlog_cannot_fill_it(
) -> None:
    rec, clock = Recorder(), FakeClock()
    waiting = [10]
    async with make(rec, clock, max_batch_size=4, max_batch_delay_ms=5,
                    max_batch_hold_ms=20, backlog=lambda: waiting[0]) as batcher:
        await batcher.put("a")  # the backlog never arrives (e.g. the consumer is paused)
        clock.advance(0.015)
        await settle()
        assert rec.batches == []
        clock.advance(0.005)  # 20 ms after its first item: closes with what it has
        await wait_for(lambda: len(rec.batches) == 1)
        assert rec.batches[0] == (None, ["a"])

        waiting[0] = 2  # fewer than the 3 missing: holding would not fill it
        await batcher.put("b")
        clock.advance(0.005)
        await wait_for(lambda: len(rec.batches) == 2)
        assert rec.batches[1] == (None, ["b"])
        assert batcher.stats.closed_by_delay == 2


async def test_emit_many_gets_every_ready_completion_in_put_order() -> None:
    rec, clock = Recorder(), FakeClock()
    rec.gated = True
    calls: list[list[Any]] = []

    async def emit_many(completions: list[Completion[Any]]) -> None:
        calls.append([c.item for c in completions])

    batcher = MicroBatcher(rec.run_batch, emit_many=emit_many, max_batch_size=2,
                           max_batch_delay_ms=50, max_inflight_batches=2, clock=clock,
                           sleep=clock.sleep)
    async with batcher:
        batcher.put_nowait(0)
        batcher.put_nowait(1)
        batcher.put_done_nowait("bad", ValueError("bad input"))
        batcher.put_nowait(2)
        batcher.put_nowait(3)
        await wait_for(lambda: len(rec.batches) == 2)
        rec.release(1)
        await settle()
        assert calls == []  # items 0 and 1 still run: nothing may overtake them
        rec.release(0)
        await wait_for(lambda: sum(map(len, calls)) == 5)
    assert calls == [[0, 1, "bad", 2, 3]]


async def test_reserve_waits_for_room_and_lets_one_chunk_through() -> None:
    rec, clock = Recorder(), FakeClock()
    rec.gated = True
    async with make(rec, clock, max_batch_size=2, max_inflight_batches=1) as batcher:
        assert batcher.max_pending == 4
        await batcher.reserve()
        for i in range(5):  # one chunk of records read together may pass the bound
            batcher.put_nowait(i)
        assert batcher.pending == 5
        waiting = asyncio.create_task(batcher.reserve())
        await settle()
        assert not waiting.done()
        rec.release(0)
        rec.release(1)
        await wait_for(waiting.done)
        assert batcher.pending < batcher.max_pending
        rec.release(2)
        clock.advance(1.0)


def test_exactly_one_of_emit_and_emit_many() -> None:
    rec = Recorder()
    with pytest.raises(ValueError, match="exactly one"):
        MicroBatcher(rec.run_batch, max_batch_size=1, max_batch_delay_ms=0,
                     max_inflight_batches=1)


# -- screening at batch start (queue policy) ------------------------------------------------------


async def test_screen_completes_items_unrun_when_their_batch_starts_and_keeps_put_order() -> None:
    rec, clock = Recorder(), FakeClock()
    rec.gated = True
    seen: list[list[Any]] = []

    def screen(key: Hashable, items: list[Any]) -> list[Any]:
        seen.append(list(items))
        return [f"skipped {i}" if i % 2 else None for i in items]

    async with make(rec, clock, max_batch_size=4, max_inflight_batches=1,
                    screen=screen) as batcher:
        for i in range(4):
            batcher.put_nowait(i, screened=True)  # batch 0 (runs at once)
        for i in range(4, 8):
            batcher.put_nowait(i, screened=True)  # batch 1: waits for the slot
        await wait_for(lambda: len(rec.batches) == 1)
        assert seen == [[0, 1, 2, 3]]  # batch 1 is screened only when it can start
        rec.release(0)
        await wait_for(lambda: len(rec.batches) == 2)
        assert seen == [[0, 1, 2, 3], [4, 5, 6, 7]]
        rec.release(1)
        await wait_for(lambda: len(rec.emitted) == 8)
    assert [c.item for c in rec.emitted] == list(range(8))
    assert [items for _, items in rec.batches] == [[0, 2], [4, 6]]  # the engine saw only these
    assert [c.result for c in rec.emitted] == [
        "r0", "skipped 1", "r2", "skipped 3", "r4", "skipped 5", "r6", "skipped 7"]
    assert [c.batch is None for c in rec.emitted] == [False, True] * 4
    assert [c.batch.size for c in rec.emitted if c.batch] == [2, 2, 2, 2]
    assert batcher.stats.screened_out == 4 and batcher.stats.batches == 2


async def test_a_batch_whose_items_are_all_screened_out_never_runs() -> None:
    rec, clock = Recorder(), FakeClock()
    async with make(rec, clock, max_batch_size=2, screen=lambda k, items: ["x"] * len(items)
                    ) as batcher:
        batcher.put_nowait("a", screened=True)
        batcher.put_nowait("b", screened=True)
        batcher.put_nowait("c")  # the next batch: not screened
        clock.advance(0.05)
        await wait_for(lambda: len(rec.emitted) == 3)
    assert rec.batches == [(None, ["c"])]
    assert [c.result for c in rec.emitted] == ["x", "x", "rc"]
    assert (batcher.stats.batches, batcher.stats.empty_batches) == (1, 1)


async def test_batches_without_a_screened_item_skip_the_screen() -> None:
    rec, clock = Recorder(), FakeClock()
    calls: list[Any] = []

    def screen(key: Hashable, items: list[Any]) -> None:
        calls.append(items)

    async with make(rec, clock, max_batch_size=2, screen=screen) as batcher:
        batcher.put_nowait(1)
        batcher.put_nowait(2)
        await wait_for(lambda: len(rec.emitted) == 2)
    assert calls == [] and rec.batches == [(None, [1, 2])]


@pytest.mark.parametrize("screen", [
    lambda k, items: 1 / 0,  # raises
    lambda k, items: ["x"],  # wrong length
])
async def test_a_broken_screen_runs_the_batch_whole(screen: Any) -> None:
    rec, clock = Recorder(), FakeClock()
    async with make(rec, clock, max_batch_size=2, screen=screen) as batcher:
        batcher.put_nowait(1, screened=True)
        batcher.put_nowait(2, screened=True)
        await wait_for(lambda: len(rec.emitted) == 2)
    assert rec.batches == [(None, [1, 2])]
    assert [c.result for c in rec.emitted] == ["r1", "r2"]
