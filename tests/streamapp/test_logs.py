"""The worker log's first block and the Faust INFO lines it leaves out (unit); the log of a real
worker is checked in tests/integration/test_worker_log.py."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from engines.base import EngineInfo
from streamapp.logs import PerKeyThrottle, QuietChangelogs, startup_block
from streamapp.models import ModelRepository
from streamapp.settings import load_settings


def record(name: str, message: str, level: int = logging.INFO, *args: object) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, message, args, None)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("faust.tables.table", "[^---Table: device_stats]: Starting..."),
        ("faust.stores.rocksdb", "[^----Store: rocksdb:device_stats]: Stopping..."),
        ("faust.stores.rocksdb", "opening partition 3 for gen id 0 app id 0"),
        ("faust.stores.rocksdb", "Closing rocksdb on stop"),
        ("faust.tables.recovery", "[^---Recovery]: Highwater for active changelog partitions:\n"
                                  "+Highwater - Active---+\n| t-changelog | 0 | -1 |"),
        ("faust.transport.drivers.aiokafka", "[^--Producer]: Creating topic 'a-x-changelog'"),
        ("faust.transport.drivers.aiokafka", "[^--Producer]: Topic 'a-x-changelog' created."),
    ],
)
def test_per_changelog_info_lines_are_dropped(name: str, message: str) -> None:
    assert QuietChangelogs().filter(record(name, message)) is False


@pytest.mark.parametrize(
    ("name", "message", "level"),
    [
        ("faust.tables.recovery", "[^---Recovery]: Highwater for active changelog partitions:\n"
                                  "+---+", logging.WARNING),
        ("faust.tables.recovery", "[^---Recovery]: Still fetching changelog topics for "
                                  "recovery, estimated time remaining 3 minutes", logging.INFO),
        ("faust.worker", "[^Worker]: Ready", logging.INFO),
        ("faust.transport.drivers.aiokafka",
         "[^--Producer]: Creating topic 'a-__assignor-__leader'", logging.INFO),
        ("streamapp.pipeline", "model digits: JPEG frames decoded on the CPU", logging.INFO),
    ],
)
def test_other_lines_pass(name: str, message: str, level: int) -> None:
    assert QuietChangelogs().filter(record(name, message, level)) is True


def test_startup_block_says_where_the_worker_is(tmp_path: Path) -> None:
    settings = load_settings(broker="kafka://10.0.0.5:9092", app_id="cams", topic_prefix="prod.",
                             web_port=6070, web_bind="0.0.0.0", web_host="gpu-3",
                             data_dir=tmp_path, backend="auto", topic_partitions=12)
    info = EngineInfo(backend="onnxruntime", model_path="m.onnx", model_sha256="1ec95d21" * 8,
                      version="1.32.0", device="cpu", precision="fp32", max_batch_size=64)
    block = startup_block(settings, {"digits": SimpleNamespace(info=info, version="2")})

    assert block.splitlines() == [
        "streamapp worker of group 'cams' (12 partitions per topic)",
        "  web      http://gpu-3:6070 (bound to 0.0.0.0; /ready, /metrics, /devices/{id})",
        f"  broker   kafka://10.0.0.5:9092 ({settings.broker_kind})",
        "  reads    prod.inference-request, prod.inference-retry (intake direct; batches of 32 "
        "or 5 ms)",
        "  writes   prod.inference-result, prod.inference-dlq",
        "  delivery at_least_once (processing_guarantee; docs/delivery.md)",
        "  models   digits v2 onnxruntime-1.32.0:1ec95d21 (cpu, fp32, max batch 64)",
        "  backend  auto (onnxruntime)",
        f"  data dir {tmp_path}",
    ]


def test_startup_block_shows_each_models_queue_policy_and_the_guarantee(tmp_path: Path) -> None:
    settings = load_settings(data_dir=tmp_path, processing_guarantee="exactly_once")
    info = EngineInfo(backend="onnxruntime", model_path="m.onnx", model_sha256="1ec95d21" * 8,
                      version="1.32.0", device="cpu", precision="fp32", max_batch_size=64)
    digits = ModelRepository().get("digits")
    policed = dataclasses.replace(digits, name="cams", max_age_ms=200.0, latest_frame=True)
    models = {"cams": SimpleNamespace(info=info, version="1", config=policed),
              "digits": SimpleNamespace(info=info, version="1", config=digits)}
    lines = startup_block(settings, models).splitlines()

    assert "  delivery exactly_once (processing_guarantee; docs/delivery.md)" in lines
    at = lines.index("  models   cams v1 onnxruntime-1.32.0:1ec95d21 (cpu, fp32, max batch 64)")
    assert lines[at + 1:at + 3] == [
        "           queue policy: max age 200 ms, latest frame",
        "           digits v1 onnxruntime-1.32.0:1ec95d21 (cpu, fp32, max batch 64)",
    ]  # the bundled digits has no queue policy: no line


def test_startup_block_of_a_shared_executor_worker_names_the_server(tmp_path: Path) -> None:
    # a new-user trial read "backend auto (onnxruntime)" as the worker running its own engine
    socket = str(tmp_path / "gpu.sock")
    settings = load_settings(data_dir=tmp_path, backend="auto", gpu_executor="shared",
                             gpu_server_socket=socket)
    info = EngineInfo(backend="onnxruntime", model_path="m.onnx", model_sha256="1ec95d21" * 8,
                      version="1.32.0", device="cpu", precision="fp32", max_batch_size=64)
    lines = startup_block(settings, {"digits": SimpleNamespace(info=info)}).splitlines()

    assert f"  backend  auto (onnxruntime), in the shared executor server at {socket}" in lines


def test_a_flood_of_one_kind_of_line_is_cut_to_a_few_and_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    throttle = PerKeyThrottle(per_window=3, window_s=60.0, clock=lambda: now[0])
    logger = logging.getLogger("test.throttle")
    with caplog.at_level(logging.WARNING, logger="test.throttle"):
        allowed = [throttle.allow("out_of_range", logger, "dead letters") for _ in range(10)]
        other = throttle.allow("bad_shape", logger, "dead letters")
        throttle.expire(logger, "dead letters")
        assert caplog.messages == []  # the count waits for the window's end
        now[0] += 60.0
        again = throttle.allow("out_of_range", logger, "dead letters")
        assert caplog.messages == [
            "dead letters out_of_range: 7 more in 60 s not logged one by one (at most 3 a "
            "window)"]
        assert allowed == [True] * 3 + [False] * 7 and other and again
        caplog.clear()
        for _ in range(5):
            throttle.allow("bad_shape", logger, "dead letters")  # a new window: 3, 2 left out
        throttle.expire(logger, "dead letters")
        assert caplog.messages == []
        now[0] += 60.0
        throttle.expire(logger, "dead letters")  # no new line needed: the flush loop's call
        assert caplog.messages == [
            "dead letters bad_shape: 2 more in 60 s not logged one by one (at most 3 a window)"]
        caplog.clear()
        for _ in range(4):
            throttle.allow("bad_dtype", logger, "dead letters")
        throttle.flush(logger, "dead letters")  # at stop, whatever the window
    assert caplog.messages == [
        "dead letters bad_dtype: 1 more in 60 s not logged one by one (at most 3 a window)"]
