from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
import torch
import xxhash

from cache import EmbeddingCache, EmbeddingKey, codec
from cache import key as key_module
from preprocess.hashing import HASH_ALGORITHMS, image_hash
from tests.xxh3_collision import colliding_bmps

PINNED_DIGEST = "01cc50abb15a6e8185f6f04e1ee0b7508776112ae172929fecf9014f40614e36"
KEY = EmbeddingKey(image_hash(b"jpeg bytes"), (1, 32, 48), "pre-7f3a", "qwen2vl-tiny-91c2")
# The same image's key as schema v1 wrote it: xxh3-128 everywhere, no algorithm in the key.
V1_IMAGE_HASH = xxhash.xxh3_128_hexdigest(b"jpeg bytes")
V1_DIGEST = "41e806f172a60ac7cd05b3412d7b0aa8"


def test_digest_is_blake3_hex_and_deterministic() -> None:
    d = KEY.digest()
    assert KEY.hash_algorithm == "blake3" and len(d) == 64 and int(d, 16) >= 0
    assert d == EmbeddingKey(KEY.image_hash, (1, 32, 48), "pre-7f3a", "qwen2vl-tiny-91c2").digest()


def test_digest_is_pinned() -> None:
    # Redis entries written by other replicas/versions are found by this value: a change here is
    # a cache-format change and must come with a bump of the key schema.
    assert KEY.digest() == PINNED_DIGEST


def _v1_digest(image_hash_hex: str, grid, pre: str, model: str) -> str:
    """schema v1's digest, re-derived from its encoding (for the test that old entries are misses)."""

    def field(v: str) -> bytes:
        return struct.pack("<I", len(v.encode())) + v.encode()

    raw = field("vlmserve.emb-key.v1") + field(image_hash_hex) + struct.pack("<3q", *grid)
    return xxhash.xxh3_128_hexdigest(raw + field(pre) + field(model))


@pytest.mark.parametrize("algorithm", HASH_ALGORITHMS)
def test_entries_of_schema_v1_are_misses_under_every_algorithm(algorithm: str) -> None:
    """A v1 entry in Redis sits under ``emb:<v1 digest>`` and echoes that digest in its header: no v2 key (even
    one hashed with xxh3, as v1 was) looks it up, and decoding it for a v2 key refuses it."""
    assert _v1_digest(V1_IMAGE_HASH, KEY.grid, KEY.preprocess_fingerprint, KEY.model_fingerprint) == V1_DIGEST
    image = image_hash(b"jpeg bytes", algorithm)
    key = EmbeddingKey(image, KEY.grid, KEY.preprocess_fingerprint, KEY.model_fingerprint, 0, algorithm)
    assert algorithm != "xxh3" or key.image_hash == V1_IMAGE_HASH  # same image hash as v1 wrote ...
    assert key.digest() != V1_DIGEST  # ... still another key
    old_entry = codec.encode(V1_DIGEST, torch.zeros(2, 4))
    with pytest.raises(codec.CorruptEntry):
        codec.decode(key.digest(), old_entry)


def test_every_field_changes_the_digest() -> None:
    variants = [
        replace(KEY, image_hash=image_hash(b"other bytes")),
        replace(KEY, grid=(1, 48, 32)),  # transposed grid: different image layout
        replace(KEY, grid=(2, 32, 48)),
        replace(KEY, preprocess_fingerprint="pre-7f3b"),
        replace(KEY, model_fingerprint="qwen2vl-tiny-91c3"),
        replace(KEY, levels=3),
        replace(KEY, cache_salt="tenant-a"),
        replace(KEY, cache_salt="tenant-b"),
        *(replace(KEY, hash_algorithm=a) for a in HASH_ALGORITHMS if a != KEY.hash_algorithm),
    ]
    digests = {KEY.digest(), *(v.digest() for v in variants)}
    assert len(digests) == len(variants) + 1


def test_algorithm_is_part_of_identity() -> None:
    """Two servers configured with different algorithms never take each other's keys for their own, even for
    the same image-hash string."""
    keys = {a: replace(KEY, hash_algorithm=a) for a in HASH_ALGORITHMS}
    assert len({k.digest() for k in keys.values()}) == len(HASH_ALGORITHMS)
    assert len(set(keys.values())) == len(HASH_ALGORITHMS)  # L1 (a dict keyed by the key) too
    assert [len(k.raw) for k in keys.values()] == [32, 32, 32, 16]
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        replace(KEY, hash_algorithm="md5")


@pytest.mark.parametrize("algorithm", ["blake3", "xxh3"])
def test_images_colliding_under_xxh3_are_two_entries_unless_xxh3_is_chosen(algorithm: str) -> None:
    a, b = colliding_bmps(128, 176, seed=3)
    assert a != b and xxhash.xxh3_128_digest(a) == xxhash.xxh3_128_digest(b)
    key_a, key_b = (
        EmbeddingKey(image_hash(x, algorithm), (1, 10, 8), "pre", "model", 0, algorithm) for x in (a, b)
    )
    cache = EmbeddingCache.create(1 << 20)
    cache.put(key_a, torch.ones(20, 4))
    if algorithm == "xxh3":  # the opt-in's risk: the second picture is served the first one's embedding
        assert key_a == key_b and key_a.digest() == key_b.digest()
        assert cache.get(key_b) is not None
    else:
        assert key_a != key_b and key_a.digest() != key_b.digest()
        assert cache.get(key_b) is None
        cache.put(key_b, torch.zeros(20, 4))
        assert len(cache.l1) == 2 and cache.get(key_a).sum() == 80 and cache.get(key_b).sum() == 0


def test_salt_is_appended_only_when_given() -> None:
    """Unsalted keys keep their shape; a salt is a length-prefixed field of its own at the end."""
    salted = replace(KEY, cache_salt="tenant-a")
    assert salted.canonical_bytes().startswith(KEY.canonical_bytes())
    assert salted != KEY and salted.digest() != KEY.digest()
    assert replace(KEY, cache_salt="").canonical_bytes() == KEY.canonical_bytes()


def test_field_boundaries_are_unambiguous() -> None:
    a = EmbeddingKey("h", (1, 2, 3), "ab", "c")
    b = EmbeddingKey("h", (1, 2, 3), "a", "bc")
    assert a.digest() != b.digest()
    # The salt, optional and last, cannot pose as a deepstack level count or vice versa.
    assert (
        EmbeddingKey("h", (1, 2, 3), "a", "b", 4).digest()
        != EmbeddingKey("h", (1, 2, 3), "a", "b", 0, cache_salt="\0\0\0\0").digest()
    )


def test_digest_is_the_same_in_another_process_with_another_hash_seed() -> None:
    # The child loads cache/key.py alone (no torch import), so two interpreters start quickly.
    code = textwrap.dedent(
        f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("emb_key", {key_module.__file__!r})
        mod = sys.modules["emb_key"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        key = mod.EmbeddingKey({KEY.image_hash!r}, {KEY.grid!r}, {KEY.preprocess_fingerprint!r},
                               {KEY.model_fingerprint!r})
        print(key.digest(), hash("salted"))
        """
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            stdout=subprocess.PIPE,
            text=True,
        )
        for seed in ("1", "2")
    ]
    outs = [p.communicate(timeout=60)[0].split() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0][1] != outs[1][1], "the two processes should salt hash() differently"
    assert outs[0][0] == outs[1][0] == KEY.digest()


@pytest.mark.parametrize("grid", [(1, 2), (1, 2, -3), (1.0, 2, 3)])
def test_bad_grid_is_rejected(grid: tuple) -> None:
    with pytest.raises(ValueError):
        EmbeddingKey("h", grid, "p", "m")
