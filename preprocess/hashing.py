"""Image identity: a hash of the encoded bytes, computed before any decode."""

from __future__ import annotations

import xxhash


def image_hash(data: bytes) -> str:
    """xxh3_128 hex digest of the bytes exactly as received.

    NOTE: two encodings of the same pixels hash differently; that costs a cache miss, never a
    wrong hit, and it lets a cache hit skip decoding entirely.
    """
    return xxhash.xxh3_128_hexdigest(data)
