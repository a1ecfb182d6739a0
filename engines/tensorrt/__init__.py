"""TensorRT backend: ``engines build`` (ONNX → plan + sidecar) and a plan runtime.

Registered as ``"tensorrt"``; first in ``auto`` order. Available when TensorRT 10+ imports (with
its API, not only the ``tensorrt-stubs`` type stubs) and a CUDA GPU is usable, or when the
in-repo stand-in is selected with ``ENGINES_TENSORRT_STANDIN=1`` (which also needs the CUDA
stand-in, ``ENGINES_CUDA_STANDIN=1``, on a machine without a GPU).

**What has run where:** this code is type-checked against ``tensorrt-stubs`` and tested against
:mod:`engines.testing.fake_trt`; it has not run on real TensorRT (none is installable on the
machines of this project). Nothing heavy is imported with this package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engines.registry import register

__all__ = ["is_available", "load"]


def is_available() -> bool:
    """TensorRT (real or the selected stand-in) and a CUDA device are usable here."""
    from engines import cuda
    from engines.exceptions import BackendUnavailableError
    from engines.tensorrt._api import trt_module

    try:
        trt_module()
    except BackendUnavailableError:
        return False
    return cuda.is_available()


def load(model_path: Path, **options: Any) -> Any:
    """Load a plan (see :class:`engines.tensorrt.engine.TensorRTEngine`)."""
    from engines.tensorrt.engine import load as _load

    return _load(model_path, **options)


register(
    "tensorrt",
    load,
    is_available=is_available,
    description="TensorRT 10+ plans on CUDA (build with 'engines build'; stand-in tested only)",
)
