"""The TensorRT backend type-checks against tensorrt-stubs (TensorRT 10's Python API)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_tensorrt_backend_typechecks_against_the_stubs() -> None:
    if (
        importlib.util.find_spec("tensorrt_stubs") is None
        or importlib.util.find_spec("mypy") is None
    ):
        pytest.skip("needs tensorrt-stubs and mypy")
    result = subprocess.run(
        [sys.executable, "scripts/mypy_tensorrt.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
