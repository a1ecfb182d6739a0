"""The web API in process, without a broker: routes, validation, JSON errors, docs.

Device answers with real data are tested against running workers in
``tests/integration/test_state.py``; here the app never joins a group, so device queries that
pass validation get 503 ``not_ready`` (no worker owns any partition yet).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from streamapp.app import create_app
from streamapp.children import free_port
from streamapp.codecs import decode_request
from streamapp.exceptions import InvalidRequestError
from streamapp.faust_compat import PartitionMarks
from streamapp.readiness import ProgressWatch
from streamapp.settings import Settings
from streamapp.views import ENDPOINTS, api_reference
from streamapp.views.errors import (
    LINGER_S,
    MAX_HEADER_BYTES,
    MAX_URL_BYTES,
    unreadable_request,
)

API_DOC = (Path(__file__).resolve().parents[3] / "docs" / "api.md").read_text()


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    app = create_app(Settings(app_id="views-test", data_dir=tmp_path, backend="onnxruntime"))
    async with TestClient(TestServer(app.web.web_app)) as c:
        c.faust_app = app  # type: ignore[attr-defined]
        yield c


def test_the_registered_routes_are_the_documented_endpoints(tmp_path: Path) -> None:
    app = create_app(Settings(app_id="views-test", data_dir=tmp_path))
    routes = {(r.method, r.resource.canonical) for r in app.web.web_app.router.routes()
              if r.method != "HEAD"}
    assert routes == {(method, path) for method, path, *_ in ENDPOINTS}


def test_the_api_doc_shows_the_api_reference() -> None:
    block = API_DOC.split("<!-- api-reference:start -->\n")[1].split("\n<!-- api-reference:end")[0]
    assert block == api_reference()


async def test_health_and_not_ready(client: TestClient[Any, Any]) -> None:
    response = await client.get("/health")
    assert response.status == 200 and (await response.json())["status"] == "ok"
    response = await client.get("/ready")
    body = await response.json()
    assert response.status == 503 and body["ready"] is False
    assert body["checks"]["partitions_assigned"] is False and body["assigned"] == []


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [
        ("/devices/cam1", 503, "not_ready"),
        ("/devices/cam1/windows?kind=hopping&last=3", 503, "not_ready"),
        ("/devices/%00", 400, "bad_device_id"),
        ("/devices/%C3%28", 400, "bad_device_id"),
        ("/devices/" + "d" * 257, 400, "bad_device_id"),
        ("/devices/cam1/windows?kind=session", 400, "bad_query"),
        ("/devices/cam1/windows?last=0", 400, "bad_query"),
        ("/devices/cam1/windows?last=361", 400, "bad_query"),
        ("/devices/cam1/windows?kind=hopping&last=356", 400, "bad_query"),
        ("/devices/cam1/windows?last=1.5", 400, "bad_query"),
        ("/devices/cam1?x=1", 400, "bad_query"),
        ("/devices?limit=abc", 400, "bad_query"),
        ("/devices?sort=total", 400, "bad_query"),
        ("/health?verbose=1", 400, "bad_query"),
        ("/nonexistent", 404, "not_found"),
        ("/devices/cam1/windows/extra", 404, "not_found"),
    ],
)
async def test_errors_are_json_with_a_code_and_a_message(
    client: TestClient[Any, Any], path: str, status: int, code: str
) -> None:
    response = await client.get(path)
    body = await response.json()
    assert (response.status, body["error"]) == (status, code), body
    assert body["status"] == status and body["message"]


@pytest.mark.parametrize(
    ("last", "message"),
    [
        ("99999999999999999999999", "last=99999999999999999... is out of range; use 1..360"),
        ("9" * 5000, "last=99999999999999999... is out of range; use 1..360"),
        ("-99999999999999999999999", "last=-9999999999999999... is out of range; use 1..360"),
        ("\u0665", "last='\u0665' is not an integer; use 1..360"),
        ("1_0", "last='1_0' is not an integer; use 1..360"),
        (" 5", "last=' 5' is not an integer; use 1..360"),
    ],
)
async def test_a_huge_or_non_ascii_last_is_a_json_400_naming_the_range(
    client: TestClient[Any, Any], last: str, message: str
) -> None:
    response = await client.get("/devices/cam1/windows", params={"last": last})
    body = await response.json()

    assert (response.status, body["error"], body["message"]) == (400, "bad_query", message)


async def test_last_has_a_cap_of_its_own_whatever_window_expires_s_keeps(
    tmp_path: Path,
) -> None:
    # one-second windows kept a day: expiry alone would allow last=86,400
    settings = Settings(app_id="views-test", data_dir=tmp_path, backend="onnxruntime",
                        tumbling_window_s=1.0, hopping_step_s=1.0, window_expires_s=86_400)
    app = create_app(settings)
    async with TestClient(TestServer(app.web.web_app)) as c:
        capped = await c.get("/devices/cam1/windows?last=1000")
        refused = await c.get("/devices/cam1/windows?last=1001")
        body = await refused.json()

    assert capped.status == 503  # valid; no worker owns the device yet
    assert (refused.status, body["error"], body["message"]) == (
        400, "bad_query", "last=1001 is out of range; use 1..1000")


def _accepted_at_intake(device_id: str) -> bool:
    body = {"request_id": "r", "device_id": device_id, "seq": 0, "ts": 1_700_000_000.0,
            "model": "digits", "tensor": {"dtype": "uint8", "shape": [0], "data": ""}}
    try:
        decode_request(json.dumps(body).encode(), now=1_700_000_000.0)
    except InvalidRequestError as exc:
        assert exc.reason == "bad_device_id", exc
        return False
    return True


DEVICE_IDS = ["cam17", "tab\tdev", "nul\x00dev", "rtl-\u202e-abc", "d" * 256, "d" * 257,
              "space dev", "kamera-äö", "📷-cam", "\ufffd-dev", "a/b", "%41",
              "new\nline", "zw\u200bj", "\ud800-surrogate", "nbsp\u00a0dev"]


@pytest.mark.parametrize("device_id", DEVICE_IDS, ids=[ascii(d)[:20] for d in DEVICE_IDS])
async def test_a_device_id_is_queryable_exactly_when_a_request_may_carry_it(
    client: TestClient[Any, Any], device_id: str
) -> None:
    # one rule at intake and in the views: a device the worker records can be asked for
    response = await client.get("/devices/" + quote(device_id.encode("utf-8", "surrogatepass"),
                                                     safe=""))
    body = await response.json()
    accepted = _accepted_at_intake(device_id)

    assert (response.status, body["error"]) == ((503, "not_ready") if accepted
                                                else (400, "bad_device_id")), body


@pytest.mark.parametrize(("method", "path", "allowed", "header"), [
    ("POST", "/ready", "GET", "GET,HEAD"),
    ("DELETE", "/devices/cam1", "GET", "GET,HEAD"),
    ("GET", "/models/digits/load", "POST", "POST"),
    ("PUT", "/models/digits/unload", "POST", "POST"),
])
async def test_a_method_a_path_does_not_answer_is_a_json_405_naming_those_it_does(
    client: TestClient[Any, Any], method: str, path: str, allowed: str, header: str
) -> None:
    response = await client.request(method, path)
    body = await response.json()

    assert (response.status, body["error"]) == (405, "method_not_allowed")
    assert body["message"] == (
        f"{method} is not allowed on {path}; it answers {allowed} (docs/api.md)")
    assert response.headers["Allow"] == header  # exactly the methods answered


@pytest.mark.parametrize("path", ["/models/digits/load", "/models/digits/unload"])
async def test_head_on_a_post_only_path_is_a_405_with_allow_post(
    client: TestClient[Any, Any], path: str,
) -> None:
    response = await client.head(path)

    assert (response.status, response.headers["Allow"]) == (405, "POST")
    # HEAD stays answered where GET is
    assert (await client.head("/health")).status == 200


async def test_the_404_message_lists_every_route_with_its_method(
    client: TestClient[Any, Any],
) -> None:
    response = await client.get("/nonexistent")
    body = await response.json()

    assert (response.status, body["error"]) == (404, "not_found")
    listed = body["message"].removeprefix("no endpoint serves /nonexistent; the endpoints are ")
    listed = listed.removesuffix(" (docs/api.md)").replace(" and ", ", ").split(", ")
    assert sorted(listed) == sorted(f"{method} {path}" for method, path, *_ in ENDPOINTS)
    assert {"GET /models", "POST /models/{name}/load", "POST /models/{name}/unload"} <= set(
        listed)


async def test_the_404_message_lists_no_faust_builtin_route(tmp_path: Path) -> None:
    app = create_app(Settings(app_id="views-test", data_dir=tmp_path, backend="onnxruntime"))
    app.web.init_server()  # what a worker does: Faust adds its own routes (/router/, /table/, /)
    canonical = {r.resource.canonical for r in app.web.web_app.router.routes()}
    assert {"/router/", "/table/", "/"} <= canonical

    async with TestClient(TestServer(app.web.web_app)) as c:
        body = await (await c.get("/nonexistent")).json()

    assert body["message"] == (
        "no endpoint serves /nonexistent; the endpoints are "
        + ", ".join(f"{m} {p}" for m, p, *_ in ENDPOINTS[:-1])
        + f" and {ENDPOINTS[-1][0]} {ENDPOINTS[-1][1]} (docs/api.md)")
    assert "/router" not in body["message"] and "/table" not in body["message"]


async def test_a_404_repeats_at_most_200_characters_of_the_path(
    client: TestClient[Any, Any],
) -> None:
    path = "/" + "x" * 5000
    body = await (await client.get(path)).json()

    assert body["message"].startswith(f"no endpoint serves {path[:200]}…; the endpoints are ")
    assert "x" * 200 not in body["message"]


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[str]:
    """The app's web server as a worker starts it (Faust's driver, streamapp's runner) on a
    free port; its URL."""
    port = free_port()
    app = create_app(Settings(app_id="views-test", data_dir=tmp_path, backend="onnxruntime",
                              web_port=port))
    await app.web.start_server()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await app.web.stop_server()


@pytest.mark.parametrize(("url_bytes", "status", "code"), [
    (MAX_URL_BYTES, 400, "bad_device_id"),  # read, and answered by the view
    (MAX_URL_BYTES + 1, 414, "uri_too_long"),
    (100_000, 414, "uri_too_long"),
])
async def test_a_url_over_the_limit_is_a_json_414_from_the_running_server(
    served: str, url_bytes: int, status: int, code: str
) -> None:
    path = "/devices/" + "d" * (url_bytes - len("/devices/"))
    async with aiohttp.ClientSession() as session, session.get(served + path) as response:
        body = await response.json()

    assert (response.status, response.content_type) == (status, "application/json")
    assert (body["error"], body["status"]) == (code, status)
    if status == 414:
        assert body["message"] == (
            "the URL (path and query) is longer than 8,192 bytes, the most the web API reads; "
            "a device id is at most 256 characters (docs/api.md)")


@pytest.mark.parametrize("headers", [
    {"X-Big": "v" * (MAX_HEADER_BYTES + 1)},  # a value over the limit
    {"X-" + "n" * (MAX_HEADER_BYTES - 1): "v"},  # a name over it
], ids=["value", "name"])
async def test_a_header_over_the_limit_is_a_json_431_from_the_running_server(
    served: str, headers: dict[str, str],
) -> None:
    async with aiohttp.ClientSession() as session, session.get(
        served + "/health", headers=headers
    ) as response:
        body = await response.json()

    assert (response.status, body) == (431, {
        "error": "header_too_long", "status": 431,
        "message": "a request header name or value is longer than 8,190 bytes, the most the "
                   "web API reads of each"})


async def test_a_header_name_and_value_each_within_the_limit_are_read(served: str) -> None:
    # the limit is on the name and on the value, each: together they may exceed it
    name, value = "X-" + "n" * (MAX_HEADER_BYTES - 10), "v" * (MAX_HEADER_BYTES - 10)
    async with aiohttp.ClientSession() as session, session.get(
        served + "/health", headers={name: value}
    ) as response:
        assert response.status == 200


@pytest.mark.parametrize(("request_bytes", "message"), [
    (b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
     "the request is not valid HTTP/1.1: Invalid header token"),
    (b"GET /health HTTP/9.1\r\n\r\n",
     "the request is not valid HTTP/1.1: Bad status line: Invalid HTTP version"),
], ids=["header", "version"])
async def test_a_request_that_is_not_http_is_a_json_400_from_the_running_server(
    served: str, request_bytes: bytes, message: str,
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", int(served.rsplit(":", 1)[1]))
    writer.write(request_bytes)
    await writer.drain()
    head, _, payload = (await reader.read()).partition(b"\r\n\r\n")  # then it closes
    writer.close()

    assert head.split(b"\r\n")[0].endswith(b" 400 Bad Request")
    assert b"Content-Type: application/json" in head
    body = json.loads(payload)
    assert (body["error"], body["status"]) == ("bad_request", 400)
    assert body["message"] == message  # one line: not the parser's copy of the input and caret


async def test_an_unread_huge_body_holds_its_connection_about_linger_s_not_10_s(
    served: str,
) -> None:
    """A 405 is answered before the body is read; the rest of the declared body is then
    discarded for LINGER_S, not aiohttp's default 10 s, before the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", int(served.rsplit(":", 1)[1]))
    writer.write(b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n"
                 + b"x" * 1000)
    await writer.drain()
    answered = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    closed = await asyncio.wait_for(reader.read(), LINGER_S + 4)  # EOF: it closed
    writer.close()

    assert answered.split(b"\r\n")[0].endswith(b" 405 Method Not Allowed")
    assert b"error" in closed  # the JSON body, then EOF well before 10 s


async def test_a_connection_that_never_finishes_its_request_head_is_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Slowloris: a connection that sends part of a request head and then nothing is closed
    after KEEPALIVE_S (1 s here; 30 s by default, aiohttp's own 75 s before), while the
    server goes on answering others."""
    from streamapp.views import errors

    monkeypatch.setattr(errors, "KEEPALIVE_S", 1.0)
    port = free_port()
    app = create_app(Settings(app_id="views-test", data_dir=tmp_path, backend="onnxruntime",
                              web_port=port))
    await app.web.start_server()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # no blank line: never done
        await writer.drain()
        async with aiohttp.ClientSession() as session, session.get(
            f"http://127.0.0.1:{port}/health"
        ) as response:
            assert response.status == 200
        assert await asyncio.wait_for(reader.read(), 6) == b""  # EOF: closed, no answer
        writer.close()
    finally:
        await app.web.stop_server()


def test_a_failure_outside_the_views_is_a_json_500_too() -> None:
    # what aiohttp's request handler passes on when an exception escapes the app
    assert unreadable_request(500, RuntimeError("bug")).body() == {
        "error": "internal_error", "status": 500,
        "message": "the worker failed to answer; its log has the traceback"}


async def test_the_running_server_answers_as_before(served: str) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(served + "/health") as health:
            assert (health.status, (await health.json())["status"]) == (200, "ok")
        async with session.get(served + "/nonexistent") as missing:
            assert (missing.status, (await missing.json())["error"]) == (404, "not_found")


async def test_a_device_listing_when_nothing_is_owned(client: TestClient[Any, Any]) -> None:
    response = await client.get("/devices?limit=10&sort=-total")
    body = await response.json()
    assert response.status == 200
    assert (body["count"], body["devices"], body["next_offset"]) == (0, [], None)


async def test_metrics_are_prometheus_text(client: TestClient[Any, Any]) -> None:
    response = await client.get("/metrics")
    assert response.status == 200 and response.content_type == "text/plain"
    text = await response.text()
    assert re.search(r"^streamapp_ready 0\.0$", text, re.M)


async def test_ready_is_503_while_the_broker_accepts_connections_but_does_not_answer(
    tmp_path: Path,
) -> None:
    async def frozen(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.read()  # what a broker stopped with SIGSTOP does: the kernel accepts
        finally:
            writer.close()

    server = await asyncio.start_server(frozen, "127.0.0.1", 0)
    address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    app = create_app(Settings(app_id="views-test", data_dir=tmp_path, backend="onnxruntime",
                              broker=f"kafka://{address}", ready_probe_timeout_ms=300))
    try:
        async with TestClient(TestServer(app.web.web_app)) as c:
            response = await c.get("/ready")
            body = await response.json()
            health = await c.get("/health")
    finally:
        server.close()
        await server.wait_closed()

    assert response.status == 503 and body["ready"] is False
    assert body["checks"]["broker_responsive"] is False
    assert body["problems"]["broker_responsive"] == (
        f"{address} did not answer a Kafka ApiVersions request within 0.3 s")
    assert health.status == 200  # liveness: restarting the worker would not wake the broker


async def test_ready_reports_no_progress_while_records_wait(
    client: TestClient[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    state = client.faust_app.streamapp_state  # type: ignore[attr-defined]
    now = [0.0]
    state.progress = ProgressWatch(stall_s=15.0, clock=lambda: now[0])
    stuck = PartitionMarks(highwater={("inference-request", 0): 1_200},
                           position={("inference-request", 0): 200},
                           assigned={"inference-request": 1})

    async def marks() -> PartitionMarks:
        return stuck

    monkeypatch.setattr(state, "marks", marks)
    checks = []
    for _ in range(3):
        body = await (await client.get("/ready")).json()
        checks.append(body["checks"]["making_progress"])
        now[0] += 10.0

    assert checks == [True, True, False]  # 20 s without a record read, a commit or a fetch
    assert body["problems"]["making_progress"] == (
        "1000 records wait, but for 20 s no record was read, no offset committed and no fetch "
        "moved (ready_stall_s=15)")


async def test_an_unexpected_failure_is_a_json_500(client: TestClient[Any, Any]) -> None:
    state = client.faust_app.streamapp_state  # type: ignore[attr-defined]

    def boom() -> None:
        raise RuntimeError("bug")

    state.readiness = boom
    response = await client.get("/ready")
    assert response.status == 500 and (await response.json())["error"] == "internal_error"
