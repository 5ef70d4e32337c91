"""Keys on the encoder tier's wire: they carry their hash algorithm and salt, and a receiver takes only keys
hashed with its own algorithm (the same image's embedding under another's key would be a wrong hit)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cache import EmbeddingKey
from encoder.tier import wire
from encoder.tier.client import RemoteVisionPipeline
from preprocess import PreprocessConfig
from preprocess.hashing import HASH_ALGORITHMS, image_hash


@pytest.mark.parametrize("algorithm", HASH_ALGORITHMS)
@pytest.mark.parametrize("salt", ["", "tenant-a"])
def test_keys_round_trip_with_algorithm_and_salt(algorithm, salt):
    key = EmbeddingKey(image_hash(b"png bytes", algorithm), (1, 8, 6), "pre", "model", 2, algorithm, salt)
    back = wire.key_from_json(wire.key_to_json(key), algorithm)
    assert back == key and back.digest() == key.digest()  # the digest names shipped entries


def test_keys_of_another_algorithm_or_shape_are_refused():
    key = wire.key_to_json(
        EmbeddingKey(image_hash(b"png bytes", "xxh3"), (1, 8, 6), "pre", "model", 0, "xxh3")
    )
    with pytest.raises(wire.ProtocolError, match="not a blake3 digest"):
        wire.key_from_json(key, "blake3")
    for forged in (
        {**key, "hash": "blake3"},  # claims blake3, carries a 128-bit hash
        {**key, "image_hash": key["image_hash"] + "00"},
        {**key, "image_hash": key["image_hash"].upper()},
        {**key, "image_hash": 12},
        {k: v for k, v in key.items() if k != "hash"},
    ):
        with pytest.raises(wire.ProtocolError):
            wire.key_from_json(forged, "xxh3" if forged.get("hash") != "blake3" else "blake3")


def test_engine_refuses_a_pool_hashing_otherwise():
    config = PreprocessConfig()
    engine = SimpleNamespace(
        local=SimpleNamespace(config=config), model_fingerprint="", hash_algorithm="blake3"
    )
    hello = {"preprocess": config.fingerprint(), "model": "m", "hash": "blake3"}
    RemoteVisionPipeline._check_hello(engine, hello)
    for other in ("xxh3", None):
        with pytest.raises(ConnectionRefusedError, match="keys images with"):
            RemoteVisionPipeline._check_hello(engine, {**hello, "hash": other})
