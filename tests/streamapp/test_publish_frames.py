"""``streamapp publish --file/--dir`` and ``streamapp.frames`` refuse what cannot become a
request with one error line (exit 1; a bad ``--deadline``: exit 2) before anything is sent, and
turn the rest into the request values the worker reads."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from streamapp.cli import cli
from streamapp.client import frame_requests
from streamapp.codecs import decode_request, encode_request, tensor_to_array
from streamapp.exceptions import FrameError
from streamapp.frames import frame_input, make_request

#: Nothing listens here: a command that got as far as connecting would say so instead.
NOWHERE = "kafka://127.0.0.1:1"


def jpeg(size: tuple[int, int] = (16, 16)) -> bytes:
    out = io.BytesIO()
    Image.new("L", size, 200).save(out, "JPEG")
    return out.getvalue()


def publish(runner: CliRunner, *args: str, stdin: bytes | None = None) -> list[str]:
    """Run ``streamapp publish`` and return its output lines; it must exit 1."""
    result = runner.invoke(cli, ["publish", "--broker", NOWHERE, *args], input=stdin,
                           prog_name="streamapp")
    assert result.exit_code == 1, result.output
    return result.output.splitlines()


def test_a_file_that_is_no_frame_is_one_line(runner: CliRunner, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    assert publish(runner, "--file", str(notes)) == [
        f"error: {notes} is neither a PNG, a JPEG nor a .npy array (it starts with "
        "68 65 6c 6c 6f)"]


def test_a_missing_file_is_one_line(runner: CliRunner, tmp_path: Path) -> None:
    assert publish(runner, "--file", str(tmp_path / "gone.jpg")) == [
        f"error: cannot read {tmp_path / 'gone.jpg'}: No such file or directory"]


def test_a_directory_without_frames_and_a_missing_one(runner: CliRunner, tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x")
    assert publish(runner, "--dir", str(tmp_path)) == [
        f"error: {tmp_path} holds no frame files (.jpg, .jpeg, .png, .npy) among its 1 files"]
    assert publish(runner, "--dir", str(tmp_path / "nope")) == [
        f"error: cannot list {tmp_path / 'nope'}: No such file or directory"]


def test_a_bad_file_in_a_directory_stops_before_anything_is_sent(
    runner: CliRunner, tmp_path: Path,
) -> None:
    (tmp_path / "a.jpg").write_bytes(jpeg())
    (tmp_path / "b.jpg").write_bytes(b"GIF89a...")  # named .jpg, is not one
    assert publish(runner, "--dir", str(tmp_path)) == [
        f"error: {tmp_path / 'b.jpg'} is neither a PNG, a JPEG nor a .npy array (it starts with "
        "47 49 46 38 39 61 2e 2e)"]


def test_npy_files_that_no_request_can_carry(runner: CliRunner, tmp_path: Path) -> None:
    pickled, flags, cut = tmp_path / "o.npy", tmp_path / "b.npy", tmp_path / "cut.npy"
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.save(flags, np.zeros((8, 8), dtype=bool))
    np.save(cut, np.zeros((8, 8), np.float32))
    cut.write_bytes(cut.read_bytes()[:-10])

    (line,) = publish(runner, "--file", str(pickled))
    assert line.startswith(f"error: {pickled} is not a readable .npy array (")
    assert line.endswith("); save it with numpy.save, without object dtypes")
    assert publish(runner, "--file", str(flags)) == [
        f"error: {flags} has dtype bool; a request tensor is one of float16, float32, float64, "
        "int16, int32, int64, int8, uint16, uint8 (convert it with .astype(...))"]
    (line,) = publish(runner, "--file", str(cut))
    assert line.startswith(f"error: {cut} is not a readable .npy array (")


def test_stdin_that_is_no_frame_and_stdin_twice(runner: CliRunner) -> None:
    assert publish(runner, "--file", "-", stdin=b"") == [
        "error: stdin is neither a PNG, a JPEG nor a .npy array (it starts with nothing)"]
    result = runner.invoke(cli, ["publish", "--file", "-", "--file", "-"], prog_name="streamapp")
    assert result.exit_code == 2
    assert result.output.splitlines() == ["error: --file - (stdin) can be given once"]


def test_a_frame_larger_than_max_request_bytes(runner: CliRunner, tmp_path: Path) -> None:
    big = tmp_path / "big.npy"
    np.save(big, np.zeros((64, 64), np.float32))  # 16 KiB of data, 21.9 KB as base64 JSON
    result = runner.invoke(cli, ["publish", "--broker", NOWHERE, "--file", str(big), "--device",
                                 "cam1"], env={"STREAMAPP_MAX_REQUEST_BYTES": "16384"},
                           prog_name="streamapp")
    assert result.exit_code == 1
    (line,) = result.output.splitlines()
    assert line.startswith(f"error: the request for device 'cam1' ({big}) is 21,")
    assert line.endswith("bytes as json, more than max_request_bytes=16,384 that the worker "
                         "accepts (STREAMAPP_MAX_REQUEST_BYTES): send a smaller frame (a smaller "
                         "tensor or dtype, or the image it came from as a JPEG), or msgpack "
                         "instead of json (no base64)")


@pytest.mark.parametrize(("value", "shown"), [
    ("0", "0.0"), ("-5", "-5.0"), ("nan", "nan"), ("inf", "inf"), ("86400001", "86400001.0"),
    ("1e400", "inf"),
])
def test_a_deadline_the_worker_would_dead_letter_is_one_usage_line(
    runner: CliRunner, value: str, shown: str,
) -> None:
    result = runner.invoke(cli, ["publish", "--broker", NOWHERE, f"--deadline={value}"],
                           prog_name="streamapp")
    assert result.exit_code == 2
    assert result.output.splitlines() == [
        f"error: --deadline is {shown}; it is how old the request may be when its batch would "
        "start, in milliseconds: a number above 0 and at most 86400000 (one day), or leave it "
        "out for the model's policy"]


def test_a_good_deadline_gets_as_far_as_the_broker(runner: CliRunner, tmp_path: Path) -> None:
    (tmp_path / "a.jpg").write_bytes(jpeg())
    (line,) = publish(runner, "--file", str(tmp_path / "a.jpg"), "--deadline", "86400000")
    assert line.startswith("error: cannot talk to the broker at 127.0.0.1:1")


def test_a_good_file_gets_as_far_as_the_broker(runner: CliRunner, tmp_path: Path) -> None:
    (tmp_path / "a.jpg").write_bytes(jpeg())
    (line,) = publish(runner, "--file", str(tmp_path / "a.jpg"))
    assert line.startswith("error: cannot talk to the broker at 127.0.0.1:1")


# -- streamapp.frames ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["uint8", ">f4", "<i2", "float64"])
def test_an_array_becomes_the_tensor_the_worker_decodes(dtype: str) -> None:
    array = (np.arange(24).reshape(2, 3, 4) % 17).astype(dtype)[:, ::-1]  # not C-contiguous
    request = make_request("cam1", array, model="digits", seq=3, ts=1.8e9)
    decoded = decode_request(encode_request(request), now=1.8e9)

    assert decoded.tensor is not None
    got = tensor_to_array(decoded.tensor)
    assert got.dtype == np.dtype(dtype).newbyteorder("=") and got.shape == (2, 3, 4)
    np.testing.assert_array_equal(got, array)
    assert (decoded.device_id, decoded.seq, decoded.ts) == ("cam1", 3, 1.8e9)


@pytest.mark.parametrize("deadline", [5000, 0.001, 86_400_000.0])
def test_a_deadline_is_carried_as_float_milliseconds(deadline: float) -> None:
    request = make_request("cam1", np.zeros((8, 8), np.uint8), model="digits", seq=0, ts=1.8e9,
                           deadline=deadline)
    decoded = decode_request(encode_request(request, "msgpack"), now=1.8e9)

    assert decoded.deadline == float(deadline) and isinstance(decoded.deadline, float)
    no_deadline = make_request("cam1", np.zeros((8, 8), np.uint8), model="digits", seq=0)
    assert b"deadline" not in encode_request(no_deadline)


@pytest.mark.parametrize(("deadline", "message"), [
    (0, "deadline is 0; it is how old the request may be when its batch would start, in "
     "milliseconds: a number above 0 and at most 86400000 (one day), or None for the model's "
     "policy"),
    (-1.5, "deadline is -1.5; it is how old"),
    (float("nan"), "deadline is nan; it is how old"),
    (float("inf"), "deadline is inf; it is how old"),
    (86_400_000.5, "deadline is 86400000.5; it is how old"),
    ("5000", "deadline is str, expected a number of milliseconds (or None for none)"),
    (True, "deadline is bool, expected a number of milliseconds (or None for none)"),
])
def test_a_deadline_the_worker_would_dead_letter_is_refused_before_sending(
    deadline: object, message: str,
) -> None:
    with pytest.raises(FrameError) as raised:
        make_request("cam1", np.zeros((8, 8), np.uint8), model="digits", seq=0,
                     deadline=deadline)  # type: ignore[arg-type]
    assert str(raised.value).startswith(message)
    with pytest.raises(FrameError):
        frame_requests([jpeg()], device_ids=["cam1"], model="digits",
                       deadline=deadline)  # type: ignore[arg-type]


def test_images_as_bytes_path_and_pil() -> None:
    data = jpeg()
    assert frame_input(data) == data
    assert frame_input(bytearray(data)) == data
    with Image.open(io.BytesIO(data)) as image:
        png = frame_input(image)
    assert isinstance(png, bytes) and png.startswith(b"\x89PNG")
    with Image.open(io.BytesIO(png)) as back:
        assert back.mode == "L" and back.size == (16, 16) and back.getpixel((3, 3)) == 200
    cmyk = frame_input(Image.new("CMYK", (4, 4)))
    assert isinstance(cmyk, bytes)
    with Image.open(io.BytesIO(cmyk)) as back:
        assert back.mode == "RGB"


@pytest.mark.parametrize(("frame", "message"), [
    (b"GIF89a", "the frame's bytes is not a PNG or JPEG (it starts with 47 49 46 38 39 61); "
     "send PNG/JPEG bytes, or a numpy array as a tensor"),
    (np.zeros(3, np.complex64), "the array of shape [3] has dtype complex64; a request tensor "
     "is one of float16, float32, float64, int16, int32, int64, int8, uint16, uint8 (convert it "
     "with .astype(...))"),
    (np.zeros((1,) * 9, np.uint8), "the array of shape [1, 1, 1, 1, 1, 1, 1, 1, 1] has 9 "
     "dimensions; a request tensor has at most 8"),
    ([1, 2, 3], "a frame is a numpy array, PNG/JPEG bytes, a file path or a PIL image; got "
     "list [1, 2, 3]"),
])
def test_frames_that_cannot_become_requests(frame: object, message: str) -> None:
    with pytest.raises(FrameError) as raised:
        frame_input(frame)  # type: ignore[arg-type]
    assert str(raised.value) == message


@pytest.mark.parametrize(("value", "why"), [
    ("", "is empty"),
    ("cam\t1", "holds U+0009 (a control character) at index 3"),
])
def test_a_device_id_the_worker_would_dead_letter_is_one_usage_line(
    runner: CliRunner, value: str, why: str,
) -> None:
    """An empty --device used to send every frame as device-00 without a word (a new-user
    trial, 2026-12-03)."""
    result = runner.invoke(cli, ["publish", "--broker", NOWHERE, "--device", value],
                           prog_name="streamapp")
    assert result.exit_code == 2
    (line,) = result.output.splitlines()
    assert line.startswith(f"error: --device {value!r}: {why}")


def test_a_good_device_id_gets_as_far_as_the_broker(runner: CliRunner) -> None:
    (line,) = publish(runner, "--device", "cam 1", "--count", "1")
    assert line.startswith("error: cannot talk to the broker at 127.0.0.1:1")
