"""A CPU executor: batches run on a small thread pool (ONNX Runtime releases the GIL)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Sequence

import numpy as np

from engines.base import Engine
from engines.exceptions import EngineClosedError, InputSpecError
from engines.executor.base import Executor, Item, pack_items

__all__ = ["ThreadExecutor"]


class ThreadExecutor(Executor):
    """Runs each batch in a worker thread and awaits it without blocking the event loop.

    Packing happens in the worker thread as well, so the event loop only moves references.
    Each thread packs into its own staging buffer per input, kept for the next batch and
    grown to the largest batch it has packed (at most ``engine.max_batch_size`` rows): a new
    batch array per batch is a fresh mapping whose every page faults on first write (147
    minor faults for each float32[3, 224, 224] item; ``python -m bench.pipeline_cost
    --workload resnet50-tensor`` prints them).

    Args:
        engine: Any engine whose ``infer`` is safe to call from several threads at once
            (ONNX Runtime's ``InferenceSession.run`` is).
        max_inflight: Batches running at once (= threads), >= 1. Two is enough to overlap one
            batch's packing/unpacking with the next one's compute on a small CPU.

    Raises:
        ValueError: ``max_inflight`` < 1.
    """

    def __init__(self, engine: Engine, *, max_inflight: int = 2) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self.engine = engine
        self.max_inflight = max_inflight
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_inflight, thread_name_prefix="engine"
        )
        self._slots = asyncio.Semaphore(max_inflight)
        self._inflight = 0
        self._closed = False
        self._local = threading.local()  # .staging: input name → this thread's buffer

    @property
    def inflight(self) -> int:
        return self._inflight

    def _staging(self, n: int) -> dict[str, np.ndarray]:
        staging: dict[str, np.ndarray] | None = getattr(self._local, "staging", None)
        if staging is None or next(iter(staging.values())).shape[0] < n:
            staging = self._local.staging = {
                spec.name: np.empty((n, *spec.item_shape), dtype=spec.dtype)
                for spec in self.engine.inputs}
        return staging

    def _run_sync(self, items: Sequence[Item]) -> dict[str, np.ndarray]:
        if not self.engine.inputs:
            return self.engine.infer({})
        staging = self._staging(len(items))
        feeds = {spec.name: pack_items(items, spec, staging[spec.name])
                 for spec in self.engine.inputs}
        outputs = self.engine.infer(feeds)
        # Outputs are the caller's: never a view of a buffer the next batch overwrites.
        return {name: array.copy() if any(np.may_share_memory(array, b)
                                          for b in staging.values()) else array
                for name, array in outputs.items()}

    async def run(self, items: Sequence[Item]) -> dict[str, np.ndarray]:
        if self._closed:
            raise EngineClosedError("the executor is closed")
        if not items:
            raise InputSpecError("cannot run an empty batch")
        async with self._slots:
            self._inflight += 1
            try:
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(self._pool, self._run_sync, items)
            finally:
                self._inflight -= 1

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._pool.shutdown, True)
