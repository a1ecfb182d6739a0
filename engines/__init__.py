"""Model engines: the engine interface, backends (ONNX Runtime, TensorRT, ...), and the GPU
executor.

This package never imports ``faust``; the stream processor talks to it only through
:class:`engines.base.Engine` and the registry.
"""

from __future__ import annotations

from engines.base import DYNAMIC, Engine, EngineInfo, TensorSpec
from engines.exceptions import EngineError
from engines.registry import available_backends, load_engine, register, registered_backends

__all__ = [
    "DYNAMIC",
    "Engine",
    "EngineError",
    "EngineInfo",
    "TensorSpec",
    "available_backends",
    "load_engine",
    "register",
    "registered_backends",
]
