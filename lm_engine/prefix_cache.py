"""Prefix-cache block hashing and the hash → block index.

A full block's hash chains its parent's hash, its token ids and its *extra keys*: for every image whose
placeholder span overlaps the block, the image's identity and the span's offset relative to the block.
Placeholder token ids are the same for every image, so without the extra keys one image's KV would be
served to another image's question.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import xxhash

from lm_engine.sequence import ImageItem, Sequence

ROOT_HASH = 0x9E3779B97F4A7C15  # any fixed value: the parent of a sequence's first block


@dataclass(frozen=True, slots=True)
class BlockKey:
    """Everything a cached block's KV depends on; compared exactly on every hit (the hash only finds it)."""

    parent: int
    # NOTE: packed int64s, one object: the index keeps a key per cached block (up to the whole pool), and a
    # tuple of ints costs ~5x as much (each id past 256 is an int object of its own).
    token_ids: bytes
    extra: tuple[bytes, ...]


def block_extra_keys(images: Seq[ImageItem], start: int, end: int) -> tuple[bytes, ...]:
    keys = []
    for img in images:
        if img.offset < end and img.end > start:
            keys.append(img.key.raw + (img.offset - start).to_bytes(8, "little", signed=True))
    return tuple(keys)


def hash_block(key: BlockKey) -> int:
    # NOTE: never Python's hash(): it is salted per process and attackable (CVE-2025-25183).
    h = xxhash.xxh3_64()
    h.update(key.parent.to_bytes(8, "little"))
    h.update(key.token_ids)
    for extra in key.extra:
        h.update(len(extra).to_bytes(4, "little"))
        h.update(extra)
    return h.intdigest()


def block_key(parent: int, token_ids: Seq[int], images: Seq[ImageItem], start: int) -> BlockKey:
    packed = array("q", token_ids).tobytes()
    return BlockKey(parent, packed, block_extra_keys(images, start, start + len(token_ids)))


def extend_chain(seq: Sequence, num_blocks: int, block_size: int) -> list[tuple[int, BlockKey]]:
    """``seq.block_chain`` grown to (at least) its first ``num_blocks`` full blocks and returned: each block's
    key and hash are computed once per sequence, however often it is looked up or committed."""
    chain = seq.block_chain
    for i in range(len(chain), num_blocks):
        parent = chain[-1][0] if chain else ROOT_HASH
        key = block_key(
            parent, seq.token_ids[i * block_size : (i + 1) * block_size], seq.images, i * block_size
        )
        chain.append((hash_block(key), key))
    return chain


class PrefixIndex:
    """hash → block id for full, computed blocks; a lookup is confirmed against the stored key."""

    def __init__(self) -> None:
        self._by_hash: dict[int, int] = {}
        self._keys: dict[int, BlockKey] = {}  # block id → key, for indexed blocks only

    def __len__(self) -> int:
        return len(self._by_hash)

    def lookup(self, block_hash: int, key: BlockKey) -> int | None:
        block_id = self._by_hash.get(block_hash)
        if block_id is None or self._keys.get(block_id) != key:
            return None
        return block_id

    def insert(self, block_hash: int, key: BlockKey, block_id: int) -> bool:
        """Index ``block_id``; False when another block already holds this content."""
        if block_hash in self._by_hash:
            return False
        self._by_hash[block_hash] = block_id
        self._keys[block_id] = key
        return True

    def evict(self, block_id: int, block_hash: int) -> None:
        if self._by_hash.get(block_hash) == block_id:
            del self._by_hash[block_hash]
        self._keys.pop(block_id, None)

    def items(self):
        return self._by_hash.items()

    def key_of(self, block_id: int) -> BlockKey | None:
        return self._keys.get(block_id)

    def clear(self) -> None:
        self._by_hash.clear()
        self._keys.clear()
