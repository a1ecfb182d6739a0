"""``streamapp results tail`` pieces: the line format and the result check (unit), then on the
session broker records that are not results (one line each, never a crash) and bad options.
The command against a running worker is in tests/integration/test_results_tail.py."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import msgpack
import pytest
from aiokafka import AIOKafkaProducer
from typer.testing import CliRunner

from streamapp.cli import cli
from streamapp.kafka import create_topics
from streamapp.results import (
    RESULT_HEADER,
    ResultEntry,
    check_result,
    format_result_json,
    format_result_line,
)
from streamapp.settings import Settings, load_settings
from streamapp.tail import display_width
from tests.conftest import Broker


def result(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "request_id": "r-1", "device_id": "device-07", "seq": 1234, "model": "digits",
        "engine": "onnxruntime-1.32.0:1ec95d21",
        "outputs": {"top_k": [{"label": "7", "score": 0.98765}, {"label": "1", "score": 0.01}]},
        "attempt": 0, "queue_ms": 1.0, "infer_ms": 2.0, "e2e_ms": 12.345, "batch_id": "b",
        "batch_size": 16, "worker": "host:1", "ts": 1.8e9, "clock_skew_ms": None,
    }
    body.update(changes)
    return body


def entry(body: dict[str, Any] | None, problem: str | None = None,
          key: bytes | None = b"device-07") -> ResultEntry:
    return ResultEntry(body, problem, partition=2, offset=17, timestamp_ms=1_800_000_000_000,
                       key=key, size=321)


# -- the line -------------------------------------------------------------------------------------


def test_line_shows_device_seq_model_engine_label_score_latency() -> None:
    line = format_result_line(entry(result()))

    assert line.split() == ["device-07", "1234", "digits", "onnxruntime-1.32.0:1ec95d21", "7",
                            "0.988", "12.3"]
    assert len(line) <= 79


def test_lines_line_up_with_the_header() -> None:
    lines = [RESULT_HEADER, format_result_line(entry(result())),
             format_result_line(entry(result(device_id="d", seq=1, e2e_ms=123456.0)))]

    for name in ("SEQ", "SCORE", "E2E_MS"):  # right-aligned columns end under their names
        end = RESULT_HEADER.index(name) + len(name)
        assert all(line[end - 1] != " " for line in lines), (name, lines)
    for name in ("MODEL", "LABEL"):
        start = RESULT_HEADER.index(name)
        assert all(line[start] != " " and line[start - 1] == " " for line in lines[1:])


@pytest.mark.parametrize("device", ["摄像头大门左侧第二台", "tab\tdevice\nname", "カメラ-７"])
def test_wide_and_control_characters_keep_the_line_in_its_columns(device: str) -> None:
    plain = format_result_line(entry(result()))
    line = format_result_line(entry(result(device_id=device), key=device.encode()))

    assert "\t" not in line and "\n" not in line
    assert display_width(line) <= 79
    # the seq column ends where it ends for an ASCII device: columns, not characters, count
    seq_end = display_width(plain[: plain.index("1234") + 4])
    assert display_width(line[: line.index("1234") + 4]) == seq_end


def test_long_cells_are_cut_and_the_model_hash_is_kept() -> None:
    line = format_result_line(entry(result(
        device_id="a-very-long-device-identifier", model="resnet50-imagenet",
        engine="tensorrt-10.13.0:0123abcd", seq=10**9,
        outputs={"top_k": [{"label": "golden retriever", "score": 1.0}]}, e2e_ms=98765432.1,
    )))

    assert len(line) <= 79
    assert line.startswith("a-very-long…")
    assert " …000000 resnet50-imagenet tensor…:0123abcd " in line
    assert "golden …" in line
    assert line.endswith(" 98765s")


def test_named_tensor_outputs_show_dashes() -> None:
    line = format_result_line(entry(result(outputs={"logits": [0.1, 0.9]})))

    assert line.split()[-3:] == ["-", "-", "12.3"]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ([1, 2], "a list, not a result object"),
        (result(seq="3"), "'seq' is '3', not an integer"),
        (result(seq=True), "'seq' is True"),
        ({k: v for k, v in result().items() if k != "model"}, "no 'model' field"),
        (result(engine=5), "'engine' is a int, not a str"),
        (result(e2e_ms=None), "'e2e_ms' is None, not a number"),
        (result(outputs={"top_k": [{"label": "x"}]}), "'outputs.top_k' is not a list"),
    ],
)
def test_check_result_says_what_is_wrong(body: Any, says: str) -> None:
    with pytest.raises(ValueError, match=r"^" + re.escape(says)):
        check_result(body)


def test_invalid_record_is_one_clear_line() -> None:
    line = format_result_line(entry(None, "no 'model' field"))

    assert line == "2@17  not a result (key 'device-07', 321 B): no 'model' field"
    long = format_result_line(entry(None, "neither JSON nor msgpack " + "x" * 200, key=None))
    assert long.startswith("2@17  not a result (no key, 321 B): neither JSON")
    assert len(long) == 79 and long.endswith("…")


def test_json_lines_carry_the_result_and_its_position() -> None:
    lines = format_result_json([entry(result()), entry(None, "no 'model' field")])
    good, bad = (json.loads(line) for line in lines.splitlines())

    assert good == {**result(), "record": {"partition": 2, "offset": 17,
                                           "timestamp_ms": 1_800_000_000_000}}
    assert bad == {"invalid": "no 'model' field", "key": "device-07", "size": 321,
                   "record": {"partition": 2, "offset": 17, "timestamp_ms": 1_800_000_000_000}}


# -- the command on the broker --------------------------------------------------------------------


@pytest.fixture
def topics(kafka_broker: Broker, app_id: str) -> Settings:
    settings = load_settings(broker=kafka_broker.url, topic_prefix=f"{app_id}.")
    create_topics(kafka_broker.bootstrap_servers, {settings.result_topic: 1})
    return settings


@pytest.mark.kafka
async def test_records_that_are_not_results_get_a_line_each(
    topics: Settings, runner: CliRunner
) -> None:
    records = [
        (b"cam-1", json.dumps(result(device_id="cam-1", seq=0)).encode()),
        (b"cam-1", b"{this is not json"),
        (None, b""),
        (b"cam-2", json.dumps({"hello": "world"}).encode()),
        (b"cam-2", msgpack.packb(result(device_id="cam-2", seq=5), use_bin_type=True)),
    ]
    producer = AIOKafkaProducer(bootstrap_servers=topics.bootstrap_servers, acks="all")
    await producer.start()
    try:
        for key, value in records:
            await producer.send_and_wait(topics.result_topic, value, key=key)
    finally:
        await producer.stop()

    out = await asyncio.to_thread(
        runner.invoke, cli, ["results", "tail", "--broker", topics.broker,
                             "--topic-prefix", topics.topic_prefix]
    )

    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert lines[0] == RESULT_HEADER
    assert lines[1].split()[:2] == ["cam-1", "0"]
    assert lines[2].startswith("0@1  not a result (key 'cam-1', 17 B): neither JSON nor msgpack")
    assert lines[3].startswith("0@2  not a result (no key, 0 B): neither JSON nor msgpack")
    assert lines[4] == "0@3  not a result (key 'cam-2', 18 B): no 'request_id' field"
    assert lines[5].split()[:2] == ["cam-2", "5"]
    assert len(lines) == 6
    # read from the end: says how far back (a user read "38 records read" as the topic's size)
    assert (f"5 shown of 5 matching (all) in the last 50 records of each partition of "
            f"{topics.result_topic} (5 read; -n 0 reads the whole topic)") in out.stderr


def test_an_expired_or_superseded_request_shows_its_outcome_as_the_label() -> None:
    header = RESULT_HEADER.index("SCORE") + len("SCORE")
    for outcome in ("expired", "superseded"):  # superseded runs on into the score column
        line = format_result_line(entry(result(outputs={}, outcome=outcome)))
        assert line.split()[-3:] == [outcome, "-", "12.3"] and len(line) <= 79
        assert line.index(" -") + 2 == header  # the "-" under SCORE
    answered = format_result_line(entry(result(outcome="answered")))
    assert answered == format_result_line(entry(result()))
