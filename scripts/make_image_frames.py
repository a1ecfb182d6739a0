"""Write the JPEG frames the GPU image tests and the decode benchmark use (needs scikit-image).

- ``workload_<i>.jpg``: the ResNet-50 image workload's frames, byte for byte
  (``bench.workloads.sample_jpegs``);
- ``rot_<i>_o<o>_q<q>.jpg``: each photo stored turned/flipped with EXIF orientation ``o``
  (2..8) so that it displays upright, at JPEG quality ``q``;
- ``cam640_<i>.jpg`` / ``cam1280_<i>.jpg``: each photo resized to 640×480 / 1280×720, quality 90
  (camera frames, for the decode ceiling; written to ``--cam`` folder).

Usage: ``python scripts/make_image_frames.py -o .out/frames --cam .out/cam``
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STORE = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
         4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
         6: Image.Transpose.ROTATE_90, 7: Image.Transpose.TRANSVERSE,
         8: Image.Transpose.ROTATE_270}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--out", type=Path, default=Path(".out/frames"))
    parser.add_argument("--cam", type=Path, default=Path(".out/cam"))
    args = parser.parse_args()
    from bench.workloads import sample_jpegs

    args.out.mkdir(parents=True, exist_ok=True)
    args.cam.mkdir(parents=True, exist_ok=True)
    for i, data in enumerate(sample_jpegs()):
        (args.out / f"workload_{i}.jpg").write_bytes(data)
        photo = Image.open(io.BytesIO(data)).convert("RGB")
        for orientation, transpose in STORE.items():
            for quality in (75, 95):
                exif = Image.Exif()
                exif[0x0112] = orientation
                out = io.BytesIO()
                photo.transpose(transpose).save(out, "JPEG", quality=quality, exif=exif.tobytes())
                (args.out / f"rot_{i}_o{orientation}_q{quality}.jpg").write_bytes(out.getvalue())
        for name, size in (("cam640", (640, 480)), ("cam1280", (1280, 720))):
            out = io.BytesIO()
            photo.resize(size, Image.Resampling.BICUBIC).save(out, "JPEG", quality=90)
            (args.cam / f"{name}_{i}.jpg").write_bytes(out.getvalue())
    sizes = [p.stat().st_size for p in args.cam.glob("cam640_*.jpg")]
    print(f"{len(list(args.out.glob('*.jpg')))} frames in {args.out}; 640x480 frames "
          f"{int(np.mean(sizes)) // 1000} kB mean")


if __name__ == "__main__":
    main()
