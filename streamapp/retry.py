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
import binascii
import heapq
import itertools
import json
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, Protocol

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from streamapp.codecs import readable_fields
from streamapp.exceptions import InvalidRequestError
from streamapp.tasks import cancel_and_wait, wait_event

__all__ = [
    "DelayScheduler",
    "MemoryRetryStore",
    "RetryRecord",
    "RetryStore",
    "backoff_s",
]

log = logging.getLogger(__name__)


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

    def row(self) -> dict[str, Any]:
        """The ``retry_counts`` table row of this request (attempts so far, last and all
        errors, device): the one format every :class:`RetryStore` keeps."""
        return {
            "attempts": self.attempt,
            "last_error": self.errors[-1] if self.errors else None,
            "errors": self.errors,
            "device_id": self.device_id,
        }

    def encode(self) -> bytes:
        body = asdict(self)
        body["key"] = None if self.key is None else base64.b64encode(self.key).decode("ascii")
        body["value"] = base64.b64encode(self.value).decode("ascii")
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, value: bytes | None, *, now: float | None = None) -> RetryRecord:
        """Parse and validate a retry record read from the retry topic.

        The retry topic is input like any other: every field is checked for its type and range
        (:class:`_RetryBody`, a strict pydantic model) before anything is scheduled, stored in
        ``retry_counts`` or run, so that a record written by something else becomes a dead
        letter instead of crashing the retry agent or its scheduler.

        Args:
            value: The record value (JSON written by :meth:`encode`).
            now: The worker's clock (epoch seconds) for the ``not_before`` bound; default
                ``time.time()``.

        Returns:
            The record, with ``key`` and ``value`` base64-decoded.

        Raises:
            InvalidRequestError: ``invalid_retry_record``; its message names the fields that are
                wrong and ``fields`` holds the ids that could be read (request_id, device_id,
                model) for the dead letter.
        """
        try:
            body = json.loads((value or b"").decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise _invalid(f"it is not UTF-8 JSON ({_clip(str(exc))})", {}) from exc
        if not isinstance(body, dict):
            raise _invalid(f"it is a JSON {type(body).__name__}, not an object", {})
        readable = readable_fields(body)
        try:
            parsed = _RetryBody.model_validate(body)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}"
                for e in exc.errors(include_input=False, include_url=False)[:5]
            )
            raise _invalid(_clip(problems), readable) from exc
        now = time.time() if now is None else now
        if parsed.not_before > now + MAX_RETRY_DELAY_S:
            raise _invalid(
                f"not_before is {parsed.not_before:.0f}, {parsed.not_before - now:.0f} s ahead of "
                f"the worker's clock; a retry is due within {MAX_RETRY_DELAY_S:.0f} s",
                readable,
            )
        return cls(
            request_id=parsed.request_id,
            device_id=parsed.device_id,
            model=parsed.model,
            attempt=parsed.attempt,
            not_before=parsed.not_before,
            errors=[e.model_dump() for e in parsed.errors],
            first_failed_ts=parsed.first_failed_ts,
            source=parsed.source.model_dump(),
            key=parsed.key,
            value=parsed.value,
            extra=parsed.extra,
        )


#: How far ahead of the worker's clock a retry record's ``not_before`` may be (seconds): one day,
#: far beyond any backoff this module computes (capped by ``retry_backoff_max_ms``). A record due
#: later would hold a scheduler slot for that long.
MAX_RETRY_DELAY_S = 86_400.0

#: Most entries in a retry record's ``errors`` (one per attempt; ``max_retries`` is far lower).
MAX_RETRY_ERRORS = 1_000

_MAX_MESSAGE_CHARS = 400


def _clip(text: str, limit: int = _MAX_MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _invalid(problem: str, readable: dict[str, Any]) -> InvalidRequestError:
    error = InvalidRequestError(
        "invalid_retry_record",
        f"the retry topic holds a record this worker cannot use: {problem}; only streamapp "
        "workers should write to the retry topic",
    )
    error.fields = readable
    return error


def _base64(value: str) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not base64 ({exc})") from None


_Text = Annotated[str, Field(min_length=1)]
_Time = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
_Count = Annotated[int, Field(ge=0, le=2**63 - 1)]


class _ErrorEntry(BaseModel):
    """One failed attempt in a retry record's ``errors``."""

    model_config = ConfigDict(strict=True, extra="allow")

    attempt: _Count
    reason: _Text
    type: str
    message: str
    ts: _Time


class _Source(BaseModel):
    """Where the original request record was read."""

    model_config = ConfigDict(strict=True, extra="allow")

    topic: _Text
    partition: _Count
    offset: _Count


class _RetryBody(BaseModel):
    """The JSON form of :class:`RetryRecord`, checked strictly: no coercion (``"1"`` is not an
    attempt, ``true`` is not a number), times finite, counts in range, key/value base64.
    Unknown fields are ignored (a newer worker may add some)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    request_id: _Text
    device_id: _Text
    model: _Text
    attempt: Annotated[int, Field(ge=1, le=2**31 - 1)]
    not_before: _Time
    errors: Annotated[list[_ErrorEntry], Field(max_length=MAX_RETRY_ERRORS)]
    first_failed_ts: _Time
    source: _Source
    key: Annotated[bytes | None, BeforeValidator(
        lambda v: _base64(v) if isinstance(v, str) else v
    )]
    value: Annotated[bytes, BeforeValidator(lambda v: _base64(v) if isinstance(v, str) else v)]
    extra: dict[str, Any] = Field(default_factory=dict)


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
        self.rows[record.request_id] = record.row()

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
        """Run ``item`` at ``due`` (epoch seconds, a finite float: it is compared with others).

        Raises:
            TypeError / ValueError: ``due`` is not a finite number (nothing is added).
        """
        if isinstance(due, bool) or not isinstance(due, int | float) or not math.isfinite(due):
            raise (ValueError if isinstance(due, int | float) else TypeError)(
                f"due time {due!r} is not a finite number of epoch seconds"
            )
        await self._space.acquire()
        heapq.heappush(self._heap, (due, next(self._ids), item))
        self._wakeup.set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="retry-scheduler")

    async def stop(self) -> None:
        """Stop running items (those waiting stay in memory: their records are not committed, so
        they are read again after a restart). Never raises: a stopping worker must go on to close
        its engines and commit."""
        task, self._task = self._task, None
        try:
            await cancel_and_wait(task)
        except Exception:  # _run catches callback errors; this would be a bug of ours
            log.exception("the retry scheduler had failed")

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
                await wait_event(self._wakeup, delay)
                continue
            _, _, item = heapq.heappop(self._heap)
            self._space.release()
            try:
                await self._callback(item)
            except Exception:
                # One item must never stop the others: the record stays unacknowledged (read
                # again after a restart) and the log says why.
                log.exception("running the due retry %r failed", item)
