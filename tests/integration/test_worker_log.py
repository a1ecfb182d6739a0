"""A real worker's log as a user reads it: it starts with the block that says where the worker
is, and Faust's per-changelog-table INFO lines are not there at the default level."""

from __future__ import annotations

import re

import pytest

from streamapp.process import WorkerProcess
from streamapp.settings import Settings

pytestmark = [pytest.mark.kafka]


def test_the_log_starts_with_where_the_worker_is_and_skips_changelog_chatter(
    worker: WorkerProcess, worker_settings: Settings
) -> None:
    text = worker.log_path.read_text()
    s = worker_settings
    block = text.split("\n[", 1)[0].splitlines()

    assert block[0].endswith(f"streamapp worker of group {s.app_id!r} (4 partitions per topic)")
    assert block[1].startswith(f"  web      {worker.web_url} ")
    assert block[2] == f"  broker   {s.broker} ({s.broker_kind})"
    # the worker fixture's batches: 16 requests or 5 ms
    assert block[3] == (f"  reads    {s.request_topic}, {s.retry_topic} (intake direct; "
                        "batches of 16 or 5 ms)")
    assert block[4] == f"  writes   {s.result_topic}, {s.dlq_topic}"
    assert block[5] == (f"  delivery {s.processing_guarantee} (processing_guarantee; "
                        "docs/delivery.md)")
    assert re.fullmatch(r"  models   digits v1 onnxruntime-[\d.]+:[0-9a-f]{8} \(cpu, fp32, "
                        r"max batch \d+\)", block[6]), block[6]
    assert block[7] == "  backend  onnxruntime"
    assert block[8].startswith("  data dir ") and block[8].rstrip().endswith("data")
    for chatter in ("Highwater", "Reading Starts At", "Table: device_stats", "Store: rocksdb",
                    "opening partition", "-changelog' created"):
        assert chatter not in text, chatter
    assert "[^Worker]: Ready" in text
