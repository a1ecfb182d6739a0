"""What the benchmark sends: digits tensors, ResNet-50 JPEG images, pre-processed tensors.

Each workload gives a :data:`bench.load.PayloadFn` (request ``n`` at time ``ts`` →
``(key, value)``, msgpack: raw bytes, as a gateway in front of cameras would send) over 16
devices (or as many as asked), and the model the worker must load.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import cache, partial
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

__all__ = ["DEVICES", "Workload", "forwarded_parse", "result_parse", "workload"]

DEVICES = 16

#: scikit-image's bundled colour photos (no download): natural images of 300–640 px.
SAMPLE_IMAGES = ("astronaut", "chelsea", "coffee", "rocket", "immunohistochemistry", "logo",
                 "colorwheel")


@dataclass(frozen=True)
class Workload:
    """A request stream for one model.

    Attributes:
        name: ``digits``, ``digits-image``, ``resnet50-image``, ``resnet50-jpeg`` or
            ``resnet50-tensor``.
        model: Model name in the worker's repository.
        models_dir: The repository (None: the bundled one).
        payload: ``(n, ts) -> (key, value)``.
        payload_bytes: Mean value size.
        describe: One line for the report.
        factory: Builds this workload again, in another process (picklable: the generator
            of :func:`bench.load.open_loop` runs in a process of its own).
    """

    name: str
    model: str
    models_dir: Path | None
    payload: Callable[[int, float], tuple[bytes, bytes]]
    payload_bytes: int
    describe: str
    factory: Callable[[], Workload] | None = None

    def payload_factory(self) -> Callable[[], Callable[[int, float], tuple[bytes, bytes]]] | None:
        """A picklable callable that rebuilds :attr:`payload` (None: not rebuildable)."""
        return None if self.factory is None else partial(_payload_of, self.factory)


def _payload_of(factory: Callable[[], Workload]) -> Callable[[int, float], tuple[bytes, bytes]]:
    return factory().payload


def _payload_fn(model: str, inputs: list[dict[str, Any]], run: str, devices: int = DEVICES,
                fields: Mapping[str, Any] | None = None,
                ) -> Callable[[int, float], tuple[bytes, bytes]]:
    keys = [f"device-{d:02d}" for d in range(devices)]
    key_bytes = [k.encode() for k in keys]
    packb = msgpack.packb
    extra = dict(fields or {})

    def payload(n: int, ts: float) -> tuple[bytes, bytes]:
        d = n % devices
        body = {"request_id": f"{run}-{n}", "device_id": keys[d], "seq": n // devices,
                "ts": ts, "model": model, **extra, **inputs[n % len(inputs)]}
        return key_bytes[d], packb(body, use_bin_type=True)

    return payload


def _digits_inputs() -> list[dict[str, Any]]:
    from streamapp.client import load_digits_frames

    images, _ = load_digits_frames()
    return [{"tensor": {"dtype": "uint8", "shape": [8, 8], "data": im.tobytes()}}
            for im in images]


@cache
def sample_jpegs(quality: int = 90) -> list[bytes]:
    """scikit-image's bundled colour photos, encoded as JPEG (Pillow, ``quality``)."""
    import skimage.data
    from PIL import Image

    out = []
    for name in SAMPLE_IMAGES:
        array = getattr(skimage.data, name)()
        if array.ndim != 3:
            continue
        buf = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(array[..., :3])).save(buf, "JPEG", quality=quality)
        out.append(buf.getvalue())
    return out


@cache
def camera_jpegs(size: tuple[int, int] = (640, 480), quality: int = 90) -> list[bytes]:
    """The same photos as camera frames: resized to ``size`` (bicubic), JPEG ``quality``."""
    from PIL import Image

    out = []
    for data in sample_jpegs():
        buf = io.BytesIO()
        photo = Image.open(io.BytesIO(data)).convert("RGB")
        photo.resize(size, Image.Resampling.BICUBIC).save(buf, "JPEG", quality=quality)
        out.append(buf.getvalue())
    return out


def _digits_images(side: int = 256) -> list[dict[str, Any]]:
    """Digits as a camera would see them: ``side``×``side`` 8-bit grey PNGs (nearest-upscaled
    from the 8×8 data; the model area-averages them back)."""
    from PIL import Image

    from streamapp.client import load_digits_frames

    images, _ = load_digits_frames()
    out = []
    for im in images[:256]:
        pixels = np.rint(im.astype(np.float32) * 255 / 16).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels, "L").resize((side, side), Image.Resampling.NEAREST).save(
            buf, "PNG")
        out.append({"image": buf.getvalue()})
    return out


def workload(name: str, *, run: str, models_dir: Path | None = None,
             tensor_dtype: str = "float16", devices: int = DEVICES,
             fields: Mapping[str, Any] | None = None) -> Workload:
    """Build a workload; ``run`` prefixes request ids; requests cycle over ``devices`` keys;
    ``fields`` are added to every request (e.g. ``{"deadline": 60000.0}``: the queue policy
    on, issue 20). The result's :attr:`Workload.factory` builds the same one again."""
    built = _workload(name, run=run, models_dir=models_dir, tensor_dtype=tensor_dtype,
                      devices=devices, fields=fields)
    return replace(built, factory=partial(
        workload, name, run=run, models_dir=models_dir, tensor_dtype=tensor_dtype,
        devices=devices, fields=dict(fields) if fields else None))


def _workload(name: str, *, run: str, models_dir: Path | None, tensor_dtype: str, devices: int,
              fields: Mapping[str, Any] | None) -> Workload:
    if name == "digits":
        inputs = _digits_inputs()
        return _make(name, "digits", None, inputs, run,
                     "scikit-learn digits, uint8[8, 8] tensors, msgpack", devices, fields)
    if name == "digits-image":
        return _make(name, "digits", None, _digits_images(), run,
                     "scikit-learn digits as 256x256 grey PNGs, decoded in the worker, msgpack",
                     devices, fields)
    if name == "resnet50-jpeg":
        jpegs = camera_jpegs()
        return _make(name, "resnet50", models_dir, [{"image": j} for j in jpegs], run,
                     f"the photos as 640x480 camera JPEGs ({min(map(len, jpegs)) // 1000}-"
                     f"{max(map(len, jpegs)) // 1000} kB), decoded on the GPU (nvJPEG) with the "
                     "torch backend, else in the worker's decode pool, msgpack", devices, fields)
    if name in ("resnet50-image", "resnet50-tensor"):
        from streamapp.models import ModelRepository

        jpegs = sample_jpegs()
        if name == "resnet50-image":
            inputs = [{"image": j} for j in jpegs]
            sizes = f"{min(map(len, jpegs)) // 1000}-{max(map(len, jpegs)) // 1000} kB"
            return _make(name, "resnet50", models_dir, inputs, run,
                         f"{len(jpegs)} scikit-image photos as JPEG ({sizes}), decoded, resized "
                         "and normalized in the worker, msgpack", devices, fields)
        config = ModelRepository(models_dir).get("resnet50")
        assert config.image is not None
        inputs = []
        for j in jpegs:
            array = config.image.to_array(j).astype(tensor_dtype)
            inputs.append({"tensor": {"dtype": tensor_dtype, "shape": list(array.shape),
                                      "data": array.tobytes()}})
        return _make(name, "resnet50", models_dir, inputs, run,
                     f"the same photos pre-processed at the gateway: {tensor_dtype}[3, 224, 224] "
                     "tensors, msgpack", devices, fields)
    raise ValueError(f"unknown workload {name!r}")


def _make(name: str, model: str, models_dir: Path | None, inputs: list[dict[str, Any]],
          run: str, describe: str, devices: int = DEVICES,
          fields: Mapping[str, Any] | None = None) -> Workload:
    payload = _payload_fn(model, inputs, run, devices, fields)
    size = int(np.mean([len(payload(i, 1.8e9)[1]) for i in range(min(len(inputs), 64))]))
    return Workload(name, model, models_dir, payload, size, describe)


def result_parse(value: bytes) -> tuple[float, int | None, tuple[float, float, float]]:
    """A result record → (request ts, batch size, (queue_ms, infer_ms, e2e_ms)).
    ``ts − e2e_ms`` is the request's ``ts``."""
    if value[:1] == b"{":
        r = json.loads(value)
    else:
        r = msgpack.unpackb(value, raw=False)
    e2e = r["e2e_ms"]
    return (r["ts"] - e2e / 1000.0, r["batch_size"],
            (r.get("queue_ms") or 0.0, r.get("infer_ms") or 0.0, e2e))


def forwarded_parse(value: bytes) -> tuple[float, int | None]:
    """A forwarded request (msgpack) → (its ts, None)."""
    return msgpack.unpackb(value, raw=False)["ts"], None
