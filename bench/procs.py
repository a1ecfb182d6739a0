"""Processes a measurement needs: a fresh broker, a worker or forwarder, samplers, a profiler."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import psutil

from streamapp.broker import EmbeddedBroker
from streamapp.children import free_port, popen_child, terminate_group
from streamapp.kafka import create_topics
from streamapp.kafka_server import JVM_OPTS_ENV, KafkaBroker
from streamapp.process import WorkerProcess

__all__ = ["BENCH_KAFKA_JVM_OPTS", "Broker", "BrokerKind", "Forwarder", "Sampler",
           "bench_topics", "fresh_broker", "kind_of", "profile_pid", "profiling", "start_worker"]

#: A broker of either kind (the same interface: bootstrap_servers, url, pid).
Broker = EmbeddedBroker | KafkaBroker
BrokerKind = Literal["embedded", "kafka"]
#: JVM options of the benchmark's Apache Kafka: those of Kafka's own kafka-server-start.sh and
#: kafka-run-class.sh (1 GB heap, G1), not the tests' C1-only JIT of
#: streamapp.kafka_server.DEFAULT_JVM_OPTS (faster start, slower code). $STREAMAPP_KAFKA_JVM_OPTS,
#: when set, wins.
BENCH_KAFKA_JVM_OPTS = ("-Xmx1G -Xms1G -server -XX:+UseG1GC -XX:MaxGCPauseMillis=20 "
                        "-XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent "
                        "-XX:MaxInlineLevel=15 -Djava.awt.headless=true")


@contextlib.contextmanager
def fresh_broker(log_dir: Path, name: str, kind: BrokerKind = "embedded",
                 nodes: int | None = None,
                 properties: Mapping[str, str] | None = None) -> Iterator[Broker]:
    """A new broker for one measurement (or one workload, on Apache Kafka).

    ``embedded``: Tansu, fresh per measurement (its log length then does not carry over:
    shared/BROKER.md item 3). ``kafka``: Apache Kafka of ``nodes`` nodes (KRaft, temporary
    data directory, the tests' broker properties: streamapp.kafka_server.broker_properties,
    with the 2-core thread counts only on a machine of at most 4 cores;
    :data:`BENCH_KAFKA_JVM_OPTS`); its log is copied to ``log_dir`` when it stops.
    ``nodes`` None: ``$BENCH_KAFKA_NODES``, else 1. Each node leads about 1/``nodes`` of
    every topic's partitions (replication factor 1 below 3 nodes). ``$BENCH_KAFKA_SMALL=1``
    forces the 2-core thread counts (2 network, 2 I/O threads) on any machine, for an A/B.
    ``properties`` adds or overrides broker properties, and ``$BENCH_KAFKA_PROPS="key=value,..."``
    overrides both (e.g. ``group.initial.rebalance.delay.ms=0``, the test brokers' value).
    """
    if kind == "embedded":
        with EmbeddedBroker(log_path=log_dir / f"broker-{name}.log") as broker:
            yield broker
        return
    previous = os.environ.get(JVM_OPTS_ENV)
    os.environ[JVM_OPTS_ENV] = previous or BENCH_KAFKA_JVM_OPTS
    count = nodes if nodes is not None else int(os.environ.get("BENCH_KAFKA_NODES") or 1)
    small = True if os.environ.get("BENCH_KAFKA_SMALL") == "1" else None
    extra = dict(properties or {})
    extra |= dict(kv.split("=", 1) for kv in os.environ.get("BENCH_KAFKA_PROPS", "").split(",")
                  if "=" in kv)
    kafka = KafkaBroker(count, small_machine=small, extra_properties=extra)
    try:
        kafka.start()
    finally:
        if previous is None:
            os.environ.pop(JVM_OPTS_ENV, None)
    try:
        yield kafka
    finally:
        if kafka.log_path is not None and kafka.log_path.is_file():
            with contextlib.suppress(OSError):
                shutil.copyfile(kafka.log_path, log_dir / f"kafka-{name}.log")
        kafka.stop()


def bench_topics(broker: Broker, topics: Mapping[str, int], timeout_s: float = 30.0) -> None:
    """Create ``topics`` (name -> partitions) and, on Apache Kafka, wait until every partition
    answers a ListOffsets request: right after creation its leader may not be serving yet, and
    the first sends fail with NotLeaderForPartitionError and are retried inside a
    measurement."""
    create_topics(broker.bootstrap_servers, dict(topics))
    if kind_of(broker) == "kafka":
        asyncio.run(_wait_leaders(broker.bootstrap_servers, list(topics), timeout_s))


async def _wait_leaders(bootstrap: str, topics: list[str], timeout_s: float) -> None:
    from aiokafka import AIOKafkaConsumer, TopicPartition
    from aiokafka.errors import KafkaError

    deadline = time.monotonic() + timeout_s
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None)
    await consumer.start()
    try:
        for topic in topics:
            while True:
                parts = consumer.partitions_for_topic(topic)
                if parts:
                    try:
                        await consumer.end_offsets([TopicPartition(topic, p) for p in parts])
                        break
                    except KafkaError:
                        pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"topic {topic!r} has no serving leader after "
                                       f"{timeout_s} s")
                await consumer._client.force_metadata_update()
                await asyncio.sleep(0.1)
    finally:
        await consumer.stop()


def kind_of(broker: Broker) -> BrokerKind:
    """``embedded`` or ``kafka``: the workers' ``broker_kind`` for ``broker``."""
    return "embedded" if isinstance(broker, EmbeddedBroker) else "kafka"


def restore_environ(saved: Mapping[str, str | None]) -> None:
    """Put back the variables ``saved`` recorded (``{name: value, or None where unset}``)."""
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def topic_names(prefix: str) -> dict[str, str]:
    return {k: f"{prefix}inference-{k}" for k in ("request", "result", "dlq", "retry")}


@contextlib.contextmanager
def start_worker(
    broker: Broker, settings: Mapping[str, Any], log_dir: Path, name: str,
    *, partitions: int, ready_timeout_s: float = 120.0,
) -> Iterator[tuple[WorkerProcess, dict[str, str], float]]:
    """A ``streamapp worker`` child on ``broker``, ready; yields (process, topics, seconds to
    ready). Topics get a fresh prefix and ``partitions`` partitions; ``broker_kind`` follows
    the broker's type."""
    app_id = f"bench-{name}-{uuid.uuid4().hex[:6]}"
    prefix = f"{app_id}."
    topics = topic_names(prefix)
    bench_topics(broker, {t: partitions for t in topics.values()})
    data_dir = log_dir / f"data-{app_id}"
    proc = WorkerProcess(
        {"broker": broker.url, "broker_kind": kind_of(broker), "app_id": app_id,
         "topic_prefix": prefix, "topic_partitions": partitions, "data_dir": data_dir, **settings},
        log_path=log_dir / f"worker-{name}.log",
    )
    proc.start()
    try:
        ready_s = proc.wait_ready(ready_timeout_s)
        yield proc, topics, ready_s
    finally:
        proc.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


@dataclass
class Forwarder:
    """``python -m bench.forwarder``: a Faust agent that forwards ``source`` to ``sink``."""

    broker: EmbeddedBroker
    log_dir: Path
    partitions: int
    source: str = field(init=False)
    sink: str = field(init=False)
    process: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.app_id = f"bench-fwd-{uuid.uuid4().hex[:6]}"
        self.source, self.sink = f"{self.app_id}.in", f"{self.app_id}.out"
        self.data_dir = self.log_dir / f"data-{self.app_id}"

    def __enter__(self) -> Forwarder:
        create_topics(self.broker.bootstrap_servers,
                      {self.source: self.partitions, self.sink: self.partitions})
        env = dict(os.environ, STREAMAPP_BROKER=self.broker.url, STREAMAPP_APP_ID=self.app_id,
                   STREAMAPP_WEB_PORT=str(free_port()), STREAMAPP_DATA_DIR=str(self.data_dir),
                   STREAMAPP_TOPIC_PARTITIONS=str(self.partitions), PYTHONUNBUFFERED="1",
                   BENCH_FWD_SOURCE=self.source, BENCH_FWD_SINK=self.sink)
        with open(self.log_dir / "forwarder.log", "ab") as log:
            self.process = popen_child(
                [sys.executable, "-m", "bench.forwarder"],
                stdout=log, stderr=subprocess.STDOUT, env=env,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            terminate_group(self.process, timeout_s=15.0)
        shutil.rmtree(self.data_dir, ignore_errors=True)


class Sampler:
    """Samples CPU (% of one core) and RSS of named processes, the whole machine's CPU, and the
    GPU's utilisation (NVML through nvidia-ml-py, else ``nvidia-smi``) every ``interval_s``.

    Use as a context manager; :meth:`summary` averages over a time window (epoch seconds).
    """

    def __init__(self, pids: Mapping[str, int], interval_s: float = 0.25) -> None:
        self.procs = {}
        for name, pid in pids.items():
            with contextlib.suppress(psutil.Error):
                self.procs[name] = psutil.Process(pid)
        self.interval_s = interval_s
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._gpu = _gpu_reader()

    def __enter__(self) -> Sampler:
        for p in self.procs.values():
            with contextlib.suppress(psutil.Error):
                p.cpu_percent(None)
        psutil.cpu_percent(None)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            sample: dict[str, Any] = {"t": time.time(), "cpu": {}, "rss": {},
                                      "machine_cpu": psutil.cpu_percent(None)}
            for name, p in self.procs.items():
                try:
                    with p.oneshot():
                        sample["cpu"][name] = p.cpu_percent(None)
                        sample["rss"][name] = p.memory_info().rss
                except psutil.Error:
                    pass
            if self._gpu is not None:
                sample["gpu"] = self._gpu()
            self.samples.append(sample)

    def summary(self, t0: float, t1: float) -> dict[str, Any]:
        """Means over ``[t0, t1]``: CPU % per process (100 = one core), machine CPU % (of all
        cores), max RSS (MiB) per process, GPU utilisation % and memory used (MiB)."""
        window = [s for s in self.samples if t0 <= s["t"] <= t1] or self.samples[-3:]
        if not window:
            return {}
        out: dict[str, Any] = {
            "cpu_pct": {n: round(sum(s["cpu"].get(n, 0.0) for s in window) / len(window), 1)
                        for n in self.procs},
            "machine_cpu_pct": round(sum(s["machine_cpu"] for s in window) / len(window), 1),
            "rss_mib_max": {n: round(max(s["rss"].get(n, 0) for s in window) / 2**20, 1)
                            for n in self.procs},
            "cores": psutil.cpu_count(),
        }
        # CPU of everything else on the machine (other users' processes, py-spy, ...), in % of
        # one core: a measurement is only clean when this is small.
        tracked = sum(out["cpu_pct"].values())
        out["other_cpu_pct"] = round(max(0.0, out["machine_cpu_pct"] * out["cores"] - tracked), 1)
        gpu = [s["gpu"] for s in window if s.get("gpu")]
        if gpu:
            out["gpu_util_pct"] = round(sum(g["util"] for g in gpu) / len(gpu), 1)
            per_gpu = [g["per_gpu"] for g in gpu if g.get("per_gpu")]
            if per_gpu and len(per_gpu[0]) > 1:  # each GPU of a multi-GPU host (issue 23)
                out["gpu_util_pct_per_gpu"] = [
                    round(sum(p[i] for p in per_gpu) / len(per_gpu), 1)
                    for i in range(len(per_gpu[0]))]
            out["gpu_mem_mib_max"] = round(max(g["mem_mib"] for g in gpu), 0)
        return out


def _gpu_reader() -> Any:
    """A function returning ``{"util": %, "mem_mib": MiB, "per_gpu": [%, ...]}``: the mean
    utilisation over the host's GPUs, their memory in use in total, and each GPU's utilisation
    by NVML index (issue 23: a two-GPU host), or None without a GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                   for i in range(pynvml.nvmlDeviceGetCount())]
        if not handles:
            return None

        def nvml() -> dict[str, Any]:
            utils = [float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu) for h in handles]
            mem = sum(pynvml.nvmlDeviceGetMemoryInfo(h).used for h in handles)
            return gpu_sample(utils, mem / 2**20)

        nvml()
        return nvml
    except Exception:
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None

    def nvidia_smi() -> dict[str, Any] | None:
        try:
            lines = subprocess.run(
                [smi, "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=5,
            ).stdout.strip().splitlines()
            rows = [[float(v) for v in line.split(",")] for line in lines if line.strip()]
            return gpu_sample([r[0] for r in rows], sum(r[1] for r in rows)) if rows else None
        except Exception:
            return None

    return nvidia_smi if nvidia_smi() is not None else None


def gpu_sample(utils: list[float], mem_mib: float) -> dict[str, Any]:
    """One GPU sample of the :class:`Sampler`: each GPU's utilisation (%), their mean, and
    the memory in use on all of them (MiB)."""
    return {"util": sum(utils) / len(utils), "mem_mib": mem_mib, "per_gpu": list(utils)}


def py_spy() -> str | None:
    """The py-spy executable (next to this Python, on PATH, or under a --target site dir)."""
    candidates = [Path(sys.executable).parent / "py-spy"]
    candidates += [Path(p) / "bin" / "py-spy" for p in sys.path if p]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return shutil.which("py-spy")


def profile_pid(pid: int, duration_s: float, out: Path, rate: int = 100) -> subprocess.Popen[bytes]:
    """Start ``py-spy record`` on ``pid`` (raw collapsed stacks per thread, running samples
    only, without pausing the target); returns the process (wait for it)."""
    exe = py_spy()
    if exe is None:
        raise FileNotFoundError("py-spy is not installed (pip install -e '.[bench]')")
    return subprocess.Popen(
        [exe, "record", "--pid", str(pid), "--duration", str(int(max(1, duration_s))),
         "--rate", str(rate), "--format", "raw", "--threads", "--full-filenames", "--nonblocking",
         "-o", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )


@contextlib.contextmanager
def profiling(pid: int | None, seconds: float, raw: Path) -> Iterator[dict[str, Any]]:
    """py-spy on ``pid`` for ``seconds`` while the ``with`` body runs; the yielded dict is
    filled on exit with :func:`bench.profile.summarize` of ``raw`` (or ``skipped``/``error``).
    ``pid`` None or ``seconds`` 0: yields an empty dict and profiles nothing."""
    out: dict[str, Any] = {}
    if pid is None or seconds <= 0:
        yield out
        return
    if py_spy() is None:
        out["skipped"] = "py-spy not installed"
        yield out
        return
    from bench.profile import summarize

    spy = profile_pid(pid, seconds, raw)
    try:
        yield out
    finally:
        _, err = spy.communicate(timeout=seconds + 60)
        if spy.returncode != 0 or not raw.is_file():
            out["error"] = err.decode(errors="replace")[-500:]
        else:
            out.update(summarize(raw, duration_s=max(1, int(seconds))))
            out["raw_file"] = raw.name
