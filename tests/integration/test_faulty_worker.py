"""A real worker process runs the test-only ``faulty`` backend configured through the environment:
it starts (its warm-up batch passes), answers traffic through the wrapped ONNX Runtime engine, and
a batch holding a marked request fails without taking the worker down."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engines.registry import PLUGINS_ENV
from engines.testing import FAULTS_PLUGIN
from streamapp.broker import EmbeddedBroker
from streamapp.client import collect_outcomes, digits_requests, load_digits_frames, publish
from streamapp.process import WorkerProcess
from streamapp.records import InferenceRequest, TensorPayload
from streamapp.settings import Settings

pytestmark = [pytest.mark.kafka]


async def test_worker_with_faulty_backend_from_the_environment(
    kafka_broker: EmbeddedBroker,
    worker_settings: Settings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Non-retriable "input" failures for any batch holding the marker (15.5/16 after
    # scaling: real digits are whole numbers, and -1 would be out of the model's range).
    monkeypatch.setenv(
        "ENGINES_FAULTS",
        json.dumps([{"match_first_value": 0.96875, "kind": "input"}]),
    )
    # Test-only backends exist only where a test registers them: the worker process gets
    # "faulty" through the registry's plugin hook.
    monkeypatch.setenv(PLUGINS_ENV, FAULTS_PLUGIN)
    s = worker_settings
    proc = WorkerProcess(
        {
            "broker": s.broker, "app_id": s.app_id, "topic_prefix": s.topic_prefix,
            "topic_partitions": s.topic_partitions, "backend": "faulty",
            "data_dir": tmp_path / "data", "max_batch_size": 16, "max_batch_delay_ms": 5,
        },
        log_path=tmp_path / "worker.log",
    )
    images, _ = load_digits_frames()
    good = digits_requests(images, devices=4, indices=range(40))
    pixels = images[0].astype(np.float32)
    pixels[0, 0] = 15.5
    poison = InferenceRequest(
        "poison-1", "device-00", 1000, 0.0, "digits",
        tensor=TensorPayload("float32", (8, 8), pixels.tobytes()),
    )
    with proc:
        proc.wait_ready()
        status, body = proc.get("/engines")
        assert status == 200 and body["digits"]["backend"] == "faulty"
        await publish(kafka_broker.bootstrap_servers, s.request_topic, [*good, (0, poison)])
        out = await collect_outcomes(
            kafka_broker.bootstrap_servers, s.result_topic, s.dlq_topic,
            done=lambda o: len(o.result_ids() | o.dead_letter_ids()) >= 41, timeout_s=60,
        )
        assert proc.process is not None and proc.process.poll() is None, proc.log_tail()

    assert out.result_ids() == {r.request_id for _, r in good}
    assert {r["engine"].split("-")[0] for r in out.results} == {"faulty"}
    assert out.dead_letter_ids() == {"poison-1"}
    letter = out.dead_letters[0]
    assert letter.error["type"] == "InputSpecError"
    assert "injected input failure" in letter.error["message"]
