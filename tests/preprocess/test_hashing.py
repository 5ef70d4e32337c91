"""Image identity: cryptographic by default, so bytes built to collide under XXH3 still get two identities."""

from __future__ import annotations

import hashlib

import blake3
import pytest
import xxhash

from lm_engine.config import EngineConfig
from preprocess.hashing import (
    DEFAULT_HASH,
    HASH_ALGORITHMS,
    TRUSTED_ONLY,
    digest,
    digest_size,
    image_hash,
    is_image_hash,
)
from tests.xxh3_collision import colliding_pair

CRYPTOGRAPHIC = [a for a in HASH_ALGORITHMS if a not in TRUSTED_ONLY]


@pytest.fixture(scope="module")
def pair() -> tuple[bytes, bytes]:
    a, b = colliding_pair(b"", 64 << 10, seed=1)
    assert a != b and sum(x != y for x, y in zip(a, b)) > len(a) // 3
    assert xxhash.xxh3_128_digest(a) == xxhash.xxh3_128_digest(b)
    assert xxhash.xxh3_64_digest(a) == xxhash.xxh3_64_digest(b)
    return a, b


def test_the_default_is_cryptographic_and_the_engines_default():
    assert DEFAULT_HASH in CRYPTOGRAPHIC and "xxh3" in TRUSTED_ONLY
    assert EngineConfig(model="unused").hash_algorithm == DEFAULT_HASH


@pytest.mark.parametrize("algorithm", CRYPTOGRAPHIC)
def test_xxh3_collisions_get_two_identities(pair, algorithm):
    a, b = pair
    assert image_hash(a, algorithm) != image_hash(b, algorithm)


def test_xxh3_collisions_alias_under_the_opt_in(pair):
    """What ``--hash-algorithm xxh3`` risks: two different pictures, one identity."""
    a, b = pair
    assert image_hash(a, "xxh3") == image_hash(b, "xxh3")


def test_digests_are_the_libraries_own():
    data = bytes(range(256)) * 40
    assert digest(data, "blake3") == blake3.blake3(data).digest()
    assert digest(data, "sha256") == hashlib.sha256(data).digest()
    assert digest(data, "blake2b") == hashlib.blake2b(data, digest_size=32).digest()
    assert digest(data, "xxh3") == xxhash.xxh3_128_digest(data)
    assert image_hash(data) == blake3.blake3(data).hexdigest()


@pytest.mark.parametrize("algorithm", HASH_ALGORITHMS)
def test_image_hash_shape_is_checkable(algorithm):
    h = image_hash(b"jpeg bytes", algorithm)
    assert len(h) == 2 * digest_size(algorithm) and is_image_hash(h, algorithm)
    other = next(a for a in HASH_ALGORITHMS if digest_size(a) != digest_size(algorithm))
    assert not is_image_hash(h, other)
    assert not is_image_hash("A" * len(h), algorithm)  # lowercase only: one spelling per key
    assert not is_image_hash(h[:-1] + "g", algorithm) and not is_image_hash(None, algorithm)


def test_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        image_hash(b"x", "md5")
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        EngineConfig(model="unused", hash_algorithm="md5")
