"""What a JPEG's header says, read without decoding a pixel (pure Python, no Pillow).

Used to route each camera frame: nvJPEG (through ``torchvision.io.decode_jpeg`` on CUDA) gets
8-bit baseline JPEGs with one (grey) or three (YCbCr) components — what cameras send, and what
was checked against the CPU path on the H200 (docs/images.md); everything else — progressive
and extended JPEGs (nvJPEG may decode them, not yet checked here), CMYK/YCCK (4 components),
12-bit, lossless or arithmetic-coded JPEGs, Adobe RGB-transform files, truncated files — goes to
the CPU path (Pillow), which either decodes it or gives the request a clear dead-letter
reason. Marker codes: ITU-T T.81 (JPEG), Table B.1; EXIF orientation: CIPA DC-008 (EXIF 2.3),
tag 0x0112.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = ["ORIENTATION_OPS", "JpegInfo", "inspect_jpeg"]

#: SOFn marker → coding process (T.81 Table B.1). nvJPEG decodes the Huffman ones below marked
#: True; the rest are legal but rare and go to the CPU.
_SOF = {
    0xC0: ("baseline", True),
    0xC1: ("extended", False),
    0xC2: ("progressive", False),
    0xC3: ("lossless", False),
    0xC5: ("differential-sequential", False),
    0xC6: ("differential-progressive", False),
    0xC7: ("differential-lossless", False),
    0xC9: ("arithmetic-extended", False),
    0xCA: ("arithmetic-progressive", False),
    0xCB: ("arithmetic-lossless", False),
    0xCD: ("arithmetic-differential-sequential", False),
    0xCE: ("arithmetic-differential-progressive", False),
    0xCF: ("arithmetic-differential-lossless", False),
}

#: EXIF orientation (1..8) → (transpose, flip vertically, flip horizontally), applied in that
#: order to the stored pixels (rows × columns) to get the displayed image — what Pillow's
#: ``ImageOps.exif_transpose`` does (2: FLIP_LEFT_RIGHT, 3: ROTATE_180, 4: FLIP_TOP_BOTTOM,
#: 5: TRANSPOSE, 6: ROTATE_270, 7: TRANSVERSE, 8: ROTATE_90; a test holds the two together).
ORIENTATION_OPS: dict[int, tuple[bool, bool, bool]] = {
    1: (False, False, False),
    2: (False, False, True),
    3: (False, True, True),
    4: (False, True, False),
    5: (True, False, False),
    6: (True, False, True),
    7: (True, True, True),
    8: (True, True, False),
}


@dataclass(frozen=True)
class JpegInfo:
    """A JPEG's header.

    Attributes:
        width / height: Stored size in pixels (before orientation); 0 when the file has no
            frame header.
        components: 1 (grey), 3 (YCbCr or RGB) or 4 (CMYK/YCCK).
        precision: Bits per sample (8, or 12 for extended JPEGs).
        process: Coding process, e.g. ``"baseline"`` or ``"progressive"``; ``""`` when none.
        orientation: EXIF orientation 1..8 (1 when absent or invalid).
        adobe_transform: The Adobe APP14 colour transform (0: none, i.e. RGB/CMYK stored as
            is; 1: YCbCr; 2: YCCK), or None without an Adobe segment.
        complete: The data ends with the EOI marker (trailing zero padding allowed); False for a
            truncated frame.
    """

    width: int
    height: int
    components: int
    precision: int
    process: str
    orientation: int = 1
    adobe_transform: int | None = None
    complete: bool = True

    @property
    def pixels(self) -> int:
        return self.width * self.height

    @property
    def gpu_unsupported(self) -> str | None:
        """Why nvJPEG should not decode this frame, or None when it can."""
        if not self.process:
            return "no frame header"
        if not _SOF_BY_NAME.get(self.process, False):
            return f"{self.process} JPEG"
        if self.precision != 8:
            return f"{self.precision}-bit samples"
        if self.components not in (1, 3):
            return f"{self.components} components (CMYK/YCCK)"
        if self.components == 3 and self.adobe_transform == 0:
            return "RGB-coded (Adobe transform 0)"
        if self.width < 1 or self.height < 1:
            return "no size in the frame header"
        if not self.complete:
            return "truncated (no end-of-image marker)"
        return None


_SOF_BY_NAME = {name: ok for name, ok in _SOF.values()}


def inspect_jpeg(data: bytes | memoryview) -> JpegInfo | None:
    """Read a JPEG's markers up to the first scan.

    Args:
        data: The file's bytes (untrusted).

    Returns:
        Its :class:`JpegInfo`, or None when ``data`` does not start like a JPEG or its markers
        are malformed before the first scan (the CPU path then says why it cannot decode it).
    """
    view = memoryview(data)
    if len(view) < 4 or view[0] != 0xFF or view[1] != 0xD8:
        return None
    pos = 2
    width = height = components = precision = 0
    process = ""
    orientation = 1
    adobe: int | None = None
    end = len(view)
    while pos + 4 <= end:
        if view[pos] != 0xFF:
            return None
        marker = view[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # TEM, RSTn: no length
            pos += 2
            continue
        if marker in (0xD8, 0xD9):
            return None
        (length,) = struct.unpack_from(">H", view, pos + 2)
        segment = view[pos + 4 : pos + 2 + length]
        if length < 2 or len(segment) != length - 2:
            return None
        if marker in _SOF:
            if len(segment) < 6:
                return None
            precision, height, width, components = struct.unpack_from(">BHHB", segment)
            process = _SOF[marker][0]
        elif marker == 0xE1 and bytes(segment[:6]) == b"Exif\x00\x00":
            orientation = _exif_orientation(bytes(segment[6:]))
        elif marker == 0xEE and bytes(segment[:5]) == b"Adobe" and len(segment) >= 12:
            adobe = segment[11]
        elif marker == 0xDA:  # start of scan: the header is over
            break
        pos += 2 + length
    else:
        return None
    complete = bytes(view[-64:]).rstrip(b"\x00").endswith(b"\xff\xd9")
    return JpegInfo(width, height, components, precision, process, orientation, adobe, complete)


def _exif_orientation(tiff: bytes) -> int:
    """Tag 0x0112 of IFD0 of an EXIF TIFF block; 1 when absent or malformed."""
    if len(tiff) < 8 or tiff[:2] not in (b"II", b"MM"):
        return 1
    order = "<" if tiff[:2] == b"II" else ">"
    try:
        (ifd,) = struct.unpack_from(order + "I", tiff, 4)
        (count,) = struct.unpack_from(order + "H", tiff, ifd)
        for i in range(min(count, 512)):
            tag, kind, _, value = struct.unpack_from(order + "HHI2s", tiff, ifd + 2 + 12 * i)
            if tag == 0x0112 and kind == 3:  # SHORT
                (orientation,) = struct.unpack(order + "H", value)
                return orientation if orientation in ORIENTATION_OPS else 1
    except struct.error:
        return 1
    return 1
