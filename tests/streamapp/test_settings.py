"""Settings: defaults, STREAMAPP_ environment variables, explicit overrides, validation errors
that name the field, and the derived topic and broker names."""

from __future__ import annotations

import os
from typing import Any

import pytest

from streamapp.exceptions import ConfigError
from streamapp.settings import load_settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No STREAMAPP_ variable from the machine running the tests leaks into them."""
    for name in list(os.environ):
        if name.upper().startswith("STREAMAPP_"):
            monkeypatch.delenv(name)


def test_defaults() -> None:
    settings = load_settings()

    assert settings.max_batch_size == 32
    assert settings.max_batch_delay_ms == 5.0
    assert settings.models == ("digits",)
    assert settings.request_topic == "inference-request"
    assert settings.bootstrap_servers == "127.0.0.1:9092"


def test_environment_overrides_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMAPP_MAX_BATCH_SIZE", "64")
    monkeypatch.setenv("STREAMAPP_MAX_BATCH_DELAY_MS", "2.5")
    monkeypatch.setenv("STREAMAPP_RESULT_CODEC", "msgpack")
    monkeypatch.setenv("STREAMAPP_BACKEND", "onnxruntime")

    settings = load_settings()

    assert settings.max_batch_size == 64
    assert settings.max_batch_delay_ms == 2.5
    assert settings.result_codec == "msgpack"
    assert settings.backend == "onnxruntime"


def test_variables_without_the_prefix_are_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAX_BATCH_SIZE", "64")

    assert load_settings().max_batch_size == 32


def test_explicit_overrides_beat_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMAPP_MAX_BATCH_SIZE", "64")
    monkeypatch.setenv("STREAMAPP_APP_ID", "from-env")

    settings = load_settings(max_batch_size=8)

    assert settings.max_batch_size == 8
    assert settings.app_id == "from-env"


def test_none_overrides_are_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMAPP_MAX_BATCH_SIZE", "64")

    settings = load_settings(max_batch_size=None, top_k=None, app_id="cli")

    assert settings.max_batch_size == 64  # from the environment, not replaced by None
    assert settings.top_k == 3  # the default
    assert settings.app_id == "cli"


@pytest.mark.parametrize(
    ("value", "models"),
    [("a,b", ("a", "b")), (" a , b ,", ("a", "b")), ("digits", ("digits",))],
)
def test_models_from_environment_are_comma_separated(
    monkeypatch: pytest.MonkeyPatch, value: str, models: tuple[str, ...]
) -> None:
    monkeypatch.setenv("STREAMAPP_MODELS", value)

    assert load_settings().models == models


def test_models_from_keyword_string() -> None:
    assert load_settings(models="a,b").models == ("a", "b")


def test_settings_are_frozen() -> None:
    settings = load_settings()

    with pytest.raises(ValueError, match="frozen"):
        settings.max_batch_size = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("env", "value", "field"),
    [
        ("STREAMAPP_MAX_BATCH_SIZE", "many", "max_batch_size"),
        ("STREAMAPP_MAX_BATCH_SIZE", "0", "max_batch_size"),
        ("STREAMAPP_MAX_BATCH_DELAY_MS", "-1", "max_batch_delay_ms"),
        ("STREAMAPP_RESULT_CODEC", "xml", "result_codec"),
        ("STREAMAPP_BACKEND", "tpu", "backend"),
        ("STREAMAPP_WEB_PORT", "70000", "web_port"),
        ("STREAMAPP_MAX_REQUEST_BYTES", "10", "max_request_bytes"),
        ("STREAMAPP_LOG_LEVEL", "verbose", "log_level"),
    ],
)
def test_invalid_environment_value_names_the_field(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str, field: str
) -> None:
    monkeypatch.setenv(env, value)

    with pytest.raises(ConfigError) as info:
        load_settings()

    assert f"{field}:" in str(info.value)
    assert "STREAMAPP_" in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"max_inflight_batches": 0}, "max_inflight_batches"),
        ({"top_k": 0}, "top_k"),
        ({"session_timeout_s": "soon"}, "session_timeout_s"),
        ({"no_such_setting": 1}, "no_such_setting"),
        ({"broker": "kafka://127.0.0.1:99999"}, "broker"),
        ({"broker": "kafka://127.0.0.1:0"}, "broker"),
        ({"broker": "kafka://127.0.0.1"}, "broker"),
        ({"broker": "kafka://127.0.0.1:9092;kafka://h2:port"}, "broker"),
    ],
)
def test_invalid_override_names_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(**overrides)

    assert f"{field}:" in str(info.value)


@pytest.mark.parametrize("heartbeat_s", [6.0, 10.0])
def test_heartbeat_not_below_session_timeout_is_rejected(heartbeat_s: float) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(heartbeat_interval_s=heartbeat_s, session_timeout_s=6.0)

    assert "heartbeat_interval_s" in str(info.value)
    assert "session_timeout_s" in str(info.value)


def test_heartbeat_from_environment_checked_against_session_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STREAMAPP_SESSION_TIMEOUT_S", "0.5")

    with pytest.raises(ConfigError, match="heartbeat_interval_s"):
        load_settings()
    assert load_settings(heartbeat_interval_s=0.25).session_timeout_s == 0.5


def test_empty_models_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMAPP_MODELS", " , ")

    with pytest.raises(ConfigError, match="models"):
        load_settings()


@pytest.mark.parametrize(("prefix", "expected"), [("", ""), ("prod.", "prod.")])
def test_topic_names_carry_the_prefix(
    monkeypatch: pytest.MonkeyPatch, prefix: str, expected: str
) -> None:
    monkeypatch.setenv("STREAMAPP_TOPIC_PREFIX", prefix)

    settings = load_settings()

    assert settings.request_topic == f"{expected}inference-request"
    assert settings.result_topic == f"{expected}inference-result"
    assert settings.dlq_topic == f"{expected}inference-dlq"
    assert settings.topic("retry") == f"{expected}inference-retry"


@pytest.mark.parametrize(
    "broker",
    [
        "kafka://k1:9092;kafka://k2:9093;kafka://10.0.0.3:9094",
        "k1:9092,k2:9093,10.0.0.3:9094",
        " kafka://k1:9092 ; k2:9093,kafka://10.0.0.3:9094 ;",
    ],
    ids=["faust-form", "plain-form", "mixed"],
)
def test_broker_conversions_for_several_brokers(broker: str) -> None:
    settings = load_settings(broker=broker)

    assert settings.bootstrap_servers == "k1:9092,k2:9093,10.0.0.3:9094"
    assert settings.faust_broker == "kafka://k1:9092;kafka://k2:9093;kafka://10.0.0.3:9094"


def test_single_broker_conversions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMAPP_BROKER", "kafka://localhost:19092")

    settings = load_settings()

    assert settings.bootstrap_servers == "localhost:19092"
    assert settings.faust_broker == "kafka://localhost:19092"


def test_uvloop_asked_for_but_missing_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    from streamapp.cli import use_event_loop
    from streamapp.exceptions import ConfigError

    real_import = builtins.__import__

    def no_uvloop(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "uvloop":
            raise ImportError("No module named 'uvloop'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_uvloop)
    with pytest.raises(ConfigError, match=r"pip install 'streamapp\[uvloop\]'"):
        use_event_loop("uvloop")
    use_event_loop("asyncio")  # the default needs nothing


def test_the_projects_own_kafka_variables_are_not_settings_and_not_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from typer.testing import CliRunner

    from streamapp.cli import cli

    monkeypatch.setenv("STREAMAPP_KAFKA_HOME", "/opt/kafka-jars")
    monkeypatch.setenv("STREAMAPP_KAFKA_JVM_OPTS", "-Xmx1G -XX:+UseG1GC")
    monkeypatch.setenv("STREAMAPP_MAX_BATCH_SIZE", "48")

    assert load_settings().max_batch_size == 48
    result = CliRunner().invoke(cli, ["settings"])
    assert result.exit_code == 0, result.output
    assert '"max_batch_size": 48' in result.output and "kafka_home" not in result.output


def test_a_misspelt_setting_in_the_environment_is_still_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STREAMAPP_KAFKA_HOME", "/opt/kafka-jars")
    monkeypatch.setenv("STREAMAPP_MAX_BATCH_SIZ", "48")

    with pytest.raises(ConfigError, match="unknown setting") as info:
        load_settings()

    assert "STREAMAPP_MAX_BATCH_SIZ (did you mean STREAMAPP_MAX_BATCH_SIZE?)" in str(info.value)
    assert "KAFKA_HOME" not in str(info.value)


def test_every_prefixed_variable_the_project_reads_is_a_setting_or_listed_as_other() -> None:
    """A ``"STREAMAPP_..."`` literal in the code is a setting's variable or one of
    ``OTHER_ENV``; otherwise a worker started where it is set would refuse to start."""
    import re
    from pathlib import Path

    from streamapp import kafka_server
    from streamapp.settings import ENV_PREFIX, OTHER_ENV, Settings

    root = Path(__file__).resolve().parents[2]
    names = set()
    for folder in ("streamapp", "engines", "bench", "scripts"):
        for path in (root / folder).rglob("*.py"):
            names.update(re.findall(r"""["'](STREAMAPP_[A-Z0-9_]+)["']""", path.read_text()))
    settings = {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields}

    assert names - settings == OTHER_ENV
    assert {kafka_server.HOME_ENV, kafka_server.JVM_OPTS_ENV} == OTHER_ENV
