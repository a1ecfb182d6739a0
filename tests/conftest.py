"""Shared pytest fixtures for the whole test suite.

Brokers: tests that take ``kafka_broker`` run twice, on the embedded Tansu broker and on Apache
Kafka (single node, KRaft, ``streamapp.kafka_server``); each kind is started once per session.
``--broker=embedded`` or ``--broker=kafka`` keeps one side; ``-m "not apache_kafka"`` drops
everything that needs Apache Kafka (the Kafka side of ``kafka_broker`` and the Kafka-only
tests, which take ``apache_kafka`` or start their own cluster).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import ModuleType
from typing import Literal
from uuid import uuid4

import pytest
from typer.testing import CliRunner

from engines import registry, testing
from streamapp.broker import EmbeddedBroker
from streamapp.kafka_server import KafkaBroker

#: A session broker: the embedded Tansu broker or Apache Kafka (same interface for the tests).
Broker = EmbeddedBroker | KafkaBroker
BROKER_KINDS = ("embedded", "kafka")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--broker", choices=(*BROKER_KINDS, "both"), default="both",
        help="Which broker the broker-parametrized tests run on (default: both).",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With ``--broker=X``, deselect the other broker's side of parametrized tests and, for
    ``embedded``, the Apache-Kafka-only tests."""
    chosen = config.getoption("--broker")
    if chosen == "both":
        return
    keep, drop = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        kind = callspec.params.get("kafka_broker") if callspec is not None else None
        if kind is None and item.get_closest_marker("apache_kafka") is not None:
            kind = "kafka"
        (drop if kind is not None and kind != chosen else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def embedded_broker() -> Iterator[EmbeddedBroker]:
    """One embedded Tansu broker for the session (tests of Tansu's own behaviour take this)."""
    with EmbeddedBroker() as broker:
        yield broker


@pytest.fixture(scope="session")
def apache_kafka() -> Iterator[KafkaBroker]:
    """One single-node Apache Kafka for the session (temporary data dir; never restarted).

    The first use fetches the jars with Maven (``make kafka-jars`` does it ahead of time).
    Tests that stop or kill a broker start their own :class:`KafkaBroker` instead.
    """
    with KafkaBroker() as kafka:
        yield kafka


@pytest.fixture(
    scope="session",
    params=["embedded", pytest.param("kafka", marks=pytest.mark.apache_kafka)],
)
def kafka_broker(request: pytest.FixtureRequest) -> Broker:
    """The session broker of this side of the parametrization: Tansu, then Apache Kafka.

    Tests sharing it must use their own topic and group names (see ``app_id``). Use it from
    tests marked ``kafka``; ``broker_kind`` tells which side runs.
    """
    name = "embedded_broker" if request.param == "embedded" else "apache_kafka"
    broker: Broker = request.getfixturevalue(name)
    return broker


@pytest.fixture
def broker_kind(kafka_broker: Broker) -> Literal["embedded", "kafka"]:
    """``"embedded"`` or ``"kafka"``: which ``kafka_broker`` runs (the workers' ``broker_kind``)."""
    return "embedded" if isinstance(kafka_broker, EmbeddedBroker) else "kafka"


@pytest.fixture
def app_id() -> str:
    """A fresh id per test, for Faust app ids, consumer groups and topic names.

    Tansu fixes a group's session timeout at its first join for the broker's lifetime, so tests
    sharing the session broker must never share a group.
    """
    return f"test-{uuid4().hex[:10]}"


@pytest.fixture
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, registry.Backend]]:
    """A copy of the engine backend registry (built-ins loaded) that the test may change
    freely; the real one is back after the test."""
    registry.registered_backends()  # import the built-in backends into the real registry first
    copy = dict(registry._REGISTRY)
    monkeypatch.setattr(registry, "_REGISTRY", copy)
    yield copy


@pytest.fixture
def test_backends(isolated_registry: dict[str, registry.Backend]) -> dict[str, registry.Backend]:
    """The isolated registry with the test-only backends ``fake`` and ``faulty`` registered
    (:func:`engines.testing.register`), as only tests may do."""
    testing.register()
    return isolated_registry


@pytest.fixture
def trt_standins() -> Iterator[ModuleType]:
    """The in-repo TensorRT and CUDA stand-ins in place of the real ones (no real TensorRT is
    installable here: tests that take this say nothing about it); yields ``engines.cuda``, and
    fails the test if it left a CUDA object open."""
    from engines import cuda
    from engines.tensorrt._api import use_tensorrt
    from engines.testing import fake_cuda, fake_trt

    fake_cuda.reset()
    with cuda.use_runtime(fake_cuda), use_tensorrt(fake_trt):
        yield cuda
    assert cuda.live_handles() == {}, "the test leaked CUDA objects"
    fake_cuda.reset()


@pytest.fixture
def runner() -> Iterator[CliRunner]:
    """A CLI runner for ``streamapp.cli.cli`` with no ``STREAMAPP_*`` variable set, so that
    only the test's flags count (the variables are back after the test)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("STREAMAPP_")}
    for k in saved:
        del os.environ[k]
    yield CliRunner()
    os.environ.update(saved)
