"""A worker with ``gpu_executor=shared`` on CPU: its executor server is SIGKILLed while
requests flow and started again; with the default ``max_retries``, backoff and
``gpu_server_wait_s`` every request is answered once, none is dead-lettered, none used up a
retry (the batches waited for the server and were sent again), the device totals count every
request, and ``/ready`` says why it is 503 meanwhile."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engines.server import query_stats
from streamapp.client import collect_outcomes, digits_requests, load_digits_frames, publish
from streamapp.process import WorkerProcess
from streamapp.settings import Settings
from tests.engines.server.test_shared_executor import _listening, _start_server

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.fixture
def gpu_server(tmp_path: Path) -> Iterator[Path]:
    """An executor server (``streamapp gpu-server``) on a socket in tmp_path, ready."""
    path, log = tmp_path / "gpu.sock", tmp_path / "gpu-server.log"
    server = _servers[path] = _start_server(path, log, 2.0)
    deadline = time.monotonic() + 60
    while not _listening(path):
        assert server.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    try:
        yield path
    finally:
        _stop(path)


_servers: dict[Path, subprocess.Popen[bytes]] = {}


def _stop(path: Path) -> None:
    """SIGTERM the servers started for ``path``."""
    for proc in [p for p in _servers.values() if p.poll() is None]:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    _servers.clear()


@pytest.fixture
def worker_options(gpu_server: Path) -> dict[str, Any]:
    return {"gpu_executor": "shared", "gpu_server_socket": gpu_server}


def _ready(worker: WorkerProcess) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"{worker.web_url}/ready", timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def _get(worker: WorkerProcess, path: str) -> Any:
    try:
        with urllib.request.urlopen(f"{worker.web_url}{path}", timeout=2) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


async def _until(what: str, check: Callable[[], bool], worker: WorkerProcess,
                 timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not {what} after {timeout_s} s:\n" \
            f"{worker.log_tail(40)}"
        await asyncio.sleep(0.1)


async def test_a_killed_server_loses_no_request(
    worker: WorkerProcess, worker_settings: Settings, gpu_server: Path, tmp_path: Path,
) -> None:
    settings = worker_settings
    bootstrap = settings.bootstrap_servers
    images, _ = load_digits_frames()
    total = 1200
    requests = digits_requests(images, devices=8, indices=[i % len(images) for i in range(total)])
    ids = {r.request_id for _, r in requests}
    per_device = Counter(r.device_id for _, r in requests)
    publisher = asyncio.create_task(
        publish(bootstrap, settings.request_topic, requests, codec="msgpack", rate_per_s=300))
    await _until("200 requests through the server",
                 lambda: query_stats(gpu_server)["digits"]["rows"] >= 200, worker)
    os.killpg(_servers[gpu_server].pid, signal.SIGKILL)
    _servers[gpu_server].wait()
    await _until("/ready 503 with the server unreachable", lambda: (
        (r := _ready(worker))[0] == 503
        and json.loads(r[1])["checks"]["gpu_server_reachable"] is False), worker)
    problems = json.loads(_ready(worker)[1])["problems"]
    assert f"the executor server at {gpu_server} is not reachable" in problems[
        "gpu_server_reachable"]
    _servers[gpu_server] = _start_server(gpu_server, tmp_path / "gpu-server.log", 2.0)
    await _until("/ready 200 again", lambda: _ready(worker)[0] == 200, worker)
    await publisher
    out = await collect_outcomes(
        bootstrap, settings.result_topic, settings.dlq_topic,
        done=lambda o: ids <= (o.result_ids() | o.dead_letter_ids()), timeout_s=120,
    )
    assert out.dead_letters == []
    counts = Counter(r["request_id"] for r in out.results)
    assert set(counts) == ids and set(counts.values()) == {1}
    assert {r["attempt"] for r in out.results} == {0}  # waiting used up no retry
    assert "re-submitted once it is back" in worker.log_path.read_text(errors="replace")
    await _until("device totals right", lambda: all(
        (row := _get(worker, f"/devices/{device}")) is not None
        and row["counts"]["result"] == n and row["counts"]["dead_letter"] == 0
        for device, n in per_device.items()), worker)

