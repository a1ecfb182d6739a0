"""Send a device query to the worker that owns the device's partition.

Faust's ``app.table_route`` does this too, but it forwards with the caller's headers, answers a
missing assignment with an HTML 503, and two workers that briefly disagree about the assignment
(during a rebalance) can bounce a request between them. Here the owner comes from the same
assignment data (``app.router.table_metadata``: worker URL → changelog partitions), the partition
from the key with Kafka's default partitioner, and a forwarded request carries
:data:`FORWARDED_HEADER` so that it is answered where it lands, never forwarded twice, and the
worker's own web token (:mod:`streamapp.views.auth`), never the caller's other headers.
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
from faust.web import Request, Response, View
from yarl import URL

from streamapp.tables.faust_tables import FaustDeviceTables
from streamapp.views.auth import WEB_AUTH_KEY
from streamapp.views.errors import ApiError

__all__ = ["FORWARDED_HEADER", "call_worker", "forward_to_owner", "group_urls", "owner_of",
           "same_worker"]

log = logging.getLogger(__name__)

#: Header on forwarded requests; its value is the forwarding worker's URL.
FORWARDED_HEADER = "X-Streamapp-Forwarded-By"
#: Seconds to wait for the owner's answer.
FORWARD_TIMEOUT_S = 10.0


def _ident(url: str | URL) -> tuple[str, int]:
    u = URL(str(url))
    return (u.host or "", int(u.port or 80))


def owner_of(app: Any, tables: FaustDeviceTables, device_key: bytes) -> tuple[int, str | None]:
    """``(partition, owner URL or None when no worker owns it yet)`` of a device."""
    partition = tables.partition_of(device_key)
    topic = tables.stats.changelog_topic.get_topic_name()
    try:
        metadata = app.router.table_metadata(tables.stats.name)
    except KeyError:
        return partition, None
    for url, topics in metadata.items():
        if partition in (topics.get(topic) or ()):
            return partition, str(url)
    return partition, None


async def forward_to_owner(
    view: View, request: Request, tables: FaustDeviceTables, device_key: bytes
) -> Response | None:
    """Forward the request to the device's owner and return its answer, or None when this
    worker should answer (it owns the device, or the request was forwarded to it already).

    Raises:
        ApiError: 503 when no worker owns the device's partition yet (the group is forming or
            rebalancing) or the owner did not answer.
    """
    if request.headers.get(FORWARDED_HEADER):
        return None
    app = view.app
    partition, owner = owner_of(app, tables, device_key)
    if owner is None:
        raise ApiError(
            503, "not_ready",
            f"no worker owns partition {partition} (of device "
            f"{device_key.decode('utf-8', 'replace')!r}) yet; the group is forming or "
            "rebalancing, retry in a few seconds",
        )
    if same_worker(owner, app.conf.canonical_url):
        return None
    target = str(URL(owner).with_path("/")).rstrip("/") + str(request.rel_url)
    # faust's Request type has no app; the aiohttp driver's requests (the only ones) have
    auth = request.app.get(WEB_AUTH_KEY)  # type: ignore[attr-defined]
    headers = {FORWARDED_HEADER: str(app.conf.canonical_url), **(auth.headers() if auth else {})}
    try:
        async with app.http_client.get(
            target,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=FORWARD_TIMEOUT_S),
        ) as answer:
            body = await answer.read()
            relayed = view.bytes(
                body, content_type=answer.content_type or "application/json",
                status=answer.status,
            )
            retry_after = answer.headers.get("Retry-After")
            if retry_after is not None:  # the owner was busy: the caller should wait as told
                relayed.headers["Retry-After"] = retry_after
            return relayed
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("forwarding %s to %s failed: %s", request.rel_url, owner, exc)
        raise ApiError(
            503, "owner_unavailable",
            f"the worker that owns partition {partition}, {owner}, did not answer ({exc}); "
            "retry shortly (a dead worker's partitions move within the session timeout)",
        ) from None


def same_worker(a: str | URL, b: str | URL) -> bool:
    """Whether two web URLs name the same worker (host and port)."""
    return _ident(a) == _ident(b)


def group_urls(app: Any, tables: FaustDeviceTables) -> list[str]:
    """The web URL of every worker of the group this worker knows from the assignment
    (``app.router.table_metadata``, what ``/cluster`` shows), this worker's own included,
    sorted."""
    own = str(app.conf.canonical_url)
    try:
        urls = [str(u) for u in app.router.table_metadata(tables.stats.name)]
    except KeyError:
        urls = []
    if not any(same_worker(u, own) for u in urls):
        urls.append(own)
    return sorted(set(urls))


async def call_worker(
    app: Any, url: str, method: str, path_qs: str, timeout_s: float
) -> tuple[int, Any]:
    """Ask another worker of the group (marked as forwarded, so that it answers for itself).

    Returns:
        ``(HTTP status, decoded JSON body)``.

    Raises:
        aiohttp.ClientError / TimeoutError / ValueError: It did not answer, or not with JSON.
    """
    target = str(URL(url).with_path("/")).rstrip("/") + path_qs
    async with app.http_client.request(
        method, target, headers={FORWARDED_HEADER: str(app.conf.canonical_url)},
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    ) as answer:
        return answer.status, await answer.json(content_type=None)
