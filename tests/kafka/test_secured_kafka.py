"""A secured Apache Kafka (issue 21, item 2): SASL_SSL with SCRAM-SHA-512, a CA and broker
certificate made for the run, the StandardAuthorizer and the ACLs of :mod:`streamapp.acls`.

A worker with the right user, password and CA answers, dead-letters, retries and restores its
tables; a wrong password, an unknown CA, a host name the certificate does not hold and a user
without the ACLs of the result topic each end ``streamapp worker`` with one line and exit 1;
the publisher may write requests but not read results; no password reaches a log, an error
line, ``streamapp status`` or ``/metrics``.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import TopicAuthorizationFailedError
from typer.testing import CliRunner

from engines.registry import PLUGINS_ENV
from engines.testing import FAULTS_PLUGIN
from streamapp.acls import Operation, create_acls, publisher_acls, worker_acls
from streamapp.cli import cli
from streamapp.client import collect_outcomes, load_digits_frames, publish_values
from streamapp.codecs import encode_request
from streamapp.kafka import create_topics, run_sync
from streamapp.kafka_security import ADMIN_USER, BrokerSecurity, make_pki
from streamapp.kafka_server import KafkaBroker
from streamapp.partitions import TABLE_NAMES, changelog_topic
from streamapp.process import WorkerProcess
from streamapp.records import InferenceRequest, TensorPayload
from streamapp.settings import load_settings

pytestmark = [pytest.mark.kafka, pytest.mark.apache_kafka]

PASSWORDS = {"worker": "wOrker-pw-7f3a9c", "publisher": "pUblisher-pw-2b8d1e",
             "lacking": "lAcking-pw-5c6e0f", "nowrite": "nOwrite-pw-9a1b2c"}
APP = "secured"
FLAKY = 15.5  # first-pixel marker of the faulty backend (tests/integration/test_failures.py)


@pytest.fixture(scope="module")
def secured() -> Iterator[KafkaBroker]:
    """One secured broker for the module, with the topics of app ``secured`` (created by the
    admin) and the ACLs of a worker, a publisher and a worker lacking the result topic's."""
    security = BrokerSecurity(users=PASSWORDS)
    with KafkaBroker(security=security) as kafka:
        admin = security.client_options()
        settings = load_settings(app_id=APP, topic_partitions=4)
        topics = {t: 4 for t in settings.topics}
        changelogs = {changelog_topic(APP, t): 4 for t in TABLE_NAMES}
        create_topics(kafka.bootstrap_servers, {**topics, **changelogs}, security=admin,
                      configs={n: {"cleanup.policy": "compact"} for n in changelogs})
        lacking = [a for a in worker_acls(settings, "lacking")
                   if a.name != settings.result_topic]
        lacking += [a for a in worker_acls(settings, "nowrite")
                    if (a.name, a.operation) != (settings.result_topic, Operation.WRITE)]
        run_sync(lambda: create_acls(
            kafka.bootstrap_servers,
            worker_acls(settings, "worker") + publisher_acls(settings, "publisher") + lacking,
            security=admin))
        yield kafka


def _secrets(kafka: KafkaBroker) -> list[str]:
    assert kafka.security is not None
    return [*PASSWORDS.values(), kafka.security.admin_password]


def _env(kafka: KafkaBroker, user: str, **changes: Any) -> dict[str, str]:
    assert kafka.security is not None
    given = {"broker": kafka.url, "app_id": APP, "topic_partitions": 4,
             **kafka.security.client_settings(user), **changes}
    return {f"STREAMAPP_{k.upper()}": str(v) for k, v in given.items()}


def _security(kafka: KafkaBroker, user: str) -> dict[str, Any]:
    assert kafka.security is not None
    return kafka.security.client_options(user)


def _request(seq: int, device: str = "cam-s", first: float | None = None) -> tuple[bytes, bytes]:
    images, _ = load_digits_frames()
    pixels = images[seq % len(images)].astype(np.float32)
    if first is not None:
        pixels[0, 0] = first
    return device.encode(), encode_request(InferenceRequest(
        request_id=f"{device}-{seq}", device_id=device, seq=seq, ts=time.time(),
        model="digits", tensor=TensorPayload("float32", (8, 8), pixels.tobytes())), "json")


def _worker(kafka: KafkaBroker, tmp_path: Path, data: str = "data") -> WorkerProcess:
    settings = {k[len("STREAMAPP_"):].lower(): v for k, v in _env(kafka, "worker").items()}
    return WorkerProcess(
        {**settings, "broker_kind": "kafka", "backend": "faulty", "data_dir": tmp_path / data,
         "max_retries": 3, "retry_backoff_base_ms": 100, "retry_backoff_max_ms": 200,
         "max_batch_size": 8},
        log_path=tmp_path / "worker.log",
    )


@pytest.mark.slow
async def test_a_worker_with_the_right_credentials_answers_retries_dead_letters_and_restores(
    secured: KafkaBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ENGINES_FAULTS", json.dumps(
        [{"match_first_value": FLAKY / 16, "kind": "runtime", "times": 1, "count": "alone"}]))
    monkeypatch.setenv(PLUGINS_ENV, FAULTS_PLUGIN)
    settings = load_settings(app_id=APP)
    records = [_request(0), _request(1, first=FLAKY), (b"cam-s", b"{not json"), _request(3)]
    await publish_values(secured.bootstrap_servers, settings.request_topic, records,
                         security=_security(secured, "publisher"), partitions=None)

    with _worker(secured, tmp_path) as worker:
        worker.wait_ready(90)
        out = await collect_outcomes(
            secured.bootstrap_servers, settings.result_topic, settings.dlq_topic,
            done=lambda o: len(o.results) == 3 and len(o.dead_letters) == 1, timeout_s=60,
            security=_security(secured, ADMIN_USER))
        attempts = {r["request_id"]: r["attempt"] for r in out.results}
        assert attempts == {"cam-s-0": 0, "cam-s-1": 1, "cam-s-3": 0}
        (letter,) = out.dead_letters
        assert letter.error["reason"] == "invalid_json"
        device = _device_total(worker, 4)
        assert device["total"] == 4, device
        metrics = await asyncio.to_thread(_text, worker.web_url + "/metrics")
        shown = subprocess.run(
            [sys.executable, "-m", "streamapp", "status", worker.web_url, "--interval", "0.2"],
            capture_output=True, text=True, timeout=60, env=_plain_env(),
        ).stdout

    # the tables come back from the changelogs (SASL_SSL reads) into an empty data dir
    shutil.rmtree(tmp_path / "data")
    with _worker(secured, tmp_path) as worker:
        worker.wait_ready(90)
        device = _device_total(worker, 4)
        assert device["total"] == 4, device

    log = (tmp_path / "worker.log").read_text()
    broker_log = secured.log_path.read_text() if secured.log_path else ""
    assert "cam-s" in shown
    for secret in _secrets(secured):
        assert secret not in log and secret not in metrics and secret not in shown
        assert secret not in broker_log


def _device_total(worker: WorkerProcess, total: int, timeout_s: float = 20.0) -> Any:
    """``/devices/cam-s`` once its total is ``total`` (device state is flushed every
    ``state_flush_interval_ms``), or the last answer after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, device = worker.get("/devices/cam-s")
        if (status == 200 and device["total"] == total) or time.monotonic() > deadline:
            return device
        time.sleep(0.2)


def _text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def _plain_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("STREAMAPP_")}


def _other_ca(tmp_path: Path) -> Path:
    return make_pki(tmp_path / "other-ca", "127.0.0.1", ca_name="someone else's CA").ca


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ("wrong_password", "refused the login of user 'worker' with SCRAM-SHA-512: wrong user "
                           "name or password"),
        ("unknown_ca", "is not signed by a CA in ssl_cafile"),
        ("hostname", "does not name 'localhost'"),
        ("no_result_acl", "denied creating topics ['inference-result']"),
        ("no_result_write", "does not allow user 'nowrite' to WRITE topic 'inference-result'"),
    ],
)
def test_a_worker_that_cannot_get_in_says_why_in_one_line(
    secured: KafkaBroker, tmp_path: Path, runner: CliRunner, change: str, expected: str,
) -> None:
    user, changes = "worker", dict[str, Any]()
    if change == "wrong_password":
        changes = {"sasl_password": "not-the-password-1"}
    elif change == "unknown_ca":
        changes = {"ssl_cafile": _other_ca(tmp_path)}
    elif change == "hostname":
        changes = {"broker": f"kafka://localhost:{secured.port}"}
    elif change == "no_result_acl":
        user = "lacking"
    else:
        user = "nowrite"
    env = {**_env(secured, user, **changes), "STREAMAPP_DATA_DIR": str(tmp_path / "d")}

    started = time.monotonic()
    result = runner.invoke(cli, ["worker"], env=env)

    lines = result.output.strip().splitlines()
    assert result.exit_code == 1, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert expected in lines[0], lines[0]
    assert time.monotonic() - started < 30  # no retry loop
    for secret in [*_secrets(secured), "not-the-password-1"]:
        assert secret not in result.output


async def test_the_publisher_may_write_requests_but_not_read_results(
    secured: KafkaBroker, runner: CliRunner,
) -> None:
    settings = load_settings(app_id=APP)
    await publish_values(secured.bootstrap_servers, settings.request_topic, [_request(9)],
                         security=_security(secured, "publisher"), partitions=None)
    consumer = AIOKafkaConsumer(settings.result_topic, bootstrap_servers=secured.bootstrap_servers,
                                group_id=None, auto_offset_reset="earliest",
                                **_security(secured, "publisher"))
    with pytest.raises(TopicAuthorizationFailedError):
        try:
            await consumer.start()
            await consumer.getmany(timeout_ms=5000)
        finally:
            await consumer.stop()

    result = await asyncio.to_thread(
        runner.invoke, cli, ["results", "tail"], env=_env(secured, "publisher"))

    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert "denied user 'publisher' access to the topic" in lines[0], lines[0]
    assert PASSWORDS["publisher"] not in result.output


def test_secure_needs_apache_kafka(runner: CliRunner) -> None:
    result = runner.invoke(cli, ["broker", "--secure"])

    assert result.exit_code == 2
    assert "--secure needs --kafka" in result.output
