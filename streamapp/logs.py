"""What the worker's log says first, and which of Faust's INFO lines it leaves out.

:func:`startup_block` is the first thing a worker logs: where it is (web URL, broker, topics,
models with their engine tags, backend, data dir). :class:`QuietChangelogs` drops Faust's lines
per changelog table and partition at INFO (each table's and store's start and stop, the
changelog topics' creation, RocksDB's "opening partition", the recovery's highwater and offset
tables, which grow with the partitions); warnings and errors still pass, and nothing is dropped
at ``log_level=debug``. :class:`PerKeyThrottle` keeps a flood of one kind of line (dead
letters of one reason) to a few lines a minute and a count.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from streamapp.settings import Settings
from streamapp.state import advertised_host

__all__ = ["PerKeyThrottle", "QuietChangelogs", "startup_block"]

#: Faust's loggers of tables, stores and their recovery.
_TABLE_LOGGERS = ("faust.tables", "faust.stores")


class PerKeyThrottle:
    """At most ``per_window`` lines per key in each ``window_s``, then one line saying how many
    were left out once the window is over: when the key's next line comes, at :meth:`expire`
    (the worker calls it with every state flush, ~0.5 s) or at :meth:`flush` (at stop).

    A worker fed bad requests logged one WARNING per dead letter: 1,248 lines after a trial's
    floods of out-of-range tensors. Every dead letter is still in the dead-letter topic.

    Args:
        per_window: Lines logged per key and window, >= 1.
        window_s: Window length in seconds.
        clock: Monotonic seconds (tests pass their own).
    """

    def __init__(self, per_window: int = 10, window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.per_window, self.window_s, self._clock = per_window, window_s, clock
        self._windows: dict[str, _Window] = {}

    def allow(self, key: str, logger: logging.Logger, what: str) -> bool:
        """Whether to log this ``key``'s line now; a window that is over first gets its
        "left out" line (``what`` names the lines, e.g. "dead letters out_of_range")."""
        now = self._clock()
        window = self._windows.get(key)
        if window is None or now - window.start >= self.window_s:
            if window is not None:
                self._said(key, window, logger, what)
            window = self._windows[key] = _Window(now)
        if window.logged < self.per_window:
            window.logged += 1
            return True
        window.left_out += 1
        return False

    def expire(self, logger: logging.Logger, what: str) -> None:
        """Close the windows that are over, with their "left out" lines."""
        now = self._clock()
        for key in [k for k, w in self._windows.items() if now - w.start >= self.window_s]:
            self._said(key, self._windows.pop(key), logger, what)

    def flush(self, logger: logging.Logger, what: str) -> None:
        """Log every key's "left out" count now (at stop)."""
        for key, window in self._windows.items():
            self._said(key, window, logger, what)
        self._windows.clear()

    def _said(self, key: str, window: _Window, logger: logging.Logger, what: str) -> None:
        if window.left_out:
            logger.warning("%s %s: %d more in %.0f s not logged one by one (at most %d a "
                           "window)", what, key, window.left_out, self.window_s,
                           self.per_window)


@dataclass(slots=True)
class _Window:
    """One key's window of :class:`PerKeyThrottle`: when it began, lines logged, left out."""

    start: float
    logged: int = 0
    left_out: int = 0


class QuietChangelogs(logging.Filter):
    """A handler filter that drops Faust's per-table and per-changelog INFO records.

    Kept from those loggers: records of WARNING and above, and one-line records other than a
    service's start and stop and RocksDB's partition opening and closing (so that a long
    restore's progress lines still show).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        if record.name.startswith(_TABLE_LOGGERS):
            message = record.getMessage()
            return not (
                "\n" in message  # the recovery's tables, one row per changelog partition
                or message.endswith(("Starting...", "Stopping..."))
                or message.startswith(("opening partition", "Closing rocksdb"))
            )
        # The producer creating each table's changelog topic (at start and again at recovery).
        return not (record.name.startswith("faust.") and "-changelog'" in record.getMessage())


def startup_block(settings: Settings, models: Mapping[str, Any]) -> str:
    """The worker's first log record: several lines that say where it is.

    Args:
        settings: The worker's settings.
        models: Model name → :class:`streamapp.agents.pipeline.LoadedModel` (its ``version``,
            ``info``: engine tag, device, precision, max batch size; and the queue policy of
            its ``config``, shown under it when set).
    """
    s = settings
    web = f"http://{advertised_host(s)}:{s.web_port}"
    guarded = s.web_token.get_secret_value() or s.web_token_file is not None
    open_paths = ", ".join(s.web_open_paths) or "none"
    token = f"; web token required, open: {open_paths}" if guarded else ""
    login = (f", {s.security_protocol} as {s.sasl_username!r}" if s.sasl_username
             else f", {s.security_protocol}" if s.security_protocol != "PLAINTEXT" else "")
    lines = [
        f"streamapp worker of group {s.app_id!r} ({s.topic_partitions} partitions per topic)",
        f"  web      {web} (bound to {s.web_bind}; /ready, /metrics, /devices/{{id}}{token})",
        f"  broker   {s.broker} ({s.broker_kind}{login})",
        f"  reads    {s.request_topic}, {s.retry_topic} (intake {s.intake}; "
        f"batches of {s.max_batch_size} or {s.max_batch_delay_ms:g} ms)",
        f"  writes   {s.result_topic}, {s.dlq_topic}",
        f"  delivery {s.processing_guarantee} (processing_guarantee; docs/delivery.md)",
    ]
    for n, (name, model) in enumerate(models.items()):
        info = model.info
        version = getattr(model, "version", None)
        named = f"{name} v{version}" if version is not None else name
        lines.append(
            f"  {'models' if n == 0 else '':8} {named} {info.tag} ({info.device}, "
            f"{info.precision}, max batch {info.max_batch_size})"
        )
        policy = getattr(getattr(model, "config", None), "queue_policy_text", None)
        if policy is not None:
            lines.append(f"  {'':8} queue policy: {policy}")
    chosen = sorted({m.info.backend for m in models.values()})
    backend = s.backend if chosen == [s.backend] else f"{s.backend} ({', '.join(chosen)})"
    if s.gpu_executor == "shared":  # the engines run in the executor server, not here
        from streamapp.gpu_server import server_socket

        backend += f", in the shared executor server at {server_socket(s)}"
    lines += [f"  backend  {backend}", f"  data dir {s.data_dir.absolute()}"]
    return "\n".join(lines)
