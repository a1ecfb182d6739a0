"""Executors run engine batches asynchronously: :class:`ThreadExecutor` on CPU threads; the GPU
executor on CUDA streams lives in :mod:`engines.executor.cuda`."""

from __future__ import annotations

from engines.executor.base import Executor, Item, pack_items
from engines.executor.thread import ThreadExecutor

__all__ = ["Executor", "Item", "ThreadExecutor", "pack_items"]
