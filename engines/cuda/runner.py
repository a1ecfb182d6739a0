"""IO buffers for a :class:`~engines.base.StreamEngine`, and a synchronous single-stream runner.

:class:`DeviceIO` holds one device buffer per IO tensor at the engine's maximum batch;
:class:`HostIO` the matching pinned staging buffers. :class:`StreamRunner` runs one batch at a
time on its own stream: what a GPU backend's synchronous ``infer()`` does, and the "raw loop" of
``engines bench``. The GPU executor (:mod:`engines.executor.cuda`) builds on the same pieces.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from engines.base import DYNAMIC, StreamContext, StreamEngine, TensorSpec
from engines.cuda.core import (
    DeviceBuffer,
    PinnedBuffer,
    Stream,
    memcpy_dtoh_async,
    memcpy_htod_async,
    set_device,
)
from engines.exceptions import InputSpecError

__all__ = ["DeviceIO", "HostIO", "StreamRunner", "row_nbytes"]


def row_nbytes(spec: TensorSpec) -> int:
    """Bytes of one item (one batch row) of ``spec``.

    Raises:
        InputSpecError: A non-batch dimension is dynamic (buffers are allocated once, so every
            item dimension must be fixed).
    """
    if any(d == DYNAMIC for d in spec.item_shape):
        raise InputSpecError(
            f"tensor {spec.name!r} has dynamic item dimensions {list(spec.shape)}; the GPU path "
            "allocates buffers once and needs every dimension but the batch fixed (export the "
            "model with static item shapes)"
        )
    return int(np.prod(spec.item_shape, dtype=np.int64)) * spec.dtype.itemsize


class DeviceIO:
    """One device buffer per IO tensor of ``engine``, each ``dtype[max_batch, *item_shape]``.

    Raises:
        CudaOutOfMemoryError: Not enough device memory.
    """

    def __init__(self, engine: StreamEngine, max_batch: int) -> None:
        self.max_batch = max_batch
        self.buffers: dict[str, DeviceBuffer] = {}
        try:
            for spec in (*engine.inputs, *engine.outputs):
                self.buffers[spec.name] = DeviceBuffer(max_batch * row_nbytes(spec))
        except BaseException:
            self.close()
            raise

    @property
    def addresses(self) -> dict[str, int]:
        """IO name → device pointer, as :meth:`StreamEngine.bind_stream` takes them."""
        return {name: buf.ptr for name, buf in self.buffers.items()}

    @property
    def nbytes(self) -> int:
        return sum(buf.nbytes for buf in self.buffers.values())

    def close(self) -> None:
        for buf in self.buffers.values():
            buf.close()


class HostIO:
    """Pinned staging for one batch: ``inputs[name]`` and ``outputs[name]`` are numpy views
    ``dtype[max_batch, *item_shape]`` over page-locked memory, reused batch after batch."""

    def __init__(self, engine: StreamEngine, max_batch: int) -> None:
        self._pinned: dict[str, PinnedBuffer] = {}
        self.inputs: dict[str, np.ndarray] = {}
        self.outputs: dict[str, np.ndarray] = {}
        self.row_bytes: dict[str, int] = {}
        try:
            for group, specs in ((self.inputs, engine.inputs), (self.outputs, engine.outputs)):
                for spec in specs:
                    row = row_nbytes(spec)
                    buf = PinnedBuffer(max_batch * row)
                    self._pinned[spec.name] = buf
                    self.row_bytes[spec.name] = row
                    group[spec.name] = buf.view(spec.dtype, (max_batch, *spec.item_shape))
        except BaseException:
            self.close()
            raise

    def ptr(self, name: str) -> int:
        return self._pinned[name].ptr

    @property
    def nbytes(self) -> int:
        return sum(buf.nbytes for buf in self._pinned.values())

    def close(self) -> None:
        self.inputs.clear()
        self.outputs.clear()
        for buf in self._pinned.values():
            buf.close()


def enqueue_batch(
    engine: StreamEngine,
    context: StreamContext,
    stream: Stream,
    host: HostIO,
    device: DeviceIO,
    batch: int,
    marks: tuple[Any, Any, Any, Any] | None = None,
    *,
    skip_inputs: Collection[str] = (),
) -> None:
    """Enqueue H2D of every input → ``context.enqueue(batch)`` → D2H of every output.

    ``marks``, when given, are four timing events recorded before H2D, after H2D, after the
    compute and after D2H (the executor's timeline). ``skip_inputs``: inputs whose rows the
    context writes on the device itself (every row a frame it decodes): their host staging
    holds nothing, so no H2D copy (ResNet-50 at batch 64: 19 MB a batch not copied).
    """
    if marks:
        marks[0].record(stream)
    for spec in engine.inputs:
        if spec.name in skip_inputs:
            continue
        memcpy_htod_async(
            device.buffers[spec.name].ptr,
            host.ptr(spec.name),
            batch * host.row_bytes[spec.name],
            stream,
        )
    if marks:
        marks[1].record(stream)
    context.enqueue(batch)
    if marks:
        marks[2].record(stream)
    for spec in engine.outputs:
        memcpy_dtoh_async(
            host.ptr(spec.name),
            device.buffers[spec.name].ptr,
            batch * host.row_bytes[spec.name],
            stream,
        )
    if marks:
        marks[3].record(stream)


class StreamRunner:
    """Runs batches of a :class:`StreamEngine` synchronously on a private stream.

    Buffers are allocated once at ``max_batch``. Thread-safe (one batch at a time).

    Args:
        engine: The engine.
        max_batch: Largest batch; defaults to ``engine.max_batch_size``.
        device: CUDA device ordinal.
    """

    def __init__(self, engine: StreamEngine, *, max_batch: int | None = None, device: int = 0):
        self.engine = engine
        self.max_batch = max_batch or engine.max_batch_size
        self.device = device
        self._lock = threading.Lock()
        set_device(device)
        self.stream = Stream()
        self.device_io: DeviceIO | None = None
        self.host_io: HostIO | None = None
        self.context: StreamContext | None = None
        try:
            self.device_io = DeviceIO(engine, engine.max_batch_size)
            self.host_io = HostIO(engine, self.max_batch)
            self.context = engine.bind_stream(self.stream.handle, self.device_io.addresses)
        except BaseException:
            self.close()
            raise

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Copy ``feeds`` (validated, ``dtype[batch, *item]``) in, run, copy fresh outputs out."""
        assert self.host_io is not None and self.device_io is not None and self.context
        with self._lock:
            set_device(self.device)
            batch = next(iter(feeds.values())).shape[0]
            if batch > self.max_batch:
                raise InputSpecError(f"batch {batch} exceeds this runner's max {self.max_batch}")
            for spec in self.engine.inputs:
                self.host_io.inputs[spec.name][:batch] = feeds[spec.name]
            enqueue_batch(
                self.engine, self.context, self.stream, self.host_io, self.device_io, batch
            )
            self.stream.synchronize()
            return {
                spec.name: self.host_io.outputs[spec.name][:batch].copy()
                for spec in self.engine.outputs
            }

    def close(self) -> None:
        """Wait for the stream, then release context, buffers and stream. Idempotent."""
        if self.stream.closed:
            return
        try:
            self.stream.synchronize()
        finally:
            if self.context is not None:
                self.context.close()
            if self.device_io is not None:
                self.device_io.close()
            if self.host_io is not None:
                self.host_io.close()
            self.stream.close()

    def __enter__(self) -> StreamRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
