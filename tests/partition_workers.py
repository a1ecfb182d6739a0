"""Workers on fresh groups and what a user reads from them: shared by the partition-count
tests on both brokers (tests/integration) and on Apache Kafka only (tests/kafka)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from streamapp.process import WorkerProcess
from streamapp.settings import Settings, load_settings
from tests.conftest import Broker

__all__ = ["committed_and_ends", "device_totals", "fresh_settings", "metric", "start_worker"]


def device_totals(worker: WorkerProcess, devices: list[str]) -> dict[str, int | None]:
    """``total`` of each device's ``/devices/{id}`` answer (None: not 200)."""
    out: dict[str, int | None] = {}
    for device in devices:
        status, body = worker.get(f"/devices/{device}", timeout_s=10)
        out[device] = body.get("total") if status == 200 else None
    return out


def fresh_settings(kafka_broker: Broker, app_id: str, **extra: Any) -> Settings:
    """Settings of a worker with its own group and topics, none of them created yet."""
    return load_settings(broker=kafka_broker.url, app_id=app_id, topic_prefix=f"{app_id}.",
                         backend="onnxruntime", **extra)


def start_worker(settings: Settings, tmp_path: Path, name: str = "w",
                 args: tuple[str, ...] = (), **extra: Any) -> WorkerProcess:
    """A worker with the defaults (no topic_partitions given) on ``settings``' group."""
    return WorkerProcess(
        {"broker": settings.broker, "app_id": settings.app_id,
         "topic_prefix": settings.topic_prefix, "backend": "onnxruntime",
         "data_dir": tmp_path / f"data-{name}", "max_batch_size": 16, "max_batch_delay_ms": 5,
         **extra},
        log_path=tmp_path / f"{name}.log", args=args,
    )


def metric(worker: WorkerProcess, name: str) -> float | None:
    """The value of an unlabelled sample ``name`` in the worker's ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = worker.metrics_text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and not sample.labels:
                return float(sample.value)
    return None


async def committed_and_ends(bootstrap: str, group: str, topic: str, partitions: int
                             ) -> tuple[dict[int, int | None], dict[int, int | None]]:
    """``group``'s committed offset and the end (the fetch high watermark: Tansu's ListOffsets
    is wrong after multi-record batches, docs/broker.md) of each partition of ``topic``."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group,
                                enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        deadline = time.monotonic() + 30
        while any(consumer.highwater(tp) is None for tp in tps) and time.monotonic() < deadline:
            await consumer.getmany(timeout_ms=200)
        ends = {tp.partition: consumer.highwater(tp) for tp in tps}
        committed = {tp.partition: await consumer.committed(tp) for tp in tps}
        return committed, ends
    finally:
        await consumer.stop()
