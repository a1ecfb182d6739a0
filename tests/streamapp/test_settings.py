"""Settings: defaults, STREAMAPP_ environment variables, explicit overrides, validation errors
that name the field, and the derived topic and broker names."""

from __future__ import annotations

import os
from typing import Any

import pytest

from streamapp.exceptions import ConfigError
from streamapp.settings import (
    BROKER_FORMS,
    TRANSACTION_TIMEOUT_MS,
    UPPER_BOUNDS,
    Settings,
    load_settings,
)


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


@pytest.mark.parametrize(
    "broker",
    ["http://host:9092", "https://host:9092", "tcp://127.0.0.1:9092", "SASL_SSL://host:9093",
     "kafka://k1:9092;http://k2:9092", "k1:9092,PLAINTEXT://k2:9092"],
)
@pytest.mark.parametrize("source", ["environment", "override"])
def test_a_broker_scheme_that_is_not_kafkas_is_refused_naming_the_accepted_forms(
    monkeypatch: pytest.MonkeyPatch, broker: str, source: str
) -> None:
    if source == "environment":
        monkeypatch.setenv("STREAMAPP_BROKER", broker)

    with pytest.raises(ConfigError) as info:
        load_settings(**({"broker": broker} if source == "override" else {}))

    message = str(info.value)
    bad = next(p for p in broker.replace(",", ";").split(";") if not p.startswith("kafka://")
               and "://" in p)
    scheme = bad.split("://")[0]
    assert message.count("\n") == 0
    assert f"broker: {bad!r} has the scheme {scheme}://, not Kafka's: give {BROKER_FORMS}" \
        in message
    if scheme in ("SASL_SSL", "PLAINTEXT"):
        assert f"STREAMAPP_SECURITY_PROTOCOL={scheme}" in message


@pytest.mark.parametrize("broker", ["kafka:/host:9092", "kafka://http://host:9092", "h:9092/"])
def test_a_malformed_broker_address_is_refused_naming_the_accepted_forms(broker: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(broker=broker)

    assert f"broker: {broker!r} is not host:port with a port of 1-65535: give {BROKER_FORMS}" \
        in str(info.value)


@pytest.mark.parametrize("broker", ["", ";", " , "])
def test_a_broker_list_that_names_no_server_is_refused(broker: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(broker=broker)

    assert f"broker: names no bootstrap server: give {BROKER_FORMS}, e.g. " \
        "kafka://127.0.0.1:9092" in str(info.value)


@pytest.mark.parametrize("broker", ["kafka://user:s3cretpw@k1:9092",
                                    "k0:9092;user:s3cretpw@k1:9092",
                                    "http://user:s3cretpw@k1:9092",
                                    "kafka://user:s3cretpw@k1:99999"])
def test_user_info_in_the_broker_is_refused_pointing_at_sasl_without_showing_it(
    monkeypatch: pytest.MonkeyPatch, broker: str
) -> None:
    monkeypatch.setenv("STREAMAPP_BROKER", broker)

    with pytest.raises(ConfigError) as info:
        load_settings()

    message = str(info.value)
    assert "broker: holds user info (user:password@ before a host)" in message
    assert "STREAMAPP_SASL_USERNAME and STREAMAPP_SASL_PASSWORD with " \
        "STREAMAPP_SECURITY_PROTOCOL=SASL_SSL" in message
    assert "s3cretpw" not in message and "s3cretpw" not in repr(info.value.__cause__)


@pytest.mark.parametrize("broker", ["127.0.0.1:\u0665\u0669\u0667\u0667\u0663",
                                    "kafka://h:\uff19\uff10\uff19\uff12", "h:9\u00b2"])
def test_a_broker_port_in_other_than_ascii_digits_is_refused(broker: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(broker=broker)

    assert f"broker: {broker!r} is not host:port with a port of 1-65535" in str(info.value)


@pytest.mark.parametrize("broker", ["kafka://k1:9092", "k1:9092", "KAFKA://k1:9092",
                                    "[::1]:9092"])
def test_kafka_scheme_and_plain_host_port_are_accepted(broker: str) -> None:
    settings = load_settings(broker=broker)

    assert settings.bootstrap_servers == broker.split("://")[-1]
    assert settings.faust_broker == f"kafka://{settings.bootstrap_servers}"


def _valid_with(name: str, value: float) -> dict[str, Any]:
    """``{name: value}`` plus what the cross-field checks need for it to be the only problem:
    a request timeout above the session timeout and the fetch wait."""
    return {name: value} if name == "request_timeout_s" else {
        name: value, "request_timeout_s": UPPER_BOUNDS["request_timeout_s"][0]}


@pytest.mark.parametrize("name", sorted(UPPER_BOUNDS))
def test_each_upper_bound_is_accepted_and_one_above_it_refused_with_why(name: str) -> None:
    bound, why = UPPER_BOUNDS[name]
    integer = Settings.model_fields[name].annotation is int
    above = int(bound) + 1 if integer else bound * 1.5

    at_bound = load_settings(**_valid_with(name, int(bound) if integer else bound))
    with pytest.raises(ConfigError) as info:
        load_settings(**_valid_with(name, above))

    assert getattr(at_bound, name) == bound
    assert f"{name}: must be at most {bound:,.0f}, not {above:,.0f}: {why}" in str(info.value)
    # what the setting's description (docs/settings.md, --help) says
    assert f"At most {bound:,.0f}: {why}." in (Settings.model_fields[name].description or "")


def test_a_huge_max_batch_size_from_the_environment_is_refused_with_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STREAMAPP_MAX_BATCH_SIZE", str(10**9))

    with pytest.raises(ConfigError) as info:
        load_settings()

    bound, why = UPPER_BOUNDS["max_batch_size"]
    assert f"max_batch_size: must be at most {bound:,.0f}, not {10**9:,}: {why}" \
        in str(info.value)


@pytest.mark.parametrize("name", ["max_batch_delay_ms", "commit_interval_ms", "max_clock_skew_s",
                                  "failure_quarantine_s", "gpu_server_wait_s"])
@pytest.mark.parametrize("value", ["inf", "nan"])
def test_float_settings_are_finite(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(f"STREAMAPP_{name.upper()}", value)

    with pytest.raises(ConfigError) as info:
        load_settings()

    assert f"{name}:" in str(info.value)


def test_a_fetch_wait_not_below_the_request_timeout_is_refused() -> None:
    load_settings(fetch_max_wait_ms=29_999, request_timeout_s=30)
    with pytest.raises(ConfigError) as info:
        load_settings(fetch_max_wait_ms=30_000, request_timeout_s=30)

    assert "fetch_max_wait_ms (30000.0) must be shorter than request_timeout_s (30.0 s)" \
        in str(info.value)


def test_exactly_once_commit_interval_is_at_most_half_the_transaction_timeout() -> None:
    most = TRANSACTION_TIMEOUT_MS / 2
    at_most = load_settings(processing_guarantee="exactly_once", commit_interval_ms=most)
    with pytest.raises(ConfigError) as info:
        load_settings(processing_guarantee="exactly_once", commit_interval_ms=most + 1)

    assert at_most.commit_interval_ms == most
    assert load_settings(commit_interval_ms=most + 1).commit_interval_ms == most + 1
    assert f"commit_interval_ms ({most + 1}) must be at most {most:,.0f} with " \
        "processing_guarantee=exactly_once" in str(info.value)


_DIGITS_30 = "1,000,000,000,000,000,000,000,000,000,0… (31 digits)"


@pytest.mark.parametrize(("name", "value", "shown"), [
    ("window_expires_s", 1e9, "1,000,000,000"), ("window_expires_s", 1e30, "1e+30"),
    ("max_request_bytes", 10**9, "1,000,000,000"), ("max_retries", 10**30, _DIGITS_30),
    ("metadata_refresh_interval_s", 1e30, "1e+30"), ("gpu_server_wait_s", 1e9, "1,000,000,000"),
    ("retry_backoff_base_ms", 1e30, "1e+30"), ("ready_stall_s", 1e9, "1,000,000,000"),
    ("failure_quarantine_s", 1e30, "1e+30"), ("max_produce_bytes", 10**9, "1,000,000,000"),
    ("topic_replication_factor", 10**9, "1,000,000,000"),
    ("image_decode_threads", 10**9, "1,000,000,000"),
    ("stream_buffer_maxsize", 10**30, _DIGITS_30), ("max_fetch_bytes", 10**9, "1,000,000,000"),
])
def test_values_of_the_new_user_trial_are_refused_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, name: str, value: float, shown: str
) -> None:
    monkeypatch.setenv(f"STREAMAPP_{name.upper()}", str(value))

    with pytest.raises(ConfigError) as info:
        load_settings()

    bound, why = UPPER_BOUNDS[name]
    assert f"{name}: must be at most {bound:,.0f}, not {shown}: {why}" in str(info.value)


@pytest.mark.parametrize(("name", "value", "shown"), [
    ("session_timeout_s", "1e30", "1e+30"),
    ("session_timeout_s", "1e308", "1e+308"),
    ("session_timeout_s", "2e15", "2e+15"),
    ("session_timeout_s", "2700.5", "2700.5"),
    ("session_timeout_s", "5000", "5,000"),
    ("max_retries", "9" * 60, "999,999,999,999,999,999,999,999,999,999… (60 digits)"),
    ("max_retries", "9" * 4000, "9,999,999,999,999,999,999,999,999,999,9… (4,000 digits)"),
])
def test_a_refused_value_is_echoed_compactly_whatever_its_size(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, shown: str
) -> None:
    # a huge float used to print its 31 or 309 rounded digits, a huge int the digits of its
    # float (wrong ones), and a 4,000-digit int crashed the check (OverflowError)
    monkeypatch.setenv(f"STREAMAPP_{name.upper()}", value)

    with pytest.raises(ConfigError) as info:
        load_settings()

    bound, why = UPPER_BOUNDS[name]
    said = f"{name}: must be at most {bound:,.0f}, not {shown}: {why}"
    assert said in str(info.value)
    assert len(str(info.value)) < len(said) + 100  # one short line, whatever the value


@pytest.mark.parametrize(("name", "value", "said"), [
    ("max_batch_size", "1e30", "max_batch_size: Input should be a valid integer, unable to "
     "parse string as an integer, got '1e30'"),
    ("max_batch_size", "nan", "got 'nan'"),
    ("max_batch_delay_ms", "5ms", "max_batch_delay_ms: Input should be a valid number, unable "
     "to parse string as a number, got '5ms'"),
    ("max_retries", "x" * 60, f"got '{'x' * 39}…'"),
    # below a minimum, a choice not offered: pydantic's message alone does not show the value
    ("max_batch_size", "-5", "max_batch_size: Input should be greater than or equal to 1, "
     "got '-5'"),
    ("log_level", "verbose", "log_level: Input should be 'debug', 'info', 'warning' or 'error', "
     "got 'verbose'"),
])
def test_a_value_that_does_not_parse_is_echoed(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, said: str
) -> None:
    monkeypatch.setenv(f"STREAMAPP_{name.upper()}", value)

    with pytest.raises(ConfigError) as info:
        load_settings()

    assert said in str(info.value)


def test_a_flag_below_its_minimum_is_echoed_as_a_number() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(max_batch_size=-5)

    assert "max_batch_size: Input should be greater than or equal to 1, got -5)" in str(
        info.value)


def test_an_int_too_long_to_print_is_refused_with_its_size() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(max_retries=10**5000)  # beyond sys.get_int_max_str_digits()

    assert "max_retries: must be at most 100, not a number of about 5,001 digits: " \
        in str(info.value)


def test_the_defaults_are_within_every_bound() -> None:
    settings = Settings()

    for name, (bound, _why) in UPPER_BOUNDS.items():
        assert getattr(settings, name) <= bound, name


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


def test_a_lowercase_setting_is_read_and_a_lowercase_misspelt_one_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The settings are read whatever the case of the variable's name, so a misspelt one in
    lower case is refused like an upper-case one, not ignored (re-trial, thirteenth
    session: ``streamapp_bogus=1`` was silently ignored)."""
    monkeypatch.setenv("streamapp_max_batch_size", "48")
    assert load_settings().max_batch_size == 48
    monkeypatch.setenv("streamapp_max_batch_siz", "48")
    with pytest.raises(ConfigError, match="unknown setting") as info:
        load_settings()
    assert "streamapp_max_batch_siz (did you mean STREAMAPP_MAX_BATCH_SIZE?)" in str(info.value)


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


@pytest.mark.parametrize("name", ["table_write_buffer_mib", "table_block_cache_mib"])
@pytest.mark.parametrize("value", ["1e-9", "0.0625", "0.06", "1"])
def test_a_table_memory_bound_below_64_kib_is_refused(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str,
) -> None:
    """RocksDB raises a write buffer below 64 KiB to 64 KiB, and a tiny block cache rounded
    to 0 bytes, without a word (new-user trials, twelfth session): such a value is refused,
    not changed behind the user's back."""
    monkeypatch.setenv(f"STREAMAPP_{name.upper()}", value)
    if float(value) >= 0.0625:
        assert getattr(load_settings(), name) == float(value)
        return
    with pytest.raises(ConfigError, match=rf"{name}: .*greater than or equal to 0\.0625"):
        load_settings()
