"""A TensorRT logger that keeps what TensorRT said, so our errors can quote it."""

from __future__ import annotations

import logging
import threading
from typing import Any

from engines.tensorrt._api import trt

__all__ = ["CapturingLogger", "make_logger"]

_log = logging.getLogger("engines.tensorrt")


class CapturingLogger:
    """Holds a ``trt.ILogger`` (:attr:`trt_logger`) that records errors and forwards all
    messages at or above ``min_severity`` to the ``engines.tensorrt`` Python logger."""

    def __init__(self, trt_logger: Any) -> None:
        self.trt_logger = trt_logger
        self.errors: list[str] = []
        self.messages: list[tuple[int, str]] = []

    def last_errors(self, n: int = 3) -> str:
        return " | ".join(self.errors[-n:]) or "no error was logged"

    def clear(self) -> None:
        self.errors.clear()
        self.messages.clear()


def make_logger(min_severity: int = 2) -> CapturingLogger:
    """A capturing logger; ``min_severity`` is TensorRT's (0 internal error … 4 verbose)."""
    lock = threading.Lock()

    class _Logger(trt.ILogger):  # type: ignore[misc]  # subclassing the pybind base class
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.capture: CapturingLogger | None = None

        def log(self, severity: Any, msg: str) -> None:
            level = int(severity)
            capture = self.capture
            if capture is not None:
                with lock:
                    if level <= 1:
                        capture.errors.append(msg)
                    capture.messages.append((level, msg))
            if level <= min_severity:
                python_level = {0: logging.CRITICAL, 1: logging.ERROR, 2: logging.WARNING}.get(
                    level, logging.INFO if level == 3 else logging.DEBUG
                )
                _log.log(python_level, "TensorRT: %s", msg)

    logger = _Logger()
    capture = CapturingLogger(logger)
    logger.capture = capture
    return capture
