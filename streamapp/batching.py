"""Micro-batching with overlap, backpressure and in-order completion.

A :class:`MicroBatcher` groups items by a batch key (model and input shape: batches never mix
models). A batch closes when it holds ``max_batch_size`` items, or ``max_batch_delay_ms`` after
its *first* item arrived (tumbling-window semantics), whichever comes first — except that a batch
whose delay has passed while every in-flight slot is busy keeps filling until a slot frees (it
could not start earlier anyway), and one whose missing items are already waiting upstream
(``backlog``) keeps filling up to ``max_batch_hold_ms``: with a backlog, batches close full
instead of on the delay.
This is the dynamic batcher's rule in NVIDIA Triton (a batch is formed when the model instance
becomes free, up to the preferred size); the delay only bounds how long an item waits for
company while the engine is *idle*.

Closed batches run concurrently up to ``max_inflight_batches``; meanwhile
:meth:`MicroBatcher.put` keeps accepting items for the next batch, so assembly overlaps
inference. When ``max_pending`` items are waiting (default: the in-flight batches plus one batch
being assembled) :meth:`~MicroBatcher.reserve` (and :meth:`~MicroBatcher.put`) waits: that is
the backpressure that makes the Kafka consumer stop reading instead of buffering without limit.
Records arrive from Kafka in chunks, so the hot path reserves room once per chunk
(:meth:`~MicroBatcher.reserve`) and puts each item without awaiting
(:meth:`~MicroBatcher.put_nowait`, :meth:`~MicroBatcher.put_done_nowait`).

Completions are emitted strictly in the order items were put, whatever order batches finish in;
this is what keeps per-device order when a device's requests land in different batches. Items
rejected before batching (bad input) are put with :meth:`~MicroBatcher.put_done` and keep their
place in that order too. Every completion that is ready is handed to ``emit_many`` in one call,
so the caller can produce them with one producer call per partition.

A batch may be *screened* when it starts (``screen``): items put with ``screened=True`` are
shown to the screen hook at the moment an in-flight slot is free and the run would begin, and
the hook may complete some of them without running them (a queue policy: requests too old, or
replaced by a newer one). Those keep their place in the put order, are not counted in the
batch's size and never reach ``run_batch``; a batch left empty does not run at all. Batches
holding no screened item skip the hook: a policy that is off costs nothing per item.

Faust's ``stream.take()`` cannot be used for this: it stops filling its buffer while the body
runs, so the next batch would only start assembling after the current one finished.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from streamapp.tasks import cancel_and_wait

__all__ = ["BatchInfo", "BatcherStats", "Completion", "MicroBatcher", "Screen"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: ``run_batch(key, items) -> one result per item`` (same order). Raising fails every item.
RunBatch = Callable[[Hashable, list[T]], Awaitable[Sequence[Any]]]
#: ``emit_many(completions)``: every completion ready to go, in put order.
EmitMany = Callable[[list["Completion[T]"]], Awaitable[None]]
#: ``screen(key, items) -> None | one verdict per item``: called when a batch holding a screened
#: item starts; a verdict that is not None completes its item with that result, unrun.
Screen = Callable[[Hashable, list[T]], "Sequence[Any] | None"]


@dataclass(frozen=True)
class BatchInfo:
    """What happened to one batch. Times are ``clock()`` seconds.

    Attributes:
        batch_id: Unique within the batcher, e.g. ``"b42"``.
        size: Items in the batch.
        closed_by: ``"size"``, ``"delay"`` or ``"flush"``.
        opened_at / closed_at / started_at / finished_at: First item put, batch closed, an
            in-flight slot was free and the run began, the run returned.
    """

    batch_id: str
    size: int
    closed_by: str
    opened_at: float
    closed_at: float
    started_at: float
    finished_at: float


@dataclass
class Completion(Generic[T]):
    """The outcome of one item, delivered to ``emit`` in put order.

    Exactly one of ``result`` / ``error`` is meaningful: ``error`` is None on success.
    ``batch`` is None for items put with :meth:`MicroBatcher.put_done` and for items the
    ``screen`` hook completed unrun (``result`` is then the hook's verdict).
    """

    item: T
    result: Any = None
    error: BaseException | None = None
    batch: BatchInfo | None = None
    put_at: float = 0.0


@dataclass
class BatcherStats:
    """Counters since start."""

    items: int = 0
    batches: int = 0
    closed_by_size: int = 0
    closed_by_delay: int = 0
    closed_by_flush: int = 0
    failed_batches: int = 0
    #: Items the ``screen`` hook completed without running them.
    screened_out: int = 0
    #: Batches not run because the ``screen`` hook completed every item.
    empty_batches: int = 0
    max_pending_seen: int = 0
    max_inflight_seen: int = 0


class _Slot(Generic[T]):
    __slots__ = ("completion", "done")

    def __init__(self, completion: Completion[T], done: bool) -> None:
        self.completion = completion
        self.done = done


class _Batch(Generic[T]):
    __slots__ = ("closed", "deadline", "due", "key", "opened_at", "screened", "slots", "timer")

    def __init__(self, key: Hashable, opened_at: float, deadline: float) -> None:
        self.key = key
        self.opened_at = opened_at
        self.deadline = deadline
        self.slots: list[_Slot[T]] = []
        self.timer: asyncio.Task[None] | None = None
        self.closed = False
        #: The delay passed while every in-flight slot was busy: close when a slot frees.
        self.due = False
        #: An item was put with ``screened=True``: the screen hook sees the batch at its start.
        self.screened = False


class MicroBatcher(Generic[T]):
    """Groups items into batches, runs them concurrently, emits outcomes in put order.

    Args:
        run_batch: ``async (key, items) -> results``, one result per item in order. An exception
            fails every item of the batch with that exception.
        emit: ``async (completion) -> None``, called once per item, strictly in put order, never
            concurrently. An exception from it is logged and the item counts as emitted. None
            when ``emit_many`` is given.
        emit_many: ``async (completions) -> None``: instead of ``emit``, every completion that
            is ready (a run of done items at the head of the put order) in one call, in put
            order, never concurrently. An exception from it is logged and the items count as
            emitted.
        max_batch_size: A batch closes when it has this many items (>= 1).
        max_batch_delay_ms: A batch closes this long after its first item (>= 0; 0 = no wait
            beyond the items already queued).
        max_inflight_batches: Batches running at once (>= 1).
        max_pending: Items accepted but not yet emitted before :meth:`put` waits. Default
            ``max_batch_size * (max_inflight_batches + 1)``.
        backlog: ``() -> records`` waiting upstream that will reach :meth:`put` (e.g. the
            assigned partitions' fetch high watermarks beyond the last record read). While it
            covers what a batch lacks, a batch whose delay passed keeps filling, up to
            ``max_batch_hold_ms`` after its first item: with a backlog the engine gets full
            batches even when intake, not the engine, is the limit. None: never held.
        max_batch_hold_ms: Longest a batch is held open for a backlog (ms, from its first
            item; at least ``max_batch_delay_ms``).
        screen: ``(key, items) -> verdicts or None``, called when a batch that holds an item
            put with ``screened=True`` starts (an in-flight slot is free), with every item of
            the batch in put order. None (or an all-None list) runs the batch whole; a verdict
            that is not None completes its item unrun with ``result`` = the verdict. It must
            not raise (an exception is logged and the batch runs whole). None: no screening.
        clock: Monotonic seconds; tests pass a fake.
        sleep: ``async sleep(seconds)``; tests pass a fake that follows the fake clock.

    Raises:
        ValueError: A size or delay is out of range.
    """

    def __init__(
        self,
        run_batch: RunBatch[T],
        emit: Callable[[Completion[T]], Awaitable[None]] | None = None,
        *,
        emit_many: EmitMany[T] | None = None,
        max_batch_size: int,
        max_batch_delay_ms: float,
        max_inflight_batches: int,
        max_pending: int | None = None,
        backlog: Callable[[], int] | None = None,
        max_batch_hold_ms: float = 0.0,
        screen: Screen[T] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_batch_delay_ms < 0:
            raise ValueError(f"max_batch_delay_ms must be >= 0, got {max_batch_delay_ms}")
        if max_inflight_batches < 1:
            raise ValueError(f"max_inflight_batches must be >= 1, got {max_inflight_batches}")
        if max_pending is None:
            max_pending = max_batch_size * (max_inflight_batches + 1)
        if max_pending < max_batch_size:
            raise ValueError(
                f"max_pending ({max_pending}) must be >= max_batch_size ({max_batch_size}), "
                "or no batch could ever fill"
            )
        if (emit is None) == (emit_many is None):
            raise ValueError("give exactly one of emit and emit_many")
        self._run_batch = run_batch
        self._emit_many: EmitMany[T] = emit_many or self._one_by_one(emit)  # type: ignore[arg-type]
        self.max_batch_size = max_batch_size
        self.max_batch_delay_s = max_batch_delay_ms / 1000.0
        self.max_inflight_batches = max_inflight_batches
        self.max_pending = max_pending
        self._backlog = backlog
        self._screen = screen
        self.max_batch_hold_s = max(max_batch_hold_ms / 1000.0, self.max_batch_delay_s)
        self._clock = clock
        self._sleep = sleep

        self._order: deque[_Slot[T]] = deque()
        self._open: dict[Hashable, _Batch[T]] = {}
        self._room = asyncio.Event()
        self._room.set()
        self._inflight_slots = asyncio.Semaphore(max_inflight_batches)
        #: Set (and replaced) whenever an in-flight slot frees: wakes batches that are due.
        self._slot_freed = asyncio.Event()
        self._ready: asyncio.Queue[tuple[_Batch[T], str, float]] = asyncio.Queue()
        self._progress = asyncio.Event()
        self._drained = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._dispatcher: asyncio.Task[None] | None = None
        self._emitter: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self._inflight = 0
        self._dispatching = 0
        self._stopping = False
        self.stats = BatcherStats()

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the dispatcher and emitter tasks (idempotent)."""
        if self._dispatcher is None:
            self._dispatcher = asyncio.create_task(self._dispatch_loop(), name="batcher-dispatch")
            self._emitter = asyncio.create_task(self._emit_loop(), name="batcher-emit")

    async def stop(self, *, drain: bool = True) -> None:
        """Stop: with ``drain``, close open batches and wait until every item was emitted."""
        if drain and self._dispatcher is not None:
            await self.drain()
        self._stopping = True
        await cancel_and_wait(self._dispatcher, self._emitter, *self._tasks)
        self._dispatcher = self._emitter = None

    async def __aenter__(self) -> MicroBatcher[T]:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- input ----------------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Items put but not yet emitted."""
        return len(self._order)

    @property
    def inflight(self) -> int:
        """Batches running now."""
        return self._inflight

    async def reserve(self) -> None:
        """Wait until fewer than ``max_pending`` items are pending (backpressure).

        The items put right after (with :meth:`put_nowait` / :meth:`put_done_nowait`, without
        awaiting in between) may take the pending count past ``max_pending`` by the size of
        that chunk: the bound is ``max_pending`` plus one chunk of records read together.
        """
        while len(self._order) >= self.max_pending:
            self._room.clear()
            await self._room.wait()

    async def put(self, item: T, key: Hashable = None, *, screened: bool = False) -> None:
        """Add an item to the open batch for ``key`` (waits while ``max_pending`` are pending).

        Args:
            item: Anything; handed to ``run_batch`` and back in its :class:`Completion`.
            key: Batch key: items with different keys never share a batch.
            screened: Show its batch to the ``screen`` hook when the batch starts.
        """
        await self.reserve()
        self.put_nowait(item, key, screened=screened)

    def put_nowait(self, item: T, key: Hashable = None, *, screened: bool = False) -> None:
        """:meth:`put` without waiting for room: call :meth:`reserve` first."""
        now = self._clock()
        slot: _Slot[T] = _Slot(Completion(item, put_at=now), done=False)
        self._order.append(slot)
        self._note_pending()
        batch = self._open.get(key)
        if batch is None:
            batch = _Batch(key, now, now + self.max_batch_delay_s)
            self._open[key] = batch
            if self.max_batch_size > 1:
                batch.timer = asyncio.create_task(self._expire(batch))
        batch.slots.append(slot)
        if screened:
            batch.screened = True
        if len(batch.slots) >= self.max_batch_size:
            self._close(batch, "size")

    async def put_done(self, item: T, error: BaseException | None, result: Any = None) -> None:
        """Add an item that needs no batch (e.g. rejected input); it is emitted in put order."""
        await self.reserve()
        self.put_done_nowait(item, error, result)

    def put_done_nowait(self, item: T, error: BaseException | None, result: Any = None) -> None:
        """:meth:`put_done` without waiting for room: call :meth:`reserve` first."""
        completion = Completion(item, result=result, error=error, put_at=self._clock())
        self._order.append(_Slot(completion, done=True))
        self._note_pending()
        self._progress.set()

    async def flush(self) -> None:
        """Close every open batch now."""
        for batch in list(self._open.values()):
            self._close(batch, "flush")

    async def drain(self) -> None:
        """Flush, then wait until every item put so far has been emitted."""
        await self.flush()
        if self._order and (self._emitter is None or self._emitter.done()):
            raise RuntimeError("the batcher is not running; call start() first")
        while self._order:
            await self._drained.wait()

    def _note_pending(self) -> None:
        self._drained.clear()
        self.stats.items += 1
        self.stats.max_pending_seen = max(self.stats.max_pending_seen, len(self._order))

    # -- batches --------------------------------------------------------------------------------

    async def _expire(self, batch: _Batch[T]) -> None:
        delay = batch.deadline - self._clock()
        if delay > 0:
            await self._sleep(delay)
        # Every slot busy (running, or claimed by a closed batch waiting for one): this batch
        # could not start now anyway, so it keeps filling until a slot frees (or it is full).
        while not batch.closed and self._busy_slots() >= self.max_inflight_batches:
            batch.due = True
            await self._slot_freed.wait()
        # Records already waiting upstream (a backlog in the assigned partitions) would fill
        # this batch: keep it open for them, up to max_batch_hold_ms after its first item.
        # Closing now would only give the engine a small batch while the rest waits.
        hold_until = batch.opened_at + self.max_batch_hold_s
        while not batch.closed and self._held_for_backlog(batch, hold_until):
            batch.due = True
            await self._sleep(min(self.max_batch_delay_s / 2 or 0.001,
                                  hold_until - self._clock()))
        if not batch.closed:
            self._close(batch, "delay")

    def _held_for_backlog(self, batch: _Batch[T], hold_until: float) -> bool:
        if self._backlog is None or self._clock() >= hold_until:
            return False
        missing = self.max_batch_size - len(batch.slots)
        # a backlog smaller than what is missing cannot fill it: close now
        return missing > 0 and self._backlog() >= missing

    def _busy_slots(self) -> int:
        return self._inflight + self._ready.qsize() + self._dispatching

    def _close(self, batch: _Batch[T], reason: str) -> None:
        if batch.closed:
            return
        batch.closed = True
        if self._open.get(batch.key) is batch:
            del self._open[batch.key]
        if batch.timer is not None and batch.timer is not asyncio.current_task():
            batch.timer.cancel()
            # The cancelled timer's CancelledError holds its traceback, whose frame holds this
            # batch: with the batch holding the timer, that is a reference cycle, and every
            # item of every batch closed by size waited for the cyclic collector (~7 objects
            # a request; its pauses of 20-100 ms hit the p99, issue 17).
            batch.timer = None
        self._ready.put_nowait((batch, reason, self._clock()))

    async def _dispatch_loop(self) -> None:
        while True:
            batch, reason, closed_at = await self._ready.get()
            self._dispatching = 1  # still claims a slot between the queue and the semaphore
            try:
                await self._inflight_slots.acquire()
            finally:
                self._dispatching = 0
            task = asyncio.create_task(self._run(batch, reason, closed_at))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _screened(self, batch: _Batch[T]) -> list[_Slot[T]]:
        """The slots of ``batch`` left to run after the ``screen`` hook completed the others."""
        slots = batch.slots
        if not batch.screened or self._screen is None:
            return slots
        try:
            verdicts = self._screen(batch.key, [slot.completion.item for slot in slots])
        except Exception:
            log.exception("the batch screen failed; the batch of %d runs whole", len(slots))
            return slots
        if not verdicts:
            return slots
        if len(verdicts) != len(slots):
            log.error("the batch screen gave %d verdicts for %d items; the batch runs whole",
                      len(verdicts), len(slots))
            return slots
        kept: list[_Slot[T]] = []
        for slot, verdict in zip(slots, verdicts, strict=True):
            if verdict is None:
                kept.append(slot)
            else:
                slot.completion.result = verdict
                slot.done = True
        if len(kept) < len(slots):
            self.stats.screened_out += len(slots) - len(kept)
            self._progress.set()
        return kept

    def _release_slot(self) -> None:
        """Free an in-flight slot and wake the batches waiting for one."""
        self._inflight_slots.release()
        freed, self._slot_freed = self._slot_freed, asyncio.Event()
        freed.set()

    async def _run(self, batch: _Batch[T], reason: str, closed_at: float) -> None:
        slots = self._screened(batch)
        if not slots:  # every item was completed unrun: no engine run, no batch
            self.stats.empty_batches += 1
            self._release_slot()
            return
        self._inflight += 1
        self.stats.max_inflight_seen = max(self.stats.max_inflight_seen, self._inflight)
        batch_id = f"b{next(self._ids)}"
        started_at = self._clock()
        items = [slot.completion.item for slot in slots]
        results: Sequence[Any] | None = None
        error: BaseException | None = None
        try:
            results = await self._run_batch(batch.key, items)
            if len(results) != len(items):
                raise RuntimeError(
                    f"run_batch returned {len(results)} results for {len(items)} items"
                )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = exc
            self.stats.failed_batches += 1
        finally:
            self._inflight -= 1
            self._release_slot()
        info = BatchInfo(
            batch_id, len(items), reason, batch.opened_at, closed_at, started_at, self._clock()
        )
        self.stats.batches += 1
        setattr(self.stats, f"closed_by_{reason}", getattr(self.stats, f"closed_by_{reason}") + 1)
        for i, slot in enumerate(slots):
            slot.completion.batch = info
            if error is not None:
                slot.completion.error = error
            else:
                assert results is not None
                slot.completion.result = results[i]
            slot.done = True
        self._progress.set()

    # -- output ---------------------------------------------------------------------------------

    async def _emit_loop(self) -> None:
        order = self._order
        while True:
            while not order or not order[0].done:
                if not order:
                    self._drained.set()
                await self._progress.wait()
                self._progress.clear()
            ready: list[Completion[T]] = []
            while order and order[0].done:
                ready.append(order.popleft().completion)
            try:
                await self._emit_many(ready)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("emit failed for %d item(s), the first %r", len(ready),
                              ready[0].item)
            finally:
                if len(order) < self.max_pending:
                    self._room.set()

    @staticmethod
    def _one_by_one(emit: Callable[[Completion[T]], Awaitable[None]]) -> EmitMany[T]:
        """``emit_many`` over a per-item ``emit`` (an exception fails only its own item)."""

        async def emit_many(completions: list[Completion[T]]) -> None:
            for completion in completions:
                try:
                    await emit(completion)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("emit failed for %r", completion.item)

        return emit_many
