"""Shared pytest fixtures for the whole test suite."""

from __future__ import annotations

from collections.abc import Iterator
from uuid import uuid4

import pytest

from engines import registry, testing
from streamapp.broker import EmbeddedBroker


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[EmbeddedBroker]:
    """One embedded Tansu broker for the whole session, on a free loopback port.

    Memory storage: topics and offsets live until the session ends. Tests sharing it must use
    their own topic and group names (see ``app_id``). Use it from tests marked ``kafka``.
    """
    with EmbeddedBroker() as broker:
        yield broker


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
