"""The GPU executor: batches on N CUDA streams, completion delivered to asyncio.

Layout (all allocated once, in ``__init__``, at the engine's maximum batch):

- **lanes**, one per CUDA stream: the stream, one execution context of the engine bound to the
  lane's device input/output buffers, and one *waiter thread*;
- **slots**, ``depth`` per lane: pinned host staging for the inputs and outputs of one batch and
  a completion event (``cudaEventBlockingSync``). A slot is one batch in flight, so
  ``max_inflight = streams * depth``; :meth:`CudaExecutor.run` waits for a free slot first
  (bounded in-flight work = backpressure).

One batch: take a free slot → pack the items straight into its pinned staging (in a worker
thread, so the event loop never copies megabytes; a batch of at most ``inline_pack_bytes``, 256
KiB by default, is packed and enqueued on the event loop itself: a copy of microseconds costs
less than the thread crossing, which can wait a GIL switch interval, 5 ms, issue 17) → under the
lane lock enqueue H2D copy, ``context.enqueue``, D2H copy and record the slot's event, and hand
the slot to the lane's waiter → the waiter thread sleeps in ``cudaEventSynchronize``
(blocking-sync event: no spinning), copies the outputs out of pinned memory and resolves the
asyncio future with ``loop.call_soon_threadsafe``. A batch enqueued on the event loop is first
*polled* there instead (``cudaEventQuery`` at each pass of the loop, at least every
``poll_interval_s``, for up to ``inline_poll_s``): a small batch usually completes within a
millisecond, and answering it on the loop saves the two GIL crossings of the waiter thread
(issue 17: a 0.05 ms digits batch spent a median 10 ms in ``run`` with inline packing alone).
Only a batch still running after ``inline_poll_s`` goes to the waiter thread. Work on one lane
runs in stream order, so the device buffers are reused safely; with two lanes the H2D copy of
batch k+1 overlaps the compute of batch k.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engines.base import StreamContext, StreamEngine
from engines.cuda.core import Event, Stream, set_device
from engines.cuda.runner import DeviceIO, HostIO, enqueue_batch
from engines.exceptions import (
    EngineClosedError,
    EngineError,
    EngineRuntimeError,
    InputSpecError,
)
from engines.executor.base import Executor, Item, check_batch, pack_items
from engines.preprocess.base import StagedBatch, stage_encoded, supports_gpu_images

__all__ = ["CudaExecutor", "TimelineEntry", "overlap_report"]


@dataclass(frozen=True)
class TimelineEntry:
    """CUDA-event times of one batch, in ms since the executor's reference event.

    Attributes:
        batch: Submission number (0, 1, 2, ... in the order batches took a slot).
        stream: Lane (stream) index.
        size: Items in the batch.
        h2d: (start, end) of the host→device copies.
        compute: (start, end) of the engine's work.
        d2h: (start, end) of the device→host copies.
    """

    batch: int
    stream: int
    size: int
    h2d: tuple[float, float]
    compute: tuple[float, float]
    d2h: tuple[float, float]

    def as_dict(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "stream": self.stream,
            "size": self.size,
            "h2d_ms": list(self.h2d),
            "compute_ms": list(self.compute),
            "d2h_ms": list(self.d2h),
        }


@dataclass
class _Lane:
    index: int
    stream: Stream
    device_io: DeviceIO
    context: StreamContext
    lock: threading.Lock = field(default_factory=threading.Lock)
    jobs: queue.SimpleQueue[_Job | None] = field(default_factory=queue.SimpleQueue)
    waiter: threading.Thread | None = None


@dataclass
class _Slot:
    lane: _Lane
    host_io: HostIO
    done: Event
    marks: tuple[Event, Event, Event, Event] | None


@dataclass
class _Job:
    slot: _Slot
    size: int
    seq: int
    future: asyncio.Future[dict[str, np.ndarray]]
    loop: asyncio.AbstractEventLoop


class CudaExecutor(Executor):
    """Runs batches of a :class:`~engines.base.StreamEngine` on N CUDA streams.

    Create it inside a running event loop's thread or outside any loop; use it from one event
    loop. Close it with ``await executor.close()`` (or ``async with``).

    Args:
        engine: A stream-capable engine (TensorRT, the PyTorch CUDA backend, ...). The executor
            does not close it.
        streams: CUDA streams (lanes), each with its own execution context, >= 1. Default 2.
        depth: Batches in flight per stream (pinned staging slots per lane), >= 1. Default 2:
            one batch computing while the next one's input is copied in.
        max_batch: Largest batch accepted; buffers are sized for it. Defaults to
            ``engine.max_batch_size``.
        device: CUDA device ordinal.
        record_timeline: Record four timing events per batch and keep :attr:`timeline`
            (a little overhead; for ``engines bench``).
        inline_pack_bytes: A batch whose inputs are at most this many bytes is packed and
            enqueued on the calling event loop's thread instead of a pool thread (module
            docstring). 0: always in a pool thread.
        inline_poll_s: How long (seconds) the event loop polls the completion of a batch it
            enqueued before handing it to the lane's waiter thread (module docstring). 0: the
            waiter thread always.
        poll_interval_s: Longest time between two polls of such a batch while the loop is
            idle (seconds; asyncio's timers resolve to about 1 ms on Linux).

    Raises:
        TypeError: ``engine`` cannot enqueue on a stream.
        ValueError: ``streams``/``depth``/``max_batch`` out of range.
        CudaOutOfMemoryError: Buffers do not fit (fewer streams or a smaller max batch).
    """

    engine: StreamEngine

    def __init__(
        self,
        engine: StreamEngine,
        *,
        streams: int = 2,
        depth: int = 2,
        max_batch: int | None = None,
        device: int = 0,
        record_timeline: bool = False,
        inline_pack_bytes: int = 256 * 1024,
        inline_poll_s: float = 0.005,
        poll_interval_s: float = 0.0002,
    ) -> None:
        if not isinstance(engine, StreamEngine):
            raise TypeError(
                f"{type(engine).__name__} cannot enqueue on a CUDA stream; use ThreadExecutor "
                "or a GPU backend (tensorrt, torch)"
            )
        if streams < 1 or depth < 1:
            raise ValueError(f"streams and depth must be >= 1, got {streams} and {depth}")
        self.engine = engine
        self.max_batch = max_batch or engine.max_batch_size
        if not 1 <= self.max_batch <= engine.max_batch_size:
            raise ValueError(
                f"max_batch must be in 1..{engine.max_batch_size}, got {self.max_batch}"
            )
        self.streams = streams
        self.depth = depth
        self.max_inflight = streams * depth
        self.device = device
        self.record_timeline = record_timeline
        self.timeline: list[TimelineEntry] = []
        #: Bytes of one item's inputs; None where a dimension is dynamic or the engine decodes
        #: frames itself (those batches are always packed in a pool thread).
        self._item_bytes: int | None = None
        self.inline_pack_bytes = inline_pack_bytes
        self.inline_poll_s = inline_poll_s
        self.poll_interval_s = poll_interval_s
        #: Batches answered by polling on the loop / handed to the waiter thread after polling.
        self.polled = 0
        self.poll_handoffs = 0
        if not supports_gpu_images(engine):
            shapes = [(tuple(spec.item_shape), np.dtype(spec.dtype)) for spec in engine.inputs]
            if all(d >= 0 for shape, _ in shapes for d in shape):
                self._item_bytes = sum(int(np.prod(shape)) * dt.itemsize for shape, dt in shapes)

        self._closed = False
        self._inflight = 0
        self._seq = 0
        self._lanes: list[_Lane] = []
        self._slots: list[_Slot] = []
        self._reference: Event | None = None
        self._outstanding: set[asyncio.Future[dict[str, np.ndarray]]] = set()
        try:
            set_device(device)
            self._build()
        except BaseException:
            self._release()
            raise
        # Interleave lanes so consecutive batches go to different streams.
        self._free: collections.deque[_Slot] = collections.deque(
            self._slots[d * streams + s] for d in range(depth) for s in range(streams)
        )
        self._slot_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.max_inflight, thread_name_prefix="cuda-pack"
        )
        for lane in self._lanes:
            lane.waiter = threading.Thread(
                target=self._wait_loop, args=(lane,), name=f"cuda-waiter-{lane.index}", daemon=True
            )
            lane.waiter.start()

    # ------------------------------------------------------------------------------------------
    # construction and teardown

    def _build(self) -> None:
        for index in range(self.streams):
            stream = Stream()
            try:
                # bind_stream's contract: device buffers hold engine.max_batch_size rows.
                device_io = DeviceIO(self.engine, self.engine.max_batch_size)
            except BaseException:
                stream.close()
                raise
            try:
                context = self.engine.bind_stream(stream.handle, device_io.addresses)
            except BaseException:
                device_io.close()
                stream.close()
                raise
            self._lanes.append(_Lane(index, stream, device_io, context))
        for _ in range(self.depth):
            for lane in self._lanes:
                host_io = HostIO(self.engine, self.max_batch)
                try:
                    done = Event(blocking=True)
                except BaseException:
                    host_io.close()
                    raise
                marks = None
                if self.record_timeline:
                    marks = (
                        Event(timing=True),
                        Event(timing=True),
                        Event(timing=True),
                        Event(timing=True),
                    )
                self._slots.append(_Slot(lane, host_io, done, marks))
        if self.record_timeline:
            self._reference = Event(timing=True)
            self._reference.record(self._lanes[0].stream)
            self._reference.synchronize()

    def _release(self) -> None:
        """Free everything (after all work finished). Safe on a partly built executor."""
        errors: list[BaseException] = []

        def attempt(fn: Any) -> None:
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)

        for lane in self._lanes:
            attempt(lane.stream.synchronize)
        for slot in self._slots:
            attempt(slot.done.close)
            for mark in slot.marks or ():
                attempt(mark.close)
            attempt(slot.host_io.close)
        for lane in self._lanes:
            attempt(lane.context.close)
            attempt(lane.device_io.close)
            attempt(lane.stream.close)
        if self._reference is not None:
            attempt(self._reference.close)
        self._slots.clear()
        self._lanes.clear()
        if errors:
            raise errors[0]

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host memory held (all slots)."""
        return sum(slot.host_io.nbytes for slot in self._slots)

    @property
    def device_bytes(self) -> int:
        """Device memory held for IO buffers (all lanes; the engine's own memory not counted)."""
        return sum(lane.device_io.nbytes for lane in self._lanes)

    async def close(self) -> None:
        """Wait for batches in flight, stop the waiter threads, free streams and buffers.

        Idempotent. Batches submitted after ``close()`` started fail with EngineClosedError.
        """
        if self._closed:
            return
        self._closed = True
        for waiter in self._slot_waiters:
            if not waiter.done():
                waiter.set_exception(EngineClosedError("the executor was closed"))
        if self._outstanding:
            await asyncio.gather(*list(self._outstanding), return_exceptions=True)
        for lane in self._lanes:
            lane.jobs.put(None)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._shutdown_threads)
        self._release()

    def _shutdown_threads(self) -> None:
        for lane in self._lanes:
            if lane.waiter is not None:
                lane.waiter.join()
        self._pool.shutdown(wait=True)

    async def __aenter__(self) -> CudaExecutor:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------------------------------
    # submission

    async def _acquire(self) -> _Slot:
        while not self._free:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._slot_waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._slot_waiters:
                    self._slot_waiters.remove(waiter)
            if self._closed:
                raise EngineClosedError("the executor is closed")
        return self._free.popleft()

    def _release_slot(self, slot: _Slot) -> None:
        self._free.append(slot)
        # Wake every waiter: each re-checks for a free slot (a woken waiter may have been
        # cancelled meanwhile, so waking only one could leave a slot idle).
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    async def submit(self, items: Sequence[Item]) -> asyncio.Future[dict[str, np.ndarray]]:
        """Start one batch and return a future of its outputs without waiting for them.

        Waits only for a free slot (in-flight bound). Futures of successive ``submit`` calls can
        be awaited in submission order (see :meth:`map`); each resolves to outputs as
        :meth:`run` returns them, or to its exception.

        Raises:
            InputSpecError: Empty batch or more than ``max_batch`` items.
            EngineClosedError: The executor is closed.
        """
        check_batch(items, closed=self._closed, max_batch=self.max_batch, who="the executor's")
        slot = await self._acquire()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[dict[str, np.ndarray]] = loop.create_future()
        job = _Job(slot, len(items), self._seq, future, loop)
        self._seq += 1
        self._inflight += 1
        self._outstanding.add(future)
        future.add_done_callback(self._outstanding.discard)
        small = self._item_bytes is not None \
            and len(items) * self._item_bytes <= self.inline_pack_bytes
        if small:
            # small: no thread crossing (module docstring)
            self._submit_batch(job, items, poll=self.inline_poll_s > 0)
        else:
            self._pool.submit(self._submit_batch, job, items)
        return future

    async def run(self, items: Sequence[Item]) -> dict[str, np.ndarray]:
        """Pack ``items``, run them as one batch on a free stream, return the outputs.

        Args:
            items: 1..``max_batch`` items, each input name → ``dtype[*item_shape]``.

        Returns:
            Output name → ``dtype[len(items), ...]`` (fresh arrays owned by the caller).

        Raises:
            InputSpecError: An item does not fit the engine's inputs (not retriable).
            EngineRuntimeError: CUDA or the backend failed (retriable).
            EngineClosedError: The executor is closed.
        """
        return await (await self.submit(items))

    async def map(
        self, batches: Iterable[Sequence[Item]], *, ordered: bool = True
    ) -> AsyncIterator[dict[str, np.ndarray]]:
        """Run many batches, keeping up to ``max_inflight`` in flight, yielding their outputs.

        Args:
            batches: Batches of items (see :meth:`run`).
            ordered: Yield in submission order (default); else in completion order.

        Raises:
            The first batch's exception, when a batch fails (later batches still finish).
        """
        pending: collections.deque[asyncio.Future[dict[str, np.ndarray]]] = collections.deque()
        for items in batches:
            pending.append(await self.submit(items))
            while pending and (pending[0].done() if ordered else any(f.done() for f in pending)):
                if ordered:
                    yield pending.popleft().result()
                else:
                    ready = next(f for f in pending if f.done())
                    pending.remove(ready)
                    yield ready.result()
        while pending:
            if ordered:
                yield await pending.popleft()
            else:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    pending.remove(fut)
                    yield fut.result()

    # ------------------------------------------------------------------------------------------
    # worker side (pack thread, waiter thread)

    def _submit_batch(self, job: _Job, items: Sequence[Item], poll: bool = False) -> None:
        """Pool thread (or the event loop, for a small batch): pack into the slot's pinned
        staging, then enqueue on the lane's stream. ``poll`` (event loop only): poll the
        completion on the loop before handing the batch to the waiter thread."""
        slot, lane = job.slot, job.slot.lane
        staged: StagedBatch | None = None
        filled: frozenset[str] = frozenset()
        try:
            if supports_gpu_images(self.engine):  # frames the engine decodes itself
                staged = stage_encoded(items, self.engine.inputs)
                items = staged.items
                filled = staged.filled(len(items))
            for spec in self.engine.inputs:
                if spec.name not in filled:
                    pack_items(items, spec, out=slot.host_io.inputs[spec.name])
        except EngineError as exc:
            self._finish(job, None, exc)
            return
        except Exception as exc:
            self._finish(job, None, InputSpecError(f"could not pack the batch: {exc!r}"))
            return
        with lane.lock:
            try:
                set_device(self.device)
                if staged is not None and staged.images:
                    lane.context.stage_images(staged.images)  # type: ignore[attr-defined]
                enqueue_batch(
                    self.engine,
                    lane.context,
                    lane.stream,
                    slot.host_io,
                    lane.device_io,
                    job.size,
                    slot.marks,
                    skip_inputs=filled,
                )
                slot.done.record(lane.stream)
            except BaseException as exc:
                error = _as_engine_error(exc, "enqueueing the batch")
                # Part of the batch may be queued: let it drain before the slot is reused.
                try:
                    lane.stream.synchronize()
                except EngineError:
                    pass
                self._finish(job, None, error)
                return
            if not poll or slot.marks is not None:
                lane.jobs.put(job)
                return
        job.loop.call_soon(self._poll, job, job.loop.time() + self.inline_poll_s)

    def _poll(self, job: _Job, give_up_at: float) -> None:
        """Event loop: answer a batch whose event fired, else poll again, else (after
        ``inline_poll_s``) hand it to the lane's waiter thread."""
        slot = job.slot
        try:
            fired = slot.done.query()
            if fired:
                outputs = self._outputs(job)
        except BaseException as exc:
            self._resolve(job, None, _as_engine_error(exc, "waiting for the batch"))
            return
        if fired:
            self.polled += 1
            self._resolve(job, outputs, None)
        elif job.loop.time() >= give_up_at:
            self.poll_handoffs += 1
            slot.lane.jobs.put(job)
        else:
            job.loop.call_later(self.poll_interval_s, self._poll, job, give_up_at)

    def _outputs(self, job: _Job) -> dict[str, np.ndarray]:
        """Copies of the first ``job.size`` rows of the slot's pinned outputs (the slot is
        reused once the job resolves)."""
        return {
            spec.name: job.slot.host_io.outputs[spec.name][: job.size].copy()
            for spec in self.engine.outputs
        }

    def _wait_loop(self, lane: _Lane) -> None:
        """Waiter thread of one lane: jobs complete in stream order, so wait for them FIFO."""
        try:
            set_device(self.device)
        except EngineError:
            pass
        while (job := lane.jobs.get()) is not None:
            slot = job.slot
            try:
                slot.done.synchronize()
                outputs = self._outputs(job)
                if slot.marks is not None and self._reference is not None:
                    t = [mark.elapsed_ms(self._reference) for mark in slot.marks]
                    self.timeline.append(
                        TimelineEntry(
                            job.seq, lane.index, job.size, (t[0], t[1]), (t[1], t[2]), (t[2], t[3])
                        )
                    )
            except BaseException as exc:
                self._finish(job, None, _as_engine_error(exc, "waiting for the batch"))
                continue
            self._finish(job, outputs, None)

    def _finish(
        self, job: _Job, outputs: dict[str, np.ndarray] | None, error: BaseException | None
    ) -> None:
        """Any thread: hand the outcome to the event loop, which frees the slot."""
        try:
            job.loop.call_soon_threadsafe(self._resolve, job, outputs, error)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _resolve(
        self, job: _Job, outputs: dict[str, np.ndarray] | None, error: BaseException | None
    ) -> None:
        """Event loop: resolve the future and return the slot."""
        self._inflight -= 1
        self._release_slot(job.slot)
        if job.future.done():  # cancelled by the caller
            return
        if error is not None:
            job.future.set_exception(error)
        else:
            assert outputs is not None
            job.future.set_result(outputs)

    # ------------------------------------------------------------------------------------------

    def overlap_report(self) -> dict[str, Any]:
        """Copy/compute overlap in :attr:`timeline` (needs ``record_timeline=True``).

        Batches are numbered in the order the GPU started computing them (streams interleave,
        so submission order is not GPU order). For consecutive batches k, k+1 in that order:
        how long (ms) the H2D copy of k+1 overlapped the compute of k.
        """
        return overlap_report([e.as_dict() for e in self.timeline])


def overlap_report(entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """:meth:`CudaExecutor.overlap_report` for timeline entries as dicts (``h2d_ms``,
    ``compute_ms``: ``[start, end]``), e.g. read back from ``bench.json``."""
    ordered = sorted(entries, key=lambda e: e["compute_ms"][0])
    pairs: list[dict[str, Any]] = []
    for a, b in itertools.pairwise(ordered):
        start = max(b["h2d_ms"][0], a["compute_ms"][0])
        end = min(b["h2d_ms"][1], a["compute_ms"][1])
        pairs.append(
            {
                "batch": a["batch"],
                "next": b["batch"],
                "streams": [a["stream"], b["stream"]],
                "overlap_ms": max(0.0, end - start),
                "next_h2d_ms": b["h2d_ms"][1] - b["h2d_ms"][0],
            }
        )
    overlapping = [p for p in pairs if p["overlap_ms"] > 0]
    return {
        "order": "gpu compute start",
        "pairs": pairs,
        "overlapping_pairs": len(overlapping),
        "total_pairs": len(pairs),
        "h2d_overlaps_compute": bool(overlapping),
    }


def _as_engine_error(exc: BaseException, doing: str) -> EngineError:
    if isinstance(exc, EngineError):
        return exc
    if isinstance(exc, MemoryError):
        return EngineRuntimeError(f"out of host memory while {doing}")
    if isinstance(exc, Exception):
        error = EngineRuntimeError(f"the backend failed while {doing}: {exc!r}")
        error.__cause__ = exc
        return error
    # Not an Exception (e.g. SystemExit in a waiter thread): a bug, not retriable.
    return EngineError(f"unexpected {exc!r} while {doing}")
