"""A fake engine for tests of code that uses engines (the stream processor), with no model file.

:class:`FakeEngine` computes a fixed, documented function of its input, so a test can compute the
expected prediction itself; it can be told to fail (every batch holding a chosen item, or the
first N batches), it records the size of every batch it ran, and it can sleep to simulate compute.
Like httpx's ``MockTransport``, it ships in the library so users' tests need no GPU or model.

The backend ``"fake"`` is registered only by :func:`register_fake_backend` (or
:func:`engines.testing.register`), never at import, and it is ``test_only``: ``auto`` never
picks it.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engines.base import DYNAMIC, Engine, EngineInfo, TensorSpec
from engines.exceptions import EngineError, EngineRuntimeError
from engines.registry import Backend, register

__all__ = [
    "DEFAULT_INPUT",
    "DEFAULT_OUTPUT",
    "FAKE_BACKEND",
    "FakeEngine",
    "register_fake_backend",
]

#: Registry name of the fake backend.
FAKE_BACKEND = "fake"

#: Default input: a batch of 8x8 single-channel images, ``float32[batch, 1, 8, 8]``.
DEFAULT_INPUT = TensorSpec("input", np.dtype("float32"), (DYNAMIC, 1, 8, 8))

#: Default output: probabilities over 10 classes, ``float32[batch, 10]``.
DEFAULT_OUTPUT = TensorSpec("probs", np.dtype("float32"), (DYNAMIC, 10))


class FakeEngine(Engine):
    """Deterministic stand-in for a real engine.

    For each item ``i`` of a batch, let ``x`` be the concatenation of
    ``feeds[spec.name][i].astype(float64).ravel()`` over :attr:`inputs` in order (``F`` values).
    Each output ``o`` is then::

        softmax(x @ weights[o.name]).reshape(o.item_shape).astype(o.dtype)

    where ``weights[o.name]`` is ``float64[F, K]`` (``K`` = items in ``o.item_shape``), drawn from
    ``numpy.random.default_rng(seed)`` as ``standard_normal((F, K)) / sqrt(F)``, one output after
    the other. Items are computed one at a time, so an item's output is bit-for-bit the same
    whichever batch it is in. :meth:`predict` computes it without failing, recording or sleeping.

    Safe to call from several threads at once.

    Args:
        inputs: Input specs; default :data:`DEFAULT_INPUT`. First dimension dynamic, the others
            static, numeric dtypes.
        outputs: Output specs; default :data:`DEFAULT_OUTPUT`. First dimension dynamic, the others
            static, floating dtypes.
        seed: Seed of the weights.
        max_batch_size: Largest batch accepted (items).
        fail_on: Called with each item of the first input (``dtype[*item_shape]``, a view: do
            not modify it) before computing; when it returns an error for any item, the whole
            batch raises that error, as a batch holding a poison input fails on a real engine.
            Return a new exception instance per call.
        fail_batches: The first this many batches raise :class:`EngineRuntimeError`
            (retriable), before ``fail_on`` is consulted.
        delay_s: Seconds to sleep in every batch before computing, to simulate compute time.
        model_path: Shown as :attr:`EngineInfo.model_path`; no file is read.

    Attributes:
        batch_sizes: Size of every batch that passed input validation, in call order, failed
            ones included. Feeds rejected by :meth:`infer`'s validation are not recorded.
        weights: The weights by output name, ``float64[F, K]``.

    Raises:
        ValueError: A spec or option is invalid.
    """

    def __init__(
        self,
        inputs: Sequence[TensorSpec] | None = None,
        outputs: Sequence[TensorSpec] | None = None,
        *,
        seed: int = 0,
        max_batch_size: int = 256,
        fail_on: Callable[[np.ndarray], EngineError | None] | None = None,
        fail_batches: int = 0,
        delay_s: float = 0.0,
        model_path: str = "<fake>",
    ) -> None:
        self.inputs = tuple(inputs) if inputs is not None else (DEFAULT_INPUT,)
        self.outputs = tuple(outputs) if outputs is not None else (DEFAULT_OUTPUT,)
        if not self.inputs or not self.outputs:
            raise ValueError("FakeEngine needs at least one input and one output spec")
        for spec in (*self.inputs, *self.outputs):
            if len(spec.shape) < 2 or spec.shape[0] != DYNAMIC or DYNAMIC in spec.item_shape:
                raise ValueError(
                    f"spec {spec.name!r} has shape {spec.shape}; FakeEngine needs a dynamic "
                    "batch dimension followed by static ones, e.g. (-1, 1, 8, 8)"
                )
        for spec in self.inputs:
            if spec.dtype.kind not in "biuf":
                raise ValueError(f"input {spec.name!r} has non-numeric dtype {spec.dtype}")
        for spec in self.outputs:
            if spec.dtype.kind != "f":
                raise ValueError(
                    f"output {spec.name!r} has dtype {spec.dtype}; FakeEngine outputs "
                    "probabilities, use a floating dtype"
                )
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if fail_batches < 0 or delay_s < 0:
            raise ValueError("fail_batches and delay_s must not be negative")

        n_features = sum(math.prod(spec.item_shape) for spec in self.inputs)
        rng = np.random.default_rng(seed)
        self.weights: dict[str, np.ndarray] = {
            spec.name: rng.standard_normal((n_features, math.prod(spec.item_shape)))
            / math.sqrt(n_features)
            for spec in self.outputs
        }
        self.batch_sizes: list[int] = []
        self._fail_on = fail_on
        self._failures_left = fail_batches
        self._delay_s = delay_s
        self._lock = threading.Lock()

        digest = hashlib.sha256(repr((seed, self.inputs, self.outputs)).encode("utf-8")).hexdigest()
        self.info = EngineInfo(
            backend=FAKE_BACKEND,
            model_path=model_path,
            model_sha256=digest,
            version="0",
            device="cpu",
            precision="fp32",
            max_batch_size=max_batch_size,
            extra={"seed": seed},
        )

    def predict(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The outputs :meth:`infer` returns for ``feeds``, without failing, recording or sleeping.

        Args:
            feeds: One array per input, ``dtype[batch, *item_shape]``; not validated.

        Returns:
            One array per output, ``dtype[batch, *item_shape]``.
        """
        batch = len(feeds[self.inputs[0].name])
        results = {
            spec.name: np.empty((batch, *spec.item_shape), dtype=spec.dtype)
            for spec in self.outputs
        }
        for i in range(batch):
            x = np.concatenate(
                [np.asarray(feeds[spec.name][i], dtype=np.float64).ravel() for spec in self.inputs]
            )
            for spec in self.outputs:
                logits = x @ self.weights[spec.name]
                exp = np.exp(logits - logits.max())
                results[spec.name][i] = (exp / exp.sum()).reshape(spec.item_shape)
        return results

    def infer_impl(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Record the batch, sleep, inject failures, then :meth:`predict`. See :meth:`infer`."""
        batch = len(feeds[self.inputs[0].name])
        with self._lock:
            self.batch_sizes.append(batch)
            fail_now = self._failures_left > 0
            if fail_now:
                self._failures_left -= 1
        if self._delay_s:
            time.sleep(self._delay_s)
        if fail_now:
            raise EngineRuntimeError(f"injected failure of a batch of {batch} (fail_batches)")
        if self._fail_on is not None:
            for item in feeds[self.inputs[0].name]:
                error = self._fail_on(item)
                if error is not None:
                    try:
                        raise error
                    finally:  # the frame must not keep its own error: a reference cycle
                        del error
        return self.predict(feeds)


def _load_fake(model_path: Path, **options: Any) -> FakeEngine:
    return FakeEngine(model_path=str(model_path), **options)


def register_fake_backend() -> Backend:
    """Register :class:`FakeEngine` as backend ``"fake"``; its options are FakeEngine's.

    Example:
        ``register_fake_backend(); load_engine("fake", "any-name", delay_s=0.01)``

    Returns:
        The registered backend.
    """
    return register(
        FAKE_BACKEND,
        _load_fake,
        is_available=lambda: True,
        description="TEST ONLY: deterministic fake engine (no model file; engines.testing)",
        test_only=True,
    )
