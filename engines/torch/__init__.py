"""PyTorch CUDA backend (registry name ``"torch"``): ONNX models via onnx2torch, on CUDA.

Second in ``auto`` order (after TensorRT, before ONNX Runtime on CPU). Available when PyTorch
sees a CUDA device, onnx2torch is installed and cuda-python works (the executor's streams come
from :mod:`engines.cuda`). Importing this package imports neither torch nor onnx2torch.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

from engines.registry import register

__all__ = ["is_available", "load"]


@functools.cache
def is_available() -> bool:
    """torch with CUDA, onnx2torch and a usable CUDA device via cuda-python are all present."""
    for module in ("torch", "onnx2torch", "onnx"):
        if importlib.util.find_spec(module) is None:
            return False
    from engines import cuda

    if not cuda.is_available() or cuda.using_standin():
        return False
    import torch

    return bool(torch.cuda.is_available())


def load(model_path: Path, **options: Any) -> Any:
    """Load an ONNX model (see :func:`engines.torch.engine.load` for options)."""
    from engines.torch.engine import load as _load

    return _load(model_path, **options)


register(
    "torch",
    load,
    is_available=is_available,
    description="PyTorch on CUDA via onnx2torch (fp16, CUDA graphs); GPU fallback",
)
