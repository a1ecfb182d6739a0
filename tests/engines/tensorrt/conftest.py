"""TensorRT backend tests run against the in-repo stand-ins (TensorRT and CUDA): no real
TensorRT is installable here, and these tests say nothing about it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engines import cuda
from engines.cuda import fake_runtime
from engines.tensorrt import fake_trt
from engines.tensorrt._api import use_tensorrt


@pytest.fixture(autouse=True)
def standins() -> Iterator[None]:
    fake_runtime.reset()
    with cuda.use_runtime(fake_runtime), use_tensorrt(fake_trt):
        yield
    assert cuda.live_handles() == {}, "the test leaked CUDA objects"
    fake_runtime.reset()
