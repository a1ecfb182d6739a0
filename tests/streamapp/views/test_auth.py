"""The web token (issue 21, item 3), in process without a broker: every route but the open
ones answers 401 without it (routes added later too), 200 (or its usual answer) with it;
forwarded device queries carry it; ``streamapp status`` sends it; nothing leaks the token."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from faust.web import Request, Response
from rich.console import Console
from typer.testing import CliRunner

from streamapp.app import create_app
from streamapp.cli import cli
from streamapp.exceptions import ConfigError
from streamapp.settings import WEB_OPEN_PATHS, load_settings, web_token
from streamapp.status import run_status
from streamapp.views import ApiView, WebAuth, routing

TOKEN = "s3cr3t-web-token-0123456789abcdef"
WRONG = "wrong-web-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _app(tmp_path: Path, **settings: Any) -> Any:
    return create_app(load_settings(app_id="auth-test", data_dir=tmp_path,
                                    backend="onnxruntime", **settings))


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    app = _app(tmp_path, web_token=TOKEN)
    async with TestClient(TestServer(app.web.web_app)) as c:
        c.faust_app = app  # type: ignore[attr-defined]
        yield c


def _concrete_paths(app: Any) -> list[str]:
    paths = []
    for route in app.web.web_app.router.routes():
        if route.method == "GET":
            paths.append(route.resource.canonical.replace("{device_id}", "cam1"))
    return sorted(set(paths))


async def _status(client: TestClient[Any, Any], path: str, **kwargs: Any) -> tuple[int, Any]:
    response = await client.get(path, **kwargs)
    return response.status, await response.read()


async def test_every_route_but_the_open_ones_needs_the_token(
    client: TestClient[Any, Any],
) -> None:
    paths = _concrete_paths(client.faust_app)  # type: ignore[attr-defined]
    assert {"/devices", "/devices/cam1", "/engines", "/cluster"} <= set(paths)

    for path in paths:
        status, body = await _status(client, path)
        if path in WEB_OPEN_PATHS:
            assert status != 401, path
            continue
        assert status == 401, (path, body)
        for headers in ({"Authorization": f"Bearer {WRONG}"}, {"Authorization": TOKEN},
                        {"Authorization": f"Basic {TOKEN}"}, {"Authorization": "Bearer "}):
            wrong, body = await _status(client, path, headers=headers)
            assert wrong == 401, (path, headers)
            assert TOKEN.encode() not in body and WRONG.encode() not in body
        # with it: the route's own answer (no worker owns a device yet: 503 for device queries)
        status, body = await _status(client, path, headers=AUTH)
        assert status in (200, 503), (path, body)


async def test_a_401_is_json_that_says_what_to_send(client: TestClient[Any, Any]) -> None:
    response = await client.get("/devices", headers={"Authorization": f"Bearer {WRONG}"})
    body = await response.json()

    assert response.status == 401
    assert response.headers["WWW-Authenticate"] == 'Bearer realm="streamapp"'
    assert body["error"] == "unauthorized" and body["status"] == 401
    assert "Authorization: Bearer <token>" in body["message"]
    assert TOKEN not in str(body) and WRONG not in str(body)


async def test_unknown_paths_need_the_token_too(client: TestClient[Any, Any]) -> None:
    # deny by default: without the token nobody learns which paths exist
    assert (await client.get("/no/such/path")).status == 401
    assert (await client.get("/health/")).status == 401
    assert (await client.get("/no/such/path", headers=AUTH)).status == 404


async def test_a_route_added_later_is_protected_without_naming_it(tmp_path: Path) -> None:
    app = _app(tmp_path, web_token=TOKEN)

    @app.page("/models/load")  # e.g. the model-loading endpoint of another branch
    class Load(ApiView):
        async def post(self, request: Request) -> Response:
            return self.json({"loaded": True})

    async with TestClient(TestServer(app.web.web_app)) as c:
        assert (await c.post("/models/load")).status == 401
        answer = await c.post("/models/load", headers=AUTH)
        assert answer.status == 200 and (await answer.json()) == {"loaded": True}


async def test_open_paths_are_configurable(tmp_path: Path) -> None:
    app = _app(tmp_path, web_token=TOKEN, web_open_paths=("/health",))
    async with TestClient(TestServer(app.web.web_app)) as c:
        assert (await c.get("/health")).status == 200
        assert (await c.get("/ready")).status == 401
        assert (await c.get("/metrics")).status == 401
        metrics = await c.get("/metrics", headers=AUTH)
        assert metrics.status == 200
        assert TOKEN not in await metrics.text()


async def test_without_a_token_everything_stays_open(tmp_path: Path) -> None:
    app = _app(tmp_path)
    async with TestClient(TestServer(app.web.web_app)) as c:
        assert (await c.get("/engines")).status == 200
        assert (await c.get("/devices")).status == 200


# -- forwarded queries ------------------------------------------------------------------------


SEEN = web.AppKey("seen", list)


def _owner(token: str) -> web.Application:
    """A stand-in for the worker that owns the device: behind the same token check."""
    seen: list[str | None] = []

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        seen.append(request.headers.get("Authorization"))
        return await handler(request)  # type: ignore[no-any-return]

    async def device(request: web.Request) -> web.Response:
        return web.json_response({"device_id": "cam1", "served_by": "owner"})

    owner = web.Application(middlewares=[record, WebAuth(token, WEB_OPEN_PATHS).middleware()])
    owner.router.add_get("/devices/{device_id}", device)
    owner[SEEN] = seen
    return owner


@pytest.mark.parametrize(("owner_token", "expected"), [(TOKEN, 200), (WRONG, 401)],
                         ids=["same-token", "owner-has-another"])
async def test_forwarded_queries_carry_the_token(
    client: TestClient[Any, Any], monkeypatch: pytest.MonkeyPatch, owner_token: str,
    expected: int,
) -> None:
    owner = _owner(owner_token)
    async with TestClient(TestServer(owner)) as owner_client:
        url = str(owner_client.make_url("/"))
        monkeypatch.setattr(routing, "owner_of", lambda app, tables, key: (0, url))

        refused = await client.get("/devices/cam1")
        assert refused.status == 401 and owner[SEEN] == []  # refused before forwarding
        answered = await client.get("/devices/cam1", headers=AUTH)

        assert answered.status == expected, await answered.text()
        assert owner[SEEN] == [f"Bearer {TOKEN}"]
        if expected == 200:
            assert (await answered.json())["served_by"] == "owner"


# -- settings and the CLI ----------------------------------------------------------------------


def test_the_token_comes_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(f"{TOKEN}\n")

    assert web_token(load_settings(web_token_file=path)) == TOKEN
    assert web_token(load_settings(web_token=TOKEN)) == TOKEN
    assert web_token(load_settings()) == ""


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"web_token": "short"}, "at least 16 characters"),
        ({"web_token": "has spaces in the middle of it"}, "at least 16 characters"),
        ({"web_token": TOKEN, "web_token_file": "x"}, "both set"),
        ({"web_open_paths": "/health,/devices"}, "/devices"),
    ],
    ids=["short", "spaces", "both", "open-devices"],
)
def test_bad_token_settings_are_one_line(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        load_settings(**settings)
    given = settings.get("web_token")
    assert not given or given not in str(info.value)


@pytest.mark.parametrize("content", [None, "", "tiny\n"], ids=["missing", "empty", "short"])
def test_an_unusable_token_file_is_one_line(tmp_path: Path, content: str | None) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)

    with pytest.raises(ConfigError, match="web_token_file") as info:
        web_token(load_settings(web_token_file=path))
    assert "tiny" not in str(info.value)


def test_the_worker_refuses_an_unusable_token_file(tmp_path: Path, runner: CliRunner) -> None:
    result = runner.invoke(cli, [
        "worker", "--broker", "kafka://127.0.0.1:1", "--data-dir", str(tmp_path / "d"),
    ], env={"STREAMAPP_WEB_TOKEN_FILE": str(tmp_path / "missing"),
            "STREAMAPP_BROKER_KIND": "kafka"})

    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "web_token_file" in lines[0] and "Traceback" not in result.output


async def test_status_sends_the_token(client: TestClient[Any, Any]) -> None:
    url = str(client.make_url("")).rstrip("/")

    def status(token: str) -> str:
        out = io.StringIO()
        run_status([url], interval_s=0.05, discover_peers=True, token=token,
                   console=Console(file=out, width=200))
        return out.getvalue()

    without = await asyncio.to_thread(status, "")
    with_token = await asyncio.to_thread(status, TOKEN)

    # /metrics and /ready are open by default, the device listing is not
    assert "needs the web token" in without
    assert "web token" not in with_token and url.split("//")[1] in with_token
    assert TOKEN not in with_token


@pytest.mark.parametrize("args", [["models"], ["models", "load", "digits"]],
                         ids=["models", "models-load"])
async def test_the_models_commands_send_the_token(
    client: TestClient[Any, Any], runner: CliRunner, args: list[str],
) -> None:
    url = str(client.make_url("")).rstrip("/")

    def invoke(env: dict[str, str]) -> Any:
        return runner.invoke(cli, [*args, "--url", url], env=env)

    with_token = await asyncio.to_thread(invoke, {"STREAMAPP_WEB_TOKEN": TOKEN})
    without = await asyncio.to_thread(invoke, {})
    wrong = await asyncio.to_thread(invoke, {"STREAMAPP_WEB_TOKEN": WRONG})

    # with it: the worker's own answer (a listing; a load refused as not ready: no pipeline)
    assert "401" not in with_token.output and "unauthorized" not in with_token.output
    if args == ["models"]:
        # this worker's line (the URL it advertises; no models served yet)
        assert with_token.exit_code == 0 and with_token.output.startswith("http://")
    else:
        assert with_token.output.startswith("refused (not_ready, HTTP 503)")
    path = "/models" if args == ["models"] else "/models/digits/load"
    said = (f"error: {url} answered 401 (unauthorized): {path} needs the worker's web token: "
            "send the header 'Authorization: Bearer <token>' with the value of "
            "STREAMAPP_WEB_TOKEN (or of the file STREAMAPP_WEB_TOKEN_FILE names); ")
    assert (without.exit_code, without.output.splitlines()) == (1, [
        said + "set STREAMAPP_WEB_TOKEN (or STREAMAPP_WEB_TOKEN_FILE) to the worker's web token"])
    assert (wrong.exit_code, wrong.output.splitlines()) == (1, [
        said + "the STREAMAPP_WEB_TOKEN (or STREAMAPP_WEB_TOKEN_FILE) set here is not the "
        "worker's"])
    assert TOKEN not in with_token.output + without.output + wrong.output


def test_the_startup_log_says_a_token_is_required_never_which() -> None:
    from streamapp.logs import startup_block

    banner = startup_block(load_settings(web_token=TOKEN, web_open_paths="/health"), {})

    assert "web token required, open: /health" in banner
    assert TOKEN not in banner
