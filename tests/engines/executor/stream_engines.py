"""Small :class:`~engines.base.StreamEngine` implementations for executor tests.

They run on the CPU stand-in runtime and on a real GPU alike (only ``engines.cuda`` calls):

- :class:`CopyEngine`: ``y = x`` with one device-to-device copy per batch (truly async on a GPU);
- :class:`AffineEngine`: ``y = 2 x + 1`` computed in a host function on the stream, optionally
  sleeping ``delay_s`` to simulate compute and failing on a poison value.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Mapping

import numpy as np

from engines import cuda
from engines.base import DYNAMIC, EngineInfo, StreamContext, StreamEngine, TensorSpec
from engines.exceptions import EngineRuntimeError

FEATURES = 4


def _info(name: str, max_batch: int) -> EngineInfo:
    return EngineInfo(
        backend=name,
        model_path=f"<{name}>",
        model_sha256=hashlib.sha256(name.encode()).hexdigest(),
        version="test",
        device="cuda:0",
        precision="fp32",
        max_batch_size=max_batch,
    )


class _Base(StreamEngine):
    def __init__(self, name: str, max_batch: int) -> None:
        self.inputs = (TensorSpec("x", np.dtype("float32"), (DYNAMIC, FEATURES)),)
        self.outputs = (TensorSpec("y", np.dtype("float32"), (DYNAMIC, FEATURES)),)
        self.info = _info(name, max_batch)
        self.contexts_open = 0
        self.enqueued: list[int] = []
        self._lock = threading.Lock()

    def expected(self, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class _CopyContext(StreamContext):
    def __init__(self, engine: CopyEngine, stream: int, addresses: Mapping[str, int]) -> None:
        self.engine, self.stream, self.addresses = engine, stream, dict(addresses)
        engine.contexts_open += 1
        self.closed = False

    def enqueue(self, batch_size: int) -> None:
        self.engine.enqueued.append(batch_size)
        cuda.memcpy_dtod_async(
            self.addresses["y"], self.addresses["x"], batch_size * FEATURES * 4, self.stream
        )

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.engine.contexts_open -= 1


class CopyEngine(_Base):
    """``y = x``, float32[batch, 4] → float32[batch, 4]."""

    def __init__(self, max_batch: int = 8) -> None:
        super().__init__("copy", max_batch)

    def expected(self, x: np.ndarray) -> np.ndarray:
        return x

    def infer_impl(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"y": feeds["x"].copy()}

    def bind_stream(self, stream: int, addresses: Mapping[str, int]) -> StreamContext:
        self.check_addresses(addresses)
        return _CopyContext(self, stream, addresses)


class _AffineContext(StreamContext):
    def __init__(self, engine: AffineEngine, stream: int, addresses: Mapping[str, int]) -> None:
        self.engine, self.stream, self.addresses = engine, stream, dict(addresses)
        engine.contexts_open += 1
        self.closed = False

    def enqueue(self, batch_size: int) -> None:
        engine = self.engine
        engine.enqueued.append(batch_size)
        x_ptr, y_ptr = self.addresses["x"], self.addresses["y"]

        def compute() -> None:
            x = cuda.memcpy_dtoh(np.empty((batch_size, FEATURES), np.float32), x_ptr)
            with engine._lock:
                engine.running += 1
                engine.max_running = max(engine.max_running, engine.running)
            try:
                if engine.delay_s:
                    time.sleep(engine.delay_s)
                if engine.poison is not None and (x == engine.poison).any():
                    raise EngineRuntimeError(f"poison value {engine.poison} in the batch")
                cuda.memcpy_htod(y_ptr, engine.expected(x))
            finally:
                with engine._lock:
                    engine.running -= 1

        cuda.stream_host_call(self.stream, compute)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.engine.contexts_open -= 1


class AffineEngine(_Base):
    """``y = 2 x + 1``, float32[batch, 4] → float32[batch, 4], computed on the host in stream
    order; ``delay_s`` per batch; a batch containing ``poison`` fails."""

    def __init__(
        self, max_batch: int = 8, *, delay_s: float = 0.0, poison: float | None = None
    ) -> None:
        super().__init__("affine", max_batch)
        self.delay_s = delay_s
        self.poison = poison
        self.running = 0
        self.max_running = 0

    def expected(self, x: np.ndarray) -> np.ndarray:
        return (2 * x + 1).astype(np.float32)

    def infer_impl(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"y": self.expected(feeds["x"])}

    def bind_stream(self, stream: int, addresses: Mapping[str, int]) -> StreamContext:
        self.check_addresses(addresses)
        return _AffineContext(self, stream, addresses)


def items(n: int, start: int = 0) -> list[dict[str, np.ndarray]]:
    """``n`` items; item ``i`` is ``x = [i, i, i, i] + start`` (float32[4])."""
    return [{"x": np.full(FEATURES, start + i, dtype=np.float32)} for i in range(n)]
