"""Small asyncio helpers shared by the worker's long-running tasks."""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["cancel_and_wait", "wait_event"]


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None) -> None:
    """Cancel every task given (``None`` entries are skipped) and wait until each has ended.

    A task's own ``CancelledError`` is swallowed; if the *caller* is cancelled meanwhile, that
    propagates as usual, and so does any other exception a task ended with.
    """
    pending = [t for t in tasks if t is not None]
    for task in pending:
        task.cancel()
    current = asyncio.current_task()
    for task in pending:
        try:
            await task
        except asyncio.CancelledError:
            if current is not None and current.cancelling():
                raise  # the caller is being cancelled (or timed out): not the task's own


async def wait_event(event: asyncio.Event, timeout_s: float | None) -> bool:
    """Wait until ``event`` is set or ``timeout_s`` seconds (None: no limit) have passed.

    Returns:
        True when the event is set, False on the timeout.

    Raises:
        asyncio.CancelledError: The caller was cancelled, even at the moment the timeout
            expired. ``asyncio.wait_for`` on Python 3.11 can turn that cancellation into a
            timeout (CPython gh-86296), and a loop that treats the timeout as "go round again"
            then never ends: a worker's stop waited forever for its state-flush task.
    """
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True
