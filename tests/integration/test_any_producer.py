"""Records any Kafka producer may write: compressed batches and transactions (issue 12, item 5).

Compression runs on both brokers (Tansu stores compressed batches as they came, so the worker
decodes them either way); transactions on Apache Kafka only (Tansu has none).
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer

from streamapp.client import collect_outcomes, digits_requests, load_digits_frames
from streamapp.codecs import encode_request
from streamapp.process import WorkerProcess
from streamapp.records import InferenceRequest
from streamapp.settings import Settings
from tests.conftest import Broker

pytestmark = [pytest.mark.kafka]

CODECS = ("gzip", "snappy", "lz4", "zstd")
PER_BATCH = 8


def _requests(n: int, run_id: str, devices: int = 4) -> list[tuple[bytes, bytes, str]]:
    """``(key, value, request_id)`` of ``n`` JSON digit requests."""
    images, _ = load_digits_frames()
    out = []
    for _, r in digits_requests(images, devices=devices, indices=range(n), run_id=run_id):
        stamped = InferenceRequest(  # capture time now, as streamapp.client.publish does
            r.request_id, r.device_id, r.seq, time.time(), r.model, r.tensor, r.image
        )
        out.append((r.device_id.encode(), encode_request(stamped, "json"), r.request_id))
    return out


async def test_requests_in_gzip_snappy_lz4_and_zstd_batches_are_answered(
    kafka_broker: Broker, worker: WorkerProcess, worker_settings: Settings
) -> None:
    s = worker_settings
    sent: dict[str, str] = {}
    for codec in CODECS:
        producer = AIOKafkaProducer(
            bootstrap_servers=kafka_broker.bootstrap_servers, compression_type=codec,
            linger_ms=50,  # several records per (compressed) batch
        )
        await producer.start()
        try:
            batch = _requests(PER_BATCH, run_id=f"{codec}-{s.app_id}")
            futures = [await producer.send(s.request_topic, v, key=k) for k, v, _ in batch]
            for future in futures:
                await future
        finally:
            await producer.stop()
        sent.update({rid: codec for _, _, rid in batch})

    out = await collect_outcomes(
        kafka_broker.bootstrap_servers, s.result_topic, s.dlq_topic,
        done=lambda o: len(o.results) + len(o.dead_letters) >= len(sent), timeout_s=90,
    )

    assert out.dead_letters == []
    answered = Counter(r["request_id"] for r in out.results)
    missing = {codec for rid, codec in sent.items() if rid not in answered}
    assert missing == set(), f"requests of these codecs were not answered: {missing}"
    assert set(answered) == set(sent)


async def test_transactions_committed_answered_once_aborted_never_markers_not_lost(
    kafka_broker: Broker, broker_kind: str, worker: WorkerProcess, worker_settings: Settings,
    tmp_path: Path,
) -> None:
    if broker_kind != "kafka":
        pytest.skip("the embedded broker (Tansu) has no transactions (InitProducerId fails)")
    s = worker_settings
    producer = AIOKafkaProducer(
        bootstrap_servers=kafka_broker.bootstrap_servers, transactional_id=f"tx-{s.app_id}",
        enable_idempotence=True,
    )
    await producer.start()
    committed: set[str] = set()
    aborted: set[str] = set()
    try:
        # One device: every record, marker and aborted record lands in one partition, so the
        # last committed transaction is behind the aborted ones there.
        for round_, outcome in enumerate(["commit", "abort", "commit", "abort", "commit"]):
            batch = _requests(5, run_id=f"{outcome}{round_}-{s.app_id}", devices=1)
            await producer.begin_transaction()
            for key, value, _ in batch:
                await producer.send(s.request_topic, value, key=key)
            if outcome == "commit":
                await producer.commit_transaction()
                committed |= {rid for _, _, rid in batch}
            else:
                await producer.abort_transaction()
                aborted |= {rid for _, _, rid in batch}
    finally:
        await producer.stop()

    out = await collect_outcomes(
        kafka_broker.bootstrap_servers, s.result_topic, s.dlq_topic,
        done=lambda o: committed <= {r["request_id"] for r in o.results}, timeout_s=90,
    )
    # Markers and aborted records sit between the committed transactions' records.
    answered = Counter(r["request_id"] for r in out.results)
    assert set(answered) == committed
    assert set(answered.values()) == {1}, "a committed request was answered twice"
    assert out.dead_letters == []
    log = (tmp_path / "worker.log").read_text(errors="replace")
    assert "no longer exist" not in log, "transaction markers were reported as lost records"
    assert "the consumer skipped" not in log, "transaction markers were reported as skipped"
    assert aborted.isdisjoint(answered)
