"""``streamapp status``: a terminal view of one or all workers, from their web APIs.

For each worker it reads ``/ready``, ``/metrics`` twice (``interval_s`` apart, for rates) and
``/devices?sort=-total``, then shows throughput (finished requests per second), dead-letter rate,
end-to-end latency p50/p99 over the interval (from the ``streamapp_e2e_duration_seconds`` histogram,
interpolated within buckets as Prometheus' ``histogram_quantile`` does), mean batch size,
in-flight batches, consumer lag and partitions, plus the busiest devices. With discovery on, the
first worker's ``/cluster`` names the others.

Workers started by ``streamapp worker --processes N`` are found without URLs: the supervisor lists
its children (URL, pid, restarts) in ``<data_dir>/supervisor.json`` (:func:`supervised_urls`),
and their restart counts are shown next to their names.
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

__all__ = [
    "Snapshot",
    "WorkerStatus",
    "collect",
    "histogram_quantile",
    "render",
    "run_status",
    "stopped_children",
    "supervised_urls",
]

#: Seconds one HTTP request to a worker may take.
HTTP_TIMEOUT_S = 5.0

Labels = tuple[tuple[str, str], ...]


@dataclass
class Snapshot:
    """One scrape of a worker: samples by name and sorted labels, and when it was taken."""

    at: float
    samples: dict[str, dict[Labels, float]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str, at: float) -> Snapshot:
        snap = cls(at)
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                snap.samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
        return snap

    def total(self, name: str, where: Callable[[dict[str, str]], bool] = lambda _: True) -> float:
        return sum(v for labels, v in self.samples.get(name, {}).items() if where(dict(labels)))

    def buckets(self, name: str, **match: str) -> dict[float, float]:
        """Cumulative histogram buckets ``{le: count}`` summed over series matching ``match``."""
        out: dict[float, float] = {}
        for labels, v in self.samples.get(f"{name}_bucket", {}).items():
            d = dict(labels)
            if all(d.get(k) == want for k, want in match.items()):
                le = float(d["le"])
                out[le] = out.get(le, 0.0) + v
        return out


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The ``q`` quantile of a cumulative histogram, interpolating linearly within the bucket
    that holds it (Prometheus' ``histogram_quantile``); None without observations. A quantile in
    the ``+Inf`` bucket is reported as the largest finite bound."""
    edges = sorted(buckets)
    if not edges or buckets[edges[-1]] <= 0:
        return None
    rank = q * buckets[edges[-1]]
    lower, below = 0.0, 0.0
    for le in edges:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = (le if not math.isinf(le) else lower), count
    return lower


def _in_overflow_bucket(q: float, buckets: Mapping[float, float]) -> bool:
    """Whether the ``q`` quantile lies beyond the largest finite bucket bound (in ``+Inf``):
    :func:`histogram_quantile` then reports that bound, a lower limit rather than a value."""
    finite = [le for le in buckets if not math.isinf(le)]
    total = max(buckets.values(), default=0.0)
    return bool(finite) and total > 0 and buckets[max(finite)] < q * total


def _delta(after: Mapping[float, float], before: Mapping[float, float]) -> dict[float, float]:
    return {le: after[le] - before.get(le, 0.0) for le in after}


@dataclass
class WorkerStatus:
    """What ``status`` shows for one worker (rates over the sampling interval)."""

    url: str
    worker: str = "?"
    ready: bool | None = None
    error: str | None = None
    partitions: int = 0
    throughput_per_s: float = 0.0
    results_per_s: float = 0.0
    dead_letters_per_s: float = 0.0
    dlq_ratio: float = 0.0
    retries_per_s: float = 0.0
    p50_ms: float | None = None
    p99_ms: float | None = None
    #: The p50 / p99 lies beyond the histogram's largest finite bucket: the value is that bound.
    p50_beyond_buckets: bool = False
    p99_beyond_buckets: bool = False
    #: p50/p99 are since the worker started: nothing finished during the interval.
    latency_all_time: bool = False
    mean_batch: float | None = None
    #: ``mean_batch`` is since the worker started: no batch ran during the interval.
    batch_all_time: bool = False
    inflight: int = 0
    lag: int = 0
    finished_total: int = 0
    restarts: int | None = None
    #: The supervisor's word for a child that does not answer (``stopped``, ``failed``...).
    stopped: str | None = None
    top_devices: list[dict[str, Any]] = field(default_factory=list)


_FINAL = ("result", "dead_letter")


def summarize(url: str, before: Snapshot, after: Snapshot) -> WorkerStatus:
    """Rates and quantiles between two scrapes of one worker."""
    dt = max(after.at - before.at, 1e-9)

    def rate(name: str, where: Callable[[dict[str, str]], bool] = lambda _: True) -> float:
        return max(0.0, after.total(name, where) - before.total(name, where)) / dt

    status = WorkerStatus(url)
    final = lambda labels: labels.get("outcome") in _FINAL  # noqa: E731
    status.throughput_per_s = rate("streamapp_requests_total", final)
    status.results_per_s = rate("streamapp_requests_total", lambda d: d.get("outcome") == "result")
    status.dead_letters_per_s = rate("streamapp_dead_letters_total")
    status.retries_per_s = rate("streamapp_retries_total")
    if status.throughput_per_s > 0:
        status.dlq_ratio = status.dead_letters_per_s / status.throughput_per_s
    status.finished_total = int(after.total("streamapp_requests_total", final))
    e2e_after = after.buckets("streamapp_e2e_duration_seconds")
    e2e = _delta(e2e_after, before.buckets("streamapp_e2e_duration_seconds"))
    if not e2e or max(e2e.values(), default=0) <= 0:
        e2e = e2e_after  # idle during the interval: since the worker started
        status.latency_all_time = True
    for q, name in ((0.5, "p50_ms"), (0.99, "p99_ms")):
        value = histogram_quantile(q, e2e)
        setattr(status, name, None if value is None else value * 1000.0)
    status.p50_beyond_buckets = _in_overflow_bucket(0.5, e2e)
    status.p99_beyond_buckets = _in_overflow_bucket(0.99, e2e)
    batches = after.total("streamapp_batch_size_count") - before.total("streamapp_batch_size_count")
    items = after.total("streamapp_batch_size_sum") - before.total("streamapp_batch_size_sum")
    if batches <= 0:
        batches, items = (after.total("streamapp_batch_size_count"),
                          after.total("streamapp_batch_size_sum"))
        status.batch_all_time = True
    status.mean_batch = items / batches if batches > 0 else None
    status.inflight = int(after.total("streamapp_inflight_batches"))
    status.lag = int(after.total("streamapp_consumer_lag"))
    status.partitions = int(after.total("streamapp_assigned_partitions",
                                        lambda d: "request" in d.get("topic", "")))
    return status


#: What a worker's 401 (issue 21's web token) means for ``status``.
_NEEDS_TOKEN = "needs the web token: set STREAMAPP_WEB_TOKEN or STREAMAPP_WEB_TOKEN_FILE"


def _get(url: str, headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _get_json(url: str, headers: Mapping[str, str] | None = None) -> Any:
    return json.loads(_get(url, headers)[1] or b"null")


def supervised_urls(data_dir: Path) -> dict[str, int] | None:
    """The children of a ``streamapp worker --processes N`` started with ``data_dir``: web URL →
    restarts so far, from its ``supervisor.json``; None when there is none."""
    from streamapp.supervisor import read_state

    state = read_state(data_dir)
    if state is None:
        return None
    return {str(c["url"]).rstrip("/"): int(c.get("restarts", 0)) for c in state["children"]}


def stopped_children(data_dir: Path) -> dict[str, str]:
    """The children of a supervisor (``supervisor.json`` in ``data_dir``) that are not running:
    web URL → what to show instead of their connection error, e.g. ``stopped (exit code 0)``,
    or, for every child of a supervisor that is gone, ``stopped (supervisor pid 123 is not
    running)``."""
    from streamapp.supervisor import describe_exit, read_state

    state = read_state(data_dir) or {"children": []}
    pid = state.get("pid")
    out = {}
    for child in state["children"]:
        url, rc = str(child["url"]).rstrip("/"), child.get("last_exit")
        word = child.get("state", "running")
        if word not in ("running", "starting"):
            out[url] = f"{word} ({describe_exit(rc)})" if isinstance(rc, int) else str(word)
        elif not _alive(pid):
            out[url] = f"stopped (supervisor pid {pid} is not running)"
    return out


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def worker_url(text: str) -> str:
    """A worker address as typed (``localhost:6066``, ``http://host:6066/``) as a base URL:
    ``http://`` added when no scheme is given, no trailing slash."""
    url = text.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


def discover(urls: Sequence[str], headers: Mapping[str, str] | None = None) -> list[str]:
    """``urls`` plus every worker the first reachable one's ``/cluster`` names (``headers``:
    sent with each request, e.g. the web token's ``Authorization``)."""
    found = [worker_url(u) for u in urls]
    for url in list(found):
        try:
            cluster = _get_json(f"{url}/cluster", headers)
        except (OSError, ValueError):
            continue
        for worker in cluster.get("workers", []):
            peer = str(worker["url"]).rstrip("/")
            if peer not in found:
                found.append(peer)
        break
    return found


def collect(
    urls: Sequence[str], *, interval_s: float = 2.0, top: int = 5,
    headers: Mapping[str, str] | None = None,
) -> list[WorkerStatus]:
    """Scrape every worker twice, ``interval_s`` apart, and summarize (``headers``: sent with
    each request, e.g. the web token's ``Authorization``)."""

    def scrape(url: str) -> Snapshot | str:
        try:
            status, body = _get(f"{url}/metrics", headers)
            if status == 401:
                return f"/metrics {_NEEDS_TOKEN}"
            if status != 200:
                return f"/metrics answered {status}"
            return Snapshot.parse(body.decode(), time.monotonic())
        except (OSError, ValueError) as exc:
            return f"unreachable ({exc})"

    with ThreadPoolExecutor(max_workers=max(1, len(urls))) as pool:
        first = list(pool.map(scrape, urls))
        time.sleep(interval_s)
        second = list(pool.map(scrape, urls))
        ready = list(pool.map(lambda u: _safe_json(f"{u}/ready", headers), urls))
        devices = list(pool.map(
            lambda u: _safe_json(f"{u}/devices?sort=-total&limit={top}", headers), urls))
    out = []
    for url, a, b, r, d in zip(urls, first, second, ready, devices, strict=True):
        if isinstance(a, str) or isinstance(b, str):
            out.append(WorkerStatus(url, error=a if isinstance(a, str) else str(b)))
            continue
        if any(isinstance(x, dict) and x.get("status") == 401 for x in (r, d)):
            out.append(WorkerStatus(url, error=f"the web API {_NEEDS_TOKEN}"))
            continue
        status = summarize(url, a, b)
        if isinstance(r, dict):
            status.ready, status.worker = bool(r.get("ready")), str(r.get("worker", "?"))
        if isinstance(d, dict):
            status.top_devices = [{**dev, "worker": status.worker} for dev in d.get("devices", [])]
        out.append(status)
    return out


def _safe_json(url: str, headers: Mapping[str, str] | None = None) -> Any:
    try:
        return _get_json(url, headers)
    except (OSError, ValueError):
        return None


def _ms(value: float | None, beyond: bool = False) -> str:
    if value is None:
        return "—"
    return f"> {value:,.0f}" if beyond else f"{value:,.1f}"


#: The workers table's columns: (header, justify, drop rank). Columns of rank 0 are always
#: shown; when the table is wider than the console the others go, rank 1 first (the address
#: moves under the worker's name before any column goes).
_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("worker", "left", 0), ("ready", "center", 0), ("parts", "right", 0),
    ("req/s", "right", 0), ("DLQ/s", "right", 5), ("DLQ %", "right", 0),
    ("retry/s", "right", 3), ("p50 ms", "right", 6), ("p99 ms", "right", 0),
    ("batch", "right", 4), ("in-flight", "right", 2), ("lag", "right", 0),
    ("finished*", "right", 1),
)

#: The devices table's columns, as :data:`_COLUMNS`.
_DEVICE_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("device", "left", 0), ("worker", "left", 3), ("finished*", "right", 0),
    ("results*", "right", 2), ("dead letters*", "right", 0), ("last seq", "right", 1),
    ("e2e EWMA ms", "right", 0), ("last seen", "right", 0),
)

#: A console that only measures tables (their width when nothing is cut).
_MEASURE = Console(width=100_000, file=io.StringIO())

#: A row of cells, or ``None`` for a section line before the next row.
_Rows = Sequence[Sequence[Any] | None]


def _fitted_table(columns: Sequence[tuple[str, str, int]], rows: Callable[[bool], _Rows],
                  width: int, **table_options: Any) -> Table:
    """The table of ``rows`` with as many of ``columns`` as fit in ``width`` characters.

    ``rows(stacked)`` gives the rows with every column's cell; ``stacked``: a cell's secondary
    part (the worker's address) on a line of its own rather than after a space. Tried in order:
    every column on one line each, stacked, then without the columns of drop rank 1, 1-2, ...
    until the table's natural width fits. Cells are never cut with an ellipsis: should even the
    columns of rank 0 not fit, a cell wraps onto more lines instead (``overflow="fold"``).
    """
    ranks = sorted({rank for *_, rank in columns if rank})
    layouts = [(False, 0), (True, 0), *((True, rank) for rank in ranks)]
    table = Table()
    for stacked, dropped in layouts:
        keep = [not rank or rank > dropped for *_, rank in columns]
        table = Table(**table_options)
        for (name, justify, _), kept in zip(columns, keep, strict=True):
            if kept:
                table.add_column(name, justify=justify,  # type: ignore[arg-type]
                                 overflow="fold")
        for cells in rows(stacked):
            if cells is None:
                table.add_section()
            else:
                table.add_row(*(c for c, kept in zip(cells, keep, strict=True) if kept))
        if _MEASURE.measure(table).maximum <= width:
            break
    return table


def render(statuses: Iterable[WorkerStatus], *, top: int = 5, now: float | None = None,
           width: int = 200, interval_s: float | None = None) -> Group:
    """The status screen: one row per worker plus a total, the busiest devices, and the
    workers that did not answer with their errors in full (or, for a supervisor's child that
    stopped, its state). ``width``: the console's width in characters; a table wider than that
    puts the worker's address under its name, then leaves out its less important columns
    (:data:`_COLUMNS`, :func:`_fitted_table`) rather than cut numbers or headers (an
    80-column terminal cut every header of the full table to two letters). ``interval_s``: the
    time between the two scrapes, named in the caption; figures since the worker started (not
    over the interval) are marked ``*``."""
    statuses = list(statuses)
    now = time.time() if now is None else now
    over = f"over the last {interval_s:g} s" if interval_s else "over the interval"

    def all_time(flag: bool) -> str:
        return "*" if flag else ""

    ok = [s for s in statuses if not s.error]

    def worker_rows(stacked: bool) -> _Rows:
        sep = "\n" if stacked else " "
        rows: list[Sequence[Any] | None] = []
        for s in statuses:
            if s.error:
                word = "stopped" if s.stopped else "unreachable"
                rows.append([s.url, Text("✗", style="red"), *["—"] * 10,
                             Text(word, style="red")])
                continue
            ready = Text("✓", style="green") if s.ready else Text("✗", style="red")
            restarts = f" [yellow]↻{s.restarts}[/yellow]" if s.restarts else ""
            rows.append([
                f"{s.worker}{restarts}{sep}[dim]{s.url.split('://')[-1]}[/dim]", ready,
                str(s.partitions),
                f"{s.throughput_per_s:,.1f}", f"{s.dead_letters_per_s:,.1f}",
                f"{100 * s.dlq_ratio:.1f}", f"{s.retries_per_s:,.1f}",
                _ms(s.p50_ms, s.p50_beyond_buckets)
                + all_time(s.latency_all_time and s.p50_ms is not None),
                _ms(s.p99_ms, s.p99_beyond_buckets) + all_time(s.latency_all_time and s.p99_ms
                                                                is not None),
                "—" if s.mean_batch is None else f"{s.mean_batch:.1f}"
                + all_time(s.batch_all_time),
                str(s.inflight), str(s.lag),
                f"{s.finished_total:,}",
            ])
        if len(ok) > 1:
            total = sum(s.throughput_per_s for s in ok)
            dlq = sum(s.dead_letters_per_s for s in ok)
            worst = max((s for s in ok if s.p99_ms is not None), key=lambda s: s.p99_ms or 0.0,
                        default=None)
            rows.append(None)
            rows.append([
                "[b]all[/b]", "", str(sum(s.partitions for s in ok)), f"{total:,.1f}",
                f"{dlq:,.1f}", f"{100 * dlq / total:.1f}" if total else "0.0",
                f"{sum(s.retries_per_s for s in ok):,.1f}", "",
                _ms(None) if worst is None else _ms(worst.p99_ms, worst.p99_beyond_buckets)
                + all_time(worst.latency_all_time), "",
                str(sum(s.inflight for s in ok)), str(sum(s.lag for s in ok)),
                f"{sum(s.finished_total for s in ok):,}",
            ])
        return rows

    table = _fitted_table(
        _COLUMNS, worker_rows, width, title="streamapp workers", title_justify="left",
        expand=False, caption=f"rates and latencies {over}; * since the worker started",
        caption_justify="left")
    devices = sorted((d for s in ok for d in s.top_devices),
                     key=lambda d: (-(d.get("total") or 0), d.get("device_id", "")))[:top]

    def device_rows(stacked: bool) -> _Rows:
        rows = []
        for d in devices:
            counts = d.get("counts") or {}
            seen = d.get("last_seen")
            rows.append((
                str(d.get("device_id")), str(d.get("worker")), f"{d.get('total', 0):,}",
                f"{counts.get('result', 0):,}", f"{counts.get('dead_letter', 0):,}",
                str(d.get("last_seq")), _ms(d.get("e2e_ewma_ms")),
                "—" if seen is None else f"{max(0.0, now - seen):.0f} s ago",
            ))
        return rows

    dev_table = _fitted_table(_DEVICE_COLUMNS, device_rows, width, title=f"top {top} devices",
                              title_justify="left")
    errors = [Text(f"✗ {s.url}: {s.stopped or s.error}", style="red")
              for s in statuses if s.error]
    return Group(table, dev_table, *errors)


def run_status(
    urls: Sequence[str], *, interval_s: float = 2.0, watch: bool = False, top: int = 5,
    discover_peers: bool = True, console: Console | None = None,
    restarts: Mapping[str, int] | None = None, supervisor_dir: Path | None = None,
    token: str = "",
) -> int:
    """Print the status screen (refreshing every ``interval_s`` with ``watch``).

    Args:
        restarts: Restarts by worker URL (supervised workers, :func:`supervised_urls`).
        supervisor_dir: Where the supervisor's ``supervisor.json`` is: a child of it that does
            not answer and is not running shows its state (:func:`stopped_children`), not a
            connection error.
        token: The workers' web token (``web_token``), sent as ``Authorization: Bearer``;
            "" sends none.

    Returns:
        0 when every worker answered and is ready, 1 otherwise.
    """
    # Output to a file or pipe: wide (rich would assume 80 columns and cut the tables), unless
    # COLUMNS says otherwise
    wide = sys.stdout.isatty() or "COLUMNS" in os.environ  # a width the user chose is kept
    console = console or Console(width=None if wide else 200)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    targets = discover(urls, headers) if discover_peers else [worker_url(u) for u in urls]

    def gather() -> list[WorkerStatus]:
        statuses = collect(targets, interval_s=interval_s, top=top, headers=headers)
        stopped = stopped_children(supervisor_dir) if supervisor_dir is not None else {}
        for s in statuses:
            s.restarts = (restarts or {}).get(s.url)
            if s.error:
                s.stopped = stopped.get(s.url)
        return statuses

    statuses = gather()
    if not watch:
        console.print(render(statuses, top=top, width=console.width, interval_s=interval_s))
        return 0 if all(s.ready and not s.error for s in statuses) else 1
    from rich.live import Live

    with Live(render(statuses, top=top, width=console.width, interval_s=interval_s),
              console=console, refresh_per_second=4) as live:
        try:
            while True:
                statuses = gather()
                live.update(render(statuses, top=top, width=console.width, interval_s=interval_s))
        except KeyboardInterrupt:
            pass
    return 0
