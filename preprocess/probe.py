"""Open untrusted image bytes lazily: size, format and EXIF orientation from the header alone."""

from __future__ import annotations

import io
import struct
import warnings
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from preprocess.config import PreprocessConfig
from preprocess.errors import (
    CORRUPT,
    DECOMPRESSION_BOMB,
    EMPTY,
    TOO_MANY_BYTES,
    UNSUPPORTED_FORMAT,
    ZERO_SIZE,
    PreprocessError,
)

_ORIENTATION_TAG = 0x0112

_DEFAULT_CONFIG = PreprocessConfig()


@dataclass(frozen=True, slots=True)
class ImageInfo:
    """What the header says. width/height are upright: EXIF orientations 5-8 swap them."""

    width: int
    height: int
    format: str
    orientation: int
    mode: str


def probe(data: bytes, config: PreprocessConfig | None = None) -> ImageInfo:
    """Header-only look at an image (no pixel decode); raises PreprocessError on bad input.

    `config` supplies the acceptance limits (bytes, formats, pixel count).
    """
    return open_image(data, config or _DEFAULT_CONFIG)[1]


def open_image(data: bytes, config: PreprocessConfig) -> tuple[Image.Image, ImageInfo]:
    """Lazily opened image plus its ImageInfo, after every check that needs no decode."""
    if not data:
        raise PreprocessError(EMPTY, "image is empty (0 bytes)")
    if len(data) > config.max_bytes:
        raise PreprocessError(
            TOO_MANY_BYTES, f"image is {len(data)} bytes, over the limit of {config.max_bytes} bytes"
        )
    try:
        with warnings.catch_warnings():
            # Our own max_image_pixels check below is the limit; PIL's warning threshold is not.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=config.formats)
    except Image.DecompressionBombError as e:
        raise PreprocessError(DECOMPRESSION_BOMB, f"image rejected as a decompression bomb: {e}") from None
    except UnidentifiedImageError:
        raise _unidentified(data, config) from None
    except Exception as e:  # PIL's header parsers raise many types on malformed input
        fmt = _sniff_format(data) or "image"
        raise PreprocessError(CORRUPT, f"{fmt} header is truncated or corrupt: {e}") from None

    raw_w, raw_h = im.size
    if raw_w <= 0 or raw_h <= 0:
        raise PreprocessError(ZERO_SIZE, f"image has zero size ({raw_w}x{raw_h})")
    if raw_w * raw_h > config.max_image_pixels:
        raise PreprocessError(
            DECOMPRESSION_BOMB,
            f"image is {raw_w}x{raw_h} = {raw_w * raw_h / 1e6:.1f} MP, "
            f"over the limit of {config.max_image_pixels / 1e6:.1f} MP",
        )
    orientation = _orientation(im)
    w, h = (raw_h, raw_w) if orientation >= 5 else (raw_w, raw_h)
    return im, ImageInfo(width=w, height=h, format=im.format or "", orientation=orientation, mode=im.mode)


def _orientation(im: Image.Image) -> int:
    try:
        # NOTE: the base-class getexif, because PngImageFile.getexif() decodes the whole image to
        # look for an eXIf chunk after the pixel data. probe() and preprocess() both read the
        # orientation here, so the planned grid and the decoded one cannot disagree.
        value = Image.Image.getexif(im).get(_ORIENTATION_TAG, 1)
    except Exception:  # a broken EXIF block must not reject an otherwise fine image
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def _unidentified(data: bytes, config: PreprocessConfig) -> PreprocessError:
    """Tell "valid but not allowed", "looks like an allowed format but broken" and "not an image" apart."""
    sniffed = _sniff_format(data)
    allowed = ", ".join(config.formats)
    if sniffed is None:
        return PreprocessError(
            UNSUPPORTED_FORMAT, f"data is not a recognised image format (allowed: {allowed})"
        )
    if sniffed in config.formats:
        if 0 in _declared_size(sniffed, data):
            # PIL refuses these outright; name the real problem.
            return PreprocessError(ZERO_SIZE, f"{sniffed} header declares a zero-sized image")
        return PreprocessError(CORRUPT, f"{sniffed} image header is truncated or corrupt")
    return PreprocessError(
        UNSUPPORTED_FORMAT, f"image format {sniffed} is not supported (allowed: {allowed})"
    )


def _declared_size(fmt: str, data: bytes) -> tuple[int, ...]:
    """(width, height) from fixed header offsets, for the formats that have them."""
    if fmt == "PNG" and len(data) >= 24:
        return struct.unpack(">II", data[16:24])
    if fmt == "GIF" and len(data) >= 10:
        return struct.unpack("<HH", data[6:10])
    return ()


def _sniff_format(data: bytes) -> str | None:
    """Name the format from magic bytes only (each plugin's accept check; nothing is parsed)."""
    Image.init()
    prefix = data[:16]
    for name, (_, accept) in Image.OPEN.items():
        try:
            if accept is not None and accept(prefix):
                return name
        except Exception:
            continue
    return None
