"""``/devices`` listings off the event loop: snapshot, sort, paginate by cursor.

Listing reads every stats row this worker owns (0.7–1 s for 30,000 devices, issue 19), so it
never runs on the event loop: :class:`DeviceListing` takes a snapshot of the rows in a thread,
sorts it there, and renders pages there. A snapshot is reused for ``cache_s`` and at least four
times as long as taking it lasted (so scans keep at most a fifth of the wall time, however many
clients ask); one scan runs at a time and concurrent askers share it. Pages are keyset-paginated:
the cursor is the sort key of the last device of the page, so a page follows its predecessor
even when devices were added in between (with ``-total`` / ``-last_seen`` a device whose value
changed between two pages may appear twice or not at all; ``device_id`` pages are exact).
"""

from __future__ import annotations

import base64
import binascii
import bisect
import json
import time
from collections.abc import Callable
from typing import Any

from streamapp.views.errors import ApiError
from streamapp.views.limits import Cached, off_loop

__all__ = ["SORTS", "DeviceListing", "decode_cursor", "encode_cursor"]

SORTS = ("device_id", "-total", "-last_seen")

#: A device's position in a sort order: ``(-value, device_id)`` or ``(device_id,)``.
SortKey = tuple[Any, ...]
#: Times a snapshot is kept relative to how long it took (a scan's share of wall time <= 1/5).
SCAN_DUTY_FACTOR = 4.0


def sort_key(sort: str, device: dict[str, Any]) -> SortKey:
    if sort == "device_id":
        return (device["device_id"],)
    value = device.get(sort[1:]) or 0
    return (-value, device["device_id"])


def encode_cursor(sort: str, key: SortKey) -> str:
    """The opaque ``cursor`` that asks for the devices after ``key`` in ``sort`` order."""
    raw = json.dumps([sort, list(key)], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def decode_cursor(cursor: str, sort: str) -> SortKey:
    """The sort key a ``cursor`` from :func:`encode_cursor` stands for.

    Raises:
        ApiError: 400 ``bad_query`` when it is not such a cursor, or was made for another sort.
    """
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        made_for, key = json.loads(raw)
        if not isinstance(made_for, str) or not isinstance(key, list):
            raise ValueError(cursor)
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError):
        raise ApiError(
            400, "bad_query",
            f"cursor={cursor[:80]!r} is not a cursor this API gave; use the next_cursor of the "
            "previous page as it is",
        ) from None
    if made_for != sort:
        raise ApiError(
            400, "bad_query",
            f"the cursor was given for sort={made_for}, not sort={sort}; keep the sort of the "
            "first page",
        )
    expected = (str,) if sort == "device_id" else (int | float, str)
    if len(key) != len(expected) or not all(
        isinstance(v, t) and not isinstance(v, bool) for v, t in zip(key, expected, strict=True)
    ):
        raise ApiError(400, "bad_query", f"cursor={cursor[:80]!r} is damaged; start again")
    return tuple(key)


class _Sorted:
    """One sort order of a snapshot: devices and their sort keys, in order."""

    __slots__ = ("devices", "keys")

    def __init__(self, sort: str, devices: list[dict[str, Any]]) -> None:
        pairs = sorted(((sort_key(sort, d), d) for d in devices), key=lambda p: p[0])
        self.keys = [k for k, _ in pairs]
        self.devices = [d for _, d in pairs]


class DeviceListing:
    """Pages of the devices this worker owns, computed in threads and cached.

    Args:
        scan: ``() -> device summaries`` (``DeviceStateReader.devices``); runs in a thread.
        cache_s: How long snapshots and rendered pages are reused (seconds, >= 0).
        clock: Monotonic seconds; tests pass a fake.
    """

    def __init__(
        self, scan: Callable[[], list[dict[str, Any]]], cache_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._scan = scan
        self.cache_s = cache_s
        self._snapshots: Cached[_Sorted] = Cached(cache_s, max_keys=len(SORTS), clock=clock)
        self._pages: Cached[bytes] = Cached(cache_s, max_keys=64, clock=clock)
        self._clock = clock
        #: Scans run so far (tests read it).
        self.scans = 0

    async def page(
        self, sort: str, limit: int, offset: int, after: SortKey | None, head: dict[str, Any]
    ) -> bytes:
        """One page as JSON bytes: ``head`` plus ``count``, ``offset``, ``limit``,
        ``next_offset`` (offset paging) or ``next_cursor`` (None on the last page),
        ``devices``.

        Args:
            sort: One of :data:`SORTS`.
            limit: Devices per page (>= 1).
            offset: Devices to skip (ignored when ``after`` is given).
            after: The sort key a cursor stands for: the page starts after it.
            head: Fields every page carries (worker, url).

        Raises:
            ApiError: 503 ``not_ready`` when the tables changed under the scan (a rebalance).
        """
        snapshot = await self._snapshots.get(sort, lambda: self._take(sort))

        def render() -> bytes:
            if after is not None:
                start = bisect.bisect_right(snapshot.keys, after)
            else:
                start = offset
            rows = snapshot.devices[start: start + limit]
            more = start + limit < len(snapshot.devices)
            body = {
                **head, "count": len(snapshot.devices), "offset": start, "limit": limit,
                "next_offset": start + limit if more else None,
                "next_cursor": encode_cursor(sort, snapshot.keys[start + limit - 1])
                if more else None,
                "devices": rows,
            }
            return json.dumps(body).encode()

        key = (id(snapshot), sort, limit, offset, after)
        return await self._pages.get(key, lambda: off_loop(render))

    async def _take(self, sort: str) -> _Sorted:
        started = self._clock()

        def scan_and_sort() -> _Sorted:
            return _Sorted(sort, self._scan())

        try:
            snapshot = await off_loop(scan_and_sort)
        except RuntimeError as exc:  # a partition's store came or went while it was read
            raise ApiError(
                503, "not_ready",
                f"this worker's partitions changed while its devices were listed ({exc}); "
                "retry in a few seconds",
            ) from None
        self.scans += 1
        took = self._clock() - started
        self._snapshots.ttl_s = max(self.cache_s, SCAN_DUTY_FACTOR * took)
        return snapshot
