"""Row formats and merging: what a batch of outcomes adds to a device."""

from __future__ import annotations

import json
from typing import Any

import pytest

from streamapp.agents.observer import Outcome
from streamapp.tables.aggregates import (
    DeviceDelta,
    merge_bucket,
    public_stats,
    render_window,
    update_stats,
)
from streamapp.tables.windows import WindowPlan

PLAN = WindowPlan(tumbling_ms=10_000, hopping_ms=60_000, step_ms=10_000, expires_ms=60_000)


def outcome(kind: str = "result", *, seq: int = 0, ts: float = 1_000.0, e2e: float | None = 10.0,
            label: str | None = "3", reason: str | None = None, **kw: Any) -> Outcome:
    result = kind == "result"
    return Outcome(
        kind=kind,  # type: ignore[arg-type]
        device_id="cam1", request_id=f"r{seq}", seq=seq, model="digits", reason=reason,
        label=label if result else None, score=0.9 if result else None,
        e2e_ms=e2e if result else None, queue_ms=1.0 if result else None,
        infer_ms=2.0 if result else None, attempt=kw.get("attempt", 0), ts=ts, partition=0,
    )


def delta_of(*outcomes: Outcome, plan: WindowPlan = PLAN) -> DeviceDelta:
    delta = DeviceDelta("cam1")
    for o in outcomes:
        delta.add(o, plan)
    return delta


def test_counts_reasons_and_last_values() -> None:
    delta = delta_of(
        outcome(seq=0), outcome("dead_letter", seq=1, reason="bad_shape"),
        outcome("retry", seq=2, reason="engine_oom"), outcome(seq=3, label="7"),
    )
    row, expired = update_stats(None, delta, PLAN, alpha=0.5, now_s=1_000.0)
    assert row["counts"] == {"result": 2, "dead_letter": 1, "retry": 1}
    assert row["total"] == 3  # a retry does not finish a request
    assert row["dead_letters_by_reason"] == {"bad_shape": 1}
    assert row["retries_by_reason"] == {"engine_oom": 1}
    assert row["last_seq"] == 3
    assert row["last_result"]["label"] == "7" and row["last_result"]["seq"] == 3
    assert (row["first_seen"], row["last_seen"]) == (1_000.0, 1_000.0)
    assert expired == []
    json.dumps(row)  # what the changelog stores


def test_a_second_delta_adds_to_the_stored_row() -> None:
    row, _ = update_stats(None, delta_of(outcome(seq=0, ts=1_000.0)), PLAN, alpha=0.5,
                          now_s=1_000.0)
    row, _ = update_stats(row, delta_of(outcome("dead_letter", seq=1, reason="bad_dtype",
                                                ts=1_001.0)),
                          PLAN, alpha=0.5, now_s=1_001.0)
    assert row["counts"] == {"result": 1, "dead_letter": 1, "retry": 0}
    assert row["last_seq"] == 1
    assert row["last_result"]["seq"] == 0  # the last *result* is still the first request
    assert (row["first_seen"], row["last_seen"]) == (1_000.0, 1_001.0)


def test_latency_ewma_is_seeded_with_the_first_value_and_weights_the_newest_by_alpha() -> None:
    row, _ = update_stats(None, delta_of(outcome(e2e=10.0), outcome(e2e=20.0)), PLAN,
                          alpha=0.25, now_s=1_000.0)
    assert row["latency_ewma_ms"]["e2e"] == pytest.approx(0.25 * 20 + 0.75 * 10)
    row, _ = update_stats(row, delta_of(outcome(e2e=40.0)), PLAN, alpha=0.25, now_s=1_000.0)
    assert row["latency_ewma_ms"]["e2e"] == pytest.approx(0.25 * 40 + 0.75 * 12.5)
    assert row["latency_ewma_ms"]["queue"] == pytest.approx(1.0)


def test_buckets_collect_counts_latency_and_labels() -> None:
    delta = delta_of(
        outcome(e2e=10.0, label="3", ts=1_000.0), outcome(e2e=30.0, label="3", ts=1_005.0),
        outcome("dead_letter", reason="bad_shape", ts=1_009.0), outcome(label="8", ts=1_011.0),
    )
    assert set(delta.buckets) == {(10_000, 1_000_000), (10_000, 1_010_000)}
    first = delta.buckets[(10_000, 1_000_000)]
    assert (first["count"], first["results"], first["dead_letters"]) == (3, 2, 1)
    assert (first["e2e_sum_ms"], first["e2e_n"], first["e2e_max_ms"]) == (40.0, 2, 30.0)
    assert first["labels"] == {"3": 2}


def test_merge_and_render_a_window() -> None:
    a = delta_of(outcome(e2e=10.0, label="1")).buckets[(10_000, 1_000_000)]
    b = delta_of(outcome(e2e=50.0, label="1"), outcome("retry", reason="timeout"),
                 outcome("dead_letter", reason="bad_shape")).buckets[(10_000, 1_000_000)]
    merged = merge_bucket(a, b)
    assert merge_bucket(None, merged) == merged
    (window,) = PLAN.last_windows("tumbling", 1, now_s=1_000.0)
    shown = render_window(window, [merged])
    assert shown == {
        "start": 1_000.0, "end": 1_010.0, "count": 3, "results": 2, "dead_letters": 1,
        "retries": 1, "skipped": 0, "e2e_mean_ms": 30.0, "e2e_max_ms": 50.0,
        "labels": {"1": 2},
    }
    empty = render_window(window, [None])
    assert (empty["count"], empty["e2e_mean_ms"], empty["labels"]) == (0, None, {})


def test_buckets_older_than_expiry_are_reported_for_deletion() -> None:
    row, _ = update_stats(None, delta_of(outcome(ts=1_000.0)), PLAN, alpha=0.1, now_s=1_000.0)
    assert row["_buckets"] == {"10000": [1_000_000]}
    row, expired = update_stats(row, delta_of(outcome(ts=1_075.0)), PLAN, alpha=0.1,
                                now_s=1_075.0)
    assert expired == [(10_000, 1_000_000)]  # ended at 1010 s, more than 60 s before 1075 s
    assert row["_buckets"] == {"10000": [1_070_000]}
    assert "_buckets" not in public_stats(row)


def test_a_negative_latency_from_an_old_row_is_reseeded_and_never_averaged() -> None:
    # a row written before e2e was measured from the record timestamp on a skewed clock
    old, _ = update_stats(None, delta_of(outcome(e2e=10.0)), PLAN, alpha=0.5, now_s=1_000.0)
    old["latency_ewma_ms"]["e2e"] = -10_066_519.0
    row, _ = update_stats(old, delta_of(outcome(seq=1, e2e=12.0)), PLAN, alpha=0.5,
                          now_s=1_000.0)
    assert row["latency_ewma_ms"]["e2e"] == 12.0  # seeded again, not -5,033,253
    bad = delta_of(outcome(seq=2, e2e=-82_799_881.0), outcome(seq=3, e2e=float("nan")),
                   outcome(seq=4, e2e=20.0))
    row, _ = update_stats(row, bad, PLAN, alpha=0.5, now_s=1_000.0)
    assert row["latency_ewma_ms"]["e2e"] == 16.0
    for bucket in bad.buckets.values():  # the tumbling and the hopping bucket
        assert (bucket["e2e_n"], bucket["e2e_sum_ms"], bucket["e2e_max_ms"]) == (1, 20.0, 20.0)
        assert bucket["results"] == 3


def test_skewed_clocks_are_counted_per_device() -> None:
    skewed = outcome(seq=1)
    skewed.clock_skew_ms, skewed.ts = 82_800_000.0, 1_001.0
    row, _ = update_stats(None, delta_of(outcome(), skewed), PLAN, alpha=0.5, now_s=1_001.0)
    assert row["clock_skew"] == {"count": 1, "last_ms": 82_800_000.0, "last_ts": 1_001.0}
    row, _ = update_stats(row, delta_of(outcome(seq=2)), PLAN, alpha=0.5, now_s=1_002.0)
    assert row["clock_skew"]["count"] == 1


def test_expired_and_superseded_requests_finish_and_count_apart_from_results() -> None:
    delta = delta_of(outcome(seq=0, label="7"), outcome("expired", seq=1),
                     outcome("superseded", seq=2), outcome("expired", seq=3))
    row, _ = update_stats(None, delta, PLAN, alpha=0.5, now_s=1_000.0)

    assert row["counts"] == {"result": 1, "dead_letter": 0, "retry": 0, "expired": 2,
                             "superseded": 1}
    assert row["total"] == 4 and row["last_seq"] == 3  # skipped requests are finished
    assert row["last_result"]["seq"] == 0  # but they are not results
    assert row["latency_ewma_ms"]["e2e"] == 10.0
    bucket = delta.buckets[(10_000, 1_000_000)]
    assert (bucket["count"], bucket["results"], bucket["skipped"]) == (4, 1, 3)
    assert bucket["labels"] == {"7": 1}
    # a device without skipped requests keeps the row it had before the queue policy
    plain, _ = update_stats(None, delta_of(outcome()), PLAN, alpha=0.5, now_s=1_000.0)
    assert plain["counts"] == {"result": 1, "dead_letter": 0, "retry": 0}
