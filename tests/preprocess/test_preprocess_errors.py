"""Every kind of bad input fails with a PreprocessError whose code and message name the problem."""

from __future__ import annotations

import io
import struct
import zlib

import pytest
from PIL import Image

from preprocess import PreprocessConfig, PreprocessError, preprocess, probe


def _png_header_only(width: int, height: int) -> bytes:
    """A valid PNG signature + IHDR declaring (width, height), with almost no pixel data."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    )


def _error(data: bytes, config: PreprocessConfig | None = None) -> PreprocessError:
    with pytest.raises(PreprocessError) as info:
        preprocess(data, config or PreprocessConfig())
    assert isinstance(info.value, ValueError)
    return info.value


def test_empty():
    err = _error(b"")
    assert err.code == "empty" and "empty" in str(err)


def test_too_many_bytes(make_image):
    data = make_image("png", 64, 64)
    err = _error(data, PreprocessConfig(max_bytes=len(data) - 1))
    assert err.code == "too_many_bytes" and str(len(data)) in err.message


def test_unsupported_format_named():
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "TIFF")
    err = _error(buf.getvalue())
    assert err.code == "unsupported_format" and "TIFF" in err.message
    assert _error(b"%PDF-1.7 hello").code == "unsupported_format"


@pytest.mark.parametrize("kind", ["jpeg", "png", "webp"])
def test_truncated(kind, make_image):
    data = make_image(kind, 200, 150)
    err = _error(data[: len(data) * 2 // 3])
    assert err.code == "corrupt" and "truncated or corrupt" in err.message


def test_truncated_header(make_image):
    err = _error(make_image("png", 50, 50)[:20])
    assert err.code == "corrupt" and "PNG" in err.message


def test_corrupt_middle(make_image):
    data = bytearray(make_image("png", 200, 150))
    data[len(data) // 2 : len(data) // 2 + 64] = b"\xff" * 64  # breaks the zlib stream / CRC
    assert _error(bytes(data)).code == "corrupt"


def test_zero_size():
    err = _error(_png_header_only(0, 10))
    assert err.code == "zero_size" and "zero" in err.message


def test_decompression_bomb_caught_from_header_before_decoding():
    # 9000 x 9000 = 81 MP declared; the file is a few dozen bytes. Nothing may be decoded.
    data = _png_header_only(9000, 9000)
    err = _error(data)
    assert err.code == "decompression_bomb" and "81.0 MP" in err.message
    with pytest.raises(PreprocessError):
        probe(data)  # probe applies the same limit


def test_pils_own_bomb_guard_is_mapped():
    # Over 2x Image.MAX_IMAGE_PIXELS PIL refuses at open; with a raised limit of ours, the error is still ours.
    err = _error(_png_header_only(20000, 20000), PreprocessConfig(max_image_pixels=10**9))
    assert err.code == "decompression_bomb"


def test_extreme_aspect_ratio(make_image):
    err = _error(make_image("png", 2010, 10))
    assert err.code == "aspect_ratio" and "201" in err.message


def test_errors_pickle_with_code_and_message():
    import pickle

    err = pickle.loads(pickle.dumps(PreprocessError("corrupt", "broken")))
    assert (err.code, err.message) == ("corrupt", "broken")
