"""``ModelConfig.preprocess``'s quick path (``_quick_input``, a ``_TensorPlan`` per dtype)
against its full checks: the same engine input (values, dtype, shape, read-only view or not),
or the same error (reason and message), for every pre-processing a model may declare and
tensors at and past every bound. ``filterwarnings = error`` makes a numpy overflow warning
that a quiet conversion let through fail the test.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from engines.base import put_item, widen_half
from streamapp.codecs import ALLOWED_DTYPES
from streamapp.exceptions import InvalidRequestError
from streamapp.models import ModelConfig, ModelRepository
from streamapp.models.repository import _half_within
from streamapp.records import InferenceRequest, TensorPayload


@pytest.fixture(scope="module")
def digits() -> ModelConfig:
    return ModelRepository().get("digits")


_HALF_PLAN = dataclasses.replace(ModelRepository().get("digits"), request_dtypes=frozenset(
    ALLOWED_DTYPES))._tensor_plans["float16"]


def variants(digits: ModelConfig) -> Iterator[tuple[str, ModelConfig]]:
    every = frozenset(ALLOWED_DTYPES)
    base = dataclasses.replace(digits, request_dtypes=every)
    changes: dict[str, dict[str, Any]] = {
        "digits": {},
        "no-range": {"value_range": None},
        "allow-non-finite": {"allow_non_finite": True},
        "allow-non-finite-no-range": {"allow_non_finite": True, "value_range": None},
        "identity": {"scale": 1.0, "offset": 0.0},
        "identity-no-range": {"scale": 1.0, "offset": 0.0, "value_range": None},
        "offset": {"scale": 0.5, "offset": -3.0},
        "scale-zero": {"scale": 0.0, "value_range": None},
        "scale-huge": {"scale": 1e30, "value_range": None},
        "float16-input": {"input_dtype": np.dtype("float16"), "value_range": None},
        "float16-offset-1e6": {"input_dtype": np.dtype("float16"), "scale": 1.0,
                               "offset": 1e6, "value_range": None},
        "float64-input": {"input_dtype": np.dtype("float64")},
        "negative-range": {"value_range": (-2.5, 2.5)},
    }
    for name, change in changes.items():
        yield name, dataclasses.replace(base, **change)


def tensors(dtype: str) -> Iterator[np.ndarray]:
    dt = np.dtype(dtype)
    ramp = (np.arange(64) % 17).astype(dt).reshape(8, 8)
    yield ramp
    yield np.zeros((8, 8), dt)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        for value in (info.max, info.min, 16, 17, -1 if info.min < 0 else 0, -3):
            t = ramp.copy()
            t[3, 5] = np.array(value).astype(dt)
            yield t
    else:
        info_f = np.finfo(dt)
        for value in (np.nan, np.inf, -np.inf, info_f.max, -info_f.max, 16.0, 16.0001, -0.0,
                      -1e-30, 2.5, -2.5, -2.5001):
            t = ramp.copy()
            with np.errstate(over="ignore"):
                t[3, 5] = dt.type(value)
            yield t
        yield np.full((8, 8), np.nan, dt)
        yield (ramp / 16).astype(dt)


def packed(config: ModelConfig, item: np.ndarray) -> np.ndarray:
    """The row an executor packs ``item`` into (``pack_items``, the shared executor's slot)."""
    row = np.empty(config.item_shape, config.input_dtype)
    put_item(row, item)
    return row


def answer(config: ModelConfig, request: InferenceRequest) -> np.ndarray | tuple[str, str]:
    try:
        return config.preprocess(request)
    except InvalidRequestError as exc:
        return exc.reason, str(exc)


def test_the_quick_path_answers_as_the_full_checks(
    digits: ModelConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    cases = [(name, config, tensor) for name, config in variants(digits)
             for dtype in sorted(ALLOWED_DTYPES) for tensor in tensors(dtype)]
    quick = [answer(config, _request(tensor)) for _, config, tensor in cases]
    monkeypatch.setattr(ModelConfig, "_quick_input", lambda self, plan, data: None)
    full = [answer(config, _request(tensor)) for _, config, tensor in cases]
    taken = 0
    for (name, config, tensor), got, want in zip(cases, quick, full, strict=True):
        what = f"{name}: {tensor.dtype} holding {tensor[3, 5]!r}"
        if isinstance(want, tuple):
            assert got == want, what
            continue
        assert isinstance(got, np.ndarray), what
        if config._tensor_plans[tensor.dtype.name].half_as_is:
            # the request's own float16 bytes: the executor widens them as it packs
            assert got.dtype == np.float16 and not got.flags.writeable, what
            got = packed(config, got)
        assert got.dtype == want.dtype and got.shape == want.shape == config.item_shape, what
        assert got.flags.writeable == want.flags.writeable or tensor.dtype == np.float16, what
        np.testing.assert_array_equal(got, want, err_msg=what, strict=True)
        assert np.array_equal(np.signbit(got), np.signbit(want)), what
        taken += 1
    assert taken > 100


@pytest.mark.parametrize(("dtype", "pixels"), [
    ("uint8", np.arange(64, dtype=np.uint8) % 17),
    ("float32", (np.arange(64, dtype=np.float32) % 17) / 16),
    # a gateway's float16 tensors: checked after the exact cast (ResNet-50 fp16 on the H200)
    ("float16", (np.arange(64, dtype=np.float32) % 17) / 16),
])
def test_the_digits_workloads_take_the_quick_path(
    digits: ModelConfig, dtype: str, pixels: np.ndarray
) -> None:
    config = dataclasses.replace(digits, request_dtypes=frozenset(ALLOWED_DTYPES))
    plan = config._tensor_plans[dtype]
    assert plan.quiet and plan.kind in ("int", "float")
    assert plan.widen == (dtype == "float16")
    quick = config._quick_input(plan, pixels.astype(dtype).tobytes())
    assert quick is not None
    np.testing.assert_array_equal(
        quick, (pixels.astype(np.float32) * np.float32(0.0625)).reshape(1, 8, 8), strict=True)


def test_a_gateways_float16_tensor_reaches_the_executor_as_its_own_bytes(
    digits: ModelConfig,
) -> None:
    # ResNet-50's case: float16 requests, a float32 input, no scale or offset, a value range
    config = dataclasses.replace(digits, request_dtypes=frozenset(ALLOWED_DTYPES), scale=1.0,
                                 offset=0.0, value_range=(-2.12, 2.65))
    values = np.linspace(-2.12, 2.65, 64).astype(np.float16)
    data = values.tobytes()
    item = config.preprocess(_request(values.reshape(8, 8)))
    assert item.dtype == np.float16 and item.shape == (1, 8, 8)
    assert item.tobytes() == data
    np.testing.assert_array_equal(packed(config, item), values.astype(np.float32).reshape(1, 8, 8),
                                  strict=True)
    # one value past the range: the full checks answer, with its index
    values[37] = np.float16(2.66)  # 2.6601..., above 2.65 rounded to float16 (2.6504...)
    with pytest.raises(InvalidRequestError) as raised:
        config.preprocess(_request(values.reshape(8, 8)))
    assert raised.value.reason == "out_of_range" and "[4, 5]" in str(raised.value)


@pytest.mark.parametrize("bounds", [(-2.12, 2.65), (0.5, 3.0), (-3.0, -0.5), (0.0, 0.0),
                                    (-1e-7, 1e-7), (-65504.0, 65504.0), (-1e6, 1e6),
                                    (-np.inf, 3.0), (2.0, np.inf)])
def test_half_within_is_the_float_comparison(bounds: tuple[float, float]) -> None:
    with np.errstate(over="ignore"):  # ±1e6 round to ±inf in float16
        low, high = float(np.float16(bounds[0])), float(np.float16(bounds[1]))
    plan = dataclasses.replace(_HALF_PLAN, half_low=low, half_high=high)
    rng = np.random.default_rng(7)
    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    inside = every[np.isfinite(every) & (every >= low) & (every <= high)]
    arrays = [every, inside, every[:1], every[-1:], np.float16([-0.0, 0.0])]
    arrays += [rng.choice(every, 50) for _ in range(2000)]
    if inside.size:
        arrays += [rng.choice(inside, 50) for _ in range(500)]
        arrays += [np.append(rng.choice(inside, 20), rng.choice(every, 1)) for _ in range(2000)]
    for values in arrays:
        with np.errstate(invalid="ignore"):
            want = bool(np.isfinite(values).all() and (values >= low).all()
                        and (values <= high).all())
        assert _half_within(values, plan) == want, values


@pytest.mark.parametrize(("change", "dtype", "quiet"), [
    ({}, "uint8", True),
    ({}, "int64", True),
    ({}, "float32", True),
    ({}, "float16", True),
    ({}, "float64", False),  # narrowed: 1e300 becomes inf
    ({"scale": 1.0}, "float32", True),
    ({"scale": 2.0}, "float32", False),  # float32's largest doubles to inf
    ({"scale": 0.0}, "float32", False),  # inf * 0 is 'invalid'
    ({"scale": 0.0}, "uint8", True),
    ({"input_dtype": np.dtype("float16")}, "int16", False),  # 32767 > 65504 / 2
    ({"input_dtype": np.dtype("float16")}, "uint8", True),
    ({"input_dtype": np.dtype("float16"), "scale": 1.0, "offset": 1e6}, "uint8", False),
    ({"input_dtype": np.dtype("int32"), "scale": 1.0}, "int32", True),  # the identity
    ({"input_dtype": np.dtype("int32"), "scale": 1.0}, "uint8", False),
])
def test_which_conversions_are_quiet(
    digits: ModelConfig, change: dict[str, Any], dtype: str, quiet: bool
) -> None:
    config = dataclasses.replace(digits, request_dtypes=frozenset([dtype]), **change)
    assert config._tensor_plans[dtype].quiet is quiet


def test_plans_follow_the_config_not_a_copy_of_it(digits: ModelConfig) -> None:
    other = dataclasses.replace(digits, scale=1.0)
    assert digits._tensor_plans["uint8"].scaled and not other._tensor_plans["uint8"].scaled
    assert ModelConfig(**digits.__dict__) == digits  # plans are not fields


def _request(tensor: np.ndarray) -> InferenceRequest:
    little = tensor.astype(tensor.dtype.newbyteorder("<"))
    return InferenceRequest(
        request_id="r", device_id="d", seq=0, ts=1_796_000_000.0, model="digits",
        tensor=TensorPayload(little.dtype.name, tuple(tensor.shape), little.tobytes()),
    )


@pytest.mark.parametrize("out", ["float32", "float64"])
def test_widen_half_is_numpys_cast_bit_for_bit(out: str) -> None:
    # every float16 bit pattern: zeros of both signs, subnormals, ±inf, NaN payloads
    codes = np.arange(1 << 16, dtype=np.uint16).view(np.float16).reshape(256, 256)
    with np.errstate(all="ignore"):
        expected = codes.astype(out)
    got = widen_half(codes, np.dtype(out))
    uint = np.dtype(f"uint{np.dtype(out).itemsize * 8}")
    assert got.dtype == np.dtype(out) and got.shape == (256, 256)
    assert got.flags.c_contiguous and got.flags.writeable
    np.testing.assert_array_equal(got.view(uint), expected.view(uint))
