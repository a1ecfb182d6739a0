"""``streamapp worker --processes 2`` on the embedded broker, and the one-worker-per-data-dir
lock: what an operator checks (every request answered, offsets committed to the end, exit codes,
one clear line)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engines.server import query_stats
from streamapp.broker import EmbeddedBroker
from streamapp.client import collect_outcomes, digits_requests, load_digits_frames, publish
from streamapp.datadir import LOCK_NAME
from streamapp.process import WorkerProcess
from streamapp.settings import Settings
from streamapp.supervisor import read_state
from tests.partition_workers import committed_and_ends

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def _env(settings: Settings, data_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "STREAMAPP_BROKER": settings.broker, "STREAMAPP_APP_ID": settings.app_id,
        "STREAMAPP_TOPIC_PREFIX": settings.topic_prefix,
        "STREAMAPP_TOPIC_PARTITIONS": str(settings.topic_partitions),
        "STREAMAPP_BACKEND": "onnxruntime", "STREAMAPP_DATA_DIR": str(data_dir),
        "STREAMAPP_WEB_PORT": "0",  # a free port per child, listed in supervisor.json
        "STREAMAPP_MAX_BATCH_SIZE": "16", "STREAMAPP_COMMIT_INTERVAL_MS": "20",
        "PYTHONUNBUFFERED": "1",
        # Two GPUs as the supervisor sees them (issue 23): it hands them out round-robin; the
        # onnxruntime backend on CPU ignores the variable, so this runs on any machine.
        "CUDA_VISIBLE_DEVICES": "0,1",
    })
    return env


def _cuda_visible_devices(pid: int) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` in the environment process ``pid`` was started with."""
    for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if entry.startswith(b"CUDA_VISIBLE_DEVICES="):
            return entry.split(b"=", 1)[1].decode()
    return None


@pytest.fixture
def supervisor_options() -> dict[str, str]:
    """Extra ``STREAMAPP_*`` settings of the ``supervised`` fixture (parametrize to change)."""
    return {}


@pytest.fixture
def supervised(worker_settings: Settings, tmp_path: Path, supervisor_options: dict[str, str]
               ) -> Iterator[subprocess.Popen[bytes]]:
    """``streamapp worker --processes 2`` with its output in tmp_path/supervisor.log."""
    with open(tmp_path / "supervisor.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamapp", "worker", "--processes", "2"],
            env={**_env(worker_settings, tmp_path / "data"), **supervisor_options}, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # children follow (PR_SET_PDEATHSIG)
            proc.wait()


def _log(tmp_path: Path) -> str:
    return "\n".join((tmp_path / "supervisor.log").read_text(errors="replace").splitlines()[-60:])


def _children(tmp_path: Path) -> list[dict[str, Any]]:
    state = read_state(tmp_path / "data")
    return [] if state is None else list(state["children"])


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=1.0) as response:
            return bool(response.status == 200)
    except (OSError, ValueError):  # not up yet, or 503 (HTTPError is an OSError)
        return False


async def _until(what: str, check: Any, proc: subprocess.Popen[bytes], tmp_path: Path,
                 timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert proc.poll() is None, f"the supervisor exited ({proc.returncode}):\n{_log(tmp_path)}"
        assert time.monotonic() < deadline, f"not {what} after {timeout_s} s:\n{_log(tmp_path)}"
        await asyncio.sleep(0.2)


async def test_two_supervised_workers_survive_a_sigkill_and_drain_on_sigterm(
    kafka_broker: EmbeddedBroker, worker_settings: Settings, tmp_path: Path,
    supervised: subprocess.Popen[bytes],
) -> None:
    settings, proc = worker_settings, supervised
    bootstrap = kafka_broker.bootstrap_servers
    await _until("two children listed", lambda: len(_children(tmp_path)) == 2, proc, tmp_path)
    children = _children(tmp_path)
    # each child has its own data dir (holding its own lock) and its own web port
    assert [c["data_dir"] for c in children] == [str(tmp_path / "data" / f"worker-{i}")
                                                for i in range(2)]
    assert children[0]["web_port"] != children[1]["web_port"]
    await _until("both ready", lambda: all(_ready(c["url"]) for c in _children(tmp_path)),
                 proc, tmp_path)
    for c in _children(tmp_path):
        assert (Path(c["data_dir"]) / LOCK_NAME).read_text().strip() == f"worker (pid {c['pid']})"
    # each child runs on its own GPU, and only that one
    assert [_cuda_visible_devices(c["pid"]) for c in _children(tmp_path)] == ["0", "1"]
    assert [c["gpu"] for c in _children(tmp_path)] == ["0", "1"]

    images, _ = load_digits_frames()
    total = 3000
    requests = digits_requests(images, devices=32, indices=[i % len(images) for i in range(total)])
    ids = {r.request_id for _, r in requests}
    publisher = asyncio.create_task(
        publish(bootstrap, settings.request_topic, requests, codec="msgpack", rate_per_s=300))
    await asyncio.sleep(3)  # traffic is flowing to both
    victim = _children(tmp_path)[1]
    os.kill(victim["pid"], signal.SIGKILL)
    await _until("worker 1 restarted and ready", lambda: (
        (c := _children(tmp_path)[1])["restarts"] == 1 and c["pid"] not in (None, victim["pid"])
        and _ready(c["url"])), proc, tmp_path)
    # the child killed on GPU 1 came back on GPU 1
    assert _cuda_visible_devices(_children(tmp_path)[1]["pid"]) == "1"
    await publisher
    out = await collect_outcomes(
        bootstrap, settings.result_topic, settings.dlq_topic,
        done=lambda o: ids <= (o.result_ids() | o.dead_letter_ids()), timeout_s=180,
    )
    lost = ids - (out.result_ids() | out.dead_letter_ids())
    assert lost == set(), f"{len(lost)} requests unanswered:\n{_log(tmp_path)}"
    assert out.dead_letters == []

    os.kill(proc.pid, signal.SIGTERM)
    assert await asyncio.to_thread(proc.wait, 90) == 0, _log(tmp_path)
    final = _children(tmp_path)
    assert [c["state"] for c in final] == ["stopped", "stopped"]
    assert [c["last_exit"] for c in final] == [0, 0]
    assert [c["restarts"] for c in final] == [0, 1]
    committed, ends = await committed_and_ends(bootstrap, settings.app_id, settings.request_topic,
                                               settings.topic_partitions)
    assert sum(v or 0 for v in ends.values()) == total
    assert committed == ends


def _get_json(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")
    except (OSError, ValueError):
        return 0, None


def _servers(tmp_path: Path) -> list[dict[str, Any]]:
    state = read_state(tmp_path / "data")
    return [] if state is None else list(state.get("servers", []))


@pytest.mark.parametrize("supervisor_options", [{
    "STREAMAPP_GPU_EXECUTOR": "shared",  # the default retries and gpu_server_wait_s
    "CUDA_VISIBLE_DEVICES": "",  # no GPU: one server (for the CPU), not one per GPU entry
}])
async def test_shared_gpu_executor_answers_everything_across_a_killed_server(
    kafka_broker: EmbeddedBroker, worker_settings: Settings, tmp_path: Path,
    supervised: subprocess.Popen[bytes],
) -> None:
    """``--processes 2 --gpu-executor shared`` on CPU: one executor server serves both
    workers; SIGKILLed while requests flow, it is restarted, the workers' batches wait for it
    and are sent again (no retry used up, none dead-lettered with the default ``max_retries``
    and backoff), and every request gets exactly one result. (Device totals after
    retries are checked with one worker in tests/integration/test_shared_executor.py: with two,
    a retry processed by the worker that does not own its device's table partition is not
    added to the owner's row, which is not about the executor.)"""
    settings, proc = worker_settings, supervised
    bootstrap = kafka_broker.bootstrap_servers
    await _until("both ready", lambda: len(_children(tmp_path)) == 2 and all(
        _ready(c["url"]) for c in _children(tmp_path)), proc, tmp_path)
    (server,) = _servers(tmp_path)
    assert server["state"] == "ready" and server["pid"] is not None
    for c in _children(tmp_path):
        status, body = _get_json(f"{c['url']}/ready")
        assert status == 200 and body["checks"]["gpu_server_reachable"] is True
        assert body["engines"]["digits"]["backend"] == "onnxruntime"

    images, _ = load_digits_frames()
    total, devices = 1500, 16
    requests = digits_requests(images, devices=devices,
                               indices=[i % len(images) for i in range(total)])
    ids = {r.request_id for _, r in requests}
    publisher = asyncio.create_task(
        publish(bootstrap, settings.request_topic, requests, codec="msgpack", rate_per_s=300))
    await _until("200 requests through the server", lambda: query_stats(
        server["socket"])["digits"]["rows"] >= 200, proc, tmp_path)
    os.kill(server["pid"], signal.SIGKILL)
    await _until("the server restarted", lambda: (s := _servers(tmp_path)[0])["restarts"] == 1
                 and s["state"] == "ready", proc, tmp_path)
    await publisher
    out = await collect_outcomes(
        bootstrap, settings.result_topic, settings.dlq_topic,
        done=lambda o: ids <= (o.result_ids() | o.dead_letter_ids()), timeout_s=180,
    )
    assert out.dead_letters == [], _log(tmp_path)
    counts = Counter(r["request_id"] for r in out.results)
    assert set(counts) == ids and set(counts.values()) == {1}
    # the kill hit the workers, and their batches waited instead of using up retries
    log = (tmp_path / "supervisor.log").read_text(errors="replace")
    assert "re-submitted once it is back" in log, _log(tmp_path)
    assert {r["attempt"] for r in out.results} == {0}, _log(tmp_path)
    os.kill(proc.pid, signal.SIGTERM)
    assert await asyncio.to_thread(proc.wait, 90) == 0, _log(tmp_path)
    assert [s["state"] for s in _servers(tmp_path)] == ["stopped"]
    assert [c["state"] for c in _children(tmp_path)] == ["stopped", "stopped"]
    # A clean stop frees each worker's shared-memory slots itself (nothing left in /dev/shm,
    # no "leaked shared_memory objects" warning from Python's resource tracker; H200 run,
    # 2026-12-03: every one of 16 workers printed it).
    log = (tmp_path / "supervisor.log").read_text(errors="replace")
    assert "leaked shared_memory" not in log, _log(tmp_path)
    pids = {str(c["pid"]) for c in _children(tmp_path)}
    shm = Path("/dev/shm")
    left = [p.name for p in shm.glob("streamapp-*") if p.name.split("-")[1] in pids] \
        if shm.is_dir() else []
    assert left == [], left


async def test_a_second_worker_in_a_used_data_dir_stops_with_one_clear_line(
    worker: WorkerProcess, tmp_path: Path, kafka_broker: EmbeddedBroker,
    worker_settings: Settings,
) -> None:
    second = subprocess.run(
        [sys.executable, "-m", "streamapp", "worker", "--web-port", "0"],
        env=_env(worker_settings, Path(worker.settings["data_dir"])),
        capture_output=True, text=True, timeout=60,
    )
    assert second.returncode != 0
    lines = [line for line in second.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, second.stderr
    assert str(Path(worker.settings["data_dir"]).resolve()) in lines[0]
    assert "--data-dir" in lines[0] and "STREAMAPP_DATA_DIR" in lines[0]
    assert f"pid {worker.process.pid}" in lines[0]  # type: ignore[union-attr]
    # the first one keeps serving: a request sent now is answered
    images, _ = load_digits_frames()
    requests = digits_requests(images, devices=1, indices=[0])
    await publish(kafka_broker.bootstrap_servers, worker_settings.request_topic, requests)
    out = await collect_outcomes(
        kafka_broker.bootstrap_servers, worker_settings.result_topic, worker_settings.dlq_topic,
        done=lambda o: len(o.results) >= 1, timeout_s=60,
    )
    assert out.result_ids() == {requests[0][1].request_id}
    assert worker.process is not None and worker.process.poll() is None


def test_a_single_worker_on_web_port_0_serves_on_the_port_it_names(
    kafka_broker: EmbeddedBroker, worker_settings: Settings, tmp_path: Path,
) -> None:
    # The help says 0 is a free port: a single worker (no --processes) picks one and says which.
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamapp", "worker", "--web-port", "0"],
            env=_env(worker_settings, tmp_path / "data"), stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        port = None
        while port is None and time.monotonic() < deadline and proc.poll() is None:
            found = re.search(r"web port 0: this worker serves on port (\d+)",
                              log_path.read_text(errors="replace"))
            port = int(found[1]) if found else None
            time.sleep(0.1)  # polling a file the worker writes
        assert port, log_path.read_text(errors="replace")[-3000:]
        health = None
        while health is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    health = r.status
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.1)
        assert health == 200, log_path.read_text(errors="replace")[-3000:]
    finally:
        proc.terminate()
        proc.wait(90)
