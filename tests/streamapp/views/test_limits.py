"""The web bounds (issue 19): concurrency and rate bounds answer 503/429 with Retry-After,
probes are never refused, listings run off the event loop with cursor pages, and what a
dashboard polls is computed once per interval."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from streamapp.app import create_app
from streamapp.settings import Settings
from streamapp.views.errors import ApiError
from streamapp.views.limits import Cached, WebLimits
from streamapp.views.listing import DeviceListing, decode_cursor, encode_cursor


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_beyond_the_concurrency_bound_a_request_gets_503_busy_and_probes_still_answer(
) -> None:
    limits = WebLimits(max_concurrent=3, max_per_s=0)
    release = asyncio.Event()
    entered = 0

    async def slow(request: web.Request) -> web.Response:
        nonlocal entered
        entered += 1
        await release.wait()
        return web.json_response({"ok": True})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application(middlewares=[limits.middleware()])
    app.router.add_get("/slow", slow)
    app.router.add_get("/health", health)
    async with TestClient(TestServer(app)) as client:
        held = [asyncio.ensure_future(client.get("/slow")) for _ in range(3)]
        async with asyncio.timeout(10):
            while entered < 3:
                await asyncio.sleep(0)
        refused = await client.get("/slow")
        body = await refused.json()
        assert refused.status == 503 and body["error"] == "busy" and body["message"]
        assert refused.headers["Retry-After"] == "1" and body["retry_after_s"] == 1
        assert (await client.get("/health")).status == 200  # exempt while the bound is full
        release.set()
        assert [r.status for r in await asyncio.gather(*held)] == [200, 200, 200]
        assert limits.inflight == 0 and limits.refused == {"busy": 1, "rate_limited": 0}
        assert (await client.get("/slow")).status == 200


def test_the_rate_bound_admits_a_second_s_worth_then_answers_429_until_tokens_refill() -> None:
    clock = FakeClock()
    limits = WebLimits(max_concurrent=100, max_per_s=5, clock=clock)
    admitted = [limits.refusal() is None for _ in range(5)]
    refused = limits.refusal()
    assert admitted == [True] * 5
    assert refused is not None and refused.status == 429
    assert refused.headers["Retry-After"] == "1"
    clock.now += 0.2  # one token back (5 per second)
    assert limits.refusal() is None
    assert limits.refusal() is not None
    assert limits.refused["rate_limited"] == 2


def test_limits_refuse_impossible_bounds() -> None:
    with pytest.raises(ValueError, match="max_concurrent"):
        WebLimits(0, 10)
    with pytest.raises(ValueError, match="max_per_s"):
        WebLimits(1, -1)


@pytest.fixture
async def limited_client(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    settings = Settings(app_id="limits-test", data_dir=tmp_path, backend="onnxruntime",
                        web_max_requests_per_s=3)
    app = create_app(settings)
    async with TestClient(TestServer(app.web.web_app)) as c:
        yield c


async def test_the_worker_s_api_answers_429_with_retry_after_beyond_its_rate(
    limited_client: TestClient[Any, Any],
) -> None:
    statuses = [(await limited_client.get("/metrics")).status for _ in range(3)]
    refused = await limited_client.get("/devices?limit=10")
    body = await refused.json()
    assert statuses == [200, 200, 200]
    assert refused.status == 429 and body["error"] == "rate_limited"
    assert int(refused.headers["Retry-After"]) >= 1
    assert "STREAMAPP_WEB_MAX_REQUESTS_PER_S" in body["message"]
    assert (await limited_client.get("/health")).status == 200
    assert (await limited_client.get("/ready")).status == 503  # not ready, but not refused


@pytest.mark.parametrize(
    "query", ["cursor=nonsense", "cursor=" + encode_cursor("-total", (-3, "a")),
              "cursor=" + encode_cursor("device_id", ("a",)) + "&offset=3"],
)
async def test_a_bad_cursor_is_a_400(tmp_path: Path, query: str) -> None:
    app = create_app(Settings(app_id="limits-test", data_dir=tmp_path, backend="onnxruntime"))
    async with TestClient(TestServer(app.web.web_app)) as client:
        response = await client.get(f"/devices?{query}")
        body = await response.json()
    assert (response.status, body["error"]) == (400, "bad_query"), body


def devices(n: int) -> list[dict[str, Any]]:
    return [{"device_id": f"dev-{i:05d}", "total": (i * 7919) % 101, "last_seen": float(i % 13)}
            for i in range(n)]


@pytest.mark.parametrize("sort", ["device_id", "-total", "-last_seen"])
async def test_cursor_pages_list_every_device_once_in_order_from_a_scan_off_the_loop(
    sort: str,
) -> None:
    rows = devices(2_345)
    scanned_on: list[int] = []

    def scan() -> list[dict[str, Any]]:
        scanned_on.append(threading.get_ident())
        return rows

    listing = DeviceListing(scan, cache_s=60.0)
    seen: list[dict[str, Any]] = []
    after = None
    pages = 0
    while True:
        body = json.loads(await listing.page(sort, 1000, 0, after, {}))
        seen += body["devices"]
        pages += 1
        assert body["count"] == len(rows)
        if body["next_cursor"] is None:
            break
        after = decode_cursor(body["next_cursor"], sort)
    field = sort.lstrip("-")
    expected = sorted(rows, key=lambda d: (d["device_id"],) if sort == "device_id"
                      else (-d[field], d["device_id"]))
    assert pages == 3 and seen == expected
    assert scanned_on and threading.get_ident() not in scanned_on  # never on the loop's thread
    assert listing.scans == 1  # one snapshot served all three pages


async def test_concurrent_listings_share_one_scan_and_a_new_one_comes_after_the_interval(
) -> None:
    clock = FakeClock()
    calls = 0

    def scan() -> list[dict[str, Any]]:
        nonlocal calls
        calls += 1
        return devices(50)

    listing = DeviceListing(scan, cache_s=0.25, clock=clock)
    pages = await asyncio.gather(*(listing.page("-total", 10, i, None, {}) for i in range(20)))
    assert len(pages) == 20 and calls == 1
    clock.now += 0.3
    await listing.page("-total", 10, 0, None, {})
    assert calls == 2


async def test_a_listing_interrupted_by_a_rebalance_is_a_503() -> None:
    def scan() -> list[dict[str, Any]]:
        raise RuntimeError("dictionary changed size during iteration")

    listing = DeviceListing(scan, cache_s=0.25)
    with pytest.raises(ApiError) as caught:
        await listing.page("device_id", 10, 0, None, {})
    assert caught.value.status == 503 and caught.value.code == "not_ready"


async def test_cached_computes_once_per_interval_and_not_after_a_failure() -> None:
    clock = FakeClock()
    cache: Cached[bytes] = Cached(0.25, clock=clock)
    computed = 0

    async def render() -> bytes:
        nonlocal computed
        computed += 1
        await asyncio.sleep(0)
        return b"text %d" % computed

    answers = await asyncio.gather(*(cache.get("m", render) for _ in range(10)))
    assert set(answers) == {b"text 1"} and computed == 1
    clock.now += 0.1
    assert await cache.get("m", render) == b"text 1"
    clock.now += 0.2
    assert await cache.get("m", render) == b"text 2"

    async def broken() -> bytes:
        raise OSError("no")

    clock.now += 1.0
    with pytest.raises(OSError):
        await cache.get("m", broken)
    assert await cache.get("m", render) == b"text 3"
