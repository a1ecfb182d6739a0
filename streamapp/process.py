"""Run a worker as a child process and wait until it is ready (demo, tests, benchmarks)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from streamapp.children import free_port, popen_child, terminate_group
from streamapp.exceptions import StreamAppError

__all__ = ["WorkerProcess"]


def _retry_after_s(exc: urllib.error.HTTPError) -> float:
    """An answer's ``Retry-After`` in seconds (the web API sends whole seconds); 1 when absent
    or not a number."""
    try:
        return max(0.0, float(exc.headers.get("Retry-After", "1")))
    except ValueError:
        return 1.0


class WorkerProcess:
    """``streamapp worker`` in a child process, configured through ``STREAMAPP_*`` variables.

    Args:
        settings: Setting name → value (e.g. ``{"broker": "kafka://...", "app_id": "x"}``);
            ``web_port`` is chosen free when absent.
        log_path: Where the worker's stdout/stderr go.
        cwd: Working directory of the worker.
        args: Extra ``streamapp worker`` flags that are not settings (``--reset-data-dir``).
    """

    def __init__(self, settings: dict[str, Any], log_path: Path, cwd: Path | None = None,
                 args: tuple[str, ...] = ()) -> None:
        self.args = args
        self.settings = dict(settings)
        self.settings.setdefault("web_port", free_port())
        self.log_path = log_path
        self.cwd = cwd
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def web_url(self) -> str:
        return f"http://127.0.0.1:{self.settings['web_port']}"

    def start(self) -> WorkerProcess:
        env = dict(os.environ)
        for name, value in self.settings.items():
            if isinstance(value, list | tuple):
                value = ",".join(map(str, value))
            env[f"STREAMAPP_{name.upper()}"] = str(value)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = popen_child(
                [sys.executable, "-m", "streamapp", "worker", *self.args],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.cwd,
            )
        return self

    def get(self, path: str, timeout_s: float = 2.0) -> tuple[int, Any]:
        """GET a path of the worker's web server: ``(status, decoded JSON body)``.

        A 429 ``rate_limited`` answer (``web_max_requests_per_s``) is retried after its
        ``Retry-After`` seconds, as a polite client would, for at most :attr:`RATE_LIMIT_WAIT_S`
        in all; after that the 429 is returned.
        """
        status, body = self.get_bytes(path, timeout_s)
        return status, json.loads(body or b"null")

    #: Seconds :meth:`get` and :meth:`get_bytes` wait in all on 429 answers before returning one.
    RATE_LIMIT_WAIT_S = 30.0

    def get_bytes(self, path: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
        """GET a path of the worker's web server: ``(status, body)`` (``/metrics`` is text);
        429 answers are retried as :meth:`get` says."""
        deadline = time.monotonic() + self.RATE_LIMIT_WAIT_S
        while True:
            try:
                with urllib.request.urlopen(self.web_url + path, timeout=timeout_s) as response:
                    return response.status, response.read()
            except urllib.error.HTTPError as exc:
                body = exc.read()
                wait_s = _retry_after_s(exc)
                if exc.code != 429 or time.monotonic() + wait_s > deadline:
                    return exc.code, body
                time.sleep(wait_s)

    def metrics_text(self, timeout_s: float = 15.0) -> str:
        """The worker's ``/metrics`` (Prometheus text format).

        Raises:
            StreamAppError: The answer was not 200 (a 429 still, after :attr:`RATE_LIMIT_WAIT_S`).
        """
        status, body = self.get_bytes("/metrics", timeout_s)
        if status != 200:
            raise StreamAppError(f"/metrics answered {status}: {body[:300]!r}")
        return body.decode()

    def wait_ready(self, timeout_s: float = 60.0) -> float:
        """Wait until ``/ready`` answers 200; return the seconds waited.

        Raises:
            StreamAppError: The worker exited or was not ready in time (with its log tail).
        """
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.process is None or self.process.poll() is not None:
                raise StreamAppError(f"the worker exited early:\n{self.log_tail()}")
            try:
                status, _ = self.get("/ready", timeout_s=1.0)
                if status == 200:
                    return time.monotonic() - start
            except (OSError, ValueError):
                pass  # web server not up yet
            time.sleep(0.1)
        raise StreamAppError(
            f"the worker was not ready after {timeout_s:.0f} s:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def stop(self, timeout_s: float = 15.0, sig: int = signal.SIGTERM) -> int | None:
        """Send ``sig`` (SIGTERM: clean shutdown), then SIGKILL after ``timeout_s``. Idempotent."""
        if self.process is None:
            return None
        return terminate_group(self.process, timeout_s, sig)

    def kill(self) -> None:
        """SIGKILL the worker (a crash)."""
        self.stop(timeout_s=5.0, sig=signal.SIGKILL)

    def __enter__(self) -> WorkerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
