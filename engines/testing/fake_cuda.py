"""A CPU stand-in for cuda-python's runtime API (``cuda.bindings.runtime``), for tests and demos.

**Not CUDA.** It follows the names, argument order and ``(cudaError_t, *values)`` return
convention of the functions :mod:`engines.cuda` uses, so the CUDA layer, the GPU executor and the
TensorRT stand-in run unchanged on a machine without a GPU:

- "device" memory is host memory, but every allocation is registered and ``cudaMemcpy*`` checks
  that the pointers lie inside allocations of the kind the copy direction needs and that the
  copy fits (``cudaErrorInvalidValue`` otherwise), so an off-by-one in the executor fails here;
- each stream is a worker thread that runs its queued operations in order, so work on different
  streams really overlaps and ``cudaEventSynchronize`` really waits;
- events record ``time.perf_counter()`` when the stream reaches them (``cudaEventElapsedTime``);
- :func:`launch_host_work` queues a Python callable on a stream: stand-in engines compute there;
- :func:`configure` sets the device's memory size/name/compute capability and
  :func:`fail_next` makes the next call(s) of a function return an error code.

Errors raised by host work are reported, as ``cudaErrorLaunchFailure``, by the next event
recorded or stream synchronisation on that stream (like an asynchronous kernel error, but not
sticky).
"""

from __future__ import annotations

import bisect
import ctypes
import enum
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["IS_STANDIN", "configure", "fail_next", "launch_host_work", "reset"]

#: Marks this module as the stand-in (``engines.cuda.using_standin()`` reads it).
IS_STANDIN = True
__version__ = "standin"


class cudaError_t(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorMemoryAllocation = 2
    cudaErrorInitializationError = 3
    cudaErrorInsufficientDriver = 35
    cudaErrorInvalidDevice = 101
    cudaErrorNoDevice = 100
    cudaErrorInvalidResourceHandle = 400
    cudaErrorNotReady = 600
    cudaErrorIllegalAddress = 700
    cudaErrorLaunchFailure = 719


class cudaMemcpyKind(enum.IntEnum):
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3
    cudaMemcpyDefault = 4


cudaStreamDefault = 0
cudaStreamNonBlocking = 1
cudaEventDefault = 0
cudaEventBlockingSync = 1
cudaEventDisableTiming = 2

_OK = cudaError_t.cudaSuccess


class cudaStream_t:
    """Handle object; ``int(stream)`` is its address-like id, as in cuda-python."""

    def __init__(self, value: int = 0) -> None:
        self._value = int(value)

    def __int__(self) -> int:
        return self._value

    def __repr__(self) -> str:
        return f"<cudaStream_t 0x{self._value:x}>"


class cudaEvent_t(cudaStream_t):
    def __repr__(self) -> str:
        return f"<cudaEvent_t 0x{self._value:x}>"


@dataclass
class cudaDeviceProp:
    name: bytes
    major: int
    minor: int
    totalGlobalMem: int
    multiProcessorCount: int = 1


# ----------------------------------------------------------------------------------------------
# State


@dataclass
class _Alloc:
    start: int
    nbytes: int
    kind: str  # "device" or "pinned"
    buffer: Any


@dataclass
class _EventState:
    flags: int
    done: threading.Event = field(default_factory=threading.Event)
    timestamp: float | None = None
    error: int = 0
    recorded: bool = False


class _StreamWorker:
    def __init__(self, handle: int) -> None:
        self.handle = handle
        self.ops: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self.error = 0
        self.thread = threading.Thread(
            target=self._loop, name=f"fake-cuda-stream-{handle:x}", daemon=True
        )
        self.thread.start()

    def _loop(self) -> None:
        while True:
            op = self.ops.get()
            if op is None:
                return
            try:
                op()
            except Exception:
                self.error = int(cudaError_t.cudaErrorLaunchFailure)

    def stop(self) -> None:
        self.ops.put(None)
        self.thread.join()


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.total_memory = 16 << 30
        self.device_name = "Stand-in CUDA device (engines.testing.fake_cuda)"
        self.cc = (9, 0)
        self.allocs: dict[int, _Alloc] = {}
        self.starts: list[int] = []
        self.device_bytes = 0
        self.streams: dict[int, _StreamWorker] = {}
        self.events: dict[int, _EventState] = {}
        self.next_id = 0x1000
        self.failures: dict[str, list[int]] = {}

    def new_id(self) -> int:
        with self.lock:
            self.next_id += 0x10
            return self.next_id


_state = _State()


def reset() -> None:
    """Stop all streams and forget all allocations (between tests)."""
    global _state
    for worker in list(_state.streams.values()):
        worker.stop()
    _state = _State()


def configure(
    *,
    total_memory: int | None = None,
    device_name: str | None = None,
    compute_capability: tuple[int, int] | None = None,
) -> None:
    """Set the stand-in device's memory size (bytes), name and compute capability."""
    if total_memory is not None:
        _state.total_memory = total_memory
    if device_name is not None:
        _state.device_name = device_name
    if compute_capability is not None:
        _state.cc = compute_capability


def fail_next(
    function: str, error: int = cudaError_t.cudaErrorLaunchFailure, times: int = 1
) -> None:
    """Make the next ``times`` calls of ``function`` (e.g. ``"cudaMemcpyAsync"``) return
    ``error`` without doing anything."""
    _state.failures.setdefault(function, []).extend([int(error)] * times)


def _injected(function: str) -> cudaError_t | None:
    pending = _state.failures.get(function)
    if pending:
        return cudaError_t(pending.pop(0))
    return None


# ----------------------------------------------------------------------------------------------
# Errors and device


def cudaGetErrorName(error: Any) -> tuple[cudaError_t, bytes]:
    try:
        return _OK, cudaError_t(int(error)).name.encode()
    except ValueError:
        return _OK, b"cudaErrorUnknown"


def cudaGetErrorString(error: Any) -> tuple[cudaError_t, bytes]:
    texts = {
        1: b"invalid argument",
        2: b"out of memory",
        400: b"invalid resource handle",
        600: b"device not ready",
        719: b"unspecified launch failure",
    }
    return _OK, texts.get(int(error), b"stand-in error")


def cudaGetDeviceCount() -> tuple[cudaError_t, int]:
    if (err := _injected("cudaGetDeviceCount")) is not None:
        return err, 0
    return _OK, 1


def cudaSetDevice(device: int) -> tuple[cudaError_t]:
    if int(device) != 0:
        return (cudaError_t.cudaErrorInvalidDevice,)
    return (_OK,)


def cudaGetDeviceProperties(device: int) -> tuple[cudaError_t, cudaDeviceProp | None]:
    if int(device) != 0:
        return cudaError_t.cudaErrorInvalidDevice, None
    return _OK, cudaDeviceProp(
        name=_state.device_name.encode(),
        major=_state.cc[0],
        minor=_state.cc[1],
        totalGlobalMem=_state.total_memory,
    )


def cudaDriverGetVersion() -> tuple[cudaError_t, int]:
    return _OK, 13000


def cudaRuntimeGetVersion() -> tuple[cudaError_t, int]:
    return _OK, 13000


def cudaMemGetInfo() -> tuple[cudaError_t, int, int]:
    return _OK, _state.total_memory - _state.device_bytes, _state.total_memory


# ----------------------------------------------------------------------------------------------
# Memory


def _allocate(nbytes: int, kind: str) -> tuple[cudaError_t, int]:
    if nbytes <= 0:
        return cudaError_t.cudaErrorInvalidValue, 0
    with _state.lock:
        if kind == "device" and _state.device_bytes + nbytes > _state.total_memory:
            return cudaError_t.cudaErrorMemoryAllocation, 0
        buffer = (ctypes.c_ubyte * nbytes)()
        start = ctypes.addressof(buffer)
        _state.allocs[start] = _Alloc(start, nbytes, kind, buffer)
        bisect.insort(_state.starts, start)
        if kind == "device":
            _state.device_bytes += nbytes
    return _OK, start


def _free(ptr: int, kind: str) -> tuple[cudaError_t]:
    with _state.lock:
        alloc = _state.allocs.get(int(ptr))
        if alloc is None or alloc.kind != kind:
            return (cudaError_t.cudaErrorInvalidValue,)
        del _state.allocs[alloc.start]
        _state.starts.remove(alloc.start)
        if kind == "device":
            _state.device_bytes -= alloc.nbytes
    return (_OK,)


def cudaMalloc(size: int) -> tuple[cudaError_t, int]:
    if (err := _injected("cudaMalloc")) is not None:
        return err, 0
    return _allocate(int(size), "device")


def cudaFree(ptr: int) -> tuple[cudaError_t]:
    return _free(ptr, "device")


def cudaMallocHost(size: int) -> tuple[cudaError_t, int]:
    if (err := _injected("cudaMallocHost")) is not None:
        return err, 0
    return _allocate(int(size), "pinned")


def cudaFreeHost(ptr: int) -> tuple[cudaError_t]:
    return _free(ptr, "pinned")


def _find(ptr: int) -> _Alloc | None:
    with _state.lock:
        i = bisect.bisect_right(_state.starts, ptr) - 1
        if i < 0:
            return None
        alloc = _state.allocs[_state.starts[i]]
    return alloc if alloc.start <= ptr < alloc.start + alloc.nbytes else None


def _check_range(ptr: int, count: int, on_device: bool) -> bool:
    alloc = _find(ptr)
    if on_device:
        return (
            alloc is not None
            and alloc.kind == "device"
            and ptr + count <= alloc.start + alloc.nbytes
        )
    # Host side: any host memory, but not device memory; if it is a pinned allocation, in bounds.
    if alloc is None:
        return True
    return alloc.kind == "pinned" and ptr + count <= alloc.start + alloc.nbytes


def _validate_copy(dst: int, src: int, count: int, kind: int) -> bool:
    if count < 0:
        return False
    directions = {
        cudaMemcpyKind.cudaMemcpyHostToDevice: (True, False),
        cudaMemcpyKind.cudaMemcpyDeviceToHost: (False, True),
        cudaMemcpyKind.cudaMemcpyDeviceToDevice: (True, True),
        cudaMemcpyKind.cudaMemcpyHostToHost: (False, False),
    }
    if kind not in directions:
        return False
    dst_dev, src_dev = directions[cudaMemcpyKind(kind)]
    return _check_range(int(dst), count, dst_dev) and _check_range(int(src), count, src_dev)


def cudaMemcpy(dst: int, src: int, count: int, kind: Any) -> tuple[cudaError_t]:
    if (err := _injected("cudaMemcpy")) is not None:
        return (err,)
    if not _validate_copy(int(dst), int(src), int(count), int(kind)):
        return (cudaError_t.cudaErrorInvalidValue,)
    ctypes.memmove(int(dst), int(src), int(count))
    return (_OK,)


def cudaMemcpyAsync(dst: int, src: int, count: int, kind: Any, stream: Any) -> tuple[cudaError_t]:
    if (err := _injected("cudaMemcpyAsync")) is not None:
        return (err,)
    worker = _worker(stream)
    if worker is None:
        return (cudaError_t.cudaErrorInvalidResourceHandle,)
    d, s, n = int(dst), int(src), int(count)
    if not _validate_copy(d, s, n, int(kind)):
        return (cudaError_t.cudaErrorInvalidValue,)
    worker.ops.put(lambda: ctypes.memmove(d, s, n))
    return (_OK,)


# ----------------------------------------------------------------------------------------------
# Streams


def _worker(stream: Any) -> _StreamWorker | None:
    handle = int(stream) if stream is not None else 0
    if handle == 0:
        with _state.lock:
            if 0 not in _state.streams:
                _state.streams[0] = _StreamWorker(0)
    return _state.streams.get(handle)


def cudaStreamCreateWithFlags(flags: int) -> tuple[cudaError_t, cudaStream_t | None]:
    if (err := _injected("cudaStreamCreateWithFlags")) is not None:
        return err, None
    handle = _state.new_id()
    _state.streams[handle] = _StreamWorker(handle)
    return _OK, cudaStream_t(handle)


def cudaStreamDestroy(stream: Any) -> tuple[cudaError_t]:
    worker = _state.streams.pop(int(stream), None)
    if worker is None or int(stream) == 0:
        return (cudaError_t.cudaErrorInvalidResourceHandle,)
    worker.stop()
    return (_OK,)


def cudaStreamSynchronize(stream: Any) -> tuple[cudaError_t]:
    worker = _worker(stream)
    if worker is None:
        return (cudaError_t.cudaErrorInvalidResourceHandle,)
    done = threading.Event()
    worker.ops.put(done.set)
    done.wait()
    if worker.error:
        err, worker.error = worker.error, 0
        return (cudaError_t(err),)
    return (_OK,)


def cudaStreamWaitEvent(stream: Any, event: Any, flags: int = 0) -> tuple[cudaError_t]:
    worker = _worker(stream)
    state = _state.events.get(int(event))
    if worker is None or state is None:
        return (cudaError_t.cudaErrorInvalidResourceHandle,)
    if state.recorded:
        done = state.done
        worker.ops.put(done.wait)
    return (_OK,)


def launch_host_work(stream: Any, fn: Callable[[], object]) -> tuple[cudaError_t]:
    """Queue ``fn()`` on ``stream`` (stand-in only; the way stand-in engines "launch kernels")."""
    worker = _worker(stream)
    if worker is None:
        return (cudaError_t.cudaErrorInvalidResourceHandle,)
    worker.ops.put(fn)
    return (_OK,)


# ----------------------------------------------------------------------------------------------
# Events


def cudaEventCreateWithFlags(flags: int) -> tuple[cudaError_t, cudaEvent_t | None]:
    if (err := _injected("cudaEventCreateWithFlags")) is not None:
        return err, None
    handle = _state.new_id()
    state = _EventState(int(flags))
    state.done.set()  # an event never recorded counts as complete, as in CUDA
    _state.events[handle] = state
    return _OK, cudaEvent_t(handle)


def cudaEventDestroy(event: Any) -> tuple[cudaError_t]:
    if _state.events.pop(int(event), None) is None:
        return (cudaError_t.cudaErrorInvalidResourceHandle,)
    return (_OK,)


def cudaEventRecord(event: Any, stream: Any = 0) -> tuple[cudaError_t]:
    if (err := _injected("cudaEventRecord")) is not None:
        return (err,)
    state = _state.events.get(int(event))
    worker = _worker(stream)
    if state is None or worker is None:
        return (cudaError_t.cudaErrorInvalidResourceHandle,)
    done = threading.Event()
    state.done = done
    state.recorded = True
    state.timestamp = None

    def fire() -> None:
        state.timestamp = time.perf_counter()
        # The first event after a failed operation reports it (then the stream is clean again;
        # real CUDA kernel faults are sticky, stand-in failures are not).
        state.error, worker.error = worker.error, 0
        done.set()

    worker.ops.put(fire)
    return (_OK,)


def cudaEventSynchronize(event: Any) -> tuple[cudaError_t]:
    if (err := _injected("cudaEventSynchronize")) is not None:
        return (err,)
    state = _state.events.get(int(event))
    if state is None:
        return (cudaError_t.cudaErrorInvalidResourceHandle,)
    state.done.wait()
    if state.error:
        return (cudaError_t(state.error),)
    return (_OK,)


def cudaEventQuery(event: Any) -> tuple[cudaError_t]:
    state = _state.events.get(int(event))
    if state is None:
        return (cudaError_t.cudaErrorInvalidResourceHandle,)
    if not state.done.is_set():
        return (cudaError_t.cudaErrorNotReady,)
    return (cudaError_t(state.error) if state.error else _OK,)


def cudaEventElapsedTime(start: Any, end: Any) -> tuple[cudaError_t, float]:
    a = _state.events.get(int(start))
    b = _state.events.get(int(end))
    if a is None or b is None:
        return cudaError_t.cudaErrorInvalidResourceHandle, 0.0
    if (a.flags | b.flags) & cudaEventDisableTiming:
        return cudaError_t.cudaErrorInvalidResourceHandle, 0.0
    if not (a.done.is_set() and b.done.is_set()):
        return cudaError_t.cudaErrorNotReady, 0.0
    if a.timestamp is None or b.timestamp is None:
        return cudaError_t.cudaErrorInvalidResourceHandle, 0.0
    return _OK, (b.timestamp - a.timestamp) * 1000.0
