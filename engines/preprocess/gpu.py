"""The GPU implementation of :class:`~engines.preprocess.ImageSpec`: nvJPEG + PyTorch.

A batch's JPEG frames are decoded together by ``torchvision.io.decode_jpeg(list_of_frames,
device="cuda")`` (nvJPEG's batched decode) on the caller's current CUDA stream, then, per group
of frames of one size: EXIF orientation (transpose/flips), resize with ``interpolate``
(antialiased like Pillow), rounding to 0..255 like Pillow's 8-bit resize output,
``p * scale + offset``, ``(· - mean) / std``, channel order and layout, and a cast into the
engine's input rows — the decoded pixels never leave the GPU.

Used by the ``torch`` backend's stream contexts; any CUDA engine with PyTorch and torchvision
installed can use it the same way (wrap its input buffer as a tensor and call
:meth:`GpuImageWriter.write` on its stream) — TensorRT does not yet (see docs/images.md).
Imports torch and torchvision; import it only where they are installed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from engines.exceptions import InputSpecError
from engines.preprocess.base import GPU_RESIZE, EncodedImage, ImageSpec
from engines.preprocess.jpeg import ORIENTATION_OPS

__all__ = ["GpuImageWriter", "ImageDecodeError", "gpu_decoding_unavailable"]


class ImageDecodeError(InputSpecError):
    """nvJPEG could not decode a frame of the batch (corrupt data behind a valid header).

    Not retriable; the pipeline's bisection isolates the frame.
    """

    reason = "undecodable_image"


def gpu_decoding_unavailable() -> str | None:
    """Why GPU JPEG decoding cannot run here (no torchvision, or one without CUDA decoding), or
    None when it can."""
    try:
        import torch
        import torchvision.io
    except ImportError as exc:
        return f"torchvision is not installed ({exc})"
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA device"
    if not hasattr(torchvision.io, "decode_jpeg"):
        return "this torchvision has no decode_jpeg"
    return None


class GpuImageWriter:
    """Decodes and pre-processes JPEG frames on one CUDA device per an :class:`ImageSpec`.

    Args:
        spec: The model's declaration.
        device: A ``torch.device`` (CUDA).

    Raises:
        InputSpecError: The declaration has no GPU implementation
            (:attr:`ImageSpec.gpu_unsupported`).
    """

    def __init__(self, spec: ImageSpec, device: Any) -> None:
        import torch
        from torchvision.io import ImageReadMode

        reason = spec.gpu_unsupported
        if reason is not None:
            raise InputSpecError(reason)
        self.spec = spec
        self.device = device
        self._mode = ImageReadMode.GRAY if spec.channels == 1 else ImageReadMode.RGB
        self._resize = GPU_RESIZE[spec.resize]
        width, height = spec.size
        self._hw = (height, width)
        shape = (spec.channels, 1, 1)
        self._scale = float(spec.scale)
        self._offset = float(spec.offset)
        self._mean = (
            torch.tensor(spec.mean, dtype=torch.float32, device=device).reshape(shape)
            if spec.mean is not None else None
        )
        self._std = (
            torch.tensor(spec.std, dtype=torch.float32, device=device).reshape(shape)
            if spec.std is not None else None
        )

    def decode(self, frames: Sequence[EncodedImage]) -> list[Any]:
        """nvJPEG-decode frames on the current stream: ``uint8[channels, height, width]`` each
        (stored orientation).

        Raises:
            ImageDecodeError: nvJPEG failed on a frame (each frame is retried alone to name it).
        """
        import torch
        from torchvision.io import decode_jpeg

        # decode_jpeg wants writable CPU tensors; the copy is of the compressed bytes only.
        datas = [torch.from_numpy(np.array(f.data)) for f in frames]
        try:
            return list(decode_jpeg(datas, mode=self._mode, device=self.device))
        except RuntimeError:
            out = []
            for i, data in enumerate(datas):
                try:
                    out.append(decode_jpeg(data, mode=self._mode, device=self.device))
                except RuntimeError as exc:
                    raise ImageDecodeError(
                        f"nvJPEG cannot decode frame {i} of the batch "
                        f"({frames[i].info.width}×{frames[i].info.height} "
                        f"{frames[i].info.process} JPEG): {exc}"
                    ) from exc
            return out

    def transform(self, pixels: Any, orientation: int = 1) -> Any:
        """One frame or a stack of equally sized frames, ``uint8[(n,) c, h, w]`` → the declared
        ``spec.dtype[(n,) *spec.array_shape]`` (float math in float32)."""
        import torch
        import torch.nn.functional as F

        transpose, flip_v, flip_h = ORIENTATION_OPS.get(orientation, ORIENTATION_OPS[1])
        x = pixels if pixels.dim() == 4 else pixels[None]
        if transpose:
            x = x.transpose(-2, -1)
        dims = [d for d, on in ((-2, flip_v), (-1, flip_h)) if on]
        if dims:
            x = x.flip(dims)
        x = x.float()
        if self.spec.color == "BGR":
            x = x.flip(1)
        if tuple(x.shape[-2:]) != self._hw:
            antialias = self._resize in ("bilinear", "bicubic")
            x = F.interpolate(x, size=self._hw, mode=self._resize, antialias=antialias,
                              **({"align_corners": False} if antialias else {}))
            x = x.round_().clamp_(0.0, 255.0)  # Pillow's resize of an 8-bit image is 8-bit
        if self._scale != 1.0:
            x = x * self._scale
        if self._offset != 0.0:
            x = x + self._offset
        if self._mean is not None:
            x = x - self._mean
        if self._std is not None:
            x = x / self._std
        if self.spec.channels == 1:
            x = x[:, 0]
        elif self.spec.layout == "HWC":
            x = x.permute(0, 2, 3, 1)
        x = x.to(getattr(torch, self.spec.dtype))
        return x if pixels.dim() == 4 else x[0]

    def write(self, frames: Sequence[tuple[int, EncodedImage]], out: Any) -> None:
        """Decode ``frames`` and write each into its row of ``out`` on the current stream.

        Args:
            frames: ``(row, frame)`` pairs.
            out: The engine's input buffer, ``dtype[max_batch, *item_shape]`` on the device,
                where ``item_shape`` has as many elements as ``spec.array_shape``.

        Raises:
            ImageDecodeError: A frame could not be decoded.
        """
        import torch

        if not frames:
            return
        decoded = self.decode([f for _, f in frames])
        stream = torch.cuda.current_stream(self.device)
        for pixels in decoded:
            # Allocated by torchvision's decoder on its own stream and read on ours: keep the
            # caching allocator from handing the memory out again before our stream is done.
            pixels.record_stream(stream)
        groups: dict[tuple[tuple[int, ...], int], list[int]] = {}
        for i, ((_, frame), pixels) in enumerate(zip(frames, decoded, strict=True)):
            groups.setdefault((tuple(pixels.shape), frame.info.orientation), []).append(i)
        item = tuple(out.shape[1:])
        for (_, orientation), members in groups.items():
            stack = torch.stack([decoded[i] for i in members]) if len(members) > 1 else \
                decoded[members[0]][None]
            result = self.transform(stack, orientation).reshape(len(members), *item)
            rows = [frames[i][0] for i in members]
            # One copy per group, not one per frame: a camera's frames (one size, one
            # orientation) fill rows 0..n-1 in order, a slice; other groups scatter.
            if rows == list(range(rows[0], rows[0] + len(rows))):
                out[rows[0]:rows[0] + len(rows)].copy_(result)
            else:
                index = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
                out.index_copy_(0, index, result)
