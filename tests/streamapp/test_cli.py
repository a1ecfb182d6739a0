"""What a person reads from the ``streamapp`` command line: help, and one-line errors (issue 19,
item 6)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka.errors import IncompatibleBrokerVersion, KafkaConnectionError, RequestTimedOutError
from typer.testing import CliRunner

from streamapp.cli import cli
from streamapp.exceptions import BrokerError
from streamapp.kafka import describe_error
from streamapp.settings import BROKER_FORMS, UPPER_BOUNDS, Settings

COMMANDS = [["broker"], ["worker"], ["publish"], ["demo"], ["settings"], ["status"],
            ["dlq", "tail"], ["dlq", "replay"], ["results", "tail"]]


def _help(runner: CliRunner, command: list[str]) -> str:
    result = runner.invoke(cli, [*command, "--help"], env={"COLUMNS": "80"},
                           prog_name="streamapp")
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_fits_80_columns_without_type_tags_on_flags_or_markup(
    runner: CliRunner, command: list[str]
) -> None:
    text = _help(runner, command)

    assert "<bool>" not in text and "``" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    assert re.search(r"^  --help\s+Show this message and exit\.$", text, re.M)


@pytest.mark.parametrize(
    "name",
    ["broker", "app_id", "backend", "models", "max_batch_size", "max_batch_delay_ms",
     "max_inflight_batches", "topic_prefix", "topic_partitions", "web_port", "web_bind",
     "data_dir", "log_level"],
)
def test_worker_help_gives_each_setting_its_description_variable_and_default(
    runner: CliRunner, name: str
) -> None:
    text = " ".join(_help(runner, ["worker"]).split())  # unwrapped
    field = Settings.model_fields[name]
    default = field.default
    shown = ",".join(default) if isinstance(default, tuple) else str(default) or "none"
    option = "--" + name.replace("_", "-")
    described = re.split(r" --[a-z-]+ <", text.split(option + " <", 1)[1])[0]  # to the next

    assert " ".join((field.description or "").replace("`", "").split()) in described
    assert f"Env STREAMAPP_{name.upper()}; default: {shown}." in described


@pytest.fixture
def served_port() -> Iterator[int]:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]


@pytest.mark.parametrize("kafka", [True, False], ids=["kafka", "embedded"])
def test_broker_on_a_served_port_fails_at_once_with_one_line(
    served_port: int, kafka: bool
) -> None:
    command = [sys.executable, "-m", "streamapp", "broker", "--port", str(served_port)]
    result = subprocess.run([*command, "--kafka"] if kafka else command, capture_output=True,
                            text=True, timeout=60)

    assert result.returncode == 1 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: Cannot start ")
    assert f"port {served_port} on 127.0.0.1 is already in use" in line
    assert "choose another --port" in line and "pass port=None" not in line


@pytest.mark.parametrize("command", [["dlq", "tail"], ["results", "tail"], ["publish"],
                                     ["tables", "rebuild"], ["worker"]], ids=" ".join)
def test_an_unreachable_broker_is_one_line_naming_no_type_twice(
    command: list[str], tmp_path: Path
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    # a subprocess: aiokafka's own "Unable connect" ERROR lines must not reach stderr either
    result = subprocess.run(
        [sys.executable, "-m", "streamapp", *command, "--broker", f"kafka://127.0.0.1:{closed}"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "STREAMAPP_BROKER_KIND": "kafka",
             "STREAMAPP_DATA_DIR": str(tmp_path / "data")},
    )

    assert result.returncode == 1 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line == (
        f"error: cannot talk to the broker at 127.0.0.1:{closed}: no broker answered "
        "(connection refused or timed out). Is it running (streamapp broker), and are --broker "
        "/ STREAMAPP_BROKER and the security settings right?")


BROKER_COMMANDS = [["worker"], ["publish"], ["dlq", "tail"], ["dlq", "replay", "-r", "x"],
                   ["results", "tail"], ["tables", "rebuild"]]


@pytest.mark.parametrize("command", BROKER_COMMANDS, ids=" ".join)
@pytest.mark.parametrize("source", ["flag", "environment"])
def test_a_broker_url_with_another_scheme_is_one_line_in_every_command(
    runner: CliRunner, command: list[str], source: str
) -> None:
    url = "http://host:9092"
    flag = ["--broker", url] if source == "flag" else []
    env = {"STREAMAPP_BROKER": url} if source == "environment" else {}

    result = runner.invoke(cli, [*command, *flag], env=env, prog_name="streamapp")

    assert result.exit_code == 1
    assert result.output.splitlines() == [
        f"error: invalid settings (broker: {url!r} has the scheme http://, not Kafka's: give "
        f"{BROKER_FORMS}); environment variables use the prefix STREAMAPP_"]


def test_worker_max_batch_size_beyond_its_bound_is_one_line_with_the_bound_and_why(
    runner: CliRunner,
) -> None:
    bound, why = UPPER_BOUNDS["max_batch_size"]

    result = runner.invoke(cli, ["worker", "--max-batch-size", str(10**9)],
                           prog_name="streamapp")

    assert result.exit_code == 1
    assert result.output.splitlines() == [
        f"error: invalid settings (max_batch_size: must be at most {bound:,.0f}, not "
        f"{10**9:,}: {why}); environment variables use the prefix STREAMAPP_"]


@pytest.mark.parametrize("port", ["99999", "0", "-5"])
@pytest.mark.parametrize("kafka", [True, False], ids=["kafka", "embedded"])
def test_broker_port_out_of_range_is_one_usage_line(
    runner: CliRunner, port: str, kafka: bool
) -> None:
    args = ["broker", "--port", port, *(["--kafka"] if kafka else [])]
    result = runner.invoke(cli, args, prog_name="streamapp")

    assert result.exit_code == 2
    assert result.output.splitlines() == [
        f"error: --port must be a TCP port, 1-65535, or leave it out for a free one; got {port}"]


def test_worker_web_port_out_of_range_is_one_usage_line(runner: CliRunner) -> None:
    result = runner.invoke(cli, ["worker", "--web-port", "99999"], prog_name="streamapp")

    assert result.exit_code == 2
    assert result.output.splitlines() == [
        "error: --web-port must be a TCP port, 1-65535, or 0 for a free port; got 99999"]


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "file"
    path.write_text("not a directory")
    return path


@pytest.mark.parametrize("below", [False, True], ids=["the-file", "below-it"])
def test_worker_data_dir_that_is_a_file_is_one_line(
    runner: CliRunner, a_file: Path, below: bool
) -> None:
    given = a_file / "sub" if below else a_file
    result = runner.invoke(
        cli, ["worker", "--data-dir", str(given), "--broker", "kafka://127.0.0.1:1"],
        env={"STREAMAPP_BROKER_KIND": "kafka"}, prog_name="streamapp",
    )

    assert result.exit_code == 1
    assert result.output.splitlines() == [
        f"error: data directory {given} cannot be created: a parent of it is a file; give "
        "--data-dir / STREAMAPP_DATA_DIR a directory path" if below else
        f"error: data directory {given} is a file, not a directory: give --data-dir / "
        "STREAMAPP_DATA_DIR a directory (it is created when missing)"]


def test_kafka_broker_data_dir_that_is_a_file_is_one_line(a_file: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "streamapp", "broker", "--kafka", "--data-dir", str(a_file)],
        capture_output=True, text=True, timeout=60)

    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"error: Cannot use the Kafka data directory {a_file}: it, or a parent of it, is a "
        "file; give --data-dir a directory (it is created when missing)."]


def test_demo_workdir_that_is_a_file_is_one_line(runner: CliRunner, a_file: Path) -> None:
    result = runner.invoke(cli, ["demo", "--workdir", str(a_file)], prog_name="streamapp")

    assert result.exit_code == 1
    assert result.output.splitlines() == [
        f"error: data directory {a_file} is a file, not a directory: give --workdir a "
        "directory (it is created when missing)"]


@pytest.mark.parametrize(("error", "line"), [
    (KafkaConnectionError("KafkaConnectionError: Unable to bootstrap from [...]"),
     "KafkaConnectionError: Unable to bootstrap from [...]"),
    (IncompatibleBrokerVersion("IncompatibleBrokerVersion: Kafka broker does not support the "
                               "'CreatePartitionsRequest_v0' Kafka protocol."),
     "IncompatibleBrokerVersion: Kafka broker does not support the "
     "'CreatePartitionsRequest_v0' Kafka protocol."),
    (RequestTimedOutError("RequestTimedOutError: no answer in 40 s"),
     "RequestTimedOutError: no answer in 40 s"),
    (RequestTimedOutError(), "RequestTimedOutError"),
])
def test_a_client_error_is_quoted_with_its_type_once(error: Exception, line: str) -> None:
    assert describe_error(error) == line


def test_tables_rebuild_on_a_broker_that_cannot_add_partitions_names_the_type_once(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    from streamapp import kafka

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise IncompatibleBrokerVersion(
            "IncompatibleBrokerVersion: Kafka broker does not support it")

    monkeypatch.setattr(kafka, "with_admin", refuse)
    settings = Settings(broker="kafka://127.0.0.1:9092")

    with pytest.raises(BrokerError) as raised:
        kafka.add_partitions(settings, {"inference-request": 8})

    assert str(raised.value) == (
        "cannot add partitions to ['inference-request'] on 127.0.0.1:9092: "
        "IncompatibleBrokerVersion: Kafka broker does not support it (the embedded broker "
        "cannot add partitions; Apache Kafka can)")


def test_tables_rebuild_refuses_more_partitions_than_settings_allow_before_asking_the_broker(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    from streamapp import rebuild
    from streamapp.settings import MAX_TOPIC_PARTITIONS

    asked: list[object] = []
    monkeypatch.setattr(rebuild, "cluster_facts", lambda settings: asked.append(settings))
    monkeypatch.setattr(rebuild, "add_partitions", lambda *args: asked.append(args))
    result = runner.invoke(cli, ["tables", "rebuild", "-b", "kafka://127.0.0.1:9092",
                                 "--partitions", str(MAX_TOPIC_PARTITIONS + 1)],
                           prog_name="streamapp")

    assert result.exit_code == 1 and asked == []
    assert result.output.splitlines() == [
        "error: --partitions 1,025 is above 1,024, the most STREAMAPP_TOPIC_PARTITIONS allows "
        "(the workers could not start with it, and Kafka cannot remove partitions again); give "
        "at most 1,024"]
    assert UPPER_BOUNDS["topic_partitions"][0] == MAX_TOPIC_PARTITIONS


def test_tables_rebuild_of_an_app_without_changelogs_refuses_with_one_line(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    from streamapp import rebuild
    from streamapp.kafka import ClusterFacts

    grown: list[object] = []
    facts = ClusterFacts("c", {"inference-request": 4, "inference-retry": 4,
                               "streamapp-device_stats-changelog": 4})
    monkeypatch.setattr(rebuild, "cluster_facts", lambda _settings: facts)
    monkeypatch.setattr(rebuild, "add_partitions", lambda *args: grown.append(args))
    result = runner.invoke(cli, ["tables", "rebuild", "-b", "kafka://127.0.0.1:9092",
                                 "--app-id", "nosuchapp"], prog_name="streamapp")

    assert result.exit_code == 1 and grown == []
    assert result.output.splitlines() == [
        "error: no changelog topic of app 'nosuchapp' exists on 127.0.0.1:9092 (looked for "
        "nosuchapp-device_stats-changelog, nosuchapp-device_windows-changelog, "
        "nosuchapp-retry_counts-changelog): nothing to rebuild; check --app-id (the workers' "
        "STREAMAPP_APP_ID) and --broker"]


# -- streamapp models --url ---------------------------------------------------------------------

MODELS_COMMANDS = [["models"], ["models", "load", "digits"]]
URL_USAGE = "error: --url must be an http:// or https:// URL such as http://localhost:6066"


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("command", MODELS_COMMANDS, ids=" ".join)
def test_a_worker_that_does_not_answer_is_one_line(
    runner: CliRunner, closed_port: int, command: list[str]
) -> None:
    result = runner.invoke(cli, [*command, "--url", f"http://127.0.0.1:{closed_port}"],
                           prog_name="streamapp")

    assert result.exit_code == 1
    (line,) = result.output.splitlines()
    assert line.startswith(f"error: the worker at http://127.0.0.1:{closed_port} did not "
                           "answer (")
    assert line.endswith("); is it running? give its web URL with --url")


@pytest.mark.parametrize("command", MODELS_COMMANDS, ids=" ".join)
@pytest.mark.parametrize(("url", "line"), [
    # urllib took user:pw@host for the host name: a traceback (no port) or a false "did not
    # answer" (new-user trial, ninth session)
    ("http://user:s3cretpw@127.0.0.1", "error: --url must not carry a user name or password "
     "(got 'http://***@127.0.0.1'): the worker takes its web token from STREAMAPP_WEB_TOKEN "
     "(or STREAMAPP_WEB_TOKEN_FILE) set here"),
    ("https://u:s3cretpw@host:6066/w?token=s3cret", "error: --url must not carry a user name "
     "or password (got 'https://***@host:6066/w'): the worker takes its web token from "
     "STREAMAPP_WEB_TOKEN (or STREAMAPP_WEB_TOKEN_FILE) set here"),
    # the query swallowed the /models appended to it: GET /?token=s3cret/models answered 200
    # with nothing listed, exit 0
    ("http://127.0.0.1:6066/?token=s3cret", "error: --url must be the worker's base URL, "
     "without a query or fragment, such as http://localhost:6066 (got "
     "'http://127.0.0.1:6066/?…'); the web token goes in STREAMAPP_WEB_TOKEN"),
    ("http://127.0.0.1:6066#frag", "error: --url must be the worker's base URL, without a "
     "query or fragment, such as http://localhost:6066 (got 'http://127.0.0.1:6066#…'); the "
     "web token goes in STREAMAPP_WEB_TOKEN"),
    ("http://127.0.0.1:6066?", "error: --url must be the worker's base URL, without a query "
     "or fragment, such as http://localhost:6066 (got 'http://127.0.0.1:6066?…'); the web "
     "token goes in STREAMAPP_WEB_TOKEN"),
], ids=["user-info", "user-info-and-query", "query", "fragment", "bare-question-mark"])
def test_a_url_with_user_info_or_a_query_is_one_usage_line_without_its_secrets(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch, command: list[str], url: str,
    line: str,
) -> None:
    from streamapp.models import commands

    asked: list[object] = []
    monkeypatch.setattr(commands, "request_json", lambda *args, **kwargs: asked.append(args))
    result = runner.invoke(cli, [*command, "--url", url], prog_name="streamapp")

    assert (result.exit_code, asked) == (2, [])
    assert result.output.splitlines() == [line]
    assert "s3cret" not in result.output


def test_an_url_error_raised_by_http_client_is_one_line(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    from http.client import InvalidURL

    from streamapp.models import commands

    def refuse(url: str, *args: object, **kwargs: object) -> None:
        raise InvalidURL("nonnumeric port: 'x'")

    monkeypatch.setattr(commands, "request_json", refuse)
    result = runner.invoke(cli, ["models", "--url", "http://host:6066"], prog_name="streamapp")

    assert result.exit_code == 1
    assert result.output.splitlines() == [
        "error: the worker at http://host:6066 did not answer (nonnumeric port: 'x'); is it "
        "running? give its web URL with --url"]


@pytest.mark.parametrize(("status", "said"), [
    (401, "answered 401 (unauthorized): no web token; set STREAMAPP_WEB_TOKEN"),
    (500, "answered 500: boom"),
])
def test_a_worker_answer_names_the_url(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch, status: int, said: str
) -> None:
    from streamapp.models import commands

    monkeypatch.setattr(commands, "request_json",
                        lambda *args, **kwargs: (status, {"message": "boom"} if status == 500
                                                 else None))
    result = runner.invoke(cli, ["models", "--url", "http://host:6066"], prog_name="streamapp")

    assert result.exit_code == 1
    (line,) = result.output.splitlines()
    assert line.startswith(f"error: http://host:6066 {said}")


@pytest.mark.parametrize("command", MODELS_COMMANDS, ids=" ".join)
@pytest.mark.parametrize(("url", "got"), [
    ("", "; got ''"),
    ("localhost:6066", "; got 'localhost:6066'"),
    ("ftp://x", "; got 'ftp://x'"),
    ("http://", "; got 'http://'"),
    ("http://localhost:99999", "; got 'http://localhost:99999'"),
    ("user:pw@host:6066?token=s3cret", "; got '***@host:6066'"),
    ("ftp://user:pw@host/?token=s3cret", "; got 'ftp://***@host/'"),
    ("http://[::1", ""),  # not parseable: none of it is echoed
], ids=["empty", "no-scheme", "ftp", "no-host", "bad-port", "no-scheme-user-info",
        "ftp-user-info", "unparseable"])
def test_a_url_that_is_not_http_is_one_usage_line_before_any_request(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch, command: list[str], url: str, got: str
) -> None:
    from streamapp.models import commands

    asked: list[object] = []
    monkeypatch.setattr(commands, "request_json", lambda *args, **kwargs: asked.append(args))
    result = runner.invoke(cli, [*command, "--url", url], prog_name="streamapp")

    assert (result.exit_code, asked) == (2, [])
    assert result.output.splitlines() == [URL_USAGE + got]


def test_a_refused_load_says_each_workers_reason_once() -> None:
    from streamapp.models.commands import format_load

    why = "version 1 of digits is refused: it accepts other requests than version 2 (serving)"
    body = {"error": "incompatible_version", "model": "digits", "version": "1",
            "message": f"version 1 of digits is refused by 1 of 2 worker(s), the old version "
                       f"keeps serving; w1: {why}",
            "workers": [{"worker": "w1", "status": "refused", "reason": "incompatible_version",
                         "message": why},
                        {"worker": "w2", "status": "prepared",
                         "engine": "onnxruntime", "samples_checked": 3}]}

    lines = format_load(409, body)

    assert lines == [
        "refused (incompatible_version, HTTP 409): version 1 of digits is refused by 1 of 2 "
        "worker(s), the old version keeps serving",
        f"  w1: refused incompatible_version: {why}",
        "  w2: prepared (onnxruntime, 3 sample(s) checked)"]
    assert sum(line.count(why) for line in lines) == 1


def test_the_models_groups_url_is_the_loads_and_is_checked_too(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    from streamapp.models import commands

    asked: list[tuple[str, str]] = []

    def answer(url: str, method: str = "GET", **kwargs: object) -> tuple[int, object]:
        asked.append((url, method))
        return 200, {"model": "digits", "version": "2", "workers": []}

    monkeypatch.setattr(commands, "request_json", answer)
    result = runner.invoke(cli, ["models", "--url", "http://w2:6067", "load", "digits",
                                 "--version", "2"], prog_name="streamapp")
    assert result.exit_code == 0, result.output
    assert [(u.split("?")[0], m) for u, m in asked] == [
        ("http://w2:6067/models/digits/load", "POST")]

    refused = runner.invoke(cli, ["models", "--url", "http://u:s3cret@w2:6067", "load",
                                  "digits"], prog_name="streamapp")
    assert refused.exit_code == 2 and "s3cret" not in refused.output
    assert len(asked) == 1


def test_a_listing_waits_list_timeout_s_not_a_loads_time(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    from streamapp.models import commands

    waits: list[object] = []

    def answer(url: str, method: str = "GET", **kwargs: object) -> tuple[int, object]:
        waits.append(kwargs.get("timeout_s"))
        return 200, {"workers": []}

    monkeypatch.setattr(commands, "request_json", answer)
    result = runner.invoke(cli, ["models", "--url", "http://w2:6067"], prog_name="streamapp")

    assert result.exit_code == 0, result.output
    assert waits == [commands.LIST_TIMEOUT_S] and commands.LIST_TIMEOUT_S < 60


@pytest.mark.parametrize(("error", "line"), [
    (json.JSONDecodeError("Expecting value", "<html>", 0),
     "error: http://host:6066 answered, but not with JSON (Expecting value: line 1 column 1 "
     "(char 0)); is it a streamapp worker's web port (STREAMAPP_WEB_PORT)?"),
    (ConnectionResetError("garbage\nmore"),
     "error: the worker at http://host:6066 did not answer (garbage more); is it running? "
     "give its web URL with --url"),
], ids=["not-json", "two-lines"])
def test_an_answer_that_is_not_a_workers_is_one_line_that_says_so(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch, error: Exception, line: str
) -> None:
    from streamapp.models import commands

    def fail(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(commands, "request_json", fail)
    result = runner.invoke(cli, ["models", "--url", "http://host:6066"], prog_name="streamapp")

    assert result.exit_code == 1
    assert result.output.splitlines() == [line]


def test_an_empty_version_is_a_usage_line_not_the_highest(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    from streamapp.models import commands

    asked: list[object] = []
    monkeypatch.setattr(commands, "request_json", lambda *args, **kwargs: asked.append(args))
    result = runner.invoke(cli, ["models", "load", "digits", "--version", " "],
                           prog_name="streamapp")

    assert (result.exit_code, asked) == (2, [])
    assert result.output.splitlines() == [
        "error: --version must name a version, e.g. --version 2 (leave it out for the highest)"]
