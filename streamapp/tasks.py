"""Small asyncio helpers shared by the worker's long-running tasks."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

__all__ = ["cancel_and_wait"]


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None) -> None:
    """Cancel every task given (``None`` entries are skipped) and wait until each has ended.

    A task's own ``CancelledError`` is swallowed; if the *caller* is cancelled meanwhile, that
    propagates as usual, and so does any other exception a task ended with.
    """
    pending = [t for t in tasks if t is not None]
    for task in pending:
        task.cancel()
    for task in pending:
        with contextlib.suppress(asyncio.CancelledError):
            await task
