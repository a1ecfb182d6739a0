"""TensorRT backend tests run against the in-repo stand-ins (TensorRT and CUDA): no real
TensorRT is installable here, and these tests say nothing about it."""

from __future__ import annotations

from types import ModuleType

import pytest


@pytest.fixture(autouse=True)
def standins(trt_standins: ModuleType) -> ModuleType:
    return trt_standins
