"""Images as real devices produce them, through the CPU path (Pillow), checked by the label the
digits model predicts or by the dead-letter reason: EXIF orientations 1–8, 16-bit grey and RGB
PNGs, palette with transparency, grey+alpha, RGBA, CMYK JPEG, truncated and corrupt data, and
the pixel limit. The two inputs of issue 11 that were classified wrongly with no error (a 16-bit
PNG of a digit, a JPEG stored rotated with EXIF Orientation 6) are the first two tests."""

from __future__ import annotations

import io
import struct
import warnings
import zlib
from collections.abc import Callable

import numpy as np
import onnxruntime as ort
import pytest
from PIL import Image, ImageOps
from sklearn.datasets import load_digits

from engines.preprocess import EncodedImage, inspect_jpeg
from engines.preprocess.jpeg import ORIENTATION_OPS
from streamapp.exceptions import InvalidRequestError
from streamapp.models import ModelConfig, ModelRepository
from streamapp.models.images import to_declared_mode
from streamapp.records import InferenceRequest

#: Digits checked per kind: the issue's 60.
N = 60

#: Pillow's transpose for each EXIF orientation (what ImageOps.exif_transpose applies) and its
#: inverse, used to store an upright picture the way a rotated camera would.
_TO_DISPLAY = {
    2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_90,
}
_TO_STORED = {**_TO_DISPLAY, 6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270}


@pytest.fixture(scope="module")
def digits() -> ModelConfig:
    return ModelRepository().get("digits")


@pytest.fixture(scope="module")
def bitmaps() -> np.ndarray:
    """The first 60 digits as the 32×32 uint8 bitmaps they could come from (light ink on dark,
    each 8×8 cell a 4×4 block of brightness round(v × 255 / 16))."""
    data = load_digits().images[:N]
    return np.stack([np.kron(np.rint(d * 255 / 16), np.ones((4, 4))) for d in data]).astype(
        np.uint8
    )


@pytest.fixture(scope="module")
def predict(digits: ModelConfig) -> Callable[[bytes], int]:
    """Image bytes → the label the digits model gives them through ``ModelConfig.preprocess``."""
    session = ort.InferenceSession(str(digits.path), providers=["CPUExecutionProvider"])

    def run(image: bytes) -> int:
        request = InferenceRequest("r", "d", 0, 1.7e9, "digits", image=image)
        x = digits.preprocess(request)[None]
        return int(session.run(None, {digits.input_name: x})[0].argmax())

    return run


@pytest.fixture(scope="module")
def upright(bitmaps: np.ndarray, predict: Callable[[bytes], int]) -> list[int]:
    """Labels of the plain 8-bit grey PNGs: what every other kind must give."""
    return [predict(save(Image.fromarray(b, "L"), "PNG")) for b in bitmaps]


def save(image: Image.Image, fmt: str, **options: object) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def png(pixels: np.ndarray) -> bytes:
    """A PNG written by hand (Pillow cannot write 16-bit RGB): grey ``uint16[h, w]`` or RGB
    ``uint16[h, w, 3]`` at 16 bits, big-endian, filter 0 on every row."""
    height, width = pixels.shape[:2]
    colour_type = 2 if pixels.ndim == 3 else 0
    rows = pixels.astype(">u2").reshape(height, -1).tobytes()
    stride = len(rows) // height
    raw = b"".join(b"\x00" + rows[i * stride:(i + 1) * stride] for i in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data)
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 16, colour_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw))
            + chunk(b"IEND", b""))


def rejection(digits: ModelConfig, image: bytes, **kw: int) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        digits.preprocess(InferenceRequest("r", "d", 0, 1.7e9, "digits", image=image), **kw)
    return info.value


def agreement(labels: list[int], expected: list[int]) -> float:
    return float(np.mean(np.asarray(labels) == np.asarray(expected)))


# -- the two inputs -----------------------------------------------------------------------


def test_16_bit_grey_png_gives_the_8_bit_label(
    bitmaps: np.ndarray, predict: Callable[[bytes], int], upright: list[int]
) -> None:
    sixteen = [save(Image.fromarray(b.astype(np.uint16) * 257), "PNG") for b in bitmaps]
    assert Image.open(io.BytesIO(sixteen[0])).mode == "I;16"

    assert [predict(p) for p in sixteen] == upright


def test_exif_orientation_6_jpeg_is_classified_as_displayed(
    bitmaps: np.ndarray, predict: Callable[[bytes], int], upright: list[int]
) -> None:
    plain = [predict(save(Image.fromarray(b, "L"), "JPEG", quality=95)) for b in bitmaps]
    rotated = []
    for b in bitmaps:
        exif = Image.Exif()
        exif[0x0112] = 6
        stored = Image.fromarray(b, "L").transpose(Image.Transpose.ROTATE_90)
        rotated.append(save(stored, "JPEG", quality=95, exif=exif.tobytes()))

    assert [predict(j) for j in rotated] == plain
    assert agreement(plain, upright) >= 0.95  # JPEG artefacts may move a borderline digit


# -- siblings: every orientation, PNG and JPEG -----------------------------------------------------


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_every_exif_orientation(
    bitmaps: np.ndarray, predict: Callable[[bytes], int], upright: list[int],
    orientation: int, fmt: str,
) -> None:
    options: dict[str, object] = {"quality": 95} if fmt == "JPEG" else {}
    expected = upright if fmt == "PNG" else [
        predict(save(Image.fromarray(b, "L"), fmt, **options)) for b in bitmaps
    ]
    labels = []
    for b in bitmaps:
        image = Image.fromarray(b, "L")
        if orientation != 1:
            image = image.transpose(_TO_STORED[orientation])
        exif = Image.Exif()
        exif[0x0112] = orientation
        labels.append(predict(save(image, fmt, exif=exif.tobytes(), **options)))

    assert labels == expected


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orientation_table_of_the_gpu_path_matches_pillow(orientation: int) -> None:
    # The GPU path applies ORIENTATION_OPS with torch; here the same table in numpy.
    stored = np.arange(5 * 3, dtype=np.uint8).reshape(5, 3)
    transpose, flip_v, flip_h = ORIENTATION_OPS[orientation]
    ours = stored.T if transpose else stored
    ours = ours[::-1] if flip_v else ours
    ours = ours[:, ::-1] if flip_h else ours
    image = Image.fromarray(stored, "L")
    image.getexif()[0x0112] = orientation
    image.info["exif"] = image.getexif().tobytes()

    np.testing.assert_array_equal(ours, np.asarray(ImageOps.exif_transpose(image)))


def test_exif_orientation_is_read_from_the_jpeg_header(bitmaps: np.ndarray) -> None:
    exif = Image.Exif()
    exif[0x0112] = 6
    data = save(Image.fromarray(bitmaps[0], "L"), "JPEG", exif=exif.tobytes())

    info = inspect_jpeg(data)

    assert info is not None and info.orientation == 6 and (info.width, info.height) == (32, 32)


# -- siblings: 16-bit, alpha, palette, CMYK --------------------------------------------------------


def test_16_bit_rgb_png(
    bitmaps: np.ndarray, predict: Callable[[bytes], int], upright: list[int]
) -> None:
    frames = [png(np.repeat(b.astype(np.uint16)[..., None] * 257, 3, axis=2)) for b in bitmaps]

    assert [predict(f) for f in frames] == upright


def test_hand_written_16_bit_grey_png(
    bitmaps: np.ndarray, predict: Callable[[bytes], int], upright: list[int]
) -> None:
    assert [predict(png(b.astype(np.uint16) * 257)) for b in bitmaps] == upright


@pytest.mark.parametrize("mode", ["I;16", "I;16B", "I"])
def test_wide_modes_scale_by_1_over_257(mode: str) -> None:
    values = np.array([[0, 257, 32896, 65535]], dtype=np.uint16)  # 0, 1, 128, 255 at 8 bits
    if mode == "I":
        image = Image.fromarray(values.astype(np.int32), "I")
    else:
        image = Image.frombytes(mode, (4, 1), values.astype(
            ">u2" if mode == "I;16B" else "<u2").tobytes())

    converted = to_declared_mode(image, "L")

    assert np.asarray(converted).tolist() == [[0, 1, 128, 255]]  # not clipped to 255


def _garbage_under_alpha(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Grey pixels with a bright colour (200) where the digit has no ink, made transparent:
    read without the alpha channel the background turns bright and the label changes."""
    grey = np.where(b == 0, 200, b).astype(np.uint8)
    alpha = np.where(b == 0, 0, 255).astype(np.uint8)
    return grey, alpha


def test_grey_alpha_png_is_composited_over_the_background(
    bitmaps: np.ndarray, predict: Callable[[bytes], int], upright: list[int]
) -> None:
    frames = []
    for b in bitmaps:
        grey, alpha = _garbage_under_alpha(b)
        frames.append(save(Image.fromarray(np.stack([grey, alpha], axis=2), "LA"), "PNG"))
    assert Image.open(io.BytesIO(frames[0])).mode == "LA"

    assert [predict(f) for f in frames] == upright


def test_rgba_png_is_composited_over_the_background(
    bitmaps: np.ndarray, predict: Callable[[bytes], int], upright: list[int]
) -> None:
    frames = []
    for b in bitmaps:
        grey, alpha = _garbage_under_alpha(b)
        rgba = np.stack([grey, grey, grey, alpha], axis=2)
        frames.append(save(Image.fromarray(rgba, "RGBA"), "PNG"))

    assert [predict(f) for f in frames] == upright


def test_palette_png_with_a_transparent_index(
    bitmaps: np.ndarray, predict: Callable[[bytes], int], upright: list[int]
) -> None:
    frames = []
    for b in bitmaps:
        # Palette entry 0 is white and transparent: the background of every digit.
        image = Image.fromarray(b, "L").convert("P")
        palette = [255, 255, 255] + [v for i in range(1, 256) for v in (i, i, i)]
        indices = np.asarray(b).astype(np.uint8)  # value v → entry v, entry 0 transparent
        image = Image.fromarray(indices, "P")
        image.putpalette(palette)
        frames.append(save(image, "PNG", transparency=0))
    opened = Image.open(io.BytesIO(frames[0]))
    assert opened.mode == "P" and "transparency" in opened.info

    assert [predict(f) for f in frames] == upright


def test_palette_png_without_transparency(
    bitmaps: np.ndarray, predict: Callable[[bytes], int], upright: list[int]
) -> None:
    frames = [save(Image.fromarray(b, "L").convert("P"), "PNG") for b in bitmaps]

    assert [predict(f) for f in frames] == upright


def test_cmyk_jpeg(bitmaps: np.ndarray, predict: Callable[[bytes], int]) -> None:
    rgb = [Image.fromarray(b, "L").convert("RGB") for b in bitmaps]
    expected = [predict(save(im, "JPEG", quality=95)) for im in rgb]
    frames = [save(im.convert("CMYK"), "JPEG", quality=95) for im in rgb]
    assert Image.open(io.BytesIO(frames[0])).mode == "CMYK"

    assert agreement([predict(f) for f in frames], expected) >= 0.95


@pytest.mark.parametrize(("fmt", "mode"), [("PNG", "RGB"), ("JPEG", "RGB"), ("PNG", "1")])
def test_other_colour_modes(
    bitmaps: np.ndarray, predict: Callable[[bytes], int], upright: list[int], fmt: str,
    mode: str,
) -> None:
    options: dict[str, object] = {"quality": 95} if fmt == "JPEG" else {}
    labels = [predict(save(Image.fromarray(b, "L").convert(mode), fmt, **options))
              for b in bitmaps]

    # Bilevel keeps only ink/no ink (Pillow dithers at 128): most digits survive.
    assert agreement(labels, upright) >= (0.7 if mode == "1" else 0.95)


# -- broken data and size limits -------------------------------------------------------------------


@pytest.mark.parametrize("cut", [0.3, 0.5, 0.7])
@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_image_is_undecodable(
    digits: ModelConfig, bitmaps: np.ndarray, fmt: str, cut: float
) -> None:
    data = save(Image.fromarray(bitmaps[0], "L"), fmt)

    assert rejection(digits, data[: int(len(data) * cut)]).reason == "undecodable_image"


def test_corrupt_png_data_is_undecodable(digits: ModelConfig, bitmaps: np.ndarray) -> None:
    data = bytearray(save(Image.fromarray(bitmaps[0], "L"), "PNG"))
    data[60:70] = b"\x00" * 10  # inside the compressed pixels: the CRC fails

    assert rejection(digits, bytes(data)).reason == "undecodable_image"


def test_jpeg_header_with_garbage_scan_is_undecodable(
    digits: ModelConfig, bitmaps: np.ndarray
) -> None:
    data = save(Image.fromarray(bitmaps[0], "L"), "JPEG")
    start = data.index(b"\xff\xda")
    corrupt = data[: start + 20]  # the scan header and nothing after it

    assert rejection(digits, corrupt).reason == "undecodable_image"


def test_worker_pixel_limit_refuses_from_the_header(
    digits: ModelConfig, bitmaps: np.ndarray
) -> None:
    data = save(Image.fromarray(bitmaps[0], "L"), "JPEG")  # 32×32 = 1,024 pixels

    error = rejection(digits, data, max_image_pixels=1000)

    assert error.reason == "image_too_large"
    assert "32×32 = 1024" in error.message and "max_image_pixels" in error.message


def test_bomb_over_pillows_limit_never_warns(
    digits: ModelConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A JPEG header claiming 10,000 × 10,000 pixels, with Pillow's own limit below that: Pillow
    # would warn (or raise) in Image.open; the header check refuses it first.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 50_000_000)
    data = save(Image.new("L", (8, 8)), "JPEG")
    sof = data.index(b"\xff\xc0")
    bomb = data[: sof + 5] + struct.pack(">HH", 10_000, 10_000) + data[sof + 9:]

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        error = rejection(digits, bomb)

    assert error.reason == "image_too_large"
    assert "10000×10000" in error.message


# -- what goes to the GPU -------------------------------------------------------------------------


def _jpeg(mode: str = "RGB", **options: object) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8)
    return save(Image.fromarray(pixels, "RGB").convert(mode), "JPEG", **options)


@pytest.mark.parametrize(("data", "reason"), [
    (_jpeg(), None),
    (_jpeg("L"), None),
    (_jpeg(progressive=True), "progressive JPEG"),  # not yet checked against nvJPEG
    (_jpeg("CMYK"), "4 components (CMYK/YCCK)"),
    (_jpeg()[:-200], "truncated (no end-of-image marker)"),
])
def test_which_jpegs_go_to_nvjpeg(data: bytes, reason: str | None) -> None:
    info = inspect_jpeg(data)

    assert info is not None and (info.width, info.height) == (64, 48)
    assert info.gpu_unsupported == reason


def test_png_and_garbage_are_not_jpegs() -> None:
    assert inspect_jpeg(save(Image.new("L", (4, 4)), "PNG")) is None
    assert inspect_jpeg(b"\xff\xd8\xff\xe0\x00") is None
    assert inspect_jpeg(b"") is None


def test_gpu_frames_are_views_of_the_request_bytes(digits: ModelConfig) -> None:
    data = _jpeg("L")
    assert digits.image is not None

    frame = digits.image.for_gpu(data)
    png_frame = digits.image.for_gpu(save(Image.new("L", (4, 4)), "PNG"))

    assert isinstance(frame, EncodedImage) and frame.info.components == 1
    assert np.shares_memory(frame.data, np.frombuffer(data, dtype=np.uint8))
    assert png_frame is None  # PNG stays on the CPU
    assert digits.image.for_gpu(data, max_image_pixels=100) is None  # the CPU path refuses it


def test_digits_spec_folds_the_models_scale(digits: ModelConfig, bitmaps: np.ndarray) -> None:
    spec = digits.image_spec()
    assert spec is not None and spec.gpu_unsupported is None
    request = InferenceRequest("r", "d", 0, 1.7e9, "digits",
                               image=save(Image.fromarray(bitmaps[0], "L"), "PNG"))
    cpu = digits.preprocess(request)
    boxed = np.asarray(Image.fromarray(bitmaps[0], "L").resize((8, 8), Image.Resampling.BOX),
                       dtype=np.float32)

    # The GPU path computes p * spec.scale + spec.offset: the same numbers as the CPU path.
    np.testing.assert_allclose(boxed * spec.scale + spec.offset, cpu[0], rtol=1e-6)
    assert spec.array_shape == (8, 8) and spec.dtype == "float32" and spec.color == "L"
