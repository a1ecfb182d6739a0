"""The queue policy on a real worker, on both brokers (docs/delivery.md, "Queue policy").

The worker runs the test-only ``faulty`` backend with no fault rules and ``batch_delay_ms`` 32:
batches of 16 at most, one at a time, so it answers about 500 requests/s. A burst of 5,000
requests (2,500/s for 2 s) with a ``deadline`` of 200 ms: the requests it can reach within
200 ms of their Kafka timestamp are answered, the others get ``expired`` results, in each
device's order; the engine ran only the answered ones (``streamapp_batch_size_sum``), and
``/metrics`` and the device stats count the same. A model whose metadata sets
``queue_policy.latest_frame`` (a copy of ``digits``) answers only the newest request of a
device in a batch; the others name it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engines.registry import PLUGINS_ENV
from engines.testing import FAULTS_PLUGIN
from streamapp.client import collect_outcomes, digits_requests, load_digits_frames, publish
from streamapp.models import ModelRepository
from streamapp.process import WorkerProcess
from streamapp.settings import Settings
from tests.conftest import Broker
from tests.integration.conftest import wait_for

pytestmark = [pytest.mark.kafka]

DEVICES = 16
MAX_AGE_MS = 200.0


def metric(worker: WorkerProcess, name: str, **labels: str) -> float:
    text = worker.metrics_text()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def slow_worker(settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                **options: Any) -> WorkerProcess:
    """A worker answering about 500 requests/s (32 ms per batch of at most 16)."""
    monkeypatch.setenv("ENGINES_FAULTS", json.dumps({"rules": [], "batch_delay_ms": 32}))
    monkeypatch.setenv(PLUGINS_ENV, FAULTS_PLUGIN)
    s = settings
    return WorkerProcess(
        {
            "broker": s.broker, "app_id": s.app_id, "topic_prefix": s.topic_prefix,
            "topic_partitions": s.topic_partitions, "backend": "faulty",
            "data_dir": tmp_path / "data", "max_batch_size": 16, "max_batch_delay_ms": 5,
            "max_inflight_batches": 1, **options,
        },
        log_path=tmp_path / "worker.log",
    )


def in_device_order(results: list[dict[str, Any]]) -> bool:
    seqs: dict[str, list[int]] = defaultdict(list)
    for r in results:
        seqs[r["device_id"]].append(r["seq"])
    return all(s == sorted(s) for s in seqs.values())


async def test_a_burst_past_its_deadline_is_expired_without_engine_time(
    kafka_broker: Broker, worker_settings: Settings, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = worker_settings
    images, _ = load_digits_frames()
    n = 5_000
    requests = [(i, dataclasses.replace(r, deadline=MAX_AGE_MS)) for i, r in digits_requests(
        images, devices=DEVICES, indices=[k % len(images) for k in range(n)])]
    warm = digits_requests(images, devices=DEVICES, indices=range(32), run_id="warm")
    with slow_worker(s, tmp_path, monkeypatch) as proc:
        proc.wait_ready()
        # first a few without a deadline: the consumer and producer are past their first
        # fetch and produce (hundreds of ms on Apache Kafka) when the burst comes
        await publish(kafka_broker.bootstrap_servers, s.request_topic, warm)
        await collect_outcomes(kafka_broker.bootstrap_servers, s.result_topic, s.dlq_topic,
                               done=lambda o: len(o.results) >= len(warm), timeout_s=60)
        # 2 s at 2,500/s: five times what the worker can answer. (All 5,000 at once would reach
        # the worker as one fetch on Apache Kafka, and decoding a chunk of 5,000 takes it
        # longer than 200 ms before its first batch starts: every request would expire.)
        await publish(kafka_broker.bootstrap_servers, s.request_topic, requests,
                      rate_per_s=2_500)
        out = await collect_outcomes(
            kafka_broker.bootstrap_servers, s.result_topic, s.dlq_topic,
            done=lambda o: len(o.results) + len(o.dead_letters) >= n + len(warm), timeout_s=90,
        )
        results = [r for r in out.results if "max_age_ms" in r]
        assert not out.dead_letters and len(results) == n, proc.log_tail()
        answered = [r for r in results if r["outcome"] == "answered"]
        expired = [r for r in results if r["outcome"] == "expired"]
        assert len(answered) + len(expired) == n
        assert {r["request_id"] for r in results} == {r.request_id for _, r in requests}
        assert answered and len(expired) > n / 2  # the engine could not reach most in time
        assert all(r["age_ms"] <= MAX_AGE_MS and r["outputs"]["top_k"] for r in answered)
        assert all(r["age_ms"] > MAX_AGE_MS and r["outputs"] == {} and r["batch_size"] == 0
                   for r in expired)
        assert all(r["max_age_from"] == "request" for r in results)
        assert in_device_order(results)
        # the engine ran the answered requests only; /metrics and device stats agree
        assert metric(proc, "streamapp_batch_size_sum", model="digits") == len(answered) + len(
            warm)
        assert metric(proc, "streamapp_requests_total", model="digits",
                      outcome="expired") == len(expired)
        assert metric(proc, "streamapp_requests_total", model="digits",
                      outcome="result") == len(answered) + len(warm)
        counted: dict[str, int] = {}

        def stats_written() -> bool:  # device state is flushed every state_flush_interval_ms
            counted.clear()
            for d in range(DEVICES):
                status, row = proc.get(f"/devices/device-{d:02d}")
                for kind, k in (row["counts"] if status == 200 else {}).items():
                    counted[kind] = counted.get(kind, 0) + k
            return sum(counted.values()) >= n + len(warm)

        wait_for(stats_written, 30, "the device stats of every request")
        assert counted == {"result": len(answered) + len(warm), "expired": len(expired),
                           "dead_letter": 0, "retry": 0}


async def test_latest_frame_answers_the_newest_request_of_a_device_in_a_batch(
    kafka_broker: Broker, worker_settings: Settings, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = worker_settings
    models = tmp_path / "models"
    shutil.copytree(ModelRepository().get("digits").path.parent, models / "digits")
    meta_path = models / "digits" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["queue_policy"] = {"latest_frame": True}
    meta_path.write_text(json.dumps(meta))
    images, _ = load_digits_frames()
    n = 1_000
    requests = digits_requests(images, devices=4, indices=[k % len(images) for k in range(n)])
    with slow_worker(s, tmp_path, monkeypatch, models_dir=models) as proc:
        proc.wait_ready()
        await publish(kafka_broker.bootstrap_servers, s.request_topic, requests)
        out = await collect_outcomes(
            kafka_broker.bootstrap_servers, s.result_topic, s.dlq_topic,
            done=lambda o: len(o.results) + len(o.dead_letters) >= n, timeout_s=90,
        )
        results = out.results
        assert not out.dead_letters and len(results) == n, proc.log_tail()
        by_id = {r["request_id"]: r for r in results}
        answered = [r for r in results if r["outcome"] == "answered"]
        superseded = [r for r in results if r["outcome"] == "superseded"]
        assert superseded and len(answered) + len(superseded) == n
        for r in superseded:
            newer = by_id[r["superseded_by"]]
            assert newer["device_id"] == r["device_id"] and newer["seq"] > r["seq"]
            assert newer["outcome"] == "answered"
        per_batch: dict[str, list[str]] = defaultdict(list)
        for r in answered:
            per_batch[r["batch_id"]].append(r["device_id"])
        assert all(len(d) == len(set(d)) for d in per_batch.values())
        assert in_device_order(results)
        assert metric(proc, "streamapp_batch_size_sum", model="digits") == len(answered)
        assert metric(proc, "streamapp_requests_total", model="digits",
                      outcome="superseded") == len(superseded)
