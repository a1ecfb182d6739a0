"""WorkerProcess's web client, as tests and benchmarks use it against a worker's web server."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamapp.exceptions import StreamAppError
from streamapp.process import WorkerProcess


class _Limited(http.server.BaseHTTPRequestHandler):
    """Answers 429 ``rate_limited`` (Retry-After 0) to the first ``refusals`` requests."""

    refusals = 0
    seen: list[str] = []

    def do_GET(self) -> None:
        type(self).seen.append(self.path)
        if type(self).refusals > 0:
            type(self).refusals -= 1
            body = json.dumps({"error": "rate_limited", "status": 429}).encode()
            self.send_response(429)
            self.send_header("Retry-After", "0")
        elif self.path == "/metrics":
            body = b"streamapp_state_degraded 0.0\n"
            self.send_response(200)
        else:
            body = json.dumps({"total": 3}).encode()
            self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def limited(tmp_path: Path) -> Iterator[WorkerProcess]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Limited)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Limited.seen = []
    try:
        yield WorkerProcess({"web_port": server.server_address[1]}, log_path=tmp_path / "w.log")
    finally:
        server.shutdown()
        server.server_close()


def test_a_rate_limited_answer_is_retried_after_its_retry_after(limited: WorkerProcess) -> None:
    _Limited.refusals = 2
    assert limited.get("/devices/d-1") == (200, {"total": 3})
    assert _Limited.seen == ["/devices/d-1"] * 3
    _Limited.refusals = 1
    assert limited.metrics_text() == "streamapp_state_degraded 0.0\n"


def test_a_429_past_the_wait_bound_is_returned(limited: WorkerProcess,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(WorkerProcess, "RATE_LIMIT_WAIT_S", 0.0)
    _Limited.refusals = 1
    _Limited.seen = []
    assert limited.get("/devices/d-1") == (429, {"error": "rate_limited", "status": 429})
    _Limited.refusals = 1
    with pytest.raises(StreamAppError, match="/metrics answered 429"):
        limited.metrics_text()
