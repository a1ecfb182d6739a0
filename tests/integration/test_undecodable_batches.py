"""A record batch the worker cannot decode, between good requests on one partition (issue 12,
item 5): the requests before and after it are answered, each offset of the bad batch has one
``undecodable_record_batch`` dead letter, the worker keeps running and the group's committed
offset reaches the end of the partition.

Two kinds of bad batch, put on the broker with raw ProduceRequests (aiokafka's client):

* a batch whose CRC does not match: the embedded broker (Tansu) stores it as it came; Apache
  Kafka validates batches on produce and refuses it (``CORRUPT_MESSAGE``, checked here), so on
  Kafka this case cannot reach a consumer;
* a valid lz4 batch read by a worker without lz4: the worker process gets a ``sitecustomize``
  (through ``PYTHONPATH``, test-only) that makes aiokafka report the lz4 codec missing, as it
  did before cramjam was installed. This runs on both brokers.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.client import AIOKafkaClient
from aiokafka.protocol.produce import ProduceRequest
from prometheus_client.parser import text_string_to_metric_families

from streamapp.broker import EmbeddedBroker
from streamapp.client import collect_outcomes, digits_requests, load_digits_frames
from streamapp.codecs import encode_request
from streamapp.dlq import replayable
from streamapp.kafka import create_topics, read_partition_range
from streamapp.process import WorkerProcess
from streamapp.record_batches import guard_record_batches
from streamapp.records import DeadLetter, InferenceRequest
from streamapp.settings import Settings
from streamapp.tables.faust_tables import SEAL_KEY
from tests.conftest import Broker
from tests.record_batch_bytes import batch_bytes, with_bad_crc

pytestmark = [pytest.mark.kafka]

#: Kafka error code CORRUPT_MESSAGE (a batch whose CRC does not match).
CORRUPT_MESSAGE = 2


def _requests(n: int, run_id: str) -> list[tuple[bytes, bytes, str]]:
    """``(key, value, request_id)`` of ``n`` JSON digit requests of 2 devices."""
    images, _ = load_digits_frames()
    out = []
    for _, r in digits_requests(images, devices=2, indices=range(n), run_id=run_id):
        stamped = InferenceRequest(
            r.request_id, r.device_id, r.seq, time.time(), r.model, r.tensor, r.image
        )
        out.append((r.device_id.encode(), encode_request(stamped, "json"), r.request_id))
    return out


async def _produce_raw(bootstrap: str, topic: str, partition: int, batch: bytes) -> tuple[int, int]:
    """Send one record batch as it is (no client-side checks): ``(error code, base offset)``."""
    client = AIOKafkaClient(bootstrap_servers=bootstrap)
    await client.bootstrap()
    try:
        await client.force_metadata_update()
        leader = client.cluster.leader_for_partition(TopicPartition(topic, partition))
        response = await client.send(leader, ProduceRequest(
            transactional_id=None, required_acks=-1, timeout=10_000,
            topics=[(topic, [(partition, batch)])],
        ))
    finally:
        await client.close()
    ((_, ((_, error_code, base_offset, *_),)),) = response.topics
    return int(error_code), int(base_offset)


async def _committed(bootstrap: str, group: str, tp: TopicPartition, end: int,
                     timeout_s: float = 60.0) -> int | None:
    """The group's committed offset of ``tp`` once it reaches ``end`` (or at the timeout)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group,
                                enable_auto_commit=False)
    await consumer.start()
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            committed = await consumer.committed(tp)
            if (committed is not None and committed >= end) or time.monotonic() > deadline:
                return committed
            await asyncio.sleep(0.2)
    finally:
        await consumer.stop()


def _without_lz4(directory: Path) -> str:
    """A ``PYTHONPATH`` whose ``sitecustomize`` makes aiokafka report lz4 as missing."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(
        "# test-only: as if the lz4 library were not installed (tests/integration/"
        "test_undecodable_batches.py)\nimport aiokafka.codec\n\n"
        "aiokafka.codec.has_lz4 = lambda: False\n"
    )
    return os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH")) if p)


def _check_letters(letters: list[DeadLetter], topic: str, first: int, sent: bytes, *,
                   error_type: str, codec: str, count: int) -> None:
    """One letter per offset ``first .. first + count - 1`` in offset order; the first holds
    the batch (the broker may rewrite base offset and leader epoch, the bytes before magic)."""
    assert [d.source for d in letters] == [
        {"topic": topic, "partition": 0, "offset": o} for o in range(first, first + count)
    ]
    for letter in letters:
        assert letter.error["reason"] == "undecodable_record_batch"
        assert (letter.error["type"], letter.error["stage"]) == (error_type, "consume")
        batch = letter.extra["record_batch"]
        assert (batch["first_offset"], batch["last_offset"]) == (first, first + count - 1)
        assert (batch["record_count"], batch["codec"]) == (count, codec)
        assert batch["size_bytes"] == len(sent)
        assert not replayable(letter)
    stored = letters[0].value
    assert stored[16:] == sent[16:]
    assert letters[0].extra["record_batch"]["sha256"] == hashlib.sha256(stored).hexdigest()
    assert [d.value for d in letters[1:]] == [b""] * (count - 1)


async def test_bad_batches_between_good_requests_become_dead_letters_and_the_partition_goes_on(
    kafka_broker: Broker, broker_kind: str, worker_settings: Settings, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = worker_settings
    bootstrap = kafka_broker.bootstrap_servers
    monkeypatch.setenv("PYTHONPATH", _without_lz4(tmp_path / "no-lz4"))
    proc = WorkerProcess(
        {
            "broker": s.broker, "app_id": s.app_id, "topic_prefix": s.topic_prefix,
            "topic_partitions": s.topic_partitions, "backend": s.backend,
            "data_dir": tmp_path / "data", "max_batch_size": 16, "max_batch_delay_ms": 5,
        },
        log_path=tmp_path / "worker.log",
    )
    requests = _requests(14, run_id=s.app_id)
    before, corrupt, between, lz4, after = (
        requests[0:3], requests[3:6], requests[6:8], requests[8:12], requests[12:14]
    )
    crc_batch = with_bad_crc(batch_bytes([(k, v) for k, v, _ in corrupt]))
    lz4_batch = batch_bytes([(k, v) for k, v, _ in lz4], codec="lz4")
    with proc:
        proc.wait_ready()
        offsets: dict[str, int] = {}
        for name, batch in (
            ("before", batch_bytes([(k, v) for k, v, _ in before])),
            ("corrupt", crc_batch),
            ("between", batch_bytes([(k, v) for k, v, _ in between])),
            ("lz4", lz4_batch),
            ("after", batch_bytes([(k, v) for k, v, _ in after])),
        ):
            error, offsets[name] = await _produce_raw(bootstrap, s.request_topic, 0, batch)
            if name == "corrupt" and broker_kind == "kafka":
                assert error == CORRUPT_MESSAGE  # Kafka validates batches: never stored
                continue
            assert error == 0, f"{name}: error {error}"
        corrupt_stored = broker_kind == "embedded"
        good = {rid for part in (before, between, after) for *_, rid in part}
        letters_expected = len(lz4) + (len(corrupt) if corrupt_stored else 0)

        out = await collect_outcomes(
            bootstrap, s.result_topic, s.dlq_topic, timeout_s=90,
            done=lambda o: good <= o.result_ids() and len(o.dead_letters) >= letters_expected,
        )
        end = offsets["after"] + len(after)
        committed = await _committed(bootstrap, s.app_id, TopicPartition(s.request_topic, 0), end)
        assert proc.process is not None and proc.process.poll() is None, (
            f"the worker died:\n{proc.log_tail()}"
        )
        status, _ = proc.get("/ready")
        metrics = _metrics(proc)

    answered = Counter(r["request_id"] for r in out.results)
    assert set(answered) == good  # before and after the bad batches; nothing of theirs
    assert set(answered.values()) == {1}
    assert len(out.dead_letters) == letters_expected
    by_type = {t: sorted((d for d in out.dead_letters if d.error["type"] == t),
                         key=lambda d: d.source["offset"])
               for t in ("CorruptRecordException", "UnsupportedCodecError")}
    _check_letters(by_type["UnsupportedCodecError"], s.request_topic, offsets["lz4"], lz4_batch,
                   error_type="UnsupportedCodecError", codec="lz4", count=len(lz4))
    if corrupt_stored:
        _check_letters(by_type["CorruptRecordException"], s.request_topic, offsets["corrupt"],
                       crc_batch, error_type="CorruptRecordException", codec="none",
                       count=len(corrupt))
    else:
        assert by_type["CorruptRecordException"] == []
    assert committed == end
    assert status == 200  # still ready: the partition goes on
    where = {"topic": s.request_topic, "handling": "dead_lettered"}
    assert metrics[("streamapp_undecodable_batches_total", where)] == (2 if corrupt_stored else 1)
    assert metrics[("streamapp_undecodable_records_total", where)] == letters_expected
    assert metrics[("streamapp_dead_letters_total",
                    {"model": "unknown", "reason": "undecodable_record_batch"})] == letters_expected


class _Samples(dict[tuple[str, frozenset[tuple[str, str]]], float]):
    """``/metrics`` samples, looked up by ``(name, {label: value})``."""

    def __getitem__(self, key: tuple[str, dict[str, str]]) -> float:  # type: ignore[override]
        name, labels = key
        return super().__getitem__((name, frozenset(labels.items())))


def _metrics(proc: WorkerProcess) -> _Samples:
    text = proc.metrics_text()
    return _Samples({
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text) for sample in family.samples
    })


async def test_the_gap_reader_hands_out_stand_ins_for_a_corrupt_batch(
    embedded_broker: EmbeddedBroker,
) -> None:
    """What delivery reads directly to fill a consumer gap (streamapp.kafka.read_partition_range)
    passes a corrupt batch too. Tansu only: Apache Kafka refuses such a batch."""
    topic = f"gap-{uuid4().hex[:8]}"
    bootstrap = embedded_broker.bootstrap_servers
    create_topics(bootstrap, {topic: 1})
    guard_record_batches([topic])  # as the worker does for its request and retry topics
    for batch in (batch_bytes([(b"k", b"a"), (b"k", b"b")]),
                  with_bad_crc(batch_bytes([(b"k", b"c"), (b"k", b"d"), (b"k", b"e")])),
                  batch_bytes([(b"k", b"f")])):
        error, _ = await _produce_raw(bootstrap, topic, 0, batch)
        assert error == 0

    read = await read_partition_range(bootstrap, topic, 0, 0, 6, timeout_s=30)

    assert list(read) == [(0, b"k", b"a"), (1, b"k", b"b"), (2, None, None), (3, None, None),
                          (4, None, None), (5, b"k", b"f")]


def _device_row(proc: WorkerProcess, device: str) -> dict[str, Any] | None:
    status, body = proc.get(f"/devices/{device}")
    return body if status == 200 else None


async def _wait_for(check: Callable[[], bool], what: str, proc: WorkerProcess,
                    timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not {what} after {timeout_s} s:\n{proc.log_tail()}"
        await asyncio.sleep(0.2)


async def _last_record(bootstrap: str, topic: str, partitions: int) -> tuple[int, int, bytes]:
    """``(partition, end offset, value)`` of the last record of the one partition of ``topic``
    that holds records (read from the beginning: no ListOffsets, wrong on Tansu)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        last: dict[int, tuple[int, bytes]] = {}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for tp, records in (await consumer.getmany(timeout_ms=300)).items():
                for r in records:
                    if r.value is not None and r.key != SEAL_KEY:
                        last[tp.partition] = (r.offset, r.value)
            ends = [consumer.highwater(tp) for tp in tps]
            positions = [await consumer.position(tp) for tp in tps]
            if all(end is not None and at >= end for at, end in zip(positions, ends, strict=True)):
                break
        (partition,) = last  # one device: one partition
        return partition, last[partition][0], last[partition][1]
    finally:
        await consumer.stop()


async def test_an_undecodable_changelog_batch_is_skipped_and_the_tables_recover(
    kafka_broker: Broker, worker_settings: Settings, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A device's stats row, then an lz4 batch (the worker has no lz4) at the end of its
    changelog partition: a worker restarted with an empty data dir skips the batch with one
    ERROR, recovers the row before it, becomes ready and goes on counting."""
    s = worker_settings
    bootstrap = kafka_broker.bootstrap_servers
    monkeypatch.setenv("PYTHONPATH", _without_lz4(tmp_path / "no-lz4"))

    def worker(name: str) -> WorkerProcess:
        return WorkerProcess(
            {
                "broker": s.broker, "app_id": s.app_id, "topic_prefix": s.topic_prefix,
                "topic_partitions": s.topic_partitions, "backend": s.backend,
                "data_dir": tmp_path / f"data-{name}", "max_batch_size": 16,
                "max_batch_delay_ms": 5,
            },
            log_path=tmp_path / f"{name}.log",
        )

    device = "device-00"
    first = [(key, value) for key, value, _ in _requests(6, run_id=f"one-{s.app_id}")
             if key == device.encode()]
    with worker("first") as proc:
        proc.wait_ready()
        for key, value in first:
            assert (await _produce_raw(bootstrap, s.request_topic, 0,
                                       batch_bytes([(key, value)])))[0] == 0
        await _wait_for(lambda: (_device_row(proc, device) or {}).get("counts", {}).get(
            "result") == len(first), "the device's row", proc)
    changelog = f"{s.app_id}-device_stats-changelog"
    partition, _, row = await _last_record(bootstrap, changelog, s.topic_partitions)
    counted = json.loads(row)
    assert counted["counts"]["result"] == len(first)
    # a later row for the device, in a batch the worker cannot decode
    later = json.dumps({**counted, "counts": {**counted["counts"], "result": 999}}).encode()
    error, bad_offset = await _produce_raw(bootstrap, changelog, partition,
                                           batch_bytes([(device.encode(), later)], codec="lz4"))
    assert error == 0

    with worker("second") as proc:  # empty data dir: the tables come from the changelogs
        proc.wait_ready()
        restored = _device_row(proc, device)
        metrics = _metrics(proc)
        second = [(k, v) for k, v, _ in _requests(6, run_id=f"two-{s.app_id}")
                  if k == device.encode()]
        for key, value in second:
            assert (await _produce_raw(bootstrap, s.request_topic, 0,
                                       batch_bytes([(key, value)])))[0] == 0
        await _wait_for(lambda: (_device_row(proc, device) or {}).get("counts", {}).get(
            "result") == len(first) + len(second), "counting to go on", proc)
        log = (tmp_path / "second.log").read_text(errors="replace")

    assert restored is not None and restored["counts"]["result"] == len(first)  # not 999
    errors = [line for line in log.splitlines()
              if "[ERROR]" in line and "record batch cannot be decoded" in line]
    assert len(errors) == 1, errors
    assert f"{changelog}[{partition}]@{bad_offset}..{bad_offset}" in errors[0]
    assert "UnsupportedCodecError" in errors[0]
    where = {"topic": changelog, "handling": "skipped"}
    assert metrics[("streamapp_undecodable_batches_total", where)] == 1
    assert metrics[("streamapp_undecodable_records_total", where)] == 1
