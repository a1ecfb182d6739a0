"""Image requests through the pipeline: decoded in the decode pool (never on the event loop),
answered in read order with the label the model gives the image, bad images dead-lettered in
their place; and which frames an image-decoding engine would get."""

from __future__ import annotations

import asyncio
import io
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from PIL import Image
from sklearn.datasets import load_digits

from engines.executor import ThreadExecutor
from engines.preprocess import EncodedImage, ImageSpec
from engines.registry import load_engine
from streamapp.agents.pipeline import InferencePipeline, LoadedModel, SourceMessage
from streamapp.codecs import decode_dead_letter, decode_result, encode_request
from streamapp.models import ModelRepository
from streamapp.models.decoding import ImageDecoder
from streamapp.models.images import ImageConfig
from streamapp.records import InferenceRequest
from streamapp.settings import Settings


class Sink:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    async def send(self, topic: str, key: bytes | None, value: bytes) -> asyncio.Future[None]:
        self.sent.append((topic, value))
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


def png_of(digit: np.ndarray) -> bytes:
    bitmap = np.kron(np.rint(digit * 255 / 16), np.ones((4, 4))).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(bitmap.astype(np.uint16) * 257).save(out, "PNG")  # 16-bit, as a camera
    return out.getvalue()


async def test_images_are_decoded_off_the_event_loop_and_answered_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = ModelRepository().get("digits")
    digits = load_digits()
    threads: list[str] = []
    to_array = ImageConfig.to_array

    def recording(self: ImageConfig, data: bytes, max_image_pixels: int | None = None
                  ) -> np.ndarray:
        threads.append(threading.current_thread().name)
        return to_array(self, data, max_image_pixels)

    monkeypatch.setattr(ImageConfig, "to_array", recording)
    engine = load_engine("onnxruntime", config.path, intra_op_threads=1)
    executor = ThreadExecutor(engine)
    sink, acked = Sink(), []
    settings = Settings(max_batch_size=8, max_batch_delay_ms=5.0, topic_prefix="",
                        image_decode_threads=2)
    pipeline = InferencePipeline(settings, {"digits": LoadedModel(config, executor)}, sink,
                                 worker="w")
    await pipeline.start()
    sent: list[tuple[str, int]] = []  # (request_id, expected label or -1 for the bad image)
    loop_thread = threading.current_thread().name
    try:
        for i in range(40):
            device = f"cam-{i % 3}"
            image = png_of(digits.images[i]) if i != 17 else b"\x89PNG\r\n\x1a\n broken"
            request = InferenceRequest(f"r-{i}", device, i // 3, 1.7e9, "digits", image=image)
            message = SourceMessage(device.encode(), encode_request(request), "in", 0, i,
                                    ack=lambda i=i: acked.append(i))
            await pipeline.handle(message)
            sent.append((f"r-{i}", -1 if i == 17 else int(digits.target[i])))
        async with asyncio.timeout(30):
            while len(acked) < 40:
                await asyncio.sleep(0.01)
    finally:
        await pipeline.stop(drain=True)
        await executor.close()
        engine.close()

    outcomes = []
    for topic, value in sink.sent:
        if topic == settings.result_topic:
            result = decode_result(value)
            outcomes.append((result["request_id"], int(result["outputs"]["top_k"][0]["label"])))
        else:
            letter = decode_dead_letter(value)
            assert letter.error["reason"] == "undecodable_image"
            outcomes.append((letter.request_id, -1))
    assert [rid for rid, _ in outcomes] == [rid for rid, _ in sent]  # read order
    correct = sum(got == want for (_, got), (_, want) in zip(outcomes, sent, strict=True))
    assert correct >= 38  # the digits model is 99.5 % right on its data set
    assert acked == list(range(40))
    assert len(threads) == 40
    assert all(name.startswith("image-decode") for name in threads)
    assert loop_thread not in threads


class _DecodingEngine:
    """Stands for an engine that advertises GPU decoding (nothing runs)."""

    def __init__(self) -> None:
        self.specs: dict[str, ImageSpec] = {}

    def configure_images(self, input_name: str, spec: ImageSpec) -> str | None:
        self.specs[input_name] = spec
        return None


def _jpeg(mode: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 10, 10)).convert(mode).save(out, "JPEG")
    return out.getvalue()


@pytest.mark.parametrize(("image", "on_gpu"), [
    (_jpeg("L"), True),
    (_jpeg("RGB"), True),
    (_jpeg("CMYK"), False),
    (_jpeg("RGB")[:-100], False),
])
async def test_only_frames_nvjpeg_decodes_go_to_the_engine(image: bytes, on_gpu: bool) -> None:
    config = ModelRepository().get("digits")
    engine = _DecodingEngine()
    decoder = ImageDecoder(1)
    try:
        assert decoder.use_engine(config, engine) is None
        request = InferenceRequest("r", "d", 0, 1.7e9, "digits", image=image)
        if on_gpu:
            item: Any = await decoder.submit(config, request)
            assert isinstance(item, EncodedImage)
        elif image.endswith(b"\xff\xd9"):
            item = await decoder.submit(config, request)
            assert isinstance(item, np.ndarray) and item.shape == (1, 8, 8)
        else:
            with pytest.raises(Exception, match="cannot be decoded"):
                await decoder.submit(config, request)
    finally:
        decoder.close()
    spec = engine.specs["input"]
    assert (spec.size, spec.color, spec.resize) == ((8, 8), "L", "box")
    assert spec.scale == pytest.approx(1 / 255)  # 16/255 per pixel × the model's 1/16


def test_engines_without_decoding_keep_the_cpu_path() -> None:
    config = ModelRepository().get("digits")
    engine = load_engine("onnxruntime", config.path, intra_op_threads=1)
    decoder = ImageDecoder(1)
    try:
        reason = decoder.use_engine(config, engine)
    finally:
        decoder.close()
        engine.close()
    assert reason is not None and "does not decode images" in reason
    assert not decoder.decodes_on_gpu("digits")


def test_float_tensors_reach_the_engine_without_a_copy() -> None:
    import json

    from streamapp.records import TensorPayload

    meta: dict[str, Any] = json.loads(
        (ModelRepository().root / "digits" / "metadata.json").read_text()
    )
    config = ModelRepository().get("digits")
    identity = type(config)(**{**config.__dict__, "scale": 1.0, "offset": 0.0,
                               "metadata": meta})
    data = (np.arange(64) % 17).astype(np.float32).tobytes()  # the model's range, 0..16
    request = InferenceRequest("r", "d", 0, 1.7e9, "digits",
                               tensor=TensorPayload("float32", (8, 8), data))

    item = identity.preprocess(request)
    scaled: Callable[[InferenceRequest], np.ndarray] = config.preprocess

    assert item.shape == (1, 8, 8)
    assert np.shares_memory(item, np.frombuffer(data, dtype=np.uint8))  # a view, no copy
    assert not np.shares_memory(scaled(request), np.frombuffer(data, dtype=np.uint8))
