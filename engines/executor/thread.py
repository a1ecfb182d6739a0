"""A CPU executor: batches run on a small thread pool (ONNX Runtime releases the GIL)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence

import numpy as np

from engines.base import Engine
from engines.exceptions import EngineClosedError, InputSpecError
from engines.executor.base import Executor, Item, pack_items

__all__ = ["ThreadExecutor"]


class ThreadExecutor(Executor):
    """Runs each batch in a worker thread and awaits it without blocking the event loop.

    Packing happens in the worker thread as well, so the event loop only moves references.

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

    @property
    def inflight(self) -> int:
        return self._inflight

    def _run_sync(self, items: Sequence[Item]) -> dict[str, np.ndarray]:
        feeds = {spec.name: pack_items(items, spec) for spec in self.engine.inputs}
        return self.engine.infer(feeds)

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
