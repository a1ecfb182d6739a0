"""``/models`` endpoints in process, without a broker: the app never joins a group, so the
group is this worker alone and a load is refused with ``not_ready`` (no pipeline yet). Loads
on a running group: ``tests/integration/test_model_swap.py``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from streamapp.app import create_app
from streamapp.settings import Settings


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    app = create_app(Settings(app_id="models-test", data_dir=tmp_path, backend="onnxruntime"))
    async with TestClient(TestServer(app.web.web_app)) as c:
        yield c


async def test_the_listing_names_this_worker(client: TestClient[Any, Any]) -> None:
    response = await client.get("/models")
    body = await response.json()
    assert response.status == 200
    (worker,) = body["workers"]
    assert worker["models"] == {} and worker["http_status"] == 200  # not serving yet


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [
        ("/models/digits/load", 503, "not_ready"),
        ("/models/digits/load?version=2&keep=true", 503, "not_ready"),
        ("/models/faces/load", 404, "version_not_found"),
        ("/models/digits/load?keep=maybe", 400, "bad_query"),
        ("/models/digits/load?phase=commit", 400, "bad_query"),  # phases: forwarded only
        ("/models/digits/unload", 400, "bad_query"),
        ("/models/digits/unload?version=1", 503, "not_ready"),
    ],
)
async def test_refusals_are_json_with_each_workers_reason(
    client: TestClient[Any, Any], path: str, status: int, code: str
) -> None:
    response = await client.post(path)
    body = await response.json()
    assert (response.status, body["error"]) == (status, code), body
    assert body["message"]
    if code == "not_ready":
        (worker,) = body["workers"]
        assert worker["status"] == "refused" and worker["reason"] == "not_ready"
        assert "retry when /ready answers 200" in worker["message"]


async def test_a_load_is_a_post(client: TestClient[Any, Any]) -> None:
    response = await client.get("/models/digits/load")
    assert response.status == 405 and (await response.json())["error"] == "method_not_allowed"
