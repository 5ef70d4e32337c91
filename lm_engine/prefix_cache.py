"""Prefix-cache block hashing and the hash → block index.

A full block's hash chains its parent's hash, its token ids and its *extra keys*: for every image whose
placeholder span overlaps the block, the image's identity and the span's offset relative to the block.
Placeholder token ids are the same for every image, so without the extra keys one image's KV would be
served to another image's question. A hash is a digest of the deployment's identity hash
(preprocess.hashing): cryptographic unless it opted into xxh3, since prompts and images are the clients'.
The first block also takes the request's cache salt (vLLM's ``cache_salt``), so prefix reuse never crosses
salts.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from lm_engine.sequence import ImageItem, Sequence
from preprocess.hashing import DEFAULT_HASH, digest

ROOT_HASH = b""  # the parent of a sequence's first block


@dataclass(frozen=True, slots=True)
class BlockKey:
    """Everything a cached block's KV depends on; compared exactly on every hit (the hash only finds it)."""

    parent: bytes
    # NOTE: packed int64s, one object: the index keeps a key per cached block (up to the whole pool), and a
    # tuple of ints costs ~5x as much (each id past 256 is an int object of its own).
    token_ids: bytes
    extra: tuple[bytes, ...]
    salt: str = ""  # the request's cache salt, in its first block only (a later block has it via its parent)


def block_extra_keys(images: Seq[ImageItem], start: int, end: int) -> tuple[bytes, ...]:
    keys = []
    for img in images:
        if img.offset < end and img.end > start:
            key = img.key.raw + (img.offset - start).to_bytes(8, "little", signed=True)
            # NOTE: only when non-zero, so image spans keep their keys: which rows of a video a span shows.
            keys.append(key + img.rows_from.to_bytes(8, "little") if img.rows_from else key)
    return tuple(keys)


def _framed(part: bytes) -> bytes:
    return struct.pack("<I", len(part)) + part


def hash_block(key: BlockKey, algorithm: str = DEFAULT_HASH) -> bytes:
    # NOTE: never Python's hash(): it is salted per process and attackable (CVE-2025-25183); every part framed by
    # its length, so no two keys encode alike.
    parts = [key.parent, key.salt.encode("utf-8"), key.token_ids, *key.extra]
    return digest(b"".join(_framed(p) for p in parts), algorithm)


def block_key(
    parent: bytes, token_ids: Seq[int], images: Seq[ImageItem], start: int, salt: str = ""
) -> BlockKey:
    packed = array("q", token_ids).tobytes()
    return BlockKey(parent, packed, block_extra_keys(images, start, start + len(token_ids)), salt)


def extend_chain(
    seq: Sequence, num_blocks: int, block_size: int, algorithm: str = DEFAULT_HASH
) -> list[tuple[bytes, BlockKey]]:
    """``seq.block_chain`` grown to (at least) its first ``num_blocks`` full blocks and returned: each block's
    key and hash are computed once per sequence, however often it is looked up or committed."""
    chain = seq.block_chain
    for i in range(len(chain), num_blocks):
        parent = chain[-1][0] if chain else ROOT_HASH
        key = block_key(
            parent,
            seq.token_ids[i * block_size : (i + 1) * block_size],
            seq.images,
            i * block_size,
            "" if chain else seq.cache_salt,
        )
        chain.append((hash_block(key, algorithm), key))
    return chain


class PrefixIndex:
    """hash → block id for full, computed blocks; a lookup is confirmed against the stored key."""

    def __init__(self) -> None:
        self._by_hash: dict[bytes, int] = {}
        self._keys: dict[int, BlockKey] = {}  # block id → key, for indexed blocks only

    def __len__(self) -> int:
        return len(self._by_hash)

    def lookup(self, block_hash: bytes, key: BlockKey) -> int | None:
        block_id = self._by_hash.get(block_hash)
        if block_id is None or self._keys.get(block_id) != key:
            return None
        return block_id

    def insert(self, block_hash: bytes, key: BlockKey, block_id: int) -> bool:
        """Index ``block_id``; False when another block already holds this content."""
        if block_hash in self._by_hash:
            return False
        self._by_hash[block_hash] = block_id
        self._keys[block_id] = key
        return True

    def evict(self, block_id: int, block_hash: bytes) -> None:
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
