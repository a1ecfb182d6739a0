"""``streamapp.client`` as a user's script calls it, against a running worker on both brokers:
``infer`` publishes a frame and returns that request's prediction or dead letter, for many
concurrent requests over one consumer, blocking or async; the README's "publish a JPEG" block
runs as printed."""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from PIL import Image
from typer.testing import CliRunner

from streamapp.cli import cli
from streamapp.client import AsyncClient, Client, collect_outcomes, load_digits_frames
from streamapp.demo import offline_predictions
from streamapp.exceptions import BrokerError, ReplyTimeoutError
from streamapp.kafka import create_topics, with_admin
from streamapp.models import ModelRepository
from streamapp.process import WorkerProcess
from streamapp.records import InferenceRequest
from streamapp.settings import Settings, load_settings
from tests.conftest import Broker

pytestmark = [pytest.mark.kafka]

ROOT = Path(__file__).resolve().parents[2]
#: The worker refuses values above this; the clients of these tests send up to 1 MiB.
WORKER_MAX_REQUEST_BYTES = 16_384


@pytest.fixture
def worker_options() -> dict[str, Any]:
    return {"max_request_bytes": WORKER_MAX_REQUEST_BYTES}


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray]:
    images, _ = load_digits_frames()
    return images, offline_predictions(images)


@pytest.fixture(scope="module")
def image_label() -> Callable[[bytes], str]:
    """PNG/JPEG bytes → the label the digits model gives them (its documented pre-processing)."""
    config = ModelRepository().get("digits")
    session = ort.InferenceSession(str(config.path), providers=["CPUExecutionProvider"])

    def label(image: bytes) -> str:
        x = config.preprocess(InferenceRequest("r", "d", 0, 1.7e9, "digits", image=image))[None]
        return str(int(session.run(None, {config.input_name: x})[0].argmax()))

    return label


def camera_jpeg(digit: np.ndarray) -> bytes:
    """A digit ``uint8[8, 8]`` (0..16) as a 64×64 grey JPEG, light ink on dark."""
    pixels = np.kron(np.rint(digit * 255 / 16), np.ones((8, 8))).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "L").save(out, "JPEG", quality=90)
    return out.getvalue()


def client_settings(worker_settings: Settings) -> Settings:
    """The worker's broker and topics, with a larger request limit than the worker's."""
    return load_settings(broker=worker_settings.broker, topic_prefix=worker_settings.topic_prefix,
                         max_request_bytes=1 << 20)


async def test_concurrent_infers_each_get_their_own_prediction_or_dead_letter(
    worker: WorkerProcess, worker_settings: Settings, digits: tuple[np.ndarray, np.ndarray],
    image_label: Callable[[bytes], str],
) -> None:
    images, offline = digits
    async with AsyncClient(settings=client_settings(worker_settings)) as client:
        tensors = [client.infer(f"cam-{i % 4}", images[i], timeout=60) for i in range(24)]
        jpegs = [camera_jpeg(images[i]) for i in range(24, 32)]
        pictures = [client.infer("door-1", jpeg, timeout=60) for jpeg in jpegs]
        pil = client.infer("door-2", Image.open(io.BytesIO(jpegs[0])), timeout=60)
        bad_shape = client.infer("cam-0", np.zeros(64, np.uint8), timeout=60)
        out_of_range = client.infer("cam-1", np.full((8, 8), 255, np.uint8), timeout=60)
        # too large for the worker (not for this client): a dead letter without a request id,
        # matched by where the request was stored
        too_large = client.infer("cam-2", np.zeros((64, 64), np.float64), timeout=60)
        replies = await asyncio.gather(*tensors, *pictures, pil, bad_shape, out_of_range,
                                       too_large)

    tensor_replies = replies[:24]
    assert [r.label for r in tensor_replies] == [str(offline[i]) for i in range(24)]
    assert all(r.ok and r.result is not None and r.result["model"] == "digits"
               for r in tensor_replies)
    assert [r.label for r in replies[24:32]] == [image_label(j) for j in jpegs]
    assert replies[32].label == image_label(jpegs[0])  # PIL image, sent as PNG
    assert [r.reason for r in replies[33:]] == ["bad_shape", "out_of_range", "too_large"]
    letter = replies[33].dead_letter
    assert letter is not None and letter.request_id == replies[33].request_id
    assert "[8, 8]" in letter.error["message"]
    too_large_letter = replies[35].dead_letter
    assert too_large_letter is not None and too_large_letter.request_id is None
    assert str(WORKER_MAX_REQUEST_BYTES) in too_large_letter.error["message"]
    assert len({r.request_id for r in replies}) == len(replies)


async def test_the_blocking_client_from_threads_with_msgpack_and_a_npy_file(
    worker: WorkerProcess, worker_settings: Settings, digits: tuple[np.ndarray, np.ndarray],
    tmp_path: Path,
) -> None:
    images, offline = digits
    np.save(tmp_path / "frame.npy", images[40].astype(np.float32))

    def blocking() -> list[str | None]:
        with Client(settings=client_settings(worker_settings), codec="msgpack") as client:
            with ThreadPoolExecutor(4) as pool:
                labels = list(pool.map(
                    lambda i: client.infer(f"cam-{i}", images[i], timeout=60).label,
                    range(50, 58)))
            return [*labels, client.infer("cam-9", tmp_path / "frame.npy", timeout=60).label]

    labels = await asyncio.to_thread(blocking)
    assert labels == [str(offline[i]) for i in range(50, 58)] + [str(offline[40])]


async def test_a_deadline_expires_or_answers_and_an_empty_device_id_is_a_bad_device_id(
    worker: WorkerProcess, worker_settings: Settings, digits: tuple[np.ndarray, np.ndarray],
) -> None:
    images, offline = digits
    settings = client_settings(worker_settings)
    async with AsyncClient(settings=settings) as client:
        # 1 µs: older than that before any worker can read it
        expired = await client.infer("cam-dl", images[60], deadline=0.001, timeout=60)
        empty_id = await client.infer("", images[61], timeout=60)

    def blocking() -> Any:
        with Client(settings=settings) as client:
            return client.infer("cam-dl", images[62], deadline=60_000, timeout=60)

    answered = await asyncio.to_thread(blocking)

    assert expired.ok and expired.result is not None
    assert expired.result["outcome"] == "expired" and expired.label is None
    assert expired.result["outputs"] == {} and expired.result["batch_size"] == 0
    assert expired.result["max_age_ms"] == 0.001 and expired.result["max_age_from"] == "request"
    assert answered.ok and answered.result is not None
    assert answered.result["outcome"] == "answered" and answered.label == str(offline[62])
    assert answered.result["max_age_ms"] == 60_000 and answered.result["max_age_from"] == "request"
    assert empty_id.reason == "bad_device_id"
    assert empty_id.dead_letter is not None
    assert empty_id.dead_letter.error["message"] == "field 'device_id' '' is empty"


async def test_no_worker_is_a_timeout_that_says_where_the_request_went(
    kafka_broker: Broker, app_id: str,
) -> None:
    prefix = f"{app_id}-idle."
    settings = load_settings(broker=kafka_broker.url, topic_prefix=prefix, topic_partitions=2)
    create_topics(kafka_broker.bootstrap_servers, {t: 2 for t in settings.topics})
    async with AsyncClient(settings=settings) as client:
        with pytest.raises(ReplyTimeoutError) as raised:
            await client.infer("cam-1", np.zeros((8, 8), np.uint8), timeout=1.5)
        sent = await client.send("cam-1", np.zeros((8, 8), np.uint8))
    error = raised.value
    assert error.timeout_s == 1.5 and re.fullmatch("[0-9a-f]{32}", error.request_id)
    message = str(error)
    assert f"no answer to request {error.request_id} (device 'cam-1', model 'digits')" in message
    assert f"neither {prefix}inference-result nor {prefix}inference-dlq has it" in message
    assert re.search(rf"published to {re.escape(prefix)}inference-request\[[01]\]@0\b", message)
    assert sent.seq == 1 and sent.offset == 1  # the device's second frame, same partition


def readme_block() -> str:
    """The Python block under the README's "Publish a JPEG from Python" heading."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Publish a JPEG from Python", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None
    return match.group(1)


async def test_the_readme_block_prints_the_prediction_of_a_jpeg(
    worker: WorkerProcess, worker_settings: Settings, digits: tuple[np.ndarray, np.ndarray],
    image_label: Callable[[bytes], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    images, _ = digits
    jpeg = camera_jpeg(images[7])
    (tmp_path / "frame.jpg").write_bytes(jpeg)
    code = readme_block()
    assert len(code.strip().splitlines()) <= 10
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("STREAMAPP_TOPIC_PREFIX", worker_settings.topic_prefix)
    code = code.replace("kafka://127.0.0.1:PORT", worker_settings.broker)
    out = io.StringIO()

    def run() -> None:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md", "exec"), {})

    await asyncio.to_thread(run)
    label, score, e2e, unit = out.getvalue().split()
    assert label == image_label(jpeg) and 0 < float(score) <= 1
    assert float(e2e) >= 0 and unit == "ms"


async def test_streamapp_publish_sends_a_directory_and_stdin_that_the_worker_answers(
    kafka_broker: Broker, worker: WorkerProcess, worker_settings: Settings,
    digits: tuple[np.ndarray, np.ndarray], image_label: Callable[[bytes], str], tmp_path: Path,
) -> None:
    images, offline = digits
    folder = tmp_path / "frames"
    folder.mkdir()
    jpeg, png = camera_jpeg(images[3]), camera_jpeg(images[4])
    (folder / "a.jpg").write_bytes(jpeg)
    np.save(folder / "b.npy", images[5])
    Image.open(io.BytesIO(png)).save(folder / "c.PNG")
    (folder / "notes.txt").write_text("not a frame: left out")
    stdin_jpeg = camera_jpeg(images[6])
    s = worker_settings
    common = ["publish", "--broker", s.broker, "--topic-prefix", s.topic_prefix]

    runner = CliRunner()
    dir_run = await asyncio.to_thread(
        runner.invoke, cli, [*common, "--dir", str(folder), "--device", "cam7"])
    stdin_run = await asyncio.to_thread(
        runner.invoke, cli, [*common, "--file", "-", "--device", "cam8", "--codec", "msgpack"],
        input=stdin_jpeg)

    assert dir_run.exit_code == 0, dir_run.output
    assert f"published 3 frames from device cam7 to {s.request_topic}" in dir_run.stdout
    assert stdin_run.exit_code == 0, stdin_run.output
    out = await collect_outcomes(
        kafka_broker.bootstrap_servers, s.result_topic, s.dlq_topic,
        done=lambda o: len(o.results) + len(o.dead_letters) >= 4, timeout_s=60)
    assert out.dead_letters == []
    answers = {(r["device_id"], r["seq"]): r["outputs"]["top_k"][0]["label"] for r in out.results}
    assert answers == {
        ("cam7", 0): image_label(jpeg), ("cam7", 1): str(offline[5]),
        ("cam7", 2): image_label((folder / "c.PNG").read_bytes()),
        ("cam8", 0): image_label(stdin_jpeg),
    }


async def test_before_any_worker_ran_infer_says_to_start_one(
    kafka_broker: Broker, app_id: str,
) -> None:
    prefix = f"{app_id}-none."
    settings = load_settings(broker=kafka_broker.url, topic_prefix=prefix, topic_partitions=2)
    async with AsyncClient(settings=settings) as client:
        sent = await client.send("cam-1", np.zeros((8, 8), np.uint8))  # creates its topic
        with pytest.raises(BrokerError) as raised:
            await client.infer("cam-1", np.zeros((8, 8), np.uint8), timeout=5)
    assert sent.offset == 0
    assert str(raised.value) == (
        f"topic '{prefix}inference-result' does not exist: start a worker (streamapp worker), "
        "which creates it, or check the broker and the topic prefix (STREAMAPP_TOPIC_PREFIX)")
    async def topics(admin: Any) -> set[str]:
        return {t for t in await admin.list_topics() if t.startswith(prefix)}

    assert await with_admin(settings, topics) == {
        f"{prefix}inference-request"}  # nothing auto-created by asking
