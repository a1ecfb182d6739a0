"""``processing_guarantee=exactly_once`` on Apache Kafka (issue 21, item 1).

What a user of the guarantee checks, with a ``read_committed`` consumer of the result and DLQ
topics: every request_id has exactly one outcome (0 lost, 0 duplicates) although the worker was
SIGKILLed and restarted in place during the traffic, and each device's total in the tables
equals its number of requests; engine failures in the middle of a transaction end in one
result per request; the embedded broker (no transactions) refuses the setting with one line.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from engines.registry import PLUGINS_ENV
from engines.testing import FAULTS_PLUGIN
from streamapp.broker import EmbeddedBroker
from streamapp.client import (
    Outcomes,
    collect_outcomes,
    digits_requests,
    load_digits_frames,
    publish,
    publish_values,
)
from streamapp.kafka import create_topics
from streamapp.kafka_server import KafkaBroker
from streamapp.process import WorkerProcess
from streamapp.settings import Settings, load_settings
from tests.integration.test_failures import FLAKY, request

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(900)]
# The tests on Apache Kafka are long (about 3.5 min together on a shared 2-core machine):
# marked apache_kafka and slow, they run in ``make test-kafka-slow``.

PARTITIONS = 4


@pytest.fixture
def kafka_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMAPP_BROKER_KIND", "kafka")


@pytest.fixture
def eos_settings(apache_kafka: KafkaBroker, app_id: str, kafka_env: None) -> Settings:
    settings = load_settings(
        broker=apache_kafka.url, app_id=app_id, topic_prefix=f"{app_id}.",
        topic_partitions=PARTITIONS, backend="onnxruntime", broker_kind="kafka",
    )
    create_topics(apache_kafka.bootstrap_servers, dict.fromkeys(settings.topics, PARTITIONS))
    return settings


def _worker(settings: Settings, tmp_path: Path, **extra: Any) -> WorkerProcess:
    """An exactly_once worker with static membership (restarted in place: same data dir,
    group instance id and so transactional id)."""
    return WorkerProcess(
        {
            "broker": settings.broker, "app_id": settings.app_id,
            "topic_prefix": settings.topic_prefix, "topic_partitions": PARTITIONS,
            "backend": "onnxruntime", "data_dir": tmp_path / "data", "max_batch_size": 32,
            "max_inflight_batches": 2, "commit_interval_ms": 100,
            "processing_guarantee": "exactly_once", "group_instance_id": "w",
            "worker_name": "w", **extra,
        },
        log_path=tmp_path / f"{extra.get('worker_name', 'w')}.log",
    )


def _counts(out: Outcomes) -> tuple[Counter[str | None], Counter[str | None]]:
    return (Counter(r["request_id"] for r in out.results),
            Counter(d.request_id for d in out.dead_letters))


async def _committed(bootstrap: str, settings: Settings) -> int:
    out = await collect_outcomes(bootstrap, settings.result_topic, settings.dlq_topic,
                                 done=lambda o: False, timeout_s=0.5)
    return len(out.results) + len(out.dead_letters)


def _metrics(worker: WorkerProcess) -> dict[str, float]:
    """The worker's unlabelled ``/metrics`` samples by name."""
    text = worker.metrics_text()
    samples = (line.split() for line in text.splitlines() if line and line[0] != "#")
    return {parts[0]: float(parts[1]) for parts in samples if len(parts) == 2}


def _device_totals(worker: WorkerProcess) -> dict[str, int]:
    status, body = worker.get("/devices?limit=1000", timeout_s=15)
    assert status == 200, body
    return {d["device_id"]: d["total"] for d in body["devices"]}


async def _wait_for_totals(worker: WorkerProcess, want: dict[str, int],
                           timeout_s: float = 60) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        totals = await asyncio.to_thread(_device_totals, worker)
        if totals == want or time.monotonic() > deadline:
            return totals
        await asyncio.sleep(0.5)


@pytest.mark.apache_kafka
@pytest.mark.slow
async def test_sigkill_during_traffic_every_request_answered_exactly_once(
    apache_kafka: KafkaBroker, eos_settings: Settings, tmp_path: Path
) -> None:
    settings, bootstrap = eos_settings, apache_kafka.bootstrap_servers
    images, _ = load_digits_frames()
    total, devices, kills = 20_000, 64, 5
    requests = digits_requests(images, devices=devices, indices=[i % len(images)
                                                                  for i in range(total)])
    sent = await publish(bootstrap, settings.request_topic, requests, codec="msgpack")
    ids = {s.request_id for s in sent}
    per_device = Counter(r.device_id for _, r in requests)
    rng = random.Random(21)
    worker = _worker(settings, tmp_path).start()
    recovery_s = []
    try:
        worker.wait_ready(timeout_s=120)
        for kill in range(kills):
            target = (kill + 1) * total // (kills + 2) + rng.randrange(0, total // (kills * 4))
            deadline = time.monotonic() + 300
            while await _committed(bootstrap, settings) < target:
                assert time.monotonic() < deadline, worker.log_tail()
                assert worker.process is not None and worker.process.poll() is None, \
                    worker.log_tail()
                await asyncio.sleep(rng.uniform(0.05, 0.3))
            worker.kill()  # SIGKILL: a transaction is open, with outcomes and changelogs in it
            started = time.monotonic()
            worker = _worker(settings, tmp_path).start()
            worker.wait_ready(timeout_s=120)
            recovery_s.append(round(time.monotonic() - started, 1))
        out = await collect_outcomes(
            bootstrap, settings.result_topic, settings.dlq_topic,
            done=lambda o: len(o.results) + len(o.dead_letters) >= total, timeout_s=240,
        )
        await asyncio.sleep(2.0)  # anything beyond the total would be a duplicate: look again
        out = await collect_outcomes(
            bootstrap, settings.result_topic, settings.dlq_topic,
            done=lambda o: False, timeout_s=3.0,
        )
        totals = await _wait_for_totals(worker, dict(per_device))
    finally:
        worker.stop()
    results, letters = _counts(out)
    answered = set(results) | set(letters)
    lost = ids - answered
    duplicates = sum(n - 1 for n in (results + letters).values())
    print(f"\nexactly_once, SIGKILL x{kills}: sent {total}, lost {len(lost)}, duplicates "
          f"{duplicates}, recovery {recovery_s} s")
    assert lost == set()
    assert duplicates == 0
    assert out.dead_letters == []
    assert totals == dict(per_device)  # every request counted once in the device tables


@pytest.mark.apache_kafka
@pytest.mark.slow
async def test_engine_failures_inside_transactions_end_in_one_result_each(
    apache_kafka: KafkaBroker, eos_settings: Settings, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Batches fail in the engine while their transaction is open (retry records join it),
    and the worker is SIGKILLed while retries are pending: the aborted transaction's retry
    records and results are never seen, and the requests are answered once, by a retry."""
    settings, bootstrap = eos_settings, apache_kafka.bootstrap_servers
    rules = [{"match_first_value": FLAKY / 16, "kind": "runtime", "times": 2, "count": "alone"}]
    monkeypatch.setenv("ENGINES_FAULTS", json.dumps(rules))
    monkeypatch.setenv(PLUGINS_ENV, FAULTS_PLUGIN)
    # the fault counts per process: a restarted worker fails a request twice more
    options = {"backend": "faulty", "max_batch_size": 8, "max_retries": 6,
               "retry_backoff_base_ms": 300, "retry_backoff_max_ms": 600}
    records, flaky = [], set()
    for seq in range(400):
        device = f"dev-{seq % 8}"
        bad = seq % 10 == 3
        # a distinct image each: the fault counts failures per item content
        records.append(request(seq, seq, device=device, first=FLAKY if bad else None,
                               request_id=f"r-{seq}"))
        if bad:
            flaky.add(f"r-{seq}")
    worker = _worker(settings, tmp_path, **options).start()
    try:
        worker.wait_ready(timeout_s=120)
        await publish_values(bootstrap, settings.request_topic, records[:200])
        deadline = time.monotonic() + 120
        while await _committed(bootstrap, settings) < 100:
            assert time.monotonic() < deadline, worker.log_tail()
            await asyncio.sleep(0.1)
        worker.kill()  # retries in flight, a transaction open
        worker = _worker(settings, tmp_path, **options).start()
        worker.wait_ready(timeout_s=120)
        await publish_values(bootstrap, settings.request_topic, records[200:])
        out = await collect_outcomes(
            bootstrap, settings.result_topic, settings.dlq_topic,
            done=lambda o: len(o.results) + len(o.dead_letters) >= len(records), timeout_s=180,
        )
        await asyncio.sleep(2.0)
        out = await collect_outcomes(bootstrap, settings.result_topic, settings.dlq_topic,
                                     done=lambda o: False, timeout_s=3.0)
        metrics = _metrics(worker)
    finally:
        worker.stop()
    results, letters = _counts(out)
    ids = {f"r-{seq}" for seq in range(len(records))}
    assert ids - set(results) == set(), worker.log_tail()
    assert [rid for rid, n in results.items() if n > 1] == []
    assert letters == Counter()
    retried = {r["request_id"] for r in out.results if r["attempt"] > 0}
    assert retried == flaky  # each answered once, by a retry (attempt > 0)
    assert metrics["streamapp_transactions_total"] > 0
    assert metrics["streamapp_transaction_failures_total"] == 0


def test_the_embedded_broker_refuses_exactly_once_with_one_line(
    embedded_broker: EmbeddedBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STREAMAPP_PROCESSING_GUARANTEE", "exactly_once")
    monkeypatch.delenv("STREAMAPP_BROKER_KIND", raising=False)
    done = subprocess.run(
        [sys.executable, "-m", "streamapp", "worker", "--broker", embedded_broker.url,
         "--app-id", "eos-refused", "--data-dir", str(tmp_path / "data"),
         "--backend", "onnxruntime"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "processing_guarantee=exactly_once needs Apache Kafka" in lines[0]
    assert "has no transactions" in lines[0]



@pytest.mark.apache_kafka
@pytest.mark.slow
async def test_a_worker_joining_and_leaving_during_traffic_answers_exactly_once(
    apache_kafka: KafkaBroker, eos_settings: Settings, tmp_path: Path
) -> None:
    """Rebalances: partitions move to a second worker and back while requests flow. The
    revoking worker commits its transaction before it gives them up; outcomes of records read
    before a revocation are not produced by the old reader (``stale_dropped``)."""
    settings, bootstrap = eos_settings, apache_kafka.bootstrap_servers
    images, _ = load_digits_frames()
    total = 6_000
    requests = digits_requests(images, devices=32, indices=[i % len(images)
                                                             for i in range(total)])
    ids = {r.request_id for _, r in requests}
    per_device = Counter(r.device_id for _, r in requests)

    def named(name: str) -> WorkerProcess:
        return _worker(settings, tmp_path, data_dir=tmp_path / f"data-{name}",
                       group_instance_id=name, worker_name=name)

    first, second = named("a").start(), None
    try:
        first.wait_ready(timeout_s=120)
        publisher = asyncio.create_task(
            publish(bootstrap, settings.request_topic, requests, codec="msgpack",
                    rate_per_s=300))
        await asyncio.sleep(2)
        second = named("b").start()
        await asyncio.to_thread(second.wait_ready, 120)
        await asyncio.sleep(3)
        assert second.stop(timeout_s=60) == 0, second.log_tail()
        await publisher
        out = await collect_outcomes(
            bootstrap, settings.result_topic, settings.dlq_topic,
            done=lambda o: len(o.results) + len(o.dead_letters) >= total, timeout_s=180)
        await asyncio.sleep(2.0)
        out = await collect_outcomes(bootstrap, settings.result_topic, settings.dlq_topic,
                                     done=lambda o: False, timeout_s=3.0)
        assert first.process is not None and first.process.poll() is None, first.log_tail()
        totals = await _wait_for_totals(first, dict(per_device))
    finally:
        first.stop()
        if second is not None:
            second.stop()
    results, letters = _counts(out)
    lost = ids - set(results) - set(letters)
    duplicates = sum(n - 1 for n in (results + letters).values())
    print(f"\nexactly_once, a worker joining and leaving: sent {total}, lost {len(lost)}, "
          f"duplicates {duplicates}")
    assert lost == set()
    assert duplicates == 0
    assert totals == dict(per_device)
