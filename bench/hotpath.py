"""``python -m bench hotpath``: the worker's hot path against the best Faust agent (issue 17).

One broker kind (Apache Kafka by default, or the embedded one), 32 partitions, 256 devices,
digits requests in msgpack. For each *rung*, on a fresh broker: produce a backlog of K requests,
*then* start one consumer process and let it drain the backlog while a collector reads its
output topics from the beginning. Rungs:

* ``yardstick``: :mod:`bench.yardstick`, a Faust agent with ``stream.take_events`` and one
  ``send_batch`` per output partition through Faust's own aiokafka producer (per-key order and
  at-least-once kept): what a Faust agent can cost per record;
* ``product``: one ``streamapp worker`` (digits model, ONNX Runtime, batches of at most 64
  closed after 5 ms).

Per rung: records/s from the first to the last output record (arrival times are the
collector's fetches, tens of ms apart), the CPU seconds of the process (and of the broker) over
that span from psutil's ``cpu_times`` sampled at those two fetches, CPU µs per record, and for
the product the batch sizes its results report. Then issue 17's targets: product CPU per
record ≤ 1.4 × the yardstick's, product rate ≥ 0.7 × the yardstick's, mean batch ≥ 0.75 ×
``max_batch_size``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from aiokafka import AIOKafkaConsumer, TopicPartition

from bench import load
from bench.common import produce_backlog
from bench.procs import (
    BrokerKind,
    bench_topics,
    fresh_broker,
    kind_of,
    profile_pid,
    py_spy,
    topic_names,
)
from bench.run import environment
from bench.scaleout import Child
from bench.workloads import Workload, result_parse, workload

__all__ = ["RUNGS", "TARGETS", "HotpathConfig", "format_hotpath", "hotpath_ratios",
           "run_hotpath"]

Log = Callable[[str], None]

#: The rungs, in the order they run.
RUNGS = ("yardstick", "product")
#: Issue 17's targets: (ratio name, comparison, bound).
TARGETS: dict[str, tuple[str, float]] = {
    "cpu_per_record": ("<=", 1.4),
    "rate": (">=", 0.7),
    "batch_fill": (">=", 0.75),
}


@dataclass(frozen=True)
class HotpathConfig:
    """One ``python -m bench hotpath`` run.

    Attributes:
        requests: K, the backlog each rung drains (requests).
        broker: ``kafka`` (Apache Kafka, :func:`bench.procs.fresh_broker`) or ``embedded``.
        rungs: Which of :data:`RUNGS` to measure.
        uvloop: Run the yardstick on uvloop's event loop.
        worker_env: Extra environment of the worker (``STREAMAPP_MAX_BATCH_SIZE=128``, ...);
            ``STREAMAPP_*`` entries override the settings below.
        partitions: Partitions of every topic.
        devices: Distinct device keys of the requests.
        max_batch_size: The worker's ``max_batch_size`` and the yardstick's ``take_events``
            bound (records), unless ``worker_env`` sets ``STREAMAPP_MAX_BATCH_SIZE``.
        max_batch_delay_ms: The worker's ``max_batch_delay_ms`` and the yardstick's
            ``within`` (milliseconds).
        backend: The worker's engine backend.
        yardstick_batch: The yardstick's ``take_events`` bound (records); None: the
            product's ``max_batch_size`` (the same batches on both sides).
        profile_s: Seconds of ``py-spy record`` on each rung's process during its drain
            (0: none), started ``profile_after_s`` after the launch (past the start-up).
        profile_after_s: Seconds from a rung's launch to the start of its profile.
        rate: None: the backlog of ``requests`` is produced before the rung starts. A rate
            (records/s): ``warmup`` requests are produced before it starts, and once their
            outputs are all out, ``requests`` more are sent at ``rate`` while it runs (each
            scheduled, as :func:`bench.load.open_loop` sends); CPU per record is then measured
            over those, the cost at a rate below saturation (the open loop's fetches are
            small: issue 17's p99 level).
        warmup: Requests drained before a paced window (the rung's start-up and group join).
    """

    requests: int = 30_000
    broker: BrokerKind = "kafka"
    rungs: tuple[str, ...] = RUNGS
    uvloop: bool = False
    worker_env: Mapping[str, str] = field(default_factory=dict)
    partitions: int = 32
    devices: int = 256
    max_batch_size: int = 64
    max_batch_delay_ms: float = 5.0
    backend: str = "onnxruntime"
    yardstick_batch: int | None = None
    profile_s: float = 0.0
    profile_after_s: float = 8.0
    rate: float | None = None
    warmup: int = 2_000

    def worker_settings(self) -> dict[str, Any]:
        """The worker's settings (name → value) before broker, topics and data directory."""
        settings: dict[str, Any] = {
            "backend": self.backend, "models": "digits", "max_batch_size": self.max_batch_size,
            "max_batch_delay_ms": self.max_batch_delay_ms, "log_level": "warning",
        }
        for key, value in self.worker_env.items():
            if key.startswith("STREAMAPP_"):
                settings[key[len("STREAMAPP_"):].lower()] = value
        return settings

    @property
    def batch_bound(self) -> int:
        """The effective ``max_batch_size`` (records)."""
        return int(self.worker_settings()["max_batch_size"])

    @property
    def delay_ms(self) -> float:
        """The effective ``max_batch_delay_ms`` (milliseconds)."""
        return float(self.worker_settings()["max_batch_delay_ms"])

    def drain_timeout_s(self) -> float:
        """Longest a rung may take from launch to its last output (s): a start allowance
        plus K at 100 records/s (the worker on Apache Kafka on a busy 2-core machine:
        111/s)."""
        paced = 0.0 if self.rate is None else self.requests / self.rate
        return 60.0 + (self.requests + self.warmup * (self.rate is not None)) / 100.0 + paced


# -- measuring a drain -------------------------------------------------------------------------


def _machine_busy_s() -> float:
    """CPU seconds all cores of the machine spent busy so far (everything but idle and
    iowait)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def _cpu_s(procs: Sequence[psutil.Process]) -> float:
    """User + system CPU seconds of ``procs`` so far (processes gone count 0)."""
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


async def measure_drain(bootstrap: str, topics: Sequence[str], k: int,
                        pids: Mapping[str, int], *, measured: str, timeout_s: float,
                        dead: Callable[[], str | None] = lambda: None,
                        batch_sizes: bool = False, skip: int = 0,
                        window: asyncio.Event | None = None) -> dict[str, Any]:
    """Read ``topics`` from the beginning until ``k`` records came (or ``timeout_s``, or
    ``dead()`` names a reason); time the first → last fetch that returned records and sample
    the CPU of each of ``pids`` (name → pid, with its child processes) at each such fetch.
    With ``skip``, the span starts at the fetch that brought the ``skip``-th record (and
    ``window`` is set then: a paced sender starts on it).

    Args:
        bootstrap: Kafka bootstrap servers.
        topics: Output topics; the first holds results (``batch_sizes``), others are counted
            as dead letters or other.
        k: Records expected (the backlog).
        pids: Processes whose CPU is measured, e.g. ``{"product": pid, "broker": pid}``.
        measured: The name in ``pids`` of the process under test: its child processes
            count with it.
        timeout_s: Longest wait (s) from the start of this call.
        dead: Returns why the measured process can no longer deliver (it exited), else None.
        batch_sizes: Parse each result's ``batch_size`` (:func:`bench.workloads.result_parse`).
        skip: Records read before the span starts (a warm-up's outputs).
        window: Set when the span starts.

    Returns:
        ``records``, ``complete``, ``first``/``last`` (epoch s of the fetches),
        ``records_per_s`` (records after the first fetch ÷ the span; None for one fetch),
        ``cpu_s`` (name → CPU seconds over the span), ``cpu_us_per_record`` (name → µs),
        ``machine_busy_cores`` / ``other_cores`` (the whole machine's busy CPU over the span,
        and what ``pids`` do not account for, in cores), ``other`` (records of the other
        topics), ``batch_sizes`` (list, per result).
    """
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
        # 50 ms, not load.Collector's 20: fewer empty polls of 64 partitions while the worker
        # trickles (the collector shares the 2 cores with what it measures: 14 % of one core
        # at 20 ms), and arrival times still to within a fetch.
        auto_offset_reset="earliest", fetch_max_wait_ms=50, max_partition_fetch_bytes=8 << 20,
    )
    await consumer.start()
    procs: dict[str, list[psutil.Process]] = {}
    for name, pid in pids.items():
        try:
            procs[name] = [psutil.Process(pid)]
        except psutil.Error:
            procs[name] = []
    try:
        tps: list[TopicPartition] = []
        for topic in topics:
            parts = await consumer._client._wait_on_metadata(topic)
            tps += [TopicPartition(topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        deadline = time.monotonic() + timeout_s
        count = other = 0
        sizes: list[int] = []
        first: tuple[float, int, dict[str, float]] | None = None
        last = first
        stopped_by: str | None = None
        while count < k:
            batches = await consumer.getmany(timeout_ms=100, max_records=10_000)
            if batches:
                now = time.time()
                if first is None and procs.get(measured):
                    # The measured process's children (a worker's helper processes) exist by
                    # now; theirs count as its CPU.
                    try:
                        procs[measured] += procs[measured][0].children(recursive=True)
                    except psutil.Error:
                        pass
                cpu = {name: _cpu_s(plist) for name, plist in procs.items()}
                cpu["machine"] = _machine_busy_s()
                for tp, records in batches.items():
                    count += len(records)
                    if tp.topic != topics[0]:
                        other += len(records)
                    elif batch_sizes and (first is not None or not skip):  # not a warm-up's
                        for record in records:
                            size = result_parse(record.value)[1] if record.value else None
                            if size is not None:
                                sizes.append(size)
                last = (now, count, cpu)
                if first is None and count >= skip:
                    first = last
                    if window is not None:
                        window.set()
            if time.monotonic() > deadline:
                stopped_by = f"timeout after {timeout_s:.0f} s"
                break
            if (why := dead()) is not None:
                stopped_by = why
                break
    finally:
        await consumer.stop()
    out: dict[str, Any] = {"backlog": k, "records": count, "complete": count >= k,
                           "other": other, "batch_sizes": sizes, "records_per_s": None}
    if stopped_by:
        out["stopped_by"] = stopped_by
    if first is not None and last is not None:
        span, n = last[0] - first[0], last[1] - first[1]
        out.update(first=first[0], last=last[0], span_s=round(span, 3), span_records=n)
        out["cpu_s"] = {name: round(last[2][name] - first[2][name], 3) for name in procs}
        machine = last[2]["machine"] - first[2]["machine"]
        if span > 0 and n > 0:
            out["records_per_s"] = n / span
            out["cpu_us_per_record"] = {name: round(cpu * 1e6 / n, 1)
                                        for name, cpu in out["cpu_s"].items()}
            # Everything else the machine ran meanwhile (other users' processes), in cores:
            # a measurement is clean only when this is small.
            out["machine_busy_cores"] = round(machine / span, 2)
            out["other_cores"] = round(max(0.0, machine - sum(out["cpu_s"].values())) / span,
                                       2)
    return out


def batch_summary(sizes: Sequence[int], bound: int) -> dict[str, Any]:
    """Batch sizes as results report them (one entry per result).

    Returns:
        ``mean_batch`` (mean over results: the batch a result was in), ``mean_batch_per_batch``
        (results ÷ batches, each batch of size s counting s of its results once),
        ``full_fraction`` (share of results in batches of ``bound``), ``batch_hist``
        (size → results); None values when there are no sizes.
    """
    if not len(sizes):
        return {"mean_batch": None, "mean_batch_per_batch": None, "full_fraction": None,
                "batch_hist": {}}
    a = np.asarray(sizes, dtype=np.int64)
    values, counts = np.unique(a, return_counts=True)
    batches = float(np.sum(counts / values))
    return {
        "mean_batch": round(float(a.mean()), 2),
        "mean_batch_per_batch": round(len(a) / batches, 2),
        "full_fraction": round(float((a >= bound).mean()), 4),
        "batch_hist": {int(v): int(c) for v, c in zip(values, counts, strict=True)},
    }


# -- the rungs ---------------------------------------------------------------------------------


class Hotpath:
    """Runs the rungs of a :class:`HotpathConfig`, each on a fresh broker."""

    def __init__(self, config: HotpathConfig, logs: Path, log: Log = print) -> None:
        self.config, self.logs, self.log = config, logs, log
        self.logs.mkdir(parents=True, exist_ok=True)
        self.run_id = uuid.uuid4().hex[:6]
        self.workload: Workload = workload("digits", run=self.run_id, devices=config.devices)

    def rung(self, name: str) -> dict[str, Any]:
        """Measure one rung (``yardstick`` or ``product``)."""
        if name not in RUNGS:
            raise ValueError(f"unknown rung {name!r}; use one of {', '.join(RUNGS)}")
        cfg = self.config
        app_id = f"bench-hot-{name}-{uuid.uuid4().hex[:6]}"
        phases: dict[str, float] = {}
        began = time.monotonic()
        with fresh_broker(self.logs, f"hotpath-{name}", cfg.broker) as broker:
            phases["broker_start_s"] = round(time.monotonic() - began, 1)
            topics = topic_names(f"{app_id}.")
            bench_topics(broker, {t: cfg.partitions for t in topics.values()})
            started = time.time()
            backlog = cfg.requests if cfg.rate is None else cfg.warmup
            failed = asyncio.run(produce_backlog(broker.bootstrap_servers, topics["request"],
                                                 self.workload, backlog))
            if failed:
                raise RuntimeError(f"{failed} of {backlog} backlog requests failed to send")
            produce_s = time.time() - started
            data_dir = self.logs / f"data-{app_id}"
            common = {"broker": broker.url, "broker_kind": kind_of(broker), "app_id": app_id,
                      "topic_partitions": cfg.partitions, "data_dir": data_dir}
            if name == "yardstick":
                outputs = [topics["result"]]
                child = Child(
                    [sys.executable, "-m", "bench.yardstick"], common,
                    self.logs / f"yardstick-{cfg.broker}.log",
                    {"BENCH_YS_SOURCE": topics["request"], "BENCH_YS_SINK": topics["result"],
                     "BENCH_YS_MAX_BATCH": str(cfg.yardstick_batch or cfg.batch_bound),
                     "BENCH_YS_WITHIN_MS": str(cfg.delay_ms),
                     "BENCH_YS_UVLOOP": "1" if cfg.uvloop else "0"})
            else:
                outputs = [topics["result"], topics["dlq"]]
                extra = {k: v for k, v in cfg.worker_env.items()
                         if not k.startswith("STREAMAPP_")}
                child = Child([sys.executable, "-m", "streamapp", "worker"],
                              {**common, "topic_prefix": f"{app_id}.",
                               **cfg.worker_settings()},
                              self.logs / f"worker-{cfg.broker}.log", extra)
            t_launch = time.time()
            child.start()
            assert child.process is not None
            process = child.process

            def dead() -> str | None:
                code = process.poll()
                return None if code is None else f"{name} exited with status {code}"

            spy = _DelayedProfile(process.pid, cfg.profile_after_s, cfg.profile_s,
                                  self.logs / f"profile-{name}-{cfg.broker}.txt")
            pids = {name: process.pid, "broker": broker.pid or 0, "collector": os.getpid()}
            try:
                if cfg.rate is None:
                    res = asyncio.run(measure_drain(
                        broker.bootstrap_servers, outputs, cfg.requests, pids, measured=name,
                        timeout_s=cfg.drain_timeout_s(), dead=dead,
                        batch_sizes=name == "product"))
                else:
                    res = asyncio.run(self._paced(broker.bootstrap_servers, topics["request"],
                                                  outputs, pids, name, dead))
            finally:
                profile = spy.result()
                stopping = time.monotonic()
                child.stop(timeout_s=20.0)
                phases["child_stop_s"] = round(time.monotonic() - stopping, 1)
                shutil.rmtree(data_dir, ignore_errors=True)
            if not res["complete"]:
                res["log_tail"] = child.log_tail(15)
            stopping = time.monotonic()
        phases["broker_stop_s"] = round(time.monotonic() - stopping, 1)
        # Where a rung's wall time goes (s): for the time limits of a run on the GPU host.
        res["phases"] = {**phases, "produce_s": round(produce_s, 1),
                         "total_s": round(time.monotonic() - began, 1)}
        res["produce_per_s"] = round(cfg.requests / max(produce_s, 1e-6))
        if res.get("first"):
            res["launch_to_first_s"] = round(res["first"] - t_launch, 2)
        res["cpu_us_per_record_self"] = (res.get("cpu_us_per_record") or {}).get(name)
        if profile:
            res["profile"] = profile
        sizes = res.pop("batch_sizes")
        if name == "product":
            res.update(batch_summary(sizes, cfg.batch_bound))
            res["settings"] = {k: str(v) for k, v in cfg.worker_settings().items()}
        else:
            res["take_events"] = {"max_": cfg.yardstick_batch or cfg.batch_bound,
                                  "within_ms": cfg.delay_ms, "uvloop": cfg.uvloop}
        self.log("  " + format_rung(name, res, cfg.batch_bound))
        return res

    async def _paced(self, bootstrap: str, request_topic: str, outputs: list[str],
                     pids: dict[str, int], name: str, dead: Callable[[], str | None]
                     ) -> dict[str, Any]:
        """The warm-up's outputs, then ``requests`` sent at ``rate`` while they are measured."""
        cfg = self.config
        assert cfg.rate is not None
        window = asyncio.Event()
        sender = asyncio.create_task(_send_paced(bootstrap, request_topic, self.workload,
                                                 cfg.rate, cfg.requests, window, cfg.warmup))
        try:
            res = await measure_drain(
                bootstrap, outputs, cfg.warmup + cfg.requests, pids, measured=name,
                timeout_s=cfg.drain_timeout_s(), dead=dead, batch_sizes=name == "product",
                skip=cfg.warmup, window=window)
        finally:
            if not sender.done():
                sender.cancel()
            behind_ms = (await asyncio.gather(sender, return_exceptions=True))[0]
        res["rate"] = cfg.rate
        if isinstance(behind_ms, float):
            res["sender_max_behind_ms"] = round(behind_ms, 1)
        return res


async def _send_paced(bootstrap: str, topic: str, wl: Workload, rate: float, n: int,
                      start: asyncio.Event, first: int) -> float:
    """Once ``start`` is set, send requests ``first`` .. ``first + n - 1`` of ``wl`` at
    ``rate``/s on a schedule (``ts`` the scheduled time, as :func:`bench.load.open_loop`);
    returns how far (ms) the sends fell behind the schedule at most."""
    await start.wait()
    producer = load._producer(bootstrap, {})
    await producer.start()
    try:
        sender = load._Sender(producer, topic, wl.payload)
        behind = await load.send_paced(sender, rate, n, time.time(), first)
        await sender.flush()
        return behind * 1000.0
    finally:
        await producer.stop()


class _DelayedProfile:
    """``py-spy record`` on ``pid`` for ``seconds``, starting ``after_s`` from now (a timer
    thread), so a drain's profile leaves out the worker's start-up; :meth:`result` waits for
    it and returns :func:`bench.profile.summarize` of the samples (``{}`` when
    ``seconds`` is 0, ``skipped``/``error`` when py-spy is missing or failed)."""

    def __init__(self, pid: int, after_s: float, seconds: float, raw: Path) -> None:
        self.pid, self.seconds, self.raw = pid, seconds, raw
        self.out: dict[str, Any] = {}
        self.spy: Any = None
        self.timer: threading.Timer | None = None
        if seconds > 0:
            if py_spy() is None:
                self.out["skipped"] = "py-spy not installed"
            else:
                self.timer = threading.Timer(after_s, self._start)
                self.timer.daemon = True
                self.timer.start()

    def _start(self) -> None:
        self.spy = profile_pid(self.pid, self.seconds, self.raw)

    def result(self) -> dict[str, Any]:
        if self.timer is None:
            return self.out
        self.timer.cancel()
        self.timer.join()
        if self.spy is None:
            return {"skipped": "the drain ended before the profile started"}
        from bench.profile import summarize

        _, err = self.spy.communicate(timeout=self.seconds + 60)
        if self.spy.returncode != 0 or not self.raw.is_file():
            self.out["error"] = err.decode(errors="replace")[-500:]
        else:
            self.out.update(summarize(self.raw, duration_s=max(1, int(self.seconds))))
            self.out["raw_file"] = self.raw.name
        return self.out


def hotpath_ratios(rungs: Mapping[str, Mapping[str, Any]], bound: int,
                   paced: bool = False) -> dict[str, Any]:
    """Issue 17's ratios (None where an input is missing), each with its target and whether
    it is met: ``cpu_per_record`` (product ÷ yardstick CPU µs per record), ``rate`` (product
    ÷ yardstick records/s), ``batch_fill`` (the product's mean batch per result ÷ ``bound``).
    ``paced``: the targets are the backlog's; at a paced rate ``cpu_per_record`` and ``rate``
    are reported without one (``target`` and ``met`` None)."""
    y, p = rungs.get("yardstick", {}), rungs.get("product", {})

    def div(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    values = {
        "cpu_per_record": div(p.get("cpu_us_per_record_self"), y.get("cpu_us_per_record_self")),
        "rate": div(p.get("records_per_s"), y.get("records_per_s")),
        "batch_fill": div(p.get("mean_batch"), bound),
    }
    out: dict[str, Any] = {}
    if paced:
        del values["batch_fill"]
        return {key: {"value": None if value is None else round(value, 3), "target": None,
                      "op": "", "met": None} for key, value in values.items()}
    for key, value in values.items():
        op, bound_value = TARGETS[key]
        met = None if value is None else (value <= bound_value if op == "<=" else
                                          value >= bound_value)
        out[key] = {"value": None if value is None else round(value, 3), "target": bound_value,
                    "op": op, "met": met}
    return out


# -- the report --------------------------------------------------------------------------------


def _f(value: Any, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def format_rung(name: str, res: Mapping[str, Any], bound: int) -> str:
    """One line for one rung."""
    cpu = res.get("cpu_s", {})
    per = res.get("cpu_us_per_record") or {}
    line = (f"{name}: {_f(res.get('records_per_s'))} records/s first→last "
            f"({_f(res.get('span_records'))} records in {_f(res.get('span_s'), '.2f')} s), "
            f"CPU {_f(cpu.get(name), '.2f')} s = {_f(per.get(name), ',.1f')} µs/record "
            f"(broker {_f(per.get('broker'), ',.1f')} µs/record; other processes "
            f"{_f(res.get('other_cores'), '.2f')} cores)")
    if name == "product":
        full = res.get("full_fraction")
        line += (f", mean batch {_f(res.get('mean_batch'), '.1f')} per result "
                 f"({_f(res.get('mean_batch_per_batch'), '.1f')} per batch), "
                 f"{_f(None if full is None else 100 * full, '.0f')} % of results in full "
                 f"batches of {bound}")
        if res.get("other"):
            line += f", {res['other']} dead letters"
    if res.get("profile"):
        from bench.profile import describe

        line += f"\n    profile: {describe(res['profile'])}"
    if not res.get("complete"):
        line += (f"; INCOMPLETE: {res.get('records')} of {res.get('backlog')}"
                 f" ({res.get('stopped_by', '?')})")
    return line


def format_hotpath(results: Mapping[str, Any]) -> str:
    """The printed report of a ``bench.json`` written by :func:`run_hotpath`."""
    cfg = results["config"]
    env = results.get("env", {})
    rungs = results.get("rungs", {})
    bound = results.get("max_batch_size", cfg["max_batch_size"])
    broker = results.get("broker", cfg["broker"])
    lines = [
        f"== hot path on {broker}: {cfg['requests']:,} digits requests "
        f"({results.get('payload_bytes', '?')} B, msgpack) from {cfg['devices']} devices, "
        f"{cfg['partitions']} partitions, " + (
            "the backlog produced before the consumer starts" if cfg.get("rate") is None
            else f"sent at {cfg['rate']:,.0f}/s once a warm-up of {cfg['warmup']:,} drained"),
        f"   {env.get('date_utc', '')}, {env.get('cpu', '')} × {env.get('cores', '?')}, "
        f"Python {env.get('python', '?')}, faust-streaming {env.get('faust-streaming', '?')}, "
        f"aiokafka {env.get('aiokafka', '?')}",
    ]
    for name in RUNGS:
        if name in rungs:
            res = rungs[name]
            if "error" in res:
                lines.append(f"  {name}: FAILED: {res['error']}")
            else:
                lines.append("  " + format_rung(name, res, bound))
    y = rungs.get("yardstick", {}).get("take_events")
    if y:
        lines.append(f"  (yardstick: take_events({y['max_']}, {y['within_ms']:g} ms), "
                     f"send_batch per partition{', uvloop' if y.get('uvloop') else ''}; "
                     f"product: streamapp worker, {bound} / {results.get('delay_ms', '?')} ms)")
    labels = {"cpu_per_record": "product CPU/record ÷ yardstick CPU/record",
              "rate": "product rate ÷ yardstick rate",
              "batch_fill": f"mean batch (per result) ÷ max_batch_size {bound}"}
    ratios = results.get("ratios", {})
    if ratios:
        paced = cfg.get("rate") is not None
        lines.append("  ratios" + (" (issue 17's targets are the backlog's; none at a paced "
                                   "rate):" if paced else " (issue 17 targets):"))
        for key, label in labels.items():
            if key not in ratios:
                continue
            r = ratios[key]
            met = {True: "met", False: "MISSED", None: "not measured"}[r.get("met")]
            lines.append(f"    {label} = {_f(r.get('value'), '.2f')}" + (
                "" if paced else f" (target {r.get('op', '')} {r.get('target', '')}: {met})"))
    return "\n".join(lines)


def run_hotpath(config: HotpathConfig, out: Path, *, log: Log = print,
                logs: Path | None = None) -> dict[str, Any]:
    """Measure every rung of ``config``; write ``bench.json`` and ``report.txt`` under ``out``
    (after each rung).

    A rung that fails is recorded with its ``error`` and the others still run.

    Returns:
        The results (as in ``bench.json``).
    """
    from streamapp.kafka_server import KAFKA_VERSION

    out.mkdir(parents=True, exist_ok=True)
    bench = Hotpath(config, logs or out / "logs", log)
    broker = (f"Apache Kafka {KAFKA_VERSION}" if config.broker == "kafka"
              else "the embedded broker (Tansu)")
    results: dict[str, Any] = {
        "command": "python -m bench hotpath", "config": asdict(config), "env": environment(),
        "broker": broker, "payload_bytes": bench.workload.payload_bytes,
        "max_batch_size": config.batch_bound, "delay_ms": config.delay_ms, "rungs": {},
    }
    results["config"]["worker_env"] = dict(config.worker_env)
    log(f"== hot path on {broker}: {config.requests:,} requests"
        + ("" if config.rate is None else f" at {config.rate:,.0f}/s") + ", rungs "
        f"{', '.join(config.rungs)}")
    for name in config.rungs:
        try:
            results["rungs"][name] = bench.rung(name)
        except Exception as exc:  # report what failed, measure the rest
            log(f"  {name}: FAILED: {type(exc).__name__}: {exc}")
            results["rungs"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        # After every rung: a run killed by an outer time limit keeps what it measured.
        results["ratios"] = hotpath_ratios(results["rungs"], config.batch_bound,
                                           paced=config.rate is not None)
        (out / "bench.json").write_text(_dumps(results))
        (out / "report.txt").write_text(format_hotpath(results) + "\n")
    return results


def _dumps(results: Mapping[str, Any]) -> str:
    import json

    return json.dumps(results, indent=1, default=str)
