"""Error tree of the ``streamapp`` package.

Every error derives from :class:`StreamAppError` and carries a ``retriable`` flag and a ``reason``
code. Routing reads the flag: retriable failures go to the retry topic, the others to the
dead-letter queue with their reason code. Bugs in our code are :class:`InternalError`.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BrokerError",
    "ConfigError",
    "FrameError",
    "InternalError",
    "InvalidRequestError",
    "ModelNotFoundError",
    "ModelSwapError",
    "PublishError",
    "ReplyTimeoutError",
    "SecurityError",
    "StreamAppError",
    "TableUnavailableError",
]


class StreamAppError(Exception):
    """Root of all streamapp errors.

    Attributes:
        retriable: True when processing the same message again may succeed.
        reason: Short machine-readable reason code (dead-letter records, metrics labels).
    """

    retriable: bool = False
    reason: str = "error"


class BrokerError(StreamAppError):
    """The embedded broker could not be started, reached or stopped."""

    reason = "broker_error"


class SecurityError(BrokerError):
    """The broker refused the TLS handshake or the SASL login, or denied an operation (an ACL
    is missing): a configuration problem that no retry helps."""

    retriable = False
    reason = "broker_security"


class TableUnavailableError(StreamAppError):
    """A table partition's RocksDB database can be neither opened nor read (a full disk while
    it was closed, and its files cannot be opened read-only either); retried at the next flush."""

    retriable = True
    reason = "table_unavailable"


class PublishError(BrokerError):
    """Sending records failed part way; the message says how many were sent and acknowledged
    before it (the others may or may not have arrived).

    Attributes:
        sent: Records handed to the producer.
        acknowledged: Records the broker acknowledged.
        total: Records there were to send.
    """

    def __init__(self, message: str, *, sent: int, acknowledged: int, total: int) -> None:
        super().__init__(message)
        self.sent, self.acknowledged, self.total = sent, acknowledged, total


class FrameError(StreamAppError, ValueError):
    """A frame given to the client cannot become a request (an array of a dtype no request may
    carry, bytes that are neither PNG nor JPEG, a file that cannot be read); nothing was sent."""

    reason = "bad_frame"


class ReplyTimeoutError(StreamAppError, TimeoutError):
    """No result and no dead letter of a published request arrived in time
    (:meth:`streamapp.client.AsyncClient.infer`). The request was sent and acknowledged, and it
    may still be answered: retrying sends it again (a new request id).

    Attributes:
        request_id: The request that was not answered.
        timeout_s: How long was waited (seconds).
    """

    retriable = True
    reason = "reply_timeout"

    def __init__(self, message: str, *, request_id: str, timeout_s: float) -> None:
        super().__init__(message)
        self.request_id, self.timeout_s = request_id, timeout_s


class ConfigError(StreamAppError, ValueError):
    """A setting has an invalid value."""

    reason = "config_error"


class ModelNotFoundError(StreamAppError, LookupError):
    """A model name is not in the model repository."""

    reason = "unknown_model"


class InvalidRequestError(StreamAppError, ValueError):
    """A request value cannot be processed; retrying cannot fix it, so it goes to the DLQ.

    Args:
        reason: Reason code, one of :data:`streamapp.codecs.REASONS`.
        message: What was wrong with which field, and how to fix it.
        fields: What could be read of the record before it was rejected (``request_id``,
            ``device_id``, ``seq``, ``ts``, ``model`` where present with the right type), so that
            its dead letter and metrics name them; empty when nothing was readable.
    """

    def __init__(self, reason: str, message: str, fields: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.fields: dict[str, Any] = dict(fields or {})

    @property
    def message(self) -> str:
        return str(self.args[0])


class ModelSwapError(StreamAppError):
    """A model version was refused by ``streamapp models load`` (the old one keeps serving).

    Attributes:
        reason: ``unknown_model``, ``version_not_found``, ``bad_metadata``,
            ``incompatible_version``, ``load_failed``, ``warmup_failed``, ``check_failed``,
            ``not_supported`` (shared executor), ``not_prepared``, ``busy``, ``not_ready``,
            ``worker_unreachable``; for an unload also ``version_serving`` (docs/versions.md
            lists them).
        status: The HTTP status the endpoint answers with (404, 409, 422, 503).
    """

    def __init__(self, reason: str, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status


class InternalError(StreamAppError):
    """A bug in streamapp, never a property of the input."""

    reason = "internal_error"
