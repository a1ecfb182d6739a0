"""Delivery guarantees under crashes and rebalances, on the embedded broker.

These tests kill real worker processes (SIGKILL) and move partitions between two workers while
traffic flows, then check what a user of the guarantee checks: every request_id has a result or a
dead letter (nothing lost), duplicates stay within the in-flight window, and each device's first
deliveries keep its order.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from streamapp.broker import EmbeddedBroker
from streamapp.client import (
    Outcomes,
    collect_outcomes,
    digits_requests,
    load_digits_frames,
    publish,
)
from streamapp.process import WorkerProcess
from streamapp.settings import Settings

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(1800)]

BATCH, INFLIGHT = 32, 2
#: Finished records that wait for the next device state flush (``state_flush_max_records``).
FLUSH_RECORDS = 64
#: Read but not committed: batches in flight, one being filled, and the finished records that
#: wait for the state flush; a crash re-delivers at most about twice this (docs/delivery.md).
MAX_PENDING = BATCH * (INFLIGHT + 1) + FLUSH_RECORDS


def _worker(settings: Settings, tmp_path: Path, name: str, static: bool = False) -> WorkerProcess:
    """A worker; ``static``: static group membership (a restarted worker gets its partitions
    back without waiting for its old session to expire)."""
    return WorkerProcess(
        {
            "broker": settings.broker, "app_id": settings.app_id,
            "topic_prefix": settings.topic_prefix, "topic_partitions": settings.topic_partitions,
            "backend": "onnxruntime", "data_dir": tmp_path / f"data-{name}",
            "max_batch_size": BATCH, "max_inflight_batches": INFLIGHT,
            "commit_interval_ms": 20, "state_flush_max_records": FLUSH_RECORDS,
            "worker_name": name,
            **({"group_instance_id": name} if static else {}),
        },
        log_path=tmp_path / f"{name}.log",
    )


def _answered(outcomes: Outcomes) -> set[str | None]:
    return outcomes.result_ids() | outcomes.dead_letter_ids()


async def _count_results(bootstrap: str, settings: Settings) -> int:
    """Records in the result topic (duplicates included), read to each partition's high
    watermark as fetch responses report it (right on both brokers; Tansu's ListOffsets is not).
    A fixed read timeout undercounts once the topic is large, and the test then waits forever
    for a count the worker reached long ago."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                auto_offset_reset="earliest")
    await consumer.start()
    try:
        tps = [TopicPartition(settings.result_topic, p) for p in range(settings.topic_partitions)]
        consumer.assign(tps)
        count = 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            batches = await consumer.getmany(*tps, timeout_ms=200, max_records=10_000)
            count += sum(len(records) for records in batches.values())
            reached = [await _at(consumer, tp, consumer.highwater(tp)) for tp in tps]
            if all(reached):
                return count
        return count
    finally:
        await consumer.stop()


async def _at(consumer: AIOKafkaConsumer, tp: TopicPartition, mark: int | None) -> bool:
    return mark is not None and await consumer.position(tp) >= mark


def _first_delivery_order_violations(outcomes: Outcomes) -> int:
    seen: set[str] = set()
    last: dict[str, int] = {}
    violations = 0
    for r in outcomes.results:  # topic order; a device's results share one partition
        if r["request_id"] in seen:
            continue
        seen.add(r["request_id"])
        device = r["device_id"]
        if device in last and r["seq"] < last[device]:
            violations += 1
        last[device] = r["seq"]
    return violations


@pytest.fixture
def delivery_settings(worker_settings: Settings) -> Settings:
    return worker_settings


async def test_sigkill_at_random_moments_loses_nothing(
    kafka_broker: EmbeddedBroker, delivery_settings: Settings, tmp_path: Path
) -> None:
    settings = delivery_settings
    bootstrap = kafka_broker.bootstrap_servers
    images, _ = load_digits_frames()
    total, devices, kills = 20_000, 64, 5
    requests = digits_requests(images, devices=devices, indices=[i % len(images)
                                                                  for i in range(total)])
    sent = await publish(bootstrap, settings.request_topic, requests, codec="msgpack")
    ids = {s.request_id for s in sent}
    rng = random.Random(7)
    recovery_s = []
    worker = _worker(settings, tmp_path, "w", static=True).start()
    try:
        worker.wait_ready()
        for kill in range(kills):
            # let it run a random while (at least some results beyond the last kill), then kill
            target = (kill + 1) * total // (kills + 2) + rng.randrange(0, total // (kills * 4))
            deadline = time.monotonic() + 300  # generous: the 2-core machine may be shared
            while await _count_results(bootstrap, settings) < target:
                assert time.monotonic() < deadline, worker.log_tail()
                assert worker.process is not None and worker.process.poll() is None, \
                    worker.log_tail()
                await asyncio.sleep(rng.uniform(0.05, 0.3))
            worker.kill()
            started = time.monotonic()
            worker = _worker(settings, tmp_path, "w", static=True).start()
            worker.wait_ready()
            recovery_s.append(time.monotonic() - started)
        out = await collect_outcomes(
            bootstrap, settings.result_topic, settings.dlq_topic,
            done=lambda o: ids <= _answered(o), timeout_s=180,
        )
    finally:
        worker.stop()
    lost = ids - _answered(out)
    duplicates = sum(n - 1 for n in Counter(r["request_id"] for r in out.results).values())
    print(f"\nSIGKILL x{kills}: sent {total}, lost {len(lost)}, duplicates {duplicates} "
          f"({duplicates / kills:.0f} per kill), recovery {np.round(recovery_s, 1).tolist()} s")
    assert lost == set()
    assert out.dead_letters == []
    assert duplicates <= kills * MAX_PENDING * 2, "more duplicates than the in-flight window"
    assert _first_delivery_order_violations(out) == 0


async def test_a_worker_joining_and_leaving_during_traffic_loses_nothing(
    kafka_broker: EmbeddedBroker, delivery_settings: Settings, tmp_path: Path
) -> None:
    settings = delivery_settings
    bootstrap = kafka_broker.bootstrap_servers
    images, _ = load_digits_frames()
    total = 12_000
    requests = digits_requests(images, devices=32, indices=[i % len(images)
                                                             for i in range(total)])
    ids = {r.request_id for _, r in requests}
    first = _worker(settings, tmp_path, "a").start()
    second: WorkerProcess | None = None
    try:
        first.wait_ready()
        publisher = asyncio.create_task(
            publish(bootstrap, settings.request_topic, requests, codec="msgpack",
                    rate_per_s=600)
        )
        for round_ in range(2):
            await asyncio.sleep(2)
            second = _worker(settings, tmp_path, f"b{round_}").start()
            await asyncio.to_thread(second.wait_ready)
            await asyncio.sleep(3)
            # SIGTERM: leaves the group cleanly (the drain may take long on a loaded machine)
            assert second.stop(timeout_s=60) == 0, second.log_tail()
        await publisher
        out = await collect_outcomes(
            bootstrap, settings.result_topic, settings.dlq_topic,
            done=lambda o: ids <= _answered(o), timeout_s=120,
        )
        assert first.process is not None and first.process.poll() is None, first.log_tail()
    finally:
        first.stop()
        if second is not None:
            second.stop()
    lost = ids - _answered(out)
    duplicates = sum(n - 1 for n in Counter(r["request_id"] for r in out.results).values())
    print(f"\nrebalances x4: sent {total}, lost {len(lost)}, duplicates {duplicates}")
    assert lost == set(), f"lost {len(lost)}: {sorted(lost)[:10]}"
    assert _first_delivery_order_violations(out) == 0


def _metric(worker: WorkerProcess, name: str) -> float:
    """The value of an unlabelled sample of the worker's ``/metrics``."""
    text = worker.metrics_text()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics:\n{text[:2000]}")


async def test_a_backlog_larger_than_fausts_buffers_is_read_once(
    kafka_broker: EmbeddedBroker, delivery_settings: Settings, tmp_path: Path
) -> None:
    """With a backlog the consumer's position runs far ahead of what Faust has handed to the
    agent; the gap sweeper must not take the records waiting in Faust's buffers for skipped
    ones (it read them a second time, directly from the broker)."""
    settings = delivery_settings
    bootstrap = kafka_broker.bootstrap_servers
    images, _ = load_digits_frames()
    total = 4_000  # the stream buffers hold 64 here; one fetch returns up to 1 MiB a partition
    requests = digits_requests(images, devices=32, indices=[i % len(images)
                                                             for i in range(total)])
    ids = {r.request_id for _, r in requests}
    await publish(bootstrap, settings.request_topic, requests, codec="msgpack")
    worker = _worker(settings, tmp_path, "w")
    # small stream buffers: the backlog is many times what Faust holds for the agent
    worker.settings["stream_buffer_maxsize"] = 64
    with worker:
        worker.wait_ready()
        out = await collect_outcomes(
            bootstrap, settings.result_topic, settings.dlq_topic,
            done=lambda o: ids <= _answered(o), timeout_s=300,
        )
        gap_reads = _metric(worker, "streamapp_gap_reads_total")
        gap_records = _metric(worker, "streamapp_gap_records_total")
    assert ids - _answered(out) == set()
    assert Counter(r["request_id"] for r in out.results).most_common(1)[0][1] == 1
    assert out.dead_letters == []
    assert (gap_reads, gap_records) == (0, 0)
