"""``/devices``, ``/devices/{device_id}`` and ``/devices/{device_id}/windows``."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import faust
from faust.web import Request, Response

from streamapp.tables import WINDOW_KINDS
from streamapp.views.errors import ApiError, ApiView
from streamapp.views.limits import Cached, off_loop
from streamapp.views.listing import SORTS, DeviceListing, decode_cursor
from streamapp.views.params import (
    check_params,
    choice,
    device_id_from_path,
    device_key,
    int_param,
)
from streamapp.views.routing import forward_to_owner

if TYPE_CHECKING:
    from streamapp.state import WorkerState

__all__ = ["add_device_views"]

#: ``/devices`` page size: default and maximum.
PAGE_DEFAULT, PAGE_MAX = 100, 1000
#: ``/devices/{id}/windows``: windows returned by default, and the most a query may ask for
#: whatever the settings (at most what expiry keeps: 360 tumbling windows by default): each
#: window is rendered, empty or not, so ``last`` bounds the work and size of one answer.
LAST_DEFAULT, LAST_MAX = 6, 1000


def _unknown(device_id: str) -> ApiError:
    return ApiError(
        404, "unknown_device",
        f"no state of device {device_id!r}: none of its requests was processed, its first "
        "outcomes are not written yet (device state is written every "
        "state_flush_interval_ms), or its state expired; device ids are the request "
        "records' keys",
        device_id=device_id,
    )


def add_device_views(app: faust.App, state: WorkerState, cache_s: float = 0.0) -> None:
    """Register ``/devices``, ``/devices/{device_id}`` and ``/devices/{device_id}/windows``.

    Args:
        cache_s: How long a listing's snapshot of this worker's devices and its rendered pages
            are served before they are computed again (seconds; ``web_cache_ms``).
    """
    reader = state.reader
    listing = DeviceListing(reader.devices, cache_s)
    rendered: Cached[bytes | None] = Cached(cache_s, max_keys=256)

    @app.page("/devices")
    class Devices(ApiView):
        """Devices this worker owns, paginated by cursor (or offset)."""

        async def get(self, request: Request) -> Response:
            query = request.query
            check_params(query, ("limit", "offset", "sort", "cursor"))
            limit = int_param(query, "limit", default=PAGE_DEFAULT, low=1, high=PAGE_MAX)
            offset = int_param(query, "offset", default=0, low=0, high=2**31)
            sort = choice(query, "sort", SORTS, default="device_id")
            cursor = query.get("cursor")
            if cursor is not None and "offset" in query:
                raise ApiError(400, "bad_query", "give cursor or offset, not both")
            after = None if cursor is None else decode_cursor(cursor, sort)
            body = await listing.page(
                sort, limit, offset, after, {"worker": state.worker, "url": state.url}
            )
            return self.bytes(body, content_type="application/json")

    @app.page("/devices/{device_id}")
    class Device(ApiView):
        """One device's stats, from whichever worker owns it."""

        async def get(self, request: Request, device_id: str) -> Response:
            check_params(request.query, ())
            device_id = device_id_from_path(request)
            key = device_key(device_id)
            forwarded = await forward_to_owner(self, request, state.tables, key)
            if forwarded is not None:
                return forwarded
            row = reader.stats(key)
            if row is None:
                raise _unknown(device_id)
            body: dict[str, Any] = {
                **row, "partition": state.tables.partition_of(key), "served_by": state.worker,
            }
            return self.json(body)

    @app.page("/devices/{device_id}/windows")
    class DeviceWindows(ApiView):
        """A device's most recent tumbling or hopping windows."""

        async def get(self, request: Request, device_id: str) -> Response:
            query = request.query
            check_params(query, ("kind", "last"))
            device_id = device_id_from_path(request)
            key = device_key(device_id)
            kind = choice(query, "kind", WINDOW_KINDS, default="tumbling")
            plan = state.plan
            last = int_param(query, "last", default=LAST_DEFAULT, low=1,
                             high=min(plan.max_last(kind), LAST_MAX))
            forwarded = await forward_to_owner(self, request, state.tables, key)
            if forwarded is not None:
                return forwarded

            def render() -> bytes | None:
                windows = reader.windows(key, kind, last)
                if windows is None:
                    return None
                return json.dumps({
                    "device_id": device_id, "kind": kind,
                    "size_s": plan.size_ms(kind) / 1000.0,
                    "step_s": plan.step_of(kind) / 1000.0,
                    "served_by": state.worker, "windows": windows,
                }).encode()

            # up to 360 windows from as many buckets: read and rendered off the event loop,
            # and served again for web_cache_ms (buckets change once per state flush)
            body = await rendered.get((key, kind, last), lambda: off_loop(render))
            if body is None:
                raise _unknown(device_id)
            return self.bytes(body, content_type="application/json")
