"""Scale-out (issue 9): N = 1, 2, … workers of one group on one host, draining a backlog.

For each workload and each N, on a fresh embedded broker: produce K requests from many devices
into a topic with many partitions, *then* start N ``streamapp worker`` processes of one group
and time the first → last result (aggregate results/s), sampling each worker's CPU, the
broker's CPU, the host's CPU and the GPU's utilisation (NVML) meanwhile; optionally keep the
same workers under closed-loop load for a few seconds after (``closed_s``). The same N and
the same backlog for two ceilings: N plain aiokafka clients that forward request → result in
one group (:mod:`bench.relay`), and N Faust agents that only forward (:mod:`bench.forwarder`).
On the GPU profile the GPU workload is repeated under CUDA MPS at some N.

How the N workers are started is one function, :func:`launch_workers`: ``own`` starts N
``streamapp worker`` processes (own data directory and web port each, one app id);
``processes`` starts one ``streamapp worker --processes N`` (the supervisor of issue 9 item
2: children's web ports base + i, readiness from each child's ``/ready``).

Every step has a time estimate; with a budget, what no longer fits is skipped with a SKIPPED
line (``--dry-run`` prints the plan and those decisions without running anything).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil

from bench import load
from bench.common import engine_ceiling, produce_backlog, results_count
from bench.procs import (
    BrokerKind,
    Sampler,
    fresh_broker,
    profiling,
    restore_environ,
    topic_names,
)
from bench.profile import describe
from bench.workloads import Workload, result_parse, workload
from streamapp.broker import EmbeddedBroker
from streamapp.children import free_port, popen_child
from streamapp.kafka import create_topics
from streamapp.kafka_server import is_small_machine
from streamapp.process import WorkerProcess
from streamapp.supervisor import read_state

__all__ = ["LAUNCHERS", "SCALE_PROFILES", "Fleet", "ScalePlan", "ScaleProfile", "launch_clients",
           "launch_workers", "limiting", "run_scaleout", "summarize_series"]

Log = Callable[[str], None]

#: How the N workers are started (see :func:`launch_workers`).
LAUNCHERS = ("own", "processes")


@dataclass(frozen=True)
class ScalePlan:
    """One workload's scale-out: the worker counts, the backlog, the ceilings, MPS.

    Attributes:
        workload: ``digits`` or ``resnet50-tensor`` (any :func:`bench.workloads.workload`).
        ns: Worker counts N.
        backend, batch, delay_ms, inflight: The workers' engine and batching settings.
        partitions: Partitions of every topic (≥ the largest N, or workers sit idle).
        devices: Distinct device keys of the requests.
        backlog_per_worker, backlog_max: K = min(backlog_max, backlog_per_worker × N).
        expect_per_worker: Results/s one worker is expected to reach; only for time estimates.
        drain_timeout_s: Longest a drain may take; an incomplete drain is reported as such.
        closed_s, closed_window_per_worker: Closed-loop variant on the same workers after the
            drain (0 s: none): ``closed_window_per_worker × N`` requests outstanding.
        ceilings: ``aiokafka`` and/or ``faust``, measured at the same N and backlog.
        ceiling_expect: Expected results/s of one ceiling client (time estimates only).
        mps_ns: N at which the worker run is repeated under CUDA MPS (GPU profile).
        engine: Also measure the engine alone (the min(engine, transport) target).
        producer: Extra aiokafka producer options of the load generator (large payloads).
        relay_result_bytes: The ``aiokafka`` relays produce a value of this many bytes per
            record read (0: the record's own value). Image workloads set about a result's
            size, so that the ceiling carries what their workers carry: large requests in,
            small results out (relaying each 62 kB frame again is twice the transport).
    """

    workload: str
    ns: tuple[int, ...] = (1, 2)
    backend: str = "onnxruntime"
    batch: int = 32
    delay_ms: float = 5.0
    inflight: int = 2
    partitions: int = 32
    devices: int = 256
    backlog_per_worker: int = 10_000
    backlog_max: int = 60_000
    expect_per_worker: float = 800.0
    drain_timeout_s: float = 60.0
    closed_s: float = 0.0
    closed_window_per_worker: int = 2000
    ceilings: tuple[str, ...] = ("aiokafka", "faust")
    ceiling_expect: Mapping[str, float] = field(
        default_factory=lambda: {"aiokafka": 8000.0, "faust": 2500.0})
    #: K per client of each ceiling (capped at ``backlog_max``): a ceiling is faster than a
    #: worker, so it needs a larger backlog for a drain long enough to time.
    ceiling_backlog_per_client: Mapping[str, int] = field(
        default_factory=lambda: {"aiokafka": 30_000, "faust": 5_000})
    mps_ns: tuple[int, ...] = ()
    engine: bool = False
    engine_s: float = 2.0
    producer: Mapping[str, Any] = field(default_factory=dict)
    relay_result_bytes: int = 0

    def backlog(self, n: int, kind: str = "workers") -> int:
        """K for N processes of ``kind`` (``workers`` or a ceiling); ``$BENCH_WORKERS_K``, when
        set, is the workers' K at every N (e.g. 24,000 ResNet-50 tensors, whose 12,000
        drained in 1.5 s on the H100 host while the 16 workers' start spread over 0.46 s)."""
        if kind == "workers" and os.environ.get("BENCH_WORKERS_K"):
            return int(os.environ["BENCH_WORKERS_K"])
        per = self.ceiling_backlog_per_client.get(kind, self.backlog_per_worker)
        return min(self.backlog_max, (self.backlog_per_worker if kind == "workers" else per)
                   * n)


@dataclass(frozen=True)
class ScaleProfile:
    """The scale-out of one ``bench`` profile.

    Attributes:
        start_s: Seconds one worker start is expected to take (estimates only).
        produce_per_s: Backlog produce rate by payload size class (estimates only).
        cuda_streams: The workers' ``cuda_streams``.
    """

    name: str
    plans: tuple[ScalePlan, ...]
    start_s: float = 8.0
    cuda_streams: int = 2


_RESNET_GPU = dict(backend="torch", batch=64, delay_ms=5.0, inflight=4, partitions=32,
                   backlog_per_worker=300, backlog_max=3_000, expect_per_worker=250.0,
                   drain_timeout_s=30.0, ceilings=("aiokafka",),
                   ceiling_expect={"aiokafka": 600.0, "faust": 400.0},
                   ceiling_backlog_per_client={"aiokafka": 300, "faust": 300}, engine=True,
                   producer={"max_request_size": 2 << 20, "max_batch_size": 1 << 20},
                   # a ResNet-50 result (top 3 labels, ids, timings) is about 450 B of JSON
                   relay_result_bytes=512)

SCALE_PROFILES: dict[str, ScaleProfile] = {
    # CI: the scale-out code path at N = 1 and 2 with tiny counts (yet drains of ≥ 0.25 s
    # at the unloaded 2-core machine's rates: ~1,300 results/s per worker, ~3,000 per Faust
    # forwarder; the aiokafka drains are too short to time there and say so).
    "smoke": ScaleProfile("smoke", (
        ScalePlan("digits", ns=(1, 2), partitions=8, devices=64, backlog_per_worker=1_000,
                  ceiling_backlog_per_client={"aiokafka": 3_000, "faust": 1_000},
                  drain_timeout_s=40.0, closed_s=2.0, closed_window_per_worker=200),
    ), start_s=7.0),
    # make bench: the 2-core machine (digits only: ResNet-50 on 2 CPU cores is engine-bound).
    "cpu": ScaleProfile("cpu", (
        ScalePlan("digits", ns=(1, 2), backlog_per_worker=12_000, drain_timeout_s=90.0,
                  closed_s=6.0),
    ), start_s=8.0),
    # The H200 (bash bench/run_h200.sh scaleout): one device call of at most 9 minutes.
    "gpu": ScaleProfile("gpu", (
        ScalePlan("digits", ns=(1, 2, 4, 8, 12), backend="torch", batch=64, inflight=2,
                  # (2026-12-03, intake=direct: 24,000 drained in 0.57 s at N=8; 4,089–5,834
                  # results/s per worker at N = 1–16)
                  backlog_per_worker=12_000, backlog_max=192_000, expect_per_worker=4_000.0,
                  drain_timeout_s=30.0, ceiling_expect={"aiokafka": 15_000.0, "faust": 2_500.0},
                  ceiling_backlog_per_client={"aiokafka": 20_000, "faust": 3_000}),
        # (2026-12-03, sixth session: with the shared executor 3,000 requests drained too fast
        # to time, so K grows with N; 301 kB a request, 3.6 GB at K = 12,000)
        ScalePlan("resnet50-tensor", ns=(1, 2, 4, 8, 12),  # type: ignore[arg-type]
                  **{**_RESNET_GPU, "mps_ns": (2, 4, 8, 12), "backlog_per_worker": 750,
                     "backlog_max": 12_000, "expect_per_worker": 500.0,
                     "ceiling_backlog_per_client": {"aiokafka": 1_500, "faust": 300}}),
        # camera JPEGs decoded on the GPU (issue 11); run it with --only resnet50-jpeg
        # (issue 17: on Apache Kafka, a backlog long enough for batches to fill, MPS at N = 8)
        # (2026-12-03: N up to 16, K up to 48,000: the shared executor drained 12,000 at N=8
        # in 1.5 s, too short for NVML's GPU busy sampled every 0.25 s; 1,500 per relay client
        # drained too fast to time)
        ScalePlan("resnet50-jpeg", ns=(1, 4, 8, 12, 16),  # type: ignore[arg-type]
                  **{**_RESNET_GPU, "backlog_per_worker": 3_000, "backlog_max": 48_000,
                     "expect_per_worker": 500.0,
                     "mps_ns": (8,),
                     # 300 per relay drained in under 0.5 s at N=8 (too short to time)
                     "ceiling_backlog_per_client": {"aiokafka": 2_000, "faust": 300}}),
    ), start_s=15.0),
}


#: Broker properties of the scale-out's Apache Kafka: Kafka's own default initial rebalance
#: delay (3 s), what a production broker has, where the tests' brokers use 0 so that a single
#: worker starts at once. With 0, a group of 16 forms in 2–3 generations while the backlog
#: drains (the first members start on every partition and hand most of them over): on the H200,
#: 2026-12-03, 16 workers drained digits at 26,764/s with 0 and 65,428/s with 3 s, camera JPEGs
#: at 5,475 and 7,356/s (docs/scaleout.md). ``$BENCH_KAFKA_PROPS`` overrides it.
GROUP_START = {"group.initial.rebalance.delay.ms": "3000"}


# -- launching ---------------------------------------------------------------------------------


class Child(WorkerProcess):
    """A child process of the benchmark in its own process group (stopped like a worker:
    SIGTERM to the group, SIGKILL after a timeout), configured through ``STREAMAPP_*``
    variables from ``settings`` plus ``extra_env``."""

    def __init__(self, argv: Sequence[str], settings: Mapping[str, Any], log_path: Path,
                 extra_env: Mapping[str, str] | None = None) -> None:
        super().__init__(dict(settings), log_path)
        self.argv = list(argv)
        self.extra_env = dict(extra_env or {})

    def start(self) -> Child:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.extra_env)
        for name, value in self.settings.items():
            env[f"STREAMAPP_{name.upper()}"] = str(value)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            # As a worker (popen_child): its own process group, killed if this process dies
            # (a benchmark stopped by an outer time limit leaves no child behind).
            self.process = popen_child(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                       env=env)
        return self


@dataclass
class Fleet:
    """The processes of one measurement: what to stop, what to sample, where to ask."""

    children: list[WorkerProcess] = field(default_factory=list)
    #: Sampled processes: name → pid (``w0``, ``w1``, … and ``supervisor``).
    pids: dict[str, int] = field(default_factory=dict)
    #: Web URLs of the workers (their ``/metrics``), in worker order.
    urls: list[str] = field(default_factory=list)
    ready_s: list[float] = field(default_factory=list)
    data_dirs: list[Path] = field(default_factory=list)
    #: Sockets of the executor servers (``gpu_executor=shared``), in server order.
    servers: list[str] = field(default_factory=list)
    #: Set once every process to sample exists (``pids`` is complete).
    launched: threading.Event = field(default_factory=threading.Event)

    def stop(self) -> None:
        """SIGTERM every child at once (each drains and commits), then wait for all."""
        if self.children:
            with ThreadPoolExecutor(len(self.children)) as pool:
                list(pool.map(lambda c: c.stop(timeout_s=20.0), self.children))
        for d in self.data_dirs:
            shutil.rmtree(d, ignore_errors=True)

    def dead(self) -> list[str]:
        return [c.log_tail(5) for c in self.children
                if c.process is not None and c.process.poll() is not None]


def _wait_all_ready(urls: Sequence[str], children: Sequence[WorkerProcess],
                    timeout_s: float, started: float) -> list[float]:
    """Seconds from ``started`` until each URL's ``/ready`` answered 200."""
    ready: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(ready) < len(urls) and time.monotonic() < deadline:
        for c in children:
            if c.process is not None and c.process.poll() is not None:
                raise RuntimeError(f"a worker exited early (rc {c.process.returncode}):\n"
                                   f"{c.log_tail(15)}")
        for i, url in enumerate(urls):
            if i in ready:
                continue
            try:
                with urllib.request.urlopen(url + "/ready", timeout=1.0) as r:
                    if r.status == 200:
                        ready[i] = time.monotonic() - started
            except OSError:
                pass
        time.sleep(0.1)
    if len(ready) < len(urls):
        raise RuntimeError(f"{len(urls) - len(ready)} of {len(urls)} workers not ready after "
                           f"{timeout_s:.0f} s:\n{children[0].log_tail(15)}")
    return [round(ready[i], 2) for i in range(len(urls))]


def _ephemeral_low() -> int:
    """The lowest port of the OS's ephemeral range (Linux ``ip_local_port_range``; 32768 where
    it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free_port_range(n: int) -> int:
    """A base port such that base … base + n − 1 were free a moment ago, below the OS's
    ephemeral range: a port in that range can be taken by any outgoing connection (the N
    workers' own Kafka connections among them) between this check and the worker's bind — on
    the H200, 2026-12-03, a worker of 8 found its port taken 5 times in a row and the
    supervisor gave up."""
    import random
    import socket

    edge = _ephemeral_low()
    low, high = max(1024, edge - 12_000), edge - n
    for _ in range(50):
        base = random.randint(low, high) if high > low else free_port()
        if base + n > 65535:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports found")


def launch_workers(fleet: Fleet, launcher: str, settings: Mapping[str, Any], n: int,
                   logs: Path, name: str, ready_timeout_s: float = 180.0) -> None:
    """Start N workers of one group (``settings`` holds broker, app id, topics, batching) and
    wait until each one's ``/ready`` answers; fills ``fleet`` (stopped by the caller).

    ``own``: N ``streamapp worker`` processes, each with its own data directory and web port.
    ``processes``: one ``streamapp worker --processes N`` (the supervisor gives each child its
    own data directory, web port base + i and group instance id); its children are sampled.
    """
    started = time.monotonic()
    base_dir = logs / f"data-{settings['app_id']}"
    if launcher == "own":
        for i in range(n):
            data_dir = Path(f"{base_dir}-{i}")
            worker = WorkerProcess({**settings, "data_dir": data_dir},
                                   log_path=logs / f"worker-{name}-{i}.log")
            fleet.children.append(worker)
            fleet.data_dirs.append(data_dir)
            worker.start()
            assert worker.process is not None
            fleet.pids[f"w{i}"] = worker.process.pid
            fleet.urls.append(worker.web_url)
        fleet.launched.set()
        fleet.ready_s = _wait_all_ready(fleet.urls, fleet.children, ready_timeout_s, started)
        return
    if launcher != "processes":
        raise ValueError(f"unknown launcher {launcher!r}; use one of {', '.join(LAUNCHERS)}")
    base = _free_port_range(n)
    parent = Child([sys.executable, "-m", "streamapp", "worker", "--processes", str(n)],
                   {**settings, "data_dir": base_dir, "web_port": base},
                   logs / f"worker-{name}-supervisor.log")
    fleet.children.append(parent)
    fleet.data_dirs.append(base_dir)
    parent.start()
    assert parent.process is not None
    fleet.pids["supervisor"] = parent.process.pid
    fleet.urls = [f"http://127.0.0.1:{base + i}" for i in range(n)]
    fleet.ready_s = _wait_all_ready(fleet.urls, fleet.children, ready_timeout_s, started)
    # The supervisor's workers and executor servers, as its supervisor.json lists them.
    state = read_state(base_dir) or {}
    for i, child in enumerate(state.get("children", [])):
        if child.get("pid"):
            fleet.pids[f"w{i}"] = int(child["pid"])
    for i, server in enumerate(state.get("servers", [])):
        fleet.servers.append(str(server["socket"]))
        if server.get("pid"):
            fleet.pids[f"gpu-server{i}"] = int(server["pid"])
    fleet.launched.set()


def launch_clients(fleet: Fleet, kind: str, n: int, broker: EmbeddedBroker, source: str,
                    sink: str, group: str, partitions: int, logs: Path, name: str,
                    max_request: int, relay_result_bytes: int = 0) -> None:
    """N ceiling clients of one group: ``aiokafka`` relays (each record's value, or
    ``relay_result_bytes`` bytes, forwarded) or ``faust`` forwarders."""
    for i in range(n):
        log_path = logs / f"{kind}-{name}-{i}.log"
        if kind == "aiokafka":
            child = Child([sys.executable, "-m", "bench.relay", broker.bootstrap_servers,
                           source, sink, group, str(max_request),
                           str(relay_result_bytes)], {}, log_path)
            child.settings.pop("web_port", None)
        else:
            data_dir = logs / f"data-{group}-{i}"
            fleet.data_dirs.append(data_dir)
            child = Child([sys.executable, "-m", "bench.forwarder"],
                          {"broker": broker.url, "app_id": group, "data_dir": data_dir,
                           "topic_partitions": partitions},
                          log_path, {"BENCH_FWD_SOURCE": source, "BENCH_FWD_SINK": sink})
        fleet.children.append(child)
        child.start()
        assert child.process is not None
        fleet.pids[f"w{i}"] = child.process.pid
    fleet.launched.set()


@contextlib.contextmanager
def mps_daemon(log: Log) -> Iterator[dict[str, Any]]:
    """CUDA MPS for the processes started inside: ``nvidia-cuda-mps-control -d`` with a private
    pipe and log directory (set in this process's environment, so children connect to it);
    ``echo quit | nvidia-cuda-mps-control`` on exit. Changes no GPU setting.

    Raises:
        FileNotFoundError: ``nvidia-cuda-mps-control`` is not on PATH.
    """
    exe = shutil.which("nvidia-cuda-mps-control")
    if exe is None:
        raise FileNotFoundError("nvidia-cuda-mps-control is not on PATH")
    root = Path(tempfile.mkdtemp(prefix="bench-mps-"))
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(root / "pipe"),
           "CUDA_MPS_LOG_DIRECTORY": str(root / "log")}
    for d in env.values():
        Path(d).mkdir(parents=True)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        subprocess.run([exe, "-d"], check=True, timeout=30, env=os.environ.copy())
        log(f"  CUDA MPS daemon started ({root})")
        yield {"dir": str(root)}
    finally:
        try:
            subprocess.run([exe], input=b"quit\n", timeout=30, env=os.environ.copy())
        finally:
            restore_environ(saved)
            with contextlib.suppress(OSError):
                tail = (root / "log" / "control.log").read_text()[-400:]
                log(f"  CUDA MPS stopped; control.log tail: {tail.strip()[-200:]}")


# -- measuring ---------------------------------------------------------------------------------


#: Shortest first → last span that is timed (s).
MIN_DRAIN_S = 0.25


def _count_only(_value: bytes) -> tuple[float, int | None]:
    return 0.0, None


async def _drain(broker: EmbeddedBroker, outcome_topics: Sequence[str], k: int,
                 start: Callable[[], None], fleet: Fleet, timeout_s: float,
                 cap: Callable[[float], float] = lambda t: t) -> dict[str, Any]:
    """Start collecting, start the fleet (in a thread), wait up to ``cap(timeout_s)`` after
    it is up for ``k`` outcomes; sample the fleet, the broker and this process from the moment
    the processes exist."""
    collector = await load.Collector(broker.bootstrap_servers, outcome_topics,
                                     _count_only).start()
    t_launch = time.time()
    sampler: Sampler | None = None
    try:
        launched = asyncio.get_running_loop().run_in_executor(None, start)
        while not launched.done():
            await asyncio.sleep(0.05)
            if sampler is None and fleet.launched.is_set():
                sampler = Sampler({**fleet.pids, "broker": broker.pid or 0,
                                   "bench": os.getpid()}).__enter__()
        launched.result()
        if sampler is None:
            sampler = Sampler({**fleet.pids, "broker": broker.pid or 0,
                               "bench": os.getpid()}).__enter__()
        deadline = time.monotonic() + cap(timeout_s)
        while collector.count < k and time.monotonic() < deadline and not fleet.dead():
            await collector.wait_progress(0.5)
        arrivals = collector.arrivals
        out: dict[str, Any] = {"backlog": k, "outcomes": collector.count,
                               "dead_letters_or_other": collector.other,
                               "complete": collector.count >= k,
                               "launch_to_first_s": None}
        if len(arrivals) >= 2:
            first, last = arrivals[0], arrivals[-1]
            out.update(first=first, last=last, launch_to_first_s=round(first - t_launch, 2),
                       drain_s=round(last - first, 3), results_per_s=None)
            # Arrival times are those of the collector's fetches (tens of ms apart): a drain
            # shorter than MIN_DRAIN_S cannot be timed; it needs a larger backlog.
            if last - first >= MIN_DRAIN_S:
                out["results_per_s"] = (len(arrivals) - 1) / (last - first)
            else:
                out["too_short"] = True
            # Steady rate: the middle 80 % of the results (start-up and tail left out).
            lo, hi = int(0.1 * len(arrivals)), int(0.9 * len(arrivals))
            if hi > lo and arrivals[hi] > arrivals[lo]:
                out["steady_per_s"] = (hi - lo) / (arrivals[hi] - arrivals[lo])
            out["utilisation"] = sampler.summary(first, last)
        if fleet.dead():
            out["dead"] = fleet.dead()
        out["sampler"] = sampler
        return out
    except BaseException:
        if sampler is not None:
            sampler.__exit__()
        raise
    finally:
        await collector.stop()


def _per_worker(util: Mapping[str, Any], n: int) -> list[float | None]:
    cpu = util.get("cpu_pct", {})
    return [cpu.get(f"w{i}") for i in range(n)]


def limiting(point: Mapping[str, Any], transport_per_s: float | None = None
             ) -> tuple[str, dict[str, float]]:
    """The resource at its limit during a drain, by rule, and every resource's fraction of
    its limit: worker CPU (mean over workers, ÷ 100 % of one core: a worker's event loop is
    one thread), broker CPU (÷ all cores), host CPU (every process, ÷ all cores), GPU
    utilisation (÷ 100 %), transport (aggregate ÷ the aiokafka clients' rate at the same N).
    The limit is the largest fraction when it is ≥ 0.8, else ``none``."""
    util = point.get("utilisation") or {}
    cores = util.get("cores") or psutil.cpu_count() or 1
    workers = [c for c in _per_worker(util, point["n"]) if c is not None]
    fr: dict[str, float] = {}
    if workers:
        fr["worker CPU"] = sum(workers) / len(workers) / 100.0
    if util.get("cpu_pct", {}).get("broker") is not None:
        fr["broker CPU"] = util["cpu_pct"]["broker"] / (100.0 * cores)
    if util.get("machine_cpu_pct") is not None:
        fr["host CPU"] = util["machine_cpu_pct"] / 100.0
    if util.get("gpu_util_pct") is not None:
        fr["GPU"] = util["gpu_util_pct"] / 100.0
    if transport_per_s and point.get("results_per_s"):
        fr["transport"] = point["results_per_s"] / transport_per_s
    fr = {k: round(v, 2) for k, v in fr.items()}
    if not fr:
        return "-", fr
    top = max(fr, key=lambda k: fr[k])
    return (top if fr[top] >= 0.8 else "none"), fr


def summarize_series(section: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Per series, per N: aggregate, efficiency ÷ (N × the N = 1 aggregate), limit."""
    series = section.get("series", {})
    out: dict[str, list[dict[str, Any]]] = {}
    for key, s in series.items():
        points = sorted(s.get("points", []), key=lambda p: p["n"])
        single = next((p.get("results_per_s") for p in points if p["n"] == 1), None)
        relay = {p["n"]: p.get("results_per_s")
                 for p in series.get(f"{s['workload']} aiokafka", {}).get("points", [])}
        rows = []
        for p in points:
            row = dict(p)
            agg = p.get("results_per_s")
            row["efficiency"] = (agg / (p["n"] * single)) if agg and single else None
            row["limit"], row["fractions"] = limiting(
                p, relay.get(p["n"]) if s["kind"] == "workers" else None)
            rows.append(row)
        out[key] = rows
    return out


class ScaleOut:
    """Runs a :class:`ScaleProfile`, writing into ``results["scaleout"]``."""

    def __init__(self, profile: ScaleProfile, results: dict[str, Any], logs: Path, log: Log,
                 launcher: str = "own", save: Callable[[], None] = lambda: None,
                 broker: BrokerKind = "embedded", gpu_executor: str = "inprocess") -> None:
        self.profile, self.logs, self.log, self.launcher = profile, logs, log, launcher
        self.save, self.broker, self.gpu_executor = save, broker, gpu_executor
        self.section: dict[str, Any] = results.setdefault("scaleout", {})
        self.section.update({"profile": profile.name, "launcher": launcher, "broker": broker,
                             "gpu_executor": gpu_executor,
                             # BENCH_KAFKA_NODES (bench.procs.fresh_broker); "broker CPU"
                             # is the first node's alone
                             "kafka_nodes": int(os.environ.get("BENCH_KAFKA_NODES") or 1)
                             if broker == "kafka" else None,
                             # the 2-core thread counts (BENCH_KAFKA_SMALL, broker_properties)
                             "kafka_small_machine": os.environ.get("BENCH_KAFKA_SMALL") == "1"
                             or is_small_machine() if broker == "kafka" else None,
                             "plans": [asdict(p) for p in profile.plans]})
        self.section.setdefault("series", {})
        self.section.setdefault("engine", {})
        self.run_id = uuid.uuid4().hex[:6]
        self._workloads: dict[str, Workload] = {}
        #: time.monotonic() by which the section must end (None: no budget); drains and
        #: worker starts are cut short so that one stuck step cannot overrun it.
        self.deadline: float | None = None
        #: ``--profile-procs`` (issue 17): fleet.pids keys (``w0``, ``gpu-server0``, ...) that
        #: py-spy records for ``profile_s`` under closed-loop load after each workers drain.
        self.profile_procs: tuple[str, ...] = ()
        self.profile_s = 0.0

    def timeout(self, wanted_s: float) -> float:
        """``wanted_s``, or less when the budget's deadline comes first (at least 5 s)."""
        if self.deadline is None:
            return wanted_s
        return max(5.0, min(wanted_s, self.deadline - time.monotonic() - 15.0))

    def _wl(self, plan: ScalePlan) -> Workload:
        if plan.workload not in self._workloads:
            models_dir = None
            if plan.workload.startswith("resnet50"):
                from bench.models import DEFAULT_REPO, ensure_resnet50

                ensure_resnet50(DEFAULT_REPO, log=self.log)
                models_dir = DEFAULT_REPO
            self._workloads[plan.workload] = workload(
                plan.workload, run=self.run_id, models_dir=models_dir, devices=plan.devices)
        return self._workloads[plan.workload]

    def _series(self, plan: ScalePlan, kind: str, mps: bool = False) -> dict[str, Any]:
        key = f"{plan.workload} {kind}" + (" MPS" if mps else "")
        return self.section["series"].setdefault(
            key, {"workload": plan.workload, "kind": kind, "mps": mps, "points": []})

    def _settings(self, plan: ScalePlan, wl: Workload) -> dict[str, Any]:
        settings: dict[str, Any] = {
            "backend": plan.backend, "models": wl.model, "max_batch_size": plan.batch,
            "max_batch_delay_ms": plan.delay_ms, "max_inflight_batches": plan.inflight,
            "cuda_streams": self.profile.cuda_streams, "log_level": "warning",
            "topic_partitions": plan.partitions, "gpu_executor": self.gpu_executor,
        }
        if wl.models_dir is not None:
            settings["models_dir"] = wl.models_dir
        return settings

    def _produce(self, broker: EmbeddedBroker, topic: str, wl: Workload, k: int,
                 plan: ScalePlan) -> float:
        started = time.time()
        failed = _run(produce_backlog(broker.bootstrap_servers, topic, wl, k,
                                      dict(plan.producer)))
        if failed:
            raise RuntimeError(f"{failed} of {k} backlog requests failed to send")
        return k / max(time.time() - started, 1e-6)

    def workers(self, plan: ScalePlan, n: int, *, mps: bool = False) -> dict[str, Any]:
        """N workers drain a backlog of K requests; then, optionally, closed-loop load."""
        wl = self._wl(plan)
        k = plan.backlog(n)
        name = f"scale-{wl.name}-n{n}" + ("-mps" if mps else "")
        with fresh_broker(self.logs, name, self.broker, properties=GROUP_START) as broker:
            app_id = f"bench-{name}-{uuid.uuid4().hex[:6]}"
            topics = topic_names(f"{app_id}.")
            create_topics(broker.bootstrap_servers,
                          {t: plan.partitions for t in topics.values()})
            produce_per_s = self._produce(broker, topics["request"], wl, k, plan)
            settings = {"broker": broker.url, "app_id": app_id, "topic_prefix": f"{app_id}.",
                        **self._settings(plan, wl)}
            fleet = Fleet()
            try:
                res = _run(_drain(
                    broker, [topics["result"], topics["dlq"]], k,
                    lambda: launch_workers(fleet, self.launcher, settings, n, self.logs, name,
                                           self.timeout(max(60.0, self.profile.start_s * 6))),
                    fleet, plan.drain_timeout_s + self.profile.start_s * 4, self.timeout))
                sampler: Sampler = res.pop("sampler")
                try:
                    res["worker_results"] = [results_count(u) for u in fleet.urls]
                    res["ready_s"] = fleet.ready_s
                    if fleet.servers:
                        res["server_batches"] = server_batches(fleet.servers)
                    if plan.closed_s > 0 and res["complete"]:
                        res["closed_loop"] = self._closed(plan, wl, n, broker, topics, sampler)
                    if self.profile_procs and self.profile_s > 0 and res["complete"]:
                        res["profiles"] = self._profiled(plan, wl, n, broker, topics, fleet,
                                                         name)
                finally:
                    sampler.__exit__()
            finally:
                fleet.stop()
        res.update(n=n, produce_per_s=round(produce_per_s))
        return res

    def _closed(self, plan: ScalePlan, wl: Workload, n: int, broker: EmbeddedBroker,
                topics: Mapping[str, str], sampler: Sampler) -> dict[str, Any]:
        res = _run(load.closed_loop(
            broker.bootstrap_servers, topics["request"], [topics["result"], topics["dlq"]],
            wl.payload, result_parse, window=plan.closed_window_per_worker * n,
            warmup_s=min(2.0, plan.closed_s / 2), duration_s=plan.closed_s,
            producer_options=dict(plan.producer), from_end=True))
        res["utilisation"] = sampler.summary(res["t0"], res["t1"])
        return {k: res.get(k) for k in ("results_per_s", "window", "duration_s", "drained",
                                        "utilisation")}

    def _profiled(self, plan: ScalePlan, wl: Workload, n: int, broker: EmbeddedBroker,
                  topics: Mapping[str, str], fleet: Fleet, name: str) -> dict[str, Any]:
        """py-spy on the ``profile_procs`` of ``fleet`` for ``profile_s`` while a closed loop
        keeps ``batch × inflight × 2`` requests per worker outstanding."""
        with contextlib.ExitStack() as stack:
            summaries = {key: stack.enter_context(profiling(
                fleet.pids.get(key), self.profile_s, self.logs / f"profile-{name}-{key}.txt"))
                for key in self.profile_procs}
            res = _run(load.closed_loop(
                broker.bootstrap_servers, topics["request"], [topics["result"], topics["dlq"]],
                wl.payload, result_parse, window=plan.batch * plan.inflight * 2 * n,
                warmup_s=0.5, duration_s=max(1.0, self.profile_s - 1.0),
                producer_options=dict(plan.producer), from_end=True))
        for key, summary in summaries.items():
            if key not in fleet.pids:
                summary["skipped"] = f"no process {key!r} (have {', '.join(fleet.pids)})"
            self.log(f"    profile {key} at N={n} ({res['results_per_s']:,.0f} results/s): "
                     f"{describe(summary)}")
        return {"results_per_s": res["results_per_s"], **summaries}

    def ceiling(self, plan: ScalePlan, kind: str, n: int) -> dict[str, Any]:
        """N aiokafka relays or Faust forwarders of one group drain a backlog."""
        wl = self._wl(plan)
        k = plan.backlog(n, kind)
        name = f"scale-{wl.name}-{kind}-n{n}"
        with fresh_broker(self.logs, name, self.broker, properties=GROUP_START) as broker:
            group = f"bench-{name}-{uuid.uuid4().hex[:6]}"
            source, sink = f"{group}.in", f"{group}.out"
            create_topics(broker.bootstrap_servers, {source: plan.partitions,
                                                     sink: plan.partitions})
            produce_per_s = self._produce(broker, source, wl, k, plan)
            fleet = Fleet()
            max_request = int(plan.producer.get("max_request_size", 1 << 20))
            try:
                res = _run(_drain(
                    broker, [sink], k,
                    lambda: launch_clients(fleet, kind, n, broker, source, sink, group,
                                            plan.partitions, self.logs, name, max_request,
                                            plan.relay_result_bytes),
                    fleet, plan.drain_timeout_s + 30.0, self.timeout))
                res.pop("sampler").__exit__()
            finally:
                fleet.stop()
        res.update(n=n, produce_per_s=round(produce_per_s))
        return res

    def engine(self, plan: ScalePlan) -> dict[str, Any]:
        return engine_ceiling(self._wl(plan), plan.backend, plan.batch, plan.engine_s,
                              self.log, inflight=plan.inflight)


def server_batches(sockets: Sequence[str]) -> dict[str, dict[str, Any]]:
    """What the executor servers' engines saw, per model, summed over the servers: batches,
    rows, sub_batches (client requests), merged, split (client requests run in more than one
    batch), mean_batch (rows ÷ batches). The counters
    run from the server's start (its warm-up batch of 1 included)."""
    from engines.server import query_stats

    out: dict[str, dict[str, Any]] = {}
    for path in sockets:
        try:
            stats = query_stats(path)
        except Exception as exc:  # the report says so instead of failing the step
            out.setdefault("_errors", {})[path] = str(exc)
            continue
        for model, s in stats.items():
            agg = out.setdefault(model, {"batches": 0, "rows": 0, "sub_batches": 0,
                                         "merged": 0, "split": 0})
            for k in ("batches", "rows", "sub_batches", "merged", "split"):
                agg[k] += int(s.get(k, 0))
    for model, agg in out.items():
        if model != "_errors":
            agg["mean_batch"] = round(agg["rows"] / agg["batches"], 2) if agg["batches"] else 0
    return out


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


@dataclass(frozen=True)
class Step:
    """One measurement of the plan, with its time estimate (s)."""

    label: str
    estimate_s: float
    action: Callable[[], None]


def _fmt_point(p: Mapping[str, Any]) -> str:
    util = p.get("utilisation") or {}
    cpu = [c for c in _per_worker(util, p["n"]) if c is not None]
    rate = p.get("results_per_s")
    parts = [(f"{rate:,.0f} results/s first→last" if rate is not None else
              f"drain of {p.get('drain_s')} s too short to time")
             + ("" if p.get("complete") else f" INCOMPLETE ({p.get('outcomes')} of "
                f"{p.get('backlog')})")]
    if p.get("steady_per_s"):
        parts.append(f"steady {p['steady_per_s']:,.0f}/s")
    if cpu:
        parts.append("worker CPU " + "/".join(f"{c:.0f}" for c in cpu) + " %")
    if util.get("cpu_pct", {}).get("broker") is not None:
        parts.append(f"broker {util['cpu_pct']['broker']:.0f} %")
    if util.get("gpu_util_pct") is not None:
        parts.append(f"GPU {util['gpu_util_pct']:.0f} %" + (
            " (" + "/".join(f"{u:.0f}" for u in util["gpu_util_pct_per_gpu"]) + " % by GPU)"
            if util.get("gpu_util_pct_per_gpu") else ""))
    if p.get("closed_loop"):
        parts.append(f"closed loop {p['closed_loop']['results_per_s']:,.0f}/s")
    for model, b in (p.get("server_batches") or {}).items():
        if model != "_errors":
            parts.append(f"engine batch {b['mean_batch']:.1f} ({model}, {b['batches']} batches "
                         f"from {b['sub_batches']} worker batches, {b.get('split', 0)} split)")
    if p.get("dead"):
        parts.append(f"{len(p['dead'])} process(es) DIED")
    return ", ".join(parts)


def plan_steps(profile: ScaleProfile, scale: ScaleOut | None, ns: tuple[int, ...] | None = None,
               mps: bool = True) -> list[Step]:
    """Every step in the order they run, the least important last so that a budget cuts
    those first (see the comment on the order below)."""
    steps: list[Step] = []
    start = profile.start_s

    def est(plan: ScalePlan, n: int, rate_per_client: float, start_s: float,
            closed: float = 0.0, kind: str = "workers") -> float:
        k = plan.backlog(n, kind)
        produce = k / (600.0 if plan.workload.startswith("resnet50") else 40_000.0)
        # Pessimistic: 70 % of linear scaling, capped by the drain timeout.
        drain = min(plan.drain_timeout_s, k / max(1.0, 0.7 * rate_per_client * n))
        return 2.0 + produce + start_s + drain + closed + 3.0

    def wrap(label: str, fn: Callable[[], dict[str, Any]], series: dict[str, Any] | None,
             store: Callable[[dict[str, Any]], None] | None = None) -> Callable[[], None]:
        def action() -> None:
            assert scale is not None
            try:
                res = fn()
            except Exception as exc:  # report what failed, keep measuring the rest
                scale.log(f"  {label}: FAILED: {type(exc).__name__}: {exc}")
                scale.section.setdefault("failed", []).append(f"{label}: {exc}")
                return
            if store is not None:
                store(res)
            elif series is not None:
                series["points"].append(res)
                scale.log(f"  {label}: {_fmt_point(res)}")
            scale.save()
        return action

    def ns_of(plan: ScalePlan) -> tuple[int, ...]:
        return plan.ns if ns is None else ns

    def series(plan: ScalePlan, kind: str, is_mps: bool = False) -> dict[str, Any] | None:
        return None if scale is None else scale._series(plan, kind, is_mps)

    # Order: (1) the worker series, (2) the engine alone, (3) the ceilings at N = 1 and at
    # the largest N (the targets' inputs), (4) CUDA MPS at the two largest of mps_ns, (5) the
    # ceilings at the other N, (6) MPS at the other N: a budget cuts the least important last.
    groups: list[list[Step]] = [[] for _ in range(6)]
    for plan in profile.plans:
        s = series(plan, "workers")
        # The ResNet-50 model folder is built on first use (bench/models.py).
        build = 15.0 if plan.workload.startswith("resnet50") else 0.0
        for i, n in enumerate(ns_of(plan)):
            groups[0].append(Step(
                f"{plan.workload} workers N={n}",
                est(plan, n, plan.expect_per_worker, start + 0.5 * n, plan.closed_s + 2.0)
                + (build if i == 0 else 0.0),
                wrap(f"{plan.workload} workers N={n}",
                     lambda plan=plan, n=n: scale.workers(plan, n),  # type: ignore[union-attr]
                     s)))
        if plan.engine:
            def store(res: dict[str, Any], plan: ScalePlan = plan) -> None:
                assert scale is not None
                scale.section["engine"][plan.workload] = res
            groups[1].append(Step(f"{plan.workload} engine alone", 3 * plan.engine_s + 10,
                                  wrap(f"{plan.workload} engine alone",
                                       lambda plan=plan: scale.engine(plan),  # type: ignore
                                       None, store)))
    for kind in ("aiokafka", "faust"):
        for plan in profile.plans:
            if kind not in plan.ceilings:
                continue
            s = series(plan, kind)
            client_start = 1.0 if kind == "aiokafka" else 5.0
            key_ns = {1, max(ns_of(plan))}
            for n in ns_of(plan):
                groups[2 if n in key_ns else 4].append(Step(
                    f"{plan.workload} {kind} N={n}",
                    est(plan, n, plan.ceiling_expect.get(kind, 1000.0), client_start + 0.3 * n,
                        kind=kind),
                    wrap(f"{plan.workload} {kind} clients N={n}",
                         lambda plan=plan, kind=kind, n=n:
                         scale.ceiling(plan, kind, n),  # type: ignore[union-attr]
                         s)))
    for plan in profile.plans if mps else ():
        mps_ns = plan.mps_ns if ns is None else tuple(x for x in ns if x in plan.mps_ns)
        s = series(plan, "workers", True) if mps_ns else None
        first = sorted(mps_ns)[-2:]
        for n in sorted(mps_ns, key=lambda x: (x not in first, x)):
            groups[3 if n in first else 5].append(Step(
                f"{plan.workload} workers N={n} with CUDA MPS",
                est(plan, n, plan.expect_per_worker, start + 0.5 * n) + 3.0,
                wrap(f"{plan.workload} workers N={n} with CUDA MPS",
                     lambda plan=plan, n=n: _with_mps(scale, plan, n),  # type: ignore
                     s)))
    for group in groups:
        steps += group
    return steps


def _with_mps(scale: ScaleOut, plan: ScalePlan, n: int) -> dict[str, Any]:
    with mps_daemon(scale.log) as info:
        res = scale.workers(plan, n, mps=True)
    res["mps"] = info
    return res


def run_scaleout(profile: ScaleProfile, results: dict[str, Any], logs: Path, *, log: Log = print,
                 launcher: str = "own", budget_s: float | None = None,
                 ns: tuple[int, ...] | None = None, only: tuple[str, ...] = (),
                 dry_run: bool = False, save: Callable[[], None] = lambda: None,
                 backend: str | None = None, broker: BrokerKind = "embedded",
                 gpu_executor: str = "inprocess", profile_procs: tuple[str, ...] = (),
                 profile_s: float = 8.0, no_mps: bool = False,
                 ceilings: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Run (or, ``dry_run``, print) the scale-out section; returns ``results["scaleout"]``.

    Args:
        budget_s: Seconds this section may take; a step whose estimate no longer fits is
            skipped with a ``SKIPPED`` line (listed in ``results["scaleout"]["skipped"]``).
        ns: Override every plan's worker counts (e.g. ``(1, 2)`` for a CPU try of the GPU
            profile); MPS then runs at those of them in the plan's ``mps_ns``.
        only: Workloads to run (default all).
        backend: Override every plan's backend (e.g. ``onnxruntime`` to try the GPU profile's
            logic on CPU).
        broker: ``embedded`` (Tansu, fresh per measurement) or ``kafka`` (Apache Kafka, fresh
            per measurement: what users run; needs Java).
        gpu_executor: The workers' ``gpu_executor``: ``inprocess``, or ``shared`` (one
            executor server per GPU, started by ``streamapp worker --processes N``: implies
            ``launcher="processes"``); each worker point then has ``server_batches``, the
            mean batch the server's engine saw.
        profile_procs: Processes py-spy records after each workers drain, for ``profile_s``
            under closed-loop load (keys of the fleet: ``w0``..., ``gpu-server0``...).
        no_mps: Leave out the CUDA MPS steps (the comparison is in docs/scaleout.md).
        ceilings: Override every plan's ceilings (``()``: none, the worker series alone).
    """
    if gpu_executor == "shared" and launcher != "processes":
        log("  gpu_executor=shared: the workers are started by `streamapp worker --processes N`"
            " (launcher processes), which starts the executor servers")
        launcher = "processes"
    override: dict[str, Any] = {"backend": backend} if backend else {}
    if ceilings is not None:
        override["ceilings"] = ceilings
    plans = tuple(replace(p, **override) for p in profile.plans if not only or p.workload in only)
    profile = replace(profile, plans=plans)
    scale = None if dry_run else ScaleOut(profile, results, logs, log, launcher, save, broker,
                                          gpu_executor)
    if scale is not None:
        scale.profile_procs, scale.profile_s = profile_procs, profile_s
    section = results.setdefault("scaleout", {}) if scale is None else scale.section
    has_mps = shutil.which("nvidia-cuda-mps-control") is not None
    steps = plan_steps(profile, scale, ns, mps=(has_mps or dry_run) and not no_mps)
    log(f"\n== scale-out ({profile.name}, launcher {launcher}, gpu executor {gpu_executor}): "
        f"{len(steps)} steps, estimated "
        f"{sum(s.estimate_s for s in steps):.0f} s"
        + (f", budget {budget_s:.0f} s" if budget_s is not None else ""))
    if not has_mps and not no_mps and any(p.mps_ns for p in plans):
        msg = "CUDA MPS steps: SKIPPED, nvidia-cuda-mps-control is not on PATH"
        log("  " + msg + (" (listed below as they would run)" if dry_run else ""))
        section.setdefault("skipped", []).append(msg)
    started = time.monotonic()
    if scale is not None and budget_s is not None:
        scale.deadline = started + budget_s
    planned = 0.0
    for step in steps:
        used = planned if dry_run else time.monotonic() - started
        if budget_s is not None and used + step.estimate_s > budget_s:
            msg = (f"{step.label}: SKIPPED, estimated {step.estimate_s:.0f} s and "
                   f"{budget_s - used:.0f} s of the budget left")
            log("  " + msg)
            section.setdefault("skipped", []).append(msg)
            continue
        planned += step.estimate_s
        if dry_run:
            log(f"  {step.label}: about {step.estimate_s:.0f} s (total {planned:.0f} s)")
            continue
        step.action()
    section["elapsed_s"] = round(time.monotonic() - started, 1)
    save()
    return section
