"""CUDA streams, events, pinned host buffers and device buffers, with explicit ``close()``.

Every object here owns one CUDA handle or allocation, releases it in :meth:`close` (idempotent)
and on context-manager exit, and is counted in :func:`live_handles` while open, so tests can
assert that nothing leaked. Objects are not thread-safe except where a method says so; the CUDA
calls themselves may be made from any thread.

Modelled on Polygraphy's ``cuda`` module (``Stream``, ``DeviceArray``).
"""

from __future__ import annotations

import ctypes
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engines.cuda.runtime import check, runtime
from engines.exceptions import EngineClosedError, InputSpecError

__all__ = [
    "DeviceBuffer",
    "DeviceInfo",
    "Event",
    "PinnedBuffer",
    "Stream",
    "device_count",
    "device_info",
    "live_handles",
    "mem_get_info",
    "memcpy_dtoh",
    "memcpy_dtoh_async",
    "memcpy_htod",
    "memcpy_htod_async",
    "set_device",
    "stream_host_call",
    "versions",
]

_live: Counter[str] = Counter()
_live_lock = threading.Lock()


def _track(kind: str, delta: int) -> None:
    with _live_lock:
        _live[kind] += delta
        if _live[kind] == 0:
            del _live[kind]


def live_handles() -> dict[str, int]:
    """Open objects by kind (``"Stream"``, ``"Event"``, ``"PinnedBuffer"``, ``"DeviceBuffer"``)."""
    with _live_lock:
        return dict(_live)


class _Handle:
    """Base for objects owning one CUDA resource: ``close()`` once, context manager, tracking."""

    _closed = True

    def _opened(self) -> None:
        self._closed = False
        _track(type(self).__name__, +1)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError(f"{type(self).__name__} is closed")

    def close(self) -> None:
        """Release the resource. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _track(type(self).__name__, -1)
        self._release()

    def _release(self) -> None:  # pragma: no cover - every subclass overrides
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # A safety net only: code should close explicitly. Never raise from a finalizer.
        if not self._closed:
            try:
                self.close()
            except Exception:
                pass


class Stream(_Handle):
    """A CUDA stream (``cudaStreamNonBlocking`` by default: no implicit sync with stream 0).

    Args:
        non_blocking: Create with ``cudaStreamNonBlocking``.

    Raises:
        CudaError: Creation failed.
    """

    def __init__(self, *, non_blocking: bool = True) -> None:
        rt = runtime()
        flags = rt.cudaStreamNonBlocking if non_blocking else rt.cudaStreamDefault
        self._stream = check(rt.cudaStreamCreateWithFlags(flags), "cudaStreamCreateWithFlags")
        self._opened()

    @property
    def handle(self) -> int:
        """The ``cudaStream_t`` as an int (what TensorRT's ``execute_async_v3`` and
        ``torch.cuda.ExternalStream`` take)."""
        return int(self._stream)

    @property
    def raw(self) -> Any:
        """The cuda-python ``cudaStream_t`` object."""
        return self._stream

    def synchronize(self) -> None:
        """Block the calling thread until all work queued on the stream has finished."""
        self._check_open()
        check(runtime().cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")

    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait for ``event`` (no host blocking)."""
        self._check_open()
        check(runtime().cudaStreamWaitEvent(self._stream, event.raw, 0), "cudaStreamWaitEvent")

    def _release(self) -> None:
        rt = runtime()
        # Destroy returns at once and the driver frees the stream when its work is done; syncing
        # first makes close() a point after which nothing of ours runs on the GPU.
        try:
            check(rt.cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")
        finally:
            check(rt.cudaStreamDestroy(self._stream), "cudaStreamDestroy")


class Event(_Handle):
    """A CUDA event.

    Args:
        timing: Record timestamps (needed for :meth:`elapsed_ms`); costs a little per record.
        blocking: ``cudaEventBlockingSync``: :meth:`synchronize` puts the calling thread to
            sleep instead of spinning a CPU core while it waits.

    Raises:
        CudaError: Creation failed.
    """

    def __init__(self, *, timing: bool = False, blocking: bool = True) -> None:
        rt = runtime()
        flags = rt.cudaEventDefault
        if blocking:
            flags |= rt.cudaEventBlockingSync
        if not timing:
            flags |= rt.cudaEventDisableTiming
        self.timing = timing
        self._event = check(rt.cudaEventCreateWithFlags(flags), "cudaEventCreateWithFlags")
        self._opened()

    @property
    def raw(self) -> Any:
        return self._event

    def record(self, stream: Stream | int) -> None:
        """Mark the point in ``stream``'s queue reached by all work enqueued so far."""
        self._check_open()
        handle = stream.raw if isinstance(stream, Stream) else stream
        check(runtime().cudaEventRecord(self._event, handle), "cudaEventRecord")

    def synchronize(self) -> None:
        """Block the calling thread (without spinning if ``blocking``) until the event fires.

        Raises:
            CudaError: Work before the event failed (e.g. an illegal address in a kernel).
        """
        self._check_open()
        check(runtime().cudaEventSynchronize(self._event), "cudaEventSynchronize")

    def query(self) -> bool:
        """True when the event has fired, False while work before it is still running."""
        self._check_open()
        rt = runtime()
        result = rt.cudaEventQuery(self._event)
        err = result[0] if isinstance(result, tuple) else result
        if int(err) == int(rt.cudaError_t.cudaErrorNotReady):
            return False
        check(result, "cudaEventQuery")
        return True

    def elapsed_ms(self, start: Event) -> float:
        """Milliseconds from ``start`` to this event (both recorded, fired, with timing).

        Events recorded on different streams of one device may be compared.
        """
        self._check_open()
        return float(
            check(runtime().cudaEventElapsedTime(start.raw, self._event), "cudaEventElapsedTime")
        )

    def _release(self) -> None:
        check(runtime().cudaEventDestroy(self._event), "cudaEventDestroy")


def _host_view(ptr: int, nbytes: int) -> np.ndarray:
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    raw = (ctypes.c_ubyte * nbytes).from_address(ptr)
    return np.ctypeslib.as_array(raw)


class PinnedBuffer(_Handle):
    """Page-locked host memory (``cudaMallocHost``): the source/target of async copies.

    Args:
        nbytes: Size in bytes (> 0).

    Raises:
        CudaOutOfMemoryError: Not enough lockable host memory.
    """

    def __init__(self, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        self.nbytes = int(nbytes)
        self.ptr = int(check(runtime().cudaMallocHost(self.nbytes), "cudaMallocHost"))
        self._bytes = _host_view(self.ptr, self.nbytes)
        self._opened()

    def view(self, dtype: np.dtype[Any] | type, shape: Sequence[int]) -> np.ndarray:
        """A numpy array over the buffer's first bytes (no copy).

        The view must not be used after :meth:`close`: it would point to freed memory.

        Raises:
            InputSpecError: ``shape`` of ``dtype`` does not fit in the buffer.
        """
        self._check_open()
        dt = np.dtype(dtype)
        need = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if need > self.nbytes:
            raise InputSpecError(
                f"a {dt}{list(shape)} view needs {need} bytes, the pinned buffer has {self.nbytes}"
            )
        return self._bytes[:need].view(dt).reshape(tuple(shape))

    def _release(self) -> None:
        self._bytes = np.empty(0, dtype=np.uint8)
        check(runtime().cudaFreeHost(self.ptr), "cudaFreeHost")


class DeviceBuffer(_Handle):
    """Device memory (``cudaMalloc``).

    Args:
        nbytes: Size in bytes (> 0).

    Raises:
        CudaOutOfMemoryError: Not enough device memory.
    """

    def __init__(self, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        self.nbytes = int(nbytes)
        self.ptr = int(check(runtime().cudaMalloc(self.nbytes), "cudaMalloc"))
        self._opened()

    def _release(self) -> None:
        check(runtime().cudaFree(self.ptr), "cudaFree")


def _kinds() -> Any:
    return runtime().cudaMemcpyKind


def memcpy_htod_async(dst: int, src: int, nbytes: int, stream: Stream) -> None:
    """Enqueue a host→device copy of ``nbytes`` on ``stream`` (``src`` should be pinned)."""
    if nbytes:
        check(
            runtime().cudaMemcpyAsync(
                dst, src, nbytes, _kinds().cudaMemcpyHostToDevice, stream.raw
            ),
            "cudaMemcpyAsync",
        )


def memcpy_dtoh_async(dst: int, src: int, nbytes: int, stream: Stream) -> None:
    """Enqueue a device→host copy of ``nbytes`` on ``stream`` (``dst`` should be pinned)."""
    if nbytes:
        check(
            runtime().cudaMemcpyAsync(
                dst, src, nbytes, _kinds().cudaMemcpyDeviceToHost, stream.raw
            ),
            "cudaMemcpyAsync",
        )


def memcpy_dtod_async(dst: int, src: int, nbytes: int, stream: Stream | int) -> None:
    """Enqueue a device→device copy of ``nbytes`` on ``stream``."""
    handle = stream.raw if isinstance(stream, Stream) else stream
    if nbytes:
        check(
            runtime().cudaMemcpyAsync(dst, src, nbytes, _kinds().cudaMemcpyDeviceToDevice, handle),
            "cudaMemcpyAsync",
        )


def memcpy_htod(dst: int, array: np.ndarray) -> None:
    """Copy a host array to device memory at ``dst`` and wait (synchronous ``cudaMemcpy``)."""
    src = np.ascontiguousarray(array)
    if src.nbytes:
        check(
            runtime().cudaMemcpy(dst, src.ctypes.data, src.nbytes, _kinds().cudaMemcpyHostToDevice),
            "cudaMemcpy",
        )


def memcpy_dtoh(array: np.ndarray, src: int) -> np.ndarray:
    """Copy ``array.nbytes`` from device memory at ``src`` into the C-contiguous ``array``."""
    if not array.flags.c_contiguous:
        raise ValueError("memcpy_dtoh needs a C-contiguous target array")
    if array.nbytes:
        check(
            runtime().cudaMemcpy(
                array.ctypes.data, src, array.nbytes, _kinds().cudaMemcpyDeviceToHost
            ),
            "cudaMemcpy",
        )
    return array


def stream_host_call(stream: int, fn: Any) -> None:
    """Run the host function ``fn()`` in ``stream`` order (for CPU stand-ins of GPU engines).

    On the stand-in runtime ``fn`` runs asynchronously on the stream's worker, after earlier
    work and before later work. On a real GPU the stream is synchronized first and ``fn`` runs
    on the calling thread (so it may use synchronous copies); correct, but not asynchronous.
    """
    rt = runtime()
    launch = getattr(rt, "launch_host_work", None)
    if launch is not None:
        check(launch(stream, fn), "launch_host_work")
        return
    check(rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
    fn()


def set_device(device: int) -> None:
    """Make ``device`` current for the calling thread (``cudaSetDevice``)."""
    check(runtime().cudaSetDevice(device), "cudaSetDevice")


def device_count() -> int:
    """Number of visible CUDA devices (0 when the driver reports none)."""
    return int(check(runtime().cudaGetDeviceCount(), "cudaGetDeviceCount"))


def mem_get_info() -> tuple[int, int]:
    """``(free_bytes, total_bytes)`` of the current device (``cudaMemGetInfo``)."""
    free, total = check(runtime().cudaMemGetInfo(), "cudaMemGetInfo")
    return int(free), int(total)


@dataclass(frozen=True)
class DeviceInfo:
    """What the plan sidecar and ``EngineInfo.device`` record about a GPU.

    Attributes:
        index: CUDA device ordinal.
        name: e.g. ``"NVIDIA H200"``.
        compute_capability: ``(major, minor)``, e.g. ``(9, 0)``.
        total_memory_bytes: Global memory size.
    """

    index: int
    name: str
    compute_capability: tuple[int, int]
    total_memory_bytes: int

    @property
    def sm(self) -> str:
        """``"sm_90"`` style tag."""
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"


def device_info(device: int = 0) -> DeviceInfo:
    """Name, compute capability and memory of CUDA device ``device``."""
    prop = check(runtime().cudaGetDeviceProperties(device), "cudaGetDeviceProperties")
    name = prop.name
    if isinstance(name, bytes):
        name = name.split(b"\0", 1)[0].decode(errors="replace")
    return DeviceInfo(
        index=device,
        name=str(name),
        compute_capability=(int(prop.major), int(prop.minor)),
        total_memory_bytes=int(prop.totalGlobalMem),
    )


def versions() -> dict[str, str]:
    """CUDA driver and runtime versions as ``"12.4"``-style strings, and the binding's version."""
    rt = runtime()

    def fmt(v: int) -> str:
        return f"{v // 1000}.{(v % 1000) // 10}"

    out = {
        "driver": fmt(int(check(rt.cudaDriverGetVersion(), "cudaDriverGetVersion"))),
        "runtime": fmt(int(check(rt.cudaRuntimeGetVersion(), "cudaRuntimeGetVersion"))),
    }
    out["bindings"] = str(getattr(rt, "__version__", "") or _bindings_version())
    return out


def _bindings_version() -> str:
    try:
        from importlib.metadata import version

        return version("cuda-bindings")
    except Exception:
        return "unknown"
