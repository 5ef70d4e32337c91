"""Two different inputs with the same XXH3 hash (64- and 128-bit), built from the construction, in milliseconds.

XXH3 hashes an input longer than 240 bytes in 64-byte stripes of eight 8-byte words, sixteen stripes to a
1 KiB block. For word ``w`` of lane ``i`` in stripe ``n`` of a block, with ``s`` the secret's word at byte
``8n + 8i``, it does

    acc[i ^ 1] += w
    acc[i]     += lo32(w ^ s) * hi32(w ^ s)

and scrambles the accumulators only after each block; the last partial block and the last 64 bytes are
accumulated once more at the end, then the accumulators and the length are merged into the hash. The secret is
public (XXH3_kSecret of xxhash.h; the Python package's default). A word whose low half equals the secret's adds
no product whatever its high half ``h``, and adds ``lo32(s) + h << 32`` to its neighbour lane. So two such words
of one lane in two stripes of one block, with high halves ``r`` and ``K - r``, add the same sum for every ``r``:
each choice of ``r`` is another input with the same accumulators, hence the same hash. Half the bytes of every
word used this way (its high half) differ between two inputs.
"""

from __future__ import annotations

import random
import struct

# XXH3_kSecret (xxhash.h), the default secret of XXH3_64bits and XXH3_128bits.
XXH3_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
STRIPE, STRIPES_PER_BLOCK = 64, 16
BLOCK = STRIPE * STRIPES_PER_BLOCK


def colliding_pair(prefix: bytes, size: int, seed: int = 0) -> tuple[bytes, bytes]:
    """Two ``size``-byte inputs that both start with ``prefix`` and share their XXH3 hashes, differing in about
    half their bytes. Stripes holding any of ``prefix``, the last partial block or the last 64 bytes are
    left alike (those bytes are accumulated a second time, under another secret offset)."""
    assert size > 240 + len(prefix), "XXH3's long-input path starts past 240 bytes"
    rng = random.Random(seed)
    a = bytearray(prefix + bytes(rng.getrandbits(8) for _ in range(size - len(prefix))))
    b = bytearray(a)
    for block in range((size - 1) // BLOCK):
        for first in range(0, STRIPES_PER_BLOCK, 2):
            start = block * BLOCK + first * STRIPE
            if start < len(prefix) or start + 2 * STRIPE > size - STRIPE:
                continue
            for lane in range(8):
                k = rng.getrandbits(32)
                for buf in (a, b):
                    r = rng.getrandbits(32)
                    for j, high in ((0, r), (1, (k - r) % (1 << 32))):
                        secret_lo = int.from_bytes(XXH3_SECRET[8 * (first + j + lane) :][:4], "little")
                        struct.pack_into("<Q", buf, start + j * STRIPE + 8 * lane, secret_lo | high << 32)
    return bytes(a), bytes(b)


def bmp_header(width: int, height: int) -> bytes:
    """A 24-bit bottom-up BMP's 54-byte header (rows of ``width`` × 3 bytes, ``width`` a multiple of 4 so rows
    need no padding)."""
    assert width % 4 == 0
    pixels = width * height * 3
    return (
        b"BM"
        + struct.pack("<IHHI", 54 + pixels, 0, 0, 54)
        + struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, pixels, 2835, 2835, 0, 0)
    )


def colliding_bmps(width: int, height: int, seed: int = 0) -> tuple[bytes, bytes]:
    """Two valid BMP images of the same size and header whose bytes collide under XXH3: BMP stores raw pixels,
    so the colliding words are pixel data."""
    header = bmp_header(width, height)
    return colliding_pair(header, len(header) + width * height * 3, seed)
