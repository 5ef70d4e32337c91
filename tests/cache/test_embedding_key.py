from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
import xxhash

from cache import EmbeddingKey
from cache import key as key_module

PINNED_DIGEST = "41e806f172a60ac7cd05b3412d7b0aa8"
KEY = EmbeddingKey(xxhash.xxh3_128_hexdigest(b"jpeg bytes"), (1, 32, 48), "pre-7f3a", "qwen2vl-tiny-91c2")


def test_digest_is_xxh3_128_hex_and_deterministic() -> None:
    d = KEY.digest()
    assert len(d) == 32 and int(d, 16) >= 0
    assert d == EmbeddingKey(KEY.image_hash, (1, 32, 48), "pre-7f3a", "qwen2vl-tiny-91c2").digest()


def test_digest_is_pinned() -> None:
    # Redis entries written by other replicas/versions are found by this value: a change here is
    # a cache-format change and must come with a bump of the key schema.
    assert KEY.digest() == PINNED_DIGEST


def test_every_field_changes_the_digest() -> None:
    variants = [
        replace(KEY, image_hash=xxhash.xxh3_128_hexdigest(b"other bytes")),
        replace(KEY, grid=(1, 48, 32)),  # transposed grid: different image layout
        replace(KEY, grid=(2, 32, 48)),
        replace(KEY, preprocess_fingerprint="pre-7f3b"),
        replace(KEY, model_fingerprint="qwen2vl-tiny-91c3"),
    ]
    digests = {KEY.digest(), *(v.digest() for v in variants)}
    assert len(digests) == len(variants) + 1


def test_field_boundaries_are_unambiguous() -> None:
    a = EmbeddingKey("h", (1, 2, 3), "ab", "c")
    b = EmbeddingKey("h", (1, 2, 3), "a", "bc")
    assert a.digest() != b.digest()


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
