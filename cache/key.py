"""Identity of one cached vision embedding."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import xxhash

# NOTE: bump when the canonical encoding changes, so old Redis entries stop matching
# instead of being read under a new meaning.
_KEY_SCHEMA = "vlmserve.emb-key.v1"


def _field(value: str) -> bytes:
    raw = value.encode("utf-8")
    # Length-prefixed so ("ab", "c") and ("a", "bc") cannot encode alike.
    return struct.pack("<I", len(raw)) + raw


@dataclass(frozen=True, slots=True)
class EmbeddingKey:
    """What an image's connector output depends on.

    image_hash: xxh3_128 hex of the encoded bytes as received.
    grid: (t, h, w) patch grid the image was resized to (the visual budget is part of identity).
    preprocess_fingerprint: hash of the preprocessing config (mean/std, resize rule, patch size, ...).
    model_fingerprint: hash of the vision tower + merger weights/config.
    levels: deepstack levels each embedding row carries after the main one (the entry's layout).
    """

    image_hash: str
    grid: tuple[int, int, int]
    preprocess_fingerprint: str
    model_fingerprint: str
    levels: int = 0
    # The digest, computed once: prefix-cache block hashes read it for every block an image touches.
    raw: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.grid) != 3 or any(not isinstance(g, int) or g < 0 for g in self.grid):
            raise ValueError(f"grid must be three non-negative ints (t, h, w), got {self.grid!r}")
        object.__setattr__(self, "raw", xxhash.xxh3_128_digest(self.canonical_bytes()))

    def canonical_bytes(self) -> bytes:
        return b"".join(
            (
                _field(_KEY_SCHEMA),
                _field(self.image_hash),
                struct.pack("<3q", *self.grid),
                _field(self.preprocess_fingerprint),
                _field(self.model_fingerprint),
                # NOTE: only when non-zero, so keys of families without deepstack keep their digests.
                struct.pack("<q", self.levels) if self.levels else b"",
            )
        )

    def digest(self) -> str:
        """Stable across processes and machines (never Python's salted hash()): the hex of ``raw``."""
        return self.raw.hex()
