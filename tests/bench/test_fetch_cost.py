"""``python -m bench.fetch_cost`` against Apache Kafka: one short variant, its row printed."""

from __future__ import annotations

import pytest

from bench import fetch_cost
from streamapp.kafka_server import KafkaBroker

pytestmark = [pytest.mark.kafka, pytest.mark.apache_kafka]


def test_a_short_run_prints_one_row_per_variant_with_every_record_counted(
    apache_kafka: KafkaBroker, capsys: pytest.CaptureFixture[str],
) -> None:
    fetch_cost.main(["--bootstrap", apache_kafka.bootstrap_servers, "--rate", "500",
                     "--seconds", "4", "--repeat", "1", "--variants", "1:25,4096:5"])

    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[0], r[1]) for r in rows] == [("1", "25"), ("4096", "5")]
    for row in rows:
        records_per_s, fetches_per_s, per_fetch, us, _, _ = (
            float(v.replace(",", "")) for v in row[2:])
        assert 200 < records_per_s < 800  # sent at 500/s
        assert per_fetch == pytest.approx(records_per_s / fetches_per_s, rel=0.05)
        assert us > 0
    assert float(rows[0][-1]) == 1.0
