"""Transport anchor on Apache Kafka: Kafka's own producer and consumer performance tools.

Starts a single-node Apache Kafka (streamapp.kafka_server), then runs
``org.apache.kafka.tools.ProducerPerformance`` and ``ConsumerPerformance`` (what
kafka-producer-perf-test.sh / kafka-consumer-perf-test.sh run) for two record sizes: a digits
request (171 B) and a ResNet-50 input tensor (301 kB: 3x224x224 float16 = 301,056 B). The
records are the tools' own filler bytes; only the size matters for the transport. Prints
msgs/s and MB/s per size and direction.

    .venv/bin/python scripts/kafka_perf.py [--digits-records N] [--tensor-records N]

The broker runs with the test JVM options (C1 JIT only, 512 MB heap) unless
``$STREAMAPP_KAFKA_JVM_OPTS`` says otherwise; the tools run with the full JIT.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

from streamapp.kafka import create_topics
from streamapp.kafka_server import KafkaBroker, _java, ensure_kafka_jars

SIZES = {"digits (171 B)": 171, "resnet tensor (301 kB)": 301_000}
TOOL_JVM = ["-Xmx512m", "-XX:+UseSerialGC"]


def _tool(main: str, *args: str) -> str:
    libs = ensure_kafka_jars()
    command = [_java(), *TOOL_JVM, "-cp", f"{libs}/*", main, *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{main} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout


def produce(bootstrap: str, topic: str, records: int, size: int) -> tuple[float, float]:
    """(records/s, MB/s) of ProducerPerformance's final summary line."""
    out = _tool(
        "org.apache.kafka.tools.ProducerPerformance", "--topic", topic,
        "--num-records", str(records), "--record-size", str(size), "--throughput", "-1",
        "--producer-props", f"bootstrap.servers={bootstrap}", "acks=all", "linger.ms=5",
        "max.request.size=2000000",
    )
    last = [line for line in out.splitlines() if "records sent" in line][-1]
    match = re.search(r"([\d.]+) records/sec \(([\d.]+) MB/sec\)", last)
    assert match is not None, last
    return float(match[1]), float(match[2])


def consume(bootstrap: str, topic: str, records: int) -> tuple[float, float]:
    """(records/s, MB/s) from ConsumerPerformance's CSV line."""
    out = _tool(
        "org.apache.kafka.tools.ConsumerPerformance", "--bootstrap-server", bootstrap,
        "--topic", topic, "--messages", str(records), "--timeout", "60000",
    )
    header, row = [line for line in out.splitlines() if line.strip()][-2:]
    fields = dict(zip([h.strip() for h in header.split(",")],
                      [v.strip() for v in row.split(",")], strict=False))
    return float(fields["nMsg.sec"]), float(fields["MB.sec"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--digits-records", type=int, default=500_000)
    parser.add_argument("--tensor-records", type=int, default=3_000)
    args = parser.parse_args()
    counts = {"digits (171 B)": args.digits_records,
              "resnet tensor (301 kB)": args.tensor_records}
    with KafkaBroker(extra_properties={"message.max.bytes": "2000000"}) as kafka:
        print(f"Apache Kafka ready in {kafka.startup_s:.1f} s at {kafka.bootstrap_servers}",
              file=sys.stderr)
        print(f"{'records':<24}{'direction':<10}{'msgs/s':>12}{'MB/s':>10}")
        for name, size in SIZES.items():
            topic = f"perf-{size}-{int(time.time())}"
            create_topics(kafka.bootstrap_servers, {topic: 4})
            rates = {
                "produce": produce(kafka.bootstrap_servers, topic, counts[name], size),
                "consume": consume(kafka.bootstrap_servers, topic, counts[name]),
            }
            for direction, (rate, mb) in rates.items():
                print(f"{name:<24}{direction:<10}{rate:>12,.0f}{mb:>10.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
