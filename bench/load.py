"""Load generation and result collection with plain aiokafka, as a gateway and a sink would.

Three drivers, each one asyncio coroutine in the benchmark process:

* :func:`closed_loop`: keeps ``window`` requests outstanding (sent, no outcome yet) for a while:
  saturation throughput in steady state without an unbounded backlog;
* :func:`open_loop`: sends at a fixed rate on a schedule; each request's ``ts`` is its
  *scheduled* send time, so a generator that falls behind cannot hide queueing (coordinated
  omission); latency is result arrival − ``ts``. Given a payload factory, the generator runs
  in a process of its own (:class:`GeneratorProcess`), so that neither it nor the collector
  waits for the other's Python;
* :func:`transport`: produce ``n`` payloads as fast as possible and consume them back from the
  same topic, in one process: the transport ceiling.

Payloads come from a :data:`PayloadFn` ``(n, ts) -> (key, value)``; outcomes are parsed by a
:data:`ParseFn` ``value -> (request ts, batch size or None[, stages])``; ``stages``: the
result's own ``(queue_ms, infer_ms, e2e_ms)`` (issue 17: where a request's latency goes).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import os
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from streamapp.tasks import cancel_and_wait

__all__ = ["PROBE_KEY", "Collector", "GeneratorProcess", "closed_loop", "open_loop",
           "percentiles", "produce_only", "quiet_gc", "transport", "transport_options"]

PayloadFn = Callable[[int, float], tuple[bytes, bytes]]
#: Builds a :data:`PayloadFn` in another process (picklable: a module-level function or a
#: ``functools.partial`` of one, e.g. :meth:`bench.workloads.Workload.payload_factory`).
PayloadFactory = Callable[[], PayloadFn]
ParseFn = Callable[[bytes], tuple[Any, ...]]

#: Key of readiness probes; collectors skip records with this key.
PROBE_KEY = b"__bench_probe__"


def percentiles(values_ms: Sequence[float]) -> dict[str, float | None]:
    """p50/p95/p99/max of latencies (ms); None when there are none."""
    if not len(values_ms):
        return {"p50_ms": None, "p95_ms": None, "p99_ms": None, "max_ms": None}
    a = np.asarray(values_ms, dtype=np.float64)
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    return {"p50_ms": float(p50), "p95_ms": float(p95), "p99_ms": float(p99),
            "max_ms": float(a.max())}


@contextlib.contextmanager
def quiet_gc(out: dict[str, Any]) -> Iterator[None]:
    """Keep this process's garbage collector from pausing the generator and the collector
    during a latency measurement, and record what it did in ``out["bench_gc"]``.

    The benchmark process holds every outcome of its earlier measurements (about 1.3 GB on
    the GPU host after a saturation run), so a full collection there can take longer than
    the latency budget (``generator_max_behind_ms`` reached 977 ms on the H100 host,
    issue 17, tenth session), and a pause both delays sends and stamps arrivals late: the
    harness's own pause was counted as the product's latency. Here everything alive is
    collected and frozen (``gc.freeze``), then automatic collection is off until the
    measurement ends. ``BENCH_GC_QUIET=0`` leaves the collector on (what earlier runs
    measured); either way ``bench_gc`` gives the collections of this process meanwhile:
    ``{"quiet", "collections", "total_ms", "max_ms"}`` (wall time of each collection).
    """
    quiet = os.environ.get("BENCH_GC_QUIET", "1") != "0"
    started: list[float] = []
    pauses: list[float] = []

    def timer(phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            pauses.append(time.perf_counter() - started[0])

    if quiet:
        gc.collect()
        gc.freeze()
        gc.disable()
    gc.callbacks.append(timer)
    try:
        yield
    finally:
        gc.callbacks.remove(timer)
        if quiet:
            gc.enable()
            gc.unfreeze()
        out["bench_gc"] = {"quiet": quiet, "collections": len(pauses),
                           "total_ms": round(1e3 * sum(pauses), 1),
                           "max_ms": round(1e3 * max(pauses, default=0.0), 1)}


@dataclass
class Collector:
    """Reads outcome topics from the beginning (``from_end``: only what arrives after
    :meth:`start`); counts records, parses those of the first topic.

    Attributes:
        count: Outcome records read (every topic, probes excluded).
        arrivals / req_ts / batch: Per parsed record: epoch arrival time, request ts, batch size.
        stages: Per parsed record whose parse gave them: ``(queue_ms, infer_ms, e2e_ms)``.
    """

    bootstrap: str
    topics: Sequence[str]
    parse: ParseFn | None = None
    count: int = 0
    other: int = 0
    #: Parsed records whose request ts is at or after ``min_ts`` (this run's own requests).
    fresh: int = 0
    min_ts: float = 0.0
    from_end: bool = False
    parse_errors: int = 0
    arrivals: list[float] = field(default_factory=list)
    req_ts: list[float] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)
    stages: list[tuple[float, float, float]] = field(default_factory=list)
    _consumer: AIOKafkaConsumer | None = None
    _task: asyncio.Task[None] | None = None
    _progress: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self) -> Collector:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap, group_id=None, enable_auto_commit=False,
            auto_offset_reset="earliest", fetch_max_wait_ms=20,
            max_partition_fetch_bytes=8 << 20,
            # an exactly_once worker's outcomes count once committed (at_least_once writes no
            # transactions: the same records either way)
            isolation_level="read_committed",
        )
        await consumer.start()
        tps = []
        for topic in self.topics:
            for _ in range(100):
                parts = consumer.partitions_for_topic(topic)
                if parts:
                    break
                await consumer._client.force_metadata_update()
            else:
                raise RuntimeError(f"topic {topic!r} does not exist")
            tps += [TopicPartition(topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        if self.from_end:
            await consumer.seek_to_end(*tps)
        else:
            await consumer.seek_to_beginning(*tps)
        self._consumer = consumer
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        assert self._consumer is not None
        first = self.topics[0]
        parse = self.parse
        while True:
            batches = await self._consumer.getmany(timeout_ms=100, max_records=10_000)
            now = time.time()
            for tp, records in batches.items():
                for record in records:
                    if record.key == PROBE_KEY:
                        continue
                    self.count += 1
                    if tp.topic != first:
                        self.other += 1
                    elif parse is not None and record.value is not None:
                        try:
                            parsed = parse(record.value)
                            ts, size = parsed[0], parsed[1]
                        except Exception:
                            self.parse_errors += 1
                            continue
                        if ts >= self.min_ts:
                            self.fresh += 1
                        self.arrivals.append(now)
                        self.req_ts.append(ts)
                        if size is not None:
                            self.batch.append(size)
                        if len(parsed) > 2:
                            self.stages.append(parsed[2])
            if batches:
                self._progress.set()

    async def wait_progress(self, timeout_s: float) -> None:
        self._progress.clear()
        try:
            await asyncio.wait_for(self._progress.wait(), timeout_s)
        except TimeoutError:
            pass

    async def wait_count(self, n: int, timeout_s: float, *, fresh: bool = False) -> bool:
        """Wait until ``n`` records were read (``fresh``: parsed ones of this run)."""
        deadline = time.monotonic() + timeout_s

        def have() -> int:
            return self.fresh if fresh else self.count

        while have() < n and time.monotonic() < deadline:
            await self.wait_progress(0.2)
        return have() >= n

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        if self._consumer is not None:
            await self._consumer.stop()

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        """Outcomes that arrived in ``[t0, t1]`` (epoch s): rate, latency, batch sizes."""
        arr = np.asarray(self.arrivals)
        sel = (arr >= t0) & (arr <= t1)
        lat = (arr[sel] - np.asarray(self.req_ts)[sel]) * 1000.0
        out: dict[str, Any] = {"results_per_s": float(sel.sum()) / (t1 - t0)}
        out.update(percentiles(lat.tolist()))
        if self.batch:
            out.update(batch_stats(np.asarray(self.batch)[sel[: len(self.batch)]]))
        return out


def batch_stats(sizes: np.ndarray) -> dict[str, Any]:
    """Mean batch size (per request) and the histogram of batch sizes seen by requests."""
    if not sizes.size:
        return {"mean_batch": None, "batch_hist": {}}
    values, counts = np.unique(sizes, return_counts=True)
    return {"mean_batch": float(sizes.mean()),
            "batch_hist": {int(v): int(c) for v, c in zip(values, counts, strict=True)}}


def _producer(bootstrap: str, options: Mapping[str, Any]) -> AIOKafkaProducer:
    kwargs = {"acks": "all", "linger_ms": 1, "max_batch_size": 1 << 16,
              "request_timeout_ms": 30_000, **options}
    return AIOKafkaProducer(bootstrap_servers=bootstrap, **kwargs)


class _Sender:
    """Sends without waiting for each ack; counts failures."""

    def __init__(self, producer: AIOKafkaProducer, topic: str, payload: PayloadFn) -> None:
        self.producer, self.topic, self.payload = producer, topic, payload
        self.sent = 0
        self.failed = 0
        self._pending: set[asyncio.Future[Any]] = set()

    async def send(self, n: int, ts: float) -> None:
        key, value = self.payload(n, ts)
        fut = await self.producer.send(self.topic, value, key=key)
        self.sent += 1
        self._pending.add(fut)
        fut.add_done_callback(self._done)

    def _done(self, fut: asyncio.Future[Any]) -> None:
        self._pending.discard(fut)
        if fut.cancelled() or fut.exception() is not None:
            self.failed += 1

    async def flush(self) -> None:
        await self.producer.flush()


async def send_paced(sender: _Sender, rate: float, n: int, start: float, first: int = 0
                     ) -> float:
    """Send requests ``first`` .. ``first + n - 1`` at ``rate``/s from epoch ``start`` on a
    schedule, each with its *scheduled* time as ``ts`` (a late sender cannot hide queueing);
    returns how far (s) the sends fell behind the schedule at most."""
    behind = 0.0
    i = 0
    while i < n:
        now = time.time()
        due = min(n, int((now - start) * rate) + 1)
        if due > i:
            behind = max(behind, now - (start + i / rate))
        while i < due:
            await sender.send(first + i, start + i / rate)
            i += 1
        delay = start + i / rate - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
    return behind


async def probe_until_flowing(bootstrap: str, source: str, sink: str, timeout_s: float) -> float:
    """Send probe records to ``source`` until one comes out of ``sink``; seconds it took."""
    started = time.monotonic()
    producer = _producer(bootstrap, {})
    await producer.start()
    consumer = AIOKafkaConsumer(sink, bootstrap_servers=bootstrap, group_id=None,
                                auto_offset_reset="earliest", fetch_max_wait_ms=50)
    await consumer.start()
    try:
        while time.monotonic() - started < timeout_s:
            await producer.send_and_wait(source, b"probe", key=PROBE_KEY)
            got = await consumer.getmany(timeout_ms=500)
            if any(r.key == PROBE_KEY for rs in got.values() for r in rs):
                return time.monotonic() - started
        raise TimeoutError(f"nothing came out of {sink} within {timeout_s} s")
    finally:
        await consumer.stop()
        await producer.stop()


async def closed_loop(
    bootstrap: str, request_topic: str, outcome_topics: Sequence[str], payload: PayloadFn,
    parse: ParseFn | None, *, window: int, warmup_s: float, duration_s: float,
    producer_options: Mapping[str, Any] | None = None, from_end: bool = False,
) -> dict[str, Any]:
    """Keep ``window`` requests outstanding; measure outcomes/s over ``duration_s`` after
    ``warmup_s``. Latency here is queueing behind the window (reported, not the product's
    latency: see :func:`open_loop`). ``from_end``: outcomes already in the topics (an earlier
    measurement on the same workers) are not counted."""
    collector = await Collector(bootstrap, outcome_topics, parse, from_end=from_end).start()
    producer = _producer(bootstrap, {"linger_ms": 2, **(producer_options or {})})
    await producer.start()
    sender = _Sender(producer, request_topic, payload)
    t_start = time.time()
    t0, t1 = t_start + warmup_s, t_start + warmup_s + duration_s
    try:
        n = 0
        while time.time() < t1:
            burst = 0
            while n - collector.count < window and burst < 500:
                await sender.send(n, time.time())
                n += 1
                burst += 1
            if burst >= 500:
                await asyncio.sleep(0)
            else:
                await collector.wait_progress(0.05)
        # Let the window drain, so that whatever runs next on this worker starts clean.
        drained = await collector.wait_count(sender.sent, max(10.0, 2 * duration_s))
        out = collector.window(t0, t1)
        out.update({
            "mode": "closed_loop", "window": window, "sent": sender.sent, "drained": drained,
            "send_failures": sender.failed, "outcomes": collector.count,
            "dead_letters_or_other": collector.other, "parse_errors": collector.parse_errors,
            "t0": t0, "t1": t1, "warmup_s": warmup_s, "duration_s": duration_s,
        })
        return out
    finally:
        await producer.stop()
        await collector.stop()


class GeneratorProcess:
    """The open loop's generator in a process of its own (``spawn``): it builds its payloads
    with ``factory``, starts an aiokafka producer, and on :meth:`run` sends ``n`` requests
    at ``rate``/s with :func:`send_paced` from the epoch it is given.

    Why a process: in one event loop with the collector, the generator fell 0.6–1.0 s
    behind its schedule at 6,500–7,500 requests/s on the H100 host, and the benchmark
    process was 100 % busy during the plain aiokafka round trip whose p99 is the budget's
    transport term (issue 17, eleventh session). A late generator sends in bursts and its
    lateness counts as latency (``ts`` is the scheduled time), so the harness measured itself.

    :meth:`start` waits until its producer is connected; :meth:`stop` ends it. Both
    :meth:`start` and :meth:`run` raise RuntimeError when the process fails (its traceback in
    the message), dies or says nothing in time.
    """

    def __init__(self, bootstrap: str, topic: str, factory: PayloadFactory, *, rate: float,
                 n: int, producer_options: Mapping[str, Any] | None = None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(
            target=_generator_main, name="bench-generator", daemon=True,
            args=(child, bootstrap, topic, factory, rate, n, dict(producer_options or {})))
        self._child = child

    async def _recv(self, timeout_s: float) -> Any:
        loop = asyncio.get_running_loop()
        ready = await loop.run_in_executor(None, self._conn.poll, timeout_s)
        if not ready:
            raise RuntimeError(f"the generator process said nothing in {timeout_s:.0f} s")
        try:
            kind, value = self._conn.recv()
        except EOFError:
            self._process.join(5)
            raise RuntimeError("the generator process died (exit code "
                               f"{self._process.exitcode})") from None
        if kind == "error":
            raise RuntimeError(f"the generator process failed:\n{value}")
        return value

    async def start(self, timeout_s: float = 120.0) -> GeneratorProcess:
        self._process.start()
        self._child.close()
        try:
            await self._recv(timeout_s)
        except BaseException:
            await self.stop()
            raise
        return self

    async def run(self, start: float, timeout_s: float) -> dict[str, Any]:
        """Send from epoch ``start``; returns ``{"sent", "failed", "max_behind_s",
        "send_end", "cpu_pct", "bench_gc"}`` once every send is acknowledged (``cpu_pct``:
        the process's CPU from ``start`` to its last send, % of one core)."""
        self._conn.send(start)
        return await self._recv(timeout_s)

    async def stop(self) -> None:
        """End the process (idempotent; it ends on its own once the pipe closes)."""
        self._conn.close()
        if self._process.pid is None:
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._process.join, 10)
        if self._process.is_alive():
            self._process.kill()


def _generator_main(conn: Any, bootstrap: str, topic: str, factory: PayloadFactory,
                    rate: float, n: int, producer_options: dict[str, Any]) -> None:
    """The body of :class:`GeneratorProcess` (in the child)."""
    try:
        asyncio.run(_generate(conn, bootstrap, topic, factory(), rate, n, producer_options))
    except BaseException:  # the parent reports it
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


async def _generate(conn: Any, bootstrap: str, topic: str, payload: PayloadFn, rate: float,
                    n: int, producer_options: dict[str, Any]) -> None:
    producer = _producer(bootstrap, producer_options)
    await producer.start()
    try:
        sender = _Sender(producer, topic, payload)
        conn.send(("ready", None))
        start = conn.recv()  # blocks this loop until the parent says when: nothing is due yet
        gc_out: dict[str, Any] = {}
        with quiet_gc(gc_out):
            cpu0 = time.process_time()
            behind = await send_paced(sender, rate, n, start)
            send_end = time.time()
            cpu_pct = 100.0 * (time.process_time() - cpu0) / max(send_end - start, 1e-9)
            await sender.flush()
        conn.send(("done", {"sent": sender.sent, "failed": sender.failed,
                            "max_behind_s": behind, "send_end": send_end,
                            "cpu_pct": round(cpu_pct, 1), **gc_out}))
    finally:
        await producer.stop()


async def open_loop(
    bootstrap: str, request_topic: str, outcome_topics: Sequence[str], payload: PayloadFn,
    parse: ParseFn, *, rate: float, warmup_s: float, duration_s: float, drain_s: float,
    producer_options: Mapping[str, Any] | None = None,
    payload_factory: PayloadFactory | None = None,
) -> dict[str, Any]:
    """Send at ``rate``/s for ``warmup_s + duration_s`` (``ts`` = scheduled time), wait up to
    ``drain_s`` for the outcomes, and report the latency of requests scheduled in the measured
    window (arrival − ts, so queueing behind a late generator counts).

    With ``payload_factory`` (it must build the same payloads as ``payload``) the generator
    runs in a :class:`GeneratorProcess` and this process only collects, unless
    ``BENCH_GENERATOR=inline`` (one event loop for both, as every run before the twelfth
    session measured). ``generator`` in the result says which ran; ``generator_gc`` gives
    the generator process's collections (none: its collector is off, :func:`quiet_gc`) and
    ``generator_cpu_pct`` its CPU while it sent (% of one core, all its threads).
    """
    # min_ts from the start: the collector reads from the beginning at once, and outcomes of
    # an earlier run on the same topics (smoke: the saturation run's) must not count as this
    # run's while the producer starts (under load they made a level "complete" with none of
    # its own results read).
    collector = await Collector(bootstrap, outcome_topics, parse, min_ts=time.time()).start()
    total = max(1, int(rate * (warmup_s + duration_s)))
    separate = payload_factory is not None and os.environ.get("BENCH_GENERATOR") != "inline"
    generator: GeneratorProcess | None = None
    producer: AIOKafkaProducer | None = None
    gc_out: dict[str, Any] = {"generator": "process" if separate else "inline"}
    try:
        if separate:
            assert payload_factory is not None
            generator = await GeneratorProcess(bootstrap, request_topic, payload_factory,
                                               rate=rate, n=total,
                                               producer_options=producer_options).start()
        else:
            producer = _producer(bootstrap, dict(producer_options or {}))
            await producer.start()
        sender = _Sender(producer, request_topic, payload) if producer else None
        with quiet_gc(gc_out):  # first: its collection must not eat into the schedule
            start = time.time() + 0.05
            # Outcomes of earlier runs on this topic do not count; 1 ms of slack because a
            # result's ts is reconstructed from e2e_ms, which is rounded to the microsecond.
            collector.min_ts = start - 0.001
            if generator is not None:
                sent = await generator.run(start, warmup_s + duration_s + 120.0)
                max_behind, send_end = sent["max_behind_s"], sent["send_end"]
                n_sent, n_failed = sent["sent"], sent["failed"]
                gc_out["generator_gc"] = sent["bench_gc"]
                gc_out["generator_cpu_pct"] = sent["cpu_pct"]
            else:
                assert sender is not None
                max_behind = await send_paced(sender, rate, total, start)
                send_end = time.time()
                await sender.flush()
                n_sent, n_failed = sender.sent, sender.failed
            complete = await collector.wait_count(total, drain_s, fresh=True)
        ts = np.asarray(collector.req_ts)
        arr = np.asarray(collector.arrivals)
        t0, t1 = start + warmup_s, start + warmup_s + duration_s
        sel = (ts >= t0) & (ts < t1)
        lat = ((arr - ts) * 1000.0)[sel]
        out: dict[str, Any] = {
            "mode": "open_loop", "rate": rate, "sent": n_sent,
            "send_rate": n_sent / max(send_end - start, 1e-9),
            "send_failures": n_failed, "outcomes": collector.fresh,
            "complete": complete, "missing": total - collector.fresh,
            "dead_letters_or_other": collector.other, "parse_errors": collector.parse_errors,
            "generator_max_behind_ms": max_behind * 1000.0,
            "measured_requests": int(sel.sum()),
            "results_per_s": float(((arr >= t0) & (arr < t1)).sum()) / duration_s,
            "t0": t0, "t1": t1, "warmup_s": warmup_s, "duration_s": duration_s, **gc_out,
        }
        out.update(percentiles(lat.tolist()))
        if collector.batch:
            out.update(batch_stats(np.asarray(collector.batch)[sel[: len(collector.batch)]]))
        if collector.stages and len(collector.stages) == len(collector.req_ts):
            stages = np.asarray(collector.stages, dtype=np.float64)[sel]
            out["stages_ms"] = {
                name: {"p50": float(np.percentile(stages[:, i], 50)),
                       "p99": float(np.percentile(stages[:, i], 99))}
                for i, name in enumerate(("queue", "infer", "e2e")) if len(stages)}
        return out
    finally:
        if generator is not None:
            await generator.stop()
        if producer is not None:
            await producer.stop()
        await collector.stop()


def transport_options(producer_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The aiokafka producer options of the transport ceiling (and of the produce-only anchor):
    ``acks="all"``, ``linger_ms=5``, ``max_batch_size`` 64 KiB, then ``producer_options``."""
    return {"acks": "all", "linger_ms": 5, "max_batch_size": 1 << 16,
            "request_timeout_ms": 30_000, **(producer_options or {})}


def _cached(payload: PayloadFn, n: int) -> tuple[PayloadFn, list[tuple[bytes, bytes]]]:
    """Up to 4,096 payloads encoded ahead (encoding is the generator's cost, not the
    transport's), served round-robin."""
    payloads = [payload(i, time.time()) for i in range(min(n, 4096))]

    def cached(i: int, _ts: float) -> tuple[bytes, bytes]:
        return payloads[i % len(payloads)]

    return cached, payloads


async def produce_only(
    bootstrap: str, topic: str, payload: PayloadFn, *, n: int,
    producer_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Produce ``n`` payloads as fast as aiokafka can, nothing consuming: the aiokafka side of
    the comparison with Kafka's ProducerPerformance (same options as :func:`transport`)."""
    return await transport(bootstrap, topic, payload, n=n, producer_options=producer_options,
                           consume=False)


async def transport(
    bootstrap: str, topic: str, payload: PayloadFn, *, n: int,
    producer_options: Mapping[str, Any] | None = None, timeout_s: float = 120.0,
    consume: bool = True,
) -> dict[str, Any]:
    """Produce ``n`` payloads as fast as aiokafka can while a consumer reads them back
    (producer options: :func:`transport_options`); ``consume=False``: nobody reads, the rate
    is produce-and-acknowledged."""
    collector = await Collector(bootstrap, [topic], None).start() if consume else None
    producer = _producer(bootstrap, transport_options(producer_options))
    await producer.start()
    sender = _Sender(producer, topic, payload)
    sender.payload, payloads = _cached(payload, n)
    try:
        started = time.time()
        for i in range(n):
            await sender.send(i, 0.0)
        await sender.flush()
        produced = time.time()
        complete = await collector.wait_count(n, timeout_s) if collector else not sender.failed
        done = time.time()
        nbytes = sum(len(k) + len(v) for k, v in payloads) / len(payloads) * n
        received = collector.count if collector else n - sender.failed
        return {
            "messages": n, "complete": complete, "send_failures": sender.failed,
            "produce_per_s": n / (produced - started),
            "msgs_per_s": received / (done - started),
            "mb_per_s": nbytes / (done - started) / 1e6,
            "payload_bytes": int(nbytes / n),
            "t0": started, "t1": done,
        }
    finally:
        await producer.stop()
        if collector is not None:
            await collector.stop()
