"""``/models`` endpoints in process, without a broker: the app never joins a group, so the
group is this worker alone and a load is refused with ``not_ready`` (no pipeline yet), or, with
a pipeline started by the test, answered by this worker. Loads on a running group:
``tests/integration/test_model_swap.py``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from typer.testing import CliRunner

from streamapp.agents.pipeline import InferencePipeline
from streamapp.app import create_app
from streamapp.cli import cli
from streamapp.models import ModelRepository
from streamapp.models.loading import load_version
from streamapp.models.swap import close_model
from streamapp.settings import Settings
from tests.model_versions import make_digits_versions
from tests.streamapp.agents.test_pipeline import FakeSink


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
        ("/models/faces/load", 404, "unknown_model"),  # not served (STREAMAPP_MODELS)
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


@pytest.fixture
async def serving(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    """A worker serving ``digits`` v1 of a repository with versions 1 and 2 (its pipeline
    started by hand: no broker, so no partitions would start it)."""
    models = make_digits_versions(tmp_path / "models", versions=(1, 2))
    settings = Settings(app_id="models-test", data_dir=tmp_path / "data", backend="onnxruntime",
                        models_dir=models, max_batch_size=8)
    app = create_app(settings)
    runtime = app.streamapp_runtime  # type: ignore[attr-defined]
    v1 = load_version(settings, ModelRepository(models).get("digits", "1"))
    pipeline = InferencePipeline(settings, {"digits": v1}, FakeSink(), worker="w")
    await pipeline.start()
    runtime.pipeline = pipeline
    try:
        async with TestClient(TestServer(app.web.web_app)) as c:
            yield c
    finally:
        runtime.pipeline = None
        await pipeline.stop()
        await runtime.swapper.close()
        for model in pipeline.loaded["digits"].values():
            await close_model(model)


@pytest.mark.parametrize(
    ("path", "code", "says"),
    [
        # a model this worker does not serve, with or without a version
        ("/models/nosuch/load", "unknown_model",
         "model 'nosuch' is not served by this worker (serving: digits; STREAMAPP_MODELS)"),
        ("/models/nosuch/load?version=1", "unknown_model",
         "model 'nosuch' is not served by this worker (serving: digits; STREAMAPP_MODELS)"),
        # a model it serves, without that version
        ("/models/digits/load?version=9", "version_not_found",
         "model 'digits' has no version '9'"),
    ],
)
async def test_an_unknown_model_is_unknown_model_and_an_unknown_version_version_not_found(
    serving: TestClient[Any, Any], path: str, code: str, says: str,
) -> None:
    response = await serving.post(path)
    body = await response.json()
    assert (response.status, body["error"]) == (404, code), body
    assert says in body["message"]
    for worker in body.get("workers", []):  # a load that named a version: each worker's say
        assert (worker["status"], worker["reason"]) == ("refused", code)
    listing = await (await serving.get("/models")).json()
    (worker,) = listing["workers"]
    assert worker["models"]["digits"]["current"] == "1"  # still serving what it served


async def test_models_load_of_an_unknown_model_says_unknown_model(
    serving: TestClient[Any, Any],
) -> None:
    url = str(serving.make_url("/"))
    done = await asyncio.to_thread(
        CliRunner().invoke, cli, ["models", "load", "nosuch", "--url", url])
    assert done.exit_code == 1
    assert done.output.splitlines() == [
        "refused (unknown_model, HTTP 404): model 'nosuch' is not served by this worker "
        "(serving: digits; STREAMAPP_MODELS)"]
