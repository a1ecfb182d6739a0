"""Error tree of the ``engines`` package.

Every error derives from :class:`EngineError` and carries a ``retriable`` flag: callers (the
stream processor's retry/DLQ routing) read the flag instead of listing types, as aiokafka does.
Vendor errors (ONNX Runtime, CUDA, TensorRT) are translated into this tree at the boundary with
``raise ... from``.
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailableError",
    "EngineClosedError",
    "EngineError",
    "EngineLoadError",
    "EngineRuntimeError",
    "EngineTimeoutError",
    "ExecutorUnavailableError",
    "InputSpecError",
    "OutOfMemoryError",
    "PlanMismatchError",
    "UnknownBackendError",
]


class EngineError(Exception):
    """Root of all engine errors.

    Attributes:
        retriable: True when running the same request again may succeed (transient failure).
        reason: Short machine-readable reason code used in dead-letter records.
    """

    retriable: bool = False
    reason: str = "engine_error"


class UnknownBackendError(EngineError, LookupError):
    """A backend name is not in the registry."""

    reason = "unknown_backend"


class BackendUnavailableError(EngineError):
    """A registered backend cannot run here (its library or device is missing)."""

    reason = "backend_unavailable"


class EngineLoadError(EngineError):
    """A model file or plan could not be loaded."""

    reason = "engine_load_failed"


class PlanMismatchError(EngineLoadError):
    """A serialized plan was built for another GPU or TensorRT version."""

    reason = "plan_mismatch"


class InputSpecError(EngineError, ValueError):
    """An input array does not fit the engine's IO tensor spec (name, dtype or shape).

    Not retriable: the same input fails the same way every time.
    """

    reason = "input_spec_mismatch"


class EngineRuntimeError(EngineError):
    """Inference failed inside the backend. Retriable: most such failures are transient."""

    retriable = True
    reason = "engine_runtime_error"


class OutOfMemoryError(EngineRuntimeError):
    """The device or host ran out of memory while running a batch."""

    reason = "out_of_memory"


class EngineTimeoutError(EngineRuntimeError):
    """A batch did not finish in time (a hung kernel, an overloaded device). Retriable."""

    reason = "timeout"


class ExecutorUnavailableError(EngineRuntimeError):
    """The shared GPU executor process (:mod:`engines.server`) cannot be reached or died while
    a batch was in flight. Retriable: the supervisor restarts the server and the client
    reconnects, so the same request succeeds later."""

    reason = "executor_unavailable"


class EngineClosedError(EngineError):
    """The engine was used after :meth:`Engine.close`."""

    reason = "engine_closed"
