"""Identity of one cached vision embedding."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from preprocess.hashing import DEFAULT_HASH, check_algorithm, digest

# NOTE: bump when the canonical encoding changes, so old Redis entries stop matching
# instead of being read under a new meaning. v2: the hash algorithm (and any cache salt) became part of the
# key, and digests are that algorithm's (v1 entries were xxh3-128 over bytes without either).
_KEY_SCHEMA = "vlmserve.emb-key.v2"


def _field(value: str) -> bytes:
    raw = value.encode("utf-8")
    # Length-prefixed so ("ab", "c") and ("a", "bc") cannot encode alike.
    return struct.pack("<I", len(raw)) + raw


@dataclass(frozen=True, slots=True)
class EmbeddingKey:
    """What an image's connector output depends on, and who may share it.

    image_hash: hex digest of the encoded bytes as received, under ``hash_algorithm``.
    grid: (t, h, w) patch grid the image was resized to (the visual budget is part of identity).
    preprocess_fingerprint: hash of the preprocessing config (mean/std, resize rule, patch size, ...).
    model_fingerprint: hash of the vision tower + merger weights/config.
    levels: deepstack levels each embedding row carries after the main one (the entry's layout).
    hash_algorithm: what ``image_hash`` and ``raw`` are computed with (preprocess.hashing): two servers
        configured differently never take each other's entries for their own.
    cache_salt: the request's cache salt; salted requests share embeddings only with the same salt.
    """

    image_hash: str
    grid: tuple[int, int, int]
    preprocess_fingerprint: str
    model_fingerprint: str
    levels: int = 0
    hash_algorithm: str = DEFAULT_HASH
    cache_salt: str = ""
    # The digest, computed once: prefix-cache block hashes read it for every block an image touches.
    raw: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.grid) != 3 or any(not isinstance(g, int) or g < 0 for g in self.grid):
            raise ValueError(f"grid must be three non-negative ints (t, h, w), got {self.grid!r}")
        check_algorithm(self.hash_algorithm)
        object.__setattr__(self, "raw", digest(self.canonical_bytes(), self.hash_algorithm))

    def canonical_bytes(self) -> bytes:
        return b"".join(
            (
                _field(_KEY_SCHEMA),
                _field(self.hash_algorithm),
                _field(self.image_hash),
                struct.pack("<3q", *self.grid),
                _field(self.preprocess_fingerprint),
                _field(self.model_fingerprint),
                struct.pack("<q", self.levels),
                # NOTE: only when salted, and last (the one optional field, length-prefixed, so present and
                # absent cannot encode alike): unsalted keys keep their shape.
                _field(self.cache_salt) if self.cache_salt else b"",
            )
        )

    def digest(self) -> str:
        """Stable across processes and machines (never Python's salted hash()): the hex of ``raw``."""
        return self.raw.hex()
