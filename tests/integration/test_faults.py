"""Faults from the field (issue 10), end to end on a real worker and the embedded broker."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections import Counter

import pytest
from aiokafka import AIOKafkaProducer

from streamapp.broker import EmbeddedBroker
from streamapp.client import collect_outcomes, publish_values
from streamapp.process import WorkerProcess
from streamapp.settings import Settings
from tests.integration.test_failures import FLAKY, faulty_worker, request  # noqa: F401
from tests.integration.test_state import _wait_committed

pytestmark = [pytest.mark.kafka]


async def publish_batched(bootstrap: str, topic: str,
                          records: list[tuple[bytes, bytes]]) -> None:
    """Publish in order without waiting for each ack (``publish_values`` takes ~170 ms a record
    on a loaded machine); aiokafka keeps one batch in flight per partition, so order holds."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5,
                                max_request_size=2_000_000)
    await producer.start()
    try:
        futures = [await producer.send(topic, value, key=key) for key, value in records]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


def retry_record(**changes: object) -> bytes:
    """A complete retry record as a worker writes it, with ``changes`` applied."""
    key, value = request(5, 50, device="dev-rr")
    body: dict[str, object] = {
        "request_id": "rr-nb", "device_id": "dev-rr", "model": "digits", "attempt": 1,
        "not_before": time.time(), "errors": [], "first_failed_ts": time.time(),
        "source": {"topic": "inference-request", "partition": 0, "offset": 0},
        "key": base64.b64encode(key).decode(), "value": base64.b64encode(value).decode(),
        "extra": {},
    }
    body.update(changes)
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    "faulty_worker",
    [{
        "faults": [{"match_first_value": FLAKY / 16, "kind": "runtime", "times": 1,
                    "count": "alone"}],
        "max_retries": 3, "retry_backoff_base_ms": 100, "retry_backoff_max_ms": 400,
    }],
    indirect=True,
)
async def test_poisoned_retry_records_are_dead_lettered_and_retries_go_on(
    kafka_broker: EmbeddedBroker, faulty_worker: WorkerProcess,  # noqa: F811
    worker_settings: Settings,
) -> None:
    s = worker_settings
    poisoned = [retry_record(not_before="soon"), retry_record(request_id=123)]
    await publish_values(kafka_broker.bootstrap_servers, s.retry_topic,
                         [(b"rr-nb", v) for v in poisoned])
    await publish_values(kafka_broker.bootstrap_servers, s.request_topic,
                         [request(2, 1, first=FLAKY)])
    out = await collect_outcomes(
        kafka_broker.bootstrap_servers, s.result_topic, s.dlq_topic,
        done=lambda o: len(o.results) == 1 and len(o.dead_letters) == 2, timeout_s=60,
    )
    assert [(r["request_id"], r["attempt"]) for r in out.results] == [("dev-f-1", 1)]
    assert sorted(d.value for d in out.dead_letters) == sorted(poisoned)
    assert {d.error["reason"] for d in out.dead_letters} == {"invalid_retry_record"}
    # SIGTERM stops it cleanly (the issue: killed after 90 s once the retry scheduler had died)
    assert faulty_worker.stop(timeout_s=30) == 0
    faulty_worker.start().wait_ready(timeout_s=60)


@pytest.mark.slow
@pytest.mark.timeout(600)  # 501 records and two restarts: ~2 min alone, more on a loaded host
async def test_an_unproducible_result_is_dead_lettered_and_restarts_answer_nothing_twice(
    kafka_broker: EmbeddedBroker, worker: WorkerProcess, worker_settings: Settings,
) -> None:
    s, bootstrap = worker_settings, kafka_broker.bootstrap_servers
    # valid in every field and under max_request_bytes, but its result (which repeats the
    # request_id) would be over the producer's 1,000,000-byte limit
    key, big = request(0, 0, device="dev-big", request_id="r" * 999_600)
    assert 999_000 < len(big) < s.max_request_bytes
    good = [request(i % 10, i, device="dev-big") for i in range(1, 501)]
    await publish_batched(bootstrap, s.request_topic, [(key, big), *good])
    out = await collect_outcomes(
        bootstrap, s.result_topic, s.dlq_topic,
        done=lambda o: len(o.results) >= 500 and len(o.dead_letters) >= 1, timeout_s=120,
    )
    (letter,) = out.dead_letters
    assert letter.error["reason"] == "unproducible_outcome"
    assert letter.request_id == "r" * 256 and letter.extra["ids_truncated"] == {
        "request_id": 999_600
    }
    assert letter.source["offset"] == 0 and letter.value == b""
    assert Counter(r["request_id"] for r in out.results) == Counter(
        f"dev-big-{i}" for i in range(1, 501)
    )
    # the committed offset moves past the bad record, to the end of the partition
    await _wait_committed(bootstrap, s, timeout_s=60)
    for restart in (1, 2):
        assert worker.stop(timeout_s=30) == 0
        worker.start().wait_ready(timeout_s=60)
        # a marker of the same device (same partition): anything processed again would be
        # answered before it
        marker = f"dev-big-{500 + restart}"
        await publish_values(bootstrap, s.request_topic,
                             [request(1, 500 + restart, device="dev-big")])
        out = await collect_outcomes(
            bootstrap, s.result_topic, s.dlq_topic,
            done=lambda o, m=marker: m in o.result_ids(), timeout_s=60,
        )
        counts = Counter(r["request_id"] for r in out.results)
        assert len(out.results) == 500 + restart, f"after restart {restart}: duplicates"
        assert set(counts.values()) == {1} and len(out.dead_letters) == 1
