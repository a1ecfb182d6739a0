"""Prometheus metrics of one worker (``GET /metrics``), named after Triton's where they match.

Every worker (every app) has its own :class:`prometheus_client.CollectorRegistry`, so several
apps in one process (tests) never share counters. :class:`Metrics` is a
:class:`~streamapp.agents.observer.PipelineObserver`: counters and histograms are updated from
outcomes and batches as they happen; gauges (in-flight batches, consumer lag, readiness, GPUs)
are read when scraped.

Consumer lag is ``high watermark - position`` per assigned request-topic partition, with the
high watermark the consumer learnt from its last *fetch response*: on the embedded broker
(Tansu) a ListOffsets answer is wrong after multi-record batches (``docs/broker.md``), while
the fetch high watermark is right, and on Apache Kafka both agree.

GPU gauges come from NVML (the ``nvidia-ml-py`` package, module ``pynvml``) when it imports and
initialises; without it they are simply absent.

The *Metrics* table in docs/metrics.md lists every family (a test keeps it in sync with
:data:`METRIC_FAMILIES`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from streamapp.agents.observer import Outcome
from streamapp.batching import BatchInfo

__all__ = [
    "CONTENT_TYPE_LATEST",
    "METRIC_FAMILIES",
    "GpuMonitor",
    "Metrics",
    "WorkerGauges",
    "metrics_reference",
]

log = logging.getLogger(__name__)

#: Outcomes of requests a queue policy kept from the engine: counted, no latencies.
_SKIPPED = frozenset(("expired", "superseded"))

#: Latency buckets (seconds): 0.5 ms … 10 s, roughly x2 apart.
LATENCY_BUCKETS_S = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
)

#: Every metric family we export (name as exposed, type, labels, help). Process and platform
#: families of prometheus-client (``process_*``, ``python_info``) come on top.
METRIC_FAMILIES: tuple[tuple[str, str, str, str], ...] = (
    ("streamapp_requests_total", "counter", "model, outcome",
     "Requests finished, by final outcome: `result`, `dead_letter`, or `expired` / "
     "`superseded` (a queue policy kept them from the engine: a result record without "
     "outputs, docs/delivery.md); they sum to the requests read (Triton: "
     "`nv_inference_request_success` / `_failure`). Retries are not outcomes: they are "
     "counted in `streamapp_retries_total`."),
    ("streamapp_dead_letters_total", "counter", "model, reason",
     "Dead letters by reason code."),
    ("streamapp_retries_total", "counter", "model, reason",
     "Attempts that failed transiently and were sent to the retry topic, by reason code (a "
     "request retried twice counts 2 here and 1 in `streamapp_requests_total`)."),
    ("streamapp_batches_total", "counter", "model, closed_by",
     "Batches run, by why they closed: `size`, `delay` or `flush` (Triton: "
     "`nv_inference_exec_count`)."),
    ("streamapp_batch_size", "histogram", "model",
     "Requests per batch, as run by the engine (Triton: `nv_inference_count` / "
     "`exec_count`): requests a queue policy skipped are not in it, and a batch it emptied "
     "is neither run nor counted, so `_sum` is the requests the engine ran."),
    ("streamapp_queue_duration_seconds", "histogram", "model",
     "Per answered request: from reading it to its batch starting on the engine (result "
     "field `queue_ms`; Triton: `nv_inference_queue_duration_us`)."),
    ("streamapp_inference_duration_seconds", "histogram", "model",
     "Per answered request: the engine time of the batch it ran in (result field `infer_ms`; "
     "Triton: `nv_inference_compute_infer_duration_us`)."),
    ("streamapp_e2e_duration_seconds", "histogram", "model",
     "Per answered request: from its capture time `ts` to its result being produced (result "
     "field `e2e_ms`); includes the queue and inference durations and everything before the "
     "worker read it."),
    ("streamapp_inflight_batches", "gauge", "",
     "Batches running on the engines now (at most `max_inflight_batches`)."),
    ("streamapp_pending_requests", "gauge", "",
     "Requests read but not yet answered (batching, running or waiting to be emitted)."),
    ("streamapp_consumer_lag", "gauge", "topic, partition",
     "Records in the partition the worker has not fetched yet: fetch high watermark − "
     "position."),
    ("streamapp_backlog_records", "gauge", "topic, partition",
     "Records of the partition not committed yet: fetch high watermark − the group's "
     "committed offset, so it counts what waits in the broker, what Faust fetched into its "
     "buffers, what is in the pipeline and what is answered but not yet committed (what a "
     "crash would re-deliver). What an alert or an autoscaler reads (docs/metrics.md); per "
     "assigned partition, so sum it over workers."),
    ("streamapp_consumer_highwater", "gauge", "topic, partition",
     "High watermark (next offset to be written) from the last fetch response."),
    ("streamapp_assigned_partitions", "gauge", "topic",
     "Partitions of the request topic assigned to this worker."),
    ("streamapp_ready", "gauge", "",
     "1 when `/ready` answers 200 (partitions assigned, engines warmed up, tables recovered, "
     "the broker answers a Kafka request, progress while records wait)."),
    ("streamapp_engine_info", "info", "model, backend, engine, device, precision, "
     "max_batch_size, model_version", "The engine serving each model (value 1); "
     "`model_version` is its current version, changed by `streamapp models load` "
     "(docs/versions.md)."),
    ("streamapp_table_flushes_total", "counter", "",
     "Times the device tables were written (once per state flush: state_flush_interval_ms, "
     "or sooner after state_flush_max_records finished records)."),
    ("streamapp_table_rows_written_total", "counter", "",
     "Table rows written (stats rows and window buckets)."),
    ("streamapp_table_buckets_expired_total", "counter", "",
     "Window buckets deleted because they expired."),
    ("streamapp_state_degraded", "gauge", "",
     "1 while device state is degraded: the request or retry topic's partition count "
     "differs from the tables' (`streamapp tables rebuild`; `/ready` is 503 meanwhile), or "
     "rows are kept in memory because RocksDB refuses writes (a full disk; `/ready` stays "
     "200 and says why). docs/tables.md."),
    ("streamapp_topic_partitions", "gauge", "topic",
     "Partition count of the request and retry topics as the worker's consumer sees them, and "
     "of the tables (topic `tables`)."),
    ("streamapp_table_updates_skipped_total", "counter", "",
     "Device-state flushes and retry-counter writes skipped while the partition counts of "
     "the topics and the tables differed."),
    ("streamapp_table_write_errors_total", "counter", "table",
     "Table writes RocksDB refused (a full disk); the rows are kept in memory and written "
     "when the database takes writes again (docs/tables.md)."),
    ("streamapp_table_reopens_total", "counter", "table",
     "Partition databases reopened after refusing writes, whose kept rows were then written."),
    ("streamapp_table_rows_in_memory", "gauge", "table",
     "Rows kept in memory now because their database refuses writes."),
    ("streamapp_state_rows_rejected_total", "counter", "table, reason, source",
     "Table rows that could not be read and were reset (`device_stats`: the device's answer "
     "carries `state_reset`; `device_windows`: an empty bucket; `retry_counts`: dropped), "
     "each logged once at ERROR. `reason`: `undecodable` (not UTF-8 JSON), `bad_shape` (JSON "
     "that is not a row of the table) or `no_key`; `source`: `changelog` (a record restored "
     "from the changelog, logged with topic, partition and offset) or `store` (the local "
     "store); docs/tables.md."),
    ("streamapp_gpu_utilization_ratio", "gauge", "gpu, name",
     "GPU utilisation, 0–1, from NVML (Triton: `nv_gpu_utilization`); absent without NVML."),
    ("streamapp_gpu_memory_used_bytes", "gauge", "gpu, name",
     "GPU memory in use (Triton: `nv_gpu_memory_used_bytes`); absent without NVML."),
    ("streamapp_gpu_memory_total_bytes", "gauge", "gpu, name",
     "GPU memory in total (Triton: `nv_gpu_memory_total_bytes`); absent without NVML."),
    *(
        # -- delivery (streamapp.delivery, streamapp.agents.pipeline) --
        ("streamapp_gap_reads_total", "counter", "",
         "Times records the consumer skipped were read directly from the broker (at admission "
         "or by the idle sweep); 0 in normal operation."),
        ("streamapp_gap_records_total", "counter", "",
         "Records those gap reads handed to the pipeline."),
        ("streamapp_commits_total", "counter", "",
         "Offset commits of the source topics the broker accepted."),
        ("streamapp_commit_failures_total", "counter", "",
         "Offset commits that failed (retried at the next interval)."),
        ("streamapp_produce_failures_total", "counter", "",
         "Outcomes the producer failed to deliver (the request stays uncommitted and is "
         "processed again)."),
        ("streamapp_bisections_total", "counter", "",
         "Failed batches whose requests were run again, each alone, to isolate the failing "
         "request(s)."),
        ("streamapp_transactions_total", "counter", "",
         "Transactions committed with outcomes, changelog records or offsets in them "
         "(processing_guarantee=exactly_once; 0 otherwise); docs/delivery.md."),
        ("streamapp_transaction_failures_total", "counter", "",
         "Transactions that could not be committed (the worker aborts and stops after one)."),
        ("streamapp_stale_outcomes_dropped_total", "counter", "",
         "Outcomes not produced because their partition was revoked or reassigned after the "
         "record was read (its next reader answers it)."),
        ("streamapp_undecodable_batches_total", "counter", "topic, handling",
         "Fetched record batches the consumer could not decode (bad CRC, a codec it lacks, "
         "corrupt compressed data), each counted once: `dead_lettered` (request and retry "
         "topics: one `undecodable_record_batch` dead letter per offset) or `skipped` (table "
         "changelogs: logged at ERROR); docs/faults.md."),
        ("streamapp_undecodable_records_total", "counter", "topic, handling",
         "Offsets those batches cover."),
    ),
)


def metrics_reference() -> str:
    """The Markdown table of :data:`METRIC_FAMILIES` (what docs/metrics.md shows)."""
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for name, kind, labels, text in METRIC_FAMILIES:
        rows.append(f"| `{name}` | {kind} | {labels or '—'} | {text} |")
    return "\n".join(rows)


def _batch_buckets(max_batch_size: int) -> tuple[float, ...]:
    edges = [1.0]
    while edges[-1] < max_batch_size:
        edges.append(edges[-1] * 2)
    edges[-1] = float(max_batch_size)
    return tuple(sorted(set(edges)))


class GpuMonitor:
    """GPU utilisation and memory through NVML, when ``pynvml`` imports and NVML initialises.

    Attributes:
        available: False when NVML is missing or failed; :meth:`sample` then returns nothing.
    """

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: list[tuple[str, str, Any]] = []
        try:
            import pynvml  # nvidia-ml-py; optional (the gpu extra)

            pynvml.nvmlInit()
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                name = pynvml.nvmlDeviceGetName(handle)
                if isinstance(name, bytes):
                    name = name.decode()
                self._handles.append((str(i), str(name), handle))
            self._nvml = pynvml
        except Exception as exc:  # ImportError, NVMLError (no driver), ...
            log.debug("no GPU metrics: NVML unavailable (%s)", exc)
            self._handles = []

    @property
    def available(self) -> bool:
        return self._nvml is not None and bool(self._handles)

    def sample(self) -> list[tuple[str, str, float, int, int]]:
        """``(index, name, utilisation 0-1, memory used bytes, memory total bytes)`` per GPU."""
        out: list[tuple[str, str, float, int, int]] = []
        if self._nvml is None:
            return out
        for index, name, handle in self._handles:
            try:
                util = self._nvml.nvmlDeviceGetUtilizationRates(handle)
                mem = self._nvml.nvmlDeviceGetMemoryInfo(handle)
                out.append((index, name, util.gpu / 100.0, int(mem.used), int(mem.total)))
            except Exception as exc:
                log.debug("NVML query of GPU %s failed: %s", index, exc)
        return out


@dataclass
class WorkerGauges:
    """Point-in-time values the collector exports; refreshed by :meth:`Metrics.refresh`.

    Attributes:
        lag / highwater / backlog: ``{(topic, partition): records}``.
        assigned: ``{topic: partitions assigned}``.
    """

    ready: bool = False
    inflight_batches: int = 0
    pending_requests: int = 0
    lag: dict[tuple[str, int], int] = field(default_factory=dict)
    highwater: dict[tuple[str, int], int] = field(default_factory=dict)
    backlog: dict[tuple[str, int], int] = field(default_factory=dict)
    assigned: dict[str, int] = field(default_factory=dict)
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)
    table_flushes: int = 0
    table_rows_written: int = 0
    table_buckets_expired: int = 0
    state_degraded: bool = False
    table_updates_skipped: int = 0
    #: ``{topic: partitions}`` of the request and retry topics, plus ``"tables"``.
    partitions: dict[str, int] = field(default_factory=dict)
    #: ``{table: (write errors, reopens, rows in memory)}`` (:class:`TableWriteStatus`).
    table_writes: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    #: ``{(table, reason, source): rows}`` of rows rejected (:mod:`streamapp.tables.rows`).
    rows_rejected: dict[tuple[str, str, str], int] = field(default_factory=dict)
    #: Delivery counters: ``gap_reads``, ``gap_records``, ``commits``, ``commit_failures``,
    #: ``produce_failures``, ``bisections``, ``transactions``, ``transaction_failures``,
    #: ``stale_dropped`` (see :data:`DELIVERY_COUNTERS`).
    delivery: dict[str, int] = field(default_factory=dict)
    #: ``{(topic, handling): (batches, offsets)}`` of undecodable record batches
    #: (:func:`streamapp.record_batches.undecodable_counts`).
    undecodable: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)


#: ``(key in WorkerGauges.delivery, family name without _total, help)`` of the delivery counters.
DELIVERY_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("gap_reads", "streamapp_gap_reads", "Gap reads from the broker."),
    ("gap_records", "streamapp_gap_records", "Records handed out by gap reads."),
    ("commits", "streamapp_commits", "Offset commits accepted."),
    ("commit_failures", "streamapp_commit_failures", "Offset commits failed."),
    ("produce_failures", "streamapp_produce_failures", "Outcomes not delivered."),
    ("bisections", "streamapp_bisections", "Failed batches whose requests were run again alone."),
    ("transactions", "streamapp_transactions", "Transactions committed (exactly_once)."),
    ("transaction_failures", "streamapp_transaction_failures", "Transactions that failed."),
    ("stale_dropped", "streamapp_stale_outcomes_dropped",
     "Outcomes of revoked partitions' records not produced (exactly_once)."),
)


class _GaugeCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Any]:
        g = self._metrics.gauges
        yield _gauge("streamapp_ready", "1 when the worker is ready.", value=float(g.ready))
        yield _gauge("streamapp_inflight_batches", "Batches running now.",
                     value=g.inflight_batches)
        yield _gauge("streamapp_pending_requests", "Requests read, not yet answered.",
                     value=g.pending_requests)
        lag = GaugeMetricFamily("streamapp_consumer_lag", "Records not fetched yet "
                                "(fetch high watermark - position).", labels=["topic", "partition"])
        for (topic, partition), value in sorted(g.lag.items()):
            lag.add_metric([topic, str(partition)], value)
        yield lag
        backlog = GaugeMetricFamily("streamapp_backlog_records", "Records not committed yet "
                                    "(fetch high watermark - committed offset).",
                                    labels=["topic", "partition"])
        for (topic, partition), value in sorted(g.backlog.items()):
            backlog.add_metric([topic, str(partition)], value)
        yield backlog
        hw = GaugeMetricFamily("streamapp_consumer_highwater", "High watermark from the last "
                               "fetch.", labels=["topic", "partition"])
        for (topic, partition), value in sorted(g.highwater.items()):
            hw.add_metric([topic, str(partition)], value)
        yield hw
        assigned = GaugeMetricFamily("streamapp_assigned_partitions", "Partitions assigned.",
                                     labels=["topic"])
        for topic, n in sorted(g.assigned.items()):
            assigned.add_metric([topic], n)
        yield assigned
        info = InfoMetricFamily("streamapp_engine", "The engine serving each model.",
                                labels=["model"])
        for model, e in sorted(g.engines.items()):
            info.add_metric([model], {k: str(e.get(k, "")) for k in (
                "backend", "engine", "device", "precision", "max_batch_size",
                "model_version")})
        yield info
        yield _gauge("streamapp_state_degraded", "1 while device state is degraded (partition "
                     "counts differ, or rows kept in memory).", value=float(g.state_degraded))
        partitions = GaugeMetricFamily("streamapp_topic_partitions", "Partitions of the source "
                                       "topics and of the tables.", labels=["topic"])
        for topic, n in sorted(g.partitions.items()):
            partitions.add_metric([topic], n)
        yield partitions
        for name, value, text in (
            ("streamapp_table_updates_skipped", g.table_updates_skipped,
             "Table updates skipped while the state was degraded."),
            ("streamapp_table_flushes", g.table_flushes, "Device table flushes."),
            ("streamapp_table_rows_written", g.table_rows_written, "Table rows written."),
            ("streamapp_table_buckets_expired", g.table_buckets_expired,
             "Window buckets expired."),
        ):
            yield CounterMetricFamily(name, text, value=value)
        errors = CounterMetricFamily("streamapp_table_write_errors", "Table writes refused.",
                                     labels=["table"])
        reopens = CounterMetricFamily("streamapp_table_reopens", "Table databases reopened.",
                                      labels=["table"])
        kept = GaugeMetricFamily("streamapp_table_rows_in_memory", "Rows kept in memory.",
                                 labels=["table"])
        for table, (n_errors, n_reopens, n_kept) in sorted(g.table_writes.items()):
            errors.add_metric([table], n_errors)
            reopens.add_metric([table], n_reopens)
            kept.add_metric([table], n_kept)
        yield from (errors, reopens, kept)
        rejected = CounterMetricFamily("streamapp_state_rows_rejected", "Table rows that could "
                                       "not be read and were reset.",
                                       labels=["table", "reason", "source"])
        for (table, reason, source), n in sorted(g.rows_rejected.items()):
            rejected.add_metric([table, reason, source], n)
        yield rejected
        for key, name, text in DELIVERY_COUNTERS:
            yield CounterMetricFamily(name, text, value=g.delivery.get(key, 0))
        batches = CounterMetricFamily("streamapp_undecodable_batches", "Record batches the "
                                      "consumer could not decode.", labels=["topic", "handling"])
        offsets = CounterMetricFamily("streamapp_undecodable_records", "Offsets of undecodable "
                                      "record batches.", labels=["topic", "handling"])
        for (topic, handling), (n_batches, n_offsets) in sorted(g.undecodable.items()):
            batches.add_metric([topic, handling], n_batches)
            offsets.add_metric([topic, handling], n_offsets)
        yield from (batches, offsets)
        samples = self._metrics.gpu.sample() if self._metrics.gpu is not None else []
        if samples:
            util = GaugeMetricFamily("streamapp_gpu_utilization_ratio", "GPU utilisation 0-1.",
                                     labels=["gpu", "name"])
            used = GaugeMetricFamily("streamapp_gpu_memory_used_bytes", "GPU memory used.",
                                     labels=["gpu", "name"])
            total = GaugeMetricFamily("streamapp_gpu_memory_total_bytes", "GPU memory total.",
                                      labels=["gpu", "name"])
            for index, gpu_name, u, m_used, m_total in samples:
                util.add_metric([index, gpu_name], u)
                used.add_metric([index, gpu_name], m_used)
                total.add_metric([index, gpu_name], m_total)
            yield from (util, used, total)


def _gauge(name: str, text: str, *, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, value=value)


def observe_many(histogram: Any, values: np.ndarray) -> None:
    """``histogram.observe(v)`` for every ``v`` of ``values`` (float64[n]), in O(buckets)
    Python calls instead of O(n): the bucket of each value (the first upper bound ≥ it, as
    ``Histogram.observe`` picks) comes from one ``np.searchsorted``.

    Uses prometheus_client's histogram child internals (``_upper_bounds``, ``_buckets``,
    ``_sum``, unchanged since 0.4); where they are missing, observes one value at a time.
    """
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None:
        for value in values.tolist():
            histogram.observe(value)
        return
    index = np.searchsorted(np.asarray(bounds, dtype=np.float64), values, side="left")
    index = index[index < len(bounds)]  # NaN falls in no bucket, as in observe()
    for i, n in enumerate(np.bincount(index, minlength=len(bounds)).tolist()):
        if n:
            buckets[i].inc(n)
    total.inc(float(values.sum()))


class Metrics:
    """The worker's metrics: a pipeline observer plus scrape-time gauges.

    Args:
        models: Names of the models this worker loads; any other model name a request carries
            is labelled ``unknown`` (request fields are untrusted: they must not create label
            values without bound).
        max_batch_size: Top bucket of the batch-size histogram.
        gpu: NVML monitor; default: one is created (and is empty without NVML).
        process_metrics: Also export ``process_*`` and ``python_info``.
    """

    def __init__(
        self,
        models: Sequence[str],
        *,
        max_batch_size: int,
        gpu: GpuMonitor | None = None,
        process_metrics: bool = True,
    ) -> None:
        self.registry = CollectorRegistry()
        self.models = frozenset(models)
        r = self.registry
        self.requests = Counter("streamapp_requests", "Requests finished, by final outcome.",
                                ["model", "outcome"], registry=r)
        self.dead_letters = Counter("streamapp_dead_letters", "Dead letters by reason.",
                                    ["model", "reason"], registry=r)
        self.retries = Counter("streamapp_retries", "Attempts sent to the retry topic, by reason.",
                               ["model", "reason"], registry=r)
        self.batches = Counter("streamapp_batches", "Batches run by close reason.",
                               ["model", "closed_by"], registry=r)
        self.batch_size = Histogram("streamapp_batch_size", "Requests per batch.", ["model"],
                                    buckets=_batch_buckets(max_batch_size), registry=r)
        # One family per duration: e2e contains queue and inference, so they must not be summed
        # or share a family.
        self.queue_duration = Histogram(
            "streamapp_queue_duration_seconds", "Read to batch start, per answered request.",
            ["model"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.inference_duration = Histogram(
            "streamapp_inference_duration_seconds", "Engine time of the request's batch.",
            ["model"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.e2e_duration = Histogram(
            "streamapp_e2e_duration_seconds", "Capture ts to result produced, per request.",
            ["model"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.gauges = WorkerGauges()
        self.gpu = gpu if gpu is not None else GpuMonitor()
        r.register(_GaugeCollector(self))
        if process_metrics:
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
        self._children: dict[tuple[Any, ...], Any] = {}
        self._refreshers: list[Callable[[WorkerGauges], Any]] = []

    # -- PipelineObserver -----------------------------------------------------------------------

    def _model(self, model: str | None) -> str:
        return model if model in self.models else "unknown"

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def on_outcome(self, outcome: Outcome) -> None:
        model = self._model(outcome.model)
        if outcome.kind == "retry":  # not final: the request comes back
            self._child(self.retries, model, outcome.reason or "unknown").inc()
            return
        self._child(self.requests, model, outcome.kind).inc()
        if outcome.kind == "dead_letter":
            self._child(self.dead_letters, model, outcome.reason or "unknown").inc()
            return
        if outcome.kind in _SKIPPED:  # never reached the engine: no latencies
            return
        for histogram, ms in ((self.queue_duration, outcome.queue_ms),
                              (self.inference_duration, outcome.infer_ms),
                              (self.e2e_duration, outcome.e2e_ms)):
            if ms is not None:
                self._child(histogram, model).observe(max(ms, 0.0) / 1000.0)

    def on_outcomes(self, outcomes: Sequence[Outcome]) -> None:
        """:meth:`on_outcome` for many outcomes: counters incremented once per label set and
        the latency histograms filled in bulk (:func:`observe_many`)."""
        counts: dict[tuple[Any, ...], int] = {}
        latencies: dict[str, list[list[float]]] = {}
        for outcome in outcomes:
            model = self._model(outcome.model)
            kind = outcome.kind
            if kind == "retry":  # not final: the request comes back
                key: tuple[Any, ...] = (self.retries, model, outcome.reason or "unknown")
                counts[key] = counts.get(key, 0) + 1
                continue
            key = (self.requests, model, kind)
            counts[key] = counts.get(key, 0) + 1
            if kind == "dead_letter":
                key = (self.dead_letters, model, outcome.reason or "unknown")
                counts[key] = counts.get(key, 0) + 1
                continue
            if kind in _SKIPPED:
                continue
            columns = latencies.get(model)
            if columns is None:
                columns = latencies[model] = [[], [], []]
            for column, ms in zip(columns, (outcome.queue_ms, outcome.infer_ms,
                                            outcome.e2e_ms), strict=True):
                if ms is not None:
                    column.append(ms)
        for (metric, *labels), n in counts.items():
            self._child(metric, *labels).inc(n)
        for model, columns in latencies.items():
            for histogram, values in zip(
                (self.queue_duration, self.inference_duration, self.e2e_duration), columns,
                strict=True,
            ):
                if values:
                    observe_many(self._child(histogram, model),
                                 np.maximum(np.asarray(values, dtype=np.float64), 0.0) / 1e3)

    def on_batch(self, model: str, info: BatchInfo) -> None:
        model = self._model(model)
        self._child(self.batches, model, info.closed_by).inc()
        self._child(self.batch_size, model).observe(info.size)

    async def flush(self) -> None:
        return None

    # -- scraping -------------------------------------------------------------------------------

    def add_refresher(self, refresh: Callable[[WorkerGauges], Any]) -> None:
        """Register ``refresh(gauges)`` (sync or async) to run before each scrape."""
        self._refreshers.append(refresh)

    async def refresh(self) -> None:
        """Run the refreshers; one that fails is logged and leaves its gauges as they were."""
        for refresh in self._refreshers:
            try:
                result = refresh(self.gauges)
                if hasattr(result, "__await__"):
                    await result
            except Exception:
                log.exception("refreshing metrics with %r failed", refresh)

    async def render(self) -> bytes:
        """Refresh, then the Prometheus text exposition (``CONTENT_TYPE_LATEST``)."""
        await self.refresh()
        data: bytes = generate_latest(self.registry)
        return data

    def family_names(self) -> Iterator[str]:
        """Names of the families this registry exports (for the docs test)."""
        for metric in self.registry.collect():
            yield metric.name
