"""The executor server: one process per GPU runs the engines once and serves every worker of
the host through a cross-client dynamic batcher.

Why: N worker processes that each batch 1/N of the traffic hand the GPU N small batches from
N CUDA contexts (issue 17: batches of 7–8 of 64 at N = 8, the GPU 64 % busy). Here the
sub-batches that arrive from all clients within ``batch_delay_ms`` of the first one are merged,
up to the engine's largest batch, and run as one batch on the in-process executor
(:class:`~engines.executor.cuda.CudaExecutor` on a GPU, :class:`ThreadExecutor` on CPU) — the
dynamic batcher of NVIDIA Triton (``dynamic_batching { max_queue_delay_microseconds }``,
Triton's model configuration docs), with whole client sub-batches as its unit.

A batch closes when it holds ``max_batch`` rows, or ``batch_delay_ms`` after its first
sub-batch arrived *and* an executor slot is free: while every slot is busy the batch keeps
filling (it could not start anyway), so under load the engine sees full batches. A sub-batch
that does not fit in the rest of a batch is split: its first rows fill the batch and the rest
lead the next one, which is when the whole sub-batch would have run unsplit, so no row runs
later than it would have, and a queue of more than one batch gives full batches (whole
sub-batches of about 30 rows from 16 workers gave batches of 46 of 64 on the H100 host,
issue 17; Triton's dynamic batcher does not split a request, but a sub-batch here is itself
a batch of independent rows). A client is answered once every row
of its sub-batch has run. When a merged batch fails, each of its pieces is run alone, so one
client's poison request fails only that client's sub-batch (the client's pipeline then bisects
it as usual); a sub-batch with a failed piece is answered with that error once none of its
pieces is running, so the engine never reads a slot that its client has been told is free.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Any

import numpy as np

from engines.exceptions import EngineError, InputSpecError
from engines.executor.base import Executor
from engines.server.protocol import (
    LENGTH,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    ProtocolError,
    error_to_wire,
    frame,
    read_items,
    spec_to_wire,
    unpack,
    write_outputs,
)

__all__ = ["BatchStats", "ExecutorServer"]

log = logging.getLogger(__name__)


@dataclass
class BatchStats:
    """What the server's engine of one model saw, since start.

    Attributes:
        batches: Batches run on the executor (merged ones count once; the re-runs of a failed
            merged batch's pieces count too).
        rows: Items in those batches.
        sub_batches: Client requests received.
        merged: Batches made of more than one client request (or piece of one).
        split: Client requests whose rows ran in more than one batch.
        sizes: Batch size → batches of that size.
    """

    batches: int = 0
    rows: int = 0
    sub_batches: int = 0
    merged: int = 0
    split: int = 0
    sizes: collections.Counter[int] = field(default_factory=collections.Counter)

    def record(self, size: int, parts: int) -> None:
        self.batches += 1
        self.rows += size
        self.merged += parts > 1
        self.sizes[size] += 1

    def as_dict(self) -> dict[str, Any]:
        """``batches``, ``rows``, ``sub_batches``, ``merged``, ``split``, ``mean_batch``
        (rows per batch, 0.0 before the first), ``sizes`` (``{"8": 3, ...}``)."""
        return {"batches": self.batches, "rows": self.rows, "sub_batches": self.sub_batches,
                "merged": self.merged, "split": self.split,
                "mean_batch": round(self.rows / self.batches, 3) if self.batches else 0.0,
                "sizes": {str(k): v for k, v in sorted(self.sizes.items())}}


@dataclass(eq=False)
class _Request:
    """One client sub-batch, and how far its rows have got through the batcher."""

    conn: _Connection
    request_id: int
    items: list[dict[str, Any]]
    slot: int
    arrived: float = field(default_factory=time.monotonic)
    answered: bool = False
    #: Rows of the sub-batch (``items`` is emptied when it is answered; this stays).
    size: int = 0
    #: Rows handed to batches so far (the rest wait in the queue).
    taken: int = 0
    #: Pieces in a running batch.
    running: int = 0
    #: First row → the outputs of the piece that starts there.
    parts: dict[int, Mapping[str, np.ndarray]] = field(default_factory=dict)
    #: Rows whose outputs are in ``parts``.
    done: int = 0
    error: BaseException | None = None

    @property
    def left(self) -> int:
        """Rows not handed to a batch yet (0 once a piece failed: the rest is dropped)."""
        return self.size - self.taken


@dataclass(frozen=True)
class _Piece:
    """Rows ``start:stop`` of one request, in one batch."""

    request: _Request
    start: int
    stop: int

    @property
    def items(self) -> list[dict[str, Any]]:
        return self.request.items[self.start:self.stop]


class _Connection:
    """One client: its socket, its model and its attached shared-memory slots."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.slots: list[shared_memory.SharedMemory] = []
        self.pending = 0
        self.closed = False
        self.idle = asyncio.Event()
        self.idle.set()

    def send(self, message: Mapping[str, Any]) -> None:
        if not self.closed:
            self.writer.write(frame(message))

    def buffer(self, slot: int) -> memoryview | None:
        return self.slots[slot].buf if 0 <= slot < len(self.slots) else None

    def attach(self, names: Sequence[Any], size: int) -> None:
        """Map the client's slots (created and unlinked by the client).

        Raises:
            ProtocolError: A name is not a string, or a segment is missing or too small.
        """
        for name in names:
            if not isinstance(name, str):
                raise ProtocolError(f"slot name {name!r} is not a string")
            try:
                shm = shared_memory.SharedMemory(name=name)
            except (FileNotFoundError, ValueError, OSError) as exc:
                raise ProtocolError(f"cannot map the client's slot {name!r}: {exc}") from None
            # Attaching registers the segment with this process's resource tracker, which
            # would unlink the client's segment when the server exits (Python < 3.13 has no
            # track=False): the client owns it.
            with contextlib.suppress(Exception):
                resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
            self.slots.append(shm)
            if shm.size < size:
                raise ProtocolError(f"slot {name!r} has {shm.size} bytes, less than {size}")

    def release(self) -> None:
        for shm in self.slots:
            with contextlib.suppress(BufferError, OSError):
                shm.close()  # BufferError: a view is still alive; the mapping goes with it
        self.slots.clear()


class _ModelBatcher:
    """The dynamic batcher of one model (module docstring)."""

    def __init__(self, name: str, executor: Executor, max_batch: int, delay_s: float,
                 images: bool) -> None:
        self.name, self.executor, self.max_batch, self.delay_s = name, executor, max_batch, \
            delay_s
        self.images = images
        self.queue: collections.deque[_Request] = collections.deque()
        self.rows = 0
        self.stats = BatchStats()
        self._arrived = asyncio.Event()
        self._slots = asyncio.Semaphore(executor.max_inflight)
        self._running: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"batcher-{self.name}")

    def put(self, request: _Request) -> None:
        request.size = len(request.items)
        self.queue.append(request)
        self.rows += request.size
        self.stats.sub_batches += 1
        self._arrived.set()

    async def _wait(self, timeout_s: float | None) -> None:
        self._arrived.clear()
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can lose a cancellation that
        # coincides with its timeout (CPython gh-86296), and this loop would never stop
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._arrived.wait()

    async def _loop(self) -> None:
        while True:
            while not self.queue:
                await self._wait(None)
            deadline = self.queue[0].arrived + self.delay_s
            while self.rows < self.max_batch and (left := deadline - time.monotonic()) > 0:
                await self._wait(left)
            await self._slots.acquire()  # meanwhile the batch keeps filling
            batch = self._take()
            if not batch:  # only failed requests' rest was queued
                self._slots.release()
                continue
            task = asyncio.create_task(self._run(batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    def _take(self) -> list[_Piece]:
        """Up to ``max_batch`` rows from the head of the queue, splitting the last request
        that does not fit whole (module docstring)."""
        batch: list[_Piece] = []
        size = 0
        while self.queue and size < self.max_batch:
            request = self.queue[0]
            n = min(request.left, self.max_batch - size)
            if n > 0:
                if request.taken == 0 and n < request.size:
                    self.stats.split += 1
                batch.append(_Piece(request, request.taken, request.taken + n))
                request.taken += n
                request.running += 1
                size += n
            if request.left == 0:
                self.queue.popleft()
        self.rows -= size
        return batch

    async def _execute(self, batch: Sequence[_Piece]) -> dict[str, np.ndarray]:
        items = [item for piece in batch for item in piece.items]
        self.stats.record(len(items), len(batch))
        return await self.executor.run(items)

    async def _run(self, batch: list[_Piece]) -> None:
        pending = list(batch)  # pieces not finished yet

        def finish(piece: _Piece, outputs: Mapping[str, np.ndarray] | None,
                   error: BaseException | None) -> None:
            pending.remove(piece)
            self._finish(piece, outputs, error)

        try:
            try:
                outputs = await self._execute(batch)
            except EngineError as exc:
                if len(batch) == 1:
                    finish(batch[0], None, exc)
                    return
                log.info("a merged batch of %d pieces failed (%s); running each alone",
                         len(batch), exc)
                for piece in batch:
                    try:
                        finish(piece, await self._execute([piece]), None)
                    except EngineError as one:
                        finish(piece, None, one)
                return
            start = 0
            for piece in batch:
                n = piece.stop - piece.start
                finish(piece, {k: v[start:start + n] for k, v in outputs.items()}, None)
                start += n
        except Exception as exc:  # a bug: tell the clients, keep serving
            log.exception("internal error running a batch of %s", self.name)
            for piece in list(pending):
                finish(piece, None, exc)
        finally:
            self._slots.release()

    def _finish(self, piece: _Piece, outputs: Mapping[str, np.ndarray] | None,
                error: BaseException | None) -> None:
        """One piece has run: answer its request once all of its rows have, or once one
        piece failed and none is running any more (its queued rest is dropped)."""
        request = piece.request
        request.running -= 1
        if request.answered:
            return
        if error is not None:
            if request.error is None:
                request.error = error
            self.rows -= request.left
            request.taken = request.size  # the loop drops its queued rest
        elif request.error is None:
            assert outputs is not None
            request.parts[piece.start] = outputs
            request.done += piece.stop - piece.start
        if request.running:
            return
        if request.error is not None:
            self.answer(request, None, request.error)
        elif request.done == request.size:
            parts = [request.parts[k] for k in sorted(request.parts)]
            self.answer(request, parts[0] if len(parts) == 1 else
                        {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}, None)

    def answer(self, request: _Request, outputs: Mapping[str, np.ndarray] | None,
                error: BaseException | None) -> None:
        conn = request.conn
        if request.answered:
            return
        request.answered = True
        request.items = []  # drop the views of the slot before it is reused
        request.parts = {}
        try:
            if conn.closed:
                return
            if error is not None:
                conn.send({"op": "result", "id": request.request_id, "ok": False,
                           "error": error_to_wire(error)})
                return
            assert outputs is not None
            layout, inline = write_outputs(outputs, conn.buffer(request.slot))
            message: dict[str, Any] = {"op": "result", "id": request.request_id, "ok": True,
                                       "outputs": layout}
            if inline is not None:
                message["data"] = inline
            conn.send(message)
        finally:
            conn.pending -= 1
            if conn.pending == 0:
                conn.idle.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._running:
            await asyncio.gather(*list(self._running), return_exceptions=True)


class ExecutorServer:
    """Serves loaded executors to many clients over a Unix domain socket (module docstring).

    Args:
        executors: Model name → the in-process executor of its engine (loaded once, here).
        path: The socket's path (created with mode 0600; an existing socket file there is
            replaced).
        batch_delay_ms: Longest a merged batch waits for more clients after its first
            sub-batch arrived (ms); 0: merge only what is already waiting.
        image_inputs: Model name → input name → None when the engine decodes that input's
            JPEG frames itself, else why not (what clients' pipelines are told).
        max_batch: Model name → most rows in a merged batch (default the engine's
            ``max_batch_size``, or the executor's ``max_batch`` when it has one).

    Attributes:
        stats: Model name → :class:`BatchStats`.
    """

    def __init__(self, executors: Mapping[str, Executor], path: str | Path, *,
                 batch_delay_ms: float = 2.0,
                 image_inputs: Mapping[str, Mapping[str, str | None]] | None = None,
                 max_batch: Mapping[str, int] | None = None) -> None:
        if batch_delay_ms < 0:
            raise ValueError(f"batch_delay_ms must be >= 0, got {batch_delay_ms}")
        self.executors = dict(executors)
        self.path = Path(path)
        self.batch_delay_ms = batch_delay_ms
        self.image_inputs = {k: dict(v) for k, v in (image_inputs or {}).items()}
        self._max_batch = {
            name: int((max_batch or {}).get(name) or getattr(ex, "max_batch", None)
                      or ex.engine.max_batch_size)
            for name, ex in self.executors.items()
        }
        self._batchers: dict[str, _ModelBatcher] = {}
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self._handlers: set[asyncio.Task[Any]] = set()

    @property
    def stats(self) -> dict[str, BatchStats]:
        return {name: b.stats for name, b in self._batchers.items()}

    async def start(self) -> None:
        """Start the batchers and listen on :attr:`path`.

        Raises:
            OSError: The socket cannot be created there (path too long: 107 bytes on Linux).
        """
        for name, ex in self.executors.items():
            images = any(r is None for r in self.image_inputs.get(name, {}).values())
            batcher = _ModelBatcher(name, ex, self._max_batch[name],
                                    self.batch_delay_ms / 1e3, images)
            batcher.start()
            self._batchers[name] = batcher
        with contextlib.suppress(FileNotFoundError):
            if self.path.is_socket():
                self.path.unlink()
        old = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(
                self._serve, path=str(self.path), limit=MAX_FRAME_BYTES)
        finally:
            os.umask(old)

    async def close(self) -> None:
        """Stop listening, answer what is queued or running, close connections. Idempotent."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for batcher in self._batchers.values():
            while batcher.queue:  # let the batcher take what is queued
                await asyncio.sleep(0.001)
            await batcher.close()
        for conn in list(self._connections):
            conn.closed = True
            conn.writer.close()
        # A closed transport ends each handler's read (IncompleteReadError): let them end so,
        # and cancel only what is still running after a while. A cancelled handler task made
        # asyncio log a CancelledError traceback per connection (its client_connected_cb
        # callback asks a cancelled task for its exception; seen in a new-user trial).
        if self._handlers:
            _, stuck = await asyncio.wait(list(self._handlers), timeout=5.0)
            for task in stuck:
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def describe(self, name: str) -> dict[str, Any]:
        """What a client learns about one model in the ``hello`` answer."""
        ex = self.executors[name]
        info = ex.engine.info
        return {
            "inputs": [spec_to_wire(s) for s in ex.engine.inputs],
            "outputs": [spec_to_wire(s) for s in ex.engine.outputs],
            "max_batch": self._max_batch[name],
            "info": {"backend": info.backend, "model_path": info.model_path,
                     "model_sha256": info.model_sha256, "version": info.version,
                     "device": info.device, "precision": info.precision,
                     "max_batch_size": info.max_batch_size},
            "images": self.image_inputs.get(name, {}),
            "pid": os.getpid(),
        }

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        conn = _Connection(writer)
        self._connections.add(conn)
        try:
            await self._session(reader, conn)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away
        except ProtocolError as exc:
            log.warning("closing a client connection: %s", exc)
            conn.send({"op": "error", "error": error_to_wire(exc)})
        except Exception:  # a bug of ours: drop this client, keep serving the others
            log.exception("internal error serving a client; closing its connection")
        finally:
            conn.closed = True
            self._connections.discard(conn)
            writer.close()
            await conn.idle.wait()  # the engine may still read its slots
            conn.release()
            if task is not None:
                self._handlers.discard(task)

    async def _read(self, reader: asyncio.StreamReader) -> dict[str, Any]:
        (length,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
        if length > MAX_FRAME_BYTES:
            raise ProtocolError(f"a frame of {length} bytes is larger than {MAX_FRAME_BYTES}")
        return unpack(await reader.readexactly(length))

    async def _session(self, reader: asyncio.StreamReader, conn: _Connection) -> None:
        message = await self._read(reader)
        if message["op"] == "stats":  # a monitoring client: one answer, then close
            conn.send({"op": "stats", "models": {n: s.as_dict()
                                                 for n, s in self.stats.items()}})
            await conn.writer.drain()
            return
        if message["op"] != "hello" or message.get("version") != PROTOCOL_VERSION:
            raise ProtocolError(f"expected hello version {PROTOCOL_VERSION}, got "
                                f"{message['op']!r} version {message.get('version')!r}")
        name = message.get("model")
        if name not in self._batchers:
            conn.send({"op": "hello", "ok": False, "error": error_to_wire(InputSpecError(
                f"model {name!r} is not served here; served: {', '.join(self._batchers)}"))})
            await conn.writer.drain()
            return
        batcher = self._batchers[str(name)]
        described = self.describe(str(name))
        conn.send({"op": "hello", "ok": True, **described})
        await conn.writer.drain()
        attach = await self._read(reader)
        if attach["op"] != "attach":
            raise ProtocolError(f"expected attach, got {attach['op']!r}")
        if attach.get("slots"):
            conn.attach(attach["slots"], int(attach.get("slot_bytes") or 0))
        inputs = batcher.executor.engine.inputs
        while True:
            message = await self._read(reader)
            if message["op"] != "run":
                raise ProtocolError(f"unexpected {message['op']!r} frame")
            request_id, slot, rows = message.get("id"), message.get("slot", -1), \
                message.get("rows")
            if not isinstance(request_id, int) or not isinstance(slot, int) \
                    or not isinstance(rows, int):
                raise ProtocolError("a run request needs integer id, slot and rows")
            data = message.get("data")
            buffer = memoryview(data) if isinstance(data, bytes) else conn.buffer(slot)
            conn.pending += 1
            conn.idle.clear()
            request = _Request(conn, request_id, [], slot)
            try:
                if buffer is None:
                    raise ProtocolError(f"request {request_id} names slot {slot} and has no "
                                        "inline data")
                if not 1 <= rows <= batcher.max_batch:
                    raise InputSpecError(f"a request of {rows} rows; this server merges up to "
                                         f"{batcher.max_batch} per batch")
                request.items = read_items(message.get("inputs"), inputs, buffer, rows,
                                           images=batcher.images)
            except InputSpecError as exc:
                batcher.answer(request, None, exc)
                continue
            except ProtocolError:
                conn.pending -= 1
                if conn.pending == 0:
                    conn.idle.set()
                raise
            batcher.put(request)
