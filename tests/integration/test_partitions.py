"""Partition counts that are not the ones the tables assume (issue 18, item 2), on real workers.

What a user checks: every device's total at ``/devices/{id}``, ``/ready``, the one line the
worker prints, and the partition count of the topic ``streamapp publish`` created.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from streamapp.client import digits_requests, load_digits_frames, publish
from streamapp.kafka import cluster_facts
from tests.conftest import Broker
from tests.integration.conftest import wait_for
from tests.partition_workers import device_totals, fresh_settings, start_worker

pytestmark = [pytest.mark.kafka]


async def test_a_worker_started_after_a_gateway_published_keeps_every_devices_total(
    kafka_broker: Broker, app_id: str, tmp_path: Path
) -> None:
    """Publisher first: a gateway's 64 requests from 16 devices made the broker auto-create the
    request topic with its default of 4 partitions; a worker with the defaults (16) then sizes
    its tables from that topic. Before, every table write failed (PartitionsMismatch 4 vs 16)
    and every ``/devices`` query answered 404 while ``/ready`` said 200. On Apache Kafka this
    is also the cold start with a backlog waiting, where the consumer used to begin before it
    knew the changelogs (0 partitions)."""
    settings = fresh_settings(kafka_broker, app_id)
    images, _ = load_digits_frames()
    requests = digits_requests(images, devices=16, indices=range(64))
    # a gateway: a plain producer that leaves topic creation to the broker
    await publish(kafka_broker.bootstrap_servers, settings.request_topic, requests,
                  partitions=None)
    assert cluster_facts(settings).partitions[settings.request_topic] == 4

    devices = [f"device-{d:02d}" for d in range(16)]
    worker = start_worker(settings, tmp_path)
    with worker:
        worker.wait_ready()
        wait_for(lambda: set(device_totals(worker, devices).values()) == {4}, 60,
                 "every device's total to be 4")
        status, ready = worker.get("/ready")
        assert status == 200, ready
    log = worker.log_path.read_text()
    assert "topic_partitions=16 is not used" in log and "already has 4 partitions" in log, log
    assert "PartitionsMismatch" not in log
    assert "could not update the tables" not in log
    facts = cluster_facts(settings).partitions
    assert {facts[t] for t in settings.topics} == {4}


def test_streamapp_publish_creates_the_request_topic_with_the_configured_count(
    kafka_broker: Broker, app_id: str, runner: Any
) -> None:
    """``streamapp publish`` before any worker: the request topic gets
    ``STREAMAPP_TOPIC_PARTITIONS`` partitions, not the broker's auto-creation default (4)."""
    from streamapp.cli import cli

    result = runner.invoke(cli, [
        "publish", "--broker", kafka_broker.url, "--topic-prefix", f"{app_id}.",
        "--count", "8", "--devices", "2",
    ], env={"STREAMAPP_TOPIC_PARTITIONS": "6"})
    assert result.exit_code == 0, result.output
    assert "published 8 frames" in result.output
    settings = fresh_settings(kafka_broker, app_id)
    assert cluster_facts(settings).partitions[settings.request_topic] == 6
