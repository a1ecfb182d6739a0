"""Model inputs beyond plain tensors: PNG/JPEG images decoded per the model's ``image`` config
(real digits rendered as images must give the tensor's prediction), decompression bombs refused
from the header, and NaN/Inf refused where the model forbids them."""

from __future__ import annotations

import io
import json
import struct
import time
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from PIL import Image
from sklearn.datasets import load_digits

from streamapp.exceptions import ConfigError, InvalidRequestError
from streamapp.models import BUNDLED_MODELS_DIR, ModelConfig, ModelRepository
from streamapp.models.repository import ImageConfig
from streamapp.records import InferenceRequest, TensorPayload


@pytest.fixture(scope="module")
def digits() -> ModelConfig:
    return ModelRepository().get("digits")


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    """``float64[1797, 8, 8]``, values 0..16."""
    data: np.ndarray = load_digits().images
    return data


def request_for(array: np.ndarray | None = None, image: bytes | None = None) -> InferenceRequest:
    tensor = None
    if array is not None:
        tensor = TensorPayload(str(array.dtype), tuple(array.shape), array.tobytes())
    return InferenceRequest("r-1", "dev-1", 0, 1.7e9, "digits", tensor=tensor, image=image)


def encode_image(pixels: np.ndarray, fmt: str = "PNG", mode: str = "L", **save: object) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).convert(mode).save(out, format=fmt, **save)
    return out.getvalue()


def digit_as_32x32(digit: np.ndarray) -> np.ndarray:
    """A 0..16 digit as the 32×32 uint8 bitmap it could have come from: each cell a 4×4 block
    of brightness ``round(v × 255 / 16)``."""
    return np.kron(np.rint(digit * 255 / 16), np.ones((4, 4))).astype(np.uint8)


def rejection(model: ModelConfig, request: InferenceRequest) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        model.preprocess(request)
    return info.value


def png_header(width: int, height: int) -> bytes:
    """A PNG (8-bit grayscale) claiming ``width``×``height`` with no pixel data: signature, IHDR,
    IEND."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data)
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


# -- the digits model's image contract ------------------------------------------------------------


def test_digits_declares_image_input(digits: ModelConfig) -> None:
    assert digits.image == ImageConfig(
        mode="L", size=(8, 8), scale=16 / 255, offset=0.0, resample="box",
        formats=("PNG", "JPEG"), max_pixels=4_194_304,
    )
    assert digits.image.array_shape == digits.request_shape == (8, 8)
    assert digits.allow_non_finite is False


def test_png_of_a_real_digit_gives_its_tensor_input(
    digits: ModelConfig, images: np.ndarray
) -> None:
    digit = images[0]

    from_image = digits.preprocess(request_for(image=encode_image(digit_as_32x32(digit))))
    from_tensor = digits.preprocess(request_for(digit.astype(np.float32)))

    assert from_image.dtype == np.float32 and from_image.shape == (1, 8, 8)
    # 16 identical pixels per cell average to the cell; only the 8-bit rounding differs.
    np.testing.assert_allclose(from_image, from_tensor, atol=0.5 / 255)


def test_8x8_png_is_used_without_resizing(digits: ModelConfig, images: np.ndarray) -> None:
    digit = images[5]
    pixels = np.rint(digit * 255 / 16)

    array = digits.preprocess(request_for(image=encode_image(pixels)))

    np.testing.assert_allclose(array[0], pixels * (16 / 255) / 16, rtol=1e-6)


@pytest.mark.parametrize(
    ("fmt", "mode", "min_agreement"),
    [("PNG", "L", 1.0), ("PNG", "RGB", 1.0), ("PNG", "RGBA", 1.0), ("JPEG", "L", 0.97)],
)
def test_digit_images_are_classified_like_their_tensors(
    digits: ModelConfig, images: np.ndarray, fmt: str, mode: str, min_agreement: float
) -> None:
    session = ort.InferenceSession(str(digits.path), providers=["CPUExecutionProvider"])
    subset = images[:200]
    tensors = np.stack([digits.preprocess(request_for(d.astype(np.float32))) for d in subset])
    pictures = np.stack(
        [
            digits.preprocess(request_for(image=encode_image(digit_as_32x32(d), fmt, mode)))
            for d in subset
        ]
    )

    from_tensors = session.run(None, {digits.input_name: tensors})[0].argmax(axis=1)
    from_images = session.run(None, {digits.input_name: pictures})[0].argmax(axis=1)

    assert np.mean(from_images == from_tensors) >= min_agreement


def test_tensor_wins_when_both_are_given(digits: ModelConfig, images: np.ndarray) -> None:
    digit = images[3].astype(np.float32)
    request = request_for(digit, image=b"not an image")

    np.testing.assert_array_equal(digits.preprocess(request)[0], digit / 16)


# -- undecodable images ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "named"),
    [
        (b"", "PNG or JPEG"),
        (b"\x89PNG\r\n\x1a\n", "PNG or JPEG"),
        (b"GIF89a" + bytes(64), "PNG or JPEG"),
        (bytes(range(256)) * 4, "PNG or JPEG"),
        (png_header(8, 8), "PNG or JPEG"),  # a header and no pixel data
        (b"\xff\xd8\xff\xe0" + bytes(100), "PNG or JPEG"),  # JPEG marker, garbage after it
    ],
    ids=["empty", "png-signature-only", "gif-header", "noise", "png-without-data", "jpeg-garbage"],
)
def test_undecodable_image(digits: ModelConfig, data: bytes, named: str) -> None:
    error = rejection(digits, request_for(image=data))

    assert error.reason == "undecodable_image"
    assert named in error.message
    assert "BytesIO" not in error.message


def test_truncated_png(digits: ModelConfig, images: np.ndarray) -> None:
    png = encode_image(digit_as_32x32(images[0]))

    error = rejection(digits, request_for(image=png[: len(png) // 2]))

    assert error.reason == "undecodable_image"


@pytest.mark.parametrize("fmt", ["GIF", "BMP", "TIFF", "WEBP"])
def test_formats_the_model_does_not_accept(
    digits: ModelConfig, images: np.ndarray, fmt: str
) -> None:
    data = encode_image(digit_as_32x32(images[0]), fmt)
    assert Image.open(io.BytesIO(data)).format == fmt  # a real image, just not PNG/JPEG

    error = rejection(digits, request_for(image=data))

    assert error.reason == "undecodable_image"
    assert "PNG or JPEG" in error.message


# -- decompression bombs ---------------------------------------------------------------------------


def test_image_over_max_pixels_is_refused_from_its_header(digits: ModelConfig) -> None:
    # A real, valid 4000×4000 PNG (16 M pixels > 4,194,304) that compresses to a few KB.
    data = encode_image(np.zeros((4000, 4000), dtype=np.uint8))
    assert len(data) < 64_000
    tracemalloc.start()
    try:
        started = time.perf_counter()
        error = rejection(digits, request_for(image=data))
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert error.reason == "image_too_large"
    assert "4000×4000" in error.message and "4194304" in error.message
    assert peak < 1 << 20  # the 16 MB of pixels were never decoded
    assert elapsed < 0.5


def test_header_claiming_a_huge_image_is_too_large_not_undecodable(digits: ModelConfig) -> None:
    # No pixel data at all: decoding would fail, so too_large proves the header came first.
    error = rejection(digits, request_for(image=png_header(3000, 3000)))

    assert error.reason == "image_too_large"


def test_pillow_decompression_bomb_guard_applies(digits: ModelConfig) -> None:
    # 100,000² pixels: over 2 × Image.MAX_IMAGE_PIXELS, where Pillow itself raises.
    error = rejection(digits, request_for(image=png_header(100_000, 100_000)))

    assert error.reason == "image_too_large"


def test_image_max_pixels_is_capped_by_pillows_limit(
    digits: ModelConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 32 * 32)
    ok = encode_image(np.zeros((32, 32), dtype=np.uint8))
    big = encode_image(np.zeros((32, 33), dtype=np.uint8))

    assert digits.preprocess(request_for(image=ok)).shape == (1, 8, 8)
    assert rejection(digits, request_for(image=big)).reason == "image_too_large"


# -- NaN and infinity -----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [(0, 0), (7, 7), (3, 5)])
def test_non_finite_tensor_is_refused(
    digits: ModelConfig, images: np.ndarray, bad: float, where: tuple[int, int]
) -> None:
    digit = images[0].astype(np.float32)
    digit[where] = bad

    error = rejection(digits, request_for(digit))

    assert error.reason == "non_finite"
    assert f"index {list(where)}" in error.message
    assert "1 NaN/infinite" in error.message


def test_non_finite_counts_every_bad_value(digits: ModelConfig) -> None:
    digit = np.full((8, 8), np.nan, dtype=np.float32)

    assert "64 NaN/infinite" in rejection(digits, request_for(digit)).message


def _model_with(tmp_path: Path, **request: object) -> ModelConfig:
    meta = json.loads((BUNDLED_MODELS_DIR / "digits" / "metadata.json").read_text())
    meta["request"].update(request)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "metadata.json").write_text(json.dumps(meta))
    return ModelRepository(tmp_path).get("m")


def test_non_finite_allowed_when_the_model_says_so(tmp_path: Path) -> None:
    model = _model_with(tmp_path, allow_non_finite=True)
    digit = np.zeros((8, 8), dtype=np.float32)
    digit[1, 2] = np.inf

    array = model.preprocess(request_for(digit))

    assert array[0, 1, 2] == np.inf and np.isfinite(np.delete(array.ravel(), 10)).all()


def test_values_that_overflow_the_engine_dtype_are_non_finite(tmp_path: Path) -> None:
    model = _model_with(tmp_path, dtypes=["float64"], value_range=None)  # no range to check
    digit = np.zeros((8, 8), dtype=np.float64)
    digit[0, 0] = 1e300  # finite in float64, inf in the engine's float32

    error = rejection(model, request_for(digit))

    assert error.reason == "non_finite"
    assert "overflow" in error.message


def test_integer_tensors_are_never_non_finite(tmp_path: Path) -> None:
    model = _model_with(tmp_path, value_range=None)
    array = model.preprocess(request_for(np.full((8, 8), 255, dtype=np.uint8)))

    assert np.isfinite(array).all()


# -- request.value_range ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "value", "shown"),
    [("uint8", 255, "255"), ("float32", 255.0, "255.0"), ("float32", -0.5, "-0.5"),
     ("float32", 16.001, "16.00")],
)
def test_values_outside_the_declared_range_are_out_of_range(
    digits: ModelConfig, dtype: str, value: float, shown: str
) -> None:
    digit = np.full((8, 8), 3, dtype=dtype)
    digit[2, 5] = value  # raw 0-255 pixels are the common mistake
    digit[7, 7] = value

    error = rejection(digits, request_for(digit))

    assert error.reason == "out_of_range"
    assert "takes values from 0 to 16" in error.message
    assert "2 value(s) outside it" in error.message and f"first {shown}" in error.message
    assert "at index [2, 5]" in error.message


@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_values_at_the_bounds_of_the_range_are_taken(digits: ModelConfig, dtype: str) -> None:
    digit = np.zeros((8, 8), dtype=dtype)
    digit[0, :] = 16

    array = digits.preprocess(request_for(digit))

    assert array[0, 0, 0] == 1.0 and array[0, 1, 0] == 0.0  # x / 16


def test_the_bundled_models_declare_their_value_range() -> None:
    assert ModelRepository().get("digits").value_range == (0.0, 16.0)


@pytest.mark.parametrize("value", [[16, 0], [0], [0, "16"], [0, float("inf")], "0-16", [True, 1]])
def test_a_bad_value_range_is_a_config_error(tmp_path: Path, value: object) -> None:
    with pytest.raises(ConfigError, match="value_range"):
        _model_with(tmp_path, value_range=value)


@pytest.mark.parametrize("value", ["false", 0, None])
def test_allow_non_finite_must_be_a_boolean(tmp_path: Path, value: object) -> None:
    with pytest.raises(ConfigError, match="allow_non_finite"):
        _model_with(tmp_path, allow_non_finite=value)


# -- image config validation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("image", "named"),
    [
        ({"mode": "L", "size": [8, 4]}, "request.shape"),
        ({"mode": "RGB", "size": [8, 8]}, "[8, 8, 3]"),
        ({"mode": "L", "size": [8, 8], "resample": "sharpest"}, "SHARPEST"),
        ({"mode": "XYZ", "size": [8, 8]}, "XYZ"),
        ({"mode": "L"}, "size"),
        ({"mode": "L", "size": [8, 8], "max_pixels": 10}, "max_pixels"),
    ],
    ids=["size", "bands", "resample", "mode", "no-size", "max-pixels"],
)
def test_invalid_image_config(tmp_path: Path, image: dict[str, object], named: str) -> None:
    meta = json.loads((BUNDLED_MODELS_DIR / "digits" / "metadata.json").read_text())
    meta["image"] = image
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "metadata.json").write_text(json.dumps(meta))

    with pytest.raises(ConfigError, match=named.replace("[", r"\[")):
        ModelRepository(tmp_path).get("m")
