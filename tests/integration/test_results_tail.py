"""``streamapp results tail`` as a user runs it: real requests through a running worker, then the
printed lines must carry each request's device, seq and the label the model gives its image."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from typer.testing import CliRunner

from streamapp.cli import cli
from streamapp.client import SentRequest, collect_outcomes, digits_requests, load_digits_frames
from streamapp.client import publish as publish_requests
from streamapp.demo import offline_predictions
from streamapp.process import WorkerProcess
from streamapp.results import RESULT_HEADER
from streamapp.settings import Settings
from streamapp.tail import iso_utc
from tests.conftest import Broker

pytestmark = [pytest.mark.kafka]


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray]:
    images, _ = load_digits_frames()
    return images, offline_predictions(images)


async def answered(broker: Broker, settings: Settings, images: np.ndarray,
                   indices: range) -> list[SentRequest]:
    """Publish these images from 4 devices and wait until each has its result."""
    sent = await publish_requests(
        broker.bootstrap_servers, settings.request_topic,
        digits_requests(images, devices=4, indices=indices),
    )
    ids = {s.request_id for s in sent}
    await collect_outcomes(
        broker.bootstrap_servers, settings.result_topic, settings.dlq_topic,
        done=lambda o: ids <= o.result_ids(), timeout_s=60,
    )
    return sent


def expected(sent: list[SentRequest], offline: np.ndarray) -> set[tuple[str, int, str]]:
    return {(s.device_id, s.seq, str(offline[s.index])) for s in sent}


def shown(lines: list[str]) -> set[tuple[str, int, str]]:
    """(device, seq, label) of result lines; every line must be a result in 80 columns."""
    out = set()
    for line in lines:
        device, seq, model, version, engine, label, score, e2e = line.split()
        assert len(line) <= 79 and model == "digits" and engine.startswith("onnxruntime-")
        assert version == "v1"  # the bundled model's one version
        assert 0 < float(score) <= 1 and float(e2e) >= 0
        out.add((device, int(seq), label))
    return out


async def tail(runner: CliRunner, settings: Settings, *more: str) -> tuple[list[str], str]:
    args = ["results", "tail", "--broker", settings.broker, "--topic-prefix",
            settings.topic_prefix, *more]
    out = await asyncio.to_thread(runner.invoke, cli, args)
    assert out.exit_code == 0, out.output
    return out.stdout.splitlines(), out.stderr


async def test_tail_shows_each_answered_request_with_device_seq_and_label(
    kafka_broker: Broker, worker: WorkerProcess, worker_settings: Settings,
    digits: tuple[np.ndarray, np.ndarray], runner: CliRunner,
) -> None:
    images, offline = digits
    first = await answered(kafka_broker, worker_settings, images, range(24))

    lines, stderr = await tail(runner, worker_settings)
    assert lines[0] == RESULT_HEADER
    assert shown(lines[1:]) == expected(first, offline)
    assert "24 shown of 24 matching (all)" in stderr

    lines, _ = await tail(runner, worker_settings, "--device", "device-02")
    assert shown(lines[1:]) == expected([s for s in first if s.device_id == "device-02"], offline)
    assert len(lines) == 1 + 6

    lines, _ = await tail(runner, worker_settings, "--limit", "5")
    assert len(lines) == 1 + 5 and shown(lines[1:]) <= expected(first, offline)

    await asyncio.sleep(1.0)  # results of the first round are older than the mark
    mark = time.time()
    await asyncio.sleep(0.2)
    second = await answered(kafka_broker, worker_settings, images, range(100, 108))

    lines, stderr = await tail(runner, worker_settings, "--since", iso_utc(mark))
    assert len(lines) == 1 + 8 and shown(lines[1:]) == expected(second, offline)
    assert f"8 shown of 8 matching (since={iso_utc(mark)})" in stderr
    lines, _ = await tail(runner, worker_settings, "--since", "1h", "--json", "--limit", "0")
    bodies = [json.loads(line) for line in lines]
    assert {b["request_id"] for b in bodies} == {s.request_id for s in first + second}
    assert all(b["engine"] == bodies[0]["engine"] and "record" in b for b in bodies)


async def test_follow_prints_results_as_they_arrive(
    kafka_broker: Broker, worker: WorkerProcess, worker_settings: Settings,
    digits: tuple[np.ndarray, np.ndarray],
) -> None:
    images, offline = digits
    env = {**os.environ, "STREAMAPP_BROKER": worker_settings.broker,
           "STREAMAPP_TOPIC_PREFIX": worker_settings.topic_prefix}
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamapp", "results", "tail", "--follow"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        assert proc.stdout is not None
        header = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
        assert header.rstrip("\n") == RESULT_HEADER
        sent = await answered(kafka_broker, worker_settings, images, range(200, 212))
        lines = [await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
                 for _ in sent]
        assert shown([line.rstrip("\n") for line in lines]) == expected(sent, offline)
        assert proc.poll() is None  # still following
    finally:
        proc.terminate()
        proc.communicate(timeout=10)
