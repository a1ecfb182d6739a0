"""docker-compose's Kafka runs what the tests run (issue 12, item 7)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from streamapp.kafka_server import KAFKA_VERSION, broker_properties
from streamapp.settings import Settings

COMPOSE = yaml.safe_load((Path(__file__).parents[1] / "docker-compose.yml").read_text())
KAFKA = COMPOSE["services"]["kafka"]


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    return {k: str(v) for k, v in env.items()}


def test_compose_kafka_sets_the_broker_settings_the_tests_run() -> None:
    env = _env(KAFKA)
    wanted = {
        "KAFKA_" + key.upper().replace(".", "_"): value
        for key, value in broker_properties(1, small_machine=False).items()
    }
    assert {k: env.get(k) for k in wanted} == wanted


def test_compose_kafka_is_the_release_the_tests_run() -> None:
    images = {name: s["image"] for name, s in COMPOSE["services"].items()
              if str(s.get("image", "")).startswith("apache/kafka:")}
    assert images and set(images.values()) == {f"apache/kafka:{KAFKA_VERSION}"}


def test_compose_kafka_keeps_its_logs_on_the_data_volume() -> None:
    mounts = {m.split(":")[1]: m.split(":")[0] for m in KAFKA["volumes"]}
    log_dirs = _env(KAFKA)["KAFKA_LOG_DIRS"]
    assert mounts.get(log_dirs) == "kafka-data", (log_dirs, mounts)


def test_the_host_reaches_compose_kafka_at_streamapps_default_broker() -> None:
    # commands run on the host (streamapp publish, results tail) need no --broker
    env = _env(KAFKA)
    listeners = dict(item.split("://") for item in env["KAFKA_LISTENERS"].split(","))
    advertised = dict(item.split("://") for item in env["KAFKA_ADVERTISED_LISTENERS"].split(","))
    protocols = dict(item.split(":") for item in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"]
                     .split(","))
    assert set(advertised) <= set(listeners) <= set(protocols)
    default = Settings().bootstrap_servers  # 127.0.0.1:9092
    (host_listener,) = [name for name, address in advertised.items() if address == default]
    container_port = listeners[host_listener].rsplit(":", 1)[1]
    host, port = default.rsplit(":", 1)
    assert f"{host}:{port}:{container_port}" in KAFKA["ports"]  # loopback only: no auth
    # the compose network keeps its own listener, which every streamapp service uses
    services = [s for s in COMPOSE["services"].values() if "STREAMAPP_BROKER" in _env(s)]
    assert services and {_env(s)["STREAMAPP_BROKER"] for s in services} == {
        f"kafka://{advertised['PLAINTEXT']}"}
    assert env["KAFKA_INTER_BROKER_LISTENER_NAME"] == "PLAINTEXT"
