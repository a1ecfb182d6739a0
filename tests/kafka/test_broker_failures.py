"""Delivery when Apache Kafka itself fails (issue 12, item 4): each test starts its own brokers.

* a single broker restarted (SIGTERM, same data dir) while the worker is busy: the worker
  recovers by itself, nothing is lost, and ``/ready`` answers 503 while the broker is down;
* a 3-node cluster (replication factor 3, ``min.insync.replicas=2``) with one node killed
  (SIGKILL) and restarted while the worker is busy: nothing is lost.

Counted as a user would: every request id has a result or a dead letter. Lost, duplicates and
recovery times are printed (``-s``) for the record.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from streamapp.client import (
    Outcomes,
    collect_outcomes,
    digits_requests,
    load_digits_frames,
    publish,
)
from streamapp.kafka import create_topics
from streamapp.kafka_server import KafkaBroker
from streamapp.process import WorkerProcess
from streamapp.settings import Settings, load_settings

pytestmark = [
    pytest.mark.kafka, pytest.mark.apache_kafka, pytest.mark.slow, pytest.mark.timeout(900),
]

TOTAL, DEVICES = 8_000, 32
#: Partitions of every topic (``_setup``).
PARTITIONS = 4
#: Finished records that wait for the next device state flush (``state_flush_max_records``).
FLUSH_RECORDS = 64
#: Records a worker can have read but not committed: batches in flight plus one being filled,
#: plus the finished ones waiting for the state flush (as in tests/integration/test_delivery.py);
#: duplicates stay within twice this per failure.
MAX_PENDING = 32 * (2 + 1) + FLUSH_RECORDS


def _answered(outcomes: Outcomes) -> set[str | None]:
    return outcomes.result_ids() | outcomes.dead_letter_ids()


async def _results(bootstrap: str, settings: Settings) -> int | None:
    """Outcomes on the broker (duplicates included): the end offsets of the result and DLQ
    topics (Apache Kafka's ListOffsets; no transactions here, so no markers), or None while the
    broker does not answer. Reading the records back within a fixed 0.5 s instead undercounted
    on a loaded machine: CI once waited 180 s for one more outcome than an earlier read had
    counted."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                request_timeout_ms=5_000)
    try:
        await consumer.start()
        ends = await consumer.end_offsets([
            TopicPartition(topic, p) for topic in (settings.result_topic, settings.dlq_topic)
            for p in range(PARTITIONS)])
    except KafkaError:
        return None
    finally:
        await consumer.stop()
    return sum(ends.values())


async def _results_now(bootstrap: str, settings: Settings, timeout_s: float = 60) -> int:
    """:func:`_results` once the broker answers."""
    deadline = time.monotonic() + timeout_s
    while (count := await _results(bootstrap, settings)) is None:
        assert time.monotonic() < deadline, "the broker did not answer ListOffsets"
        await asyncio.sleep(0.2)
    return count


async def _wait_results(bootstrap: str, settings: Settings, at_least: int, worker: WorkerProcess,
                        timeout_s: float = 180) -> float:
    """Wait until ``at_least`` outcomes are on the broker; returns when (monotonic)."""
    deadline = time.monotonic() + timeout_s
    while (await _results(bootstrap, settings) or 0) < at_least:
        assert time.monotonic() < deadline, worker.log_tail()
        assert worker.process is not None and worker.process.poll() is None, worker.log_tail()
        await asyncio.sleep(0.2)
    return time.monotonic()


def _more(before: int, n: int) -> int:
    """The outcome count that shows the worker at work again after ``before`` were counted:
    ``n`` more, but at most TOTAL (fewer outcomes than requests means one is unanswered, and a
    count past TOTAL is a duplicate, never needed). CI once counted ``before`` only after the
    worker had reconnected and answered the rest, and then waited in vain for one more."""
    return max(before, min(before + n, TOTAL))


def _ready_status(worker: WorkerProcess) -> tuple[int, dict[str, bool]]:
    try:
        status, body = worker.get("/ready", timeout_s=3.0)
    except (OSError, ValueError):
        return 0, {}
    return status, body.get("checks", {})


async def _wait_ready_status(
    worker: WorkerProcess, want: int, timeout_s: float = 60
) -> dict[str, bool]:
    deadline = time.monotonic() + timeout_s
    while True:
        status, checks = await asyncio.to_thread(_ready_status, worker)
        if status == want:
            return checks
        assert time.monotonic() < deadline, f"/ready stayed {status} {checks}\n{worker.log_tail()}"
        await asyncio.sleep(0.2)


@pytest.fixture
def kafka_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMAPP_BROKER_KIND", "kafka")


def _setup(kafka: KafkaBroker, app_id: str, tmp_path: Path, replicas: int
           ) -> tuple[Settings, WorkerProcess]:
    settings = load_settings(
        broker=kafka.url, app_id=app_id, topic_prefix=f"{app_id}.", topic_partitions=PARTITIONS,
        topic_replication_factor=replicas, backend="onnxruntime",
    )
    create_topics(kafka.bootstrap_servers, {t: PARTITIONS for t in settings.topics},
                  replication_factor=replicas)
    worker = WorkerProcess(
        {
            "broker": settings.broker, "app_id": app_id, "topic_prefix": settings.topic_prefix,
            "topic_partitions": PARTITIONS, "topic_replication_factor": replicas,
            "backend": "onnxruntime", "data_dir": tmp_path / "data", "max_batch_size": 32,
            "commit_interval_ms": 20, "state_flush_max_records": FLUSH_RECORDS,
            "group_instance_id": "w",
        },
        log_path=tmp_path / "worker.log",
    )
    return settings, worker


def _report(name: str, ids: set[str], out: Outcomes, recovery_s: float) -> tuple[set, int]:
    lost = ids - _answered(out)
    duplicates = sum(n - 1 for n in Counter(r["request_id"] for r in out.results).values())
    print(f"\n{name}: sent {len(ids)}, lost {len(lost)}, duplicates {duplicates}, "
          f"recovery {recovery_s:.1f} s")
    return lost, duplicates


@pytest.fixture
def single_kafka(tmp_path: Path) -> Iterator[KafkaBroker]:
    with KafkaBroker(data_dir=tmp_path / "kafka") as kafka:
        yield kafka


@pytest.fixture
def kafka_cluster(tmp_path: Path) -> Iterator[KafkaBroker]:
    with KafkaBroker(nodes=3, data_dir=tmp_path / "cluster") as kafka:
        yield kafka


async def test_single_broker_restart_worker_recovers_by_itself(
    kafka_env: None, single_kafka: KafkaBroker, app_id: str, tmp_path: Path
) -> None:
    kafka = single_kafka
    settings, worker = _setup(kafka, app_id, tmp_path, replicas=1)
    images, _ = load_digits_frames()
    requests = digits_requests(images, devices=DEVICES,
                               indices=[i % len(images) for i in range(TOTAL)])
    sent = await publish(kafka.bootstrap_servers, settings.request_topic, requests,
                         codec="msgpack")
    ids = {s.request_id for s in sent}
    with worker:
        await asyncio.to_thread(worker.wait_ready, 120)
        await _wait_results(kafka.bootstrap_servers, settings, TOTAL // 4, worker)
        kafka.stop_node(0)  # SIGTERM; the data stays on disk
        down = time.monotonic()
        checks = await _wait_ready_status(worker, 503)
        assert checks["broker_responsive"] is False
        await asyncio.to_thread(kafka.start_node, 0)
        before = await _results_now(kafka.bootstrap_servers, settings)
        resumed = await _wait_results(kafka.bootstrap_servers, settings,
                                      _more(before, 1), worker)
        await _wait_ready_status(worker, 200, timeout_s=120)
        out = await collect_outcomes(
            kafka.bootstrap_servers, settings.result_topic, settings.dlq_topic,
            done=lambda o: ids <= _answered(o), timeout_s=240,
        )
        assert worker.process is not None and worker.process.poll() is None, worker.log_tail()
    lost, duplicates = _report("broker restart", ids, out, resumed - down)
    assert lost == set()
    assert out.dead_letters == []
    assert duplicates <= 2 * MAX_PENDING


async def test_cluster_node_killed_and_restarted_loses_nothing(
    kafka_env: None, kafka_cluster: KafkaBroker, app_id: str, tmp_path: Path
) -> None:
    kafka = kafka_cluster
    settings, worker = _setup(kafka, app_id, tmp_path, replicas=3)
    images, _ = load_digits_frames()
    requests = digits_requests(images, devices=DEVICES,
                               indices=[i % len(images) for i in range(TOTAL)])
    sent = await publish(kafka.bootstrap_servers, settings.request_topic, requests,
                         codec="msgpack")
    ids = {s.request_id for s in sent}
    with worker:
        await asyncio.to_thread(worker.wait_ready, 120)
        await _wait_results(kafka.bootstrap_servers, settings, TOTAL // 4, worker)
        kafka.kill_node(1)  # SIGKILL one of three: every partition keeps 2 in-sync replicas
        killed = time.monotonic()
        before = await _results_now(kafka.bootstrap_servers, settings)
        resumed = await _wait_results(kafka.bootstrap_servers, settings, _more(before, 500),
                                      worker)
        await asyncio.to_thread(kafka.start_node, 1)
        out = await collect_outcomes(
            kafka.bootstrap_servers, settings.result_topic, settings.dlq_topic,
            done=lambda o: ids <= _answered(o), timeout_s=240,
        )
        assert worker.process is not None and worker.process.poll() is None, worker.log_tail()
    lost, duplicates = _report("cluster node kill", ids, out, resumed - killed)
    assert lost == set()
    assert out.dead_letters == []
    assert duplicates <= 2 * MAX_PENDING
