"""Identity hashes: an image's is a hash of its encoded bytes, computed before any decode.

One algorithm serves every identity a deployment keeps (image bytes, embedding keys, prefix-cache block chains),
chosen with ``--hash-algorithm``. Clients choose the bytes, so the default is cryptographic: XXH3 collisions
between two different inputs can be built in milliseconds (its long-input accumulator adds
``lo32(w ^ s) * hi32(w ^ s)`` per input word ``w`` and public secret word ``s``: a word whose one half equals
the secret's contributes nothing whatever its other half, so the other halves can be traded between stripes).
``xxh3`` stays as an explicit opt-in for deployments whose clients are all trusted.
"""

from __future__ import annotations

import hashlib

import blake3
import xxhash

# NOTE: blake3 is the fastest cryptographic candidate measured (benchmarks/hashing.py): on an AVX-512 EPYC with
# SHA-NI, 12 MB at 5.7 GB/s against sha256's 1.8 and blake2b's 0.9 (xxh3: 62). The default is fixed, not
# measured at start-up: replicas sharing Redis must compute the same keys.
DEFAULT_HASH = "blake3"
HASH_ALGORITHMS = ("blake3", "sha256", "blake2b", "xxh3")
TRUSTED_ONLY = frozenset({"xxh3"})  # not collision resistant

_DIGEST_SIZE = {"blake3": 32, "sha256": 32, "blake2b": 32, "xxh3": 16}


def check_algorithm(algorithm: str) -> str:
    if algorithm not in _DIGEST_SIZE:
        raise ValueError(f"unknown hash algorithm {algorithm!r}; use one of {', '.join(HASH_ALGORITHMS)}")
    return algorithm


def digest_size(algorithm: str) -> int:
    """Bytes of ``algorithm``'s digest (its hex is twice as long)."""
    return _DIGEST_SIZE[check_algorithm(algorithm)]


def digest(data: bytes | memoryview, algorithm: str = DEFAULT_HASH) -> bytes:
    """``algorithm``'s digest of ``data``. The cryptographic ones release the GIL on large buffers, so the
    API's prompt threads hash images in parallel; blake3 runs single-threaded (those threads are the
    parallelism)."""
    if algorithm == "blake3":
        return blake3.blake3(data).digest()
    if algorithm == "sha256":
        return hashlib.sha256(data).digest()
    if algorithm == "blake2b":
        return hashlib.blake2b(data, digest_size=32).digest()
    if algorithm == "xxh3":
        return xxhash.xxh3_128_digest(data)
    raise ValueError(check_algorithm(algorithm))


def image_hash(data: bytes, algorithm: str = DEFAULT_HASH) -> str:
    """Hex digest of the bytes exactly as received.

    NOTE: two encodings of the same pixels hash differently; that costs a cache miss, never a
    wrong hit, and it lets a cache hit skip decoding entirely.
    """
    return digest(data, algorithm).hex()


def is_image_hash(value: object, algorithm: str) -> bool:
    """Whether ``value`` reads as an ``algorithm`` image hash (lowercase hex of its digest's length)."""
    return (
        isinstance(value, str)
        and len(value) == 2 * digest_size(algorithm)
        and all(c in "0123456789abcdef" for c in value)
    )
