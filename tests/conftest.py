"""Shared pytest fixtures for the whole test suite."""

from __future__ import annotations

from collections.abc import Iterator
from uuid import uuid4

import pytest

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
