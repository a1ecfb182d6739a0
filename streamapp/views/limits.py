"""Bounds on what the web API may take from the worker's event loop (issue 19).

The web server shares the event loop with the agents: every query answered is loop time the
inference pipeline waits for. Unbounded, 64 clients asking for device state raised inference
p99 from 42 ms to 16 s. Three bounds keep queries from starving the agents:

* :class:`WebLimits`, an aiohttp middleware: at most ``web_max_concurrent_requests`` requests
  are answered at once (beyond: 503 ``busy``) and at most ``web_max_requests_per_s`` are
  admitted per second (a token bucket, bursts up to one second's worth; beyond: 429
  ``rate_limited``), both with ``Retry-After`` (seconds). Liveness and readiness probes
  (:data:`EXEMPT_PATHS`) are never refused: an orchestrator must not restart or unroute a worker
  because it is busy answering queries.
* :class:`Cached`: what a dashboard polls (``/metrics``, ``/devices`` listings) is computed at
  most once per ``web_cache_ms`` and served from memory in between.
* The heavy part of a query — reading many rows, sorting, rendering large answers — runs in
  one thread of its own (:func:`off_loop`), never on the event loop: queries then compete with
  the agents for the GIL (one thread, released every ``sys.getswitchinterval()``), not for
  the loop, and never with each other for more than that one thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, Generic, TypeVar

from aiohttp import web

__all__ = ["EXEMPT_PATHS", "Cached", "WebLimits", "off_loop"]

#: Paths the bounds never refuse (cheap, and what orchestrators probe).
EXEMPT_PATHS = frozenset({"/health", "/ready"})

V = TypeVar("V")

#: The one thread the web API's heavy work runs in (created on first use).
_QUERY_THREAD: concurrent.futures.ThreadPoolExecutor | None = None


async def off_loop(fn: Callable[[], V]) -> V:
    """Run ``fn()`` in the web API's query thread (one for the process) and return its value.

    Raises:
        Exception: What ``fn`` raised.
    """
    global _QUERY_THREAD
    if _QUERY_THREAD is None:
        _QUERY_THREAD = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="web-query"
        )
    return await asyncio.get_running_loop().run_in_executor(_QUERY_THREAD, fn)


class WebLimits:
    """Admission control for the web server: a concurrency bound and a rate bound.

    Args:
        max_concurrent: Requests answered at once (>= 1); one more gets 503 ``busy``.
        max_per_s: Requests admitted per second (token bucket of that many tokens, refilled
            continuously); 0 means no rate bound. Beyond it: 429 ``rate_limited``.
        clock: Monotonic seconds; tests pass a fake.

    Raises:
        ValueError: ``max_concurrent < 1`` or ``max_per_s < 0``.

    Attributes:
        inflight: Requests being answered now (exempt paths not counted).
        refused: Requests refused so far, by error code (``busy``, ``rate_limited``).
    """

    def __init__(
        self, max_concurrent: int, max_per_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        if max_per_s < 0:
            raise ValueError(f"max_per_s must be >= 0 (0: no rate bound), got {max_per_s}")
        self.max_concurrent = max_concurrent
        self.max_per_s = float(max_per_s)
        self._clock = clock
        self._tokens = self.max_per_s
        self._refilled_at = clock()
        self.inflight = 0
        self.refused: dict[str, int] = {"busy": 0, "rate_limited": 0}

    def _take_token(self) -> float:
        """Take a token; 0.0 when one was taken, else the seconds until one is available."""
        if self.max_per_s <= 0:
            return 0.0
        now = self._clock()
        self._tokens = min(self.max_per_s,
                           self._tokens + (now - self._refilled_at) * self.max_per_s)
        self._refilled_at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self.max_per_s

    def refusal(self) -> web.Response | None:
        """The answer to a request beyond a bound, or None when it is admitted (the caller
        must then call :meth:`done` once it is answered)."""
        if self.inflight >= self.max_concurrent:
            return self._refuse(
                503, "busy", 1.0,
                f"this worker is answering {self.inflight} requests already, its bound "
                f"(STREAMAPP_WEB_MAX_CONCURRENT_REQUESTS={self.max_concurrent}); retry after "
                "the Retry-After seconds",
            )
        wait_s = self._take_token()
        if wait_s > 0:
            return self._refuse(
                429, "rate_limited", wait_s,
                f"this worker answers at most {self.max_per_s:g} requests per second "
                "(STREAMAPP_WEB_MAX_REQUESTS_PER_S); retry after the Retry-After seconds",
            )
        self.inflight += 1
        return None

    def done(self) -> None:
        self.inflight -= 1

    def _refuse(self, status: int, code: str, wait_s: float, message: str) -> web.Response:
        self.refused[code] += 1
        retry_after = max(1, math.ceil(wait_s))  # Retry-After takes whole seconds
        return web.json_response(
            {"error": code, "message": message, "status": status, "retry_after_s": retry_after},
            status=status, headers={"Retry-After": str(retry_after)},
        )

    def middleware(self) -> Any:
        """The aiohttp middleware applying these bounds (append it to the web app's
        ``middlewares`` before the server starts)."""

        @web.middleware
        async def limit(request: web.Request, handler: Any) -> web.StreamResponse:
            if request.path in EXEMPT_PATHS:
                return await handler(request)  # type: ignore[no-any-return]
            refused = self.refusal()
            if refused is not None:
                return refused
            try:
                return await handler(request)  # type: ignore[no-any-return]
            finally:
                self.done()

        return limit


class Cached(Generic[V]):
    """Values computed at most once per ``ttl_s`` per key; concurrent askers of a key whose
    value is being computed wait for that one computation (single flight).

    Args:
        ttl_s: How long a value is served after it was computed (seconds; 0: every ask
            computes, but concurrent asks still share one computation).
        max_keys: Values kept at most; the oldest goes first.
        clock: Monotonic seconds; tests pass a fake.
    """

    def __init__(self, ttl_s: float, *, max_keys: int = 64,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._clock = clock
        self._values: dict[Hashable, tuple[float, V]] = {}
        self._computing: dict[Hashable, asyncio.Future[V]] = {}
        #: Computations run so far (tests read it).
        self.computed = 0

    async def get(self, key: Hashable, compute: Callable[[], Awaitable[V]]) -> V:
        """The value of ``key``: cached when younger than ``ttl_s``, else ``await compute()``.

        Raises:
            Exception: What ``compute`` raised (nothing is cached then).
        """
        hit = self._values.get(key)
        if hit is not None and self._clock() - hit[0] < self.ttl_s:
            return hit[1]
        running = self._computing.get(key)
        if running is not None:
            return await asyncio.shield(running)
        future: asyncio.Future[V] = asyncio.get_running_loop().create_future()
        self._computing[key] = future
        try:
            value = await compute()
        except BaseException as exc:
            if isinstance(exc, Exception):
                future.set_exception(exc)
                future.exception()  # retrieved: waiters re-raise it, and no asyncio warning
            else:
                future.cancel()
            raise
        finally:
            del self._computing[key]
        self.computed += 1
        self._values.pop(key, None)
        self._values[key] = (self._clock(), value)
        while len(self._values) > self.max_keys:
            del self._values[next(iter(self._values))]
        future.set_result(value)
        return value
