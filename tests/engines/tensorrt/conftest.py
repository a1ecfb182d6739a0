"""TensorRT backend tests run against the in-repo stand-ins (TensorRT and CUDA): no real
TensorRT is installable here, and these tests say nothing about it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engines import cuda
from engines.tensorrt._api import use_tensorrt
from engines.testing import fake_cuda, fake_trt


@pytest.fixture(autouse=True)
def standins() -> Iterator[None]:
    fake_cuda.reset()
    with cuda.use_runtime(fake_cuda), use_tensorrt(fake_trt):
        yield
    assert cuda.live_handles() == {}, "the test leaked CUDA objects"
    fake_cuda.reset()
