"""``python -m bench security``: SASL_SSL (SCRAM-SHA-512, TLS) against PLAINTEXT on Apache Kafka,
side by side in one run (issue 21).

For each listener, on a fresh single-node Apache Kafka (``KafkaBroker``, the secured one with
the ACLs of :mod:`streamapp.acls`):

* **transport**: raw aiokafka, ``records`` records of ``record_bytes`` produced with
  ``acks=all`` (one ``send`` each, linger 5 ms), then consumed from the beginning: records/s;
* **worker**: one ``streamapp worker`` (onnxruntime, the digits model) answering ``requests``
  published at full speed: results/s from the first publish to the last result read; then
  requests paced at ``paced_rate_per_s`` for ``paced_s`` seconds: their end-to-end p50/p99
  (``e2e_ms``, milliseconds; the burst's latencies would measure its queue).

The two listeners run one after the other (the same machine, the same load), and the report
gives each figure with its ratio SASL_SSL ÷ PLAINTEXT.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from streamapp.acls import create_acls, publisher_acls, worker_acls
from streamapp.client import collect_outcomes, digits_requests, load_digits_frames, publish
from streamapp.kafka import ensure_topics
from streamapp.kafka_security import ADMIN_USER, BrokerSecurity
from streamapp.kafka_server import KafkaBroker
from streamapp.partitions import TABLE_NAMES, changelog_topic
from streamapp.process import WorkerProcess
from streamapp.settings import load_settings

__all__ = ["SecurityConfig", "format_security", "run_security"]

LISTENERS = ("PLAINTEXT", "SASL_SSL")


@dataclass(frozen=True)
class SecurityConfig:
    """What :func:`run_security` measures (counts of records; bytes)."""

    records: int = 50_000
    record_bytes: int = 200
    requests: int = 3_000
    partitions: int = 4
    #: Requests per second, and seconds, of the paced phase the latencies come from.
    paced_rate_per_s: float = 100.0
    paced_s: float = 10.0
    #: Rounds of both listeners (ABBA order); the report gives each figure's median.
    rounds: int = 2


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _transport(kafka: KafkaBroker, security: dict[str, Any],
                     config: SecurityConfig) -> dict[str, float]:
    topic = "bench-transport"
    await ensure_topics(kafka.bootstrap_servers, {topic: config.partitions}, security=security)
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap_servers, acks="all",
                                linger_ms=5, **security)
    await producer.start()
    value = b"x" * config.record_bytes
    began = time.perf_counter()
    try:
        futures = [await producer.send(topic, value, key=str(i % 64).encode())
                   for i in range(config.records)]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()
    produce_s = time.perf_counter() - began
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=kafka.bootstrap_servers, group_id=None,
                                auto_offset_reset="earliest", **security)
    await consumer.start()
    began, seen = time.perf_counter(), 0
    try:
        while seen < config.records and time.perf_counter() - began < 120:
            batches = await consumer.getmany(timeout_ms=500, max_records=10_000)
            seen += sum(len(r) for r in batches.values())
    finally:
        await consumer.stop()
    consume_s = time.perf_counter() - began
    return {"produce_per_s": config.records / produce_s, "consume_per_s": seen / consume_s}


async def _worker(kafka: KafkaBroker, listener: str, config: SecurityConfig,
                  workdir: Path) -> dict[str, Any]:
    app = f"bench-sec-{listener.lower()}"
    settings = load_settings(app_id=app, topic_partitions=config.partitions)
    sec = kafka.security
    admin = sec.client_options() if sec else {}
    changelogs = [changelog_topic(app, t) for t in TABLE_NAMES]
    await ensure_topics(kafka.bootstrap_servers,
                        dict.fromkeys([*settings.topics, *changelogs], config.partitions),
                        security=admin,
                        configs={n: {"cleanup.policy": "compact"} for n in changelogs})
    env: dict[str, Any] = {"broker": kafka.url, "app_id": app, "broker_kind": "kafka",
                           "topic_partitions": config.partitions, "backend": "onnxruntime",
                           "data_dir": workdir / app}
    publisher = reader = admin
    if sec is not None:
        await create_acls(kafka.bootstrap_servers, worker_acls(settings, "worker")
                          + publisher_acls(settings, "publisher"), security=admin)
        env |= sec.client_settings("worker")
        publisher = sec.client_options("publisher")
        reader = sec.client_options(ADMIN_USER)
    images, _ = load_digits_frames()
    indices = [i % len(images) for i in range(config.requests)]
    requests = digits_requests(images, devices=16, indices=indices, run_id="burst")
    paced_n = int(config.paced_rate_per_s * config.paced_s)
    paced = digits_requests(images, devices=16, run_id="paced",
                            indices=[i % len(images) for i in range(paced_n)])
    with WorkerProcess(env, log_path=workdir / f"{app}.log") as worker:
        worker.wait_ready(120)
        began = time.perf_counter()
        await publish(kafka.bootstrap_servers, settings.request_topic, requests,
                      security=publisher, partitions=None)
        out = await collect_outcomes(
            kafka.bootstrap_servers, settings.result_topic, settings.dlq_topic,
            done=lambda o: len(o.results) + len(o.dead_letters) >= config.requests,
            timeout_s=300, security=reader)
        took = time.perf_counter() - began
        # latency at a light, paced load (the burst above measures queueing, not latency)
        await publish(kafka.bootstrap_servers, settings.request_topic, paced,
                      rate_per_s=config.paced_rate_per_s, security=publisher, partitions=None)
        total = config.requests + paced_n
        late = await collect_outcomes(
            kafka.bootstrap_servers, settings.result_topic, settings.dlq_topic,
            done=lambda o: len(o.results) + len(o.dead_letters) >= total,
            timeout_s=120, security=reader)
    e2e = [float(r["e2e_ms"]) for r in late.results
           if str(r.get("request_id", "")).startswith("paced")]
    return {"results": len(out.results), "dead_letters": len(out.dead_letters),
            "results_per_s": len(out.results) / took, "e2e_p50_ms": _percentile(e2e, 0.5),
            "e2e_p99_ms": _percentile(e2e, 0.99), "paced_results": len(e2e)}


def run_security(config: SecurityConfig = SecurityConfig()) -> dict[str, Any]:
    """Measure both listeners ``config.rounds`` times; returns ``{"config", "rounds": [every
    measurement], "listeners": {name: median figures}, "ratios": {figure: SASL_SSL /
    PLAINTEXT}}``.

    Raises:
        streamapp.exceptions.BrokerError: A broker did not start (no Java, no jars).
    """
    out: dict[str, Any] = {"config": config.__dict__, "listeners": {}, "rounds": []}
    for round_no in range(config.rounds):
        # ABBA order: a load that drifts during the run weighs on both listeners alike
        for listener in LISTENERS if round_no % 2 == 0 else LISTENERS[::-1]:
            security = (BrokerSecurity(users={"worker": "bench-worker-pw", "publisher":
                                              "bench-publisher-pw"})
                        if listener == "SASL_SSL" else None)
            with tempfile.TemporaryDirectory(prefix="bench-security-") as tmp, \
                    KafkaBroker(security=security) as kafka:
                admin = security.client_options() if security else {}
                figures = asyncio.run(_transport(kafka, admin, config))
                figures |= asyncio.run(_worker(kafka, listener, config, Path(tmp)))
                out["rounds"].append({"listener": listener, **figures})
    for listener in LISTENERS:
        runs = [r for r in out["rounds"] if r["listener"] == listener]
        out["listeners"][listener] = {
            key: statistics.median(r[key] for r in runs) if all(
                r[key] is not None for r in runs) else None
            for key in runs[0] if key != "listener"
        }
    plain, secured = out["listeners"]["PLAINTEXT"], out["listeners"]["SASL_SSL"]
    out["ratios"] = {
        k: secured[k] / plain[k] for k in ("produce_per_s", "consume_per_s", "results_per_s",
                                           "e2e_p50_ms", "e2e_p99_ms")
        if plain.get(k) and secured.get(k) is not None
    }
    return out


def format_security(results: dict[str, Any]) -> str:
    """The side-by-side table of :func:`run_security`'s results."""
    rows = [("produce records/s", "produce_per_s", "{:,.0f}"),
            ("consume records/s", "consume_per_s", "{:,.0f}"),
            ("worker results/s", "results_per_s", "{:,.0f}"),
            ("worker e2e p50 ms (paced)", "e2e_p50_ms", "{:,.1f}"),
            ("worker e2e p99 ms (paced)", "e2e_p99_ms", "{:,.1f}")]
    plain, secured = results["listeners"]["PLAINTEXT"], results["listeners"]["SASL_SSL"]
    lines = ["| figure | PLAINTEXT | SASL_SSL | SASL_SSL ÷ PLAINTEXT |", "|---|---|---|---|"]
    for label, key, fmt in rows:
        ratio = results["ratios"].get(key)
        lines.append(
            f"| {label} | {fmt.format(plain[key]) if plain.get(key) is not None else '—'} | "
            f"{fmt.format(secured[key]) if secured.get(key) is not None else '—'} | "
            f"{'—' if ratio is None else f'{ratio:.2f}'} |")
    cfg = results["config"]
    lines.append(f"\nmedians of {cfg['rounds']} rounds (ABBA); {cfg['records']:,} records of "
                 f"{cfg['record_bytes']} B (acks=all, linger "
                 f"5 ms); {cfg['requests']:,} digits requests through one worker at full speed, "
                 f"then {cfg['paced_rate_per_s']:g}/s for {cfg['paced_s']:g} s (latencies); "
                 f"{cfg['partitions']} partitions; SASL_SSL = SCRAM-SHA-512 over TLS 1.3 "
                 "(RSA 2048 certificate), StandardAuthorizer with the least ACLs")
    return "\n".join(lines)


def main(out: Path | None = None, config: SecurityConfig = SecurityConfig()) -> int:
    """Run, print the table, write ``out`` (JSON) when given."""
    results = run_security(config)
    print(format_security(results))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(v["results"] for v in results["listeners"].values()) else 1
