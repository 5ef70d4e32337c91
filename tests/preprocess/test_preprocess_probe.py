"""probe() (header only) against a full decode; image_hash against xxhash."""

from __future__ import annotations

import io

import pytest
import xxhash
from PIL import Image, ImageOps

from preprocess import PreprocessError, image_hash, probe

KINDS = ["jpeg", "png", "rgba_png", "l_png", "p_png", "cmyk_jpeg", "i16_png", "webp", "gif", "bmp"]


@pytest.mark.parametrize("kind", KINDS)
def test_probe_dims_match_full_decode(kind, make_image):
    data = make_image(kind, 123, 45)
    info = probe(data)
    decoded = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    assert (info.width, info.height) == decoded.size == (123, 45)
    assert info.format == Image.open(io.BytesIO(data)).format
    assert info.orientation == 1


@pytest.mark.parametrize("orientation", range(1, 9))
def test_probe_applies_exif_orientation(orientation, make_image):
    data = make_image("jpeg", 120, 50, orientation=orientation)
    info = probe(data)
    assert info.orientation == orientation
    assert (info.width, info.height) == ImageOps.exif_transpose(Image.open(io.BytesIO(data))).size


def test_probe_does_not_decode_pixels(make_image):
    # Cut the JPEG in the middle of its entropy-coded data: the header is intact, the pixels are not.
    data = make_image("jpeg", 640, 480)
    truncated = data[: len(data) // 2]
    assert (probe(truncated).width, probe(truncated).height) == (640, 480)
    with pytest.raises(OSError):
        Image.open(io.BytesIO(truncated)).load()


def test_image_hash_is_blake3_of_the_bytes(make_image):
    # published BLAKE3 of ""
    assert image_hash(b"") == "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    assert image_hash(b"", "xxh3") == "99aa06d3014798d86001c324468d497f"  # published xxh3_128 of ""
    data = make_image("png", 64, 64)
    assert image_hash(data, "xxh3") == xxhash.xxh3_128_hexdigest(data)
    assert len(image_hash(data)) == 64
    assert image_hash(data) != image_hash(make_image("png", 64, 64, seed=1))
    # Same pixels, different bytes (another encoding) is a different identity, by design.
    assert image_hash(make_image("bmp", 64, 64)) != image_hash(data)


def test_probe_rejects_bad_input_before_decoding():
    with pytest.raises(PreprocessError) as info:
        probe(b"not an image at all")
    assert info.value.code == "unsupported_format"
