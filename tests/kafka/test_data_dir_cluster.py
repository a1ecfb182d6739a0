"""A data dir from another cluster (issue 18, item 5): the README's embedded-broker section,
then its Apache Kafka section, both with the same ``--data-dir``. Before, the Kafka worker
exited 1 after 8 s with 287 log lines and Faust's ``ConsistencyError``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from streamapp.broker import EmbeddedBroker
from streamapp.client import digits_requests, load_digits_frames, publish
from streamapp.kafka_server import KafkaBroker
from tests.integration.conftest import wait_for
from tests.partition_workers import device_totals, fresh_settings, start_worker

pytestmark = [pytest.mark.kafka, pytest.mark.apache_kafka]


@pytest.mark.timeout(300)
async def test_a_data_dir_of_another_cluster_is_refused_with_one_line(
    embedded_broker: EmbeddedBroker, apache_kafka: KafkaBroker, app_id: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    images, _ = load_digits_frames()
    devices = [f"device-{d:02d}" for d in range(4)]
    data: dict[str, Any] = {"data_dir": tmp_path / "data"}

    monkeypatch.setenv("STREAMAPP_BROKER_KIND", "embedded")
    embedded = fresh_settings(embedded_broker, app_id)
    with start_worker(embedded, tmp_path, name="embedded", **data) as worker:
        worker.wait_ready()
        await publish(embedded_broker.bootstrap_servers, embedded.request_topic,
                      digits_requests(images, devices=4, indices=range(40)))
        wait_for(lambda: set(device_totals(worker, devices).values()) == {10}, 60,
                 "every device's total to be 10")

    monkeypatch.setenv("STREAMAPP_BROKER_KIND", "kafka")
    kafka = fresh_settings(apache_kafka, app_id)
    refused = start_worker(kafka, tmp_path, name="kafka", **data)
    with refused:
        assert refused.process is not None
        assert refused.process.wait(timeout=60) == 1
    lines = refused.log_path.read_text().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: data directory ") and "tansu_cluster" in lines[0]
    assert "--data-dir" in lines[0] and "--reset-data-dir" in lines[0]

    afresh = start_worker(kafka, tmp_path, name="afresh", args=("--reset-data-dir",), **data)
    with afresh:
        afresh.wait_ready()
        await publish(apache_kafka.bootstrap_servers, kafka.request_topic,
                      digits_requests(images, devices=4, indices=range(8)))
        # this cluster's counts only: none of the embedded broker's 10 per device
        wait_for(lambda: set(device_totals(afresh, devices).values()) == {2}, 60,
                 "every device's total to be 2")
    assert "dropped the tables of app" in afresh.log_path.read_text()
