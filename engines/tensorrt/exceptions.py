"""Errors of the TensorRT backend (all in the :class:`~engines.exceptions.EngineError` tree)."""

from __future__ import annotations

from engines.exceptions import EngineError

__all__ = ["BuildError"]


class BuildError(EngineError):
    """Building a plan failed (ONNX parse error, bad shapes, calibration, TensorRT builder).

    Not retriable: the same inputs fail the same way. The message lists TensorRT's errors.
    """

    reason = "plan_build_failed"
