"""docker-compose.yml's cpu profile, without Docker: its worker's environment and command, its
health check and its publisher's command, run against Apache Kafka (what the compose file runs),
give answers from the bundled model.

What differs from the containers, and why: the broker address (the session's Kafka instead of
kafka:9092), the group and topic names (each test has its own), the data dir and web port (a
free one on this machine), and the publisher's frame count and rate (a few frames, not an hour's).
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from streamapp.cli import cli
from streamapp.client import collect_outcomes
from streamapp.process import WorkerProcess
from tests.conftest import Broker

pytestmark = [pytest.mark.kafka]

COMPOSE = yaml.safe_load((Path(__file__).resolve().parents[2] / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def _env(name: str) -> dict[str, str]:
    return {k: str(v) for k, v in SERVICES[name]["environment"].items()}


async def test_the_cpu_profiles_worker_and_publisher_give_answers(
    kafka_broker: Broker, broker_kind: str, app_id: str, tmp_path: Path,
) -> None:
    if broker_kind != "kafka":
        pytest.skip("the compose file runs Apache Kafka")
    here = {"STREAMAPP_BROKER": kafka_broker.url, "STREAMAPP_APP_ID": app_id,
            "STREAMAPP_TOPIC_PREFIX": f"{app_id}.", "STREAMAPP_DATA_DIR": str(tmp_path / "data"),
            "STREAMAPP_TOPIC_PARTITIONS": "4"}
    worker_env = {**_env("worker-cpu"), **here}
    settings = {k.removeprefix("STREAMAPP_").lower(): v for k, v in worker_env.items()}
    settings.pop("web_port")  # a free one
    command = SERVICES["worker-cpu"]["command"]
    assert command[0] == "worker"
    worker = WorkerProcess(settings, log_path=tmp_path / "worker.log", args=tuple(command[1:]))
    with worker:
        worker.wait_ready(timeout_s=90)
        # the container's health check, pointed at this worker's port
        check = SERVICES["worker-cpu"]["healthcheck"]["test"]
        assert check[0] == "CMD-SHELL"
        probe = check[1].replace(":6066/", f":{worker.settings['web_port']}/")
        assert probe != check[1]
        done = await asyncio.to_thread(subprocess.run, probe, shell=True, timeout=30,
                                       executable="/bin/sh",
                                       env={**os.environ, "PATH": f"{Path(sys.executable).parent}"
                                            f":{os.environ.get('PATH', '')}"})
        assert done.returncode == 0

        publish = list(SERVICES["publisher"]["command"])
        publish[publish.index("--count") + 1] = "48"
        publish[publish.index("--rate") + 1] = "200"
        out = await asyncio.to_thread(CliRunner().invoke, cli, publish,
                                      env={**_env("publisher"), **here})
        assert out.exit_code == 0, out.output
        assert re.search(r"published 48 frames from 16 devices", out.stdout), out.stdout
        outcomes = await collect_outcomes(
            kafka_broker.bootstrap_servers, f"{app_id}.inference-result",
            f"{app_id}.inference-dlq", done=lambda o: len(o.results) >= 48, timeout_s=60,
        )
    assert outcomes.dead_letters == [] and len(outcomes.results) == 48
    assert {r["model"] for r in outcomes.results} == {"digits"}
    assert {r["engine"].split("-")[0] for r in outcomes.results} == {"onnxruntime"}
    assert len({r["device_id"] for r in outcomes.results}) == 16
