"""Fault injection for tests: :class:`FaultyEngine` wraps a real engine and fails chosen batches
with chosen error kinds (:class:`FaultRule`).

The backend ``"faulty"`` is **test-only**: nothing registers it in production. Tests in this
process call :func:`register_faulty_backend` (or :func:`engines.testing.register`); a worker
*process* started by a test gets it through the registry's plugin hook, by running with
``ENGINES_PLUGINS=engines.testing.faults`` (see :data:`engines.registry.PLUGINS_ENV`), which
calls :func:`register_backends`. Its rules come from ``faults=`` or the environment variable
:data:`FAULTS_ENV`. ``auto`` never picks it, and it only ever makes things fail.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from engines.base import Engine
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
    "FAULTS_ENV",
    "FAULTY_BACKEND",
    "FAULT_ERRORS",
    "FaultKind",
    "FaultRule",
    "FaultSpec",
    "FaultyEngine",
    "InjectedFault",
    "parse_faults",
    "register_backends",
    "register_faulty_backend",
]

#: Registry name of the fault-injecting wrapper backend (test-only).
FAULTY_BACKEND = "faulty"

#: Environment variable read by the ``faulty`` backend when it is loaded without ``faults=``:
#: JSON, either a list of rules, one rule object, or
#: ``{"backend": NAME, "pass_first": N, "rules": [...]}`` (see :func:`parse_faults`).
#: Example: ``[{"match_first_value": 0.96875, "kind": "runtime", "times": 2}]``.
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
        match_first_value: The marker value, e.g. ``0.96875`` (a digits request whose first
            pixel is 15.5, scaled by 1/16: a marker must lie inside the model's
            ``request.value_range`` to reach the engine); None matches every batch. NaN never
            matches. Avoid 0.0 with real traffic: a worker's warm-up item is all zeros (it
            passes anyway when loaded through the registry, see ``pass_first``).
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
        batch_delay_ms: Milliseconds every batch sleeps before running (a slow engine: 32 ms
            for batches of 16 answers about 500 requests/s); 0 for none.
    """

    backend: str | None = None
    rules: tuple[FaultRule, ...] = ()
    pass_first: int | None = None
    batch_delay_ms: float = 0.0


def parse_faults(spec: str | Sequence[Any] | Mapping[str, Any] | None) -> FaultSpec:
    """Parse a fault specification, as found in :data:`FAULTS_ENV`.

    Args:
        spec: JSON text or its decoded form: a list of rules, one rule, or
            ``{"backend": NAME, "pass_first": N, "batch_delay_ms": MS, "rules": [...]}``
            (``backend``, ``pass_first`` and ``batch_delay_ms`` optional); None or ``""``
            means no rules.

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
    delay: Any = 0.0
    if isinstance(spec, Mapping) and "rules" in spec:
        extra = sorted(set(spec) - {"backend", "pass_first", "batch_delay_ms", "rules"})
        if extra:
            raise ValueError(
                f"fault specification has unknown field(s) {extra}; fields: backend, "
                "pass_first, batch_delay_ms, rules"
            )
        backend, pass_first = spec.get("backend"), spec.get("pass_first")
        delay = spec.get("batch_delay_ms", 0.0)
        spec = spec["rules"]
    if isinstance(delay, bool) or not isinstance(delay, int | float) or not 0 <= delay < 60_000:
        raise ValueError(f"fault batch_delay_ms must be a number from 0 to 60000, got {delay!r}")
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
        float(delay),
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
        batch_delay_ms: Milliseconds every batch sleeps before running (a slow engine).

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
        batch_delay_ms: float = 0.0,
    ) -> None:
        if pass_first < 0:
            raise ValueError(f"pass_first must be >= 0, got {pass_first}")
        self.inner = inner
        self.pass_first = pass_first
        self.batch_delay_s = batch_delay_ms / 1000.0
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
        if self.batch_delay_s:
            time.sleep(self.batch_delay_s)
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
                        pass_first=pass_first, batch_delay_ms=spec.batch_delay_ms)


def register_faulty_backend() -> Backend:
    """Register :class:`FaultyEngine` as the test-only backend ``"faulty"``.

    Only tests call it (directly, through :func:`engines.testing.register`, or in a worker
    process through the ``ENGINES_PLUGINS`` hook); ``auto`` never picks a test-only backend.

    Example:
        ``load_engine("faulty", "model.onnx", faults=[{"kind": "oom", "times": 1}])``
    """
    return register(
        FAULTY_BACKEND,
        _load_faulty,
        is_available=lambda: True,
        description=(
            f"TEST ONLY: wraps a real backend and injects failures from {FAULTS_ENV} "
            "(engines.testing.faults)"
        ),
        test_only=True,
    )



def register_backends() -> None:
    """Plugin hook (``ENGINES_PLUGINS=engines.testing.faults``): register ``"faulty"``."""
    register_faulty_backend()
