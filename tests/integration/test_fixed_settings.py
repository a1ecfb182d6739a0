"""Window sizes fixed for a deployment (issue 18, item 6), on both brokers.

The issue's trial: a worker restarted with another ``STREAMAPP_TUMBLING_WINDOW_S`` showed
``"count": 0`` in every window of a device that had just had its results. Now it refuses to
start (exit 1, one line naming the setting, both values and what to do); a hopping window size
may change and keeps the counts; with ``STREAMAPP_ACCEPT_WINDOW_CHANGE=1`` it starts, warns
once and keeps the totals.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from streamapp.process import WorkerProcess
from streamapp.settings import Settings
from tests.conftest import Broker
from tests.integration.test_bad_rows import DEVICES, FIRST, _totals, _traffic
from tests.integration.test_undecodable_batches import _wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def _worker(s: Settings, tmp_path: Path, name: str, **extra: Any) -> WorkerProcess:
    return WorkerProcess(
        {
            "broker": s.broker, "app_id": s.app_id, "topic_prefix": s.topic_prefix,
            "topic_partitions": s.topic_partitions, "backend": s.backend,
            "data_dir": tmp_path / "data", "max_batch_size": 16, "max_batch_delay_ms": 5,
            **extra,
        },
        log_path=tmp_path / f"{name}.log",
    )


async def test_other_window_sizes_are_refused_and_an_accepted_change_keeps_the_totals(
    kafka_broker: Broker, worker_settings: Settings, tmp_path: Path
) -> None:
    s, bootstrap = worker_settings, kafka_broker.bootstrap_servers
    await _traffic(bootstrap, s, FIRST, "one")
    with _worker(s, tmp_path, "first") as proc:
        proc.wait_ready()
        await _wait_for(lambda: set(_totals(proc).values()) == {FIRST}, "5 per device", proc)
        assert proc.stop() == 0, proc.log_tail()
    shutil.rmtree(tmp_path / "data")  # the stored state is the changelog's, not the data dir's

    refused = _worker(s, tmp_path, "refused", tumbling_window_s=20)
    with refused:
        assert refused.process is not None
        assert refused.process.wait(timeout=60) == 1
    lines = refused.log_path.read_text().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: window sizes are fixed for a deployment: "
                               "STREAMAPP_TUMBLING_WINDOW_S is 20 here, 10 in the stored state")
    assert "Start with STREAMAPP_TUMBLING_WINDOW_S=10" in lines[0]

    with _worker(s, tmp_path, "hopping", hopping_window_s=120) as proc:  # may change
        proc.wait_ready()
        status, body = proc.get("/devices/device-03/windows?kind=hopping&last=1", timeout_s=15)
        assert status == 200 and body["size_s"] == 120.0
        assert body["windows"][0]["count"] == FIRST  # summed from the stored 10 s buckets

    with _worker(s, tmp_path, "accepted", tumbling_window_s=20,
                 accept_window_change=True) as proc:
        proc.wait_ready()
        assert _totals(proc) == {f"device-{d:02d}": FIRST for d in range(DEVICES)}
        status, body = proc.get("/devices/device-03/windows?last=3", timeout_s=15)
        assert status == 200 and body["size_s"] == 20.0
        warnings = [line for line in proc.log_path.read_text().splitlines()
                    if "window sizes changed" in line]
    assert len(warnings) == 1 and "[WARNING]" in warnings[0], warnings
