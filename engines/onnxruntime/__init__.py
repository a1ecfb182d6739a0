"""ONNX Runtime backend, registered as ``"onnxruntime"``.

Importing this package registers the backend without importing ``onnxruntime`` itself: the
registry's availability check must stay cheap, and a machine without ONNX Runtime must still be
able to import :mod:`engines` (the backend then reports itself unavailable).
:class:`OnnxRuntimeEngine` and :func:`read_opset_imports` are imported from
:mod:`engines.onnxruntime.runner` on first use.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engines.registry import register

if TYPE_CHECKING:
    from engines.onnxruntime.runner import OnnxRuntimeEngine, read_opset_imports

__all__ = ["OnnxRuntimeEngine", "read_opset_imports"]

_LAZY = {"OnnxRuntimeEngine", "read_opset_imports"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module("engines.onnxruntime.runner"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _is_available() -> bool:
    return importlib.util.find_spec("onnxruntime") is not None


def _load(model_path: Path, **options: Any) -> OnnxRuntimeEngine:
    from engines.onnxruntime.runner import OnnxRuntimeEngine

    return OnnxRuntimeEngine(model_path, **options)


register(
    "onnxruntime",
    _load,
    is_available=_is_available,
    description="ONNX Runtime on CPU (CUDA execution provider where onnxruntime-gpu is installed)",
)
