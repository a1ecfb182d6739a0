"""Changelog rows that cannot be read (issue 18, item 1), on both brokers.

The issue's trial: one worker, 8 devices x 5 requests, SIGTERM; one record whose value is the
bytes ``ff fe 00 67 61 72 62 61 67 65`` appended under a device's key to the
``device_stats`` changelog (in that device's partition); the worker restarted with its data dir
removed, so the tables come from the changelogs; 24 new requests. Before: "Error in recovery
'utf-8' codec can't decode byte 0xff", ``/ready`` never 200, 0 of 24 answered, every
``/devices`` query 404. Wrong-shape JSON rows (``"x"``, ``[1, 2]``, ``{"total": "many"}``)
answered 500 and were never updated again, or reset a total silently.

What a user checks here: ``/ready``, the 24 answers, each device's totals (the reset device's
starting afresh and saying so in ``state_reset``), one ERROR line per bad record naming its
topic, partition, offset and key, and ``streamapp_state_rows_rejected_total``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.partitioner import DefaultPartitioner

from streamapp.client import collect_outcomes, digits_requests, load_digits_frames, publish
from streamapp.process import WorkerProcess
from streamapp.settings import Settings
from streamapp.tables.base import bucket_key
from tests.conftest import Broker
from tests.integration.test_undecodable_batches import _device_row, _metrics, _wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

DEVICES, FIRST, SECOND = 8, 5, 3
GARBAGE = bytes.fromhex("fffe0067617262616765")  # the record: not UTF-8


def _worker(s: Settings, tmp_path: Path, name: str) -> WorkerProcess:
    return WorkerProcess(
        {
            "broker": s.broker, "app_id": s.app_id, "topic_prefix": s.topic_prefix,
            "topic_partitions": s.topic_partitions, "backend": s.backend,
            "data_dir": tmp_path / "data", "max_batch_size": 16, "max_batch_delay_ms": 5,
        },
        log_path=tmp_path / f"{name}.log",
    )


async def _append(bootstrap: str, topic: str, records: list[tuple[bytes, bytes | None]],
                  partition: int | None = None) -> list[tuple[int, int]]:
    """Produce ``(key, value)`` records (the key's default partition, as the tables write a
    device's stats row; ``partition``: that one, e.g. a window bucket's device's partition);
    ``(partition, offset)`` of each."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        out = []
        for key, value in records:
            meta = await producer.send_and_wait(topic, key=key, value=value, partition=partition)
            out.append((meta.partition, meta.offset))
        return out
    finally:
        await producer.stop()


async def _traffic(bootstrap: str, s: Settings, per_device: int, run_id: str) -> set[str]:
    images, _ = load_digits_frames()
    requests = digits_requests(images, devices=DEVICES, run_id=run_id,
                               indices=range(DEVICES * per_device))
    await publish(bootstrap, s.request_topic, requests)
    return {r.request_id for _, r in requests}


def _totals(proc: WorkerProcess) -> dict[str, int | None]:
    rows = {f"device-{d:02d}": _device_row(proc, f"device-{d:02d}") for d in range(DEVICES)}
    return {device: None if row is None else row["total"] for device, row in rows.items()}


async def _first_run(bootstrap: str, s: Settings, tmp_path: Path) -> dict[str, Any]:
    """8 devices x 5 requests, every row written, SIGTERM; the tumbling windows of device-06."""
    await _traffic(bootstrap, s, FIRST, "one")
    with _worker(s, tmp_path, "first") as proc:
        proc.wait_ready()
        await _wait_for(lambda: set(_totals(proc).values()) == {FIRST}, "5 per device", proc)
        status, windows = proc.get("/devices/device-06/windows?last=360", timeout_s=15)
        assert status == 200
        assert proc.stop() == 0, proc.log_tail()
    return windows  # type: ignore[no-any-return]


async def _ready_then_send(bootstrap: str, s: Settings, proc: WorkerProcess
                           ) -> tuple[dict[str, Any], set[str]]:
    """Once the restarted worker is ready: every device's answer, then 8 x 3 new requests,
    all answered."""
    proc.wait_ready(timeout_s=90)  # before the fix: never
    before = {f"device-{d:02d}": proc.get(f"/devices/device-{d:02d}")[1]
              for d in range(DEVICES)}
    ids = await _traffic(bootstrap, s, SECOND, "two")
    out = await collect_outcomes(
        bootstrap, s.result_topic, s.dlq_topic,
        done=lambda o: ids <= o.result_ids(), timeout_s=60,
    )
    assert len(ids & out.result_ids()) == DEVICES * SECOND, proc.log_tail()  # 24 of 24
    return before, ids


def _errors(proc: WorkerProcess) -> list[str]:
    text = proc.log_path.read_text(errors="replace")
    assert "Error in recovery" not in text
    return [line for line in text.splitlines() if "[ERROR]" in line]


async def test_an_undecodable_changelog_record_resets_its_device_and_nothing_else(
    kafka_broker: Broker, worker_settings: Settings, tmp_path: Path
) -> None:
    s, bootstrap = worker_settings, kafka_broker.bootstrap_servers
    await _first_run(bootstrap, s, tmp_path)
    changelog = f"{s.app_id}-device_stats-changelog"
    ((partition, offset),) = await _append(bootstrap, changelog, [(b"device-00", GARBAGE)])

    shutil.rmtree(tmp_path / "data")  # the tables come from the changelogs
    with _worker(s, tmp_path, "second") as proc:
        before, _ = await _ready_then_send(bootstrap, s, proc)
        reset = before["device-00"]
        assert (reset["total"], reset["state_reset"]["reason"]) == (0, "undecodable")
        assert reset["state_reset"]["source"] == {
            "topic": changelog, "partition": partition, "offset": offset}
        assert all(before[f"device-{d:02d}"]["total"] == FIRST for d in range(1, DEVICES))
        want = {f"device-{d:02d}": FIRST + SECOND for d in range(1, DEVICES)}
        want["device-00"] = SECOND  # afresh from its next request
        await _wait_for(lambda: _totals(proc) == want, "the totals to go on", proc)
        row = _device_row(proc, "device-00")
        assert row is not None and row["state_reset"] == reset["state_reset"]
        metrics = _metrics(proc)
        errors = _errors(proc)
    assert len(errors) == 1, errors
    assert f"{changelog}[{partition}]@{offset}, key 'device-00', cannot be read" in errors[0]
    assert "'utf-8' codec can't decode byte 0xff" in errors[0]
    assert metrics[("streamapp_state_rows_rejected_total", {
        "table": "device_stats", "reason": "undecodable", "source": "changelog"})] == 1


async def test_wrong_shape_rows_in_every_restored_table_reset_only_themselves(
    kafka_broker: Broker, worker_settings: Settings, tmp_path: Path
) -> None:
    """The issue's wrong-shape rows, and siblings: a bad window bucket, a bad ``retry_counts``
    row, a row with an unexpected extra key (accepted), a tombstone (the device forgotten)."""
    s, bootstrap = worker_settings, kafka_broker.bootstrap_servers
    windows = await _first_run(bootstrap, s, tmp_path)
    stats = f"{s.app_id}-device_stats-changelog"
    extra = {"device_id": "device-04", "total": FIRST, "counts": {
        "result": FIRST, "dead_letter": 0, "retry": 0}, "added_by_a_newer_version": 1}
    appended = await _append(bootstrap, stats, [
        (b"device-01", b'"x"'), (b"device-02", b"[1, 2]"),
        (b"device-03", b'{"total": "many"}'), (b"device-04", json.dumps(extra).encode()),
        (b"device-05", None),
    ])
    filled = [w for w in windows["windows"] if w["count"]]
    bucket = bucket_key(b"device-06", round(windows["size_s"] * 1000),
                        round(filled[0]["start"] * 1000))
    # A device's buckets live in the device's partition (the tables write them from its
    # request's event), not in the partition the bucket key would hash to.
    device_partition = DefaultPartitioner()(
        b"device-06", list(range(s.topic_partitions)), list(range(s.topic_partitions)))
    ((w_partition, w_offset),) = await _append(
        bootstrap, f"{s.app_id}-device_windows-changelog", [(bucket, b"[1, 2]")],
        partition=device_partition)
    ((r_partition, r_offset),) = await _append(
        bootstrap, f"{s.app_id}-retry_counts-changelog", [(b"request-x", GARBAGE)])

    shutil.rmtree(tmp_path / "data")  # the tables come from the changelogs
    with _worker(s, tmp_path, "second") as proc:
        before, _ = await _ready_then_send(bootstrap, s, proc)
        for device in ("device-01", "device-02", "device-03"):  # 500 / never updated before
            assert before[device]["total"] == 0, before[device]
            assert before[device]["state_reset"]["reason"] == "bad_shape"
        assert before["device-04"]["total"] == FIRST
        assert "added_by_a_newer_version" not in before["device-04"]
        assert "state_reset" not in before["device-04"]
        assert before["device-05"]["error"] == "unknown_device"
        status, win = proc.get("/devices/device-06/windows?last=360", timeout_s=15)
        assert status == 200
        by_start = {w["start"]: w for w in win["windows"]}
        assert by_start[filled[0]["start"]]["count"] == 0
        assert by_start[filled[0]["start"]]["state_reset"]["reason"] == "bad_shape"
        assert before["device-06"]["total"] == FIRST  # its stats row was readable

        want = {f"device-{d:02d}": FIRST + SECOND for d in range(DEVICES)}
        want.update({"device-01": SECOND, "device-02": SECOND, "device-03": SECOND,
                     "device-05": SECOND})
        await _wait_for(lambda: _totals(proc) == want, "the totals to go on", proc)
        metrics = _metrics(proc)
        errors = _errors(proc)
    assert len(errors) == 5, errors
    for (partition, offset), device in zip(appended[:3], ("01", "02", "03"), strict=True):
        assert any(f"{stats}[{partition}]@{offset}, key 'device-{device}'" in line
                   for line in errors), device
    assert any(f"device_windows-changelog[{w_partition}]@{w_offset}, key 'device-06' (bucket"
               in line for line in errors)
    assert any(f"retry_counts-changelog[{r_partition}]@{r_offset}, key 'request-x'" in line
               for line in errors)

    def rejected(table: str, reason: str) -> float:
        return metrics[("streamapp_state_rows_rejected_total",
                        {"table": table, "reason": reason, "source": "changelog"})]

    assert rejected("device_stats", "bad_shape") == 3
    assert rejected("device_windows", "bad_shape") == 1
    assert rejected("retry_counts", "undecodable") == 1
