"""Kafka's perf tools as the benchmark's second transport anchor: parsing their output, the
producer settings they are given, the Apache Kafka section of the report, and one short real
run of each tool against Apache Kafka."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from bench import kafka_tools
from bench.kafka_tools import (
    consumer_perf,
    parse_consumer_csv,
    parse_producer_summary,
    producer_perf,
    producer_properties,
)
from bench.load import transport_options
from bench.report import format_report, kafka_ratios
from bench.run import PROFILES, run_profile
from streamapp import kafka_server
from streamapp.kafka import create_topics
from streamapp.kafka_server import KafkaBroker

# Output of ProducerPerformance (Kafka 4.4.0) with --warmup-records, as printed on this machine.
PRODUCER_OUT = """\
Warmup first 20000 records. Steady state results will print after the complete test summary.
100000 records sent, 58927.519151 records/sec (9.61 MB/sec), 54.46 ms avg latency, 599.00 ms \
max latency, 48 ms 50th, 116 ms 95th, 138 ms 99th, 140 ms 99.9th.
80000 steady state records sent, 94786.729858 records/sec (15.46 MB/sec), 55.18 ms avg \
latency, 141.00 ms max latency, 49 ms 50th, 121 ms 95th, 138 ms 99th, 140 ms 99.9th.
"""
CONSUMER_OUT = """\
start.time, end.time, data.consumed.in.MB, MB.sec, data.consumed.in.nMsg, nMsg.sec, \
rebalance.time.ms, fetch.time.ms, fetch.MB.sec, fetch.nMsg.sec
2026-11-30 13:41:01:744, 2026-11-30 13:41:03:121, 16.4390, 11.9382, 100000, 72621.6412, 706, \
671, 24.4992, 149031.2966
"""


def test_producer_summary_gives_the_whole_run_and_the_steady_state() -> None:
    res = parse_producer_summary(PRODUCER_OUT)

    assert res["records"] == 100_000 and res["records_per_s"] == pytest.approx(58927.519151)
    assert res["mb_per_s"] == 9.61 and res["max_ms"] == 599.0 and res["p99_ms"] == 138.0
    steady = res["steady"]
    assert steady["records"] == 80_000 and steady["records_per_s"] == pytest.approx(94786.73)
    assert (steady["p50_ms"], steady["p95_ms"], steady["p999_ms"]) == (49.0, 121.0, 140.0)


def test_producer_summary_without_warmup_has_no_steady_state() -> None:
    res = parse_producer_summary(PRODUCER_OUT.splitlines()[1])

    assert res["records"] == 100_000 and "steady" not in res


def test_producer_output_without_summary_names_what_it_got() -> None:
    with pytest.raises(ValueError, match=r"no ProducerPerformance summary line.*Connection"):
        parse_producer_summary("Connection to node -1 could not be established.\n")


def test_consumer_csv_row() -> None:
    res = parse_consumer_csv("Warning: something\n" + CONSUMER_OUT)

    assert res["records"] == 100_000 and res["records_per_s"] == pytest.approx(72621.6412)
    assert res["fetch_records_per_s"] == pytest.approx(149031.2966)
    assert res["mb_per_s"] == pytest.approx(11.9382) and res["rebalance_ms"] == 706.0


def test_java_producer_gets_the_aiokafka_ceilings_settings() -> None:
    props = producer_properties(transport_options({"max_request_size": 2 << 20}))

    assert props == {"acks": "all", "linger.ms": "5", "batch.size": "65536",
                     "max.request.size": str(2 << 20), "compression.type": "none",
                     "enable.idempotence": "false"}
    assert producer_properties({"acks": 1, "linger_ms": 20})["acks"] == "1"


def test_missing_java_is_one_clear_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kafka_server, "find_java", lambda: None)

    reason = kafka_tools.java_missing()

    assert reason is not None and "'java'" in reason


def test_without_java_the_kafka_section_is_skipped_with_its_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kafka_tools, "java_missing", lambda: "no 'java' on PATH")

    results = run_profile(PROFILES["smoke"], tmp_path, brokers=("kafka",), log=lambda _m: None)

    assert results["apache_kafka"] == {"skipped": "no 'java' on PATH"}
    assert results["workloads"] == {} and "backlog" not in results
    assert "Apache Kafka: SKIPPED (no 'java' on PATH)" in format_report(results)


def _side(transport: float, product: float, p99: float) -> dict[str, Any]:
    return {"describe": "d", "payload_bytes": 171,
            "plan": {"delay_ms": 5.0, "batch": 32, "backend": "x", "inflight": 2,
                     "partitions": 4, "p99_level": 0.7},
            "transport": {"msgs_per_s": transport, "mb_per_s": 1.0, "utilisation": {
                "cpu_pct": {"broker": transport / 1000}, "other_cpu_pct": 0.0}},
            "saturation": {"results_per_s": product, "window": 10},
            "open_loop": [{"level": 0.7, "rate": 0.7 * product, "results_per_s": 0.7 * product,
                           "p50_ms": 4.0, "p95_ms": 6.0, "p99_ms": p99, "complete": True}]}


def test_kafka_ratios_and_side_by_side_report() -> None:
    kafka = _side(40_000.0, 1_000.0, 80.0)
    kafka["anchor"] = {
        "records": 200_000,
        "aiokafka_produce": {"msgs_per_s": 30_000.0},
        "producer_perf": {**parse_producer_summary(PRODUCER_OUT), "record_size": 171,
                          "properties": producer_properties(transport_options())},
        "consumer_perf": parse_consumer_csv(CONSUMER_OUT),
    }
    results = {"profile": "t", "env": {}, "workloads": {"digits": _side(80_000.0, 1_200.0, 60.0)},
               "apache_kafka": {"version": "4.4.0", "jvm_opts": "-Xmx1G",
                                "workloads": {"digits": kafka}}}

    r = kafka_ratios(results)["digits"]

    assert r["product_over_transport_embedded"] == pytest.approx(0.015)
    assert r["product_over_transport_kafka"] == pytest.approx(0.025)
    assert r["transport_kafka_over_embedded"] == pytest.approx(0.5)
    assert r["aiokafka_over_java"] == pytest.approx(30_000 / 94786.729858)
    assert r["aiokafka_over_java_whole_run"] == pytest.approx(30_000 / 58927.519151)
    rows = {" ".join(line.split()) for line in format_report(results).splitlines()}
    assert "ceiling: aiokafka produce+consume, msgs/s 80,000 40,000" in rows
    assert "broker CPU, % of one core 80 40" in rows
    assert "other processes' CPU meanwhile, % of one core 0 0" in rows
    assert "product at saturation, results/s 1,200 1,000" in rows
    assert "product p99 at 70% of saturation, ms 60.0 80.0" in rows
    assert "product ÷ transport ceiling 0.015 0.025" in rows
    assert ("aiokafka ÷ ProducerPerformance = 0.32 (0.51 against its whole run); aiokafka "
            "produce+consume ceiling ÷ ProducerPerformance = 0.42") in rows



def test_the_exactly_once_comparison_is_side_by_side_with_its_ratios() -> None:
    kafka = _side(40_000.0, 1_000.0, 80.0)

    def side(rate: float, p99: float) -> dict[str, Any]:
        return {"results_per_s": rate, "open_loop": {"rate": 500.0, "p50_ms": p99 / 2,
                                                      "p99_ms": p99}}

    kafka["exactly_once"] = {"commit_interval_ms": 100.0, "level": 0.5,
                             "at_least_once": side(1_000.0, 40.0),
                             "exactly_once": side(800.0, 120.0),
                             "throughput_ratio": 0.8, "p99_ratio": 3.0}
    results = {"profile": "t", "env": {}, "workloads": {},
               "apache_kafka": {"version": "4.4.0", "jvm_opts": "-Xmx1G",
                                "workloads": {"digits": kafka}}}
    rows = {" ".join(line.split()) for line in format_report(results).splitlines()}
    assert "saturation, results/s 1,000 800 0.800" in rows
    assert "p99 at 500/s (50% of at_least_once sat.), ms 40.0 120.0 3.000" in rows


def test_the_p99_target_on_apache_kafka_uses_its_own_round_trip_and_the_runs_engine() -> None:
    kafka = _side(40_000.0, 1_000.0, 80.0)
    kafka["roundtrip"] = {"p99_ms": 12.0, "level": 0.7}
    embedded = {**_side(80_000.0, 1_200.0, 60.0), "engine": {
        "batch": 32, "mode": "sync", "items_per_s": 9_000.0, "batch_ms_p50": 1.0},
                "roundtrip": {"p99_ms": 3.0, "level": 0.7, "results_per_s": 700.0,
                              "complete": True}}
    results = {"profile": "t", "env": {}, "workloads": {"digits": embedded},
               "apache_kafka": {"version": "4.4.0", "jvm_opts": "-Xmx1G",
                                "workloads": {"digits": kafka}}}

    r = kafka_ratios(results)["digits"]

    # 5 ms delay + 3 × 1 ms compute + Kafka's own 12 ms round trip (not the embedded 3 ms)
    assert r["p99_budget_ms"] == pytest.approx(20.0)
    assert r["p99_over_budget"] == pytest.approx(4.0)
    assert any("= 4.00 (target ≤ 1)" in line for line in format_report(results).splitlines())
    kafka["engine"] = {"batch_ms_p50": 2.0}  # --broker kafka: the engine measured there
    assert kafka_ratios(results)["digits"]["p99_budget_ms"] == pytest.approx(23.0)

@pytest.mark.kafka
@pytest.mark.apache_kafka
def test_perf_tools_run_against_apache_kafka(apache_kafka: KafkaBroker) -> None:
    topic = f"perf-{uuid.uuid4().hex[:6]}"
    create_topics(apache_kafka.bootstrap_servers, {topic: 2})

    produced = producer_perf(apache_kafka.bootstrap_servers, topic, records=2_000,
                             record_size=171, options=transport_options(), warmup=500)
    consumed = consumer_perf(apache_kafka.bootstrap_servers, topic, records=2_000)

    assert produced["records"] == 2_000 and produced["steady"]["records"] == 1_500
    assert produced["records_per_s"] > 0 and produced["properties"]["acks"] == "all"
    assert consumed["records"] == 2_000
