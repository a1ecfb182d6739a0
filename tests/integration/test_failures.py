"""Retries, poison isolation and bad input, end to end on a real worker and broker.

The worker runs the test-only ``faulty`` backend (ONNX Runtime with injected failures, see
``engines/testing/faults.py``): a request whose first pixel carries a marker value fails as
configured.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from engines.registry import PLUGINS_ENV
from engines.testing import FAULTS_PLUGIN
from streamapp.broker import EmbeddedBroker
from streamapp.client import collect_outcomes, publish_values
from streamapp.codecs import encode_request
from streamapp.process import WorkerProcess
from streamapp.records import InferenceRequest, TensorPayload
from streamapp.settings import Settings
from tests.bad_inputs import BadInput, bad_input_records

pytestmark = [pytest.mark.kafka]

FLAKY, DOOMED, POISON = 15.5, 15.25, 14.5  # first-pixel markers; real digits are integers


def request(index: int, seq: int, device: str = "dev-f", first: float | None = None,
            request_id: str | None = None) -> tuple[bytes, bytes]:
    from streamapp.client import load_digits_frames

    images, _ = load_digits_frames()
    pixels = images[index].astype(np.float32)
    if first is not None:
        pixels[0, 0] = first
    value = encode_request(
        InferenceRequest(
            request_id=request_id or f"{device}-{seq}", device_id=device, seq=seq,
            ts=time.time(), model="digits",
            tensor=TensorPayload("float32", (8, 8), pixels.tobytes()),
        ),
        "json",
    )
    return device.encode(), value


@pytest.fixture
def faulty_worker(
    worker_settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> Iterator[WorkerProcess]:
    options: dict[str, Any] = dict(request.param)  # a copy: each broker side pops "faults"
    faults = options.pop("faults")
    monkeypatch.setenv("ENGINES_FAULTS", json.dumps(faults))
    monkeypatch.setenv(PLUGINS_ENV, FAULTS_PLUGIN)  # the worker process registers "faulty"
    s = worker_settings
    proc = WorkerProcess(
        {
            "broker": s.broker, "app_id": s.app_id, "topic_prefix": s.topic_prefix,
            "topic_partitions": s.topic_partitions, "backend": "faulty",
            "data_dir": tmp_path / "data", **options,
        },
        log_path=tmp_path / "worker.log",
    )
    with proc:
        proc.wait_ready()
        yield proc
        assert proc.process is not None and proc.process.poll() is None, proc.log_tail()


async def _table_rows(bootstrap: str, topic: str) -> dict[bytes, Any]:
    """The final state of a changelog topic (tombstones delete)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                auto_offset_reset="earliest")
    await consumer.start()
    rows: dict[bytes, Any] = {}
    try:
        parts = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
        if not parts:
            await consumer._client.force_metadata_update()
            parts = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        while True:
            batch = await consumer.getmany(timeout_ms=500)
            if not batch:
                break
            for records in batch.values():
                for r in records:
                    assert r.key is not None
                    if r.value is None:
                        rows.pop(r.key, None)
                    else:
                        rows[r.key] = json.loads(r.value)
    finally:
        await consumer.stop()
    return rows


@pytest.mark.parametrize(
    "faulty_worker",
    [{
        "faults": [
            {"match_first_value": FLAKY / 16, "kind": "runtime", "times": 2, "count": "alone"},
            {"match_first_value": DOOMED / 16, "kind": "oom"},
        ],
        "max_retries": 3, "retry_backoff_base_ms": 100, "retry_backoff_max_ms": 400,
        "max_batch_size": 8,
    }],
    indirect=True,
)
async def test_retries_end_in_one_result_or_one_dead_letter_and_clear_the_counters(
    kafka_broker: EmbeddedBroker, faulty_worker: WorkerProcess, worker_settings: Settings,
) -> None:
    s = worker_settings
    records = [request(1, 0), request(2, 1, first=FLAKY), request(3, 2, first=DOOMED),
               request(4, 3)]
    await publish_values(kafka_broker.bootstrap_servers, s.request_topic, records)
    out = await collect_outcomes(
        kafka_broker.bootstrap_servers, s.result_topic, s.dlq_topic,
        done=lambda o: len(o.results) == 3 and len(o.dead_letters) == 1, timeout_s=60,
    )
    attempts = {r["request_id"]: r["attempt"] for r in out.results}
    assert attempts == {"dev-f-0": 0, "dev-f-1": 2, "dev-f-3": 0}
    (letter,) = out.dead_letters
    assert letter.request_id == "dev-f-2"
    assert letter.error["reason"] == "retries_exhausted"
    assert letter.attempts == 4  # max_retries + 1
    assert [e["reason"] for e in letter.errors] == ["out_of_memory"] * 4
    assert letter.value == records[2][1]
    rows = await _table_rows(kafka_broker.bootstrap_servers, f"{s.app_id}-retry_counts-changelog")
    assert rows == {}  # every counter row removed once its request finished
    # a restarted worker restores retry_counts from that changelog (deletions included) and serves
    assert faulty_worker.stop() == 0
    faulty_worker.start().wait_ready(timeout_s=30)
    await publish_values(kafka_broker.bootstrap_servers, s.request_topic, [request(5, 4)])
    out = await collect_outcomes(
        kafka_broker.bootstrap_servers, s.result_topic, s.dlq_topic,
        done=lambda o: "dev-f-4" in o.result_ids(), timeout_s=30,
    )
    assert "dev-f-4" in out.result_ids()


@pytest.mark.parametrize(
    "faulty_worker",
    [{"faults": [{"match_first_value": POISON / 16, "kind": "input"}],
      "max_batch_size": 64, "max_batch_delay_ms": 3000}],
    indirect=True,
)
async def test_one_poison_request_in_a_batch_of_64_gets_the_only_dead_letter(
    kafka_broker: EmbeddedBroker, faulty_worker: WorkerProcess, worker_settings: Settings,
) -> None:
    s = worker_settings
    records = [request(i, i, first=POISON if i == 40 else None) for i in range(64)]
    await publish_values(kafka_broker.bootstrap_servers, s.request_topic, records)
    out = await collect_outcomes(
        kafka_broker.bootstrap_servers, s.result_topic, s.dlq_topic,
        done=lambda o: len(o.results) + len(o.dead_letters) >= 64, timeout_s=60,
    )
    assert len(out.results) == 63
    assert {r["batch_size"] for r in out.results} == {64}
    assert [(d.request_id, d.error["reason"]) for d in out.dead_letters] == [
        ("dev-f-40", "inference_failed")
    ]
    assert [r["seq"] for r in out.results] == [i for i in range(64) if i != 40]


@pytest.mark.parametrize(
    "worker_options", [{"max_request_bytes": 65_536, "max_batch_delay_ms": 500}]
)
async def test_every_kind_of_bad_input_between_good_traffic_gets_its_dead_letter(
    kafka_broker: EmbeddedBroker, worker: WorkerProcess, worker_settings: Settings,
) -> None:
    s = worker_settings
    # the catalogue's oversized value is over aiokafka's own 1 MiB request limit: this worker
    # accepts 64 KiB, so 100 KiB values are "too large" here
    bad = [b for b in bad_input_records(device="dev-f") if len(b.value) < 900_000]
    big = json.loads(request(0, 0)[1])
    big["padding"] = "x" * 100_000
    bad.append(BadInput("too-large", "too_large", b"dev-f", json.dumps(big).encode()))
    records: list[tuple[bytes | None, bytes]] = []
    good_ids = []
    for i, item in enumerate(bad):
        key, value = request(i, 2 * i)
        records.append((key, value))
        good_ids.append(f"dev-f-{2 * i}")
        records.append((item.key, item.value))
    pid = worker.process.pid if worker.process else None
    await publish_values(kafka_broker.bootstrap_servers, s.request_topic, records)
    # A request_id twice in one batch: the second copy is the dead letter. Sent on their own,
    # once the rest is answered, so that both land in the same batch (its window is 500 ms).
    await collect_outcomes(
        kafka_broker.bootstrap_servers, s.result_topic, s.dlq_topic,
        done=lambda o: len(o.results) + len(o.dead_letters) >= len(records), timeout_s=60,
    )
    dup_key, dup_value = request(0, 999, request_id="dup-1")
    records += [(dup_key, dup_value), (dup_key, dup_value)]
    await publish_values(kafka_broker.bootstrap_servers, s.request_topic, records[-2:])
    out = await collect_outcomes(
        kafka_broker.bootstrap_servers, s.result_topic, s.dlq_topic,
        done=lambda o: len(o.results) + len(o.dead_letters) >= len(records), timeout_s=60,
    )
    assert sorted(r["request_id"] for r in out.results) == sorted([*good_ids, "dup-1"])
    got = sorted((d.error["reason"], d.value) for d in out.dead_letters)
    want = sorted([(b.reason, b.value) for b in bad] + [("duplicate_request_id", dup_value)])
    assert got == want
    assert len({b.reason for b in bad} | {"duplicate_request_id"}) >= 12
    # never restarted: the same process, still ready
    assert worker.process is not None and worker.process.pid == pid
    assert worker.process.poll() is None
    assert worker.get("/ready")[0] == 200
    # every device the worker lists can be asked for (issue 19): the records with a device id
    # no view takes (tab, NUL, U+202E, 257 characters) are dead letters of no device
    keyed = sum(1 for key, _ in records if key == b"dev-f")
    deadline = time.monotonic() + 30
    while _device_total(worker, "dev-f") < keyed:  # the state flush of the last records
        assert time.monotonic() < deadline, worker.get("/devices/dev-f")
        await asyncio.sleep(0.2)
    status, listing = worker.get("/devices?limit=1000")
    listed = [d["device_id"] for d in listing["devices"]]
    assert status == 200 and sorted(listed) == ["dev-f", "dev-other"]
    assert [worker.get("/devices/" + quote(d, safe=""))[0] for d in listed] == [200, 200]


def _device_total(worker: WorkerProcess, device: str) -> int:
    status, body = worker.get(f"/devices/{device}")
    return int(body["total"]) if status == 200 else 0
