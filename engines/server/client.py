"""The client side of the executor server: :class:`SharedExecutor` implements the
:class:`~engines.executor.base.Executor` interface, so a worker's pipeline runs unchanged on a
GPU that it shares with the host's other workers.

Threads, as in :class:`~engines.executor.cuda.CudaExecutor`, so that the executor works from
any event loop and can connect before one exists (a worker loads its models before Faust
starts its loop): a small pool writes a batch into its shared-memory slot and sends the header
(off the event loop), one reader thread per connection receives answers, copies the outputs out
of the slot and resolves the caller's future with ``loop.call_soon_threadsafe``.

A server that is down is not the batch's fault, so it does not fail the batch at once: when
the connection breaks, a background thread reconnects with backoff (0.05 s doubling to 1 s),
:attr:`SharedExecutor.connected` is False meanwhile (the worker's ``/ready`` says so), and each
call of :meth:`SharedExecutor.run` waits for the reconnect and sends its batch again, which it
still holds (at-least-once: a batch whose outputs were lost with the server simply runs again).
Only a server that stays away for ``wait_s`` from the call's start, or a batch that the server
died with ``max_resubmits`` + 1 times (it may be what kills it), fails with the retriable
:class:`~engines.exceptions.ExecutorUnavailableError`; the stream processor then retries it
through its retry topic as any transient failure. A waiting call holds its caller's in-flight
slot, so the pipeline stops reading while the server is down (backpressure).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np

from engines.base import Engine, EngineInfo, TensorSpec
from engines.exceptions import (
    EngineError,
    ExecutorUnavailableError,
)
from engines.executor.base import Executor, Item, check_batch
from engines.server.protocol import (
    LENGTH,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    ProtocolError,
    error_from_wire,
    frame,
    read_outputs,
    slot_bytes,
    spec_from_wire,
    unpack,
    write_items,
)

__all__ = ["RemoteEngine", "RemoteImageEngine", "SharedExecutor", "query_stats"]

log = logging.getLogger(__name__)

_RECONNECT_MIN_S, _RECONNECT_MAX_S = 0.05, 1.0


class _Lost(Exception):
    """A batch's connection went away before its answer came (internal to the client: the
    caller of :meth:`SharedExecutor.run` waits and re-submits; see the module docstring)."""

    def __init__(self, message: str, *, in_flight: bool) -> None:
        super().__init__(message)
        #: True when the server may have had the batch (it died with it), False when the
        #: batch never left this process.
        self.in_flight = in_flight


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("the executor server closed the connection")
        got += k
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> dict[str, Any]:
    (length,) = LENGTH.unpack(_recv_exact(sock, LENGTH.size))
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"a frame of {length} bytes is larger than {MAX_FRAME_BYTES}")
    return unpack(_recv_exact(sock, length))


def _connect(path: str, timeout_s: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(path)
    except BaseException:
        sock.close()
        raise
    return sock


def query_stats(path: str | Path, timeout_s: float = 5.0) -> dict[str, dict[str, Any]]:
    """The server's batch counters: model name → :meth:`BatchStats.as_dict
    <engines.server.BatchStats.as_dict>` (what its engines saw: batches, rows, mean batch).

    Raises:
        ExecutorUnavailableError: No server answers at ``path``.
    """
    try:
        with _connect(str(path), timeout_s) as sock:
            sock.sendall(frame({"op": "stats"}))
            answer = _recv_frame(sock)
    except (OSError, ConnectionError) as exc:
        raise ExecutorUnavailableError(f"no executor server answers at {path}: {exc}") from None
    models = answer.get("models")
    return models if isinstance(models, dict) else {}


class RemoteEngine(Engine):
    """The engine of a model served by an executor server, as its clients see it: the IO
    specs and :class:`EngineInfo` the server reported. Batches run through
    :meth:`SharedExecutor.run`; :meth:`infer` is not available here."""

    def __init__(self, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
                 info: EngineInfo, images: Mapping[str, str | None]) -> None:
        self.inputs, self.outputs, self.info = tuple(inputs), tuple(outputs), info
        self.images = dict(images)

    def infer_impl(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise EngineError("a served engine runs batches through its SharedExecutor.run(), "
                          "not Engine.infer()")


class RemoteImageEngine(RemoteEngine):
    """A served engine that decodes JPEG frames itself (see
    :class:`~engines.preprocess.ImageDecodingEngine`): the server configured it when it loaded
    the model; :meth:`configure_images` reports what the server said."""

    def configure_images(self, input_name: str, spec: Any) -> str | None:
        """None when the server's engine decodes ``input_name``'s frames, else why not."""
        return self.images.get(input_name, f"the server does not decode {input_name!r} frames")


@dataclass
class _Pending:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[dict[str, np.ndarray]]
    slot: int


def _free_slots(slots: list[shared_memory.SharedMemory]) -> None:
    """Close and unlink a client's shared-memory slots (its owner: the server only maps them)."""
    for shm in slots:
        with contextlib.suppress(BufferError, OSError):
            shm.close()  # BufferError: a view is still alive; the mapping goes with it
        with contextlib.suppress(FileNotFoundError, OSError):
            shm.unlink()
    slots.clear()


class SharedExecutor(Executor):
    """Runs one model's batches on an :class:`~engines.server.ExecutorServer` (module
    docstring). Connects in ``__init__``.

    Args:
        path: The server's Unix socket.
        model: The model's name on the server.
        max_inflight: Batches in flight (= shared-memory slots of this client), >= 1.
        connect_timeout_s: How long connecting and the handshake may take (s).
        shm: Put payloads in shared memory (default); False: inline in the socket frames.
        wait_s: How long :meth:`run` waits for an unreachable server to come back (s, from
            the call's start) before it fails with :class:`ExecutorUnavailableError`; 0: it
            fails at once.
        max_resubmits: How often :meth:`run` sends a batch again after the server died with
            it (a batch that kills the server each time fails after this many, retriably).

    Attributes:
        engine: A :class:`RemoteEngine` (or :class:`RemoteImageEngine`) with the served IO
            specs; closing it does nothing to the server.
        max_batch: Most items :meth:`run` accepts (the server's merged batch limit).

    Raises:
        ExecutorUnavailableError: No server answers at ``path``.
        InputSpecError: The server does not serve ``model``.
        ValueError: ``max_inflight`` < 1, or ``wait_s`` or ``max_resubmits`` < 0.
    """

    engine: RemoteEngine

    def __init__(self, path: str | Path, model: str, *, max_inflight: int = 2,
                 connect_timeout_s: float = 10.0, shm: bool = True, wait_s: float = 60.0,
                 max_resubmits: int = 2) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        if wait_s < 0 or max_resubmits < 0:
            raise ValueError(f"wait_s and max_resubmits must be >= 0, got {wait_s} and "
                             f"{max_resubmits}")
        self.wait_s, self.max_resubmits = float(wait_s), max_resubmits
        self.path, self.model = str(path), model
        self.max_inflight = max_inflight
        self.connect_timeout_s = connect_timeout_s
        self._use_shm = shm
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._generation = 0
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count()
        self._slots: list[shared_memory.SharedMemory] = []
        self._unlink: Callable[[], Any] = lambda: None
        self._free: collections.deque[int] = collections.deque(range(max_inflight))
        self._sem: asyncio.Semaphore | None = None
        self._inflight = 0
        self._closed = False
        self._reconnecting = False
        self._stop = threading.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_inflight, thread_name_prefix="shared-exec")
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        #: Connections lost, and batches sent again after one was lost.
        self.disconnects = 0
        self.resubmits = 0
        try:
            self._connect()
        except (OSError, ConnectionError) as exc:
            self._pool.shutdown(wait=False)
            raise ExecutorUnavailableError(
                f"cannot reach the executor server at {self.path} ({exc}); start it with "
                "`streamapp gpu-server`, or run the workers with `streamapp worker --processes "
                "N --gpu-executor shared`, which starts one per GPU") from None
        except BaseException:
            self._pool.shutdown(wait=False)
            self._release_slots()
            raise

    # -- connection ---------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether the server is reachable now (False between a lost connection and the
        reconnect)."""
        return self._sock is not None

    @property
    def inflight(self) -> int:
        return self._inflight

    def _connect(self) -> None:
        """Connect, handshake, (re)attach the slots and start the reader thread."""
        sock = _connect(self.path, self.connect_timeout_s)
        try:
            sock.sendall(frame({"op": "hello", "version": PROTOCOL_VERSION,
                                "model": self.model, "pid": os.getpid()}))
            hello = _recv_frame(sock)
            if hello.get("op") != "hello":
                raise ProtocolError(f"expected a hello answer, got {hello.get('op')!r}")
            if not hello.get("ok"):
                raise error_from_wire(hello.get("error"), where=f"server at {self.path}")
            self._learn(hello)
            if self._use_shm and not self._slots:
                self._create_slots()
            sock.sendall(frame({"op": "attach", "slots": [s.name for s in self._slots],
                                "slot_bytes": self.slot_bytes}))
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        with self._lock:
            self._generation += 1
            self._sock = sock
            generation = self._generation
        threading.Thread(target=self._read_loop, args=(sock, generation), daemon=True,
                         name=f"shared-exec-reader-{self.model}").start()
        self._wake_waiters()

    def _wake_waiters(self) -> None:
        with self._lock:
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(_wake, future)

    def _learn(self, hello: Mapping[str, Any]) -> None:
        try:
            inputs = [spec_from_wire(s) for s in hello["inputs"]]
            outputs = [spec_from_wire(s) for s in hello["outputs"]]
            info = EngineInfo(**{k: hello["info"][k] for k in (
                "backend", "model_path", "model_sha256", "version", "device", "precision",
                "max_batch_size")}, extra={"served_by": self.path, "server_pid":
                                            hello.get("pid")})
            self.max_batch = int(hello["max_batch"])
            images = {str(k): (None if v is None else str(v))
                      for k, v in dict(hello.get("images") or {}).items()}
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"bad hello answer from {self.path}: {exc!r}") from None
        current = getattr(self, "engine", None)
        if current is None or (current.inputs, current.outputs, current.images) != (
                tuple(inputs), tuple(outputs), images):
            if current is not None:  # a restarted server with another model: say so
                log.warning("the executor server at %s now serves %s with other IO specs",
                            self.path, self.model)
            cls = RemoteImageEngine if images else RemoteEngine
            self.engine = cls(inputs, outputs, info, images)
        self.slot_bytes = slot_bytes(inputs, outputs, self.max_batch)

    def _create_slots(self) -> None:
        token = uuid.uuid4().hex[:8]
        slots: list[shared_memory.SharedMemory] = []
        # Unlinked by close(), else when this object is collected or the process exits: a
        # worker's shutdown can end before its models are closed (Faust stops the agents),
        # and then every segment stayed in /dev/shm until Python's resource tracker removed
        # it with a "leaked shared_memory objects" warning (16 of 16 workers on the H200,
        # 2026-12-03).
        self._unlink = weakref.finalize(self, _free_slots, slots)
        self._slots = slots
        try:
            for i in range(self.max_inflight):
                slots.append(shared_memory.SharedMemory(
                    name=f"streamapp-{os.getpid()}-{token}-{i}", create=True,
                    size=self.slot_bytes))
        except OSError as exc:  # e.g. /dev/shm too small: payloads go through the socket
            log.warning("cannot create %d shared-memory slots of %d bytes (%s); batches go "
                        "through the socket", self.max_inflight, self.slot_bytes, exc)
            self._release_slots()

    def _release_slots(self) -> None:
        self._unlink()  # once: a finalizer runs at most once
        self._slots = []

    def _read_loop(self, sock: socket.socket, generation: int) -> None:
        reason: BaseException | None = None
        try:
            while True:
                message = _recv_frame(sock)
                if message.get("op") == "result":
                    self._on_result(message)
                elif message.get("op") == "error":
                    raise error_from_wire(message.get("error"), where="server")
        except (OSError, ConnectionError, EngineError) as exc:
            reason = exc
        self._lost(generation, reason)

    def _on_result(self, message: Mapping[str, Any]) -> None:
        with self._lock:
            pending = self._pending.pop(message.get("id"), None)  # type: ignore[arg-type]
        if pending is None:
            return
        outputs: dict[str, np.ndarray] | None = None
        error: BaseException | None = None
        try:
            if message.get("ok"):
                data = message.get("data")
                buffer = (memoryview(data) if isinstance(data, bytes)
                          else self._slots[pending.slot].buf)
                if buffer is None:
                    raise ProtocolError("an answer in shared memory to a client without it")
                outputs = read_outputs(message.get("outputs"), buffer)
            else:
                error = error_from_wire(message.get("error"), where=f"server at {self.path}")
        except EngineError as exc:
            error = exc
        self._hand_over(pending, outputs, error)

    def _lost(self, generation: int, reason: BaseException | None) -> None:
        with self._lock:
            if generation != self._generation or self._sock is None:
                return
            sock, self._sock = self._sock, None
            pending, self._pending = self._pending, {}
            self.disconnects += 1
        with contextlib.suppress(OSError):
            sock.close()
        if not self._closed:
            log.warning("lost the executor server at %s (%s); reconnecting, %d batch(es) in "
                        "flight are re-submitted once it is back (up to %g s)", self.path,
                        reason, len(pending), self.wait_s)
        error = _Lost(f"the executor server at {self.path} went away with the batch in "
                      f"flight ({reason})", in_flight=True)
        for entry in pending.values():
            self._hand_over(entry, None, error)
        self._start_reconnect()

    def _start_reconnect(self) -> None:
        with self._lock:
            if self._closed or self._reconnecting:
                return
            self._reconnecting = True
        threading.Thread(target=self._reconnect_loop, daemon=True,
                         name=f"shared-exec-reconnect-{self.model}").start()

    def _reconnect_loop(self) -> None:
        delay = _RECONNECT_MIN_S
        try:
            while not self._closed:
                try:
                    self._connect()
                    log.warning("reconnected to the executor server at %s", self.path)
                    return
                except (OSError, ConnectionError, EngineError):
                    pass
                if self._stop.wait(delay):
                    return
                delay = min(_RECONNECT_MAX_S, delay * 2)
        finally:
            with self._lock:
                self._reconnecting = False

    # -- batches ------------------------------------------------------------------------------

    def _hand_over(self, pending: _Pending, outputs: dict[str, np.ndarray] | None,
                   error: BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            pending.loop.call_soon_threadsafe(self._resolve, pending, outputs, error)

    def _resolve(self, pending: _Pending, outputs: dict[str, np.ndarray] | None,
                 error: BaseException | None) -> None:
        self._inflight -= 1
        self._free.append(pending.slot)
        if self._sem is not None:
            self._sem.release()
        if pending.future.done():
            return
        if error is not None:
            pending.future.set_exception(error)
        else:
            pending.future.set_result(outputs)  # type: ignore[arg-type]

    def _send(self, request_id: int, slot: int, items: Sequence[Item]) -> None:
        """Pool thread: lay the items out (into the slot) and send the header."""
        buffer = self._slots[slot].buf if self._slots else None
        layout, inline = write_items(items, self.engine.inputs, buffer)
        message: dict[str, Any] = {"op": "run", "id": request_id, "rows": len(items),
                                   "slot": slot if inline is None else -1, "inputs": layout}
        if inline is not None:
            message["data"] = inline
        data = frame(message)
        with self._send_lock:
            sock = self._sock
            if sock is None:
                raise ConnectionError("not connected")
            sock.sendall(data)

    async def run(self, items: Sequence[Item]) -> dict[str, np.ndarray]:
        """Run ``items`` as (part of) one batch on the server's engine. While the server is
        unreachable, waits for it to come back (up to ``wait_s`` from the call) and sends the
        batch again (module docstring).

        Args:
            items: 1..``max_batch`` items, each input name → ``dtype[*item_shape]`` (or an
                :class:`~engines.preprocess.EncodedImage` when the server's engine decodes
                that input's frames).

        Returns:
            Output name → ``dtype[len(items), ...]`` (fresh arrays owned by the caller).

        Raises:
            InputSpecError: An item does not fit the engine's inputs (not retriable).
            ExecutorUnavailableError: The server stayed unreachable for ``wait_s``, or died
                with the batch more than ``max_resubmits`` times (retriable).
            EngineRuntimeError: The server's engine failed (retriable).
            EngineClosedError: The executor is closed.
        """
        check_batch(items, closed=self._closed, max_batch=self.max_batch, who="the server's")
        deadline = time.monotonic() + self.wait_s
        lost_in_flight = 0
        while True:
            await self._until_connected(deadline)
            try:
                return await self._submit(items)
            except _Lost as exc:
                lost_in_flight += exc.in_flight
                if self._closed:  # the worker stops: retriable, the batch is not at fault
                    raise ExecutorUnavailableError(
                        f"{exc}; the shared executor was closed meanwhile") from None
                if lost_in_flight > self.max_resubmits:
                    raise ExecutorUnavailableError(
                        f"{exc}; the server died with this batch {lost_in_flight} times, "
                        f"more than max_resubmits={self.max_resubmits}: the batch may be what "
                        "kills it (the server's log says why it exited)") from None
                if time.monotonic() >= deadline:
                    raise ExecutorUnavailableError(
                        f"{exc}; not back within {self.wait_s:g} s (gpu_server_wait_s): is "
                        "the server restarting (its log, `streamapp worker --processes N` "
                        "restarts it)?") from None
                self.resubmits += 1

    async def _until_connected(self, deadline: float) -> None:
        """Return once connected; wait for the reconnect until ``deadline`` (monotonic s).

        Raises:
            ExecutorUnavailableError: Still not connected at ``deadline``, or the executor
                was closed meanwhile (retriable: the batch is not at fault).
        """
        loop = asyncio.get_running_loop()
        while True:
            if self._closed:
                raise ExecutorUnavailableError(
                    f"the shared executor was closed while waiting for the executor server "
                    f"at {self.path}")
            if self._sock is not None:
                return
            self._start_reconnect()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ExecutorUnavailableError(
                    f"the executor server at {self.path} is not reachable (reconnecting); "
                    f"waited {self.wait_s:g} s (gpu_server_wait_s) for it to come back: is it "
                    "running (`streamapp gpu-server`, or `streamapp worker --processes N "
                    "--gpu-executor shared`, which restarts it)?")
            future: asyncio.Future[None] = loop.create_future()
            with self._lock:
                if self._sock is not None:  # connected since the check above
                    continue
                self._waiters.append((loop, future))
            try:
                await asyncio.wait({future}, timeout=remaining)
            finally:
                with self._lock, contextlib.suppress(ValueError):
                    self._waiters.remove((loop, future))

    async def _submit(self, items: Sequence[Item]) -> dict[str, np.ndarray]:
        """Send ``items`` once and wait for the answer.

        Raises:
            _Lost: The connection went away before the answer (or before sending).
        """
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_inflight)
        await self._sem.acquire()
        slot = self._free.popleft()
        loop = asyncio.get_running_loop()
        pending = _Pending(loop, loop.create_future(), slot)
        request_id = next(self._ids)
        self._inflight += 1
        with self._lock:
            self._pending[request_id] = pending
        try:
            await loop.run_in_executor(self._pool, self._send, request_id, slot, items)
        except BaseException as exc:
            with self._lock:
                mine = self._pending.pop(request_id, None) is not None
            if mine:  # else an answer or a lost connection already handed it over
                error: BaseException = exc
                if isinstance(exc, OSError | ConnectionError):
                    error = _Lost(f"cannot send the batch to the executor server at "
                                  f"{self.path}: {exc}", in_flight=False)
                self._resolve(pending, None, error)
            if not isinstance(exc, Exception):
                raise
        return await pending.future

    async def close(self) -> None:
        """Wait (up to 10 s) for batches in flight, disconnect, free the slots. Idempotent."""
        if self._closed:
            return
        deadline = time.monotonic() + 10.0
        while self._inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        self._closed = True
        self._stop.set()
        self._wake_waiters()  # calls waiting for a reconnect fail (retriably)
        with self._lock:
            sock, self._sock = self._sock, None
            self._generation += 1
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        await asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown, True)
        self._release_slots()
