"""Retries of transient failures: the retry-record format, backoff, and the delay scheduler.

A request whose inference failed with a retriable error (engine error, CUDA out-of-memory,
timeout) is written to the retry topic, keyed by ``request_id``, as a :class:`RetryRecord`: the
original key and value byte for byte, the attempt to run next, when it may run (``not_before``)
and every error so far. The retry agent consumes that topic, records the attempt in the
changelogged ``retry_counts`` table, waits until ``not_before`` without blocking anything else
(:class:`DelayScheduler`), then runs the original request again. After ``max_retries`` retries
the request goes to the dead-letter queue with every attempt recorded, and its table row is
deleted when it finishes either way.

Backoff is exponential with jitter: ``min(max, base * 2**(attempt-1)) * U(1-j, 1+j)`` ("Exponential
Backoff And Jitter", AWS Architecture Blog, 2015).
"""

from __future__ import annotations

import asyncio
import base64
import heapq
import itertools
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from streamapp.exceptions import InvalidRequestError
from streamapp.tasks import cancel_and_wait

__all__ = [
    "DelayScheduler",
    "MemoryRetryStore",
    "RetryRecord",
    "RetryStore",
    "backoff_s",
]


def backoff_s(attempt: int, *, base_ms: float, max_ms: float, jitter: float,
              rng: random.Random | None = None) -> float:
    """Seconds to wait before retry ``attempt`` (1 = first retry).

    Args:
        attempt: >= 1.
        base_ms / max_ms: Backoff of the first retry and the cap, milliseconds.
        jitter: 0..1; the delay is multiplied by a uniform factor in ``[1 - jitter, 1 + jitter]``.
    """
    delay_ms = min(max_ms, base_ms * 2 ** max(attempt - 1, 0))
    factor = 1.0 + jitter * ((rng or random).uniform(-1.0, 1.0))
    return max(delay_ms * factor, 0.0) / 1000.0


@dataclass
class RetryRecord:
    """One pending retry (JSON in the retry topic; key = ``request_id`` as UTF-8).

    Attributes:
        request_id / device_id / model: From the original request.
        attempt: The attempt to run next (1 = first retry).
        not_before: Epoch seconds before which it must not run.
        errors: One ``{attempt, reason, type, message, ts}`` per failed attempt so far.
        first_failed_ts: Epoch seconds of the first failure.
        source: ``{topic, partition, offset}`` of the original request record.
        key / value: The original request record's key and value (bytes; base64 in JSON).
    """

    request_id: str
    device_id: str
    model: str
    attempt: int
    not_before: float
    errors: list[dict[str, Any]]
    first_failed_ts: float
    source: dict[str, Any]
    key: bytes | None
    value: bytes
    extra: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        body = asdict(self)
        body["key"] = None if self.key is None else base64.b64encode(self.key).decode("ascii")
        body["value"] = base64.b64encode(self.value).decode("ascii")
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, value: bytes | None) -> RetryRecord:
        """Parse a retry record.

        Raises:
            InvalidRequestError: ``invalid_retry_record`` — not written by this module.
        """
        try:
            body = json.loads(value or b"")
            body["key"] = None if body["key"] is None else base64.b64decode(body["key"])
            body["value"] = base64.b64decode(body["value"])
            record = cls(**body)
        except (ValueError, TypeError, KeyError) as exc:
            raise InvalidRequestError(
                "invalid_retry_record",
                f"the retry topic holds a record this worker cannot read ({exc}); only "
                "streamapp workers should write to it",
            ) from exc
        return record


class RetryStore(Protocol):
    """Where attempt counters live (the changelogged ``retry_counts`` table in a worker)."""

    def record_attempt(self, record: RetryRecord, event: Any) -> None:
        """Store ``{attempts, last_error, errors}`` for ``record.request_id``."""

    def finish(self, request_id: str, event: Any) -> None:
        """Remove the row of a request that got its result or went to the DLQ."""


class MemoryRetryStore:
    """A dict-backed :class:`RetryStore` for tests and single-process use."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, Any]] = {}

    def record_attempt(self, record: RetryRecord, event: Any) -> None:
        self.rows[record.request_id] = {
            "attempts": record.attempt,
            "last_error": record.errors[-1] if record.errors else None,
            "errors": record.errors,
        }

    def finish(self, request_id: str, event: Any) -> None:
        self.rows.pop(request_id, None)


class DelayScheduler:
    """Runs ``callback(item)`` at each item's due time, without a task per item.

    Args:
        callback: ``async (item) -> None``; awaited one at a time, in due-time order.
        max_items: Items waiting at most; :meth:`add` waits beyond that (backpressure).
        clock: Epoch seconds (due times are epoch seconds, as in retry records).
    """

    def __init__(
        self,
        callback: Callable[[Any], Awaitable[None]],
        *,
        max_items: int = 10_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._callback = callback
        self._heap: list[tuple[float, int, Any]] = []
        self._ids = itertools.count()
        self._wakeup = asyncio.Event()
        self._space = asyncio.Semaphore(max_items)
        self._clock = clock
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._heap)

    async def add(self, due: float, item: Any) -> None:
        await self._space.acquire()
        heapq.heappush(self._heap, (due, next(self._ids), item))
        self._wakeup.set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="retry-scheduler")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        while True:
            if not self._heap:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            due = self._heap[0][0]
            delay = due - self._clock()
            if delay > 0:
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), timeout=delay)
                except TimeoutError:
                    pass
                continue
            _, _, item = heapq.heappop(self._heap)
            self._space.release()
            await self._callback(item)
