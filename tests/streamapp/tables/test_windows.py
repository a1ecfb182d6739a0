"""Window and bucket arithmetic."""

from __future__ import annotations

import pytest

from streamapp.settings import Settings
from streamapp.tables.windows import WindowPlan

PLAN = WindowPlan(tumbling_ms=10_000, hopping_ms=60_000, step_ms=10_000, expires_ms=3_600_000)


def test_plan_from_default_settings() -> None:
    assert WindowPlan.from_settings(Settings()) == PLAN
    assert PLAN.bucket_sizes_ms == (10_000,)  # tumbling size == hop step: one series


def test_buckets_are_aligned_to_the_epoch() -> None:
    assert WindowPlan.bucket_start(1_000.0, 10_000) == 1_000_000
    assert WindowPlan.bucket_start(1_009.999, 10_000) == 1_000_000
    assert WindowPlan.bucket_start(1_010.0, 10_000) == 1_010_000
    plan = WindowPlan(tumbling_ms=15_000, hopping_ms=60_000, step_ms=10_000, expires_ms=600_000)
    assert plan.bucket_sizes_ms == (10_000, 15_000)
    assert plan.bucket_starts(1_014.0) == {10_000: 1_010_000, 15_000: 1_005_000}


def test_last_tumbling_windows_end_with_the_current_one() -> None:
    windows = PLAN.last_windows("tumbling", 3, now_s=1_025.0)
    assert [(w.start_ms, w.end_ms, w.buckets) for w in windows] == [
        (1_000_000, 1_010_000, (1_000_000,)),
        (1_010_000, 1_020_000, (1_010_000,)),
        (1_020_000, 1_030_000, (1_020_000,)),
    ]


def test_hopping_windows_are_made_of_step_buckets_and_hop_by_one_step() -> None:
    windows = PLAN.last_windows("hopping", 2, now_s=1_025.0)
    newest = windows[-1]
    assert (newest.start_ms, newest.end_ms) == (970_000, 1_030_000)  # the last minute up to now
    assert newest.buckets == tuple(range(970_000, 1_030_000, 10_000))
    assert (windows[0].start_ms, windows[0].end_ms) == (960_000, 1_020_000)
    assert newest.bucket_size_ms == 10_000


@pytest.mark.parametrize(
    ("start_ms", "now_s", "expired"),
    [(0, 3_609.999, False), (0, 3_610.0, True), (1_000_000, 4_000.0, False)],
)
def test_a_bucket_expires_once_it_ended_expires_ago(start_ms: int, now_s: float,
                                                    expired: bool) -> None:
    assert PLAN.expired(10_000, start_ms, now_s) is expired


def test_max_last_is_what_expiry_keeps() -> None:
    assert PLAN.max_last("tumbling") == 360
    assert PLAN.max_last("hopping") == 355  # (3600 - 60) / 10 + 1


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hopping_window_s": 45.0, "hopping_step_s": 10.0}, "whole multiple"),
        ({"window_expires_s": 30.0}, "at least the longest window"),
        ({"tumbling_window_s": 0.0005}, "whole number of milliseconds"),
    ],
)
def test_settings_reject_windows_that_cannot_be_served(changes: dict[str, float],
                                                       message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Settings(**changes)  # type: ignore[arg-type]
