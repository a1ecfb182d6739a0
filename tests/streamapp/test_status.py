"""``streamapp status``: quantiles, rates between two scrapes, and the screen, against fake
workers served over HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from streamapp.status import Snapshot, histogram_quantile, run_status, summarize

INF = float("inf")


def test_histogram_quantile_interpolates_within_the_bucket() -> None:
    buckets = {0.1: 50.0, 0.2: 90.0, 0.5: 100.0, INF: 100.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.7, buckets) == pytest.approx(0.15)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.2 + 0.3 * 9 / 10)
    assert histogram_quantile(0.99, {0.1: 0.0, INF: 0.0}) is None
    assert histogram_quantile(0.99, {0.1: 1.0, INF: 10.0}) == 0.1  # beyond the last bound


def metrics_text(results: int, dead: int, e2e_le_0_1: int, e2e_total: int,
                 batches: int) -> str:
    return f"""
# TYPE streamapp_requests_total counter
streamapp_requests_total{{model="digits",outcome="result"}} {results}
streamapp_requests_total{{model="digits",outcome="dead_letter"}} {dead}
# TYPE streamapp_retries_total counter
streamapp_retries_total{{model="digits",reason="engine_oom"}} 3
# TYPE streamapp_dead_letters_total counter
streamapp_dead_letters_total{{model="digits",reason="bad_shape"}} {dead}
# TYPE streamapp_queue_duration_seconds histogram
streamapp_queue_duration_seconds_bucket{{le="0.1",model="digits"}} {e2e_total}
streamapp_queue_duration_seconds_bucket{{le="+Inf",model="digits"}} {e2e_total}
streamapp_queue_duration_seconds_count{{model="digits"}} {e2e_total}
streamapp_queue_duration_seconds_sum{{model="digits"}} 0.1
# TYPE streamapp_e2e_duration_seconds histogram
streamapp_e2e_duration_seconds_bucket{{le="0.1",model="digits"}} {e2e_le_0_1}
streamapp_e2e_duration_seconds_bucket{{le="1.0",model="digits"}} {e2e_total}
streamapp_e2e_duration_seconds_bucket{{le="+Inf",model="digits"}} {e2e_total}
streamapp_e2e_duration_seconds_count{{model="digits"}} {e2e_total}
streamapp_e2e_duration_seconds_sum{{model="digits"}} 1.0
# TYPE streamapp_batch_size histogram
streamapp_batch_size_bucket{{le="+Inf",model="digits"}} {batches}
streamapp_batch_size_count{{model="digits"}} {batches}
streamapp_batch_size_sum{{model="digits"}} {results + dead}
# TYPE streamapp_consumer_lag gauge
streamapp_consumer_lag{{partition="0",topic="p.inference-request"}} 12
streamapp_consumer_lag{{partition="1",topic="p.inference-request"}} 3
# TYPE streamapp_assigned_partitions gauge
streamapp_assigned_partitions{{topic="p.inference-request"}} 2
streamapp_assigned_partitions{{topic="p.inference-retry"}} 2
# TYPE streamapp_inflight_batches gauge
streamapp_inflight_batches 1
"""


def test_rates_and_quantiles_over_the_interval() -> None:
    before = Snapshot.parse(metrics_text(100, 0, 100, 100, 10), at=10.0)
    after = Snapshot.parse(metrics_text(290, 10, 100, 290, 20), at=12.0)
    s = summarize("http://w1", before, after)
    assert s.throughput_per_s == pytest.approx(100.0)  # (290 + 10 - 100) / 2 s
    assert s.results_per_s == pytest.approx(95.0)
    assert s.dead_letters_per_s == pytest.approx(5.0) and s.dlq_ratio == pytest.approx(0.05)
    # all 190 new observations are in (0.1, 1.0]: p99 interpolates in that bucket
    assert s.p99_ms == pytest.approx((0.1 + 0.9 * 0.99) * 1000)
    assert s.mean_batch == pytest.approx(20.0)  # 200 requests in 10 batches
    assert (s.lag, s.partitions, s.inflight, s.finished_total) == (15, 2, 1, 300)


class FakeWorker(BaseHTTPRequestHandler):
    scrapes = 0
    peer = ""

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path == "/metrics":
            FakeWorker.scrapes += 1
            n = FakeWorker.scrapes
            body, ctype = metrics_text(100 * n, n, 50 * n, 100 * n, 10 * n).encode(), "text/plain"
        elif path == "/ready":
            body, ctype = json.dumps({"ready": True, "worker": "w1"}).encode(), "application/json"
        elif path == "/cluster":
            body = json.dumps({"workers": [{"url": FakeWorker.peer, "partitions": [0, 1]},
                                           {"url": "http://127.0.0.1:9", "partitions": [2]}]})
            body, ctype = body.encode(), "application/json"
        elif path == "/devices":
            body = json.dumps({"devices": [
                {"device_id": "cam17", "total": 420, "counts": {"result": 418, "dead_letter": 2},
                 "last_seq": 419, "last_seen": 1.0e9, "e2e_ewma_ms": 12.5}]}).encode()
            ctype = "application/json"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def fake_worker() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeWorker)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    FakeWorker.peer, FakeWorker.scrapes = url, 0
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield url
    finally:
        server.shutdown()
        server.server_close()


def test_the_screen_shows_every_discovered_worker_and_the_busiest_devices(
    fake_worker: str,
) -> None:
    console = Console(record=True, width=160, force_terminal=False)
    code = run_status([fake_worker], interval_s=0.05, console=console)
    screen = console.export_text()
    assert "w1" in screen and "cam17" in screen and "420" in screen
    assert "unreachable" in screen  # the second worker /cluster names is down
    assert code == 1  # ... so the command fails


def test_without_urls_status_shows_the_children_a_supervisor_lists(
    fake_worker: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from typer.testing import CliRunner

    from streamapp.cli import cli

    (tmp_path / "supervisor.json").write_text(json.dumps({"pid": 1, "children": [
        {"index": 0, "url": fake_worker, "restarts": 2},
        {"index": 1, "url": "http://127.0.0.1:9", "restarts": 0},
    ]}))
    monkeypatch.setenv("COLUMNS", "200")
    result = CliRunner().invoke(cli, ["status", "--data-dir", str(tmp_path), "--interval",
                                      "0.1", "--no-discover"])
    assert "w1 ↻2" in result.output  # child 0, restarted twice
    assert "127.0.0.1:9" in result.output and "unreachable" in result.output  # child 1 is down
    assert result.exit_code == 1


@pytest.mark.parametrize(("supervisor_pid", "child", "reads"), [
    ("self", {"state": "stopped", "last_exit": 0}, "stopped (exit code 0)"),
    ("self", {"state": "failed", "last_exit": -9}, "failed (signal SIGKILL)"),
    ("gone", {"state": "running", "last_exit": None}, "stopped (supervisor pid {pid} is not "
                                                      "running)"),
])
def test_a_supervised_worker_that_stopped_reads_stopped_not_a_connection_error(
    fake_worker: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, supervisor_pid: str,
    child: dict[str, Any], reads: str,
) -> None:
    from typer.testing import CliRunner

    from streamapp.cli import cli

    if supervisor_pid == "self":
        pid = os.getpid()
    else:  # a pid that was just freed
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        proc.wait()
        pid = proc.pid
    (tmp_path / "supervisor.json").write_text(json.dumps({"pid": pid, "children": [
        {"index": 0, "url": fake_worker, "restarts": 0, "state": "running"},
        {"index": 1, "url": "http://127.0.0.1:9", "restarts": 1, **child},
    ]}))
    monkeypatch.setenv("COLUMNS", "200")
    result = CliRunner().invoke(cli, ["status", "--data-dir", str(tmp_path), "--interval",
                                      "0.1", "--no-discover"])

    assert f"✗ http://127.0.0.1:9: {reads.format(pid=pid)}" in result.output
    assert "unreachable" not in result.output and "Connection refused" not in result.output
    assert result.exit_code == 1


def test_figures_since_the_worker_started_are_marked() -> None:
    from streamapp.status import render

    idle = Snapshot.parse(metrics_text(100, 0, 100, 100, 10), at=10.0)
    s = summarize("http://w1", idle, Snapshot.parse(metrics_text(100, 0, 100, 100, 10), at=12.0))
    busy = summarize("http://w2", idle, Snapshot.parse(metrics_text(290, 10, 100, 290, 20),
                                                       at=12.0))
    assert s.latency_all_time and s.batch_all_time
    assert not busy.latency_all_time and not busy.batch_all_time
    console = Console(record=True, width=200)
    console.print(render([s, busy], width=200, interval_s=2.0))
    screen = console.export_text()

    assert "rates and latencies over the last 2 s; * since the worker started" in screen
    assert "finished*" in screen and "dead letters*" in screen
    idle_row = next(line for line in screen.splitlines() if "w1" in line)
    busy_row = next(line for line in screen.splitlines() if "w2" in line)
    assert idle_row.count("*") == 3  # p50, p99, batch
    assert "*" not in busy_row


def _beyond_the_last_bucket(inf_total: int) -> tuple[Any, str]:
    """A 2 s interval with 200 new results, of which the ``+Inf`` bucket ends at
    ``inf_total`` (above 200: slower than the largest finite bucket, 1 s); its summary and
    screen."""
    from streamapp.status import render

    before = Snapshot.parse(metrics_text(100, 0, 100, 100, 10), at=10.0)
    after = Snapshot.parse(metrics_text(300, 0, 100, 200, 20).replace(
        'streamapp_e2e_duration_seconds_bucket{le="+Inf",model="digits"} 200',
        f'streamapp_e2e_duration_seconds_bucket{{le="+Inf",model="digits"}} {inf_total}'),
        at=12.0)
    s = summarize("http://w1", before, after)
    console = Console(record=True, width=160)
    console.print(render([s], width=160))
    return s, console.export_text()


def test_a_p99_beyond_the_last_bucket_is_shown_as_a_lower_limit() -> None:
    # 200 new results, 100 of them slower than the largest finite bucket (1 s)
    s, screen = _beyond_the_last_bucket(300)
    assert s.p99_beyond_buckets and s.p99_ms == pytest.approx(1000.0)
    assert "> 1,000" in screen


def test_a_p50_beyond_the_last_bucket_is_shown_as_a_lower_limit_too() -> None:
    # a worker restarted on a backlog: nearly every latency is over the largest bucket
    s, screen = _beyond_the_last_bucket(2000)
    assert s.p50_beyond_buckets and s.p50_ms == pytest.approx(1000.0)
    row = next(line for line in screen.splitlines() if "w1" in line)
    assert row.count("> 1,000") == 2  # p50 and p99
    assert "1,000.0" not in row


def test_a_worker_address_without_a_scheme_is_an_http_url() -> None:
    from streamapp.status import worker_url

    assert worker_url("localhost:6066") == "http://localhost:6066"
    assert worker_url(" http://10.0.0.5:6066/ ") == "http://10.0.0.5:6066"
    assert worker_url("https://w.example:443") == "https://w.example:443"


def test_an_80_column_terminal_gets_whole_headers_and_whole_errors() -> None:
    from streamapp.status import WorkerStatus, render

    statuses = [
        WorkerStatus("http://127.0.0.1:6066", worker="worker-host-0", ready=True, partitions=16,
                     throughput_per_s=456.3, p99_ms=35.0, lag=123456),
        WorkerStatus("http://127.0.0.1:6068",
                     error="<urlopen error [Errno 111] Connection refused>"),
    ]
    console = Console(record=True, width=80)
    console.print(render(statuses, width=80))
    screen = console.export_text()
    assert max(len(line) for line in screen.splitlines()) <= 80
    for header in ("worker", "ready", "parts", "req/s", "DLQ %", "p99 ms", "lag"):
        assert header in screen
    assert "123456" in screen and "…" not in screen
    assert "http://127.0.0.1:6068: <urlopen error [Errno 111] Connection refused>" in screen


def test_piped_output_is_wide_unless_columns_is_set(
    fake_worker: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    run_status([fake_worker], interval_s=0.05)
    wide = capsys.readouterr().out
    monkeypatch.setenv("COLUMNS", "80")
    run_status([fake_worker], interval_s=0.05)
    narrow = capsys.readouterr().out
    assert "retry/s" in wide and max(len(line) for line in wide.splitlines()) > 80
    assert "retry/s" not in narrow and max(len(line) for line in narrow.splitlines()) <= 80



def _busy_statuses() -> list[Any]:
    """Two workers with wide figures (terminals of 120-135 columns cut them before)."""
    from streamapp.status import WorkerStatus

    return [
        WorkerStatus("http://127.0.0.1:6066", worker="worker-1", ready=True, partitions=2,
                     throughput_per_s=135.5, dead_letters_per_s=5.0, dlq_ratio=0.037,
                     p50_ms=19.4, p99_ms=49.4, mean_batch=2.2, finished_total=1253),
        WorkerStatus("http://10.20.30.40:6067", worker="worker-host-22", ready=True,
                     partitions=16, throughput_per_s=12345.5, dead_letters_per_s=10.0,
                     dlq_ratio=0.056, p50_ms=20.9, p99_ms=10_000.0, p99_beyond_buckets=True,
                     mean_batch=62.7, inflight=4, lag=1234567, finished_total=123456789),
    ]


def _workers_table(width: int) -> str:
    """The workers table (without the devices table) on a console ``width`` columns wide."""
    from streamapp.status import render

    console = Console(record=True, width=width)
    console.print(render(_busy_statuses(), width=width, interval_s=3.0))
    screen = console.export_text()
    assert max(len(line) for line in screen.splitlines()) <= width
    return screen.split("top 5 devices")[0]


@pytest.mark.parametrize("width", [80, 100, 110, 120, 125, 130, 135, 140, 160, 200])
def test_no_terminal_width_cuts_a_number_or_a_header(width: int) -> None:
    table = _workers_table(width)

    assert "…" not in table
    for essential in ("worker", "ready", "parts", "req/s", "DLQ %", "p99 ms", "lag",
                      "worker-host-22", "10.20.30.40:6067", "12,345.5", "12,481.0", "> 10,000",
                      "1234567"):
        assert essential in table, essential
    # a column that is shown is shown whole: its header and every figure in it
    for header, figures in (("finished*", ["1,253", "123,456,789", "123,458,042"]),
                            ("batch", ["2.2", "62.7"]), ("DLQ/s", ["10.0", "15.0"]),
                            ("p50 ms", ["19.4", "20.9"])):
        if header in table:
            assert all(f in table for f in figures), (header, figures)


def test_the_full_table_where_it_fits_and_less_important_columns_go_first() -> None:
    def headers(width: int) -> str:
        return _workers_table(width).splitlines()[2]

    wide = _workers_table(200)
    assert all(h in headers(200) for h in ("finished*", "in-flight", "retry/s", "p50 ms"))
    assert "worker-host-22 10.20.30.40:6067" in wide  # the address after the name
    assert "worker-host-22 10.20.30.40:6067" not in _workers_table(140)  # ... under it
    assert "finished*" not in headers(125) and "in-flight" in headers(125)  # first to go
    assert "p50 ms" in headers(100) and "in-flight" not in headers(100)
    assert "p50 ms" not in headers(80) and "DLQ/s" not in headers(80)  # last to go


def test_a_terminal_too_narrow_for_the_essential_columns_wraps_numbers_never_cuts_them(
) -> None:
    table = _workers_table(50)
    assert "…" not in table
    lag = [line.split("│")[-2].strip() for line in table.splitlines() if line.startswith("│")]
    first = lag.index(next(c for c in lag if c.startswith("12")))  # worker-host-22, folded
    assert lag[first] != "1234567" and lag[first] + lag[first + 1] == "1234567"
