"""Queryable device state, readiness and metrics of real workers on the embedded broker.

What an operator checks: any worker answers ``GET /devices/{id}`` with the same, correct counts
(compared with what was sent), windows add up to the totals, ``/ready`` turns from 503 to 200,
``/metrics`` counts every request, tables survive a restart, and bad queries get a 4xx JSON
answer, never a 500.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from streamapp.broker import EmbeddedBroker
from streamapp.client import (
    SentRequest,
    collect_outcomes,
    digits_requests,
    load_digits_frames,
    publish,
    publish_values,
)
from streamapp.kafka import create_topics
from streamapp.process import WorkerProcess
from streamapp.settings import Settings
from tests.integration.conftest import wait_for as _wait

pytestmark = [pytest.mark.kafka]

DEVICES = 32
PER_DEVICE = 12
#: Devices that also send a request with a wrong shape (a dead letter each).
BAD_DEVICES = ("device-03", "device-17", "device-30")


def _worker(settings: Settings, tmp_path: Path, name: str, **extra: Any) -> WorkerProcess:
    return WorkerProcess(
        {
            "broker": settings.broker, "app_id": settings.app_id,
            "topic_prefix": settings.topic_prefix, "topic_partitions": settings.topic_partitions,
            "backend": "onnxruntime", "data_dir": tmp_path / f"data-{name}",
            "max_batch_size": 16, "max_batch_delay_ms": 5, "worker_name": name, **extra,
        },
        log_path=tmp_path / f"{name}.log",
    )


@pytest.fixture
def state_settings(worker_settings: Settings, kafka_broker: EmbeddedBroker) -> Settings:
    create_topics(kafka_broker.bootstrap_servers, {worker_settings.retry_topic: 4})
    return worker_settings


def _get(worker: WorkerProcess, path: str) -> tuple[int, str, Any]:
    """``(status, content type, decoded JSON body)`` — the body must be JSON, whatever the
    status."""
    try:
        with urllib.request.urlopen(worker.web_url + path, timeout=15) as response:
            status, ctype, raw = response.status, response.headers.get_content_type(), \
                response.read()
    except urllib.error.HTTPError as exc:
        status, ctype, raw = exc.code, exc.headers.get_content_type(), exc.read()
    assert ctype == "application/json", (path, status, ctype, raw[:200])
    return status, ctype, json.loads(raw)


def _metrics(worker: WorkerProcess) -> dict[str, list[Any]]:
    text = worker.metrics_text()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def _bad_value(device: str, n: int) -> bytes:
    return json.dumps({
        "request_id": f"bad-{device}-{n}", "device_id": device, "seq": 10_000 + n,
        "ts": time.time(), "model": "digits",
        "tensor": {"dtype": "uint8", "shape": [64], "data": base64.b64encode(bytes(64)).decode()},
    }).encode()


def _expected(sent: list[SentRequest], bad: Counter[str]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for s in sent:
        row = out.setdefault(s.device_id, {"result": 0, "dead_letter": 0, "last_seq": -1})
        row["result"] += 1
        row["last_seq"] = max(row["last_seq"], s.seq)
    for device, n in bad.items():
        out[device]["dead_letter"] += n
    return out


async def _send(
    bootstrap: str, settings: Settings, images: Any, *, devices: int, per_device: int,
    run_id: str, bad_devices: tuple[str, ...] = (),
) -> tuple[list[SentRequest], Counter[str]]:
    requests = digits_requests(
        images, devices=devices, run_id=run_id, indices=range(devices * per_device)
    )
    sent = await publish(bootstrap, settings.request_topic, requests)
    bad = Counter(bad_devices)
    await publish_values(
        bootstrap, settings.request_topic,
        [(d.encode(), _bad_value(d, n)) for n, d in enumerate(bad_devices)],
    )
    return sent, bad


async def _wait_committed(bootstrap: str, settings: Settings, timeout_s: float = 30) -> None:
    """Until the group's committed offsets reach the end of every request partition."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=settings.app_id,
                                enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(settings.request_topic, p) for p in range(4)]
        # The end of each partition from a fetch response's high watermark: Tansu's ListOffsets
        # (end_offsets) is wrong after multi-record batches (docs/broker.md).
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends: dict[TopicPartition, int | None] = dict.fromkeys(tps)
        deadline = time.monotonic() + timeout_s
        while any(v is None for v in ends.values()) and time.monotonic() < deadline:
            await consumer.getmany(timeout_ms=200)
            ends = {tp: consumer.highwater(tp) for tp in tps}
        while time.monotonic() < deadline:
            committed = {tp: await consumer.committed(tp) for tp in tps}
            if all((committed[tp] or 0) >= (ends[tp] or 0) for tp in tps):
                return
            await asyncio.sleep(0.2)
        raise AssertionError(f"offsets not committed: {committed} < {ends}")
    finally:
        await consumer.stop()


def _device_rows_match(
    workers: list[WorkerProcess], expected: dict[str, dict[str, int]]
) -> Callable[[], bool]:
    def check() -> bool:
        for device, want in expected.items():
            status, _, body = _get(workers[0], f"/devices/{device}")
            if status != 200 or body["counts"]["result"] != want["result"] or \
                    body["counts"]["dead_letter"] != want["dead_letter"]:
                return False
        return True
    return check


@pytest.fixture
def two_workers(state_settings: Settings, tmp_path: Path) -> Iterator[list[WorkerProcess]]:
    workers = [_worker(state_settings, tmp_path, name) for name in ("w1", "w2")]
    try:
        yield workers
    finally:
        for w in workers:
            w.stop()


@pytest.mark.slow
async def test_two_workers_answer_for_every_device_with_the_counts_that_were_sent(
    kafka_broker: EmbeddedBroker, state_settings: Settings, two_workers: list[WorkerProcess]
) -> None:
    settings = state_settings
    w1, w2 = two_workers
    w1.start()
    # /ready answers 503 (JSON, with the failing check) until partitions are assigned
    _wait(lambda: _try_get(w1, "/ready") is not None, 30, "w1's web server")
    status, _, body = _get(w1, "/ready")
    assert status == 503 and body["ready"] is False
    assert body["checks"]["partitions_assigned"] is False
    w1.wait_ready()
    w2.start()
    w2.wait_ready()
    status, _, body = _get(w1, "/ready")
    assert status == 200 and body["checks"] == {
        "partitions_assigned": True, "engines_warm": True, "tables_recovered": True,
        "table_partitions_match": True, "broker_responsive": True, "making_progress": True}
    assert body["problems"] == {}

    def split() -> bool:  # both ready and owning disjoint halves of the 4 partitions
        owned = []
        for w in (w1, w2):
            status, _, body = _get(w, "/ready")
            if status != 200:
                return False
            owned.append({a for a in body["assigned"]})
        return bool(owned[0]) and bool(owned[1]) and not owned[0] & owned[1] and \
            len(owned[0] | owned[1]) == 4
    _wait(split, 60, "both workers to own partitions")

    images, _ = load_digits_frames()
    sent, bad = await _send(
        kafka_broker.bootstrap_servers, settings, images, devices=DEVICES,
        per_device=PER_DEVICE, run_id="state", bad_devices=BAD_DEVICES,
    )
    total = len(sent) + sum(bad.values())
    out = await collect_outcomes(
        kafka_broker.bootstrap_servers, settings.result_topic, settings.dlq_topic,
        done=lambda o: len(o.results) + len(o.dead_letters) >= total, timeout_s=60,
    )
    assert len(out.results) == len(sent) and len(out.dead_letters) == len(BAD_DEVICES)
    expected = _expected(sent, bad)
    _wait(_device_rows_match([w1], expected), 15, "tables to hold every outcome")

    for device, want in expected.items():
        answers = [_get(w, f"/devices/{device}") for w in (w1, w2)]
        assert answers[0] == answers[1], device  # either worker: the owner's answer
        status, _, row = answers[0]
        assert status == 200
        assert row["device_id"] == device
        assert row["counts"] == {"result": want["result"], "dead_letter": want["dead_letter"],
                                 "retry": 0}
        assert row["total"] == want["result"] + want["dead_letter"]
        assert row["last_seq"] is not None
        assert row["last_result"]["seq"] == want["last_seq"]
        assert row["dead_letters_by_reason"] == (
            {"bad_shape": want["dead_letter"]} if want["dead_letter"] else {})
        assert row["latency_ewma_ms"]["e2e"] > 0
        # tumbling windows partition time: they add up to the totals
        status, _, win = _get(w2, f"/devices/{device}/windows?kind=tumbling&last=360")
        assert status == 200 and len(win["windows"]) == 360
        assert sum(w["count"] for w in win["windows"]) == row["total"]
        assert sum(w["results"] for w in win["windows"]) == want["result"]
        assert sum(w["dead_letters"] for w in win["windows"]) == want["dead_letter"]
        assert sum(sum(w["labels"].values()) for w in win["windows"]) == want["result"]
        # the newest hopping window (the last minute) holds everything sent seconds ago
        status, _, hop = _get(w1, f"/devices/{device}/windows?kind=hopping&last=1")
        assert status == 200 and hop["windows"][0]["count"] == row["total"]

    # each device is listed by exactly one worker: its owner
    listed = []
    for w in (w1, w2):
        status, _, page = _get(w, "/devices?limit=1000")
        assert status == 200
        listed += [d["device_id"] for d in page["devices"]]
    assert sorted(listed) == sorted(expected)

    # /metrics parses, and the final outcomes counted by both workers are the requests sent
    counted = Counter[str]()
    for w in (w1, w2):
        families = _metrics(w)
        for sample in families["streamapp_requests"]:
            if sample.name == "streamapp_requests_total":
                counted[sample.labels["outcome"]] += int(sample.value)
        assert families["streamapp_ready"][0].value == 1.0
        lags = [s for s in families["streamapp_consumer_lag"]
                if s.labels["topic"] == settings.request_topic]
        assert len(lags) == 2 and all(s.value == 0 for s in lags)
    assert counted["result"] + counted["dead_letter"] == total
    assert counted == {"result": len(sent), "dead_letter": len(BAD_DEVICES)}


def _try_get(worker: WorkerProcess, path: str) -> int | None:
    try:
        return _get(worker, path)[0]
    except (OSError, ValueError):
        return None


@pytest.mark.slow
@pytest.mark.parametrize("data_dir", ["kept", "wiped"])
async def test_tables_survive_a_worker_restart(
    kafka_broker: EmbeddedBroker, state_settings: Settings, tmp_path: Path, data_dir: str
) -> None:
    """Counts continue after a restart: from the local RocksDB files (``kept``) or, on a new
    machine, from the changelog topic (``wiped``)."""
    settings = state_settings
    bootstrap = kafka_broker.bootstrap_servers
    images, _ = load_digits_frames()
    worker = _worker(settings, tmp_path, "w1")
    with worker:
        worker.wait_ready()
        sent1, bad1 = await _send(bootstrap, settings, images, devices=8, per_device=10,
                                  run_id="one", bad_devices=("device-02",))
        expected1 = _expected(sent1, bad1)
        _wait(_device_rows_match([worker], expected1), 30, "first traffic in the tables")
        await _wait_committed(bootstrap, settings)
    if data_dir == "wiped":
        import shutil

        shutil.rmtree(tmp_path / "data-w1")
    restarted = _worker(settings, tmp_path, "w1")
    with restarted:
        restarted.wait_ready()
        for device, want in expected1.items():  # restored, before any new traffic
            status, _, row = _get(restarted, f"/devices/{device}")
            assert status == 200, (device, row, restarted.log_tail())
            assert row["counts"]["result"] == want["result"], (device, row)
            assert row["counts"]["dead_letter"] == want["dead_letter"], (device, row)
        sent2, bad2 = await _send(bootstrap, settings, images, devices=8, per_device=5,
                                  run_id="two", bad_devices=("device-02", "device-05"))
        expected = _expected(sent1 + sent2, bad1 + bad2)
        _wait(_device_rows_match([restarted], expected), 30, "counts to continue")
        status, _, win = _get(restarted, "/devices/device-02/windows?last=360")
        assert sum(w["count"] for w in win["windows"]) == 10 + 5 + 2
        assert "ConsistencyError" not in restarted.log_tail(400)


async def test_bad_queries_get_a_4xx_json_answer_never_a_500(
    kafka_broker: EmbeddedBroker, state_settings: Settings, tmp_path: Path
) -> None:
    worker = _worker(state_settings, tmp_path, "w1")
    with worker:
        worker.wait_ready()
        await publish(kafka_broker.bootstrap_servers, state_settings.request_topic,
                      digits_requests(load_digits_frames()[0], devices=1, indices=range(3)))
        _wait(lambda: _get(worker, "/devices/device-00")[0] == 200, 30, "device-00's row")
        quote = urllib.parse.quote
        cases = {
            "/devices/never-seen": (404, "unknown_device"),
            "/devices/never-seen/windows": (404, "unknown_device"),
            f"/devices/{quote(chr(1) + 'ctl')}": (400, "bad_device_id"),
            f"/devices/{'x' * 300}": (400, "bad_device_id"),
            "/devices/%FF%FE": (400, "bad_device_id"),
            "/devices/device-00/windows?kind=sliding": (400, "bad_query"),
            "/devices/device-00/windows?last=0": (400, "bad_query"),
            "/devices/device-00/windows?last=abc": (400, "bad_query"),
            "/devices/device-00/windows?last=1000000": (400, "bad_query"),
            "/devices/device-00/windows?kind=hopping&last=-3": (400, "bad_query"),
            "/devices/device-00/windows?lats=3": (400, "bad_query"),
            "/devices/device-00/windows?last=2&last=3": (400, "bad_query"),
            "/devices/device-00?verbose=1": (400, "bad_query"),
            "/devices?limit=0": (400, "bad_query"),
            "/devices?limit=5000": (400, "bad_query"),
            "/devices?offset=-1": (400, "bad_query"),
            "/devices?sort=bogus": (400, "bad_query"),
        }
        for path, (want_status, want_code) in cases.items():
            status, _, body = _get(worker, path)
            assert (status, body["error"]) == (want_status, want_code), (path, body)
            assert body["status"] == status and body["message"], path
        status, _, body = _get(worker, "/devices/device-00/windows?kind=hopping&last=2")
        assert status == 200 and len(body["windows"]) == 2
        status, _, body = _get(worker, "/devices?limit=1&sort=-total")
        assert status == 200 and [d["device_id"] for d in body["devices"]] == ["device-00"]
