"""Window sizes fixed for a deployment (issue 18, item 6): what the stored rows say, and the
one-line refusal. Integration: tests/integration/test_bad_rows.py::test_other_window_sizes*."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError

from streamapp.exceptions import ConfigError
from streamapp.settings import Settings
from streamapp.tables import stored_windows
from streamapp.tables.aggregates import DeviceDelta, update_stats
from streamapp.tables.stored_windows import (
    check_stored_windows,
    newest_stored_windows,
    window_changes,
)
from streamapp.tables.windows import WindowPlan

PLAN = WindowPlan(tumbling_ms=10_000, hopping_ms=60_000, step_ms=10_000, expires_ms=3_600_000)


def _row(device: str, last_seen: float, plan: WindowPlan = PLAN) -> bytes:
    row, _ = update_stats(None, DeviceDelta(device, last_ts=last_seen), plan, alpha=0.1,
                          now_s=last_seen)
    return json.dumps(row).encode()


def test_every_stats_row_records_its_window_sizes() -> None:
    row = json.loads(_row("cam1", 1_000.0))
    assert row["_windows"] == {"tumbling_ms": 10_000, "hopping_ms": 60_000, "step_ms": 10_000}


def test_the_newest_device_across_partitions_decides_and_unreadable_rows_do_not() -> None:
    other = WindowPlan(tumbling_ms=20_000, hopping_ms=60_000, step_ms=5_000,
                       expires_ms=3_600_000)
    tails = {
        0: [(3, b"old", _row("old", 1_000.0, other)), (4, b"", None), (5, b"bad", b"\xff")],
        1: [(8, b"new", _row("new", 2_000.0)),
            (9, b"legacy", json.dumps({"total": 1, "counts": {}, "last_seen": 3_000}).encode())],
    }
    stored = newest_stored_windows(tails)
    assert stored is not None
    assert (stored.device, stored.partition, stored.offset) == ("new", 1, 8)
    assert window_changes(stored, PLAN) == []
    assert window_changes(stored, other) == [("tumbling_window_s", 10.0, 20.0),
                                             ("hopping_step_s", 10.0, 5.0)]
    assert newest_stored_windows({0: [(1, b"legacy", b'{"total": 1, "counts": {}}')]}) is None


def _settings(**extra: Any) -> Settings:
    return Settings(app_id="win-test", broker="kafka://127.0.0.1:1", **extra)


@pytest.fixture
def stored_tail(monkeypatch: pytest.MonkeyPatch) -> dict[int, list[Any]]:
    tails: dict[int, list[Any]] = {2: [(41, b"device-02", _row("device-02", 1_000.0))]}

    async def read(bootstrap: str, topic: str, last: int, **kw: Any) -> dict[int, list[Any]]:
        assert topic == "win-test-device_stats-changelog"
        return tails

    monkeypatch.setattr(stored_windows, "read_partition_tails", read)
    return tails


def test_other_window_sizes_are_refused_in_one_line_that_says_what_to_do(
    stored_tail: dict[int, list[Any]],
) -> None:
    check_stored_windows(_settings())  # the same sizes: nothing to say
    check_stored_windows(_settings(hopping_window_s=120.0))  # may change
    with pytest.raises(ConfigError) as caught:
        check_stored_windows(_settings(tumbling_window_s=20.0))
    message = str(caught.value)
    assert "\n" not in message
    assert "STREAMAPP_TUMBLING_WINDOW_S is 20 here, 10 in the stored state" in message
    assert "Start with STREAMAPP_TUMBLING_WINDOW_S=10, or set STREAMAPP_ACCEPT_WINDOW_CHANGE=1" \
        in message
    assert "device 'device-02', win-test-device_stats-changelog partition 2 offset 41" in message
    assert "HOPPING_STEP_S" not in message


def test_an_accepted_change_is_a_warning_and_nothing_stored_is_nothing_to_check(
    stored_tail: dict[int, list[Any]],
) -> None:
    warning = check_stored_windows(_settings(hopping_step_s=5.0, accept_window_change=True))
    assert warning is not None
    assert "STREAMAPP_HOPPING_STEP_S is 5 here, 10 in the stored state" in warning
    assert check_stored_windows(_settings()) is None
    stored_tail.clear()  # a new deployment (no changelog yet)
    assert check_stored_windows(_settings(tumbling_window_s=20.0)) is None


def test_an_unreachable_broker_is_a_warning_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def read(*args: Any, **kw: Any) -> dict[int, list[Any]]:
        raise KafkaConnectionError("Unable to bootstrap from [('127.0.0.1', 1)]")

    monkeypatch.setattr(stored_windows, "read_partition_tails", read)
    warning = check_stored_windows(_settings(tumbling_window_s=20.0))
    assert warning is not None and "could not be read" in warning and "not checked" in warning
