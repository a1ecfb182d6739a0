"""``/ready`` tells the truth about the broker (issue 19, item 3), on both brokers.

The session broker is frozen with SIGSTOP for a few seconds: the kernel still completes TCP
handshakes for a stopped process, so a connect-only check said ready throughout; the Kafka
request ``/ready`` sends now gets no answer. Tests run one at a time, so freezing the shared
broker affects this test's worker only; it is always resumed (SIGCONT).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from streamapp.client import collect_outcomes, digits_requests, load_digits_frames, publish
from streamapp.process import WorkerProcess
from streamapp.settings import Settings
from tests.conftest import Broker

pytestmark = [pytest.mark.kafka]


@contextmanager
def frozen(broker: Broker) -> Iterator[None]:
    """The broker's process group stopped (SIGSTOP) inside the block, resumed after it."""
    assert broker.pid is not None
    os.killpg(broker.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(broker.pid, signal.SIGCONT)


def _wait_ready_status(worker: WorkerProcess, want: int, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    status, body = 0, {}
    while time.monotonic() < deadline:
        try:
            status, body = worker.get("/ready", timeout_s=5.0)
        except OSError:
            status = 0
        if status == want:
            return dict(body)
        time.sleep(0.2)
    raise AssertionError(f"/ready stayed {status} {body} for {timeout_s} s:\n{worker.log_tail()}")


async def test_ready_is_503_while_the_broker_is_frozen_and_200_again_after(
    kafka_broker: Broker, worker: WorkerProcess, worker_settings: Settings,
) -> None:
    body = _wait_ready_status(worker, 200, 10)
    assert body["checks"]["broker_responsive"] is True and body["problems"] == {}
    server = kafka_broker.bootstrap_servers

    with frozen(kafka_broker):
        began = time.monotonic()
        body = _wait_ready_status(worker, 503, 10)
        noticed_s = time.monotonic() - began
        health = worker.get("/health")

    assert body["checks"]["broker_responsive"] is False
    assert body["problems"]["broker_responsive"] == (
        f"{server} did not answer a Kafka ApiVersions request within 1 s")
    assert noticed_s < 5.0  # one probe timeout (1 s) and the poll
    assert health == (200, {"status": "ok", "worker": health[1]["worker"]})  # liveness holds
    # resumed: ready again, and it answers
    _wait_ready_status(worker, 200, 60)
    images, _ = load_digits_frames()
    sent = await publish(server, worker_settings.request_topic,
                         digits_requests(images, devices=2, indices=[0, 1]), codec="msgpack")
    done: Callable[[Any], bool] = lambda o: len(o.results) >= len(sent)  # noqa: E731
    out = await collect_outcomes(server, worker_settings.result_topic, worker_settings.dlq_topic,
                                 done=done, timeout_s=60)
    assert sorted(r["request_id"] for r in out.results) == sorted(s.request_id for s in sent)
