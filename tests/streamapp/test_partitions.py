"""The tables' partition count at start, while starting and while running (issue 18, item 2),
and the data dir's marker (item 5), without a broker."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from streamapp.datadir import MARKER_NAME, DataDirMismatchError, check_data_dir
from streamapp.partitions import (
    PartitionCheck,
    TablePartitionsError,
    plan_partitions,
    wait_for_metadata,
)
from streamapp.settings import load_settings

SETTINGS = load_settings(app_id="g", broker="kafka://h:9092", topic_partitions=16)
REQUEST, RETRY = SETTINGS.request_topic, SETTINGS.retry_topic
STATS = "g-device_stats-changelog"


def test_with_no_topics_the_configured_count_is_used() -> None:
    plan = plan_partitions(SETTINGS, {})
    assert (plan.partitions, plan.notes) == (16, [])


def test_a_request_topic_that_exists_sizes_the_tables_and_says_the_setting_is_not_used() -> None:
    plan = plan_partitions(SETTINGS, {REQUEST: 4})
    assert plan.partitions == 4
    assert plan.notes == [
        "topic_partitions=16 is not used: inference-request already has 4 partitions, so the "
        "tables use 4; set STREAMAPP_TOPIC_PARTITIONS=4 (or --topic-partitions 4) to match the "
        "topics and silence this warning, e.g. after `streamapp tables rebuild` (to change the "
        "topics' count, see `streamapp tables rebuild` in docs/tables.md)"
    ]


def test_changelogs_of_another_count_are_refused_naming_both_counts_and_the_command() -> None:
    with pytest.raises(TablePartitionsError) as err:
        plan_partitions(SETTINGS, {REQUEST: 24, RETRY: 24, STATS: 16})
    assert str(err.value) == (
        "the topic inference-request has 24 partitions but the table changelog "
        "g-device_stats-changelog has 16: device state is kept for 16; stop every worker of "
        "group 'g' and run `streamapp tables rebuild --broker kafka://h:9092 --app-id g` to "
        "move the tables to 24 partitions (docs/tables.md)"
    )


def test_a_retry_topic_of_another_count_is_refused() -> None:
    with pytest.raises(TablePartitionsError, match="inference-retry has 16: they must be equal"):
        plan_partitions(SETTINGS, {REQUEST: 24, RETRY: 16})


class FakeApp:
    """Faust's app as the checks see it: ``consumer.topic_partitions`` from a dict that
    ``consumer._thread`` refreshes (a metadata update)."""

    def __init__(self, known: dict[str, int], after_refresh: dict[str, int]) -> None:
        self.known, self.after_refresh, self.refreshes = known, after_refresh, 0
        app = self

        class Thread:
            def _ensure_consumer(self) -> Any:
                async def update() -> None:
                    app.refreshes += 1
                    app.known.update(app.after_refresh)

                return type("C", (), {"_client": type("K", (), {
                    "force_metadata_update": staticmethod(update)})})()

            async def call_thread(self, fun: Any) -> None:
                await fun()

        self.consumer = type("Consumer", (), {
            "_thread": Thread(), "topic_partitions": lambda _s, t: app.known.get(t)})()


async def test_a_changelog_the_consumer_does_not_know_yet_is_waited_for() -> None:
    """The cold-start race: Faust's consumer reads a changelog created after its metadata
    fetch as 0 partitions (every table write then failed); the worker refreshes until it knows
    it."""
    app = FakeApp({STATS: 0}, {STATS: 16})
    await wait_for_metadata(app, {STATS: 16}, timeout_s=5, poll_s=0.01)
    assert app.refreshes >= 1 and app.known[STATS] == 16


async def test_a_changelog_never_known_fails_with_a_clear_error() -> None:
    app = FakeApp({STATS: 0}, {})
    with pytest.raises(TablePartitionsError) as err:
        await wait_for_metadata(app, {STATS: 16}, timeout_s=0.05, poll_s=0.01)
    assert "g-device_stats-changelog (0 known, 16 expected) after 0 s" in str(err.value)


def test_a_grown_request_topic_degrades_state_with_one_error_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = FakeApp({REQUEST: 16, RETRY: 16}, {})
    check = PartitionCheck(app, SETTINGS)
    assert check.gate() and not check.degraded
    app.known[REQUEST] = 24
    with caplog.at_level(logging.ERROR, logger="streamapp.partitions"):
        assert [check.gate() for _ in range(3)] == [False] * 3
    assert check.skipped == 3
    assert [r.getMessage() for r in caplog.records] == [
        "inference-request now has 24 partitions, the tables 16: device state is no longer "
        "updated (requests are still answered; /ready is 503). Stop every worker of group 'g' "
        "and run `streamapp tables rebuild --broker kafka://h:9092 --app-id g`, then start "
        "them again (docs/tables.md)"
    ]


def test_a_data_dir_of_another_cluster_is_refused_and_reset_drops_its_tables(
    tmp_path: Path,
) -> None:
    tables = tmp_path / "v1" / "tables" / "device_stats-0.db"
    tables.mkdir(parents=True)
    assert check_data_dir(tmp_path, cluster_id="tansu_cluster", app_id="g", partitions=4) is None
    with pytest.raises(DataDirMismatchError) as err:
        check_data_dir(tmp_path, cluster_id="abc", app_id="g", partitions=4)
    assert "app 'g' on cluster 'tansu_cluster', not of app 'g' on this cluster 'abc'" in str(
        err.value)
    assert "--data-dir" in str(err.value) and "--reset-data-dir" in str(err.value)
    assert tables.exists()  # refused: nothing dropped
    note = check_data_dir(tmp_path, cluster_id="abc", app_id="g", partitions=4, reset=True)
    assert note is not None and not tables.exists()
    assert json.loads((tmp_path / MARKER_NAME).read_text()) == {
        "cluster_id": "abc", "app_id": "g", "partitions": 4}


def test_tables_kept_for_another_partition_count_are_dropped(tmp_path: Path) -> None:
    """After ``streamapp tables rebuild`` the local stores are for the old count."""
    check_data_dir(tmp_path, cluster_id="c", app_id="g", partitions=16)
    (tmp_path / "v1" / "tables").mkdir(parents=True)
    note = check_data_dir(tmp_path, cluster_id="c", app_id="g", partitions=24)
    assert note is not None and "kept for 16 partitions, the tables now have 24" in note
    assert not (tmp_path / "v1").exists()
