"""A worker's queryable state and observability, installed by one call from ``create_app``.

:func:`install_state` defines the device tables (:mod:`streamapp.tables`), the metrics
(:mod:`streamapp.metrics`) and the web views (:mod:`streamapp.views`) on the app, and returns the
pipeline observers that feed them.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from dataclasses import dataclass
from typing import Any

import faust
from yarl import URL

from streamapp.agents.observer import PipelineObserver
from streamapp.metrics import Metrics, WorkerGauges
from streamapp.settings import Settings
from streamapp.tables import DeviceStateObserver, DeviceStateReader, WindowPlan
from streamapp.tables.faust_tables import FaustDeviceTables, define_tables

__all__ = ["WorkerState", "advertised_host", "install_state"]

log = logging.getLogger(__name__)


def advertised_host(settings: Settings) -> str:
    """The host other workers reach this one at: ``web_host``, else ``web_bind`` unless that is
    a wildcard address, else the host name."""
    if settings.web_host:
        return settings.web_host
    if settings.web_bind not in ("0.0.0.0", "::", ""):
        return settings.web_bind
    return socket.gethostname()


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
        return {
            "partitions_assigned": bool(self.assigned()),
            "engines_warm": bool(self.runtime.ready),
            "tables_recovered": not bool(getattr(self.app, "rebalancing", False)),
        }

    async def refresh_gauges(self, gauges: WorkerGauges) -> None:
        """Point-in-time values for ``/metrics``."""
        gauges.ready = all(self.readiness().values())
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
        topics = (self.settings.request_topic, self.settings.retry_topic)
        lag: dict[tuple[str, int], int] = {}
        highwater: dict[tuple[str, int], int] = {}
        assigned: dict[str, int] = dict.fromkeys(topics, 0)
        consumer = self.app.consumer
        tps = []
        with contextlib.suppress(Exception):  # consumer not started yet
            tps = [tp for tp in consumer.assignment() if tp.topic in topics]
        for tp in tps:
            assigned[tp.topic] += 1
            try:
                # The high watermark of the last fetch response: right on Tansu, unlike the
                # ListOffsets answer (docs/broker.md); None until the partition was fetched.
                hw = consumer.highwater(tp)
                position = await consumer.position(tp) if hw is not None else None
            except Exception:  # e.g. revoked between assignment() and here
                continue
            if hw is None:
                continue
            highwater[(tp.topic, tp.partition)] = int(hw)
            if position is not None:
                lag[(tp.topic, tp.partition)] = max(0, int(hw) - int(position))
        gauges.lag, gauges.highwater, gauges.assigned = lag, highwater, assigned


def install_state(app: faust.App, settings: Settings, runtime: Any) -> list[PipelineObserver]:
    """Define device tables, metrics and web views on ``app``.

    Call it from ``create_app`` before the worker starts; pass the returned observers to the
    pipeline.

    Args:
        app: The worker's Faust app.
        settings: The worker's settings.
        runtime: The :class:`~streamapp.runtime.WorkerRuntime` (``ready``, ``worker``,
            ``describe()``, ``pipeline``).

    Returns:
        The pipeline observers: the device-state writer and the metrics.
    """
    from streamapp.views import install_views

    # Routing needs the URL peers reach us at (Faust derives it from web_host at app creation,
    # where ours is the bind address; a wildcard bind would advertise 0.0.0.0).
    app.conf.canonical_url = URL(f"http://{advertised_host(settings)}:{settings.web_port}")
    app.conf.recovery_consistency_check = settings.consistency_check
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
    )
    metrics.add_refresher(state.refresh_gauges)
    install_views(app, state)
    app.streamapp_state = state  # type: ignore[attr-defined]
    return [observer, metrics]
