"""Image pre-processing declared once, run on the CPU (the worker) or on the GPU (the engine).

:class:`ImageSpec` is the declaration a model's ``metadata.json`` makes (size, resize filter,
colour, layout, scale/offset, mean/std, dtype); ``streamapp.models`` implements it with Pillow on
the CPU and :mod:`engines.preprocess.gpu` with nvJPEG + PyTorch on the GPU. An engine that can
decode frames itself says so through :class:`ImageDecodingEngine`; the pipeline then hands it
:class:`EncodedImage` items (the JPEG bytes) for the frames :func:`inspect_jpeg` finds
GPU-decodable, and arrays for every other frame. Importing this package imports neither torch
nor torchvision.
"""

from __future__ import annotations

from engines.preprocess.base import (
    EncodedImage,
    ImageDecodingEngine,
    ImageSpec,
    StagedBatch,
    stage_encoded,
    supports_gpu_images,
)
from engines.preprocess.jpeg import JpegInfo, inspect_jpeg

__all__ = [
    "EncodedImage",
    "ImageDecodingEngine",
    "ImageSpec",
    "JpegInfo",
    "StagedBatch",
    "inspect_jpeg",
    "stage_encoded",
    "supports_gpu_images",
]
