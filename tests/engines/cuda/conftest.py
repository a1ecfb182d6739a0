"""The CUDA layer's tests run on the CPU stand-in everywhere and on a real GPU where there is
one (the ``real`` parameter, marker ``gpu``)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from engines import cuda
from engines.testing import fake_cuda


@pytest.fixture(params=["standin", pytest.param("real", marks=pytest.mark.gpu)])
def runtime(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test on the stand-in runtime, then (where a GPU exists) on cuda-python."""
    if request.param == "standin":
        fake_cuda.reset()
        with cuda.use_runtime(fake_cuda):
            yield "standin"
        fake_cuda.reset()
    else:
        if os.environ.get(cuda.ENV_STANDIN) == "1" or not cuda.is_available():
            pytest.skip("needs an NVIDIA GPU and cuda-python")
        yield "real"


@pytest.fixture
def standin() -> Iterator[None]:
    """The stand-in runtime only (fault injection, out-of-bounds checks)."""
    fake_cuda.reset()
    with cuda.use_runtime(fake_cuda):
        yield
    fake_cuda.reset()
