from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from engines import registry
from engines.base import TensorSpec
from engines.exceptions import EngineError, EngineRuntimeError, InputSpecError
from engines.testing import DEFAULT_INPUT, DEFAULT_OUTPUT, FakeEngine, register_fake_backend


def _batch(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 1, 8, 8)).astype(np.float32)


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_default_specs() -> None:
    engine = FakeEngine()
    assert engine.inputs == (TensorSpec("input", np.dtype("float32"), (-1, 1, 8, 8)),)
    assert engine.outputs == (TensorSpec("probs", np.dtype("float32"), (-1, 10)),)
    assert (DEFAULT_INPUT, DEFAULT_OUTPUT) == (engine.inputs[0], engine.outputs[0])
    assert engine.info.backend == "fake"
    assert engine.max_batch_size == 256
    assert engine.weights["probs"].shape == (64, 10)


def test_outputs_follow_the_documented_formula() -> None:
    x = _batch(6)
    engine = FakeEngine(seed=5)
    probs = engine.infer({"input": x})["probs"]

    rng = np.random.default_rng(5)
    weights = rng.standard_normal((64, 10)) / np.sqrt(64)
    expected = _softmax(x.reshape(6, 64).astype(np.float64) @ weights)

    assert probs.dtype == np.float32
    assert probs.shape == (6, 10)
    np.testing.assert_allclose(probs, expected, rtol=1e-6)
    np.testing.assert_array_equal(probs, engine.predict({"input": x})["probs"])


def test_same_seed_same_outputs_other_seed_other_outputs() -> None:
    x = _batch(4)
    a = FakeEngine(seed=1).infer({"input": x})["probs"]
    b = FakeEngine(seed=1).infer({"input": x})["probs"]
    c = FakeEngine(seed=2).infer({"input": x})["probs"]
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    assert FakeEngine(seed=1).info.model_sha256 == FakeEngine(seed=1).info.model_sha256
    assert FakeEngine(seed=1).info.model_sha256 != FakeEngine(seed=2).info.model_sha256


def test_an_items_output_does_not_depend_on_its_batch() -> None:
    engine = FakeEngine()
    x = _batch(9)
    together = engine.infer({"input": x})["probs"]
    for i in range(9):
        alone = engine.infer({"input": x[i : i + 1]})["probs"]
        np.testing.assert_array_equal(alone[0], together[i])
    np.testing.assert_array_equal(engine.infer({"input": x[3:7]})["probs"], together[3:7])


def test_custom_specs() -> None:
    inputs = [
        TensorSpec("pixels", np.dtype("uint8"), (-1, 2, 2)),
        TensorSpec("meta", np.dtype("int64"), (-1, 3)),
    ]
    outputs = [
        TensorSpec("grid", np.dtype("float16"), (-1, 2, 3)),
        TensorSpec("score", np.dtype("float64"), (-1, 1)),
    ]
    engine = FakeEngine(inputs, outputs, max_batch_size=4)
    feeds: dict[str, np.ndarray] = {
        "pixels": np.arange(3 * 4, dtype=np.uint8).reshape(3, 2, 2),
        "meta": np.ones((3, 3), dtype=np.int64),
    }
    out = engine.infer(feeds)
    assert engine.weights["grid"].shape == (7, 6)
    assert out["grid"].dtype == np.float16 and out["grid"].shape == (3, 2, 3)
    grid_sums = out["grid"].reshape(3, 6).astype(np.float64).sum(axis=1)
    np.testing.assert_allclose(grid_sums, 1.0, rtol=1e-2)
    np.testing.assert_array_equal(out["score"], np.ones((3, 1)))  # softmax of one logit
    x0 = np.concatenate([feeds["pixels"][0].ravel(), feeds["meta"][0]]).astype(np.float64)
    np.testing.assert_allclose(
        out["grid"][0].ravel(), _softmax(x0 @ engine.weights["grid"]), rtol=1e-3
    )
    with pytest.raises(InputSpecError, match="batch 5"):
        engine.infer({k: np.concatenate([v, v[:2]]) for k, v in feeds.items()})


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"inputs": [TensorSpec("x", np.dtype("float32"), (-1, -1))]}, "static"),
        ({"inputs": [TensorSpec("x", np.dtype("float32"), (4, 3))]}, "dynamic batch"),
        ({"outputs": [TensorSpec("y", np.dtype("int32"), (-1, 3))]}, "floating"),
        ({"inputs": [TensorSpec("s", np.dtype("U4"), (-1, 3))]}, "non-numeric"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"fail_batches": -1}, "negative"),
    ],
)
def test_invalid_configuration(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        FakeEngine(**kwargs)


def test_fail_batches_fails_the_first_n_and_records_every_batch() -> None:
    engine = FakeEngine(fail_batches=2)
    x = _batch(3)
    for _ in range(2):
        with pytest.raises(EngineRuntimeError, match="injected") as info:
            engine.infer({"input": x})
        assert info.value.retriable
    assert engine.infer({"input": x})["probs"].shape == (3, 10)
    assert engine.infer({"input": x[:1]})["probs"].shape == (1, 10)
    assert engine.batch_sizes == [3, 3, 3, 1]


def test_fail_on_fails_every_batch_holding_a_poison_item() -> None:
    seen: list[tuple[int, ...]] = []

    def poison(item: np.ndarray) -> EngineError | None:
        seen.append(item.shape)
        return InputSpecError("poison pixel") if item[0, 0, 0] > 100 else None

    engine = FakeEngine(fail_on=poison)
    x = _batch(4)
    x[2, 0, 0, 0] = 1000.0
    with pytest.raises(InputSpecError, match="poison pixel"):
        engine.infer({"input": x})
    assert seen[:3] == [(1, 8, 8)] * 3
    clean = np.delete(x, 2, axis=0)
    np.testing.assert_array_equal(
        engine.infer({"input": clean})["probs"], engine.predict({"input": clean})["probs"]
    )
    with pytest.raises(InputSpecError):
        engine.infer({"input": x[2:3]})
    assert engine.batch_sizes == [4, 3, 1]


def test_rejected_feeds_are_not_recorded() -> None:
    engine = FakeEngine(max_batch_size=2)
    with pytest.raises(InputSpecError):
        engine.infer({"input": _batch(3)})
    with pytest.raises(InputSpecError):
        engine.infer({"wrong": _batch(1)})
    assert engine.batch_sizes == []


def test_delay_s_sleeps_in_every_batch() -> None:
    engine = FakeEngine(delay_s=0.05)
    start = time.perf_counter()
    engine.infer({"input": _batch(1)})
    engine.infer({"input": _batch(1)})
    assert time.perf_counter() - start >= 0.1


def test_concurrent_calls_fail_exactly_fail_batches_times() -> None:
    engine = FakeEngine(fail_batches=5, delay_s=0.001)

    def call(batch: int) -> bool:
        try:
            engine.infer({"input": _batch(batch)})
        except EngineRuntimeError:
            return False
        return True

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(call, [1 + i % 4 for i in range(40)]))
    assert results.count(False) == 5
    assert sorted(engine.batch_sizes) == sorted(1 + i % 4 for i in range(40))


def test_fake_backend_is_registered_only_on_request(
    isolated_registry: dict[str, registry.Backend],
) -> None:
    assert "fake" not in registry.registered_backends()
    backend = register_fake_backend()
    assert backend.name == "fake" and backend.is_available()
    assert "fake" in registry.available_backends()
    assert backend.test_only and registry.resolve_backend("auto") != "fake"
    engine = registry.load_engine("fake", "models/demo.onnx", seed=7, delay_s=0.0)
    assert isinstance(engine, FakeEngine)
    assert engine.info.model_path == "models/demo.onnx"
    np.testing.assert_array_equal(
        engine.infer({"input": _batch(2)})["probs"],
        FakeEngine(seed=7).infer({"input": _batch(2)})["probs"],
    )
