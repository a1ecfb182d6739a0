"""The test-only ``faulty`` backend: rules decide which batches fail, with which error; the rest
run on the wrapped engine unchanged; rules come from ``faults=`` or the environment (so a worker
process can be told), and ``auto`` never picks it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from engines import registry
from engines.exceptions import (
    EngineError,
    EngineLoadError,
    EngineRuntimeError,
    EngineTimeoutError,
    InputSpecError,
    OutOfMemoryError,
)
from engines.registry import PLUGINS_ENV
from engines.testing import (
    FAULT_ERRORS,
    FAULTS_ENV,
    FAULTS_PLUGIN,
    FakeEngine,
    FaultRule,
    FaultSpec,
    FaultyEngine,
    InjectedFault,
    parse_faults,
)
from streamapp.models import ModelRepository
from streamapp.records import InferenceRequest, TensorPayload

MARK = 0.96875  # 15.5 / 16: a digits pixel of 15.5 (real ones are whole numbers)

#: The test backends ("faulty" wraps real ones) are registered for every test here.
pytestmark = pytest.mark.usefixtures("test_backends")


def items(n: int, seed: int = 0) -> np.ndarray:
    """``float32[n, 1, 8, 8]`` in 0..1, never starting with the marker."""
    return np.random.default_rng(seed).uniform(0, 1, (n, 1, 8, 8)).astype(np.float32)


def marked(batch: np.ndarray, index: int, value: float = MARK) -> np.ndarray:
    out = batch.copy()
    out[index, 0, 0, 0] = value
    return out


def run(engine: FaultyEngine, batch: np.ndarray) -> np.ndarray | EngineError:
    try:
        return engine.infer({"input": batch})["probs"]
    except EngineError as exc:
        return exc


def test_batches_no_rule_matches_run_on_the_wrapped_engine() -> None:
    inner = FakeEngine(seed=3)
    engine = FaultyEngine(inner, [{"match_first_value": MARK, "kind": "runtime"}])
    x = items(8)

    probs = engine.infer({"input": x})["probs"]

    np.testing.assert_array_equal(probs, inner.predict({"input": x})["probs"])
    assert engine.injected == [] and engine.seen == 1
    assert inner.batch_sizes == [8]
    assert engine.info.backend == "faulty" and engine.info.extra["wraps"] == "fake"
    assert engine.inputs == inner.inputs and engine.outputs == inner.outputs


def test_a_matching_item_fails_its_whole_batch_times_then_succeeds() -> None:
    inner = FakeEngine()
    engine = FaultyEngine(inner, [{"match_first_value": MARK, "kind": "runtime", "times": 2}])
    x = marked(items(16), 5)

    outcomes = [run(engine, x) for _ in range(3)]

    assert [type(o).__name__ for o in outcomes] == [
        "EngineRuntimeError",
        "EngineRuntimeError",
        "ndarray",
    ]
    np.testing.assert_array_equal(outcomes[2], inner.predict({"input": x})["probs"])
    assert engine.injected == [InjectedFault(0, "runtime", 16)] * 2
    assert inner.batch_sizes == [16]  # failed batches never reached the wrapped engine
    assert "batch of 16" in str(outcomes[0])


def test_times_are_counted_per_item_content() -> None:
    engine = FaultyEngine(FakeEngine(), [{"match_first_value": MARK, "times": 1}])
    a = marked(items(1, seed=1), 0)
    b = marked(items(1, seed=2), 0)

    assert isinstance(run(engine, a), EngineRuntimeError)
    assert isinstance(run(engine, b), EngineRuntimeError)  # other content: its own count
    assert isinstance(run(engine, a), np.ndarray)
    # The same item in another batch, at another position, is the same item.
    assert isinstance(run(engine, np.concatenate([items(3), b])), np.ndarray)


def test_count_alone_fails_bisection_steps_without_using_up_times() -> None:
    engine = FaultyEngine(FakeEngine(), [{"match_first_value": MARK, "times": 2, "count": "alone"}])
    x = marked(items(8), 6)

    def bisect(batch: np.ndarray) -> list[int]:
        """Sizes of the single-item batches that failed: what a caller would retry."""
        if not isinstance(run(engine, batch), EngineError):
            return []
        if len(batch) == 1:
            return [1]
        half = len(batch) // 2
        return bisect(batch[:half]) + bisect(batch[half:])

    assert bisect(x) == [1]  # attempt 0: 8 → 4 → 2 → 1 failed, the item isolated
    assert bisect(x) == [1]  # attempt 1: the same
    assert bisect(x) == []  # attempt 2: succeeds
    assert [f.batch_size for f in engine.injected] == [8, 4, 2, 1] * 2


@pytest.mark.parametrize(
    ("kind", "error", "retriable", "reason"),
    [
        ("runtime", EngineRuntimeError, True, "engine_runtime_error"),
        ("oom", OutOfMemoryError, True, "out_of_memory"),
        ("timeout", EngineTimeoutError, True, "timeout"),
        ("input", InputSpecError, False, "input_spec_mismatch"),
    ],
)
def test_kinds_raise_engine_errors_with_their_retriable_flag(
    kind: str, error: type[EngineError], retriable: bool, reason: str
) -> None:
    engine = FaultyEngine(FakeEngine(), [{"kind": kind}])

    raised = run(engine, items(2))

    assert type(raised) is error and FAULT_ERRORS[kind] is error
    assert isinstance(raised, EngineError)
    assert raised.retriable is retriable and raised.reason == reason


def test_timeout_is_a_retriable_runtime_error() -> None:
    assert issubclass(EngineTimeoutError, EngineRuntimeError)
    assert EngineTimeoutError.retriable and EngineTimeoutError.reason == "timeout"


def test_batch_rule_with_probability_is_seeded() -> None:
    def failures(seed: int) -> list[int]:
        engine = FaultyEngine(FakeEngine(), [{"probability": 0.05, "seed": seed}])
        return [i for i in range(2000) if isinstance(run(engine, items(1)), EngineError)]

    first = failures(1)

    assert first == failures(1)
    assert first != failures(2)
    assert 60 <= len(first) <= 140  # 5 % of 2000 = 100, binomial sd ≈ 9.7


def test_batch_rule_times_is_a_total() -> None:
    engine = FaultyEngine(FakeEngine(), [{"kind": "oom", "times": 3}])

    outcomes = [run(engine, items(2, seed=i)) for i in range(5)]

    assert [isinstance(o, OutOfMemoryError) for o in outcomes] == [True] * 3 + [False] * 2


def test_item_rule_with_probability() -> None:
    engine = FaultyEngine(
        FakeEngine(), [{"match_first_value": MARK, "probability": 0.5, "seed": 0}]
    )
    plain = [run(engine, items(4, seed=i)) for i in range(50)]
    with_mark = [run(engine, marked(items(4, seed=i), 0)) for i in range(400)]

    assert all(isinstance(o, np.ndarray) for o in plain)
    assert 150 <= sum(isinstance(o, EngineError) for o in with_mark) <= 250


def test_first_matching_rule_decides_the_error() -> None:
    engine = FaultyEngine(
        FakeEngine(),
        [{"match_first_value": MARK, "kind": "input"}, {"kind": "timeout", "times": 1}],
    )

    assert isinstance(run(engine, marked(items(2), 1)), InputSpecError)
    assert isinstance(run(engine, items(2)), EngineTimeoutError)
    assert isinstance(run(engine, items(2)), np.ndarray)


def test_nan_never_matches() -> None:
    engine = FaultyEngine(FakeEngine(), [FaultRule(match_first_value=float("nan"))])

    assert isinstance(run(engine, marked(items(2), 0, float("nan"))), np.ndarray)


def test_close_closes_the_wrapped_engine() -> None:
    inner = FakeEngine()
    with FaultyEngine(inner, []):
        pass

    assert inner.closed


# -- specifications --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "parsed"),
    [
        (None, FaultSpec()),
        ("", FaultSpec()),
        ('{"kind": "oom"}', FaultSpec(rules=(FaultRule(kind="oom"),))),
        (
            '[{"match_first_value": -0.0625, "kind": "runtime", "times": 2}]',
            FaultSpec(rules=(FaultRule(match_first_value=-0.0625, times=2),)),
        ),
        (
            {"backend": "fake", "pass_first": 0, "rules": [{"probability": 0.05, "seed": 1}]},
            FaultSpec("fake", (FaultRule(probability=0.05, seed=1),), 0),
        ),
    ],
    ids=["none", "empty", "one-object", "list", "with-backend"],
)
def test_parse_faults(spec: object, parsed: FaultSpec) -> None:
    assert parse_faults(spec) == parsed  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("[{", "not valid JSON"),
        ('[{"kind": "segfault"}]', "'segfault'"),
        ('[{"kind": "runtime", "probabilty": 0.5}]', "probabilty"),
        ('[{"probability": 1.5}]', "[0, 1]"),
        ('[{"times": 0}]', "positive"),
        ('[{"count": "twice"}]', "'batch' or 'alone'"),
        ('"runtime"', "list of objects"),
        ("[1]", "JSON object"),
        ('{"rules": [], "extra": 1}', "extra"),
        ('{"rules": [], "pass_first": -1}', "pass_first"),
        ('[{"match_first_value": "-0.0625"}]', "match_first_value"),
        ('[{"probability": "0.5"}]', "probability"),
        ('[{"times": 1.5}]', "times"),
    ],
    ids=[
        "json", "kind", "typo", "probability", "times", "count", "string", "number", "extra",
        "pass-first", "value-string", "probability-string", "times-float",
    ],
)
def test_invalid_specifications_name_the_problem(spec: str, named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("[", r"\[")):
        parse_faults(spec)


# -- the registered backend -----------------------------------------------------------------------


def test_load_engine_faulty_wraps_onnxruntime(onnx_model: Path) -> None:
    engine = registry.load_engine(
        "faulty", onnx_model, faults=[{"kind": "timeout", "times": 1}], max_batch_size=8
    )
    assert isinstance(engine, FaultyEngine)
    assert engine.info.extra["wraps"] == "onnxruntime"
    assert engine.max_batch_size == 8
    x = items(3)
    expected = engine.inner.infer({"input": x})["probs"]

    # Loaded through the registry, the first batch (a worker's warm-up) always passes.
    np.testing.assert_array_equal(run(engine, x), expected)
    assert isinstance(run(engine, x), EngineTimeoutError)
    np.testing.assert_array_equal(run(engine, x), expected)


def test_pass_first_batches_are_never_faulted() -> None:
    engine = FaultyEngine(FakeEngine(), [{"kind": "oom", "times": 1}], pass_first=2)

    outcomes = [type(run(engine, items(1))).__name__ for _ in range(4)]

    assert outcomes == ["ndarray", "ndarray", "OutOfMemoryError", "ndarray"]
    assert engine.seen == 4


def test_specification_can_fault_the_first_batch(onnx_model: Path) -> None:
    engine = registry.load_engine(
        "faulty", onnx_model, faults={"pass_first": 0, "rules": [{"kind": "input"}]}
    )

    assert isinstance(run(engine, items(1)), InputSpecError)  # type: ignore[arg-type]


def test_rules_come_from_the_environment(onnx_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULTS_ENV, json.dumps([{"kind": "oom"}]))

    engine = registry.load_engine("faulty", onnx_model)

    assert isinstance(run(engine, items(1)), np.ndarray)  # type: ignore[arg-type]
    assert isinstance(run(engine, items(1)), OutOfMemoryError)  # type: ignore[arg-type]


def test_invalid_environment_fails_the_load_and_says_where(
    onnx_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAULTS_ENV, "[{oops")

    with pytest.raises(EngineLoadError, match=FAULTS_ENV):
        registry.load_engine("faulty", onnx_model)


@pytest.mark.parametrize("inner", ["auto", "faulty"])
def test_faulty_must_wrap_a_named_real_backend(onnx_model: Path, inner: str) -> None:
    with pytest.raises(EngineLoadError, match="named real backend"):
        registry.load_engine("faulty", onnx_model, faults=[], inner_backend=inner)


def test_a_fresh_process_loads_faulty_from_the_environment(onnx_model: Path) -> None:
    # What a worker subprocess started by a test does: the plugin hook registers "faulty", then
    # STREAMAPP_BACKEND=faulty → load_engine("faulty", path).
    script = (
        "import numpy as np\n"
        "from engines.registry import load_engine\n"
        f"engine = load_engine('faulty', {str(onnx_model)!r})\n"
        "x = np.zeros((4, 1, 8, 8), np.float32)\n"
        "engine.infer({'input': x})  # the warm-up batch passes\n"
        "for _ in range(3):\n"
        "    try:\n"
        "        engine.infer({'input': x}); print('ok')\n"
        "    except Exception as exc:\n"
        "        print(type(exc).__name__, exc.retriable)\n"
    )
    env = {
        FAULTS_ENV: json.dumps([{"match_first_value": 0.0, "kind": "timeout", "times": 2}]),
        PLUGINS_ENV: FAULTS_PLUGIN,
    }
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**_base_env(), **env},
        check=True,
    )

    assert out.stdout.split("\n")[:3] == ["EngineTimeoutError True"] * 2 + ["ok"]


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != FAULTS_ENV}


def test_digits_request_with_the_marker_pixel_fails_on_the_real_model() -> None:
    """The documented recipe: a float32 request whose first pixel is 15.5 (inside the model's
    0-16 range; real pixels are whole numbers) is pre-processed to 15.5/16 = 0.96875 and so
    matches ``match_first_value: 0.96875``."""
    digits = ModelRepository().get("digits")
    pixels = np.zeros((8, 8), np.float32)
    pixels[0, 0] = 15.5
    request = InferenceRequest(
        "r",
        "d",
        0,
        1.7e9,
        "digits",
        tensor=TensorPayload("float32", (8, 8), pixels.tobytes()),
    )
    poison = digits.preprocess(request)
    good = digits.preprocess(
        InferenceRequest(
            "g", "d", 1, 1.7e9, "digits",
            tensor=TensorPayload("uint8", (8, 8), bytes(i % 17 for i in range(64))),
        )
    )
    engine = registry.load_engine(
        "faulty",
        digits.path,
        faults={
            "pass_first": 0,
            "rules": [{"match_first_value": MARK, "kind": "runtime", "times": 1}],
        },
    )
    batch = np.stack([good, poison, good])

    assert isinstance(run(engine, batch), EngineRuntimeError)  # type: ignore[arg-type]
    probs = run(engine, batch)  # type: ignore[arg-type]
    assert isinstance(probs, np.ndarray) and probs.shape == (3, 10)


def test_batch_delay_makes_every_batch_sleep_and_bad_delays_are_refused() -> None:
    spec = parse_faults({"rules": [], "batch_delay_ms": 30})
    assert spec.batch_delay_ms == 30.0 and parse_faults([]).batch_delay_ms == 0.0
    engine = FaultyEngine(FakeEngine(), spec.rules, batch_delay_ms=spec.batch_delay_ms)
    feeds = {"input": np.zeros((2, 1, 8, 8), dtype=np.float32)}
    started = time.perf_counter()
    engine.infer(feeds)
    assert time.perf_counter() - started >= 0.03
    for bad in (-1, "30", True, 60_000):
        with pytest.raises(ValueError, match="batch_delay_ms"):
            parse_faults({"rules": [], "batch_delay_ms": bad})
