"""Everything in ``engines`` that exists for tests only, in one place; production code never
imports this package.

* :mod:`engines.testing.fake_engine` — :class:`FakeEngine`, a deterministic engine with no model
  file (backend ``"fake"``).
* :mod:`engines.testing.faults` — :class:`FaultyEngine`, which wraps a real engine and fails
  chosen batches (backend ``"faulty"``).
* :mod:`engines.testing.fake_cuda` — a CPU stand-in for the CUDA runtime API
  (``ENGINES_CUDA_STANDIN=1`` or :func:`engines.cuda.use_runtime`).
* :mod:`engines.testing.fake_trt` — a stand-in for the TensorRT 10 Python API
  (``ENGINES_TENSORRT_STANDIN=1`` or :func:`engines.tensorrt.use_tensorrt`).

Both test backends are ``test_only`` (``auto`` never picks them) and are registered only when a
test asks: :func:`register` here, or, for a worker process a test starts, the registry's plugin
hook ``ENGINES_PLUGINS=engines.testing.faults``.
"""

from __future__ import annotations

from engines.registry import Backend
from engines.testing.fake_engine import (
    DEFAULT_INPUT,
    DEFAULT_OUTPUT,
    FAKE_BACKEND,
    FakeEngine,
    register_fake_backend,
)
from engines.testing.faults import (
    FAULT_ERRORS,
    FAULTS_ENV,
    FAULTY_BACKEND,
    FaultKind,
    FaultRule,
    FaultSpec,
    FaultyEngine,
    InjectedFault,
    parse_faults,
    register_faulty_backend,
)

__all__ = [
    "DEFAULT_INPUT",
    "DEFAULT_OUTPUT",
    "FAKE_BACKEND",
    "FAULTS_ENV",
    "FAULTS_PLUGIN",
    "FAULTY_BACKEND",
    "FAULT_ERRORS",
    "FakeEngine",
    "FaultKind",
    "FaultRule",
    "FaultSpec",
    "FaultyEngine",
    "InjectedFault",
    "parse_faults",
    "register",
    "register_fake_backend",
    "register_faulty_backend",
]

#: What a test puts in ``ENGINES_PLUGINS`` (:data:`engines.registry.PLUGINS_ENV`) so that a worker
#: process it starts has the ``faulty`` backend.
FAULTS_PLUGIN = "engines.testing.faults"


def register() -> list[Backend]:
    """Register the test backends ``"fake"`` and ``"faulty"`` in this process.

    Returns:
        The registered backends.
    """
    return [register_fake_backend(), register_faulty_backend()]
