"""A fake engine for tests of code that uses engines (the stream processor), with no model file.

:class:`FakeEngine` computes a fixed, documented function of its input, so a test can compute the
expected prediction itself; it can be told to fail (every batch holding a chosen item, or the
first N batches), it records the size of every batch it ran, and it can sleep to simulate compute.
Like httpx's ``MockTransport``, it ships in the library so users' tests need no GPU or model.

The backend ``"fake"`` is registered only by :func:`register_fake_backend`, never at import, so
production code cannot pick it by accident.

:class:`FaultyEngine` wraps a real engine and fails chosen batches with chosen error kinds
(:class:`FaultRule`): the backend ``"faulty"`` is registered when the registry loads its built-in
backends, so a worker *process* can use it (``STREAMAPP_BACKEND=faulty`` plus the rules in the
environment variable :data:`FAULTS_ENV`), but it is **test-only**: ``auto`` never picks it and
it only ever makes things fail.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from engines.base import DYNAMIC, Engine, EngineInfo, TensorSpec
from engines.exceptions import (
    EngineError,
    EngineLoadError,
    EngineRuntimeError,
    EngineTimeoutError,
    InputSpecError,
    OutOfMemoryError,
)
from engines.registry import Backend, load_engine, register

__all__ = [
    "DEFAULT_INPUT",
    "DEFAULT_OUTPUT",
    "FAKE_BACKEND",
    "FAULTS_ENV",
    "FAULTY_BACKEND",
    "FAULT_ERRORS",
    "FakeEngine",
    "FaultKind",
    "FaultRule",
    "FaultSpec",
    "FaultyEngine",
    "InjectedFault",
    "parse_faults",
    "register_fake_backend",
    "register_faulty_backend",
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
                    raise error
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
        description="deterministic fake engine for tests (no model file; engines.testing)",
    )


# -- fault injection -----------------------------------------------------------------------------

#: Registry name of the fault-injecting wrapper backend (test-only).
FAULTY_BACKEND = "faulty"

#: Environment variable read by the ``faulty`` backend when it is loaded without ``faults=``:
#: JSON, either a list of rules, one rule object, or
#: ``{"backend": NAME, "pass_first": N, "rules": [...]}`` (see :func:`parse_faults`).
#: Example: ``[{"match_first_value": -0.0625, "kind": "runtime", "times": 2}]``.
FAULTS_ENV = "ENGINES_FAULTS"

#: Error kinds a rule can inject.
FaultKind = Literal["runtime", "oom", "timeout", "input"]

#: What each kind raises: ``runtime``, ``oom`` and ``timeout`` are retriable, ``input`` is not.
FAULT_ERRORS: dict[str, type[EngineError]] = {
    "runtime": EngineRuntimeError,
    "oom": OutOfMemoryError,
    "timeout": EngineTimeoutError,
    "input": InputSpecError,
}

_RULE_FIELDS = ("kind", "match_first_value", "probability", "times", "count", "seed")


@dataclasses.dataclass(frozen=True)
class FaultRule:
    """When to make a batch fail, and how.

    A rule with ``match_first_value`` looks at every item of a batch: an item *matches* when the
    first element of its first input (``feeds[inputs[0].name][i].flat[0]``) equals the value
    exactly. A rule without it matches every batch once. A match fires with ``probability``,
    at most ``times`` times — counted per item content (sha256 of the item's bytes in every
    input) for item rules, in total for batch rules — and a firing match makes the **whole
    batch** raise, as a poison input does on a real engine; splitting the batch is the caller's
    job.

    Attributes:
        kind: ``"runtime"`` → :class:`EngineRuntimeError`, ``"oom"`` →
            :class:`OutOfMemoryError`, ``"timeout"`` → :class:`EngineTimeoutError` (all
            retriable), ``"input"`` → :class:`InputSpecError` (not retriable).
        match_first_value: The marker value, e.g. ``-0.0625`` (a digits request whose first
            pixel is -1, scaled by 1/16); None matches every batch. NaN never matches. Avoid
            0.0 with real traffic: a worker's warm-up item is all zeros (it passes anyway when
            loaded through the registry, see ``pass_first``).
        probability: Chance that a match fires, in [0, 1].
        times: Most firings (per item for item rules); None for no limit.
        count: For item rules with ``times``: ``"batch"`` counts every batch failed because of
            the item; ``"alone"`` counts only batches of that one item, so that batches holding
            it keep failing until a caller has isolated it ``times`` times — with bisection,
            ``times=2, count="alone"`` makes a request fail exactly twice whatever the batching.
        seed: Seed of this rule's random draws (None: unpredictable).
    """

    kind: FaultKind = "runtime"
    match_first_value: float | None = None
    probability: float = 1.0
    times: int | None = None
    count: Literal["batch", "alone"] = "batch"
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in FAULT_ERRORS:
            raise ValueError(
                f"fault kind {self.kind!r} is unknown; use one of {', '.join(FAULT_ERRORS)}"
            )
        value = self.match_first_value
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"fault match_first_value must be a number or null, got {value!r}")
        probability = self.probability
        if (
            isinstance(probability, bool)
            or not isinstance(probability, int | float)
            or not 0.0 <= probability <= 1.0
        ):
            raise ValueError(f"fault probability must be in [0, 1], got {probability!r}")
        times = self.times
        if times is not None and (
            isinstance(times, bool) or not isinstance(times, int) or times < 1
        ):
            raise ValueError(f"fault times must be a positive integer or null, got {times!r}")
        if self.count not in ("batch", "alone"):
            raise ValueError(f"fault count must be 'batch' or 'alone', got {self.count!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FaultRule:
        """Build a rule from its JSON form (the field names above).

        Raises:
            ValueError: An unknown field or an invalid value; the message names it.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"a fault rule must be a JSON object, got {data!r}")
        unknown = sorted(set(data) - set(_RULE_FIELDS))
        if unknown:
            raise ValueError(
                f"fault rule {dict(data)} has unknown field(s) {unknown}; fields: "
                f"{', '.join(_RULE_FIELDS)}"
            )
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"fault rule {dict(data)} is invalid: {exc}") from None


@dataclasses.dataclass(frozen=True)
class InjectedFault:
    """One injected failure: which rule (index), what kind, and the size of the failed batch."""

    rule: int
    kind: str
    batch_size: int


@dataclasses.dataclass(frozen=True)
class FaultSpec:
    """A parsed fault specification (see :func:`parse_faults`).

    Attributes:
        backend: The backend to wrap, or None for the loader's default (``onnxruntime``).
        rules: The rules, in order.
        pass_first: Batches run unfaulted before any rule is consulted, or None for the
            loader's default (1: the worker's warm-up batch).
    """

    backend: str | None = None
    rules: tuple[FaultRule, ...] = ()
    pass_first: int | None = None


def parse_faults(spec: str | Sequence[Any] | Mapping[str, Any] | None) -> FaultSpec:
    """Parse a fault specification, as found in :data:`FAULTS_ENV`.

    Args:
        spec: JSON text or its decoded form: a list of rules, one rule, or
            ``{"backend": NAME, "pass_first": N, "rules": [...]}`` (``backend`` and
            ``pass_first`` optional); None or ``""`` means no rules.

    Returns:
        The specification.

    Raises:
        ValueError: Not valid JSON, or an invalid rule or field.
    """
    if spec is None or spec == "":
        return FaultSpec()
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"fault specification is not valid JSON: {exc}") from None
    backend = pass_first = None
    if isinstance(spec, Mapping) and "rules" in spec:
        extra = sorted(set(spec) - {"backend", "pass_first", "rules"})
        if extra:
            raise ValueError(
                f"fault specification has unknown field(s) {extra}; fields: backend, "
                "pass_first, rules"
            )
        backend, pass_first = spec.get("backend"), spec.get("pass_first")
        spec = spec["rules"]
    if isinstance(spec, Mapping):
        spec = [spec]
    if not isinstance(spec, Sequence) or isinstance(spec, str):
        raise ValueError(f"fault rules must be a JSON list of objects, got {spec!r}")
    if backend is not None and not isinstance(backend, str):
        raise ValueError(f"fault backend must be a backend name, got {backend!r}")
    if pass_first is not None and (
        not isinstance(pass_first, int) or isinstance(pass_first, bool) or pass_first < 0
    ):
        raise ValueError(f"fault pass_first must be an integer >= 0, got {pass_first!r}")
    rules: list[Any] = list(spec)
    return FaultSpec(
        backend,
        tuple(r if isinstance(r, FaultRule) else FaultRule.from_dict(r) for r in rules),
        pass_first,
    )


class FaultyEngine(Engine):
    """Test-only wrapper that makes chosen batches of a real engine fail (see :class:`FaultRule`).

    Batches that no rule fires on are run by the wrapped engine unchanged, so results stay
    real. Rules are checked in order; the first that fires decides the error. Safe to call from
    several threads at once when the wrapped engine is (the executor gives each its own).

    Args:
        inner: The engine to wrap; closed with this one.
        rules: The rules (objects or their JSON form).
        pass_first: The first this many batches run without consulting any rule (no draw, no
            count) — e.g. 1 for a worker's warm-up batch, which must pass for it to start.

    Attributes:
        injected: Every failure injected so far, in order.
        seen: Batches seen, failed ones included.
    """

    def __init__(
        self,
        inner: Engine,
        rules: Sequence[FaultRule | Mapping[str, Any]],
        *,
        pass_first: int = 0,
    ) -> None:
        if pass_first < 0:
            raise ValueError(f"pass_first must be >= 0, got {pass_first}")
        self.inner = inner
        self.pass_first = pass_first
        self.rules = [r if isinstance(r, FaultRule) else FaultRule.from_dict(r) for r in rules]
        self.inputs = inner.inputs
        self.outputs = inner.outputs
        self.info = dataclasses.replace(
            inner.info,
            backend=FAULTY_BACKEND,
            extra={**inner.info.extra, "wraps": inner.info.backend, "fault_rules": len(self.rules)},
        )
        self.injected: list[InjectedFault] = []
        self.seen = 0
        self._rngs = [random.Random(rule.seed) for rule in self.rules]
        self._fired: list[dict[bytes, int]] = [{} for _ in self.rules]
        self._lock = threading.Lock()

    def infer_impl(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Raise the first firing rule's error for the whole batch, else run the inner engine."""
        batch = len(feeds[self.inputs[0].name])
        with self._lock:
            self.seen += 1
            fault = self._decide(feeds, batch) if self.seen > self.pass_first else None
            if fault is not None:
                self.injected.append(fault)
        if fault is not None:
            raise FAULT_ERRORS[fault.kind](
                f"injected {fault.kind} failure (rule {fault.rule}) of a batch of {batch}; "
                f"set by {FAULTS_ENV} / FaultyEngine rules, for tests only"
            )
        return self.inner.infer(feeds)

    def _decide(self, feeds: Mapping[str, np.ndarray], batch: int) -> InjectedFault | None:
        first = np.asarray(feeds[self.inputs[0].name])
        for index, rule in enumerate(self.rules):
            fired = self._fired[index]
            if rule.match_first_value is None:
                if rule.times is not None and fired.get(b"", 0) >= rule.times:
                    continue
                if self._draw(index):
                    fired[b""] = fired.get(b"", 0) + 1
                    return InjectedFault(index, rule.kind, batch)
                continue
            for i in range(batch):
                if first[i].size == 0 or float(first[i].flat[0]) != rule.match_first_value:
                    continue
                key = self._item_key(feeds, i)
                if rule.times is not None and fired.get(key, 0) >= rule.times:
                    continue
                if self._draw(index):
                    if rule.count == "batch" or batch == 1:
                        fired[key] = fired.get(key, 0) + 1
                    return InjectedFault(index, rule.kind, batch)
        return None

    def _draw(self, index: int) -> bool:
        probability = self.rules[index].probability
        return probability >= 1.0 or self._rngs[index].random() < probability

    def _item_key(self, feeds: Mapping[str, np.ndarray], i: int) -> bytes:
        digest = hashlib.sha256()
        for spec in self.inputs:
            item = np.ascontiguousarray(feeds[spec.name][i])
            digest.update(f"{spec.name}:{item.dtype.str}:{item.shape}".encode())
            digest.update(item.tobytes())
        return digest.digest()

    def close_impl(self) -> None:
        self.inner.close()


def _load_faulty(
    model_path: Path,
    *,
    faults: str | Sequence[Any] | Mapping[str, Any] | None = None,
    inner_backend: str | None = None,
    **options: Any,
) -> FaultyEngine:
    """Loader of the ``faulty`` backend: wraps ``inner_backend`` (or the specification's
    ``backend``, default ``onnxruntime``) loaded with ``options``. Unless the specification
    says otherwise (``pass_first``), the first batch — a worker's warm-up — always passes."""
    source = faults if faults is not None else os.environ.get(FAULTS_ENV)
    try:
        spec = parse_faults(source)
    except ValueError as exc:
        where = "faults=" if faults is not None else f"the environment variable {FAULTS_ENV}"
        raise EngineLoadError(f"{where} is invalid: {exc}") from None
    backend = inner_backend or spec.backend or "onnxruntime"
    if backend in ("auto", FAULTY_BACKEND):
        raise EngineLoadError(
            f"the faulty backend must wrap a named real backend, not {backend!r}"
        )
    pass_first = 1 if spec.pass_first is None else spec.pass_first
    return FaultyEngine(load_engine(backend, model_path, **options), spec.rules,
                        pass_first=pass_first)


def register_faulty_backend() -> Backend:
    """Register :class:`FaultyEngine` as the test-only backend ``"faulty"``.

    Called when the registry loads its built-in backends, so worker processes can be told
    ``STREAMAPP_BACKEND=faulty``; ``auto`` never picks a test-only backend.

    Example:
        ``load_engine("faulty", "model.onnx", faults=[{"kind": "oom", "times": 1}])``
    """
    return register(
        FAULTY_BACKEND,
        _load_faulty,
        is_available=lambda: True,
        description=(
            f"TEST ONLY: wraps a real backend and injects failures from {FAULTS_ENV} "
            "(engines.testing)"
        ),
        test_only=True,
    )


register_faulty_backend()
