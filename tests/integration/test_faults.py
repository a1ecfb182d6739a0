"""Faults from the field (issue 10), end to end on a real worker and the embedded broker."""

from __future__ import annotations

import base64
import json
import time

import pytest

from streamapp.broker import EmbeddedBroker
from streamapp.client import collect_outcomes, publish_values
from streamapp.process import WorkerProcess
from streamapp.settings import Settings
from tests.integration.test_failures import FLAKY, faulty_worker, request  # noqa: F401

pytestmark = [pytest.mark.kafka]


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
