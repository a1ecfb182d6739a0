"""``make bench-smoke`` end to end, so that the benchmark cannot rot: a real broker, the
forwarder, workers, the load generator, the profile, the scale-out at N = 1 and 2, the report
and the plots; and, in a second run, the Apache Kafka section (transport ceiling, Kafka's perf
tools, the product). The suite's ``--broker`` option picks which runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.kafka
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "broker", ["embedded", pytest.param("kafka", marks=pytest.mark.apache_kafka)])
def test_smoke_profile_measures_everything(tmp_path: Path, broker: str) -> None:
    """One benchmark run per broker; the Apache Kafka one is ``slow and apache_kafka``, so it
    runs in ``make test-kafka-slow`` (keeping ``make test`` under 15 minutes)."""
    out = tmp_path / "smoke"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "run", "--profile", "smoke", "--out", str(out),
         "--broker", broker],
        cwd=ROOT, capture_output=True, text=True, timeout=580,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "bench.json").read_text())
    report = (out / "report.txt").read_text()
    if broker == "embedded":
        _embedded_side(results, report, out)
    else:
        _kafka_side(results, report)


def _kafka_side(results: dict[str, Any], report: str) -> None:
    digits = results["apache_kafka"]["workloads"]["digits"]
    assert digits["warmup"]["complete"]
    assert digits["transport"]["complete"] and digits["transport"]["msgs_per_s"] > 1000
    anchor = digits["anchor"]
    assert anchor["producer_perf"]["records"] == anchor["records"] == 20_000
    assert anchor["producer_perf"]["steady"]["records"] == 16_000
    assert anchor["producer_perf"]["record_size"] == digits["payload_bytes"]
    assert anchor["consumer_perf"]["records"] == 20_000
    assert anchor["aiokafka_produce"]["send_failures"] == 0
    saturation = digits["saturation"]
    assert saturation["results_per_s"] > 0 and saturation["dead_letters_or_other"] == 0
    assert saturation["settings"]["broker_kind"] == "kafka"
    level = digits["open_loop"][0]
    assert level["complete"] and level["p99_ms"] is not None and level["p99_ms"] > 0
    assert level["generator"] == "process" and level["sent"] == level["outcomes"]
    assert "aiokafka ÷ ProducerPerformance = " in report
    assert "Apache Kafka 4.4.0 beside the embedded broker" in report


def _embedded_side(results: dict[str, Any], report: str, out: Path) -> None:
    digits = results["workloads"]["digits"]

    assert digits["engine"]["items_per_s"] > 1000
    assert digits["transport"]["complete"] and digits["transport"]["msgs_per_s"] > 1000
    assert digits["forwarder"]["results_per_s"] > 0
    saturation = digits["saturation"]
    assert saturation["results_per_s"] > 0 and saturation["dead_letters_or_other"] == 0
    assert saturation["mean_batch"] >= 1
    level = digits["open_loop"][0]
    assert level["complete"] and level["p99_ms"] is not None and level["p99_ms"] > 0
    assert digits["seeds"]["sync"]["mean_batch"] == 1.0
    assert results["backlog"]["rss_mib_max"] > 0
    roundtrip = digits["roundtrip"]
    assert roundtrip["complete"] and roundtrip["p99_ms"] > 0
    # The open loops' generators ran in processes of their own, and sent every request.
    for measured in (level, roundtrip):
        assert measured["generator"] == "process" and measured["generator_cpu_pct"] > 0
        assert measured["sent"] == measured["outcomes"] and measured["send_failures"] == 0
    assert "open-loop generators (ts = scheduled send time): 50%: process" in report

    series = results["scaleout"]["series"]
    workers = series["digits workers"]["points"]
    assert [p["n"] for p in workers] == [1, 2]
    for point in workers:
        assert point["complete"] and point["dead_letters_or_other"] == 0
        assert len(point["ready_s"]) == point["n"]
        # Tiny backlogs: a drain too short to time says so instead of giving a rate.
        assert point["results_per_s"] > 0 if point["results_per_s"] is not None \
            else point["too_short"]
        # Every request answered, by the workers' own counters (duplicates after a
        # rebalance can only add).
        assert sum(point["worker_results"]) >= point["backlog"]
        assert point["closed_loop"]["results_per_s"] > 0
        assert set(point["utilisation"]["cpu_pct"]) >= {f"w{i}" for i in range(point["n"])}
    for kind in ("aiokafka", "faust"):
        points = series[f"digits {kind}"]["points"]
        assert [p["n"] for p in points] == [1, 2] and all(p["complete"] for p in points)

    assert "product / min(engine, transport)" in report.splitlines()[-1]
    assert "round trip p99" in report.splitlines()[-1]
    assert "dynamic / synchronous" in report
    assert "scale-out targets (issue 9" in report and "digits workers: streamapp workers" in report
    for png in ("throughput.png", "latency.png", "backlog.png", "scaleout.png"):
        assert (out / png).stat().st_size > 1000
