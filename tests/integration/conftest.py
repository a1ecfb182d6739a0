"""Fixtures for tests that run a real worker against the session broker.

Every test here runs on both brokers (``kafka_broker`` is parametrized in tests/conftest.py):
the autouse fixture below tells the workers (and ``load_settings``) which kind they talk to.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from streamapp.kafka import create_topics
from streamapp.process import WorkerProcess
from streamapp.settings import Settings, load_settings
from tests.conftest import Broker


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str,
             seen: Callable[[], object] | None = None) -> None:
    """Poll ``condition`` every 0.2 s until it holds; fail naming ``what`` after ``timeout_s``
    (and what ``seen()`` returns then: the values the condition looked at)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    detail = f"; seen: {seen()!r}" if seen is not None else ""
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}{detail}")


@pytest.fixture(autouse=True)
def _broker_kind_env(broker_kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``STREAMAPP_BROKER_KIND`` for this test's workers (children inherit the environment)."""
    monkeypatch.setenv("STREAMAPP_BROKER_KIND", broker_kind)


@pytest.fixture
def worker_settings(kafka_broker: Broker, app_id: str) -> Settings:
    """Settings of a fresh worker: its own group and its own topics (prefix = app id)."""
    settings = load_settings(
        broker=kafka_broker.url, app_id=app_id, topic_prefix=f"{app_id}.", topic_partitions=4,
        backend="onnxruntime",
    )
    create_topics(
        kafka_broker.bootstrap_servers,
        {t: 4 for t in settings.topics},
    )
    return settings


@pytest.fixture
def worker_options() -> dict[str, Any]:
    """Extra settings of the ``worker`` fixture; override with
    ``@pytest.mark.parametrize("worker_options", [{...}])``."""
    return {}


@pytest.fixture
def worker(
    worker_settings: Settings, tmp_path: Path, worker_options: dict[str, Any]
) -> Iterator[WorkerProcess]:
    """One running, ready worker (stopped with SIGTERM after the test)."""
    s = worker_settings
    proc = WorkerProcess(
        {
            "broker": s.broker, "app_id": s.app_id, "topic_prefix": s.topic_prefix,
            "topic_partitions": s.topic_partitions, "backend": s.backend,
            "data_dir": tmp_path / "data", "max_batch_size": 16, "max_batch_delay_ms": 5,
            **worker_options,
        },
        log_path=tmp_path / "worker.log",
    )
    with proc:
        proc.wait_ready()
        yield proc
        assert proc.process is not None and proc.process.poll() is None, (
            f"the worker died during the test:\n{proc.log_tail()}"
        )
