"""Partitions added to the request topic under a running worker (issue 18, item 2), on Apache
Kafka only: the embedded broker refuses CreatePartitions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from streamapp.client import collect_outcomes, digits_requests, load_digits_frames, publish
from streamapp.kafka import add_partitions
from tests.conftest import Broker
from tests.integration.conftest import wait_for
from tests.partition_workers import (
    committed_and_ends,
    device_totals,
    fresh_settings,
    metric,
    start_worker,
)

pytestmark = [pytest.mark.kafka, pytest.mark.apache_kafka, pytest.mark.slow]


@pytest.mark.timeout(600)
async def test_partitions_added_while_running_are_read_and_the_rebuild_keeps_every_total(
    apache_kafka: Broker, app_id: str, tmp_path: Path, runner: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The request topic grown from 16 to 24 partitions under a running worker (Kafka's
    CreatePartitions; the embedded broker refuses it). Before: the new partitions were not
    read for about 5 minutes, then the worker crashed (``Unrecognized partition``), and after a
    restart table updates failed for good. Now: within the metadata refresh interval the worker
    says its state is degraded (``/ready`` 503, ``streamapp_state_degraded`` 1, one ERROR line
    naming both counts and the command), answers every request, refuses a restart with one
    line, and after ``streamapp tables rebuild`` every device has the total it had."""
    monkeypatch.setenv("STREAMAPP_BROKER_KIND", "kafka")
    settings = fresh_settings(apache_kafka, app_id)
    bootstrap = apache_kafka.bootstrap_servers
    images, _ = load_digits_frames()
    devices = [f"device-{d:02d}" for d in range(40)]

    async def send(per_device: int, run_id: str) -> None:
        requests = digits_requests(images, devices=40, run_id=run_id,
                                   indices=[i % len(images) for i in range(40 * per_device)])
        await publish(bootstrap, settings.request_topic, requests)

    extra = {"metadata_refresh_interval_s": 2}
    worker = start_worker(settings, tmp_path, **extra)
    with worker:
        worker.wait_ready()
        await send(3, "before")
        wait_for(lambda: set(device_totals(worker, devices).values()) == {3}, 60,
                 "every device's total to be 3")
        add_partitions(settings, {settings.request_topic: 24})
        wait_for(lambda: worker.get("/ready")[0] == 503, 30, "/ready to answer 503")
        assert metric(worker, "streamapp_state_degraded") == 1.0
        await send(5, "during")
        out = await collect_outcomes(bootstrap, settings.result_topic, settings.dlq_topic,
                                     done=lambda o: len(o.result_ids()) >= 320, timeout_s=120)
        assert len(out.result_ids()) == 320, "every request answered, new partitions included"
        assert {r["_partition"] for r in out.results} and worker.process is not None
        assert worker.process.poll() is None, worker.log_tail()
        status, ready = worker.get("/ready")
        assert status == 503 and ready["checks"]["table_partitions_match"] is False, ready
    # a clean stop commits every answered request: none is answered (and counted) again
    committed, ends = await committed_and_ends(bootstrap, app_id, settings.request_topic, 24)
    # (a partition no request went to has end 0 and nothing committed)
    assert {p: c or 0 for p, c in committed.items()} == ends, (committed, ends)
    assert sum(v or 0 for v in ends.values()) == 40 * 8, ends
    log = worker.log_path.read_text()
    errors = [line for line in log.splitlines() if "now has 24 partitions, the tables 16" in line]
    assert len(errors) == 1, log[-4000:]
    assert "streamapp tables rebuild" in errors[0]
    assert "Unrecognized partition" not in log and "PartitionsMismatch" not in log

    # a restart before the rebuild refuses with one line
    refused = start_worker(settings, tmp_path, name="refused", **extra)
    with refused:
        assert refused.process is not None
        assert refused.process.wait(timeout=120) == 1
    lines = [line for line in refused.log_path.read_text().splitlines()
             if line.startswith("error:")]
    assert len(lines) == 1 and "has 24 partitions" in lines[0] and "has 16" in lines[0], lines
    assert "streamapp tables rebuild" in lines[0]

    from streamapp.cli import cli

    result = runner.invoke(cli, ["tables", "rebuild", "--broker", apache_kafka.url,
                                 "--app-id", app_id, "--topic-prefix", f"{app_id}."])
    assert result.exit_code == 0, result.output
    assert "have 24 partitions" in result.output

    # the first worker's data dir, a log of its own
    again = start_worker(settings, tmp_path, name="again", data_dir=tmp_path / "data-w", **extra)
    with again:
        again.wait_ready()
        # updates made while degraded were skipped (and counted); the totals before are kept
        assert set(device_totals(again, devices).values()) == {3}
        await send(2, "after")
        wait_for(lambda: set(device_totals(again, devices).values()) == {5}, 60,
                 "every device's total to be 5",
                 seen=lambda: (device_totals(again, devices), again.get("/ready"),
                               again.log_tail()))
        assert again.get("/ready")[0] == 200
        assert metric(again, "streamapp_state_degraded") == 0.0
    assert "dropped the local tables" in again.log_path.read_text()
