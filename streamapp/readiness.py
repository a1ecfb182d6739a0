"""What ``/ready`` asks the broker and the worker's progress, beside the local checks
(:meth:`streamapp.state.WorkerState.readiness`).

* **The broker answers a Kafka request.** A TCP connect is not enough: the kernel completes the
  handshake for a broker process that is stopped (``kill -STOP``), swapping or deadlocked, and
  the worker's consumer and producer then wait silently. :func:`probe_kafka` sends an
  ``ApiVersions`` request (API key 18, version 0: the first request every Kafka client sends,
  answered before authentication, also by Tansu) to each bootstrap server and waits at most
  ``ready_probe_timeout_ms`` for an answer with its correlation id.
* **The worker makes progress while records wait.** :class:`ProgressWatch` remembers when the
  worker last read a record from a source partition, committed an offset or saw a partition's
  fetch high watermark or position move; when records wait (the backlog,
  :func:`streamapp.state.WorkerState.backlog`, is not 0) and none of that happened for
  ``ready_stall_s`` seconds, the worker is stalled (a broker that stopped answering fetches or
  commits, an engine that hangs).

Neither belongs in liveness (``/health``): restarting a worker does not wake a frozen broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import struct
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

__all__ = ["ProgressWatch", "probe_kafka"]

#: ApiVersions request v0: API key 18, version 0, then the correlation id and client id.
_API_VERSIONS_KEY, _API_VERSIONS_VERSION = 18, 0
_CLIENT_ID = b"streamapp-ready"
_CORRELATION_ID = 0x5EAD


def _api_versions_request() -> bytes:
    header = struct.pack(">hhih", _API_VERSIONS_KEY, _API_VERSIONS_VERSION, _CORRELATION_ID,
                         len(_CLIENT_ID)) + _CLIENT_ID
    return struct.pack(">i", len(header)) + header


async def _probe_one(
    server: str, timeout_s: float, ssl_context: ssl.SSLContext | None
) -> str | None:
    host, _, port_text = server.strip().rpartition(":")
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        return f"{server!r} is not host:port"
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port, ssl=ssl_context)
            writer.write(_api_versions_request())
            await writer.drain()
            size, correlation_id = struct.unpack(">ii", await reader.readexactly(8))
    except TimeoutError:
        return f"{server} did not answer a Kafka ApiVersions request within {timeout_s:g} s"
    except ConnectionRefusedError:
        return f"{server} refused the connection (no broker listens there)"
    except asyncio.IncompleteReadError:
        return f"{server} closed the connection without answering"
    except OSError as exc:
        return f"{server}: cannot connect ({exc.strerror or exc})"
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError, ssl.SSLError):
                await writer.wait_closed()
    if correlation_id != _CORRELATION_ID or size < 4:
        return f"{server} answered, but not as a Kafka broker (correlation id {correlation_id})"
    return None


async def probe_kafka(
    bootstrap_servers: str, *, timeout_s: float, ssl_context: ssl.SSLContext | None = None
) -> str | None:
    """Ask every bootstrap server for its API versions, all at once.

    Args:
        bootstrap_servers: ``"host:port,host2:port"``.
        timeout_s: Seconds each server may take to connect and answer.
        ssl_context: For ``SSL`` / ``SASL_SSL`` listeners (``ApiVersions`` needs no SASL
            authentication).

    Returns:
        None when at least one server answered; else why not, one clause per server
        (``"127.0.0.1:9092 did not answer a Kafka ApiVersions request within 1 s"``).
    """
    servers = [s for s in bootstrap_servers.split(",") if s.strip()]
    if not servers:
        return "no bootstrap server is configured"
    problems = await asyncio.gather(*(_probe_one(s, timeout_s, ssl_context) for s in servers))
    if any(p is None for p in problems):
        return None
    return "; ".join(p for p in problems if p is not None)


@dataclass
class ProgressWatch:
    """Whether a worker with records waiting still makes progress.

    :meth:`observe` is called whenever readiness is asked for (``/ready``, ``/metrics``); the
    signals it is given are cumulative (records read, commits accepted, positions and high
    watermarks), so a change between two calls however far apart shows progress in between.

    Args:
        stall_s: Seconds without progress, while records wait, after which :meth:`observe`
            reports a stall; 0 never reports one.
        clock: Monotonic seconds (tests give their own).
    """

    stall_s: float
    clock: Callable[[], float] = time.monotonic
    _last: Hashable = None
    _since: float | None = None
    _waiting: bool = False

    def observe(self, progress: Hashable, waiting: int) -> float | None:
        """Record the worker's progress signals now.

        Args:
            progress: Anything that changes whenever the worker makes progress (e.g. a tuple of
                records read, commits accepted, per-partition positions and high watermarks).
            waiting: Records that wait to be answered (the backlog), in all source partitions.

        Returns:
            Seconds since the last progress when records wait and that is more than
            ``stall_s``; else None.
        """
        now = self.clock()
        was_waiting, self._waiting = self._waiting, waiting > 0
        # the count starts at the first look that finds records waiting: when they began to
        # wait since the look before is unknown
        if self._since is None or progress != self._last or not (was_waiting and waiting > 0):
            self._last, self._since = progress, now
            return None
        stalled = now - self._since
        return stalled if self.stall_s > 0 and stalled > self.stall_s else None
