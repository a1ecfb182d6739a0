"""Isolation (issue 19): inference latency with and without a disturbance, in one run.

Two scenarios, each on a fresh embedded broker, each measured twice back to back on the same
workers — first the steady request stream alone, then the same stream with the disturbance —
so the ratio compares like with like on a shared machine:

* ``web``: two workers of one group, 100 req/s from 32 devices; the disturbance is 64
  concurrent HTTP clients (a separate process) on worker 1 asking in turn for
  ``/devices/{id}`` (half of the devices live on the other worker: forwarded),
  ``/devices/{id}/windows?kind=hopping&last=355``, ``/devices?limit=1000`` and ``/metrics``.
  A client refused with 429/503 waits the ``Retry-After`` it was given, as a well-behaved
  client does. Latency: every result of both workers.
* ``retries``: one worker on the test-only ``faulty`` backend (every batch holding a request
  whose first pixel is 15.5 fails, retriably), 200 req/s of normal requests; the disturbance is
  40 req/s of such failing requests from 8 other devices (each retried ``max_retries`` times,
  then dead-lettered). Latency: the healthy devices' results.

Latency is end to end (result arrival − the request's scheduled ``ts``, open loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import numpy as np

from bench.load import open_loop, percentiles
from bench.procs import bench_topics, fresh_broker, restore_environ, topic_names
from bench.workloads import result_parse, workload
from engines.registry import PLUGINS_ENV
from engines.testing.faults import FAULTS_ENV
from streamapp.process import WorkerProcess

__all__ = ["SCENARIOS", "format_isolation", "run_isolation"]

SCENARIOS = ("web", "retries")
Log = Callable[[str], None]

#: Flood shape of issue 19 item 1.
FLOOD_CLIENTS = 64
DEVICES = 32
#: Devices of the failing stream (not among the healthy ones).
FAILING_DEVICES = 8


def _flood_process(url: str, devices: list[str], seconds: float, out: Any) -> None:
    """Child process: ``FLOOD_CLIENTS`` clients asking ``url`` for ``seconds``; puts the status
    counts and answered latencies on ``out``."""
    out.put(asyncio.run(_flood(url, devices, seconds)))


async def _flood(url: str, devices: list[str], seconds: float) -> dict[str, Any]:
    statuses: dict[str, int] = {}
    answered_ms: list[float] = []
    waited_s = 0.0
    deadline = time.monotonic() + seconds
    paths = [lambda d: f"/devices/{d}", lambda d: f"/devices/{d}/windows?kind=hopping&last=355",
             lambda d: "/devices?limit=1000", lambda d: "/metrics"]

    async def client(i: int, session: aiohttp.ClientSession) -> None:
        nonlocal waited_s
        rng = random.Random(i)
        n = i
        while time.monotonic() < deadline:
            path = paths[n % len(paths)](rng.choice(devices))
            n += 1
            started = time.monotonic()
            try:
                async with session.get(url + path) as answer:
                    await answer.read()
                    status = answer.status
                    retry_after = answer.headers.get("Retry-After")
            except (aiohttp.ClientError, TimeoutError) as exc:
                statuses[type(exc).__name__] = statuses.get(type(exc).__name__, 0) + 1
                await asyncio.sleep(0.1)
                continue
            statuses[str(status)] = statuses.get(str(status), 0) + 1
            if status in (429, 503) and retry_after is not None:
                pause = min(float(retry_after), max(deadline - time.monotonic(), 0.0))
                waited_s += pause
                await asyncio.sleep(pause)
            elif status < 400:
                answered_ms.append((time.monotonic() - started) * 1000.0)

    timeout = aiohttp.ClientTimeout(total=30)
    connector = aiohttp.TCPConnector(limit=FLOOD_CLIENTS)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(client(i, session) for i in range(FLOOD_CLIENTS)))
    return {"statuses": statuses, "answered": len(answered_ms),
            "answered_per_s": len(answered_ms) / seconds,
            "query_latency": percentiles(answered_ms), "retry_after_waited_s": waited_s}


@contextlib.contextmanager
def _workers(broker: Any, n: int, settings: Mapping[str, Any], logs: Path, name: str,
             env: Mapping[str, str] | None = None) -> Iterator[tuple[list[WorkerProcess],
                                                                   dict[str, str]]]:
    app_id = f"bench-{name}-{uuid.uuid4().hex[:6]}"
    topics = topic_names(f"{app_id}.")
    bench_topics(broker, {t: 4 for t in topics.values()})
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    procs = [WorkerProcess(
        {"broker": broker.url, "broker_kind": "embedded", "app_id": app_id,
         "topic_prefix": f"{app_id}.", "topic_partitions": 4, "worker_name": f"w{i + 1}",
         "data_dir": logs / f"data-{app_id}-{i}", **settings},
        log_path=logs / f"worker-{name}-{i + 1}.log",
    ) for i in range(n)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready(120.0)
        _wait_assigned(procs)
        yield procs, topics
    finally:
        restore_environ(saved)
        for p in procs:
            p.stop()


def _wait_assigned(procs: list[WorkerProcess], timeout_s: float = 60.0) -> None:
    """Until every worker owns request partitions and /ready says so (after the rebalance)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ok = True
        for p in procs:
            status, body = p.get("/ready")
            ok = ok and status == 200 and bool(body.get("assigned"))
        if ok:
            return
        time.sleep(0.5)
    raise TimeoutError("the workers did not all get partitions")


def _measure(bootstrap: str, topics: dict[str, str], payload: Any, rate: float,
             seconds: float, during: Callable[[], Any] | None = None) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        side = None if during is None else asyncio.ensure_future(during())
        try:
            return await open_loop(
                bootstrap, topics["request"], [topics["result"], topics["dlq"]], payload,
                result_parse, rate=rate, warmup_s=3.0, duration_s=seconds, drain_s=30.0,
            )
        finally:
            if side is not None:
                side.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await side

    return asyncio.run(go())


def _pair(without: Mapping[str, Any], with_: Mapping[str, Any]) -> dict[str, Any]:
    def ratio(key: str) -> float | None:
        a, b = without.get(key), with_.get(key)
        return None if not a or b is None else round(b / a, 2)

    return {"p50_ratio": ratio("p50_ms"), "p99_ratio": ratio("p99_ms")}


def run_web(logs: Path, seconds: float, log: Log) -> dict[str, Any]:
    run = uuid.uuid4().hex[:4]
    wl, wl2 = (workload("digits", run=f"iso-web-{run}-{p}") for p in ("a", "b"))
    devices = [f"device-{d:02d}" for d in range(DEVICES)]
    with fresh_broker(logs, "isolation-web") as broker, \
            _workers(broker, 2, {}, logs, "iso-web") as (procs, topics):
        log(f"web: 2 workers ready; {seconds:.0f} s at 100 req/s without the flood")
        without = _measure(broker.bootstrap_servers, topics, wl.payload, 100.0, seconds)
        log(f"web:   p50 {without['p50_ms']:.1f} ms, p99 {without['p99_ms']:.1f} ms; "
            f"now with {FLOOD_CLIENTS} HTTP clients on worker 1")
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        flood = ctx.Process(target=_flood_process,
                            args=(procs[0].web_url, devices, seconds + 3.0, queue))

        async def start_flood() -> None:
            flood.start()
            await asyncio.Event().wait()

        with_ = _measure(broker.bootstrap_servers, topics, wl2.payload, 100.0, seconds,
                         during=start_flood)
        flood_stats = queue.get(timeout=60)
        flood.join(30)
        log(f"web:   p50 {with_['p50_ms']:.1f} ms, p99 {with_['p99_ms']:.1f} ms; flood "
            f"answered {flood_stats['answered_per_s']:.0f} queries/s, {flood_stats['statuses']}")
    return {"rate": 100.0, "devices": DEVICES, "workers": 2, "seconds": seconds,
            "without": without, "with": with_, "flood": flood_stats, **_pair(without, with_)}


def _failing_payload(run: str) -> Callable[[int, float], tuple[bytes, bytes]]:
    pixels = np.zeros((8, 8), dtype=np.float32)
    pixels[0, 0] = 15.5  # in the digits range (0–16): an out-of-range −1 never reaches the engine
    data = pixels.tobytes()

    def payload(n: int, ts: float) -> tuple[bytes, bytes]:
        device = f"failing-{n % FAILING_DEVICES:02d}"
        body = {"request_id": f"{run}-{n}", "device_id": device, "seq": n // FAILING_DEVICES,
                "ts": ts, "model": "digits",
                "tensor": {"dtype": "float32", "shape": [8, 8], "data": data}}
        return device.encode(), msgpack.packb(body, use_bin_type=True)

    return payload


async def _send_at(bootstrap: str, topic: str, payload: Callable[[int, float], Any],
                   rate: float) -> None:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
    await producer.start()
    try:
        start, n = time.time(), 0
        while True:
            key, value = payload(n, start + n / rate)
            await producer.send(topic, value, key=key)
            n += 1
            await asyncio.sleep(max(start + n / rate - time.time(), 0.0))
    finally:
        await producer.stop()


def run_retries(logs: Path, seconds: float, log: Log) -> dict[str, Any]:
    run = uuid.uuid4().hex[:4]
    wl, wl2 = (workload("digits", run=f"iso-retry-{run}-{p}") for p in ("a", "b"))
    env = {PLUGINS_ENV: "engines.testing.faults",
           FAULTS_ENV: json.dumps([{"match_first_value": 15.5 / 16.0, "kind": "runtime"}])}
    with fresh_broker(logs, "isolation-retries") as broker, \
            _workers(broker, 1, {"backend": "faulty"}, logs, "iso-retries", env) as (
                procs, topics):
        log(f"retries: worker ready; {seconds:.0f} s at 200 req/s without failing requests")
        without = _measure(broker.bootstrap_servers, topics, wl.payload, 200.0, seconds)
        before = _bisections(procs[0])
        log(f"retries:   p50 {without['p50_ms']:.1f} ms, p99 {without['p99_ms']:.1f} ms; now "
            "with 40 failing req/s")
        failing = _failing_payload(f"iso-fail-{uuid.uuid4().hex[:4]}")
        with_ = _measure(broker.bootstrap_servers, topics, wl2.payload, 200.0, seconds,
                         during=lambda: _send_at(broker.bootstrap_servers, topics["request"],
                                                 failing, 40.0))
        isolations = _bisections(procs[0]) - before
        log(f"retries:   p50 {with_['p50_ms']:.1f} ms, p99 {with_['p99_ms']:.1f} ms; "
            f"{isolations:.0f} failed batches isolated")
    return {"rate": 200.0, "failing_rate": 40.0, "workers": 1, "seconds": seconds,
            "without": without, "with": with_, "failed_batches_isolated": isolations,
            **_pair(without, with_)}


def _bisections(proc: WorkerProcess) -> float:
    """``streamapp_bisections_total`` of a worker (failed batches isolated)."""
    import urllib.request

    with urllib.request.urlopen(proc.web_url + "/metrics", timeout=5) as answer:
        text = answer.read().decode()
    for line in text.splitlines():
        if line.startswith("streamapp_bisections_total"):
            return float(line.split()[-1])
    return 0.0


def run_isolation(out: Path, *, scenarios: tuple[str, ...] = SCENARIOS, seconds: float = 20.0,
                  log: Log = print, logs: Path | None = None) -> dict[str, Any]:
    """Run ``scenarios`` and write ``out/bench.json`` and ``out/report.txt``."""
    out.mkdir(parents=True, exist_ok=True)
    logs = logs or out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "scenarios": {},
                               "cpus": os.cpu_count()}
    runners = {"web": run_web, "retries": run_retries}
    for name in scenarios:
        try:
            results["scenarios"][name] = runners[name](logs, seconds, log)
        except Exception as exc:  # one scenario's failure must not lose the other's figures
            log(f"{name}: failed: {type(exc).__name__}: {exc}")
            results["scenarios"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        (out / "bench.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "report.txt").write_text(format_isolation(results) + "\n")
    return results


def format_isolation(results: Mapping[str, Any]) -> str:
    """The side-by-side table of :func:`run_isolation`'s results."""
    lines = [f"isolation (issue 19), {results.get('date')}, {results.get('cpus')} CPUs",
             f"{'scenario':<10} {'phase':<8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
             f"{'answered':>9} {'complete':>8}"]
    for name, res in results.get("scenarios", {}).items():
        if "error" in res:
            lines.append(f"{name:<10} failed: {res['error']}")
            continue
        for phase in ("without", "with"):
            r = res[phase]
            lines.append(f"{name:<10} {phase:<8} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} "
                         f"{r['max_ms']:>8.1f} {r['measured_requests']:>9} "
                         f"{r['complete']!s:>8}")
        lines.append(f"{name:<10} ratio    {res['p50_ratio']:>8} {res['p99_ratio']:>8}")
        if name == "web":
            f = res["flood"]
            lines.append(f"           flood: {f['answered_per_s']:.0f} queries/s answered, "
                         f"statuses {f['statuses']}, query p99 "
                         f"{f['query_latency']['p99_ms'] or 0:.1f} ms")
        if name == "retries":
            lines.append(f"           failed batches isolated during the failing stream: "
                         f"{res['failed_batches_isolated']:.0f}")
    return "\n".join(lines)
