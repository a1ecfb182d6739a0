"""Image requests are decoded off the event loop: a bounded thread pool, or the GPU.

The event loop only starts the work (:meth:`ImageDecoder.submit` returns an asyncio future at
once) and the batch that holds the request awaits it, so decoding overlaps with reading the
next records and with the batches in flight, while the order of results is still the order of
reading (the batcher emits in submission order whatever finishes first). In each task, for a
model whose engine decodes JPEGs itself (:class:`~engines.preprocess.ImageDecodingEngine`),
only the frame's header is read and the bytes go to the engine; every other image is decoded
and pre-processed with Pillow (:mod:`streamapp.models.images`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os

import numpy as np

from engines.preprocess import EncodedImage, ImageDecodingEngine
from streamapp.models.repository import ModelConfig
from streamapp.records import InferenceRequest

__all__ = ["ImageDecoder", "configure_engine_images", "default_decode_threads"]

log = logging.getLogger(__name__)


def default_decode_threads() -> int:
    """One thread per CPU core this process may use, at most 8.

    Pillow decodes and resizes a 640×480 JPEG to 224×224 at 278 images/s on one core of the
    H200 host, and at only 597 images/s with 16 threads (``scripts/gpu_image_ceiling.py``,
    2026-11-30): the parts that hold the GIL limit scaling, so more threads buy little; more
    worker processes, or the GPU path, do."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


def configure_engine_images(config: ModelConfig, engine: object) -> str | None:
    """Let ``engine`` decode ``config``'s JPEG frames when it can (what the worker does, and
    the executor server for the engines it serves).

    Returns:
        None when the engine decodes them from now on; else why not.
    """
    if config.image is None:
        return "the model takes no images"
    if not isinstance(engine, ImageDecodingEngine):
        return f"the {type(engine).__name__} engine does not decode images"
    spec = config.image_spec()
    if spec is None:
        return "the image declaration cannot be folded into one GPU pre-processing step"
    return engine.configure_images(config.input_name, spec)


class ImageDecoder:
    """Decodes image requests in a bounded thread pool, or hands JPEG frames to the engine.

    Args:
        threads: Pool size (``Settings.image_decode_threads``; 0: :func:`default_decode_threads`).
        max_image_pixels: The worker's pixel limit (``Settings.max_image_pixels``).
    """

    def __init__(self, threads: int = 0, *, max_image_pixels: int | None = None) -> None:
        self.threads = threads or default_decode_threads()
        self.max_image_pixels = max_image_pixels
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.threads, thread_name_prefix="image-decode"
        )
        self._gpu: set[str] = set()

    def use_engine(self, config: ModelConfig, engine: object) -> str | None:
        """Let ``engine`` decode this model's JPEG frames when it can.

        Returns:
            None when the engine decodes them from now on; else why not (the frames are then
            decoded on the CPU).
        """
        reason = configure_engine_images(config, engine)
        if reason is None:
            self._gpu.add(config.name)
        return reason

    def decodes_on_gpu(self, model: str) -> bool:
        return model in self._gpu

    def submit(
        self, config: ModelConfig, request: InferenceRequest
    ) -> asyncio.Future[np.ndarray | EncodedImage]:
        """Start pre-processing an image request; the future gives the engine input item
        (``input_dtype[*item_shape]``) or the frame for the engine, or raises
        :class:`~streamapp.exceptions.InvalidRequestError` (``undecodable_image``,
        ``image_too_large``, ...). Never decodes in the calling (event-loop) thread."""
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._pool, self._prepare, config, request,
                                    config.name in self._gpu)

    def _prepare(
        self, config: ModelConfig, request: InferenceRequest, gpu: bool
    ) -> np.ndarray | EncodedImage:
        if gpu:
            frame = config.encoded_image(request, self.max_image_pixels)
            if frame is not None:
                return frame
        return config.preprocess(request, self.max_image_pixels)

    def close(self) -> None:
        """Finish queued work and stop the threads."""
        self._pool.shutdown(wait=True, cancel_futures=False)
