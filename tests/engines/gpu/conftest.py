"""Fixtures for tests that need a real NVIDIA GPU (marker ``gpu``; skipped elsewhere)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engines import cuda

#: Where GPU tests write their reports (JSON) when set, e.g. ``$OUT`` on the GPU machine.
REPORT_DIR_ENV = "ENGINES_GPU_REPORT_DIR"


@pytest.fixture(scope="session")
def real_cuda() -> None:
    """Skip unless cuda-python sees a GPU (never the stand-in)."""
    if os.environ.get(cuda.ENV_STANDIN) == "1" or not cuda.is_available():
        pytest.skip("needs an NVIDIA GPU and cuda-python")


@pytest.fixture(scope="session")
def real_torch(real_cuda: None) -> None:
    """Skip unless the torch backend can run (torch with CUDA, onnx2torch)."""
    from engines.torch import is_available

    if not is_available():
        pytest.skip("needs torch with CUDA and onnx2torch")


@pytest.fixture
def report() -> Callable[[str, dict[str, Any]], None]:
    """``report(name, data)`` prints ``data`` (seen in ``-rA`` output) and adds it to
    gpu_reports.json in $ENGINES_GPU_REPORT_DIR when that is set."""

    def write(name: str, data: dict[str, Any]) -> None:
        text = json.dumps(data, indent=2, default=str)
        print(f"REPORT {name}: {text}")
        target = os.environ.get(REPORT_DIR_ENV)
        if target:
            # One file for all reports: the GPU machine returns only a few files.
            path = Path(target) / "gpu_reports.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            reports = json.loads(path.read_text()) if path.exists() else {}
            reports[name] = data
            path.write_text(json.dumps(reports, indent=2, default=str) + "\n")

    return write
