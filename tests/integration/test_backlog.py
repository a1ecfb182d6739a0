"""``streamapp_backlog_records`` counts every record not committed yet (issue 19, item 4), on
both brokers.

The worker here holds its commits back (device state flushed once a minute: an offset is
committed only after the flush that follows its outcome), so every record it answered stays in
the backlog: the gauge must read exactly what was published while ``streamapp_consumer_lag``
(high watermark − fetch position) and ``streamapp_pending_requests`` read 0 — the shape of
the soak in the issue, where lag read 3 with 1,073 records uncommitted.
"""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from streamapp.client import collect_outcomes, digits_requests, load_digits_frames, publish
from streamapp.process import WorkerProcess
from streamapp.settings import Settings
from tests.conftest import Broker

pytestmark = [pytest.mark.kafka]

TOTAL = 300


def _samples(worker: WorkerProcess, family: str, topic: str | None = None) -> list[float]:
    text = worker.metrics_text()
    return [s.value for f in text_string_to_metric_families(text) if f.name == family
            for s in f.samples if topic is None or s.labels.get("topic") == topic]


@pytest.mark.parametrize(
    "worker_options", [{"state_flush_interval_ms": 60_000, "state_flush_max_records": 100_000}]
)
async def test_the_backlog_gauge_counts_what_is_not_committed_where_lag_reads_0(
    kafka_broker: Broker, worker: WorkerProcess, worker_settings: Settings,
) -> None:
    s = worker_settings
    images, _ = load_digits_frames()
    sent = await publish(kafka_broker.bootstrap_servers, s.request_topic,
                         digits_requests(images, devices=8, indices=list(range(TOTAL))),
                         codec="msgpack")
    out = await collect_outcomes(kafka_broker.bootstrap_servers, s.result_topic, s.dlq_topic,
                                 done=lambda o: len(o.results) >= len(sent), timeout_s=60)
    assert len(out.results) == TOTAL  # every request answered, none committed yet

    backlog = _samples(worker, "streamapp_backlog_records", s.request_topic)
    assert len(backlog) == 4 and sum(backlog) == TOTAL  # one sample per assigned partition
    assert sum(_samples(worker, "streamapp_consumer_lag", s.request_topic)) == 0
    assert _samples(worker, "streamapp_pending_requests") == [0]
