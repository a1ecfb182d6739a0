"""A worker's queryable state and observability: what the web views query.

:func:`build_state` defines the device tables (:mod:`streamapp.tables`) and the metrics
(:mod:`streamapp.metrics`) on the app; :mod:`streamapp.app` installs the views on it.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Any

import faust

from streamapp.agents.observer import PipelineObserver
from streamapp.faust_compat import PartitionMarks, partition_marks
from streamapp.kafka import kafka_security_options
from streamapp.metrics import Metrics, WorkerGauges
from streamapp.partitions import GatedStateObserver, PartitionCheck
from streamapp.readiness import ProgressWatch, probe_kafka
from streamapp.record_batches import undecodable_counts
from streamapp.settings import Settings
from streamapp.tables import DeviceStateObserver, DeviceStateReader, WindowPlan
from streamapp.tables.faust_tables import FaustDeviceTables, define_tables
from streamapp.tables.rows import RowScreen

__all__ = ["WorkerState", "advertised_host", "build_state"]

log = logging.getLogger(__name__)


def advertised_host(settings: Settings) -> str:
    """The host other workers reach this one at: ``web_host``, else ``web_bind`` unless that is
    a wildcard address, else the host name."""
    if settings.web_host:
        return settings.web_host
    if settings.web_bind not in ("0.0.0.0", "::", ""):
        return settings.web_bind
    return socket.gethostname()


#: Seconds after the worker's start without any partition assigned before ``/ready`` explains
#: why and the worker logs it once (a group of 16 formed in 6 s on the H200 with Kafka's
#: default 3 s initial rebalance delay, docs/scaleout.md; a restart on the embedded broker
#: takes 5–20 s, docs/broker.md).
UNASSIGNED_WARN_S = 60.0


@dataclass
class WorkerState:
    """Everything the views need: the app, settings, runtime, tables and metrics."""

    app: faust.App
    settings: Settings
    runtime: Any
    tables: FaustDeviceTables
    plan: WindowPlan
    observer: DeviceStateObserver
    reader: DeviceStateReader
    metrics: Metrics
    partition_check: PartitionCheck
    #: Row readers of every restored table (device tables, retry_counts): their rejections.
    screens: list[RowScreen] = field(default_factory=list)
    progress: ProgressWatch = field(default_factory=lambda: ProgressWatch(0.0))
    #: For the readiness probe of SSL / SASL_SSL listeners.
    probe_ssl: ssl.SSLContext | None = None
    #: ``time.monotonic()`` when the state was built (the worker's start).
    started: float = field(default_factory=time.monotonic)

    @property
    def worker(self) -> str:
        return str(self.runtime.worker)

    @property
    def url(self) -> str:
        return str(self.app.conf.canonical_url)

    def assigned(self, topic: str | None = None) -> list[tuple[str, int]]:
        """Assigned ``(topic, partition)`` pairs (of ``topic``, default the request topic)."""
        topic = topic or self.settings.request_topic
        with contextlib.suppress(Exception):  # consumer not started yet
            return sorted(
                (tp.topic, tp.partition) for tp in self.app.consumer.assignment()
                if tp.topic == topic
            )
        return []

    def readiness(self) -> dict[str, bool]:
        """The checks behind ``/ready``: partitions assigned, engines loaded and warmed up,
        tables recovered (no rebalance or changelog recovery in progress)."""
        checks = {
            "partitions_assigned": bool(self.assigned()),
            "engines_warm": bool(self.runtime.ready),
            "tables_recovered": not bool(getattr(self.app, "rebalancing", False)),
            "table_partitions_match": not self.partition_check.degraded,
        }
        if self.settings.gpu_executor == "shared":
            # False while the executor server is down (its clients reconnect on their own)
            checks["gpu_server_reachable"] = bool(self.runtime.ready) and all(
                getattr(m.executor, "connected", True) for m in self.runtime.models.values())
        return checks

    def unassigned_problem(self, now: float | None = None) -> str | None:
        """Why no partition is assigned, once :data:`UNASSIGNED_WARN_S` passed since the start
        without any (None before, and while partitions are assigned)."""
        waited = (time.monotonic() if now is None else now) - self.started
        if waited < UNASSIGNED_WARN_S or self.assigned():
            return None
        return (
            f"no partition of {self.settings.request_topic} assigned {waited:.0f} s after the "
            "start: the group may still be rebalancing (workers starting or stopping), or it "
            "has more workers than the topic has partitions; on the embedded broker a group can "
            "stay stuck for good after some of its workers stopped (the broker keeps a member "
            "that left as the group's leader: docs/broker.md): restart `streamapp broker` or "
            "give the workers a new --app-id")

    def readiness_problems(self, checks: dict[str, bool]) -> dict[str, str]:
        """Why the failing checks of :meth:`readiness` fail, for ``/ready``'s ``problems``
        (a sentence each: ``partitions_assigned`` after :data:`UNASSIGNED_WARN_S`,
        ``gpu_server_reachable``)."""
        out: dict[str, str] = {}
        if not checks.get("partitions_assigned", True):
            unassigned = self.unassigned_problem()
            if unassigned is not None:
                out["partitions_assigned"] = unassigned
        if checks.get("gpu_server_reachable", True):
            return out
        if not self.runtime.ready:
            out["gpu_server_reachable"] = "the models are not connected to the executor " \
                "server yet (see engines_warm)"
            return out
        lost = sorted({str(getattr(m.executor, "path", "?")) for m in
                       self.runtime.models.values()
                       if not getattr(m.executor, "connected", True)})
        out["gpu_server_reachable"] = (
            f"the executor server at {', '.join(lost)} is not reachable: the worker "
            "reconnects on its own and batches wait up to gpu_server_wait_s "
            f"({self.settings.gpu_server_wait_s:g} s) for it, reading paused; a server that "
            "does not come back: its log (`streamapp worker --processes N` restarts it, "
            "`streamapp gpu-server` starts one by hand)")
        return out

    def degraded(self) -> dict[str, str]:
        """Why the device state is degraded now, by component (empty: it is not): tables whose
        rows are kept in memory (a full disk: still served and kept, ``/ready`` stays 200 for
        it), and ``table_partitions`` while the topics' partition counts differ from the
        tables' (``/ready`` is 503 for that one: ``table_partitions_match``); docs/tables.md."""
        out: dict[str, str] = {}
        mismatched = self.partition_check.mismatch()
        if mismatched:
            out["table_partitions"] = (
                "; ".join(f"{t} has {n} partitions" for t, n in sorted(mismatched.items()))
                + f", the tables {self.partition_check.table_partitions}: table updates are "
                "skipped until `streamapp tables rebuild` (docs/tables.md)")
        for name, status in self.tables.write_status().items():
            if status.degraded:
                out[name] = (
                    f"{status.rows_in_memory} row(s) of partition(s) "
                    f"{', '.join(map(str, status.partitions))} kept in memory: the database "
                    f"refuses writes ({status.error})"
                )
        return out

    async def marks(self) -> PartitionMarks:
        """High watermarks and positions of the assigned request and retry partitions."""
        return await partition_marks(
            self.app, (self.settings.request_topic, self.settings.retry_topic)
        )

    def backlog(self, marks: PartitionMarks) -> dict[tuple[str, int], int]:
        """Records not committed yet per fetched source partition: the fetch high watermark
        minus the group's committed offset (the records waiting in the broker, fetched into
        Faust's buffers, in the pipeline, and answered but not committed yet).

        The committed offset is the one delivery tracks (:mod:`streamapp.offsets`); for a
        partition the agent has not read from yet, the consumer's position stands in for it
        (the same unless Faust fetched records of it that the agent has not taken yet).
        """
        tracker = self.runtime.delivery.tracker
        out = {}
        for tp, high in marks.highwater.items():
            state = tracker.state(tp)
            base = state.committed if state is not None else marks.position.get(tp)
            if base is not None:
                out[tp] = max(0, high - base)
        return out

    async def broker_checks(
        self, marks: PartitionMarks | None = None
    ) -> tuple[dict[str, bool], dict[str, str]]:
        """The checks of ``/ready`` beyond :meth:`readiness` (:mod:`streamapp.readiness`): a
        bootstrap server answers a Kafka request within ``ready_probe_timeout_ms``
        (``broker_responsive``), and the worker makes progress while records wait
        (``making_progress``: not stalled for ``ready_stall_s``).

        Returns:
            ``(checks, problems)``: the two checks, and for each failing one why (a sentence).
        """
        marks = marks if marks is not None else await self.marks()
        problems: dict[str, str] = {}
        probe = await probe_kafka(
            self.settings.bootstrap_servers,
            timeout_s=self.settings.ready_probe_timeout_ms / 1000.0, ssl_context=self.probe_ssl,
        )
        if probe is not None:
            problems["broker_responsive"] = probe
        waiting = sum(self.backlog(marks).values())
        pipeline = getattr(self.runtime, "pipeline", None)
        progress = (
            pipeline.stats.received if pipeline is not None else -1,
            self.runtime.delivery.stats.commits,
            tuple(sorted(marks.position.items())), tuple(sorted(marks.highwater.items())),
        )
        stalled = self.progress.observe(progress, waiting)
        if stalled is not None:
            problems["making_progress"] = (
                f"{waiting} records wait, but for {stalled:.0f} s no record was read, no offset "
                f"committed and no fetch moved (ready_stall_s={self.settings.ready_stall_s:g})"
            )
        checks = {name: name not in problems for name in ("broker_responsive", "making_progress")}
        return checks, problems

    async def refresh_gauges(self, gauges: WorkerGauges) -> None:
        """Point-in-time values for ``/metrics``."""
        marks = await self.marks()
        broker, _ = await self.broker_checks(marks)
        gauges.ready = all(self.readiness().values()) and all(broker.values())
        pipeline = getattr(self.runtime, "pipeline", None)
        batcher = getattr(pipeline, "batcher", None)
        gauges.inflight_batches = int(getattr(batcher, "inflight", 0) or 0)
        gauges.pending_requests = int(getattr(batcher, "pending", 0) or 0)
        gauges.engines = {
            name: {**e, "engine": e.get("tag", "")}
            for name, e in (self.runtime.describe().get("engines") or {}).items()
        }
        stats = self.observer.stats
        gauges.table_flushes = stats.flushes
        gauges.table_rows_written = stats.rows_written
        gauges.table_buckets_expired = stats.buckets_expired
        check = self.partition_check
        gauges.table_updates_skipped = check.skipped
        gauges.partitions = {
            "tables": check.table_partitions,
            **{t: n for t, n in check.counts().items() if n is not None},
        }
        gauges.table_writes = {
            name: (status.write_errors, status.reopens, status.rows_in_memory)
            for name, status in self.tables.write_status().items()
        }
        gauges.state_degraded = check.degraded or bool(self.degraded())
        gauges.rows_rejected = {
            (screen.table, reason, source): n
            for screen in self.screens for (reason, source), n in screen.rejected.items()
        }
        delivery = self.runtime.delivery.stats
        produced = pipeline.stats if pipeline is not None else None
        gauges.delivery = {
            "gap_reads": delivery.gap_reads,
            "gap_records": delivery.gap_records,
            "commits": delivery.commits,
            "commit_failures": delivery.commit_failures,
            # pipeline counters restart with the pipeline; keep the highest seen
            "produce_failures": max(gauges.delivery.get("produce_failures", 0),
                                    produced.produce_failures if produced else 0),
            "bisections": max(gauges.delivery.get("bisections", 0),
                              produced.bisections if produced else 0),
            "stale_dropped": max(gauges.delivery.get("stale_dropped", 0),
                                 produced.stale_dropped if produced else 0),
        }
        transactions = getattr(self.runtime, "transactions", None)
        if transactions is not None:
            gauges.delivery["transactions"] = transactions.stats.commits
            gauges.delivery["transaction_failures"] = transactions.stats.failures
        # This worker's topics: several apps may share a process (tests); Faust names
        # changelogs "<app id>-<table>-changelog".
        gauges.undecodable = {
            key: counts for key, counts in undecodable_counts().items()
            if key[0] in (self.settings.request_topic, self.settings.retry_topic)
            or key[0].startswith(f"{self.settings.app_id}-")
        }
        gauges.lag, gauges.highwater, gauges.assigned = marks.lag, marks.highwater, marks.assigned
        gauges.backlog = self.backlog(marks)

    @property
    def observers(self) -> list[PipelineObserver]:
        """The pipeline observers that feed this state: the device-state writer, the metrics."""
        return [GatedStateObserver(self.observer, self.partition_check), self.metrics]


def build_state(
    app: faust.App, settings: Settings, runtime: Any, check: PartitionCheck | None = None
) -> WorkerState:
    """Define the device tables and the metrics on ``app``.

    Call it from ``create_app`` before the worker starts; pass :attr:`WorkerState.observers` to
    the pipeline.

    Args:
        app: The worker's Faust app.
        settings: The worker's settings.
        runtime: The :class:`~streamapp.runtime.WorkerRuntime` (``ready``, ``worker``,
            ``describe()``, ``pipeline``).
        check: Whether the tables' partition count still matches the topics' (default: a
            new :class:`~streamapp.partitions.PartitionCheck`).

    Returns:
        The state the views query.
    """
    plan = WindowPlan.from_settings(settings)
    tables = define_tables(app, settings)
    observer = DeviceStateObserver(
        tables, plan, request_topic=settings.request_topic,
        ewma_alpha=settings.latency_ewma_alpha,
    )
    metrics = Metrics(settings.models, max_batch_size=settings.max_batch_size)
    state = WorkerState(
        app=app, settings=settings, runtime=runtime, tables=tables, plan=plan,
        observer=observer, reader=DeviceStateReader(tables, plan), metrics=metrics,
        partition_check=check or PartitionCheck(app, settings),
        screens=list(tables.screens.values()),
        progress=ProgressWatch(settings.ready_stall_s),
        probe_ssl=kafka_security_options(settings).get("ssl_context"),
    )
    metrics.add_refresher(state.refresh_gauges)
    return state
