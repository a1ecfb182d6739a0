"""GPU JPEG decoders side by side on the benchmark's 640x480 camera JPEGs, batch 64:
torchvision's ``decode_jpeg`` (what the torch backend uses) and nvImageCodec's hardware
(``HW_GPU_ONLY``), CUDA (``GPU_ONLY``) and hybrid backends. Prints images/s and CPU µs per image
(one thread, CUDA synchronized at both ends), and each decoder's mean difference from
torchvision in 8-bit levels.

Needs torch/torchvision with CUDA; nvImageCodec is optional (``nvidia-nvimgcodec-cu13`` and
``nvidia-nvjpeg`` wheels, with the folder of ``libnvjpeg.so.13`` on ``LD_LIBRARY_PATH``).
Usage: ``python scripts/jpeg_decoder_probe.py`` (issue 17, docs/performance.md).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    from bench.workloads import camera_jpegs

    jpegs = camera_jpegs()
    batch = [jpegs[i % len(jpegs)] for i in range(64)]
    print(f"{len(jpegs)} frames, {sum(map(len, jpegs)) / len(jpegs) / 1000:.1f} kB mean",
          flush=True)

    def rate(name: str, fn: Callable[[], Any], seconds: float = 3.0) -> None:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        n, cpu0, t0 = 0, time.process_time(), time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            fn()
            n += len(batch)
        torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        print(json.dumps({"decoder": name, "images_per_s": round(n / wall),
                          "cpu_us_per_image": round(1e6 * cpu / n, 1)}), flush=True)

    tensors = [torch.frombuffer(bytearray(j), dtype=torch.uint8) for j in batch]
    rate("torchvision decode_jpeg (list of 64)",
         lambda: decode_jpeg(tensors, mode=ImageReadMode.RGB, device="cuda"))
    try:
        from nvidia import nvimgcodec
    except ImportError as exc:
        print(f"nvImageCodec not installed: {exc}")
        return 0
    params = nvimgcodec.DecodeParams(color_spec=nvimgcodec.ColorSpec.SRGB,
                                     apply_exif_orientation=False)
    reference = decode_jpeg(tensors[:4], mode=ImageReadMode.RGB, device="cuda")
    for kind in ("HW_GPU_ONLY", "GPU_ONLY", "HYBRID_CPU_GPU"):
        try:
            decoder = nvimgcodec.Decoder(
                backends=[nvimgcodec.Backend(getattr(nvimgcodec.BackendKind, kind))])

            def decode(decoder: Any = decoder) -> list[Any]:
                return [torch.as_tensor(image, device="cuda")
                        for image in decoder.decode(batch, params=params)]

            rate(f"nvimgcodec {kind}", decode)
            diff = max((r.permute(1, 2, 0).int() - m.int()).abs().float().mean().item()
                       for r, m in zip(reference, decode()[:4], strict=True))
            print(f"{kind}: mean difference from torchvision {diff:.3f} levels", flush=True)
        except Exception as exc:  # report each backend's failure, try the next
            print(f"{kind} failed: {exc!r}"[:400], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
